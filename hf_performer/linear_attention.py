"""Linear attention kernels: bidirectional, causal (chunked prefix sums) and recurrent.

All tensors use one layout, the one of transformers' attention functions: queries ``[B, H, Lq, d]``,
keys ``[B, Hkv, Lk, d]`` and values ``[B, Hkv, Lk, dv]`` (``Hkv`` divides ``H``: grouped-query
attention). With features ``phi`` from a :class:`~.feature_maps.FeatureMap`,

    out_i = sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j)

over the allowed keys ``j`` (all unpadded keys; in causal mode those with ``j <= i``). Inputs are
multiplied by ``sqrt(scaling)`` first, so that FAVOR+ estimates ``exp(scaling * q.k)`` exactly as
softmax attention with that ``scaling`` would use it.

Numerics (see ``pitfalls.md`` of the project):

* everything after the inputs runs in float32 (float64 for float64 inputs) with autocast disabled;
  the output is cast back to the dtype of ``value``;
* query features carry a per-row stabiliser, which cancels between numerator and denominator;
* key features share one stabiliser per (example, head): the maximum over unpadded keys in the
  bidirectional case, and in the causal case the running maximum over the keys seen so far, so that
  appending tokens never changes earlier outputs. Sums are rescaled when the running maximum grows,
  as in an online softmax;
* padded keys are removed from numerator and denominator by zeroing ``phi(k)`` after the map and ``v``.

The slow, obvious float64 references these kernels are tested against live in ``reference.py``.

This module imports only ``torch`` and its sibling ``feature_maps``: it is copied next to saved
models for ``trust_remote_code``.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from .feature_maps import FeatureMap, Features, compute_dtype_for

DEFAULT_CHUNK_SIZE = 128


class LinearAttentionState(NamedTuple):
    """Recurrent state of causal linear attention after ``n`` tokens, per (example, head).

    With ``c`` the stabiliser (the running maximum of the key log-scales):

    Attributes:
        kv: ``[B, H, m, dv]``, ``sum_j exp(-c) phi(k_j) v_j^T``.
        k_sum: ``[B, H, m]``, ``sum_j exp(-c) phi(k_j)`` (the normaliser).
        stabilizer: ``[B, H]``, ``c`` (``-inf``-like, i.e. the float minimum, before any key).
    """

    kv: torch.Tensor
    k_sum: torch.Tensor
    stabilizer: torch.Tensor

    def reorder(self, index: torch.Tensor) -> "LinearAttentionState":
        """Select batch rows (beam search)."""
        return LinearAttentionState(*(t.index_select(0, index.to(t.device)) for t in self))


class LinearAttentionError(ValueError):
    """Raised for inputs the kernels do not accept (shapes, masks, options)."""


def _check_inputs(query, key, value, feature_map, causal, key_padding_mask, initial_state):
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.dim() != 4:
            raise LinearAttentionError(
                f"{name} must have shape [batch, heads, length, head_dim]; got {tuple(tensor.shape)}"
            )
    batch, heads, q_len, head_dim = query.shape
    if key.shape[:3] != value.shape[:3] or key.shape[0] != batch:
        raise LinearAttentionError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must share batch, heads and length "
            f"with each other and the batch of query {tuple(query.shape)}"
        )
    if key.shape[-1] != head_dim:
        raise LinearAttentionError(f"query and key head_dim differ: {head_dim} vs {key.shape[-1]}")
    if heads % key.shape[1]:
        raise LinearAttentionError(
            f"query heads ({heads}) must be a multiple of key/value heads ({key.shape[1]})"
        )
    if feature_map is not None and head_dim != feature_map.head_dim:  # None: window attention without a tail
        raise LinearAttentionError(
            f"the feature map was built for head_dim={feature_map.head_dim}, inputs have {head_dim}"
        )
    if causal and q_len != key.shape[2]:
        raise LinearAttentionError(
            f"causal linear attention needs as many queries as keys (pass earlier tokens as "
            f"initial_state); got {q_len} queries and {key.shape[2]} keys"
        )
    if q_len == 0 or key.shape[2] == 0:
        raise LinearAttentionError("linear attention needs at least one query and one key")
    if not causal and initial_state is not None:
        raise LinearAttentionError("initial_state is only meaningful for causal attention")
    if key_padding_mask is not None:
        if key_padding_mask.dim() != 2 or tuple(key_padding_mask.shape) != (batch, key.shape[2]):
            raise LinearAttentionError(
                "linear attention accepts only a 2-D key padding mask of shape [batch, key_length] "
                f"= {[batch, key.shape[2]]} (True/1 = attend); got shape {tuple(key_padding_mask.shape)}. "
                "Causality is set with causal=True; arbitrary (4-D) attention masks cannot be "
                "expressed with linear attention."
            )


def _as_bool_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A bool key padding mask from a bool or 0/1 mask; anything else (additive masks) raises."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise LinearAttentionError(
            "a non-boolean key padding mask must hold only 0 (padding) and 1 (token); got values "
            f"{mask.unique()[:8].tolist()} (additive masks with -inf are not accepted)"
        )
    return mask != 0


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, Hkv, ...] -> [B, Hkv * groups, ...]`` (grouped-query attention)."""
    if groups == 1:
        return x
    return x.repeat_interleave(groups, dim=1)


