"""The model card of a Performer model folder (``hf-performer card``).

:func:`build_model_card` renders ``model_cards/performer_card.md`` with ``huggingface_hub``'s
``ModelCard.from_template`` / ``ModelCardData``: metadata (``base_model``, ``library_name``, ``pipeline_tag``, tags,
``datasets``, ``model-index`` results), what each layer computes and what its kind supports (:mod:`.summary`,
:mod:`.capabilities`), the conversion settings (explained for the kind, with its paper cited), the run records
(``attention_transfer.json``, ``linearize.json``: :mod:`.runs`), the fidelity report, results and the measured speed,
memory and decoding state of the model's kinds of attention. The card is parsed back and validated offline by
:func:`validate_model_card` (``model-index`` round trip through ``huggingface_hub.repocard_data``).
:func:`write_model_card` writes it as the folder's ``README.md``; :func:`write_recipe_card` writes the card of a
fine-tuning recipe's output folder, with the results of its ``metrics.json``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData
from huggingface_hub.constants import REPOCARD_NAME
from huggingface_hub.repocard_data import eval_results_to_model_index, model_index_to_eval_results

from .capabilities import behaviour_rows
from .describe import (
    SETTING_MEANINGS, _citations, _map_kind, describe_map, setting_meanings, uses_feature_map,
)
from .folder import (
    _HUB_ID,
    ARCHITECTURES,
    ModelCardError,
    _check_code,
    _looks_like_hub_id,
    _read_json,
)
from .results import (
    _is_recipe_run,
    load_metrics,
    normalize_recovery,
    normalize_results,
)
from .runs import cache_budget_context, linearize_context, serving_settings_context, transfer_context
from .summary import attention_context, speed_context, status_warning

TEMPLATE_NAME = "performer_card.md"
CARD_FILE_NAME = REPOCARD_NAME  # README.md: the Hub reads a repository's card from this file

CARD_TAGS = ("performer", "favor+", "linear-attention", "hf-performer", "custom_code")
"""Tags of a FAVOR+ card (the source architecture's model type is added). A card of another feature map carries
that map's name (``hedgehog``, ``elu+1``, ...) instead of ``favor+``; see :func:`card_tags` for the other kinds."""

REQUIRED_CARD_TAGS = ("performer", "hf-performer", "custom_code")
"""Tags every card must carry, plus the name of its feature map or the tag of its attention kind (checked by
:func:`validate_model_card`)."""

ATTENTION_TAGS = {"clustered": "clustered-attention", "improved-clustered": "clustered-attention",
                  "window": "sliding-window-attention", "window-no-tail": "sliding-window-attention"}
"""The tag of each layer kind (:mod:`.capabilities`) that is not plain linear attention."""
ALL_SOFTMAX_TAG = "softmax-attention"
"""The attention tag of a folder whose every layer went back to exact softmax (``linearize --softmax-worst``)."""


MAP_ONLY_SETTINGS = ("feature_map", "nb_features", "orthogonal", "row_norms", "redraw_interval", "seed",
                     "feature_map_options", "softmax_weight", "tail_cap", "tail_gate")
"""Settings that only a layer with a feature map reads (linear attention, a window layer's tail): listed as unused
in the card of a model whose window layers have no tail."""


def default_template_path() -> Path:
    """``model_cards/performer_card.md``, installed as package data of ``hf_performer.model_cards``."""
    from importlib.resources import files

    path = Path(str(files("hf_performer.model_cards") / TEMPLATE_NAME))
    if not path.is_file():
        raise ModelCardError(f"model card template {TEMPLATE_NAME} not found at {path}; pass template_path=")
    return path


def _source_geometry(config: dict) -> dict:
    source = config.get("source_config") or {}
    layers = source.get("num_hidden_layers") or source.get("n_layer") or source.get("n_layers")
    heads = source.get("num_attention_heads") or source.get("n_head") or source.get("n_heads")
    hidden = source.get("hidden_size") or source.get("n_embd") or source.get("dim")
    head_dim = source.get("head_dim") or (hidden // heads if hidden and heads else None)
    kv_heads = source.get("num_key_value_heads") or heads
    max_positions = source.get("max_position_embeddings") or source.get("n_positions")
    return {
        "source_model_type": source.get("model_type", "unknown"),
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "hidden_size": hidden,
        "head_dim": head_dim,
        "max_positions": max_positions,
        "name_or_path": source.get("_name_or_path"),
        "source_architectures": source.get("architectures") or [],
    }


def _format_setting(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) if value else "none"
    if isinstance(value, dict):
        return ", ".join(f"`{k}`: {_format_setting(v)}" for k, v in value.items()) if value else "none"
    return f"`{value}`" if isinstance(value, str) else str(value)


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def _read_record(given, folder: Path, name: str, what: str) -> tuple[dict | None, str]:
    """A run record: ``given`` (a dict, or a path), else the folder's file ``name`` if present; with where it was
    read from (for error messages)."""
    where = f"the {what}"
    if given is None and (folder / name).is_file():
        given = folder / name
    if isinstance(given, (str, os.PathLike)):
        where = str(given)
        given = _read_json(Path(given), what)
    return given, where


def _recipe_results(folder: Path):
    """The results of a recipe run's ``metrics.json`` in ``folder`` (``None`` without one, or when it names no
    result a ``model-index`` can hold: a warning says why)."""
    from ..recipes.results import METRICS_FILE as METRICS_FILE_NAME

    if not _is_recipe_run(folder):
        return None
    try:
        results, _ = load_metrics(folder / METRICS_FILE_NAME)
    except ModelCardError as error:
        if "holds no metric" not in str(error):  # a run trained with --no-evaluation: nothing to say
            print(f"warning: the model card gets no results: {error}", file=sys.stderr)
        return None
    return results


def card_tags(settings: dict, kinds: list[str], distilled: bool, linearized: bool) -> list[str]:
    """The tags of a card: :data:`REQUIRED_CARD_TAGS`, the feature map and ``linear-attention`` when a layer uses the
    map, the tag of each other attention kind, ``attention-transfer`` / ``linearized`` for those flows."""
    feature_map = settings.get("feature_map", "favor+")
    uses_map = uses_feature_map(kinds)
    all_softmax = bool(kinds) and set(kinds) == {"softmax"}
    tags = ["performer", *([feature_map, "linear-attention"] if uses_map else []),
            *(ATTENTION_TAGS[kind] for kind in kinds if kind in ATTENTION_TAGS),
            *([ALL_SOFTMAX_TAG] if all_softmax else []), "hf-performer", "custom_code"]
    tags += ["attention-transfer"] if distilled else []
    tags += ["linearized"] if linearized else []
    return list(dict.fromkeys(tags))


def build_model_card(
    folder: str | os.PathLike,
    *,
    base_model: str | list[str] | None = None,
    datasets: str | list[str] | None = None,
    results=None,
    recovery=None,
    model_name: str | None = None,
    repo_id: str | None = None,
    license: str | None = None,
    language: str | list[str] | None = None,
    tags: list[str] | None = None,
    report=None,
    fine_tuned: bool | None = None,
    template_path: str | os.PathLike | None = None,
    transfer=None,
    linearize=None,
) -> ModelCard:
    """Build the model card of a Performer model folder (validated; see :func:`validate_model_card`).

    The card describes the model it sits next to: what each layer computes (from ``config.json``'s
    ``favor_settings``: linear attention, the sink + window hybrid, clustered attention, kept softmax layers), what
    those layers support today (:mod:`.capabilities`), the flow that wrote the folder and its records
    (``conversion_report.json``, ``attention_transfer.json``, ``linearize.json``, a recipe's ``metrics.json``) and
    the measured speed of its kinds of attention.

    Args:
        folder: the model folder (``config.json`` with ``favor_settings``; ``conversion_report.json`` if any).
        base_model: Hub id(s) of the model this one derives from. Default: the conversion source when it is a
            Hub id (a local path is never written as ``base_model``).
        datasets: Hub dataset id(s) used for training. Default: the datasets of ``results``.
        results: evaluation results of *this* model (``model-index``): dicts or ``EvalResult`` objects, see
            :func:`normalize_results`. Default: those of the folder's recipe ``metrics.json``, if any.
        recovery: rows comparing softmax / converted / recovered models, shown in the card body only (see
            :func:`normalize_recovery`).
        model_name: the card's title and ``model-index`` name. Default: the last part of ``repo_id``, else the
            folder name.
        repo_id: the Hub repository the card's loading example uses (default: ``model_name``).
        license, language, tags: extra metadata (``tags`` are added to the card's own, see :func:`card_tags`).
        report: the fidelity report (a ``FidelityReport`` or its dict); default: the folder's
            ``conversion_report.json`` if present, else the ``fidelity_after`` of the attention-transfer record.
        fine_tuned: whether the model was trained after conversion (the card warns when it was not). Default: whether
            the folder holds a Trainer's files (:data:`hf_performer.tasks.evaluation.TRAINING_FILES`), a recipe's
            ``metrics.json`` with completed steps, or a ``linearize.json`` whose LoRA stage ran.
        template_path: a Jinja template; default :func:`default_template_path`.
        transfer: the attention-transfer record of ``hf-performer distill`` (the dict it writes as
            ``attention_transfer.json``, or a path to such a file); default: the folder's ``attention_transfer.json``
            if present. With one, the card says the model was distilled and gains an "Attention transfer" section
            (see :func:`transfer_context`).
        linearize: the record of ``hf-performer linearize`` (``linearize.json``'s dict or path); default: the
            folder's file if present. With one, the card gains a "Linearize run" section (stages, steps, tokens,
            losses, wall time, the perplexity and its protocol; see :func:`linearize_context`).

    Returns:
        A ``huggingface_hub.ModelCard``.

    Raises:
        ModelCardError: not a Performer folder, invalid results, a malformed record, or metadata that fails
            validation.
    """
    from ..conversion.attention_transfer import TRANSFER_FILE_NAME
    from ..conversion.cache_budget import CACHE_BUDGET_FILE, SERVING_SETTINGS_FILE
    from ..conversion.fidelity import REPORT_FILE_NAME
    from ..recipes.linearize import LINEARIZE_FILE
    from ..tasks.evaluation import TRAINING_FILES

    folder = Path(folder)
    config = _read_json(folder / "config.json", "config")
    settings = config.get("favor_settings")
    if not isinstance(settings, dict):
        raise ModelCardError(f"{folder}: config.json has no favor_settings: not a Performer model folder")
    architecture = (config.get("architectures") or ["PerformerModel"])[0]
    if architecture not in ARCHITECTURES:
        raise ModelCardError(
            f"{folder}: unknown architecture {architecture!r} (expected one of {', '.join(ARCHITECTURES)})"
        )
    pipeline_tag, auto_class, usage_example = ARCHITECTURES[architecture]
    geometry = _source_geometry(config)
    feature_map = settings.get("feature_map", "favor+")
    kind = _map_kind(feature_map)
    attention = attention_context(settings, geometry["num_layers"], geometry["head_dim"])
    kinds = attention["kinds"]

    transfer, transfer_where = _read_record(transfer, folder, TRANSFER_FILE_NAME, "attention-transfer record")
    transfer_info = transfer_context(transfer, transfer_where, feature_map) if transfer is not None else None
    if transfer_info is not None and kind not in ("learned", None):
        raise ModelCardError(
            f"{transfer_where}: attention transfer trains learned feature maps, but this model's {feature_map!r} map "
            f"is {kind} (no trainable parameters): the record does not belong to this model"
        )
    linearize, linearize_where = _read_record(linearize, folder, LINEARIZE_FILE, "linearize record")
    linearize_info = linearize_context(linearize, linearize_where) if linearize is not None else None
    budget, budget_where = _read_record(None, folder, CACHE_BUDGET_FILE, "cache budget record")
    budget_info = cache_budget_context(budget, budget_where) if budget is not None else None
    serving, serving_where = _read_record(None, folder, SERVING_SETTINGS_FILE, "serving settings record")
    serving_info = serving_settings_context(serving, serving_where) if serving is not None else None

    report_file = f"`{REPORT_FILE_NAME}`"
    if report is None and (folder / REPORT_FILE_NAME).is_file():
        report = _read_json(folder / REPORT_FILE_NAME, "fidelity report")
    elif report is None and transfer_info is not None:
        report, report_file = transfer_info["fidelity_after"], f"`{TRANSFER_FILE_NAME}` (`fidelity_after`)"
    elif report is not None and not isinstance(report, dict):
        report = report.to_dict()
    if report is not None:
        missing = [key for key in ("layers", "final_hidden_state_cosine", "inputs") if key not in report]
        if missing:
            raise ModelCardError(f"the fidelity report lacks {', '.join(missing)}: not a conversion_report.json")
        source = report.get("source")
        # A local path says nothing to a reader of the Hub page (and may expose a home folder): keep Hub ids only.
        report = {**report, "source": source if source and _looks_like_hub_id(source) else None}
    if results is None:
        results = _recipe_results(folder)
    if fine_tuned is None:
        fine_tuned = (any((folder / name).is_file() for name in TRAINING_FILES) or _is_recipe_run(folder)
                      or bool(linearize_info and linearize_info["lora_done"]))

    if base_model is None:
        for candidate in ((report or {}).get("source"), geometry["name_or_path"]):
            if candidate and _looks_like_hub_id(candidate):
                base_model = candidate
                break
    base_model_list = [base_model] if isinstance(base_model, str) else list(base_model or [])
    for name in base_model_list:
        if not _looks_like_hub_id(name) and not _HUB_ID.match(name or ""):
            raise ModelCardError(f"base_model {name!r} is not a Hub model id (namespace/name)")

    eval_results = normalize_results(results, default_task=pipeline_tag)
    recovery_rows = normalize_recovery(recovery)
    if datasets is None and eval_results:
        datasets = sorted({result.dataset_type for result in eval_results})
    dataset_list = [datasets] if isinstance(datasets, str) else list(datasets or [])

    if model_name is None:
        model_name = repo_id.split("/")[-1] if repo_id else folder.resolve().name
    tag_list = card_tags(settings, kinds, transfer_info is not None, linearize_info is not None)
    card_data = ModelCardData(
        base_model=base_model if base_model_list else None,
        datasets=dataset_list or None,
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        tags=list(dict.fromkeys([*tag_list, geometry["source_model_type"], *(tags or [])])),
        license=license,
        language=language,
        eval_results=eval_results or None,
        model_name=model_name if eval_results else None,
    )

    try:
        code_files = sorted(_check_code(folder, config.get("auto_map") or {}, "config.json", [], []))
    except OSError:
        code_files = []
    is_causal = architecture == "PerformerForCausalLM" or any(
        "CausalLM" in name or "LMHead" in name for name in geometry["source_architectures"]
    )
    dtype_bytes = _DTYPE_BYTES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), 4)
    described = describe_map(feature_map, kinds, settings, distilled=transfer_info is not None)
    if "linear" not in kinds and "window" not in kinds or not described["is_favor"]:
        usage_example = usage_example.replace("  # constant-memory FAVOR+ state", "")
    paper, citations = _citations(feature_map, kinds, distilled=transfer_info is not None)
    meanings = setting_meanings(settings, geometry["head_dim"])
    clustered = settings.get("attention", "linear") != "linear"
    shown = [key for key in settings if (not clustered or key in meanings)
             and (uses_feature_map(kinds) or key not in MAP_ONLY_SETTINGS)]
    order = list(meanings) + [key for key in SETTING_MEANINGS if key not in meanings]
    columns, behaviours = behaviour_rows(kinds or ["linear"], is_causal, settings)
    context = {
        "model_name": model_name,
        "repo_id": repo_id or model_name,
        "base_model_list": base_model_list,
        "architecture": architecture,
        "auto_class": auto_class,
        "usage_example": usage_example,
        "pipeline_tag": pipeline_tag,
        "code_files": code_files or ["modeling_performer.py"],
        **described,
        **attention,
        "paper": paper,
        "citations": citations,
        "behaviour_columns": columns,
        "behaviour_rows": behaviours,
        "settings_rows": [
            {"name": key, "value": _format_setting(settings[key]), "meaning": meanings.get(key, "")}
            for key in sorted(shown, key=lambda k: (order.index(k) if k in order else 99, k))
        ],
        "unused_settings": [key for key in settings if key not in shown],
        **geometry,
        # The record's fidelity_after (local source path included) is read through `fidelity` only.
        "transfer": {k: v for k, v in transfer_info.items() if k != "fidelity_after"} if transfer_info else None,
        "linearize": linearize_info,
        "cache_budget": budget_info,
        "serving": serving_info,
        "fidelity": report,
        "fidelity_tails": any((layer.get("tail_positions") is not None) for layer in (report or {}).get("layers", [])),
        "fidelity_file": report_file,
        "results": eval_results,
        "recovery": recovery_rows,
        "is_causal": is_causal,
        "fine_tuned": fine_tuned,
        "status_warning": status_warning(kinds=kinds, settings=settings, is_causal=is_causal, fine_tuned=fine_tuned,
                                         transfer=transfer_info, linearize=linearize_info, report=report),
        **speed_context(kinds, settings, geometry, is_causal, dtype_bytes),
    }
    template = Path(template_path) if template_path is not None else default_template_path()
    try:
        card = ModelCard.from_template(card_data, template_path=str(template), **context)
    except Exception as error:  # jinja2 errors (undefined values, syntax) carry no common base class here
        raise ModelCardError(f"cannot render the model card template {template}: {error}") from error
    validate_model_card(card, expected_results=eval_results)
    return card


