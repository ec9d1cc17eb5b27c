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
(:func:`~.window_block_operands.reused_outputs`), so that only the hand-written block gradient computes them again.
Bidirectional: each segment reads its band's halo and two small tail sums (the keys before and after its halo)
through :mod:`.window_segments` (:func:`~.window_bidirectional.segmented_bidirectional_window_attention`). A map
that redraws in training mode keeps the one pass.

On the parallel path (CUDA, :func:`~.linear_attention_parallel.attention_path`) a call without a state runs
:mod:`.window_parallel` (every block at once) when it serves it, and nothing is segmented (one pass, the memory of its
graph).

The bidirectional operator lives in :mod:`.window_bidirectional`, the causal one in :mod:`.window_causal`, decoding
steps in :mod:`.window_decode`, the parallel path in :mod:`.window_parallel`. This module imports only ``torch`` and
its siblings ``feature_maps``, ``linear_attention``, ``linear_attention_parallel``, ``window_bidirectional``,
``window_tail_cap``, ``window_segments``, ``window_block_operands``, ``window_parallel``, ``window_causal``,
``window_decode``, ``window_sparse_cache`` and ``window_state``.
"""

from __future__ import annotations

import math
import torch
from torch import nn

from .feature_maps import FeatureMap
from .linear_attention import DEFAULT_CHUNK_SIZE, _as_bool_mask, _check_inputs
from .linear_attention_parallel import attention_path
from .window_bidirectional import (
    BIDIRECTIONAL_SEGMENT_LENGTH,
    bidirectional_window_attention,
    segmented_bidirectional_window_attention,
)
from .window_block_operands import reused_outputs
from .window_causal import causal_window_attention, tail_features
from .window_parallel import parallel_window_attention
from .window_decode import can_decode_step, decode_step, exact_decode_step
from .window_segments import CausalPlan, segmented_causal
from .window_sparse_cache import check_selection, check_span
from .window_state import (
    WindowAttentionState, state_tensors, with_key_copies, with_state_tensors, without_key_copies,
)
from .window_tail_cap import check_tail_cap, check_tail_gate


SOFTMAX_WEIGHT_INIT = 0.1
"""gamma at initialisation (LoLCATs: sigmoid(w) with w = logit(0.1) = -2.1972)."""

CAUSAL_SEGMENT_LENGTH = 256
"""Causal calls that need gradients run in segments of this many queries (:func:`_segmented_for_gradients`): each
segment's entering state is kept, so shorter segments trade graph for states; 256 had the lowest peak at 4k-16k
(12 heads, ``d`` 64, window 64, Hedgehog tail: 156 / 242 / 402 MiB against 215 / 295 / 440 MiB with 512) and is no
slower."""

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
    sparse_cache_selection: str = "recall",
    sparse_cache_span: int = 1,
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
        feature_map: a :class:`~.feature_map_base.FeatureMap` built for ``d``, or ``None``: no tail at all (sinks +
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
        sparse_cache_selection: ``"recall"`` (default, the above) or ``"attention"``: keep the candidates the
            boundary's own query attends to most (H2O / TOVA family, :mod:`.window_sparse_cache`); not with
            ``max_rollback`` (a replayed boundary's query is not kept).
        sparse_cache_span: odd ``s >= 1``: each candidate's score (either rule) is averaged over its ``s`` nearest
            candidates before ranking, so that whole runs of tokens stay rather than their sharpest keys
            (:func:`~.window_sparse_cache.span_mean`); ``1`` (default): each token on its own score.
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
    check_selection(sparse_cache_selection)
    check_span(sparse_cache_span)
    check_tail_cap(tail_cap, causal, feature_map is not None)
    check_tail_gate(tail_gate, causal, feature_map is not None, query.shape[1])
    if feature_map is None and window == 0 and sinks == 0 and sparse_cache == 0:
        raise ValueError("window attention without a feature map (no linear tail) needs window, sinks or sparse_cache "
                         "> 0")
    if stateful:
        max_rollback = _check_state_arguments(query, key, value, feature_map, window, sinks, sparse_cache, causal,
                                              initial_state, max_rollback, chunk_size)
    by_attention = sparse_cache_selection == "attention" and sparse_cache > 0
    if by_attention and stateful and (max_rollback or (initial_state is not None and (
            initial_state.checkpoint is not None or initial_state.current is None))):
        raise ValueError("sparse_cache_selection='attention' keeps no queries to replay a selection: it takes no "
                         "max_rollback (assisted decoding); use 'recall' there")
    if not stateful:  # a call's cost is bounded by its input: more exact keys than it has tokens change nothing
        window, sparse_cache = min(window, key.shape[2]), min(sparse_cache, key.shape[2])
    parallel = attention_path(query) == "parallel"
    segmented = not parallel and _segmented_for_gradients(query, key, value, feature_map, (softmax_weight, tail_gate),
                                                          causal)
    if segmented and not causal:  # (bidirectional calls are never stateful)
        return segmented_bidirectional_window_attention(
            query, key, value, feature_map, window=window, sinks=sinks, softmax_weight=softmax_weight,
            key_padding_mask=key_padding_mask, scaling=scaling, chunk_size=chunk_size, eps=eps)
    if segmented:
        return _segmented_window_attention(
            query, key, value, feature_map, window=window, sinks=sinks, sparse_cache=sparse_cache, tail_cap=tail_cap,
            tail_gate=tail_gate, softmax_weight=softmax_weight, key_padding_mask=key_padding_mask, scaling=scaling,
            initial_state=initial_state, return_state=return_state, max_rollback=max_rollback, chunk_size=chunk_size,
            eps=eps, sparse_cache_selection=sparse_cache_selection, sparse_cache_span=sparse_cache_span)
    mask = _as_bool_mask(key_padding_mask)
    # (The parallel path's selection kernel ranks single tokens by recall.)
    if not stateful and parallel and not by_attention and (sparse_cache_span == 1 or not sparse_cache):
        out = parallel_window_attention(
            query, key, value, feature_map, window=window, sinks=sinks, causal=causal, softmax_weight=softmax_weight,
            key_padding_mask=mask, scaling=scaling, sparse_cache=sparse_cache, tail_cap=tail_cap, tail_gate=tail_gate,
            chunk_size=chunk_size, eps=eps)
        if out is not None:
            return out
    if causal and can_decode_step(initial_state, query.shape[2], max_rollback or 0):
        step = None if feature_map is not None else exact_decode_step(
            query, key, value, state=initial_state, key_padding_mask=mask, scaling=scaling, eps=eps,
            by_attention=by_attention, span=sparse_cache_span)
        if step is not None:
            return step if return_state else step[0]
        out, state = decode_step(query, key, value, feature_map, state=initial_state, softmax_weight=softmax_weight,
                                 key_padding_mask=mask, scaling=scaling, eps=eps, tail_cap=tail_cap,
                                 tail_gate=tail_gate, by_attention=by_attention, span=sparse_cache_span)
        return (out, state) if return_state else out
    if causal:
        return causal_window_attention(
            query, key, value, feature_map, window=window, sinks=sinks, sparse_cache=sparse_cache,
            softmax_weight=softmax_weight, key_padding_mask=mask, scaling=scaling, initial_state=initial_state,
            return_state=return_state, max_rollback=max_rollback or 0, chunk_size=chunk_size, eps=eps,
            tail_cap=tail_cap, tail_gate=tail_gate, sparse_cache_selection=sparse_cache_selection,
            sparse_cache_span=sparse_cache_span)
    return bidirectional_window_attention(query, key, value, feature_map, window=window, sinks=sinks,
                                           softmax_weight=softmax_weight, key_padding_mask=mask, scaling=scaling,
                                           chunk_size=chunk_size, eps=eps)


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
                                max_rollback, chunk_size, eps, sparse_cache_selection="recall", sparse_cache_span=1):
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
            sparse_cache_selection=sparse_cache_selection, sparse_cache_span=sparse_cache_span, tail_cap=tail_cap,
            tail_gate=gate, initial_state=state,
            return_state=True, max_rollback=rollback,
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
