"""Tiny random source models for every model type of the installed transformers (for compatibility_sweep.py).

transformers' per-model testers (``tests/models/*/test_modeling_*.py``) would give a valid tiny config for each
architecture, but its sdist does not ship them (``tests/`` there holds the common mixins only; checked on the
5.24.0 sdist: no ``tests/models/`` entry), and a git copy of transformers cannot be fetched here. So each config is
built from its class's defaults with the size fields shrunk (:data:`TINY_SIZES`, by field name, through the class's
``attribute_map``, sub-configs too), then the model is built on the meta device first so that a config this does not
shrink enough is refused (:data:`MAX_PARAMETERS`) before it allocates anything. Layer counts are tried from
:data:`LAYER_COUNTS` until the model has an attention layer of every kind the default config has (hybrid models
interleave attention with recurrent layers every few layers).
"""

from __future__ import annotations

import dataclasses
import inspect
import os

import torch
import transformers
from transformers.models.auto import configuration_auto, modeling_auto

from hf_performer.source_architectures import MODALITY_WORDS

VOCAB_SIZE = 256
TINY_SIZES = {
    "vocab_size": VOCAB_SIZE, "vocab_size_per_layer_input": VOCAB_SIZE,
    "hidden_size": 64, "d_model": 64, "embedding_size": 64, "hidden_size_per_layer_input": 16,
    "intermediate_size": 64, "ffn_dim": 64, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "d_ff": 64, "ffn_hidden_size": 64,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "num_attention_heads": 4, "encoder_attention_heads": 4, "decoder_attention_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "d_kv": 16, "kv_channels": 16,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "top_k_experts": 2, "moe_topk": 2, "n_group": 1, "topk_group": 1,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "index_head_dim": 16, "index_n_heads": 2, "rotary_dim": 8,
    "coordinate_size": 8, "shape_size": 16,  # LayoutLMv3: 4 x coordinate + 2 x shape = hidden_size
    "shape_vocab_size": 64, "pronunciation_vocab_size": 64, "shape_embed_dim": 16, "pronunciation_embed_dim": 16,
    "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 1,
    "attn_layer_indices": [1],  # Bamba and GraniteMoeHybrid have no attention layer by default
    "n_input_layers": 1, "n_output_layers": 0,  # Dory: the other layers are the looped ones
}
"""Size fields of a config and their tiny values (a field is set only if the config class has it), and the one structure
field that decides whether a hybrid model has attention at all."""

TESTER_VALUES = {
    "dbrx": {"attn_config": {"rope_theta": 500000, "clip_qkv": 8}},  # DbrxAttention reads both; no defaults
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # (no default: the modeling code indexes it)
    "longcat_flash": {"head_dim": 8},  # the rotary part of each head: qk_rope_head_dim
    "blt": {"encoder_hash_byte_group_vocab": 64, "encoder_hash_byte_group_size": [2, 3], "patch_in_forward": False,
            "cross_attn_k": 2, "decoder_config": {"hidden_size_global": 128}, "encoder_config": {"hidden_size_global": 128},
            "global_config": {"hidden_size": 128, "num_attention_heads": 8}},
    "dots3_note_text": {"layer_types": ["indexed_attention", "sliding_attention"],  # both kinds of the default
                        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_q_lora_rank": 16,
                        "swa_kv_lora_rank": 16, "swa_head_dim": 16, "swa_qk_nope_head_dim": 8, "swa_v_head_dim": 16},
    "inkling2_text": {"unpadded_vocab_size": VOCAB_SIZE},
    "inkling2_loop_text": {"unpadded_vocab_size": VOCAB_SIZE},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 4},  # (None by default, read by its QSA indexer)
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
}
"""Per model type, values of transformers' own tester (``tests/models/<type>/test_modeling_<type>.py``, read through
the search tool's file look-up) that the shrunk defaults lack; dicts are merged into the sub-config of that name."""

TESTER_ATTRIBUTES = {"blt": {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}}
"""Attributes a tester sets on the built config (its class does not take them as arguments)."""

