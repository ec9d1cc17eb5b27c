"""``hf-performer convert``: convert a pretrained softmax model folder into a Performer model folder.

The output folder holds the weights (safetensors), the config (with ``auto_map``), the model code (for
``trust_remote_code=True``), the tokenizer and ``conversion_report.json`` (the fidelity report, also
printed as a table). It is written to a temporary folder beside the output and moved into place only
once complete, so a failure leaves nothing half-written; an existing output folder is refused unless
``--overwrite`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile

from hf_performer.favor_attention import FAVOR_DEFAULTS
from hf_performer.feature_maps import available_feature_maps
from hf_performer.hub import write_model_card

from .convert import TASKS, ConversionError, convert_to_performer, load_source
from .fidelity import fidelity_report


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``convert`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    parser = subparsers.add_parser(
        "convert",
        help="convert a pretrained softmax model into a Performer (FAVOR+) model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", metavar="SOURCE", help="folder (or offline Hub name) of the pretrained model")
    parser.add_argument("output", metavar="OUTPUT", help="folder to write the Performer model to")
    parser.add_argument(
        "--task",
        choices=TASKS,
        default=None,
        help="model head to build (default: the task of the class the checkpoint was saved from, else base)",
    )
    parser.add_argument(
        "--feature-map",
        choices=available_feature_maps(),
        default=FAVOR_DEFAULTS["feature_map"],
        help="feature map (default: %(default)s)",
    )
    parser.add_argument(
        "--nb-features",
        type=int,
        default=None,
        help=f"random features per head (default: {FAVOR_DEFAULTS['nb_features']} for random maps; elu+1 uses head_dim)",
    )
    parser.add_argument(
        "--keep-softmax-layers",
        type=int,
        nargs="+",
        default=[],
        metavar="LAYER",
        help="indices of layers that keep exact softmax attention",
    )
    parser.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        metavar="N",
        help="extend the learned absolute position table to N positions (BERT/RoBERTa/DistilBERT/GPT-2)",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help=f"seed of the projections (default: {FAVOR_DEFAULTS['seed']})"
    )
    parser.add_argument(
        "--projection",
        choices=("orthogonal", "iid"),
        default=None,
        help="random projection kind (default: orthogonal)",
    )
    parser.add_argument(
        "--row-norms",
        choices=("chi", "fixed"),
        default=None,
        help="norms of the projection rows (default: chi)",
    )
    parser.add_argument(
        "--redraw-interval",
        type=int,
        default=None,
        help="training forward calls between projection redraws (default: 0, never)",
    )
    parser.add_argument("--chunk-size", type=int, default=None, help="chunk size of the causal scan")
    parser.add_argument(
        "--text",
        action="append",
        default=None,
        metavar="TEXT",
        help="sample text for the fidelity report (repeatable; default: built-in sentences)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    parser.set_defaults(func=run_convert)
    return parser


def check_output_folder(output: str, overwrite: bool, command: str) -> str:
    """The absolute path of an output folder, after refusing an existing one (without ``overwrite``) or a missing
    parent, with ``hf-performer COMMAND: error: ...``."""
    path = os.path.abspath(output)
    if os.path.lexists(path) and not overwrite:
        raise SystemExit(f"hf-performer {command}: error: {output} already exists; pass --overwrite to replace it")
    if not os.path.isdir(os.path.dirname(path)):
        raise SystemExit(f"hf-performer {command}: error: the parent folder of {output} does not exist")
    return path


@contextlib.contextmanager
def staged_folder(output: str):
    """Yield a temporary folder beside ``output``; when the block succeeds, move it into place (replacing an existing
    ``output`` only at the last moment); when it fails, delete it. A failure never leaves a half-written folder."""
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.partial-", dir=os.path.dirname(output))
    try:
        yield staging
        _replace_folder(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def run_convert(args: argparse.Namespace) -> int:
    """Run ``hf-performer convert`` (see :func:`add_parser`). Returns the exit status."""
    output = check_output_folder(args.output, args.overwrite, "convert")

    try:
        source, tokenizer = load_source(args.source, args.task)
        if args.text and tokenizer is None:
            raise ConversionError(f"--text was given but {args.source} has no tokenizer to encode it")
        performer = convert_to_performer(
            source,
            task=args.task,
            feature_map=args.feature_map,
            nb_features=args.nb_features,
            keep_softmax_layers=args.keep_softmax_layers,
            max_position_embeddings=args.max_position_embeddings,
            seed=args.seed,
            orthogonal=None if args.projection is None else args.projection == "orthogonal",
            row_norms=args.row_norms,
            redraw_interval=args.redraw_interval,
            chunk_size=args.chunk_size,
        )
        report = fidelity_report(source, performer, tokenizer, texts=args.text)
    except ConversionError as error:
        raise SystemExit(f"hf-performer convert: error: {error}") from None

    with staged_folder(output) as staging:
        performer.save_pretrained(staging)
        if tokenizer is not None:
            if args.max_position_embeddings is not None:
                tokenizer.model_max_length = args.max_position_embeddings
            tokenizer.save_pretrained(staging)
        write_model_card(staging, report=report, model_name=os.path.basename(output))  # README.md model card
        report.save(staging)

    print(report.format_table())
    print(f"\nwrote {output}")
    return 0


def _replace_folder(staging: str, output: str) -> None:
    """Move the complete ``staging`` folder to ``output``, replacing an existing one only at the last moment."""
    if not os.path.lexists(output):
        os.replace(staging, output)
        return
    retired = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.old-", dir=os.path.dirname(output))
    os.rmdir(retired)
    os.replace(output, retired)
    try:
        os.replace(staging, output)
    except BaseException:
        os.replace(retired, output)
        raise
    if os.path.isdir(retired) and not os.path.islink(retired):
        shutil.rmtree(retired)
    else:
        os.remove(retired)


def main(argv: list[str] | None = None) -> int:
    """Run the convert subcommand alone (``python -m hf_performer.conversion.cli SOURCE OUTPUT ...``)."""
    parser = argparse.ArgumentParser(prog="hf-performer")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["convert", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
