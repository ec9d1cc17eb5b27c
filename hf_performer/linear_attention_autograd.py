"""Chunked linear attention with a hand-written backward that recomputes the features chunk by chunk.

The features ``phi(Q)``, ``phi(K)`` ``[B, H, L, m]`` (``m = 4 d`` for FAVOR+) are never held for the whole
sequence, in the forward or the backward: :class:`ChunkedLinearAttention` saves only its inputs
``q, k, v`` ``[B, H, L, d]``, its output and the output's denominators ``[B, H, L, dv + 1]`` (as a flash-style
softmax kernel saves its output and log-sum-exp: the backward then needs no second forward), the small sums
(``[m, dv + 1]`` per head), the key stabilisers (one per (example, head), or the running one per token
``[B, H, L]`` in causal mode) and, in the backward, recomputes the features of ``C`` tokens at a time. Peak memory
is then ``O(L d)`` per head, like a flash-style softmax kernel, plus ``O(C m)`` of chunk temporaries.

Layout and conventions are those of :mod:`.linear_attention` (queries ``[B, H, L, d]``, keys and values
``[B, Hkv, L, d]``, ``H % Hkv == 0``); the inputs are multiplied by ``scale`` chunk by chunk (no scaled
copy of the inputs is kept). Stabilisers (``pitfalls.md`` #1-#3):

* bidirectional: the keys share ``c``, the maximum of the unpadded keys' log-scales of each (example, head).
  It is found in the same pass as the sums, online: when a chunk raises the maximum, the sums so far are
  rescaled by ``exp(c_old - c_new)``. The backward reuses the saved ``c``;
* causal: ``c_j``, the running maximum of the log-scales up to key ``j`` (and the initial state's); the
  forward saves ``c_j`` ``[B, H, L]`` and the backward uses it as it is.

Gradients: maps with :meth:`~.feature_map_base.FeatureMap.features_vjp` (FAVOR+, whose projection is a buffer)
use it; any other map (learned maps with trainable parameters, trig, relu, elu+1) recomputes each chunk's
features under autograd and backpropagates the chunk's feature gradient with ``torch.autograd.grad``, which
also accumulates the gradients of the map's parameters. The backward recomputes with the tensors of the forward:
a random map that redrew its projection in between gets the forward's back meanwhile (a saved ``[m, d]`` copy).

The causal backward takes two passes: forward order (rebuilding the states ``[m, dv + 1]`` chunk by chunk)
for the query gradients, reverse order (accumulating the state gradients) for the key and value gradients;
the states between chunks are never stored.

The call's settings and the shared tensor helpers live in :mod:`.linear_attention_chunks`. This module imports only
``torch`` and its siblings ``feature_maps`` and ``linear_attention_chunks``: it ships next to saved models for
``trust_remote_code``.
"""

from __future__ import annotations

import torch

from .feature_maps import compute_dtype_for
from .linear_attention_chunks import (
    ChunkedAttentionSettings,
    _add_matmul_,
    _chunks,
    _finite_min,
    _keep,
    _repeat_kv,
    _safe_denominator,
    _scale_rows,
    _sum_groups,
    _values_with_ones,
)


# -------------------------------------------------------------------------------------------- bidirectional


def _stabilised_keys(values, log_scale, keep, stabilizer):
    """``phi(k) exp(-c)``: values ``[B, h, C, m]`` times ``exp(log_scale - c)``, padded keys zeroed."""
    if log_scale is not None:
        values = _scale_rows(values, torch.exp(log_scale - stabilizer[..., None])[..., None])
    if keep is not None:
        values = _scale_rows(values, keep[..., None])
    return values


