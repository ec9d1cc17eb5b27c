"""The blocks of causal window attention as one autograd function with a hand-written backward.

What :func:`attend_blocks_naive` computes with autograd (the slow reference beside this fast path, same
operands), :func:`attend_blocks` computes group of blocks by group of blocks, keeping nothing between them but the
outputs and three numbers per query row (its exact-score maximum ``c``, its denominator ``D`` and its stabiliser
``rho``); the backward recomputes each group's scores and features and writes the gradients, as a flash-style softmax
kernel does. Per query row ``i`` (block ``n``, rows = the ``g`` query heads of a key head times the block's ``C``
queries), with ``[v, 1]`` the values with a ones column:

    E_i = sum_{x in sinks, cache, band} exp(s_ix - c_i) [v_x, 1]              (times gamma in learned mode)
    T_i = phi_i^T (S_n exp(K_n - K_i) + sum_{pending j} phi_j exp(lk_j - K_i) [v_j, 1])
    total_i = E_i exp(-rho_i) + T_i exp(f_i - rho_i),   f_i = u_i (learned) or u_i - c_i (calibrated),
    u_i = lq_i + K_i + a_i,   rho_i = max(0, f_i),   out_i = total_i[:dv] / D_i,   D_i = total_i[dv]

(``a_i <= 0`` the constant log tail weight of a bounded tail, 0 without one.) With ``go`` the output gradient, ``dtotal_i = [go_i, -go_i . out_i] / D_i``; everything else is the chain rule of
those lines (module code). In learned mode ``c_i`` is part of the definition: its gradient goes to the arg-max score
(shared by ties, as ``amax``'s). Feature maps are recomputed per group under autograd and backpropagated with
``torch.autograd.grad`` (which also accumulates a learned map's parameter gradients).

The operands, their layout and the reuse of outputs live in :mod:`.window_block_operands`. This module imports only
``torch`` and its siblings ``linear_attention`` and ``window_block_operands``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .linear_attention import _safe_denominator
from .window_block_operands import (  # noqa: F401  (re-exported: the causal operator and the exact twin use them)
    BlockOperands,
    BlockSpec,
    _accumulate,
    _fold_tiles,
    _from_blocks,
    _group,
    _per_block,
    block_layout,
    record_for_reuse,
    reused_outputs,
    take_reused,
)


def attend_blocks(operands: BlockOperands, spec: BlockSpec) -> torch.Tensor:
    """The outputs ``[B, Hkv, n, g C, dv]`` of the query blocks (module docstring), differentiable in every float
    operand and the feature map's parameters."""
    parameters = [] if spec.feature_map is None else [p for p in spec.feature_map.parameters() if p.requires_grad]
    names = [name for name, tensor in zip(BlockOperands._fields, operands)
             if isinstance(tensor, torch.Tensor) and tensor.is_floating_point()]
    floats = [getattr(operands, name) for name in names]
    return _BlockAttention.apply(spec, operands, names, len(parameters), *floats, *parameters)


def attend_blocks_naive(operands: BlockOperands, spec: BlockSpec) -> torch.Tensor:
    """:func:`attend_blocks` in one piece with autograd (the reference its backward is tested against)."""
    total, _ = _total(_forward_pieces(operands, spec))
    return total[..., :-1] / _safe_denominator(total[..., -1:], spec.eps)


class _Pieces(NamedTuple):
    """One group's recomputed forward quantities."""

    query: torch.Tensor  # [B, Hkv, n, gC, d]
    tiles: tuple  # (tile keys [B, Hkv, n, d, span], tile values + ones [B, Hkv, n, span, dv + 1])
    scores: list  # masked scores per kind, [B, Hkv, n, gC, x]
    weights: list  # exp(score - c), zero where masked
    value_ones: list  # the matching [.., x, dv + 1] values (sinks broadcast over blocks)
    row_max: torch.Tensor  # [B, Hkv, n, gC]
    exact: torch.Tensor  # [B, Hkv, n, gC, dv + 1] before gamma
    gamma_rows: torch.Tensor | None  # [Hkv, 1, gC, 1]
    tail: tuple | None  # (T [.., dv + 1], phi_q values [.., m], carried factor [.., gC], decayed pending scores, K)
    exponent: torch.Tensor | None  # f [B, Hkv, n, gC], or None


