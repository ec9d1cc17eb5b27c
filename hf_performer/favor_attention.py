"""FAVOR+ / linear attention as a transformers attention implementation (``attn_implementation="favor"``).

Importing this module registers:

* ``AttentionInterface.register("favor", favor_attention_forward)``: stock models that dispatch attention
  through ``ALL_ATTENTION_FUNCTIONS`` (BERT, RoBERTa, DistilBERT, GPT-2, Llama, ... in transformers 5.x)
  accept ``from_pretrained(..., attn_implementation="favor")`` and ``model.set_attn_implementation("favor")``;
* ``AttentionMaskInterface.register("favor", favor_attention_mask)``: without it transformers builds *no*
  mask for an unknown implementation and padding would be silently ignored. The mask is the 2-D key
  padding mask ``[batch, kv_length]`` (``True`` = token) of flash attention, or ``None`` when nothing
  is padded; patterns linear attention cannot express (sliding windows, chunked attention, packed
  sequences, custom ``or``/``and`` mask functions) raise an error.

Behaviour of :func:`favor_attention_forward`:

* causal or bidirectional exactly like transformers' sdpa function: ``kwargs["is_causal"]`` if given,
  else ``module.is_causal``;
* ``exp(scaling * q.k)`` is estimated with the ``scaling`` the model passes (GPT-2 may fold a per-layer
  factor into it); grouped-query attention (fewer key/value heads) is supported;
* attention masks: ``None``, a 2-D key padding mask (bool or 0/1), or a 4-D mask ``[B, 1 or H, Lq, Lk]``
  (bool, or additive float with 0 / large negative values) *only if* it is exactly "key padding AND
  (causal or full)" (fully masked query rows are accepted: they are padding queries). Any other mask
  raises :class:`FavorMaskError`: it is never silently dropped;
* attention dropout cannot be applied to linear attention (there is no attention matrix): a
  ``dropout > 0`` in training is ignored with a one-time warning;
* ``output_attentions``: there are no attention weights; ``None`` is returned (one-time warning);
* layers listed in ``favor_settings["softmax_layers"]`` delegate to transformers' sdpa function (exact
  softmax), with the 2-D padding mask turned into the mask sdpa would have been given;
* "window layers" (``favor_settings`` ``window`` or ``sinks`` > 0 for the layer, :func:`~.favor_settings.layer_window`)
  run :func:`~.window_attention.window_linear_attention`: exact softmax over the sink tokens and a sliding window,
  the feature map for older keys (none with ``linear_tail=False``), one shared normaliser. In learned mode
  (:func:`~.favor_settings.softmax_weight_mode`) the module owns ``favor_softmax_weight``
  (:class:`~.window_attention.SoftmaxWeight`, gamma per head);
* ``favor_settings["attention"]`` ``"clustered"`` / ``"improved-clustered"`` (bidirectional models only) runs
  :func:`~.clustered_attention.clustered_attention` / :func:`~.clustered_attention.improved_clustered_attention`
  with ``clusters`` and ``topk`` (capped at the key length: ``topk >= L`` is exact softmax) and hash seed
  ``seed + layer``: a zero-shot approximation with no feature map and no parameters. Causal layers are refused
  (when the model is built, and in the forward of a stock model switched to favor).

Settings are read from ``module.config.favor_settings`` (validated strictly by
:func:`~.favor_settings.resolve_favor_settings`; absent keys take :data:`~.favor_settings.FAVOR_DEFAULTS`)
once, when the module's feature map is attached, and kept on the module (:func:`module_favor_settings`).
Each favor attention module owns a submodule ``favor_feature_map`` (seed ``settings["seed"] + layer_idx``),
so projections and redraw counters live in the state dict and reload bit-identically.
:func:`attach_feature_maps` creates them eagerly (call it before loading a state dict); a stock model switched
with ``set_attn_implementation("favor")`` gets them lazily on its first forward.

Generation: :func:`attach_feature_maps` also installs a forward pre-hook on the attention modules that
hands the layer's ``past_key_values`` to the attention function and, for causal favor layers, replaces an
*empty* ``DynamicLayer`` of that cache by a :class:`~.cache.FavorCacheLayer` (the layer
``generate()`` and the models create by default). Prefill and token-by-token decoding then carry the
recurrent state (constant memory, equal to one full forward). A cache layer that already holds full keys
and values (e.g. a ``DynamicCache`` filled before the hook existed) is still handled correctly: the
causal kernel is run over all cached keys at every step (``O(L)`` per token). Static caches (whose key
length differs from the mask length) raise.

This module imports only ``torch``, ``transformers`` and relative siblings: it is copied next to saved
models for ``trust_remote_code``.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer, EncoderDecoderCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    AttentionMaskInterface,
    bidirectional_mask_function,
    causal_mask_function,
    flash_attention_mask,
    sdpa_mask,
)
from transformers.utils import logging

from .cache import FavorCacheLayer
from .clustered_attention import ClusteredAttentionError, clustered_attention, improved_clustered_attention
from .favor_settings import (
    build_feature_map,
    favor_settings_of,
    is_clustered,
    is_int,
    layer_window,
    softmax_weight_mode,
)
from .feature_maps import FeatureMap
from .linear_attention import LinearAttentionError, linear_attention
from .window_attention import SoftmaxWeight, window_linear_attention


logger = logging.get_logger(__name__)

ATTN_IMPLEMENTATION = "favor"
FEATURE_MAP_ATTRIBUTE = "favor_feature_map"
SOFTMAX_WEIGHT_ATTRIBUTE = "favor_softmax_weight"
"""Attribute of a learned-mode window layer's attention module holding its :class:`~.window_attention.SoftmaxWeight`
(state-dict key ``...favor_softmax_weight.logit``)."""
SETTINGS_ATTRIBUTE = "_favor_settings"

class FavorMaskError(LinearAttentionError):
    """An attention mask that linear attention cannot express (raised instead of ignoring it)."""


# --------------------------------------------------------------------------------------------
# Attention modules: recognition, layer index, head dim
# --------------------------------------------------------------------------------------------


def is_attention_module(module: nn.Module) -> bool:
    """Whether ``module`` dispatches through transformers' attention registry, i.e. is the ``module``
    argument an attention function receives (``BertSelfAttention``, ``GPT2Attention``, ``LlamaAttention``,
    ``DistilBertSelfAttention``, ...): its ``forward`` looks up ``ALL_ATTENTION_FUNCTIONS``."""
    forward = getattr(type(module), "forward", None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def find_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every attention module of ``model``, in module order."""
    return [(name, module) for name, module in model.named_modules() if is_attention_module(module)]


