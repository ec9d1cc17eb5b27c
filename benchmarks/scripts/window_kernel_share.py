"""How much of a causal window-cache call (window + sinks + sparse cache, no tail: fwd + bwd) is SDPA's fused CPU
kernel, and how fast the call would be against causal SDPA if it were the kernels alone.

    python benchmarks/scripts/window_kernel_share.py --lengths 4096,8192,16384

The fused path (:mod:`hf_performer.window_exact_blocks`) runs each group of query blocks as one call of
``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward; everything else in the call (the sparse
cache's selection, the per-block keys, values and masks, the gathers and their gradients, the segments' bookkeeping)
is the rest. Both kernels are timed inside the call (``time.perf_counter`` around each), the call and causal SDPA
around the whole forward + backward, interleaved, medians of ``--repeats`` after a warm-up. B, heads and head size as
``hf-performer bench attention`` (1, 12, 64); window 64, 4 sinks, G 256 by default.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--lengths", default="4096", help="sequence lengths (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--sparse-cache", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        args.lengths = [int(part) for part in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths must be comma-separated ints, got {args.lengths!r}")
    if min(args.lengths) < 1 or min(args.heads, args.repeats, args.threads, args.sparse_cache) < 1:
        parser.error("--lengths, --heads, --repeats, --threads and --sparse-cache must be >= 1")
    return args


class KernelClock:
    """Stands in for ``torch`` in :mod:`hf_performer.window_exact_blocks`, timing its two kernel calls."""

    KERNELS = {"_scaled_dot_product_flash_attention_for_cpu": "forward",
               "_scaled_dot_product_flash_attention_for_cpu_backward": "backward"}

    def __init__(self, torch):
        self.torch, self.seconds = torch, {"forward": 0.0, "backward": 0.0}
        clock = self

        class Aten:
            def __getattr__(self, name):
                function = getattr(torch.ops.aten, name)
                if name not in KernelClock.KERNELS:
                    return function

                def timed(*args, **kwargs):
                    start = time.perf_counter()
                    result = function(*args, **kwargs)
                    clock.seconds[KernelClock.KERNELS[name]] += time.perf_counter() - start
                    return result
                return timed

        self.ops = types.SimpleNamespace(aten=Aten())

    def __getattr__(self, name):
        return getattr(self.torch, name)


def measure(length: int, args, torch, clock) -> dict:
    from torch.nn.functional import scaled_dot_product_attention

    from hf_performer import window_linear_attention

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, length, 64, generator=generator).requires_grad_() for _ in range(3))

    def window_call():
        window_linear_attention(q, k, v, None, window=args.window, sinks=args.sinks, sparse_cache=args.sparse_cache,
                                causal=True).sum().backward()

    def sdpa_call():
        scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    times = {"window": [], "sdpa": [], "kernels": []}
    for round_index in range(args.repeats + 1):  # a warm-up round
        clock.seconds.update(forward=0.0, backward=0.0)
        start = time.perf_counter()
        window_call()
        window = time.perf_counter() - start
        start = time.perf_counter()
        sdpa_call()
        sdpa = time.perf_counter() - start
        if round_index:
            times["window"].append(window)
            times["sdpa"].append(sdpa)
            times["kernels"].append(sum(clock.seconds.values()))
    median = {name: statistics.median(values) for name, values in times.items()}
    return dict(length=length, median_s=median, kernel_share=median["kernels"] / median["window"],
                sdpa_over_window=median["sdpa"] / median["window"], sdpa_over_kernels=median["sdpa"] / median["kernels"])


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from hf_performer import window_exact_blocks

    torch.set_num_threads(args.threads)
    clock = KernelClock(torch)
    window_exact_blocks.torch = clock
    try:
        for length in args.lengths:
            row = measure(length, args, torch, clock)
            s = row["median_s"]
            print(f"L {length}: window-cache {s['window']:.3f} s (its kernels {s['kernels']:.3f} s, "
                  f"{100 * row['kernel_share']:.0f}%), SDPA {s['sdpa']:.3f} s: {row['sdpa_over_window']:.2f}x SDPA, "
                  f"the kernels alone {row['sdpa_over_kernels']:.2f}x", flush=True)
    finally:
        window_exact_blocks.torch = torch
    return 0


if __name__ == "__main__":
    sys.exit(main())
