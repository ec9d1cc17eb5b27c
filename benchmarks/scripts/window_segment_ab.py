"""Time and peak memory of training's causal window attention with recomputed segments against one pass.

``window_linear_attention`` runs a call that needs gradients in recomputed segments of
``CAUSAL_SEGMENT_LENGTH`` queries. This sets that length (``--segment-length 0``: one pass) and times, in this
process, either one operator call (SmolLM2-135M's LoRA shapes: B=2, 9 heads, L=1024, d=64, Hedgehog tail, learned
gamma) or, with ``--model``, the forward + backward of a converted model on 2 x 1024 tokens under bf16 autocast with
gradients for q/k/v/o only (as LoRA's). Run each setting in its own process, alternately:

    for run in 1 2; do for segment in 256 0; do
        python benchmarks/scripts/window_segment_ab.py --segment-length $segment --model ../runs/wh_bf16/hybrid_lora
    done; done

Prints the median (after one warm-up), every time in seconds and the peak resident-memory growth.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--segment-length", type=int, required=True, help="queries per segment; 0: one pass")
    parser.add_argument("--model", help="a converted causal-LM folder: time its whole forward + backward instead")
    parser.add_argument("--window", type=int, default=64, help="the operator call's window (without --model)")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args(argv)
    if args.segment_length < 0:
        parser.error(f"--segment-length must be >= 0 (0: one pass), got {args.segment_length}")

    import torch

    import hf_performer.window_attention as window_attention
    from hf_performer.bench.machine import peak_resident_bytes, reset_peak_resident, resident_bytes
    from hf_performer.feature_maps import make_feature_map

    window_attention.CAUSAL_SEGMENT_LENGTH = args.segment_length or sys.maxsize
    generator = torch.Generator().manual_seed(0)
    if args.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model).train()
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(any(part in name for part in ("q_proj", "k_proj", "v_proj", "o_proj")))
        ids = torch.randint(0, model.config.vocab_size, (2, 1024), generator=generator)

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
    else:
        heads, dim = 9, 64
        q, k, v = (torch.randn(2, heads, 1024, dim, generator=generator).requires_grad_() for _ in range(3))
        feature_map = make_feature_map("hedgehog", dim, num_heads=heads)
        gamma = torch.full((heads,), 0.1, requires_grad=True)

        def step():
            out = window_attention.window_linear_attention(q, k, v, feature_map, window=args.window, sinks=4,
                                                           softmax_weight=gamma)
            out.backward(torch.ones_like(out))
            q.grad = k.grad = v.grad = None

    base, times = resident_bytes(), []
    reset_peak_resident()
    for _ in range(args.repeats + 1):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    growth = (peak_resident_bytes() - base) / 2**20
    what = f"model {args.model}" if args.model else f"operator, window {args.window}"
    print(f"{what}, segment length {args.segment_length or 'one pass'}: median {statistics.median(times[1:]):.3f} s "
          f"{[round(t, 3) for t in times]}, peak resident +{growth:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
