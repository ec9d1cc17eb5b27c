"""Attention weights for ``output_attentions=True``: the ``[B, H, Lq, Lk]`` matrix a layer actually applies.

Linear attention never forms this matrix (that is its point); it is built here only on request, in ``O(Lq Lk)``
time and memory per head:

* :func:`linear_attention_weights`: ``W = phi(Q) phi(K)^T`` with the causal / padding / packed-sequence mask,
  normalised per query with the kernel's own stabilisers and denominator guard, so that ``W @ V`` equals
  :func:`~.linear_attention.linear_attention`'s output;
* :func:`softmax_attention_weights`: ``softmax(scaling Q K^T + mask)`` for layers kept on softmax attention.

:func:`attention_weights_requested` tells an attention function whether the model asked for them: transformers 5.x
collects attentions with hooks on the attention modules (``output_attentions`` is not passed to the attention
function), so the active output collector is read as well.

This module imports only ``torch``, ``transformers`` and relative siblings: it is copied next to saved models for
``trust_remote_code``.
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from .feature_maps import FeatureMap, Features, compute_dtype_for
from .linear_attention import (
    DEFAULT_CHUNK_SIZE,
    _finite_min,
    _repeat_features,
    _repeat_kv,
    _safe_denominator,
    same_segment_mask,
)
from .window_causal import sparse_cache_membership
from .window_tail_cap import tail_log_weights


logger = logging.get_logger(__name__)

try:  # transformers >= 5: attentions are captured by hooks while this collector is active
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover - other transformers layouts
    _active_collector = None


def attention_weights_requested(kwargs: dict) -> bool:
    """Whether the running forward asked for attention weights (``output_attentions=True`` given to the attention
    function, or an active transformers output collector that records ``attentions``)."""
    if kwargs.get("output_attentions"):
        return True
    collector = _active_collector.get() if _active_collector is not None else None
    return isinstance(collector, dict) and "attentions" in collector


def allowed_attention_pairs(
    batch: int, q_len: int, k_len: int, causal: bool, key_padding_mask, segment_ids, device
) -> torch.Tensor | None:
    """``[B, 1, Lq, Lk]`` bool, ``True`` where query ``i`` may attend key ``j`` (queries are the last ``Lq`` of
    the ``Lk`` positions), or ``None`` when every pair is allowed."""
    allowed = None
    if causal:
        query_positions = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
        allowed = (torch.arange(k_len, device=device)[None, :] <= query_positions).expand(batch, 1, q_len, k_len)
    if key_padding_mask is not None:
        keep = key_padding_mask.to(torch.bool)[:, None, None, :]
        allowed = keep if allowed is None else allowed & keep
    if segment_ids is not None:
        same = same_segment_mask(segment_ids)[:, None, -q_len:, :]
        allowed = same if allowed is None else allowed & same
    return None if allowed is None else allowed.expand(batch, 1, q_len, k_len)


def linear_attention_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    feature_map: FeatureMap,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    scaling: float | None = None,
    eps: float = 1e-12,
) -> torch.Tensor:
    """The normalised weights linear attention applies, ``[B, H, Lq, Lk]`` in ``query.dtype``.

    ``W_ij = phi(q_i).phi(k_j) / sum_j' phi(q_i).phi(k_j')`` over the allowed keys, computed as the kernels do:
    float32 (float64 for float64 inputs), query features without their per-row scale (it cancels), key features
    relative to one stabiliser per query row (the maximum key log-scale over the keys that row may see; in causal
    mode the running maximum, as in the causal scan), the same ``eps`` guard on the denominator.

    Args:
        query: ``[B, H, Lq, d]``; in causal mode the last ``Lq`` of the ``Lk`` positions.
        key: ``[B, Hkv, Lk, d]`` (``H % Hkv == 0``).
        feature_map: the layer's map (not redrawn here: call it after the attention call it describes).
        causal, key_padding_mask, scaling, eps: as for :func:`~.linear_attention.linear_attention`.
        segment_ids: ``[B, Lk]`` packed-sequence ids (causal only): keys of another sequence get weight 0.

    Returns:
        ``W`` ``[B, H, Lq, Lk]``; ``W @ V`` is the attention output. Rows of padding queries that see no key are 0.
    """
    batch, heads, q_len, head_dim = query.shape
    k_len = key.shape[2]
    scale = (head_dim**-0.5 if scaling is None else float(scaling)) ** 0.5
    dtype = compute_dtype_for(query)
    q_features = feature_map.query_features(query.to(dtype) * scale)
    k_features = _repeat_features(feature_map.key_features(key.to(dtype) * scale), heads // key.shape[1])
    scores = torch.matmul(q_features.values, k_features.values.transpose(-1, -2))  # [B, H, Lq, Lk]
    allowed = allowed_attention_pairs(batch, q_len, k_len, causal, key_padding_mask, segment_ids, query.device)
    if k_features.log_scale is not None:
        log_scale = k_features.log_scale[:, :, None, :].expand(batch, heads, q_len, k_len)
        if allowed is not None:
            log_scale = log_scale.masked_fill(~allowed, float("-inf"))
        stabilizer = log_scale.detach().amax(-1, keepdim=True).clamp_min(_finite_min(dtype))
        scores = scores * torch.exp(log_scale - stabilizer)
    elif allowed is not None:
        scores = scores.masked_fill(~allowed, 0.0)
    denominator = _safe_denominator(scores.sum(-1, keepdim=True), eps)
    return (scores / denominator).to(query.dtype)


def apply_attention_weights(weights: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``weights [B, H, Lq, Lk] @ value [B, Hkv, Lk, dv]`` -> ``[B, H, Lq, dv]`` (grouped heads repeated)."""
    value = value.repeat_interleave(weights.shape[1] // value.shape[1], dim=1)
    return torch.matmul(weights, value.to(weights.dtype)).to(value.dtype)


def requested_linear_attention_weights(
    kwargs: dict,
    query: torch.Tensor,
    key: torch.Tensor,
    feature_map: FeatureMap,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    segment_ids: torch.Tensor | None,
    scaling: float | None,
    decoding_from_state: bool,
) -> torch.Tensor | None:
    """:func:`linear_attention_weights` when the forward asked for attention weights (``kwargs`` of the attention
    function), else ``None``.

    A decoding step from a recurrent state (``decoding_from_state``) has no past keys: its weights cannot be formed
    and, as transformers' sdpa does for ``output_attentions``, ``None`` is returned with a one-time warning."""
    if not attention_weights_requested(kwargs):
        return None
    if decoding_from_state:
        logger.warning_once(
            "favor attention: output_attentions during cached decoding: the recurrent state keeps no past keys, so "
            "the weights of these steps cannot be formed and are returned as None (prefill and forward passes "
            "without a cache return them)."
        )
        return None
    return linear_attention_weights(
        query, key, feature_map, causal=causal, key_padding_mask=key_padding_mask, segment_ids=segment_ids,
        scaling=scaling,
    )


def softmax_attention_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    causal: bool,
    scaling: float | None = None,
) -> torch.Tensor:
    """``softmax(scaling Q K^T + mask)`` ``[B, H, Lq, Lk]`` (float32 softmax, returned in ``query.dtype``).

    Args:
        query: ``[B, H, Lq, d]``; key ``[B, Hkv, Lk, d]``.
        attention_mask: the 4-D mask given to sdpa (bool, ``True`` = attend, or additive float), or ``None`` for
            plain causal (``causal=True``, queries the last ``Lq`` positions) or full attention.
    """
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    key = _repeat_kv(key, query.shape[1] // key.shape[1])
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if attention_mask is None and causal:
        attention_mask = allowed_attention_pairs(query.shape[0], query.shape[2], key.shape[2], True, None, None, query.device)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask.float()
    return torch.softmax(scores, dim=-1).to(query.dtype)


def window_attention_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    feature_map: FeatureMap | None,
    *,
    window: int,
    sinks: int = 0,
    causal: bool = True,
    softmax_weight: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    sparse_cache: int = 0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    eps: float = 1e-12,
    tail_cap: int = 0,
    tail_gate: torch.Tensor | None = None,
    sparse_cache_selection: str = "recall",
    sparse_cache_span: int = 1,
) -> torch.Tensor:
    """The combined weights of sink + sliding-window softmax with a linear tail, ``[B, H, L, L]`` in
    ``query.dtype``: what :func:`~.window_attention.window_linear_attention` (same arguments) applies, so that
    ``weights @ V`` is its output.

    Exact keys ``E`` (the row's sinks, i.e. its first ``sinks`` unpadded keys, the window, and with a
    ``sparse_cache`` the keys the operator keeps for the query's boundary; every key for bidirectional sink queries)
    weigh ``exp(s_ij - c_i)`` (times ``gamma`` in learned mode), tail keys ``T`` weigh ``phi(q_i).phi(k_j)`` (times
    ``exp(-c_i)`` in calibrated mode; none without a feature map), ``c_i`` the largest exact score of row ``i`` (0 if
    none), times ``min(1, tail_cap / n_i)`` with a ``tail_cap`` and ``max(n_i, 1) ** -alpha_h`` with a ``tail_gate``
    (``n_i`` the row's tail keys); rows are normalised
    with one shared denominator. Computed in log space with one stabiliser per row
    (float32, float64 for float64 inputs). ``value`` is read only to choose the sparse cache.
    """
    batch, heads, length, head_dim = query.shape
    scaling = head_dim**-0.5 if scaling is None else float(scaling)
    dtype = compute_dtype_for(query)
    groups = heads // key.shape[1]
    q, k = query.to(dtype), _repeat_kv(key.to(dtype), groups)
    root = scaling**0.5
    if feature_map is None:
        q_features = Features(q.new_zeros(q.shape[:-1] + (1,)), None)
        k_features = Features(k.new_zeros(k.shape[:-1] + (1,)), None)
    else:
        q_features = feature_map.query_features(q * root)
        k_features = _repeat_features(feature_map.key_features(key.to(dtype) * root), groups)
    keep = torch.ones(batch, length, dtype=torch.bool, device=query.device)
    if key_padding_mask is not None:
        keep = key_padding_mask.to(torch.bool)
    is_sink = keep & (keep.long().cumsum(-1) <= sinks)  # a row's sinks: its first `sinks` unpadded keys
    i = torch.arange(length, device=query.device)[None, :, None]
    j = torch.arange(length, device=query.device)[None, None, :]
    band = (i - j).abs() < window
    if causal:
        exact = (j <= i) & (is_sink[:, None, :] | band)
        tail = (j <= i) & ~exact
    else:
        exact = is_sink[:, None, :] | is_sink[:, :, None] | band
        tail = ~exact
    exact, tail = (exact & keep[:, None, :])[:, None], (tail & keep[:, None, :])[:, None]
    if sparse_cache:
        cached = sparse_cache_membership(key.to(dtype), value.to(dtype), feature_map, window=window, sinks=sinks,
                                         sparse_cache=sparse_cache, key_padding_mask=key_padding_mask,
                                         scaling=scaling, chunk_size=chunk_size, eps=eps,
                                         selection_query=q if sparse_cache_selection == "attention" else None,
                                         span=sparse_cache_span)
        cached = _repeat_kv(cached, groups)  # [B, H, L, L]
        exact, tail = exact | cached, tail & ~cached
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    row_max = scores.masked_fill(~exact, float("-inf")).amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    exact_log = scores - row_max
    zeros = q.new_zeros(batch, heads, length)
    log_q = zeros if q_features.log_scale is None else q_features.log_scale
    log_k = zeros if k_features.log_scale is None else k_features.log_scale
    tail_log = log_q[..., :, None] + log_k[..., None, :]
    gate = None if tail_gate is None else tail_gate.view(1, heads, 1)
    tail_weight = tail_log_weights(tail.sum(-1), tail_cap, gate, dtype)
    if tail_weight is not None:
        tail_log = tail_log + tail_weight[..., None]
    if softmax_weight is None:
        tail_log = tail_log - row_max
    else:
        exact_log = exact_log + torch.log(softmax_weight.to(dtype))[None, :, None, None]
    stabilizer = torch.maximum(
        exact_log.masked_fill(~exact, float("-inf")).amax(-1, keepdim=True),
        tail_log.masked_fill(~tail, float("-inf")).amax(-1, keepdim=True),
    )
    stabilizer = torch.where(torch.isfinite(stabilizer), stabilizer, torch.zeros_like(stabilizer)).detach()
    tail_values = torch.matmul(q_features.values, k_features.values.transpose(-1, -2))
    weights = torch.exp((exact_log - stabilizer).masked_fill(~exact, float("-inf"))) + tail_values * torch.exp(
        (tail_log - stabilizer).masked_fill(~tail, float("-inf"))
    )
    return (weights / _safe_denominator(weights.sum(-1, keepdim=True), eps)).to(query.dtype)
