"""Evaluation results for the model card: normalising results and recovery rows, reading metrics files.

:func:`normalize_results` turns result dicts into ``huggingface_hub.EvalResult`` objects (``model-index``),
:func:`normalize_recovery` checks the recovery rows of the card's body, :func:`load_metrics` reads a metrics
file (several layouts, among them a fine-tuning recipe's ``metrics.json``, read by :func:`recipe_results`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from huggingface_hub import EvalResult

from ..tasks.data import LM_DATASETS, TASKS, DataError, get_task
from .folder import ModelCardError

LM_HUB_DATASET_IDS = {"wikitext": "Salesforce/wikitext"}
"""Canonical Hub repositories of the causal-LM datasets of :data:`~hf_performer.tasks.data.LM_DATASETS`."""

_RESULT_ALIASES = {
    "task": "task_type",
    "dataset": "dataset_type",
    "config": "dataset_config",
    "split": "dataset_split",
    "metric": "metric_type",
    "value": "metric_value",
}
_RESULT_FIELDS = (
    "task_type", "task_name", "dataset_type", "dataset_name", "dataset_config", "dataset_split",
    "dataset_revision", "dataset_args", "metric_type", "metric_name", "metric_value", "metric_config",
    "metric_args", "source_name", "source_url",
)
_RECOVERY_FIELDS = ("setting", "task", "dataset", "metric", "value", "steps", "notes")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_metric_value(value, where: str):
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ModelCardError(f"{where}: the metric value must be a number or a string, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ModelCardError(f"{where}: the metric value is not finite ({value})")
    return value


def normalize_results(results, default_task: str | None = None) -> list[EvalResult]:
    """Evaluation results as ``huggingface_hub.EvalResult`` objects (what ``model-index`` is built from).

    Each result is an ``EvalResult`` or a dict with ``EvalResult``'s fields or their short names:
    ``task`` (``task_type``), ``dataset`` (``dataset_type``), ``config`` (``dataset_config``), ``split``
    (``dataset_split``), ``metric`` (``metric_type``), ``value`` (``metric_value``), plus optional
    ``task_name``, ``dataset_name``, ``metric_name``, ... A GLUE task name as ``task`` (``"sst2"``) means
    task ``text-classification`` on dataset ``nyu-mll/glue`` with that config; ``"imdb"`` means
    ``stanfordnlp/imdb``. A missing ``task`` defaults to ``default_task`` (the card's pipeline tag) and a
    missing ``dataset_name`` to the dataset id (and config). Unknown keys are an error.
    """
    if results is None:
        return []
    if isinstance(results, (EvalResult, dict)):
        results = [results]
    normalized = []
    for index, result in enumerate(results):
        where = f"result {index}"
        if isinstance(result, EvalResult):
            normalized.append(result)
            continue
        if not isinstance(result, dict):
            raise ModelCardError(f"{where}: expected a dict or an EvalResult, got {type(result).__name__}")
        values = {}
        for key, value in result.items():
            name = _RESULT_ALIASES.get(key, key)
            if name not in _RESULT_FIELDS:
                raise ModelCardError(
                    f"{where}: unknown key {key!r}; accepted: {', '.join(_RESULT_FIELDS)} and the short names "
                    f"{', '.join(f'{k} ({v})' for k, v in _RESULT_ALIASES.items())}"
                )
            if name in values:
                raise ModelCardError(f"{where}: {name!r} given twice (as {key!r} and under another name)")
            values[name] = value
        task = values.get("task_type")
        spec = TASKS.get(task.lower()) if isinstance(task, str) else None
        if spec is not None:  # a task of the recipes (GLUE, IMDB): its Hub dataset and name
            values.setdefault("task_name", spec.display_name)
            values.setdefault("dataset_type", spec.hub_dataset_id)
            if spec.hub_config is not None:
                values.setdefault("dataset_config", spec.hub_config)
            values["task_type"] = "text-classification"
        if values.get("task_type") is None:
            values["task_type"] = default_task
        for required in ("task_type", "dataset_type", "metric_type", "metric_value"):
            if values.get(required) is None:
                raise ModelCardError(f"{where}: {required} is required (got keys {sorted(result)})")
        values["metric_value"] = _check_metric_value(values["metric_value"], where)
        if values.get("dataset_name") is None:
            config = values.get("dataset_config")
            values["dataset_name"] = values["dataset_type"] + (f" ({config})" if config else "")
        try:
            normalized.append(EvalResult(**values))
        except (TypeError, ValueError) as error:
            raise ModelCardError(f"{where}: {error}") from None
    return normalized


def normalize_recovery(rows) -> list[dict]:
    """Recovery rows for the card's body (not ``model-index``): dicts with ``setting`` (or ``variant``), ``task``,
    ``dataset``, ``metric``, ``value`` and optional ``steps`` and ``notes``."""
    if rows is None:
        return []
    if isinstance(rows, dict):
        rows = [rows]
    normalized = []
    for index, row in enumerate(rows):
        where = f"recovery row {index}"
        if not isinstance(row, dict):
            raise ModelCardError(f"{where}: expected a dict, got {type(row).__name__}")
        row = dict(row)
        if "variant" in row:
            if "setting" in row:
                raise ModelCardError(f"{where}: give 'setting' or 'variant', not both")
            row["setting"] = row.pop("variant")
        unknown = sorted(set(row) - set(_RECOVERY_FIELDS))
        if unknown:
            raise ModelCardError(f"{where}: unknown keys {unknown}; accepted: {', '.join(_RECOVERY_FIELDS)} (and variant)")
        missing = [key for key in ("setting", "task", "dataset", "metric", "value") if row.get(key) is None]
        if missing:
            raise ModelCardError(f"{where}: missing {', '.join(missing)}")
        value = _check_metric_value(row["value"], where)
        row["value"] = f"{value:.4g}" if isinstance(value, float) else value
        normalized.append({key: row.get(key) for key in _RECOVERY_FIELDS})
    return normalized


def load_metrics(path: str | os.PathLike) -> tuple[list[dict], list[dict]]:
    """Read a metrics JSON file; returns ``(results, recovery)`` (lists of dicts, see :func:`normalize_results`).

    Accepted layouts:

    * a list of result dicts;
    * ``{"results": [...], "recovery": [...]}`` (either key may be absent);
    * one result dict (``{"task": "sst2", "metric": "accuracy", "value": 0.91, ...}``);
    * a run summary ``{"task": ..., "dataset": ..., "split": ..., "metrics": {"accuracy": 0.91, ...}}``: one
      result per numeric metric (a leading ``eval_`` is removed from metric names); other top-level keys of
      the summary (run settings, timings) are not results and are not read;
    * the ``metrics.json`` of a fine-tuning recipe (``{"kind": "text-classification", "task": "sst2", "final":
      {"accuracy": 0.91, "eval_loss": 0.3}, ...}``): one result per final metric but the loss, on the task's
      evaluation split (causal LM: perplexity on the validation split of ``args.dataset``); see
      :func:`recipe_results`.
    """
    from ..recipes.arguments import KINDS as RECIPE_KINDS  # read lazily: `push --help` imports no recipe code

    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise ModelCardError(f"metrics file not found: {path}") from None
    except json.JSONDecodeError as error:
        raise ModelCardError(f"{path}: not valid JSON ({error})") from None
    if isinstance(data, list):
        return data, []
    if not isinstance(data, dict):
        raise ModelCardError(f"{path}: expected a JSON object or list, got {type(data).__name__}")
    if "results" in data or "recovery" in data:
        extra = sorted(set(data) - {"results", "recovery"})
        if extra:
            raise ModelCardError(f"{path}: unknown top-level keys {extra} next to results/recovery")
        results, recovery = data.get("results") or [], data.get("recovery") or []
        if not isinstance(results, list) or not isinstance(recovery, list):
            raise ModelCardError(f"{path}: 'results' and 'recovery' must be lists")
        return results, recovery
    if data.get("kind") in RECIPE_KINDS and "final" in data:
        return recipe_results(data, str(path)), []
    if isinstance(data.get("metrics"), dict):
        base = {}
        for key in ("task", "task_name", "dataset", "dataset_name", "config", "split", "dataset_config",
                    "dataset_split"):
            if data.get(key) is not None:
                base[key] = data[key]
        results = []
        for name, value in data["metrics"].items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric = name[len("eval_"):] if name.startswith("eval_") else name
            results.append({**base, "metric": metric, "value": value})
        if not results:
            raise ModelCardError(f"{path}: 'metrics' holds no numeric value")
        return results, []
    return [data], []


def recipe_results(metrics: dict, where: str | None = None) -> list[dict]:
    """The results (dicts for :func:`normalize_results`) of a recipe's ``metrics.json`` (:mod:`hf_performer.recipes.train`).

    Text classification: one result per finite metric of ``final`` but ``eval_loss``, on the task's evaluation split
    (``validation``; MNLI ``validation_matched``; IMDB ``test``), the task naming its Hub dataset. Causal LM: the
    perplexity on the ``validation`` split of ``args.dataset`` (``wikitext``: ``Salesforce/wikitext``).

    Raises:
        ModelCardError: ``final`` is not an object of numbers, an unknown task, or a causal-LM run evaluated on a
            local text file (which names no Hub dataset: give its result in a results file).
    """
    if where is None:
        from ..recipes.results import METRICS_FILE as where
    final = metrics.get("final")
    if not isinstance(final, dict):
        raise ModelCardError(f"{where}: 'final' must be an object of metrics (a recipe's metrics.json), got {final!r}")
    if not any(name != "eval_loss" and _is_number(value) and math.isfinite(value) for name, value in final.items()):
        raise ModelCardError(f"{where}: 'final' holds no metric but the loss")
    if metrics.get("kind") == "causal-lm":
        run_args = metrics.get("args") or {}
        if run_args.get("validation_file"):
            raise ModelCardError(
                f"{where}: the run evaluated on a local text file, which names no Hub dataset; give its result in a "
                'results file: [{"task": "text-generation", "dataset": "namespace/name", "split": "validation", '
                '"metric": "perplexity", "value": ...}]'
            )
        dataset = run_args.get("dataset") or "wikitext"
        hub_args = LM_DATASETS.get(dataset, (dataset,))
        base = {
            "task": "text-generation",
            "dataset": LM_HUB_DATASET_IDS.get(hub_args[0], hub_args[0]),
            "config": run_args.get("dataset_config") or (hub_args[1] if len(hub_args) > 1 else None),
            "split": "validation",
        }
        base = {key: value for key, value in base.items() if value is not None}
    else:
        try:
            spec = get_task(str(metrics.get("task")))
        except DataError as error:
            raise ModelCardError(f"{where}: {error}") from None
        base = {"task": spec.name, "split": spec.validation_split}
    return [
        {**base, "metric": name, "value": value}
        for name, value in final.items()
        if name != "eval_loss" and _is_number(value) and math.isfinite(value)
    ]


def _is_recipe_run(folder: Path) -> bool:
    """Whether ``folder`` is the output of a fine-tuning recipe that trained (``metrics.json`` with steps)."""
    from ..recipes.arguments import KINDS as RECIPE_KINDS
    from ..recipes.results import METRICS_FILE as METRICS_FILE_NAME

    try:
        metrics = json.loads((folder / METRICS_FILE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(metrics, dict) and metrics.get("kind") in RECIPE_KINDS and bool(metrics.get("completed_steps"))

