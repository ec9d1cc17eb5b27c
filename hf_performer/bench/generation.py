"""How much faster than softmax any attention could make generation: a converted causal LM's decode step and prompt
prefill with its window layers, with softmax (sdpa + DynamicCache), and with no attention work at all.

``hf-performer bench generation FOLDER`` (the folder ``hf-performer convert SRC OUT --window W --sinks S`` writes;
benchmarks/README.md uses SmolLM2-135M). In one process, one model, the three implementations take turns:

* ``favor``: its window layers with their constant-size cache (``make_favor_cache``); decode contexts are reached by
  a real chunked prefill through that cache;
* ``softmax``: ``sdpa`` with transformers' ``DynamicCache`` (synthetic keys / values at decode contexts, as
  ``hf-performer bench decode``);
* ``floor``: an attention function that returns zeros and no cache: the embeddings, projections, MLPs, norms, rotary
  and LM head alone. No attention implementation is faster than this, so ``softmax / floor`` is the largest speedup
  over softmax that attention work can buy on this model and machine.

Decode: one greedy step of ``batch`` sequences at each context length, the three in turn for ``repeats`` consecutive
rounds after two warm-up rounds (and the bytes the window layers' cache and softmax's hold after them). The default,
64 rounds, is one selection cycle of the sparse cache (a window layer selects once every ``chunk_size`` = 64 tokens,
and that step costs more): the mean step is what ``generate()``'s tokens per second see, the median the typical
step; both are recorded, the speedups are of the means. Prefill: one forward of a ``prefill_length`` prompt
(``logits_to_keep=1``, through the cache), the three in turn, medians. With ``processes`` > 1 each figure is the
median over whole runs in fresh processes (:func:`.machine.median_of_fresh_processes`).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from .decode import cache_nbytes, use_implementation
from .decode_converted import load_converted_causal_lm, prefill, synthetic_kv_cache
from .machine import load_average, machine_record, median_of_fresh_processes
from .report import _pyplot, _save

NO_ATTENTION = "no_attention"
IMPLEMENTATIONS = ("favor", "softmax", "floor")
LABELS = {"favor": "window layers", "softmax": "softmax (sdpa)", "floor": "no attention"}
DEFAULT_CONTEXTS = (512, 16384)
DEFAULT_PREFILL_LENGTH = 4096
DEFAULT_REPEATS = 64
"""One selection cycle of the sparse cache (64 tokens): the mean step over it is what ``generate()`` sees."""


def _no_attention(module, query, key, value, attention_mask, **kwargs):
    """``[B, L, H, dv]`` zeros: the layer's output projection still runs, no attention work or cache is done."""
    return torch.zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1], dtype=query.dtype), None


class Runner:
    """The model under the three implementations; each call switches before the clock starts."""

    def __init__(self, model):
        from transformers import AttentionInterface

        AttentionInterface.register(NO_ATTENTION, _no_attention)
        self.model = model

    def switch(self, implementation: str) -> None:
        if implementation == "floor":
            self.model.set_attn_implementation(NO_ATTENTION)
        else:
            use_implementation(self.model, implementation)

    def timed(self, implementation: str, **inputs) -> tuple[float, object]:
        self.switch(implementation)
        start = time.perf_counter()
        logits = self.model(**inputs).logits
        return time.perf_counter() - start, logits


