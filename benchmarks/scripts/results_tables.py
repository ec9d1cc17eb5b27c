"""The markdown tables of the committed results, built from ``benchmarks/results/*.json`` alone.

Each table has a name (:data:`TABLES`); ``update_readme_results.py`` writes it between the markers
``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` wherever they stand in README.md and docs/, and ``--check`` (as
tests/test_docs_build.py does) fails when a page's text differs from what the JSON gives. Every table states the
machine it was measured on and, for speed, the break-even length (from which the faster kernel stays faster at every
longer measured length; log-log interpolation between measured lengths, as ``hf_performer.bench.report`` computes
crossovers).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from hf_performer.bench.report import crossover_length
from hf_performer.recipes.report import table as recovery_table
from hf_performer.recipes.results import load_results

RESULTS = Path(__file__).resolve().parents[1] / "results"
RESULTS_LINK = "benchmarks/results"  # the results folder as pages link it, from the repository root
MIB = 2 ** 20
RECOVERY_FILES = ("recovery_sst2.json", "recovery_stsb.json", "recovery_imdb.json")
RECOVERY_COMMAND = "python benchmarks/scripts/update_readme_results.py"
# One-experiment pipelines and collectors removed from benchmarks/scripts (issue 50) once the product's own commands
# (`hf-performer linearize / evaluate`, hybrid_arms.py) did their work: the results they wrote stay committed, and
# their commands run from a checkout of the last commit that had the script.
REMOVED_SCRIPTS = dict.fromkeys(
    ("smollm2_window_hybrid.sh", "collect_window_hybrid.py", "reuse_transfer.py", "smollm2_transfer.sh",
     "collect_lm_transfer.py", "greedy_samples.py", "tail_error_probe.py", "collect_tail_probe.py",
     "sparse_cache_sweep.py"), "72868fe") | dict.fromkeys(
    ("generation_floor.py", "packed_window_speed.py", "lora_step_speed.py"), "705cf19") | dict.fromkeys(
    ("collect_encoder_window.py", "stsb_window_hybrid.sh", "favor_throughput_bound.py"), "6fa08f8")


def load(name: str) -> dict:
    with open(RESULTS / name) as handle:
        return json.load(handle)


def machine(result: dict) -> str:
    """One line: where and when ``result`` was measured (CPU, cores, threads, torch, date, load, matmul rate)."""
    info = result["machine"]
    parts = [f"{info['cpu_count']}-core {info.get('cpu') or info['device_name']}",
             f"torch {info['torch']}", f"{info['torch_threads']} thread{'s' if info['torch_threads'] > 1 else ''}",
             info["date"][:16].replace("T", " ") + " UTC"]
    load_average = info.get("load_average") or info.get("load_average_1_5_15min") or {}
    load_average = load_average.get("start") if isinstance(load_average, dict) else load_average
    if load_average:
        parts.append(f"load average {load_average[0]:.1f} at the start")
    if result.get("matmul_gflops_per_s"):
        parts.append(f"2048 x 2048 matmul {result['matmul_gflops_per_s']:.0f} GFLOP/s in the same run")
    return "Machine: " + ", ".join(parts) + "."


def _latest_machine(names) -> str:
    """The machine line of the latest of several runs made on one machine."""
    latest = max((load(name) for name in names), key=lambda result: result["machine"]["date"])
    return "Every run on one machine; the latest: " + machine(latest)[len("Machine: "):]


def _fmt_length(length: float) -> str:
    return f"{round(length):,}"


def break_even(records: list[dict], mode: str, implementation: str, baseline: str = "sdpa") -> str:
    """Where ``implementation`` becomes faster than ``baseline`` in ``mode``, in words."""
    lengths = sorted(r["length"] for r in records if r["mode"] == mode and r["implementation"] == implementation)
    crossover = crossover_length(records, mode, baseline=baseline, implementation=implementation)
    if not lengths:
        return "not measured"
    if crossover is None:
        return f"not reached (slower at {_fmt_length(lengths[-1])}, the longest measured)"
    if crossover == lengths[0]:
        return f"at most {_fmt_length(lengths[0])} tokens (faster at every measured length; shorter not measured)"
    return f"about {_fmt_length(crossover)} tokens"


def _speed_records(result: dict) -> dict:
    return {(r["mode"], r["implementation"], r["length"]): r for r in result["records"]}


def _speedup(result: dict, mode: str, implementation: str, length: int) -> float:
    """SDPA's time over ``implementation``'s, same run, same length."""
    records = _speed_records(result)
    return records[(mode, "sdpa", length)]["seconds"] / records[(mode, implementation, length)]["seconds"]


def _speedup_text(result: dict, mode: str, implementation: str, length: int, bold: bool = False,
                  digits: int = 1) -> str:
    """``"9.5x"`` (bold if asked), with the range of the runs' own ratios when the result holds several processes'."""
    records = _speed_records(result)
    sdpa, other = records[(mode, "sdpa", length)], records[(mode, implementation, length)]
    by_run = [a / b for a, b in zip(sdpa.get("process_seconds", ()), other.get("process_seconds", ()))]
    return _ratio_text(_speedup(result, mode, implementation, length), by_run, digits, bold)


def _ratio_text(value: float, by_run: list[float] | None, digits: int = 2, bold: bool = False) -> str:
    """``"3.45x"`` (bold if asked) with the range of the runs' own ratios when there are several."""
    text = f"**{value:.{digits}f}x**" if bold else f"{value:.{digits}f}x"
    if by_run and len(by_run) > 1:
        text += f" (runs: {min(by_run):.{digits}f}-{max(by_run):.{digits}f}x)"
    return text


def _medians_text(settings: dict) -> str:
    """``"median of 3 runs (fresh processes) of 5 calls each"``, or ``"median of 5"`` for a single run."""
    if settings.get("processes", 1) > 1:
        return f"median of {settings['processes']} runs (fresh processes) of {settings['repeats']} calls each"
    return f"median of {settings['repeats']}"


def _link(root: str, name: str, text: str | None = None) -> str:
    """A markdown link to the result ``name`` from a page whose path to the repository root is ``root``."""
    return f"[{text or name}]({root}{RESULTS_LINK}/{name})"


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


