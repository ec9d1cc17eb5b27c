"""``hf-performer budget``: give a trained window hybrid the per-layer sparse caches (and softmax layers) that one
decoding-memory budget buys best (the library: :mod:`hf_performer.conversion.cache_budget`)."""

from __future__ import annotations

import argparse
import os
import sys

from . import add_verb_parser
from ._output import check_output_folder, write_reconfigured_model

CLI_DESCRIPTION = """Spend one decoding-memory budget where a window hybrid needs exact memory.

  hf-performer budget MODEL OUTPUT --cache-budget 16MiB --context 16384 \\
      --text-file ../shared/data/wikitext-2-raw/wiki.valid.raw

For every causal window layer and every --cache-sizes G, what keeping G hard keys costs is measured on
--sequences x --length tokens of --text-file: by default (--metric loss) the rise of the model's next-token loss when
only that layer keeps G keys and the others run exact softmax (what a dropped token costs the layers after it too); with
--metric error the layer's attention output error against exact softmax (teacher forcing). Then one option per layer
(a sparse cache of G hard keys per key head, or exact softmax unless --no-softmax) is chosen to minimise the sum while
the decoding state of one sequence at --context tokens stays within --cache-budget (bytes with a unit: 16MiB, 20MB;
or '2048tokens': what the model's softmax key/value cache holds for 2048 tokens), and (--metric loss) the perplexity
of the choice is measured beside the best single G for every layer within the same budget. No weight changes:
OUTPUT is MODEL with the per-layer settings, its card and cache_budget.json (every measured option, the choice, the
bytes, the best single G and the measured perplexities).
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``budget`` subcommand to ``subparsers``."""
    parser = add_verb_parser(subparsers, "budget", CLI_DESCRIPTION)
    parser.add_argument("model", metavar="MODEL", help="a window-hybrid causal LM folder (hf-performer linearize)")
    parser.add_argument("output", metavar="OUTPUT", help="folder to write the model with its allocation to")
    parser.add_argument("--cache-budget", required=True, metavar="SIZE",
                        help="decoding state of one sequence at --context tokens: bytes with a unit (16MiB, 20MB) "
                             "or softmax tokens (2048tokens)")
    parser.add_argument("--context", type=int, default=16384, metavar="TOKENS",
                        help="context length the budget holds at (softmax layers grow with it; default: 16384)")
    parser.add_argument("--text-file", required=True, help="text the errors are measured on (not the evaluation text)")
    parser.add_argument("--cache-sizes", nargs="+", type=int, default=None, metavar="G",
                        help="sparse-cache sizes to measure (default: 0 32 64 128 256 512)")
    parser.add_argument("--no-softmax", action="store_true", help="never put a layer back on exact softmax")
    parser.add_argument("--metric", choices=("loss", "error"), default="loss",
                        help="what an option costs: the model's next-token loss rise (one forward per layer and G; "
                             "default) or the layer's attention output error")
    parser.add_argument("--sequences", type=int, default=2, help="measurement sequences (default: 2)")
    parser.add_argument("--length", type=int, default=1024, help="tokens per measurement sequence (default: 1024)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sequences' order (default: 0)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUTPUT")
    parser.set_defaults(func=run_budget)
    return parser


