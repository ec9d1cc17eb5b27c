"""Model cards and Hub upload for Performer model folders (the verbs ``hf-performer card`` / ``push``:
:mod:`hf_performer.cli.card`, :mod:`hf_performer.cli.push`).

A Performer model folder (written by ``hf-performer convert``, ``hf-performer distill`` or by ``save_pretrained``
after fine-tuning) holds ``config.json`` (with ``auto_map`` and ``favor_settings``), the weights, the model code
(``modeling_performer.py`` and the modules it imports), the tokenizer, usually ``conversion_report.json`` and, after
attention transfer (``hf-performer distill``), ``attention_transfer.json``.

* :mod:`.folder`: :func:`validate_folder` (would the folder load?) and :func:`upload_file_list`.
* :mod:`.results`: :func:`normalize_results`, :func:`normalize_recovery`, :func:`load_metrics`,
  :func:`recipe_results` (a fine-tuning recipe's ``metrics.json``).
* :mod:`.describe`: what the card says about the feature map, its settings and citations.
* :mod:`.capabilities`: what each kind of attention layer supports (checked against the runtime by a test).
* :mod:`.summary`: the attention layer by layer, whether the model is ready, its measured speed and decoding state.
* :mod:`.runs`: the run records of a folder (``attention_transfer.json``, ``linearize.json``).
* :mod:`.card`: :func:`build_model_card`, :func:`validate_model_card`, :func:`write_model_card`,
  :func:`write_recipe_card`.
* :mod:`.push`: :func:`push_folder`.
"""

from __future__ import annotations

# ruff: noqa: F401  (the names below are re-exported: `from hf_performer.hub import ...` keeps working)

from .card import (
    CARD_FILE_NAME,
    CARD_TAGS,
    REQUIRED_CARD_TAGS,
    TEMPLATE_NAME,
    build_model_card,
    default_template_path,
    validate_model_card,
    write_model_card,
    write_recipe_card,
)
from .describe import (
    DETERMINISTIC_SETTING_MEANINGS,
    FEATURE_MAP_DESCRIPTIONS,
    FEATURE_MAP_PAPERS,
    LEARNED_SETTING_MEANINGS,
    MEASURED_SPEED,
    PAPERS,
    SETTING_MEANINGS,
    TRANSFER_LOSSES,
    effective_nb_features,
    setting_meanings,
)
from .folder import (
    ARCHITECTURES,
    CHECKPOINT_PATTERNS,
    TOKENIZER_FILES,
    UPLOAD_IGNORE_PATTERNS,
    WEIGHT_FILES,
    WEIGHT_INDEX_FILES,
    FolderCheck,
    FolderValidationError,
    ModelCardError,
    UploadFile,
    upload_file_list,
    validate_folder,
)
from .push import PushError, PushResult, push_folder
from .runs import linearize_context, transfer_context
from .results import (
    LM_HUB_DATASET_IDS,
    load_metrics,
    normalize_recovery,
    normalize_results,
    recipe_results,
)


__all__ = [
    "CARD_TAGS",
    "REQUIRED_CARD_TAGS",
    "FolderCheck",
    "FolderValidationError",
    "ModelCardError",
    "PushError",
    "PushResult",
    "UploadFile",
    "build_model_card",
    "load_metrics",
    "normalize_recovery",
    "normalize_results",
    "push_folder",
    "recipe_results",
    "setting_meanings",
    "transfer_context",
    "upload_file_list",
    "validate_folder",
    "validate_model_card",
    "write_model_card",
    "write_recipe_card",
]
