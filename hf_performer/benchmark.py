"""Benchmarks of one attention layer: FAVOR+ against softmax, and FAVOR+ against its target.

* ``speed``: forward+backward time and peak memory of one attention call at head geometry
  ``[B, H, L, d]`` for FAVOR+ (bidirectional and causal) against
  ``torch.nn.functional.scaled_dot_product_attention`` and the eager materialised softmax that
  transformers' ``"eager"`` path uses, all measured in the same run, interleaved length by length.
  Reports the crossover length, achieved GFLOP/s and a plain matmul's GFLOP/s on the same machine.
* ``approximation``: mean squared error of FAVOR+ attention against exact softmax attention as the
  number of random features grows, orthogonal against iid projections, over several seeds.

Both write a JSON (with machine, device and versions) and a PNG plot. Run ``hf-performer bench --help``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .feature_maps import make_feature_map
from .linear_attention import DEFAULT_CHUNK_SIZE, linear_attention
from .reference import softmax_attention

IMPLEMENTATIONS = ("favor", "favor-recompute", "sdpa", "eager")  # favor-recompute: bidirectional only
MODES = ("bidirectional", "causal")


# ------------------------------------------------------------------------------------ environment


def machine_info(device: torch.device) -> dict:
    """What ran the benchmark: CPU model, cores, device name, versions, date."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({cpu})",
    }
    return info


def machine_load_warning() -> str | None:
    """One line when the 1-minute load average is above half the cores (other work makes the timings noisy)."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not available on this platform
        return None
    if load <= 0.5 * cores:
        return None
    return (f"warning: the machine is loaded (1-minute load average {load:.1f} on {cores} cores): timings are noisy; "
            "rerun on an idle machine for numbers to quote")


def matmul_gflops(device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Throughput of a plain square matmul: the compute floor the attention kernels are held to."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    timings = []
    for _ in range(repeats + 1):
        _synchronize(device)
        start = time.perf_counter()
        a @ b
        _synchronize(device)
        timings.append(time.perf_counter() - start)
    return 2 * size**3 / min(timings[1:]) / 1e9


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------ FLOP counts


def attention_flops(implementation: str, mode: str, length: int, heads: int, head_dim: int, nb_features: int,
                    batch: int = 1, chunk_size: int = DEFAULT_CHUNK_SIZE, backward: bool = True) -> float:
    """Matmul FLOPs of one attention call (forward, plus backward if asked).

    Softmax: ``4 L^2 d`` forward, ``10 L^2 d`` backward (flash-style, scores recomputed), halved
    when causal. FAVOR+ bidirectional: ``8 L m d`` forward (half of it the feature map) and
    ``12 L m d`` backward. FAVOR+ causal (chunk ``C``, ``e = d + 1``): ``4 L m d + 2 L C (m + e) +
    4 L m e`` forward and ``4 L m d + 4 L C (m + e) + 8 L m e`` backward.
    """
    L, d, m, C, e = length, head_dim, nb_features, chunk_size, head_dim + 1
    if implementation in ("sdpa", "eager"):
        forward, backward_flops = 4 * L * L * d, 10 * L * L * d
        if mode == "causal":
            forward, backward_flops = forward / 2, backward_flops / 2
    elif mode == "bidirectional":
        forward, backward_flops = 8 * L * m * d, 12 * L * m * d
        if implementation == "favor-recompute":
            backward_flops += 4 * L * m * d
    else:
        forward = 4 * L * m * d + 2 * L * C * (m + e) + 4 * L * m * e
        backward_flops = 4 * L * m * d + 4 * L * C * (m + e) + 8 * L * m * e
    return batch * heads * (forward + (backward_flops if backward else 0))


# ------------------------------------------------------------------------------------ one call


def _eager_attention(q, k, v, causal):
    """Materialised softmax, as transformers' eager attention: an [L, L] score matrix per head."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def make_attention_call(implementation: str, mode: str, head_dim: int, nb_features: int, chunk_size: int,
                        device: torch.device):
    """A function ``(q, k, v) -> out`` for one implementation and mode."""
    causal = mode == "causal"
    if implementation == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if implementation == "eager":
        return lambda q, k, v: _eager_attention(q, k, v, causal)
    if implementation in ("favor", "favor-recompute"):
        feature_map = make_feature_map("favor+", head_dim, nb_features=nb_features).to(device)
        recompute = implementation == "favor-recompute"
        return lambda q, k, v: linear_attention(q, k, v, feature_map, causal=causal, chunk_size=chunk_size,
                                                recompute_features=recompute)
    raise ValueError(f"unknown implementation {implementation!r}; choose from {IMPLEMENTATIONS}")


