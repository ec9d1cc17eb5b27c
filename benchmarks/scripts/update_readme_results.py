"""Rewrite the recovery results section of the README from the committed JSON files.

    python benchmarks/scripts/update_readme_results.py benchmarks/results/recovery_sst2.json \\
        benchmarks/results/recovery_stsb.json benchmarks/results/recovery_imdb.json --readme README.md

The text between :data:`README_START` and :data:`README_END` is replaced by the table of
:func:`hf_performer.recipes.report.table` (what ``hf-performer results table`` prints); nothing else changes.
"""

from __future__ import annotations

import argparse
import os
import sys

from hf_performer.recipes.report import table
from hf_performer.recipes.results import ResultsError, load_results

COMMAND = "python benchmarks/scripts/update_readme_results.py"

README_START = "<!-- recovery-results:start -->"
README_END = "<!-- recovery-results:end -->"


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
    new = text[:start] + "\n" + content.strip("\n") + "\n" + text[end:]
    tmp = readme + ".tmp"
    with open(tmp, "w") as handle:
        handle.write(new)
    os.replace(tmp, readme)



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks/scripts/update_readme_results.py",
        description=f"Write the recovery results table of collected JSON files (`hf-performer results collect`) "
                    f"between {README_START} and {README_END} of the README (nothing else is changed).",
    )
    parser.add_argument("results", metavar="FILE.json", nargs="+", help="JSON files written by `results collect`")
    parser.add_argument("--readme", default="README.md", help="the file holding the markers (default: README.md)")
    args = parser.parse_args(argv)
    try:
        text = table([load_results(path) for path in args.results], sources=args.results, command=COMMAND)
        replace_in_readme(args.readme, text)
    except ResultsError as error:
        raise SystemExit(f"update_readme_results.py: error: {error}") from None
    sys.stdout.write(text)
    print(f"updated {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
