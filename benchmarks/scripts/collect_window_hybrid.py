"""Collect the sink + sliding-window hybrid experiment on a causal LM (issue 15) into one JSON + PNG.

    python benchmarks/scripts/collect_window_hybrid.py \\
        --arm softmax_lora=OUT/softmax_lora --arm hybrid_lora=OUT/hybrid_lora ... \\
        --eval softmax_lora=OUT/eval/softmax_lora_ctx1024.json --eval softmax_lora=OUT/eval/softmax_lora_passkey.json \\
        ... --timings OUT/timings.tsv --command "PROFILE=short bash benchmarks/scripts/smollm2_window_hybrid.sh" \\
        --output benchmarks/results/window_hybrid_smollm2.json

Arms (any subset; the comparisons need both of their arms):

* ``softmax_zeroshot``: the source model, no training;
* ``hybrid_zeroshot`` / ``window_zeroshot``: ``hf-performer linearize ... --transfer-steps 0 --lora-steps 0`` (with
  ``--no-tail`` for window-only: sinks + window exact softmax, no linear tail): converted, not trained;
* ``softmax_lora``: ``linearize --baseline softmax``: the softmax model given the same LoRA budget (the fair baseline);
* ``hybrid_transfer``: ``hybrid_lora``'s model after the attention transfer, before LoRA (``linearize --stop-after
  transfer``; evaluation records only);
* ``hybrid_lora``: ``linearize``: attention transfer of the tail, then LoRA;
* ``window_lora``: ``linearize --no-tail``: window-only, the same LoRA budget (the tail ablation).

Inputs, as the package's tools write them: ``--arm NAME=DIR`` a ``hf-performer linearize`` output folder (its
``linearize.json``: kind, settings, stages with wall times and tokens seen, the loss curve); ``--eval NAME=FILE``
an ``hf-performer evaluate --output`` record of that arm: perplexity (any ``--context-length``, with
``--position-ranges`` for the position split) or ``--task passkey``. Every perplexity in the result comes from the
evaluate records (one protocol for all arms), not from linearize's own closing evaluation.

The JSON holds: per arm, perplexity per context (and per window-position range), passkey accuracy per (context
length, depth), tokens seen, wall times; the ratio hybrid + LoRA / softmax + LoRA at each context with the target
(<= 1.10x; stretch 1.05x); zero-shot ratios; the tail ablation (hybrid vs window-only, overall and at the far
positions); the ratio against tokens seen (the LoRA training losses of the two arms at equal steps, plus the
evaluated points); the pipeline's step timings, the machine and the command. Paths are recorded relative to the
runs folder (no local absolute path). A PNG with the same name is written beside it.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import math
import os
import shlex
import sys

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(SCRIPTS))
DEFAULT_OUTPUT = os.path.join(REPO, "benchmarks", "results", "window_hybrid_smollm2.json")
SCHEMA = "lm-window-hybrid/1"
TARGET_RATIO = 1.10
STRETCH_RATIO = 1.05
LINEARIZE_FILE = "linearize.json"

ARMS = {
    "softmax_zeroshot": "softmax, no training",
    "hybrid_zeroshot": "hybrid (sinks + window + linear tail), converted, no training",
    "window_zeroshot": "window-only (sinks + window), converted, no training",
    "softmax_lora": "softmax + LoRA (the baseline: same LoRA budget)",
    "hybrid_transfer": "hybrid after attention transfer, before LoRA",
    "hybrid_lora": "hybrid: attention transfer + LoRA",
    "window_lora": "window-only + LoRA (tail ablation, same LoRA budget)",
    "hybrid_worst_softmax_lora": "hybrid with the layers the tail fits worst back on exact softmax (linearize "
                            "--softmax-worst K): transfer + select + LoRA",
}
SHORT_LABELS = {"softmax_zeroshot": "softmax\n0-shot", "hybrid_zeroshot": "hybrid\n0-shot",
                "window_zeroshot": "window\n0-shot", "softmax_lora": "softmax\n+LoRA",
                "hybrid_transfer": "hybrid\ntransfer",
                "hybrid_lora": "hybrid\ntransfer+LoRA", "window_lora": "window\n+LoRA",
                "hybrid_worst_softmax_lora": "hybrid, worst\nlayers softmax"}
COLOURS = {"softmax_zeroshot": "#9ecae1", "softmax_lora": "#3182bd", "hybrid_zeroshot": "#bcbddc",
           "hybrid_transfer": "#9e9ac8",
           "hybrid_lora": "#756bb1", "window_zeroshot": "#fdae6b", "window_lora": "#e6550d",
           "hybrid_worst_softmax_lora": "#54278f"}


def _load_sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"_collect_{name}", os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_lm = _load_sibling("collect_lm_transfer")  # the perplexity-record reader, JSON loading, protocol check, machine
CollectError = _lm.CollectError


# --------------------------------------------------------------------------------------------
# Reading the inputs
# --------------------------------------------------------------------------------------------


def parse_pairs(values: list[str], option: str) -> list[tuple[str, str]]:
    """``NAME=PATH`` pairs with a known arm name."""
    pairs = []
    for value in values:
        name, separator, path = value.partition("=")
        if not separator or not path:
            raise CollectError(f"{option} expects NAME=PATH, got {value!r}")
        if name not in ARMS:
            raise CollectError(f"{option} {value!r}: unknown arm {name!r}; accepted: {', '.join(ARMS)}")
        pairs.append((name, path))
    return pairs


def read_linearize(folder: str, arm: str) -> dict:
    """A ``hf-performer linearize`` output folder, summarised (its ``linearize.json``)."""
    from hf_performer.recipes.results import without_local_paths

    path = os.path.join(folder, LINEARIZE_FILE) if os.path.isdir(folder) else folder
    record = _lm._load_json(path, f"--arm {arm}")
    stages = _lm._require(record, ("stages",), f"--arm {arm}", path)
    settings = record.get("settings") or {}
    stage_rows = {}
    for name, stage in stages.items():
        details = stage.get("details") or {}
        stage_rows[name] = {"status": stage.get("status"), "reason": stage.get("reason"),
                            "wall_time_s": stage.get("wall_time_s"), "tokens_seen": stage.get("tokens_seen"),
                            "steps_done": details.get("steps_done")}
    curve = [point for point in record.get("curve") or [] if isinstance(point, dict)]
    return {
        "file": path,
        "kind": record.get("kind"),
        "settings": {key: settings.get(key) for key in (
            "source", "train_files", "max_train_chars", "feature_map", "window", "sinks", "linear_tail",
            "transfer_steps", "transfer_length", "transfer_batch_size", "transfer_learning_rate", "transfer_schedule",
            "lora_steps", "block_size", "batch_size", "gradient_accumulation_steps", "learning_rate", "lora_r", "lora_alpha",
            "baseline", "seed", "time_limit", "softmax_layers", "softmax_worst") if key in settings},
        "stages": stage_rows,
        "tokens_seen": record.get("tokens_seen"),
        "transfer_tokens_seen": (stages.get("transfer") or {}).get("tokens_seen", 0),
        "softmax_layers": ((stages.get("select") or {}).get("details") or {}).get(
            "softmax_layers", settings.get("softmax_layers") or []),
        "lora_tokens_seen": (stages.get("lora") or {}).get("tokens_seen", 0),
        "wall_time_s": record.get("wall_time_s"),
        "linearize_perplexity": record.get("perplexity"),
        "lora_loss_curve": [{"step": p.get("step"), "tokens_seen": p.get("tokens_seen"), "loss": p.get("loss")}
                            for p in curve if p.get("stage") == "lora" and _number(p.get("loss"))],
        "machine": record.get("machine"),
        "command": without_local_paths(record.get("command")),
    }


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_eval(path: str, arm: str) -> tuple[str, dict]:
    """An evaluate record: ``("perplexity", row)`` or ``("passkey", row)``."""
    what = f"--eval {arm}"
    record = _lm._load_json(path, what)
    if record.get("task") == "passkey":
        cells = _lm._require(record, ("cells",), what, path)
        protocol = record.get("protocol") or {}
        return "passkey", {
            "file": path, "accuracy": (record.get("metrics") or {}).get("passkey_accuracy"),
            "by_context_length": {str(length): (record.get("metrics") or {}).get(f"passkey_accuracy_{length}")
                                  for length in protocol.get("context_lengths", [])},
            "cells": [{key: cell.get(key) for key in ("context_length", "depth", "trials", "accuracy",
                                                     "key_log_likelihood_mean")} for cell in cells],
            "protocol": protocol, "eval_seconds": record.get("eval_seconds"),
        }
    row = _lm.read_evaluation(path, what)
    ranges = {f"{entry['start']}:{entry['end']}": {"perplexity": entry.get("perplexity"),
                                                    "num_predictions": entry.get("num_predictions")}
              for entry in record.get("position_ranges") or []}
    protocol = row["protocol"]
    return "perplexity", {
        "file": path, "perplexity": row["perplexity"], "nll": row["nll"], "position_ranges": ranges,
        "protocol": {**protocol, "data": os.path.basename(str(protocol.get("data") or "")) or None},
        "eval_seconds": row["eval_seconds"], "device": row["device"],
    }


def read_timings(path: str) -> dict[str, float]:
    """The pipeline's ``timings.tsv`` (``step<TAB>seconds``; the last run of a step counts)."""
    if not os.path.isfile(path):
        raise CollectError(f"--timings: {path} does not exist")
    timings = {}
    with open(path, encoding="utf-8") as handle:
        for row in csv.reader(handle, delimiter="\t"):
            if len(row) == 2 and row[1].strip().lstrip("-").isdigit():
                timings[row[0]] = float(row[1])
    return timings