# Modules without `layer_idx` (DistilBERT) met lazily are numbered in call order, per config object.
_LAZY_LAYER_COUNTERS: dict[int, tuple[weakref.ref, int]] = {}


def layer_index_of(module: nn.Module) -> int:
    """The layer index of an attention module: ``module.layer_idx``, else ``module.favor_layer_idx`` (set by
    :func:`attach_feature_maps`), else the next index in call order among this config's modules."""
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        layer_idx = getattr(module, "favor_layer_idx", None)
    if layer_idx is None:
        config = getattr(module, "config", None)
        key = id(config)
        entry = _LAZY_LAYER_COUNTERS.get(key)
        count = entry[1] if entry is not None and entry[0]() is config else 0
        try:
            _LAZY_LAYER_COUNTERS[key] = (weakref.ref(config), count + 1)
        except TypeError:  # no config, or not weak-referenceable
            pass
        layer_idx = count
        module.favor_layer_idx = layer_idx
    return int(layer_idx)


def _module_head_dim(module: nn.Module) -> int | None:
    for attribute in ("head_dim", "attention_head_size", "head_size"):
        value = getattr(module, attribute, None)
        if is_int(value):
            return value
    config = getattr(module, "config", None)
    if config is None:
        return None
    head_dim = getattr(config, "head_dim", None)
    if is_int(head_dim):
        return head_dim
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if is_int(hidden) and is_int(heads) and heads > 0:
        return hidden // heads
    return None


