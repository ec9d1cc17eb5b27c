"""The bidirectional window hybrid (encoders): every non-sink query attends exactly to the row's sinks and its band
``|i - j| < window`` and through the tail to every other key (a left prefix and a right suffix, :mod:`.window_tail`);
a sink query (e.g. [CLS]) attends to every unpadded key exactly. One pass (:func:`bidirectional_window_attention`),
or in segments when gradients are wanted on long inputs (:func:`segmented_bidirectional_window_attention`), both
through :func:`~.window_attention.window_linear_attention`, whose docstring gives the sets and weights.

This module imports only ``torch`` and its siblings ``feature_maps``, ``linear_attention``, ``window_segments``,
``window_state`` and ``window_tail``.
"""

from __future__ import annotations

import torch

from .feature_maps import compute_dtype_for
from .linear_attention import _as_bool_mask, _no_autocast, _repeat_kv, _safe_denominator, _with_ones_column
from .window_segments import SegmentPlan, segmented_bidirectional
from .window_state import row_sinks
from .window_tail import _tail_prefix, _tail_suffix, _tail_sum, pieces

BIDIRECTIONAL_SEGMENT_LENGTH = 512
"""Bidirectional calls that need gradients run in segments of this many queries
(:func:`segmented_bidirectional_window_attention`): each cut adds a span sum, so 256 peaks higher at 16k (684 against
498 MiB)."""


def _exact_block(query_block, key_block, value_ones_block, scores_scale, allowed, softmax_weight):
    """Scores of the queries ``query_block`` ``[B, H, C, d]`` against the keys ``key_block`` ``[B, H, n, d]`` (values
    and a ones column ``value_ones_block`` ``[B, H, n, dv + 1]``), ``allowed`` ``[B, 1 or H, C, n]``.

    Returns the row maximum ``c`` ``[B, H, C]`` (0 for rows without keys) and a closure that, given
    the row offset ``rho`` ``[B, H, C]``, returns ``sum_j gamma exp(s_ij - c_i - rho_i) [v_j, 1]``.
    """
    if key_block.shape[2] == 0:  # no exact key for these queries (window 0, no sinks)
        row_max = query_block.new_zeros(query_block.shape[:-1])
        return row_max, lambda rho: value_ones_block.new_zeros(row_max.shape + value_ones_block.shape[-1:])
    scores = torch.matmul(query_block, key_block.transpose(-1, -2)) * scores_scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    # Not detached: in learned mode c_i is part of the definition (gamma exp(s - c) against an unscaled tail).
    row_max = scores.amax(dim=-1)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))

    def weighted(rho):
        weights = (scores - (row_max + rho)[..., None]).exp()
        if softmax_weight is not None:
            weights = weights * softmax_weight[None, :, None, None]
        return torch.matmul(weights, value_ones_block)

    return row_max, weighted


