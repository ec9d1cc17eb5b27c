"""``hf-performer convert``: convert a pretrained softmax model folder into a Performer model folder.

The output folder holds the weights (safetensors), the config (with ``auto_map``), the model code (for
``trust_remote_code=True``), the tokenizer (when the source has a usable one; otherwise the fidelity report
runs on random token ids) and ``conversion_report.json`` (the fidelity report, also printed as a table).
A learned absolute position table (BERT/RoBERTa 512, GPT-2 1024) is extended to 4096 positions unless
``--keep-position-table`` or ``--max-position-embeddings N`` is given; rotary positions (Llama) need none.
It is written to a temporary folder beside the output (following the umask) and moved into place only once
complete, so a failure leaves nothing half-written, and what a killed run leaves is cleaned up or restored
by the next one; an existing output folder is refused unless ``--overwrite`` is given, and an output that
is, contains or lies inside SOURCE always is.

The parser imports no torch (``--help`` is fast): the conversion library is imported when the verb runs.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..conversion.defaults import DEFAULT_MAX_POSITION_EMBEDDINGS
from ..favor_schema import FAVOR_DEFAULTS, PERFORMER_TASKS
from . import add_verb_parser
from ._output import check_output_folder, staged_folder
from .arguments import (
    CLUSTERED_FLAG_SETTINGS,
    WINDOW_FLAG_SETTINGS,
    add_deprecated_alias,
    add_favor_arguments,
    favor_settings_from_args,
    refuse_ignored_flags,
)

CONVERT_SETTINGS = ("feature_map", "nb_features", "feature_map_options", "softmax_layers", "seed", "orthogonal", "row_norms",
                    "redraw_interval", "chunk_size", *WINDOW_FLAG_SETTINGS, *CLUSTERED_FLAG_SETTINGS)
"""The favor settings ``convert`` takes as flags (:data:`.arguments.FAVOR_FLAGS`)."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``convert`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    parser = add_verb_parser(subparsers, "convert", __doc__)
    parser.add_argument("source", metavar="SOURCE", help="folder (or offline Hub name) of the pretrained model")
    parser.add_argument("output", metavar="OUTPUT", help="folder to write the Performer model to")
    parser.add_argument(
        "--task",
        choices=PERFORMER_TASKS,
        default=None,
        help="model head to build (default: the task of the class the checkpoint was saved from, else base)",
    )
    add_favor_arguments(parser, CONVERT_SETTINGS[:4],
                        helps={"feature_map": f"feature map (default: {FAVOR_DEFAULTS['feature_map']}; not with "
                                              "--attention clustered / improved-clustered)"})
    add_position_table_arguments(parser)
    favor_seed = add_favor_arguments(
        parser, CONVERT_SETTINGS[4:-len(WINDOW_FLAG_SETTINGS) - len(CLUSTERED_FLAG_SETTINGS)])["seed"]
    add_favor_arguments(parser.add_argument_group("sink + sliding-window hybrid (any feature map)"),
                        WINDOW_FLAG_SETTINGS)
    add_favor_arguments(parser.add_argument_group(
        "zero-shot clustered attention (bidirectional models; no feature map, no training)"), CLUSTERED_FLAG_SETTINGS)
    add_deprecated_alias(parser, "--seed", favor_seed)
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


def add_position_table_arguments(parser: argparse.ArgumentParser) -> None:
    """``--max-position-embeddings N`` / ``--keep-position-table`` (convert and distill; see
    :func:`position_table_size`)."""
    positions = parser.add_mutually_exclusive_group()
    positions.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        metavar="N",
        help="extend the learned absolute position table to N positions (BERT/RoBERTa/DistilBERT/GPT-2; default: "
        f"{DEFAULT_MAX_POSITION_EMBEDDINGS} for a shorter table; rotary models such as Llama have none)",
    )
    positions.add_argument(
        "--keep-position-table",
        action="store_true",
        help="keep the source's learned absolute position table as it is (inputs longer than it are refused)",
    )


