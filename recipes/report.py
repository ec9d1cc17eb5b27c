"""The recovery results as a plot (:func:`plot`) and a markdown table (:func:`table`,
:func:`comparison_table`), and the runners of the ``hf-performer results`` actions (collect, plot, table).

    hf-performer results collect --task sst2 --run a=RUN_A --run b=B/dev_metrics.json --run c=RUN_C \\
        --run d=RUN_D --run e=E/dev_metrics.json --run f=RUN_F --protocol "..." \\
        --output benchmarks/results/recovery_sst2.json
    hf-performer results plot benchmarks/results/recovery_sst2.json        # -> recovery_sst2.png
    hf-performer results table benchmarks/results/recovery_*.json

The README's results section is rewritten by ``python benchmarks/scripts/update_readme_results.py``.
"""

from __future__ import annotations

import json
import os
import sys

from .results import (
    ATTENTION_TRANSFER_TARGET_POINTS,
    ATTENTION_TRANSFER_TARGET_RATIO,
    LABELS,
    TARGET_POINTS,
    ResultsError,
    number_or_none,
    parse_label_pairs,
    as_points,
    transfer_target,
    collect,
    load_results,
    target_check,
)


def _curve_xy(run: dict, metric: str, offset: int = 0) -> tuple[list[float], list[float]]:
    points = [p for p in run["curve"] if metric in p]
    return [offset + p["step"] for p in points], [as_points(p[metric]) for p in points]


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
            x, y = [offset] + x, [as_points(runs["b"]["metric"])] + y
        ax.plot(x, y, "^-", color=colours["c"],
                label=f"(c) FAVOR+ recovery ({runs['c']['steps']} steps, {where})")
    if "b" in runs:
        ax.plot([offset], [as_points(runs["b"]["metric"])], "X", markersize=11, color=colours["b"], zorder=5,
                label=f"(b) (a) converted, no training: {as_points(runs['b']['metric']):.2f}")
    if "f" in runs:
        x, y = _curve_xy(runs["f"], metric, offset)
        if "e" in runs:
            x, y = [offset] + x, [as_points(runs["e"]["metric"])] + y
        ax.plot(x, y, "D--", color=colours["f"], markersize=5,
                label=f"(f) (e) + fine-tuning ({runs['f']['steps']} steps, {where})")
    if "e" in runs:
        transfer = runs["e"].get("attention_transfer") or {}
        feature_map = transfer.get("feature_map") or (runs["e"].get("favor_settings") or {}).get("feature_map")
        details = ", ".join(part for part in (
            feature_map, f"{transfer['steps']} transfer steps" if transfer.get("steps") is not None else None,
        ) if part)
        ax.plot([offset], [as_points(runs["e"]["metric"])], "*", markersize=15, color=colours["e"], zorder=6,
                label=f"(e) attention transfer{f' ({details})' if details else ''}, no fine-tuning: "
                      f"{as_points(runs['e']['metric']):.2f}")
    if "a" in runs:
        a = as_points(runs["a"]["metric"])
        threshold = results.get("target", {}).get("threshold_points", TARGET_POINTS)
        ax.axhline(a - threshold, color=colours["a"], linestyle=":", linewidth=1,
                   label=f"issue 4 target: (a) - {threshold:g} points = {a - threshold:.2f}")
        if transfer_runs:
            check = transfer_target(results)
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
        return f"- (transfer {_seconds(transfer)})" if number_or_none(transfer) is not None else "-"
    if run.get("kind") != "evaluated":
        return _seconds(seconds)
    if number_or_none(transfer) is not None:
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
    return f"{status} ({numbers}: (a) {as_points(target['a']):.2f}, ({other}) {as_points(target[other]):.2f})"


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
    if number_or_none(summary.get("wall_time_s")) is not None:
        text += f" in {_seconds(summary['wall_time_s'])}"
    parts.append(text)
    mean = summary.get("mean_own_inputs_relative_error") or {}
    layers = [e for e in summary.get("own_inputs_relative_error") or []
              if number_or_none(e.get("before")) is not None and number_or_none(e.get("after")) is not None]
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
    text = f"({label}) {results['main_metric']} {as_points(run['metric']):.2f}"
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
        transfer = transfer_target(results)
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


def table(results_list: list[dict], sources: list[str] | None = None,
          command: str = "hf-performer results table") -> str:
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
                f"{metric} {as_points(run['metric']):.2f} | {run['steps']} | "
                f"{examples if examples else '-'} | {seed if seed is not None else '-'} | {_wall(run)} |"
            )
        target = results.get("target") or target_check(results["runs"])
        evals = sorted({run.get("eval_examples") for run in results["runs"].values() if run.get("eval_examples")})
        dev = f"dev: {', '.join(map(str, evals))} examples" if evals else "dev"
        footer.append(f"- {results['task']} ({dev}): FAVOR+ target (issue 4) {target.get('description')}: "
                      f"{_target_status(target, 'c')}.")
        transfer = transfer_target(results)
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
        lines.append(f"Generated by `{command} " + " ".join(sources) + "` from the committed JSON; do not edit by hand.")
    return "\n".join(lines) + "\n"


def _fail(action: str, error: Exception):
    raise SystemExit(f"hf-performer results {action}: error: {error}") from None


def run_collect(args) -> int:
    try:
        runs = parse_label_pairs(args.run, "--run")
        commands = parse_label_pairs(args.command, "--command")
        results = collect(args.task, runs, args.protocol, commands)
    except ResultsError as error:
        _fail("collect", error)
    folder = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(folder, exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump(results, handle, indent=2)
        handle.write("\n")
    for label, run in results["runs"].items():
        print(f"({label}) {run['description']}: {results['main_metric']} {as_points(run['metric']):.2f} "
              f"after {run['steps']} steps")
    target = results["target"]
    gap = f" (gap {target['gap_points']:+.2f} points)" if target["gap_points"] is not None else ""
    print(f"target (issue 4) {target['description']}: {target['status']}{gap}")
    print(f"attention-transfer target (issue 5) {results['attention_transfer_target']['description']}: "
          f"{_target_status(results['attention_transfer_target'], 'f', bold=False)}")
    print(f"wrote {args.output}")
    return 0


def run_plot(args) -> int:
    output = args.output or os.path.splitext(args.results)[0] + ".png"
    try:
        plot(load_results(args.results), output)
    except ResultsError as error:
        _fail("plot", error)
    print(f"wrote {output}")
    return 0


def run_table(args) -> int:
    try:
        text = table([load_results(path) for path in args.results], sources=args.results)
    except ResultsError as error:
        _fail("table", error)
    sys.stdout.write(text)
    return 0

