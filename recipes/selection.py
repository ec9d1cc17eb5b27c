"""Held-out model selection and early stopping of the recipes (``--early-stopping-split``,
``--metric-for-best-model``, ``--load-best-model-at-end``, ``--early-stopping-patience``), and the checks that keep
it honest: the default metric is the task's main metric (MRPC / QQP: F1), and the held-out split may not be carved
from data the starting model's own records say it was trained on (:func:`check_selection_options`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

import torch

from ..tasks.data import get_task
from .arguments import RecipeError
from .results import METRICS_FILE


def carve_early_stopping_split(dataset, fraction: float, seed: int):
    """Split ``dataset`` (the training examples) into ``(train, held_out)``: ``round(fraction * n)`` examples
    drawn with ``numpy.random.default_rng(seed)`` are held out, both parts keep the dataset's order.

    Raises:
        RecipeError: a fraction that leaves either part empty.
    """
    import numpy as np

    total = len(dataset)
    held_out = round(fraction * total)
    if not 1 <= held_out < total:
        raise RecipeError(f"--early-stopping-split {fraction} of {total} training examples holds out {held_out}: "
                          "both the held-out and the training part need at least one example")
    order = np.random.default_rng(seed).permutation(total)
    return dataset.select(np.sort(order[held_out:]).tolist()), dataset.select(np.sort(order[:held_out]).tolist())


class BestStepSelection:
    """The best evaluation step on the held-out split (``--metric-for-best-model``), the evaluations since it
    improved (early stopping), and, when ``keep_weights``, a CPU copy of the weights of that step."""

    def __init__(self, metric: str, patience: int | None, keep_weights: bool):
        self.metric = metric
        self.greater_is_better = metric not in ("eval_loss", "perplexity")
        self.patience = patience
        self.keep_weights = keep_weights
        self.best_step: int | None = None
        self.best_value: float | None = None
        self.evaluations_without_improvement = 0
        self.best_weights: dict[str, torch.Tensor] | None = None

    def update(self, step: int, value: float, model_weights: Callable[[], dict]) -> bool:
        """Record the held-out ``value`` of ``step``; ``model_weights()`` is called only on improvement."""
        improved = not math.isnan(value) and (
            self.best_value is None
            or (value > self.best_value if self.greater_is_better else value < self.best_value))
        if improved:
            self.best_step, self.best_value, self.evaluations_without_improvement = step, value, 0
            if self.keep_weights:
                self.best_weights = model_weights()
        else:
            self.evaluations_without_improvement += 1
        return improved

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.evaluations_without_improvement >= self.patience

    def state(self) -> dict:
        return {"best_step": self.best_step, "best_value": self.best_value,
                "evaluations_without_improvement": self.evaluations_without_improvement}

    def load_state(self, state: dict, best_weights: dict | None) -> None:
        self.best_step, self.best_value = state["best_step"], state["best_value"]
        self.evaluations_without_improvement = state["evaluations_without_improvement"]
        self.best_weights = best_weights


def selection_metrics(args) -> tuple[str, ...]:
    """The metrics ``--metric-for-best-model`` accepts for the recipe's task, the default (the task's main metric:
    MRPC and QQP F1, STS-B Pearson, CoLA Matthews correlation; perplexity for causal LMs) first."""
    if args.kind == "causal-lm":
        return ("perplexity", "eval_loss")
    spec = get_task(args.task)
    return tuple(dict.fromkeys((spec.main_metric, *spec.metrics, "eval_loss")))


def check_selection_options(args) -> None:
    selects = args.load_best_model_at_end or args.early_stopping_patience is not None
    if args.no_evaluation:
        given = [flag for flag, value in (("--eval-steps", args.eval_steps),
                                          ("--early-stopping-split", args.early_stopping_split),
                                          ("--metric-for-best-model", args.metric_for_best_model)) if value is not None]
        given += ["--load-best-model-at-end"] if args.load_best_model_at_end else []
        if given:
            raise RecipeError(f"--no-evaluation trains without evaluating: it takes no {', '.join(given)}")
    if args.early_stopping_split is not None and not 0 < args.early_stopping_split < 1:
        raise RecipeError(f"--early-stopping-split must be in (0, 1) (a fraction of the training examples), "
                          f"got {args.early_stopping_split}")
    if (selects or args.metric_for_best_model is not None) and args.early_stopping_split is None:
        raise RecipeError("--load-best-model-at-end, --early-stopping-patience and --metric-for-best-model select on "
                          "a split carved from the training data, never on the reported validation split: pass "
                          "--early-stopping-split FRACTION (e.g. 0.1)")
    if selects and not args.eval_steps:
        raise RecipeError("--load-best-model-at-end and --early-stopping-patience choose among evaluations: pass "
                          "--eval-steps N")
    if args.early_stopping_patience is not None and args.early_stopping_patience < 1:
        raise RecipeError(f"--early-stopping-patience must be >= 1, got {args.early_stopping_patience}")
    accepted = selection_metrics(args)
    if args.metric_for_best_model is not None and args.metric_for_best_model not in accepted:
        raise RecipeError(f"--metric-for-best-model {args.metric_for_best_model!r} is not a metric of this task; "
                          f"accepted: {', '.join(accepted)}")
    if args.early_stopping_split is not None:
        _check_heldout_is_unseen(args)


def training_data_fingerprint(args) -> str | None:
    """The content fingerprint of ``--train-file`` (:func:`hf_performer.tasks.data.file_fingerprint`), ``None`` for
    a Hub dataset; recorded in ``metrics.json`` and in every checkpoint."""
    from ..tasks.data import file_fingerprint

    if not args.train_file:
        return None
    try:
        return file_fingerprint(args.train_file)
    except OSError as error:
        raise RecipeError(f"--train-file {args.train_file}: {error.strerror}") from None


def _check_heldout_is_unseen(args) -> None:
    """Refuse an early-stopping split carved from data the starting model (``--model``) was already trained on, as
    its records say (a recipe's ``metrics.json``, ``hf-performer distill``'s ``attention_transfer.json``; followed one
    step back to the model it came from when that folder sits beside it): its held-out metric would be optimistic and
    the best step chosen on it meaningless."""
    fingerprint = training_data_fingerprint(args)
    if fingerprint is None:
        return
    name = os.path.basename(args.train_file)
    for record_file, record in _starting_model_records(args.model):
        seen = record.get("train_data_fingerprint")
        trained_on = (record.get("args") or {}).get("train_file") or (record.get("data") or {}).get("file")
        if seen == fingerprint or (seen is None and trained_on == name):
            how = "the same contents" if seen == fingerprint else "a file of the same name (no fingerprint recorded)"
            raise RecipeError(
                f"--early-stopping-split carves its held-out examples from {name}, but the starting model was "
                f"trained on {how} ({record_file}): its held-out metric would be optimistic and the step chosen on it "
                "meaningless; give a --train-file the model has not seen, or drop --early-stopping-split")


def _starting_model_records(model: str) -> list[tuple[str, dict]]:
    """``[(where, record)]``: the training records in the folder ``model`` and, through their ``source``, in the
    folder of the model it came from when it sits beside it."""
    from ..conversion.attention_transfer import TRANSFER_FILE_NAME

    records, folder, visited = [], os.path.abspath(model), set()
    while os.path.isdir(folder) and folder not in visited:
        visited.add(folder)
        source = None
        for name in (METRICS_FILE, TRANSFER_FILE_NAME):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as handle:
                    record = json.load(handle)
            except (OSError, ValueError):
                continue
            if isinstance(record, dict):
                records.append((f"{os.path.basename(folder)}/{name}", record))
                source = source or (record.get("model") or {}).get("source") or record.get("source")
        if not isinstance(source, str) or not source:
            break
        folder = os.path.join(os.path.dirname(folder), os.path.basename(source))
    return records


def keep_model(accelerator, model, args, selection: BestStepSelection | None, curve: list[dict],
                completed_steps: int, stopped_at: int | None) -> tuple[dict, str]:
    """The kept model: the last step, or with ``--load-best-model-at-end`` the best held-out step (whose weights
    are loaded back into ``model``).

    Returns:
        ``(kept_point, kept_reason)``: the kept step's point of the curve and why it was kept.
    """
    kept_point = curve[-1] if curve else {"step": completed_steps}  # --no-evaluation: no point was evaluated
    if stopped_at is not None:
        kept_reason = (f"last step: early stopping after {selection.patience} evaluations without improvement of "
                       f"the held-out {selection.metric} (best {selection.best_value:.4f} at step "
                       f"{selection.best_step})")
    else:
        kept_reason = "last step"
    if args.load_best_model_at_end and selection.best_step is not None:
        kept_point = next(point for point in curve if point["step"] == selection.best_step)
        if selection.best_step != completed_steps:
            accelerator.unwrap_model(model).load_state_dict(selection.best_weights)
        evaluated = ", ".join(str(point["step"]) for point in curve)
        kept_reason = (f"--load-best-model-at-end: best held-out {selection.metric} ({selection.best_value:.4f}) at "
                       f"step {selection.best_step} among the evaluations at steps {evaluated} on the early-stopping "
                       f"split" + (f" (stopped early at step {stopped_at})" if stopped_at is not None else ""))
    return kept_point, kept_reason


def early_stopping_record(args, selection: BestStepSelection | None, heldout_set, kept_point: dict,
                           stopped_at: int | None) -> dict | None:
    """``metrics.json``'s ``early_stopping``: the held-out split, the selection and the kept step's held-out
    metrics (``None`` without ``--early-stopping-split``)."""
    early_stopping = None
    if selection is not None:
        early_stopping = {
            "split_fraction": args.early_stopping_split,
            "split_examples": len(heldout_set),
            "seed": args.seed,
            "metric": selection.metric,
            "greater_is_better": selection.greater_is_better,
            "patience": selection.patience,
            "load_best_model_at_end": bool(args.load_best_model_at_end),
            "best_step": selection.best_step,
            "best_value": selection.best_value,
            "stopped_at_step": stopped_at,
            "kept_heldout": {k[len("heldout_"):]: v for k, v in kept_point.items() if k.startswith("heldout_")},
        }
    return early_stopping
