"""How much attention error a window hybrid's linear tail removes, layer by layer.

For each transferred window-hybrid model folder (``NAME=FOLDER``), every window layer's attention output is compared
with exact softmax under teacher forcing (``hf_performer.conversion.attention_transfer.measure_transfer_losses``,
1000 x MSE as the transfer stage reports it) twice on the same text: with the layer's tail, and with the tail dropped
(sinks + window alone). Their ratio per layer is the share of the window-only error the tail leaves.

    python benchmarks/scripts/tail_error_probe.py w64=../runs/wh_bf16/hybrid_transfer \\
        w256=../runs/wh_w256/hybrid_transfer --text-file ../shared/data/wikitext-2-raw/wiki.test.raw \\
        --output benchmarks/results/window_hybrid_smollm2_tail_error.json

Writes the JSON (per model: window, sinks, features, per-layer errors with and without the tail, their means; the
text, sequences, machine and command; paths relative to the working directory) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse_models(pairs: list[str]) -> dict[str, str]:
    models = {}
    for pair in pairs:
        name, sep, folder = pair.partition("=")
        if not sep or not name or not folder:
            raise SystemExit(f"tail_error_probe: expected NAME=FOLDER, got {pair!r}")
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise SystemExit(f"tail_error_probe: {name}: no config.json in {folder} (a saved model folder is expected)")
        models[name] = folder
    return models


def measure(folder: str, text: str, length: int, sequences: int, seed: int) -> dict:
    """Per-layer errors of one folder's window layers with and without their tails."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_performer.conversion.attention_transfer import measure_transfer_losses
    from hf_performer.recipes.linearize import OUTPUT_LOSS_FACTOR, transfer_batches  # errors as the transfer's loss

    tokenizer = AutoTokenizer.from_pretrained(folder)
    batches = transfer_batches(tokenizer(text)["input_ids"], length, 1, seed)[:sequences]
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    settings = model.config.favor_settings
    errors = {}
    for variant, with_tail in (("hybrid", True), ("window_only", False)):
        measured = measure_transfer_losses(model, batches, with_tail=with_tail)
        errors[variant] = {str(layer): OUTPUT_LOSS_FACTOR * entry["output_squared_error"]
                           for layer, entry in measured.items()}
    if not errors["window_only"]:
        raise SystemExit(f"tail_error_probe: {folder} has no window-hybrid layer with a tail")
    layers = list(errors["window_only"])
    ratios = {layer: errors["hybrid"][layer] / errors["window_only"][layer] for layer in layers}
    mean = {variant: sum(values.values()) / len(values) for variant, values in errors.items()}
    return {"window": settings.get("window"), "sinks": settings.get("sinks"),
            "feature_map": settings.get("feature_map"), "nb_features": settings.get("nb_features"),
            "sequences": len(batches), "errors": errors, "ratio_hybrid_to_window_only": ratios, "mean": mean,
            "mean_ratio": mean["hybrid"] / mean["window_only"]}


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    figure, (errors_axis, ratio_axis) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, model in models.items():
        layers = [int(layer) for layer in model["errors"]["window_only"]]
        line, = errors_axis.plot(layers, list(model["errors"]["window_only"].values()), "--", alpha=0.7,
                                 label=f"{name}: window only")
        errors_axis.plot(layers, list(model["errors"]["hybrid"].values()), "-o", ms=3, color=line.get_color(),
                         label=f"{name}: with tail")
        ratio_axis.plot(layers, list(model["ratio_hybrid_to_window_only"].values()), "-o", ms=3,
                        label=f"{name} (mean {model['mean_ratio']:.2f})")
    errors_axis.set(xlabel="layer", ylabel="1000 x MSE vs exact softmax", title="attention-output error per layer")
    ratio_axis.axhline(1.0, color="grey", lw=0.8)
    ratio_axis.set(xlabel="layer", ylabel="with tail / window only", ylim=(0, 1.2),
                   title="error the tail leaves (1 = the tail removes nothing)")
    for axis in (errors_axis, ratio_axis):
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    figure.suptitle(f"{result['sequences']} x {result['length']} tokens of {result['text_file']}, teacher forcing")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", metavar="NAME=FOLDER", help="transferred window-hybrid model folders")
    parser.add_argument("--text-file", required=True, help="evaluation text (e.g. wiki.test.raw)")
    parser.add_argument("--max-chars", type=int, default=400_000,
                        help="characters of the text read (default: %(default)s)")
    parser.add_argument("--length", type=int, default=2048, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--sequences", type=int, default=4, help="sequences measured (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="order of the sequences (default: %(default)s)")
    parser.add_argument("--output", required=True, help="the JSON to write (the PNG goes beside it)")
    args = parser.parse_args(argv)
    if not args.output.endswith(".json"):
        raise SystemExit(f"tail_error_probe: --output must end in .json, got {args.output!r}")
    models = _parse_models(args.models)
    with open(args.text_file, encoding="utf-8") as handle:
        text = handle.read(args.max_chars)

    from pathlib import Path

    import torch

    from hf_performer.bench.machine import load_average, machine_info
    from hf_performer.bench.report import write_result

    machine = {**machine_info(torch.device("cpu")), "load_average": load_average()}
    result = {"what": "per-layer attention-output error (1000 x MSE against exact softmax, every layer fed the "
                      "softmax model's hidden states) of each model's window layers, with the linear tail and with "
                      "it dropped (sinks + window alone)",
              "text_file": os.path.basename(args.text_file), "max_chars": args.max_chars, "length": args.length,
              "sequences": args.sequences, "seed": args.seed,
              "models": {name: measure(folder, text, args.length, args.sequences, args.seed)
                         for name, folder in models.items()},
              "machine": machine,
              "command": "python benchmarks/scripts/tail_error_probe.py " + " ".join(
                  [f"{name}={os.path.relpath(folder)}" for name, folder in models.items()]
                  + [f"--text-file {os.path.relpath(args.text_file)}", f"--max-chars {args.max_chars}",
                     f"--length {args.length}", f"--sequences {args.sequences}", f"--seed {args.seed}"])}
    output = Path(args.output)
    write_result(result, output.parent, output.stem, _plot)
    for name, model in result["models"].items():
        print(f"{name}: window {model['window']}, mean error with tail {model['mean']['hybrid']:.3f}, window only "
              f"{model['mean']['window_only']:.3f} (ratio {model['mean_ratio']:.3f})")
    print(f"wrote {args.output} and its .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
