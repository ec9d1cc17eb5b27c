"""Sink + sliding-window softmax attention with a linear-attention tail and one shared normaliser.

The operator only (no cache, model integration or training yet). Layouts as
:func:`~.linear_attention.linear_attention`: queries ``[B, H, L, d]``, keys and values ``[B, Hkv, L, d]``
(``Hkv`` divides ``H``). With scores ``s_ij = scaling * q_i.k_j``, features ``phi`` of
``sqrt(scaling) q`` and ``sqrt(scaling) k``, an exact key set ``E(i)`` and a tail key set ``T(i)``:

    y_i = (sum_{E(i)} w_ij v_j + sum_{T(i)} t_ij v_j) / (sum_{E(i)} w_ij + sum_{T(i)} t_ij)

* causal: ``E(i)`` = sinks ``0..sinks-1`` (those ``<= i``) and ``max(sinks, i-window+1)..i``;
  ``T(i)`` = ``sinks..i-window``. ``window=0`` means no window keys (with ``sinks=0``: plain causal
  linear attention).
* bidirectional: a non-sink query has ``E(i)`` = the sinks and the band ``|i-j| < window``,
  ``T(i)`` = every other key; a sink query (``i < sinks``, e.g. [CLS]) attends to every key exactly
  (``E(i)`` = all keys, no tail): sinks are exact "both ways".
* padded keys are in neither set.

Weights, with ``c_i`` the maximum score over ``E(i)`` (0 if ``E(i)`` is empty):

* calibrated (``softmax_weight=None``): ``w_ij = exp(s_ij - c_i)``, ``t_ij = phi(q_i).phi(k_j) exp(-c_i)``;
  a map estimating ``exp(s)`` (favor+, trig) then tends to exact softmax as ``m`` grows.
* learned (``softmax_weight=gamma``, ``[H]``, LoLCATs Eq. 7): ``w_ij = gamma_h exp(s_ij - c_i)``,
  ``t_ij = phi_q(q_i).phi_k(k_j)``.

Cost (per example and head, ``C = chunk_size``, ``w = window``, ``m`` features):
``O(L (C + w + sinks) d)`` for the exact tiles, ``O(L C m + L m d)`` for the tail, ``O(L (m + d))``
extra memory; never an ``L x L`` tensor. The causal tail keeps the prefix state
``(sum phi(k) v^T, sum phi(k))`` of the keys before ``block_start - window + 1`` and adds the (at most
``C``) keys between that boundary and each query's own ``i - window`` with a masked ``[C, C]``
feature tile: the per-block correction costs ``O(C^2 m)`` per block, as a chunked linear scan does.
The bidirectional tail is a left prefix (``j <= i - window``) plus a right suffix (``j >= i + window``,
the same scan on the reversed sequence): no subtraction of band sums from global sums, so no
cancellation. Sums run in float32 (float64 for float64 inputs) with autocast off.

Stabilisers: keys' feature log-scales share a running maximum ``K_i`` over the tail keys of query
``i`` (past keys only in the causal case, so appending tokens never changes earlier outputs); each
row is rescaled by one detached constant that cancels between numerator and denominator.

This module imports only ``torch`` and its siblings ``feature_maps`` and ``linear_attention``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .feature_maps import FeatureMap, compute_dtype_for
from .linear_attention import (
    DEFAULT_CHUNK_SIZE,
    _as_bool_mask,
    _check_inputs,
    _no_autocast,
    _repeat_features,
    _repeat_kv,
    _safe_denominator,
    _with_ones_column,
)


SOFTMAX_WEIGHT_INIT = 0.1
"""gamma at initialisation (LoLCATs: sigmoid(w) with w = logit(0.1) = -2.1972)."""


class SoftmaxWeight(nn.Module):
    """The learned weight gamma of the exact (sink + window) terms against the linear tail, one per head.

    ``logit`` ``[num_heads]`` starts at ``logit(0.1) = -2.1972`` (deterministic); ``forward()`` returns
    ``sigmoid(logit)`` ``[num_heads]``, the ``softmax_weight`` argument of :func:`window_linear_attention`.
    """

    def __init__(self, num_heads: int):
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"SoftmaxWeight needs num_heads as an int >= 1, got {num_heads!r}")
        self.logit = nn.Parameter(torch.full((num_heads,), self.initial_logit()))

    @staticmethod
    def initial_logit() -> float:
        return math.log(SOFTMAX_WEIGHT_INIT / (1.0 - SOFTMAX_WEIGHT_INIT))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.logit.fill_(self.initial_logit())

    def forward(self) -> torch.Tensor:
        return torch.sigmoid(self.logit)

    def extra_repr(self) -> str:
        return f"num_heads={self.logit.shape[0]}"


def _check_window_arguments(query, key, window, sinks, causal, softmax_weight, chunk_size):
    length = key.shape[2]
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0 = no window keys); got {window!r}")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0 or sinks > length:
        raise ValueError(f"sinks must be an int in [0, sequence length = {length}]; got {sinks!r}")
    if not causal and query.shape[2] != length:
        raise ValueError(
            f"window attention needs as many queries as keys; got {query.shape[2]} queries, {length} keys"
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1; got {chunk_size!r}")
    if softmax_weight is not None:
        heads = query.shape[1]
        if not isinstance(softmax_weight, torch.Tensor) or tuple(softmax_weight.shape) != (heads,):
            shape = tuple(softmax_weight.shape) if isinstance(softmax_weight, torch.Tensor) else type(softmax_weight)
            raise ValueError(
                f"softmax_weight must be None (calibrated) or a tensor of shape [heads] = [{heads}] with values "
                f"in (0, 1); got {shape}"
            )
        if not bool((softmax_weight.detach() > 0).all()):
            raise ValueError("softmax_weight must be None (calibrated) or hold values in (0, 1); got a value <= 0")


def _tail_prefix(phi_q, phi_k, log_scale_k, value_ones, eligible, offset, chunk_size):
    """Per query ``i`` the linear tail over the eligible keys ``j <= i - offset``, stabilised.

    Args:
        phi_q: query feature values ``[B, H, L, m]`` (their log-scale is applied by the caller).
        phi_k: key feature values ``[B, H, L, m]``.
        log_scale_k: key log-scales ``[B, H, L]`` (zeros for maps without one).
        value_ones: ``[B, H, L, dv + 1]`` (values and a column of ones).
        eligible: ``[B, L]`` bool, keys that may enter the tail (unpadded, not sinks).
        offset: ``>= 0``; query ``i`` uses keys ``j <= i - offset``.

    Returns:
        ``tail`` ``[B, H, L, dv + 1]`` = ``sum_j phi_q_i.phi_k_j exp(lk_j - K_i) [v_j, 1]`` and ``K``
        ``[B, H, L]``, the detached maximum of ``lk_j`` over those keys (``finfo.min`` if none).
    """
    batch, heads, length, _ = phi_q.shape
    floor = torch.finfo(phi_q.dtype).min
    masked_log_scale = log_scale_k.masked_fill(~eligible[:, None, :], float("-inf"))
    running_max = masked_log_scale.detach().cummax(dim=-1).values.clamp_min(floor)  # [B, H, L]
    # K_i = running_max[i - offset], floor before any key.
    if offset >= length:
        query_max = torch.full_like(running_max, floor)
    else:
        before_any_key = running_max.new_full((batch, heads, offset), floor)
        query_max = torch.cat([before_any_key, running_max[..., : length - offset]], -1)
    key_weights = phi_k * eligible[:, None, :, None]
    positions = torch.arange(length, device=phi_q.device)
    state = value_ones.new_zeros(batch, heads, phi_k.shape[-1], value_ones.shape[-1])
    state_max = running_max.new_full((batch, heads), floor)
    state_end = 0  # the state holds the keys [0, state_end)
    tails = []
    for start in range(0, length, chunk_size):
        end = min(start + chunk_size, length)
        boundary = min(max(start - offset + 1, 0), length)  # first key the state does not hold
        if boundary > state_end:  # fold keys [state_end, boundary) into the state
            new_max = running_max[..., boundary - 1]
            rescale = (masked_log_scale[..., state_end:boundary] - new_max[..., None]).exp()  # [B, H, n]
            added = torch.matmul((key_weights[:, :, state_end:boundary] * rescale[..., None]).transpose(-1, -2),
                                 value_ones[:, :, state_end:boundary])
            state = state * (state_max - new_max).exp()[..., None, None] + added
            state_max, state_end = new_max, boundary
        k_max = query_max[:, :, start:end]  # [B, H, C]
        out = torch.matmul(phi_q[:, :, start:end], state) * (state_max[..., None] - k_max).exp()[..., None]
        tile_end = min(max(end - offset, 0), length)  # keys [boundary, tile_end) are needed by some query
        if tile_end > boundary:
            keys = positions[boundary:tile_end]
            allowed = keys[None, :] <= positions[start:end, None] - offset  # [C, n]
            decay = (masked_log_scale[:, :, None, boundary:tile_end] - k_max[..., None]).exp()  # [B, H, C, n]
            decay = decay.masked_fill(~allowed, 0.0)
            tile = torch.matmul(phi_q[:, :, start:end], key_weights[:, :, boundary:tile_end].transpose(-1, -2))
            out = out + torch.matmul(tile * decay, value_ones[:, :, boundary:tile_end])
        tails.append(out)
    return torch.cat(tails, dim=2), query_max


def _exact_block(query, key, value_ones, scores_scale, start, end, key_index, allowed, softmax_weight):
    """Scores of queries ``[start, end)`` against the keys ``key_index`` and the masked tile.

    Returns the row maximum ``c`` ``[B, H, C]`` (0 for rows without keys) and a closure that, given
    the row offset ``rho`` ``[B, H, C]``, returns ``sum_j gamma exp(s_ij - c_i - rho_i) [v_j, 1]``.
    """
    scores = torch.matmul(query[:, :, start:end], key[:, :, key_index].transpose(-1, -2)) * scores_scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    # Not detached: in learned mode c_i is part of the definition (gamma exp(s - c) against an unscaled tail).
    row_max = scores.amax(dim=-1)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))

    def weighted(rho):
        weights = (scores - (row_max + rho)[..., None]).exp()
        if softmax_weight is not None:
            weights = weights * softmax_weight[None, :, None, None]
        return torch.matmul(weights, value_ones[:, :, key_index])

    return row_max, weighted


def window_linear_attention(
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
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    eps: float = 1e-12,
) -> torch.Tensor:
    """Sink + sliding-window exact softmax with a linear tail, one shared normaliser (module docstring).

    Args:
        query: ``[B, H, L, d]``.
        key: ``[B, Hkv, L, d]`` with ``H % Hkv == 0``.
        value: ``[B, Hkv, L, dv]``.
        feature_map: a :class:`~.feature_maps.FeatureMap` built for ``d``, or ``None``: no tail at all (sinks +
            window exact softmax only, ``O(L (window + sinks) d)``; ``window`` and ``sinks`` not both 0).
        window: exact keys per query: causal ``i-window+1..i``; bidirectional ``|i-j| < window``. ``>= 0``.
        sinks: the first ``sinks`` keys are always exact (``0 <= sinks <= L``).
        causal: causal (default) or bidirectional.
        softmax_weight: ``None`` (calibrated mode) or ``gamma`` ``[H]`` in (0, 1) (learned mode).
        key_padding_mask: ``[B, L]``, ``True``/1 = token.
        scaling: score scale, default ``d ** -0.5``.
        chunk_size: query block size.
        eps: smallest magnitude of a denominator.

    Returns:
        ``[B, H, L, dv]`` in ``value.dtype``.
    """
    _check_inputs(query, key, value, feature_map, True, key_padding_mask, None)
    _check_window_arguments(query, key, window, sinks, causal, softmax_weight, chunk_size)
    if feature_map is None and window == 0 and sinks == 0:
        raise ValueError("window attention without a feature map (no linear tail) needs window > 0 or sinks > 0")
    mask = _as_bool_mask(key_padding_mask)
    batch, heads, length, head_dim = query.shape
    scaling = head_dim**-0.5 if scaling is None else float(scaling)
    groups = heads // key.shape[1]
    out_dtype = value.dtype
    dtype = compute_dtype_for(query)
    device = query.device
    with _no_autocast(device.type):
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        gamma = None if softmax_weight is None else softmax_weight.to(dtype)
        if feature_map is not None:  # None: no linear tail
            root = scaling**0.5
            q_features, k_features = feature_map(query * root, key * root)
            k_features = _repeat_features(k_features, groups)
        key, value_ones = _repeat_kv(key, groups), _with_ones_column(_repeat_kv(value, groups))
        keep = torch.ones(batch, length, dtype=torch.bool, device=device) if mask is None else mask
        value_ones = value_ones.masked_fill(~keep[:, None, :, None], 0.0)
        positions = torch.arange(length, device=device)
        eligible = keep & (positions >= sinks)[None, :]
        tails = []  # (tail sums, their log-scale) per direction; none without a feature map
        if feature_map is not None:
            phi_q, phi_k = q_features.values, k_features.values
            zeros = phi_q.new_zeros(batch, heads, length)
            log_q = zeros if q_features.log_scale is None else q_features.log_scale
            log_k = zeros if k_features.log_scale is None else k_features.log_scale
            tails.append(_tail_prefix(phi_q, phi_k, log_k, value_ones, eligible, window, chunk_size))
        if tails and not causal:  # keys j >= i + max(window, 1), as a prefix of the reversed sequence
            right, right_max = _tail_prefix(*(t.flip(2) for t in (phi_q, phi_k, log_k, value_ones)),
                                            eligible.flip(1), max(window, 1), chunk_size)
            tails.append((right.flip(2), right_max.flip(2)))

        outputs = []
        sink_index = positions[:sinks]
        for start in range(0, length, chunk_size):
            end = min(start + chunk_size, length)
            rows = positions[start:end, None]
            if causal:
                band = positions[max(sinks, start - window + 1):end]
            else:
                band = positions[max(sinks, start - window + 1):min(length, end + window - 1)]
            key_index = torch.cat([sink_index, band])
            cols = key_index[None, :]
            exact = (cols < sinks) | ((rows - cols).abs() < window)
            if causal:
                exact = exact & (cols <= rows)
            allowed = exact[None, None] & keep[:, None, None, key_index]
            row_max, weighted = _exact_block(query, key, value_ones, scaling, start, end, key_index, allowed, gamma)
            # Tail log factors u = lq + K (- c in calibrated mode); rho = max(0, u) keeps every term <= ~1.
            log_factors = []
            for _, tail_max in tails:
                u = log_q[:, :, start:end] + tail_max[:, :, start:end]
                log_factors.append(u - row_max if gamma is None else u)
            rho = torch.stack([torch.zeros_like(row_max)] + [u.detach() for u in log_factors]).amax(0)
            total = weighted(rho)
            for (tail, _), u in zip(tails, log_factors):
                total = total + tail[:, :, start:end] * (u - rho).exp()[..., None]
            outputs.append(total)
        total = torch.cat(outputs, dim=2)
        out = total[..., :-1] / _safe_denominator(total[..., -1:], eps)
        if not causal and sinks > 0:  # sink queries: exact softmax over every key
            scores = torch.matmul(query[:, :, :sinks], key.transpose(-1, -2)) * scaling
            scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
            sink_out = torch.matmul(torch.softmax(scores, dim=-1), value_ones[..., :-1])
            out = torch.cat([sink_out, out[:, :, sinks:]], dim=2)
    return out.to(out_dtype)
