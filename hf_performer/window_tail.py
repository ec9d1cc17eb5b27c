"""The linear tail of window attention: sums ``sum_j phi(k_j) exp(lk_j - K) [v_j, 1]`` over key sets, stabilised.

With key features ``phi(k_j) = values_j exp(lk_j)`` (:class:`~.feature_maps.Features`), a tail sum over a key set
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


def _running_key_max(log_scale_k, eligible, start_max):
    """Key log-scales ``[B, H, L]`` with non-eligible keys at ``-inf``, and their running maximum (detached,
    at least ``start_max`` ``[B, H]``, the stabiliser of the keys before the sequence)."""
    floor = torch.finfo(log_scale_k.dtype).min
    masked_log_scale = log_scale_k.masked_fill(~eligible[:, None, :], float("-inf"))
    running_max = torch.maximum(masked_log_scale.detach().cummax(dim=-1).values, start_max[..., None])
    return masked_log_scale, running_max.clamp_min(floor)


def _fold_keys(state, state_max, key_weights, masked_log_scale, value_ones, start, end, new_max):
    """``state`` ``[B, H, m, e]`` (relative to ``state_max`` ``[B, H]``) plus the keys ``[start, end)``,
    relative to ``new_max`` ``[B, H]`` (``>=`` both ``state_max`` and those keys' log-scales)."""
    rescale = (masked_log_scale[..., start:end] - new_max[..., None]).exp()  # [B, H, n]
    added = torch.matmul((key_weights[:, :, start:end] * rescale[..., None]).transpose(-1, -2),
                         value_ones[:, :, start:end])
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
    state_end = 0  # the state holds the keys [0, state_end)
    tails = []
    for start in range(query_start, length, chunk_size):
        end = min(start + chunk_size, length)
        rows = slice(start - query_start, end - query_start)
        # First key the state does not hold. Continuing a state, the first block takes the recent keys as
        # a tile (one decoded token: O(L m), not O(L m dv)).
        boundary = state_end if 0 < query_start == start else min(max(start - offset + 1, 0), length)
        if boundary > state_end:  # fold keys [state_end, boundary) into the state
            new_max = running_max[..., boundary - 1]
            state = _fold_keys(state, state_max, key_weights, masked_log_scale, value_ones, state_end, boundary,
                               new_max)
            state_max, state_end = new_max, boundary
        k_max = query_max[:, :, rows]  # [B, H, C]
        out = torch.matmul(phi_q[:, :, rows], state) * (state_max[..., None] - k_max).exp()[..., None]
        tile_end = min(max(end - offset, 0), length)  # keys [state_end, tile_end) are needed by some query
        if tile_end > state_end:
            keys = positions[state_end:tile_end]
            allowed = keys[None, :] <= positions[start:end, None] - offset  # [C, n]
            decay = (masked_log_scale[:, :, None, state_end:tile_end] - k_max[..., None]).exp()  # [B, H, C, n]
            decay = decay.masked_fill(~allowed, 0.0)
            tile = torch.matmul(phi_q[:, :, rows], key_weights[:, :, state_end:tile_end].transpose(-1, -2))
            out = out + torch.matmul(tile * decay, value_ones[:, :, state_end:tile_end])
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
    return _fold_keys(empty, empty_max, key_weights, masked_log_scale, value_ones, 0, length, new_max), new_max


def _merge_tail_sums(first, second):
    """The tail sum over two disjoint key sets, each ``(sum [B, H, m, e], K [B, H])``."""
    (first_sum, first_max), (second_sum, second_max) = first, second
    new_max = torch.maximum(first_max, second_max)
    return (first_sum * (first_max - new_max).exp()[..., None, None]
            + second_sum * (second_max - new_max).exp()[..., None, None]), new_max
