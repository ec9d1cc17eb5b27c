"""Collect the encoder sink + sliding-window hybrid experiment (issue 15 item 6) into one JSON + PNG.

Reads the runs folder of ``benchmarks/scripts/stsb_window_hybrid.sh``. Every fine-tuning row starts from the
pretrained model and gets the same recipe arguments (``glue_recovery.sh``'s ``finetune_args``):

* ``a_softmax``: softmax, fine-tuned (the baseline);
* ``e_transfer`` -> ``f_transfer_finetuned``: the hybrid (band + sinks exact softmax, learned linear tail) after
  attention transfer of the tail on the pretrained model (no labels), then fine-tuned;
* ``window_only/e_transfer`` -> ``window_only/f_transfer_finetuned``: the tail ablation, sinks + band only
  (``--no-tail``, nothing to transfer), fine-tuned;
* ``b_converted`` (optional): the fine-tuned softmax model (a) converted to sinks + band only, no training;
* ``from_a/e_transfer`` (optional): (a) converted to the hybrid, attention transfer of the tail with (a) as the
  teacher, no fine-tuning (zero-shot: the same head, so comparable with ``b_converted``).

    python benchmarks/scripts/collect_encoder_window.py --runs $TMPDIR/stsb_window16 --task stsb \\
        --validation-file ../shared/data/glue/STS-B/dev.tsv --window 16 --sinks 1 \\
        --command "bash benchmarks/scripts/stsb_window_hybrid.sh" --output benchmarks/results/window_hybrid_stsb.json

The JSON is :func:`hf_performer.recipes.results.collect` of (a, f) (so it carries issue 15's encoder target:
(f) >= 97% of (a)) plus the transfer summary, ``window_only`` (the ablation rows with their own descriptions), the
ratio of every arm to (a), ``tail_pairs``: the share of the dev set's (query, key) pairs that go through the linear
tail at this window, the step timings, the command and the machine; paths relative to the runs folder.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys

HYBRID_DESCRIPTION = "hybrid: pretrained model + attention transfer of the linear tail, fine-tuned like (a)"
WINDOW_ONLY_DESCRIPTIONS = {
    "zero_shot": "(a) converted to sinks + window softmax only (--no-tail), no training",
    "fine_tuned": "pretrained model converted to sinks + window softmax only (--no-tail), fine-tuned like "
                  "(a): the tail ablation of (f)",
}
HYBRID_ZERO_SHOT_DESCRIPTION = ("(a) converted to the hybrid, attention transfer of the tail with (a) as the teacher, "
                               "no fine-tuning")
RUN_FILES = ("metrics.json", "dev_metrics.json")


def tail_pair_share(lengths: list[int], window: int, sinks: int) -> dict:
    """Share of (query, key) pairs of unpadded sequences with ``|i - j| >= window`` and neither token a sink, i.e.
    the pairs a bidirectional window layer sends through its linear tail (sinks attend and are attended exactly)."""
    tail = total = 0
    for length in lengths:
        plain = max(length - sinks, 0)  # the non-sink tokens
        total += length * length
        # ordered pairs (i, j) of non-sink tokens with |i - j| >= window: 2 * sum_{gap >= window} (plain - gap)
        tail += sum(2 * (plain - gap) for gap in range(window, plain))
    return {"window": window, "sinks": sinks, "sequences": len(lengths), "mean_tokens": sum(lengths) / len(lengths),
            "tail_pair_share": tail / total, "note": "token-pair count over the dev set, [CLS] is the sink"}


EVAL_LINE = re.compile(r"^step (\d+): (.*)$", re.MULTILINE)
PROGRESS = re.compile(r"(\d+)/(\d+) \[[^\]]*loss=([-+0-9.e]+)\]")


def recipe_log_progress(path: str) -> dict:
    """What a recipe run's log shows so far (for a run stopped before its ``metrics.json``): the evaluations
    (``step N: metric=value, ...`` lines) and the training loss of every step from the progress bar (the last value
    shown for each step), with the planned number of steps."""
    with open(path, errors="replace") as handle:
        text = handle.read()
    curve = []
    for step, fields in EVAL_LINE.findall(text):
        point = {"step": int(step)}
        for field in fields.split(", "):
            name, _, value = field.partition("=")
            try:
                point[name] = float(value)
            except ValueError:
                continue
        curve.append(point)
    losses, planned = {}, None
    for step, total, loss in PROGRESS.findall(text):
        losses[int(step)] = float(loss)
        planned = int(total)
    return {"curve": curve, "train_loss_by_step": [losses[k] for k in sorted(losses)],
            "steps_done": max(losses, default=0), "planned_steps": planned}


def equal_step_comparison(softmax_curve: list[dict], hybrid_curve: list[dict], metric: str) -> list[dict]:
    """The two runs' dev metric at every step both evaluated (same schedule: the same learning rate there)."""
    softmax = {p["step"]: p[metric] for p in softmax_curve if metric in p}
    return [{"step": p["step"], "softmax": softmax[p["step"]], "hybrid": p[metric],
             "ratio": p[metric] / softmax[p["step"]] if softmax[p["step"]] else None}
            for p in hybrid_curve if metric in p and p["step"] in softmax]