def _repeat_features(features: Features, groups: int) -> Features:
    """Key features of ``Hkv`` heads repeated for the ``Hkv * groups`` query heads."""
    log_scale = None if features.log_scale is None else _repeat_kv(features.log_scale, groups)
    return Features(_repeat_kv(features.values, groups), log_scale)


def _safe_denominator(denominator: torch.Tensor, eps: float) -> torch.Tensor:
    """Move denominators away from 0 by ``eps`` keeping their sign (trig features can be < 0)."""
    tiny = denominator.abs() < eps
    return torch.where(tiny, torch.where(denominator < 0, -eps, eps), denominator)


def _masked_key_log_scale(log_scale: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Key log-scales with padded keys at ``-inf`` (they must not set the stabiliser)."""
    if mask is None:
        return log_scale
    return log_scale.masked_fill(~mask[:, None, :], float("-inf"))


def _finite_min(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).min


# --------------------------------------------------------------------------------------------
# Bidirectional
# --------------------------------------------------------------------------------------------


def _shared_key_weights(log_scale: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``exp(log_scale_j - c)`` ``[B, H, Lk, 1]`` with ``c`` the maximum over unpadded keys of each
    (example, head): one stabiliser shared by all keys, so it cancels exactly."""
    log_scale = _masked_key_log_scale(log_scale, mask)
    stabilizer = log_scale.detach().amax(dim=-1, keepdim=True).clamp_min(_finite_min(log_scale.dtype))
    return torch.exp(log_scale - stabilizer).unsqueeze(-1)


def _normalise(numerator_and_denominator: torch.Tensor, eps: float) -> torch.Tensor:
    """``[..., dv + 1]`` (the last column is the denominator) ``-> [..., dv]``."""
    return numerator_and_denominator[..., :-1] / _safe_denominator(numerator_and_denominator[..., -1:], eps)


def _with_ones_column(value: torch.Tensor) -> torch.Tensor:
    """``[..., dv] -> [..., dv + 1]``: one matmul then gives numerator and denominator together."""
    return torch.cat([value, value.new_ones(value.shape[:-1] + (1,))], dim=-1)


def bidirectional_linear_attention(
    q_features: Features,
    k_features: Features,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = 1e-12,
) -> torch.Tensor:
    """Non-causal linear attention in O(L m d) time and O(m d) extra memory per head.

    Args:
        q_features: query features, values ``[B, H, Lq, m]`` (the query log-scale cancels).
        k_features: key features, values ``[B, H, Lk, m]``, log-scale ``[B, H, Lk]`` or ``None``.
        value: ``[B, H, Lk, dv]`` in the compute dtype.
        key_padding_mask: ``[B, Lk]`` bool, ``True`` = attend.

    Returns:
        ``[B, H, Lq, dv]``.
    """
    phi_k, value = _bidirectional_key_inputs(k_features, value, key_padding_mask)
    kv = torch.matmul(phi_k.transpose(-1, -2), value)  # [B, H, m, dv+1]
    return _normalise(torch.matmul(q_features.values, kv), eps)


def _bidirectional_key_inputs(k_features: Features, value: torch.Tensor, key_padding_mask: torch.Tensor | None):
    """Stabilised, masked ``phi(K)`` ``[B, H, Lk, m]`` and the values with their normaliser column
    ``[B, H, Lk, dv + 1]``, padded keys zeroed in both. Without autograd (the fused path) the fresh
    feature tensor is rescaled in place."""
    inplace = not torch.is_grad_enabled()
    phi_k = k_features.values
    value = _with_ones_column(value)
    if k_features.log_scale is not None:
        weights = _shared_key_weights(k_features.log_scale, key_padding_mask)
        phi_k = phi_k.mul_(weights) if inplace else phi_k * weights
    if key_padding_mask is not None:
        keep = key_padding_mask[:, None, :, None]
        phi_k = phi_k.mul_(keep) if inplace else phi_k * keep
        value = value.masked_fill(~keep, 0.0)
    return phi_k, value


def _fused_bidirectional_inputs(query, key, value, feature_map, key_padding_mask):
    """``phi(Q)`` ``[B, H, Lq, m]`` and :func:`_bidirectional_key_inputs`, without autograd."""
    with torch.no_grad():
        phi_q = feature_map.features(query).values
        phi_k, value = _bidirectional_key_inputs(feature_map.features(key), value, key_padding_mask)
    return phi_q, phi_k, value


class _FusedBidirectionalLinearAttention(torch.autograd.Function):
    """Bidirectional linear attention with the feature map inside and a hand-written backward.

    For maps that provide ``features_vjp`` (FAVOR+): saves ``phi(Q)``, ``phi(K)`` and ``[m, dv+1]``
    sums instead of autograd's intermediates (or, with ``recompute_features``, recomputes the
    features in the backward and saves only ``[L, d]`` tensors). Inputs ``query`` and ``key``
    ``[B, H, L, d]`` are already scaled; ``key`` is already repeated for grouped heads.
    """

    @staticmethod
    def forward(ctx, query, key, value, feature_map, key_padding_mask, eps, recompute_features):
        phi_q, phi_k, value_ones = _fused_bidirectional_inputs(query, key, value, feature_map, key_padding_mask)
        with torch.no_grad():
            kv = torch.matmul(phi_k.transpose(-1, -2), value_ones)  # [B, H, m, dv+1]
            numerator_and_denominator = torch.matmul(phi_q, kv)
            denominator = _safe_denominator(numerator_and_denominator[..., -1:], eps)
            out = numerator_and_denominator[..., :-1] / denominator
        ctx.feature_map = feature_map
        ctx.recompute_features = recompute_features
        if recompute_features:
            ctx.projection_version = getattr(feature_map, "redraws", None)
            ctx.projection_version = None if ctx.projection_version is None else int(ctx.projection_version)
            ctx.save_for_backward(query, key, value, key_padding_mask, kv, out, denominator)
        else:
            ctx.save_for_backward(query, key, value_ones, phi_q, phi_k, kv, out, denominator)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        feature_map = ctx.feature_map
        if ctx.recompute_features:
            query, key, value, key_padding_mask, kv, out, denominator = ctx.saved_tensors
            redraws = getattr(feature_map, "redraws", None)
            if ctx.projection_version is not None and int(redraws) != ctx.projection_version:
                raise RuntimeError(
                    "recompute_features=True: the feature map redrew its projection between this call's forward and "
                    "backward, so the features cannot be recomputed; use recompute_features=False"
                )
            phi_q, phi_k, value = _fused_bidirectional_inputs(query, key, value, feature_map, key_padding_mask)
        else:
            query, key, value, phi_q, phi_k, kv, out, denominator = ctx.saved_tensors
        # out = N / D: dN = g / D, dD = -(g . out) / D, stacked as the gradient of [N, D].
        grad_numerator = grad_out / denominator
        grad_nd = torch.cat([grad_numerator, -(grad_numerator * out).sum(-1, keepdim=True)], dim=-1)
        grad_kv = torch.matmul(phi_q.transpose(-1, -2), grad_nd)  # [B, H, m, dv+1]
        grad_phi_q = torch.matmul(grad_nd, kv.transpose(-1, -2))
        grad_query = feature_map.features_vjp(query, phi_q, grad_phi_q)
        grad_value = torch.matmul(phi_k, grad_kv)[..., :-1]
        grad_phi_k = torch.matmul(value, grad_kv.transpose(-1, -2))
        grad_key = feature_map.features_vjp(key, phi_k, grad_phi_k)
        return grad_query, grad_key, grad_value, None, None, None, None


# --------------------------------------------------------------------------------------------
# Causal: chunked prefix sums with a running stabiliser
# --------------------------------------------------------------------------------------------


def _chunk_scan_forward(phi_q, phi_k, value, start_state, running, start_stabilizer):
    """Chunked causal scan on chunked inputs (see :class:`_CausalChunkScan`).

    Shapes: ``phi_q, phi_k`` ``[G, N, C, m]``, ``value`` ``[G, N, C, e]``, ``running`` ``[G, N, C]``,
    ``start_state`` ``[G, m, e]``, ``start_stabilizer`` ``[G]``. ``phi_k`` row ``j`` is relative
    to its own stabiliser ``running_j``. Returns ``out`` ``[G, N, C, e]``, the tensors the backward
    needs (among them the states before each chunk ``[G, N, m, e]``, each relative to the
    stabiliser at the previous chunk's end) and the final state ``[G, m, e]``.
    """
    n_chunks, chunk_size = phi_q.shape[1], phi_q.shape[2]
    causal_mask = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=phi_q.device).tril()
    chunk_end = running[..., -1]  # [G, N]
    boundary = torch.cat([start_stabilizer.unsqueeze(-1), chunk_end[:, :-1]], dim=-1)  # [G, N]
    # exp(c_j - c_i) <= 1 for j <= i rescales key j from its own stabiliser to the query's.
    decay = (running.unsqueeze(-2) - running.unsqueeze(-1)).clamp_max_(0.0).exp_()
    decay.masked_fill_(~causal_mask, 0.0)
    weights = torch.matmul(phi_q, phi_k.transpose(-1, -2)).mul_(decay)  # [G, N, C, C]
    out = torch.matmul(weights, value)
    # Chunk summaries relative to the stabiliser at the chunk's end: U_n = K^T (t * V), the
    # per-token rescaling t applied to the narrow values rather than to the [C, m] features.
    to_end = torch.exp(running - chunk_end.unsqueeze(-1)).unsqueeze(-1)  # [G, N, C, 1]
    value_to_end = value * to_end
    chunk_kv = torch.matmul(phi_k.transpose(-1, -2), value_to_end)  # [G, N, m, e]
    carry = torch.exp(boundary - chunk_end)[..., None, None]  # [G, N, 1, 1]
    # states[:, n] is the state before chunk n (contiguous, so matmuls take it without a copy);
    # one fused op per step keeps the sequential loop cheap.
    states = torch.empty_like(chunk_kv)
    states[:, 0] = start_state
    for n in range(n_chunks - 1):
        torch.addcmul(chunk_kv[:, n], states[:, n], carry[:, n], out=states[:, n + 1])
    final = torch.addcmul(chunk_kv[:, -1], states[:, -1], carry[:, -1])
    from_boundary = torch.exp(boundary.unsqueeze(-1) - running).unsqueeze(-1)  # [G, N, C, 1]
    out.add_(torch.matmul(phi_q, states).mul_(from_boundary))
    return out, value_to_end, states, weights, decay, to_end, carry, from_boundary, final