def position_table_size(args: argparse.Namespace, source) -> int | None:
    """The position count to extend ``source``'s learned table to (``None``: leave it as it is), from the arguments
    of :func:`add_position_table_arguments`."""
    from ..conversion.convert import default_position_table_size

    if args.max_position_embeddings is not None or args.keep_position_table:
        return args.max_position_embeddings
    return default_position_table_size(source)


def check_window_fits(settings: dict, source, max_position_embeddings: int | None) -> None:
    """Refuse a window or a sparse cache as long as the inputs the model takes (its position table after any extension,
    or its configured maximum): every input would fit in it, so the window layers would compute exact softmax at a
    higher cost than softmax itself (and a cache's state would be allocated for more tokens than any input holds).
    Raises ``ConversionError``."""
    from ..conversion import ConversionError, learned_position_count
    from ..favor_settings import exact_budget_problem

    positions = max_position_embeddings or learned_position_count(source) or getattr(
        source.config.get_text_config(), "max_position_embeddings", None)
    problem = exact_budget_problem(settings, positions)
    if problem:
        flag = problem.split()[0].replace("_", "-")
        raise ConversionError(
            f"--{problem}: every input would be exact softmax at a higher cost; give a {flag} below that (or "
            "--max-position-embeddings N above it)")


def run_convert(args: argparse.Namespace) -> int:
    """Run ``hf-performer convert`` (see :func:`add_parser`; ``quickstart`` runs it with ``args.command`` set to its
    own name, which labels the errors). Returns the exit status."""
    from ..conversion import ConversionError, convert_to_performer, fidelity_report, load_source
    from ..hub import write_model_card

    command = getattr(args, "command", None) or "convert"
    settings = favor_settings_from_args(args, CONVERT_SETTINGS)
    refuse_ignored_flags(settings, command)
    output = check_output_folder(args.output, args.overwrite, command, source=args.source)

    try:
        source, tokenizer = load_source(args.source, args.task)
        if args.text and tokenizer is None:
            raise ConversionError(f"--text was given but {args.source} has no usable tokenizer to encode it")
        max_position_embeddings = position_table_size(args, source)
        check_window_fits(settings, source, max_position_embeddings)
        performer = convert_to_performer(
            source, task=args.task, max_position_embeddings=max_position_embeddings, **settings,
        )
        report = fidelity_report(source, performer, tokenizer, texts=args.text)
    except ConversionError as error:
        raise SystemExit(f"hf-performer {command}: error: {error}") from None

    with staged_folder(output) as staging:
        performer.save_pretrained(staging)
        if tokenizer is not None:
            if max_position_embeddings is not None:
                tokenizer.model_max_length = max_position_embeddings
            tokenizer.save_pretrained(staging)
        write_model_card(staging, report=report, model_name=os.path.basename(output))  # README.md model card
        report.save(staging)

    print(report.format_table())
    warning = untrained_maps_warning(performer)
    if warning:
        print(f"\nwarning: {warning}")
    print(f"\nwrote {output}")
    return 0


def untrained_maps_warning(performer) -> str | None:
    """What a freshly converted model with learned feature maps needs before use (``None`` for other maps): its
    maps were never trained (``hf-performer linearize`` for a causal LM, ``distill`` for an encoder)."""
    from ..favor_attention import find_attention_modules
    from ..favor_settings import feature_map_kind, resolve_favor_settings
    from ..hub.capabilities import layer_kinds
    from ..hub.summary import untrained_map_advice

    settings = resolve_favor_settings(performer.config.favor_settings)
    modules = [module for _, module in find_attention_modules(performer)]
    kinds = layer_kinds(settings, len(modules))
    if feature_map_kind(settings["feature_map"]) != "learned" or not {"linear", "window"} & set(kinds):
        return None
    causal = any(getattr(module, "is_causal", False) for module in modules)
    return untrained_map_advice(settings["feature_map"], settings["feature_map_options"].get("init"), causal,
                                window="window" in kinds)


def main(argv: list[str] | None = None) -> int:
    """Run the convert verb alone, without the one-line error handling of :func:`hf_performer.cli.main`
    (``convert_main([SOURCE, OUTPUT, ...])``)."""
    parser = argparse.ArgumentParser(prog="hf-performer")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["convert", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