def _bidirectional_forward(settings, query, key, value, mask, out, denominators):
    """Writes ``out`` ``[B, H, Lq, dv]`` and its denominators ``[B, H, Lq, 1]``; returns the sums ``kv``
    ``[B, Hkv, m, dv + 1]`` (last column: the normaliser) and the key stabiliser ``c`` ``[B, Hkv]``. One pass over
    the keys (online maximum), one over the queries."""
    dtype, floor = settings.dtype, _finite_min(settings.dtype)
    batch, kv_heads = key.shape[:2]
    groups = query.shape[1] // kv_heads
    kv = stabilizer = None
    for start, end in _chunks(key.shape[2], settings.chunk_size):
        keep = _keep(mask, start, end)
        _, values, log_scale = settings.key_features(key[:, :, start:end])
        if kv is None:
            kv = values.new_zeros(batch, kv_heads, values.shape[-1], value.shape[-1] + 1)
            stabilizer = values.new_full((batch, kv_heads), floor if log_scale is not None else 0.0)
        if log_scale is not None:
            if keep is not None:
                log_scale = log_scale.masked_fill(~keep, float("-inf"))
            grown = torch.maximum(stabilizer, log_scale.amax(-1)).clamp_min_(floor)
            kv.mul_(torch.exp(stabilizer - grown)[..., None, None])
            stabilizer = grown
        phi_k = _stabilised_keys(values, log_scale, keep, stabilizer)
        _add_matmul_(kv, phi_k.transpose(-1, -2), _values_with_ones(value[:, :, start:end], keep, dtype))
    kv_per_query_head = _repeat_kv(kv, groups)
    for start, end in _chunks(query.shape[2], settings.chunk_size):
        _, phi_q = settings.query_features(query[:, :, start:end])
        sums = torch.matmul(phi_q, kv_per_query_head)
        denominator = denominators[:, :, start:end] = _safe_denominator(sums[..., -1:], settings.eps)
        out[:, :, start:end] = sums[..., :-1] / denominator
    return kv, stabilizer


def _output_gradient(out, denominator, grad_out):
    """``out = N / D`` from ``sums = [N, D]`` ``[..., dv + 1]`` (``D`` as the forward kept it away from 0): the
    gradient ``[..., dv + 1]`` of ``sums`` for ``grad_out``, from the saved ``out`` and ``D`` (no second forward)."""
    grad_numerator = grad_out / denominator
    return torch.cat([grad_numerator, -(grad_numerator * out).sum(-1, keepdim=True)], dim=-1)


def _bidirectional_backward(settings, query, key, value, mask, kv, stabilizer, out, denominators, grad_out,
                            grad_query, grad_key, grad_value):
    """Writes the gradients ``grad_query``, ``grad_key``, ``grad_value`` (shaped as the inputs); ``out`` and
    ``denominators`` are the forward's."""
    dtype = settings.dtype
    groups = query.shape[1] // key.shape[1]
    kv_per_query_head = _repeat_kv(kv, groups)
    grad_kv = torch.zeros_like(kv_per_query_head)
    for start, end in _chunks(query.shape[2], settings.chunk_size):
        x, phi_q = settings.query_features(query[:, :, start:end], track=settings.track)
        with torch.no_grad():
            phi = phi_q.detach()
            grad_sums = _output_gradient(out[:, :, start:end], denominators[:, :, start:end],
                                         grad_out[:, :, start:end].to(dtype))
            _add_matmul_(grad_kv, phi.transpose(-1, -2), grad_sums)
            grad_phi_q = torch.matmul(grad_sums, kv_per_query_head.transpose(-1, -2))
        grad_query[:, :, start:end] = settings.features_backward(x, phi_q, grad_phi_q)
    grad_kv = _sum_groups(grad_kv, groups)
    for start, end in _chunks(key.shape[2], settings.chunk_size):
        keep = _keep(mask, start, end)
        shift = stabilizer[..., None].expand(-1, -1, end - start)
        x, phi_k = settings.shifted_key_features(key[:, :, start:end], shift, keep, track=settings.track)
        with torch.no_grad():
            grad_value[:, :, start:end] = torch.matmul(phi_k.detach(), grad_kv[..., :-1])
            ones = _values_with_ones(value[:, :, start:end], keep, dtype)
            grad_phi_k = torch.matmul(ones, grad_kv.transpose(-1, -2))
        grad_key[:, :, start:end] = settings.features_backward(x, phi_k, grad_phi_k)


