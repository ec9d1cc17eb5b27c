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


class SegmentRows:
    """Packed sequences as separate right-padded rows, and back: the window operator's way to packed batches (each
    sequence alone, with the operator's guarantee that a padded row behaves as alone).

    ``segment_ids`` ``[B, L]`` (``0`` = padding, ``1, 2, ...`` = the sequences of a row, in order) give ``S``
    sequences, each a row of ``max_length`` positions: :meth:`split` ``[B, H, L, d] -> [S, H, max_length, d]``,
    :attr:`key_padding_mask` ``[S, max_length]`` its tokens, :meth:`merge` ``[S, max_length, H, d] -> [B, L, H, d]``
    (padding positions 0) and :meth:`merge_weights` ``[S, H, max_length, max_length] -> [B, H, L, L]`` (block
    diagonal). Gradients flow through all of them.
    """

    def __init__(self, segment_ids: torch.Tensor):
        batch, length = segment_ids.shape
        self.batch, self.length = batch, length
        token = segment_ids != 0
        row_keys = torch.arange(batch, device=segment_ids.device)[:, None] * (length + 1) + segment_ids
        self.positions = torch.arange(batch * length, device=segment_ids.device).view(batch, length)[token]
        _, counts = torch.unique_consecutive(row_keys[token], return_counts=True)
        self.count = counts.numel()
        self.max_length = int(counts.max()) if self.count else 0
        self.segment = torch.repeat_interleave(torch.arange(self.count, device=segment_ids.device), counts)
        starts = counts.cumsum(0) - counts
        self.offset = torch.arange(self.positions.numel(), device=segment_ids.device) - starts[self.segment]
        self.key_padding_mask = torch.zeros(self.count, self.max_length, dtype=torch.bool, device=segment_ids.device)
        self.key_padding_mask[self.segment, self.offset] = True

    def split(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[B, H, L, d]`` -> ``[S, H, max_length, d]`` (zeros after each sequence)."""
        heads, dim = tensor.shape[1], tensor.shape[-1]
        tokens = tensor.transpose(1, 2).reshape(self.batch * self.length, heads, dim)[self.positions]
        rows = tensor.new_zeros(self.count, self.max_length, heads, dim)
        rows = rows.index_put((self.segment, self.offset), tokens)
        return rows.transpose(1, 2)

    def merge(self, rows: torch.Tensor) -> torch.Tensor:
        """``[S, max_length, H, d]`` -> ``[B, L, H, d]`` (the packed layout; padding positions 0)."""
        tokens = rows[self.segment, self.offset]
        merged = rows.new_zeros(self.batch * self.length, *rows.shape[2:])
        merged = merged.index_put((self.positions,), tokens)
        return merged.view(self.batch, self.length, *rows.shape[2:])

    def merge_weights(self, weights: torch.Tensor | None) -> torch.Tensor | None:
        """``[S, H, max_length, max_length]`` -> ``[B, H, L, L]``: each sequence's weights on its block, 0 across."""
        if weights is None:
            return None
        heads = weights.shape[1]
        rows, columns = self.positions // self.length, self.positions % self.length
        same = self.segment[:, None] == self.segment[None, :]
        query_index, key_index = same.nonzero(as_tuple=True)
        values = weights[self.segment[query_index], :, self.offset[query_index], self.offset[key_index]]
        merged = weights.new_zeros(self.batch, self.length, self.length, heads)
        merged = merged.index_put((rows[query_index], columns[query_index], columns[key_index]), values)
        return merged.permute(0, 3, 1, 2)
