"""Rewrite the generated results blocks of README.md and docs/ from the committed JSON files.

    python benchmarks/scripts/update_readme_results.py            # every block of README.md and docs/**/*.md
    python benchmarks/scripts/update_readme_results.py --check    # change nothing; exit 1 naming stale blocks
    python benchmarks/scripts/update_readme_results.py benchmarks/results/recovery_sst2.json \\
        benchmarks/results/recovery_stsb.json --readme docs/results/encoders.md   # one recovery table, given files

A block is the text between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``, NAME one of
:data:`results_tables.TABLES`; its content is that table, built from ``benchmarks/results/*.json`` with links relative
to the page; nothing else changes. With JSON files and ``--readme``, the ``recovery-results`` block of that file gets
the table of :func:`hf_performer.recipes.report.table` (what ``hf-performer results table`` prints) for those files.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_performer.recipes.report import table  # noqa: E402
from hf_performer.recipes.results import ResultsError, load_results  # noqa: E402
from results_tables import RECOVERY_COMMAND, TABLES  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/**/*.md")
"""The files (glob patterns from the repository root) whose blocks are generated."""

README_START = "<!-- recovery-results:start -->"
README_END = "<!-- recovery-results:end -->"
BLOCK = re.compile(r"<!-- ([a-z0-9-]+):start -->\n(.*?)<!-- \1:end -->", re.DOTALL)


def replace_in_readme(readme: str, content: str) -> None:
    """Replace the text between :data:`README_START` and :data:`README_END` in ``readme`` with ``content``
    (the markers stay; nothing else changes).

    Raises:
        ResultsError: no such file, a marker missing or repeated, or the end marker before the start marker.
    """
    if not os.path.isfile(readme):
        raise ResultsError(f"--readme: no such file {readme}")
    with open(readme) as handle:
        text = handle.read()
    for marker in (README_START, README_END):
        count = text.count(marker)
        if count != 1:
            raise ResultsError(
                f"{readme} must contain the marker {marker} exactly once (found {count}); add the pair "
                f"{README_START} / {README_END} where the table goes"
            )
    start = text.index(README_START) + len(README_START)
    end = text.index(README_END)
    if end < start:
        raise ResultsError(f"{readme}: {README_END} comes before {README_START}")
    _write(readme, text[:start] + "\n" + content.strip("\n") + "\n" + text[end:])


def _write(path: str | Path, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def pages(repo: Path = REPO) -> list[Path]:
    """The files of :data:`PAGES` (sorted)."""
    return sorted({path for pattern in PAGES for path in repo.glob(pattern)})


def regenerate(page: Path, repo: Path = REPO) -> tuple[str, list[str]]:
    """``page``'s text with every block regenerated, and the names of the blocks whose text changed.

    Raises:
        ResultsError: a block names no table of :data:`results_tables.TABLES`.
    """
    text = page.read_text()
    root = os.path.relpath(repo, page.parent).replace(os.sep, "/") + "/"
    root = "" if root == "./" else root
    changed = []

    def block(match: re.Match) -> str:
        name = match.group(1)
        if name not in TABLES:
            raise ResultsError(f"{page.relative_to(repo)}: no table is named {name!r} (known: {', '.join(TABLES)})")
        content = TABLES[name](root).strip("\n") + "\n"
        if content != match.group(2):
            changed.append(name)
        return f"<!-- {name}:start -->\n{content}<!-- {name}:end -->"

    return BLOCK.sub(block, text), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks/scripts/update_readme_results.py",
        description="Rewrite the generated results blocks (<!-- NAME:start --> ... <!-- NAME:end -->) of README.md and "
                    "docs/ from benchmarks/results/*.json; with JSON files and --readme, only the recovery table of "
                    f"those files, between {README_START} and {README_END} of that file.",
    )
    parser.add_argument("results", metavar="FILE.json", nargs="*",
                        help="JSON files written by `results collect` (with --readme)")
    parser.add_argument("--readme", default=None, help="the file holding the recovery-results markers")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming every block whose text differs from the JSON's")
    args = parser.parse_args(argv)
    if bool(args.results) != bool(args.readme):
        parser.error("give both JSON files and --readme (one recovery table), or neither (every block)")
    try:
        if args.results:
            text = table([load_results(path) for path in args.results], sources=args.results, command=RECOVERY_COMMAND)
            replace_in_readme(args.readme, text)
            sys.stdout.write(text)
            print(f"updated {args.readme}")
            return 0
        stale = []
        for page in pages():
            text, changed = regenerate(page)
            stale += [f"{page.relative_to(REPO)}: {name}" for name in changed]
            if changed and not args.check:
                _write(page, text)
    except ResultsError as error:
        raise SystemExit(f"update_readme_results.py: error: {error}") from None
    if args.check:
        if stale:
            print("stale generated blocks (run python benchmarks/scripts/update_readme_results.py):\n  " +
                  "\n  ".join(stale))
            return 1
        print("every generated block matches benchmarks/results/*.json")
        return 0
    print("updated: " + (", ".join(stale) if stale else "nothing (every block was up to date)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
