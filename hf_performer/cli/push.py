"""``hf-performer push``: check a Performer model folder and upload it to the Hugging Face Hub (the library:
:func:`hf_performer.hub.push_folder`)."""

from __future__ import annotations

import argparse
import sys

from . import add_verb_parser

_PUSH_DESCRIPTION = """Upload a Performer model folder to the Hugging Face Hub.

The folder is checked first: it must load with from_pretrained(..., trust_remote_code=True) (config.json
with auto_map, the code files auto_map names and the modules they import, weights, tokenizer; the config
must load and describe the weights: every tensor, with its shape); a folder that would not load is refused
with the list of what is wrong. checkpoints/ (training states of a recipe run) is left out unless
--include-checkpoints. The repository is created if needed (--private), --revision uploads to a branch
(created from main if needed). The token comes from --token, else HF_TOKEN, else the cached
`hf auth login`; the endpoint from HF_ENDPOINT (default huggingface.co). With HF_HUB_OFFLINE set nothing
can be sent. --dry-run lists the files that would be uploaded, with their sizes, and sends nothing.
"""


def add_parser(subparsers) -> None:
    """Add the ``push`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    push = add_verb_parser(subparsers, "push", _PUSH_DESCRIPTION)
    push.add_argument("folder", metavar="FOLDER", help="the model folder to upload")
    push.add_argument("repo_id", metavar="REPO_ID", help="the Hub model repository, namespace/name")
    push.add_argument("--private", action="store_true", help="create the repository private")
    push.add_argument("--revision", default=None, metavar="REV", help="branch to upload to (created if needed)")
    push.add_argument("--dry-run", action="store_true", help="list the files that would be uploaded; send nothing")
    push.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the cached login)")
    push.add_argument("--commit-message", default=None, help="commit message")
    push.add_argument("--include-checkpoints", action="store_true",
                      help="also upload checkpoints/ (training states of a recipe run; left out by default)")
    push.add_argument("--no-tokenizer", action="store_true",
                      help="push a folder that has no tokenizer (a conversion of a source without one); users then "
                           "load the source's tokenizer themselves")
    push.set_defaults(func=run_push)


def run_push(args: argparse.Namespace) -> int:
    """Run ``hf-performer push`` (see :func:`add_parser`). Returns the exit status."""
    from hf_performer.hub.folder import FolderValidationError
    from hf_performer.hub.push import PushError, push_folder

    try:
        result = push_folder(
            args.folder,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            dry_run=args.dry_run,
            token=args.token,
            commit_message=args.commit_message,
            include_checkpoints=args.include_checkpoints,
            without_tokenizer=args.no_tokenizer,
        )
    except (FolderValidationError, PushError) as error:
        raise SystemExit(f"hf-performer push: error: {error}") from None
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    target = f"{args.repo_id}" + (f" (revision {args.revision})" if args.revision else "")
    if result.dry_run:
        print(f"dry run: would upload to {target}:")
        print(result.format_listing())
        print("nothing was uploaded")
    else:
        print(f"uploaded to {target}:")
        print(result.format_listing())
        print(f"commit: {result.commit_url}")
    return 0