# --------------------------------------------------------------------------------------------
# Comparisons
# --------------------------------------------------------------------------------------------


def same_tokens(first: dict, second: dict) -> tuple[bool, str]:
    """Whether two perplexity rows scored the same windows of the same text."""
    for key in ("context_length", "stride", "windows", "num_tokens", "data"):
        if first["protocol"].get(key) != second["protocol"].get(key):
            return False, f"{key} {first['protocol'].get(key)} != {second['protocol'].get(key)}"
    return True, ""


def ratio_row(arms: dict, numerator: str, denominator: str, context: str, position_range: str | None = None) -> dict:
    """``perplexity(numerator) / perplexity(denominator)`` at one context (and window-position range), or why not."""
    row = {"numerator": numerator, "denominator": denominator, "context_length": int(context),
           "position_range": position_range, "ratio": None}
    first = (arms.get(numerator) or {}).get("perplexity", {}).get(context)
    second = (arms.get(denominator) or {}).get("perplexity", {}).get(context)
    if first is None or second is None:
        row["missing"] = "not measured: " + ", ".join(
            name for name, value in ((numerator, first), (denominator, second)) if value is None)
        return row
    comparable, why = same_tokens(first, second)
    if not comparable:
        row["missing"] = f"not comparable (different evaluation: {why})"
        return row
    if position_range is None:
        row.update(numerator_perplexity=first["perplexity"], denominator_perplexity=second["perplexity"])
    else:
        a, b = first["position_ranges"].get(position_range), second["position_ranges"].get(position_range)
        if a is None or b is None:
            row["missing"] = f"positions {position_range} not measured (evaluate --position-ranges)"
            return row
        row.update(numerator_perplexity=a["perplexity"], denominator_perplexity=b["perplexity"])
    row["ratio"] = row["numerator_perplexity"] / row["denominator_perplexity"]
    return row


