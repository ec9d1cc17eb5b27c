"""The state of a causal window layer at its chunk boundaries: the tail sums and, with a sparse cache, the kept keys
that every block of a call starts from (:func:`boundary_states`): without a cache one prefix product over the tiles,
with one the selection boundary by boundary (:func:`~.window_sparse_cache.select_hard_keys`) or, on the parallel
path without a tail, every boundary in one kernel (:mod:`.window_selection_kernel`). :mod:`.window_causal` runs the
blocks from these states.

This module imports only ``torch`` and its siblings ``feature_maps``, ``linear_attention``,
``linear_attention_parallel``, ``window_block_operands``, ``window_selection_kernel``, ``window_sparse_cache`` and
``window_state``.
"""

from __future__ import annotations

import torch

from .feature_maps import Features
from .linear_attention import _with_ones_column
from .linear_attention_parallel import attention_path
from .window_block_operands import record_for_reuse, take_reused
from .window_selection_kernel import kernel_applies, select_without_tail
from .window_sparse_cache import attention_scores, empty_tail_sum, select_hard_keys
from .window_state import CommittedTail


def tail_key_features(feature_map, key, root):
    """The key features a window layer sums: its map's, or without a map (no linear tail) the constant feature 1,
    which the sparse cache's selection then uses (its recall error is the distance to the mean value)."""
    if feature_map is None:
        return Features(key.new_ones(key.shape[:-1] + (1,)), None)
    return feature_map.key_features(key * root)


def _stack_tails(tails):
    return torch.stack([t[0] for t in tails], dim=2), torch.stack([t[1] for t in tails], dim=2)


def entering_tail(state, batch, kv_heads, head_dim, value_dim, features, dtype, key, value, device) -> CommittedTail:
    """The committed tail a call continues from: the checkpoint when rollbacks are kept (the call replays from it),
    else the current tail; an empty one (at boundary -1, no cache, no sums) without a state."""
    if state is not None:
        tail = state.oldest if (state.current is None or state.checkpoint is not None) else state.current
        return tail._replace(tail_sums=tail.tail_sums.to(dtype), cache_key=tail.cache_key.to(key.dtype),
                             cache_value=tail.cache_value.to(value.dtype))
    sums, tail_max = empty_tail_sum(batch, kv_heads, features, value_dim + 1, key.new_zeros((), dtype=dtype))
    empty = torch.zeros(batch, kv_heads, 0, dtype=torch.long, device=device)
    return CommittedTail(
        boundary=torch.full((batch,), -1, dtype=torch.long, device=device),
        cache_key=key.new_zeros(batch, kv_heads, 0, head_dim), cache_value=value.new_zeros(batch, kv_heads, 0, value_dim),
        cache_position=empty, cache_valid=empty.bool(), tail_sums=sums, tail_max=tail_max)


