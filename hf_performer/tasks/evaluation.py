"""Evaluation: task metrics and perplexity (the ``hf-performer evaluate`` verb: :mod:`hf_performer.cli.evaluate`).

Task metrics
    :func:`compute_task_metrics` returns each task's GLUE metrics (CoLA: Matthews correlation; MRPC / QQP:
    accuracy and F1 of the positive class; STS-B: Pearson and Spearman correlation; the others and IMDB:
    accuracy). With ``backend="auto"`` it uses ``evaluate.load("glue", task)`` (``evaluate.load("accuracy")``
    for IMDB) when that loads (it needs the Hugging Face Hub), else the same formulas computed locally with
    scikit-learn (``accuracy_score``, ``f1_score``, ``matthews_corrcoef``) and scipy (``pearsonr``,
    ``spearmanr``): the functions ``evaluate``'s GLUE metric itself calls. The backend used is reported
    (``"evaluate"`` or ``"local"``) next to the numbers.

Perplexity (:func:`perplexity`), a fixed protocol
    The text is tokenised as one sequence of ``N`` tokens (no special tokens added). Windows of at most
    ``context_length`` tokens start every ``stride`` tokens (``0, stride, 2*stride, ...``) until one reaches the
    end: the sliding-window protocol of the transformers perplexity guide. Each window scores only the tokens
    no earlier window scored (the first scores all of its tokens but the first one, which has no context), so
    every token ``1..N-1`` is scored exactly once; a token scored by a later window sees at least
    ``context_length - stride`` tokens of left context (and at most ``context_length - 1``). The result is
    token-weighted: ``exp(sum of token NLLs / (N - 1))``. The summed NLLs are computed from the logits
    (no per-window average rescaled by a token count). ``stride`` must be smaller than ``context_length`` (a
    window starting where the previous one ended would have no context for its first token, which would then
    go unscored); ``stride = context_length - 1`` is the cheapest setting, ``stride = 1`` the most faithful.

Perplexity by position inside the window (``position_ranges``)
    How well a token is predicted depends on how much context it has: with ``position_ranges=[(0, 512), (512,
    1024)]`` the same forward passes also give the perplexity of the tokens at window positions ``0..511`` and
    ``512..1023`` (a token's position is its index inside its window; position 0 has no context and is never
    predicted). These counts use *every* predicted token of *every* window, not only the tokens the protocol
    scores: a token inside two windows counts once in each, at its position in each (``num_predictions``).
    With ``stride = context_length / 2``, positions ``>= stride`` are the tokens the protocol scores after the
    first window; positions ``< stride`` are the same text seen with less context. This answers "does a model
    use context far beyond a sliding window" (e.g. window 64: positions >= 512 are served by the linear tail).
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .data import LM_DATASETS, TaskSpec, get_task

if TYPE_CHECKING:
    import torch


METRIC_BACKENDS = ("auto", "evaluate", "local")

_EVALUATE_CACHE: dict[str, object] = {}


class EvaluationError(ValueError):
    """Evaluation asked for something inconsistent (a model whose labels do not match the task, ...)."""


# --------------------------------------------------------------------------------------------
# Task metrics
# --------------------------------------------------------------------------------------------


def _local_metrics(spec: TaskSpec, predictions: np.ndarray, references: np.ndarray) -> dict[str, float]:
    try:
        from scipy.stats import pearsonr, spearmanr
        from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef
    except ImportError as error:
        raise EvaluationError(
            f"the local metrics need scikit-learn and scipy ({error}); `pip install scikit-learn scipy`, or use "
            "--metrics-backend evaluate where the Hub is reachable"
        ) from None

    results: dict[str, float] = {}
    for name in spec.metrics:
        if name == "accuracy":
            results[name] = float(accuracy_score(references, predictions))
        elif name == "f1":
            results[name] = float(f1_score(references, predictions))
        elif name == "matthews_correlation":
            results[name] = float(matthews_corrcoef(references, predictions))
        elif name in ("pearson", "spearmanr"):
            function = pearsonr if name == "pearson" else spearmanr
            results[name] = float(function(predictions, references)[0])
        else:  # pragma: no cover - the registry only names the metrics above
            raise EvaluationError(f"no local implementation of metric {name!r}")
    return results


def _load_evaluate_metric(spec: TaskSpec):
    """``evaluate.load`` for the task (cached per process, failures included); the exception if it fails."""
    key = spec.name
    if key not in _EVALUATE_CACHE:
        try:
            import evaluate

            _EVALUATE_CACHE[key] = (
                evaluate.load("glue", spec.name) if spec.hub[0] == "glue" else evaluate.load("accuracy")
            )
        except Exception as error:  # noqa: BLE001 - offline, missing scripts, ...: all mean "not available"
            _EVALUATE_CACHE[key] = error
    return _EVALUATE_CACHE[key]


def compute_task_metrics(task: str | TaskSpec, predictions: Sequence, references: Sequence,
                         backend: str = "auto") -> tuple[dict[str, float], str, str | None]:
    """The task's metrics.

    Args:
        task: task name or spec (see :data:`hf_performer.tasks.data.TASKS`).
        predictions: ``[n]`` class ids (float scores for STS-B).
        references: ``[n]`` labels.
        backend: ``"evaluate"`` (``evaluate.load``; raises if unavailable), ``"local"`` (scikit-learn / scipy) or
            ``"auto"`` (``evaluate`` if it loads, else local).

    Returns:
        ``(metrics, backend_used, note)``: metrics by name (floats), ``"evaluate"`` or ``"local"``, and why the
        local fallback was used (``None`` otherwise).
    """
    spec = task if isinstance(task, TaskSpec) else get_task(task)
    if backend not in METRIC_BACKENDS:
        raise EvaluationError(f"unknown metrics backend {backend!r}; accepted: {', '.join(METRIC_BACKENDS)}")
    predictions = np.asarray(predictions)
    references = np.asarray(references)
    if predictions.shape != references.shape or predictions.ndim != 1:
        raise EvaluationError(f"predictions {predictions.shape} and references {references.shape} must be [n]")
    note = None
    if backend in ("auto", "evaluate"):
        metric = _load_evaluate_metric(spec)
        if not isinstance(metric, Exception):
            results = metric.compute(predictions=predictions.tolist(), references=references.tolist())
            return {name: float(results[name]) for name in spec.metrics}, "evaluate", None
        if backend == "evaluate":
            raise EvaluationError(f"evaluate.load failed for {spec.name}: {metric}") from metric
        loaded = f"'glue', {spec.name!r}" if spec.hub[0] == "glue" else repr("accuracy")
        note = (f"metrics computed locally with scikit-learn / scipy (the same formulas): evaluate.load({loaded}) is "
                f"not available here ({type(metric).__name__}); --metrics-backend local skips the attempt")
    return _local_metrics(spec, predictions, references), "local", note


# --------------------------------------------------------------------------------------------
# Classification evaluation
# --------------------------------------------------------------------------------------------


def check_model_matches_task(model, spec: TaskSpec) -> None:
    """Raise :class:`EvaluationError` when the model's head cannot produce the task's labels."""
    num_labels = getattr(model.config, "num_labels", None)
    if num_labels != spec.num_labels:
        raise EvaluationError(
            f"the model has {num_labels} output labels but task {spec.name} needs {spec.num_labels}"
            + (" (STS-B is a regression: one output)" if spec.is_regression else "")
        )


def _no_grad(function):
    """``torch.no_grad()`` as a decorator that imports torch when ``function`` runs (``evaluate --help`` stays
    fast)."""
    @functools.wraps(function)
    def without_gradients(*args, **kwargs):
        import torch

        with torch.no_grad():
            return function(*args, **kwargs)

    return without_gradients


def _progress_bar(total: int | None, description: str, show: bool, accelerator=None):
    """A tqdm bar when ``show`` on a terminal (tqdm's ``disable=None``), on the local main process only."""
    from tqdm.auto import tqdm

    hidden = not show or (accelerator is not None and not accelerator.is_local_main_process)
    return tqdm(total=total, desc=description, disable=True if hidden else None)


@_no_grad
def predict_classification(model, dataloader, spec: TaskSpec, accelerator=None,
                           show_progress: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
    """Run ``model`` over a tokenised task dataloader (batches with ``labels``).

    Args:
        model: a sequence classification model (Performer or softmax).
        dataloader: batches from ``DataCollatorWithPadding`` (``input_ids`` ``[B, L]``, ``labels`` ``[B]``).
        spec: the task.
        accelerator: an ``accelerate.Accelerator`` when the dataloader is prepared (predictions are gathered
            across processes, duplicates dropped); ``None`` runs on the model's device.
        show_progress: a tqdm bar over batches (on a terminal only).

    Returns:
        ``(predictions [n], references [n], mean loss)``: argmax class ids, or float scores for regression.
    """
    import torch

    was_training = model.training
    model.eval()
    device = None if accelerator is not None else next(model.parameters()).device
    predictions, references, losses, counts = [], [], [], []
    total = len(dataloader) if hasattr(dataloader, "__len__") else None
    progress = _progress_bar(total, f"evaluating {spec.name}", show_progress, accelerator)
    for batch in dataloader:
        if device is not None:
            batch = {key: value.to(device) for key, value in batch.items()}
        logits = model(**batch).logits.float()
        labels = batch["labels"]
        # Per-example losses (the head's own loss: cross-entropy, or MSE for regression), so that the mean over
        # the gathered examples is exact even when the last batch is padded across processes.
        if spec.is_regression:
            batch_predictions = logits.squeeze(-1)
            example_loss = (batch_predictions - labels.float()) ** 2
        else:
            batch_predictions = logits.argmax(dim=-1)
            example_loss = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        if accelerator is not None:
            batch_predictions, labels, example_loss = accelerator.gather_for_metrics(
                (batch_predictions, labels, example_loss))
        predictions.append(batch_predictions.cpu())
        references.append(labels.cpu())
        losses.append(example_loss.double().sum().item())
        counts.append(int(labels.shape[0]))
        progress.update(1)
    progress.close()
    model.train(was_training)
    mean_loss = sum(losses) / max(sum(counts), 1)
    return torch.cat(predictions).numpy(), torch.cat(references).numpy(), mean_loss


# --------------------------------------------------------------------------------------------
# Perplexity
# --------------------------------------------------------------------------------------------


def perplexity_windows(num_tokens: int, context_length: int, stride: int) -> list[tuple[int, int, int]]:
    """The windows of the perplexity protocol (module docstring).

    Returns:
        ``[(begin, end, first_scored), ...]``: the window is ``ids[begin:end]`` and scores the tokens
        ``first_scored..end-1`` (each predicted from the tokens before it inside the window).
    """
    if context_length < 2:
        raise EvaluationError(f"context length must be >= 2, got {context_length}")
    if not 1 <= stride < context_length:
        raise EvaluationError(
            f"stride must be in 1..context length - 1 ({context_length - 1}), got {stride}: every window after the "
            "first needs at least one token of left context"
        )
    if num_tokens < 2:
        raise EvaluationError(f"perplexity needs at least 2 tokens, got {num_tokens}")
    windows, previous_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + context_length, num_tokens)
        windows.append((begin, end, max(previous_end, begin + 1)))
        previous_end = end
        if end == num_tokens:
            break
    return windows


def parse_position_ranges(ranges: Sequence[str | Sequence[int]], context_length: int) -> list[tuple[int, int]]:
    """Window position ranges ``"START:END"`` (or ``(start, end)`` pairs; END exclusive, ``"512:"`` means up to
    the context length) checked against the context length.

    Raises:
        EvaluationError: a malformed or empty range, or one outside ``0..context_length``.
    """
    parsed = []
    for item in ranges:
        if isinstance(item, str):
            start_text, separator, end_text = item.partition(":")
            try:
                if not separator:
                    raise ValueError
                start = int(start_text) if start_text.strip() else 0
                end = int(end_text) if end_text.strip() else context_length
            except ValueError:
                raise EvaluationError(f"position range {item!r} is not START:END (integers, e.g. 0:512 512:1024)")\
                    from None
        else:
            start, end = (int(value) for value in item)
        if not 0 <= start < end <= context_length:
            raise EvaluationError(f"position range {start}:{end} must satisfy 0 <= START < END <= context length "
                                  f"({context_length})")
        parsed.append((start, end))
    return parsed


@_no_grad
def perplexity(model, input_ids: Sequence[int] | torch.Tensor, context_length: int, stride: int,
               batch_size: int = 1, accelerator=None, show_progress: bool = False,
               position_ranges: Sequence[str | Sequence[int]] | None = None) -> dict:
    """Token-weighted perplexity of a causal LM on one token sequence (protocol: module docstring).

    Args:
        model: a causal LM (``logits`` ``[B, L, vocab]``), e.g. ``PerformerForCausalLM`` or ``GPT2LMHeadModel``.
        input_ids: ``[N]`` token ids of the whole text.
        context_length: tokens per window (at most the model's positions).
        stride: tokens between window starts (``< context_length``).
        batch_size: windows of equal length per forward pass.
        accelerator: with several processes, windows are shared out (each process runs the same number of
            forward passes; sums are reduced); ``None`` runs on the model's device.
        show_progress: a tqdm bar over windows (on a terminal only).
        position_ranges: window position ranges (``[(start, end), ...]`` or ``"START:END"`` strings, END
            exclusive) to report separately (module docstring: every predicted token of every window counts).

    Returns:
        ``{"perplexity", "nll" (mean per token), "num_tokens" (scored), "context_length", "stride", "windows"}``,
        plus ``"position_ranges": [{"start", "end", "perplexity", "nll", "num_predictions"}, ...]`` when asked.
    """
    import torch

    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    windows = perplexity_windows(ids.numel(), context_length, stride)
    ranges = parse_position_ranges(position_ranges or (), context_length)
    world = accelerator.num_processes if accelerator is not None else 1
    rank = accelerator.process_index if accelerator is not None else 0
    device = accelerator.device if accelerator is not None else next(model.parameters()).device
    # Each process takes every world-th window; padding entries (weight 0) keep forward counts equal (FSDP / ZeRO-3).
    per_process = math.ceil(len(windows) / world)
    mine = [(windows[i], 1.0) if i < len(windows) else (windows[0], 0.0)
            for i in (rank + k * world for k in range(per_process))]
    was_training = model.training
    model.eval()
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    range_sums = torch.zeros((len(ranges), 2), dtype=torch.float64, device=device)  # [ranges, (nll sum, count)]
    groups: list[list] = []
    for item in mine:  # group consecutive windows of the same length into batches
        length = item[0][1] - item[0][0]
        if groups and len(groups[-1]) < batch_size and groups[-1][0][0][1] - groups[-1][0][0][0] == length:
            groups[-1].append(item)
        else:
            groups.append([item])
    progress = _progress_bar(len(mine), "perplexity", show_progress, accelerator)
    for group in groups:
        batch = torch.stack([ids[begin:end] for (begin, end, _), _ in group]).to(device)
        logits = model(input_ids=batch, use_cache=False).logits.float()  # [B, L, vocab]
        log_probs = torch.log_softmax(logits[:, :-1], dim=-1)
        token_nll = -log_probs.gather(-1, batch[:, 1:, None]).squeeze(-1).double()  # [B, L-1]: NLL of token j+1
        for row, ((begin, _end, first), weight) in enumerate(group):
            scored = token_nll[row, first - begin - 1:]
            nll_sum += weight * scored.sum()
            count += weight * scored.numel()
            for index, (start, end) in enumerate(ranges):  # token_nll[:, j] is the token at window position j + 1
                in_range = token_nll[row, max(start, 1) - 1:max(end - 1, 0)]
                range_sums[index, 0] += weight * in_range.sum()
                range_sums[index, 1] += weight * in_range.numel()
        progress.update(len(group))
    progress.close()
    if accelerator is not None and world > 1:
        nll_sum, count = accelerator.reduce(torch.stack([nll_sum, count]), reduction="sum")
        if ranges:
            range_sums = accelerator.reduce(range_sums, reduction="sum")
    model.train(was_training)
    mean_nll = float(nll_sum / count)
    result = {"perplexity": math.exp(mean_nll), "nll": mean_nll, "num_tokens": int(count),
              "context_length": context_length, "stride": stride, "windows": len(windows)}
    if ranges:
        result["position_ranges"] = []
        for (start, end), (range_nll, predictions) in zip(ranges, range_sums.tolist()):
            mean = range_nll / predictions if predictions else float("nan")
            result["position_ranges"].append({"start": start, "end": end, "num_predictions": int(predictions),
                                              "nll": mean, "perplexity": math.exp(mean) if predictions else
                                              float("nan")})
    return result


# --------------------------------------------------------------------------------------------
# Evaluating a model folder
# --------------------------------------------------------------------------------------------


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as error:
        raise EvaluationError(f"no tokenizer could be loaded from {path!r} ({error}); pass --tokenizer") from None


def load_trained_model(auto_class, model_path: str, trust_remote_code: bool = False):
    """``auto_class.from_pretrained(model_path)``, refused when the folder lacks weights the model needs (a base
    encoder loaded as a classifier gets a randomly initialised head: its metrics would mean nothing).

    Raises:
        EvaluationError: naming the missing weights.
    """
    model, loading_info = auto_class.from_pretrained(model_path, trust_remote_code=trust_remote_code,
                                                     output_loading_info=True)
    missing = sorted(loading_info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise EvaluationError(
            f"{model_path} has no trained weights for {shown} (initialised randomly when loaded as "
            f"{type(model).__name__}): its metrics would be those of a random head; evaluate a model fine-tuned on "
            "the task (e.g. the output folder of recipes/text_classification.py)"
        )
    return model


def load_causal_lm(model_path: str, trust_remote_code: bool = False, favor_changes: dict | None = None,
                   kv_bits: int | None = None, snapkv: dict | None = None):
    """A causal LM folder (:func:`load_trained_model`) with ``favor_changes`` made to its favor settings
    (:func:`~hf_performer.favor_attention.update_favor_settings`, e.g. ``{"sparse_cache": 64}``), or with
    ``kv_bits`` a softmax model run through a quantized KV cache (:mod:`.quantized_kv`), or with ``snapkv``
    (``{"keys", "window", "sinks", "pool"}``) through a KV cache cut after the prompt (:mod:`.snapkv`).

    Raises:
        EvaluationError: missing weights, or changes the model does not take (a softmax model, an invalid value).
    """
    from transformers import AutoModelForCausalLM

    model = load_trained_model(AutoModelForCausalLM, model_path, trust_remote_code)
    if favor_changes:
        from ..favor_attention import update_favor_settings

        try:
            update_favor_settings(model, **favor_changes)
        except ValueError as error:
            raise EvaluationError(f"{model_path}: cannot evaluate with {favor_changes}: {error}") from None
    if kv_bits:
        from .quantized_kv import QuantizedKVError, with_quantized_kv

        try:
            return with_quantized_kv(model, kv_bits, model_path)
        except QuantizedKVError as error:
            raise EvaluationError(str(error)) from None
    if snapkv:
        from .snapkv import SnapKVError, with_snapkv

        try:
            return with_snapkv(model, model_path=model_path, **snapkv)
        except SnapKVError as error:
            raise EvaluationError(str(error)) from None
    return model


TRAINING_FILES = ("trainer_state.json", "training_args.bin", "all_results.json", "train_results.json")
"""Files a ``transformers.Trainer`` run leaves in its output folder: their presence marks a fine-tuned model."""


def check_head_was_trained(model_path: str) -> None:
    """Raise :class:`EvaluationError` when ``model_path`` is a converted folder whose head was new at conversion
    (its ``conversion_report.json`` says ``untrained_head``) and that records no training run since (the recipes'
    ``metrics.json`` / ``eval_curve.json``, Trainer files)."""
    from ..conversion.fidelity import REPORT_FILE_NAME

    report_path = os.path.join(model_path, REPORT_FILE_NAME)
    if not os.path.isfile(report_path):
        return
    try:
        with open(report_path, encoding="utf-8-sig") as handle:
            untrained_head = json.load(handle).get("untrained_head", False)
    except (OSError, ValueError, AttributeError):
        return
    training_records = ("metrics.json", "eval_curve.json", *TRAINING_FILES)
    if untrained_head and not any(os.path.isfile(os.path.join(model_path, name)) for name in training_records):
        raise EvaluationError(
            f"the task head of {model_path} was newly initialised at conversion and never trained ({REPORT_FILE_NAME}: "
            f"untrained_head; no {', '.join(training_records[:2])} or Trainer files): its metrics would be those of a "
            "random head; fine-tune it first (recipes/text_classification.py)"
        )


def evaluate_classification_model(model_path: str, task: str, validation_file: str | None = None,
                                  max_eval_samples: int | None = None, seed: int = 0, max_length: int = 128,
                                  batch_size: int = 32, tokenizer_path: str | None = None,
                                  metrics_backend: str = "auto", device: str | None = None,
                                  trust_remote_code: bool = False, show_progress: bool = True) -> dict:
    """Evaluate a sequence classification model folder on a task's validation split (see ``hf-performer
    evaluate --help``). Returns the metrics record written by the command."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

    from .. import modeling_performer  # noqa: F401 - registers the Performer classes with the Auto classes
    from .data import load_task_split, tokenize_task_dataset

    spec = get_task(task)
    tokenizer = _load_tokenizer(tokenizer_path or model_path)
    model = load_trained_model(AutoModelForSequenceClassification, model_path, trust_remote_code)
    check_head_was_trained(model_path)
    check_model_matches_task(model, spec)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    dataset = load_task_split(spec, "validation", validation_file, max_eval_samples, seed)
    tokenized = tokenize_task_dataset(dataset, tokenizer, spec, max_length)
    loader = DataLoader(tokenized, batch_size=batch_size, collate_fn=DataCollatorWithPadding(tokenizer))
    start = time.perf_counter()
    predictions, references, loss = predict_classification(model, loader, spec, show_progress=show_progress)
    metrics, backend, note = compute_task_metrics(spec, predictions, references, metrics_backend)
    return {
        "task": spec.name,
        "model": model_path,
        "data": validation_file or f"hub:{'/'.join(spec.hub)}:{spec.validation_split}",
        "num_examples": int(len(references)),
        "metrics": metrics,
        "main_metric": spec.main_metric,
        "eval_loss": loss,
        "metrics_backend": backend,
        "metrics_note": note,
        "eval_seconds": round(time.perf_counter() - start, 3),
        "device": str(device),
    }


def evaluate_perplexity_model(model_path: str, task: str = "wikitext", text_file: str | None = None,
                              split: str = "test", max_chars: int | None = None, context_length: int | None = None,
                              stride: int | None = None, batch_size: int = 1, tokenizer_path: str | None = None,
                              device: str | None = None, trust_remote_code: bool = False,
                              show_progress: bool = True,
                              position_ranges: Sequence[str | Sequence[int]] | None = None,
                              favor_changes: dict | None = None, kv_bits: int | None = None) -> dict:
    """Perplexity of a causal LM folder on a text file or a Hub text dataset (see ``hf-performer evaluate
    --help``). Returns the metrics record written by the command; with ``position_ranges`` (see
    :func:`perplexity`) its metrics also hold ``perplexity_positions_START_END`` and the record
    ``position_ranges``; ``favor_changes`` (e.g. ``{"sparse_cache": 64}``) are applied to the loaded model
    (:func:`load_causal_lm`) and recorded; with ``kv_bits`` a softmax model decodes through a quantized KV cache
    (:mod:`.quantized_kv`, recorded as ``kv_cache``)."""
    import torch

    from .. import modeling_performer  # noqa: F401
    from .data import load_lm_text, tokenize_lm_text

    tokenizer = _load_tokenizer(tokenizer_path or model_path)
    model = load_causal_lm(model_path, trust_remote_code, favor_changes, kv_bits=kv_bits)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    if context_length is None:
        positions = getattr(model.config.get_text_config(), "max_position_embeddings", None) or 1024
        context_length = min(int(positions), 1024)
    stride = stride if stride is not None else max(context_length // 2, 1)
    text = load_lm_text(text_file, dataset=task, split=split, max_chars=max_chars)
    ranges = parse_position_ranges(position_ranges or (), context_length)  # before the (long) run
    ids = tokenize_lm_text(text, tokenizer)
    start = time.perf_counter()
    result = perplexity(model, ids, context_length, stride, batch_size=batch_size, show_progress=show_progress,
                        position_ranges=ranges)
    metrics = {"perplexity": result["perplexity"], "nll": result["nll"]}
    for entry in result.get("position_ranges", ()):
        metrics[f"perplexity_positions_{entry['start']}_{entry['end']}"] = entry["perplexity"]
    record = {
        "task": "perplexity",
        "model": model_path,
        "data": text_file or f"hub:{'/'.join(LM_DATASETS.get(task, (task,)))}:{split}",
        "metrics": metrics,
        "protocol": {key: result[key] for key in ("context_length", "stride", "windows", "num_tokens")}
        | {"text_tokens": len(ids), "max_chars": max_chars},
        "eval_seconds": round(time.perf_counter() - start, 3),
        "device": str(device),
    }
    if favor_changes:
        record["favor_settings_changed"] = dict(favor_changes)
    if kv_bits:
        record["kv_cache"] = model.kv_cache_description
    if ranges:
        record["position_ranges"] = result["position_ranges"]
    return record


__all__ = [
    "METRIC_BACKENDS",
    "EvaluationError",
    "check_head_was_trained",
    "check_model_matches_task",
    "compute_task_metrics",
    "evaluate_classification_model",
    "evaluate_perplexity_model",
    "load_causal_lm",
    "load_trained_model",
    "parse_position_ranges",
    "perplexity",
    "perplexity_windows",
    "predict_classification",
]