def target_check(ratio: dict, threshold: float, stretch: float) -> dict:
    value = ratio.get("ratio")
    status = "not measured" if value is None else ("met" if value <= threshold else "not met")
    return {"rule": f"hybrid transfer + LoRA perplexity <= {threshold:g} x softmax + LoRA (same LoRA budget), "
                    f"context {ratio['context_length']}", "threshold_ratio": threshold, "stretch_ratio": stretch,
            "ratio": value, "status": status, "stretch_met": None if value is None else value <= stretch,
            **({"missing": ratio["missing"]} if "missing" in ratio else {})}


def tokens_curve(arms: dict, ratios: dict) -> dict:
    """The hybrid's perplexity ratio to softmax against the hybrid's tokens seen.

    Evaluated points: zero-shot (no tokens), after the transfer alone (its tokens, against softmax zero-shot) and
    after transfer + LoRA (all its tokens, against softmax + LoRA), at context 1024. Between
    them, each LoRA step's training loss of the two arms (same data, same order, same steps):
    ``exp(loss_hybrid - loss_softmax)``, the ratio of their training-batch perplexities, placed at the hybrid's
    tokens seen (transfer tokens + LoRA tokens)."""
    hybrid, softmax = arms.get("hybrid_lora") or {}, arms.get("softmax_lora") or {}
    points = []
    zero_shot = ratios.get("hybrid_zeroshot_to_softmax_zeroshot_1024") or {}
    if zero_shot.get("ratio") is not None:
        points.append({"tokens_seen": 0, "ratio": zero_shot["ratio"], "source": "evaluation, zero-shot"})
    training = []
    hybrid_run, softmax_run = hybrid.get("linearize"), softmax.get("linearize")
    transferred = ratios.get("hybrid_transfer_to_softmax_zeroshot_1024") or {}
    if transferred.get("ratio") is not None and hybrid_run:
        points.append({"tokens_seen": hybrid_run["transfer_tokens_seen"], "ratio": transferred["ratio"],
                       "source": "evaluation, after the attention transfer (before LoRA) vs softmax zero-shot"})
    if hybrid_run and softmax_run:
        softmax_loss = {p["step"]: p["loss"] for p in softmax_run["lora_loss_curve"]}
        for point in hybrid_run["lora_loss_curve"]:  # linearize.json counts tokens over its stages (transfer first)
            if point["step"] in softmax_loss:
                training.append({"step": point["step"], "tokens_seen": point["tokens_seen"],
                                 "ratio": math.exp(point["loss"] - softmax_loss[point["step"]]),
                                 "source": "LoRA training loss at the same step"})
    final = ratios.get("hybrid_lora_to_softmax_lora_1024") or {}
    if final.get("ratio") is not None and hybrid_run:
        points.append({"tokens_seen": hybrid_run["tokens_seen"], "ratio": final["ratio"],
                       "source": "evaluation, after transfer + LoRA"})
    return {"what": "perplexity of the hybrid / perplexity of softmax against the hybrid's training tokens "
                    "(transfer + LoRA); evaluated points at context 1024 (zero-shot vs zero-shot, transferred vs softmax "
                    "zero-shot, final vs the "
                    "softmax baseline after the same LoRA) and the per-step training-loss ratio of the two LoRA runs",
            "evaluated": points, "training_loss": training}


