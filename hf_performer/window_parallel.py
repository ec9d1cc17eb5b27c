"""Sink + window attention with a linear tail on the parallel path (CUDA): a call without a decoding state, every query
block at once, a fixed number of operations whatever the length.

The same function as :func:`~.window_attention.window_linear_attention` (sets and weights in that module's docstring),
for the calls a training step or a plain forward makes (no ``initial_state``, no ``return_state``):

* the exact part: query blocks of ``C`` rows (the ``g`` query heads of a key head stacked) against their tile of keys
  (causal ``[nC - w + 1, nC + C - 1]``, bidirectional ``[nC - w + 1, nC + C + w - 2]``, a fixed pattern of allowed
  keys), the row's sink slots and, with a sparse cache, the block's cached keys. Without a tail it is plain softmax
  over those keys: one ``scaled_dot_product_attention`` call with the blocks as its batch. With a tail, the exact sums
  ``sum exp(s - c) [v, 1]`` and the row maximum ``c`` from one batched product;
* the tail: the keys ``j <= i - w`` (and bidirectional ``j >= i + max(w, 1)``, on the reversed sequence) as stabilised
  causal sums (:func:`~.linear_attention_parallel.shifted_tail_sums`), weighed by a bounded tail's cap and a learned
  gate (:mod:`.window_tail_cap`) from each query's token count;
* one normaliser: ``E e^{-rho} + sum_T T e^{f_T - rho}`` with ``f = lq + K - c`` (calibrated) or ``lq + K`` (learned,
  ``E`` times gamma), ``rho = max(0, f ...)`` (detached);
* a sparse cache (causal, no tail, no padding mask): every boundary's selection in one kernel
  (:func:`~.window_selection_kernel.select_without_tail`), the candidates of boundary ``kC`` being the tokens
  ``kC - C - w < j <= kC - w`` and the cache of ``kC - C``, exactly as
  :func:`~.window_boundaries.boundary_states` chooses them; the tokens waiting for the next selection stay in the band;
* bidirectional sink queries attend to every unpadded key exactly (:func:`~.window_bidirectional.sink_query_rows`).

:func:`parallel_window_attention` returns ``None`` for what it does not serve (a sparse cache with a tail or a padding
mask, or without the kernel): the general operator takes those. Gradients by autograd; the memory of one pass.

This module imports only ``torch`` and its siblings ``feature_maps``, ``linear_attention``,
``linear_attention_parallel``, ``window_bidirectional``, ``window_block_operands``, ``window_causal``,
``window_exact_blocks``, ``window_selection_kernel``, ``window_state`` and ``window_tail_cap``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .feature_maps import compute_dtype_for
from .linear_attention import _no_autocast, _repeat_kv, _safe_denominator, _with_ones_column
from .linear_attention_parallel import operand_dtype, shifted_tail_sums
from .window_bidirectional import sink_query_rows, with_sink_queries
from .window_block_operands import _from_blocks, _per_block
from .window_boundaries import gather_slots
from .window_causal import rows_window
from .window_exact_blocks import softmax_over_blocks, stack_key_sets
from .window_selection_kernel import kernel_applies, select_without_tail
from .window_state import row_sinks
from .window_tail_cap import tail_log_weights


def _tiles(x: torch.Tensor, left: int, span: int, size: int, blocks: int, fill=0.0) -> torch.Tensor:
    """Each block's tile of positions ``[nC - left, nC - left + span)``: ``[B, Hkv, L, e] -> [B, Hkv, n, span, e]`` or
    ``[B, L] -> [B, n, span]``, ``fill`` outside the sequence (``left = -1``: the tiles start one past the block)."""
    sequence = 2 if x.dim() == 4 else 1
    right = (blocks - 1) * size + span - left - x.shape[sequence]
    if x.dim() == 4:
        return F.pad(x, (0, 0, left, max(right, 0))).unfold(2, span, size).transpose(-1, -2)
    return F.pad(x, (left, max(right, 0)), value=fill).unfold(1, span, size)


def _serves(feature_map, causal, sparse_cache, key_padding_mask, value) -> bool:
    if not causal or sparse_cache == 0:
        return True
    return feature_map is None and key_padding_mask is None and kernel_applies(value)


def parallel_window_attention(query, key, value, feature_map, *, window, sinks, causal, softmax_weight,
                              key_padding_mask, scaling, sparse_cache, tail_cap, tail_gate, chunk_size, eps):
    """The operator without a state (already validated; ``key_padding_mask`` bool or ``None``). Returns ``[B, H, L, dv]`` in ``value``'s
    dtype, or ``None`` for a call it does not serve (module docstring)."""
    if not _serves(feature_map, causal, sparse_cache, key_padding_mask, value):
        return None
    batch, heads, length, head_dim = query.shape
    kv_heads, value_dim = key.shape[1], value.shape[-1]
    groups = heads // kv_heads
    scaling = head_dim**-0.5 if scaling is None else float(scaling)
    dtype, operands = compute_dtype_for(query), operand_dtype(query)
    device = query.device
    size, w = chunk_size, window
    blocks = -(-length // size)
    with _no_autocast(device.type):
        gamma = None if softmax_weight is None else softmax_weight.to(dtype)
        if key_padding_mask is None:  # the row's sinks are its first tokens: views, no gathering
            slots = min(sinks, length)
            sink_key, sink_value = key[:, :, :slots], value[:, :, :slots]
            sink_position = torch.arange(slots, device=device).expand(batch, slots)
            sink_valid = torch.ones(batch, slots, dtype=torch.bool, device=device)
            keep = (torch.arange(length, device=device) >= slots).expand(batch, length)
            unpadded = None
        else:
            unpadded = key_padding_mask
            sink_key, sink_value, sink_position, sink_valid, is_sink = row_sinks(key, value, unpadded, sinks, None, 0)
            keep = unpadded & ~is_sink  # the band and the tail skip the row's sinks (attended through the sink slots)

        # The key sets of every block: sinks, the sparse cache, the tile.
        left = w - 1  # the tile of block n starts at position nC - w + 1 (nC + 1 without a window)
        pending = causal and sparse_cache > 0  # the tokens waiting for the next selection stay exact
        if causal:
            span = size + w - 1 if w > 0 or pending else 0
        else:
            span = size + 2 * left if w > 0 else 0
        rows = torch.arange(size, device=device)[:, None]
        columns = torch.arange(span, device=device)[None, :]
        if causal:  # tile column c is position nC - w + 1 + c; row r is nC + r
            band = (columns <= rows + w - 1) & ((columns >= rows) | pending)
        else:
            band = (rows + left - columns).abs() < w
        band = band.repeat(groups, 1)  # [g C, span]
        key_sets = []  # (keys [B, Hkv, n | 1, k, d], values [B, Hkv, n | 1, k, dv], allowed [B, Hkv | 1, n | 1, gC | 1, k])
        if sink_key.shape[2]:
            allowed = sink_valid[:, None, None, None, :]
            if causal:
                position = (torch.arange(blocks, device=device)[:, None] * size
                            + torch.arange(size, device=device).repeat(groups)[None, :])  # [n, g C]
                allowed = allowed & (sink_position[:, None, None, None, :] <= position[None, None, :, :, None])
            key_sets.append((sink_key[:, :, None], sink_value[:, :, None], allowed))
        if pending:
            key_sets.append(_sparse_cache(key, value, keep, w, size, blocks, sparse_cache, eps))
        if span:
            tile_keep = _tiles(keep, left, span, size, blocks, fill=False)  # [B, n, span]
            key_sets.append((_tiles(key, left, span, size, blocks), _tiles(value, left, span, size, blocks),
                             band[None, None, None] & tile_keep[:, None, :, None, :]))
        query_blocks = _per_block(F.pad(query, (0, 0, 0, blocks * size - length)), kv_heads, groups, size)

        if feature_map is None:  # softmax over the exact keys: one SDPA call, the blocks as its batch
            # (rows that may see no key: padding, and the queries past the end of the last block without sinks)
            guard = unpadded is not None or (blocks * size != length and not sink_key.shape[2])
            keys, values, allowed, _ = stack_key_sets(key_sets, query_blocks.shape[:4])
            out = softmax_over_blocks(query_blocks.flatten(0, 2)[:, None], keys, values, allowed, scaling, operands,
                                      guard)
            out = _from_blocks(out.view(*query_blocks.shape[:4], -1).to(dtype), groups, size)[:, :, :length]
        else:
            exact, row_max = _block_sums(query_blocks.to(dtype), key_sets, scaling, gamma, dtype)
            exact = _from_blocks(exact, groups, size)[:, :, :length]
            row_max = _from_blocks(row_max[..., None], groups, size)[:, :, :length, 0]
            if gamma is not None:
                exact = exact * gamma[None, :, None, None]
            tails = _tails(query.to(dtype), key.to(dtype), value.to(dtype), feature_map, keep, w, causal, scaling,
                           groups, operands)
            weight = _tail_weight(keep, w, tail_cap, tail_gate, heads, length, dtype) if causal else None
            out = _merge(exact, row_max, tails, weight, calibrated=gamma is None, eps=eps)
        if not causal and sinks > 0:
            full_keep = torch.ones(batch, length, dtype=torch.bool, device=device) if unpadded is None else unpadded
            sink_out = sink_query_rows(query.to(dtype), _repeat_kv(key.to(dtype), groups),
                                       _repeat_kv(value.to(dtype), groups), full_keep, sink_position, scaling)
            out = with_sink_queries(out, sink_out, sink_position, sink_valid)
    return out[..., :value_dim].to(value.dtype)


def _sparse_cache(key, value, keep, w, size, blocks, capacity, eps):
    """The sparse cache of every query block (a layer without a tail, rows from position 0): ``(keys [B, Hkv, n, G,
    d], values, valid [B, Hkv, n, 1, G])``. Selection block ``t`` is block ``t + first`` (``first`` = -1 without a
    window: boundary 0 already has token 0 as a candidate); its candidates are the cache of ``t - 1`` and its tile's
    first ``C`` tokens, positions ``(t + first) C - w + 1 ..``."""
    batch, kv_heads = key.shape[:2]
    first = -1 if w == 0 else 0
    selections = blocks - first
    start = first * size - w + 1  # the first tile's first position
    span = selections * size

    def pool(x, fill=0.0):  # positions [start, start + span), `fill` outside the sequence
        return rows_window(x, start, span, 2 if x.dim() == 4 else 1, fill=fill)

    pool_keep = pool(keep, fill=False)  # [B, T C]
    pool_key, pool_value = pool(key), pool(value)
    pool_values = _with_ones_column(pool_value.to(compute_dtype_for(value)))
    pool_values = pool_values * pool_keep[:, None, :, None].to(pool_values.dtype)
    index = torch.zeros(batch, kv_heads, capacity, dtype=torch.long, device=key.device)
    empty = torch.zeros(batch, kv_heads, capacity, dtype=torch.bool, device=key.device)
    sums = pool_values.new_zeros(batch, kv_heads, 1, pool_values.shape[-1])
    active = torch.ones(batch, selections, dtype=torch.bool, device=key.device)
    index, valid, _ = select_without_tail(pool_values, index, empty, sums, pool_keep.view(batch, selections, size),
                                          active, slots=0, capacity=capacity, size=size, eps=eps)
    index, valid = index[:, :, -first:], valid[:, :, -first:]  # the caches of the query blocks 0 .. n - 1
    flat = index.flatten(2)  # [B, Hkv, n G]
    gather = lambda x: gather_slots(x, flat).unflatten(2, (blocks, capacity))  # noqa: E731
    return gather(pool_key), gather(pool_value), valid[:, :, :, None, :]


def _block_sums(query_blocks, key_sets, scaling, gamma, dtype):
    """``E = sum exp(s - c) [v, 1]`` ``[B, Hkv, n, g C, dv + 1]`` and the row maximum ``c`` (0 without a key; detached
    in calibrated mode, where it cancels) over each block's keys."""
    batch, kv_heads, blocks, rows, _ = query_blocks.shape
    scores, values = [], []
    for keys, key_values, allowed in key_sets:
        score = torch.matmul(query_blocks, keys.to(dtype).transpose(-1, -2)) * scaling
        scores.append(score.masked_fill(~allowed, float("-inf")))
        values.append(_with_ones_column(key_values.to(dtype)))
    if not scores:
        return query_blocks.new_zeros(batch, kv_heads, blocks, rows, 1), query_blocks.new_zeros(batch, kv_heads,
                                                                                                  blocks, rows)
    row_max = torch.stack([s.amax(-1) for s in scores]).amax(0)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    if gamma is None:
        row_max = row_max.detach()
    exact = sum(torch.matmul((s - row_max[..., None]).exp(), v) for s, v in zip(scores, values))
    return exact, row_max


