"""The attention modules of a model as favor attention sees them: which modules dispatch through transformers'
attention registry, their layer index, head dimension and head counts, device, and resolved ``favor_settings``
(kept on each module), and :func:`update_favor_settings` (change a loaded model's settings in place).

The one walk over a model's attention modules that :mod:`.favor_attention`, conversion and the recipes share.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .source_architectures import reads_attention_registry
from .favor_settings import canonical_favor_settings, exact_budget_problem, favor_settings_of, is_int

ATTN_IMPLEMENTATION = "favor"
SETTINGS_ATTRIBUTE = "_favor_settings"


def is_attention_module(module: nn.Module) -> bool:
    """Whether ``module`` dispatches through transformers' attention registry, i.e. is the ``module``
    argument an attention function receives (``BertSelfAttention``, ``GPT2Attention``, ``LlamaAttention``,
    ``DistilBertSelfAttention``, ...): its ``forward`` looks up ``ALL_ATTENTION_FUNCTIONS``."""
    return reads_attention_registry(type(module))


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


def module_head_dim(module: nn.Module) -> int | None:
    """The head dimension of the module's queries and keys (what the feature map takes): ``qk_head_dim`` first, as
    multi-head latent attention (DeepSeek V2/V3, ...) has one of its own beside its values' and its rotary part's."""
    for attribute in ("qk_head_dim", "head_dim", "attention_head_size", "head_size"):
        value = getattr(module, attribute, None)
        if is_int(value):
            return value
    config = getattr(module, "config", None)
    if config is None:
        return None
    for attribute in ("qk_head_dim", "head_dim"):
        head_dim = getattr(config, attribute, None)
        if is_int(head_dim):
            return head_dim
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if is_int(hidden) and is_int(heads) and heads > 0:
        return hidden // heads
    return None


def module_head_counts(module: nn.Module) -> tuple[int | None, int | None]:
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


def module_device(module: nn.Module) -> torch.device:
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


def update_favor_settings(model: nn.Module, **changes) -> dict:
    """Change ``favor_settings`` keys of a loaded model in place, e.g. ``sparse_cache=64`` to try a sparse cache on a
    trained window hybrid without retraining: the configs its attention modules read get the validated settings
    (the next forward uses them). Returns the new settings.

    Raises:
        ValueError: the changed settings are invalid (one line), or ``model`` has no favor attention module.
    """
    configs = {id(module.config): module.config for _, module in find_attention_modules(model) if uses_favor(module)}
    if not configs:
        raise ValueError(f"{type(model).__name__} has no attention module running favor attention to change")
    settings = None
    new_settings = {}
    for key, config in configs.items():
        new_settings[key] = canonical_favor_settings({**(config.favor_settings or {}), **changes})
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        problem = exact_budget_problem(new_settings[key], getattr(text, "max_position_embeddings", None))
        if problem:
            raise ValueError(f"update_favor_settings: {problem}: every input would be exact softmax at a higher cost; "
                             "give a smaller value")
    for key, config in configs.items():  # (nothing changes unless every config takes the new settings)
        settings = config.favor_settings = new_settings[key]
    top = getattr(model, "config", None)
    if top is not None and getattr(top, "favor_settings", None) is not None and id(top) not in configs:
        top.favor_settings = settings  # a Performer model's own config records them too
    return settings