def boundary_states(entering, tile_features, tile_value_ones, tile_keep, tile_key, commit_block, n_first, blocks, size,
                capacity, selection_map, root, eps, boundary_query=None, span=1):
    """The tail sums and sparse cache at each block's boundary, ``n_first .. n_first + blocks - 1``.

    ``boundary_query``: ``None`` (the recall-error selection), or for the attention selection each block's boundary
    query, scaled, ``[B, Hkv, g, blocks, d]`` (:func:`~.window_sparse_cache.attention_scores`); ``span``: each score
    averaged over that many candidates before ranking (:func:`~.window_sparse_cache.span_mean`).

    Returns ``tails`` ``(sums [B, Hkv, blocks, m, dv + 1], K [B, Hkv, blocks])`` and ``caches``, ``None`` without a
    cache, else ``(key, value_ones, position, valid)`` per block ``[B, Hkv, blocks, G, .]``. Rows whose committed
    boundary is at or after a block keep what they entered with (their tiles there were folded by an earlier call).
    """
    batch, kv_heads = tile_key.shape[:2]
    features, log_scale = tile_features
    entering_tail = (entering.tail_sums, entering.tail_max)
    block_ids = n_first + torch.arange(blocks, device=tile_key.device)
    # Tile k is folded (or a candidate) at the boundary of block k + 1, for rows that had not committed it yet.
    new_at = (commit_block[:, None] < block_ids[None, :] + 1)  # [B, blocks]
    candidate_keep = tile_keep.view(batch, blocks, size) & new_at[..., None]
    if capacity == 0:
        return _prefix_tails(entering_tail, features, log_scale, tile_value_ones, candidate_keep, blocks, size), None

    # The pool of tokens a cache slot may hold: the entering cache's slots, then the tiles.
    pool_values = torch.cat([_with_ones_column(entering.cache_value.to(features.dtype)), tile_value_ones], dim=2)
    pool_keys = torch.cat([entering.cache_key.to(tile_key.dtype), tile_key], dim=2)
    # Without a tail the selection (and the tail sums it keeps for the next one) take no gradient to the output: a
    # segment's recomputation takes what its forward chose (window_block_operands.reused_outputs).
    reusable = selection_map is None
    reused = take_reused((batch, kv_heads, blocks, capacity), kind="selection") if reusable else None
    if reused is not None:
        index, valid, tail_sums, tail_max = reused
        return (tail_sums, tail_max), _cache_at(pool_keys, pool_values, index, valid)
    cache_features = tail_key_features(selection_map, entering.cache_key.to(features.dtype), root)
    pool_features = torch.cat([cache_features.values, features], dim=2)
    pool_log_scale = None if log_scale is None else torch.cat([cache_features.log_scale, log_scale], dim=2)
    slots = entering.cache_key.shape[2]
    index = torch.arange(slots, device=tile_key.device).expand(batch, kv_heads, slots)
    valid = entering.cache_valid
    if slots < capacity:  # a fresh state: empty slots
        index = torch.cat([index, index.new_zeros(batch, kv_heads, capacity - slots)], dim=-1)
        valid = torch.cat([valid, valid.new_zeros(batch, kv_heads, capacity - slots)], dim=-1)
    if (selection_map is None and boundary_query is None and span == 1 and kernel_applies(pool_values)
            and attention_path(tile_key) == "parallel"):
        # Without a tail, every boundary in one kernel launch (the loop below is its reference).
        index, valid, sums = select_without_tail(pool_values, index, valid, entering_tail[0], candidate_keep, new_at,
                                                 slots=slots, capacity=capacity, size=size, eps=eps)
        tails = (sums, entering_tail[1][:, :, None].expand(-1, -1, blocks))
        if reusable:
            record_for_reuse(index, valid, *(t.detach() for t in tails), kind="selection")
        return tails, _cache_at(pool_keys, pool_values, index, valid)
    tail = entering_tail
    indices, valids, tails = [index], [valid], [tail]
    for block in range(1, blocks):
        tile_index = slots + (block - 1) * size + torch.arange(size, device=tile_key.device)
        candidates = torch.cat([index, tile_index.expand(batch, kv_heads, size)], dim=-1)
        candidate_valid = torch.cat([valid, candidate_keep[:, None, block - 1].expand(-1, kv_heads, -1)], dim=-1)
        gathered = [gather_slots(pool_features, candidates), None if pool_log_scale is None else
                    pool_log_scale.gather(2, candidates), gather_slots(pool_values, candidates)]
        scores = None if boundary_query is None else attention_scores(
            boundary_query[:, :, :, block], gather_slots(pool_keys, candidates), candidate_valid, 1.0)
        new_tail, kept, kept_valid = select_hard_keys(tail, gathered[0], gathered[1], gathered[2], candidate_valid,
                                                      capacity, eps, scores, span)
        active = new_at[:, block - 1]
        index = torch.where(active[:, None, None], candidates.gather(-1, kept), index)
        valid = torch.where(active[:, None, None], kept_valid, valid)
        tail = (torch.where(active[:, None, None, None], new_tail[0], tail[0]),
                torch.where(active[:, None], new_tail[1], tail[1]))
        indices.append(index)
        valids.append(valid)
        tails.append(tail)
    index, valid, tails = torch.stack(indices, dim=2), torch.stack(valids, dim=2), _stack_tails(tails)
    if reusable:
        record_for_reuse(index, valid, *(t.detach() for t in tails), kind="selection")
    return tails, _cache_at(pool_keys, pool_values, index, valid)


