"""Which source architectures a Performer config accepts, and why: an architecture converts when its transformers
implementation dispatches attention through the ``AttentionInterface`` registry (:func:`check_source_architecture`);
its sliding-window or chunked layers must stay on softmax (:func:`bounded_attention_layers`). The errors say what
is accepted (:class:`PerformerConfigError`).

This module imports only ``transformers`` and the standard library: it is copied next to saved models for
``trust_remote_code``.
"""

from __future__ import annotations

import importlib
import inspect

from transformers import PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING


PERFORMER_MODEL_TYPE = "performer"

VERIFIED_SOURCE_MODEL_TYPES = ("bert", "distilbert", "gpt2", "llama", "roberta")
"""Source architectures converted and tested by this package. Others are accepted when their transformers
implementation dispatches attention through the ``AttentionInterface`` registry (see
:func:`check_source_architecture`)."""



class PerformerConfigError(ValueError):
    """An invalid Performer configuration (unknown key, unsupported architecture, bad setting)."""


def supported_architectures_message() -> str:
    return (
        f"verified: {', '.join(VERIFIED_SOURCE_MODEL_TYPES)}; otherwise any text transformers architecture whose "
        "attention modules call transformers' attention registry (ALL_ATTENTION_FUNCTIONS); encoder-decoder heads "
        "and multimodal wrappers are not converted"
    )