def run_budget(args: argparse.Namespace) -> int:
    """Run ``hf-performer budget`` (see :func:`add_parser`). Returns the exit status."""
    for name in ("context", "sequences", "length"):
        if getattr(args, name) < 1:
            raise SystemExit(f"hf-performer budget: error: --{name} must be an int >= 1, got {getattr(args, name)}")
    if args.cache_sizes is not None and min(args.cache_sizes) < 0:
        raise SystemExit(f"hf-performer budget: error: --cache-sizes must be ints >= 0, got {args.cache_sizes}")
    if not os.path.isfile(args.text_file):
        raise SystemExit(f"hf-performer budget: error: --text-file {args.text_file} is not a file")
    output = check_output_folder(args.output, args.overwrite, "budget", source=args.model)

    from transformers import AutoModelForCausalLM

    from ..conversion.cache_budget import (
        CACHE_BUDGET_FILE, CACHE_SIZES, CacheBudgetError, allocate_cache_budget, allocation_table,
        apply_cache_allocation, check_budget_reachable, check_measurement_length, measure_option_errors,
        measure_allocation_losses, measure_option_losses, parse_cache_budget, softmax_token_bytes, torch_dtype_bytes,
    )
    from ..recipes.arguments import RecipeError
    from ..recipes.linearize import transfer_batches
    from ..recipes.linearize_inputs import check_causal_source, load_tokenizer, read_training_text

    try:  # (before loading: a bidirectional folder loads as a causal LM with a random head)
        check_causal_source(args.model, needs="budget sizes a causal LM's decoding state, which needs causal attention",
                            instead="an encoder keeps no decoding state to budget")
    except RecipeError as error:
        raise SystemExit(f"hf-performer budget: error: {error}") from None
    try:
        tokenizer = load_tokenizer(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model).eval()
        if getattr(model.config, "favor_settings", None) is None:
            raise CacheBudgetError(f"{args.model} is not a Performer model (no favor_settings); give the folder "
                                   "hf-performer linearize wrote")
        dtype_bytes = torch_dtype_bytes(model)
        budget = parse_cache_budget(args.cache_budget, softmax_token_bytes(model.config, dtype_bytes))
        cache_sizes = args.cache_sizes or CACHE_SIZES
        check_budget_reachable(model, budget, args.context, cache_sizes, dtype_bytes)
        tie_warning = check_measurement_length(model, args.length, cache_sizes)
        if tie_warning:
            print(f"hf-performer budget: warning: {tie_warning}", file=sys.stderr)
        text = read_training_text([args.text_file])
        token_ids = tokenizer(text)["input_ids"]
        batches = transfer_batches(token_ids, args.length, 1, args.seed)[:args.sequences]
        if args.metric == "loss":
            errors, exact_loss = measure_option_losses(model, batches, cache_sizes, progress=_progress)
        else:
            errors = measure_option_errors(model, batches, cache_sizes)
        allocation = allocate_cache_budget(model, errors, budget, args.context, dtype_bytes=dtype_bytes,
                                           allow_softmax=not args.no_softmax, metric=args.metric)
        if args.metric == "loss":
            allocation.measured = measure_allocation_losses(model, batches, allocation, exact_loss)
        apply_cache_allocation(model, allocation)
    except (CacheBudgetError, RecipeError) as error:
        raise SystemExit(f"hf-performer budget: error: {error}") from None

    record = allocation.to_dict()
    record["measured_on"] = {"text_file": os.path.basename(args.text_file), "sequences": len(batches),
                             "length": args.length, "seed": args.seed}
    record["model"] = os.path.basename(os.path.normpath(args.model))
    record["command"] = " ".join(
        ["hf-performer budget", record["model"], os.path.basename(os.path.normpath(output)),
         f"--cache-budget {args.cache_budget}", f"--context {args.context}",
         f"--text-file {os.path.basename(args.text_file)}", "--cache-sizes", *map(str, cache_sizes),
         *(["--no-softmax"] if args.no_softmax else []), f"--metric {args.metric}", f"--sequences {args.sequences}",
         f"--length {args.length}",
         f"--seed {args.seed}"])
    write_reconfigured_model(output, args.model, model, tokenizer, CACHE_BUDGET_FILE, record)
    print(allocation_table(allocation))
    print(f"\nwrote {output}")
    return 0


def _progress(done: int, total: int) -> None:
    """One line per measured option on stderr, rewritten in place (a forward pass each)."""
    print(f"\rmeasured {done}/{total} options (one forward pass each)", end="\n" if done == total else "",
          file=sys.stderr, flush=True)
