"""Reading benchmark results: summaries (crossover length, decode targets), tables, plots and the JSON + PNG writing.

Results are the JSON-able dicts of :mod:`.attention` and :mod:`.decode` (``settings``, ``machine``, ``records``,
``summary``); this module also names the implementations their records hold, in display order.
"""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import torch

from .defaults import ATTENTION_IMPLEMENTATIONS, DECODE_IMPLEMENTATIONS
from .machine import machine_info

FLATNESS_TARGET = 1.1
SPEEDUP_TARGET = 3.0


# ------------------------------------------------------------------------------------ plotting


def _pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend (imported when a plot is drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log_log_axes(axes, xlabel: str, ylabels: list[str]) -> None:
    """Lengths on a log2 x axis, log y, grid and legend, one y label per axis."""
    for ax, ylabel in zip(axes, ylabels):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_median_bars(path: Path, labels: list[str], seconds: list[float], ratios: list[float], colors: list[str], *,
                     ylabel: str, title: str, width: float) -> None:
    """One bar per timed arm: its median seconds, labelled with them and its ratio to the baseline."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(width, 3.8))
    bars = ax.bar(labels, seconds, color=colors)
    ax.bar_label(bars, labels=[f"{s:.2f} s\n{r:.2f}x" for s, r in zip(seconds, ratios)], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    ax.margins(y=0.2)
    _save(plt, fig, path)


# ------------------------------------------------------------------------------------ attention speed and approximation


def _lookup(records, **where):
    for record in records:
        if all(record[key] == value for key, value in where.items()):
            return record
    return None


def crossover_length(records, mode: str, baseline: str = "sdpa", implementation: str = "favor") -> float | None:
    """The length from which ``implementation`` stays faster than ``baseline`` at every longer measured length
    (log-log interpolation between the last measured length where it is slower and the next); ``None`` if it is
    slower at the longest one or was not measured, the first length if it is never slower."""
    points = []
    for record in records:
        if record["mode"] == mode and record["implementation"] == implementation:
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
    """Every implementation's speedup over SDPA (time ratio, same run) per mode and length and its crossover
    length (``*_by_implementation``); FAVOR+'s also under ``speedup_vs_sdpa`` and ``crossover_length_vs_sdpa``."""
    records = result["records"]
    summary = {"speedup_vs_sdpa": {}, "crossover_length_vs_sdpa": {}, "speedup_vs_sdpa_by_implementation": {},
               "crossover_length_vs_sdpa_by_implementation": {}}
    for record in records:
        sdpa = _lookup(records, mode=record["mode"], implementation="sdpa", length=record["length"])
        if sdpa and record["implementation"] != "sdpa":
            by_mode = summary["speedup_vs_sdpa_by_implementation"].setdefault(record["implementation"], {})
            by_mode.setdefault(record["mode"], {})[str(record["length"])] = sdpa["seconds"] / record["seconds"]
    for implementation, by_mode in summary["speedup_vs_sdpa_by_implementation"].items():
        summary["crossover_length_vs_sdpa_by_implementation"][implementation] = {
            mode: crossover_length(records, mode, implementation=implementation) for mode in by_mode}
    favor = summary["speedup_vs_sdpa_by_implementation"].get("favor", {})
    for mode in sorted({r["mode"] for r in records}):
        summary["speedup_vs_sdpa"][mode] = favor.get(mode, {})
        summary["crossover_length_vs_sdpa"][mode] = crossover_length(records, mode)
    return summary


def format_speed_table(result: dict) -> str:
    records = result["records"]
    lines = [
        f"{'L':>6} {'mode':<13} {'impl':<18} {'time (s)':>9} {'GFLOP/s':>8} {'peak MiB':>9} {'vs sdpa':>8}",
    ]
    order = lambda r: (r["mode"], r["length"], ATTENTION_IMPLEMENTATIONS.index(r["implementation"]))  # noqa: E731
    for record in sorted(records, key=order):
        sdpa = _lookup(records, mode=record["mode"], implementation="sdpa", length=record["length"])
        ratio = f"{sdpa['seconds'] / record['seconds']:7.2f}x" if sdpa else ""
        memory = record.get("peak_memory_bytes")
        memory = f"{memory / 2**20:9.0f}" if memory is not None else f"{'-':>9}"
        lines.append(f"{record['length']:>6} {record['mode']:<13} {record['implementation']:<18} "
                     f"{record['seconds']:9.3f} {record['gflops_per_s']:8.1f} {memory} {ratio:>8}")
    summary = result["summary"]
    crossovers = summary.get("crossover_length_vs_sdpa_by_implementation")
    if crossovers is None:  # results written before the per-implementation summary
        crossovers = {"favor": summary["crossover_length_vs_sdpa"]}
    for implementation, crossover in crossovers.items():
        lines.append(f"crossover length ({_NAMES.get(implementation, implementation)} faster than SDPA at every longer "
                     "measured length from): " + ", ".join(
                         f"{mode}: {'none' if value is None else round(value)}"
                         for mode, value in sorted(crossover.items())))
    lines.append(f"plain matmul on this machine: {result['matmul_gflops_per_s']:.0f} GFLOP/s "
                 f"({result['machine']['device_name']}, {result['machine']['torch_threads']} threads)")
    return "\n".join(lines)


_STYLES = {"favor": "-o", "window": "--P", "window-cache": "--X", "sdpa": "-s", "eager": ":^", "clustered": "-.v",
           "improved-clustered": "-.D",
           "lsh": ":*"}
_NAMES = {"favor": "FAVOR+", "window": "window hybrid", "window-cache": "window + sparse cache", "sdpa": "SDPA",
          "eager": "eager softmax"}


def _legend_names(settings: dict) -> dict:
    """Legend name per implementation, with the settings that make it what it is (``?`` for a setting that results
    written by an older version did not record)."""
    s = collections.defaultdict(lambda: "?", {key: value for key, value in settings.items() if value is not None})
    return {**_NAMES, "favor": f"FAVOR+ m={s['nb_features']}",
            "window": f"window {s['window']} + {s['sinks']} sinks + tail m={s['window_nb_features']}",
            "window-cache": f"window {s['window']} + {s['sinks']} sinks + sparse cache {s['sparse_cache']}, no tail",
            "clustered": f"clustered C={s['clusters']}",
            "improved-clustered": f"improved clustered C={s['clusters']} k={s['topk']}",
            "lsh": f"LSH bucket {s['bucket_size']}"}


_MODE_COLORS = {"bidirectional": "tab:blue", "causal": "tab:red"}


def _memory_ratios(records, implementation: str) -> dict:
    """``{mode: {length: extra peak of implementation / SDPA's}}`` where both were measured."""
    ratios = {}
    for mode in sorted({r["mode"] for r in records}):
        ratios[mode] = {}
        for length in sorted({r["length"] for r in records}):
            mine = _lookup(records, mode=mode, length=length, implementation=implementation)
            sdpa = _lookup(records, mode=mode, length=length, implementation="sdpa")
            if mine and sdpa and sdpa["peak_memory_bytes"]:
                ratios[mode][str(length)] = mine["peak_memory_bytes"] / sdpa["peak_memory_bytes"]
    return {mode: by_length for mode, by_length in ratios.items() if by_length}


def summarize_memory(result: dict) -> dict:
    """Per implementation, mode and length, the extra peak memory as a multiple of SDPA's, and whether it is at
    most 1.0x at every length from 4096 (the target of issue 17); FAVOR+'s also under ``favor_over_sdpa``."""
    records = result["records"]
    by_implementation = {impl: _memory_ratios(records, impl) for impl in ATTENTION_IMPLEMENTATIONS
                         if impl != "sdpa" and any(r["implementation"] == impl for r in records)}
    def at_most_sdpa(by_length):  # None when no length >= 4096 was measured
        long = [ratio for length, ratio in by_length.items() if int(length) >= 4096]
        return all(ratio <= 1.0 for ratio in long) if long else None

    targets = {impl: {mode: at_most_sdpa(by_length) for mode, by_length in ratios.items()}
               for impl, ratios in by_implementation.items()}
    return {"favor_over_sdpa": by_implementation.get("favor", {}),
            "at_most_sdpa_from_4096": targets.get("favor", {}),
            "over_sdpa_by_implementation": by_implementation,
            "at_most_sdpa_from_4096_by_implementation": targets}


def format_memory_table(result: dict) -> str:
    """Each measured point but SDPA's, with SDPA's at the same length and mode and the ratio where SDPA was measured
    (else ``-``), then per implementation whether it stays at most SDPA's from 4096 tokens."""
    summary = result["summary"]
    by_implementation = summary.get("over_sdpa_by_implementation") or {"favor": summary["favor_over_sdpa"]}
    targets = summary.get("at_most_sdpa_from_4096_by_implementation") or {"favor": summary["at_most_sdpa_from_4096"]}
    lines = [f"{'L':>6} {'mode':<13} {'impl':<8} {'MiB':>9} {'SDPA MiB':>9} {'ratio':>6}"]
    order = {name: index for index, name in enumerate(ATTENTION_IMPLEMENTATIONS)}
    for record in sorted((r for r in result["records"] if r["implementation"] != "sdpa"),
                         key=lambda r: (order.get(r["implementation"], len(order)), r["mode"], r["length"])):
        implementation, mode, length = record["implementation"], record["mode"], record["length"]
        ratio = by_implementation.get(implementation, {}).get(mode, {}).get(str(length))
        sdpa = _lookup(result["records"], mode=mode, length=length, implementation="sdpa")
        lines.append(f"{length:>6} {mode:<13} {implementation:<8} {record['peak_memory_bytes'] / 2**20:9.1f} "
                     + (f"{sdpa['peak_memory_bytes'] / 2**20:9.1f} {ratio:6.2f}" if ratio is not None
                        else f"{'-':>9} {'-':>6}"))
    for implementation, by_mode in targets.items():
        if by_mode:
            lines.append(f"{_NAMES.get(implementation, implementation)} at most SDPA's extra peak at every L >= 4096: "
                         + ", ".join(f"{mode}: {ok}" for mode, ok in by_mode.items()))
    if not any(by_implementation.values()):
        lines.append("no SDPA point at these lengths: add sdpa to --implementations for the ratios")
    return "\n".join(lines)


def plot_memory(result: dict, path: Path) -> None:
    """Extra peak memory against the length, and its ratio to SDPA's when SDPA was measured (else that panel only)."""
    plt = _pyplot()
    records = result["records"]
    names = _legend_names(result["settings"])
    summary = result["summary"]
    ratios_by_implementation = summary.get("over_sdpa_by_implementation") or {"favor": summary["favor_over_sdpa"]}
    has_ratios = any(any(by_mode.values()) for by_mode in ratios_by_implementation.values())
    fig, axes = plt.subplots(1, 2 if has_ratios else 1, figsize=(12 if has_ratios else 6.5, 4.8), squeeze=False)
    axes = axes[0]
    for mode in sorted({r["mode"] for r in records}):
        for impl in ATTENTION_IMPLEMENTATIONS:
            points = sorted((r["length"], r) for r in records if r["mode"] == mode and r["implementation"] == impl)
            if points:
                axes[0].plot([p[0] for p in points], [p[1]["peak_memory_bytes"] / 2**20 for p in points],
                             _STYLES[impl], color=_MODE_COLORS[mode], label=f"{names[impl]} {mode}")
        for impl, ratios in ratios_by_implementation.items() if has_ratios else ():
            by_length = ratios.get(mode, {})
            axes[1].plot([int(n) for n in by_length], list(by_length.values()), _STYLES[impl],
                         color=_MODE_COLORS[mode], label=f"{names[impl]} / SDPA {mode}")
    s = result["settings"]
    _log_log_axes([axes[0]], "sequence length L", ["extra peak memory, fwd+bwd (MiB)"])
    if has_ratios:
        axes[1].axhline(1.0, color="gray", linestyle="--", linewidth=1)
        axes[1].set_xscale("log", base=2)
        axes[1].set_xlabel("sequence length L")
        axes[1].set_ylabel("extra peak memory / SDPA's")
        axes[1].grid(True, which="both", alpha=0.3)
        axes[1].legend(fontsize=8)
    fig.suptitle(f"one attention call, fwd+bwd, fresh process per point (peak RSS growth), B={s['batch']} "
                 f"H={s['heads']} d={s['head_dim']}, {s['dtype']}\n"
                 f"{result['machine']['device_name']}", fontsize=9)
    _save(plt, fig, path)


def plot_speed(result: dict, path: Path) -> None:
    plt = _pyplot()
    records = result["records"]
    has_memory = any("peak_memory_bytes" in r for r in records)
    fig, axes = plt.subplots(1, 2 if has_memory else 1, figsize=(12 if has_memory else 6.5, 4.8), squeeze=False)
    s = result["settings"]
    names = _legend_names(s)
    colors = _MODE_COLORS
    for mode in sorted({r["mode"] for r in records}):
        for impl in ATTENTION_IMPLEMENTATIONS:
            points = sorted((r["length"], r) for r in records if r["mode"] == mode and r["implementation"] == impl)
            if not points:
                continue
            label = f"{names[impl]} {mode}"
            lengths = [p[0] for p in points]
            axes[0][0].plot(lengths, [p[1]["seconds"] for p in points], _STYLES[impl], color=colors[mode], label=label)
            if has_memory:
                axes[0][1].plot(lengths, [p[1]["peak_memory_bytes"] / 2**20 for p in points], _STYLES[impl],
                                color=colors[mode], label=label)
    title = (f"one attention layer, {'fwd+bwd' if s['backward'] else 'fwd'}, B={s['batch']} H={s['heads']} "
             f"d={s['head_dim']}, {s['dtype']}\n{result['machine']['device_name']}")
    _log_log_axes(axes[0], "sequence length L", ["time (s)", "peak extra memory (MiB)"])
    fig.suptitle(title, fontsize=9)
    _save(plt, fig, path)


def format_approximation_table(result: dict) -> str:
    lines = [f"{'m':>5} {'orthogonal MSE':>15} {'iid MSE':>12} {'orth/iid':>9} {'(medians)':>10}"]
    for m in result["settings"]["nb_features"]:
        orth = _lookup(result["records"], nb_features=m, projection="orthogonal")
        iid = _lookup(result["records"], nb_features=m, projection="iid")
        lines.append(f"{m:>5} {orth['mse_mean']:15.3e} {iid['mse_mean']:12.3e} {orth['mse_mean'] / iid['mse_mean']:9.2f} "
                     f"{orth['mse_median'] / iid['mse_median']:10.2f}")
    return "\n".join(lines)


def plot_approximation(result: dict, path: Path) -> None:
    plt = _pyplot()
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
    _save(plt, fig, path)


def recorded_path(path: Path | str) -> str:
    """``path`` as a result file may name it: relative to the working directory when inside it (the repository's
    ``benchmarks/results``), else its last part only (no local absolute paths in committed results)."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path.name


def write_result(result: dict, output_dir: Path | None, stem: str, plot) -> list[Path]:
    """Write ``STEM.json`` and ``STEM.png`` (drawn by ``plot(result, path)``) into ``output_dir`` (nothing if
    ``None``); returns their paths."""
    if output_dir is None:
        return []
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = output_dir / f"{stem}.json", output_dir / f"{stem}.png"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, png_path)
    return [json_path, png_path]


# ------------------------------------------------------------------------------------ decode


def _record(records, context, implementation):
    return next((r for r in records if r["context"] == context and r["implementation"] == implementation), None)


def summarize_decode(result: dict) -> dict:
    """Targets: FAVOR+ flat in context (longest / shortest <= 1.1), and >= 3x faster than softmax at the longest.

    The flatness uses the paired ratio (FAVOR+ at the longest context against the shortest-context FAVOR+
    stream stepped in the same rounds), which machine-speed drifts between lengths do not bias; the ratio of
    the per-length medians is given too.
    """
    records = result["records"]
    lengths = sorted({r["context"] for r in records})
    shortest, longest = lengths[0], lengths[-1]
    favor_short, favor_long = _record(records, shortest, "favor"), _record(records, longest, "favor")
    softmax_long = _record(records, longest, "softmax")
    flatness = favor_long["paired_ratio_to_shortest"]
    speedup = softmax_long["seconds_per_token"] / favor_long["seconds_per_token"]
    return {
        "favor_latency_longest_over_shortest": dict(
            value=flatness, ratio_of_medians=favor_long["seconds_per_token"] / favor_short["seconds_per_token"],
            longest=longest, shortest=shortest, target=FLATNESS_TARGET, met=bool(flatness <= FLATNESS_TARGET)),
        "softmax_over_favor_latency_at_longest": dict(
            value=speedup, paired=softmax_long["paired_ratio_to_favor"], context=longest, target=SPEEDUP_TARGET,
            met=bool(speedup >= SPEEDUP_TARGET),
            **({"by_process": [s / f for s, f in zip(softmax_long["process_seconds_per_token"],
                                                      favor_long["process_seconds_per_token"])]}
               if "process_seconds_per_token" in favor_long else {})),
        "softmax_over_favor_latency": {
            str(n): _record(records, n, "softmax")["seconds_per_token"]
            / _record(records, n, "favor")["seconds_per_token"] for n in lengths},
        "favor_over_shortest_paired": {
            str(n): _record(records, n, "favor")["paired_ratio_to_shortest"] for n in lengths},
        "favor_cache_bytes_constant": len({_record(records, n, "favor")["cache_bytes"] for n in lengths}) == 1,
        "cache_bytes_at_longest": {
            impl: _record(records, longest, impl)["cache_bytes"] for impl in DECODE_IMPLEMENTATIONS},
    }


def format_decode_table(result: dict) -> str:
    records = result["records"]
    mib = lambda value: f"{value / 2**20:.1f}" if value is not None else "-"  # noqa: E731
    lines = [f"{'context':>8} {'favor ms':>9} {'softmax ms':>11} {'speedup':>8} {'favor/short':>11} {'favor MiB':>10} "
             f"{'softmax MiB':>11} {'favor peak+':>11} {'softmax peak+':>13}"]
    for length in sorted({r["context"] for r in records}):
        favor, softmax = _record(records, length, "favor"), _record(records, length, "softmax")
        lines.append(
            f"{length:>8} {favor['seconds_per_token'] * 1e3:9.1f} {softmax['seconds_per_token'] * 1e3:11.1f} "
            f"{softmax['seconds_per_token'] / favor['seconds_per_token']:7.2f}x "
            f"{favor['paired_ratio_to_shortest']:11.3f} "
            f"{mib(favor['cache_bytes']):>10} {mib(softmax['cache_bytes']):>11} "
            f"{mib(favor['peak_memory_growth_bytes']):>11} {mib(softmax['peak_memory_growth_bytes']):>13}")
    s = result["summary"]
    flat, speed = s["favor_latency_longest_over_shortest"], s["softmax_over_favor_latency_at_longest"]
    settings = result["settings"]
    lines.append(f"(median ms per decode step of batch {settings['batch']}; favor/short = paired ratio to the "
                 "shortest-context favor stream; cache MiB before decoding; peak+ = peak memory growth in the "
                 "warm-up steps, MiB)")
    lines.append(f"favor latency at {flat['longest']} / at {flat['shortest']}: {flat['value']:.3f} paired, "
                 f"{flat['ratio_of_medians']:.3f} ratio of medians (target <= {flat['target']}: "
                 f"{'met' if flat['met'] else 'NOT met'})")
    lines.append(f"softmax / favor latency at {speed['context']}: {speed['value']:.2f}x "
                 f"({speed['paired']:.2f}x paired) (target >= {speed['target']}: {'met' if speed['met'] else 'NOT met'})"
                 + (f"; medians of {len(speed['by_process'])} fresh-process runs, each run's: "
                    + ", ".join(f"{value:.2f}x" for value in speed["by_process"]) if "by_process" in speed else ""))
    verification = result.get("verification")
    if verification and "chunked_vs_one_forward_max_abs_logit_difference" in verification:  # bench decode --model
        lines.append(f"verification at context {verification['context']}: chunked prefill through the window cache vs "
                     f"one forward without cache, max |logit difference| "
                     f"{verification['chunked_vs_one_forward_max_abs_logit_difference']:.2e}")
    elif verification:
        lines.append(f"verification at context {verification['context']} (real prefill vs synthetic cache, same "
                     "structure): step time synthetic/real " + ", ".join(
                         f"{impl} {verification[impl]['synthetic_over_real_time']:.2f}"
                         for impl in DECODE_IMPLEMENTATIONS))
    load = result["machine"].get("load_average_1_5_15min") or {}
    machine = result["machine"]
    lines.append(f"{machine['device_name']}, {machine['torch_threads']} threads, {settings['dtype']}; "
                 f"load average at start {load.get('start')}")
    return "\n".join(lines)


def plot_decode(result: dict, path: Path) -> None:
    plt = _pyplot()
    records = result["records"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    favor_label = result["settings"].get("favor_label", "FAVOR+ (recurrent state)")
    styles = {"favor": ("-o", "tab:blue", favor_label),
              "softmax": ("-s", "tab:red", "softmax SDPA + KV cache")}
    for implementation in DECODE_IMPLEMENTATIONS:
        points = sorted((r["context"], r) for r in records if r["implementation"] == implementation)
        style, color, label = styles[implementation]
        lengths = [p[0] for p in points]
        axes[0].plot(lengths, [p[1]["seconds_per_token"] * 1e3 for p in points], style, color=color, label=label)
        axes[1].plot(lengths, [p[1]["cache_bytes"] / 2**20 for p in points], style, color=color, label=label)
    reference = sorted((r["context"], r["reference"]) for r in records if "reference" in r)
    if reference:
        axes[0].plot([n for n, _ in reference], [ref["seconds_per_token"] * 1e3 for _, ref in reference], ":",
                     color="tab:blue", alpha=0.7,
                     label=f"{favor_label.split(' (')[0]} at context {reference[0][1]['context']}, stepped in the "
                           "same rounds")
    s, m = result["settings"], result["settings"]["model"]
    _log_log_axes(axes, "context length (tokens in the cache)",
                  [f"ms per decode step (batch {s['batch']})", "cache memory (MiB)"])
    axes[0].set_title("per-token decode latency (median)", fontsize=10)
    axes[1].set_title("cache size", fontsize=10)
    if "folder" in m:  # a converted model (bench decode --model)
        f = s["favor_settings"]
        geometry = (f"{m['folder']} ({m['source_architecture']}, {m['num_hidden_layers']} layers), "
                    f"window {f.get('window')}, sinks {f.get('sinks')}, map {f['feature_map']}")
    else:
        geometry = f"GPT-2 geometry L={m['n_layer']} H={m['n_head']} d_model={m['n_embd']}"
    fig.suptitle(f"{geometry}, batch {s['batch']}, {s['dtype']}, m={s['favor_settings']['nb_features']}\n"
                 f"{result['machine']['device_name']}, {result['machine']['torch_threads']} threads", fontsize=9)
    _save(plt, fig, path)


# ------------------------------------------------------------------------------------ whole-model forward speed


def format_forward_speed_table(rows: list[dict], batch: int) -> str:
    """The rows of :func:`~.attention.forward_speed_comparison` as a table, headed by the batch and the CPU."""
    lines = [f"forward pass, batch {batch}, {machine_info(torch.device('cpu'))['device_name']}",
             f"{'tokens':>7} {'softmax (SDPA) s':>17} {'FAVOR+ s':>9} {'FAVOR+ speedup':>15}"]
    for row in rows:
        lines.append(f"{row['length']:>7} {row['softmax_sdpa_s']:17.3f} {row['favor_s']:9.3f} {row['speedup']:14.2f}x")
    return "\n".join(lines)