def _exact_plus_tails(query, log_q, tails, key, value_ones, keep, sink_key, sink_value_ones, sink_valid,
                      sink_position, *, query_start, first, window, causal, scaling, softmax_weight, chunk_size, eps):
    """The outputs ``[B, H, Lq, dv]`` of the queries ``query`` ``[B, H, Lq, d]`` at the local positions
    ``query_start..query_start+Lq-1`` of the keys ``key`` ``[B, H, L, d]`` (``value_ones`` ``[B, H, L, dv + 1]``,
    zero where ``keep`` ``[B, L]`` is False), local position 0 at absolute position ``first``: the exact tiles
    (the sink slots ``sink_key`` ``[B, H, s, d]`` / ``sink_value_ones``, ``sink_valid`` / ``sink_position``
    ``[B, s]``, and the band) and the ``tails`` (pairs of sums ``[B, H, Lq, dv + 1]`` and their log-scales
    ``[B, H, Lq]``) with one normaliser; ``log_q`` ``[B, H, Lq]`` are the query feature log-scales."""
    length = key.shape[2]
    query_end = query_start + query.shape[2]
    positions = torch.arange(length, device=query.device)
    starts = range(query_start, query_end, chunk_size)
    ends = [min(start + chunk_size, query_end) for start in starts]
    blocks = [(start - query_start, end - query_start) for start, end in zip(starts, ends)]
    bands = [(max(0, start - window + 1), end if causal else min(length, end + window - 1))
             for start, end in zip(starts, ends)]
    # Each tensor that may need gradients is cut once into its blocks (see window_tail.pieces).
    query_blocks, log_q_blocks = pieces(query, 2, blocks), pieces(log_q, 2, blocks)
    tail_blocks = [(pieces(tail, 2, blocks), pieces(tail_max, 2, blocks)) for tail, tail_max in tails]
    key_bands, value_bands = pieces(key, 2, bands), pieces(value_ones, 2, bands)
    outputs = []
    for index, (start, end, (band_start, band_end)) in enumerate(zip(starts, ends, bands)):
        rows = positions[start:end, None]
        cols = positions[None, band_start:band_end]
        in_band = (rows - cols).abs() < window
        sink_allowed = sink_valid[:, None, None, :]  # [B, 1, 1 or C, s]
        if causal:
            in_band = in_band & (cols <= rows)
            sink_allowed = sink_allowed & (sink_position[:, None, None, :] <= first + rows)
        allowed = torch.cat([sink_allowed.expand(-1, -1, end - start, -1),
                             in_band[None, None] & keep[:, None, None, band_start:band_end]], dim=-1)
        row_max, weighted = _exact_block(
            query_blocks[index], torch.cat([sink_key, key_bands[index]], dim=2),
            torch.cat([sink_value_ones, value_bands[index]], dim=2), scaling, allowed, softmax_weight,
        )
        # Tail log factors u = lq + K (- c in calibrated mode); rho = max(0, u) keeps every term <= ~1.
        log_factors = []
        for _, tail_max in tail_blocks:
            u = log_q_blocks[index] + tail_max[index]
            log_factors.append(u - row_max if softmax_weight is None else u)
        rho = torch.stack([torch.zeros_like(row_max)] + [u.detach() for u in log_factors]).amax(0)
        total = weighted(rho)
        for (tail, _), u in zip(tail_blocks, log_factors):
            total = total + tail[index] * (u - rho).exp()[..., None]
        outputs.append(total)
    total = torch.cat(outputs, dim=2)
    return total[..., :-1] / _safe_denominator(total[..., -1:], eps)


def bidirectional_window_attention(query, key, value, feature_map, *, window, sinks, softmax_weight, key_padding_mask,
                                    scaling, chunk_size, eps):
    """A bidirectional call in one pass (the module docstring's sets)."""
    mask = key_padding_mask
    batch, heads, q_len, head_dim = query.shape
    scaling = head_dim**-0.5 if scaling is None else float(scaling)
    groups = heads // key.shape[1]
    out_dtype = value.dtype
    dtype = compute_dtype_for(query)
    with _no_autocast(query.device.type):
        gamma = None if softmax_weight is None else softmax_weight.to(dtype)
        root = scaling**0.5
        query = query.to(dtype)
        new_keep = torch.ones(batch, q_len, dtype=torch.bool, device=query.device) if mask is None else mask
        sink_key, sink_value, sink_position, sink_valid, is_sink = row_sinks(key, value, new_keep, sinks, None, 0)
        keep = new_keep & ~is_sink  # the band and the tail skip the row's sinks (attended through the sink slots)
        key_all = _repeat_kv(key.to(dtype), groups)
        value_ones = _with_ones_column(_repeat_kv(value.to(dtype), groups)).masked_fill(~keep[:, None, :, None], 0.0)
        sink_key_all = _repeat_kv(sink_key.to(dtype), groups)
        sink_value_ones = _with_ones_column(_repeat_kv(sink_value.to(dtype), groups))
        log_q = query.new_zeros(batch, heads, q_len)
        tails = []  # (tail sums, their log-scale) per direction; none without a feature map
        if feature_map is not None:
            q_features, k_features = feature_map(query * root, key.to(dtype) * root)
            if q_features.log_scale is not None:
                log_q = q_features.log_scale
            phi_q = q_features.values
            phi_k = _repeat_kv(k_features.values, groups)
            log_k = (phi_k.new_zeros(phi_k.shape[:-1]) if k_features.log_scale is None
                     else _repeat_kv(k_features.log_scale, groups))
            tails.append(_tail_prefix(phi_q, phi_k, log_k, value_ones, keep, window, chunk_size))
            tails.append(_tail_suffix(phi_q, phi_k, log_k, value_ones, keep, max(window, 1), chunk_size))
        out = _exact_plus_tails(query, log_q, tails, key_all, value_ones, keep, sink_key_all, sink_value_ones,
                                sink_valid, sink_position, query_start=0, first=0, window=window, causal=False,
                                scaling=scaling, softmax_weight=gamma, chunk_size=chunk_size, eps=eps)
        if sinks > 0:
            sink_out = sink_query_rows(query, key_all, _repeat_kv(value.to(dtype), groups), new_keep, sink_position,
                                        scaling)
            out = with_sink_queries(out, sink_out, sink_position, sink_valid)
    return out.to(out_dtype)