# -------------------------------------------------------------------------------------------- causal


class _CausalChunk:
    """The stabiliser rescalings of one causal chunk of ``C`` tokens, ``running`` ``c`` ``[B, H, C]``
    (non-decreasing) after ``previous`` ``[B, H]`` (the stabiliser of the state before the chunk):

    * ``decay`` ``[B, H, C, C]``: ``exp(c_j - c_i)`` for keys ``j <= i``, else 0 (key ``j`` seen from query ``i``);
    * ``from_state`` ``[B, H, C, 1]``: ``exp(previous - c_i)`` (the state seen from query ``i``);
    * ``to_end`` ``[B, H, C, 1]``: ``exp(c_j - c_end)`` and ``carry`` ``[B, H, 1, 1]``: ``exp(previous - c_end)``
      (the next state is relative to the chunk's last stabiliser ``c_end``).
    """

    def __init__(self, running: torch.Tensor, previous: torch.Tensor):
        # c is non-decreasing, so c_j - c_i <= 0 below the diagonal; above it, exp may overflow, tril_ overwrites it.
        self.decay = (running[..., None, :] - running[..., :, None]).exp_().tril_()
        end = running[..., -1:]
        self.from_state = torch.exp(previous[..., None] - running)[..., None]
        self.to_end = torch.exp(running - end)[..., None]
        self.carry = torch.exp(previous[..., None] - end)[..., None]


def _next_state_(state, rescale, phi_k, ones):
    """The state after a chunk, in place (no state-sized temporary): ``state exp(c_prev - c_end) +
    phi_k^T (ones exp(c_j - c_end))``."""
    return _add_matmul_(state.mul_(rescale.carry), phi_k.transpose(-1, -2), ones * rescale.to_end)


def _causal_keys(values, log_scale, keep, previous, groups, floor):
    """Key features of a chunk for the ``H`` query heads, each row ``j`` relative to its running stabiliser
    ``c_j``: ``[B, H, C, m]`` and ``c`` ``[B, H, C]`` (the running maximum of the log-scales after ``previous``)."""
    values = _repeat_kv(values, groups)
    if log_scale is None:
        running = previous[..., None].expand(-1, -1, values.shape[2])
    else:
        log_scale = _repeat_kv(log_scale, groups)
        if keep is not None:
            log_scale = log_scale.masked_fill(~keep, float("-inf"))
        running = torch.cummax(torch.maximum(log_scale.detach(), previous[..., None]), dim=-1).values.clamp_min(floor)
        values = _scale_rows(values, torch.exp(log_scale - running)[..., None])
    if keep is not None:
        values = _scale_rows(values, keep[..., None])
    return values, running


def _known_causal_keys(settings, key, keep, previous, running, groups, track=False):
    """``x`` and the key features of a chunk for the ``H`` query heads, relative to the forward's running stabiliser
    ``running`` ``[B, H, C]``, as :func:`_causal_keys` gives them: one shifted feature step
    (:meth:`ChunkedAttentionSettings.shifted_key_features`) without grouped heads; with them (one stabiliser per
    query head, one feature row per key head), :func:`_causal_keys` from the chunk's ``previous`` ``[B, H]``."""
    if groups == 1:
        return settings.shifted_key_features(key, running, keep, track=track)
    x, values, log_scale = settings.key_features(key, track=track)
    with torch.set_grad_enabled(track):
        return x, _causal_keys(values, log_scale, keep, previous, groups, _finite_min(settings.dtype))[0]


