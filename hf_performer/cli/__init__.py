"""The ``hf-performer`` command line: one subcommand per task (``hf-performer --help``).

Each verb is one thin module of this package (``hf_performer.cli.convert``, ...) exposing
``add_parser(subparsers)``, which adds its parser and sets ``func`` to its run function, which calls the library
(the libraries parse no arguments). The favor flags are declared once, in :mod:`.arguments`. :data:`VERBS` names
the verbs with their one-line help, so that ``hf-performer --help`` imports neither torch nor transformers: only
the module of the verb that runs is imported.

Errors: a verb's exception (or ``SystemExit`` with a message) is printed as one line,
``hf-performer VERB: error: MESSAGE``, on stderr, with exit status 2 (130 when interrupted);
``hf-performer --debug VERB ...`` prints the traceback as well.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback


VERBS = (
    # (name, one-line help, module whose add_parser adds it)
    ("quickstart", "convert a pretrained model (default: the bundled MiniLM-L6) and show fidelity and speed",
     "hf_performer.cli.quickstart"),
    ("convert", "convert a pretrained softmax model into a Performer (FAVOR+) model", "hf_performer.cli.convert"),
    ("distill", "convert with a learned feature map (hedgehog, t2r) trained by attention transfer",
     "hf_performer.cli.distill"),
    ("linearize", "train a causal LM into sink + window softmax with a learned linear tail (convert, transfer, LoRA, "
     "evaluate)", "hf_performer.cli.linearize"),
    ("budget", "spend one decoding-memory budget on per-layer sparse caches / softmax layers of a window hybrid",
     "hf_performer.cli.budget"),
    ("settings", "serve a trained window hybrid with another window / sparse cache / tail bound and show its decoding "
     "memory", "hf_performer.cli.settings"),
    ("bench", "benchmarks of the attention kernels", "hf_performer.cli.bench"),
    ("evaluate", "evaluate a model on a GLUE task / IMDB (task metrics) or on text (perplexity)",
     "hf_performer.cli.evaluate"),
    ("push", "upload a Performer model folder to the Hugging Face Hub (checked first; --dry-run lists files)",
     "hf_performer.cli.push"),
    ("card", "(re)write the README.md model card of a Performer model folder", "hf_performer.cli.card"),
    ("results", "recovery results: collect runs into JSON, plot the recovery curve, write the README table",
     "hf_performer.cli.results"),
)

def add_verb_parser(subparsers, name: str, description: str) -> argparse.ArgumentParser:
    """Add verb ``name``'s parser to ``subparsers``: its one-line help from :data:`VERBS`, its ``description``
    shown as written."""
    help_text = next(text for verb, text, _ in VERBS if verb == name)
    return subparsers.add_parser(name, help=help_text, description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)


DEBUG_HINT = "(run with --debug for the traceback)"


class CommandFailed(SystemExit):
    """Exit status 2 after the one-line error was printed; ``str()`` is that line (for callers and tests)."""

    def __init__(self, line: str):
        super().__init__(2)
        self.line = line

    def __str__(self) -> str:
        return self.line


def _new_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = argparse.ArgumentParser(
        prog="hf-performer",
        description="FAVOR+ / linear attention for Hugging Face transformers.",
    )
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    return parser, parser.add_subparsers(dest="command", metavar="COMMAND", required=True)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser: every verb (importing every verb's module), or only ``command``'s."""
    parser, subparsers = _new_parser()
    modules = dict.fromkeys(module for name, _, module in VERBS if command is None or name == command)
    for module in modules:
        importlib.import_module(module).add_parser(subparsers)
    return parser


def _verb_table_parser() -> argparse.ArgumentParser:
    """``hf-performer [--debug] COMMAND ...`` from :data:`VERBS` alone (nothing imported): picks the verb."""
    parser, subparsers = _new_parser()
    for name, help_text, _ in VERBS:
        subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def _one_line(error: BaseException) -> str:
    if isinstance(error, SystemExit):
        return " ".join(str(error.code).split())
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    known, rest = _verb_table_parser().parse_known_args(argv)
    debug = known.debug or "--debug" in rest  # also accepted after the verb
    rest = [argument for argument in rest if argument != "--debug"]
    command = known.command
    try:
        args = build_parser(command).parse_args([command, *rest])
        import hf_performer

        hf_performer.import_runtime()  # the verbs run with the package fully imported, as in a library session
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"hf-performer {command}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as error:
        if error.code is None or isinstance(error.code, int):  # --help, argparse's own usage errors, exit(n)
            raise
        failure = error
    except Exception as error:  # noqa: BLE001 - every error of a verb is reported the same way
        failure = error
    if debug:
        traceback.print_exception(failure)
    message = _one_line(failure)
    if not message.startswith("hf-performer "):
        message = f"hf-performer {command}: error: {message}"
    line = message if debug else f"{message} {DEBUG_HINT}"
    sys.stdout.flush()
    print(line, file=sys.stderr)
    raise CommandFailed(line) from None


if __name__ == "__main__":
    sys.exit(main())
