"""Recovery results (issues 4 and 5): collect the runs of one task into a JSON file, plot the recovery curve, and
write the results table (into the README between markers).

The runs of a task have fixed labels:

- ``a``: the softmax model fine-tuned on the task (``recipes/text_classification.py --attention softmax``);
- ``b``: (a) converted to FAVOR+ and evaluated with no further training (``hf-performer convert`` then
  ``hf-performer evaluate``);
- ``c``: (b) after FAVOR+ recovery fine-tuning (the recipe on the converted folder);
- ``d``: the base model converted to FAVOR+ and fine-tuned as FAVOR+ directly;
- ``e``: (a) converted with a learned feature map trained by attention transfer (``hf-performer distill``, e.g.
  hedgehog) and evaluated with no fine-tuning (``hf-performer evaluate``); when the distilled folder holds
  ``attention_transfer.json``, a summary of the transfer (steps, sequences, per-layer fidelity before/after) is kept;
- ``f``: (e) after fine-tuning (the recipe on the distilled folder).

Two targets are checked: issue 4's, (c) within :data:`TARGET_POINTS` points of (a) (key ``target``), and issue 5's,
for attention transfer (key ``attention_transfer_target``): on SST-2 (f) within 0.5 points of (a), on any other task
(f) at least 97% of (a)'s metric (see :func:`attention_transfer_target_check`).

Commands::

    hf-performer results collect --task sst2 --run a=RUN_A --run b=B/dev_metrics.json --run c=RUN_C \\
        --run d=RUN_D --run e=E/dev_metrics.json --run f=RUN_F --protocol "..." \\
        --output benchmarks/results/recovery_sst2.json
    hf-performer results plot benchmarks/results/recovery_sst2.json        # -> recovery_sst2.png
    hf-performer results table benchmarks/results/recovery_*.json --readme README.md

A training run is its output folder (``metrics.json`` and ``eval_curve.json`` written by the recipe) or its
``metrics.json``; an evaluation is the JSON written by ``hf-performer evaluate --output`` or the folder holding it
as ``dev_metrics.json`` / ``eval_metrics.json``. Every label is optional; files collected before (e) and (f)
existed (runs a-d only) are read, plotted and tabulated as they are.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import shlex
import sys

SCHEMA = "hf-performer/recovery-results/1"

LABELS: dict[str, str] = {
    "a": "softmax, fine-tuned",
    "b": "(a) converted to FAVOR+, no training",
    "c": "(b) + FAVOR+ recovery fine-tuning",
    "d": "FAVOR+ from the base model, fine-tuned",
    "e": "(a) + attention transfer (hedgehog), no fine-tuning",
    "f": "(e) + fine-tuning",
}
"""The fixed meaning of each run label (run (e)'s description names the feature map its folder records)."""

TARGET_POINTS = 1.5
"""Issue 4's target: the recovered model (c) within this many points (metric x 100) of the softmax model (a)."""

ATTENTION_TRANSFER_TARGET_POINTS: dict[str, float] = {"sst2": 0.5}
"""Issue 5's target on these tasks: the fine-tuned attention-transfer model (f) within this many points of (a)."""

ATTENTION_TRANSFER_TARGET_RATIO = 0.97
"""Issue 5's target on the other tasks: (f)'s metric at least this fraction of (a)'s."""

ATTENTION_TRANSFER_FILE = "attention_transfer.json"
"""Written by ``hf-performer distill`` into the distilled model folder."""

README_START = "<!-- recovery-results:start -->"
README_END = "<!-- recovery-results:end -->"

TRAINING_FILES = ("metrics.json",)
EVALUATION_FILES = ("dev_metrics.json", "eval_metrics.json")
CURVE_FILE = "eval_curve.json"

RECIPE_ARGS = (
    "model", "tokenizer", "attention", "convert", "feature_map", "nb_features", "keep_softmax_layers", "favor_seed",
    "redraw_interval", "max_position_embeddings", "lora", "lora_r", "lora_alpha", "lora_target_modules", "task",
    "train_file", "validation_file", "max_length", "max_train_samples", "max_eval_samples", "seed", "learning_rate",
    "weight_decay", "lr_scheduler", "warmup_ratio", "warmup_steps", "per_device_train_batch_size",
    "per_device_eval_batch_size", "gradient_accumulation_steps", "num_train_epochs", "max_train_steps",
    "max_grad_norm", "mixed_precision", "eval_steps", "resume_from_checkpoint",
)
"""The recipe arguments that decide a run's result (kept in the collected JSON)."""


class ResultsError(ValueError):
    """A missing or malformed run file, an unknown label, or a README without the markers."""


# --------------------------------------------------------------------------------------------
# Reading runs
# --------------------------------------------------------------------------------------------


def _read_json(path: str, what: str):
    if not os.path.isfile(path):
        raise ResultsError(f"{what}: no such file {path}")
    try:
        with open(path, encoding="utf-8-sig") as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise ResultsError(f"{what}: cannot read {path} as JSON ({error})") from None


def _require(record: dict, keys, path: str) -> None:
    missing = [key for key in keys if key not in record]
    if missing:
        raise ResultsError(f"{path} lacks the key(s) {', '.join(missing)}")


def _none(value):
    """The recipe stores ``None`` as the string ``"None"`` in ``args``."""
    return None if value in (None, "None") else value


def _find_run_file(path: str, label: str) -> str:
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        for name in TRAINING_FILES + EVALUATION_FILES:
            candidate = os.path.join(path, name)
            if os.path.isfile(candidate):
                return candidate
        raise ResultsError(
            f"run {label}: {path} holds none of {', '.join(TRAINING_FILES + EVALUATION_FILES)} "
            "(a recipe output folder or an `hf-performer evaluate --output` file is expected)"
        )
    raise ResultsError(f"run {label}: no such file or folder {path}")


def recipe_command(metrics: dict) -> str | None:
    """The recipe command line that reproduces a training run, rebuilt from its recorded ``args`` (the options
    that differ from the recipe's defaults, plus the required ones). ``None`` if it cannot be rebuilt."""
    try:
        from .training import build_parser

        args = metrics["args"]
        kind = args.get("kind", metrics.get("kind", "text-classification"))
        parser = build_parser(kind)
    except Exception:  # noqa: BLE001 - a record from another version: no command rather than no results
        return None
    script = "recipes/text_classification.py" if kind == "text-classification" else "recipes/causal_lm.py"
    launcher = "accelerate launch" if (metrics.get("num_processes") or 1) > 1 else "python"
    parts = [launcher, script]
    for action in parser._actions:  # noqa: SLF001 - argparse offers no public list
        if not action.option_strings or action.dest not in args:
            continue
        value = args[action.dest]
        default = action.default if isinstance(action.default, (int, float, str, bool)) else str(action.default)
        if value == default and not action.required and action.dest != "seed":
            continue
        option = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            if value in (True, "True"):
                parts.append(option)
            elif value in (False, "False"):
                parts.append("--no-" + option[2:])
        elif action.nargs == 0:  # store_true
            if value in (True, "True"):
                parts.append(option)
        elif _none(value) is None:
            continue
        elif action.nargs in ("+", "*"):
            items = ast.literal_eval(value) if isinstance(value, str) else value
            if items:
                parts.append(option)
                parts.extend(shlex.quote(str(item)) for item in items)
        else:
            parts.extend([option, shlex.quote(str(value))])
    return " ".join(parts)


def _favor_settings_near(*folders: str) -> dict | None:
    """FAVOR+ settings of a converted model folder (its ``conversion_report.json`` or ``config.json``)."""
    for folder in folders:
        if not folder or not os.path.isdir(folder):
            continue
        for name, key in (("conversion_report.json", "favor_settings"), ("config.json", "favor_settings")):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                try:
                    with open(path) as handle:
                        settings = json.load(handle).get(key)
                except (OSError, json.JSONDecodeError, AttributeError):
                    continue
                if settings:
                    return settings
    return None


def _conversion_source(*folders: str) -> str | None:
    for folder in folders:
        path = os.path.join(folder, "conversion_report.json") if folder else ""
        if path and os.path.isfile(path):
            try:
                with open(path) as handle:
                    return json.load(handle).get("source")
            except (OSError, json.JSONDecodeError, AttributeError):
                pass
    return None


def _number(value):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _mean(values: list) -> float | None:
    values = [v for v in values if _number(v) is not None]
    return round(sum(values) / len(values), 6) if values else None


def attention_transfer_summary(record: dict, file: str | None = None) -> dict:
    """The compact summary of an ``attention_transfer.json`` record (written by ``hf-performer distill``) kept in
    a collected run: feature map, transfer steps, sequences, learning rate, loss, wall time, per layer the
    relative error of the attention output on the softmax model's own inputs before and after transfer, and the
    final hidden-state cosine before and after. Missing keys give ``None`` (records of other versions)."""
    if not isinstance(record, dict):
        raise ResultsError(f"{file or ATTENTION_TRANSFER_FILE} is not a JSON object")
    transfer = record.get("transfer") if isinstance(record.get("transfer"), dict) else {}
    data = record.get("data") if isinstance(record.get("data"), dict) else {}
    before = record.get("fidelity_before") if isinstance(record.get("fidelity_before"), dict) else {}
    after = record.get("fidelity_after") if isinstance(record.get("fidelity_after"), dict) else {}
    settings = record.get("favor_settings") if isinstance(record.get("favor_settings"), dict) else {}

    def by_layer(report: dict) -> dict:
        layers = report.get("layers") if isinstance(report.get("layers"), list) else []
        return {entry["layer"]: entry for entry in layers if isinstance(entry, dict) and "layer" in entry}

    layers_before, layers_after = by_layer(before), by_layer(after)
    layers = []
    for layer in sorted(set(layers_before) | set(layers_after), key=lambda x: (not isinstance(x, int), str(x))):
        old, new = layers_before.get(layer, {}), layers_after.get(layer, {})
        layers.append({
            "layer": layer,
            "attention": new.get("attention", old.get("attention")),
            "before": _number(old.get("own_inputs_relative_error")),
            "after": _number(new.get("own_inputs_relative_error")),
        })
    linear = [entry for entry in layers if entry["attention"] != "softmax"]
    history = transfer.get("history") if isinstance(transfer.get("history"), list) else []
    last = history[-1] if history and isinstance(history[-1], dict) else {}
    return {
        "file": file,
        "source": record.get("source"),
        "feature_map": record.get("feature_map") or settings.get("feature_map"),
        "nb_features": settings.get("nb_features"),
        "steps": transfer.get("steps"),
        "sequences": data.get("sequences"),
        "max_length": data.get("max_length"),
        "batch_size": data.get("batch_size"),
        "fidelity_sequences": data.get("fidelity_sequences"),
        "data": data.get("file"),
        "learning_rate": transfer.get("learning_rate"),
        "loss": transfer.get("loss"),
        "final_loss_per_layer": _number(last.get("loss_per_layer")),
        "wall_time_s": record.get("wall_time_s"),
        "own_inputs_relative_error": layers,
        "mean_own_inputs_relative_error": {"before": _mean([e["before"] for e in linear]),
                                           "after": _mean([e["after"] for e in linear]),
                                           "layers": len(linear)},
        "final_hidden_state_cosine": {"before": _number(before.get("final_hidden_state_cosine")),
                                      "after": _number(after.get("final_hidden_state_cosine"))},
        "command": record.get("command"),
    }


def _attention_transfer_near(*folders: str) -> dict | None:
    """The :func:`attention_transfer_summary` of the first of ``folders`` holding ``attention_transfer.json``."""
    for folder in folders:
        if not isinstance(folder, str) or not folder or not os.path.isdir(folder):
            continue
        path = os.path.join(folder, ATTENTION_TRANSFER_FILE)
        if os.path.isfile(path):
            return attention_transfer_summary(_read_json(path, "attention transfer record"), path)
    return None


def _describe(label: str, transfer: dict | None, settings: dict | None) -> str:
    """The run's description: :data:`LABELS`, with run (e)'s feature map as recorded in its folder."""
    if label == "e":
        feature_map = (transfer or {}).get("feature_map") or (settings or {}).get("feature_map")
        if feature_map:
            return f"(a) + attention transfer ({feature_map}), no fine-tuning"
    return LABELS[label]


def _with_transfer(run: dict, *folders: str) -> dict:
    """Runs (e) and (f): add the attention-transfer summary of the distilled folder, and (e)'s description."""
    if run["label"] in ("e", "f"):
        transfer = _attention_transfer_near(*folders)
        if transfer is not None:
            run["attention_transfer"] = transfer
        run["description"] = _describe(run["label"], transfer, run.get("favor_settings"))
    return run


def load_run(label: str, path: str, command: str | None = None) -> dict:
    """One run as collected: its final dev metric, steps, examples, seed, wall time, model settings, curve.

    Args:
        label: ``a`` to ``f`` (see :data:`LABELS`).
        path: a recipe output folder / its ``metrics.json`` (training run), or an ``hf-performer evaluate``
            JSON / the folder holding it (evaluation only). For (e), the ``attention_transfer.json`` of the
            evaluated model folder (or of the folder holding the evaluate JSON) is summarised into the run's
            ``attention_transfer``; for (f), that of the folder the recipe started from.
        command: the exact command line of the run, if known (otherwise it is rebuilt from the record).

    Raises:
        ResultsError: unknown label, missing file, or a record without the expected keys.
    """
    if label not in LABELS:
        raise ResultsError(f"unknown run label {label!r}; accepted: {', '.join(LABELS)} "
                           f"({'; '.join(f'{k}: {v}' for k, v in LABELS.items())})")
    file = _find_run_file(path, label)
    record = _read_json(file, f"run {label}")
    if not isinstance(record, dict):
        raise ResultsError(f"{file} is not a JSON object")
    folder = os.path.dirname(os.path.abspath(file))
    if "final" in record or "completed_steps" in record:
        run = _training_run(label, file, folder, record, command)
        return _with_transfer(run, _none((record.get("args") or {}).get("model")) or "",
                              (record.get("model") or {}).get("source") or "")
    if "metrics" in record:
        run = _evaluation_run(label, file, folder, record, command)
        return _with_transfer(run, record.get("model") or "", folder)
    raise ResultsError(f"{file} is neither a recipe metrics.json (keys final, completed_steps, ...) nor an "
                       "`hf-performer evaluate` record (keys metrics, main_metric, ...)")


def _training_run(label: str, file: str, folder: str, record: dict, command: str | None) -> dict:
    _require(record, ("task", "main_metric", "final", "completed_steps"), file)
    main = record["main_metric"]
    if main not in record["final"]:
        raise ResultsError(f"{file}: the main metric {main!r} is not in final ({', '.join(record['final'])})")
    args = record.get("args") or {}
    curve_path = os.path.join(folder, CURVE_FILE)
    if os.path.isfile(curve_path):
        curve = _read_json(curve_path, f"run {label} curve")
        if not isinstance(curve, list) or any(not isinstance(p, dict) or "step" not in p for p in curve):
            raise ResultsError(f"{curve_path}: expected a list of points with a 'step' key")
        curve_source = curve_path
    else:
        curve = [{"step": record["completed_steps"], **record["final"]}]
        curve_source = f"final metrics only ({CURVE_FILE} not found next to {os.path.basename(file)})"
    model = record.get("model") or {}
    return {
        "label": label,
        "description": LABELS[label],
        "kind": "fine-tuned",
        "file": file,
        "task": record["task"],
        "main_metric": main,
        "metric": record["final"][main],
        "final": record["final"],
        "steps": record["completed_steps"],
        "epochs": record.get("epochs"),
        "train_examples": record.get("train_examples"),
        "eval_examples": record.get("eval_examples"),
        "seed": _none(args.get("seed")),
        "wall_time_s": record.get("wall_time_s"),
        "wall_time_note": "training, including the evaluations along the way",
        "device": record.get("device"),
        "num_processes": record.get("num_processes"),
        "mixed_precision": record.get("mixed_precision"),
        "model": model,
        "favor_settings": model.get("favor_settings") or _favor_settings_near(_none(args.get("model")) or ""),
        "metrics_backend": record.get("metrics_backend"),
        "args": {key: args[key] for key in RECIPE_ARGS if key in args},
        "command": command or recipe_command(record),
        "command_source": "given" if command else "rebuilt from metrics.json args",
        "curve": curve,
        "curve_source": curve_source,
    }


def _evaluation_run(label: str, file: str, folder: str, record: dict, command: str | None) -> dict:
    _require(record, ("task", "main_metric", "metrics"), file)
    main = record["main_metric"]
    if main not in record["metrics"]:
        raise ResultsError(f"{file}: the main metric {main!r} is not in metrics ({', '.join(record['metrics'])})")
    model_path = record.get("model")
    rebuilt = None
    if not command:
        data = record.get("data") or ""
        parts = ["hf-performer", "evaluate", shlex.quote(str(model_path)), "--task", record["task"]]
        if data and not str(data).startswith("hub:"):
            parts += ["--validation-file", shlex.quote(str(data))]
        parts += ["--output", shlex.quote(file)]
        rebuilt = " ".join(parts)
    settings = _favor_settings_near(model_path or "", folder)
    final = {**record["metrics"], **({"eval_loss": record["eval_loss"]} if "eval_loss" in record else {})}
    return {
        "label": label,
        "description": LABELS[label],
        "kind": "evaluated",
        "file": file,
        "task": record["task"],
        "main_metric": main,
        "metric": record["metrics"][main],
        "final": final,
        "steps": 0,
        "epochs": 0,
        "train_examples": 0,
        "eval_examples": record.get("num_examples"),
        "seed": None,
        "wall_time_s": record.get("eval_seconds"),
        "wall_time_note": "evaluation only (no training)",
        "device": record.get("device"),
        "num_processes": 1,
        "mixed_precision": None,
        "model": {"source": model_path, "converted_from": _conversion_source(model_path or "", folder),
                  "attention": "favor" if settings else None, "favor_settings": settings},
        "favor_settings": settings,
        "metrics_backend": record.get("metrics_backend"),
        "args": {"model": model_path, "task": record["task"], "data": record.get("data")},
        "command": command or rebuilt,
        "command_source": "given" if command else "rebuilt from the evaluate record",
        "curve": [{"step": 0, **final}],
        "curve_source": "single evaluation",
    }


# --------------------------------------------------------------------------------------------
# Collect
# --------------------------------------------------------------------------------------------


def _points(value: float) -> float:
    return 100.0 * value


def target_check(runs: dict, threshold: float = TARGET_POINTS) -> dict:
    """Issue 4's target: (c) within ``threshold`` points of (a). ``gap_points`` = (a - c) x 100 (negative when
    (c) is better); ``met`` is ``None`` when (a) or (c) is missing."""
    check = {"description": f"(c) within {threshold} points of (a)", "threshold_points": threshold}
    if "a" not in runs or "c" not in runs:
        missing = [label for label in ("a", "c") if label not in runs]
        return {**check, "status": "not evaluated", "met": None, "a": None, "c": None, "gap_points": None,
                "reason": f"run(s) {', '.join(missing)} not collected"}
    a, c = runs["a"]["metric"], runs["c"]["metric"]
    gap = round(_points(a) - _points(c), 6)
    met = gap <= threshold
    return {**check, "status": "met" if met else "not met", "met": met, "a": a, "c": c, "gap_points": gap}


def attention_transfer_target_check(runs: dict, task: str) -> dict:
    """Issue 5's target for attention transfer, on the fine-tuned distilled model (f) against the softmax model (a).

    On the tasks of :data:`ATTENTION_TRANSFER_TARGET_POINTS` (SST-2): (f) within that many points of (a),
    ``gap_points`` = (a - f) x 100 (negative when (f) is better). On any other task: (f) at least
    :data:`ATTENTION_TRANSFER_TARGET_RATIO` of (a)'s metric, ``ratio`` = f / a (needs a positive (a)). Both
    ``gap_points`` and ``ratio`` are recorded when computable; ``met`` is ``None`` when (a) or (f) is missing.
    """
    if task in ATTENTION_TRANSFER_TARGET_POINTS:
        threshold = ATTENTION_TRANSFER_TARGET_POINTS[task]
        check = {"description": f"(f) within {threshold:g} points of (a)", "kind": "points",
                 "threshold_points": threshold}
    else:
        threshold = ATTENTION_TRANSFER_TARGET_RATIO
        check = {"description": f"(f) at least {100 * threshold:g}% of (a)", "kind": "ratio",
                 "threshold_ratio": threshold}
    check["task"] = task
    if "a" not in runs or "f" not in runs:
        missing = [label for label in ("a", "f") if label not in runs]
        return {**check, "status": "not evaluated", "met": None, "a": None, "f": None, "gap_points": None,
                "ratio": None, "reason": f"run(s) {', '.join(missing)} not collected"}
    a, f = runs["a"]["metric"], runs["f"]["metric"]
    gap = round(_points(a) - _points(f), 6)
    ratio = round(f / a, 6) if a > 0 else None
    result = {**check, "a": a, "f": f, "gap_points": gap, "ratio": ratio}
    if check["kind"] == "points":
        met = gap <= threshold
    elif ratio is None:
        return {**result, "status": "not evaluated", "met": None,
                "reason": f"(a)'s metric {a} is not positive: a ratio to it means nothing"}
    else:
        met = ratio >= threshold
    return {**result, "status": "met" if met else "not met", "met": met}


def collect(task: str, run_specs: dict[str, str], protocol: str | None = None,
            commands: dict[str, str] | None = None) -> dict:
    """The recovery results of one task (see the module docstring for the labels and the layout).

    Raises:
        ResultsError: no run, a run of another task, runs with different main metrics, unreadable files.
    """
    from .tasks.data import DataError, get_task

    try:
        spec = get_task(task)
    except DataError as error:
        raise ResultsError(str(error)) from None
    if not run_specs:
        raise ResultsError("no run given (--run LABEL=PATH, labels " + ", ".join(LABELS) + ")")
    commands = commands or {}
    unknown = sorted(set(commands) - set(run_specs))
    if unknown:
        raise ResultsError(f"--command given for run(s) {', '.join(unknown)} that were not given with --run")
    runs = {}
    for label in sorted(run_specs):
        run = load_run(label, run_specs[label], commands.get(label))
        if run["task"] != spec.name:
            raise ResultsError(f"run {label} ({run['file']}) is on task {run['task']!r}, not {spec.name!r}")
        if run["main_metric"] != spec.main_metric:
            raise ResultsError(f"run {label} ({run['file']}) reports main metric {run['main_metric']!r}, "
                               f"expected {spec.main_metric!r}")
        runs[label] = run
    notes = []
    eval_sizes = {label: run["eval_examples"] for label, run in runs.items() if run["eval_examples"] is not None}
    if len(set(eval_sizes.values())) > 1:
        notes.append("the runs were evaluated on different numbers of dev examples: "
                     + ", ".join(f"{k}: {v}" for k, v in eval_sizes.items()))
    backends = {label: run["metrics_backend"] for label, run in runs.items()}
    if len(set(backends.values())) > 1:
        notes.append("the runs used different metrics backends: " + ", ".join(f"{k}: {v}" for k, v in backends.items()))
    return {
        "schema": SCHEMA,
        "task": spec.name,
        "main_metric": spec.main_metric,
        "protocol": protocol,
        "labels": dict(LABELS),
        "runs": runs,
        "target": target_check(runs),
        "attention_transfer_target": attention_transfer_target_check(runs, spec.name),
        "notes": notes,
        "machine": _machine(runs),
        "machine_note": "the machine `hf-performer results collect` ran on; each run records its own device",
        "collected": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _machine(runs: dict) -> dict:
    import torch

    from .bench.machine import machine_info

    device = torch.device("cpu")
    if torch.cuda.is_available() and any(str(run.get("device") or "").startswith("cuda") for run in runs.values()):
        device = torch.device("cuda")
    return machine_info(device)


def _parse_pairs(values: list[str] | None, option: str) -> dict[str, str]:
    pairs = {}
    for value in values or []:
        label, sep, rest = value.partition("=")
        label = label.strip().lower()
        if not sep or not rest:
            raise ResultsError(f"{option} expects LABEL=VALUE (labels {', '.join(LABELS)}), got {value!r}")
        if label not in LABELS:
            raise ResultsError(f"{option} {value!r}: unknown label {label!r}; accepted: {', '.join(LABELS)}")
        if label in pairs:
            raise ResultsError(f"{option}: label {label!r} given twice")
        pairs[label] = rest
    return pairs


# --------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------


def load_results(path: str) -> dict:
    """A JSON file written by :func:`collect` (checked for the keys the plot and table need)."""
    results = _read_json(path, "results")
    if not isinstance(results, dict):
        raise ResultsError(f"{path} is not a JSON object")
    _require(results, ("task", "main_metric", "runs"), path)
    for label, run in results["runs"].items():
        if label not in LABELS:
            raise ResultsError(f"{path}: unknown run label {label!r}")
        _require(run, ("metric", "steps", "curve"), f"{path} (run {label})")
    return results


def _curve_xy(run: dict, metric: str, offset: int = 0) -> tuple[list[float], list[float]]:
    points = [p for p in run["curve"] if metric in p]
    return [offset + p["step"] for p in points], [_points(p[metric]) for p in points]


def _transfer_target(results: dict) -> dict:
    """Issue 5's check of a collected file (computed when the file predates it)."""
    return results.get("attention_transfer_target") or attention_transfer_target_check(results["runs"],
                                                                                     results["task"])


def _transfer_line(a_points: float, check: dict) -> float | None:
    """Issue 5's target as a metric value (x 100) under (a)."""
    if check.get("kind") == "ratio":
        ratio = check.get("threshold_ratio", ATTENTION_TRANSFER_TARGET_RATIO)
        return ratio * a_points if a_points > 0 else None
    return a_points - check.get("threshold_points", ATTENTION_TRANSFER_TARGET_POINTS.get("sst2", 0.5))


def plot(results: dict, path: str) -> str:
    """The recovery curve: dev metric vs optimizer steps. (a) softmax and (d) FAVOR+ direct from step 0; (c)
    FAVOR+ recovery continues after (a)'s last step (its steps are counted from the conversion), with (b), the
    converted model before any training, as a marker at the conversion point; likewise (f), the fine-tuned
    attention-transfer model (dashed), starts from (e), the distilled model before fine-tuning (the transfer's own
    steps train only the feature maps and are not on the axis). The targets of issue 4 (dotted) and, when (e) or
    (f) is there, issue 5 (dash-dot) are drawn under (a)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric, runs = results["main_metric"], results["runs"]
    if not any(label in runs for label in LABELS):
        raise ResultsError("nothing to plot: the results hold no run")
    transfer_runs = "e" in runs or "f" in runs
    fig, ax = plt.subplots(figsize=(8, 6.4) if transfer_runs else (8, 4.8))
    offset = int(runs["a"]["steps"]) if "a" in runs else 0
    colours = {"a": "tab:blue", "b": "tab:red", "c": "tab:orange", "d": "tab:green", "e": "indigo",
               "f": "tab:purple"}
    where = f"after (a)'s {offset} steps" if "a" in runs else "from the conversion"
    if "a" in runs:
        x, y = _curve_xy(runs["a"], metric)
        ax.plot(x, y, "o-", color=colours["a"], label=f"(a) softmax fine-tuned ({runs['a']['steps']} steps)")
    if "d" in runs:
        x, y = _curve_xy(runs["d"], metric)
        ax.plot(x, y, "s-", color=colours["d"], label=f"(d) FAVOR+ from the base model ({runs['d']['steps']} steps)")
    if "c" in runs:
        x, y = _curve_xy(runs["c"], metric, offset)
        if "b" in runs:
            x, y = [offset] + x, [_points(runs["b"]["metric"])] + y
        ax.plot(x, y, "^-", color=colours["c"],
                label=f"(c) FAVOR+ recovery ({runs['c']['steps']} steps, {where})")
    if "b" in runs:
        ax.plot([offset], [_points(runs["b"]["metric"])], "X", markersize=11, color=colours["b"], zorder=5,
                label=f"(b) (a) converted, no training: {_points(runs['b']['metric']):.2f}")
    if "f" in runs:
        x, y = _curve_xy(runs["f"], metric, offset)
        if "e" in runs:
            x, y = [offset] + x, [_points(runs["e"]["metric"])] + y
        ax.plot(x, y, "D--", color=colours["f"], markersize=5,
                label=f"(f) (e) + fine-tuning ({runs['f']['steps']} steps, {where})")
    if "e" in runs:
        transfer = runs["e"].get("attention_transfer") or {}
        feature_map = transfer.get("feature_map") or (runs["e"].get("favor_settings") or {}).get("feature_map")
        details = ", ".join(part for part in (
            feature_map, f"{transfer['steps']} transfer steps" if transfer.get("steps") is not None else None,
        ) if part)
        ax.plot([offset], [_points(runs["e"]["metric"])], "*", markersize=15, color=colours["e"], zorder=6,
                label=f"(e) attention transfer{f' ({details})' if details else ''}, no fine-tuning: "
                      f"{_points(runs['e']['metric']):.2f}")
    if "a" in runs:
        a = _points(runs["a"]["metric"])
        threshold = results.get("target", {}).get("threshold_points", TARGET_POINTS)
        ax.axhline(a - threshold, color=colours["a"], linestyle=":", linewidth=1,
                   label=f"issue 4 target: (a) - {threshold:g} points = {a - threshold:.2f}")
        if transfer_runs:
            check = _transfer_target(results)
            line = _transfer_line(a, check)
            if line is not None:
                rule = (f"{100 * check.get('threshold_ratio', ATTENTION_TRANSFER_TARGET_RATIO):g}% of (a)"
                        if check.get("kind") == "ratio" else
                        f"(a) - {check.get('threshold_points'):g} points")
                ax.axhline(line, color=colours["f"], linestyle="-.", linewidth=1,
                           label=f"issue 5 target: {rule} = {line:.2f}")
        if any(label in runs for label in "bcef"):
            ax.axvline(offset, color="grey", linestyle="--", linewidth=0.8)
            text = " conversion / attention transfer " if transfer_runs else " conversion to FAVOR+ "
            ax.text(offset, 0.02, text, transform=ax.get_xaxis_transform(), ha="right",
                    va="bottom", fontsize=8, color="grey")
    xlabel = "optimizer steps"
    continuing = [f"({label})" for label in ("c", "f") if label in runs]
    if "a" in runs and continuing:
        verb = "continues" if len(continuing) == 1 else "continue"
        xlabel += f" ({' and '.join(continuing)} {verb} after (a)'s last step: the total budget)"
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"dev {metric} (x100)")
    task = results["task"].upper() if len(results["task"]) <= 5 else results["task"]
    what = "FAVOR+ recovery and attention transfer" if transfer_runs else "FAVOR+ recovery"
    ax.set_title(f"{task}: {what} vs softmax fine-tuning")
    ax.grid(alpha=0.3)
    if transfer_runs:  # six runs and two targets: the legend goes under the axes, clear of the curves
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    else:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=120, **({"bbox_inches": "tight"} if transfer_runs else {}))
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# Table
# --------------------------------------------------------------------------------------------


def _seconds(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _wall(run: dict) -> str:
    seconds = run.get("wall_time_s")
    transfer = (run.get("attention_transfer") or {}).get("wall_time_s") if run.get("label") == "e" else None
    if seconds is None:
        return f"- (transfer {_seconds(transfer)})" if _number(transfer) is not None else "-"
    if run.get("kind") != "evaluated":
        return _seconds(seconds)
    if _number(transfer) is not None:
        return f"{_seconds(seconds)} (eval only; transfer {_seconds(transfer)})"
    return _seconds(seconds) + " (eval only)"


def _target_status(target: dict, other: str, bold: bool = True, short: bool = False) -> str:
    """A target check as text: its status and numbers ((a) vs ``other``, the run it checks)."""
    if target.get("met") is None:
        return f"not evaluated ({target.get('reason', f'(a) or ({other}) missing')})"
    status = f"**{target['status']}**" if bold else target["status"]
    gap = f"gap {target['gap_points']:+.2f} points"
    if target.get("kind") == "ratio":
        numbers = f"({other}) = {100 * target['ratio']:.2f}% of (a), {gap}"
    else:
        numbers = gap
    if short:
        return f"{status} ({numbers})"
    return f"{status} ({numbers}: (a) {_points(target['a']):.2f}, ({other}) {_points(target[other]):.2f})"


def _transfer_details(summary: dict) -> str:
    """One line on run (e)'s attention transfer (from its ``attention_transfer`` summary)."""
    parts = []
    head = f"attention transfer of the {summary.get('feature_map') or 'learned'} feature maps"
    done = []
    if summary.get("steps") is not None:
        done.append(f"{summary['steps']} steps")
    if summary.get("sequences") is not None:
        done.append(f"on {summary['sequences']} sequences")
    settings = ", ".join(f"{name} {summary[key]}" for name, key in (("lr", "learning_rate"), ("loss", "loss"))
                         if summary.get(key) is not None)
    text = head + (": " + " ".join(done) if done else "") + (f" ({settings})" if settings else "")
    if _number(summary.get("wall_time_s")) is not None:
        text += f" in {_seconds(summary['wall_time_s'])}"
    parts.append(text)
    mean = summary.get("mean_own_inputs_relative_error") or {}
    layers = [e for e in summary.get("own_inputs_relative_error") or []
              if _number(e.get("before")) is not None and _number(e.get("after")) is not None]
    if mean.get("before") is not None and mean.get("after") is not None:
        per_layer = ", ".join(f"{e['layer']}: {e['before']:.3f} -> {e['after']:.3f}" for e in layers)
        parts.append(f"relative error of the attention output on the softmax model's own inputs, mean over "
                     f"{mean.get('layers')} layers, {mean['before']:.3f} -> {mean['after']:.3f}"
                     + (f" (per layer {per_layer})" if per_layer else ""))
    cosine = summary.get("final_hidden_state_cosine") or {}
    if cosine.get("before") is not None and cosine.get("after") is not None:
        parts.append(f"final hidden-state cosine {cosine['before']:.3f} -> {cosine['after']:.3f}")
    return "; ".join(parts)


def _cell(results: dict, label: str, steps: bool = False) -> str:
    run = results["runs"].get(label)
    if run is None:
        return "-"
    text = f"({label}) {results['main_metric']} {_points(run['metric']):.2f}"
    if label == "e":
        summary = run.get("attention_transfer") or {}
        feature_map = summary.get("feature_map") or (run.get("favor_settings") or {}).get("feature_map")
        extra = ", ".join(part for part in (
            feature_map, f"{summary['steps']} transfer steps" if summary.get("steps") is not None else None) if part)
        text += f" ({extra})" if extra else ""
    elif steps:
        text += f" ({run['steps']} steps)"
    return text


def comparison_table(results_list: list[dict]) -> str:
    """FAVOR+ conversion (runs b, c; d) and attention transfer (runs e, f) side by side per task, each against the
    softmax reference (a), with the target of each route (issue 4 for (c), issue 5 for (f))."""
    lines = [
        "| Task | Stage | FAVOR+ (random features) | Attention transfer (learned feature map) |",
        "|---|---|---|---|",
    ]
    for results in results_list:
        task, runs = results["task"], results["runs"]
        target = results.get("target") or target_check(runs)
        transfer = _transfer_target(results)
        rows = [
            ("softmax fine-tuned, the reference", _cell(results, "a"), _cell(results, "a")),
            ("(a) converted, no fine-tuning", _cell(results, "b"), _cell(results, "e")),
            ("+ fine-tuning", _cell(results, "c", steps=True), _cell(results, "f", steps=True)),
        ]
        if "d" in runs:
            rows.append(("from the base model, fine-tuned", _cell(results, "d", steps=True), "-"))
        rows.append(("target",
                     f"issue 4, {target.get('description')}: {_target_status(target, 'c', short=True)}",
                     f"issue 5, {transfer.get('description')}: {_target_status(transfer, 'f', short=True)}"))
        lines.extend(f"| {task} | {stage} | {favor} | {learned} |" for stage, favor, learned in rows)
    return "\n".join(lines) + "\n"


def table(results_list: list[dict], sources: list[str] | None = None) -> str:
    """The markdown results table of one or more collected JSON files (one row per run), the side-by-side
    comparison of the FAVOR+ and attention-transfer routes per task (:func:`comparison_table`), then the target
    checks per task and the attention-transfer details of run (e)."""
    lines = [
        "| Task | Run | Dev metric | Steps | Train examples | Seed | Wall time |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    footer = []
    for results in results_list:
        metric = results["main_metric"]
        for label in sorted(results["runs"]):
            run = results["runs"][label]
            examples = run.get("train_examples")
            seed = run.get("seed")
            lines.append(
                f"| {results['task']} | ({label}) {run.get('description', LABELS[label])} | "
                f"{metric} {_points(run['metric']):.2f} | {run['steps']} | "
                f"{examples if examples else '-'} | {seed if seed is not None else '-'} | {_wall(run)} |"
            )
        target = results.get("target") or target_check(results["runs"])
        evals = sorted({run.get("eval_examples") for run in results["runs"].values() if run.get("eval_examples")})
        dev = f"dev: {', '.join(map(str, evals))} examples" if evals else "dev"
        footer.append(f"- {results['task']} ({dev}): FAVOR+ target (issue 4) {target.get('description')}: "
                      f"{_target_status(target, 'c')}.")
        transfer = _transfer_target(results)
        footer.append(f"- {results['task']}: attention-transfer target (issue 5) {transfer.get('description')}: "
                      f"{_target_status(transfer, 'f')}.")
        summary = (results["runs"].get("e") or {}).get("attention_transfer")
        if summary:
            footer.append(f"- {results['task']} (e): {_transfer_details(summary)}.")
    lines.append("")
    lines.append(comparison_table(results_list).rstrip("\n"))
    lines.append("")
    lines.extend(footer)
    if sources:
        lines.append("")
        lines.append("Generated by `hf-performer results table "
                     + " ".join(sources) + "` from the committed JSON; do not edit by hand.")
    return "\n".join(lines) + "\n"


def replace_in_readme(readme: str, content: str) -> None:
    """Replace the text between :data:`README_START` and :data:`README_END` in ``readme`` with ``content``
    (the markers stay; nothing else changes).

    Raises:
        ResultsError: no such file, a marker missing or repeated, or the end marker before the start marker.
    """
    if not os.path.isfile(readme):
        raise ResultsError(f"--readme: no such file {readme}")
    with open(readme) as handle:
        text = handle.read()
    for marker in (README_START, README_END):
        count = text.count(marker)
        if count != 1:
            raise ResultsError(
                f"{readme} must contain the marker {marker} exactly once (found {count}); add the pair "
                f"{README_START} / {README_END} where the table goes"
            )
    start = text.index(README_START) + len(README_START)
    end = text.index(README_END)
    if end < start:
        raise ResultsError(f"{readme}: {README_END} comes before {README_START}")
    new = text[:start] + "\n" + content.strip("\n") + "\n" + text[end:]
    tmp = readme + ".tmp"
    with open(tmp, "w") as handle:
        handle.write(new)
    os.replace(tmp, readme)


# --------------------------------------------------------------------------------------------
# The ``hf-performer results`` command
# --------------------------------------------------------------------------------------------


_LABEL_LINES = "\n".join(f"  {k}: {v}" for k, v in LABELS.items())

_TARGET_LINES = (
    f"Targets:\n  issue 4: (c) within {TARGET_POINTS:g} points (metric x 100) of (a)\n"
    "  issue 5 (attention transfer): "
    + "; ".join(f"on {task} (f) within {points:g} points of (a)" for task, points in
                ATTENTION_TRANSFER_TARGET_POINTS.items())
    + f";\n    on any other task (f) at least {100 * ATTENTION_TRANSFER_TARGET_RATIO:g}% of (a)'s metric"
)

_DESCRIPTION = f"""Recovery results (issues 4 and 5): collect the runs of a task, plot the recovery curve, write
the table.

Run labels (fixed meanings; every label is optional):
{_LABEL_LINES}

(e) is the folder written by `hf-performer distill RUN_A E --feature-map hedgehog ...`, evaluated with
`hf-performer evaluate E --task TASK --output E/dev_metrics.json`; (f) is the recipe run on that folder.

{_TARGET_LINES}

  hf-performer results collect --task sst2 --run a=RUN_A --run b=CONVERTED/dev_metrics.json --run c=RUN_C \\
      --run d=RUN_D --run e=DISTILLED/dev_metrics.json --run f=RUN_F \\
      --protocol "MiniLM-L6, 8000 training examples, ..." --output benchmarks/results/recovery_sst2.json
  hf-performer results plot benchmarks/results/recovery_sst2.json
  hf-performer results table benchmarks/results/recovery_*.json --readme README.md
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``results`` subcommand (``collect``, ``plot``, ``table``) to ``subparsers``."""
    parser = subparsers.add_parser(
        "results",
        help="recovery results: collect runs into JSON, plot the recovery curve, write the README table",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="results_command", metavar="ACTION", required=True)

    collect_parser = actions.add_parser(
        "collect", help="gather the runs (a)-(f) of one task into one JSON file",
        description="Gather the labelled runs of one task (final dev metric, steps, examples, seed, wall time,\n"
                    "model settings, eval curve, recipe args, metrics backend; for (e) and (f) the summary of the\n"
                    "distilled folder's attention_transfer.json) and the target checks into one JSON file.\n\n"
                    + _LABEL_LINES + "\n\n" + _TARGET_LINES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    collect_parser.add_argument("--task", required=True, help="the task of the runs (sst2, imdb, a GLUE task)")
    collect_parser.add_argument("--run", action="append", required=True, metavar="LABEL=PATH",
                                help="a run: LABEL in " + ", ".join(LABELS) + "; PATH a recipe output folder or its "
                                     "metrics.json (a, c, d, f), or an `hf-performer evaluate` JSON or the folder "
                                     "holding it as dev_metrics.json (b, e) (repeat for each run)")
    collect_parser.add_argument("--command", action="append", default=None, metavar="LABEL=COMMAND",
                                help="the exact command line of a run (default: rebuilt from its recorded args)")
    collect_parser.add_argument("--protocol", default=None, help="free text: model, data, budget, hardware, ...")
    collect_parser.add_argument("--output", required=True, help="the JSON file to write")
    collect_parser.set_defaults(func=run_collect)

    plot_parser = actions.add_parser(
        "plot", help="plot the recovery curve of a collected JSON file as PNG",
        description="Dev metric vs optimizer steps: (a) softmax and (d) FAVOR+ direct from step 0; (c) FAVOR+ "
                    "recovery after (a)'s last step, starting from (b) (the converted model, untrained); (f) "
                    "attention transfer + fine-tuning (dashed) after (a)'s last step, starting from (e) (the "
                    "distilled model, not fine-tuned); the issue 4 target (dotted) and, with (e) or (f), the "
                    "issue 5 target (dash-dot).",
    )
    plot_parser.add_argument("results", metavar="FILE.json", help="a JSON file written by `results collect`")
    plot_parser.add_argument("--output", default=None, help="the PNG to write (default: FILE.png)")
    plot_parser.set_defaults(func=run_plot)

    table_parser = actions.add_parser(
        "table", help="the markdown results table of collected JSON files (optionally into the README)",
        description=f"Print the markdown table (task, run, metric, steps, examples, seed, wall time) of one or "
                    f"more collected JSON files, then per task the FAVOR+ runs (b, c, d) and the attention-transfer "
                    f"runs (e, f) side by side against (a) with the status of both targets (issue 4 and issue 5); "
                    f"with --readme, replace the text between {README_START} and {README_END} in that file "
                    f"(nothing else is changed).",
    )
    table_parser.add_argument("results", metavar="FILE.json", nargs="+", help="JSON files written by `results collect`")
    table_parser.add_argument("--readme", default=None, help="write the table between the markers of this file")
    table_parser.set_defaults(func=run_table)
    return parser


def _fail(action: str, error: Exception):
    raise SystemExit(f"hf-performer results {action}: error: {error}") from None


def run_collect(args: argparse.Namespace) -> int:
    try:
        runs = _parse_pairs(args.run, "--run")
        commands = _parse_pairs(args.command, "--command")
        results = collect(args.task, runs, args.protocol, commands)
    except ResultsError as error:
        _fail("collect", error)
    folder = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(folder, exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump(results, handle, indent=2)
        handle.write("\n")
    for label, run in results["runs"].items():
        print(f"({label}) {run['description']}: {results['main_metric']} {_points(run['metric']):.2f} "
              f"after {run['steps']} steps")
    target = results["target"]
    gap = f" (gap {target['gap_points']:+.2f} points)" if target["gap_points"] is not None else ""
    print(f"target (issue 4) {target['description']}: {target['status']}{gap}")
    print(f"attention-transfer target (issue 5) {results['attention_transfer_target']['description']}: "
          f"{_target_status(results['attention_transfer_target'], 'f', bold=False)}")
    print(f"wrote {args.output}")
    return 0


def run_plot(args: argparse.Namespace) -> int:
    output = args.output or os.path.splitext(args.results)[0] + ".png"
    try:
        plot(load_results(args.results), output)
    except ResultsError as error:
        _fail("plot", error)
    print(f"wrote {output}")
    return 0


def run_table(args: argparse.Namespace) -> int:
    try:
        text = table([load_results(path) for path in args.results], sources=args.results)
        if args.readme:
            replace_in_readme(args.readme, text)
    except ResultsError as error:
        _fail("table", error)
    sys.stdout.write(text)
    if args.readme:
        print(f"updated {args.readme}")
    return 0


__all__ = [
    "ATTENTION_TRANSFER_TARGET_POINTS",
    "ATTENTION_TRANSFER_TARGET_RATIO",
    "LABELS",
    "README_END",
    "README_START",
    "TARGET_POINTS",
    "ResultsError",
    "add_parser",
    "attention_transfer_summary",
    "attention_transfer_target_check",
    "collect",
    "comparison_table",
    "load_results",
    "load_run",
    "plot",
    "recipe_command",
    "replace_in_readme",
    "table",
    "target_check",
]