def sink_query_rows(query, key, value, keep, sink_position, scaling, probabilities=False):
    """Bidirectional: the outputs ``[B, H, s, dv]`` of each row's sink queries (``sink_position`` ``[B, s]``), exact
    softmax over every unpadded key (``query`` ``[B, H, L, d]``, ``key`` / ``value`` ``[B, Hkv, L, .]``, ``keep``
    ``[B, L]``; sinks are exact both ways). ``O(sinks L d)``; the query heads of a key head are one matmul (no
    repeated keys). With ``probabilities``, also the sink queries ``[B, Hkv, g s, d]`` and the softmax
    ``[B, Hkv, g s, L]`` (``g = H / Hkv``)."""
    batch, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    index = sink_position[:, None, :, None]
    sink_query = query.gather(2, index.expand(-1, heads, -1, head_dim)).reshape(batch, kv_heads, -1, head_dim)
    scores = torch.matmul(sink_query, key.transpose(-1, -2)) * scaling
    # A row with no unpadded key has no valid sink slot (its rows are dropped); unmasking it keeps its weights, and
    # so the gradients of every other row, finite.
    allowed = keep | ~keep.any(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~allowed[:, None, None, :], float("-inf")), dim=-1)
    rows = torch.matmul(weights, value).reshape(batch, heads, -1, value.shape[-1])
    return (rows, sink_query, weights) if probabilities else rows


def add_sink_query_rows_grad(grad_rows, query, key, value, keep, sink_position, scaling, grad_query, grad_key,
                              grad_value):
    """The backward of :func:`sink_query_rows` (same arguments, ``grad_rows`` ``[B, H, s, dv]``), added in place
    into ``grad_query`` / ``grad_key`` / ``grad_value`` (shaped as the inputs; ``None`` when not wanted) without a
    temporary of the inputs' size: the keys' and values' gradients are accumulated by ``baddbmm_``."""
    rows, sink_query, weights = sink_query_rows(query, key, value, keep, sink_position, scaling, True)
    batch, kv_heads = key.shape[:2]
    grad_rows = grad_rows.to(rows.dtype)
    flat_grad = grad_rows.reshape(batch * kv_heads, -1, rows.shape[-1])  # [B Hkv, g s, dv]
    # softmax backward: dS = P * (dP - sum(dO * O)), dP = dO V^T
    grad_scores = torch.matmul(grad_rows.reshape(batch, kv_heads, -1, rows.shape[-1]), value.transpose(-1, -2))
    grad_scores = weights * (grad_scores - (grad_rows * rows).sum(-1).reshape(batch, kv_heads, -1, 1)) * scaling
    for target, left, right in ((grad_value, weights, flat_grad), (grad_key, grad_scores, sink_query)):
        if target is None:
            continue
        left = left.reshape(batch * kv_heads, -1, left.shape[-1]).transpose(1, 2)  # [B Hkv, L, g s]
        right = right.reshape(batch * kv_heads, -1, right.shape[-1])
        if target.dtype == left.dtype and target.is_contiguous():
            target.view(batch * kv_heads, *target.shape[2:]).baddbmm_(left, right)
        else:
            target += torch.bmm(left, right).view(target.shape).to(target.dtype)
    if grad_query is not None:
        grad_sink_query = torch.matmul(grad_scores, key).reshape(grad_rows.shape[:3] + (key.shape[-1],))
        index = sink_position[:, None, :, None].expand(-1, grad_query.shape[1], -1, grad_query.shape[-1])
        grad_query.scatter_add_(2, index, grad_sink_query.to(grad_query.dtype))