def _causal_forward(settings, query, key, value, mask, state, stabilizer, out, denominators, running_all):
    """Writes ``out`` ``[B, H, L, dv]``, its denominators ``[B, H, L, 1]`` and the running stabiliser
    ``running_all`` ``[B, H, L]``; returns the final state ``[B, H, m, dv + 1]`` and the start stabiliser as used (0
    for maps without log-scales).

    ``state`` ``[B, H, m, dv + 1]`` (or ``None``: zeros) and ``stabilizer`` ``[B, H]`` describe the tokens before.
    """
    dtype, floor = settings.dtype, _finite_min(settings.dtype)
    batch, heads, length = query.shape[:3]
    groups = heads // key.shape[1]
    state = None if state is None else state.clone()  # updated in place
    for start, end in _chunks(length, settings.chunk_size):
        keep = _keep(mask, start, end)
        _, phi_q = settings.query_features(query[:, :, start:end])
        _, values, log_scale = settings.key_features(key[:, :, start:end])
        if state is None:
            state = values.new_zeros(batch, heads, values.shape[-1], value.shape[-1] + 1)
        if log_scale is None:
            stabilizer = torch.zeros_like(stabilizer)  # maps without log-scales need no stabiliser
        phi_k, running = _causal_keys(values, log_scale, keep, stabilizer, groups, floor)
        running_all[:, :, start:end] = running
        rescale = _CausalChunk(running, stabilizer)
        ones = _repeat_kv(_values_with_ones(value[:, :, start:end], keep, dtype), groups)
        scores = torch.matmul(phi_q, phi_k.transpose(-1, -2)).mul_(rescale.decay)
        sums = torch.matmul(scores, ones).add_(torch.matmul(phi_q, state).mul_(rescale.from_state))
        denominator = denominators[:, :, start:end] = _safe_denominator(sums[..., -1:], settings.eps)
        out[:, :, start:end] = sums[..., :-1] / denominator
        state = _next_state_(state, rescale, phi_k, ones)
        if start == 0:
            start_stabilizer = stabilizer
        stabilizer = running[..., -1]
    return state, start_stabilizer


def _causal_backward(settings, query, key, value, mask, start_state, start_stabilizer, running_all, out,
                     denominators, grad_out, grad_final, grad_query, grad_key, grad_value):
    """Gradients of :func:`_causal_forward` (two passes; ``out`` and ``denominators`` are the forward's): writes
    those w.r.t. query, key and value, returns that w.r.t. the start state."""
    dtype = settings.dtype
    batch, heads, length = query.shape[:3]
    groups = heads // key.shape[1]
    chunks = _chunks(length, settings.chunk_size)
    previous_of = lambda start: start_stabilizer if start == 0 else running_all[:, :, start - 1]  # noqa: E731
    grad_sums_of = lambda start, end: _output_gradient(  # noqa: E731
        out[:, :, start:end], denominators[:, :, start:end], grad_out[:, :, start:end].to(dtype))
    state = None if start_state is None else start_state.clone()  # updated in place
    for start, end in chunks:  # forward order: the states before each chunk, the query gradients
        keep = _keep(mask, start, end)
        previous = previous_of(start)
        x, phi_q = settings.query_features(query[:, :, start:end], track=settings.track)
        with torch.no_grad():
            _, phi_k = _known_causal_keys(settings, key[:, :, start:end], keep, previous, running_all[:, :, start:end],
                                          groups)
            if state is None:
                state = phi_k.new_zeros(batch, heads, phi_k.shape[-1], value.shape[-1] + 1)
            rescale = _CausalChunk(running_all[:, :, start:end], previous)
            ones = _repeat_kv(_values_with_ones(value[:, :, start:end], keep, dtype), groups)
            grad_sums = grad_sums_of(start, end)
            grad_scores = torch.matmul(grad_sums, ones.transpose(-1, -2)).mul_(rescale.decay)
            grad_phi_q = _add_matmul_(torch.matmul(grad_scores, phi_k), grad_sums * rescale.from_state,
                                      state.transpose(-1, -2))
            state = _next_state_(state, rescale, phi_k, ones)
        grad_query[:, :, start:end] = settings.features_backward(x, phi_q, grad_phi_q)
    grad_state = torch.zeros_like(state) if grad_final is None else grad_final.to(dtype, copy=True)
    for start, end in reversed(chunks):  # reverse order: the state gradients, the key and value gradients
        keep = _keep(mask, start, end)
        previous = previous_of(start)
        with torch.no_grad():
            _, phi_q = settings.query_features(query[:, :, start:end])
        x, phi_k = _known_causal_keys(settings, key[:, :, start:end], keep, previous, running_all[:, :, start:end],
                                      groups, track=settings.track)
        with torch.no_grad():
            rescale = _CausalChunk(running_all[:, :, start:end], previous)
            ones = _repeat_kv(_values_with_ones(value[:, :, start:end], keep, dtype), groups)
            grad_sums = grad_sums_of(start, end)
            phi = phi_k.detach()
            scores = torch.matmul(phi_q, phi.transpose(-1, -2)).mul_(rescale.decay)
            grad_ones = torch.matmul(phi, grad_state).mul_(rescale.to_end)
            grad_ones = _add_matmul_(grad_ones, scores.transpose(-1, -2), grad_sums)
            grad_scores = torch.matmul(grad_sums, ones.transpose(-1, -2)).mul_(rescale.decay)
            grad_phi_k = _add_matmul_(torch.matmul(grad_scores.transpose(-1, -2), phi_q), ones * rescale.to_end,
                                      grad_state.transpose(-1, -2))
            grad_state = _add_matmul_(grad_state.mul_(rescale.carry), phi_q.transpose(-1, -2),
                                      grad_sums * rescale.from_state)
            grad_v = _sum_groups(grad_ones[..., :-1], groups)
            if keep is not None:
                grad_v = grad_v.masked_fill_(~keep[..., None], 0.0)
            grad_value[:, :, start:end] = grad_v
        grad_key[:, :, start:end] = settings.features_backward(x, phi_k, grad_phi_k, groups)
    return grad_state