LAYER_FIELDS = ("num_hidden_layers", "encoder_layers", "decoder_layers", "num_layers", "num_decoder_layers")
LAYER_COUNTS = (2, 4, 8, None)
"""Layer counts tried in turn (``None``: the default config's own count)."""

HYBRID_LAYER_TYPES = ["linear_attention", "full_attention"]
CHECK_LENGTH = 16
MAX_PARAMETERS = 5_000_000
TOKEN_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
                   "cls_token_id", "mask_token_id")

HEAD_MAPPINGS = {
    "causal-lm": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    "masked-lm": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    "sequence-classification": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
}
"""The heads the sweep converts, as hf-performer task names, with transformers' class-name mappings."""

WRAPPER_WORDS = (*MODALITY_WORDS, "vq", "text_config", "text_encoder")
"""A sub-config whose name holds one of these makes a model type multimodal: a vision / audio tower (the converter's
:data:`~hf_performer.configuration_performer.MODALITY_WORDS`), or a wrapper holding its text model apart."""


class TinySourceError(RuntimeError):
    """No tiny config of this model type could be built (a limit of this builder, not of the converter)."""


def model_types_dispatching_attention() -> list[str]:
    """Model types whose modeling code reads ``ALL_ATTENTION_FUNCTIONS`` (transformers' attention registry)."""
    models = os.path.join(os.path.dirname(transformers.__file__), "models")
    found = []
    for model_type in configuration_auto.CONFIG_MAPPING_NAMES:
        folder = os.path.join(models, configuration_auto.model_type_to_module_name(model_type))
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            if name.startswith("modeling_") and name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as handle:
                    if "ALL_ATTENTION_FUNCTIONS" in handle.read():
                        found.append(model_type)
                        break
    return found


def heads_of(model_type: str) -> list[str]:
    return [head for head, names in HEAD_MAPPINGS.items() if model_type in names]


def head_class(model_type: str, head: str) -> type:
    return getattr(transformers, HEAD_MAPPINGS[head][model_type])


def is_multimodal(model_type: str) -> bool:
    """A wrapper word in a sub-config's name, or in the name of a sub-config's own sub-config (T5Gemma2's encoder holds
    its vision tower)."""
    sub_configs = getattr(configuration_auto.CONFIG_MAPPING[model_type], "sub_configs", None) or {}
    names = [*sub_configs, *(name for sub in sub_configs.values() for name in getattr(sub, "sub_configs", None) or {})]
    return any(word in name for name in names for word in WRAPPER_WORDS)


def _field_names(config_class) -> set[str]:
    if dataclasses.is_dataclass(config_class):
        return {field.name for field in dataclasses.fields(config_class)}
    return set(inspect.signature(config_class.__init__).parameters)


def _tiny_kwargs(config_class, layers: int | None, variation: dict) -> dict:
    names = _field_names(config_class)
    aliases = getattr(config_class, "attribute_map", None) or {}
    sizes = {**TINY_SIZES, **variation}
    if "kv_lora_rank" in names:  # multi-head latent attention: keys have every head (no grouped-query sharing)
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    if layers is not None:
        sizes.update({name: layers for name in LAYER_FIELDS})
    kwargs = {}
    for name, value in sizes.items():
        target = name if name in names else aliases.get(name)
        if target in names and value is not None:
            kwargs[target] = value
    for name, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        if isinstance(sub_class, type) and issubclass(sub_class, transformers.PreTrainedConfig):
            try:
                kwargs[name] = tiny_config_of_class(sub_class, layers, variation).to_dict()
            except Exception:  # noqa: BLE001 - the parent's defaults for this part
                pass
    for name, value in TESTER_VALUES.get(getattr(config_class, "model_type", None), {}).items():
        kwargs[name] = {**kwargs.get(name, {}), **value} if isinstance(value, dict) else value
    return kwargs


VARIATIONS = ({}, {"num_key_value_heads": 4}, {"num_experts_per_tok": 1},
              {"num_key_value_heads": 4, "num_experts_per_tok": 1},
              {"mamba_n_heads": None, "mamba_d_head": None, "mamba_d_state": None, "mamba_n_groups": None})
