"""``hf-performer linearize``: turn a causal LM into a sink + sliding-window softmax model with a learned linear tail,
trained as LoLCATs: convert -> attention transfer of the tail -> LoRA -> evaluation, in one resumable run.

    hf-performer linearize SOURCE OUTPUT --train-file wiki.valid.raw --eval-file wiki.test.raw
    hf-performer linearize SOURCE OUTPUT-softmax --baseline softmax --train-file ... --eval-file ...   # same LoRA budget
    hf-performer linearize SOURCE OUTPUT-window --no-tail --train-file ... --eval-file ...             # the ablation

Stages (recipes/README.md, "Linearize a causal LM"):
  convert   window settings (--window, --sinks), a learned map (hedgehog) from the identity, separate q / k maps
  transfer  only the maps and gamma train: 1000 x MSE of each layer's attention output against exact softmax, every
            layer fed the teacher's hidden states (--transfer-*); skipped with --no-tail / --baseline
  select    with --softmax-worst K: the K layers the tail fits worst (transfer loss) go back to exact softmax;
            with --cache-budget SIZE: each window layer gets the sparse cache (or softmax) the budget buys best
  lora      PEFT LoRA on the attention projections (maps and gamma frozen) on packed --block-size blocks, merged
  evaluate  perplexity on --eval-file: windows of --eval-context tokens every --eval-context / 2

SOURCE is a model folder or a .gguf file (de-quantized to float32 once, in the staging area). Before any stage the
source (a causal LM), the data (readable, UTF-8, not empty, JSON lines with 'text'; the evaluation file is not the
training text) and the sizes are checked; after the convert stage the run's time on this machine is estimated from
one timed step and printed.

OUTPUT gets the model folder (loads with trust_remote_code=True), its tokenizer, README.md and linearize.json (every
stage's settings, tokens, wall time, losses, the perplexity, a curve against tokens seen, the estimate). Stages are
recorded in the staging area .OUTPUT.linearize beside OUTPUT: rerunning the same command after an interruption
continues from the last finished stage (and the LoRA stage from its last checkpoint); --overwrite starts over. The
LoRA stage runs the recipes' Accelerate loop: `accelerate launch -m hf_performer.cli linearize ...` works as for the
recipes.

Sizes: the defaults are the full protocol (200 transfer and 200 LoRA steps of 8 x 1024 tokens, 200,000 evaluation
characters: hours on a 2-core CPU); the LoRA stage runs them as micro-batches of 1 x 1024 tokens accumulated 8 times,
which fits 24 GiB (8 x 1024 at once was killed at 17 GB on SmolLM2-135M). --preset cpu is the protocol of the
committed SmolLM2-135M runs: 120 transfer steps of 2 x 1024 tokens, 40 LoRA steps of 2 x 1024, 50,000 evaluation
characters (about 35 min there); flags given explicitly override a preset.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from . import add_verb_parser
from ._output import check_output_folder, staged_folder
from ..favor_schema import LEARNED_MAP_INITS
from .arguments import add_favor_arguments

STAGING_SUFFIX = ".linearize"
"""The staging area of OUTPUT is the hidden folder ``.NAME.linearize`` beside it."""

CONVERSION_FLAGS = ("feature_map", "nb_features", "feature_map_init", "window", "sinks", "sparse_cache",
                    "sparse_cache_selection", "sparse_cache_span", "tail_cap",
                    "tail_gate", "no_tail",
                    "softmax_layers",
                    "softmax_worst", "cache_budget", "budget_context", "transfer_steps", "transfer_length",
                    "transfer_batch_size", "transfer_learning_rate", "transfer_schedule")
"""Flags that --baseline softmax (no conversion, no transfer) refuses."""

DEFAULTS = {"feature_map": "hedgehog", "feature_map_init": "identity", "window": 64, "sinks": 4, "sparse_cache": 0,
            "sparse_cache_selection": "recall", "sparse_cache_span": 1,
            "transfer_steps": 200,
            "transfer_length": 1024, "transfer_batch_size": 8, "transfer_learning_rate": 1e-2,
            "transfer_schedule": "constant", "softmax_layers": [], "softmax_worst": 0, "cache_budget": None,
            "budget_context": 16384, "lora_steps": 200,
            "batch_size": 1, "gradient_accumulation_steps": 8, "max_eval_chars": 200_000}
"""The value of every flag whose parser default is ``None`` (so that a preset can tell a given flag from an unset one)."""

PRESETS = {
    "cpu": {"transfer_steps": 120, "transfer_batch_size": 2, "lora_steps": 40, "batch_size": 1,
            "gradient_accumulation_steps": 2, "max_eval_chars": 50_000},
}
"""``--preset NAME``: values for the flags not given. ``cpu``: the committed SmolLM2-135M protocol on a 2-core, 24 GiB
CPU (benchmarks/results/window_hybrid_smollm2.json: 1,876 s of training for the hybrid)."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``linearize`` subcommand to ``subparsers``."""
    parser = add_verb_parser(subparsers, "linearize", __doc__)
    parser.add_argument("source", metavar="SOURCE", help="folder (or offline Hub name) of the softmax causal LM")
    parser.add_argument("output", metavar="OUTPUT", help="folder to write the linearized model to")
    data = parser.add_argument_group("data")
    data.add_argument("--train-file", action="append", required=True, metavar="FILE",
                      help="training text (raw text, or JSON lines with a 'text' field; .gz ok); repeat for several "
                           "files, read in order; never the evaluation split")
    data.add_argument("--max-train-chars", type=int, default=None, metavar="N",
                      help="use the first N characters of the training text (default: all)")
    data.add_argument("--eval-file", default=None, metavar="FILE", help="evaluation text (default: no evaluation)")
    data.add_argument("--eval-context", type=int, default=1024, help="perplexity window in tokens (default: 1024)")
    data.add_argument("--max-eval-chars", type=int, default=None,
                      help="evaluate on the first N characters of --eval-file (default: 200000; --preset cpu: 50000)")
    data.add_argument("--eval-batch-size", type=int, default=2, help="windows per forward pass (default: 2)")

    hybrid = parser.add_argument_group("conversion and attention transfer (not with --baseline)")
    add_favor_arguments(hybrid, ("feature_map", "nb_features", "window", "sinks", "sparse_cache",
                                 "sparse_cache_selection", "sparse_cache_span", "tail_cap", "tail_gate"), helps={
        "feature_map": "learned feature map of the tail (default: hedgehog, identity init, separate q / k maps)",
        "nb_features": "features per head (default: the map's own, 2 x head_dim for hedgehog)",
        "window": "exact-softmax keys per query: the last W tokens (default: 64)",
        "sinks": "first unpadded tokens of each row always attended exactly (default: 4)",
        "sparse_cache": "per key head, up to G older tokens stay exact, the ones the tail would recall worst (a "
                        "constant-size cache of hard keys; default: 0)",
        "sparse_cache_selection": "how the sparse cache chooses: recall (the tokens the tail would recall worst; "
                                  "without a tail, the farthest from the mean value) or attention (the ones the "
                                  "boundary's query attends to most, H2O / TOVA-style; default: recall)",
        "sparse_cache_span": "odd; rank each candidate by its score averaged over S neighbouring candidates, so that "
                             "whole spans stay rather than their sharpest keys (default: 1, each token on its own)",
        "tail_cap": "a query whose tail holds n > N tokens weighs it by N / n, so that contexts longer than training "
                    "never weigh the tail more than training did (0 = unbounded; default: the most tokens a tail "
                    "held at the training length)",
        "tail_gate": "a learned exponent alpha per head weighs a tail of n tokens by n ** -alpha, trained by the "
                     "attention transfer (default: off)",
    })
    hybrid.add_argument("--feature-map-init", choices=LEARNED_MAP_INITS, default=None,
                        help="the learned map's starting projection: identity (default; needs --nb-features 2 x "
                             "head_dim, the default) or favor+ (orthogonal random, any --nb-features)")
    hybrid.add_argument("--no-tail", action="store_true", default=None,
                        help="the ablation: sinks + window exact softmax only, no linear tail (no transfer stage)")
    hybrid.add_argument("--softmax-layers", type=int, nargs="+", default=None, metavar="LAYER",
                        help="layers kept on exact softmax attention (a growing key/value cache each; default: none)")
    hybrid.add_argument("--softmax-worst", type=int, default=None, metavar="K",
                        help="after the transfer, put the K layers with the largest transfer loss back on exact "
                             "softmax (the select stage; default: 0)")
    hybrid.add_argument("--cache-budget", default=None, metavar="SIZE",
                        help="after the transfer, give each window layer the sparse cache (or exact softmax) that "
                             "this decoding state per sequence buys best, measured (the select stage): bytes with a "
                             "unit (16MiB) or softmax tokens (2048tokens); see hf-performer budget")
    hybrid.add_argument("--budget-context", type=int, default=None, metavar="TOKENS",
                        help="context length --cache-budget holds at (default: 16384)")
    hybrid.add_argument("--transfer-steps", type=int, default=None, help="optimizer steps, 0 = skip (default: 200)")
    hybrid.add_argument("--transfer-length", type=int, default=None, help="tokens per sequence (default: 1024)")
    hybrid.add_argument("--transfer-batch-size", type=int, default=None, help="sequences per step (default: 8)")
    hybrid.add_argument("--transfer-learning-rate", type=float, default=None, help="AdamW peak rate (default: 1e-2)")
    hybrid.add_argument("--transfer-schedule", choices=("constant", "cosine"), default=None,
                        help="learning rate over the transfer steps: constant, or cosine decay to 0 (default: "
                             "constant)")

    lora = parser.add_argument_group("LoRA fine-tuning (the recipes' loop)")
    lora.add_argument("--lora-steps", type=int, default=None,
                      help="optimizer steps, 0 = skip (default: 200; --preset cpu: 40)")
    lora.add_argument("--block-size", type=int, default=1024, help="tokens per training block (default: 1024)")
    lora.add_argument("--batch-size", type=int, default=None,
                      help="blocks per micro-batch (default: 1, accumulated --gradient-accumulation-steps times)")
    lora.add_argument("--gradient-accumulation-steps", type=int, default=None,
                      help="micro-batches per optimizer step (default: 8, i.e. 8 x 1024 tokens per step; --preset "
                           "cpu: 2)")
    lora.add_argument("--learning-rate", type=float, default=1e-4,
                      help="peak learning rate, linear decay after 6%% warmup (default: 1e-4)")
    lora.add_argument("--lora-r", type=int, default=8, help="LoRA rank (default: 8)")
    lora.add_argument("--lora-alpha", type=int, default=16, help="LoRA alpha (default: 16)")
    lora.add_argument("--lora-target-modules", nargs="+", default=None,
                      help="modules to adapt (default: the attention projections, Llama: q_proj k_proj v_proj o_proj)")
    lora.add_argument("--teacher-weight", type=float, default=None, metavar="W",
                      help="a teacher (the source model unless --teacher-model) teaches the LoRA stage: W x the "
                           "T^2 KL (T = 2) between its and the model's next-token distributions, added to the "
                           "language-modelling loss (default: off)")
    lora.add_argument("--teacher-model", default=None, metavar="DIR",
                      help="the teacher of --teacher-weight instead of the source model, e.g. the softmax model "
                           "after the same LoRA stage (linearize --baseline softmax); same tokenizer")
    lora.add_argument("--window-dropout", type=float, default=0.0, metavar="P",
                      help="scheduled sliding-window dropout in the LoRA stage: each window layer attends to its sinks "
                           "and tail only with probability p at each step, p decaying linearly from P to 0 "
                           "(arXiv 2510.05901; a hybrid with a tail; default: 0, off)")
    lora.add_argument("--checkpointing-steps", type=int, default=None,
                      help="LoRA checkpoint every N steps, for resuming (default: a quarter of --lora-steps)")

    run = parser.add_argument_group("run")
    run.add_argument("--preset", choices=tuple(PRESETS), default=None,
                     help="cpu: sizes for a 2-core, 24 GiB CPU (120 transfer steps of 2 x 1024 tokens, 40 LoRA steps "
                          "of 2 x 1024, 50,000 evaluation characters; about 35 min for SmolLM2-135M); explicit flags "
                          "override it")
    run.add_argument("--baseline", choices=("softmax",), default=None,
                     help="the fair baseline: no conversion or transfer, the same LoRA stage and evaluation on the "
                          "softmax model")
    run.add_argument("--seed", type=int, default=0, help="seed of the conversion, data order and training (default: 0)")
    run.add_argument("--mixed-precision", choices=("no", "bf16"), default="no",
                     help="bf16: both training stages under bfloat16 autocast (about 2x faster on CPUs with bf16 "
                          "instructions; attention operators and feature maps stay float32, weights and evaluation "
                          "too); default: no")
    run.add_argument("--time-limit", type=float, default=None, metavar="MINUTES",
                     help="stop the training stages after MINUTES in all (the record says the steps done and why)")
    run.add_argument("--overwrite", action="store_true",
                     help="start over: replace OUTPUT and discard an interrupted run's staging area")
    run.add_argument("--stop-after", choices=("convert", "transfer", "select", "lora"), default=None,
                     metavar="STAGE",
                     help="stop once STAGE (convert, transfer, select or lora) is finished, keeping its model in the "
                          "staging area (.OUTPUT.linearize/converted, transferred, selected or lora) for a look; rerun "
                          "the same command without it to continue")
    run.add_argument("--no-progress", action="store_true",
                     help="no progress bars (transformers' loading / writing bars included)")
    parser.set_defaults(func=run_linearize_command)
    return parser