# --------------------------------------------------------------------------------------------
# Assembling
# --------------------------------------------------------------------------------------------


def _relative(path: str, base: str) -> str:
    relative = os.path.relpath(os.path.abspath(path), base)
    return relative if not relative.startswith("..") else os.path.basename(os.path.normpath(path))


def build_record(args: argparse.Namespace) -> dict:
    from hf_performer.recipes.results import without_local_paths

    arm_dirs = parse_pairs(args.arm, "--arm")
    eval_files = parse_pairs(args.eval, "--eval")
    if not arm_dirs and not eval_files:
        raise CollectError("nothing to collect: give --arm NAME=DIR and/or --eval NAME=FILE")
    inputs = [path for _, path in arm_dirs + eval_files]
    base = args.runs_dir or os.path.commonpath([os.path.abspath(path) for path in inputs])
    base = os.path.abspath(base if os.path.isdir(base) else os.path.dirname(base))
    arms: dict[str, dict] = {}

    def arm(name: str) -> dict:
        return arms.setdefault(name, {"label": ARMS[name], "trained": name.endswith("_lora"), "perplexity": {},
                                      "passkey": None, "linearize": None, "eval_seconds_total": 0.0})

    reused_notes = []
    for name, folder in arm_dirs:
        run = read_linearize(folder, name)
        run["file"] = _relative(run["file"], base)
        arm(name)["linearize"] = run
        if os.path.islink(os.path.normpath(folder)):  # a finished arm of another run, linked in (the pipeline's header)
            target = os.path.realpath(folder)
            origin = f"{os.path.basename(os.path.dirname(target))}/{os.path.basename(target)}"
            arm(name)["reused_from"] = origin
            reused_notes.append(f"{name}: reused from another run's folder ({origin}), trained there and not "
                                "retrained by this one; its wall times are that run's")
    for name, path in eval_files:
        kind, row = read_eval(path, name)
        row["file"] = _relative(path, base)
        entry = arm(name)
        entry["eval_seconds_total"] += row.get("eval_seconds") or 0.0
        if kind == "passkey":
            if entry["passkey"] is not None:
                raise CollectError(f"--eval {name}: two passkey records ({entry['passkey']['file']}, {row['file']})")
            entry["passkey"] = row
        else:
            context = str(row["protocol"]["context_length"])
            if context in entry["perplexity"]:
                raise CollectError(f"--eval {name}: two perplexity records at context {context}")
            entry["perplexity"][context] = row
    arms = {name: arms[name] for name in ARMS if name in arms}
    for name, entry in arms.items():
        run = entry["linearize"]
        entry["tokens_seen"] = run["tokens_seen"] if run else 0
        entry["training_wall_time_s"] = run["wall_time_s"] if run else 0.0

    contexts = sorted({context for entry in arms.values() for context in entry["perplexity"]}, key=int)
    ratios = {}
    for context in contexts:
        for numerator, denominator in (("hybrid_lora", "softmax_lora"), ("window_lora", "softmax_lora"),
                                       ("hybrid_worst_softmax_lora", "softmax_lora"),
                                       ("hybrid_lora", "hybrid_worst_softmax_lora"),
                                       ("hybrid_zeroshot", "softmax_zeroshot"),
                                       ("hybrid_transfer", "softmax_zeroshot"), ("window_zeroshot", "hybrid_transfer"),
                                       ("window_zeroshot", "softmax_zeroshot"), ("window_lora", "hybrid_lora"),
                                       ("window_zeroshot", "hybrid_zeroshot")):
            row = ratio_row(arms, numerator, denominator, context)
            if "missing" not in row or not row["missing"].startswith("not measured"):
                ratios[f"{numerator}_to_{denominator}_{context}"] = row
    far = f"{args.far_start}:{args.far_end}"
    ablation = {
        "what": "window-only / hybrid perplexity after the same training (> 1: the linear tail helps); far = window "
                f"positions {far} of each {args.far_end}-token window, where the window (and sinks) cannot reach "
                "most of the context",
        "trained_overall": ratio_row(arms, "window_lora", "hybrid_lora", str(args.far_end)),
        "trained_far_positions": ratio_row(arms, "window_lora", "hybrid_lora", str(args.far_end), far),
        "zero_shot_overall": ratio_row(arms, "window_zeroshot", "hybrid_zeroshot", str(args.far_end)),
        "zero_shot_far_positions": ratio_row(arms, "window_zeroshot", "hybrid_zeroshot", str(args.far_end), far),
        "softmax_far_positions": ratio_row(arms, "hybrid_lora", "softmax_lora", str(args.far_end), far),
    }
    trained = ablation["trained_far_positions"]
    ablation["tail_measurably_better"] = None if trained["ratio"] is None else trained["ratio"] > 1.0 + args.margin
    ablation["margin"] = args.margin
    main = ratio_row(arms, "hybrid_lora", "softmax_lora", "1024")
    passkey_table = [{"arm": name, "context_length": int(length), "accuracy": accuracy}
                     for name, entry in arms.items() if entry["passkey"]
                     for length, accuracy in entry["passkey"]["by_context_length"].items()]
    record = {
        "schema": SCHEMA,
        "title": args.title,
        "source_model": next((entry["linearize"]["settings"].get("source") for entry in arms.values()
                              if entry["linearize"]), None),
        "protocol": without_local_paths(args.protocol),
        "profile": args.profile,
        "arms": arms,
        "ratios": ratios,
        "target": target_check(main, args.target_ratio, args.stretch_ratio),
        "contexts": {context: {name: entry["perplexity"][context]["perplexity"] for name, entry in arms.items()
                               if context in entry["perplexity"]} for context in contexts},
        "tail_ablation": ablation,
        "passkey": passkey_table,
        "ratio_vs_tokens_seen": tokens_curve(arms, ratios),
        "wall_times": {"pipeline_steps_s": read_timings(args.timings) if args.timings else None,
                       "arms": {name: {"training_s": entry["training_wall_time_s"],
                                       "evaluation_s": round(entry["eval_seconds_total"], 3),
                                       "stages": (entry["linearize"] or {}).get("stages")}
                                for name, entry in arms.items()}},
        "machine": _lm.machine_info(),
        "command": without_local_paths(args.command),
        "runs_dir": "the pipeline's OUT folder (file paths below are relative to it)",
        "collected_by": without_local_paths(shlex.join(
            ["python", "benchmarks/scripts/collect_window_hybrid.py",
             *[_portable_argument(value) for value in getattr(args, "argv", [])]])),
        "notes": [without_local_paths(note) for note in [*args.notes, *reused_notes]],
    }
    warnings = [f"{key}: {row['missing']}" for key, row in ratios.items() if "missing" in row]
    if warnings:
        record["warnings"] = warnings
    return record


