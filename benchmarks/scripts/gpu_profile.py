"""Where one attention call's time goes on a CUDA GPU: kernel time against wall time, and launches.

For each kind at one length (bf16, forward + backward, B=1, H=12, d=64), torch.profiler reads the sum of the CUDA
kernels' durations and their number; wall time over kernel time says how launch-bound a call is (METHOD.md's gap).

    python benchmarks/scripts/gpu_profile.py --length 16384 --output benchmarks/results/gpu_profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from hf_performer.bench.attention import make_attention_call

KINDS = [("sdpa", "causal"), ("favor", "bidirectional"), ("favor", "causal"), ("window", "causal"),
         ("window-cache", "causal"), ("window", "bidirectional")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    records = []
    for implementation, mode in KINDS:
        call = make_attention_call(implementation, mode, 64, 256, 64, device, heads=12)
        q, k, v = (torch.randn(1, 12, args.length, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))

        def step():
            call(q, k, v).backward(torch.ones(1, 12, args.length, 64, device=device, dtype=torch.bfloat16))

        step()
        torch.cuda.synchronize()
        walls = []
        for _ in range(3):
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        kernel_us = sum(e.device_time for e in events)
        top = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]
        records.append(dict(implementation=implementation, mode=mode, length=args.length,
                            wall_ms=1e3 * statistics.median(walls), kernel_ms=kernel_us / 1e3, kernels=len(events),
                            top=[(e.key[:80], round(e.device_time_total / 1e3, 3), e.count) for e in top]))
        print(f"{implementation:13s} {mode:13s} wall {records[-1]['wall_ms']:9.2f} ms  kernels "
              f"{records[-1]['kernel_ms']:8.2f} ms in {len(events)} launches", flush=True)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"benchmark": "gpu_profile", "command": "python benchmarks/scripts/"
                                           f"gpu_profile.py --length {args.length} --output benchmarks/results/"
                                           f"{args.output.name}", "device": torch.cuda.get_device_name(),
                                           "dtype": "bfloat16", "records": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