def attention_speed(root: str) -> str:
    current, old = load("attention_speed_chunked.json"), load("attention_speed.json")
    by_key = _speed_records(current)
    lines = ["Today's kernel (chunked, features recomputed in the backward), forward + backward of one call, B=1, "
             f"H={current['settings']['heads']}, d={current['settings']['head_dim']}, "
             f"m={current['settings']['nb_features']}, float32, {_medians_text(current['settings'])} "
             f"({_link(root, 'attention_speed_chunked.json')}):", "",
             "| mode | L | FAVOR+ (s) | SDPA (s) | SDPA / FAVOR+ | FAVOR+ GFLOP/s |", "|---|---:|---:|---:|---:|---:|"]
    for mode in ("bidirectional", "causal"):
        for length in current["settings"]["lengths"]:
            favor, sdpa = by_key[(mode, "favor", length)], by_key[(mode, "sdpa", length)]
            lines.append(f"| {mode} | {length} | {favor['seconds']:.3f} | {sdpa['seconds']:.3f} | "
                         f"**{sdpa['seconds'] / favor['seconds']:.2f}x** | {favor['gflops_per_s']:.0f} |")
    lines += ["", f"Break-even: bidirectional {break_even(current['records'], 'bidirectional', 'favor')}, causal "
              f"{break_even(current['records'], 'causal', 'favor')}. {machine(current)}", ""]
    by_key = _speed_records(old)
    common = sorted(set(current["settings"]["lengths"]) & set(old["settings"]["lengths"]))
    pairs = "; ".join(
        f"{mode} " + ", ".join(f"{_speedup(current, mode, 'favor', length):.2f}x against "
                               f"{_speedup(old, mode, 'favor', length):.2f}x at {length // 1024}k" for length in common)
        for mode in ("bidirectional", "causal"))
    comparison = (f"SDPA's time over FAVOR+'s, today's kernel against it, each measured in its own run (on other days: "
                  f"compare the ratios, not the seconds): {pairs}; below {common[0]:,} only this older kernel was "
                  "measured")
    lines += ["The kernel before issue 17 (it kept the `[L, m]` features for the backward, 128-token causal chunks), "
              f"measured from {old['settings']['lengths'][0]} tokens ({_link(root, 'attention_speed.json')}): "
              f"{comparison}.", "",
              "| L | FAVOR+ bidir. (s) | SDPA bidir. (s) | speedup | FAVOR+ causal (s) | SDPA causal (s) | speedup |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for length in old["settings"]["lengths"]:
        cells = []
        for mode in ("bidirectional", "causal"):
            favor, sdpa = by_key[(mode, "favor", length)], by_key[(mode, "sdpa", length)]
            cells += [f"{favor['seconds']:.3f}", f"{sdpa['seconds']:.3f}", f"{sdpa['seconds'] / favor['seconds']:.2f}x"]
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    lines += ["", f"Break-even: bidirectional {break_even(old['records'], 'bidirectional', 'favor')}, causal "
              f"{break_even(old['records'], 'causal', 'favor')}. {machine(old)}"]
    return "\n".join(lines)


def _memory_table(result: dict, implementation: str, label: str) -> list[str]:
    records = {(r["mode"], r["implementation"], r["length"]): r["peak_memory_bytes"] for r in result["records"]}
    lines = [f"| L | {label} bidir. (MiB) | SDPA bidir. (MiB) | ratio | {label} causal (MiB) | SDPA causal (MiB) | ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for length in result["settings"]["lengths"]:
        cells = []
        for mode in ("bidirectional", "causal"):
            ours, sdpa = records[(mode, implementation, length)], records[(mode, "sdpa", length)]
            cells += [f"{ours / MIB:.1f}", f"{sdpa / MIB:.1f}", f"**{ours / sdpa:.2f}x**"]
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    return lines


def attention_memory(root: str) -> str:
    result = load("attention_memory.json")
    lines = ["Extra peak memory of one call, forward + backward (growth of the peak resident set of a fresh process), "
             f"B=1, H={result['settings']['heads']}, d={result['settings']['head_dim']}, "
             f"m={result['settings']['nb_features']}, float32 ({_link(root, 'attention_memory.json')}):", ""]
    return "\n".join(lines + _memory_table(result, "favor", "FAVOR+") + ["", machine(result)])


def window_speed(root: str) -> str:
    result = load("attention_speed_window.json")
    settings, by_key = result["settings"], _speed_records(result)
    lines = [f"Causal forward + backward of `window_linear_attention` (window {settings['window']}, "
             f"{settings['sinks']} sinks, a {settings['window_feature_map']} tail of {settings['window_nb_features']} "
             f"features, learned gamma), B=1, H={settings['heads']}, d={settings['head_dim']}, float32, "
             f"{_medians_text(settings)} ({_link(root, 'attention_speed_window.json')}):", "",
             "| L | window (s) | SDPA (s) | SDPA / window |", "|---:|---:|---:|---:|"]
    for length in settings["lengths"]:
        window, sdpa = by_key[("causal", "window", length)], by_key[("causal", "sdpa", length)]
        lines.append(f"| {length} | {window['seconds']:.3f} | {sdpa['seconds']:.3f} | "
                     f"{_speedup_text(result, 'causal', 'window', length, True, 2)} |")
    lines += ["", f"Break-even: {break_even(result['records'], 'causal', 'window')}. {machine(result)}"]
    return "\n".join(lines)


def window_memory(root: str) -> str:
    result = load("attention_memory_window.json")
    settings = result["settings"]
    lines = [f"Extra peak memory of one `window_linear_attention` call, forward + backward (window {settings['window']}, "
             f"{settings['sinks']} sinks, {settings['window_feature_map']} tail of {settings['window_nb_features']} "
             f"features), as above ({_link(root, 'attention_memory_window.json')}):", ""]
    return "\n".join(lines + _memory_table(result, "window", "window") + ["", machine(result)])


CLUSTERED_IMPLEMENTATIONS = (("favor", "FAVOR+"), ("clustered", "clustered"), ("improved-clustered", "improved clustered"),
                             ("lsh", "LSH"))


def clustered_speed(root: str) -> str:
    result = load("clustered_speed.json")
    settings, by_key = result["settings"], _speed_records(result)
    lines = [f"Forward of one bidirectional call, B=1, H={settings['heads']}, d={settings['head_dim']}, float32, "
             f"{_medians_text(settings)}: clustered attention with C={settings['clusters']} clusters, improved "
             f"with top-{settings['topk']} keys, FAVOR+ (m={settings['nb_features']}), a shared-QK LSH attention "
             f"(bucket {settings['bucket_size']}), against SDPA; time: SDPA's time / time "
             f"({_link(root, 'clustered_speed.json')}):", "",
             "| L | SDPA (s) | " + " | ".join(label for _, label in CLUSTERED_IMPLEMENTATIONS) + " |",
             "|---:|---:|" + "---:|" * len(CLUSTERED_IMPLEMENTATIONS)]
    for length in settings["lengths"]:
        sdpa = by_key[("bidirectional", "sdpa", length)]["seconds"]
        cells = [f"{by_key[('bidirectional', name, length)]['seconds']:.2f} s: "
                 f"{_speedup_text(result, 'bidirectional', name, length, digits=2)}"
                 for name, _ in CLUSTERED_IMPLEMENTATIONS]
        lines.append(f"| {length} | {sdpa:.2f} | " + " | ".join(cells) + " |")
    crossovers = ", ".join(f"{label} {break_even(result['records'], 'bidirectional', name)}"
                           for name, label in CLUSTERED_IMPLEMENTATIONS[:3])
    loaded = "" if "load_average" in result["machine"] else (
        " A heavily loaded machine (load average ~15, not recorded then): absolute times are 10-20x the idle ones; "
        "read only the same-run ratios.")
    lines += ["", f"Break-even against SDPA: {crossovers}. {machine(result)}{loaded}"]
    return "\n".join(lines)


def approximation(root: str) -> str:
    result = load("approximation.json")
    settings = result["settings"]
    by_key = {(r["nb_features"], r["projection"]): r for r in result["records"]}
    lines = [f"MSE of FAVOR+ attention against exact softmax attention (float64), d={settings['head_dim']}, "
             f"L={settings['length']}, inputs {settings['input_scale']} N(0, I), {settings['seeds']} projection seeds "
             f"per point ({_link(root, 'approximation.json')}):", "",
             "| m | orthogonal MSE | iid MSE | orthogonal / iid (means) | (medians) |", "|---:|---:|---:|---:|---:|"]
    for features in settings["nb_features"]:
        orthogonal, iid = by_key[(features, "orthogonal")], by_key[(features, "iid")]
        lines.append(f"| {features} | {orthogonal['mse_mean']:.2e} | {iid['mse_mean']:.2e} | "
                     f"{orthogonal['mse_mean'] / iid['mse_mean']:.2f} | "
                     f"{orthogonal['mse_median'] / iid['mse_median']:.2f} |")
    return "\n".join(lines + ["", machine(result)])


def throughput_bound(root: str) -> str:
    result = load("favor_throughput_bound.json")
    lines = ["Throughput of the FAVOR+ call against the bound of its own products and exps at this CPU's best rates, "
             f"as a share of the plain matmul rate ({result['matmul_gflops']:.0f} GFLOP/s in the same run; "
             f"{_link(root, 'favor_throughput_bound.json')}):", "",
             "| mode, L | achieved | bound: products + exps | bound: products only |", "|---|---:|---:|---:|"]
    for record in result["records"]:
        share = {key: record[key] / result["matmul_gflops"]
                 for key in ("achieved_gflops", "bound_gflops", "bound_products_only_gflops")}
        lines.append(f"| {record['mode']} {record['length'] // 1024}k | {share['achieved_gflops']:.0%} | "
                     f"{share['bound_gflops']:.0%} | {share['bound_products_only_gflops']:.0%} |")
    return "\n".join(lines + ["", machine(result)])


# --------------------------------------------------------------------------------------------
# Whole models and decoding
# --------------------------------------------------------------------------------------------


def model_speed(root: str) -> str:
    lines = ["| model, pass | L | softmax (s) | FAVOR+ (s) | speedup | softmax extra MiB | FAVOR+ extra MiB | memory ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    machines = []
    for name, label in (("model_speed_bert_base.json", "BERT-base geometry, 4 layers, forward + backward"),
                        ("model_speed_smollm2.json", "SmolLM2-135M, 30 layers, forward")):
        result = load(name)
        softmax_label, favor_label = result["settings"]["models"]
        records = {(r["model"], r["length"]): r for r in result["records"]}
        for index, length in enumerate(result["settings"]["lengths"]):
            softmax, favor = records[(softmax_label, length)], records[(favor_label, length)]
            by_run = [a / b for a, b in zip(softmax.get("process_seconds", ()), favor.get("process_seconds", ()))]
            lines.append(f"| {label if index == 0 else ''} | {length} | {softmax['seconds']:.1f} | "
                         f"{favor['seconds']:.1f} | "
                         f"{_ratio_text(softmax['seconds'] / favor['seconds'], by_run, bold=True)} | "
                         f"{softmax['peak_memory_bytes'] / MIB:.0f} | {favor['peak_memory_bytes'] / MIB:.0f} | "
                         f"{favor['peak_memory_bytes'] / softmax['peak_memory_bytes']:.2f}x |")
        runs, calls = result["settings"].get("processes", 1), result["settings"]["repeats"]
        machines.append(f"{_link(root, name)} ({f'median of {runs} runs' if runs > 1 else 'one run'} of {calls} "
                        f"timed call{'s' if calls > 1 else ''} a point): {machine(result)[len('Machine: '):]}")
    return "\n".join(lines + ["", "Machines: " + " ".join(machines)])


DECODE_HEADER = ["| context | {label} (ms/step) | softmax + KV cache (ms/step) | softmax / {label} | {label} vs shortest "
                 "(paired) | {label} cache | softmax cache |", "|---:|---:|---:|---:|---:|---:|---:|"]


def _decode_table(result: dict, label: str) -> tuple[list[str], str]:
    """The lines of a decode result's table (``label``: the converted model's column) and its break-even length."""
    records = {(r["implementation"], r["context"]): r for r in result["records"]}
    lines = [line.format(label=label) for line in DECODE_HEADER]
    for context in result["settings"]["context_lengths"]:
        favor, softmax = records[("favor", context)], records[("softmax", context)]
        lines.append(f"| {context} | {favor['seconds_per_token'] * 1e3:.1f} | {softmax['seconds_per_token'] * 1e3:.1f} | "
                     f"**{softmax['seconds_per_token'] / favor['seconds_per_token']:.2f}x** | "
                     f"{favor['paired_ratio_to_shortest']:.3f} | {favor['cache_bytes'] / MIB:.1f} MiB | "
                     f"{softmax['cache_bytes'] / MIB:.1f} MiB |")
    as_speed = [{"mode": "decode", "implementation": r["implementation"], "length": r["context"],
                 "seconds": r["seconds_per_token"]} for r in result["records"]]
    return lines, break_even(as_speed, "decode", "favor", baseline="softmax")


def _runs(result: dict, by_run: list[float] | None, what: str) -> str:
    """How many whole runs a result's figures are the median of, with each run's value of ``what``."""
    processes = result["settings"].get("processes", 1)
    if processes <= 1 or not by_run:
        return "one run"
    return f"median of {processes} fresh-process runs ({what}, by run: {', '.join(f'{v:.2f}x' for v in by_run)})"


def decode(root: str) -> str:
    result = load("decode.json")
    settings = result["settings"]
    table, crossover = _decode_table(result, "FAVOR+")
    model = settings["model"]
    at_longest = result["summary"]["softmax_over_favor_latency_at_longest"]
    lines = [f"One decode step (one new token per sequence through the whole model, cache update, LM head), "
             f"{model['architecture']}: {model['n_layer']} layers, {model['n_head']} heads, width {model['n_embd']}; "
             f"batch {settings['batch']}, {settings['dtype']}, median of {settings['repeats']} interleaved steps, "
             + _runs(result, at_longest.get("by_process"), f"softmax / FAVOR+ at {at_longest['context']:,}")
             + f" ({_link(root, 'decode.json')}):", "", *table, "",
             f"Break-even against softmax + KV cache: {crossover}. {machine(result)}"]
    return "\n".join(lines)


def decode_window(root: str) -> str:
    result = load("decode_window_smollm2.json")
    settings = result["settings"]
    table, crossover = _decode_table(result, "window layers")
    lengths = settings["context_lengths"]
    at_longest = result["summary"]["softmax_over_favor_latency_at_longest"]
    lines = [f"SmolLM2-135M converted to the window hybrid (window {settings['favor_settings']['window']}, "
             f"{settings['favor_settings']['sinks']} sinks, hedgehog tail in all "
             f"{len(settings['model']['window_layers'])} layers, `WindowCacheLayer`) against the same weights on "
             f"SDPA + `DynamicCache`, batch {settings['batch']}, {settings['dtype']}, median of "
             f"{settings['repeats']} interleaved steps, "
             f"{_runs(result, at_longest.get('by_process'), f'softmax / window layers at {lengths[-1]:,}')} "
             f"({_link(root, 'decode_window_smollm2.json')}):", "", *table, "",
             f"Break-even against softmax + KV cache: {crossover}, interpolated between the only two contexts measured "
             f"({lengths[0]:,} and {lengths[-1]:,}); below it the window model decodes slower (many small ops per "
             f"layer), above it faster, and its cache never grows. {machine(result)}"]
    return "\n".join(lines)


GENERATION_FILES = ("generation_floor_smollm2_window_g256.json", "generation_floor_smollm2_window_g256_batch8.json")


def generation(root: str) -> str:
    """The recommended SmolLM2 conversion decoding and prefilling against softmax and no attention at all."""
    lines = ["| batch | work | window layers | softmax (sdpa) | no attention | softmax / window layers | by run | "
             "softmax / no attention |", "|---:|---|---:|---:|---:|---:|---|---:|"]
    results = [load(name) for name in GENERATION_FILES]
    for result in results:
        summary = result["summary"]
        for record in result["decode"]:
            row = summary[f"decode_context_{record['context']}_batch_{record['batch']}"]
            by_run = ", ".join(f"{value:.2f}x" for value in row.get("favor_speedup_by_process", [])) or "one run"
            lines.append(f"| {record['batch']} | decode at {record['context']:,} (ms/step) | "
                         + " | ".join(f"{record['mean_ms'][name]:.1f}" for name in ("favor", "softmax", "floor"))
                         + f" | **{row['favor_speedup']:.2f}x** | {by_run} | {row['floor_speedup']:.2f}x |")
        if result["prefill"] is not None:
            record = result["prefill"]
            row = summary[f"prefill_{record['length']}"]
            by_run = ", ".join(f"{run['softmax'] / run['favor']:.2f}x" for run in record.get("process_median_s", []))
            lines.append(f"| 1 | prefill of {record['length']:,} (s) | "
                         + " | ".join(f"{record['median_s'][name]:.2f}" for name in ("favor", "softmax", "floor"))
                         + f" | **{row['favor_speedup']:.2f}x** | {by_run or 'one run'} | {row['floor_speedup']:.2f}x |")
    first = results[0]
    state = max(first["decode"], key=lambda record: record["context"])["cache_bytes"]
    runs = []
    for name, result in zip(GENERATION_FILES, results):
        processes = result["settings"].get("processes", 1)
        runs.append(f"batch {result['settings']['batch']} ({_link(root, name)}): "
                    + (f"each figure the median of {processes} fresh-process runs, each run's speedup beside it"
                       if processes > 1 else "one run") + f"; {machine(result)}")
    lines += ["", f"Decode: the mean step over {first['settings']['repeats']} rounds (one selection cycle of the sparse "
              f"cache: what `generate()`'s tokens per second see); prefill: the median of "
              f"{first['settings']['prefill_repeats']} forwards. State at the longest context: "
              f"{state['favor'] / MIB:.1f} MiB per sequence against softmax's {state['softmax'] / MIB:.1f} MiB.", "",
              *[f"- {line}" for line in runs]]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Encoders
# --------------------------------------------------------------------------------------------


def recovery_results(root: str) -> str:
    paths = [f"{RESULTS_LINK}/{name}" for name in RECOVERY_FILES]
    results = [load_results(str(RESULTS / name)) for name in RECOVERY_FILES]
    return recovery_table(results, sources=paths, command=RECOVERY_COMMAND).strip("\n")


def clustered_zero_shot(root: str) -> str:
    lines = []
    for name, what in (("clustered_zero_shot_stsb.json", "STS-B dev Pearson"),
                       ("clustered_zero_shot_imdb.json", "IMDB test accuracy")):
        result = load(name)
        settings = result["settings"]
        records = result["records"]
        softmax = records[0]["main_metric"]
        lines += [f"{what}, {settings['num_examples']} examples ({settings['mean_tokens']:.0f} tokens on average, "
                  f"at most {settings['max_tokens']}), each row a zero-shot swap of the fine-tuned softmax model's "
                  f"attention ({_link(root, name)}):", "",
                  f"| attention (no training after the swap) | {result['main_metric']} | vs softmax | "
                  f"agreement with softmax |", "|---|---:|---:|---:|"]
        for record in records:
            lines.append(f"| {record['name']} | {record['main_metric']:.4f} | {record['main_metric'] - softmax:+.4f} | "
                         f"{record['agreement_with_softmax']:.3f} |")
        lines += ["", f"Agreement: {result['agreement_metric']}. {machine(result)}", ""]
    return "\n".join(lines).rstrip("\n")


ENCODER_HYBRID_FILES = ("recovery_stsb_window16_identity_start.json", "recovery_stsb_window16_favor_start.json",
                        "recovery_stsb_window16_favor_start_learned.json",
                        "recovery_stsb_window16_favor_start_learned_1536.json",
                        "recovery_stsb_window16_favor_start_learned_3072.json",
                        "recovery_stsb_window16_favor_start_learned_6144.json",
                        "recovery_stsb_window16_favor_start_learned_6144_teacher.json", "recovery_sst2_window16.json")


def _flag(command: str | None, flag: str) -> str | None:
    match = re.search(rf"{flag}[ =](\S+)", command or "")
    return match.group(1) if match else None


def encoder_hybrid(root: str) -> str:
    lines = ["Every layer a hybrid: band `|i - j| < 16` and the [CLS] sink exact, a hedgehog tail for the other pairs. "
             "(a) the fine-tuned softmax model, (e) (a) converted and its tail transferred with (a) as the teacher "
             "(no labels), (f) (e) fine-tuned again with (a)'s schedule:", "",
             "| result | task | tail start, features, gamma | transfer steps | (f) taught by (a) | (a) | (e) | (f) |",
             "|---|---|---|---:|---|---:|---:|---:|"]
    for name in ENCODER_HYBRID_FILES:
        result = load(name)
        runs, metric = result["runs"], result["main_metric"]
        settings = runs["e"]["favor_settings"]
        start = (settings.get("feature_map_options") or {}).get("init", "identity")
        taught = "yes" if "--teacher-model" in (runs["f"].get("command") or "") else "no"
        a = runs["a"]["metric"]
        cells = [f"{metric} {a:.4f}"] + [f"{runs[label]['metric']:.4f} ({runs[label]['metric'] / a:.1%})"
                                          for label in ("e", "f")]
        lines.append(f"| {_link(root, name, name.removesuffix('.json'))} | {result['task']} | {start}, "
                     f"{settings['nb_features']}, {settings['softmax_weight']} | {_flag(runs['e'].get('command'), '--steps')} "
                     f"| {taught} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", _latest_machine(ENCODER_HYBRID_FILES)])


# --------------------------------------------------------------------------------------------
# Causal LM (SmolLM2-135M)
# --------------------------------------------------------------------------------------------


SMOLLM2_HYBRID_FILES = ("window_hybrid_smollm2.json", "window_hybrid_smollm2_transfer2048.json",
                        "window_hybrid_smollm2_lora_lr1e-3.json", "window_hybrid_smollm2_lora_lr1e-3_worst10.json",
                        "window_hybrid_smollm2_lora360_bf16_taught.json", "window_hybrid_smollm2_tail512.json",
                        "window_hybrid_smollm2_w256_bf16_taught.json")


SOFTMAX_BASELINE_FROM = {"window_hybrid_smollm2_tail512.json": "window_hybrid_smollm2_lora_lr1e-3.json"}
"""A run without a softmax + LoRA arm of its own, and the run whose arm had its LoRA budget."""


def _ppl(arm: dict | None, context: str = "1024") -> float | None:
    return ((arm or {}).get("perplexity") or {}).get(context, {}).get("perplexity")


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _ratio(numerator: float | None, denominator: float | None) -> str:
    return f"{numerator / denominator:.3f}x" if numerator and denominator else "-"


def smollm2_transfer(root: str) -> str:
    lines = ["| result | softmax | softmax, fine-tuned | hedgehog after transfer | hedgehog, transfer + fine-tuning | "
             "ratio to fine-tuned softmax |", "|---|---:|---:|---:|---:|---:|"]
    for name in ("attention_transfer_smollm2_transfer48.json", "attention_transfer_smollm2.json"):
        result = load(name)
        by_name = {run["name"]: run["perplexity"] for run in result["runs"]}
        lines.append(f"| {_link(root, name, name.removesuffix('.json'))} | {by_name['softmax_base']:.2f} | "
                     f"{by_name['softmax_finetuned']:.2f} | {by_name['transfer']:.1f} | "
                     f"{by_name['transfer_finetuned']:.1f} | "
                     f"**{result['comparison']['ratio_transfer_finetuned_to_softmax_finetuned']:.2f}x** |")
    return "\n".join(lines + ["", machine(load("attention_transfer_smollm2.json"))])


def smollm2_hybrid(root: str) -> str:
    lines = ["WikiText-2 test perplexity at context 1024 (first 200,000 characters) of each run's arms; the ratio is "
             "against softmax + LoRA with the same LoRA budget (the target: at most 1.10x):", "",
             "| result | window | transfer tokens | LoRA tokens (lr) | hybrid | softmax + LoRA | ratio | at 2048 | "
             "worst layers on softmax | window only + LoRA | passkey 1k / 2k |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    notes = []
    for name in SMOLLM2_HYBRID_FILES:
        result = load(name)
        arms = result["arms"]
        hybrid, softmax = arms.get("hybrid_lora"), arms.get("softmax_lora")
        baseline_from = SOFTMAX_BASELINE_FROM.get(name)
        if softmax is None and baseline_from:
            softmax = load(baseline_from)["arms"]["softmax_lora"]
            notes.append(f"{name.removesuffix('.json')} has no softmax arm: its ratio is against the softmax + LoRA "
                         f"of {baseline_from.removesuffix('.json')} (the same LoRA steps and rate).")
        record = hybrid["linearize"]
        settings = record["settings"]
        worst = arms.get("hybrid_worst_softmax_lora")
        worst_cell = "-"
        if worst:
            layers = len(worst["linearize"]["softmax_layers"])
            worst_cell = f"{layers} layers: {_ratio(_ppl(worst), _ppl(softmax))}"
        passkey = {row["context_length"]: row["accuracy"] for row in result["passkey"] if row["arm"] == "hybrid_lora"}
        lines.append(
            f"| {_link(root, name, name.removesuffix('.json'))} | {settings['window']} | "
            f"{record['transfer_tokens_seen']:,} | {record['lora_tokens_seen']:,} ({settings['learning_rate']:g}) | "
            f"{_ppl(hybrid):.2f} | {_number(_ppl(softmax))} | **{_ratio(_ppl(hybrid), _ppl(softmax))}** | "
            f"{_ratio(_ppl(hybrid, '2048'), _ppl(softmax, '2048'))} | {worst_cell} | "
            f"{_ratio(_ppl(arms.get('window_lora')), _ppl(softmax))} | "
            f"{_score(passkey.get(1024))} / {_score(passkey.get(2048))} |")
    return "\n".join(lines + ["", *[note + "\n" for note in notes], _latest_machine(SMOLLM2_HYBRID_FILES)])


ARM_TABLES = {
    "smollm2-arms": ("arm", False, (
        ("window", "window only (`--no-tail`)"), ("tail", "window + tail (G = 0)"),
        ("tail_G256_load", "window + tail, G = 256 set at load"),
        ("tail_G256", "window + tail + G = 256, trained with it"),
        ("budget20MiB", "window + tail, per-layer budget 20 MiB (no retraining)"),
        ("tail_G256_no_tail", "G = 256 trained, tail dropped at load"))),
    "smollm2-no-tail": ("arm (window 64 + 4 sinks)", False, (
        ("tail_G256", "window + tail + G = 256, trained at 1024"),
        ("tail_G256_trained4k", "window + tail + G = 256, trained at 4096"),
        ("window_G256", "**window + G = 256, no tail**"), ("window_G256_trained4k", "the same, trained at 4096"))),
    "smollm2-serving": ("served with (4 sinks, no tail)", True, (
        ("window_G256", "window 64 + G 256 (as trained)"), ("window_G1024_load", "window 64 + G 1024"),
        ("window_G1472_load", "window 64 + G 1472"), ("window512_G512_load", "window 512 + G 512"),
        ("window1024_load", "window 1024, no cache"), ("window512_G1024_load", "**window 512 + G 1024** (round 6)"),
        ("window768_G768_load", "window 768 + G 768 (round 6)"))),
}
"""The tables of ``hybrid_arms_smollm2.json``: a column label, whether ratios <= 1.10x are bold (the target), rows."""


def _state_at_16k(arm: dict, baseline: dict, share: bool) -> str:
    """An arm's decoding state per sequence at 16k (``"73.2 MiB"``), with its share of softmax's KV cache if asked."""
    state_bytes = arm["cache_bytes"]["16384"]
    return f"{state_bytes / MIB:.1f} MiB" + (f" ({state_bytes / baseline['cache_bytes']['16384']:.1%})" if share else "")


def smollm2_arms_table(root: str, name: str) -> str:
    """One table of the SmolLM2 arms: perplexity / softmax + LoRA's at each context (positions 512-1024 of the 1k
    windows), passkey, and the decoding state of one sequence (at 16k: its share of softmax's KV cache), every state
    from the record (``model_state_bytes``)."""
    result = load("hybrid_arms_smollm2.json")
    label, bold_target, rows = ARM_TABLES[name]
    baseline = result["baseline"]
    contexts = [str(context) for context in result["protocol"]["contexts"]]
    passkeys = [str(length) for length in result["protocol"]["passkey_lengths"]]

    def ratio(value: float | None, reference: float) -> str:
        if value is None:
            return "-"
        text = f"{value / reference:.3f}x"
        return f"**{text}**" if bold_target and value / reference <= 1.10 else text

    def passkey(arm: dict) -> str:
        scores = arm["passkey_by_length"]
        return " / ".join(f"{scores[n]:.2f}" if n in scores else "-" for n in passkeys) if scores else "-"

    lines = [f"| {label} | " + " | ".join(contexts[:1] + ["positions 512-1024"] + contexts[1:])
             + f" | passkey {' / '.join(f'{int(n) // 1024}k' for n in passkeys)} | state at 16k |",
             "|---|" + "---:|" * (len(contexts) + 1) + "---|---:|",
             "| softmax + LoRA | " + " | ".join(f"{baseline['perplexity'][c]:.2f}" for c in contexts[:1])
             + f" | {baseline['perplexity_by_position']['512:1024']:.2f} | "
             + " | ".join(f"{baseline['perplexity'][c]:.2f}" for c in contexts[1:])
             + f" | {passkey(baseline)} | {baseline['cache_bytes']['16384'] / MIB:.1f} MiB |"]
    for arm_name, arm_label in rows:
        arm = result["arms"][arm_name]
        perplexity = arm["perplexity"]
        by_position = arm.get("perplexity_by_position", {}).get("512:1024")
        cells = [ratio(perplexity.get(contexts[0]), baseline["perplexity"][contexts[0]]),
                 ratio(by_position, baseline["perplexity_by_position"]["512:1024"]),
                 *(ratio(perplexity.get(c), baseline["perplexity"][c]) for c in contexts[1:])]
        lines.append(f"| {arm_label} | " + " | ".join(cells) + f" | {passkey(arm)} | "
                     f"{_state_at_16k(arm, baseline, share=bold_target)} |")
    return "\n".join(lines + ["", f"{_link(root, 'hybrid_arms_smollm2.json')}; " + machine(result)])


LONG_CONTEXT_ARMS = (("window512_G1024", "**window 512 + G 1024**, recall selection (ours)"),
                     ("window512_G1024_span31", "**window 512 + G 1024**, recall selection over 31-token spans (ours, "
                      "`--sparse-cache-span 31`)"),
                     ("window1024_G512_span31", "window 1024 + G 512, recall selection over 31-token spans (the same "
                      "bytes, more of them recent)"),
                     ("window512_G1024_attention", "window 512 + G 1024, attention selection (H2O / TOVA-style)"),
                     ("streamingllm_window1536", "window 1536, no cache (StreamingLLM)"),
                     ("quantized_kv_4bit", "full KV cache, 4-bit (transformers QuantizedCache, quanto)"),
                     ("quantized_kv_2bit", "full KV cache, 2-bit (transformers QuantizedCache, quanto)"),
                     ("half_bytes_36MiB", "window 512, G 0 / 256 / 1024 per layer by `budget --metric loss` (half the "
                      "bytes)"),
                     ("half_bytes_window448_G256_span31", "window 448 + G 256 over 31-token spans (half the bytes)"),
                     ("middle_layers_G2048", "window 512, G 2048 in layers 2-12 and 256-1024 elsewhere (the same "
                      "bytes, chosen from the passkey probe)"),
                     ("snapkv_window512_K1024", "SnapKV: 4 sinks + window 512 + the 1,024 keys the prompt's last 32 "
                      "queries attend to most (each score averaged over 7 neighbours, the paper's), cut after the "
                      "prompt (full KV cache while reading it; retrieval only)"),
                     ("snapkv_window512_K1024_pool31", "SnapKV as above, each score averaged over 31 neighbours "
                      "(whole spans)"))
LONG_CONTEXT_PASSKEY = "long_context_passkey_smollm2.json"
SNAPKV_ARM, SNAPKV_SPANS_ARM = "snapkv_window512_K1024", "snapkv_window512_K1024_pool31"
SPANS_ARM = "window512_G1024_span31"


def _long_context_row(root: str) -> str:
    """The README's row of the training-free long-context arms (``long_context_arms_smollm2.json``): the recommended
    configuration (window 512 + G 1024 over 31-token spans) against softmax, per-token selection and the peers."""
    result = load("long_context_arms_smollm2.json")
    baseline, arms = result["baseline"], result["arms"]
    ours = arms[SPANS_ARM]

    def ratio(arm: dict, context: str = "8192") -> str:
        return f"{arm['perplexity'][context] / baseline['perplexity'][context]:.3f}x"

    def needles(arm: dict, length: str) -> str:
        return f"{arm['needles_by_length'][length]:.2f}"

    longest = str(result["protocol"]["retrieval_lengths"][-1])
    passkey = load(LONG_CONTEXT_PASSKEY)
    length = str(passkey["protocol"]["retrieval_lengths"][-1])
    keys = {name: arm["passkey_by_length"][length] for name, arm in passkey["arms"].items()}
    peers = [f"{label} " + ", ".join(([ratio(arms[name])] if "8192" in arms[name]["perplexity"] else [])
                                     + ([f"needles {needles(arms[name], longest)}"]
                                        if arms[name].get("needles_by_length") else [])
                                     + ([f"passkey {keys[name]:.2f}"] if name in keys else []))
             for name, label in (("window1024_G512_span31", "window 1024 + G 512 over spans (the same bytes)"),
                                 ("window512_G1024", "per-token selection"),
                                 ("streamingllm_window1536", "StreamingLLM (window 1536)"),
                                 ("window512_G1024_attention", "attention selection"),
                                 ("half_bytes_36MiB", "half the bytes by `budget`"),
                                 ("half_bytes_window448_G256_span31", "half the bytes as window 448 + G 256 over spans"),
                                 (SNAPKV_ARM, "SnapKV (same bytes, cut after the prompt)"),
                                 (SNAPKV_SPANS_ARM, "SnapKV pooled over 31 keys"),
                                 ("quantized_kv_4bit", "4-bit KV cache")) if name in arms]
    if "quantized_kv_4bit" in arms:
        grows = arms["quantized_kv_4bit"]["cache_bytes"]
        peers[-1] += f" ({grows['8192'] / MIB:.1f} MiB at 8k, growing: {grows['16384'] / MIB:.1f} MiB at 16k)"
    ratios = " / ".join(ratio(ours, c) for c in ("2048", "4096", "8192"))
    return ("| SmolLM2-135M to its 8k positions with no training: window 512 + G 1024 selected over 31-token spans "
            f"(`--sparse-cache-span 31`, constant {ours['cache_bytes']['16384'] / MIB:.1f} MiB) against the KV-cache "
            f"methods a user would pick instead | perplexity / softmax's {ratios} at 2k / 4k / 8k, multi-needle "
            f"{needles(ours, '4096')} / {needles(ours, longest)} at 4k / 8k (softmax {needles(baseline, '4096')} / "
            f"{needles(baseline, longest)}, 16 prompts each), passkey {keys[SPANS_ARM]:.2f} at "
            f"{round(int(length) / 1024)}k (softmax {passkey['baseline']['passkey_by_length'][length]:.2f}); at 8k "
            + "; ".join(peers) + f" | {_link(root, 'long_context_arms_smollm2.json', 'long context')} |")


def smollm2_long_context(root: str) -> str:
    """The training-free arms of SmolLM2-135M to its 8k positions (``long_context_arms_smollm2.json``): perplexity
    / softmax's at each context, multi-needle accuracy with its standard error, decoding state at 8k and 16k."""
    result = load("long_context_arms_smollm2.json")
    baseline = result["baseline"]
    contexts = [str(context) for context in result["protocol"]["contexts"]]
    lengths = [str(length) for length in result["protocol"]["retrieval_lengths"]]

    def needles(arm: dict) -> str:
        scores, errors = arm.get("needles_by_length", {}), arm.get("needles_standard_error_by_length", {})
        return " | ".join(f"{scores[n]:.2f} ± {errors[n]:.2f}" if n in scores else "-" for n in lengths)

    def state(arm: dict) -> str:
        sizes = [(arm["cache_bytes"][n], baseline["cache_bytes"][n]) for n in ("8192", "16384")]
        return " | ".join(f"{mine / MIB:.1f} MiB ({mine / softmax:.0%})" for mine, softmax in sizes)

    lines = ["| arm (no training) | " + " | ".join(f"perplexity {int(c) // 1024}k" for c in contexts)
             + " | " + " | ".join(f"needles {round(int(n) / 1024)}k" for n in lengths) + " | state 8k | state 16k |",
             "|---|" + "---:|" * (len(contexts) + len(lengths) + 2),
             "| softmax (full KV cache) | " + " | ".join(f"{baseline['perplexity'][c]:.2f}" for c in contexts)
             + f" | {needles(baseline)} | {state(baseline)} |"]
    for name, label in LONG_CONTEXT_ARMS:
        arm = result["arms"].get(name)
        if arm is None:
            continue
        ratios = " | ".join(f"{arm['perplexity'][c] / baseline['perplexity'][c]:.3f}x" if c in arm["perplexity"]
                            else "-" for c in contexts)
        lines.append(f"| {label} | {ratios} | {needles(arm)} | {state(arm)} |")
    protocol = result["protocol"]
    return "\n".join(lines + ["", f"Perplexity: windows of each context every half window on the first "
                              f"{protocol['max_chars']:,} characters of {protocol['text_file']} (softmax's absolute, "
                              f"the arms' as ratios); needles: {protocol['trials']} prompts at each of the depths "
                              f"{', '.join(f'{d:g}' for d in protocol['depths'])}, accuracy ± standard error; "
                              f"{_link(root, 'long_context_arms_smollm2.json')}; " + machine(result)])


def smollm2_long_context_passkey(root: str) -> str:
    """Passkey retrieval at 8k of the training-free arms (:data:`LONG_CONTEXT_PASSKEY`): accuracy ± standard error
    beside each arm's perplexity ratio at 8k and its constant state."""
    result = load(LONG_CONTEXT_PASSKEY)
    baseline, protocol = result["baseline"], result["protocol"]
    length = str(protocol["retrieval_lengths"][-1])

    def passkey(arm: dict) -> str:
        return f"{arm['passkey_by_length'][length]:.2f} ± {arm['passkey_standard_error_by_length'][length]:.2f}"

    lines = [f"| arm (no training) | passkey {round(int(length) / 1024)}k | perplexity 8k | state 16k |",
             "|---|---:|---:|---:|",
             f"| softmax (full KV cache) | {passkey(baseline)} | {baseline['perplexity']['8192']:.2f} | "
             f"{baseline['cache_bytes']['16384'] / MIB:.1f} MiB |"]
    for name, label in LONG_CONTEXT_ARMS:
        arm = result["arms"].get(name)
        if arm is not None:
            perplexity = arm["perplexity"].get("8192")
            ratio = "-" if perplexity is None else f"{perplexity / baseline['perplexity']['8192']:.3f}x"
            lines.append(f"| {label} | {passkey(arm)} | {ratio} | "
                         f"{arm['cache_bytes']['16384'] / MIB:.1f} MiB |")
    return "\n".join(lines + ["", f"Passkey: {protocol['trials']} prompts of {int(length):,} tokens at each of the "
                              f"depths {', '.join(f'{d:g}' for d in protocol['depths'])}; perplexity as in the table "
                              f"above; {_link(root, LONG_CONTEXT_PASSKEY)}; " + machine(result)])


def smollm2_budget_by_loss(root: str) -> str:
    """``hf-performer budget --metric loss`` on the zero-shot SmolLM2 window hybrid
    (``cache_budget_smollm2_loss.json``): the measured perplexity of the allocation beside the best single G within the same budget and exact softmax."""
    result = load("cache_budget_smollm2_loss.json")
    measured, uniform = result["measured"], result["uniform"]
    options = sorted({str(entry["option"]) for entry in result["layers"].values()}, key=lambda o: (o == "softmax", o))
    counts = ", ".join(f"G {option}: {sum(str(e['option']) == option for e in result['layers'].values())} layers"
                       for option in sorted(options, key=lambda o: int(o) if o.isdigit() else 10 ** 9))
    rows = [("every window layer on exact softmax (reference)", measured["exact"], None),
            (f"the allocation ({counts})", measured["allocation"], result["total_bytes"]),
            (f"one G = {uniform['sparse_cache']} for every layer (the largest that fits)", measured["uniform"],
             uniform["bytes"])]
    lines = ["| configuration | perplexity | / exact | state at 8k |", "|---|---:|---:|---:|"]
    for label, entry, size in rows:
        ratio = entry["perplexity"] / measured["exact"]["perplexity"]
        lines.append(f"| {label} | {entry['perplexity']:.3f} | {ratio:.3f}x | "
                     f"{f'{size / MIB:.1f} MiB' if size else '-'} |")
    on = result["measured_on"]
    return "\n".join(lines + ["", f"Budget {result['budget_bytes'] / MIB:.0f} MiB at {result['context']:,} tokens; "
                              f"measured on {on['sequences']} x {on['length']} tokens of {on['text_file']} (the same "
                              f"text the options were measured on); `{result['command']}`; "
                              f"{_link(root, 'cache_budget_smollm2_loss.json')}; " + machine(result)])


RECOMMENDED_SERVING = (("window_G256", "window 64 + G 256 (as trained)"), ("window512_G512_load", "window 512 + G 512"),
                       ("window_G1024_load", "window 64 + G 1024"), ("window512_G1024_load", "window 512 + G 1024"))


def smollm2_recommended(root: str) -> str:
    """The recommended causal-LM path's serving choices (the guide's table), from ``hybrid_arms_smollm2.json``."""
    result = load("hybrid_arms_smollm2.json")
    baseline = result["baseline"]
    softmax_passkey = " / ".join(f"{value:.2f}" for value in baseline["passkey_by_length"].values())
    lines = [f"| served with | perplexity | passkey (softmax {softmax_passkey}) | state per sequence (of softmax's "
             "at 16k) |", "|---|---|---|---:|"]
    for name, label in RECOMMENDED_SERVING:
        arm = result["arms"][name]
        lines.append(f"| {label} | " + " / ".join(f"{ratio:.3f}x" for ratio in arm["perplexity_ratio"].values())
                     + " | " + " / ".join(f"{value:.2f}" for value in arm["passkey_by_length"].values())
                     + f" | {_state_at_16k(arm, baseline, share=True)} |")
    return "\n".join(lines)


def smollm2_tail(root: str) -> str:
    result = load("window_hybrid_smollm2_tail_error.json")
    lines = [f"Each window layer's attention-output error against exact softmax (1000 x MSE, teacher forcing, "
             f"{result['sequences']} x {result['length']} tokens of {result['text_file']}), with the transferred tail "
             f"and with it dropped ({_link(root, 'window_hybrid_smollm2_tail_error.json')}):", "",
             "| transferred model | window | mean error, window only | with the tail | share the tail removes |",
             "|---|---:|---:|---:|---:|"]
    for label, model in result["models"].items():
        means = model["mean"]
        lines.append(f"| {label} | {model['window']} | {means['window_only']:.2f} | {means['hybrid']:.2f} | "
                     f"{1 - means['hybrid'] / means['window_only']:.0%} |")
    lines += ["", machine(result), ""]
    probe = load("window_hybrid_smollm2_tail_probe.json")
    lines += [f"Tail probes: {probe['title']} ({_link(root, 'window_hybrid_smollm2_tail_probe.json')}):", "",
              "| tail | mean layer loss | worst layer (loss) | transfer tokens | transfer wall time |",
              "|---|---:|---:|---:|---:|"]
    for probe_run in probe["probes"].values():
        losses = probe_run["layer_losses"]
        worst = max(losses, key=losses.get)
        lines.append(f"| {probe_run['nb_features']} features from {probe_run['feature_map_init']} | "
                     f"{sum(losses.values()) / len(losses):.2f} | {worst} ({losses[worst]:.1f}) | "
                     f"{probe_run['transfer']['tokens_seen']:,} | {probe_run['transfer']['wall_time_s']:.0f} s |")
    return "\n".join(lines + ["", machine(probe)])


# --------------------------------------------------------------------------------------------
# Summaries: the README's headline, the break-even lengths, the index of every committed result
# --------------------------------------------------------------------------------------------


def _memory_ratio_range(result: dict, implementation: str, from_length: int = 4096) -> tuple[float, float]:
    ratios = [value for mode in result["summary"]["over_sdpa_by_implementation"][implementation].values()
              for length, value in mode.items() if int(length) >= from_length]
    return min(ratios), max(ratios)


def _best_ratio(name: str, arm: str = "hybrid_lora") -> float:
    arms = load(name)["arms"]
    return _ppl(arms[arm]) / _ppl(arms["softmax_lora"])


def _generation_text(row: dict, digits: int = 2) -> str:
    return _ratio_text(row["favor_speedup"], row.get("favor_speedup_by_process"), digits)


def readme_headline(root: str) -> str:
    speed, memory = load("attention_speed_chunked.json"), load("attention_memory.json")
    decode_result, window_decode = load("decode.json"), load("decode_window_smollm2.json")
    sst2, stsb_hybrid = load("recovery_sst2.json"), load("recovery_stsb_window16_favor_start_learned_6144_teacher.json")
    low, high = _memory_ratio_range(memory, "favor")
    longest = max(speed["settings"]["lengths"])
    decode_summary, window_summary = decode_result["summary"], window_decode["summary"]
    decode_at_longest = decode_summary["softmax_over_favor_latency_at_longest"]
    window_at_longest = window_summary["softmax_over_favor_latency_at_longest"]
    decode_context = decode_at_longest["context"]
    window_break_even = _decode_table(window_decode, "window layers")[1]
    generation_result = load("generation_floor_smollm2_window_g256.json")
    generation = generation_result["summary"]
    prefill_by_run = [run["softmax"] / run["favor"] for run in generation_result["prefill"].get("process_median_s", [])]
    generation_bytes = max(generation_result["decode"], key=lambda record: record["context"])["cache_bytes"]
    generation_batch8_result = load("generation_floor_smollm2_window_g256_batch8.json")
    generation_batch8 = generation_batch8_result["summary"]
    generation_batch8_runs = generation_batch8_result["settings"].get("processes", 1)
    worst10 = load("window_hybrid_smollm2_lora_lr1e-3_worst10.json")
    arms_result = load("hybrid_arms_smollm2.json")
    arms = arms_result["arms"]
    trained4k, no_tail, served = arms["tail_G256_trained4k"], arms["window_G256"], arms["window512_G1024_load"]
    lines = [
        "| | result | source |", "|---|---|---|",
        "| one FAVOR+ attention call, forward + backward, vs SDPA (median of "
        f"{speed['settings'].get('processes', 1)} runs) | {_speedup_text(speed, 'bidirectional', 'favor', 8192, True)} "
        f"bidirectional and {_speedup_text(speed, 'causal', 'favor', 8192, True)} causal at 8k tokens, "
        f"{_speedup_text(speed, 'causal', 'favor', longest)} causal at {longest // 1024}k; break-even "
        f"{break_even(speed['records'], 'causal', 'favor')} | {_link(root, 'attention_speed_chunked.json', 'kernels')} |",
        f"| its extra peak memory, 4k-32k tokens | {low:.2f}-{high:.2f}x SDPA's | "
        f"{_link(root, 'attention_memory.json', 'memory')} |",
        f"| decoding at a {decode_context // 1024}k context, GPT-2-small geometry | "
        f"{_ratio_text(decode_at_longest['value'], decode_at_longest.get('by_process'), 1, True)} faster than softmax "
        "+ KV cache, "
        f"cache {decode_summary['cache_bytes_at_longest']['favor'] / MIB:.1f} MiB against "
        f"{decode_summary['cache_bytes_at_longest']['softmax'] / MIB:,.0f} MiB | {_link(root, 'decode.json', 'decoding')} |",
        "| SmolLM2-135M window hybrid as recommended (window 64 + the 256 hardest older keys per head, no tail), "
        f"decoding | {_generation_text(generation['decode_context_16384_batch_1'])} softmax's speed at 16k "
        f"(with no attention work at all: {generation['decode_context_16384_batch_1']['floor_speedup']:.2f}x), "
        f"{_generation_text(generation['decode_context_512_batch_1'])} at 512; batch 8"
        f"{'' if generation_batch8_runs > 1 else ' (one run)'}: "
        f"{_generation_text(generation_batch8['decode_context_512_batch_8'])} at 512, "
        f"{_generation_text(generation_batch8['decode_context_16384_batch_8'], 1)} at 16k; prefill of 4k tokens "
        f"{_ratio_text(generation['prefill_4096']['favor_speedup'], prefill_by_run)} (floor "
        f"{generation['prefill_4096']['floor_speedup']:.2f}x); state {generation_bytes['favor'] / MIB:.1f} MiB at any "
        f"context (softmax's KV cache {arms_result['baseline']['cache_bytes']['16384'] / MIB:,.0f} MiB at 16k); "
        f"with a tail: "
        f"{_ratio_text(window_at_longest['value'], window_at_longest.get('by_process'))} at 16k, "
        f"{window_summary['softmax_over_favor_latency']['512']:.2f}x at 512 (break-even {window_break_even}) | "
        f"{_link(root, 'generation_floor_smollm2_window_g256.json', 'generation')}, "
        f"{_link(root, 'decode_window_smollm2.json', 'with a tail')} |",
        f"| SST-2 accuracy, MiniLM-L6 (softmax {100 * sst2['runs']['a']['metric']:.2f}) | FAVOR+ after recovery "
        f"fine-tuning {100 * sst2['runs']['c']['metric']:.2f}; learned (hedgehog) maps, transfer + fine-tuning "
        f"**{100 * sst2['runs']['f']['metric']:.2f}** | {_link(root, 'recovery_sst2.json', 'recovery')} |",
        f"| STS-B Pearson, MiniLM-L6 as a band-16 + [CLS] hybrid | **{stsb_hybrid['attention_transfer_target']['ratio']:.1%}** "
        f"of softmax ({stsb_hybrid['runs']['f']['metric']:.4f} against {stsb_hybrid['runs']['a']['metric']:.4f}) | "
        f"{_link(root, 'recovery_stsb_window16_favor_start_learned_6144_teacher.json', 'encoder hybrid')} |",
        f"| SmolLM2-135M window hybrid, WikiText-2 perplexity / softmax + LoRA (goal 1.10x) | "
        f"{_best_ratio('window_hybrid_smollm2_lora360_bf16_taught.json'):.3f}x at window 64, "
        f"**{_best_ratio('window_hybrid_smollm2_w256_bf16_taught.json'):.3f}x** at window 256, "
        f"{_best_ratio('window_hybrid_smollm2_lora_lr1e-3_worst10.json', 'hybrid_worst_softmax_lora'):.3f}x with "
        f"{len(worst10['arms']['hybrid_worst_softmax_lora']['linearize']['softmax_layers'])} of 30 layers on softmax | "
        f"{_link(root, 'window_hybrid_smollm2_w256_bf16_taught.json', 'causal LM')} |",
        "| the same, the 1,024 hardest older keys per head exact, no tail (trained with window 64 + 256 keys: "
        "`--no-tail --sparse-cache 256`; served with window 512 + 1,024: `hf-performer settings`) | "
        + " / ".join(f"**{ratio:.3f}x**" if ratio <= 1.10 else f"{ratio:.3f}x"
                     for ratio in served['perplexity_ratio'].values()) + " at 1k / 2k / 4k, passkey "
        + " / ".join(f"{value:.2f}" for value in served['passkey_by_length'].values()) + " (softmax "
        + " / ".join(f"{value:.2f}" for value in arms_result['baseline']['passkey_by_length'].values())
        + f"), state {served['cache_bytes']['16384'] / MIB:.1f} MiB at any context "
        f"({served['cache_fraction_of_baseline']['16384']:.1%} of softmax's KV cache at 16k); with 256 keys "
        f"({no_tail['cache_bytes']['16384'] / MIB:.1f} MiB) "
        + " / ".join(f"{ratio:.3f}x" for ratio in no_tail['perplexity_ratio'].values())
        + f"; with a learned tail {trained4k['perplexity_ratio']['4096']:.3f}x at 4096 trained there | "
        f"{_link(root, 'hybrid_arms_smollm2.json', 'arms')} |",
        _long_context_row(root),
        "",
        f"All measured on a {speed['machine']['cpu_count']}-core {speed['machine']['cpu']} CPU with torch "
        f"{speed['machine']['torch']}; each result records its machine, date and load.",
    ]
    return "\n".join(lines)


def break_even_lengths(root: str) -> str:
    """Where each kind of attention starts to pay against softmax, per committed measurement."""
    rows = []
    for name, mode, implementation, what in (
            ("attention_speed_chunked.json", "bidirectional", "favor", "FAVOR+, bidirectional, forward + backward"),
            ("attention_speed_chunked.json", "causal", "favor", "FAVOR+, causal, forward + backward"),
            ("attention_speed.json", "bidirectional", "favor", "FAVOR+, bidirectional (previous kernel)"),
            ("attention_speed.json", "causal", "favor", "FAVOR+, causal (previous kernel)"),
            ("attention_speed_window.json", "causal", "window", "window hybrid, causal, forward + backward"),
            ("clustered_speed.json", "bidirectional", "clustered", "clustered C=100, forward"),
            ("clustered_speed.json", "bidirectional", "improved-clustered", "improved clustered C=100 top-32, forward")):
        result = load(name)
        rows.append(f"| {what} | SDPA | {break_even(result['records'], mode, implementation)} | "
                    f"{_link(root, name)}, {result['machine']['date'][:10]} |")
    for name, what in (("decode.json", "FAVOR+ decoding (GPT-2 small geometry)"),
                       ("decode_window_smollm2.json", "window hybrid decoding (SmolLM2-135M)")):
        result = load(name)
        rows.append(f"| {what} | SDPA + KV cache | {_decode_table(result, 'FAVOR+')[1]} | {_link(root, name)}, "
                    f"{result['machine']['date'][:10]} |")
    return "\n".join(["| kind | against | break-even length | measured |", "|---|---|---|---|", *rows, "",
                      "All on the project's 2-core AMD EPYC CPU"
                      + ("" if "load_average" in load("clustered_speed.json")["machine"] else
                         "; the clustered row was measured under a load average of ~15 (ratios only)")
                      + ". The results pages give each table with its machine."])


def _command(result: dict) -> str | None:
    command = result.get("command")
    if isinstance(command, str):
        return command
    runs = result.get("runs")
    if isinstance(runs, dict) and all(isinstance(run, dict) and run.get("command") for run in runs.values()):
        return f"one per run ({', '.join(runs)}), in `runs.<label>.command`"
    return None


def results_index(root: str) -> str:
    """Every committed result JSON (and its plot), when it was measured and the command recorded in it."""
    lines = ["| result | plot | measured | command recorded in the JSON |", "|---|---|---|---|"]
    for path in sorted(RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        plot = path.with_suffix(".png")
        date = (result.get("machine") or {}).get("date", "")[:10] or "-"
        command = _command(result)
        removed = sorted({commit for script, commit in REMOVED_SCRIPTS.items() if script in (command or "")})
        if command and not command.startswith("one per run"):
            command = "`" + command.replace("|", "\\|") + "`"
        if removed:
            command += f" (its script was removed: run it from a checkout of {', '.join(removed)})"
        lines.append(f"| {_link(root, path.name, path.stem)} | "
                     f"{_link(root, plot.name, 'PNG') if plot.exists() else '-'} | {date} | "
                     f"{command or 'not recorded: see the research log'} |")
    folders = sorted(folder.name for folder in RESULTS.iterdir() if folder.is_dir())
    return "\n".join(lines + ["", "Folders of evaluation records behind two of these results: " +
                              ", ".join(f"`{RESULTS_LINK}/{folder}/`" for folder in folders) + "."])


def launch_counts(root: str) -> str:
    """Kernel launches and host reads of one attention call and of one decoding step, CPU path against parallel path
    (``launch_counts.json``, counted on the CPU)."""
    result = load("launch_counts.json")
    records = result["records"]
    lengths = sorted({r["length"] for r in records})
    kinds = list(dict.fromkeys((r["implementation"], r["mode"]) for r in records))
    count = lambda path, kind, length, field="launches": next(  # noqa: E731
        r[field] for r in records if r["path"] == path and (r["implementation"], r["mode"]) == kind
        and r["length"] == length)
    head = " | ".join(f"CPU path, L={length:,}" for length in lengths) + " | " + \
        " | ".join(f"parallel path, L={length:,}" for length in lengths)
    lines = [f"One attention call, forward + backward (B=1, H=12, d=64, m=256), launches (host reads) "
             f"({_link(root, 'launch_counts.json')}):", "",
             f"| kind | {head} |", "|---|" + "---:|" * (2 * len(lengths))]
    for kind in kinds:
        cells = [f"{count(path, kind, length):,} ({count(path, kind, length, 'synchronisations')})"
                 for path in ("chunked", "parallel") for length in lengths]
        lines.append(f"| {kind[0]}, {kind[1]} | " + " | ".join(cells) + " |")
    decoding = result["decoding"]
    models = list(decoding["chunked/float32"])
    lines += ["", "One generated token, per layer of a SmolLM2-shaped model (9 heads, 3 KV heads), inside `generate`, "
              "launches (host reads):", "",
              "| model | CPU path, float32 | CPU path, bf16 | parallel path, float32 | parallel path, bf16 |",
              "|---|---:|---:|---:|---:|"]
    for model in models:
        cells = []
        for key in ("chunked/float32", "chunked/bfloat16", "parallel/float32", "parallel/bfloat16"):
            row = decoding[key][model]
            cells.append(f"{row['launches_per_layer']:.1f} ({row['synchronisations_per_layer']:.2f})")
        lines.append(f"| {model.replace('_', ' ')} | " + " | ".join(cells) + " |")
    if result.get("training"):
        lines += ["", "One training step (1 x 1,024 tokens, bf16 autocast, forward + backward of the LM loss), per layer "
                  "of the same model, launches (host reads):", "",
                  "| model | CPU path | parallel path |", "|---|---:|---:|"]
        for model in models:
            cells = [f"{result['training'][key][model]['launches_per_layer']:.0f} "
                     f"({result['training'][key][model]['synchronisations_per_layer']:.0f})"
                     for key in ("chunked", "parallel")]
            lines.append(f"| {model.replace('_', ' ')} | " + " | ".join(cells) + " |")
    info = result["machine"]
    lines += ["", f"Counted on the CPU ({info['cpu']}, torch {info['torch']}, {info['date'][:10]}); the counts do not "
              "depend on the device. A launch is an operation that is not a view (on a GPU, at least one kernel); the "
              "sparse cache's selection kernel counts as one."]
    return "\n".join(lines)


def gpu_results(root: str) -> str:
    """The parallel path on a GPU: one attention call (forward + backward, forward only) and the SmolLM2-shaped model
    against their softmax selves, measured in the same runs."""
    lines = []
    for name, title in (("gpu_attention_bf16_torch_backend.json", "forward + backward, portable linear kernels"),
                        ("gpu_attention_bf16_forward.json", "forward only")):
        result = load(name)
        records = result["records"]
        kinds = list(dict.fromkeys((r["implementation"], r["mode"]) for r in records if r["implementation"] != "sdpa"))
        lengths = sorted({r["length"] for r in records})
        seconds = {(r["implementation"], r["mode"], r["length"]): r["seconds"] for r in records}
        lines += [f"One attention call, {title}, B=1, H=12, d=64, m=256, bf16, median of "
                  f"{result['settings']['repeats']}; ms (SDPA's speed / ours) ({_link(root, name)}):", "",
                  "| kind | " + " | ".join(f"{length:,}" for length in lengths) + " |",
                  "|---|" + "---:|" * len(lengths)]
        for implementation, mode in kinds:
            cells = [f"{1e3 * seconds[(implementation, mode, length)]:.2f} "
                     f"({seconds[('sdpa', mode, length)] / seconds[(implementation, mode, length)]:.2f}x)"
                     for length in lengths]
            lines.append(f"| {implementation}, {mode} | " + " | ".join(cells) + " |")
        lines.append("| sdpa, causal | " + " | ".join(f"{1e3 * seconds[('sdpa', 'causal', length)]:.2f}"
                                                    for length in lengths) + " |")
        lines.append("")
    model = load("gpu_model_speed.json")
    rows = {}
    for record in model["records"]:
        value = record.get("median_s", record.get("median_ms_per_token"))
        rows.setdefault((record["stage"], record["length"], record["batch"]), {})[record["model"]] = value
    names = [name for name in ("softmax_sdpa", *model["conversions"])]
    lines += [f"SmolLM2-135M-shaped model (random weights), bf16, median of 2 ({_link(root, 'gpu_model_speed.json')}): "
              "training step and prefill in s, decoding in ms per token; in brackets softmax's time / the "
              "conversion's:", "",
              "| measurement | " + " | ".join(name.replace("_", " ") for name in names) + " |",
              "|---|" + "---:|" * len(names)]
    labels = {"train": "training step, 1 x {length:,}", "prefill": "prefill of {length:,} tokens",
              "decode": "decoding after {length:,} tokens, batch {batch}"}
    for (stage, length, batch), values in rows.items():
        base = values["softmax_sdpa"]
        cells = [f"{values[name]:.3g}" + ("" if name == "softmax_sdpa" else f" ({base / values[name]:.2f}x)")
                 for name in names]
        lines.append(f"| {labels[stage].format(length=length, batch=batch)} | " + " | ".join(cells) + " |")
    info = model["machine"]
    lines += ["", f"Machine: {info['device_name']}, torch {info['torch']}, {info['date'][:16].replace('T', ' ')} UTC; "
              "one process each, measured once: the device was lent for one call, so these are not medians of "
              "several runs (each figure's timed calls in its JSON). Linear backend: the portable kernels for the "
              "forward + backward table; flash-linear-attention's (0.6.0, Triton 3.6.0) for the forward-only table "
              "and the model's Hedgehog tail."]
    return "\n".join(lines)


TABLES = {
    "recovery-results": recovery_results,
    "attention-speed": attention_speed,
    "attention-memory": attention_memory,
    "window-speed": window_speed,
    "window-memory": window_memory,
    "clustered-speed": clustered_speed,
    "approximation": approximation,
    "throughput-bound": throughput_bound,
    "model-speed": model_speed,
    "decode": decode,
    "decode-window": decode_window,
    "generation": generation,
    "clustered-zero-shot": clustered_zero_shot,
    "encoder-hybrid": encoder_hybrid,
    "smollm2-transfer": smollm2_transfer,
    "smollm2-hybrid": smollm2_hybrid,
    "smollm2-tail": smollm2_tail,
    "readme-headline": readme_headline,
    "break-even": break_even_lengths,
    "results-index": results_index,
    "launch-counts": launch_counts,
    "gpu-results": gpu_results,
    "smollm2-recommended": smollm2_recommended,
    "smollm2-long-context": smollm2_long_context,
    "smollm2-long-context-passkey": smollm2_long_context_passkey,
    "smollm2-budget-by-loss": smollm2_budget_by_loss,
    **{name: functools.partial(smollm2_arms_table, name=name) for name in ARM_TABLES},
}
"""Each generated block by the name its markers carry (``<!-- NAME:start -->`` / ``<!-- NAME:end -->``)."""