def _exact_pieces(operands: BlockOperands, spec: BlockSpec, query_blocks: torch.Tensor):
    """Masked scores, weights and values of the sinks, the cache and the band (in that order)."""
    batch, kv_heads, blocks, rows, _ = query_blocks.shape
    scores, value_ones = [], []
    if operands.sink_key.shape[2]:
        sink = torch.matmul(query_blocks.flatten(2, 3), operands.sink_key.transpose(-1, -2)) * spec.scaling
        sink = sink.view(batch, kv_heads, blocks, rows, -1)
        scores.append(sink.masked_fill_(~operands.sink_allowed[:, None], float("-inf")))
        sink_ones = torch.cat([operands.sink_value, operands.sink_value.new_ones(operands.sink_value.shape[:-1] + (1,))],
                              dim=-1)
        value_ones.append(sink_ones[:, :, None])  # [B, Hkv, 1, s, dv + 1]
    if operands.cache_key is not None:
        cache = torch.matmul(query_blocks, operands.cache_key.transpose(-1, -2)) * spec.scaling
        scores.append(cache.masked_fill_(~operands.cache_valid[:, :, :, None, :], float("-inf")))
        value_ones.append(torch.cat([operands.cache_value, operands.cache_value.new_ones(
            operands.cache_value.shape[:-1] + (1,))], dim=-1))
    tiles = None
    if spec.has_band:
        tile_keys = operands.keys.unfold(2, spec.span, spec.size)  # [B, Hkv, n, d, span]
        ones = operands.values.new_ones(operands.values.shape[:-1] + (1,))
        tile_values = torch.cat([operands.values, ones], dim=-1).unfold(2, spec.span, spec.size).transpose(-1, -2)
        band = torch.matmul(query_blocks, tile_keys) * spec.scaling
        allowed = spec.band_mask(query_blocks.device) & operands.band_keep[:, None, :, None, :]
        scores.append(band.masked_fill_(~allowed, float("-inf")))
        value_ones.append(tile_values)
        tiles = (tile_keys, tile_values)
    return scores, value_ones, tiles


def _forward_pieces(operands: BlockOperands, spec: BlockSpec, phi=None) -> _Pieces:
    """Recompute a group's forward (``phi``: the queries' features ``(values, log_scale)`` in block layout, already
    computed by the caller, or ``None`` to compute them here)."""
    kv_heads = operands.keys.shape[1]
    query_blocks = _per_block(operands.query, kv_heads, spec.groups, spec.size)
    batch, _, blocks, rows, _ = query_blocks.shape
    scores, value_ones, tiles = _exact_pieces(operands, spec, query_blocks)
    row_max = query_blocks.new_zeros(batch, kv_heads, blocks, rows)
    weights, exact = [], None
    if scores:
        row_max = torch.stack([score.amax(-1) for score in scores]).amax(0)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        if operands.gamma is None:
            row_max = row_max.detach()  # calibrated: c cancels between the terms
        for score, values in zip(scores, value_ones):
            weight = torch.exp(score - row_max[..., None])
            weights.append(weight)
            part = torch.matmul(weight, values)
            exact = part if exact is None else exact + part
    if exact is None:
        exact = query_blocks.new_zeros(batch, kv_heads, blocks, rows, operands.values.shape[-1] + 1)
    gamma_rows = None
    if operands.gamma is not None:
        gamma_rows = operands.gamma.view(kv_heads, spec.groups, 1).expand(-1, -1, spec.size).reshape(
            kv_heads, 1, rows, 1)
    exponent = None if operands.gamma is not None else -row_max
    tail = None
    if spec.feature_map is not None:
        if phi is None:
            features = spec.feature_map.query_features(operands.query * spec.root)
            phi = (_per_block(features.values, kv_heads, spec.groups, spec.size),
                   None if features.log_scale is None else
                   _per_block(features.log_scale[..., None], kv_heads, spec.groups, spec.size)[..., 0])
        tail, log_factor = _tail_pieces(operands, spec, phi)
        for term in (log_factor, operands.tail_log_weight):
            if term is not None:
                exponent = term if exponent is None else exponent + term
    return _Pieces(query_blocks, tiles, scores, weights, value_ones, row_max, exact, gamma_rows, tail, exponent)