def decode_record(runner: Runner, context: int, batch: int, repeats: int, generator) -> dict:
    """Step times (s) of the three at ``context``: favor from a real prefill, softmax from a synthetic cache."""
    from ..cache import cache_argument_name, make_favor_cache

    model = runner.model
    keyword = cache_argument_name(type(model).forward)
    prompt = torch.randint(model.config.vocab_size, (batch, context), generator=generator)
    runner.switch("favor")
    favor_cache = make_favor_cache(model)
    prefill(model, favor_cache, prompt, 0, 1024)
    caches = {"favor": favor_cache, "softmax": synthetic_kv_cache(model, batch, context, generator), "floor": None}
    tokens = {name: prompt[:, -1:] for name in IMPLEMENTATIONS}
    seconds = {name: [] for name in IMPLEMENTATIONS}
    for round_index in range(repeats + 2):  # two warm-up rounds
        position = context + round_index
        for name in IMPLEMENTATIONS:
            inputs = dict(input_ids=tokens[name], position_ids=torch.full((batch, 1), position))
            if caches[name] is not None:
                inputs.update(attention_mask=torch.ones(batch, position + 1, dtype=torch.long), use_cache=True,
                              **{keyword: caches[name]})
            else:
                inputs.update(use_cache=False)
            step, logits = runner.timed(name, **inputs)
            tokens[name] = logits[:, -1].argmax(-1, keepdim=True)
            if round_index >= 2:
                seconds[name].append(step)
    return dict(context=context, batch=batch, seconds=seconds,
                median_ms={name: 1e3 * statistics.median(times) for name, times in seconds.items()},
                mean_ms={name: 1e3 * statistics.mean(times) for name, times in seconds.items()},
                cache_bytes={name: cache_nbytes(caches[name]) for name in ("favor", "softmax")})


def prefill_record(runner: Runner, length: int, repeats: int, generator) -> dict:
    """Seconds of one ``length``-token prompt forward (through its cache) for each of the three."""
    from transformers import DynamicCache

    from ..cache import cache_argument_name, make_favor_cache

    model = runner.model
    keyword = cache_argument_name(type(model).forward)
    prompt = torch.randint(model.config.vocab_size, (1, length), generator=generator)
    seconds = {name: [] for name in IMPLEMENTATIONS}
    for _ in range(repeats):
        for name in IMPLEMENTATIONS:
            inputs = dict(input_ids=prompt, logits_to_keep=1)
            if name == "floor":
                inputs.update(use_cache=False)
            else:
                runner.switch(name)
                cache = make_favor_cache(model) if name == "favor" else DynamicCache(config=model.config)
                inputs.update(use_cache=True, **{keyword: cache})
            seconds[name].append(runner.timed(name, **inputs)[0])
    return dict(length=length, seconds=seconds, median_s={name: statistics.median(t) for name, t in seconds.items()})


def summarize_generation(result: dict) -> dict:
    """Speedups over softmax: the window layers' and the floor's (the most any attention could reach); decode's of the
    mean step (tokens per second), and the window layers' of the median step beside it."""
    rows = {}
    for record in result["decode"]:
        ms, median = record["mean_ms"], record["median_ms"]
        rows[f"decode_context_{record['context']}_batch_{record['batch']}"] = dict(
            favor_speedup=ms["softmax"] / ms["favor"], floor_speedup=ms["softmax"] / ms["floor"],
            favor_median_step_speedup=median["softmax"] / median["favor"],
            attention_share_of_softmax=1 - ms["floor"] / ms["softmax"],
            **({"favor_speedup_by_process": [run["softmax"] / run["favor"] for run in record["process_mean_ms"]]}
               if "process_mean_ms" in record else {}))
    prefill_ = result["prefill"]
    if prefill_ is not None:
        s = prefill_["median_s"]
        rows[f"prefill_{prefill_['length']}"] = dict(
            favor_speedup=s["softmax"] / s["favor"], floor_speedup=s["softmax"] / s["floor"],
            attention_share_of_softmax=1 - s["floor"] / s["softmax"])
    return rows