def _tails(query, key, value, feature_map, keep, w, causal, scaling, groups, operands):
    """``[(sums [B, H, L, dv + 1], log factor lq + K [B, H, L])]``: the tail before each query and, bidirectional,
    the one after it."""
    root = scaling**0.5
    q_features, k_features = feature_map(query * root, key * root)
    phi_q = q_features.values
    log_q = phi_q.new_zeros(phi_q.shape[:-1]) if q_features.log_scale is None else q_features.log_scale
    phi_k = _repeat_kv(k_features.values, groups)
    log_k = phi_k.new_zeros(phi_k.shape[:-1]) if k_features.log_scale is None else \
        _repeat_kv(k_features.log_scale, groups)
    value_ones = _with_ones_column(_repeat_kv(value, groups)) * keep[:, None, :, None].to(value.dtype)
    sums, tail_max = shifted_tail_sums(phi_q, phi_k, log_k, value_ones, keep, w, operands)
    tails = [(sums, log_q + tail_max)]
    if not causal:
        flip = lambda t: t.flip(2) if t.dim() >= 3 else t.flip(1)  # noqa: E731
        sums, tail_max = shifted_tail_sums(flip(phi_q), flip(phi_k), flip(log_k), flip(value_ones), flip(keep),
                                           max(w, 1), operands)
        tails.append((flip(sums), log_q + flip(tail_max)))
    return tails


