"""``hf-performer settings``: serve a trained window hybrid with another window / sparse cache / tail bound (no weight
change) and see its decoding memory against the softmax source's (the library:
:func:`hf_performer.conversion.cache_budget.serving_settings_record`)."""

from __future__ import annotations

import argparse
import os

from . import add_verb_parser
from ._output import check_output_folder, write_reconfigured_model

CLI_DESCRIPTION = """Serve a trained window hybrid with another window, sparse cache or tail bound.

  hf-performer settings MODEL OUTPUT --window 512 --sparse-cache 1024 --sparse-cache-span 31

The settings a model was trained with are not the only ones it can be served with: a larger window or sparse cache
keeps more tokens exact (benchmarks/README.md, issue 33 round 5: the SmolLM2 hybrid trained with window 64 + G 256,
served with window 512 + G 1024). OUTPUT is MODEL (same weights, tokenizer and training record) with the changed
settings in every window layer, its card, and serving_settings.json (the settings before and after, the decoding
state of one sequence at 1k / 2k / 4k / 16k / 64k tokens against the softmax source's key/value cache). The table is
printed; evaluate OUTPUT (hf-performer evaluate --task perplexity / passkey) before serving it.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``settings`` subcommand to ``subparsers``."""
    parser = add_verb_parser(subparsers, "settings", CLI_DESCRIPTION)
    parser.add_argument("model", metavar="MODEL", help="a window-hybrid causal LM folder (hf-performer linearize)")
    parser.add_argument("output", metavar="OUTPUT", help="folder to write the model with its new settings to")
    parser.add_argument("--window", type=int, default=None, metavar="W", help="exact band of recent tokens")
    parser.add_argument("--sparse-cache", type=int, default=None, metavar="G",
                        help="hard keys kept exact per key head (0 = none)")
    parser.add_argument("--sparse-cache-selection", choices=("recall", "attention"), default=None,
                        help="how the sparse cache chooses its tokens: recall (the tail's recall error) or attention "
                             "(the boundary query's attention, H2O / TOVA-style)")
    parser.add_argument("--sparse-cache-span", type=int, default=None, metavar="S",
                        help="rank each candidate by its score averaged over S neighbouring candidates, odd: whole "
                             "spans stay rather than their sharpest keys (1 = each token on its own)")
    parser.add_argument("--tail-cap", type=int, default=None, metavar="N",
                        help="bound the linear tail to the weight of N tokens (0 = unbounded)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUTPUT")
    parser.set_defaults(func=run_settings)
    return parser


def run_settings(args: argparse.Namespace) -> int:
    """Run ``hf-performer settings`` (see :func:`add_parser`). Returns the exit status."""
    from ..conversion.cache_budget import SERVING_SETTINGS

    changes = {name: getattr(args, name) for name in SERVING_SETTINGS if getattr(args, name) is not None}
    if not changes:
        flags = [f"--{name.replace('_', '-')}" for name in SERVING_SETTINGS]
        raise SystemExit(f"hf-performer settings: error: nothing to change; give {', '.join(flags[:-1])} or "
                         f"{flags[-1]}")
    for name, value in changes.items():
        if isinstance(value, int) and value < 0:
            raise SystemExit(f"hf-performer settings: error: --{name.replace('_', '-')} must be an int >= 0, got "
                             f"{value}")
    output = check_output_folder(args.output, args.overwrite, "settings", source=args.model)

    from transformers import AutoModelForCausalLM

    from ..conversion.cache_budget import SERVING_SETTINGS_FILE, serving_settings_record
    from ..favor_settings import resolve_favor_settings
    from ..recipes.arguments import RecipeError
    from ..recipes.linearize_inputs import check_causal_source, load_tokenizer

    try:  # (before loading: a bidirectional folder loads as a causal LM with a random head)
        source_config = check_causal_source(args.model,
                            needs="settings change a causal LM's decoding state, which needs causal attention",
                            instead="an encoder keeps no decoding state (its window and tail are set at conversion)")
    except RecipeError as error:
        raise SystemExit(f"hf-performer settings: error: {error}") from None
    stored = getattr(source_config, "favor_settings", None)
    current = resolve_favor_settings(stored) if stored is not None else {}  # (absent keys: their defaults)
    if current and not current["layer_windows"] and all(current[name] == value for name, value in changes.items()):
        given = ", ".join(f"{name} {value}" for name, value in changes.items())
        raise SystemExit(f"hf-performer settings: error: {args.model} already has {given}: nothing to change, "
                         "nothing written")
    try:
        tokenizer = load_tokenizer(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    except (OSError, ValueError, RecipeError) as error:
        raise SystemExit(f"hf-performer settings: error: cannot load {args.model}: {error}") from None
    before = getattr(model.config, "favor_settings", None)
    if before is None or not before.get("window") and not before.get("layer_windows"):
        raise SystemExit(f"hf-performer settings: error: {args.model} is not a window hybrid (no window in its "
                         "favor_settings); give a folder hf-performer linearize or convert --window wrote")
    try:
        record = serving_settings_record(model, dict(before), changes)
    except ValueError as error:
        raise SystemExit(f"hf-performer settings: error: {args.model}: {error}") from None
    model_name = os.path.basename(os.path.normpath(args.model))
    record["model"] = model_name
    record["command"] = " ".join(["hf-performer settings", model_name, os.path.basename(os.path.normpath(output)),
                                  *(f"--{name.replace('_', '-')} {value}" for name, value in changes.items())])
    write_reconfigured_model(output, args.model, model, tokenizer, SERVING_SETTINGS_FILE, record)
    print(memory_table(record))
    print(f"\nwrote {output}")
    return 0


def memory_table(record: dict) -> str:
    """The settings before and after and the decoding state at each context, as printed."""
    changed = ", ".join(f"{name} {record['before'][name]} -> {value}" for name, value in record["after"].items()
                        if record["before"][name] != value)
    lines = [f"{record['model']}: {changed or 'no setting changed'}",
             f"{'context':>8} {'state (MiB)':>12} {'softmax KV (MiB)':>17} {'fraction':>9}"]
    for context, entry in record["decoding_state_per_sequence"].items():
        lines.append(f"{int(context):>8} {entry['state_bytes'] / 2**20:>12.1f} {entry['softmax_bytes'] / 2**20:>17.1f} "
                     f"{entry['state_bytes'] / entry['softmax_bytes']:>8.1%}")
    return "\n".join(lines)
