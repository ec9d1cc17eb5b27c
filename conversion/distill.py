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
import sys
import time

import numpy as np
import torch

from hf_performer.favor_settings import feature_map_kind
from hf_performer.feature_maps import LEARNED_MAP_INITS, available_feature_maps, default_feature_map_init
from hf_performer.hub import write_model_card

from .attention_transfer import LOSSES, TRANSFER_FILE_NAME, AttentionTransferError, transfer_attention
from .cli import add_position_table_arguments, check_output_folder, position_table_size, staged_folder
from .convert import TASKS, ConversionError, convert_to_performer, load_source, public_source_name
from .fidelity import fidelity_report


TEXT_DATA = "text"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``distill`` subcommand to ``subparsers``."""
    from hf_performer.tasks.data import TASKS as DATA_TASKS

    parser = subparsers.add_parser(
        "distill",
        help="convert with a learned feature map (hedgehog, t2r) trained by attention transfer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", metavar="SOURCE", help="folder (or offline Hub name) of the softmax model (the teacher)")
    parser.add_argument("output", metavar="OUTPUT", help="folder to write the Performer model to")
    parser.add_argument("--feature-map", default="hedgehog", choices=available_feature_maps(),
                        help="feature map; it must have trainable parameters (default: %(default)s)")
    parser.add_argument("--feature-map-init", choices=LEARNED_MAP_INITS, default=None,
                        help="initial projection of the learned map (default: the map's own, "
                             f"{default_feature_map_init('hedgehog')} for hedgehog: it fits better after transfer "
                             "than identity, the Hedgehog paper's start)")
    parser.add_argument("--nb-features", type=int, default=None,
                        help="features per head (default: the map's own, 2 * head_dim for hedgehog); more features fit the "
                             "softmax better and cost more per token (on MiniLM-L6, head_dim 32, STS-B after "
                             "transfer: 64 -> 67.2, 128 -> 72.5, 256 -> 76.8 dev Pearson)")
    parser.add_argument("--task", choices=TASKS, default=None,
                        help="model head to build (default: the task of the class the checkpoint was saved from)")
    parser.add_argument("--keep-softmax-layers", type=int, nargs="+", default=[], metavar="LAYER",
                        help="layers that keep exact softmax attention (not transferred)")
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
    parser.add_argument("--loss", choices=LOSSES, default="both",
                        help="weights: KL of the attention weights (Hedgehog); output: MSE of the attention outputs "
                             "(LoLCATs); both (default)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_distill)
    return parser


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def _split_indices(size: int, train: int, held_out: int, seed: int) -> tuple[list[int], list[int]]:
    """Disjoint seeded random samples of ``train`` and ``held_out`` indices out of ``size``."""
    order = np.random.default_rng(seed).permutation(size)
    return sorted(order[:train].tolist()), sorted(order[train:train + held_out].tolist())


def load_transfer_sequences(data: str, data_task: str, tokenizer, max_length: int, max_samples: int,
                            fidelity_samples: int, seed: int) -> tuple[list[dict], list[str]]:
    """Tokenised transfer sequences and held-out texts for the fidelity report.

    Returns:
        ``(encodings, fidelity_texts)``: ``encodings`` are dicts of id lists (``input_ids``, ``attention_mask``,
        ``token_type_ids`` when the tokenizer makes them), at most ``max_samples``.
    """
    from hf_performer.tasks.data import load_lm_text, load_task_file, tokenize_lm_text

    if data_task == TEXT_DATA:
        ids = tokenize_lm_text(load_lm_text(data), tokenizer)
        blocks = [ids[i:i + max_length] for i in range(0, len(ids) - max_length + 1, max_length)]
        if not blocks:
            raise ConversionError(f"{data} has {len(ids)} tokens, fewer than one block of {max_length}")
        train, held_out = _split_indices(len(blocks), max_samples, fidelity_samples, seed)
        encodings = [{"input_ids": blocks[i], "attention_mask": [1] * len(blocks[i])} for i in train]
        texts = [tokenizer.decode(blocks[i]) for i in held_out]
        return encodings, texts
    from hf_performer.tasks.data import get_task

    spec = get_task(data_task)
    dataset = load_task_file(data, spec)
    train, held_out = _split_indices(len(dataset), max_samples, fidelity_samples, seed)
    rows = dataset.select(train)
    columns = [list(rows[column]) for column in spec.text_columns]
    encoded = tokenizer(*columns, truncation=True, max_length=max_length)
    encodings = [{key: encoded[key][i] for key in encoded} for i in range(len(rows))]
    texts = list(dataset.select(held_out)[spec.text_columns[0]])
    return encodings, texts


def make_batches(encodings: list[dict], tokenizer, batch_size: int, seed: int) -> list[dict]:
    """Padded tensor batches of the encodings, in a seeded random order."""
    order = np.random.default_rng(seed).permutation(len(encodings)).tolist()
    batches = []
    for start in range(0, len(order), batch_size):
        chunk = [encodings[i] for i in order[start:start + batch_size]]
        batches.append(dict(tokenizer.pad(chunk, return_tensors="pt")))
    return batches


# --------------------------------------------------------------------------------------------
# Command
# --------------------------------------------------------------------------------------------


def _layer_table(before, after, transfer_before, transfer_after) -> str:
    lines = [
        "layer  attention  rel. error before  rel. error after  weights KL before  weights KL after",
    ]
    transferred = {int(k) for k in transfer_after}
    for old, new in zip(before.layers, after.layers):
        kl_before = transfer_before.get(old.layer, {}).get("weights_kl")
        kl_after = transfer_after.get(old.layer, {}).get("weights_kl")
        kind = new.attention if new.attention != "favor" or old.layer in transferred else "favor (fixed)"
        lines.append(
            f"{old.layer:>5}  {kind:<9}  {old.own_inputs_relative_error:>17.4f}  {new.own_inputs_relative_error:>16.4f}"
            f"  {_fmt(kl_before):>17}  {_fmt(kl_after):>16}"
        )
    lines.append(
        f"final hidden-state cosine: {before.final_hidden_state_cosine:.4f} before, "
        f"{after.final_hidden_state_cosine:.4f} after"
    )
    return "\n".join(lines)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def run_distill(args: argparse.Namespace) -> int:
    """Run ``hf-performer distill`` (see :func:`add_parser`). Returns the exit status."""
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
        options = {} if args.feature_map_init is None else {"init": args.feature_map_init}
        max_position_embeddings = position_table_size(args, source)
        try:
            performer = convert_to_performer(
                source, task=args.task, feature_map=args.feature_map, nb_features=args.nb_features,
                keep_softmax_layers=args.keep_softmax_layers, max_position_embeddings=max_position_embeddings,
                seed=args.seed, feature_map_options=options,
            )
        except TypeError as error:
            raise ConversionError(str(error)) from None
        encodings, fidelity_texts = load_transfer_sequences(
            args.data, args.data_task, tokenizer, args.max_length, args.max_samples, args.fidelity_samples, args.seed
        )
        batches = make_batches(encodings, tokenizer, args.batch_size, args.seed)
        steps = args.steps if args.steps is not None else len(batches)
        before = fidelity_report(source, performer, tokenizer, texts=fidelity_texts, max_length=args.max_length)
        held_out = make_batches(
            [dict(tokenizer(t, truncation=True, max_length=args.max_length)) for t in fidelity_texts],
            tokenizer, args.batch_size, args.seed,
        )
        result = transfer_attention(performer, batches, steps=steps, learning_rate=args.learning_rate,
                                    loss=args.loss, evaluation_batches=held_out, progress=not args.no_progress)
        after = fidelity_report(source, performer, tokenizer, texts=fidelity_texts, max_length=args.max_length)
    except (ConversionError, AttentionTransferError, ValueError) as error:
        raise SystemExit(f"hf-performer distill: error: {error}") from None
    wall_time = time.perf_counter() - started

    # Meant for the Hub: paths are reduced to base names (Hub ids are kept).
    command = [public_source_name(arg) if os.path.isabs(arg) or os.path.exists(arg) else arg for arg in sys.argv[2:]]
    record = {
        "source": public_source_name(args.source),
        "feature_map": args.feature_map,
        "favor_settings": dict(performer.config.favor_settings),
        "data": {"file": public_source_name(args.data), "layout": args.data_task, "sequences": len(encodings),
                 "max_length": args.max_length, "batch_size": args.batch_size, "seed": args.seed,
                 "fidelity_sequences": len(fidelity_texts)},
        "transfer": result.to_dict(),
        "fidelity_before": before.to_dict(),
        "fidelity_after": after.to_dict(),
        "wall_time_s": round(wall_time, 2),
        "command": "hf-performer distill " + " ".join(command) if sys.argv[1:2] == ["distill"] else None,
    }
    with staged_folder(output) as staging:
        performer.save_pretrained(staging)
        if max_position_embeddings is not None:
            tokenizer.model_max_length = max_position_embeddings
        tokenizer.save_pretrained(staging)
        after.save(staging)
        with open(os.path.join(staging, TRANSFER_FILE_NAME), "w") as handle:
            json.dump(record, handle, indent=2)
        write_model_card(staging, report=after, model_name=os.path.basename(output), transfer=record)

    print(_layer_table(before, after, result.layer_losses_before, result.layer_losses_after))
    print(f"\nattention transfer: {steps} steps on {len(encodings)} sequences in {wall_time:.1f} s; wrote {output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the distill subcommand alone (``python -m hf_performer.conversion.distill SOURCE OUTPUT ...``)."""
    parser = argparse.ArgumentParser(prog="hf-performer")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["distill", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