def _tail_weight(keep, w, tail_cap, tail_gate, heads, length, dtype):
    """The log weight ``[B, 1 or H, L]`` of each query's tail from its token count (the eligible keys ``j <= i - w``),
    or ``None``."""
    if not tail_cap and tail_gate is None:
        return None
    counts = F.pad(keep.long().cumsum(-1), (w, 0))[:, :length]  # eligible keys at positions <= i - w
    exponent = None if tail_gate is None else tail_gate.view(1, heads, 1)
    return tail_log_weights(counts[:, None, :], tail_cap, exponent, dtype)


def _merge(exact, row_max, tails, weight, *, calibrated: bool, eps: float):
    """``[numerator, denominator]`` of every query from the exact part and the tails (module docstring), divided."""
    exponents = []
    for _, log_factor in tails:
        exponent = log_factor - row_max if calibrated else log_factor
        exponents.append(exponent if weight is None else exponent + weight)
    rho = torch.stack([torch.zeros_like(row_max)] + [e.detach() for e in exponents]).amax(0)
    total = exact * torch.exp(-rho)[..., None]
    for (sums, _), exponent in zip(tails, exponents):
        total = total + sums * torch.exp(exponent - rho)[..., None]
    return total[..., :-1] / _safe_denominator(total[..., -1:], eps)
