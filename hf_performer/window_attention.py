"""Sink + sliding-window softmax attention with a linear-attention tail and one shared normaliser.

The operator, its decoding state and its memory-bounded training path. Layouts as
:func:`~.linear_attention.linear_attention`: queries ``[B, H, L, d]``, keys and values ``[B, Hkv, L, d]``
(``Hkv`` divides ``H``). With scores ``s_ij = scaling * q_i.k_j``, features ``phi`` of
``sqrt(scaling) q`` and ``sqrt(scaling) k``, an exact key set ``E(i)`` and a tail key set ``T(i)``:

    y_i = (sum_{E(i)} w_ij v_j + sum_{T(i)} t_ij v_j) / (sum_{E(i)} w_ij + sum_{T(i)} t_ij)

Sinks are per row: a row's sinks are its first ``sinks`` unpadded keys, ``is_sink = keep & (keep.cumsum(-1) <=
sinks)`` (``keep`` = not padding), wherever they are (keys ``0..sinks-1`` in an unpadded row; a row with fewer
unpadded keys has fewer sinks). Positions (the band) stay absolute, so a left-padded row (batched ``generate``) gets
exactly what it gets alone.

* causal: ``E(i)`` = the row's sinks at positions ``<= i`` and the band ``max(i-window+1, 0)..i`` without them
  (no double counting); ``T(i)`` = every other unpadded key ``<= i-window``. ``window=0`` means no window keys
  (with ``sinks=0``: plain causal linear attention).
* bidirectional: a non-sink query has ``E(i)`` = the row's sinks and the band ``|i-j| < window``,
  ``T(i)`` = every other key; a sink query (a row's sink position, e.g. [CLS], also after left padding) attends
  to every unpadded key exactly (``E(i)`` = all keys, no tail): sinks are exact "both ways".
* padded keys are in neither set.

Implementation: the sinks are gathered per row (``[B, Hkv, sinks, d]`` keys and values with their positions and
a valid flag) and enter every query block's exact tile beside the band; sink keys are marked not kept for the band
and the tail.

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

Training memory: a call that needs gradients and is longer than one segment (:data:`CAUSAL_SEGMENT_LENGTH`,
:data:`BIDIRECTIONAL_SEGMENT_LENGTH`) runs in segments of that many queries, so that the backward holds one
segment's graph at a time (the outputs and gradients of one pass). Causal: segments each continuing the previous
one's :class:`WindowAttentionState`, recomputed one at a time in the backward (:func:`_segmented_window_attention`,
:mod:`.window_segments`); the recomputation reuses the block outputs the forward computed
(:func:`~.window_blocks.reused_outputs`), so that only the hand-written block gradient computes them again.
Bidirectional: each segment reads its band's halo and two small tail sums (the keys before and after its halo)
through :mod:`.window_segments` (:func:`_segmented_bidirectional`). A map that redraws in training mode keeps the one
pass.

On the parallel path (CUDA, :func:`~.linear_attention_parallel.attention_path`) a call without a state runs
:mod:`.window_parallel` (every block at once) when it serves it, and nothing is segmented (one pass, the memory of its
graph).

This module imports only ``torch`` and its siblings ``feature_maps``, ``linear_attention``,
``linear_attention_parallel``, ``window_tail``, ``window_tail_cap``, ``window_segments``, ``window_blocks``,
``window_parallel``, ``window_causal``, ``window_decode`` and ``window_state``.
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
    _repeat_kv,
    _safe_denominator,
    _with_ones_column,
)
from .linear_attention_parallel import attention_path
from .window_blocks import reused_outputs
from .window_causal import causal_window_attention, tail_features
from .window_parallel import parallel_window_attention
from .window_decode import can_decode_step, decode_step, exact_decode_step
from .window_segments import CausalPlan, SegmentPlan, segmented_bidirectional, segmented_causal
from .window_state import (
    WindowAttentionState, row_sinks, state_tensors, with_key_copies, with_state_tensors, without_key_copies,
)
from .window_tail import _tail_prefix, _tail_suffix, _tail_sum, pieces
from .window_tail_cap import check_tail_cap, check_tail_gate


SOFTMAX_WEIGHT_INIT = 0.1
"""gamma at initialisation (LoLCATs: sigmoid(w) with w = logit(0.1) = -2.1972)."""

CAUSAL_SEGMENT_LENGTH = 256
"""Causal calls that need gradients run in segments of this many queries (:func:`_segmented_for_gradients`): each
segment's entering state is kept, so shorter segments trade graph for states; 256 had the lowest peak at 4k-16k
(12 heads, ``d`` 64, window 64, Hedgehog tail: 156 / 242 / 402 MiB against 215 / 295 / 440 MiB with 512) and is no
slower."""

BIDIRECTIONAL_SEGMENT_LENGTH = 512
"""Bidirectional calls that need gradients run in segments of this many queries: each cut adds a span sum, so 256
peaks higher at 16k (684 against 498 MiB)."""


def _segment_length(causal: bool) -> int:
    return CAUSAL_SEGMENT_LENGTH if causal else BIDIRECTIONAL_SEGMENT_LENGTH


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


class TailGate(nn.Module):
    """The learned tail gate of a causal window layer: an exponent ``alpha`` per query head in ``[0, 1]``, the tail
    weighed by ``max(n, 1) ** -alpha`` for a query whose tail holds ``n`` tokens (:mod:`.window_tail_cap`).

    ``exponent`` ``[num_heads]`` starts at 0 (the plain tail: a converted model is unchanged until trained);
    ``forward()`` returns it clamped to ``[0, 1]``, the ``tail_gate`` argument of :func:`window_linear_attention`.
    """

    def __init__(self, num_heads: int):
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"TailGate needs num_heads as an int >= 1, got {num_heads!r}")
        self.exponent = nn.Parameter(torch.zeros(num_heads))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.exponent.zero_()

    def forward(self) -> torch.Tensor:
        return self.exponent.clamp(0.0, 1.0)

    def extra_repr(self) -> str:
        return f"num_heads={self.exponent.shape[0]}"


def _check_window_arguments(query, key, window, sinks, causal, softmax_weight, chunk_size, stateful=False):
    length = key.shape[2]
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0 = no window keys); got {window!r}")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0 or (sinks > length and not stateful):
        accepted = ">= 0" if stateful else f"in [0, sequence length = {length}]"
        raise ValueError(f"sinks must be an int {accepted}; got {sinks!r}")
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
        # (A decoding step's weights were checked at its prefill: no device read per token.)
        if not (stateful and query.shape[2] == 1) and not bool((softmax_weight.detach() > 0).all()):
            raise ValueError("softmax_weight must be None (calibrated) or hold values in (0, 1); got a value <= 0")


def _check_sparse_cache(sparse_cache, causal):
    if isinstance(sparse_cache, bool) or not isinstance(sparse_cache, int) or sparse_cache < 0:
        raise ValueError(f"sparse_cache must be an int >= 0 (kept tokens per key head, 0 = none); got {sparse_cache!r}")
    if sparse_cache and not causal:
        raise ValueError("sparse_cache needs causal=True (a bidirectional window layer sees every key already)")


def _check_state_arguments(query, key, value, feature_map, window, sinks, sparse_cache, causal, initial_state,
                           max_rollback, chunk_size):
    """Validate the decoding arguments; returns the ``max_rollback`` to use."""
    if not causal:
        raise ValueError("initial_state / return_state need causal=True (a bidirectional layer has no decoding state)")
    if initial_state is not None and getattr(initial_state, "_fields", None) != WindowAttentionState._fields:
        raise ValueError(f"initial_state must be a WindowAttentionState; got {type(initial_state).__name__}")
    if max_rollback is None:
        max_rollback = 0 if initial_state is None else initial_state.max_rollback
    if isinstance(max_rollback, bool) or not isinstance(max_rollback, int) or max_rollback < 0:
        raise ValueError(f"max_rollback must be an int >= 0 (default: 0); got {max_rollback!r}")
    if initial_state is None:
        return max_rollback
    built = (initial_state.window, initial_state.sinks, initial_state.sparse_cache, initial_state.chunk_size)
    if built != (window, sinks, sparse_cache, chunk_size):
        raise ValueError(
            f"initial_state was built with window={built[0]}, sinks={built[1]}, sparse_cache={built[2]}, "
            f"chunk_size={built[3]}; got window={window}, sinks={sinks}, sparse_cache={sparse_cache}, "
            f"chunk_size={chunk_size}"
        )
    tail = initial_state.oldest
    expected = (query.shape[0], key.shape[1], key.shape[3], value.shape[3], tail_features(feature_map, key.shape[3]))
    found = (initial_state.buffer_key.shape[0], initial_state.buffer_key.shape[1], initial_state.buffer_key.shape[3],
             initial_state.buffer_value.shape[3], tail.tail_sums.shape[2])
    if expected != found:
        raise ValueError(
            f"initial_state holds (batch, kv heads, head_dim, value dim, features) = {found}; the inputs have {expected}"
        )
    return max_rollback


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
    sparse_cache: int = 0,
    tail_cap: int = 0,
    tail_gate: torch.Tensor | None = None,
    initial_state: WindowAttentionState | None = None,
    return_state: bool = False,
    max_rollback: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    eps: float = 1e-12,
):
    """Sink + sliding-window exact softmax with a linear tail, one shared normaliser (module docstring).

    A call that needs gradients and is longer than one segment (:data:`CAUSAL_SEGMENT_LENGTH` or
    :data:`BIDIRECTIONAL_SEGMENT_LENGTH` tokens) runs in segments, causal or
    bidirectional, with the outputs and gradients of one pass and the memory of one segment's graph (module
    docstring, "Training memory").

    Args:
        query: ``[B, H, L, d]``.
        key: ``[B, Hkv, L, d]`` with ``H % Hkv == 0``.
        value: ``[B, Hkv, L, dv]``.
        feature_map: a :class:`~.feature_maps.FeatureMap` built for ``d``, or ``None``: no tail at all (sinks +
            window exact softmax only, ``O(L (window + sinks) d)``; ``window``, ``sinks`` and ``sparse_cache`` not
            all 0).
        window: exact keys per query: causal ``i-window+1..i``; bidirectional ``|i-j| < window``. ``>= 0``.
        sinks: each row's first ``sinks`` unpadded keys are always exact (``0 <= sinks <= L``; any ``sinks >= 0``
            when decoding with a state, since the first calls may be shorter than ``sinks``).
        causal: causal (default) or bidirectional.
        softmax_weight: ``None`` (calibrated mode) or ``gamma`` ``[H]`` in (0, 1) (learned mode).
        key_padding_mask: ``[B, L]``, ``True``/1 = token (the new tokens only when ``initial_state`` is given).
        scaling: score scale, default ``d ** -0.5``.
        sparse_cache: ``G >= 0``, causal only: per row and key head, up to ``G`` tokens older than the window stay
            exact, the ones the tail would recall worst, chosen every ``chunk_size`` tokens
            (:mod:`.window_sparse_cache`); ``0`` (default): none. Without a feature map they are chosen by their
            distance to the mean value.
        tail_cap: ``M >= 0``, causal only: a query whose tail holds ``n > M`` tokens weighs it by ``M / n`` (the
            mean of its tokens at the weight of ``M``; :mod:`.window_tail_cap`), so that the tail's share of the
            normaliser stops growing past the lengths a layer was trained at; ``0`` (default): unbounded.
        tail_gate: ``alpha`` ``[H]`` in ``[0, 1]``, causal only: a query whose tail holds ``n`` tokens weighs it by
            ``max(n, 1) ** -alpha`` (a learned :class:`TailGate`; differentiable; :mod:`.window_tail_cap`);
            ``None`` (default): no gate.
        initial_state: causal only; the :class:`~.window_state.WindowAttentionState` after the preceding tokens
            (returned by an earlier call with ``return_state=True``): the inputs are then the next ``L`` tokens, and
            the outputs equal the last ``L`` outputs of one pass over all tokens. Its feature map must not redraw in
            between.
        return_state: causal only; also return the :class:`~.window_state.WindowAttentionState` after the last
            token.
        max_rollback: tokens the returned state can drop exactly (:meth:`~.window_state.WindowAttentionState.rollback`);
            default 0 (or the initial state's). The state then keeps up to ``max_rollback + chunk_size`` more
            recent keys and a second set of tail sums.
        chunk_size: query block size; causal: also the interval between sparse-cache selections (a state refuses
            another one).
        eps: smallest magnitude of a denominator.

    Returns:
        ``[B, H, L, dv]`` in ``value.dtype``, and the new state if ``return_state``. Decoding one token costs
        ``O((sinks + window + G) d + C (d + m) + m d)`` per head, whatever the number of tokens seen.
    """
    stateful = initial_state is not None or return_state
    _check_inputs(query, key, value, feature_map, True, key_padding_mask, None)
    _check_window_arguments(query, key, window, sinks, causal, softmax_weight, chunk_size, stateful)
    _check_sparse_cache(sparse_cache, causal)
    check_tail_cap(tail_cap, causal, feature_map is not None)
    check_tail_gate(tail_gate, causal, feature_map is not None, query.shape[1])
    if feature_map is None and window == 0 and sinks == 0 and sparse_cache == 0:
        raise ValueError("window attention without a feature map (no linear tail) needs window, sinks or sparse_cache "
                         "> 0")
    if stateful:
        max_rollback = _check_state_arguments(query, key, value, feature_map, window, sinks, sparse_cache, causal,
                                              initial_state, max_rollback, chunk_size)
    if not stateful:  # a call's cost is bounded by its input: more exact keys than it has tokens change nothing
        window, sparse_cache = min(window, key.shape[2]), min(sparse_cache, key.shape[2])
    parallel = attention_path(query) == "parallel"
    segmented = not parallel and _segmented_for_gradients(query, key, value, feature_map, (softmax_weight, tail_gate),
                                                          causal)
    if segmented and not causal:  # (bidirectional calls are never stateful)
        return _segmented_bidirectional(
            query, key, value, feature_map, window=window, sinks=sinks, softmax_weight=softmax_weight,
            key_padding_mask=key_padding_mask, scaling=scaling, chunk_size=chunk_size, eps=eps)
    if segmented:
        return _segmented_window_attention(
            query, key, value, feature_map, window=window, sinks=sinks, sparse_cache=sparse_cache, tail_cap=tail_cap,
            tail_gate=tail_gate, softmax_weight=softmax_weight, key_padding_mask=key_padding_mask, scaling=scaling,
            initial_state=initial_state, return_state=return_state, max_rollback=max_rollback, chunk_size=chunk_size,
            eps=eps)
    mask = _as_bool_mask(key_padding_mask)
    if not stateful and parallel:
        out = parallel_window_attention(
            query, key, value, feature_map, window=window, sinks=sinks, causal=causal, softmax_weight=softmax_weight,
            key_padding_mask=mask, scaling=scaling, sparse_cache=sparse_cache, tail_cap=tail_cap, tail_gate=tail_gate,
            chunk_size=chunk_size, eps=eps, sink_rows=(_sink_query_rows, _with_sink_queries))
        if out is not None:
            return out
    if causal and can_decode_step(initial_state, query.shape[2], max_rollback or 0):
        step = None if feature_map is not None else exact_decode_step(
            query, key, value, state=initial_state, key_padding_mask=mask, scaling=scaling, eps=eps)
        if step is not None:
            return step if return_state else step[0]
        out, state = decode_step(query, key, value, feature_map, state=initial_state, softmax_weight=softmax_weight,
                                 key_padding_mask=mask, scaling=scaling, eps=eps, tail_cap=tail_cap,
                                 tail_gate=tail_gate)
        return (out, state) if return_state else out
    if causal:
        return causal_window_attention(
            query, key, value, feature_map, window=window, sinks=sinks, sparse_cache=sparse_cache,
            softmax_weight=softmax_weight, key_padding_mask=mask, scaling=scaling, initial_state=initial_state,
            return_state=return_state, max_rollback=max_rollback or 0, chunk_size=chunk_size, eps=eps,
            tail_cap=tail_cap, tail_gate=tail_gate)
    return _bidirectional_window_attention(query, key, value, feature_map, window=window, sinks=sinks,
                                           softmax_weight=softmax_weight, key_padding_mask=mask, scaling=scaling,
                                           chunk_size=chunk_size, eps=eps)


def _bidirectional_window_attention(query, key, value, feature_map, *, window, sinks, softmax_weight, key_padding_mask,
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
            sink_out = _sink_query_rows(query, key_all, _repeat_kv(value.to(dtype), groups), new_keep, sink_position,
                                        scaling)
            out = _with_sink_queries(out, sink_out, sink_position, sink_valid)
    return out.to(out_dtype)


def _sink_query_rows(query, key, value, keep, sink_position, scaling, probabilities=False):
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


def _add_sink_query_rows_grad(grad_rows, query, key, value, keep, sink_position, scaling, grad_query, grad_key,
                              grad_value):
    """The backward of :func:`_sink_query_rows` (same arguments, ``grad_rows`` ``[B, H, s, dv]``), added in place
    into ``grad_query`` / ``grad_key`` / ``grad_value`` (shaped as the inputs; ``None`` when not wanted) without a
    temporary of the inputs' size: the keys' and values' gradients are accumulated by ``baddbmm_``."""
    rows, sink_query, weights = _sink_query_rows(query, key, value, keep, sink_position, scaling, True)
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


def _with_sink_queries(out, sink_out, sink_position, sink_valid):
    """``out`` ``[B, H, L, dv]`` with each row's valid sink slots' rows (``sink_valid`` ``[B, s]``) replaced by
    ``sink_out`` ``[B, H, s, dv]`` (:func:`_sink_query_rows`)."""
    batch, heads, length, _ = out.shape
    # Unfilled slots write to an extra position that is dropped.
    target = torch.where(sink_valid, sink_position, length)[:, None, :, None].expand(-1, heads, -1, out.shape[-1])
    padded = torch.cat([out, out.new_zeros(batch, heads, 1, out.shape[-1])], dim=2)
    replaced = padded.scatter(2, target, sink_out.to(out.dtype))[:, :, :length]
    is_sink_query = torch.zeros(batch, length + 1, dtype=torch.bool, device=out.device).scatter(
        1, torch.where(sink_valid, sink_position, length), True)[:, :length]
    return torch.where(is_sink_query[:, None, :, None], replaced, out)


# ------------------------------------------------------------------------------------ memory-bounded training


def _segmented_for_gradients(query, key, value, feature_map, learned_weights, causal) -> bool:
    """Whether a call of the chunked path runs in recomputed segments (the parallel path, CUDA, spends memory on one
    pass instead): gradients wanted, longer than one segment, and a map whose recomputation in the backward sees the
    forward's tensors (no random redraw in training mode)."""
    if not torch.is_grad_enabled() or query.shape[2] <= _segment_length(causal):
        return False
    tensors = [query, key, value, *learned_weights] + ([] if feature_map is None else list(feature_map.parameters()))
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        return False
    return feature_map is None or not (feature_map.training and getattr(feature_map, "redraw_interval", 0))


def _segmented_window_attention(query, key, value, feature_map, *, window, sinks, sparse_cache, tail_cap,
                                tail_gate, softmax_weight, key_padding_mask, scaling, initial_state, return_state,
                                max_rollback, chunk_size, eps):
    """A causal call that needs gradients, as consecutive segments of :data:`CAUSAL_SEGMENT_LENGTH` tokens, each
    continuing the previous one's :class:`WindowAttentionState` (the outputs of one pass, as decoding with a
    state gives them), run by :func:`~.window_segments.segmented_causal`: no graph in the forward, the small states
    between segments kept (their buffer and sparse cache as positions in the keys: ``without_key_copies``), one
    segment recomputed at a time in the backward (in reverse, the entering state's gradient handed to the segment
    before), the input gradients written in place. Peak memory is then the inputs, outputs and gradients plus one
    segment's graph (``benchmarks/results/attention_memory_window.json``)."""
    mask = _as_bool_mask(key_padding_mask)

    def run(segment_query, segment_key, segment_value, gamma, gate, segment_mask, state, rollback):
        # Each segment is at most CAUSAL_SEGMENT_LENGTH long, so the call inside does not segment again.
        return window_linear_attention(
            segment_query, segment_key, segment_value, feature_map, window=window, sinks=sinks, causal=True,
            softmax_weight=gamma, key_padding_mask=segment_mask, scaling=scaling, sparse_cache=sparse_cache,
            tail_cap=tail_cap, tail_gate=gate, initial_state=state, return_state=True, max_rollback=rollback,
            chunk_size=chunk_size, eps=eps)

    length = query.shape[2]
    first = 0 if initial_state is None else initial_state.seen  # the position of the call's first token
    plan = CausalPlan(
        segments=[(start, min(start + CAUSAL_SEGMENT_LENGTH, length))
                  for start in range(0, length, CAUSAL_SEGMENT_LENGTH)],
        run=run, state_tensors=state_tensors, with_state_tensors=with_state_tensors,
        max_rollback=max_rollback if return_state else 0, reuse=reused_outputs,
        store_state=lambda state, all_keys, all_values: without_key_copies(state, all_keys, all_values, first),
        load_state=lambda stored, all_keys, all_values: with_key_copies(*stored, all_keys, all_values))
    parameters = [] if feature_map is None else [p for p in feature_map.parameters() if p.requires_grad]
    out, state = segmented_causal(plan, query, key, value, softmax_weight, tail_gate, mask, initial_state,
                                  parameters)
    return (out, state) if return_state else out


def _segmented_bidirectional(query, key, value, feature_map, *, window, sinks, softmax_weight, key_padding_mask,
                             scaling, chunk_size, eps):
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
            return _sink_query_rows(query.to(dtype), key.to(dtype), value.to(dtype), unpadded, sink_position, scaling)

    def add_sink_rows_grad(grad_rows, query, key, value, grad_query, grad_key, grad_value):
        with _no_autocast(device_type):
            _add_sink_query_rows_grad(grad_rows, query.to(dtype), key.to(dtype), value.to(dtype), unpadded,
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
        return _with_sink_queries(out, rows, sink_position - start, here)

    plan = SegmentPlan(
        segments=segments, local=local, cuts=sorted({0, length} | {bound for span in local for bound in span}),
        sink_key=sink_key, sink_value=sink_value, sink_position=sink_position,
        span_sum=None if feature_map is None else span_sum, segment=segment,
        sink_rows=sink_rows if sinks > 0 else None, add_sink_rows_grad=add_sink_rows_grad)
    parameters = [] if feature_map is None else [p for p in feature_map.parameters() if p.requires_grad]
    return segmented_bidirectional(plan, query, key, value, softmax_weight, parameters).to(value.dtype)