def with_sink_queries(out, sink_out, sink_position, sink_valid):
    """``out`` ``[B, H, L, dv]`` with each row's valid sink slots' rows (``sink_valid`` ``[B, s]``) replaced by
    ``sink_out`` ``[B, H, s, dv]`` (:func:`sink_query_rows`)."""
    batch, heads, length, _ = out.shape
    # Unfilled slots write to an extra position that is dropped.
    target = torch.where(sink_valid, sink_position, length)[:, None, :, None].expand(-1, heads, -1, out.shape[-1])
    padded = torch.cat([out, out.new_zeros(batch, heads, 1, out.shape[-1])], dim=2)
    replaced = padded.scatter(2, target, sink_out.to(out.dtype))[:, :, :length]
    is_sink_query = torch.zeros(batch, length + 1, dtype=torch.bool, device=out.device).scatter(
        1, torch.where(sink_valid, sink_position, length), True)[:, :length]
    return torch.where(is_sink_query[:, None, :, None], replaced, out)


def segmented_bidirectional_window_attention(query, key, value, feature_map, *, window, sinks, softmax_weight,
                                             key_padding_mask, scaling, chunk_size, eps):
    """A bidirectional call that needs gradients, as segments of :data:`BIDIRECTIONAL_SEGMENT_LENGTH` queries run by
    :func:`~.window_segments.segmented_bidirectional` (no graph in the forward; the backward recomputes one piece at
    a time): the outputs and gradients of one pass.

    Segment ``[s, e)`` attends to its local keys ``[s - window + 1, e + window - 1)`` (the band's halo) directly;
    the rest of its tail comes from two tail sums (:mod:`.window_tail`): the left one over the eligible keys before
    ``s - window + 1`` and the right one over those from ``e + window - 1``. The keys are cut at every such boundary
    into spans; each span's tail sum ``[B, Hkv, m, dv + 1]`` is computed once, and the prefix / suffix merges of
    those small sums carry the gradients back to every span's keys, values and map parameters. Each row's sinks are
    gathered from the whole sequence first; the sink queries' exact rows (``O(sinks L)``) are computed once and
    placed by the segments holding them. Inputs as :func:`window_linear_attention`; returns ``[B, H, L, dv]``.

    Extra peak memory of forward + backward at 4k / 8k / 16k tokens (12 heads, ``d`` 64, window 64, 4 sinks,
    Hedgehog tail): 1,198 / 2,331 / 4,139 MiB in one pass -> 257 / 346 / 510 MiB, SDPA's 3.5x / 2.4x / 1.8x
    (``benchmarks/results/attention_memory_window.json``); and faster (fwd+bwd 0.51x / 0.20x of the one pass's time
    at 4k / 8k, benchmarks/README.md)."""
    batch, heads, length, head_dim = query.shape
    groups = heads // key.shape[1]
    scaling = head_dim**-0.5 if scaling is None else float(scaling)
    root = scaling**0.5
    dtype = compute_dtype_for(query)
    device_type = query.device.type
    mask = _as_bool_mask(key_padding_mask)
    unpadded = torch.ones(batch, length, dtype=torch.bool, device=query.device) if mask is None else mask
    with torch.no_grad(), _no_autocast(device_type):
        sink_key, sink_value, sink_position, sink_valid, is_sink = row_sinks(key, value, unpadded, sinks, None, 0)
    keep = unpadded & ~is_sink  # the band and the tail skip the row's sinks
    halo = max(window, 1) - 1
    segments = [(start, min(start + BIDIRECTIONAL_SEGMENT_LENGTH, length))
                for start in range(0, length, BIDIRECTIONAL_SEGMENT_LENGTH)]
    local = [(max(start - halo, 0), min(end + halo, length)) for start, end in segments]

    def key_features(segment_key):
        features = feature_map.key_features(segment_key * root)
        log_scale = features.values.new_zeros(features.values.shape[:-1]) if features.log_scale is None \
            else features.log_scale
        return features.values, log_scale

    def span_sum(span_key, span_value, start, end):
        with _no_autocast(device_type):
            eligible = keep[:, start:end]
            value_ones = _with_ones_column(span_value.to(dtype)).masked_fill(~eligible[:, None, :, None], 0.0)
            return _tail_sum(*key_features(span_key.to(dtype)), value_ones, eligible)

    def sink_rows(query, key, value):
        with _no_autocast(device_type):
            return sink_query_rows(query.to(dtype), key.to(dtype), value.to(dtype), unpadded, sink_position, scaling)

    def add_sink_rows_grad(grad_rows, query, key, value, grad_query, grad_key, grad_value):
        with _no_autocast(device_type):
            add_sink_query_rows_grad(grad_rows, query.to(dtype), key.to(dtype), value.to(dtype), unpadded,
                                      sink_position, scaling, grad_query, grad_key, grad_value)

    def segment(segment_query, segment_key, segment_value, gamma, slot_key, slot_value, rows, left, right, start,
                end, low):
        query_start = start - low
        segment_keep = keep[:, low:low + segment_key.shape[2]]
        with _no_autocast(device_type):
            segment_query, segment_key = segment_query.to(dtype), segment_key.to(dtype)
            value_ones = _with_ones_column(_repeat_kv(segment_value.to(dtype), groups))
            value_ones = value_ones.masked_fill(~segment_keep[:, None, :, None], 0.0)
            log_q, tails = segment_query.new_zeros(segment_query.shape[:-1]), []
            if feature_map is not None:
                q_features = feature_map.query_features(segment_query * root)
                if q_features.log_scale is not None:
                    log_q = q_features.log_scale
                phi_q = q_features.values
                phi_k, log_k = (_repeat_kv(t, groups) for t in key_features(segment_key))
                left, right = ((_repeat_kv(state, groups), _repeat_kv(state_max, groups))
                               for state, state_max in (left, right))
                before_end = slice(None, query_start + segment_query.shape[2])
                tails.append(_tail_prefix(phi_q, phi_k[:, :, before_end], log_k[..., before_end],
                                          value_ones[:, :, before_end], segment_keep[:, before_end], window,
                                          chunk_size, left))
                from_start = slice(query_start, None)  # keys j >= i + max(window, 1)
                tails.append(_tail_suffix(phi_q, phi_k[:, :, from_start], log_k[..., from_start],
                                          value_ones[:, :, from_start], segment_keep[:, from_start], max(window, 1),
                                          chunk_size, right))
            out = _exact_plus_tails(
                segment_query, log_q, tails, _repeat_kv(segment_key, groups), value_ones, segment_keep,
                _repeat_kv(slot_key.to(dtype), groups), _with_ones_column(_repeat_kv(slot_value.to(dtype), groups)),
                sink_valid, sink_position, query_start=query_start, first=0, window=window, causal=False,
                scaling=scaling, softmax_weight=None if gamma is None else gamma.to(dtype), chunk_size=chunk_size,
                eps=eps)
        if rows is None:
            return out
        here = sink_valid & (sink_position >= start) & (sink_position < end)  # this segment's sink queries
        return with_sink_queries(out, rows, sink_position - start, here)

    plan = SegmentPlan(
        segments=segments, local=local, cuts=sorted({0, length} | {bound for span in local for bound in span}),
        sink_key=sink_key, sink_value=sink_value, sink_position=sink_position,
        span_sum=None if feature_map is None else span_sum, segment=segment,
        sink_rows=sink_rows if sinks > 0 else None, add_sink_rows_grad=add_sink_rows_grad)
    parameters = [] if feature_map is None else [p for p in feature_map.parameters() if p.requires_grad]
    return segmented_bidirectional(plan, query, key, value, softmax_weight, parameters).to(value.dtype)
