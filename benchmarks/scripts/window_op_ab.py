"""Time one causal forward + backward of ``window_linear_attention`` with the package of a given checkout, for an A/B
of two commits in alternating processes (the numbers of one process are comparable only to those of its twin):

    git worktree add ../before COMMIT~1
    for run in 1 2 3; do
        python benchmarks/scripts/window_op_ab.py . ; python benchmarks/scripts/window_op_ab.py ../before
    done

Shapes default to SmolLM2-135M's LoRA step (B=2, 9 heads, L=1024, d=64; window 64, 4 sinks, hedgehog tail of 128
features, learned gamma); ``--no-tail --kv-heads 3 --sparse-cache 256`` times the recommended causal-LM configuration
(no tail, a sparse cache) at that shape. Prints the median and every time in seconds (after one warm-up call).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("checkout", help="the repository whose hf_performer is timed")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--sparse-cache", type=int, default=0, help="hard keys per key head (default: 0, none)")
    parser.add_argument("--no-tail", action="store_true", help="no linear tail (no feature map, no gamma)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    checkout = os.path.abspath(args.checkout)
    if not os.path.isfile(os.path.join(checkout, "hf_performer", "__init__.py")):
        parser.error(f"{args.checkout} holds no hf_performer package")
    sys.path.insert(0, checkout)
    import torch

    import hf_performer

    if not os.path.abspath(hf_performer.__file__).startswith(checkout + os.sep):
        parser.error(f"hf_performer was imported from {hf_performer.__file__}, not from {checkout}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kv_heads = args.kv_heads or args.heads
    if args.heads % kv_heads:
        parser.error(f"--heads {args.heads} is not a multiple of --kv-heads {kv_heads}")
    query = torch.randn(args.batch, args.heads, args.length, args.head_dim, requires_grad=True)
    key, value = (torch.randn(args.batch, kv_heads, args.length, args.head_dim, requires_grad=True) for _ in range(2))
    feature_map = None if args.no_tail else hf_performer.make_feature_map(
        "hedgehog", args.head_dim, num_heads=args.heads, num_key_value_heads=kv_heads)
    gamma = None if args.no_tail else torch.full((args.heads,), 0.1, requires_grad=True)
    extra = {"sparse_cache": args.sparse_cache} if args.sparse_cache else {}

    def call():
        out = hf_performer.window_linear_attention(query, key, value, feature_map, window=args.window,
                                                   sinks=args.sinks, causal=True, softmax_weight=gamma, **extra)
        out.sum().backward()
        for tensor in (query, key, value, gamma):
            if tensor is not None:
                tensor.grad = None

    call()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    print(f"{args.checkout}: median {statistics.median(times):.4f} s, all {[round(t, 3) for t in times]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