def validate_model_card(card: ModelCard | str, expected_results: list[EvalResult] | None = None) -> dict:
    """Validate a card offline with huggingface_hub's own parsing; returns its metadata as a dict.

    The card's text is parsed again as a ``ModelCard`` (YAML block, ``ModelCardData``, ``model-index`` parsed
    by ``model_index_to_eval_results``); ``model-index`` must survive a round trip
    (``model_index_to_eval_results`` then ``eval_results_to_model_index`` gives the same structure) and hold
    ``expected_results`` if given. Also checked: ``library_name: transformers``, a ``pipeline_tag``, the
    :data:`REQUIRED_CARD_TAGS` and a feature-map tag (``favor+``, ``hedgehog``, ...), ``base_model`` / ``datasets``
    as Hub ids.

    Raises:
        ModelCardError: with what is wrong.
    """
    from ..feature_maps import FEATURE_MAPS

    text = str(card)
    try:
        parsed = ModelCard(text)
    except Exception as error:  # yaml errors and ValueError from ModelCardData
        raise ModelCardError(f"the card's metadata does not parse: {error}") from error
    if not text.startswith("---\n"):
        raise ModelCardError("the card does not start with a YAML metadata block")
    data = parsed.data.to_dict()
    if data.get("library_name") != "transformers":
        raise ModelCardError(f"library_name must be 'transformers', got {data.get('library_name')!r}")
    if not data.get("pipeline_tag"):
        raise ModelCardError("the card has no pipeline_tag")
    found_tags = data.get("tags") or []
    missing_tags = [tag for tag in REQUIRED_CARD_TAGS if tag not in found_tags]
    if missing_tags:
        raise ModelCardError(f"the card lacks the tags {missing_tags}")
    kind_tags = {*ATTENTION_TAGS.values(), ALL_SOFTMAX_TAG}
    if not any(tag in FEATURE_MAPS or tag in kind_tags for tag in found_tags):
        raise ModelCardError(f"the card has no feature-map tag (one of {', '.join(sorted(FEATURE_MAPS))}) or "
                             f"attention-kind tag ({', '.join(sorted(kind_tags))})")
    for key in ("base_model", "datasets"):
        value = data.get(key)
        values = [value] if isinstance(value, str) else (value or [])
        if not isinstance(values, list) or not all(isinstance(v, str) and _HUB_ID.match(v) for v in values):
            raise ModelCardError(f"{key} must be Hub ids (namespace/name), got {value!r}")
    model_index = data.get("model-index")
    if model_index is not None:
        try:
            name, results = model_index_to_eval_results(model_index)
        except (KeyError, TypeError, ValueError) as error:
            raise ModelCardError(f"model-index does not parse: {error}") from error
        if eval_results_to_model_index(name, results) != model_index:
            raise ModelCardError("model-index does not survive a round trip through huggingface_hub")
        if expected_results is not None and sorted(map(repr, results)) != sorted(map(repr, expected_results)):
            raise ModelCardError("model-index does not hold the given results")
    elif expected_results:
        raise ModelCardError("results were given but the card has no model-index")
    return data


