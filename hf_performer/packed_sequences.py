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


GROUP_PADDING = 0.25
"""The most padding :class:`SegmentRows` adds to a group of sequences, as a share of the group's tokens: sequences
of similar lengths share one padded call, very different ones do not (one call per sequence at most)."""


class SegmentRows:
    """Packed sequences as separate right-padded rows, and back: the window operator's way to packed batches (each
    sequence alone, with the operator's guarantee that a padded row behaves as alone).

    ``segment_ids`` ``[B, L]`` (``0`` = padding, ``1, 2, ...`` = the sequences of a row, in order) give ``S``
    sequences, gathered into :attr:`groups` of similar lengths (longest first; a group's rows are padded to its
    longest sequence by at most ``max_padding`` of its tokens in all, so that the padding computed stays a bounded
    share of the tokens whatever the mix of lengths; ``None``: one group padded to the longest). For group ``g``
    of ``S_g`` sequences of at most ``L_g`` tokens: :meth:`split` ``[B, H, L, d] -> [S_g, H, L_g, d]``,
    :meth:`key_padding_mask` ``[S_g, L_g]`` its tokens (``None`` when no row of the group is padded); then
    :meth:`merge` ``[S_g, L_g, H, d]`` per group ``-> [B, L, H, d]`` (padding positions 0) and
    :meth:`merge_weights` ``[S_g, H, L_g, L_g]`` per group ``-> [B, H, L, L]`` (block diagonal). Gradients flow
    through all of them.
    """

    def __init__(self, segment_ids: torch.Tensor, max_padding: float | None = GROUP_PADDING):
        batch, length = segment_ids.shape
        device = segment_ids.device
        self.batch, self.length = batch, length
        token = segment_ids != 0
        row_keys = torch.arange(batch, device=device)[:, None] * (length + 1) + segment_ids
        self.positions = torch.arange(batch * length, device=device).view(batch, length)[token]
        _, counts = torch.unique_consecutive(row_keys[token], return_counts=True)
        self.count = counts.numel()
        self.segment = torch.repeat_interleave(torch.arange(self.count, device=device), counts)
        starts = counts.cumsum(0) - counts
        self.offset = torch.arange(self.positions.numel(), device=device) - starts[self.segment]
        lengths = counts.tolist()
        self.groups = _length_groups(lengths, max_padding)
        self.lengths = [max((lengths[i] for i in group), default=0) for group in self.groups]
        # each sequence's group and row in it; each group's tokens (indices into `positions`)
        group_of, row_of = [0] * self.count, [0] * self.count
        for g, group in enumerate(self.groups):
            for row, sequence in enumerate(group):
                group_of[sequence], row_of[sequence] = g, row
        token_group = torch.tensor(group_of, dtype=torch.long, device=device)[self.segment]
        self.row = torch.tensor(row_of, dtype=torch.long, device=device)[self.segment]
        self.tokens = [(token_group == g).nonzero().flatten() for g in range(len(self.groups))]

    def split(self, tensor: torch.Tensor, group: int) -> torch.Tensor:
        """``[B, H, L, d]`` -> ``[S_g, H, L_g, d]`` (zeros after each sequence)."""
        heads, dim = tensor.shape[1], tensor.shape[-1]
        index = self.tokens[group]
        tokens = tensor.transpose(1, 2).reshape(self.batch * self.length, heads, dim)[self.positions[index]]
        rows = tensor.new_zeros(len(self.groups[group]), self.lengths[group], heads, dim)
        rows = rows.index_put((self.row[index], self.offset[index]), tokens)
        return rows.transpose(1, 2)

    def key_padding_mask(self, group: int) -> torch.Tensor | None:
        """``[S_g, L_g]`` bool, ``True`` on each sequence's tokens; ``None`` when the group's rows are all full."""
        index = self.tokens[group]
        if index.numel() == len(self.groups[group]) * self.lengths[group]:
            return None
        mask = torch.zeros(len(self.groups[group]), self.lengths[group], dtype=torch.bool, device=index.device)
        mask[self.row[index], self.offset[index]] = True
        return mask

    def merge(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """``[S_g, L_g, H, d]`` for each group -> ``[B, L, H, d]`` (the packed layout; padding positions 0)."""
        merged = rows[0].new_zeros(self.batch * self.length, *rows[0].shape[2:])
        for index, group_rows in zip(self.tokens, rows):
            merged = merged.index_put((self.positions[index],), group_rows[self.row[index], self.offset[index]])
        return merged.view(self.batch, self.length, *rows[0].shape[2:])

    def merge_weights(self, weights: list[torch.Tensor | None]) -> torch.Tensor | None:
        """``[S_g, H, L_g, L_g]`` for each group -> ``[B, H, L, L]``: each sequence's weights on its block, 0
        across."""
        if any(w is None for w in weights):
            return None
        heads = weights[0].shape[1]
        merged = weights[0].new_zeros(self.batch, self.length, self.length, heads)
        for index, group_weights in zip(self.tokens, weights):
            positions, row, offset = self.positions[index], self.row[index], self.offset[index]
            rows, columns = positions // self.length, positions % self.length
            same = self.segment[index][:, None] == self.segment[index][None, :]
            query_index, key_index = same.nonzero(as_tuple=True)
            values = group_weights[row[query_index], :, offset[query_index], offset[key_index]]
            merged = merged.index_put((rows[query_index], columns[query_index], columns[key_index]), values)
        return merged.permute(0, 3, 1, 2)


def _length_groups(lengths: list[int], max_padding: float | None) -> list[list[int]]:
    """Sequence indices grouped longest first: a group takes the next longest sequences while its rows, padded to
    its first (longest), hold at most ``max_padding`` times its tokens in padding (``None``: one group)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if max_padding is None:
        return [order]
    groups, start = [], 0
    while start < len(order):
        longest, total, end = lengths[order[start]], 0, start
        while end < len(order) and (end - start + 1) * longest <= (1 + max_padding) * (total + lengths[order[end]]):
            total += lengths[order[end]]
            end += 1
        groups.append(order[start:end])
        start = end
    return groups or [[]]