def _chunk_scan_backward(saved, grad_out, grad_final):
    """Gradients of :func:`_chunk_scan_forward` with respect to ``phi_q``, ``phi_k``, ``value`` and
    the start state (the stabiliser rescalings are constants)."""
    phi_q, phi_k, value, value_to_end, states, weights, decay, to_end, carry, from_boundary = saved
    grad_out = grad_out.contiguous()
    # Inter-chunk part: out += r * (Q P_n).
    scaled = grad_out * from_boundary
    grad_q = torch.matmul(scaled, states.transpose(-1, -2))
    grad_states = torch.matmul(phi_q.transpose(-1, -2), scaled)  # dL/dP_n from the outputs
    # Reverse scan: dU_n = dP_{n+1} and dP_n = (dL/dP_n from the outputs) + a_n dP_{n+1}.
    grad_chunk_kv = torch.empty_like(grad_states)
    if grad_final is None:
        grad_chunk_kv[:, -1].zero_()
    else:
        grad_chunk_kv[:, -1] = grad_final
    for n in range(states.shape[1] - 1, 0, -1):
        torch.addcmul(grad_states[:, n], grad_chunk_kv[:, n], carry[:, n], out=grad_chunk_kv[:, n - 1])
    grad_start = torch.addcmul(grad_states[:, 0], grad_chunk_kv[:, 0], carry[:, 0])
    # Chunk summaries U_n = K^T (t * V).
    grad_value = torch.matmul(phi_k, grad_chunk_kv).mul_(to_end)
    grad_k = torch.matmul(value_to_end, grad_chunk_kv.transpose(-1, -2))
    # Intra-chunk part: out += ((Q K^T) * D) V.
    grad_value.add_(torch.matmul(weights.transpose(-1, -2), grad_out))
    grad_scores = torch.matmul(grad_out, value.transpose(-1, -2)).mul_(decay)
    grad_q.add_(torch.matmul(grad_scores, phi_k))
    grad_k.add_(torch.matmul(grad_scores.transpose(-1, -2), phi_q))
    return grad_q, grad_k, grad_value, grad_start