def _module_head_counts(module: nn.Module) -> tuple[int | None, int | None]:
    """``(query heads, key/value heads)`` of an attention module, from its attributes or its config."""
    config = getattr(module, "config", None)
    heads = None
    for attribute in ("num_attention_heads", "num_heads", "n_heads"):
        value = getattr(module, attribute, None)
        if is_int(value):
            heads = value
            break
    if heads is None and is_int(getattr(config, "num_attention_heads", None)):
        heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None)
    if is_int(getattr(module, "num_key_value_groups", None)) and heads is not None:
        kv_heads = heads // module.num_key_value_groups
    return heads, kv_heads if is_int(kv_heads) else heads


def _module_device(module: nn.Module) -> torch.device:
    parameter = next(module.parameters(recurse=True), None)
    if parameter is None or parameter.device.type == "meta":  # a meta buffer would lose the projection
        return torch.device("cpu")
    return parameter.device


def module_favor_settings(module: nn.Module) -> dict:
    """The resolved settings of an attention module, kept on it when first asked for (when its feature map is
    attached); resolved again only if its config's ``favor_settings`` dict has been replaced since."""
    given = getattr(getattr(module, "config", None), "favor_settings", None)
    kept = getattr(module, SETTINGS_ATTRIBUTE, None)
    if kept is None or kept[0] is not given:
        kept = (given, favor_settings_of(module))
        setattr(module, SETTINGS_ATTRIBUTE, kept)
    return kept[1]


def uses_favor(module: nn.Module) -> bool:
    """Whether this attention module runs favor attention (implementation "favor", not a softmax layer)."""
    config = getattr(module, "config", None)
    if getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        return False
    return layer_index_of(module) not in module_favor_settings(module)["softmax_layers"]


def _attach_feature_map(module: nn.Module, feature_map: FeatureMap) -> FeatureMap:
    feature_map.train(module.training)
    module.add_module(FEATURE_MAP_ATTRIBUTE, feature_map)
    return feature_map


