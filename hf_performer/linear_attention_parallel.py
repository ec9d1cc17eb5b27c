"""The parallel path of linear attention (FAVOR+ and every other feature map): a fixed number of tensor operations per
call, the one the CUDA path runs; :mod:`.linear_attention_chunks`'s chunk loop stays the CPU path.

Same function as :func:`~.linear_attention.linear_attention` (layouts, stabilisers, padding, grouped heads, initial
and final state), computed whole-sequence:

* the feature maps run once over all tokens, in float32 (the exponent of FAVOR+ needs it); the matrix products take
  the features in bf16 when the inputs are bf16 (float32 accumulation; sums over the whole sequence stay float32),
  float32 otherwise (fp16's range is too small for them);
* bidirectional: ``phi(k)`` relative to the keys' maximum log-scale, one float32 ``[m, dv + 1]`` sum per key head, one
  product for the queries (the value column of ones gives the normaliser);
* causal: the running maximum ``c_t`` of the keys' log-scales is a decay: with ``k'_t = phi(k_t) exp(l_t - c_t)`` and
  ``g_t = c_{t-1} - c_t <= 0``, the sums relative to ``c_t`` follow ``S_t = exp(g_t) S_{t-1} + k'_t [v_t, 1]^T``
  exactly (:mod:`.decayed_attention`, whose fused ``fla`` kernels or chunk-parallel ``torch`` backend run it). A
  jump of the stabiliser larger than :data:`DECAY_FLOOR` is taken as ``DECAY_FLOOR`` (``exp(-100)``: the older sums
  vanish either way), which keeps the cumulative decays small numbers.

Gradients: autograd through these operations (the feature maps' parameters included). Memory is that of the whole
sequence's features, ``O(L m)`` per head, more than the CPU path's chunked backward (``O(L d)``); the CUDA path trades
it for speed (benchmarks/README.md, "GPU").

:func:`attention_path` says which path a call takes: ``HF_PERFORMER_ATTENTION_PATH`` = ``auto`` (parallel on CUDA,
chunked elsewhere; the default), ``parallel`` or ``chunked`` (everywhere, for comparisons and tests).

This module imports only ``torch``, the standard library and its siblings ``feature_maps``, ``decayed_attention`` and
``linear_attention_chunks``: it is copied next to saved models for ``trust_remote_code``.
"""

from __future__ import annotations

import os

import torch

from .decayed_attention import decayed_attention
from .feature_maps import FeatureMap, compute_dtype_for
from .linear_attention_chunks import _finite_min, _repeat_kv, _safe_denominator

PATH_VARIABLE = "HF_PERFORMER_ATTENTION_PATH"
PATHS = ("auto", "parallel", "chunked")
DECAY_FLOOR = 100.0


def attention_path(tensor: torch.Tensor) -> str:
    """``"parallel"`` or ``"chunked"`` for a call on ``tensor``'s device (module docstring); a bad
    ``HF_PERFORMER_ATTENTION_PATH`` raises a one-line ``ValueError``."""
    name = os.environ.get(PATH_VARIABLE, "auto").strip().lower() or "auto"
    if name not in PATHS:
        raise ValueError(f"{PATH_VARIABLE}={name!r}: choose one of {', '.join(PATHS)}")
    if name == "auto":
        return "parallel" if tensor.is_cuda else "chunked"
    return name


