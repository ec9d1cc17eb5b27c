"""Collect short attention-transfer probes of the window hybrid's tail (size, start) into one JSON + PNG.

Each probe is one ``hf-performer linearize ... --softmax-worst 1 --stop-after select`` run: the convert and transfer
stages, then the select stage, which measures every layer's transfer loss on held-out training sequences. Its
staging area (``.NAME.linearize/run.json``) holds the settings, the transfer curve and those losses:

    python benchmarks/scripts/collect_tail_probe.py --probe m128_identity=RUNS/.m128_identity.linearize \\
        --probe m512_favor+=RUNS/.m512_favor+.linearize --command "..." \\
        --output benchmarks/results/window_hybrid_smollm2_tail_probe.json

The JSON holds per probe: the tail's feature map, size and start, the transfer's steps, tokens and wall time, the
mean training loss over its last 10 steps, and the per-layer transfer losses of the select stage (mean and the
worst layers); the machine and the command. Folders are recorded by name (no local path). The PNG beside it draws
the per-layer losses of every probe.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

LAST_STEPS = 10
"""The transfer's closing training loss is the mean over this many last steps."""


def _probe(name: str, folder: str) -> dict:
    path = os.path.join(folder, "run.json")
    if not os.path.isfile(path):
        raise SystemExit(f"--probe {name}: {path} not found (a linearize staging area .NAME.linearize is expected)")
    with open(path) as handle:
        run = json.load(handle)
    stages, settings = run["stages"], run["settings"]
    if "select" not in stages or "transfer" not in stages:
        raise SystemExit(f"--probe {name}: {path} has no transfer and select stages (run linearize with "
                         "--softmax-worst 1 --stop-after select)")
    transfer, losses = stages["transfer"], stages["select"]["details"]["layer_losses"]
    curve = transfer["details"]["curve"]
    tail = curve[-LAST_STEPS:]
    ranked = sorted(losses.items(), key=lambda item: -item[1])
    return {
        "staging_area": os.path.basename(os.path.normpath(folder)),
        "feature_map": settings["feature_map"], "nb_features": settings["nb_features"],
        "feature_map_init": settings.get("feature_map_init", "identity"),
        "window": settings["window"], "sinks": settings["sinks"],
        "transfer": {"steps": transfer["details"]["steps_done"], "tokens_seen": transfer["tokens_seen"],
                     "length": settings["transfer_length"], "schedule": settings["transfer_schedule"],
                     "learning_rate": settings["transfer_learning_rate"], "wall_time_s": transfer["wall_time_s"],
                     f"train_loss_last_{LAST_STEPS}_steps": sum(point["loss"] for point in tail) / len(tail)},
        "layer_losses": {layer: round(value, 4) for layer, value in losses.items()},
        "layer_loss_mean": sum(losses.values()) / len(losses),
        "worst_layers": [{"layer": int(layer), "loss": round(value, 4)} for layer, value in ranked[:5]],
    }


def _plot(result: dict, output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(11, 4.5))
    for name, probe in result["probes"].items():
        layers = sorted(probe["layer_losses"], key=int)
        axis.plot([int(layer) for layer in layers], [probe["layer_losses"][layer] for layer in layers], marker="o",
                  label=f"{name}: mean {probe['layer_loss_mean']:.1f}")
    axis.set_xlabel("layer")
    axis.set_ylabel("transfer loss (1000 x MSE of the attention outputs)")
    axis.set_title(result["title"], fontsize=10)
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(output, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe", action="append", required=True, metavar="NAME=DIR",
                        help="a linearize staging area (.NAME.linearize) after its select stage; repeat")
    parser.add_argument("--command", required=True, help="the command that produced the probes (recorded)")
    parser.add_argument("--title", default="window hybrid tail probes: per-layer transfer loss after the select stage")
    parser.add_argument("--output", required=True, help="the JSON to write; a PNG of the same name is written beside")
    args = parser.parse_args(argv)
    probes = {}
    for item in args.probe:
        name, separator, folder = item.partition("=")
        if not separator or not name or not folder:
            parser.error(f"--probe {item!r}: expected NAME=DIR")
        probes[name] = _probe(name, folder)
    import torch

    from hf_performer.bench.machine import machine_info

    result = {"title": args.title, "probes": probes, "command": args.command,
              "machine": machine_info(torch.device("cpu"))}
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output + ".tmp", "w") as handle:
        json.dump(result, handle, indent=2)
    os.replace(args.output + ".tmp", args.output)
    _plot(result, os.path.splitext(args.output)[0] + ".png")
    for name, probe in probes.items():
        print(f"{name:16s} transfer {probe['transfer']['steps']} steps {probe['transfer']['wall_time_s']:7.0f} s  "
              f"layer loss mean {probe['layer_loss_mean']:6.2f}  worst "
              + ", ".join(f"{w['layer']}: {w['loss']:.1f}" for w in probe["worst_layers"]))
    print(f"wrote {args.output} and {os.path.splitext(args.output)[0]}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
