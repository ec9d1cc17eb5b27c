"""The modules a favor attention layer owns, created eagerly by :func:`attach_feature_maps` (before a state dict is
loaded) or on first use by a stock model switched to favor: its feature map (``favor_feature_map``, seed
``settings["seed"] + layer``), a learned-mode window layer's gamma per head (``favor_softmax_weight``), a gated tail's
exponent per head (``favor_tail_gate``); and the checks of a layer's settings that need its module (causality, head
counts).

This module imports only ``torch``, ``transformers`` and relative siblings: it is copied next to saved models for
``trust_remote_code``.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from .clustered_attention import refuse_causal_clustered
from .favor_cache_hooks import install_cache_hooks, prepare_cache_with_favor_layers
from .favor_modules import (
    ATTN_IMPLEMENTATION,
    find_attention_modules,
    layer_index_of,
    module_device,
    module_favor_settings,
    module_head_counts,
    module_head_dim,
    uses_favor,
)
from .favor_settings import (
    build_feature_map,
    is_clustered,
    is_window_layer,
    layer_sparse_cache,
    layer_tail_cap,
    layer_tail_gate,
    layer_window,
    softmax_weight_mode,
)
from .feature_maps import FeatureMap
from .linear_attention import LinearAttentionError
from .window_attention import SoftmaxWeight, TailGate

FEATURE_MAP_ATTRIBUTE = "favor_feature_map"
SOFTMAX_WEIGHT_ATTRIBUTE = "favor_softmax_weight"
"""Attribute of a learned-mode window layer's attention module holding its :class:`~.window_attention.SoftmaxWeight`
(state-dict key ``...favor_softmax_weight.logit``)."""
TAIL_GATE_ATTRIBUTE = "favor_tail_gate"
"""Attribute of a causal window layer with ``tail_gate`` holding its :class:`~.window_attention.TailGate`
(state-dict key ``...favor_tail_gate.exponent``)."""
WINDOW_DROPPED_ATTRIBUTE = "_favor_window_dropped"
"""Set to ``True`` on a window layer with a linear tail by a training schedule (the recipes' sliding-window dropout,
arXiv 2510.05901): its next forward in training mode attends to its sinks and its tail only (no band, no sparse
cache), so that the tail is trained to carry the signal. Ignored in eval mode and without a tail."""

def _attach_feature_map(module: nn.Module, feature_map: FeatureMap) -> FeatureMap:
    feature_map.train(module.training)
    module.add_module(FEATURE_MAP_ATTRIBUTE, feature_map)
    return feature_map


def softmax_weight_for(module: nn.Module, layer_idx: int, settings: dict, num_heads: int | None,
                        device: torch.device) -> torch.Tensor | None:
    """gamma ``[H]`` of a learned-mode window layer (its :class:`SoftmaxWeight` created on first use, float32, with
    its deterministic initialisation), or ``None`` (calibrated mode, or not a window layer)."""
    if not is_window_layer(settings, layer_idx) or softmax_weight_mode(settings) != "learned":
        return None
    return _per_head_module(module, SOFTMAX_WEIGHT_ATTRIBUTE, SoftmaxWeight, layer_idx, num_heads, device)()


def tail_gate_for(module: nn.Module, layer_idx: int, settings: dict, num_heads: int | None,
                   device: torch.device) -> torch.Tensor | None:
    """alpha ``[H]`` of a causal window layer with ``tail_gate`` (its :class:`TailGate` created on first use, float32,
    at 0), or ``None``."""
    if not is_window_layer(settings, layer_idx) or not layer_tail_gate(settings, getattr(module, "is_causal", False)):
        return None
    return _per_head_module(module, TAIL_GATE_ATTRIBUTE, TailGate, layer_idx, num_heads, device)()


def _per_head_module(module: nn.Module, attribute: str, build, layer_idx: int, num_heads: int | None,
                     device: torch.device) -> nn.Module:
    """The learned per-head module ``module.<attribute>``, created on first use as ``build(num_heads)`` (on the CPU:
    real values even under a meta-device context, as the feature maps) in the module's training mode."""
    learned = getattr(module, attribute, None)
    if not isinstance(learned, nn.Module):  # not isinstance of `build`: remote-code copies define their own class
        if num_heads is None:
            raise ValueError(f"cannot tell the number of query heads of layer {layer_idx} for its {attribute}")
        with torch.device("cpu"):
            learned = build(num_heads)
        learned.train(module.training)
        module.add_module(attribute, learned.to(device))
    return learned


def attach_feature_maps(model: nn.Module) -> list[int]:
    """Create ``favor_feature_map`` on every attention module of ``model`` that uses favor attention.

    Call it on a model whose config has ``_attn_implementation == "favor"`` (``attn_implementation="favor"``
    at load time or ``model.set_attn_implementation("favor")``), before ``load_state_dict`` of a converted
    model. Existing feature maps are kept. It also installs the forward hooks that let the attention
    function use a constant-memory :class:`~.favor_cache_layer.FavorCacheLayer` during generation, and makes
    ``generate()`` put those layers in its cache as soon as it makes it (so that assisted decoding's past recording
reaches them). 
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
            refuse_causal_clustered(module_favor_settings(module)["attention"], layer_idx, getattr(module, "is_causal", False))
            continue
        if layer_sparse_cache(module_favor_settings(module), layer_idx) and not getattr(module, "is_causal", False):
            raise LinearAttentionError(
                f"favor_settings give layer {layer_idx} a sparse_cache, but it attends bidirectionally (an encoder "
                "layer sees every key already): sparse caches are for causal window layers; set sparse_cache=0"
            )
        if any(layer_window(module_favor_settings(module), layer_idx)):
            try:
                layer_tail_cap(module_favor_settings(module), getattr(module, "is_causal", False))
                layer_tail_gate(module_favor_settings(module), getattr(module, "is_causal", False))
            except ValueError as error:
                raise LinearAttentionError(f"layer {layer_idx}: {error}") from None
        install_cache_hooks(module)
        if not isinstance(getattr(module, FEATURE_MAP_ATTRIBUTE, None), nn.Module):
            head_dim = module_head_dim(module)
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
                    module_favor_settings(module), head_dim, layer_idx, *module_head_counts(module)
                )
            _attach_feature_map(module, feature_map.to(module_device(module)))
        for learned_weight_for in (softmax_weight_for, tail_gate_for):
            learned_weight_for(module, layer_idx, module_favor_settings(module), module_head_counts(module)[0],
                               module_device(module))
        favor_layers.add(layer_idx)
    if favor_layers and callable(getattr(model, "_prepare_cache_for_generation", None)):
        model._prepare_cache_for_generation = types.MethodType(prepare_cache_with_favor_layers, model)
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


def feature_map_for(module: nn.Module, layer_idx: int, settings: dict, query: torch.Tensor, key: torch.Tensor) -> FeatureMap:
    """The module's feature map, created on first use for stock models switched to favor."""
    feature_map = getattr(module, FEATURE_MAP_ATTRIBUTE, None)
    if isinstance(feature_map, nn.Module):  # not isinstance FeatureMap: remote-code copies define their own class
        return feature_map
    install_cache_hooks(module)  # later calls will see the cache
    softmax_weight_for(module, layer_idx, settings, query.shape[1], query.device)
    feature_map = build_feature_map(settings, query.shape[-1], layer_idx, query.shape[1], key.shape[1])
    return _attach_feature_map(module, feature_map.to(query.device))
