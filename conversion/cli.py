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
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
import tempfile

from hf_performer.favor_settings import FAVOR_DEFAULTS
from hf_performer.feature_maps import available_feature_maps
from hf_performer.hub import write_model_card

from .convert import (
    DEFAULT_MAX_POSITION_EMBEDDINGS,
    TASKS,
    ConversionError,
    convert_to_performer,
    default_position_table_size,
    load_source,
)
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
    add_position_table_arguments(parser)
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
    if args.max_position_embeddings is not None or args.keep_position_table:
        return args.max_position_embeddings
    return default_position_table_size(source)


def check_output_folder(output: str, overwrite: bool, command: str, source: str | None = None) -> str:
    """The absolute path of an output folder, checked before any work, with ``hf-performer COMMAND: error: ...``.

    Refuses an output that is, contains or lies inside the local ``source`` folder (symlinks resolved), an existing
    one without ``overwrite``, and a parent folder that is missing or not writable. First recovers what an
    interrupted earlier run left beside it (see :func:`recover_interrupted_runs`).
    """
    path = os.path.abspath(output)
    parent = os.path.dirname(path)
    if source is not None and os.path.exists(source):
        _check_not_source(output, source, command)
    if not os.path.isdir(parent):
        raise SystemExit(f"hf-performer {command}: error: the parent folder of {output} does not exist")
    for note in recover_interrupted_runs(path):
        print(f"hf-performer {command}: {note}", file=sys.stderr)
    if os.path.lexists(path) and not overwrite:
        raise SystemExit(f"hf-performer {command}: error: {output} already exists; pass --overwrite to replace it")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.check-", dir=parent))
    except OSError as error:
        raise SystemExit(
            f"hf-performer {command}: error: cannot write into {parent} (the folder of OUTPUT): {error.strerror}"
        ) from None
    return path


def _check_not_source(output: str, source: str, command: str) -> None:
    real_output, real_source = os.path.realpath(os.path.abspath(output)), os.path.realpath(source)
    if real_output == real_source:
        problem = "is the source folder"
    elif real_output.startswith(real_source.rstrip(os.sep) + os.sep):
        problem = "is inside the source folder"
    elif real_source.startswith(real_output.rstrip(os.sep) + os.sep):
        problem = "contains the source folder"
    else:
        return
    raise SystemExit(
        f"hf-performer {command}: error: OUTPUT {output} {problem} {source}; writing it would overwrite the source: "
        "choose an OUTPUT outside SOURCE"
    )


_LEFTOVER = re.compile(r"^\.(?P<base>.+)\.(?P<kind>partial|old)-(?:(?P<pid>\d+)-)?[^-]*$")
"""Names of :func:`staged_folder`'s folders beside the output: ``.NAME.partial-PID-XXXX`` (being written) and
``.NAME.old-PID-XXXX`` (the previous output, moved aside while the new one is moved in)."""


def recover_interrupted_runs(output: str) -> list[str]:
    """Put right what dead runs writing ``output`` left beside it; returns one note per action, for the user.

    A run that died between its two renames (output -> ``.old-``, ``.partial-`` -> output) left no output: its
    ``.old-`` folder is restored, so the replacement is all or nothing. Other ``.partial-`` / ``.old-`` folders of
    dead processes are removed. Those of running processes (another conversion into the same folder) are left
    alone; those without a process id (older versions, other machines) are only named.
    """
    parent, base = os.path.split(output)
    notes = []
    leftovers = [(name, _LEFTOVER.match(name)) for name in sorted(os.listdir(parent))]
    leftovers = [(name, match) for name, match in leftovers if match and match["base"] == base]
    # Restore a retired output before deleting anything.
    for name, match in sorted(leftovers, key=lambda item: item[1]["kind"] != "old"):
        leftover = os.path.join(parent, name)
        if match["pid"] is None:
            notes.append(f"left {name} (an unfinished earlier run?): delete it if no run is writing {base}")
        elif _process_is_running(int(match["pid"])):
            continue
        elif match["kind"] == "old" and not os.path.lexists(output):
            os.replace(leftover, output)
            notes.append(f"restored {base} from {name}, where a run interrupted while replacing it had moved it")
        else:
            _remove(leftover)
            notes.append(f"removed {name}, left by an interrupted run")
    return notes


def _process_is_running(pid: int) -> bool:
    if os.name == "nt":  # os.kill would terminate it
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _current_umask() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


@contextlib.contextmanager
def staged_folder(output: str):
    """Yield a temporary folder beside ``output``; when the block succeeds, move it into place (replacing an existing
    ``output`` only at the last moment); when it fails, delete it. A failure never leaves a half-written folder, and
    a run killed midway leaves folders that :func:`recover_interrupted_runs` puts right."""
    parent, name = os.path.split(output)
    staging = tempfile.mkdtemp(prefix=f".{name}.partial-{os.getpid()}-", dir=parent)
    try:
        os.chmod(staging, 0o777 & ~_current_umask())  # mkdtemp makes it 0700; save_pretrained follows the umask
        yield staging
        _replace_folder(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def run_convert(args: argparse.Namespace) -> int:
    """Run ``hf-performer convert`` (see :func:`add_parser`; ``quickstart`` runs it with ``args.command`` set to its
    own name, which labels the errors). Returns the exit status."""
    command = getattr(args, "command", None) or "convert"
    output = check_output_folder(args.output, args.overwrite, command, source=args.source)

    try:
        source, tokenizer = load_source(args.source, args.task)
        if args.text and tokenizer is None:
            raise ConversionError(f"--text was given but {args.source} has no usable tokenizer to encode it")
        max_position_embeddings = position_table_size(args, source)
        performer = convert_to_performer(
            source,
            task=args.task,
            feature_map=args.feature_map,
            nb_features=args.nb_features,
            keep_softmax_layers=args.keep_softmax_layers,
            max_position_embeddings=max_position_embeddings,
            seed=args.seed,
            orthogonal=None if args.projection is None else args.projection == "orthogonal",
            row_norms=args.row_norms,
            redraw_interval=args.redraw_interval,
            chunk_size=args.chunk_size,
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
    print(f"\nwrote {output}")
    return 0


def _replace_folder(staging: str, output: str) -> None:
    """Move the complete ``staging`` folder to ``output``, replacing an existing one only at the last moment."""
    if not os.path.lexists(output):
        os.replace(staging, output)
        return
    parent, name = os.path.split(output)
    retired = tempfile.mkdtemp(prefix=f".{name}.old-{os.getpid()}-", dir=parent)
    os.rmdir(retired)
    os.replace(output, retired)
    try:
        os.replace(staging, output)
    except BaseException:
        os.replace(retired, output)
        raise
    _remove(retired)


def _remove(path: str) -> None:
    """Delete a folder (not what a symlink points to) or a file."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def main(argv: list[str] | None = None) -> int:
    """Run the convert subcommand alone (``python -m hf_performer.conversion.cli SOURCE OUTPUT ...``)."""
    parser = argparse.ArgumentParser(prog="hf-performer")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["convert", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
