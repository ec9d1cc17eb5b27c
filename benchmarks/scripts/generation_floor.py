"""How much faster than softmax any attention could make generation: a converted causal LM's decode step and prompt
prefill with its window layers, with softmax (sdpa + DynamicCache), and with no attention work at all.

    python benchmarks/scripts/generation_floor.py ../runs/dec/smollm2-window --output-dir benchmarks/results

The folder is the one ``hf-performer convert SRC OUT --window W --sinks S`` writes (benchmarks/README.md uses
SmolLM2-135M). In one process, one model, the three implementations take turns:

* ``favor``: its window layers with their constant-size cache (``make_favor_cache``); decode contexts are reached by
  a real chunked prefill through that cache;
* ``softmax``: ``sdpa`` with transformers' ``DynamicCache`` (synthetic keys / values at decode contexts, as
  ``hf-performer bench decode``);
* ``floor``: an attention function that returns zeros and no cache: the embeddings, projections, MLPs, norms, rotary
  and LM head alone. No attention implementation is faster than this, so ``softmax / floor`` is the largest speedup
  over softmax that attention work can buy on this model and machine.

Decode: one greedy step of ``--batch`` sequences at each ``--contexts`` length, the three in turn for ``--repeats``
consecutive rounds after a warm-up (and the bytes the window layers' cache and softmax's hold after them). The
default, 64 rounds, is one selection cycle of the sparse cache (a window layer selects once every ``chunk_size`` =
64 tokens, and that step costs more): the mean step is what ``generate()``'s tokens per second see, the median the
typical step; both are recorded, the speedups are of the means. Prefill: one forward of a ``--prefill-length``
prompt (``logits_to_keep=1``, through the cache), the three in turn, medians. Writes ``NAME.json`` and ``NAME.png``
(``--name``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

NAME = "generation_floor_smollm2"
NO_ATTENTION = "no_attention"
IMPLEMENTATIONS = ("favor", "softmax", "floor")
LABELS = {"favor": "window layers", "softmax": "softmax (sdpa)", "floor": "no attention"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("model", help="a converted causal-LM folder with window layers")
    parser.add_argument("--contexts", default="512,16384", help="decode context lengths (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=1, help="decode batch (default: %(default)s)")
    parser.add_argument("--prefill-length", type=int, default=4096,
                        help="prompt tokens (default: %(default)s; 0: none)")
    parser.add_argument("--repeats", type=int, default=64,
                        help="consecutive decode rounds (default: %(default)s, one selection cycle)")
    parser.add_argument("--prefill-repeats", type=int, default=3, help="prefill rounds (default: %(default)s)")
    parser.add_argument("--output-dir", type=Path, default=None, help="write NAME.json / NAME.png here")
    parser.add_argument("--name", default=NAME, help="file stem of the outputs (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        args.contexts = [int(part) for part in args.contexts.split(",")]
    except ValueError:
        parser.error(f"--contexts must be comma-separated ints, got {args.contexts!r}")
    if min(args.contexts) < 1 or args.batch < 1 or args.repeats < 1 or args.prefill_length < 0:
        parser.error("--contexts, --batch and --repeats must be >= 1, --prefill-length >= 0")
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"{args.model} is not a model folder (no config.json)")
    return args


def _no_attention(module, query, key, value, attention_mask, **kwargs):
    """``[B, L, H, dv]`` zeros: the layer's output projection still runs, no attention work or cache is done."""
    import torch

    return torch.zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1], dtype=query.dtype), None


class Runner:
    """The model under the three implementations; each call switches before the clock starts."""

    def __init__(self, model):
        import torch
        from transformers import AttentionInterface

        from hf_performer.bench.decode import use_implementation

        AttentionInterface.register(NO_ATTENTION, _no_attention)
        self.model, self.torch, self.use = model, torch, use_implementation

    def switch(self, implementation: str) -> None:
        if implementation == "floor":
            self.model.set_attn_implementation(NO_ATTENTION)
        else:
            self.use(self.model, implementation)

    def timed(self, implementation: str, **inputs) -> tuple[float, object]:
        self.switch(implementation)
        start = time.perf_counter()
        logits = self.model(**inputs).logits
        return time.perf_counter() - start, logits


