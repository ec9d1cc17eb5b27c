"""Causal window attention computed in blocks of ``C = chunk_size`` queries, all blocks at once.

Each row is cut at its *boundaries* (``row_start + k C``, :mod:`.window_sparse_cache`), so the operator works in a
per-row shifted frame where the boundaries are the multiples of ``C`` (a row is shifted by its first unpadded
position modulo ``C``; rows without left padding are not moved). Query block ``n`` (positions ``nC .. nC + C - 1`` of
that frame) then sees:

* exactly: the row's sinks, its sparse cache at boundary ``nC`` and the band ``i - w < j <= i``, one shared tile of
  ``C + w - 1`` keys per block (``[nC - w + 1, nC + C - 1]``);
* through the tail: the tail sums at ``nC`` (every folded token) plus the *pending* tokens ``nC - w < j <= i - w``
  (those that left the window since the boundary), the first ``C`` keys of the same tile under a strictly
  lower-triangular mask. With a sparse cache the pending tokens stay exact instead (they wait in the tile for the
  next selection, as in LoLA): the exact band is then ``nC - w < j <= i``, and the tail the sums alone.

Blocks are batched matrix products over ``[B, Hkv, blocks, g C, .]`` (the ``g`` query heads of a key head stacked,
so keys are never repeated). The sparse cache and the tail sums per boundary come from a loop over the boundaries
(:func:`~.window_sparse_cache.select_hard_keys`); without a cache they are one prefix sum.

Every tensor is float32 (float64 for float64 inputs) with autocast off. With ``c_i`` the largest exact score of a row,
``u_i`` the tail's log factor (``lq_i + K``) and the weights of :mod:`.window_attention`:
calibrated ``(E + T e^{u - c}) / .``, learned ``(gamma E + T e^{u}) / .``, both rescaled by ``e^{-rho}``,
``rho = max(0, exponent)`` (detached), so that no term overflows.

On the parallel path (CUDA, :func:`~.linear_attention_parallel.attention_path`) a call is one group of blocks, the
blocks without a tail one SDPA call (:func:`~.window_exact_blocks.attend_sdpa_blocks`) and the boundaries of a layer
without a tail one kernel (:mod:`.window_selection_kernel`).

The states at the chunk boundaries (tail sums, the sparse cache's selection) come from :mod:`.window_boundaries`.
This module imports only ``torch`` and its siblings ``feature_maps``, ``linear_attention``,
``linear_attention_parallel``, ``window_state``, ``window_sparse_cache``, ``window_boundaries``, ``window_tail_cap``,
``window_block_operands``, ``window_blocks`` and ``window_exact_blocks``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .feature_maps import compute_dtype_for
from .linear_attention import _no_autocast, _with_ones_column
from .linear_attention_parallel import attention_path, operand_dtype
from .window_block_operands import BlockOperands, BlockSpec
from .window_blocks import attend_blocks
from .window_boundaries import boundary_states, entering_tail, tail_key_features
from .window_exact_blocks import attend_exact_blocks, attend_sdpa_blocks, fused_exact_applies
from .window_sparse_cache import fold_into
from .window_state import CommittedTail, WindowAttentionState, buffer_capacity, last_tokens, row_sinks
from .window_tail_cap import eligible_up_to, tail_log_weights, tail_tokens


def _floor_div(x: torch.Tensor, divisor: int) -> torch.Tensor:
    return torch.div(x, divisor, rounding_mode="floor")


def rows_window(x: torch.Tensor, start, length: int, dim: int, fill=0):
    """``x[b, ..., start_b : start_b + length, ...]`` along ``dim`` for each row ``b`` (``start`` ``[B]`` long, or
    one ``int`` for every row), with ``fill`` where that range leaves ``x``; one ``narrow`` view when every row starts
    at the same place inside."""
    size = x.shape[dim]
    if isinstance(start, int):  # one start for every row: a view, padded with `fill` where it leaves x (no host read)
        low, high = min(max(start, 0), size), min(max(start + length, 0), size)
        inside = x.narrow(dim, low, high - low)
        if high - low == length:
            return inside
        pad = lambda count: x.new_full(x.shape[:dim] + (count,) + x.shape[dim + 1:], fill)  # noqa: E731
        before = min(max(-start, 0), length)
        return torch.cat([pad(before), inside, pad(length - before - (high - low))], dim=dim)
    first, last = int(start.min()), int(start.max())
    if first == last and first >= 0 and first + length <= size:
        return x.narrow(dim, first, length)
    index = start[:, None] + torch.arange(length, device=x.device)  # [B, length]
    inside = (index >= 0) & (index < size)
    shape = [x.shape[0]] + [1] * (x.dim() - 1)
    shape[dim] = length
    index = index.clamp(0, max(size - 1, 0)).view(shape)
    if size == 0:
        return x.new_full(x.shape[:dim] + (length,) + x.shape[dim + 1:], fill)
    picked = x.gather(dim, index.expand(x.shape[:dim] + (length,) + x.shape[dim + 1:]))
    return picked.masked_fill(~inside.view(shape), fill)


def _select_blocks(tensor, index, dim=2):
    """``tensor`` ``[B, Hkv, n, ...]`` at the per-row block ``index`` ``[B]`` along ``dim``: ``[B, Hkv, ...]``."""
    shape = list(tensor.shape)
    shape[dim] = 1
    view = [tensor.shape[0]] + [1] * (tensor.dim() - 1)
    return tensor.gather(dim, index.view(view).expand(shape)).squeeze(dim)


class _Call(NamedTuple):
    """What a block call prepares before attending (:func:`_prepare_call`): rows, blocks, layout, boundaries."""

    seen: int
    length: int
    sinks: tuple  # (key, value, position, valid) of the sink slots after the call
    row_start: torch.Tensor  # [B]
    offset: torch.Tensor  # [B], the shift of each row's frame
    entering: CommittedTail
    last_block: torch.Tensor  # [B], the block of each row's last query
    n_first: int
    n_query: int
    n_last: int
    local: tuple  # (key, value, keep, start): the buffer and the new tokens, absolute positions [start, seen + L)
    kept_before: torch.Tensor  # [B], the row's kept tokens before the local ones
    layout: tuple  # (key, value, keep) [B, Hkv, blocks C + w - 1, .] in the shifted frame
    tiles: tuple  # (features, value_ones, keep) of the first blocks C keys of the layout
    tails: tuple  # (sums [B, Hkv, blocks, m, dv + 1], K [B, Hkv, blocks])
    caches: tuple | None  # (key, value_ones, pool index, valid) [B, Hkv, blocks, G, .]
    uniform_offset: int | None = None  # the offset of every row when the host knows it (no state, no padding)


def _prepare_call(key, value, feature_map, *, length, window, sinks, sparse_cache, key_padding_mask, scaling, state,
                  chunk_size, eps, selection_query=None, span=1) -> _Call:
    """Sinks, rows, blocks, the layout and every boundary's tail sums and sparse cache for the next ``length``
    tokens ``key`` / ``value`` (module docstring); ``selection_query``: the call's queries when the sparse cache
    selects by attention (``None``: by the tail's recall error); ``span``: the selection's ``sparse_cache_span``."""
    batch, kv_heads, _, head_dim = key.shape
    size, w = chunk_size, window
    scale = head_dim**-0.5 if scaling is None else float(scaling)
    root = scale**0.5
    dtype = compute_dtype_for(key)
    device = key.device
    seen = 0 if state is None else state.seen
    unpadded = (torch.ones(batch, length, dtype=torch.bool, device=device) if key_padding_mask is None
                else key_padding_mask)
    sink_key, sink_value, sink_position, sink_valid, is_sink = row_sinks(key, value, unpadded, sinks, state, seen)
    new_keep = unpadded & ~is_sink

    # Rows: first unpadded position, offset of the boundaries, the block of the boundary each row continues from.
    first_new = torch.where(unpadded.any(-1), seen + unpadded.long().argmax(-1), -1)
    known_before = torch.full((batch,), -1, dtype=torch.long, device=device) if state is None else state.row_start
    row_start = torch.where(known_before >= 0, known_before, first_new)
    offset = torch.where(row_start >= 0, row_start % size, 0)
    entering = entering_tail(state, batch, kv_heads, head_dim, value.shape[-1], tail_features(feature_map, head_dim),
                              dtype, key, value, device)
    # A row new to this call starts empty one boundary before its first query: with a window, that boundary's
    # candidates (positions <= b - w) are all before the row's first token; without one they include it.
    commit_block = torch.where(known_before >= 0, _floor_div(entering.boundary - offset, size),
                               _floor_div(seen - offset, size) - (1 if w == 0 else 0))
    last_block = _floor_div(seen + length - 1 - offset, size)
    # Without a state or padding every row starts at 0: its blocks are known on the host (no device read).
    uniform_offset = 0 if state is None and key_padding_mask is None else None
    if uniform_offset is None:
        n_first, n_last = int(commit_block.min()), int(last_block.max())
        n_query = int(_floor_div(seen - offset, size).min())
    else:
        n_first, n_last, n_query = -1 if w == 0 else 0, (length - 1) // size, 0
    blocks = n_last - n_first + 1

    # The local sequence (absolute positions [local_start, seen + L)) laid out per row in the shifted frame.
    if state is None:
        local = (key, value, new_keep, seen)
        kept_before = torch.zeros(batch, dtype=torch.long, device=device)
    else:
        kept_before = state.kept_before_buffer
        local = (torch.cat([state.buffer_key.to(key.dtype), key], dim=2),
                 torch.cat([state.buffer_value.to(value.dtype), value], dim=2),
                 torch.cat([state.buffer_keep, new_keep], dim=1), state.buffer_start)
    # layout index 0 is shifted position n_first C - w + 1
    to_local = n_first * size - w + 1 + (offset if uniform_offset is None else uniform_offset) - local[3]
    layout_length = blocks * size + max(w - 1, 0)
    layout = (rows_window(local[0].to(dtype), to_local, layout_length, 2),
              rows_window(local[1].to(dtype), to_local, layout_length, 2),
              rows_window(local[2], to_local, layout_length, 1, fill=False))

    # The tiles: block n's first C keys [nC - w + 1, nC + C - w], its pending tokens and its boundary's candidates.
    tile_key = layout[0][:, :, :blocks * size]
    tile_keep = layout[2][:, :blocks * size]
    tile_value_ones = _with_ones_column(layout[1][:, :, :blocks * size]).masked_fill(~tile_keep[:, None, :, None], 0.0)
    tile_features = tail_key_features(feature_map, tile_key, root)
    boundary_query = None
    if selection_query is not None and sparse_cache:
        # Block n's boundary query, at position n C + offset (clamped for rows that do not select there).
        at = (n_first + torch.arange(blocks, device=device))[None, :] * size + offset[:, None] - seen  # [B, blocks]
        at = at.clamp(0, length - 1)
        heads = selection_query.shape[1]
        picked = selection_query.to(dtype).gather(2, at[:, None, :, None].expand(-1, heads, -1, head_dim))
        boundary_query = picked.view(batch, kv_heads, heads // kv_heads, blocks, head_dim) * scale
    tails, caches = boundary_states(entering, tile_features, tile_value_ones, tile_keep, tile_key, commit_block,
                                    n_first, blocks, size, sparse_cache, feature_map, root, eps, boundary_query, span)
    return _Call(seen, length, (sink_key, sink_value, sink_position, sink_valid), row_start, offset, entering,
                 last_block, n_first, n_query, n_last, local, kept_before, layout, (tile_features, tile_value_ones, tile_keep),
                 tails, caches, uniform_offset)


def causal_window_attention(query, key, value, feature_map, *, window, sinks, sparse_cache, softmax_weight,
                            key_padding_mask, scaling, initial_state, return_state, max_rollback, chunk_size, eps,
                            tail_cap=0, tail_gate=None, sparse_cache_selection="recall", sparse_cache_span=1):
    """The causal operator (see :func:`~.window_attention.window_linear_attention`, already validated): ``out``
    ``[B, H, L, dv]`` in ``value.dtype``, and the new :class:`~.window_state.WindowAttentionState` if
    ``return_state``."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    dtype = compute_dtype_for(query)
    with _no_autocast(query.device.type):
        call = _prepare_call(key, value, feature_map, length=query.shape[2], window=window, sinks=sinks,
                             sparse_cache=sparse_cache, key_padding_mask=key_padding_mask, scaling=scaling,
                             state=initial_state, chunk_size=chunk_size, eps=eps,
                             selection_query=query if sparse_cache_selection == "attention" else None,
                             span=sparse_cache_span)
        gamma = None if softmax_weight is None else softmax_weight.to(dtype)
        tail_weight = (tail_cap, None if tail_gate is None else tail_gate.to(dtype))
        out = _attend_blocks(query.to(dtype), feature_map, scaling, gamma, eps, call, chunk_size, window, sparse_cache,
                             tail_weight, operand_dtype(query))
        if not return_state:
            return out.to(value.dtype)
        new_state = _next_state(call, chunk_size, window, sinks, sparse_cache, max_rollback)
    return out.to(value.dtype), new_state


def sparse_cache_membership(key, value, feature_map, *, window, sinks, sparse_cache, key_padding_mask, scaling,
                            chunk_size, eps=1e-12, selection_query=None, span=1) -> torch.Tensor:
    """Which older keys each query sees exactly through its sparse cache in one causal pass, ``[B, Hkv, L, L]`` bool:
    the kept keys of its boundary (the operator's own selection) and the keys waiting for the next one (for
    ``output_attentions``); ``selection_query``: the queries ``[B, H, L, d]`` when the cache selects by attention;
    ``span``: the selection's ``sparse_cache_span``."""
    batch, kv_heads, length, _ = key.shape
    with torch.no_grad(), _no_autocast(key.device.type):
        call = _prepare_call(key, value, feature_map, length=length, window=window, sinks=sinks,
                             sparse_cache=sparse_cache, key_padding_mask=key_padding_mask, scaling=scaling, state=None,
                             chunk_size=chunk_size, eps=eps, selection_query=selection_query, span=span)
        _, _, slot_index, valid = call.caches
        positions = _slot_positions(slot_index, call.entering, call.n_first, chunk_size, call.offset, window)
        query_position = torch.arange(length, device=key.device)
        block = _floor_div(query_position[None, :] - call.offset[:, None], chunk_size) - call.n_first  # [B, L]
        block = block.clamp(0, positions.shape[2] - 1)[:, None, :, None].expand(-1, kv_heads, -1, sparse_cache)
        query_positions, query_valid = positions.gather(2, block), valid.gather(2, block)  # [B, Hkv, L, G]
        member = torch.zeros(batch, kv_heads, length, length + 1, dtype=torch.bool, device=key.device)
        member.scatter_(3, torch.where(query_valid, query_positions, length), True)
        boundary = call.offset[:, None] + _floor_div(query_position[None, :] - call.offset[:, None],
                                                     chunk_size) * chunk_size  # [B, L]
        key_position = query_position[None, None, :]
        waiting = ((key_position > boundary[..., None] - window) & (key_position <= query_position[:, None] - window)
                   & call.local[2][:, None, :])  # [B, L, L]
    return member[..., :length] | waiting[:, None]


def tail_features(feature_map, head_dim: int) -> int:
    """Features per key of the tail sums a layer keeps: the map's, or 1 (the constant feature) without a map."""
    return 1 if feature_map is None else feature_map.nb_features


def _attend_blocks(query, feature_map, scaling, gamma, eps, call: _Call, size, w, capacity, tail_weight,
                   operands_dtype=None):
    """The outputs ``[B, H, L, dv]`` of the queries, computed for the blocks ``n_query .. n_last`` of the shifted
    frame (module docstring) by :func:`~.window_blocks.attend_blocks`; ``tail_weight`` = ``(tail_cap, tail_gate)``
    (:mod:`.window_tail_cap`); ``operands_dtype``: the dtype of the parallel path's products (that of the inputs)."""
    layout_key, layout_value, layout_keep = call.layout
    tile_features, _, tile_keep = call.tiles
    sink_key, sink_value, sink_position, sink_valid = call.sinks
    row_offset = call.offset if call.uniform_offset is None else call.uniform_offset  # (an int: no host read)
    offset, seen, n_first, n_query, n_last, caches = call.offset, call.seen, call.n_first, call.n_query, call.n_last, \
        call.caches
    batch, heads, length, _ = query.shape
    kv_heads, groups = layout_key.shape[1], heads // layout_key.shape[1]
    blocks = n_last - n_query + 1
    first = n_query - n_first  # the first output block among the call's blocks
    skip = first * size  # layout index of the first output block's tile
    rows = groups * size
    device = query.device
    pending_in_band = caches is not None
    spec = BlockSpec(size, w, groups, scaling, scaling**0.5, feature_map, pending_in_band, eps)

    query_position = n_query * size + offset[:, None] + torch.arange(blocks * size, device=device)  # [B, blocks C]
    query_position = query_position.view(batch, blocks, 1, size).expand(-1, -1, groups, -1).reshape(batch, blocks, rows)
    reach = skip + blocks * size + max(w - 1, 0)  # the tiles' last key + 1
    band_keep = layout_keep[:, skip:reach]
    band_keep = band_keep.unfold(1, spec.span, size) if spec.span > 0 else band_keep.new_zeros(batch, blocks, 0)
    features, log_scale = tile_features
    tail_blocks = slice(skip, skip + blocks * size)
    with_pending = feature_map is not None and not pending_in_band
    operands = BlockOperands(
        query=rows_window(query, n_query * size + row_offset - seen, blocks * size, 2),
        keys=layout_key[:, :, skip:reach], values=layout_value[:, :, skip:reach], band_keep=band_keep,
        sink_key=sink_key.to(query.dtype), sink_value=sink_value.to(query.dtype),
        sink_allowed=sink_valid[:, None, None, :] & (sink_position[:, None, None, :] <= query_position[..., None]),
        cache_key=None if caches is None else caches[0][:, :, first:],
        cache_value=None if caches is None else caches[1][:, :, first:, :, :-1],
        cache_valid=None if caches is None else caches[3][:, :, first:],
        tail_sums=None if feature_map is None else call.tails[0][:, :, first:first + blocks],
        tail_max=None if feature_map is None else call.tails[1][:, :, first:first + blocks],
        tile_features=features[:, :, tail_blocks].unflatten(2, (blocks, size)) if with_pending else None,
        tile_log_scale=(log_scale[:, :, tail_blocks].unflatten(2, (blocks, size))
                        if with_pending and log_scale is not None else None),
        tile_keep=tile_keep[:, tail_blocks].view(batch, blocks, size),
        gamma=gamma, tail_log_weight=None if feature_map is None else
        _tail_log_weights(call, query_position, size, w, capacity, *tail_weight, kv_heads, query.dtype))
    if feature_map is None and attention_path(query) == "parallel":
        out = attend_sdpa_blocks(operands, spec, operands_dtype)
    else:
        attend = attend_exact_blocks if fused_exact_applies(operands, spec) else attend_blocks
        out = attend(operands, spec)  # [B, Hkv, n, g C, dv]
    value_dim = out.shape[-1]
    out = out.view(batch, kv_heads, blocks, groups, size, value_dim).transpose(2, 3).reshape(
        batch, heads, blocks * size, value_dim)
    return rows_window(out, seen - n_query * size - row_offset, length, 2)


def _tail_log_weights(call: _Call, query_position, size, w, capacity, tail_cap, tail_gate, kv_heads, dtype):
    """The log weight of each query's tail (:mod:`.window_tail_cap`), ``[B, 1, n, g C]`` (a cap alone) or
    ``[B, Hkv, n, g C]`` (a gate: one exponent per query head), or ``None``: its tail's edge is ``i - w`` without a
    sparse cache, ``b_i - w`` with one (``b_i`` its boundary)."""
    if not tail_cap and tail_gate is None:
        return None
    edge = query_position - w
    if capacity:
        edge = edge - (query_position - call.offset[:, None, None]) % size
    tokens = tail_tokens(eligible_up_to(call.local[2], call.local[3], call.kept_before, edge), capacity)[:, None]
    exponent = None
    if tail_gate is not None:  # [H] -> [1, Hkv, 1, g C], the rows of a block being its g heads' C queries
        groups = tail_gate.shape[0] // kv_heads
        exponent = tail_gate.view(1, kv_heads, groups, 1).expand(-1, -1, -1, size).reshape(1, kv_heads, 1, -1)
    return tail_log_weights(tokens, tail_cap, exponent, dtype)


def exact_terms(scores, value_ones, gamma, rows, value_dim):
    """The exact part ``sum_E exp(s - c) [v, 1]`` and the row maximum ``c`` (0 without exact keys; detached in
    calibrated mode, where it cancels) from masked ``scores`` ``[..., n]`` (``-inf`` = not allowed) and the keys'
    ``value_ones`` ``[..., n, dv + 1]``, or ``None`` for both without exact keys; ``rows`` is a tensor shaped as the
    query rows."""
    if scores is None:
        return rows.new_zeros(rows.shape + (value_dim + 1,)), rows.new_zeros(rows.shape)
    row_max = torch.nan_to_num(scores.amax(-1), nan=0.0, posinf=0.0, neginf=0.0)
    if gamma is None:
        row_max = row_max.detach()
    return torch.matmul(torch.exp(scores - row_max[..., None]), value_ones), row_max


def combine(exact, row_max, tail, log_factor, calibrated: bool):
    """``[numerator, denominator]`` of each query: the exact part (already times gamma in learned mode) plus the
    tail sums times ``exp(u)`` (learned) or ``exp(u - c)`` (calibrated), ``u`` = ``log_factor`` (0 if ``None``),
    everything rescaled by ``exp(-rho)``, ``rho = max(0, exponent)`` (detached), so that nothing overflows."""
    if tail is None:
        return exact
    exponent = -row_max if calibrated else None
    if log_factor is not None:
        exponent = log_factor if exponent is None else exponent + log_factor
    if exponent is None:
        return exact + tail
    rho = exponent.detach().clamp_min(0.0)
    return exact * torch.exp(-rho)[..., None] + tail * torch.exp(exponent - rho)[..., None]


def _next_state(call: _Call, size, w, sinks, capacity, max_rollback) -> WindowAttentionState:
    """The state after the call's tokens."""
    tile_features, tile_value_ones, tile_keep = call.tiles
    tails, caches, entering, n_first, offset = call.tails, call.caches, call.entering, call.n_first, call.offset
    local_key, local_value, local_keep, local_start = call.local
    seen, row_start, last_block = call.seen + call.length, call.row_start, call.last_block
    batch, kv_heads = tile_value_ones.shape[:2]
    known = row_start >= 0
    blocks = tails[0].shape[2]

    def tail_at(block):  # the committed tail at each row's block `block` [B] (shifted frame)
        index = (block - n_first).clamp(0, blocks - 1)
        sums = _select_blocks(tails[0], index)
        tail_max = _select_blocks(tails[1], index)
        boundary = torch.where(known, block * size + offset, -1)
        if caches is None:
            empty = torch.zeros(batch, kv_heads, 0, dtype=torch.long, device=sums.device)
            return CommittedTail(boundary, entering.cache_key[:, :, :0], entering.cache_value[:, :, :0], empty,
                                 empty.bool(), sums, tail_max)
        keys, value_ones, slot_index, valid = (_select_blocks(t, index) for t in caches)
        return CommittedTail(boundary, keys.to(entering.cache_key.dtype), value_ones[..., :-1].to(
            entering.cache_value.dtype).contiguous(), _slot_positions(slot_index, entering, n_first, size, offset, w),
            valid, sums, tail_max)

    current = tail_at(last_block)
    checkpoint = None
    if max_rollback > 0:
        checkpoint = tail_at(_floor_div(seen - 1 - max_rollback - offset, size).clamp_min(n_first))
    # The last query's (position `seen - 1`) tail sums: its boundary's plus the tokens of its block's tile up to
    # `seen - 1 - w` (none with a sparse cache, which keeps them exact).
    tile_index = (last_block - n_first).clamp(0, blocks - 1)
    features, log_scale = tile_features
    tile = lambda t: _select_blocks(t.view(t.shape[:2] + (blocks, size) + t.shape[3:]), tile_index)  # noqa: E731
    tile_position = last_block[:, None] * size + offset[:, None] - w + 1 + torch.arange(size, device=offset.device)
    pending_keep = tile_keep.view(batch, blocks, size).gather(1, tile_index.view(batch, 1, 1).expand(-1, 1, size))[:, 0]
    pending_keep = pending_keep & (tile_position <= seen - 1 - w)
    # (A copy of the stabiliser: a map without log-scales would return the same tensor, shared with `current`.)
    query_tail = None if caches is not None else fold_into(
        (current.tail_sums, current.tail_max.clone()), tile(features), None if log_scale is None else tile(log_scale),
        tile(tile_value_ones), pending_keep[:, None].expand(-1, kv_heads, -1))
    buffer_key, buffer_value, buffer_keep = last_tokens(local_key, local_value, local_keep,
                                                        buffer_capacity(w, size, max_rollback))
    sink_key, sink_value, sink_position, sink_valid = call.sinks
    return WindowAttentionState(
        sink_key=sink_key.clone(), sink_value=sink_value.clone(), sink_position=sink_position.clone(),
        sink_valid=sink_valid.clone(), buffer_key=buffer_key, buffer_value=buffer_value, buffer_keep=buffer_keep,
        row_start=row_start, kept_tokens=call.kept_before + local_keep.sum(-1),
        current=current, query_tail=query_tail, checkpoint=checkpoint, seen=seen, window=w, sinks=sinks,
        sparse_cache=capacity, chunk_size=size, max_rollback=max_rollback)


def _slot_positions(slot_index, entering, n_first, size, offset, w):
    """Absolute positions of pool slots ``slot_index`` ``[B, Hkv, ...]``: the entering cache's slots, then the tiles'
    (pool slot ``G + p`` is layout index ``p``, at absolute ``n_first C - w + 1 + p + offset``)."""
    slots = entering.cache_position.shape[2]
    row_offset = offset.view((-1,) + (1,) * (slot_index.dim() - 1))
    tile_position = n_first * size - w + 1 + (slot_index - slots) + row_offset
    if not slots:
        return tile_position
    flat = slot_index.flatten(2).clamp_max(slots - 1)
    from_cache = entering.cache_position.gather(2, flat).view(slot_index.shape)
    return torch.where(slot_index < slots, from_cache, tile_position)
