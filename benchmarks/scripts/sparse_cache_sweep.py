"""What a sparse cache of hard keys gives a trained window hybrid with no training: perplexity and passkey per size G.

Each size G of ``--cache-sizes`` is set on the model's window layers at load time (``hf-performer evaluate
--sparse-cache G``, :func:`hf_performer.favor_attention.update_favor_settings`); the model is then evaluated with the
one protocol of the window-hybrid results: perplexity with windows of ``--context-length`` tokens every half window
on the first ``--max-chars`` characters of ``--text-file`` (split by window position), and the passkey probe at each
``--passkey-lengths``. ``--baseline`` (the softmax model after the same LoRA) is evaluated once, for the ratios.

    python benchmarks/scripts/sparse_cache_sweep.py ../runs/base/hybrid_lora --baseline ../runs/base/softmax_lora \\
        --text-file ../shared/data/wikitext-2-raw/wiki.test.raw \\
        --output benchmarks/results/sparse_cache_sweep_smollm2.json

Every evaluation is kept in ``--work-dir`` as it finishes (an interrupted sweep resumes there); the JSON (paths
relative to the working directory, machine, command) and a PNG are written at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def _evaluations(args, name: str, folder: str, changes: dict) -> dict:
    """Perplexity and passkey records of one model (with ``changes`` to its favor settings), kept in the work dir."""
    from hf_performer.tasks.evaluation import evaluate_perplexity_model
    from hf_performer.tasks.passkey import evaluate_passkey_model

    records = {}
    for kind in ("perplexity", "passkey"):
        path = os.path.join(args.work_dir, f"{name}_{kind}.json")
        if os.path.isfile(path):
            with open(path) as handle:
                records[kind] = json.load(handle)
            continue
        print(f"{name}: {kind} ...", flush=True)
        if kind == "perplexity":
            record = evaluate_perplexity_model(
                folder, "wikitext", args.text_file, max_chars=args.max_chars, context_length=args.context_length,
                stride=args.context_length // 2, batch_size=args.batch_size, show_progress=not args.no_progress,
                position_ranges=args.position_ranges, favor_changes=changes)
        else:
            record = evaluate_passkey_model(
                folder, args.passkey_lengths, args.depths, args.trials, args.seed, batch_size=args.batch_size,
                show_progress=not args.no_progress, favor_changes=changes)
        record["model"] = os.path.basename(os.path.normpath(folder))
        with open(path + ".partial", "w") as handle:
            json.dump(record, handle, indent=2)
        os.replace(path + ".partial", path)
        records[kind] = record
    return records


def _summary(records: dict) -> dict:
    perplexity, passkey = records["perplexity"], records["passkey"]
    return {"perplexity": perplexity["metrics"]["perplexity"],
            "perplexity_by_position": {f"{r['start']}:{r['end']}": r["perplexity"]
                                       for r in perplexity.get("position_ranges", ())},
            "passkey_accuracy": passkey["metrics"]["passkey_accuracy"],
            "passkey_by_length": {str(cell_length): value for cell_length, value in
                                  ((int(k.rsplit("_", 1)[1]), v) for k, v in passkey["metrics"].items()
                                   if k.startswith("passkey_accuracy_"))},
            "eval_seconds": perplexity["eval_seconds"] + passkey["eval_seconds"]}


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [int(size) for size in result["cache_sizes"]]
    runs = [result["runs"][str(size)] for size in sizes]
    baseline = result.get("baseline")
    figure, (ppl_axis, key_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    ppl_axis.plot(sizes, [run["perplexity"] for run in runs], "-o", label="all positions")
    for span in runs[0]["perplexity_by_position"]:
        ppl_axis.plot(sizes, [run["perplexity_by_position"][span] for run in runs], "--o", ms=3,
                      label=f"positions {span}")
    if baseline:
        ppl_axis.axhline(baseline["perplexity"], color="black", lw=1, label="softmax + LoRA")
        ppl_axis.axhline(1.1 * baseline["perplexity"], color="grey", lw=0.8, ls=":", label="1.10x softmax")
    ppl_axis.set(xlabel="sparse cache G (tokens per key head)", ylabel="perplexity",
                 title=f"perplexity at {result['protocol']['context_length']} tokens")
    for length in runs[0]["passkey_by_length"]:
        line, = key_axis.plot(sizes, [run["passkey_by_length"][length] for run in runs], "-o", label=f"{length} tokens")
        if baseline and length in baseline["passkey_by_length"]:
            key_axis.axhline(baseline["passkey_by_length"][length], color=line.get_color(), lw=0.8, ls=":")
    key_axis.set(xlabel="sparse cache G (tokens per key head)", ylabel="passkey accuracy", ylim=(-0.05, 1.05),
                 title="passkey (dotted: softmax + LoRA)")
    for axis in (ppl_axis, key_axis):
        axis.set_xscale("symlog", linthresh=32)
        axis.set_xticks(sizes, [str(size) for size in sizes])
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(f"{result['model']}: sparse cache with no training ({result['protocol']['text_file']})")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a trained window-hybrid causal LM folder (e.g. a linearize output)")
    parser.add_argument("--baseline", default=None, help="the softmax model after the same LoRA, for the ratios")
    parser.add_argument("--cache-sizes", type=int, nargs="+", default=[0, 32, 64, 128, 256], metavar="G")
    parser.add_argument("--text-file", required=True, help="evaluation text (e.g. wiki.test.raw)")
    parser.add_argument("--max-chars", type=int, default=200_000, help="characters evaluated (default: %(default)s)")
    parser.add_argument("--context-length", type=int, default=1024, help="perplexity window (default: %(default)s)")
    parser.add_argument("--position-ranges", nargs="+", default=["0:512", "512:1024"], metavar="START:END")
    parser.add_argument("--passkey-lengths", type=int, nargs="+", default=[1024, 2048, 4096], metavar="N")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--trials", type=int, default=4, help="passkey prompts per length and depth (default: 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=2, help="windows / prompts per forward (default: 2)")
    parser.add_argument("--work-dir", default=None,
                        help="where each finished evaluation is kept (default: a folder in the system's temp dir "
                             "named after the output)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--output", required=True, help="the JSON to write (the PNG goes beside it)")
    args = parser.parse_args(argv)
    if not args.output.endswith(".json"):
        raise SystemExit(f"sparse_cache_sweep: --output must end in .json, got {args.output!r}")
    if any(size < 0 for size in args.cache_sizes):
        raise SystemExit(f"sparse_cache_sweep: --cache-sizes must be >= 0, got {args.cache_sizes}")
    for folder in [args.model] + ([args.baseline] if args.baseline else []):
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise SystemExit(f"sparse_cache_sweep: no config.json in {folder} (a saved model folder is expected)")
    args.work_dir = args.work_dir or os.path.join(
        tempfile.gettempdir(), f"sparse_cache_sweep_{os.path.splitext(os.path.basename(args.output))[0]}")
    os.makedirs(args.work_dir, exist_ok=True)
    print(f"evaluations kept in {args.work_dir}")

    from pathlib import Path

    import torch

    from hf_performer.bench.machine import load_average, machine_info
    from hf_performer.bench.report import write_result

    runs = {str(size): _summary(_evaluations(args, f"G{size}", args.model, {"sparse_cache": size}))
            for size in args.cache_sizes}
    baseline = _summary(_evaluations(args, "baseline", args.baseline, {})) if args.baseline else None
    if baseline:
        for run in runs.values():
            run["perplexity_ratio"] = run["perplexity"] / baseline["perplexity"]
            run["passkey_fraction_of_baseline"] = {
                length: (value / baseline["passkey_by_length"][length] if baseline["passkey_by_length"].get(length)
                         else None) for length, value in run["passkey_by_length"].items()}
    result = {
        "what": "a trained window hybrid evaluated with a sparse cache of G hard keys per key head in every window "
                "layer, set at load time with no training (LoLA)",
        "model": os.path.relpath(args.model), "baseline_model": args.baseline and os.path.relpath(args.baseline),
        "cache_sizes": args.cache_sizes,
        "protocol": {"text_file": os.path.basename(args.text_file), "max_chars": args.max_chars,
                     "context_length": args.context_length, "stride": args.context_length // 2,
                     "position_ranges": args.position_ranges, "passkey_lengths": args.passkey_lengths,
                     "depths": args.depths, "trials": args.trials, "seed": args.seed},
        "runs": runs, "baseline": baseline,
        "machine": {**machine_info(torch.device("cpu")), "load_average": load_average()},
        "command": "python benchmarks/scripts/sparse_cache_sweep.py " + " ".join(
            [os.path.relpath(args.model)] + ([f"--baseline {os.path.relpath(args.baseline)}"] if args.baseline else [])
            + ["--cache-sizes", *map(str, args.cache_sizes), f"--text-file {os.path.relpath(args.text_file)}",
               f"--max-chars {args.max_chars}", f"--context-length {args.context_length}", "--position-ranges",
               *args.position_ranges, "--passkey-lengths", *map(str, args.passkey_lengths), "--depths",
               *map(str, args.depths), f"--trials {args.trials}", f"--seed {args.seed}",
               f"--output {args.output}"]),
    }
    output = Path(args.output)
    write_result(result, output.parent, output.stem, _plot)
    for size, run in runs.items():
        ratio = f" ({run['perplexity_ratio']:.3f}x)" if baseline else ""
        print(f"G={size}: perplexity {run['perplexity']:.3f}{ratio}, passkey {run['passkey_by_length']}")
    print(f"wrote {args.output} and its .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