def _portable_argument(value: str) -> str:
    """A command-line value with local absolute paths cut to their base name (``NAME=/tmp/x/y`` -> ``NAME=y``)."""
    name, separator, path = value.partition("=")
    if separator and os.path.isabs(path):
        return f"{name}={os.path.basename(os.path.normpath(path))}"
    return os.path.basename(os.path.normpath(value)) if os.path.isabs(value) else value


# --------------------------------------------------------------------------------------------
# Plot and text summary
# --------------------------------------------------------------------------------------------


def _readable_top(values: list[float], spread: float = 20.0) -> float | None:
    """The top of a linear axis that keeps the values within ``spread`` x the smallest readable: ``None`` when all
    are (no clipping), else 1.25 x the largest of them; the rest (e.g. an untrained tail, orders of magnitude off)
    are drawn clipped at the top and labelled by :func:`_mark_off_scale`."""
    positive = [value for value in values if value and value > 0]
    if not positive or max(positive) <= spread * min(positive):
        return None
    return 1.25 * max(value for value in positive if value <= spread * min(positive))


def _mark_off_scale(axis, points: list[tuple[float, float]], top: float, marker: bool = False) -> None:
    """Label each ``(x, value)`` above ``top`` at the top of ``axis`` with its value, written down the clipped bar
    (or, with ``marker``, beside a triangle at the top: a point)."""
    for x, value in points:
        if value <= top:
            continue
        if marker:
            axis.plot([x], [top], "^", color="#b30000", clip_on=False)
            axis.annotate(f" {value:.3g} (off scale)", (x, top), ha="left", va="top", fontsize=7, color="#b30000")
        else:
            axis.annotate(f"{value:.3g} (off scale)", (x, top * 0.98), ha="center", va="top", rotation=90,
                          fontsize=7, color="#b30000")


