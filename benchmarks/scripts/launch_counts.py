"""Kernel launches and host synchronisations of each attention kind: the CPU path against the parallel (CUDA) path.

What sets a GPU's time at short lengths and when decoding is the number of launches and the host reads, which are the
same on any device: counted here on the CPU (``hf_performer.bench.operations``) with ``HF_PERFORMER_ATTENTION_PATH``
set to each path, for one attention call (B=1, H=12, d=64, forward + backward) at two lengths, and per generated token
and per layer of one training step (1,024 tokens, bf16 autocast) of a tiny SmolLM2-shaped model (9 heads, 3 KV heads)
and its conversions. No timing: counts, exact and repeatable.

    python benchmarks/scripts/launch_counts.py --output-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

# Without a GPU the selection kernel runs in Triton's interpreter (which must be on before triton is imported); it
# counts as the one launch it is on a GPU (below), not as the interpreter's own operations.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import _disable_current_modes  # noqa: E402

from hf_performer import window_causal, window_parallel  # noqa: E402
from hf_performer.bench.machine import machine_info  # noqa: E402
from hf_performer.bench.operations import attention_call_counts, count_operations  # noqa: E402
from hf_performer.linear_attention_parallel import PATH_VARIABLE  # noqa: E402

_SELECTION_KERNEL = window_causal.select_without_tail


def _one_launch(*args, **kwargs):
    """The selection kernel, run outside the counting mode and counted as one launch."""
    with _disable_current_modes():
        result = _SELECTION_KERNEL(*args, **kwargs)
    torch.empty(0).zero_()  # (one counted operation: the kernel's launch)
    return result


window_causal.select_without_tail = window_parallel.select_without_tail = _one_launch

KINDS = [("favor", "bidirectional"), ("favor", "causal"), ("window", "bidirectional"), ("window", "causal"),
         ("window-cache", "causal"), ("improved-clustered", "bidirectional"), ("sdpa", "causal")]
DECODERS = {
    "softmax": None,
    "window64_g256": dict(feature_map="hedgehog", window=64, sinks=4, sparse_cache=256, linear_tail=False),
    "window64_tail": dict(feature_map="hedgehog", window=64, sinks=4),
    "favor": dict(feature_map="favor+"),
}


def _smollm2_shaped(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=99, hidden_size=144, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=16, max_position_embeddings=4096)
    return LlamaForCausalLM(config)


def _converted(source, settings):
    from hf_performer.conversion import convert_to_performer

    return source if settings is None else convert_to_performer(source, task="causal-lm", **settings)


def training_counts(length: int = 1024, layers=(1, 2)) -> dict:
    """Launches and synchronisations per layer of one training step (forward + backward of the LM loss, bf16 autocast,
    ``1 x length`` tokens, the model's default ``use_cache``): the difference between a 2- and a 1-layer model."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    per_layers = {}
    for count in layers:
        source = _smollm2_shaped(count)
        ids = torch.randint(0, 99, (1, length))
        for name, settings in DECODERS.items():
            model = _converted(source, settings).train()

            def step():
                with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                model.zero_grad(set_to_none=True)

            step()
            counts = count_operations(step)
            per_layers.setdefault(name, {})[count] = (counts.launches, counts.synchronisations)
    low, high = layers
    return {name: {"launches_per_layer": (c[high][0] - c[low][0]) / (high - low),
                   "synchronisations_per_layer": (c[high][1] - c[low][1]) / (high - low)}
            for name, c in per_layers.items()}


def decode_counts(dtype: torch.dtype, layers=(1, 2), steps: int = 64) -> dict:
    """Launches and synchronisations per generated token and layer (the difference between a 2- and a 1-layer model),
    inside ``generate`` after a 600-token prompt."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    per_layers = {}
    for count in layers:
        source = _smollm2_shaped(count).eval()
        ids = torch.randint(0, 99, (1, 600))
        for name, settings in DECODERS.items():
            model = _converted(source, settings)
            model.to(dtype)

            def generate(tokens):
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                   min_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0)

            short, long = count_operations(lambda: generate(1)), count_operations(lambda: generate(1 + steps))
            per_layers.setdefault(name, {})[count] = (
                (long.launches - short.launches) / steps, (long.synchronisations - short.synchronisations) / steps)
    low, high = layers
    return {name: {"launches_per_layer": (counts[high][0] - counts[low][0]) / (high - low),
                   "synchronisations_per_layer": (counts[high][1] - counts[low][1]) / (high - low),
                   "launches_per_token_2_layers": counts[high][0]} for name, counts in per_layers.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096])
    args = parser.parse_args(argv)
    previous = os.environ.get(PATH_VARIABLE)
    records, decoding, training = [], {}, {}
    try:
        for path in ("chunked", "parallel"):
            os.environ[PATH_VARIABLE] = path
            for implementation, mode in KINDS:
                for length in args.lengths:
                    counts = attention_call_counts(implementation, mode, length)
                    records.append(dict(path=path, implementation=implementation, mode=mode, length=length, **counts))
                    print(f"{path:9s} {implementation:13s} {mode:13s} L={length:6d} launches {counts['launches']:7d} "
                          f"syncs {counts['synchronisations']:5d}", flush=True)
            for dtype in (torch.float32, torch.bfloat16):
                decoding[f"{path}/{str(dtype).replace('torch.', '')}"] = decode_counts(dtype)
            training[path] = training_counts()
    finally:
        if previous is None:
            os.environ.pop(PATH_VARIABLE, None)
        else:
            os.environ[PATH_VARIABLE] = previous
    result = {
        "benchmark": "launch_counts",
        "command": "python benchmarks/scripts/launch_counts.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "what": "aten operations that are not views (kernel launches on a GPU) and host reads, counted on the CPU",
        "settings": {"batch": 1, "heads": 12, "head_dim": 64, "nb_features": 256, "backward": True,
                     "triton_interpret": os.environ.get("TRITON_INTERPRET", "0")},
        "machine": machine_info(torch.device("cpu")),
        "records": records,
        "decoding": decoding,
        "training": training,
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "launch_counts.json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(result, args.output_dir / "launch_counts.png")
    for key, table in decoding.items():
        for name, row in table.items():
            print(f"decode {key:18s} {name:14s} {row['launches_per_layer']:7.1f} launches / layer / token, "
                  f"{row['synchronisations_per_layer']:.2f} host reads")
    return 0


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in result["records"]})
    kinds = [(i, m) for i, m in KINDS if i != "sdpa"]
    figure, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4), sharey=True)
    axes = axes if len(lengths) > 1 else [axes]
    for axis, length in zip(axes, lengths):
        for offset, kernel_path in ((-0.2, "chunked"), (0.2, "parallel")):
            values = [next(r["launches"] for r in result["records"] if r["path"] == kernel_path and r["length"] == length
                           and (r["implementation"], r["mode"]) == kind) for kind in kinds]
            axis.bar([i + offset for i in range(len(kinds))], values, width=0.4, label=f"{kernel_path} path")
        sdpa = next(r["launches"] for r in result["records"] if r["implementation"] == "sdpa" and r["length"] == length)
        axis.axhline(sdpa, color="black", linestyle=":", label="SDPA")
        axis.set_xticks(range(len(kinds)), ["\n".join(i.split("-") + [m]) for i, m in kinds], fontsize=8)
        axis.set_yscale("log")
        axis.set_title(f"one attention call, fwd + bwd, L = {length}")
        axis.set_ylabel("kernel launches (non-view operations)")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    raise SystemExit(main())