def decode_record(runner, context: int, batch: int, repeats: int, generator) -> dict:
    """Step times (s) of the three at ``context``: favor from a real prefill, softmax from a synthetic cache."""
    from hf_performer.bench.decode import cache_nbytes
    from hf_performer.bench.decode_converted import prefill, synthetic_kv_cache
    from hf_performer.cache import cache_argument_name, make_favor_cache

    torch, model = runner.torch, runner.model
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


def prefill_record(runner, length: int, repeats: int, generator) -> dict:
    """Seconds of one ``length``-token prompt forward (through its cache) for each of the three."""
    from transformers import DynamicCache

    from hf_performer.cache import cache_argument_name, make_favor_cache

    torch, model = runner.torch, runner.model
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


def summary(decode: list[dict], prefill: dict | None) -> dict:
    """Speedups over softmax: the window layers' and the floor's (the most any attention could reach); decode's of the
    mean step (tokens per second), and the window layers' of the median step beside it."""
    rows = {}
    for record in decode:
        ms, median = record["mean_ms"], record["median_ms"]
        rows[f"decode_context_{record['context']}_batch_{record['batch']}"] = dict(
            favor_speedup=ms["softmax"] / ms["favor"], floor_speedup=ms["softmax"] / ms["floor"],
            favor_median_step_speedup=median["softmax"] / median["favor"],
            attention_share_of_softmax=1 - ms["floor"] / ms["softmax"])
    if prefill is not None:
        s = prefill["median_s"]
        rows[f"prefill_{prefill['length']}"] = dict(
            favor_speedup=s["softmax"] / s["favor"], floor_speedup=s["softmax"] / s["floor"],
            attention_share_of_softmax=1 - s["floor"] / s["softmax"])
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from hf_performer.bench.decode_converted import load_converted_causal_lm
    from hf_performer.bench.machine import load_average, machine_record
    from hf_performer.bench.report import recorded_path, write_result

    start_load = load_average()
    generator = torch.Generator().manual_seed(0)
    model = load_converted_causal_lm(args.model)
    runner = Runner(model)
    with torch.inference_mode():
        decode = []
        for context in args.contexts:
            decode.append(decode_record(runner, context, args.batch, args.repeats, generator))
            print(f"decode {context}: mean " + ", ".join(f"{k} {v:.1f} ms" for k, v in decode[-1]["mean_ms"].items()),
                  flush=True)
        prefill = None
        if args.prefill_length:
            prefill = prefill_record(runner, args.prefill_length, args.prefill_repeats, generator)
            print(f"prefill {args.prefill_length}: " + ", ".join(f"{k} {v:.2f} s" for k, v in
                                                                 prefill["median_s"].items()), flush=True)
    arguments = " ".join(argv if argv is not None else sys.argv[1:]).replace(str(Path(args.model)),
                                                                            Path(args.model).name)
    if args.output_dir is not None:
        arguments = arguments.replace(str(args.output_dir), recorded_path(args.output_dir))
    result = dict(
        command=f"python benchmarks/scripts/generation_floor.py {arguments}",
        settings=dict(model=Path(args.model).name, contexts=args.contexts, batch=args.batch,
                      prefill_length=args.prefill_length, repeats=args.repeats, prefill_repeats=args.prefill_repeats,
                      dtype="float32"),
        machine=machine_record(start_load),
        decode=decode, prefill=prefill, summary=summary(decode, prefill))
    for key, row in result["summary"].items():
        print(f"{key}: window layers {row['favor_speedup']:.2f}x softmax, no attention {row['floor_speedup']:.2f}x")
    for path in write_result(result, args.output_dir, args.name, plot):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
