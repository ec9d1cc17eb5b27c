"""``hf-performer results collect | plot | table``: the recovery results of the recipes (the library:
:mod:`hf_performer.recipes.results` collects, :mod:`hf_performer.recipes.report` plots and tables)."""

from __future__ import annotations

import argparse

from . import add_verb_parser


def _run_results_action(action: str):
    """The runner of ``hf-performer results ACTION`` (:mod:`hf_performer.recipes.report`, imported when run)."""

    def run(args: argparse.Namespace) -> int:
        from hf_performer.recipes import report

        return getattr(report, f"run_{action}")(args)

    return run


def _results_help_texts() -> tuple[str, str, str]:
    """The run labels, the target rules and the description of ``hf-performer results``."""
    from hf_performer.recipes.results import (
        ATTENTION_TRANSFER_TARGET_POINTS, ATTENTION_TRANSFER_TARGET_RATIO, LABELS, TARGET_POINTS,
    )

    label_lines = "\n".join(f"  {k}: {v}" for k, v in LABELS.items())
    target_lines = (
        f"Targets:\n  issue 4: (c) within {TARGET_POINTS:g} points (metric x 100) of (a)\n"
        "  issue 5 (attention transfer): "
        + "; ".join(f"on {task} (f) within {points:g} points of (a)" for task, points in
                    ATTENTION_TRANSFER_TARGET_POINTS.items())
        + f";\n    on any other task (f) at least {100 * ATTENTION_TRANSFER_TARGET_RATIO:g}% of (a)'s metric"
    )
    description = f"""Recovery results (issues 4 and 5): collect the runs of a task, plot the recovery curve, write
the table.

Run labels (fixed meanings; every label is optional):
{label_lines}

(e) is the folder written by `hf-performer distill RUN_A E --feature-map hedgehog ...`, evaluated with
`hf-performer evaluate E --task TASK --output E/dev_metrics.json`; (f) is the recipe run on that folder.

{target_lines}

  hf-performer results collect --task sst2 --run a=RUN_A --run b=CONVERTED/dev_metrics.json --run c=RUN_C \\
      --run d=RUN_D --run e=DISTILLED/dev_metrics.json --run f=RUN_F \\
      --protocol "MiniLM-L6, 8000 training examples, ..." --output benchmarks/results/recovery_sst2.json
  hf-performer results plot benchmarks/results/recovery_sst2.json
  hf-performer results table benchmarks/results/recovery_*.json
  python benchmarks/scripts/update_readme_results.py benchmarks/results/recovery_*.json --readme README.md
"""
    return label_lines, target_lines, description


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``results`` subcommand (``collect``, ``plot``, ``table``) to ``subparsers``."""
    from hf_performer.recipes.results import LABELS

    label_lines, target_lines, description = _results_help_texts()
    parser = add_verb_parser(subparsers, "results", description)
    actions = parser.add_subparsers(dest="results_command", metavar="ACTION", required=True)

    collect_parser = actions.add_parser(
        "collect", help="gather the runs (a)-(f) of one task into one JSON file",
        description="Gather the labelled runs of one task (final dev metric, steps, examples, seed, wall time,\n"
                    "model settings, eval curve, recipe args, metrics backend; for (e) and (f) the summary of the\n"
                    "distilled folder's attention_transfer.json) and the target checks into one JSON file.\n\n"
                    + label_lines + "\n\n" + target_lines,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    collect_parser.add_argument("--task", required=True, help="the task of the runs (sst2, imdb, a GLUE task)")
    collect_parser.add_argument("--run", action="append", required=True, metavar="LABEL=PATH",
                                help="a run: LABEL in " + ", ".join(LABELS) + "; PATH a recipe output folder or its "
                                     "metrics.json (a, c, d, f), or an `hf-performer evaluate` JSON or the folder "
                                     "holding it as dev_metrics.json (b, e) (repeat for each run)")
    collect_parser.add_argument("--command", action="append", default=None, metavar="LABEL=COMMAND",
                                help="the exact command line of a run (default: rebuilt from its recorded args)")
    collect_parser.add_argument("--protocol", default=None, help="free text: model, data, budget, hardware, ...")
    collect_parser.add_argument("--output", required=True, help="the JSON file to write")
    collect_parser.set_defaults(func=_run_results_action("collect"))

    plot_parser = actions.add_parser(
        "plot", help="plot the recovery curve of a collected JSON file as PNG",
        description="Dev metric vs optimizer steps: (a) softmax and (d) FAVOR+ direct from step 0; (c) FAVOR+ "
                    "recovery after (a)'s last step, starting from (b) (the converted model, untrained); (f) "
                    "attention transfer + fine-tuning (dashed) after (a)'s last step, starting from (e) (the "
                    "distilled model, not fine-tuned); the issue 4 target (dotted) and, with (e) or (f), the "
                    "issue 5 target (dash-dot).",
    )
    plot_parser.add_argument("results", metavar="FILE.json", help="a JSON file written by `results collect`")
    plot_parser.add_argument("--output", default=None, help="the PNG to write (default: FILE.png)")
    plot_parser.set_defaults(func=_run_results_action("plot"))

    table_parser = actions.add_parser(
        "table", help="the markdown results table of collected JSON files",
        description="Print the markdown table (task, run, metric, steps, examples, seed, wall time) of one or "
                    "more collected JSON files, then per task the FAVOR+ runs (b, c, d) and the attention-transfer "
                    "runs (e, f) side by side against (a) with the status of both targets (issue 4 and issue 5). "
                    "The README's results section is rewritten from the same table by `python "
                    "benchmarks/scripts/update_readme_results.py FILE.json ... --readme README.md`.",
    )
    table_parser.add_argument("results", metavar="FILE.json", nargs="+", help="JSON files written by `results collect`")
    table_parser.set_defaults(func=_run_results_action("table"))
    return parser
