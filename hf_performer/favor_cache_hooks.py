"""How a favor attention layer finds its cache: forward hooks on the attention modules hand the ``Cache`` of each call
to the attention function, and put a constant-size cache layer (:class:`~.favor_cache_layer.FavorCacheLayer`, or
a :class:`~.window_cache_layer.WindowCacheLayer` for window layers) in place of the empty default one, at the first
forward or as soon as ``generate()`` makes its cache (:func:`prepare_cache_with_favor_layers`).

This module imports only ``torch``, ``transformers`` and relative siblings: it is copied next to saved models for
``trust_remote_code``.
"""

from __future__ import annotations

from torch import nn
from transformers.cache_utils import Cache, DynamicLayer, EncoderDecoderCache

from .cache import FavorCacheLayer, cache_from_kwargs, cache_layer_class, is_favor_cache_layer, is_window_cache_layer
from .favor_modules import find_attention_modules, layer_index_of, module_favor_settings, uses_favor
from .linear_attention import LinearAttentionError

CACHE_ATTRIBUTE = "_favor_past_key_values"

def _cache_from_call(module: nn.Module, args: tuple, kwargs: dict):
    """The cache an attention module's call carries, whatever the architecture names it (``cache``,
    ``past_key_values``, ``past_key_value``, ``layer_past``, ...) and however it is passed (keyword or positional):
    the :class:`~transformers.cache_utils.Cache` object among the call's arguments."""
    cache = cache_from_kwargs(kwargs, type(module).__name__)
    if cache is not None:
        return cache
    return next((value for value in (*kwargs.values(), *args) if isinstance(value, Cache)), None)


def _self_attention_cache(cache) -> Cache | None:
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    return cache if isinstance(cache, Cache) else None


def _install_favor_cache_layer(cache: Cache, layer_idx: int, layer_class=FavorCacheLayer) -> None:
    """Replace an empty ``DynamicLayer`` (the default layer) at ``layer_idx`` by a ``layer_class()``
    (:class:`FavorCacheLayer`, or :class:`WindowCacheLayer` for window layers)."""
    layers = cache.layers
    if layer_idx < len(layers):
        layer = layers[layer_idx]
        if type(layer) is DynamicLayer and layer.get_seq_length() == 0:
            layers[layer_idx] = layer_class()
    elif cache.layer_class_to_replicate is DynamicLayer:  # DynamicCache() without config: layers added lazily
        while len(layers) < layer_idx:
            layers.append(cache.layer_class_to_replicate())
        layers.append(layer_class())


def runs_causal_favor(model: nn.Module) -> bool:
    """Whether some causal attention module of ``model`` runs favor (linear) attention: its cache is recurrent."""
    return any(getattr(module, "is_causal", False) and uses_favor(module) for _, module in find_attention_modules(model))


def prepare_cache_with_favor_layers(model, generation_config, model_kwargs: dict, *args, **kwargs):
    """``generate()``'s cache preparation with the favor layers' constant-size cache layers put in the new cache right
    away (not at the first forward), so that ``activate_past_recording()``, which assisted decoding calls before its
    first forward, reaches them (installed on the model by :func:`attach_feature_maps`)."""
    result = type(model)._prepare_cache_for_generation(model, generation_config, model_kwargs, *args, **kwargs)
    install_favor_cache_layers(cache_from_kwargs(model_kwargs, "generate"), model)
    return result


def install_favor_cache_layers(cache, model: nn.Module) -> None:
    """Put a constant-size cache layer (:func:`~.cache.cache_layer_class`: :class:`FavorCacheLayer`, or
    :class:`WindowCacheLayer` for window layers) in ``cache`` (a new one, or the self-attention part of an
    encoder-decoder cache) for every causal favor attention module of ``model``, in place of its empty default layer."""
    cache = _self_attention_cache(cache)
    if cache is None:
        return
    for _, module in find_attention_modules(model):
        if getattr(module, "is_causal", False) and uses_favor(module):
            layer_idx = layer_index_of(module)
            _install_favor_cache_layer(cache, layer_idx, cache_layer_class(module_favor_settings(module), layer_idx))


def _favor_cache_pre_hook(module: nn.Module, args: tuple, kwargs: dict):
    cache = _self_attention_cache(_cache_from_call(module, args, kwargs))
    object.__setattr__(module, CACHE_ATTRIBUTE, cache)  # (a plain attribute: nn.Module's own setattr costs more)
    if cache is not None and getattr(module, "is_causal", False):
        layer_idx = layer_index_of(module)
        layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
        installed = is_favor_cache_layer(layer) or is_window_cache_layer(layer)
        if not installed and uses_favor(module):
            _install_favor_cache_layer(cache, layer_idx, cache_layer_class(module_favor_settings(module), layer_idx))
    return None


def _favor_cache_post_hook(module: nn.Module, args: tuple, kwargs: dict, output):
    object.__setattr__(module, CACHE_ATTRIBUTE, None)
    return None


def install_cache_hooks(module: nn.Module) -> None:
    """Install (once) the hooks that hand the cache (``cache`` / ``past_key_values``) to the attention function."""
    if getattr(module, "_favor_cache_hooks", False):
        return
    module.register_forward_pre_hook(_favor_cache_pre_hook, with_kwargs=True)
    module.register_forward_hook(_favor_cache_post_hook, with_kwargs=True, always_call=True)
    module._favor_cache_hooks = True
    setattr(module, CACHE_ATTRIBUTE, None)


def cache_layer_of(module: nn.Module, layer_idx: int):
    cache = getattr(module, CACHE_ATTRIBUTE, None)
    if cache is None or layer_idx >= len(cache.layers):
        return None
    return cache.layers[layer_idx]


def reject_fixed_size_cache(layer, layer_idx: int) -> None:
    """Static / sliding cache layers hold a key buffer whose slots are not the tokens seen: refuse them."""
    if layer is not None and not is_favor_cache_layer(layer) and layer.get_max_length() != -1:
        raise LinearAttentionError(
            f"favor attention (layer {layer_idx}): cache layer {type(layer).__name__} has a fixed size "
            f"({layer.get_max_length()} slots); static and sliding-window caches are not supported. Use the default "
            "cache (generate() without cache_implementation) or make_favor_cache(model)."
        )