def write_model_card(folder: str | os.PathLike, **kwargs) -> Path:
    """Build the card (:func:`build_model_card`, same keyword arguments) and write it as ``folder/README.md``
    (replacing an existing one). Returns the path."""
    card = build_model_card(folder, **kwargs)
    path = Path(folder) / CARD_FILE_NAME
    card.save(path)
    return path


def write_recipe_card(output_dir: str | os.PathLike) -> Path | None:
    """Write the model card of a fine-tuning recipe's output folder (called by :func:`hf_performer.recipes.train.train`
    at the end of a run): fine-tuned, with the results of its ``metrics.json`` (:func:`recipe_results`; none for a
    run trained with ``--no-evaluation``).

    Returns the card's path, or ``None`` when the folder holds no Performer model (a softmax baseline,
    ``--no-save-model``) or the card could not be built (a warning on stderr says why and how to write it).
    """
    folder = Path(output_dir)
    try:
        config = _read_json(folder / "config.json", "config")
    except ModelCardError:
        return None
    if not isinstance(config.get("favor_settings"), dict):
        return None
    try:
        return write_model_card(folder, fine_tuned=True)
    except ModelCardError as error:
        print(f"warning: no model card written ({error}); write it with `hf-performer card {folder}`", file=sys.stderr)
        return None
