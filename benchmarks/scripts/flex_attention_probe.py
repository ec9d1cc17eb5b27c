"""Can FlexAttention run the window hybrid's band on this CPU? (issue 34 names it as an option.)

    python benchmarks/scripts/flex_attention_probe.py [--length 4096] [--threads 1]

Tries what the operator would need from ``torch.nn.attention.flex_attention`` compiled for the CPU (sinks + a causal
window as a block mask): a backward (training), the log-sum-exp (the shared normaliser with a tail), and times the
forward that remains against the fused exact path of ``window_linear_attention`` without a tail (same sinks and
window) and causal SDPA, median of 3 after a warm-up, in one process. Prints one line per finding.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from hf_performer import window_linear_attention

    torch.set_num_threads(args.threads)
    length, window, sinks = args.length, args.window, args.sinks
    block_mask = create_block_mask(lambda b, h, q, k: (k <= q) & ((q - k < window) | (k < sinks)), 1, args.heads,
                                   length, length, device="cpu", BLOCK_SIZE=64)
    q, k, v = (torch.randn(1, args.heads, length, 64) for _ in range(3))

    def median(call):
        call()
        call()  # compiled at the first call
        times = []
        for _ in range(3):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    with torch.no_grad():
        flex = torch.compile(flex_attention, dynamic=False)
        timings = {
            "flex_attention (compiled, block mask)": median(lambda: flex(q, k, v, block_mask=block_mask)),
            "window_linear_attention, no tail (fused exact path)": median(
                lambda: window_linear_attention(q, k, v, None, window=window, sinks=sinks, chunk_size=64)),
            "causal SDPA": median(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        }
    checks = (("backward", lambda flex: flex(*(t.clone().requires_grad_() for t in (q, k, v)),
                                            block_mask=block_mask).sum().backward()),
              ("return_lse", lambda flex: flex(q, k, v, block_mask=block_mask, return_lse=True)))
    for what, call in checks:
        torch._dynamo.reset()
        try:
            with torch.no_grad() if what == "return_lse" else contextlib.nullcontext():
                call(torch.compile(flex_attention, dynamic=False, fullgraph=True))
            print(f"{what}: supported")
        except Exception as error:  # noqa: BLE001 (the finding is the error's message)
            lines = [line.strip() for line in str(error).splitlines() if "support" in line] or [str(error)]
            print(f"{what}: not supported: {lines[0][:200]}")
    for name, seconds in timings.items():
        print(f"forward, {name}: {seconds:.4f} s (L={length}, {args.heads} heads, {args.threads} threads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