def _pending_values(operands: BlockOperands, spec: BlockSpec) -> torch.Tensor:
    """``[B, Hkv, n, C, dv + 1]``: the values and a ones column of each block's pending tokens (its tile's first
    ``C`` keys)."""
    batch, kv_heads = operands.values.shape[:2]
    blocks = operands.query.shape[2] // spec.size
    values = operands.values[:, :, :blocks * spec.size]
    values = torch.cat([values, values.new_ones(values.shape[:-1] + (1,))], dim=-1)
    return values.view(batch, kv_heads, blocks, spec.size, -1)


def _tail_pieces(operands: BlockOperands, spec: BlockSpec, phi):
    """``(T, phi_q, carried factor, pending scores and decay, stabiliser)`` and the log factor ``u`` of a group's
    queries."""
    phi_q, log_q = phi
    sums, tail_max = operands.tail_sums, operands.tail_max
    if operands.tile_features is None:  # a sparse cache keeps the pending tokens exact: only the boundary's sums
        tail = torch.matmul(phi_q, sums)
        return (tail, phi_q, None, None, None), None if log_q is None else log_q + tail_max[..., None]
    if operands.tile_log_scale is None:
        mask = spec.pending_mask(phi_q.device) & operands.tile_keep[:, None, :, None, :]
        scores = torch.matmul(phi_q, operands.tile_features.transpose(-1, -2)).masked_fill_(~mask, 0.0)
        tail = torch.matmul(phi_q, sums) + torch.matmul(scores, _pending_values(operands, spec))
        return (tail, phi_q, None, (scores, None), None), None
    # Each row's stabiliser: the largest log-scale of the keys in its tail, never a later key's.
    keep = operands.tile_keep[:, None]  # [B, 1, n, C]
    masked = operands.tile_log_scale.masked_fill(~keep, float("-inf"))
    running = masked.detach().cummax(-1).values
    before = torch.cat([torch.full_like(running[..., :1], float("-inf")), running[..., :-1]], dim=-1)
    stabilizer = torch.maximum(tail_max[..., None], before.repeat(1, 1, 1, spec.groups))
    stabilizer = stabilizer.clamp_min(torch.finfo(sums.dtype).min)  # [B, Hkv, n, gC]
    carried = torch.exp(tail_max[..., None] - stabilizer)
    tail = torch.matmul(phi_q, sums) * carried[..., None]
    mask = spec.pending_mask(phi_q.device) & keep[..., None, :]
    decay = torch.exp(masked[..., None, :] - stabilizer[..., None]).masked_fill_(~mask, 0.0)
    scores = torch.matmul(phi_q, operands.tile_features.transpose(-1, -2)) * decay
    tail = tail + torch.matmul(scores, _pending_values(operands, spec))
    return (tail, phi_q, carried, (scores, decay), stabilizer), log_q + stabilizer


def _total(pieces: _Pieces):
    exact = pieces.exact if pieces.gamma_rows is None else pieces.exact * pieces.gamma_rows
    if pieces.tail is None:
        return exact, None
    if pieces.exponent is None:
        return exact + pieces.tail[0], None
    rho = pieces.exponent.detach().clamp_min(0.0)
    return exact * torch.exp(-rho)[..., None] + pieces.tail[0] * torch.exp(pieces.exponent - rho)[..., None], rho


