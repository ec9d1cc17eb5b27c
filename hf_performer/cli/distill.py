"""``hf-performer distill``: convert a softmax model with a *learned* feature map and train that map by attention
transfer (each layer's linear attention learns to mimic the layer's softmax attention), then save the folder.

    hf-performer distill SOURCE OUTPUT --feature-map hedgehog --data train.tsv --data-task sst2
    hf-performer distill SOURCE OUTPUT --feature-map hedgehog --data wiki.valid.raw --max-length 256

Only the feature maps are trained, with no labels and little data (a few hundred sequences); fine-tune the output
folder afterwards with the recipes as usual. The folder holds what ``hf-performer convert`` writes (weights, code,
tokenizer, model card, ``conversion_report.json`` with the fidelity after transfer) plus ``attention_transfer.json``:
the settings, the loss history, and per layer the transfer losses and the fidelity (relative error of the attention
output on the softmax model's own inputs) before and after transfer. The per-layer table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from ..conversion.defaults import TEXT_DATA, TRANSFER_LOSSES
from ..favor_schema import LEARNED_MAP_DEFAULT_INIT, PERFORMER_TASKS
from . import add_verb_parser
from ._output import check_output_folder, public_command, staged_folder
from .arguments import WINDOW_FLAG_SETTINGS, add_favor_arguments, favor_settings_from_args, refuse_ignored_flags
from .convert import add_position_table_arguments, check_window_fits, position_table_size

DISTILL_SETTINGS = ("feature_map", "feature_map_options", "nb_features", "softmax_layers", *WINDOW_FLAG_SETTINGS)
"""The favor settings ``distill`` takes as flags (``--keep-softmax-layers`` listed after ``--task``)."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``distill`` subcommand to ``subparsers``."""
    from ..tasks.data import TASKS as DATA_TASKS  # numpy only
    parser = add_verb_parser(subparsers, "distill", __doc__)
    parser.add_argument("source", metavar="SOURCE", help="folder (or offline Hub name) of the softmax model (the teacher)")
    parser.add_argument("output", metavar="OUTPUT", help="folder to write the Performer model to")
    add_favor_arguments(parser, DISTILL_SETTINGS[:3], defaults={"feature_map": "hedgehog"}, helps={
        "feature_map": "feature map; it must have trainable parameters (default: %(default)s)",
        "feature_map_options": "initial projection of the learned map (default: the map's own, "
                               f"{LEARNED_MAP_DEFAULT_INIT} for hedgehog: it fits better after transfer "
                               "than identity, the Hedgehog paper's start)",
        "nb_features": "features per head (default: the map's own, 2 * head_dim for hedgehog); more features fit the "
                       "softmax better and cost more per token (on MiniLM-L6, head_dim 32, STS-B after "
                       "transfer: 64 -> 67.2, 128 -> 72.5, 256 -> 76.8 dev Pearson)",
    })
    parser.add_argument("--task", choices=PERFORMER_TASKS, default=None,
                        help="model head to build (default: the task of the class the checkpoint was saved from)")
    add_favor_arguments(parser, ("softmax_layers",),
                        helps={"softmax_layers": "layers that keep exact softmax attention (not transferred)"})
    add_favor_arguments(parser.add_argument_group("sink + sliding-window hybrid"), WINDOW_FLAG_SETTINGS)
    add_position_table_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the data sample and initialisation (default: 0)")
    parser.add_argument("--data", required=True, metavar="FILE",
                        help="training text: a raw text file (--data-task text) or a task file (TSV/CSV/JSON lines)")
    parser.add_argument("--data-task", default=TEXT_DATA, choices=[TEXT_DATA, *sorted(DATA_TASKS)],
                        help="layout of --data: 'text' (raw text cut into blocks of --max-length tokens) or a task "
                             "whose text columns are used, labels ignored (default: %(default)s)")
    parser.add_argument("--max-samples", type=int, default=512,
                        help="sequences used for transfer, a seeded random sample (default: %(default)s)")
    parser.add_argument("--fidelity-samples", type=int, default=32,
                        help="further sequences, not trained on, for the before/after fidelity (default: %(default)s)")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps (default: one pass over --max-samples)")
    parser.add_argument("--learning-rate", type=float, default=1e-2, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--loss", choices=TRANSFER_LOSSES, default="both",
                        help="weights: KL of the attention weights (Hedgehog); output: MSE of the attention outputs "
                             "(LoLCATs); both (default)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_distill)
    return parser


def run_distill(args: argparse.Namespace) -> int:
    """Run ``hf-performer distill`` (see :func:`add_parser`). Returns the exit status."""
    import torch

    from ..conversion import AttentionTransferError, ConversionError, convert_to_performer, load_source
    from ..conversion.attention_transfer import TRANSFER_FILE_NAME
    from ..conversion.convert import public_source_name
    from ..conversion.distill import format_layer_table, transfer_and_measure
    from ..favor_settings import feature_map_kind
    from ..feature_maps import available_feature_maps
    from ..hub import write_model_card

    settings = favor_settings_from_args(args, DISTILL_SETTINGS)
    refuse_ignored_flags(settings, "distill")
    output = check_output_folder(args.output, args.overwrite, "distill", source=args.source)
    for name in ("max_samples", "fidelity_samples", "max_length", "batch_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"hf-performer distill: error: --{name.replace('_', '-')} must be >= 1")

    if feature_map_kind(args.feature_map) != "learned":
        learned = [name for name in available_feature_maps() if feature_map_kind(name) == "learned"]
        raise SystemExit(
            f"hf-performer distill: error: --feature-map {args.feature_map} has no trainable parameters to transfer "
            f"attention into; use a learned map ({', '.join(learned)}) or `hf-performer convert`"
        )

    started = time.perf_counter()
    torch.manual_seed(args.seed)
    try:
        source, tokenizer = load_source(args.source, args.task)
        if tokenizer is None:
            raise ConversionError(f"{args.source} has no usable tokenizer to encode --data")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        max_position_embeddings = position_table_size(args, source)
        check_window_fits(settings, source, max_position_embeddings)
        try:
            performer = convert_to_performer(
                source, task=args.task, max_position_embeddings=max_position_embeddings, seed=args.seed,
                **{"feature_map_options": {}, **settings},
            )
        except TypeError as error:
            raise ConversionError(str(error)) from None
        run = transfer_and_measure(
            source, performer, tokenizer, args.data, args.data_task, max_length=args.max_length,
            max_samples=args.max_samples, fidelity_samples=args.fidelity_samples, batch_size=args.batch_size,
            steps=args.steps, learning_rate=args.learning_rate, loss=args.loss, seed=args.seed,
            progress=not args.no_progress,
        )
    except (ConversionError, AttentionTransferError, ValueError) as error:
        raise SystemExit(f"hf-performer distill: error: {error}") from None
    wall_time = time.perf_counter() - started

    # Meant for the Hub: paths are reduced to base names (Hub ids are kept).
    record = {
        "source": public_source_name(args.source),
        "feature_map": args.feature_map,
        "favor_settings": dict(performer.config.favor_settings),
        "data": {"file": public_source_name(args.data), "layout": args.data_task, "sequences": run.sequences,
                 "max_length": args.max_length, "batch_size": args.batch_size, "seed": args.seed,
                 "fidelity_sequences": run.fidelity_sequences},
        "transfer": run.transfer.to_dict(),
        "fidelity_before": run.before.to_dict(),
        "fidelity_after": run.after.to_dict(),
        "wall_time_s": round(wall_time, 2),
        "command": public_command("distill"),
    }
    with staged_folder(output) as staging:
        performer.save_pretrained(staging)
        if max_position_embeddings is not None:
            tokenizer.model_max_length = max_position_embeddings
        tokenizer.save_pretrained(staging)
        run.after.save(staging)
        with open(os.path.join(staging, TRANSFER_FILE_NAME), "w") as handle:
            json.dump(record, handle, indent=2)
        write_model_card(staging, report=run.after, model_name=os.path.basename(output), transfer=record)

    print(format_layer_table(run.before, run.after, run.transfer.layer_losses_before, run.transfer.layer_losses_after))
    print(f"\nattention transfer: {run.steps} steps on {run.sequences} sequences in {wall_time:.1f} s; wrote {output}")
    return 0
