"""The linear tail of window attention: sums ``sum_j phi(k_j) exp(lk_j - K) [v_j, 1]`` over key sets, stabilised.

With key features ``phi(k_j) = values_j exp(lk_j)`` (:class:`~.feature_map_base.Features`), a tail sum over a key set
holds ``sum_j values_j exp(lk_j - K) [v_j, 1]`` ``[B, H, m, dv + 1]`` with ``K`` ``[B, H]`` the (detached) maximum
of the ``lk_j`` in the set (``finfo.min`` for an empty set): every term is ``<= ~1``, and two sums merge by
rescaling to the larger maximum. :func:`_tail_prefix` gives each query the sum over its keys ``j <= i - offset``
(a chunked scan), :func:`_tail_suffix` the sum over its keys ``j >= i + offset``; :func:`_tail_sum` and
:func:`_merge_tail_sums` give the sums over spans of keys that the memory-bounded bidirectional path
(:mod:`.window_segments`) carries between segments.

This module imports only ``torch``.
"""

from __future__ import annotations

import torch


class _Pieces(torch.autograd.Function):
    """Several ranges of one tensor along a dimension, with one backward: the gradients of all pieces land in one
    zero-filled tensor of the input's shape. A slice's own backward fills a whole input-shaped tensor per slice (and
    autograd then adds them up), which made the chunk loops' backward quadratic in the number of chunks."""

    @staticmethod
    def forward(ctx, x, dim, ranges):
        ctx.set_materialize_grads(False)
        ctx.shape, ctx.dim, ctx.ranges = x.shape, dim, ranges
        return tuple(x.narrow(dim, start, end - start) for start, end in ranges)

    @staticmethod
    def backward(ctx, *grads):
        grad = None
        for (start, end), piece in zip(ctx.ranges, grads):
            if piece is None:
                continue
            if grad is None:
                grad = piece.new_zeros(ctx.shape)
            grad.narrow(ctx.dim, start, end - start).add_(piece)
        return grad, None, None