class _BlockAttention(torch.autograd.Function):
    """See :func:`attend_blocks`. Inputs after the spec: the operands (for their masks and ``None`` parts), the names
    of the float operands given next, the number of map parameters, the float operands, the map parameters."""

    @staticmethod
    def forward(ctx, spec, operands, names, n_parameters, *tensors):
        operands = operands._replace(**dict(zip(names, tensors[:len(names)])))
        blocks, per_group, expected = block_layout(operands, spec)
        reused = take_reused(expected)
        if reused is not None:
            out, denominator = reused
        else:
            outputs, denominators = [], []
            with torch.no_grad():
                for start in range(0, blocks, per_group):
                    pieces = _forward_pieces(_group(operands, spec, start, min(start + per_group, blocks)), spec)
                    total, _ = _total(pieces)
                    denominator = _safe_denominator(total[..., -1], spec.eps)
                    outputs.append(total[..., :-1] / denominator[..., None])
                    denominators.append(denominator)
            out, denominator = torch.cat(outputs, dim=2), torch.cat(denominators, dim=2)
            record_for_reuse(out, denominator)
        ctx.spec, ctx.operands, ctx.names, ctx.per_group = spec, operands._replace(
            **{name: None for name in names}), names, per_group
        ctx.save_for_backward(out, denominator, *tensors)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        spec, names = ctx.spec, ctx.names
        out, denominator, *tensors = ctx.saved_tensors
        operands = ctx.operands._replace(**dict(zip(names, tensors[:len(names)])))
        parameters = list(tensors[len(names):])
        wanted = dict(zip(names, ctx.needs_input_grad[4:4 + len(names)]))
        grads = {name: torch.zeros_like(getattr(operands, name)) for name in names if wanted[name]}
        parameter_grads = [None] * len(parameters)
        blocks = operands.query.shape[2] // spec.size
        for start in range(0, blocks, ctx.per_group):
            end = min(start + ctx.per_group, blocks)
            group = _group(operands, spec, start, end)
            group_grads, group_parameter_grads = _backward_group(
                group, spec, out[:, :, start:end], denominator[:, :, start:end], grad_out[:, :, start:end], wanted,
                parameters)
            _accumulate(grads, group_grads, spec, start, end)
            parameter_grads = [a if b is None else b if a is None else a + b
                               for a, b in zip(parameter_grads, group_parameter_grads)]
        return (None, None, None, None, *(grads.get(name) for name in names), *parameter_grads)


