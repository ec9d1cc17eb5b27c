"""Padding-free packed batches for favor attention: several sequences in one row, the state restarting at each.

transformers marks packed rows in two ways, both handled here:

* ``position_ids`` restarting inside a row (``DataCollatorWithFlattening``) without a 2-D attention mask and without
  a cache: ``create_causal_mask`` then asks the mask builder for a "packed sequence" pattern
  (:func:`packed_segment_ids` recognises it);
* ``cu_seq_lens_q`` / ``cu_seq_lens_k`` keyword arguments (``DataCollatorWithFlattening(return_flash_attn_kwargs=
  True)``), passed on to the attention function (:func:`segment_ids_from_cu_seq_lens`).

The favor mask builder hands packed rows to the attention function as a 2-D *integer* mask of segment ids: ``0`` for
padding and ``1, 2, ...`` for the tokens of the first, second, ... sequence of the row. A 0/1 key padding mask is the
special case of one sequence, so every 2-D mask keeps its meaning (:func:`split_segment_ids`).

This module imports only ``torch`` and its sibling ``linear_attention``: it is copied next to saved models for ``trust_remote_code``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .linear_attention import FavorMaskError


def packed_segment_ids(
    mask_function: Callable,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor | None:
    """Segment ids ``[batch_size, kv_length]`` (int64, ``0`` = padding, ``>= 1`` = sequence) if ``mask_function``
    is causal attention within consecutive blocks of tokens (packed sequences, or chunked attention), else ``None``.

    Recognised on ``O(L)`` pairs, without building the ``L x L`` mask: a block starts at ``i`` where ``i`` may not
    see ``i - 1``; then every ``i`` must see itself and its block's start, and see neither ``i + 1`` nor the token
    before its block's start. Only prefill-like calls (``q_length == kv_length``, no offset) can be packed.

    Args:
        mask_function: transformers' ``(batch_idx, head_idx, q_idx, kv_idx) -> bool`` mask function.
        attention_mask: optional 2-D key padding mask ``[batch_size, >= kv_length]`` (``True``/1 = token).
    """
    if q_length != kv_length or q_offset != 0 or kv_length < 2:
        return None
    batch = torch.arange(batch_size, device=device)[:, None]
    head = torch.zeros((), dtype=torch.long, device=device)
    positions = torch.arange(kv_length, device=device)[None, :]
    last = kv_length - 1

    def allowed(kv_index: torch.Tensor) -> torch.Tensor:
        result = mask_function(batch, head, positions, kv_index.clamp(0, last))
        # contiguous: a mask function that does not depend on the batch gives a broadcast view, written to below
        return torch.as_tensor(result, device=positions.device).to(torch.bool).expand(batch_size, kv_length).contiguous()

    sees_previous = allowed(positions - 1)
    sees_previous[:, 0] = False
    starts_block = ~sees_previous
    segment_ids = starts_block.long().cumsum(-1)  # 1, 2, ...
    block_start = torch.cummax(torch.where(starts_block, positions, 0).expand(batch_size, -1), dim=-1).values
    sees_next = allowed(positions + 1)
    sees_next[:, last] = False
    before_start = allowed(block_start - 1) & (block_start > 0)
    if not bool((allowed(positions) & allowed(block_start) & ~sees_next & ~before_start).all()):
        return None
    if attention_mask is not None:
        segment_ids = segment_ids.masked_fill(~attention_mask[:, -kv_length:].to(torch.bool), 0)
    return segment_ids


def segment_ids_from_cu_seq_lens(cu_seq_lens: torch.Tensor, batch_size: int, length: int) -> torch.Tensor | None:
    """Segment ids ``[1, length]`` (``1, 2, ...``) from cumulative sequence lengths ``[0, l1, l1 + l2, ..., length]``
    (flash-attention style, one packed row); ``None`` if they do not describe one row of ``length`` tokens."""
    cu_seq_lens = cu_seq_lens.flatten().long()
    if batch_size != 1 or cu_seq_lens.numel() < 2 or int(cu_seq_lens[0]) != 0 or int(cu_seq_lens[-1]) != length:
        return None
    lengths = cu_seq_lens.diff()
    ids = torch.arange(1, lengths.numel() + 1, device=cu_seq_lens.device)
    return ids.repeat_interleave(lengths).unsqueeze(0)


def split_segment_ids(attention_mask) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(segment_ids, attention_mask)``: a 2-D integer mask holding ids above 1 is a packed-sequence mask, returned
    as segment ids with its key padding mask (``ids != 0``); anything else is returned unchanged with ``None``."""
    if (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 2
        and attention_mask.dtype not in (torch.bool,)
        and not attention_mask.is_floating_point()
        and bool((attention_mask > 1).any())
    ):
        if bool((attention_mask < 0).any()):
            return None, attention_mask  # not segment ids: left to the mask checks, which raise
        return attention_mask, attention_mask != 0
    return None, attention_mask


def packed_sequences_of(attention_mask, query: torch.Tensor, kwargs: dict):
    """``(segment_ids [B, L] or None, attention_mask)``: packed sequences given by the favor mask builder's segment
    ids, or by ``cu_seq_lens_q`` keyword arguments (one packed row, no mask); see :mod:`.packed_sequences`."""
    segment_ids, attention_mask = split_segment_ids(attention_mask)
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if segment_ids is None and attention_mask is None and isinstance(cu_seq_lens, torch.Tensor):
        segment_ids = segment_ids_from_cu_seq_lens(cu_seq_lens, query.shape[0], query.shape[2])
        if segment_ids is None:
            raise FavorMaskError(
                f"favor attention: cu_seq_lens_q {cu_seq_lens.tolist()} does not describe one packed row of "
                f"{query.shape[2]} tokens (batch {query.shape[0]}); pass cumulative lengths [0, ..., {query.shape[2]}]"
            )
    return segment_ids, attention_mask