def time_attention_call(call, batch, heads, length, head_dim, device, dtype, backward=True, repeats=3) -> float:
    """Median seconds of ``repeats`` calls (forward, and backward if asked) after one warm-up."""
    shape = (batch, heads, length, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=backward) for _ in range(3))
    timings = []
    for _ in range(repeats + 1):
        _synchronize(device)
        start = time.perf_counter()
        out = call(q, k, v)
        if backward:
            out.backward(torch.ones_like(out))
        _synchronize(device)
        timings.append(time.perf_counter() - start)
        del out
        q.grad = k.grad = v.grad = None
    return statistics.median(timings[1:])


def peak_memory_bytes(implementation, mode, batch, heads, length, head_dim, nb_features, chunk_size, device,
                      dtype, backward=True) -> int:
    """Extra peak memory of one call beyond its inputs.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU (which has no allocator statistics): a fresh
    process runs the call once and reports the growth of its peak resident set size.
    """
    if device.type == "cuda":
        shape = (batch, heads, length, head_dim)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=backward) for _ in range(3))
        call = make_attention_call(implementation, mode, head_dim, nb_features, chunk_size, device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = call(q, k, v)
        if backward:
            out.backward(torch.ones_like(out))
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    request = dict(implementation=implementation, mode=mode, batch=batch, heads=heads, length=length,
                   head_dim=head_dim, nb_features=nb_features, chunk_size=chunk_size,
                   dtype=str(dtype).replace("torch.", ""), backward=backward)
    result = subprocess.run(
        [sys.executable, "-c", "import sys, json; from hf_performer.benchmark import _rss_child; _rss_child(json.loads(sys.argv[1]))",
         json.dumps(request)],
        capture_output=True, text=True, check=True,
    )
    return int(result.stdout.strip().splitlines()[-1])


def _rss_child(request: dict) -> None:
    """Child process of :func:`peak_memory_bytes` on CPU: prints the growth of the peak resident
    set size during one call, in bytes."""
    dtype = getattr(torch, request["dtype"])
    device = torch.device("cpu")
    call = make_attention_call(request["implementation"], request["mode"], request["head_dim"],
                               request["nb_features"], request["chunk_size"], device)
    # Warm up on a tiny input so that library initialisation is not counted.
    tiny = [torch.randn(1, 1, 8, request["head_dim"], dtype=dtype, requires_grad=True) for _ in range(3)]
    call(*tiny).sum().backward()
    shape = (request["batch"], request["heads"], request["length"], request["head_dim"])
    q, k, v = (torch.randn(shape, dtype=dtype, requires_grad=request["backward"]) for _ in range(3))
    before = _resident_bytes()
    _reset_peak_resident()
    out = call(q, k, v)
    if request["backward"]:
        out.backward(torch.ones_like(out))
    print(max(_peak_resident_bytes() - before, 0))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _resident_bytes() -> int:
    try:
        return _status_kib("VmRSS") * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak_resident() -> None:
    """Reset the kernel's high-water mark of resident memory (Linux >= 4.0), so VmHWM is this call's."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


def _peak_resident_bytes() -> int:
    try:
        return _status_kib("VmHWM") * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------------ speed


def run_speed_benchmark(
    lengths=(512, 1024, 2048, 4096, 8192, 16384),
    batch: int = 1,
    heads: int = 12,
    head_dim: int = 64,
    nb_features: int = 256,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    modes=MODES,
    implementations=IMPLEMENTATIONS,
    eager_max_length: int = 4096,
    device: str = "cpu",
    dtype: str = "float32",
    repeats: int = 3,
    backward: bool = True,
    memory: bool = True,
    progress: bool = True,
) -> dict:
    """Time (and measure peak memory of) every implementation at every length, interleaved."""
    from tqdm.auto import tqdm

    device_ = torch.device(device)
    dtype_ = getattr(torch, dtype)
    records = []
    jobs = [(L, mode, impl) for L in lengths for mode in modes for impl in implementations
            if not (impl == "eager" and L > eager_max_length) and not (impl == "favor-recompute" and mode == "causal")]
    for length, mode, implementation in tqdm(jobs, desc="attention benchmark", disable=not progress):
        call = make_attention_call(implementation, mode, head_dim, nb_features, chunk_size, device_)
        seconds = time_attention_call(call, batch, heads, length, head_dim, device_, dtype_, backward, repeats)
        flops = attention_flops(implementation, mode, length, heads, head_dim, nb_features, batch, chunk_size, backward)
        record = dict(length=length, mode=mode, implementation=implementation, seconds=seconds,
                      gflops_per_s=flops / seconds / 1e9, flops=flops)
        if memory:
            record["peak_memory_bytes"] = peak_memory_bytes(
                implementation, mode, batch, heads, length, head_dim, nb_features, chunk_size, device_, dtype_, backward
            )
        records.append(record)
    result = {
        "benchmark": "attention_speed",
        "settings": dict(batch=batch, heads=heads, head_dim=head_dim, nb_features=nb_features, chunk_size=chunk_size,
                         dtype=dtype, backward=backward, repeats=repeats, lengths=list(lengths),
                         eager_max_length=eager_max_length),
        "machine": machine_info(device_),
        "matmul_gflops_per_s": matmul_gflops(device_, dtype_),
        "records": records,
    }
    result["summary"] = summarize_speed(result)
    return result


def _lookup(records, **where):
    for record in records:
        if all(record[key] == value for key, value in where.items()):
            return record
    return None


def crossover_length(records, mode: str, baseline: str = "sdpa") -> float | None:
    """The length from which FAVOR+ stays faster than ``baseline`` at every longer measured length (log-log
    interpolation between the last measured length where it is slower and the next); ``None`` if it is slower at
    the longest one, the first length if it is never slower."""
    points = []
    for record in records:
        if record["mode"] == mode and record["implementation"] == "favor":
            other = _lookup(records, mode=mode, implementation=baseline, length=record["length"])
            if other:
                points.append((record["length"], other["seconds"] / record["seconds"]))
    points.sort()
    if not points or points[-1][1] < 1:
        return None
    slower = [index for index, (_, ratio) in enumerate(points) if ratio < 1]
    if not slower:
        return float(points[0][0])
    (l0, r0), (l1, r1) = points[slower[-1]], points[slower[-1] + 1]
    t = (0 - math.log(r0)) / (math.log(r1) - math.log(r0))
    return float(math.exp(math.log(l0) + t * (math.log(l1) - math.log(l0))))


def summarize_speed(result: dict) -> dict:
    records = result["records"]
    summary = {"speedup_vs_sdpa": {}, "crossover_length_vs_sdpa": {}}
    for mode in {r["mode"] for r in records}:
        speedups = {}
        for record in records:
            if record["mode"] == mode and record["implementation"] == "favor":
                sdpa = _lookup(records, mode=mode, implementation="sdpa", length=record["length"])
                if sdpa:
                    speedups[str(record["length"])] = sdpa["seconds"] / record["seconds"]
        summary["speedup_vs_sdpa"][mode] = speedups
        summary["crossover_length_vs_sdpa"][mode] = crossover_length(records, mode)
    return summary


def format_speed_table(result: dict) -> str:
    records = result["records"]
    lines = [
        f"{'L':>6} {'mode':<13} {'impl':<6} {'time (s)':>9} {'GFLOP/s':>8} {'peak MiB':>9} {'vs sdpa':>8}",
    ]
    for record in sorted(records, key=lambda r: (r["mode"], r["length"], IMPLEMENTATIONS.index(r["implementation"]))):
        sdpa = _lookup(records, mode=record["mode"], implementation="sdpa", length=record["length"])
        ratio = f"{sdpa['seconds'] / record['seconds']:7.2f}x" if sdpa else ""
        memory = record.get("peak_memory_bytes")
        memory = f"{memory / 2**20:9.0f}" if memory is not None else f"{'-':>9}"
        lines.append(f"{record['length']:>6} {record['mode']:<13} {record['implementation']:<6} "
                     f"{record['seconds']:9.3f} {record['gflops_per_s']:8.1f} {memory} {ratio:>8}")
    crossover = result["summary"]["crossover_length_vs_sdpa"]
    lines.append("crossover length (FAVOR+ faster than SDPA at every longer measured length from): " + ", ".join(
        f"{mode}: {'none' if value is None else round(value)}" for mode, value in sorted(crossover.items())))
    lines.append(f"plain matmul on this machine: {result['matmul_gflops_per_s']:.0f} GFLOP/s "
                 f"({result['machine']['device_name']}, {result['machine']['torch_threads']} threads)")
    return "\n".join(lines)


def plot_speed(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = result["records"]
    has_memory = any("peak_memory_bytes" in r for r in records)
    fig, axes = plt.subplots(1, 2 if has_memory else 1, figsize=(12 if has_memory else 6.5, 4.8), squeeze=False)
    styles = {"favor": "-o", "favor-recompute": "--x", "sdpa": "-s", "eager": ":^"}
    names = {"favor": "FAVOR+", "favor-recompute": "FAVOR+ (recompute)", "sdpa": "SDPA", "eager": "eager softmax"}
    colors = {"bidirectional": "tab:blue", "causal": "tab:red"}
    for mode in sorted({r["mode"] for r in records}):
        for impl in IMPLEMENTATIONS:
            points = sorted((r["length"], r) for r in records if r["mode"] == mode and r["implementation"] == impl)
            if not points:
                continue
            label = f"{names[impl]} {mode}"
            lengths = [p[0] for p in points]
            axes[0][0].plot(lengths, [p[1]["seconds"] for p in points], styles[impl], color=colors[mode], label=label)
            if has_memory:
                axes[0][1].plot(lengths, [p[1]["peak_memory_bytes"] / 2**20 for p in points], styles[impl],
                                color=colors[mode], label=label)
    s = result["settings"]
    title = (f"one attention layer, {'fwd+bwd' if s['backward'] else 'fwd'}, B={s['batch']} H={s['heads']} "
             f"d={s['head_dim']} m={s['nb_features']}, {s['dtype']}\n{result['machine']['device_name']}")
    for ax, ylabel in zip(axes[0], ["time (s)", "peak extra memory (MiB)"]):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------ approximation


def run_approximation_benchmark(
    head_dim: int = 100,
    nb_features=(10, 20, 50, 100, 150, 200, 300, 400),
    seeds: int = 25,
    length: int = 256,
    input_scale: float = 0.3,
    progress: bool = True,
) -> dict:
    """MSE of FAVOR+ (orthogonal and iid) against exact softmax attention, vs the number of features.

    Inputs: one head of ``length`` tokens with q, k, v ~ ``input_scale * N(0, I_d)`` (fixed), default
    temperature ``d ** -0.5``; each point averages ``seeds`` independent projections.
    """
    from tqdm.auto import tqdm

    generator = torch.Generator().manual_seed(0)
    q, k, v = (input_scale * torch.randn(1, 1, length, head_dim, generator=generator, dtype=torch.float64)
               for _ in range(3))
    exact = softmax_attention(q, k, v)
    records = []
    jobs = [(m, orthogonal) for m in nb_features for orthogonal in (True, False)]
    for m, orthogonal in tqdm(jobs, desc="approximation benchmark", disable=not progress):
        errors = []
        for seed in range(seeds):
            feature_map = make_feature_map("favor+", head_dim, nb_features=m, orthogonal=orthogonal, seed=seed).double()
            errors.append((linear_attention(q, k, v, feature_map) - exact).square().mean().item())
        records.append(dict(nb_features=m, projection="orthogonal" if orthogonal else "iid",
                            mse_mean=statistics.fmean(errors), mse_median=statistics.median(errors),
                            mse_std=statistics.pstdev(errors), mse_per_seed=errors))
    return {
        "benchmark": "favor_approximation",
        "settings": dict(head_dim=head_dim, nb_features=list(nb_features), seeds=seeds, length=length,
                         input_scale=input_scale, dtype="float64"),
        "machine": machine_info(torch.device("cpu")),
        "records": records,
    }


def format_approximation_table(result: dict) -> str:
    lines = [f"{'m':>5} {'orthogonal MSE':>15} {'iid MSE':>12} {'orth/iid':>9} {'(medians)':>10}"]
    for m in result["settings"]["nb_features"]:
        orth = _lookup(result["records"], nb_features=m, projection="orthogonal")
        iid = _lookup(result["records"], nb_features=m, projection="iid")
        lines.append(f"{m:>5} {orth['mse_mean']:15.3e} {iid['mse_mean']:12.3e} {orth['mse_mean'] / iid['mse_mean']:9.2f} "
                     f"{orth['mse_median'] / iid['mse_median']:10.2f}")
    return "\n".join(lines)


def plot_approximation(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for projection, style in (("orthogonal", "-o"), ("iid", "--s")):
        points = sorted((r["nb_features"], r) for r in result["records"] if r["projection"] == projection)
        ms = [p[0] for p in points]
        mean = [p[1]["mse_mean"] for p in points]
        std = [p[1]["mse_std"] for p in points]
        ax.errorbar(ms, mean, yerr=std, fmt=style, capsize=3, label=f"FAVOR+ {projection}")
    s = result["settings"]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("number of random features m")
    ax.set_ylabel("MSE vs exact softmax attention")
    ax.set_title(f"FAVOR+ approximation, d={s['head_dim']}, L={s['length']}, {s['seeds']} seeds", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------ CLI


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error


def _write(result: dict, output_dir: Path | None, stem: str, plot) -> list[Path]:
    if output_dir is None:
        return []
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = output_dir / f"{stem}.json", output_dir / f"{stem}.png"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, png_path)
    return [json_path, png_path]


def _run_speed(args) -> int:
    warning = machine_load_warning()
    if warning:
        print(warning, file=sys.stderr)
    result = run_speed_benchmark(
        lengths=args.lengths, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
        nb_features=args.nb_features, chunk_size=args.chunk_size, modes=args.modes,
        implementations=args.implementations, eager_max_length=args.eager_max_length, device=args.device,
        dtype=args.dtype, repeats=args.repeats, backward=not args.forward_only, memory=not args.no_memory,
    )
    print(format_speed_table(result))
    for path in _write(result, args.output_dir, args.name, plot_speed):
        print(f"wrote {path}")
    return 0


def _run_approximation(args) -> int:
    result = run_approximation_benchmark(head_dim=args.head_dim, nb_features=args.nb_features, seeds=args.seeds,
                                         length=args.length, input_scale=args.input_scale)
    print(format_approximation_table(result))
    for path in _write(result, args.output_dir, args.name, plot_approximation):
        print(f"wrote {path}")
    return 0


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks of the attention kernels",
                                  description="Benchmarks of the attention kernels (see benchmarks/README.md).")
    kinds = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)

    speed = kinds.add_parser(
        "attention", help="time and memory of one attention layer: FAVOR+ vs SDPA vs eager softmax",
        description="Forward+backward time and peak memory of one attention call, FAVOR+ (bidirectional and "
                    "causal) against scaled_dot_product_attention and eager softmax, in one run. The defaults "
                    "are a small, quick setting; benchmarks/README.md gives the committed full run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    speed.add_argument("--lengths", type=_int_list, default=[512, 1024, 2048], help="comma-separated sequence lengths")
    speed.add_argument("--batch", type=int, default=1)
    speed.add_argument("--heads", type=int, default=12)
    speed.add_argument("--head-dim", type=int, default=64)
    speed.add_argument("--nb-features", type=int, default=256)
    speed.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="causal chunk size")
    speed.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    speed.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS))
    speed.add_argument("--eager-max-length", type=int, default=4096,
                       help="skip eager softmax above this length (it materialises [L, L] per head)")
    speed.add_argument("--device", default="cpu")
    speed.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    speed.add_argument("--repeats", type=int, default=3, help="timed calls per point (median), after a warm-up")
    speed.add_argument("--forward-only", action="store_true", help="time the forward pass only")
    speed.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    speed.add_argument("--output-dir", type=Path, default=None, help="write NAME.json and NAME.png here")
    speed.add_argument("--name", default="attention_speed", help="file stem of the outputs")
    speed.set_defaults(func=_run_speed)

    approx = kinds.add_parser(
        "approximation", help="MSE of FAVOR+ against softmax vs number of features, orthogonal vs iid",
        description="Mean squared error of FAVOR+ attention against exact softmax attention as the number of "
                    "random features grows, for orthogonal and iid projections, averaged over seeds.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    approx.add_argument("--head-dim", type=int, default=100)
    approx.add_argument("--nb-features", type=_int_list, default=[10, 20, 50, 100, 150, 200, 300, 400])
    approx.add_argument("--seeds", type=int, default=25)
    approx.add_argument("--length", type=int, default=256)
    approx.add_argument("--input-scale", type=float, default=0.3, help="q, k, v ~ scale * N(0, I)")
    approx.add_argument("--output-dir", type=Path, default=None, help="write NAME.json and NAME.png here")
    approx.add_argument("--name", default="approximation")
    approx.set_defaults(func=_run_approximation)

    from .decode_benchmark import add_parser as add_decode_parser

    add_decode_parser(kinds)