def run_generation_benchmark(model_path, contexts=DEFAULT_CONTEXTS, batch: int = 1,
                             prefill_length: int = DEFAULT_PREFILL_LENGTH, repeats: int = DEFAULT_REPEATS,
                             prefill_repeats: int = 3, progress: bool = True) -> dict:
    """Decode and prefill of the converted causal LM at ``model_path``: window layers, softmax and no attention in
    turn (module docstring). Returns ``settings``, ``machine``, ``decode`` (one record per context), ``prefill``
    (``None`` when ``prefill_length`` is 0) and ``summary``."""
    if min(contexts) < 1 or batch < 1 or repeats < 1 or prefill_length < 0 or prefill_repeats < 1:
        raise ValueError("contexts, batch, repeats and prefill repeats must be >= 1, the prefill length >= 0")
    start_load = load_average()
    generator = torch.Generator().manual_seed(0)
    runner = Runner(load_converted_causal_lm(model_path))
    with torch.inference_mode():
        decode = []
        for context in contexts:
            decode.append(decode_record(runner, context, batch, repeats, generator))
            if progress:
                print(f"decode {context}: mean " + ", ".join(f"{k} {v:.1f} ms" for k, v in
                                                             decode[-1]["mean_ms"].items()), flush=True)
        prefill_ = prefill_record(runner, prefill_length, prefill_repeats, generator) if prefill_length else None
    result = dict(settings=dict(model=Path(model_path).name, contexts=list(contexts), batch=batch,
                                prefill_length=prefill_length, repeats=repeats, prefill_repeats=prefill_repeats,
                                dtype="float32"),
                  machine=machine_record(start_load), decode=decode, prefill=prefill_)
    result["summary"] = summarize_generation(result)
    return result


def run_generation_benchmark_in_processes(processes: int, **arguments) -> dict:
    """:func:`run_generation_benchmark` in ``processes`` fresh processes: each mean / median step and prefill time
    the median over the runs, the runs' values in ``process_*``."""
    merged = median_of_fresh_processes("hf_performer.bench.generation:run_generation_benchmark", processes,
                                       {"decode": ("mean_ms", "median_ms"), "prefill": ("median_s",)}, ("context",),
                                       **arguments)
    merged["summary"] = summarize_generation(merged)
    return merged


def format_generation_table(result: dict) -> str:
    """The decode and prefill times of the three, with the speedups over softmax."""
    header = " ".join(f"{LABELS[name]:>15}" for name in IMPLEMENTATIONS)
    lines = [f"{'':24} {header} {'speedup':>8} {'floor':>7}"]
    summary = result["summary"]
    for record in result["decode"]:
        row = summary[f"decode_context_{record['context']}_batch_{record['batch']}"]
        lines.append(f"{'decode ' + str(record['context']) + ' (ms/step)':24} "
                     + " ".join(f"{record['mean_ms'][name]:15.1f}" for name in IMPLEMENTATIONS)
                     + f" {row['favor_speedup']:7.2f}x {row['floor_speedup']:6.2f}x")
    if result["prefill"] is not None:
        record = result["prefill"]
        row = summary[f"prefill_{record['length']}"]
        lines.append(f"{'prefill ' + str(record['length']) + ' (s)':24} "
                     + " ".join(f"{record['median_s'][name]:15.3f}" for name in IMPLEMENTATIONS)
                     + f" {row['favor_speedup']:7.2f}x {row['floor_speedup']:6.2f}x")
    processes = result["settings"].get("processes", 1)
    settings = result["settings"]
    lines.append(f"(decode: mean step over {settings['repeats']} rounds, batch {settings['batch']}; "
                 f"speedup = softmax / window layers, floor = softmax / no attention"
                 + (f"; medians of {processes} fresh-process runs" if processes > 1 else "") + ")")
    return "\n".join(lines)


def plot_generation(result: dict, path: Path) -> None:
    """One bar group per decode context and the prefill: the three implementations' times."""
    plt = _pyplot()
    groups = [(f"decode {r['context']}\n(mean ms/step, B={r['batch']})", r["mean_ms"]) for r in result["decode"]]
    if result["prefill"] is not None:
        groups.append((f"prefill {result['prefill']['length']}\n(s)", result["prefill"]["median_s"]))
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 3.6))
    for ax, (title, values) in zip(axes if len(groups) > 1 else [axes], groups):
        bars = ax.bar([LABELS[name] for name in IMPLEMENTATIONS], [values[name] for name in IMPLEMENTATIONS],
                      color=["tab:orange", "tab:blue", "tab:gray"])
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{result['settings']['model']}: window layers, softmax, and no attention work (the floor)",
                 fontsize=10)
    fig.tight_layout()
    _save(plt, fig, path)
