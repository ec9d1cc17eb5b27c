"""Seconds of a training forward + backward on one packed row of sequences of mixed lengths: a converted causal LM's
window layers with the packed sequences grouped by length, the same with every sequence padded to the longest (the
way before the grouping), and softmax on the same row; interleaved in one process.

    python benchmarks/scripts/packed_window_speed.py ../models/smollm2 smollm2-window64-g256 \
        --output-dir benchmarks/results

The first folder is the softmax source, the second a converted folder with window layers (``hf-performer convert
... --window 64 --sinks 4 --sparse-cache 256 --no-tail``). The row is what ``DataCollatorWithFlattening``
makes of random sequences of ``--lengths`` tokens (``position_ids`` restarting at each: the window layers run each
sequence as its own row, :class:`hf_performer.packed_sequences.SegmentRows`); one step is the causal-LM loss under
bfloat16 autocast (``--precision bf16``, the default) or float32 and its backward (every parameter trained). Medians
over ``--repeats`` rounds after a warm-up round. Writes ``NAME.json`` and ``NAME.png`` (``--name``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

NAME = "packed_window_speed_smollm2"
ARMS = ("softmax", "window, grouped by length", "window, one group (padded to the longest)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("softmax", help="the softmax causal-LM folder (the source)")
    parser.add_argument("converted", help="a converted folder of the same model with window layers")
    parser.add_argument("--lengths", default="1024,384,256,192,128,96,64,48",
                        help="tokens of each packed sequence (default: %(default)s)")
    parser.add_argument("--precision", choices=("bf16", "no"), default="bf16",
                        help="bf16: bfloat16 autocast, as linearize --mixed-precision bf16 (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default: %(default)s)")
    parser.add_argument("--output-dir", type=Path, default=None, help="write NAME.json / NAME.png here")
    parser.add_argument("--name", default=NAME, help="file stem of the outputs (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        args.lengths = [int(part) for part in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths must be comma-separated ints, got {args.lengths!r}")
    if min(args.lengths) < 2 or args.repeats < 1:
        parser.error("--lengths must be >= 2 tokens each, --repeats >= 1")
    for folder in (args.softmax, args.converted):
        if not (Path(folder) / "config.json").is_file():
            parser.error(f"{folder} is not a model folder (no config.json)")
    return args


def packed_row(lengths: list[int], vocab: int) -> dict:
    """``DataCollatorWithFlattening``'s batch of random sequences of ``lengths`` tokens."""
    import torch
    from transformers import DataCollatorWithFlattening

    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(vocab, (n,), generator=generator).tolist() for n in lengths]
    return DataCollatorWithFlattening()([{"input_ids": sequence} for sequence in sequences])


def step_seconds(model, batch: dict, precision: str) -> float:
    import torch

    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                     use_cache=False).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def plot(result: dict, path: Path) -> None:
    from hf_performer.bench.report import plot_median_bars

    records, settings = result["records"], result["settings"]
    plot_median_bars(path, [r["arm"].replace(", ", ",\n") for r in records], [r["median_s"] for r in records],
                     [r["ratio_to_softmax"] for r in records], ["tab:blue", "tab:orange", "tab:gray"],
                     ylabel="seconds per forward + backward (median)",
                     title=f"one packed row of {len(settings['lengths'])} sequences, {sum(settings['lengths'])} "
                           f"tokens, {settings['precision']}", width=7)


def main(argv=None) -> int:
    args = parse_args(argv)
    import functools

    import torch
    from transformers import AutoModelForCausalLM

    from hf_performer import favor_attention, modeling_performer  # noqa: F401  (modeling: Performer classes in the Auto classes)
    from hf_performer.bench.machine import load_average, machine_record
    from hf_performer.bench.report import recorded_path, write_result
    from hf_performer.packed_sequences import GROUP_PADDING, SegmentRows

    start_load = load_average()
    models = [AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
              for folder in (args.softmax, args.converted)]
    batch = packed_row(args.lengths, min(model.config.vocab_size for model in models))
    one_group = functools.partial(SegmentRows, max_padding=None)
    arms = {ARMS[0]: (models[0], SegmentRows), ARMS[1]: (models[1], SegmentRows), ARMS[2]: (models[1], one_group)}
    seconds = {arm: [] for arm in arms}
    for round_index in range(args.repeats + 1):  # a warm-up round
        for arm, (model, rows) in arms.items():
            favor_attention.SegmentRows = rows
            elapsed = step_seconds(model, batch, args.precision)
            if round_index:
                seconds[arm].append(elapsed)
        favor_attention.SegmentRows = SegmentRows
        print(f"round {round_index}: " + ", ".join(f"{arm} {times[-1]:.2f} s" if times else f"{arm} warm-up"
                                                   for arm, times in seconds.items()), flush=True)
    baseline = statistics.median(seconds[ARMS[0]])
    records = [dict(arm=arm, seconds=times, median_s=statistics.median(times),
                    ratio_to_softmax=statistics.median(times) / baseline) for arm, times in seconds.items()]
    padded = len(args.lengths) * max(args.lengths)
    segment_ids = torch.repeat_interleave(torch.arange(1, len(args.lengths) + 1), torch.tensor(args.lengths))[None]
    grouped = SegmentRows(segment_ids)
    grouped_positions = sum(len(group) * length for group, length in zip(grouped.groups, grouped.lengths))
    result = dict(
        command=f"python benchmarks/scripts/packed_window_speed.py {Path(args.softmax).name} "
                f"{Path(args.converted).name} --lengths {','.join(map(str, args.lengths))} "
                f"--precision {args.precision} --repeats {args.repeats}"
                + (f" --output-dir {recorded_path(args.output_dir)} --name {args.name}" if args.output_dir else ""),
        settings=dict(lengths=args.lengths, tokens=sum(args.lengths), precision=args.precision,
                      repeats=args.repeats, group_padding=GROUP_PADDING,
                      window_positions=dict(grouped=grouped_positions, one_group=padded),
                      groups=[[args.lengths[i] for i in group] for group in grouped.groups]),
        machine=machine_record(start_load),
        records=records)
    for record in records:
        print(f"{record['arm']}: {record['median_s']:.2f} s, {record['ratio_to_softmax']:.2f}x softmax")
    print(f"positions the window layers compute: {grouped_positions} grouped, {padded} in one group, "
          f"{sum(args.lengths)} tokens")
    for path in write_result(result, args.output_dir, args.name, plot):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