def operand_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the matrix products' operands: bf16 inputs keep theirs (float32's range), others run in float32
    (float64 for float64): fp16's range cannot hold a chunk's sums of long inputs with large norms."""
    return torch.bfloat16 if x.dtype == torch.bfloat16 else compute_dtype_for(x)


def _with_ones(value: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    ones = torch.cat([value, value.new_ones(value.shape[:-1] + (1,))], dim=-1)
    return ones if keep is None else ones * keep[:, None, :, None].to(ones.dtype)


def parallel_linear_attention(query, key, value, feature_map: FeatureMap, *, causal: bool, key_padding_mask, scale,
                              initial_state=None, eps: float = 1e-12):
    """Linear attention as :func:`~.linear_attention.linear_attention` computes it (already validated; the map has had
    its chance to redraw; ``key_padding_mask`` bool or ``None``; ``scale`` = ``sqrt(scaling)``).

    Returns ``out`` ``[B, H, L, dv]`` in the compute dtype and, causal, the final state ``(kv [B, H, m, dv], k_sum
    [B, H, m], stabilizer [B, H])``; bidirectional ``None``."""
    dtype = compute_dtype_for(query)
    operands = operand_dtype(query)
    batch, heads, length = query.shape[:3]
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    phi_q = feature_map.query_features(query.to(dtype) * scale).values  # its log-scale cancels
    key_features = feature_map.key_features(key.to(dtype) * scale)
    phi_k, log_scale = key_features.values, key_features.log_scale
    keep = key_padding_mask
    value_ones = _with_ones(value.to(dtype), keep)
    if log_scale is not None and keep is not None:
        log_scale = log_scale.masked_fill(~keep[:, None, :], float("-inf"))
    if not causal:
        if log_scale is not None:
            stabilizer = log_scale.detach().amax(-1, keepdim=True).clamp_min(_finite_min(dtype))
            phi_k = phi_k * torch.exp(log_scale - stabilizer)[..., None]
        if keep is not None:
            phi_k = phi_k * keep[:, None, :, None].to(dtype)
        sums = torch.matmul(phi_k.transpose(-1, -2), value_ones)  # [B, Hkv, m, dv + 1], float32 over all tokens
        grouped = phi_q.to(operands).reshape(batch, kv_heads, groups * length, -1)
        totals = torch.matmul(grouped, sums.to(operands)).to(dtype).view(batch, heads, length, -1)
        return totals[..., :-1] / _safe_denominator(totals[..., -1:], eps), None

    phi_k, value_ones = _repeat_kv(phi_k, groups), _repeat_kv(value_ones, groups)
    log_scale = None if log_scale is None else _repeat_kv(log_scale, groups)
    if keep is not None:
        phi_k = phi_k * keep[:, None, :, None].to(dtype)
    start = None
    if initial_state is not None:
        start = (torch.cat([initial_state[0], initial_state[1][..., None]], dim=-1).to(dtype),
                 initial_state[2].to(dtype))
    totals, running, final = stabilised_causal_sums(phi_q, phi_k, log_scale, value_ones, operands, start, True)
    out = totals[..., :-1] / _safe_denominator(totals[..., -1:], eps)
    # (maps without log-scales need no stabiliser: 0, as the chunked path returns it)
    stabilizer = query.new_zeros(batch, heads, dtype=dtype) if running is None else running[..., -1].contiguous()
    return out, (final[..., :-1], final[..., -1], stabilizer)


def stabilised_causal_sums(phi_q, phi_k, log_scale, value_ones, operands, start=None, final_state=False):
    """``sum_{j <= i} phi_q_i . phi_k_j exp(l_j - c_i) [v_j, 1]`` for every query ``i``, with ``c_i`` the running
    maximum of the key log-scales ``l`` (``-inf`` for keys that must not count, whose features and values are zero),
    through :func:`~.decayed_attention.decayed_attention` (module docstring).

    Args:
        phi_q, phi_k: feature values ``[B, H, L, m]``; ``log_scale`` ``[B, H, L]`` or ``None`` (a map without one:
            no stabiliser, ``c = 0``); ``value_ones`` ``[B, H, L, dv + 1]``; all in the compute dtype.
        operands: the dtype of the products (:func:`operand_dtype`).
        start: ``(sums [B, H, m, dv + 1], c [B, H])`` of the keys before, or ``None``.

    Returns:
        ``(sums [B, H, L, dv + 1], c [B, H, L] or None, final sums [B, H, m, dv + 1] or None)`` in the compute dtype.
    """
    dtype = phi_q.dtype
    log_decay = running = None
    if log_scale is not None:
        floor = _finite_min(dtype)
        detached = log_scale.detach()
        if start is not None:
            detached = torch.maximum(detached, start[1][..., None])
        running = torch.cummax(detached, dim=-1).values.clamp_min(floor)
        before = torch.cat([running[..., :1] if start is None else start[1][..., None], running[..., :-1]], dim=-1)
        log_decay = (before - running).clamp_min(-DECAY_FLOOR)
        phi_k = phi_k * torch.exp(log_scale - running)[..., None]
    totals, final = decayed_attention(phi_q.to(operands), phi_k.to(operands), value_ones.to(operands), log_decay,
                                      None if start is None else start[0], output_final_state=final_state)
    return totals.to(dtype), running, None if final is None else final.to(dtype)


def shifted_tail_sums(phi_q, phi_k, log_scale, value_ones, eligible, offset: int, operands):
    """Per query ``i`` the linear tail over the eligible keys ``j <= i - offset`` (the window hybrid's older keys),
    as :func:`~.window_tail._tail_prefix` gives it: ``(sums [B, H, L, dv + 1], K [B, H, L])``, the sums relative to
    ``K_i``, the detached maximum of those keys' log-scales (``finfo.min`` for none). The keys shifted ``offset``
    places later are :func:`stabilised_causal_sums`' keys.

    ``phi_q``, ``phi_k`` ``[B, H, L, m]``, ``log_scale`` ``[B, H, L]`` (zeros for maps without one), ``value_ones``
    ``[B, H, L, dv + 1]``, ``eligible`` ``[B, L]`` bool (unpadded, not a sink)."""
    length = phi_k.shape[2]

    def shift(t, fill):  # t[..., j, (.)] moved to position j + offset along the sequence
        pad = (0, 0, offset, 0) if t.dim() == 4 else (offset, 0)
        moved = torch.nn.functional.pad(t, pad, value=fill)
        return moved[:, :, :length] if t.dim() == 4 else moved[..., :length]

    keep = shift(eligible, False)
    masked = shift(log_scale, float("-inf")).masked_fill(~keep[:, None, :], float("-inf"))
    weights = shift(phi_k, 0.0) * keep[:, None, :, None].to(phi_k.dtype)
    values = shift(value_ones, 0.0) * keep[:, None, :, None].to(value_ones.dtype)
    sums, running, _ = stabilised_causal_sums(phi_q, weights, masked, values, operands)
    return sums, running