class _CausalChunkScan(torch.autograd.Function):
    """Causal linear attention over chunked features with a hand-written backward.

    Forward, per chunk ``n`` with queries/keys ``Q, K`` ``[C, m]``, values ``V`` ``[C, e]``, state
    ``P_n`` before the chunk: ``out = ((Q K^T) * D) V + r * (Q P_n)`` and
    ``P_{n+1} = a_n P_n + (K * t)^T V`` where ``D``, ``r``, ``a``, ``t`` are the stabiliser
    rescalings (constants). Autograd through a Python loop over chunks would allocate a full-size
    gradient per chunk; here the backward is one reverse scan over ``[m, e]`` states.
    """

    @staticmethod
    def forward(ctx, phi_q, phi_k, value, start_state, running, start_stabilizer):
        out, *saved, final = _chunk_scan_forward(phi_q, phi_k, value, start_state, running, start_stabilizer)
        ctx.save_for_backward(phi_q, phi_k, value, *saved)
        return out, final

    @staticmethod
    def backward(ctx, grad_out, grad_final):
        return (*_chunk_scan_backward(ctx.saved_tensors, grad_out, grad_final), None, None)


class _CausalInputs(NamedTuple):
    """Causal-kernel inputs in chunks of ``C`` tokens, ``G = B * H`` groups (see :func:`_chunk_causal_inputs`)."""

    phi_q: torch.Tensor  # [G, N, C, m]
    phi_k: torch.Tensor  # [G, N, C, m], padded keys zeroed, row j relative to running[j]
    value: torch.Tensor  # [G, N, C, dv + 1], with the normaliser column
    start_state: torch.Tensor  # [G, m, dv + 1]
    running: torch.Tensor  # [G, N, C], the running stabiliser (non-decreasing)
    start_stabilizer: torch.Tensor  # [G]


