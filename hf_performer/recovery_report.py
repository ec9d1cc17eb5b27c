"""Recovery results (issue 4): collect the runs of one task into a JSON file, plot the recovery curve, and
write the results table (into the README between markers).

The four runs of a task have fixed labels:

- ``a``: the softmax model fine-tuned on the task (``recipes/text_classification.py --attention softmax``);
- ``b``: (a) converted to FAVOR+ and evaluated with no further training (``hf-performer convert`` then
  ``hf-performer evaluate``);
- ``c``: (b) after FAVOR+ recovery fine-tuning (the recipe on the converted folder);
- ``d``: the base model converted to FAVOR+ and fine-tuned as FAVOR+ directly.

Commands::

    hf-performer results collect --task sst2 --run a=RUN_A --run b=B/dev_metrics.json --run c=RUN_C \\
        --run d=RUN_D --protocol "..." --output benchmarks/results/recovery_sst2.json
    hf-performer results plot benchmarks/results/recovery_sst2.json        # -> recovery_sst2.png
    hf-performer results table benchmarks/results/recovery_*.json --readme README.md

A training run is its output folder (``metrics.json`` and ``eval_curve.json`` written by the recipe) or its
``metrics.json``; an evaluation is the JSON written by ``hf-performer evaluate --output`` or the folder holding
it as ``dev_metrics.json`` / ``eval_metrics.json``.
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
}
"""The fixed meaning of each run label."""

TARGET_POINTS = 1.5
"""Issue 4's target: the recovered model (c) within this many points (metric x 100) of the softmax model (a)."""

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
        with open(path) as handle:
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


def load_run(label: str, path: str, command: str | None = None) -> dict:
    """One run as collected: its final dev metric, steps, examples, seed, wall time, model settings, curve.

    Args:
        label: ``a``, ``b``, ``c`` or ``d`` (see :data:`LABELS`).
        path: a recipe output folder / its ``metrics.json`` (training run), or an ``hf-performer evaluate``
            JSON / the folder holding it (evaluation only).
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
        return _training_run(label, file, folder, record, command)
    if "metrics" in record:
        return _evaluation_run(label, file, folder, record, command)
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


def collect(task: str, run_specs: dict[str, str], protocol: str | None = None,
            commands: dict[str, str] | None = None) -> dict:
    """The recovery results of one task (see the module docstring for the labels and the layout).

    Raises:
        ResultsError: no run, a run of another task, runs with different main metrics, unreadable files.
    """
    from .data import DataError, get_task

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
        "notes": notes,
        "machine": _machine(runs),
        "machine_note": "the machine `hf-performer results collect` ran on; each run records its own device",
        "collected": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _machine(runs: dict) -> dict:
    import torch

    from .benchmark import machine_info

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


def plot(results: dict, path: str) -> str:
    """The recovery curve: dev metric vs optimizer steps. (a) softmax and (d) FAVOR+ direct from step 0; (c)
    FAVOR+ recovery continues after (a)'s last step (its steps are counted from the conversion), with (b), the
    converted model before any training, as a marker at the conversion point; the target band under (a)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric, runs = results["main_metric"], results["runs"]
    if not any(label in runs for label in LABELS):
        raise ResultsError("nothing to plot: the results hold no run")
    fig, ax = plt.subplots(figsize=(8, 4.8))
    offset = int(runs["a"]["steps"]) if "a" in runs else 0
    colours = {"a": "tab:blue", "b": "tab:red", "c": "tab:orange", "d": "tab:green"}
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
        where = f"after (a)'s {offset} steps" if "a" in runs else "from the conversion"
        ax.plot(x, y, "^-", color=colours["c"],
                label=f"(c) FAVOR+ recovery ({runs['c']['steps']} steps, {where})")
    if "b" in runs:
        ax.plot([offset], [_points(runs["b"]["metric"])], "X", markersize=11, color=colours["b"], zorder=5,
                label=f"(b) (a) converted, no training: {_points(runs['b']['metric']):.2f}")
    if "a" in runs:
        a = _points(runs["a"]["metric"])
        threshold = results.get("target", {}).get("threshold_points", TARGET_POINTS)
        ax.axhline(a - threshold, color=colours["a"], linestyle=":", linewidth=1,
                   label=f"target: (a) - {threshold:g} points = {a - threshold:.2f}")
        if "c" in runs or "b" in runs:
            ax.axvline(offset, color="grey", linestyle="--", linewidth=0.8)
            ax.text(offset, 0.02, " conversion to FAVOR+ ", transform=ax.get_xaxis_transform(), ha="right",
                    va="bottom", fontsize=8, color="grey")
    xlabel = "optimizer steps"
    if "a" in runs and "c" in runs:
        xlabel += " ((c) continues after (a)'s last step: its total budget)"
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"dev {metric} (x100)")
    task = results["task"].upper() if len(results["task"]) <= 5 else results["task"]
    ax.set_title(f"{task}: FAVOR+ recovery vs softmax fine-tuning")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# Table