def plot(record: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = record["arms"]
    fig, axes = plt.subplots(2, 3, figsize=(19, 10))
    (bars_axis, far_axis, context_axis), (curve_axis, passkey_axis, time_axis) = axes

    names = [name for name in arms if "1024" in arms[name]["perplexity"]]
    values = [arms[name]["perplexity"]["1024"]["perplexity"] for name in names]
    bars = bars_axis.bar(range(len(names)), values, color=[COLOURS[name] for name in names])
    bars_axis.set_xticks(range(len(names)), [SHORT_LABELS[name] for name in names], fontsize=8)
    top = _readable_top(values)
    for bar, value in zip(bars, values):
        if top is None or value <= top:
            bars_axis.annotate(f"{value:.3g}", (bar.get_x() + bar.get_width() / 2, value), ha="center",
                               va="bottom", fontsize=8)
    if top is not None:
        bars_axis.set_ylim(0, top)
        _mark_off_scale(bars_axis, [(bar.get_x() + bar.get_width() / 2, value) for bar, value in zip(bars, values)],
                        top)
    target = record["target"]
    softmax = arms.get("softmax_lora", {}).get("perplexity", {}).get("1024")
    if softmax:
        for ratio, style in ((target["threshold_ratio"], "--"), (target["stretch_ratio"], ":")):
            bars_axis.axhline(ratio * softmax["perplexity"], color="#756bb1", linestyle=style, linewidth=1,
                              label=f"{ratio:g} x softmax + LoRA")
        bars_axis.legend(fontsize=7)
    ratio_text = "-" if target["ratio"] is None else f"{target['ratio']:.3f}"
    worst = (record["ratios"].get("hybrid_worst_softmax_lora_to_softmax_lora_1024") or {}).get("ratio")
    worst_text = "" if worst is None else f"; worst layers on softmax: {worst:.3f}"
    bars_axis.set_title(f"perplexity, context 1024 (stride 512)\nhybrid+LoRA / softmax+LoRA = {ratio_text}: target "
                        f"{target['status']}{worst_text}", fontsize=9)
    bars_axis.set_ylabel("perplexity (lower is better)")

    far = f"{record['tail_ablation']['trained_far_positions']['position_range']}"
    split = [name for name in names if len(arms[name]["perplexity"]["1024"]["position_ranges"]) > 0]
    ranges = sorted({key for name in split for key in arms[name]["perplexity"]["1024"]["position_ranges"]},
                    key=lambda key: int(key.split(":")[0]))
    width = 0.8 / max(len(ranges), 1)
    placed = []
    for index, key in enumerate(ranges):
        heights = [arms[name]["perplexity"]["1024"]["position_ranges"].get(key, {}).get("perplexity") or 0
                   for name in split]
        places = [x + (index - (len(ranges) - 1) / 2) * width for x in range(len(split))]
        far_axis.bar(places, heights, width, label=f"window positions {key}", alpha=0.9 if key == far else 0.5)
        placed += zip(places, heights)
    far_top = _readable_top([height for _, height in placed])
    if far_top is not None:
        far_axis.set_ylim(0, far_top)
        _mark_off_scale(far_axis, placed, far_top)
    far_axis.set_xticks(range(len(split)), [SHORT_LABELS[name] for name in split], fontsize=8)
    trained_windows = [entry["linearize"]["settings"].get("window") for entry in arms.values()
                       if entry["linearize"] and entry["linearize"]["kind"] != "baseline-softmax"]
    windows = sorted({window for window in trained_windows if window})
    window_text = f"the {'/'.join(map(str, windows))}-token window" if windows else "the window"
    far_axis.set_title("perplexity by position inside each 1024-token window\n(the tail serves positions far "
                       f"beyond {window_text})", fontsize=9)
    if ranges:
        far_axis.legend(fontsize=7)

    for name in names:
        points = sorted((int(context), row["perplexity"]) for context, row in arms[name]["perplexity"].items())
        if len(points) > 1:
            context_axis.plot(*zip(*points), "o-", color=COLOURS[name], label=SHORT_LABELS[name].replace("\n", " "))
    context_axis.set_xscale("log", base=2)
    context_axis.set_xlabel("context length (tokens)")
    context_axis.set_ylabel("perplexity")
    context_axis.set_title("perplexity against context length", fontsize=9)
    if context_axis.get_lines():
        context_axis.legend(fontsize=7)

    curve = record["ratio_vs_tokens_seen"]
    if curve["training_loss"]:
        curve_axis.plot([p["tokens_seen"] for p in curve["training_loss"]],
                        [p["ratio"] for p in curve["training_loss"]], "-", color="#bcbddc", linewidth=1,
                        label="exp(train loss hybrid - softmax), LoRA steps")
    if curve["evaluated"]:
        curve_axis.plot([p["tokens_seen"] for p in curve["evaluated"]], [p["ratio"] for p in curve["evaluated"]],
                        "o", color="#756bb1", label="evaluated (context 1024)")
    curve_axis.axhline(target["threshold_ratio"], color="black", linestyle="--", linewidth=1,
                       label=f"target {target['threshold_ratio']:g}x")
    curve_axis.set_xlabel("hybrid training tokens (transfer + LoRA)")
    curve_axis.set_ylabel("perplexity ratio hybrid / softmax")
    ratios = [p["ratio"] for p in curve["training_loss"] + curve["evaluated"]] + [target["threshold_ratio"]]
    curve_top = _readable_top(ratios, spread=5.0)
    if curve_top is not None:
        curve_axis.set_ylim(min(1.0, min(ratios)) * 0.95, curve_top)
        _mark_off_scale(curve_axis, [(p["tokens_seen"], p["ratio"]) for p in curve["evaluated"]], curve_top,
                        marker=True)
    curve_axis.set_title("ratio against tokens seen", fontsize=9)
    curve_axis.legend(fontsize=7)

    table = record["passkey"]
    keyed = sorted({row["arm"] for row in table}, key=list(ARMS).index)
    lengths = sorted({row["context_length"] for row in table})
    width = 0.8 / max(len(lengths), 1)
    for index, length in enumerate(lengths):
        heights = [next((row["accuracy"] for row in table if row["arm"] == name and row["context_length"] == length),
                        0) or 0 for name in keyed]
        passkey_axis.bar([x + (index - (len(lengths) - 1) / 2) * width for x in range(len(keyed))], heights, width,
                         label=f"{length} tokens")
    passkey_axis.set_xticks(range(len(keyed)), [SHORT_LABELS[name] for name in keyed], fontsize=8)
    passkey_axis.set_ylim(0, 1.05)
    passkey_axis.set_ylabel("passkey accuracy")
    passkey_axis.set_title("passkey retrieval (all depths)", fontsize=9)
    if lengths:
        passkey_axis.legend(fontsize=7)

    wall = record["wall_times"]["arms"]
    timed = list(wall)
    time_axis.bar(range(len(timed)), [wall[name]["training_s"] or 0 for name in timed], color="#636363",
                  label="training (linearize)")
    time_axis.bar(range(len(timed)), [wall[name]["evaluation_s"] or 0 for name in timed],
                  bottom=[wall[name]["training_s"] or 0 for name in timed], color="#bdbdbd", label="evaluations")
    time_axis.set_xticks(range(len(timed)), [SHORT_LABELS[name] for name in timed], fontsize=8)
    time_axis.set_ylabel("seconds")
    time_axis.set_title(f"wall time ({record['machine'].get('cpu', record['machine'].get('device', ''))})",
                        fontsize=9)
    time_axis.legend(fontsize=7)
    fig.suptitle(f"{record['title']} ({record.get('profile') or 'default'} profile)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def format_summary(record: dict) -> str:
    contexts = list(record["contexts"])
    lines = [f"{'arm':<18} " + " ".join(f"{'ppl@' + c:>10}" for c in contexts)
             + f" {'far ppl':>9} {'tokens':>10} {'train s':>8}"]
    for name, entry in record["arms"].items():
        far = (entry["perplexity"].get("1024") or {}).get("position_ranges", {}).get(
            record["tail_ablation"]["trained_far_positions"]["position_range"], {})
        lines.append(f"{name:<18} " + " ".join(f"{_fmt((entry['perplexity'].get(c) or {}).get('perplexity')):>10}"
                                               for c in contexts)
                     + f" {_fmt(far.get('perplexity')):>9} {entry['tokens_seen'] or 0:>10} "
                       f"{entry['training_wall_time_s'] or 0:>8.0f}")
    target = record["target"]
    lines.append(f"hybrid + LoRA / softmax + LoRA at 1024: {_fmt(target['ratio'])} (target <= "
                 f"{target['threshold_ratio']:g}: {target['status']}; stretch {target['stretch_ratio']:g})")
    ablation = record["tail_ablation"]
    lines.append(f"tail ablation, window-only / hybrid after training: overall "
                 f"{_fmt(ablation['trained_overall']['ratio'])}, positions {ablation['trained_far_positions']['position_range']} "
                 f"{_fmt(ablation['trained_far_positions']['ratio'])}")
    for row in record["passkey"]:
        lines.append(f"passkey {row['arm']:<18} {row['context_length']:>5} tokens: accuracy {_fmt(row['accuracy'], 3)}")
    for warning in record.get("warnings", []):
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", action="append", default=[], metavar="NAME=DIR",
                        help=f"a linearize output folder of an arm ({', '.join(ARMS)}); repeatable")
    parser.add_argument("--eval", action="append", default=[], metavar="NAME=FILE",
                        help="an hf-performer evaluate record (perplexity or passkey) of an arm; repeatable")
    parser.add_argument("--timings", metavar="TSV", help="the pipeline's timings.tsv (step wall times)")
    parser.add_argument("--runs-dir", metavar="DIR", help="the folder input paths are recorded relative to "
                                                          "(default: their common parent)")
    parser.add_argument("--profile", default=None, help="the pipeline profile that produced the runs")
    parser.add_argument("--protocol", default=None, metavar="TEXT", help="free-text description of the protocol")
    parser.add_argument("--command", default=None, metavar="TEXT", help="the exact command that ran the pipeline")
    parser.add_argument("--note", dest="notes", action="append", default=[], metavar="TEXT",
                        help="a remark stored in the record's notes (repeatable)")
    parser.add_argument("--far-start", type=int, default=512, help="start of the far window positions (default: 512)")
    parser.add_argument("--far-end", type=int, default=1024,
                        help="end of the far positions = the context of the ablation (default: 1024)")
    parser.add_argument("--margin", type=float, default=0.01,
                        help="the tail is 'measurably better' when window-only / hybrid far-position perplexity "
                             "exceeds 1 + MARGIN (default: 0.01)")
    parser.add_argument("--title", default="SmolLM2-135M: sink + sliding-window softmax with a learned linear tail",
                        help="title of the record and the figure")
    parser.add_argument("--target-ratio", type=float, default=TARGET_RATIO, help="default: %(default)s")
    parser.add_argument("--stretch-ratio", type=float, default=STRETCH_RATIO, help="default: %(default)s")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, metavar="FILE.json",
                        help="JSON to write; the PNG goes beside it (default: "
                             "benchmarks/results/window_hybrid_smollm2.json)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        record = build_record(args)
    except CollectError as error:
        raise SystemExit(f"collect_window_hybrid: error: {error}") from None
    _lm.write_record(record, args.output, plot, format_summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