def _backward_group(operands: BlockOperands, spec: BlockSpec, out, denominator, grad_out, wanted, parameters):
    """The gradients of one group's operands (``{name: tensor}``, tiles already folded) and of the map parameters."""
    kv_heads, groups, size = operands.keys.shape[1], spec.groups, spec.size
    feature_map = spec.feature_map
    query_leaf = operands.query.detach().requires_grad_(bool(wanted.get("query")) and feature_map is not None)
    phi = None
    features = None
    if feature_map is not None:
        with torch.enable_grad():
            features = feature_map.query_features(query_leaf * spec.root)
        phi = (_per_block(features.values.detach(), kv_heads, groups, size),
               None if features.log_scale is None else
               _per_block(features.log_scale.detach()[..., None], kv_heads, groups, size)[..., 0])
    with torch.no_grad():
        pieces = _forward_pieces(operands, spec, phi)
        _, rho = _total(pieces)
        go, o = grad_out, out  # [B, Hkv, n, gC, dv]
        scale = 1.0 / denominator  # [B, Hkv, n, gC]
        d_total = torch.cat([go * scale[..., None], -(go * o).sum(-1, keepdim=True) * scale[..., None]], dim=-1)
        grads = {}
        # total = gamma E exp(-rho) + T exp(f - rho)
        d_exact = d_total if rho is None else d_total * torch.exp(-rho)[..., None]
        if pieces.gamma_rows is not None:
            if wanted.get("gamma"):
                per_row = (d_exact * pieces.exact).sum(-1).sum((0, 2))  # [Hkv, gC]
                grads["gamma"] = per_row.view(kv_heads, groups, size).sum(-1).reshape(-1)
            d_exact = d_exact * pieces.gamma_rows
        if wanted.get("tail_log_weight"):  # total = ... + T exp(f - rho), f including the log weight
            tail_term = pieces.tail[0] * torch.exp(pieces.exponent - (0.0 if rho is None else rho))[..., None]
            grads["tail_log_weight"] = (d_total * tail_term).sum(-1)  # [B, Hkv, n, gC]: a learned weight is per head
        d_query_blocks = torch.zeros_like(pieces.query)
        d_query_blocks_from_map, parameter_grads = None, [None] * len(parameters)
        if pieces.tail is not None:
            _tail_backward(pieces, operands, spec, d_total, rho, grads, wanted, phi, features, query_leaf,
                           parameters)
            d_query_blocks_from_map = grads.pop("_query_from_map", None)
            parameter_grads = grads.pop("_parameters", parameter_grads)
        _exact_backward(pieces, operands, spec, d_exact, d_query_blocks, grads, wanted)
        d_query = _from_blocks(d_query_blocks, groups, size)
        if d_query_blocks_from_map is not None:
            d_query = d_query + d_query_blocks_from_map
        grads["query"] = d_query
    return grads, parameter_grads


def _exact_backward(pieces: _Pieces, operands: BlockOperands, spec: BlockSpec, d_exact, d_query_blocks, grads,
                    wanted):
    """Gradients through ``E = sum_x exp(s_x - c) [v_x, 1]`` (``d_exact`` its gradient, gamma applied) and, in learned
    mode, through ``c`` (in calibrated mode ``c`` cancels: it is detached)."""
    if not pieces.scores:
        return
    d_scores = []
    row_sum = None
    for weight, values in zip(pieces.weights, pieces.value_ones):
        d_score = weight * torch.matmul(d_exact, values.transpose(-1, -2))
        d_scores.append(d_score)
        row_sum = d_score.sum(-1) if row_sum is None else row_sum + d_score.sum(-1)
    if operands.gamma is not None:  # c_i = max score: its gradient -sum(ds) goes to the arg-max
        d_c = -row_sum
        is_max = [(score == pieces.row_max[..., None]) for score in pieces.scores]
        ties = sum(mask.sum(-1) for mask in is_max).clamp_min(1)
        d_scores = [d_score + mask * (d_c / ties)[..., None] for d_score, mask in zip(d_scores, is_max)]
    kinds = (["sinks"] if operands.sink_key.shape[2] else []) + (["cache"] if operands.cache_key is not None else []) \
        + (["band"] if pieces.tiles is not None else [])
    batch, kv_heads, blocks, rows, _ = pieces.query.shape
    for kind, d_score, weight in zip(kinds, d_scores, pieces.weights):
        d_score = d_score * spec.scaling
        if kind == "sinks":
            flat = d_score.flatten(2, 3)  # [B, Hkv, n gC, s]
            d_query_blocks += torch.matmul(d_score, operands.sink_key[:, :, None])
            if wanted.get("sink_key"):
                grads["sink_key"] = torch.matmul(flat.transpose(-1, -2), pieces.query.flatten(2, 3))
            if wanted.get("sink_value"):
                grads["sink_value"] = torch.matmul(weight.flatten(2, 3).transpose(-1, -2),
                                                   d_exact.flatten(2, 3))[..., :-1]
        elif kind == "cache":
            d_query_blocks += torch.matmul(d_score, operands.cache_key)
            if wanted.get("cache_key"):
                grads["cache_key"] = torch.matmul(d_score.transpose(-1, -2), pieces.query)
            if wanted.get("cache_value"):
                grads["cache_value"] = torch.matmul(weight.transpose(-1, -2), d_exact)[..., :-1]
        else:
            tile_keys, _ = pieces.tiles
            d_query_blocks += torch.matmul(d_score, tile_keys.transpose(-1, -2))
            length = operands.keys.shape[2]
            if wanted.get("keys"):
                grads["keys"] = grads.get("keys", 0) + _fold_tiles(
                    torch.matmul(d_score.transpose(-1, -2), pieces.query), spec, length)
            if wanted.get("values"):
                grads["values"] = grads.get("values", 0) + _fold_tiles(
                    torch.matmul(weight.transpose(-1, -2), d_exact)[..., :-1], spec, length)