def _timings(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, newline="") as handle:
        return {row[0]: int(row[1]) for row in csv.reader(handle, delimiter="\t") if len(row) == 2}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", required=True, help="the runs folder of stsb_window_hybrid.sh (OUT)")
    parser.add_argument("--task", default="stsb")
    parser.add_argument("--validation-file", required=True, help="the dev file, to count the tail's token pairs")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--window", type=int, required=True)
    parser.add_argument("--sinks", type=int, required=True)
    parser.add_argument("--command", required=True, help="the command that produced the runs (recorded)")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from hf_performer.recipes.results import ATTENTION_TRANSFER_FILE, attention_transfer_summary, collect, load_run
    from hf_performer.tasks.data import get_task, load_task_split, tokenize_task_dataset

    runs = args.runs

    def present(folder: str) -> str | None:
        path = os.path.join(runs, folder)
        return path if any(os.path.isfile(os.path.join(path, name)) for name in RUN_FILES) else None

    result = collect(args.task, {label: path for label, path in
                                 (("a", present("a_softmax")), ("f", present("f_transfer_finetuned"))) if path})
    if "f" in result["runs"]:
        result["runs"]["f"]["description"] = HYBRID_DESCRIPTION
    transfer_file = os.path.join(runs, "e_transfer", ATTENTION_TRANSFER_FILE)
    if os.path.isfile(transfer_file):  # the transfer on the pretrained model that (f) starts from
        with open(transfer_file) as handle:
            result["hybrid_transfer"] = attention_transfer_summary(json.load(handle), transfer_file)
    logs = {name: os.path.join(runs, file) for name, file in (("softmax", "a_softmax.log"),
                                                               ("hybrid", "f_transfer_finetuned.log"))}
    progress = {name: recipe_log_progress(path) for name, path in logs.items() if os.path.isfile(path)}
    result["train_loss_by_step"] = {name: p["train_loss_by_step"] for name, p in progress.items()}
    hybrid_curve = result["runs"].get("f", {}).get("curve", [])
    if "f" not in result["runs"] and "hybrid" in progress:
        done, losses = progress["hybrid"]["steps_done"], result["train_loss_by_step"]
        softmax_losses = losses.get("softmax", [])
        result["hybrid_incomplete"] = {
            "description": HYBRID_DESCRIPTION + f"; stopped at step {done} of {progress['hybrid']['planned_steps']} "
                           "(time budget)",
            "steps_done": done, "planned_steps": progress["hybrid"]["planned_steps"],
            "curve": progress["hybrid"]["curve"],
            "mean_train_loss_steps_1_to_done": {
                "hybrid": sum(losses["hybrid"][:done]) / done if done else None,
                "softmax": sum(softmax_losses[:done]) / done if done and len(softmax_losses) >= done else None},
            "note": "per-batch training losses of the same batches (same seed and data order) averaged over the steps "
                    "both runs did; dev metrics only at the evaluated steps"}
        hybrid_curve = progress["hybrid"]["curve"]
    if "a" in result["runs"]:
        result["equal_step_comparison"] = equal_step_comparison(result["runs"]["a"]["curve"], hybrid_curve,
                                                                result["main_metric"])
    zero_shot = present(os.path.join("from_a", "e_transfer"))
    if zero_shot:
        result["hybrid_zero_shot"] = {**load_run("e", zero_shot), "description": HYBRID_ZERO_SHOT_DESCRIPTION}
    window_only = {}
    for name, label, folder in (("zero_shot", "b", "b_converted"),
                                ("fine_tuned", "c", os.path.join("window_only", "f_transfer_finetuned"))):
        if present(folder):
            window_only[name] = {**load_run(label, present(folder)), "description": WINDOW_ONLY_DESCRIPTIONS[name]}
    result["window_only"] = window_only
    softmax = result["runs"].get("a", {}).get("metric")
    arms = {**result["runs"], **({"hybrid_zero_shot": result["hybrid_zero_shot"]} if zero_shot else {}),
            **{f"window_only_{k}": v for k, v in window_only.items()}}
    result["ratio_to_softmax"] = {name: (run["metric"] / softmax if softmax else None) for name, run in arms.items()}

    spec = get_task(args.task)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(runs, "a_softmax"))
    dataset = load_task_split(spec, "validation", args.validation_file, None, 0)
    lengths = [len(ids) for ids in tokenize_task_dataset(dataset, tokenizer, spec, args.max_length)["input_ids"]]
    result["tail_pairs"] = tail_pair_share(lengths, args.window, args.sinks)
    result["timings_s"] = {**_timings(os.path.join(runs, "timings.tsv")), **{
        f"window_only/{step}": seconds for step, seconds in _timings(os.path.join(runs, "window_only", "timings.tsv")).items()}}
    result["command"] = args.command

    text = json.dumps(result, indent=1, default=str)
    for folder in ("from_a", "window_only"):  # the script's sub-runs (possibly links to other folders)
        text = text.replace(os.path.realpath(os.path.join(runs, folder)) + "/", folder + "/")
    text = text.replace(os.path.abspath(runs).rstrip("/") + "/", "")  # run paths relative to the runs folder
    repository = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = text.replace(os.path.dirname(repository).rstrip("/") + "/", "../")  # ../shared/data, as the READMEs
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as handle:
        handle.write(text + "\n")
    _plot(json.loads(text), os.path.splitext(args.output)[0] + ".png")
    for name, ratio in result["ratio_to_softmax"].items():
        print(f"{name:<16} {spec.main_metric} {arms[name]['metric']:.4f}  / softmax {ratio:.4f}")
    print(f"tail pairs at window {args.window}: {100 * result['tail_pairs']['tail_pair_share']:.1f}%")
    print(f"wrote {args.output} and .png")
    return 0


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [("a", result["runs"].get("a"), "softmax\nfine-tuned (a)"),
            ("w0", result["window_only"].get("zero_shot"), "(a) as window only\nno training"),
            ("h0", result.get("hybrid_zero_shot"), "(a) as hybrid\n+ transfer, no fine-tuning"),
            ("w", result["window_only"].get("fine_tuned"), "window only\nfine-tuned"),
            ("f", result["runs"].get("f"), "hybrid: transfer\n+ fine-tuned (f)")]
    arms = [arm for arm in arms if arm[1] is not None]
    tail = result["tail_pairs"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    values = [run["metric"] for _, run, _ in arms]
    axes[0].bar(range(len(arms)), values, color=[{"a": "black", "w0": "silver", "h0": "tab:orange", "w": "tab:gray", "f": "tab:red"}[key] for key, _, _ in arms])
    for index, value in enumerate(values):
        axes[0].text(index, value + 0.01, f"{value:.3f}", ha="center")
    if "a" in result["runs"]:
        axes[0].axhline(0.97 * result["runs"]["a"]["metric"], linestyle="--", color="tab:green", label="97% of (a)")
        axes[0].legend(loc="lower right")
    axes[0].set_xticks(range(len(arms)), [label for _, _, label in arms], fontsize=8)
    axes[0].set_ylabel(f"{result['task']} dev {result['main_metric']}")
    axes[0].set_title(f"band {tail['window']}, {tail['sinks']} sink ([CLS]): "
                      f"{100 * tail['tail_pair_share']:.1f}% of pairs in the linear tail", fontsize=9)
    for key, run, label in arms:
        curve = [p for p in run.get("curve", []) if result["main_metric"] in p]
        if run.get("kind") == "fine-tuned" and curve:
            axes[1].plot([p["step"] for p in curve], [p[result["main_metric"]] for p in curve], "-o",
                         label=label.replace("\n", " "))
    partial = result.get("hybrid_incomplete")
    if partial and partial["curve"]:
        axes[1].plot([p["step"] for p in partial["curve"]], [p[result["main_metric"]] for p in partial["curve"]], "-o",
                     color="tab:red", label=f"hybrid (stopped at step {partial['steps_done']})")
    axes[1].set_xlabel("fine-tuning step")
    axes[1].set_ylabel(f"dev {result['main_metric']}")
    if axes[1].lines:
        axes[1].legend()
    span = 20
    for name, losses in result.get("train_loss_by_step", {}).items():
        if len(losses) >= span:
            smooth = [sum(losses[i - span:i]) / span for i in range(span, len(losses) + 1)]
            axes[2].plot(range(span, len(losses) + 1), smooth, label=name)
    axes[2].set_xlabel("fine-tuning step")
    axes[2].set_ylabel(f"training loss (mean of the last {span} steps)")
    axes[2].set_yscale("log")
    if axes[2].lines:
        axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
