"""Conversion of pretrained softmax models to FAVOR+ (installed as ``hf_performer.conversion``).

* :func:`convert_to_performer`: a transformers model (or a folder) -> the matching Performer model, every
  source weight reused unchanged; hybrid layers (``keep_softmax_layers``) and longer learned position tables
  (``max_position_embeddings``) optional.
* :func:`fidelity_report`: per-layer attention errors, final hidden-state cosine and head agreement of a
  converted model against its source.
* ``hf-performer convert SOURCE OUTPUT``: both, writing a complete model folder (see :mod:`.cli`).
* :func:`transfer_attention`: train learned feature maps (hedgehog, t2r) to mimic the model's own softmax
  attention; ``hf-performer distill SOURCE OUTPUT`` converts, transfers and saves (see :mod:`.distill`).
"""

from .convert import (
    DEFAULT_MAX_POSITION_EMBEDDINGS,
    TASKS,
    ConversionError,
    convert_to_performer,
    extend_position_embeddings,
    keep_softmax_attention,
    learned_position_count,
    load_source,
    task_of_source_class,
    tokenizer_is_usable,
)
from .attention_transfer import AttentionTransferError, AttentionTransferResult, transfer_attention
from .fidelity import DEFAULT_SENTENCES, REPORT_FILE_NAME, FidelityReport, LayerFidelity, fidelity_report


__all__ = [
    "AttentionTransferError",
    "AttentionTransferResult",
    "DEFAULT_MAX_POSITION_EMBEDDINGS",
    "DEFAULT_SENTENCES",
    "REPORT_FILE_NAME",
    "TASKS",
    "ConversionError",
    "FidelityReport",
    "LayerFidelity",
    "convert_to_performer",
    "extend_position_embeddings",
    "keep_softmax_attention",
    "fidelity_report",
    "learned_position_count",
    "load_source",
    "task_of_source_class",
    "tokenizer_is_usable",
    "transfer_attention",
]
