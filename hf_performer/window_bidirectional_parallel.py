"""Bidirectional sink + window attention with a linear tail on the parallel path: a fixed number of operations per call.

The same function as the bidirectional :func:`~.window_attention.window_linear_attention` (sets and weights in that
module's docstring), computed for every query block at once instead of block by block:

* the exact part: query blocks of ``C`` rows against their tile of ``C + 2 (w - 1)`` keys (the band ``|i - j| < w``,
  a fixed ``[C, C + 2 (w - 1)]`` pattern, and the unpadded, non-sink keys) and the row's sink slots, one batched
  product, the row maximum ``c_i`` over both;
* the tail: the keys ``j <= i - w`` and ``j >= i + max(w, 1)`` as two stabilised causal sums
  (:func:`~.linear_attention_parallel.shifted_tail_sums`, the second over the reversed sequence), each relative to
  the running maximum ``K_i`` of its keys' log-scales;
* one normaliser: ``E e^{-rho} + T_left e^{f_left - rho} + T_right e^{f_right - rho}`` with ``f = lq + K - c``
  (calibrated) or ``lq + K`` (learned, ``E`` times gamma) and ``rho = max(0, f_left, f_right)`` (detached);
* a row's sink queries attend to every unpadded key exactly (``window_attention._sink_query_rows``).

Gradients by autograd; the memory of one pass (``O(L (C + w + sinks))`` scores per head), which the CUDA path trades
for speed. This module imports only ``torch`` and its siblings ``feature_maps``, ``linear_attention``,
``linear_attention_parallel`` and ``window_state``.
"""

from __future__ import annotations

import torch

from .feature_maps import compute_dtype_for
from .linear_attention import _no_autocast, _repeat_kv, _safe_denominator, _with_ones_column
from .linear_attention_parallel import operand_dtype, shifted_tail_sums
from .window_state import row_sinks

BLOCK = 64
"""Query rows per block (each block's tile is ``BLOCK + 2 (w - 1)`` keys)."""


def _band_tiles(x: torch.Tensor, window: int, blocks: int) -> torch.Tensor:
    """``x`` ``[B, H, L, e]`` (or ``[B, L]``) as each query block's tile of keys ``[nC - w + 1, nC + C + w - 1)``:
    ``[B, H, n, span, e]`` (``[B, n, span]``), zero / False outside the sequence."""
    left, span = window - 1, BLOCK + 2 * (window - 1)
    right = blocks * BLOCK + left - x.shape[2 if x.dim() == 4 else 1]  # the last tile ends at blocks C + w - 1
    if x.dim() == 4:
        padded = torch.nn.functional.pad(x, (0, 0, left, right))
        return padded.unfold(2, span, BLOCK).transpose(-1, -2)
    return torch.nn.functional.pad(x, (left, right), value=False).unfold(1, span, BLOCK)


