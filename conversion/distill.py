"""The library side of ``hf-performer distill`` (the verb and its output folder: :mod:`hf_performer.cli.distill`).

* :func:`load_transfer_sequences`: a seeded sample of tokenised sequences from raw text or a task file, and
  held-out texts for the fidelity report before / after transfer;
* :func:`make_batches`: padded tensor batches in a seeded order;
* :func:`transfer_and_measure`: attention transfer on those batches, with the fidelity report before and after;
* :func:`format_layer_table`: the per-layer table (fidelity and attention-weights KL before -> after).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .attention_transfer import AttentionTransferResult, transfer_attention
from .convert import ConversionError
from .defaults import TEXT_DATA
from .fidelity import FidelityReport, fidelity_report


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
# Transfer
# --------------------------------------------------------------------------------------------


@dataclass
class TransferRun:
    """What :func:`transfer_and_measure` did: the fidelity reports ``before`` / ``after`` transfer, the
    ``transfer`` result, the number of optimizer ``steps``, of training ``sequences`` and of held-out
    ``fidelity_sequences``."""

    before: FidelityReport
    after: FidelityReport
    transfer: AttentionTransferResult
    steps: int
    sequences: int
    fidelity_sequences: int


def transfer_and_measure(source, performer, tokenizer, data: str, data_task: str = TEXT_DATA, *, max_length: int = 128,
                         max_samples: int = 512, fidelity_samples: int = 32, batch_size: int = 16,
                         steps: int | None = None, learning_rate: float = 1e-2, loss: str = "both", seed: int = 0,
                         progress: bool = True) -> TransferRun:
    """Train ``performer``'s learned feature maps to mimic ``source``'s softmax attention on a seeded sample of
    ``data`` (:func:`load_transfer_sequences`), ``steps`` optimizer steps (default: one pass), and measure the
    fidelity against ``source`` on held-out sequences before and after.

    Raises:
        ConversionError, AttentionTransferError, ValueError: the data or the settings do not fit.
    """
    encodings, fidelity_texts = load_transfer_sequences(
        data, data_task, tokenizer, max_length, max_samples, fidelity_samples, seed
    )
    batches = make_batches(encodings, tokenizer, batch_size, seed)
    steps = steps if steps is not None else len(batches)
    before = fidelity_report(source, performer, tokenizer, texts=fidelity_texts, max_length=max_length)
    held_out = make_batches(
        [dict(tokenizer(t, truncation=True, max_length=max_length)) for t in fidelity_texts],
        tokenizer, batch_size, seed,
    )
    result = transfer_attention(performer, batches, steps=steps, learning_rate=learning_rate,
                                loss=loss, evaluation_batches=held_out, progress=progress)
    after = fidelity_report(source, performer, tokenizer, texts=fidelity_texts, max_length=max_length)
    return TransferRun(before, after, result, steps, len(encodings), len(fidelity_texts))


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def format_layer_table(before, after, transfer_before, transfer_after) -> str:
    """The per-layer table of ``hf-performer distill``: the fidelity reports ``before`` / ``after`` transfer and
    the transfer losses (``{layer: {"weights_kl": ...}}``) before / after."""
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
