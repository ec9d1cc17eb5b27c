"""``hf-performer card``: (re)write the README.md model card of a Performer model folder (the library:
:func:`hf_performer.hub.write_model_card`)."""

from __future__ import annotations

import argparse

from . import add_verb_parser

_CARD_DESCRIPTION = """(Re)write the README.md model card of a Performer model folder.

Metadata: base_model, library_name (transformers), pipeline_tag, tags, datasets, model-index (from
--metrics). Body: how to load it, the conversion settings (config.json favor_settings, explained for the
feature map's kind), the attention transfer (attention_transfer.json, written by `hf-performer distill`), the
fidelity report (conversion_report.json), results and recovery rows (--metrics) and measured notes on where
linear attention is and is not faster. The card is validated with huggingface_hub before it is written.

--metrics files hold a list of results, {"results": [...], "recovery": [...]}, one result
{"task": "sst2", "metric": "accuracy", "value": 0.91, "split": "validation"}, a run summary
{"task": ..., "metrics": {"accuracy": 0.91}}, or the metrics.json of a recipe run (recipes/; such a
folder counts as fine-tuned) (see model_cards/README.md).
"""


def add_parser(subparsers) -> None:
    """Add the ``card`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    card = add_verb_parser(subparsers, "card", _CARD_DESCRIPTION)
    card.add_argument("folder", metavar="FOLDER", help="the model folder")
    card.add_argument("--base-model", action="append", default=None, metavar="HUB_ID",
                      help="Hub id of the model this one derives from (repeatable; default: the conversion "
                           "source if it is a Hub id)")
    card.add_argument("--dataset", action="append", default=None, metavar="HUB_ID",
                      help="Hub id of a training dataset (repeatable; default: the datasets of --metrics)")
    card.add_argument("--metrics", action="append", default=None, metavar="JSON",
                      help="metrics file with results (model-index) and recovery rows (repeatable)")
    card.add_argument("--model-name", default=None, help="title and model-index name (default: folder name)")
    card.add_argument("--repo-id", default=None, help="Hub repository used in the card's loading example")
    card.add_argument("--license", default=None, help="license identifier (e.g. apache-2.0)")
    card.add_argument("--language", action="append", default=None, help="language code (repeatable)")
    card.add_argument("--tag", action="append", default=None, help="extra tag (repeatable)")
    card.add_argument("--fine-tuned", action=argparse.BooleanOptionalAction, default=None,
                      help="whether the model was fine-tuned after conversion (default: detected from Trainer files)")
    card.add_argument("--template", default=None, help="Jinja template (default: model_cards/performer_card.md)")
    card.set_defaults(func=run_card)


def run_card(args: argparse.Namespace) -> int:
    """Run ``hf-performer card`` (see :func:`add_parser`). Returns the exit status."""
    from hf_performer.hub.card import write_model_card
    from hf_performer.hub.folder import ModelCardError
    from hf_performer.hub.results import load_metrics

    results: list = []
    recovery: list = []
    try:
        for metrics_path in args.metrics or []:
            file_results, file_recovery = load_metrics(metrics_path)
            results += file_results
            recovery += file_recovery
        base_model = args.base_model
        if base_model is not None and len(base_model) == 1:
            base_model = base_model[0]
        path = write_model_card(
            args.folder,
            base_model=base_model,
            datasets=args.dataset,
            results=results or None,
            recovery=recovery or None,
            model_name=args.model_name,
            repo_id=args.repo_id,
            license=args.license,
            language=args.language,
            tags=args.tag,
            fine_tuned=args.fine_tuned,
            template_path=args.template,
        )
    except ModelCardError as error:
        raise SystemExit(f"hf-performer card: error: {error}") from None
    print(f"wrote {path}")
    return 0