def _cache_at(pool_keys, pool_values, index, valid):
    """The sparse caches ``(key, value_ones, position, valid)`` of the blocks from their slots' pool indices ``index``
    ``[B, Hkv, blocks, G]`` (differentiable in the pools)."""
    flat = index.flatten(2)
    cache_keys = gather_slots(pool_keys, flat).unflatten(2, index.shape[2:])
    cache_values = gather_slots(pool_values, flat).unflatten(2, index.shape[2:])
    return cache_keys, cache_values, index, valid


def gather_slots(pool, index):
    """``pool`` ``[B, Hkv, P, e]`` at ``index`` ``[B, Hkv, n]``: ``[B, Hkv, n, e]`` (one ``index_select`` of whole rows:
    on the CPU several times faster than ``gather`` with an index expanded over ``e``)."""
    batch, heads, slots, width = pool.shape
    base = torch.arange(0, batch * heads * slots, slots, device=index.device).view(batch, heads, 1)
    rows = pool.reshape(batch * heads * slots, width).index_select(0, (index + base).flatten())
    return rows.view(*index.shape, width)


def _prefix_tails(entering_tail, features, log_scale, value_ones, candidate_keep, blocks, size):
    """Without a sparse cache every candidate folds: the tail sums at block ``k``'s boundary are the entering sums
    plus the tiles ``0 .. k - 1`` (``[B, Hkv, blocks, m, dv + 1]`` and ``[B, Hkv, blocks]``).

    Each tile's increment is taken relative to its own largest log-scale ``M_t``; the sums at ``k`` are relative to
    ``K_k = max(K_entering, M_0 .. M_{k-1})``, i.e. ``sum_{t < k} exp(M_t - K_k) I_t + exp(K_entering - K_k) S``:
    one ``[blocks, blocks]`` product over the increments (every exponent ``<= 0``), for every block at once."""
    batch, kv_heads = features.shape[:2]
    keep = candidate_keep[:, None].expand(-1, kv_heads, -1, -1)  # [B, Hkv, blocks, C]
    tile_features = features.view(batch, kv_heads, blocks, size, -1)
    tile_values = value_ones.view(batch, kv_heads, blocks, size, -1)
    weights = tile_features * keep[..., None].to(tile_features.dtype)
    entering_sums, entering_max = entering_tail
    block = torch.arange(blocks, device=features.device)
    earlier = block[:, None] > block[None, :]  # t < k
    if log_scale is None:
        increments = torch.matmul(weights.transpose(-1, -2), tile_values)  # [B, Hkv, blocks, m, dv + 1]
        # exclusive prefix over the blocks as one small matmul (cumsum along a middle dim, and its flipped
        # backward, cost more than the increments themselves)
        before = torch.matmul(earlier.to(increments.dtype), increments.flatten(3)).view_as(increments)
        return entering_sums[:, :, None] + before, entering_max[:, :, None].expand(-1, -1, blocks)
    floor = torch.finfo(features.dtype).min
    masked = log_scale.view(batch, kv_heads, blocks, size).masked_fill(~keep, float("-inf"))
    tile_max = masked.detach().amax(-1)  # M_t, -inf for a tile without candidates
    increments = torch.matmul((weights * (masked - tile_max.clamp_min(floor)[..., None]).exp()[..., None])
                              .transpose(-1, -2), tile_values)  # relative to M_t
    running = torch.cummax(tile_max, dim=-1).values
    stabilizer = torch.maximum(entering_max[..., None], torch.cat(
        [torch.full_like(running[..., :1], float("-inf")), running[..., :-1]], dim=-1)).clamp_min(floor)  # K_k
    between = torch.where(earlier, tile_max[..., None, :] - stabilizer[..., :, None], float("-inf")).exp()
    before = torch.matmul(between, increments.flatten(3)).view_as(increments)
    carried = (entering_max[..., None] - stabilizer).exp()[..., None, None]
    return entering_sums[:, :, None] * carried + before, stabilizer
