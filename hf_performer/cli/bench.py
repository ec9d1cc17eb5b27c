"""``hf-performer bench attention | memory | approximation | decode | generation | model``: the parsers of the
benchmarks of :mod:`hf_performer.bench` and the functions that run them (print the table, write NAME.json and NAME.png).

``bench approximation --nb-features`` is a sweep (a comma-separated list), not the favor setting. The parsers import
no torch (``--help`` is fast); the sizes and the device are checked before any measurement, each bad one in one line
naming its flag.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from ..bench.defaults import (
    ATTENTION_IMPLEMENTATIONS,
    ATTENTION_MODES,
    BIDIRECTIONAL_ONLY,
    CAUSAL_ONLY,
    DEFAULT_ATTENTION_IMPLEMENTATIONS,
    DEFAULT_BUCKET_SIZE,
    DEFAULT_CLUSTERS,
    DEFAULT_SINKS,
    DEFAULT_TOPK,
    DEFAULT_WINDOW,
    FULL_CONTEXT_LENGTHS,
    QUICK_CONTEXT_LENGTHS,
    runs_in_mode,
)
from ..favor_schema import DEFAULT_CHUNK_SIZE
from . import add_verb_parser
from ._output import public_command
from .arguments import add_favor_arguments, comma_separated_ints


POSITIVE_SIZES = ("lengths", "context_lengths", "nb_features", "batch", "heads", "head_dim", "chunk_size", "repeats",
                  "processes", "seeds", "length", "clusters", "topk", "bucket_size", "prefill_chunk", "n_layer",
                  "n_head", "n_embd", "vocab_size", "prefill_repeats")
"""Arguments of the benchmarks that count something: each must be >= 1 (a list: non-empty, every entry >= 1)."""
NON_NEGATIVE_SIZES = ("window", "sinks", "warmup", "verify_context", "eager_max_length", "prefill_length")


def check_sizes(args) -> None:
    """Refuse a size a benchmark cannot measure (``--lengths -64``, ``0`` or ``""``, ``--heads 0``, ``--repeats 0``)
    and a device this torch does not have, in one line naming the flag, before any work."""
    for name, minimum in [*((name, 1) for name in POSITIVE_SIZES), *((name, 0) for name in NON_NEGATIVE_SIZES)]:
        value = getattr(args, name, None)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, list) and not value:
            raise SystemExit(f"hf-performer bench {args.benchmark}: error: {flag} is empty; give comma-separated "
                             f"integers >= {minimum}, e.g. 512,1024")
        bad = [item for item in (value if isinstance(value, list) else [value]) if item < minimum]
        if bad:
            raise SystemExit(f"hf-performer bench {args.benchmark}: error: {flag} must be "
                             f"{'integers' if isinstance(value, list) else 'an integer'} >= {minimum}, got "
                             f"{', '.join(map(str, bad))}")
    device = getattr(args, "device", None)
    if device is not None:
        from ..bench.machine import check_device

        try:
            check_device(device)
        except ValueError as error:
            raise SystemExit(f"hf-performer bench {args.benchmark}: error: --device {device}: {error}") from None


def check_pairs(args) -> None:
    """Refuse, in one line before any work, ``--implementations`` none of which runs in any of ``--modes`` (an empty
    table otherwise)."""
    if not any(runs_in_mode(implementation, mode) for implementation in args.implementations for mode in args.modes):
        raise SystemExit(
            f"hf-performer bench {args.benchmark}: error: none of --implementations {' '.join(args.implementations)} "
            f"runs in --modes {' '.join(args.modes)} ({', '.join(BIDIRECTIONAL_ONLY)} are bidirectional only, "
            f"{', '.join(CAUSAL_ONLY)} causal only)")


def _warn_if_loaded() -> None:
    from ..bench.machine import machine_load_warning

    warning = machine_load_warning()
    if warning:
        print(warning, file=sys.stderr)


def _print_and_write(args, result: dict, table: str, plot) -> int:
    """Print ``table``; write NAME.json (with the command line that made it) and NAME.png into ``--output-dir``."""
    from ..bench import report

    result = {"command": public_command(f"bench {args.benchmark}"), **result}
    print(table)
    for path in report.write_result(result, args.output_dir, args.name, plot):
        print(f"wrote {path}")
    return 0


def run_speed(args) -> int:
    """``hf-performer bench attention``: one attention layer's time and memory (:mod:`hf_performer.bench.attention`)."""
    from ..bench import attention, report

    check_sizes(args)
    check_pairs(args)
    _warn_if_loaded()
    arguments = dict(
        lengths=args.lengths, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
        nb_features=args.nb_features, chunk_size=args.chunk_size, modes=args.modes,
        implementations=args.implementations, eager_max_length=args.eager_max_length, clusters=args.clusters,
        topk=args.topk, bucket_size=args.bucket_size, window=args.window, sinks=args.sinks, device=args.device,
        dtype=args.dtype, repeats=args.repeats, backward=not args.forward_only, memory=not args.no_memory,
    )
    if args.processes > 1:
        result = attention.run_speed_benchmark_in_processes(args.processes, **arguments)
    else:
        result = attention.run_speed_benchmark(**arguments)
    return _print_and_write(args, result, report.format_speed_table(result), report.plot_speed)