def _chunk_causal_inputs(phi_q, phi_k, k_log_scale, value, key_padding_mask, initial_state, chunk_size):
    """Mask, stabilise (running maximum), pad to whole chunks and reshape into :class:`_CausalInputs`.

    ``phi_q, phi_k`` ``[B, H, L, m]``, ``k_log_scale`` ``[B, H, L]`` or ``None``, ``value``
    ``[B, H, L, dv]``. Differentiable (ordinary torch ops).
    """
    batch, heads, length, m = phi_k.shape
    dv = value.shape[-1]
    floor = _finite_min(phi_k.dtype)
    # Without autograd (the fused path), the fresh feature tensors are rescaled in place.
    inplace = not torch.is_grad_enabled()
    value = _with_ones_column(value)
    if key_padding_mask is not None:
        keep = key_padding_mask[:, None, :, None]
        phi_k = phi_k.mul_(keep) if inplace else phi_k * keep
        value = value.masked_fill(~keep, 0.0)
    if initial_state is None:
        state = value.new_zeros(batch, heads, m, dv + 1)
        start = value.new_full((batch, heads), floor)
    else:
        state = torch.cat([initial_state.kv, initial_state.k_sum.unsqueeze(-1)], dim=-1).to(value.dtype)
        start = initial_state.stabilizer.to(value.dtype)
    if k_log_scale is not None:
        log_scale = _masked_key_log_scale(k_log_scale, key_padding_mask)
        running = torch.cummax(torch.maximum(log_scale.detach(), start.unsqueeze(-1)), dim=-1).values
        running = running.clamp_min(floor)  # [B, H, L], non-decreasing
        weights = torch.exp(log_scale - running).unsqueeze(-1)
        phi_k = phi_k.mul_(weights) if inplace else phi_k * weights
    else:
        running = value.new_zeros(batch, heads, length)
        start = torch.zeros_like(start)
    # Pad to whole chunks; padded keys have zero features and no effect.
    chunk_size = min(chunk_size, length)
    n_chunks = -(-length // chunk_size)
    pad = n_chunks * chunk_size - length
    if pad:
        pad_tokens = lambda t: torch.nn.functional.pad(t, (0, 0, 0, pad))  # noqa: E731
        phi_q, phi_k, value = pad_tokens(phi_q), pad_tokens(phi_k), pad_tokens(value)
        running = torch.cat([running, running[..., -1:].expand(-1, -1, pad)], dim=-1)
    groups = batch * heads
    chunks = lambda t: t.reshape(groups, n_chunks, chunk_size, *t.shape[3:])  # noqa: E731
    return _CausalInputs(
        chunks(phi_q), chunks(phi_k), chunks(value), state.reshape(groups, m, dv + 1),
        chunks(running), start.reshape(groups),
    )


def _causal_outputs(out, final, running, batch, heads, length, eps):
    """``[G, N, C, dv + 1]`` sums, the final ``[G, m, dv + 1]`` state and the chunked running
    stabiliser ``[G, N, C]`` -> ``out`` ``[B, H, L, dv]`` and the :class:`LinearAttentionState`."""
    m, e = final.shape[-2:]
    out = _normalise(out.reshape(batch, heads, -1, e)[:, :, :length], eps)
    final = final.reshape(batch, heads, m, e)
    stabilizer = running[:, -1, -1].reshape(batch, heads)
    return out, LinearAttentionState(final[..., :-1], final[..., -1], stabilizer)


def causal_linear_attention(
    q_features: Features,
    k_features: Features,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: LinearAttentionState | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    eps: float = 1e-12,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """Causal linear attention by chunks: exact (quadratic) inside a chunk, a running state between.

    Never builds an ``[L, m, dv]`` tensor: the state is ``[m, dv]`` per head and per chunk boundary.
    Key features are stabilised by ``c_j``, the running maximum of key log-scales up to ``j``
    (and of the initial state's), so token ``i`` only ever depends on tokens ``<= i``.

    Args:
        q_features, k_features: features of ``[B, H, L, m]`` (log-scales ``[B, H, L]`` or ``None``).
        value: ``[B, H, L, dv]`` in the compute dtype.
        key_padding_mask: ``[B, L]`` bool, ``True`` = attend.
        initial_state: state after earlier tokens (prefill + decode == one pass), or ``None``.
        chunk_size: ``C``; chunks of ``C`` tokens are processed at once (any ``C >= 1`` is exact).

    Returns:
        ``out`` ``[B, H, L, dv]`` and the state after the last token.
    """
    batch, heads, length, _ = k_features.values.shape
    inputs = _chunk_causal_inputs(
        q_features.values, k_features.values, k_features.log_scale, value, key_padding_mask, initial_state, chunk_size
    )
    out, final = _CausalChunkScan.apply(*inputs)
    return _causal_outputs(out, final, inputs.running, batch, heads, length, eps)


class _FusedCausalLinearAttention(torch.autograd.Function):
    """Causal linear attention with the feature map inside and a hand-written backward.

    For maps that provide ``features_vjp`` (FAVOR+): no autograd graph over ``[L, m]`` feature
    tensors; the backward runs the scan backward, then the feature map's vector-Jacobian product.
    Returns the un-normalised sums ``[G, N, C, dv + 1]``, the final state and the chunked inputs'
    running stabiliser (needed to report the state).
    """

    @staticmethod
    def forward(ctx, query, key, value, start_kv, start_k_sum, start_stabilizer, feature_map, key_padding_mask,
                chunk_size):
        with torch.no_grad():
            q_features, k_features = feature_map.features(query), feature_map.features(key)
            initial_state = None if start_kv is None else LinearAttentionState(start_kv, start_k_sum, start_stabilizer)
            inputs = _chunk_causal_inputs(
                q_features.values, k_features.values, k_features.log_scale, value, key_padding_mask, initial_state,
                chunk_size,
            )
            out, *saved, final = _chunk_scan_forward(*inputs)
        ctx.feature_map = feature_map
        ctx.has_initial_state = start_kv is not None
        ctx.save_for_backward(query, key, key_padding_mask, inputs.phi_q, inputs.phi_k, inputs.value, *saved)
        ctx.mark_non_differentiable(inputs.running)
        return out, final, inputs.running

    @staticmethod
    def backward(ctx, grad_out, grad_final, _):
        query, key, key_padding_mask, *saved = ctx.saved_tensors
        grad_phi_q, grad_phi_k, grad_value, grad_start = _chunk_scan_backward(saved, grad_out, grad_final)
        phi_q, phi_k = saved[0], saved[1]
        batch, heads, length, head_dim = query.shape
        unchunk = lambda t: t.reshape(batch, heads, -1, t.shape[-1])[:, :, :length]  # noqa: E731
        grad_query = ctx.feature_map.features_vjp(query, unchunk(phi_q), unchunk(grad_phi_q))
        # phi_k already holds the stabilised, masked features: their vjp is the keys' gradient.
        grad_key = ctx.feature_map.features_vjp(key, unchunk(phi_k), unchunk(grad_phi_k))
        grad_value = unchunk(grad_value)[..., :-1]
        if key_padding_mask is not None:
            grad_value = grad_value.masked_fill(~key_padding_mask[:, None, :, None], 0.0)
        grad_start_kv = grad_start_k_sum = None
        if ctx.has_initial_state:
            grad_start = grad_start.reshape(batch, heads, *grad_start.shape[-2:])
            grad_start_kv, grad_start_k_sum = grad_start[..., :-1], grad_start[..., -1]
        return grad_query, grad_key, grad_value, grad_start_kv, grad_start_k_sum, None, None, None, None


def fused_causal_linear_attention(query, key, value, feature_map, key_padding_mask=None, initial_state=None,
                                  chunk_size=DEFAULT_CHUNK_SIZE, eps=1e-12):
    """:func:`causal_linear_attention` with the feature map fused in (maps with ``features_vjp``).

    ``query``, ``key`` ``[B, H, L, d]`` already scaled and repeated for grouped heads, ``value``
    ``[B, H, L, dv]``; returns ``out`` ``[B, H, L, dv]`` and the state after the last token.
    """
    batch, heads, length, _ = query.shape
    start = (None, None, None) if initial_state is None else tuple(initial_state)
    out, final, running = _FusedCausalLinearAttention.apply(
        query, key, value, *start, feature_map, key_padding_mask, chunk_size
    )
    return _causal_outputs(out, final, running, batch, heads, length, eps)


def recurrent_linear_attention_step(
    q_features: Features,
    k_features: Features,
    value: torch.Tensor,
    state: LinearAttentionState,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = 1e-12,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """One decoding step of causal linear attention, the recurrent form (what generation runs).

    ``S' = a S + phi(k) v^T``, ``z' = a z + phi(k)``, ``out = phi(q) S' / phi(q) z'`` with ``a =
    exp(c - c')`` the rescaling when the running stabiliser grows from ``c`` to ``c'``. Reads and
    writes the ``[m, dv]`` state once: no chunking, no concatenation.

    Args:
        q_features, k_features: features of one token, values ``[B, H, 1, m]`` (key log-scale ``[B, H, 1]``).
        value: ``[B, H, 1, dv]`` in the compute dtype.
        state: the state after the previous tokens.
        key_padding_mask: ``[B, 1]`` bool, ``False`` for a padding token (it leaves the state unchanged).

    Returns:
        ``out`` ``[B, H, 1, dv]`` and the new state.
    """
    phi_q, phi_k = q_features.values, k_features.values
    kv, k_sum, stabilizer = (t.to(value.dtype) for t in state)
    if k_features.log_scale is not None:
        log_scale = _masked_key_log_scale(k_features.log_scale, key_padding_mask)[..., 0]  # [B, H]
        new_stabilizer = torch.maximum(stabilizer, log_scale.detach()).clamp_min(_finite_min(value.dtype))
        phi_k = phi_k * torch.exp(log_scale - new_stabilizer)[..., None, None]
        carry = torch.exp(stabilizer - new_stabilizer)[..., None]  # [B, H, 1]
        kv, k_sum = kv * carry.unsqueeze(-1), k_sum * carry
    else:
        new_stabilizer = stabilizer
    if key_padding_mask is not None:
        keep = key_padding_mask[:, None, :, None]
        phi_k = phi_k * keep
        value = value.masked_fill(~keep, 0.0)
    kv = kv + phi_k.transpose(-1, -2) * value  # [B, H, m, 1] * [B, H, 1, dv]
    k_sum = k_sum + phi_k[..., 0, :]
    numerator = torch.matmul(phi_q, kv)
    denominator = (phi_q[..., 0, :] * k_sum).sum(-1)[..., None, None]
    return numerator / _safe_denominator(denominator, eps), LinearAttentionState(kv, k_sum, new_stabilizer)


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------


def _no_autocast(device_type: str):
    try:
        return torch.autocast(device_type=device_type, enabled=False)
    except RuntimeError:  # a device type without autocast support
        return contextlib.nullcontext()


def linear_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    feature_map: FeatureMap,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    eps: float = 1e-12,
    recompute_features: bool = False,
):
    """Linear attention ``phi(Q) phi(K)^T V`` normalised per query, in O(L) time and memory.

    Args:
        query: ``[B, H, Lq, d]``.
        key: ``[B, Hkv, Lk, d]`` with ``H % Hkv == 0`` (grouped-query attention).
        value: ``[B, Hkv, Lk, dv]``.
        feature_map: a :class:`~.feature_maps.FeatureMap` built for ``d`` (see ``make_feature_map``).
            Called once per call: a random map in training mode may redraw its projection then.
        causal: token ``i`` attends to keys ``<= i`` (needs ``Lq == Lk``).
        key_padding_mask: ``[B, Lk]``, ``True``/1 for tokens and ``False``/0 for padding; padded keys
            leave numerator and denominator. Any other mask shape raises an error.
        scaling: the softmax temperature to reproduce, ``exp(scaling * q.k)``; default ``d ** -0.5``.
        initial_state: causal only; the state returned by an earlier call on the preceding tokens.
        return_state: causal only; also return the state after the last token.
        chunk_size: causal only; tokens per chunk of the chunked scan.
        eps: smallest magnitude of a denominator.
        recompute_features: bidirectional FAVOR+ only; recompute ``phi(Q)``, ``phi(K)`` in the backward
            instead of keeping them (``2 L m`` floats per head less activation memory, the feature
            map's work done twice).

    Returns:
        ``[B, H, Lq, dv]`` in ``value.dtype``, and the :class:`LinearAttentionState` if
        ``return_state``.
    """
    _check_inputs(query, key, value, feature_map, causal, key_padding_mask, initial_state)
    if return_state and not causal:
        raise LinearAttentionError("return_state is only meaningful for causal attention")
    if chunk_size < 1:
        raise LinearAttentionError(f"chunk_size must be >= 1, got {chunk_size}")
    if recompute_features and (causal or not feature_map.has_features_vjp):
        raise LinearAttentionError(
            "recompute_features is implemented for bidirectional attention with maps that have features_vjp "
            f"(favor+); got causal={causal}, feature map {feature_map.name!r}"
        )
    mask = _as_bool_mask(key_padding_mask)
    head_dim = query.shape[-1]
    scale = (head_dim**-0.5 if scaling is None else float(scaling)) ** 0.5
    groups = query.shape[1] // key.shape[1]
    out_dtype = value.dtype
    dtype = compute_dtype_for(query)
    with _no_autocast(query.device.type):
        query, key, value = query.to(dtype) * scale, key.to(dtype) * scale, value.to(dtype)
        if causal and initial_state is not None and query.shape[2] == 1:  # a decoding step
            q_features, k_features = feature_map(query, key)
            k_features = _repeat_features(k_features, groups)
            out, state = recurrent_linear_attention_step(
                q_features, k_features, _repeat_kv(value, groups), initial_state, mask, eps=eps
            )
            return (out.to(out_dtype), state) if return_state else out.to(out_dtype)
        if feature_map.has_features_vjp:
            feature_map.maybe_redraw()
            key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
            if causal:
                out, state = fused_causal_linear_attention(
                    query, key, value, feature_map, mask, initial_state, chunk_size=chunk_size, eps=eps
                )
                return (out.to(out_dtype), state) if return_state else out.to(out_dtype)
            out = _FusedBidirectionalLinearAttention.apply(
                query, key, value, feature_map, mask, eps, recompute_features
            )
            return out.to(out_dtype)
        q_features, k_features = feature_map(query, key)
        k_features = _repeat_features(k_features, groups)
        value = _repeat_kv(value, groups)
        if causal:
            out, state = causal_linear_attention(
                q_features, k_features, value, mask, initial_state, chunk_size=chunk_size, eps=eps
            )
        else:
            out = bidirectional_linear_attention(q_features, k_features, value, mask, eps=eps)
            state = None
    out = out.to(out_dtype)
    return (out, state) if return_state else out
