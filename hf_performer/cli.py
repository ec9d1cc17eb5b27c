"""The ``hf-performer`` command line: one subcommand per task (``hf-performer --help``).

Each subcommand lives next to the code it drives and exposes ``add_parser(subparsers)``, which adds
its parser and sets ``func`` to the function that runs it.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from . import benchmark, evaluation, hub, recovery_report
    from .conversion import cli as conversion_cli
    from .conversion import distill, quickstart

    parser = argparse.ArgumentParser(
        prog="hf-performer",
        description="FAVOR+ / linear attention for Hugging Face transformers.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    quickstart.add_parser(subparsers)
    conversion_cli.add_parser(subparsers)
    distill.add_parser(subparsers)
    benchmark.add_parser(subparsers)
    evaluation.add_parser(subparsers)
    hub.add_parser(subparsers)
    recovery_report.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