# --------------------------------------------------------------------------------------------


def _wall(run: dict) -> str:
    seconds = run.get("wall_time_s")
    if seconds is None:
        return "-"
    text = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
    return text + (" (eval only)" if run.get("kind") == "evaluated" else "")


def table(results_list: list[dict], sources: list[str] | None = None) -> str:
    """The markdown results table of one or more collected JSON files, followed by the target check per task."""
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
        if target.get("met") is None:
            status = f"not evaluated ({target.get('reason', '(a) or (c) missing')})"
        else:
            status = (f"**{target['status']}** (gap {target['gap_points']:+.2f} points: "
                      f"(a) {_points(target['a']):.2f}, (c) {_points(target['c']):.2f})")
        footer.append(f"- {results['task']} ({dev}): target {target.get('description')}: {status}.")
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


_DESCRIPTION = """Recovery results (issue 4): collect the runs of a task, plot the recovery curve, write the table.

Run labels (fixed meanings):
""" + "\n".join(f"  {k}: {v}" for k, v in LABELS.items()) + f"""

Target: (c) within {TARGET_POINTS} points (metric x 100) of (a).

  hf-performer results collect --task sst2 --run a=RUN_A --run b=CONVERTED/dev_metrics.json --run c=RUN_C \\
      --run d=RUN_D --protocol "MiniLM-L6, 8000 training examples, ..." --output benchmarks/results/recovery_sst2.json
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
        "collect", help="gather the runs (a)-(d) of one task into one JSON file",
        description="Gather the labelled runs of one task (final dev metric, steps, examples, seed, wall time, "
                    "model settings, eval curve, recipe args, metrics backend) and the target check into one JSON "
                    "file.\n\n" + "\n".join(f"  {k}: {v}" for k, v in LABELS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    collect_parser.add_argument("--task", required=True, help="the task of the runs (sst2, imdb, a GLUE task)")
    collect_parser.add_argument("--run", action="append", required=True, metavar="LABEL=PATH",
                                help="a run: LABEL in a, b, c, d; PATH a recipe output folder or its metrics.json, "
                                     "or an `hf-performer evaluate` JSON or the folder holding it as "
                                     "dev_metrics.json (repeat for each run)")
    collect_parser.add_argument("--command", action="append", default=None, metavar="LABEL=COMMAND",
                                help="the exact command line of a run (default: rebuilt from its recorded args)")
    collect_parser.add_argument("--protocol", default=None, help="free text: model, data, budget, hardware, ...")
    collect_parser.add_argument("--output", required=True, help="the JSON file to write")
    collect_parser.set_defaults(func=run_collect)

    plot_parser = actions.add_parser(
        "plot", help="plot the recovery curve of a collected JSON file as PNG",
        description="Dev metric vs optimizer steps: (a) softmax and (d) FAVOR+ direct from step 0; (c) FAVOR+ "
                    "recovery after (a)'s last step, starting from (b) (the converted model, untrained).",
    )
    plot_parser.add_argument("results", metavar="FILE.json", help="a JSON file written by `results collect`")
    plot_parser.add_argument("--output", default=None, help="the PNG to write (default: FILE.png)")
    plot_parser.set_defaults(func=run_plot)

    table_parser = actions.add_parser(
        "table", help="the markdown results table of collected JSON files (optionally into the README)",
        description=f"Print the markdown table (task, run, metric, steps, examples, seed, wall time) of one or "
                    f"more collected JSON files; with --readme, replace the text between {README_START} and "
                    f"{README_END} in that file (nothing else is changed).",
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
    print(f"target {target['description']}: {target['status']}{gap}")
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
    "LABELS",
    "README_END",
    "README_START",
    "TARGET_POINTS",
    "ResultsError",
    "add_parser",
    "collect",
    "load_results",
    "load_run",
    "plot",
    "recipe_command",
    "replace_in_readme",
    "table",
    "target_check",
]