def parallel_bidirectional_window(query, key, value, feature_map, *, window, sinks, softmax_weight, key_padding_mask,
                                  scaling, eps, sink_rows):
    """The bidirectional operator (already validated; ``key_padding_mask`` bool or ``None``). ``sink_rows`` =
    ``(sink_query_rows, with_sink_queries)`` of :mod:`.window_attention` (the exact rows of the sink queries). Returns
    ``[B, H, L, dv]`` in ``value``'s dtype."""
    batch, heads, length, head_dim = query.shape
    groups = heads // key.shape[1]
    scaling = head_dim**-0.5 if scaling is None else float(scaling)
    dtype = compute_dtype_for(query)
    operands = operand_dtype(query)
    device = query.device
    with _no_autocast(device.type):
        gamma = None if softmax_weight is None else softmax_weight.to(dtype)
        query = query.to(dtype)
        unpadded = torch.ones(batch, length, dtype=torch.bool, device=device) if key_padding_mask is None \
            else key_padding_mask
        sink_key, sink_value, sink_position, sink_valid, is_sink = row_sinks(key, value, unpadded, sinks, None, 0)
        keep = unpadded & ~is_sink  # the band and the tail skip the row's sinks (attended through the sink slots)
        keys = _repeat_kv(key.to(dtype), groups)
        value_ones = _with_ones_column(_repeat_kv(value.to(dtype), groups)) * keep[:, None, :, None].to(dtype)

        blocks = -(-length // BLOCK)
        pad = blocks * BLOCK - length
        query_blocks = torch.nn.functional.pad(query, (0, 0, 0, pad)).view(batch, heads, blocks, BLOCK, head_dim)
        scores, values, allowed = [], [], []
        if sinks > 0:
            scores.append(torch.matmul(query_blocks, _repeat_kv(sink_key.to(dtype), groups)[:, :, None]
                                       .transpose(-1, -2)))
            values.append(_with_ones_column(_repeat_kv(sink_value.to(dtype), groups))[:, :, None])
            allowed.append(sink_valid[:, None, None, None, :])
        if window > 0:
            scores.append(torch.matmul(query_blocks, _band_tiles(keys, window, blocks).transpose(-1, -2)))
            values.append(_band_tiles(value_ones, window, blocks))
            row = torch.arange(BLOCK, device=device)[:, None]
            column = torch.arange(BLOCK + 2 * (window - 1), device=device)[None, :]
            band = (row + window - 1 - column).abs() < window  # |i - j| < w in tile coordinates
            allowed.append(band & _band_tiles(keep, window, blocks)[:, None, :, None, :])
        if scores:
            masked = [(s * scaling).masked_fill(~a, float("-inf")) for s, a in zip(scores, allowed)]
            row_max = torch.stack([m.amax(-1) for m in masked]).amax(0)
            row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
            if gamma is None:
                row_max = row_max.detach()  # calibrated: c cancels between the terms
            exact = sum(torch.matmul((m - row_max[..., None]).exp(), v) for m, v in zip(masked, values))
            exact = exact.reshape(batch, heads, blocks * BLOCK, -1)[:, :, :length]
            row_max = row_max.reshape(batch, heads, blocks * BLOCK)[:, :, :length]
        else:
            exact = query.new_zeros(batch, heads, length, value.shape[-1] + 1)
            row_max = query.new_zeros(batch, heads, length)
        if gamma is not None:
            exact = exact * gamma[None, :, None, None]

        exponents, tails = [], []
        if feature_map is not None:
            root = scaling**0.5
            q_features, k_features = feature_map(query * root, key.to(dtype) * root)
            phi_q = q_features.values
            log_q = query.new_zeros(batch, heads, length) if q_features.log_scale is None else q_features.log_scale
            phi_k = _repeat_kv(k_features.values, groups)
            log_k = phi_k.new_zeros(phi_k.shape[:-1]) if k_features.log_scale is None else \
                _repeat_kv(k_features.log_scale, groups)
            flip = lambda t: t.flip(2) if t.dim() >= 3 else t.flip(1)  # noqa: E731
            left = shifted_tail_sums(phi_q, phi_k, log_k, value_ones, keep, window, operands)
            right = shifted_tail_sums(flip(phi_q), flip(phi_k), flip(log_k), flip(value_ones), flip(keep),
                                      max(window, 1), operands)
            for sums, tail_max in (left, tuple(flip(t) for t in right)):
                tails.append(sums)
                exponents.append(log_q + tail_max - (row_max if gamma is None else 0.0))
        if tails:
            rho = torch.stack([torch.zeros_like(row_max)] + [e.detach() for e in exponents]).amax(0)
            total = exact * torch.exp(-rho)[..., None]
            for sums, exponent in zip(tails, exponents):
                total = total + sums * torch.exp(exponent - rho)[..., None]
        else:
            total = exact
        out = total[..., :-1] / _safe_denominator(total[..., -1:], eps)
        if sinks > 0:
            sink_query_rows, with_sink_queries = sink_rows
            rows = sink_query_rows(query, keys, _repeat_kv(value.to(dtype), groups), unpadded, sink_position, scaling)
            out = with_sink_queries(out, rows, sink_position, sink_valid)
    return out.to(value.dtype)