def settings_from_args(args: argparse.Namespace):
    """:class:`~hf_performer.recipes.linearize.LinearizeSettings` of the parsed flags (one-line errors for flags that
    do not fit together)."""
    from ..recipes.linearize import LinearizeSettings

    if args.baseline:
        given = [name for name in CONVERSION_FLAGS if getattr(args, name) is not None]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise SystemExit(f"hf-performer linearize: error: --baseline softmax trains the softmax model without "
                             f"conversion or transfer; it takes no {flags}")
    if args.no_tail:
        given = [name for name in ("feature_map", "nb_features", "feature_map_init", "tail_cap", "tail_gate",
                                   "transfer_steps", "transfer_length", "transfer_batch_size",
                                   "transfer_learning_rate", "transfer_schedule") if getattr(args, name) is not None]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise SystemExit(f"hf-performer linearize: error: {flags} would be ignored: --no-tail has no linear tail "
                             f"(no feature map, no transfer stage); drop {'it' if len(given) == 1 else 'them'}")
    preset = PRESETS.get(getattr(args, "preset", None), {})
    values = {name: getattr(args, name) if getattr(args, name) is not None else preset.get(name, DEFAULTS[name])
              for name in DEFAULTS}
    values["softmax_layers"] = sorted(set(values["softmax_layers"]))
    return LinearizeSettings(
        source=args.source, train_files=list(args.train_file), max_train_chars=args.max_train_chars,
        nb_features=args.nb_features, tail_cap=args.tail_cap, tail_gate=bool(args.tail_gate),
        linear_tail=not args.no_tail,
        block_size=args.block_size, learning_rate=args.learning_rate,
        lora_r=args.lora_r, lora_alpha=args.lora_alpha, lora_target_modules=args.lora_target_modules,
        teacher_weight=args.teacher_weight, teacher_model=args.teacher_model, window_dropout=args.window_dropout,
        eval_file=args.eval_file, eval_context=args.eval_context,
        eval_batch_size=args.eval_batch_size, baseline=args.baseline, seed=args.seed,
        mixed_precision=args.mixed_precision, time_limit=args.time_limit,
        progress=not args.no_progress, checkpoint_every=args.checkpointing_steps, **values,
    )