def run_memory(args) -> int:
    """``hf-performer bench memory``: one attention call's extra peak memory, FAVOR+ vs SDPA (fresh processes)."""
    from ..bench import attention, report

    check_sizes(args)
    check_pairs(args)
    result = attention.run_memory_benchmark(
        lengths=args.lengths, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
        nb_features=args.nb_features, chunk_size=args.chunk_size, modes=args.modes,
        implementations=args.implementations, dtype=args.dtype, backward=not args.forward_only, repeats=args.repeats,
    )
    return _print_and_write(args, result, report.format_memory_table(result), report.plot_memory)


def run_approximation(args) -> int:
    """``hf-performer bench approximation``: FAVOR+'s error against softmax vs the number of features."""
    from ..bench import attention, report

    check_sizes(args)
    result = attention.run_approximation_benchmark(
        head_dim=args.head_dim, nb_features=args.nb_features, seeds=args.seeds, length=args.length,
        input_scale=args.input_scale,
    )
    return _print_and_write(args, result, report.format_approximation_table(result), report.plot_approximation)


def run_decode(args) -> int:
    """``hf-performer bench decode``: per-token decode latency and cache memory (:mod:`hf_performer.bench.decode`)."""
    from ..bench import decode, report

    check_sizes(args)
    _warn_if_loaded()
    if args.model is not None:
        target = "hf_performer.bench.decode_converted:run_converted_decode_benchmark"
        arguments = dict(model_path=str(args.model), prefill_chunk=args.prefill_chunk)
    else:
        target = "hf_performer.bench.decode:run_decode_benchmark"
        arguments = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, vocab_size=args.vocab_size,
                         favor_settings={} if args.nb_features is None else {"nb_features": args.nb_features})
    arguments.update(context_lengths=args.context_lengths, batch=args.batch, dtype=args.dtype, repeats=args.repeats,
                     warmup=args.warmup, device=args.device, verify_context=args.verify_context)
    if args.processes > 1:
        result = decode.run_decode_benchmark_in_processes(target, args.processes, **arguments)
    else:
        module, function = target.rsplit(":", 1)
        result = getattr(importlib.import_module(module), function)(**arguments)
    return _print_and_write(args, result, report.format_decode_table(result), report.plot_decode)


def run_generation(args) -> int:
    """``hf-performer bench generation``: decode and prefill of a converted model, window layers vs softmax vs no
    attention (:mod:`hf_performer.bench.generation`)."""
    from ..bench import generation

    check_sizes(args)
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"hf-performer bench generation: error: {args.model} is not a model folder (no config.json)")
    _warn_if_loaded()
    arguments = dict(model_path=str(args.model), contexts=args.context_lengths, batch=args.batch,
                     prefill_length=args.prefill_length, repeats=args.repeats, prefill_repeats=args.prefill_repeats)
    if args.processes > 1:
        result = generation.run_generation_benchmark_in_processes(args.processes, **arguments)
    else:
        result = generation.run_generation_benchmark(**arguments)
    return _print_and_write(args, result, generation.format_generation_table(result), generation.plot_generation)


def run_model(args) -> int:
    """``hf-performer bench model``: whole-model time and peak memory, converted models vs their softmax source."""
    from ..bench import model_speed

    check_sizes(args)
    _warn_if_loaded()
    result = model_speed.run_model_benchmark(args.folders, lengths=args.lengths, batch=args.batch,
                                             backward=args.backward, repeats=args.repeats, labels=args.labels,
                                             processes=args.processes)
    return _print_and_write(args, result, model_speed.format_model_speed_table(result), model_speed.plot_model_speed)