def _tail_backward(pieces: _Pieces, operands: BlockOperands, spec: BlockSpec, d_total, rho, grads, wanted, phi,
                   features, query_leaf, parameters):
    """Gradients through ``T exp(f - rho)``: into the tail sums, the pending tiles, the exponent's ``lq`` (and, in
    learned mode, nothing else; in calibrated mode ``-c`` is detached) and through the map into the queries."""
    tail, phi_q, carried, pending, stabilizer = pieces.tail
    factor = None if pieces.exponent is None else torch.exp(pieces.exponent - rho)
    d_tail = d_total if factor is None else d_total * factor[..., None]
    d_log_q = None
    if pieces.exponent is not None and phi[1] is not None:
        d_log_q = factor * (d_total * tail).sum(-1)  # df = d u = d lq (K detached)
    sums = operands.tail_sums
    d_carried_tail = d_tail if carried is None else d_tail * carried[..., None]
    d_phi_q = torch.matmul(d_carried_tail, sums.transpose(-1, -2))
    if wanted.get("tail_sums"):
        grads["tail_sums"] = torch.matmul(phi_q.transpose(-1, -2), d_carried_tail)
    if pending is not None:
        scores, decay = pending
        pending_values = _pending_values(operands, spec)  # [B, Hkv, n, C, dv + 1]
        d_scores = torch.matmul(d_tail, pending_values.transpose(-1, -2))  # [B, Hkv, n, gC, C]
        mask = spec.pending_mask(phi_q.device) & operands.tile_keep[:, None, :, None, :]
        d_scores = d_scores.masked_fill_(~mask, 0.0)
        raw = d_scores if decay is None else d_scores * decay
        d_phi_q = d_phi_q + torch.matmul(raw, operands.tile_features)
        if wanted.get("tile_features"):
            grads["tile_features"] = torch.matmul(raw.transpose(-1, -2), phi_q)
        if decay is not None and wanted.get("tile_log_scale"):
            grads["tile_log_scale"] = (d_scores * scores).sum(-2)  # d lk_j = sum_i dS_ij S_ij
        if wanted.get("values"):
            d_values = torch.matmul(scores.transpose(-1, -2), d_tail)[..., :-1]  # [B, Hkv, n, C, dv]
            full = torch.zeros_like(operands.values)
            full[:, :, :d_values.shape[2] * spec.size] = d_values.flatten(2, 3)
            grads["values"] = grads.get("values", 0) + full
    # Through the feature map into the queries (and the map's parameters).
    groups, size = spec.groups, spec.size
    outputs, output_grads = [features.values], [_from_blocks(d_phi_q, groups, size)]
    if d_log_q is not None and features.log_scale.requires_grad:  # (FAVOR+'s log-scale is a detached constant)
        outputs.append(features.log_scale)
        output_grads.append(_from_blocks(d_log_q[..., None], groups, size)[..., 0])
    targets = ([query_leaf] if query_leaf.requires_grad else []) + list(parameters)
    if targets:
        with torch.enable_grad():
            found = list(torch.autograd.grad(outputs, targets, output_grads, allow_unused=True))
        if query_leaf.requires_grad:
            grads["_query_from_map"] = found.pop(0) * 1.0
        grads["_parameters"] = found