"""Changes to :data:`TINY_SIZES` tried in turn when a config class's validation refuses them (no grouped-query
attention, one expert per token, the class's own Mamba sizes); ``None`` leaves a field at its default."""


def tiny_config_of_class(config_class, layers: int | None = 2, variation: dict | None = None):
    if variation is None:
        for index, candidate in enumerate(VARIATIONS):
            try:
                return tiny_config_of_class(config_class, layers, candidate)
            except Exception:  # noqa: BLE001 - the next variation, then the first one's error
                if index == len(VARIATIONS) - 1:
                    return tiny_config_of_class(config_class, layers, VARIATIONS[0])
    config = config_class(**_tiny_kwargs(config_class, layers, variation))
    for name, value in TESTER_ATTRIBUTES.get(getattr(config_class, "model_type", None), {}).items():
        setattr(config, name, value)
    vocab = getattr(config, "vocab_size", None)
    if hasattr(config, "pad_token_id") and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0  # sequence classification of decoders finds the last token through it
    for name in TOKEN_ID_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and isinstance(vocab, int) and value >= vocab:
            setattr(config, name, {"pad_token_id": 0, "bos_token_id": 1}.get(name, 2))
        elif isinstance(value, list) and isinstance(vocab, int):
            setattr(config, name, [token if token < vocab else 2 for token in value])
    return config


def _attention_kinds(config) -> set[str]:
    return {str(kind) for kind in (getattr(config, "layer_types", None) or ())
            if "attention" in str(kind) and "linear" not in str(kind)}


def tiny_source_model(model_type: str, head: str, is_attention_module) -> torch.nn.Module:
    """A tiny random model of ``model_type`` with the ``head`` class, in eval mode, float32.

    Raises:
        TinySourceError: no layer count of :data:`LAYER_COUNTS` gives a model that builds, stays under
            :data:`MAX_PARAMETERS` and has a registry-routed attention module of every attention kind of the default
            config; the last reason.
    """
    config_class = configuration_auto.CONFIG_MAPPING[model_type]
    model_class = head_class(model_type, head)
    try:
        default_kinds = _attention_kinds(config_class())
    except Exception:  # noqa: BLE001
        default_kinds = set()
    reason = "no layer count tried"
    # Last, a hybrid whose default is all recurrent (GraniteMoeHybrid): one recurrent layer, one attention layer.
    attempts = [(layers, None) for layers in LAYER_COUNTS] + [(2, {"layer_types": HYBRID_LAYER_TYPES})]
    for layers, variation in attempts:
        try:
            config = tiny_config_of_class(config_class, layers, variation)
            if head == "causal-lm":
                config.is_decoder = True  # encoder architectures (BERT, RoBERTa, ...) decode only as decoders
            with torch.device("meta"):
                meta = model_class(config)
            parameters = sum(parameter.numel() for parameter in meta.parameters())
            if parameters > MAX_PARAMETERS:
                reason = f"the shrunk config still has {parameters:,} parameters"
                continue
            if not any(is_attention_module(module) for module in meta.modules()):
                reason = f"no registry-routed attention module with {layers or 'the default'} layers"
                continue
            if not default_kinds <= _attention_kinds(config):
                reason = f"{layers} layers miss attention kinds {sorted(default_kinds - _attention_kinds(config))}"
                continue
            torch.manual_seed(0)
            model = model_class(config).eval()
            languages = getattr(config, "languages", None)
            if hasattr(model, "set_default_language") and languages:  # X-MOD: one adapter per language
                model.set_default_language(languages[0])
            return model
        except Exception as error:  # noqa: BLE001 - any failure of transformers' own building: try the next count
            reason = f"{type(error).__name__}: {first_line(error)}"
    raise TinySourceError(reason)


def own_run_error(model) -> str | None:
    """``None`` if the tiny source runs one row of :data:`CHECK_LENGTH` tokens on its own (as the fidelity report
    runs it), else the error: a config this builder shrank into something the architecture cannot run."""
    try:
        with torch.no_grad():
            model(input_ids=torch.arange(5, 5 + CHECK_LENGTH)[None] % VOCAB_SIZE)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {first_line(error)}"
    return None


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__