def staging_area_of(output: str) -> str:
    """The staging area of OUTPUT: ``.NAME.linearize`` in the same folder."""
    parent, name = os.path.split(os.path.abspath(output))
    return os.path.join(parent, f".{name}{STAGING_SUFFIX}")


def run_linearize_command(args: argparse.Namespace, stop_after: str | None = None) -> int:
    """Run ``hf-performer linearize`` (see :func:`add_parser`). Returns the exit status."""
    from ..recipes.arguments import RecipeError
    from ..recipes.linearize import LINEARIZE_FILE, run_linearize
    from ..recipes.results import portable_name
    from ..tasks.data import DataError

    settings = settings_from_args(args)
    if args.no_progress:  # transformers' own bars too (loading and writing weights at every stage)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    stop_after = stop_after or args.stop_after
    try:
        settings.check()
    except RecipeError as error:
        raise SystemExit(f"hf-performer linearize: error: {error}") from None
    output = check_output_folder(args.output, args.overwrite, "linearize", source=args.source)
    staging = staging_area_of(output)
    if args.overwrite and os.path.isdir(staging):
        shutil.rmtree(staging)
    command = " ".join(portable_name(a) if os.path.isabs(a) or os.path.exists(a) else a for a in sys.argv[1:])
    try:
        record = run_linearize(settings, staging, stop_after=stop_after,
                               command=f"hf-performer {command}" if sys.argv[1:2] == ["linearize"] else None,
                               model_name=os.path.basename(output))
    except (RecipeError, DataError) as error:
        raise SystemExit(f"hf-performer linearize: error: {error}") from None
    except KeyboardInterrupt:
        if os.path.isdir(staging):
            print(f"linearize: interrupted; rerun the same command to resume from the last finished stage (the LoRA "
                  f"stage from its last checkpoint, every {settings.checkpoint_interval} steps), or pass --overwrite to "
                  "start over", file=sys.stderr)
        raise
    if record is None:
        from accelerate import PartialState

        if not PartialState().is_main_process:
            return 0
        from ..recipes.linearize import STAGE_FOLDERS

        kept = os.path.join(staging, STAGE_FOLDERS[stop_after])
        where = f" (its model: {kept})" if os.path.isdir(kept) else ""
        print(f"linearize: stopped after stage {stop_after}{where}; rerun the same command to continue")
        return 0
    with staged_folder(output) as folder:
        final = os.path.join(staging, "final")
        for name in os.listdir(final):
            os.replace(os.path.join(final, name), os.path.join(folder, name))
    shutil.rmtree(staging)
    ppl = record["perplexity"]
    print(f"linearize: wrote {output} ({LINEARIZE_FILE}: perplexity "
          f"{'not evaluated' if ppl is None else f'{ppl:.3f}'}, {record['tokens_seen']} training tokens, "
          f"{record['wall_time_s']:.1f} s)")
    return 0
