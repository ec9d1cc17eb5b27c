"""What a recipe run leaves behind, and the recovery results collected from such runs.

Run outputs: ``metrics.json`` (:data:`METRICS_FILE`, the final metrics, the kept step, the recorded arguments)
and ``eval_curve.json`` (:data:`EVAL_CURVE_FILE`, one point per evaluation), written by
:func:`write_run_results`; the recorded arguments carry no local paths (:func:`portable_name`,
:func:`without_local_paths`), as the files may go to the Hub.

Recovery results (issues 4 and 5): the runs of one task have fixed labels:

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
(f) at least 97% of (a)'s metric (see :func:`attention_transfer_target_check`). :func:`collect` gathers them
(``hf-performer results collect``); :mod:`hf_performer.recipes.report` plots and tabulates them.

A training run is its output folder (``metrics.json`` and ``eval_curve.json``) or its ``metrics.json``; an
evaluation is the JSON written by ``hf-performer evaluate --output`` or the folder holding it as
``dev_metrics.json`` / ``eval_metrics.json``. Every label is optional; files collected before (e) and (f)
existed (runs a-d only) are read, plotted and tabulated as they are.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex

from .arguments import recipe_command, recorded_value

METRICS_FILE = "metrics.json"
"""The final metrics of a recipe run (written by :func:`write_run_results`)."""

EVAL_CURVE_FILE = "eval_curve.json"
"""One point per evaluation of a recipe run (written by :func:`write_run_results`)."""


# --------------------------------------------------------------------------------------------
# Writing a run's results
# --------------------------------------------------------------------------------------------


def json_safe_args(args) -> dict:
    """Hyperparameters for TensorBoard (scalars and strings only)."""
    config = {}
    for key, value in vars(args).items():
        if key == "func":
            continue
        config[key] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return config


PATH_ARGS = ("model", "tokenizer", "train_file", "validation_file", "output_dir", "teacher_model")
"""Recipe arguments that may be local paths: recorded by :func:`portable_name` (metrics.json goes to the Hub)."""


def portable_name(name_or_path: str | None) -> str | None:
    """``name_or_path`` as a file meant for the Hub may record it: a Hub id (``org/name``, not a local path) is
    kept, a local path becomes its base name (no ``/home/...``, ``/tmp/...`` reaches a shared file)."""
    if name_or_path is None:
        return None
    text = str(name_or_path)
    if os.path.exists(text) or os.path.isabs(text) or "\\" in text or text.startswith((".", "~")):
        return os.path.basename(os.path.normpath(os.path.abspath(os.path.expanduser(text.replace("\\", "/")))))
    return text


_LOCAL_PATH = re.compile(r"(?<![\w.:/~-])[~/][^\s'\"(),;:]*")


def without_local_paths(text: str | None) -> str | None:
    """``text`` (e.g. an error message quoted in metrics.json) with each absolute or ``~`` path replaced by its
    base name; URLs and fractions such as ``1/2`` are left alone."""
    if not text:
        return text

    def base_name(match: re.Match) -> str:
        path = match.group(0)
        stripped = path.rstrip(".")  # a sentence's full stop is not part of the path
        return (os.path.basename(stripped.rstrip("/")) or stripped) + path[len(stripped):]

    return _LOCAL_PATH.sub(base_name, text)


def portable_checkpoint(path: str | None, output_dir: str) -> str | None:
    """A checkpoint folder relative to the output folder when inside it (``checkpoints/step_N``), else its base
    name; ``latest`` as it is."""
    if path is None or path == "latest":
        return path
    relative = os.path.relpath(os.path.abspath(path), os.path.abspath(output_dir))
    return relative if not relative.startswith("..") else portable_name(path)


def recorded_args(args) -> dict:
    """The arguments as ``metrics.json`` and TensorBoard record them: scalars and strings, no local paths."""
    config = json_safe_args(args)
    for key in PATH_ARGS:
        if key in config and config[key] is not None:
            config[key] = portable_name(config[key])
    if "resume_from_checkpoint" in config:
        config["resume_from_checkpoint"] = portable_checkpoint(args.resume_from_checkpoint, args.output_dir)
    return config


def write_run_results(output_dir: str, metrics: dict, curve: list[dict]) -> None:
    """Write :data:`METRICS_FILE` (``metrics``) and :data:`EVAL_CURVE_FILE` (``curve``) into ``output_dir``."""
    with open(os.path.join(output_dir, METRICS_FILE), "w") as handle:
        json.dump(metrics, handle, indent=2)
    with open(os.path.join(output_dir, EVAL_CURVE_FILE), "w") as handle:
        json.dump(curve, handle, indent=2)


# --------------------------------------------------------------------------------------------
# Recovery results: reading runs
# --------------------------------------------------------------------------------------------


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

TRAINING_FILES = (METRICS_FILE,)
EVALUATION_FILES = ("dev_metrics.json", "eval_metrics.json")

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


def _recorded_model_folder(model: str | None, record_folder: str) -> str:
    """The model folder an ``hf-performer evaluate`` record names: as written by older versions (an absolute or
    working-directory path), or relative to the record's own folder (what ``evaluate --output`` writes now)."""
    if not model:
        return ""
    if os.path.isabs(model) or os.path.isdir(model):
        return model
    return os.path.normpath(os.path.join(record_folder, model))


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


