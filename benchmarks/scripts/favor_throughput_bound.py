"""An upper bound on FAVOR+'s achievable matmul throughput on this machine (issue 17's "GFLOP/s >= 70% of matmul").

    python benchmarks/scripts/favor_throughput_bound.py --output-dir benchmarks/results

A fwd+bwd call of FAVOR+ (B=1, H=12, d=64, m=256, float32) must do its matmuls (the FLOPs ``attention_flops``
counts) and its ``exp``s (positive random features: one per feature of every query and key, in the forward and
again when the backward recomputes them; causal calls also one per entry of each chunk's decay tile). This script
times, in one process and beside the plain 2048 x 2048 matmul that the target is measured against:

* each kind of product the kernel runs, at several shapes a kernel could choose (the chunk sizes, whole-sequence
  products), keeping the fastest: an optimistic rate for each kind;
* ``exp`` over an L2-sized ``[H, C, m]`` tile, in place: the cheapest ``exp`` per element torch has here;
* the library's own call, for its achieved figure.

The bound is the counted FLOPs over (the products at their best rate + the exps at that rate): what a kernel that
did nothing else at all would reach. It ignores every other pass over the features (shifts, stabilisers, masks,
the vjp's products with the features): a real kernel is below it.

Writes ``NAME.json`` and ``NAME.png`` (``--name``, default ``favor_throughput_bound``). The machine should be idle:
the figures are compared within the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

FEATURES, HEAD_DIM, HEADS = 256, 64, 12
NAME = "favor_throughput_bound"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="8192,16384",
                        help="comma-separated sequence lengths (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed repeats per measurement, median kept (default: 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--output-dir", default=None, help="write NAME.json and NAME.png here (default: print only)")
    parser.add_argument("--name", default=NAME, help="file stem of the outputs (default: %(default)s)")
    return parser.parse_args(argv)


def _median_seconds(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def product_rates(length: int, repeats: int) -> dict:
    """GFLOP/s of each kind of product FAVOR+ runs, at the shapes a kernel could choose; ``best`` is the fastest."""
    import torch

    H, d, m, e = HEADS, HEAD_DIM, FEATURES, HEAD_DIM + 1
    kinds = {
        # features: [C, d] x [d, m] per head (projections and the vjp's [C, m] x [m, d])
        "projection": lambda C: ((torch.randn(H, C, d), torch.randn(d, m)), 2 * H * C * d * m),
        # sums: [C, m] x [m, e] (outputs from the state) and [m, C] x [C, e] (the state from keys and values)
        "feature_times_state": lambda C: ((torch.randn(H, C, m), torch.randn(H, m, e)), 2 * H * C * m * e),
        "state_update": lambda C: ((torch.randn(H, m, C), torch.randn(H, C, e)), 2 * H * C * m * e),
        # causal tiles: [C, m] x [m, C] (scores) and [C, C] x [C, e]
        "tile_scores": lambda C: ((torch.randn(H, C, m), torch.randn(H, m, C)), 2 * H * C * C * m),
        "tile_values": lambda C: ((torch.randn(H, C, C), torch.randn(H, C, e)), 2 * H * C * C * e),
    }
    chunks = {"projection": (64, 128, 512, length), "feature_times_state": (64, 128, 512, length),
              "state_update": (64, 128, 512, length), "tile_scores": (64, 128), "tile_values": (64, 128)}
    rates = {}
    for kind, make in kinds.items():
        shapes = {}
        for C in chunks[kind]:
            (a, b), flops = make(C)
            count = max(1, length // C)  # the products of one pass over the sequence
            seconds = _median_seconds(lambda: [torch.matmul(a, b) for _ in range(count)], repeats)
            shapes[str(C)] = flops * count / seconds / 1e9
        rates[kind] = {"by_chunk": shapes, "best": max(shapes.values())}
    return rates


def exp_seconds_per_element(repeats: int) -> float:
    import torch

    source, target = torch.randn(HEADS, 128, FEATURES), torch.empty(HEADS, 128, FEATURES)
    count = 64
    return _median_seconds(lambda: [torch.exp(source, out=target) for _ in range(count)], repeats) / (
        count * source.numel())


def flops_by_kind(mode: str, length: int, chunk: int) -> dict:
    """The counted FLOPs of ``attention_flops`` split by kind of product (per call, all heads)."""
    L, d, m, e, C, H = length, HEAD_DIM, FEATURES, HEAD_DIM + 1, chunk, HEADS
    if mode == "bidirectional":  # fwd 4Lmd + 4Lme, bwd 8Lmd + 8Lme
        return {"projection": H * 12 * L * m * d, "feature_times_state": H * 6 * L * m * e,
                "state_update": H * 6 * L * m * e}
    # causal: fwd 4Lmd + 2LC(m+e) + 4Lme, bwd 12Lmd + 6LC(m+e) + 10Lme
    return {"projection": H * 16 * L * m * d, "feature_times_state": H * 7 * L * m * e,
            "state_update": H * 7 * L * m * e, "tile_scores": H * 8 * L * C * m, "tile_values": H * 8 * L * C * e}


def exp_count(mode: str, length: int, chunk: int) -> int:
    """Exps of one fwd+bwd call: every query and key feature in the forward and in each backward pass that
    recomputes it (bidirectional: one; causal: two), plus the causal decay tile ``[C, C]`` per chunk and pass."""
    L, m, H = length, FEATURES, HEADS
    if mode == "bidirectional":
        return H * 4 * L * m
    return H * (6 * L * m + 3 * L * chunk)


def measure(lengths, repeats: int) -> dict:
    import torch

    from hf_performer.bench.attention import attention_flops, make_attention_call, time_attention_call
    from hf_performer.bench.machine import machine_info, matmul_gflops
    from hf_performer.linear_attention import DEFAULT_CHUNK_SIZE
    from hf_performer.linear_attention_chunks import BIDIRECTIONAL_MIN_CHUNK

    device = torch.device("cpu")
    matmul = matmul_gflops(device, torch.float32)
    exp_seconds = exp_seconds_per_element(repeats)
    records = []
    for length in lengths:
        rates = product_rates(length, repeats)
        for mode in ("bidirectional", "causal"):
            chunk = max(DEFAULT_CHUNK_SIZE, BIDIRECTIONAL_MIN_CHUNK) if mode == "bidirectional" else DEFAULT_CHUNK_SIZE
            flops = flops_by_kind(mode, length, chunk)
            counted = attention_flops("favor", mode, length, HEADS, HEAD_DIM, FEATURES, chunk_size=chunk)
            assert abs(sum(flops.values()) - counted) < 1e-6 * counted, (mode, sum(flops.values()), counted)
            product_seconds = sum(flops[kind] / (rates[kind]["best"] * 1e9) for kind in flops)
            exps = exp_count(mode, length, chunk)
            call = make_attention_call("favor", mode, HEAD_DIM, FEATURES, DEFAULT_CHUNK_SIZE, device)
            seconds = time_attention_call(call, 1, HEADS, length, HEAD_DIM, device, torch.float32, repeats=repeats)
            bound_products = counted / product_seconds / 1e9
            bound = counted / (product_seconds + exps * exp_seconds) / 1e9
            records.append(dict(
                length=length, mode=mode, chunk=chunk, counted_flops=counted, flops_by_kind=flops,
                best_rates_gflops={kind: rates[kind]["best"] for kind in flops}, exps=exps,
                products_seconds=product_seconds, exp_seconds=exps * exp_seconds, call_seconds=seconds,
                achieved_gflops=counted / seconds / 1e9, bound_products_only_gflops=bound_products,
                bound_gflops=bound, achieved_over_matmul=counted / seconds / 1e9 / matmul,
                bound_products_only_over_matmul=bound_products / matmul, bound_over_matmul=bound / matmul,
                rates_by_chunk={kind: rates[kind]["by_chunk"] for kind in flops},
            ))
    return dict(matmul_gflops=matmul, exp_ns_per_element=exp_seconds * 1e9, records=records,
                machine=machine_info(device))


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = result["records"]
    labels = [f"{r['mode']}\nL={r['length'] // 1024}k" for r in records]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = range(len(records))
    width = 0.27
    series = (("achieved (library)", "achieved_over_matmul", "tab:blue"),
              ("bound: products + exps only", "bound_over_matmul", "tab:orange"),
              ("bound: products only", "bound_products_only_over_matmul", "tab:gray"))
    for offset, (label, key, color) in zip((-width, 0, width), series):
        values = [100 * r[key] for r in records]
        bars = ax.bar([i + offset for i in x], values, width, label=label, color=color)
        ax.bar_label(bars, fmt="%.0f%%", fontsize=8)
    ax.axhline(70, color="tab:red", linestyle="--", label="issue 17 target (70%)")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("% of the plain matmul figure")
    ax.set_ylim(0, 125)
    ax.set_title(f"FAVOR+ fwd+bwd throughput vs the {result['matmul_gflops']:.0f} GFLOP/s matmul figure, "
                 f"H={HEADS} d={HEAD_DIM} m={FEATURES}, float32\n{result['machine'].get('device_name', 'CPU')}",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        lengths = [int(part) for part in args.lengths.split(",") if part.strip()]
    except ValueError:
        print(f"--lengths must be comma-separated integers; got {args.lengths!r}", file=sys.stderr)
        return 2
    if not lengths or min(lengths) < 1024 or args.repeats < 1:
        print("--lengths must be integers >= 1024 and --repeats >= 1", file=sys.stderr)
        return 2
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(lengths, args.repeats)
    result["command"] = "python benchmarks/scripts/favor_throughput_bound.py " + " ".join(argv or sys.argv[1:])
    print(f"matmul {result['matmul_gflops']:.0f} GFLOP/s; exp {result['exp_ns_per_element']:.3f} ns per element")
    print(f"{'mode':>13} {'L':>6} {'achieved':>9} {'bound':>7} {'products only':>14}   (% of the matmul figure)")
    for r in result["records"]:
        print(f"{r['mode']:>13} {r['length']:>6} {r['achieved_over_matmul']:>9.0%} {r['bound_over_matmul']:>7.0%} "
              f"{r['bound_products_only_over_matmul']:>14.0%}")
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
        stem = os.path.join(args.output_dir, args.name)
        with open(stem + ".json", "w") as handle:
            json.dump(result, handle, indent=2)
        plot(result, stem + ".png")
        print(f"wrote {stem}.json and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
