"""Collect the encoder sink + sliding-window hybrid experiment (issue 15 item 6) into one JSON + PNG.

Reads the runs folder of ``benchmarks/scripts/stsb_window_hybrid.sh``. Every fine-tuning row starts from the
pretrained model and gets the same recipe arguments (``glue_recovery.sh``'s ``finetune_args``):

* ``a_softmax``: softmax, fine-tuned (the baseline);
* ``e_transfer`` -> ``f_transfer_finetuned``: the hybrid (band + sinks exact softmax, learned linear tail) after
  attention transfer of the tail on the pretrained model (no labels), then fine-tuned;
* ``window_only/e_transfer`` -> ``window_only/f_transfer_finetuned``: the tail ablation, sinks + band only
  (``--no-linear-tail``, nothing to transfer), fine-tuned;
* ``b_converted`` (optional): the fine-tuned softmax model (a) converted to sinks + band only, no training.

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
import sys

HYBRID_DESCRIPTION = "hybrid: pretrained model + attention transfer of the linear tail, fine-tuned like (a)"
WINDOW_ONLY_DESCRIPTIONS = {
    "zero_shot": "(a) converted to sinks + window softmax only (--no-linear-tail), no training",
    "fine_tuned": "pretrained model converted to sinks + window softmax only (--no-linear-tail), fine-tuned like "
                  "(a): the tail ablation of (f)",
}
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
        if os.path.isfile(transfer_file):
            with open(transfer_file) as handle:
                result["runs"]["f"]["attention_transfer"] = attention_transfer_summary(json.load(handle),
                                                                                       transfer_file)
    window_only = {}
    for name, label, folder in (("zero_shot", "b", "b_converted"),
                                ("fine_tuned", "c", os.path.join("window_only", "f_transfer_finetuned"))):
        if present(folder):
            window_only[name] = {**load_run(label, present(folder)), "description": WINDOW_ONLY_DESCRIPTIONS[name]}
    result["window_only"] = window_only
    softmax = result["runs"].get("a", {}).get("metric")
    arms = {**result["runs"], **{f"window_only_{k}": v for k, v in window_only.items()}}
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
    text = text.replace(os.path.abspath(runs).rstrip("/") + "/", "")  # run paths relative to the runs folder
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
            ("w", result["window_only"].get("fine_tuned"), "window only\nfine-tuned"),
            ("f", result["runs"].get("f"), "hybrid: transfer\n+ fine-tuned (f)")]
    arms = [arm for arm in arms if arm[1] is not None]
    tail = result["tail_pairs"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    values = [run["metric"] for _, run, _ in arms]
    axes[0].bar(range(len(arms)), values, color=[{"a": "black", "w0": "silver", "w": "tab:gray", "f": "tab:red"}[key] for key, _, _ in arms])
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
    axes[1].set_xlabel("fine-tuning step")
    axes[1].set_ylabel(f"dev {result['main_metric']}")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