def is_window_layer(settings: dict, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` runs sink + window attention (its window or sinks > 0)."""
    return any(value > 0 for value in layer_window(settings, layer_idx))


def _softmax_weight_for(module: nn.Module, layer_idx: int, settings: dict, num_heads: int | None,
                        device: torch.device) -> torch.Tensor | None:
    """gamma ``[H]`` of a learned-mode window layer (its :class:`SoftmaxWeight` created on first use, float32, with
    its deterministic initialisation), or ``None`` (calibrated mode, or not a window layer)."""
    if not is_window_layer(settings, layer_idx) or softmax_weight_mode(settings) != "learned":
        return None
    weight = getattr(module, SOFTMAX_WEIGHT_ATTRIBUTE, None)
    if not isinstance(weight, nn.Module):  # not isinstance SoftmaxWeight: remote-code copies define their own class
        if num_heads is None:
            raise ValueError(f"cannot tell the number of query heads of layer {layer_idx} for its softmax weight")
        with torch.device("cpu"):  # real values even under a meta-device context, as the feature maps
            weight = SoftmaxWeight(num_heads)
        weight.train(module.training)
        module.add_module(SOFTMAX_WEIGHT_ATTRIBUTE, weight.to(device))
    return weight()


def attach_feature_maps(model: nn.Module) -> list[int]:
    """Create ``favor_feature_map`` on every attention module of ``model`` that uses favor attention.

    Call it on a model whose config has ``_attn_implementation == "favor"`` (``attn_implementation="favor"``
    at load time or ``model.set_attn_implementation("favor")``), before ``load_state_dict`` of a converted
    model. Existing feature maps are kept. It also installs the forward hooks that let the attention
    function use a constant-memory :class:`~.cache.FavorCacheLayer` during generation.

    Modules without ``layer_idx`` (DistilBERT) are numbered in module order (``module.favor_layer_idx``).

    Returns:
        The sorted layer indices that have a favor feature map.

    Raises:
        ValueError: no attention module of ``model`` uses ``attn_implementation="favor"``.
    """
    modules = find_attention_modules(model)
    unindexed = [module for _, module in modules if getattr(module, "layer_idx", None) is None]
    for ordinal, module in enumerate(unindexed):
        if getattr(module, "favor_layer_idx", None) is None:
            module.favor_layer_idx = ordinal

    favor_layers = set()
    for name, module in modules:
        if not uses_favor(module):
            continue
        layer_idx = layer_index_of(module)
        if is_clustered(module_favor_settings(module)):  # no feature map, no recurrent cache
            _refuse_causal_clustered(module, layer_idx, getattr(module, "is_causal", False))
            continue
        install_cache_hooks(module)
        if not isinstance(getattr(module, FEATURE_MAP_ATTRIBUTE, None), nn.Module):
            head_dim = _module_head_dim(module)
            if head_dim is None:
                raise ValueError(
                    f"cannot tell the head dimension of attention module {name!r} ({type(module).__name__}): it has "
                    "no head_dim / attention_head_size attribute and its config no head_dim or "
                    "hidden_size / num_attention_heads"
                )
            # Drawn on the CPU even under a meta-device context (from_pretrained builds models on meta):
            # the projection must exist when a checkpoint does not hold it.
            with torch.device("cpu"):
                feature_map = build_feature_map(
                    module_favor_settings(module), head_dim, layer_idx, *_module_head_counts(module)
                )
            _attach_feature_map(module, feature_map.to(_module_device(module)))
        _softmax_weight_for(module, layer_idx, module_favor_settings(module), _module_head_counts(module)[0],
                            _module_device(module))
        favor_layers.add(layer_idx)
    if not favor_layers and not any(
        getattr(getattr(m, "config", None), "_attn_implementation", None) == ATTN_IMPLEMENTATION for _, m in modules
    ):
        found = sorted({getattr(getattr(m, "config", None), "_attn_implementation", None) or "?" for _, m in modules})
        raise ValueError(
            f"attach_feature_maps: no attention module of {type(model).__name__} uses attn_implementation='favor' "
            f"(found {found or 'no attention modules'}); load it with attn_implementation='favor' or call "
            "model.set_attn_implementation('favor') first"
        )
    return sorted(favor_layers)


def _refuse_causal_clustered(module: nn.Module, layer_idx: int, causal: bool) -> None:
    """One-line :class:`ClusteredAttentionError` for a causal layer set to (improved) clustered attention."""
    if causal:
        kind = module_favor_settings(module)["attention"]
        raise ClusteredAttentionError(
            f"favor_settings attention={kind!r} is for bidirectional models (encoders) only, and layer {layer_idx} is "
            "causal (a decoder); use attention='linear' (a feature map) for causal models"
        )


def _clustered_attention_forward(query, key, value, key_padding_mask, scaling, settings, layer_idx) -> torch.Tensor:
    """(Improved) clustered attention of one bidirectional layer, ``[B, H, Lq, dv]``."""
    k_len = key.shape[2]
    if key_padding_mask is not None and key_padding_mask.shape[-1] != k_len:
        raise FavorMaskError(
            f"clustered attention (layer {layer_idx}): the attention mask covers {key_padding_mask.shape[-1]} keys "
            f"but there are {k_len} keys"
        )
    common = dict(clusters=settings["clusters"], key_padding_mask=key_padding_mask, scaling=scaling,
                  seed=settings["seed"] + layer_idx)
    if settings["attention"] == "clustered":
        return clustered_attention(query, key, value, **common)
    return improved_clustered_attention(query, key, value, topk=min(settings["topk"], k_len), **common)


def _feature_map_for(module: nn.Module, layer_idx: int, settings: dict, query: torch.Tensor, key: torch.Tensor) -> FeatureMap:
    """The module's feature map, created on first use for stock models switched to favor."""
    feature_map = getattr(module, FEATURE_MAP_ATTRIBUTE, None)
    if isinstance(feature_map, nn.Module):  # not isinstance FeatureMap: remote-code copies define their own class
        return feature_map
    install_cache_hooks(module)  # later calls will see the cache
    _softmax_weight_for(module, layer_idx, settings, query.shape[1], query.device)
    feature_map = build_feature_map(settings, query.shape[-1], layer_idx, query.shape[1], key.shape[1])
    return _attach_feature_map(module, feature_map.to(query.device))


@contextlib.contextmanager
def _no_redraw(feature_map: FeatureMap, active: bool):
    """Continuing a recurrent state needs exactly the features used before: no redraw, even in training."""
    if not active or not feature_map.training:
        yield
        return
    feature_map.train(False)
    try:
        yield
    finally:
        feature_map.train(True)


# --------------------------------------------------------------------------------------------
# Cache hand-over: forward hooks on attention modules
# --------------------------------------------------------------------------------------------

CACHE_ATTRIBUTE = "_favor_past_key_values"
_PAST_KEY_VALUES_POSITION: dict[type, int | None] = {}


def _past_key_values_from_call(module: nn.Module, args: tuple, kwargs: dict):
    if "past_key_values" in kwargs:
        return kwargs["past_key_values"]
    cls = type(module)
    if cls not in _PAST_KEY_VALUES_POSITION:
        names = list(inspect.signature(cls.forward).parameters)[1:]  # drop self
        _PAST_KEY_VALUES_POSITION[cls] = names.index("past_key_values") if "past_key_values" in names else None
    position = _PAST_KEY_VALUES_POSITION[cls]
    return args[position] if position is not None and position < len(args) else None


def _self_attention_cache(cache) -> Cache | None:
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    return cache if isinstance(cache, Cache) else None


def _install_favor_cache_layer(cache: Cache, layer_idx: int) -> None:
    """Replace an empty ``DynamicLayer`` (the default layer) at ``layer_idx`` by a :class:`FavorCacheLayer`."""
    layers = cache.layers
    if layer_idx < len(layers):
        layer = layers[layer_idx]
        if type(layer) is DynamicLayer and layer.get_seq_length() == 0:
            layers[layer_idx] = FavorCacheLayer()
    elif cache.layer_class_to_replicate is DynamicLayer:  # DynamicCache() without config: layers added lazily
        while len(layers) < layer_idx:
            layers.append(cache.layer_class_to_replicate())
        layers.append(FavorCacheLayer())


def _favor_cache_pre_hook(module: nn.Module, args: tuple, kwargs: dict):
    cache = _self_attention_cache(_past_key_values_from_call(module, args, kwargs))
    setattr(module, CACHE_ATTRIBUTE, cache)
    if cache is not None and getattr(module, "is_causal", False) and uses_favor(module):
        layer_idx = layer_index_of(module)
        # Window layers keep the default (full key/value) layer until they have a cache layer of their own.
        if not is_window_layer(module_favor_settings(module), layer_idx):
            _install_favor_cache_layer(cache, layer_idx)
    return None


def _favor_cache_post_hook(module: nn.Module, args: tuple, kwargs: dict, output):
    setattr(module, CACHE_ATTRIBUTE, None)
    return None


def install_cache_hooks(module: nn.Module) -> None:
    """Install (once) the hooks that hand ``past_key_values`` to the attention function."""
    if getattr(module, "_favor_cache_hooks", False):
        return
    module.register_forward_pre_hook(_favor_cache_pre_hook, with_kwargs=True)
    module.register_forward_hook(_favor_cache_post_hook, with_kwargs=True, always_call=True)
    module._favor_cache_hooks = True
    setattr(module, CACHE_ATTRIBUTE, None)


def _cache_layer_of(module: nn.Module, layer_idx: int):
    cache = getattr(module, CACHE_ATTRIBUTE, None)
    if cache is None or layer_idx >= len(cache.layers):
        return None
    return cache.layers[layer_idx]


def _reject_fixed_size_cache(layer, layer_idx: int) -> None:
    """Static / sliding cache layers hold a key buffer whose slots are not the tokens seen: refuse them."""
    if layer is not None and not _is_favor_cache_layer(layer) and layer.get_max_length() != -1:
        raise LinearAttentionError(
            f"favor attention (layer {layer_idx}): cache layer {type(layer).__name__} has a fixed size "
            f"({layer.get_max_length()} slots); static and sliding-window caches are not supported. Use the default "
            "cache (generate() without cache_implementation) or make_favor_cache(model)."
        )


def _is_favor_cache_layer(layer) -> bool:
    # By layer type rather than isinstance: a copy of this package loaded as remote code defines its own class.
    return getattr(type(layer), "_layer_type", None) == FavorCacheLayer._layer_type


# --------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------


def favor_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask builder registered in ``AttentionMaskInterface`` for "favor": the 2-D key padding mask
    ``[batch_size, kv_length]`` (bool, ``True`` = token) of flash attention, or ``None`` without padding.

    Raises:
        FavorMaskError: the model asked for a pattern other than plain causal / bidirectional (sliding
            window, chunked, packed sequences, custom or/and mask functions).
    """
    if mask_function not in (causal_mask_function, bidirectional_mask_function):
        name = getattr(mask_function, "__qualname__", None) or repr(mask_function)
        raise FavorMaskError(
            f"favor (linear) attention can only express causal or bidirectional attention with key padding; the "
            f"model asked for the mask pattern {name} (sliding-window, chunked, packed-sequence (position_ids "
            "restarting inside a row) or custom or/and masks cannot be expressed). Use attn_implementation='sdpa' "
            "for this model, or unpack the sequences and pass a 2-D attention_mask."
        )
    return flash_attention_mask(
        batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs
    )


def _key_padding_from_4d(mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """``[B, Lk]`` key padding mask equal to a 4-D mask ``[B, 1 or H, Lq, Lk]``, or raise."""
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask == 0
        blocked_values = mask.masked_select(~allowed)
        if blocked_values.numel() and bool((blocked_values > torch.finfo(mask.dtype).min / 2).any()):
            raise FavorMaskError(
                "favor attention got a 4-D float mask holding biases other than 0 (attend) and a large negative "
                "value (masked); linear attention cannot add a bias to attention scores. Pass a 2-D key padding "
                "mask [batch, key_length] instead."
            )
    else:
        allowed = mask != 0
    q_len, k_len = allowed.shape[-2:]
    key_padding = allowed.any(dim=(1, 2))  # [B, Lk]
    expected = key_padding[:, None, None, :].expand(allowed.shape)
    if causal:
        query_positions = torch.arange(q_len, device=mask.device)[:, None] + (k_len - q_len)
        expected = expected & (torch.arange(k_len, device=mask.device)[None, :] <= query_positions)
    padding_queries = ~allowed.any(dim=-1, keepdim=True)  # rows that attend to nothing
    if not bool(((allowed == expected) | padding_queries).all()):
        raise FavorMaskError(
            f"favor attention got a 4-D attention mask of shape {tuple(mask.shape)} that is not "
            f"'key padding AND {'causal' if causal else 'full'}': linear attention can only express a key padding "
            "mask (plus causality). Pass a 2-D attention_mask [batch, key_length] (True/1 = token), or use "
            "attn_implementation='sdpa' for arbitrary masks."
        )
    return key_padding


def _key_padding_mask(attention_mask, causal: bool) -> torch.Tensor | None:
    """The 2-D bool key padding mask ``[B, M]`` described by ``attention_mask`` (``None`` if nothing is padded)."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise FavorMaskError(
            f"favor attention accepts None, a 2-D key padding mask or an equivalent 4-D mask; got "
            f"{type(attention_mask).__name__}"
        )
    if attention_mask.dim() == 4:
        mask = _key_padding_from_4d(attention_mask, causal)
    elif attention_mask.dim() == 2:
        mask = attention_mask
        if mask.dtype != torch.bool:
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise FavorMaskError(
                    "a 2-D attention mask for favor attention must hold only 0 (padding) and 1 (token), or be bool; "
                    f"got values {mask.unique()[:8].tolist()} (additive masks are not accepted)"
                )
            mask = mask != 0
    else:
        raise FavorMaskError(
            f"favor attention accepts a 2-D key padding mask [batch, key_length] or an equivalent 4-D mask; got a "
            f"{attention_mask.dim()}-D mask of shape {tuple(attention_mask.shape)}"
        )
    return None if bool(mask.all()) else mask


# --------------------------------------------------------------------------------------------
# Attention functions
# --------------------------------------------------------------------------------------------


def _softmax_attention_forward(module, query, key, value, attention_mask, scaling, dropout, causal, kwargs):
    """Exact softmax attention (sdpa) for ``softmax_layers``, given the mask built for favor."""
    cache_layer = _cache_layer_of(module, layer_index_of(module))
    _reject_fixed_size_cache(cache_layer, layer_index_of(module))
    if _is_favor_cache_layer(cache_layer):
        raise RuntimeError(
            f"layer {layer_index_of(module)} uses softmax attention (favor_settings['softmax_layers']) but its cache "
            "layer is a FavorCacheLayer, which keeps no keys/values; build the cache with make_favor_cache(model)"
        )
    if attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2):
        # The 2-D padding mask of the favor mask builder: build what the model would have given sdpa.
        q_len, kv_len = query.shape[2], key.shape[2]
        if attention_mask is not None and attention_mask.shape[-1] != kv_len:
            raise FavorMaskError(
                f"softmax layer {layer_index_of(module)}: the 2-D mask covers {attention_mask.shape[-1]} keys but "
                f"the layer has {kv_len} keys"
            )
        padding_mask = None if attention_mask is None else attention_mask.to(torch.bool)
        if causal:
            attention_mask = sdpa_mask(
                batch_size=query.shape[0],
                q_length=q_len,
                kv_length=kv_len,
                q_offset=kv_len - q_len,
                mask_function=causal_mask_function,
                attention_mask=padding_mask,
                allow_is_causal_skip=True,
                device=query.device,
            )
        else:
            attention_mask = sdpa_mask(
                batch_size=query.shape[0],
                q_length=q_len,
                kv_length=kv_len,
                mask_function=bidirectional_mask_function,
                attention_mask=padding_mask,
                allow_is_causal_skip=False,
                allow_is_bidirectional_skip=True,
                device=query.device,
            )
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def favor_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """FAVOR+ / linear attention with transformers' attention-function contract.

    Args:
        module: the model's attention module (per-layer feature map and settings live there).
        query: ``[B, H, Lq, d]``.
        key, value: ``[B, Hkv, Lk, d]`` with ``H % Hkv == 0`` (after the model's cache update).
        attention_mask: ``None``, a 2-D key padding mask ``[B, Lk]`` (or ``[B, seen + Lq]`` when the layer's
            cache is a :class:`FavorCacheLayer`), or an equivalent 4-D mask (see the module docstring).
        scaling: softmax temperature to reproduce, ``exp(scaling * q.k)``; default ``d ** -0.5``.
        dropout: attention dropout probability (cannot apply to linear attention; warned once in training).
        **kwargs: ``is_causal`` overrides ``module.is_causal``; others are ignored (``output_attentions``
            gives ``None`` weights).

    Returns:
        ``(attn_output [B, Lq, H, d], None)``.
    """
    is_causal = kwargs.get("is_causal")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    settings = module_favor_settings(module)
    layer_idx = layer_index_of(module)

    if layer_idx in settings["softmax_layers"]:
        return _softmax_attention_forward(
            module, query, key, value, attention_mask, scaling, dropout, causal, kwargs
        )

    if dropout > 0.0 and module.training:
        logger.warning_once(
            "favor attention: attention dropout (p>0) cannot be applied to linear attention, which never forms an "
            "attention matrix; it is ignored (other dropouts of the model still apply)."
        )
    if kwargs.get("output_attentions"):
        logger.warning_once("favor attention: linear attention has no attention weights; they are returned as None.")

    if is_clustered(settings):
        _refuse_causal_clustered(module, layer_idx, causal)
        out = _clustered_attention_forward(query, key, value, _key_padding_mask(attention_mask, False), scaling,
                                           settings, layer_idx)
        return out.transpose(1, 2).contiguous(), None

    feature_map = _feature_map_for(module, layer_idx, settings, query, key)
    key_padding_mask = _key_padding_mask(attention_mask, causal)
    q_len, k_len = query.shape[2], key.shape[2]
    cache_layer = _cache_layer_of(module, layer_idx) if causal else None
    _reject_fixed_size_cache(cache_layer, layer_idx)
    common = dict(scaling=scaling, chunk_size=settings["chunk_size"])

    if is_window_layer(settings, layer_idx):
        out = _window_attention_forward(module, query, key, value, feature_map, key_padding_mask, causal, cache_layer,
                                        settings, layer_idx, common)
    elif _is_favor_cache_layer(cache_layer):
        # Recurrent path: `key`/`value` are only the new tokens; earlier ones are in the layer's state.
        if k_len != q_len:
            raise LinearAttentionError(
                f"favor cache layer {layer_idx}: expected as many new keys as queries, got {k_len} and {q_len}"
            )
        if key_padding_mask is not None:
            if key_padding_mask.shape[-1] != cache_layer.get_seq_length():
                raise FavorMaskError(
                    f"favor cache layer {layer_idx}: the 2-D attention mask covers {key_padding_mask.shape[-1]} "
                    f"tokens but the cache has seen {cache_layer.get_seq_length()} (past + new); pass the mask of "
                    "all tokens so far"
                )
            key_padding_mask = key_padding_mask[:, -k_len:]
        with _no_redraw(feature_map, active=cache_layer.state is not None):
            out, state = linear_attention(
                query, key, value, feature_map, causal=True, key_padding_mask=key_padding_mask,
                initial_state=cache_layer.state, return_state=True, **common,
            )
        cache_layer.set_state(state)
    else:
        if key_padding_mask is not None and key_padding_mask.shape[-1] != k_len:
            raise FavorMaskError(
                f"favor attention (layer {layer_idx}): the attention mask covers {key_padding_mask.shape[-1]} keys "
                f"but there are {k_len} keys (static caches, whose key buffer is longer than the tokens seen, are "
                "not supported: use the default cache or make_favor_cache(model))"
            )
        if causal and k_len > q_len:
            # A cache holding full keys/values: the queries are the last `q_len` positions. Run the causal
            # kernel over all keys with placeholder queries for the past ones (O(L) per step, still exact).
            placeholder = query.new_zeros(query.shape[0], query.shape[1], k_len - q_len, query.shape[3])
            with _no_redraw(feature_map, active=True):
                out = linear_attention(
                    torch.cat([placeholder, query], dim=2), key, value, feature_map, causal=True,
                    key_padding_mask=key_padding_mask, **common,
                )
            out = out[:, :, -q_len:]
        elif causal and k_len < q_len:
            raise LinearAttentionError(
                f"favor attention (layer {layer_idx}): causal attention with fewer keys ({k_len}) than queries "
                f"({q_len})"
            )
        else:
            out = linear_attention(
                query, key, value, feature_map, causal=causal, key_padding_mask=key_padding_mask, **common
            )
    return out.transpose(1, 2).contiguous(), None


def _window_attention_forward(module, query, key, value, feature_map, key_padding_mask, causal, cache_layer, settings,
                              layer_idx, common) -> torch.Tensor:
    """Sink + window attention of a window layer: ``[B, H, Lq, d]`` (see :func:`favor_attention_forward`)."""
    window, sinks = layer_window(settings, layer_idx)
    gamma = _softmax_weight_for(module, layer_idx, settings, query.shape[1], query.device)
    tail_map = feature_map if settings["linear_tail"] else None
    q_len, k_len = query.shape[2], key.shape[2]
    if cache_layer is not None and _is_favor_cache_layer(cache_layer):
        # ---- Recurrent window cache: not implemented yet (issue 15, decode part) ----
        raise LinearAttentionError(f"favor attention (layer {layer_idx}): window layers do not support caching yet")
    if key_padding_mask is not None and key_padding_mask.shape[-1] != k_len:
        raise FavorMaskError(
            f"favor window attention (layer {layer_idx}): the attention mask covers {key_padding_mask.shape[-1]} "
            f"keys but there are {k_len} keys"
        )
    if causal and k_len < q_len:
        raise LinearAttentionError(
            f"favor attention (layer {layer_idx}): causal attention with fewer keys ({k_len}) than queries ({q_len})"
        )
    arguments = dict(window=window, sinks=sinks, causal=causal, softmax_weight=gamma,
                     key_padding_mask=key_padding_mask, **common)
    if causal and k_len > q_len:
        # A cache holding full keys/values (the default layer): the queries are the last `q_len` positions; run
        # the operator over all keys with placeholder queries for the past ones (exact, O(L) per step).
        placeholder = query.new_zeros(query.shape[0], query.shape[1], k_len - q_len, query.shape[3])
        with _no_redraw(feature_map, active=True):
            out = window_linear_attention(torch.cat([placeholder, query], dim=2), key, value, tail_map, **arguments)
        return out[:, :, -q_len:]
    return window_linear_attention(query, key, value, tail_map, **arguments)


AttentionInterface.register(ATTN_IMPLEMENTATION, favor_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, favor_attention_mask)
