"""Seconds per LoRA training step of a softmax causal LM and its conversions, interleaved in one process.

    python benchmarks/scripts/lora_step_speed.py ../models/smollm2 ../runs/r33/window_g256 ../runs/r33/hybrid \
        --labels softmax window_G256 hedgehog_tail --output-dir benchmarks/results

The first folder is the baseline (normally the softmax source); the others are converted folders
(``hf-performer convert`` / ``linearize``). Each model gets the recipes' LoRA (``r`` 8, alpha 16, the default attention
projections of its architecture) and AdamW on the adapters; one step is what ``hf-performer linearize``'s LoRA stage
runs: the causal-LM loss of ``--batch`` x ``--length`` tokens under bfloat16 autocast (``--precision bf16``, the
default) or float32, its backward and the optimizer step. The models take turns for ``--repeats`` rounds after a
warm-up round (the same random tokens for all); medians, and each model's ratio to the baseline's. Writes
``NAME.json`` and ``NAME.png`` (``--name``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

NAME = "lora_step_smollm2"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("folders", nargs="+", help="causal-LM folders; the first is the baseline")
    parser.add_argument("--labels", nargs="+", help="names of the models (default: the folders' base names)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step (default: %(default)s)")
    parser.add_argument("--length", type=int, default=1024, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--precision", choices=("bf16", "no"), default="bf16",
                        help="bf16: bfloat16 autocast as linearize --mixed-precision bf16 (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (default: %(default)s)")
    parser.add_argument("--output-dir", type=Path, default=None, help="write NAME.json / NAME.png here")
    parser.add_argument("--name", default=NAME, help="file stem of the outputs (default: %(default)s)")
    args = parser.parse_args(argv)
    if len(args.folders) < 2:
        parser.error("give the baseline folder and at least one converted folder")
    args.labels = args.labels or [Path(folder).name for folder in args.folders]
    if len(args.labels) != len(args.folders) or len(set(args.labels)) != len(args.labels):
        parser.error(f"--labels must name each of the {len(args.folders)} folders once, got {args.labels}")
    if min(args.batch, args.length, args.repeats) < 1:
        parser.error("--batch, --length and --repeats must be >= 1")
    for folder in args.folders:
        if not (Path(folder) / "config.json").is_file():
            parser.error(f"{folder} is not a model folder (no config.json)")
    return args


def attention_of(model) -> str:
    """What a model's attention is: ``softmax (sdpa)`` or the converted settings that matter for speed."""
    config = model.config
    if config.model_type != "performer":
        return f"softmax ({config._attn_implementation})"
    settings = config.resolved_favor_settings
    parts = [f"window {settings.get('window')}", f"{settings.get('sinks')} sinks"]
    if settings.get("sparse_cache"):
        parts.append(f"sparse cache {settings['sparse_cache']}")
    parts.append(f"{settings.get('feature_map')} tail" if settings.get("linear_tail", True) else "no tail")
    return ", ".join(parts)


class LoraStep:
    """One model with the recipes' LoRA adapters and an AdamW optimizer over them."""

    def __init__(self, folder: str, precision: str):
        import torch
        from peft import LoraConfig, TaskType, get_peft_model
        from transformers import AutoModelForCausalLM

        from hf_performer import modeling_performer  # noqa: F401  (the Performer classes in the Auto classes)
        from hf_performer.recipes.arguments import LORA_TARGET_MODULES

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.attention = attention_of(model)
        config = model.config
        model_type = config.source_config.model_type if config.model_type == "performer" else config.model_type
        targets = LORA_TARGET_MODULES[model_type]
        self.model = get_peft_model(model, LoraConfig(task_type=TaskType.CAUSAL_LM, r=8, lora_alpha=16,
                                                      lora_dropout=0.0, target_modules=targets)).train()
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=1e-4)
        self.precision, self.torch = precision, torch

    def __call__(self, tokens) -> float:
        torch = self.torch
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.precision == "bf16"):
            loss = self.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start


def plot(result: dict, path: Path) -> None:
    from hf_performer.bench.report import plot_median_bars

    records, settings = result["records"], result["settings"]
    plot_median_bars(path, [r["label"] for r in records], [r["median_s"] for r in records],
                     [r["ratio_to_baseline"] for r in records],
                     ["tab:blue"] + ["tab:orange"] * (len(records) - 1), ylabel="seconds per LoRA step (median)",
                     title=f"LoRA step, {settings['batch']} x {settings['length']} tokens, {settings['precision']}",
                     width=1.8 + 1.6 * len(records))


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from hf_performer.bench.machine import load_average, machine_record
    from hf_performer.bench.report import recorded_path, write_result

    start_load = load_average()
    steps = [LoraStep(folder, args.precision) for folder in args.folders]
    vocab = min(step.model.config.vocab_size for step in steps)
    tokens = torch.randint(vocab, (args.batch, args.length), generator=torch.Generator().manual_seed(0))
    seconds = [[] for _ in steps]
    for round_index in range(args.repeats + 1):  # a warm-up round
        for step, times in zip(steps, seconds):
            elapsed = step(tokens)
            if round_index:
                times.append(elapsed)
        print(f"round {round_index}: " + ", ".join(f"{label} {times[-1]:.2f} s" if times else f"{label} warm-up"
                                                   for label, times in zip(args.labels, seconds)), flush=True)
    baseline = statistics.median(seconds[0])
    records = [dict(label=label, folder=Path(folder).name, attention=step.attention, seconds=times,
                    median_s=statistics.median(times), ratio_to_baseline=statistics.median(times) / baseline)
               for label, folder, step, times in zip(args.labels, args.folders, steps, seconds)]
    arguments = " ".join(argv if argv is not None else sys.argv[1:])
    for folder in args.folders:  # no local paths in the record: the folders' base names
        arguments = arguments.replace(str(Path(folder).parent) + "/", "")
    if args.output_dir is not None:
        arguments = arguments.replace(str(args.output_dir), recorded_path(args.output_dir))
    result = dict(
        command=f"python benchmarks/scripts/lora_step_speed.py {arguments}",
        settings=dict(batch=args.batch, length=args.length, precision=args.precision, repeats=args.repeats,
                      lora=dict(r=8, alpha=16, optimizer="AdamW", learning_rate=1e-4)),
        machine=machine_record(start_load),
        records=records)
    for record in records:
        print(f"{record['label']} ({record['attention']}): {record['median_s']:.2f} s per step, "
              f"{record['ratio_to_baseline']:.2f}x {args.labels[0]}")
    for path in write_result(result, args.output_dir, args.name, plot):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