def pieces(x: torch.Tensor, dim: int, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    """``[x.narrow(dim, start, end - start) for start, end in ranges]`` (views), with one backward for all of them
    when ``x`` needs gradients (:class:`_Pieces`). Ranges may overlap; ``end <= start`` is an empty piece."""
    dim = dim % x.dim()
    ranges = [(start, max(start, end)) for start, end in ranges]  # as slicing: a reversed range is empty
    if not (torch.is_grad_enabled() and x.requires_grad) or not ranges:
        return [x.narrow(dim, start, end - start) for start, end in ranges]
    return list(_Pieces.apply(x, dim, list(ranges)))


def _running_key_max(log_scale_k, eligible, start_max):
    """Key log-scales ``[B, H, L]`` with non-eligible keys at ``-inf``, and their running maximum (detached,
    at least ``start_max`` ``[B, H]``, the stabiliser of the keys before the sequence)."""
    floor = torch.finfo(log_scale_k.dtype).min
    masked_log_scale = log_scale_k.masked_fill(~eligible[:, None, :], float("-inf"))
    running_max = torch.maximum(masked_log_scale.detach().cummax(dim=-1).values, start_max[..., None])
    return masked_log_scale, running_max.clamp_min(floor)


def _fold_keys(state, state_max, key_weights, masked_log_scale, value_ones, new_max):
    """``state`` ``[B, H, m, e]`` (relative to ``state_max`` ``[B, H]``) plus the keys whose ``key_weights``
    ``[B, H, n, m]``, ``masked_log_scale`` ``[B, H, n]`` and ``value_ones`` ``[B, H, n, e]`` are given, relative to
    ``new_max`` ``[B, H]`` (``>=`` both ``state_max`` and those keys' log-scales)."""
    rescale = (masked_log_scale - new_max[..., None]).exp()  # [B, H, n]
    added = torch.matmul((key_weights * rescale[..., None]).transpose(-1, -2), value_ones)
    return state * (state_max - new_max).exp()[..., None, None] + added


def _tail_prefix(phi_q, phi_k, log_scale_k, value_ones, eligible, offset, chunk_size, initial=None):
    """Per query ``i`` the linear tail over the eligible keys ``j <= i - offset``, stabilised.

    Args:
        phi_q: feature values ``[B, H, Lq, m]`` of the queries at the last ``Lq`` of the ``L`` key positions
            (their log-scale is applied by the caller).
        phi_k: key feature values ``[B, H, L, m]``.
        log_scale_k: key log-scales ``[B, H, L]`` (zeros for maps without one).
        value_ones: ``[B, H, L, dv + 1]`` (values and a column of ones).
        eligible: ``[B, L]`` bool, keys that may enter the tail (unpadded, not sinks).
        offset: ``>= 0``; query ``i`` uses keys ``j <= i - offset``.
        initial: ``None`` or ``(state [B, H, m, dv + 1], stabiliser [B, H])``, sums over keys before the
            sequence that are in every query's tail.

    Returns:
        ``tail`` ``[B, H, Lq, dv + 1]`` = ``sum_j phi_q_i.phi_k_j exp(lk_j - K_i) [v_j, 1]`` and ``K``
        ``[B, H, Lq]``, the detached maximum of ``lk_j`` over those keys (``finfo.min`` if none).
    """
    batch, heads, length, features = phi_k.shape
    query_start = length - phi_q.shape[2]
    if initial is None:
        state = value_ones.new_zeros(batch, heads, features, value_ones.shape[-1])
        state_max = value_ones.new_full((batch, heads), torch.finfo(phi_k.dtype).min)
    else:
        state, state_max = initial
    masked_log_scale, running_max = _running_key_max(log_scale_k, eligible, state_max)
    positions = torch.arange(length, device=phi_q.device)
    # K_i = running_max[i - offset], the initial stabiliser before any key of the sequence.
    last_key = positions[query_start:] - offset
    query_max = torch.where(last_key >= 0, running_max[..., last_key.clamp_min(0)], state_max[..., None])
    key_weights = phi_k * eligible[:, None, :, None]
    # The plan: per query block, the keys folded into the state before it ([state_end, boundary)) and the keys
    # [boundary, tile_end) some of its queries need as a tile. Continuing a state, the first block takes the recent
    # keys as a tile (one decoded token: O(L m), not O(L m dv)).
    rows, folds, tiles = [], [], []
    state_end = 0  # the state holds the keys [0, state_end)
    for start in range(query_start, length, chunk_size):
        end = min(start + chunk_size, length)
        boundary = state_end if 0 < query_start == start else min(max(start - offset + 1, 0), length)
        folds.append((state_end, max(boundary, state_end)))
        state_end = max(boundary, state_end)
        tiles.append((state_end, max(min(max(end - offset, 0), length), state_end)))
        rows.append((start - query_start, end - query_start))
    # (weights, log-scales, values) of each fold's keys, then of each tile's keys
    key_pieces = list(zip(*(pieces(t, 2, folds + tiles) for t in (key_weights, masked_log_scale, value_ones))))
    fold_pieces, tile_pieces = key_pieces[:len(folds)], key_pieces[len(folds):]
    query_pieces = pieces(phi_q, 2, rows)
    tails = []
    for (row_start, row_end), (fold_start, fold_end), (tile_start, tile_end), fold, tile_keys, phi_q_block in zip(
            rows, folds, tiles, fold_pieces, tile_pieces, query_pieces):
        if fold_end > fold_start:  # fold keys [fold_start, fold_end) into the state
            new_max = running_max[..., fold_end - 1]
            state = _fold_keys(state, state_max, *fold, new_max)
            state_max = new_max
        k_max = query_max[:, :, row_start:row_end]  # [B, H, C] (detached)
        out = torch.matmul(phi_q_block, state) * (state_max[..., None] - k_max).exp()[..., None]
        if tile_end > tile_start:  # keys [tile_start, tile_end) are needed by some query of the block
            tile_weights, tile_log_scale, tile_values = tile_keys
            keys = positions[tile_start:tile_end]
            allowed = keys[None, :] <= positions[query_start + row_start:query_start + row_end, None] - offset  # [C, n]
            decay = (tile_log_scale[:, :, None, :] - k_max[..., None]).exp()  # [B, H, C, n]
            decay = decay.masked_fill(~allowed, 0.0)
            tile = torch.matmul(phi_q_block, tile_weights.transpose(-1, -2))
            out = out + torch.matmul(tile * decay, tile_values)
        tails.append(out)
    return torch.cat(tails, dim=2), query_max


def _tail_suffix(phi_q, phi_k, log_scale_k, value_ones, eligible, offset, chunk_size, initial=None):
    """Per query ``i`` the linear tail over the eligible keys ``j >= i + offset``: :func:`_tail_prefix` on the
    reversed sequence. Arguments as there, except that the queries sit at the *first* ``Lq`` of the ``L`` key
    positions and ``initial`` holds the keys *after* the sequence."""
    tail, tail_max = _tail_prefix(*(t.flip(2) for t in (phi_q, phi_k, log_scale_k, value_ones)), eligible.flip(1),
                                  offset, chunk_size, initial)
    return tail.flip(2), tail_max.flip(2)


def _tail_sum(phi_k, log_scale_k, value_ones, eligible):
    """The tail sum over the eligible keys of a span: ``phi_k`` ``[B, H, n, m]``, ``log_scale_k`` ``[B, H, n]``,
    ``value_ones`` ``[B, H, n, dv + 1]`` (zero rows where not eligible), ``eligible`` ``[B, n]`` (unpadded, not a
    sink). Returns ``(sum [B, H, m, dv + 1], K [B, H])``."""
    batch, heads, length, features = phi_k.shape
    empty_max = value_ones.new_full((batch, heads), torch.finfo(value_ones.dtype).min)
    masked_log_scale, running_max = _running_key_max(log_scale_k, eligible, empty_max)
    empty = value_ones.new_zeros(batch, heads, features, value_ones.shape[-1])
    if length == 0:
        return empty, empty_max
    key_weights = phi_k * eligible[:, None, :, None]
    new_max = running_max[..., -1]
    return _fold_keys(empty, empty_max, key_weights, masked_log_scale, value_ones, new_max), new_max


def _merge_tail_sums(first, second):
    """The tail sum over two disjoint key sets, each ``(sum [B, H, m, e], K [B, H])``."""
    (first_sum, first_max), (second_sum, second_max) = first, second
    new_max = torch.maximum(first_max, second_max)
    return (first_sum * (first_max - new_max).exp()[..., None, None]
            + second_sum * (second_max - new_max).exp()[..., None, None]), new_max
