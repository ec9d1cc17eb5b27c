"""Conversion of pretrained softmax models to FAVOR+ (installed as ``hf_performer.conversion``).

* :func:`convert_to_performer`: a transformers model (or a folder) -> the matching Performer model, every
  source weight reused unchanged; hybrid layers (``keep_softmax_layers``) and longer learned position tables
  (``max_position_embeddings``) optional.
* :func:`fidelity_report`: per-layer attention errors, final hidden-state cosine and head agreement of a
  converted model against its source.
* ``hf-performer convert SOURCE OUTPUT``: both, writing a complete model folder (see :mod:`.cli`).
* :func:`transfer_attention`: train learned feature maps (hedgehog, t2r) to mimic the model's own softmax
  attention; ``hf-performer distill SOURCE OUTPUT`` converts, transfers and saves (see :mod:`.distill`).

The names below are imported on first use (``from hf_performer.conversion import convert_to_performer`` works as
before): the torch-free :mod:`.defaults` the command line's parsers read must not import torch and transformers.
"""

import importlib

_NAMES_BY_MODULE = {
    "convert": ("TASKS", "ConversionError", "convert_to_performer", "extend_position_embeddings",
                "keep_softmax_attention", "learned_position_count", "load_source", "task_of_source_class",
                "tokenizer_is_usable"),
    "defaults": ("DEFAULT_MAX_POSITION_EMBEDDINGS",),
    "attention_transfer": ("AttentionTransferError", "AttentionTransferResult", "transfer_attention"),
    "cache_budget": ("CacheAllocation", "CacheBudgetError", "allocate_cache_budget", "apply_cache_allocation",
                     "measure_option_errors"),
    "fidelity": ("DEFAULT_SENTENCES", "REPORT_FILE_NAME", "FidelityReport", "LayerFidelity", "fidelity_report"),
}
_MODULE_OF = {name: module for module, names in _NAMES_BY_MODULE.items() for name in names}


def __getattr__(name: str):
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_MODULE_OF)