# -------------------------------------------------------------------------------------------- the Function


class ChunkedLinearAttention(torch.autograd.Function):
    """Linear attention, feature map inside, chunked forward and backward (see the module docstring).

    ``apply(settings, query, key, value, key_padding_mask, start_kv, start_k_sum, start_stabilizer, *parameters)``
    with ``query`` ``[B, H, L, d]``, ``key`` ``[B, Hkv, L, d]``, ``value`` ``[B, Hkv, L, dv]`` (any float dtype,
    unscaled), ``key_padding_mask`` ``[B, L]`` bool or ``None``, the causal start state (``[B, H, m, dv]``,
    ``[B, H, m]``, ``[B, H]``, or ``None``s) and ``parameters`` = ``settings.parameters`` (the map's trainable
    parameters, so that autograd routes their gradients here).

    Returns ``out`` ``[B, H, L, dv]`` in the compute dtype; causal: also the final state ``[B, H, m, dv + 1]``
    and the running stabiliser ``[B, H, L]`` (non-differentiable); bidirectional: the sums ``[B, Hkv, m, dv + 1]``
    and stabiliser ``[B, Hkv]`` (non-differentiable, for inspection).
    """

    @staticmethod
    def forward(ctx, settings, query, key, value, key_padding_mask, start_kv, start_k_sum, start_stabilizer,
                *parameters):
        ctx.settings = settings
        batch, heads, length = query.shape[:3]
        dtype = settings.dtype
        out = query.new_empty(batch, heads, length, value.shape[-1], dtype=dtype)
        denominators = query.new_empty(batch, heads, length, 1, dtype=dtype)
        if settings.causal:
            if start_kv is None:
                start_state = None
                start_stabilizer = query.new_full((batch, heads), _finite_min(dtype), dtype=dtype)
            else:
                start_state = torch.cat([start_kv, start_k_sum[..., None]], dim=-1).to(dtype)
                start_stabilizer = start_stabilizer.to(dtype)
            running = query.new_empty(batch, heads, length, dtype=dtype)
            finals, starts = [], []
            for kv_block, q_block in settings.head_blocks(query, key):
                final, used_start = _causal_forward(
                    settings, query[:, q_block], key[:, kv_block], value[:, kv_block], key_padding_mask,
                    None if start_state is None else start_state[:, q_block], start_stabilizer[:, q_block],
                    out[:, q_block], denominators[:, q_block], running[:, q_block])
                finals.append(final)
                starts.append(used_start)
            final, start_stabilizer = torch.cat(finals, dim=1), torch.cat(starts, dim=1)
            ctx.has_start_state = start_state is not None
            ctx.save_for_backward(query, key, value, key_padding_mask, out, denominators, start_state,
                                  start_stabilizer, running)
            ctx.mark_non_differentiable(running)
            return out, final, running
        sums = [_bidirectional_forward(settings, query[:, q_block], key[:, kv_block], value[:, kv_block],
                                       key_padding_mask, out[:, q_block], denominators[:, q_block])
                for kv_block, q_block in settings.head_blocks(query, key)]
        kv, stabilizer = (torch.cat(parts, dim=1) for parts in zip(*sums))
        ctx.save_for_backward(query, key, value, key_padding_mask, out, denominators, kv, stabilizer)
        ctx.mark_non_differentiable(kv, stabilizer)
        return out, kv, stabilizer

    @staticmethod
    def backward(ctx, grad_out, grad_second, _):
        settings = ctx.settings
        settings.parameter_grads = [None] * len(settings.parameters)
        grad_start_kv = grad_start_k_sum = None
        query, key, value, mask, out, denominators, *saved = ctx.saved_tensors
        grad_query, grad_key, grad_value = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        grads = lambda q_block, kv_block: (grad_query[:, q_block], grad_key[:, kv_block], grad_value[:, kv_block])  # noqa: E731
        with settings.tensors_of_the_forward():
            if settings.causal:
                start_state, start_stabilizer, running = saved
                grad_states = []
                for kv_block, q_block in settings.head_blocks(query, key):
                    grad_states.append(_causal_backward(
                        settings, query[:, q_block], key[:, kv_block], value[:, kv_block], mask,
                        None if start_state is None else start_state[:, q_block], start_stabilizer[:, q_block],
                        running[:, q_block], out[:, q_block], denominators[:, q_block], grad_out[:, q_block],
                        None if grad_second is None else grad_second[:, q_block], *grads(q_block, kv_block)))
                if ctx.has_start_state:
                    grad_state = torch.cat(grad_states, dim=1)
                    grad_start_kv, grad_start_k_sum = grad_state[..., :-1], grad_state[..., -1]
            else:
                kv, stabilizer = saved
                for kv_block, q_block in settings.head_blocks(query, key):
                    _bidirectional_backward(settings, query[:, q_block], key[:, kv_block], value[:, kv_block], mask,
                                            kv[:, kv_block], stabilizer[:, kv_block], out[:, q_block],
                                            denominators[:, q_block], grad_out[:, q_block],
                                            *grads(q_block, kv_block))
        return (None, grad_query, grad_key, grad_value, None, grad_start_kv, grad_start_k_sum, None,
                *settings.parameter_grads)


def chunked_linear_attention(query, key, value, feature_map, *, causal, key_padding_mask, scale, initial_state,
                             chunk_size, eps):
    """Run :class:`ChunkedLinearAttention` (the map has already been given its chance to redraw).

    ``initial_state``: ``(kv [B, H, m, dv], k_sum [B, H, m], stabilizer [B, H])`` or ``None``.
    Returns ``out`` ``[B, H, L, dv]`` in the compute dtype and, causal, the final
    ``(kv, k_sum, stabilizer)``; bidirectional ``None``.
    """
    settings = ChunkedAttentionSettings(feature_map, causal, scale, chunk_size, eps, compute_dtype_for(query))
    start = (None, None, None) if initial_state is None else tuple(initial_state)
    out, final, running = ChunkedLinearAttention.apply(settings, query, key, value, key_padding_mask, *start,
                                                       *settings.parameters)
    if not causal:
        return out, None
    return out, (final[..., :-1], final[..., -1], running[:, :, -1])