def number_or_none(value):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _mean(values: list) -> float | None:
    values = [v for v in values if number_or_none(v) is not None]
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
            "before": number_or_none(old.get("own_inputs_relative_error")),
            "after": number_or_none(new.get("own_inputs_relative_error")),
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
        "final_loss_per_layer": number_or_none(last.get("loss_per_layer")),
        "wall_time_s": record.get("wall_time_s"),
        "own_inputs_relative_error": layers,
        "mean_own_inputs_relative_error": {"before": _mean([e["before"] for e in linear]),
                                           "after": _mean([e["after"] for e in linear]),
                                           "layers": len(linear)},
        "final_hidden_state_cosine": {"before": number_or_none(before.get("final_hidden_state_cosine")),
                                      "after": number_or_none(after.get("final_hidden_state_cosine"))},
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
        return _with_transfer(run, recorded_value((record.get("args") or {}).get("model")) or "",
                              (record.get("model") or {}).get("source") or "")
    if "metrics" in record:
        run = _evaluation_run(label, file, folder, record, command)
        return _with_transfer(run, _recorded_model_folder(record.get("model"), folder), folder)
    raise ResultsError(f"{file} is neither a recipe metrics.json (keys final, completed_steps, ...) nor an "
                       "`hf-performer evaluate` record (keys metrics, main_metric, ...)")


def _training_run(label: str, file: str, folder: str, record: dict, command: str | None) -> dict:
    _require(record, ("task", "main_metric", "final", "completed_steps"), file)
    main = record["main_metric"]
    if main not in record["final"]:
        raise ResultsError(f"{file}: the main metric {main!r} is not in final ({', '.join(record['final'])})")
    args = record.get("args") or {}
    curve_path = os.path.join(folder, EVAL_CURVE_FILE)
    if os.path.isfile(curve_path):
        curve = _read_json(curve_path, f"run {label} curve")
        if not isinstance(curve, list) or any(not isinstance(p, dict) or "step" not in p for p in curve):
            raise ResultsError(f"{curve_path}: expected a list of points with a 'step' key")
        curve_source = curve_path
    else:
        curve = [{"step": record["completed_steps"], **record["final"]}]
        curve_source = f"final metrics only ({EVAL_CURVE_FILE} not found next to {os.path.basename(file)})"
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
        "seed": recorded_value(args.get("seed")),
        "wall_time_s": record.get("wall_time_s"),
        "wall_time_note": "training, including the evaluations along the way",
        "device": record.get("device"),
        "num_processes": record.get("num_processes"),
        "mixed_precision": record.get("mixed_precision"),
        "model": model,
        "favor_settings": model.get("favor_settings") or _favor_settings_near(recorded_value(args.get("model")) or ""),
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
    model_folder = _recorded_model_folder(model_path, folder)
    settings = _favor_settings_near(model_folder, folder)
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
        "model": {"source": model_path, "converted_from": _conversion_source(model_folder, folder),
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


def as_points(value: float) -> float:
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
    gap = round(as_points(a) - as_points(c), 6)
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
    gap = round(as_points(a) - as_points(f), 6)
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
    from ..tasks.data import DataError, get_task

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

    from ..bench.machine import machine_info

    device = torch.device("cpu")
    if torch.cuda.is_available() and any(str(run.get("device") or "").startswith("cuda") for run in runs.values()):
        device = torch.device("cuda")
    return machine_info(device)


def parse_label_pairs(values: list[str] | None, option: str) -> dict[str, str]:
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


def transfer_target(results: dict) -> dict:
    """Issue 5's check of a collected file (computed when the file predates it)."""
    return results.get("attention_transfer_target") or attention_transfer_target_check(results["runs"],
                                                                                     results["task"])