def reads_attention_registry(module_class: type) -> bool:
    """Whether ``module_class.forward`` looks up transformers' attention registry (``ALL_ATTENTION_FUNCTIONS``): such
    a module is the ``module`` argument of the attention function, where "favor" plugs in. Read from its code, not
    from a class flag."""
    forward = getattr(module_class, "forward", None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def dispatches_attention_registry(config: PreTrainedConfig) -> bool:
    """Whether the modeling module of ``config``'s architecture (``models/<name>/modeling_<name>.py``, found from the
    config class's module) defines a module class that reads the attention registry
    (:func:`reads_attention_registry`)."""
    config_module = type(config).__module__
    if ".configuration_" not in config_module:
        return False
    try:
        modeling = importlib.import_module(config_module.replace(".configuration_", ".modeling_"))
    except ImportError:
        return False
    return any(
        isinstance(value, type) and value.__module__ == modeling.__name__ and reads_attention_registry(value)
        for value in vars(modeling).values()
    )


SELECTIVE_LAYER_TYPES = ("indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "minimax_m3_sparse")
"""``config.layer_types`` entries of sparse attention layers (DeepSeek's indexer, compressed keys): refused."""

SCORE_BIAS_ARCHITECTURES = {
    "doge": "its attention adds a learned, input-dependent bias to the attention scores (Doge's dynamic mask "
            "attention, computed from the values) and keeps the top keys of that bias",
}
"""Model types whose attention modules build a bias on the scores themselves, before the attention registry is
called (so no mask the registry receives can say it): refused, with what the bias is."""

MODALITY_WORDS = ("vision", "audio", "image", "video", "speech")
"""A sub-config whose name holds one of these makes a model multimodal (a vision or audio tower beside the text)."""

BOUNDED_LAYER_TYPES = ("sliding_attention", "chunked_attention")
"""``config.layer_types`` entries of layers whose attention span is bounded (a sliding window, or chunks): they keep
their exact softmax attention, whose cache is already of constant size."""


def _layer_attribute(config: PreTrainedConfig, name: str, layer: int):
    """``config.<name>`` of ``layer`` (heterogeneous configs hold some attributes per layer)."""
    if getattr(config, "is_heterogeneous", False):
        per_layer = config.per_layer_config
        if layer < len(per_layer):
            return getattr(per_layer[layer], name, None)
    try:
        return getattr(config, name, None)
    except RuntimeError:  # a per-layer attribute read globally (AmbiguousGlobalPerLayerAttributeError)
        return None


def bounded_attention_layers(config: PreTrainedConfig) -> dict[int, str]:
    """``{layer: "sliding window of W tokens" | "chunks of C tokens"}`` for the layers of ``config`` whose attention span
    is bounded: ``layer_types`` entries of :data:`BOUNDED_LAYER_TYPES`, else every layer when a ``sliding_window`` is
    set (and ``use_sliding_window`` is not False)."""
    num_layers = getattr(config, "num_hidden_layers", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        layers = [index for index, kind in enumerate(layer_types) if kind in BOUNDED_LAYER_TYPES]
    elif isinstance(num_layers, int) and getattr(config, "use_sliding_window", True) is not False:
        layers = [index for index in range(num_layers) if _layer_attribute(config, "sliding_window", index)]
    else:
        layers = []
    spans = {}
    for layer in layers:
        if layer_types and layer_types[layer] == "chunked_attention":
            spans[layer] = f"chunks of {_layer_attribute(config, 'attention_chunk_size', layer)} tokens"
        else:
            spans[layer] = f"a sliding window of {_layer_attribute(config, 'sliding_window', layer)} tokens"
    return spans


def check_source_architecture(config: PreTrainedConfig) -> None:
    """Raise :class:`PerformerConfigError` unless FAVOR+ can replace the attention of ``config``'s architecture.

    Accepted: any text transformers architecture whose modeling code has attention modules calling
    ``ALL_ATTENTION_FUNCTIONS`` (:func:`dispatches_attention_registry`, where "favor" is registered). Rejected:
    encoder-decoder models (their decoder-only causal-LM classes, e.g. ``BartForCausalLM``, are accepted: their
    config says ``is_encoder_decoder=False``), multimodal wrappers (their text model is accepted), sparse layer types
    (:data:`SELECTIVE_LAYER_TYPES`), attention that biases its own scores (:data:`SCORE_BIAS_ARCHITECTURES`) and
    models whose every layer has a bounded attention span
    (:func:`bounded_attention_layers`: nothing would be converted).
    """
    model_type = getattr(config, "model_type", None)
    if model_type == PERFORMER_MODEL_TYPE:
        raise PerformerConfigError("source_config is already a Performer config; pass the original architecture's config")
    if model_type not in CONFIG_MAPPING:
        raise PerformerConfigError(
            f"unknown source architecture {model_type!r}: it is not a transformers model type. Supported: "
            f"{supported_architectures_message()}."
        )
    if getattr(config, "is_encoder_decoder", False):
        raise PerformerConfigError(
            f"source architecture {model_type!r} is an encoder-decoder model, which this package does not convert "
            "(its decoder-only causal-LM class, where transformers has one, can be converted). "
            f"Supported: {supported_architectures_message()}."
        )
    modalities = [name for name in getattr(config, "sub_configs", None) or {}
                  if any(word in name for word in MODALITY_WORDS)]
    if modalities:
        raise PerformerConfigError(
            f"source architecture {model_type!r} is a multimodal model ({', '.join(modalities)}), which this package "
            f"does not convert. Supported: {supported_architectures_message()}."
        )
    text_config = config.get_text_config(decoder=True)
    if text_config is not config:
        raise PerformerConfigError(
            f"source architecture {model_type!r} is a multimodal wrapper around a {text_config.model_type!r} text "
            f"model; convert the text model alone (its config is config.get_text_config()). "
            f"Supported: {supported_architectures_message()}."
        )
    if not dispatches_attention_registry(config):
        raise PerformerConfigError(
            f"source architecture {model_type!r} is not supported: no attention module of its transformers "
            "implementation calls the attention registry (ALL_ATTENTION_FUNCTIONS), so FAVOR+ cannot be plugged in. "
            f"Supported: {supported_architectures_message()}."
        )
    selective = sorted({kind for kind in getattr(config, "layer_types", None) or () if kind in SELECTIVE_LAYER_TYPES})
    if selective:
        raise PerformerConfigError(
            f"source architecture {model_type!r} has {', '.join(selective)} layers, whose queries attend to keys picked "
            "or compressed by an indexer (sparse attention), which linear attention cannot express"
        )
    if model_type in SCORE_BIAS_ARCHITECTURES:
        raise PerformerConfigError(
            f"source architecture {model_type!r} cannot be converted: {SCORE_BIAS_ARCHITECTURES[model_type]}, which "
            "linear attention cannot express"
        )
    bounded = bounded_attention_layers(config)
    num_layers = getattr(config, "num_hidden_layers", None)
    if bounded and len(bounded) == num_layers:
        raise PerformerConfigError(
            f"every layer of source architecture {model_type!r} attends over {next(iter(bounded.values()))} "
            "(a bounded span, already of constant memory), so there is nothing to convert; set sliding_window=None in "
            "the source config to convert it as full attention."
        )


def check_bounded_layers_kept(config: PreTrainedConfig, softmax_layers) -> None:
    """Raise :class:`PerformerConfigError` if a layer with a bounded attention span (:func:`bounded_attention_layers`)
    is not among ``softmax_layers``: linear attention cannot express a sliding window or chunks, and those layers
    keep their exact (constant-memory) softmax attention."""
    bounded = bounded_attention_layers(config)
    missing = sorted(set(bounded) - set(softmax_layers))
    if missing:
        raise PerformerConfigError(
            f"layers {missing} of {config.model_type!r} attend over {bounded[missing[0]]}, which linear attention "
            f"cannot express: they must keep softmax attention (softmax_layers must include {sorted(bounded)}; "
            "convert_to_performer adds them)"
        )
