"""A cache-budget allocation as a committed result: the folder ``hf-performer budget`` wrote (its
``cache_budget.json``: every window layer's measured error for each sparse-cache size, the choice, the bytes) becomes
a JSON with the machine and a PNG of which layers the budget went to.

    python benchmarks/scripts/cache_budget_result.py ../runs/r33/budget/b20 \\
        --output benchmarks/results/cache_budget_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(result["layers"], key=int)
    sizes = sorted({size for options in result["errors"].values() for size in options}, key=int)
    figure, (error_axis, choice_axis) = plt.subplots(1, 2, figsize=(14, 4.6))
    for size in sizes:
        error_axis.plot([int(layer) for layer in layers], [result["errors"][layer][size] for layer in layers], "-o",
                        ms=3, label=f"G = {size}")
    if result.get("metric") == "loss":  # (a rise can be negative: no log scale)
        error_axis.set(yscale="symlog", xlabel="layer", ylabel="next-token loss rise (nats)",
                       title="loss rise with only this layer cached (others exact softmax)")
    else:
        error_axis.set(yscale="log", xlabel="layer", ylabel="attention output MSE vs softmax",
                       title="measured error per layer (teacher forcing)")
    error_axis.legend(fontsize=7)
    chosen = [result["layers"][layer]["option"] for layer in layers]
    heights = [float(option) if option != "softmax" else 0.0 for option in chosen]
    bars = choice_axis.bar([int(layer) for layer in layers], heights, color="tab:blue")
    for bar, option in zip(bars, chosen):
        if option == "softmax":
            bar.set_color("tab:red")
            choice_axis.text(bar.get_x(), 1, "softmax", rotation=90, fontsize=7)
    uniform = result.get("uniform") or {}
    if uniform:
        choice_axis.axhline(uniform["sparse_cache"], color="grey", ls=":",
                            label=f"one G for all within the budget ({uniform['sparse_cache']})")
        choice_axis.legend(fontsize=7)
    choice_axis.set(yscale="symlog", xlabel="layer", ylabel="sparse cache G per key head",
                    title=f"{result['total_bytes'] / 2 ** 20:.1f} of {result['budget_bytes'] / 2 ** 20:.1f} MiB "
                          f"at {result['context']} tokens: summed error {result['total_error']:.3g}"
                          + (f" (one G: {uniform['error']:.3g})" if uniform else ""))
    for axis in (error_axis, choice_axis):
        axis.grid(alpha=0.3)
    figure.suptitle(f"{result['model']}: one decoding-memory budget spent per layer")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a folder written by hf-performer budget")
    parser.add_argument("--output", required=True, help="the JSON to write (the PNG goes beside it)")
    args = parser.parse_args(argv)
    record_path = os.path.join(args.folder, "cache_budget.json")
    if not os.path.isfile(record_path):
        raise SystemExit(f"cache_budget_result: no cache_budget.json in {args.folder} (hf-performer budget writes it)")
    if not args.output.endswith(".json"):
        raise SystemExit(f"cache_budget_result: --output must end in .json, got {args.output!r}")
    with open(record_path) as handle:
        result = json.load(handle)

    from pathlib import Path

    import torch

    from hf_performer.bench.machine import machine_info
    from hf_performer.bench.report import write_result

    result["machine"] = machine_info(torch.device("cpu"))
    result["collector"] = (f"python benchmarks/scripts/cache_budget_result.py {os.path.relpath(args.folder)} "
                           f"--output {args.output}")
    output = Path(args.output)
    write_result(result, output.parent, output.stem, _plot)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