def _add_processes_argument(parser) -> None:
    parser.add_argument("--processes", type=int, default=1,
                        help="whole runs, each in a fresh process, one after the other; a figure is the median of the "
                             "runs' figures, each run's kept beside it (1: in this process)")


def add_parser(subparsers) -> None:
    """Add the ``bench`` subcommand (``attention``, ``memory``, ``approximation``, ``decode``, ``generation``,
    ``model``) to ``subparsers``."""
    bench = add_verb_parser(subparsers, "bench", "Benchmarks of the attention kernels (see benchmarks/README.md).")
    kinds = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)

    speed = kinds.add_parser(
        "attention", help="time and memory of one attention layer: FAVOR+ vs SDPA vs eager softmax",
        description="Forward+backward time and peak memory of one attention call, FAVOR+ (bidirectional and "
                    "causal) against scaled_dot_product_attention and eager softmax, in one run. The defaults "
                    "are a small, quick setting; benchmarks/README.md gives the committed full run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    speed.add_argument("--lengths", type=comma_separated_ints, default=[512, 1024, 2048],
                       help="comma-separated sequence lengths")
    speed.add_argument("--batch", type=int, default=1)
    speed.add_argument("--heads", type=int, default=12)
    speed.add_argument("--head-dim", type=int, default=64)
    add_favor_arguments(speed, ("nb_features", "chunk_size"),
                        defaults={"nb_features": 256, "chunk_size": DEFAULT_CHUNK_SIZE},
                        helps={"nb_features": "features m per head", "chunk_size": "causal chunk size"})
    speed.add_argument("--modes", nargs="+", choices=ATTENTION_MODES, default=list(ATTENTION_MODES))
    speed.add_argument("--implementations", nargs="+", choices=ATTENTION_IMPLEMENTATIONS,
                       default=list(DEFAULT_ATTENTION_IMPLEMENTATIONS),
                       help="clustered, improved-clustered and lsh (Reformer-style shared-QK, a comparison row only) "
                            "are bidirectional only; window: the sink + sliding-window hybrid with a Hedgehog tail "
                            "(2 x head-dim features); window-cache (causal only): sinks + window + a sparse cache of "
                            "256 hard keys per head, no tail (the causal-LM configuration)")
    add_favor_arguments(speed, ("clusters", "topk"),
                        defaults={"clusters": DEFAULT_CLUSTERS, "topk": DEFAULT_TOPK},
                        helps={"clusters": "query clusters per head of (improved-)clustered",
                               "topk": "keys per cluster computed exactly by improved-clustered"})
    speed.add_argument("--bucket-size", type=int, default=DEFAULT_BUCKET_SIZE, help="chunk length of lsh")
    add_favor_arguments(speed, ("window", "sinks"),
                        defaults={"window": DEFAULT_WINDOW, "sinks": DEFAULT_SINKS},
                        helps={"window": "band of exact keys of the window hybrid (--implementations window)",
                               "sinks": "sink tokens of the window hybrid"})
    speed.add_argument("--eager-max-length", type=int, default=4096,
                       help="skip eager softmax above this length (it materialises [L, L] per head)")
    speed.add_argument("--device", default="cpu")
    speed.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    speed.add_argument("--repeats", type=int, default=3, help="timed calls per point (median), after a warm-up")
    _add_processes_argument(speed)
    speed.add_argument("--forward-only", action="store_true", help="time the forward pass only")
    speed.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    speed.add_argument("--output-dir", type=Path, default=None, help="write NAME.json and NAME.png here")
    speed.add_argument("--name", default="attention_speed", help="file stem of the outputs")
    speed.set_defaults(func=run_speed)

    _add_memory_parser(kinds)

    approx = kinds.add_parser(
        "approximation", help="MSE of FAVOR+ against softmax vs number of features, orthogonal vs iid",
        description="Mean squared error of FAVOR+ attention against exact softmax attention as the number of "
                    "random features grows, for orthogonal and iid projections, averaged over seeds.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    approx.add_argument("--head-dim", type=int, default=100)
    approx.add_argument("--nb-features", type=comma_separated_ints, default=[10, 20, 50, 100, 150, 200, 300, 400])
    approx.add_argument("--seeds", type=int, default=25)
    approx.add_argument("--length", type=int, default=256)
    approx.add_argument("--input-scale", type=float, default=0.3, help="q, k, v ~ scale * N(0, I)")
    approx.add_argument("--output-dir", type=Path, default=None, help="write NAME.json and NAME.png here")
    approx.add_argument("--name", default="approximation")
    approx.set_defaults(func=run_approximation)

    _add_decode_parser(kinds)
    _add_generation_parser(kinds)
    _add_model_parser(kinds)


MEMORY_IMPLEMENTATIONS = ("favor", "window", "window-cache", "sdpa")


def _add_memory_parser(kinds) -> None:
    """Add ``memory`` to the ``hf-performer bench`` subcommands (``kinds``: their subparsers object)."""
    memory = kinds.add_parser(
        "memory", help="extra peak memory of one attention call (fwd+bwd): FAVOR+ vs SDPA, fresh process per point",
        description="Extra peak memory of one attention call, forward and backward, FAVOR+ (bidirectional and causal) "
                    "against scaled_dot_product_attention, each point in a fresh process on the CPU (growth of the "
                    "peak resident set during the call, beyond its inputs). The defaults are the committed run "
                    "(benchmarks/results/attention_memory.json).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    memory.add_argument("--lengths", type=comma_separated_ints, default=[1024, 2048, 4096, 8192, 16384, 32768],
                        help="comma-separated sequence lengths")
    memory.add_argument("--batch", type=int, default=1)
    memory.add_argument("--heads", type=int, default=12)
    memory.add_argument("--head-dim", type=int, default=64)
    add_favor_arguments(memory, ("nb_features", "chunk_size"),
                        defaults={"nb_features": 256, "chunk_size": DEFAULT_CHUNK_SIZE},
                        helps={"nb_features": "features m per head", "chunk_size": "tokens per chunk"})
    memory.add_argument("--modes", nargs="+", choices=ATTENTION_MODES, default=list(ATTENTION_MODES))
    memory.add_argument("--implementations", nargs="+", choices=MEMORY_IMPLEMENTATIONS, default=["favor", "sdpa"],
                        help="window: the sink + sliding-window hybrid (window 64, 4 sinks, Hedgehog tail of "
                             "2 x head-dim features); window-cache (causal only): window 64 + 4 sinks + a sparse "
                             "cache of 256 hard keys per head, no tail")
    memory.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    memory.add_argument("--forward-only", action="store_true", help="measure the forward pass only")
    memory.add_argument("--repeats", type=int, default=1,
                        help="fresh processes per point, their median (default: %(default)s; the resident set of one "
                             "process varies with what the C allocator keeps: ~10-20%% between runs)")
    memory.add_argument("--output-dir", type=Path, default=None, help="write NAME.json and NAME.png here")
    memory.add_argument("--name", default="attention_memory", help="file stem of the outputs")
    memory.set_defaults(func=run_memory)


def _add_decode_parser(kinds) -> None:
    """Add ``decode`` to the ``hf-performer bench`` subcommands (``kinds``: their subparsers object)."""
    full = ",".join(str(n) for n in FULL_CONTEXT_LENGTHS)
    decode_parser = kinds.add_parser(
        "decode", help="per-token generation latency and cache memory: FAVOR+ recurrent state vs softmax KV cache",
        description=(
            "Per-token decode latency (one new token per sequence through the whole model, median over steps) and "
            "cache memory vs context length, for a random-weight GPT-2 small (12x12x768) with FAVOR+ and its "
            "constant-size recurrent-state cache against the same weights with SDPA softmax and transformers' "
            "DynamicCache, interleaved in one run. Caches of L tokens are built synthetically at the size a "
            "prefill leaves (checked against a real prefill at --verify-context). The defaults are a quick "
            f"setting; the full run is: --context-lengths {full} --repeats 10 --output-dir benchmarks/results. "
            "With --model FOLDER (a causal LM converted with --window/--sinks), the model is that folder instead: "
            "its window layers (WindowCacheLayer) against the same weights with softmax; their contexts come from a "
            "real prefill in chunks of --prefill-chunk tokens through the cache"),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    decode_parser.add_argument("--context-lengths", type=comma_separated_ints,
                               default=list(QUICK_CONTEXT_LENGTHS),
                               help=f"comma-separated tokens already in the cache (full run: {full})")
    decode_parser.add_argument("--batch", type=int, default=4, help="sequences decoded together")
    decode_parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    decode_parser.add_argument("--repeats", type=int, default=3,
                               help="timed decode steps per point (median); full run: 10")
    decode_parser.add_argument("--warmup", type=int, default=2, help="untimed decode steps before the timed ones")
    _add_processes_argument(decode_parser)
    add_favor_arguments(decode_parser, ("nb_features",),
                        helps={"nb_features": "FAVOR+ features m per head (None: FAVOR_DEFAULTS)"})
    decode_parser.add_argument("--model", default=None, metavar="FOLDER",
                               help="a converted causal LM with window layers (hf-performer convert --window W "
                                    "--sinks S) instead of the random GPT-2; the --n-* flags are then unused")
    decode_parser.add_argument("--prefill-chunk", type=int, default=1024,
                               help="with --model: tokens per forward of the chunked prefill through the cache")
    decode_parser.add_argument("--n-layer", type=int, default=12)
    decode_parser.add_argument("--n-head", type=int, default=12)
    decode_parser.add_argument("--n-embd", type=int, default=768)
    decode_parser.add_argument("--vocab-size", type=int, default=50257)
    decode_parser.add_argument("--verify-context", type=int, default=64,
                               help="context of the real-prefill vs synthetic-cache check (0: skip)")
    decode_parser.add_argument("--device", default="cpu")
    decode_parser.add_argument("--output-dir", type=Path, default=None, help="write NAME.json and NAME.png here")
    decode_parser.add_argument("--name", default="decode", help="file stem of the outputs")
    decode_parser.set_defaults(func=run_decode)


def _add_generation_parser(kinds) -> None:
    """Add ``generation`` to the ``hf-performer bench`` subcommands (``kinds``: their subparsers object)."""
    generation = kinds.add_parser(
        "generation", help="decode and prefill of a converted causal LM: window layers vs softmax vs no attention",
        description="Decode steps and a prompt prefill of a converted causal LM (hf-performer convert --window W "
                    "--sinks S) with its window layers and their constant-size cache, with softmax (sdpa + "
                    "DynamicCache) and with no attention work at all (the floor: the most any attention could buy), "
                    "in turn in one process. Decode: the mean step over --repeats rounds (64: one selection cycle of "
                    "the sparse cache) at each context; prefill: the median of --prefill-repeats forwards.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    generation.add_argument("model", metavar="FOLDER", help="a converted causal-LM folder with window layers")
    generation.add_argument("--context-lengths", type=comma_separated_ints, default=[512, 16384],
                            help="comma-separated decode contexts")
    generation.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    generation.add_argument("--prefill-length", type=int, default=4096, help="prompt tokens (0: no prefill)")
    generation.add_argument("--repeats", type=int, default=64, help="decode rounds (64: one selection cycle)")
    generation.add_argument("--prefill-repeats", type=int, default=3, help="prefill rounds")
    _add_processes_argument(generation)
    generation.add_argument("--output-dir", type=Path, default=None, help="write NAME.json and NAME.png here")
    generation.add_argument("--name", default="generation", help="file stem of the outputs")
    generation.set_defaults(func=run_generation)


def _add_model_parser(kinds) -> None:
    """Add ``model`` to the ``hf-performer bench`` subcommands (``kinds``: their subparsers object)."""
    model = kinds.add_parser(
        "model", help="whole-model time and extra peak memory vs length: converted models against their softmax source",
        description="Time and extra peak memory of whole models (their backbone: no task head) against sequence "
                    "length, each point in a fresh process on the CPU, length by length in one run. The first FOLDER "
                    "is the baseline of the ratios (normally the softmax source); the others are its conversions "
                    "(hf-performer convert). See benchmarks/README.md for the committed runs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model.add_argument("folders", nargs="+", metavar="FOLDER", help="model folders; the first is the baseline")
    model.add_argument("--labels", nargs="+", default=None, help="names of the models (default: folder base names)")
    model.add_argument("--lengths", type=comma_separated_ints, default=[8192, 16384],
                       help="comma-separated sequence lengths")
    model.add_argument("--batch", type=int, default=1)
    model.add_argument("--backward", action="store_true",
                       help="forward + backward of last_hidden_state.sum() (training) instead of an inference forward")
    model.add_argument("--repeats", type=int, default=1, help="timed calls per point (median), after one untimed")
    model.add_argument("--processes", type=int, default=1,
                       help="whole runs of the sweep, one after the other (every point is always a fresh process); a "
                            "figure is the median of the runs', each run's kept beside it")
    model.add_argument("--output-dir", type=Path, default=None, help="write NAME.json and NAME.png here")
    model.add_argument("--name", default="model_speed", help="file stem of the outputs")
    model.set_defaults(func=run_model)
