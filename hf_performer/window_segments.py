"""Memory-bounded training of the window operator: one autograd function over recomputed segments per direction.

:func:`segmented_causal` runs a causal call as consecutive query segments, each continuing the previous one's
decoding state (a :class:`CausalPlan`): the forward keeps no graph, only the inputs, the output and the small state
entering each segment; the backward walks the segments in reverse, recomputes one with autograd from its leaf
inputs and leaf entering state, and hands the entering state's gradient to the segment before. The query, key and
value gradients are written into three preallocated tensors. What a segment's run records in the forward within
``plan.reuse`` (the block attention's outputs and denominators: about one output's size per call) its recomputation
takes back instead of computing it again.

:func:`segmented_bidirectional` runs the pieces that
``window_bidirectional.segmented_bidirectional_window_attention`` prepares (a :class:`SegmentPlan`) without any graph in the forward, and in the backward recomputes one piece at a time with
autograd, writing the gradients of the queries, keys and values into three preallocated tensors. So the memory of
a call is its inputs, outputs and gradients plus one piece's graph, and nothing else lives from one segment to the
next (per-segment graphs or gradient pieces left on the heap between freed temporaries would make the resident set
grow with the length).

The pieces: each span of keys between two cuts has a linear-tail sum (``span_sum``, ``[B, Hkv, m, dv + 1]`` and
its stabiliser ``[B, Hkv]``); the tail sums over all spans before / from each cut are merges of those
(:func:`~.window_tail._merge_tail_sums`); each query segment's output (``segment``) reads its local keys, the row
sinks, the sink queries' exact rows and the two tail sums at its local keys' ends; the sink queries' rows
(``sink_rows``, ``[B, H, sinks, dv]``) attend to every key.

This module imports only ``torch`` and its sibling ``window_tail``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple

import torch
from torch.autograd.function import once_differentiable

from .window_tail import _merge_tail_sums


class CausalPlan(NamedTuple):
    """What :func:`segmented_causal` runs.

    Attributes:
        segments: ``(start, end)`` of each query segment (consecutive, covering ``[0, L)``).
        run: ``(query, key, value, gamma, tail_gate, key_padding_mask, state, max_rollback) -> (out, state)``, one
            segment continuing ``state`` (``None`` before the first token): the decoding step of the operator.
        state_tensors: ``state -> list`` of its floating-point tensors (the differentiable part, fixed order).
        with_state_tensors: ``(state, tensors) -> state`` with those tensors replaced.
        max_rollback: what the final state must be able to drop (the states between segments need none).
        reuse: ``(store, record) -> context manager`` within which ``run`` records its expensive outputs into
            ``store`` (a list per segment; ``record``) or takes them from there: the backward's recomputation of a
            segment reuses what the forward computed instead of computing it again; or ``None``.
        store_state: ``(state, key, value) -> stored``, what the forward keeps of a state entering a segment (e.g.
            without its copies of the call's own keys), and ``load_state`` ``(stored, key, value) -> state`` the
            state again; ``None``: the state itself.
    """

    segments: list
    run: Callable
    state_tensors: Callable
    with_state_tensors: Callable
    max_rollback: int
    reuse: Callable | None = None
    store_state: Callable | None = None
    load_state: Callable | None = None


def segmented_causal(plan: CausalPlan, query, key, value, softmax_weight, tail_gate, key_padding_mask, initial_state,
                     parameters):
    """``(out, state)`` of ``plan`` on ``query`` ``[B, H, L, d]``, ``key`` / ``value`` ``[B, Hkv, L, .]``,
    ``softmax_weight`` and ``tail_gate`` (each ``[H]`` or ``None``), ``key_padding_mask`` (``[B, L]`` bool or
    ``None``) after ``initial_state`` (or ``None``): the outputs and final state of one pass, differentiable in the
    tensors, the initial state's floating-point tensors and ``parameters`` (the trainable tensors ``plan.run`` reads:
    a feature map's). First-order gradients only."""
    initial = [] if initial_state is None else plan.state_tensors(initial_state)
    holder = []  # the final state's template (its non-differentiable parts), filled by the forward
    out, *final = _SegmentedCausal.apply(plan, initial_state, holder, len(initial), query, key, value, softmax_weight,
                                         tail_gate, key_padding_mask, *initial, *parameters)
    return out, plan.with_state_tensors(holder[0], final)


def _rollback_after(plan, index):
    """``max_rollback`` of the state after segment ``index``: only the last two states may need the user's (the one
    entering the last segment holds the tokens the final state keeps when that segment is short)."""
    return plan.max_rollback if index >= len(plan.segments) - 2 else 0


def _reusing(plan, store, record):
    return contextlib.nullcontext() if plan.reuse is None else plan.reuse(store, record)


def _piece(tensor, start, end, dim=2):
    return None if tensor is None else tensor.narrow(dim, start, end - start)


class _SegmentedCausal(torch.autograd.Function):
    """See :func:`segmented_causal`. Inputs after the plan: the initial state (for the backward's leaves), a list
    receiving the final state, the number of initial-state tensors, then the tensors."""

    @staticmethod
    def forward(ctx, plan, initial_state, holder, n_initial, query, key, value, softmax_weight, tail_gate,
                key_padding_mask, *rest):
        ctx.plan, ctx.n_initial = plan, n_initial
        ctx.set_materialize_grads(False)  # unused outputs (often the final state) give None: nothing to replay
        ctx.save_for_backward(query, key, value, softmax_weight, tail_gate, key_padding_mask, *rest)
        states, state, out = [], initial_state, None
        ctx.records = [[] for _ in plan.segments]
        for index, (start, end) in enumerate(plan.segments):
            states.append(state if plan.store_state is None or index == 0 else plan.store_state(state, key, value))
            with _reusing(plan, ctx.records[index], record=True):
                segment_out, state = plan.run(_piece(query, start, end), _piece(key, start, end),
                                              _piece(value, start, end), softmax_weight, tail_gate,
                                              _piece(key_padding_mask, start, end, dim=1), state,
                                              _rollback_after(plan, index))
            if out is None:
                out = segment_out.new_empty(query.shape[:3] + segment_out.shape[3:])
            out[:, :, start:end] = segment_out
        # The states entering segments 1.. (small: sinks, the tail sums, and the last window of keys and the sparse
        # cache unless plan.store_state keeps them as indices into the keys); the first is the caller's initial
        # state, rebuilt from the saved tensors.
        ctx.states = states[1:]
        ctx.initial_state = initial_state
        holder.append(state)
        return (out, *plan.state_tensors(state))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, *grad_final):
        plan, n_initial = ctx.plan, ctx.n_initial
        query, key, value, softmax_weight, tail_gate, mask, *rest = ctx.saved_tensors
        initial, all_parameters = rest[:n_initial], rest[n_initial:]
        parameters = [p for p in all_parameters if p.requires_grad]
        need_q, need_k, need_v, need_gamma, need_gate = ctx.needs_input_grad[4:9]
        need_initial = any(ctx.needs_input_grad[10:10 + n_initial])
        grads = [torch.zeros_like(t) if need else None for t, need in ((query, need_q), (key, need_k),
                                                                     (value, need_v))]
        gamma, gate = _leaf(softmax_weight, bool(need_gamma)), _leaf(tail_gate, bool(need_gate))
        weights = [t for t in (gamma, gate) if t is not None and t.requires_grad]  # the leaves wanted
        weight_grads, parameter_grads = [None] * len(weights), [None] * len(parameters)
        grad_state = list(grad_final)
        entering = [None if ctx.initial_state is None else plan.with_state_tensors(ctx.initial_state, initial)]
        entering += ctx.states
        for index in reversed(range(len(plan.segments))):
            start, end = plan.segments[index]
            with torch.enable_grad():
                pieces = [_leaf(_piece(t, start, end), bool(need)) for t, need in
                          ((query, need_q), (key, need_k), (value, need_v))]
                state, state_leaves = entering[index], []
                if index > 0 and plan.load_state is not None:
                    state = plan.load_state(state, key, value)
                if state is not None and (index > 0 or need_initial):
                    state_leaves = [_leaf(t) for t in plan.state_tensors(state)]
                    state = plan.with_state_tensors(state, state_leaves)
                with _reusing(plan, ctx.records[index], record=False):
                    segment_out, state_out = plan.run(*pieces, gamma, gate, _piece(mask, start, end, dim=1), state,
                                                      _rollback_after(plan, index))
                outputs, output_grads = [], []
                if grad_out is not None:
                    outputs, output_grads = [segment_out], [grad_out[:, :, start:end]]
                for tensor, grad in zip(plan.state_tensors(state_out), grad_state):
                    if grad is not None and tensor is not None and tensor.requires_grad:
                        outputs.append(tensor)
                        output_grads.append(grad)
                wanted = ([t for t in pieces if t.requires_grad] + weights
                          + [t for t in state_leaves if t is not None and t.requires_grad] + parameters)
                found = (list(torch.autograd.grad(outputs, wanted, output_grads, allow_unused=True)) if outputs
                         else [None] * len(wanted))
            _add_pieces(found, pieces, grads, ((start, end),) * 3)
            weight_grads = _add(weight_grads, [found.pop(0) for _ in weights])
            grad_state = [found.pop(0) if t is not None and t.requires_grad else None for t in state_leaves]
            parameter_grads = _add(parameter_grads, found)
        grad_initial = grad_state if need_initial and grad_state else [None] * n_initial
        all_parameter_grads, all_weight_grads = iter(parameter_grads), iter(weight_grads)
        grad_gamma, grad_gate = (next(all_weight_grads) if t is not None and t.requires_grad else None
                                 for t in (gamma, gate))
        return (None, None, None, None, *grads, grad_gamma, grad_gate, None, *grad_initial,
                *(next(all_parameter_grads) if p.requires_grad else None for p in all_parameters))


class SegmentPlan(NamedTuple):
    """What :func:`segmented_bidirectional` runs (``L`` keys, spans cut at ``cuts``).

    Attributes:
        segments: ``(start, end)`` of each query segment (consecutive, covering ``[0, L)``).
        local: ``(low, high)`` of each segment's local keys; every bound is in ``cuts``.
        cuts: increasing span bounds from 0 to ``L``.
        sink_key: ``[B, Hkv, s, d]`` and ``sink_value`` ``[B, Hkv, s, dv]``, each row's sink slots (detached),
            gathered from the positions ``sink_position`` ``[B, s]`` (long).
        span_sum: ``(span_key, span_value, start, end) -> (sum, stabiliser)``, the tail sum of the keys
            ``[start, end)`` (``None``: no linear tail).
        segment: ``(query, key, value, gamma, sink_key, sink_value, sink_rows, left, right, start, end, low)
            -> [B, H, end - start, dv]``, a segment's output from its queries ``[B, H, end - start, d]`` and local
            keys / values ``[B, Hkv, high - low, .]``, ``left`` / ``right`` the tail sums before ``low`` / from
            ``high`` (``None`` without a tail), ``sink_rows`` as below (``None`` without sinks).
        sink_rows: ``(query, key, value) -> [B, H, s, dv]``, the sink queries' exact rows (``None``: no sinks).
        add_sink_rows_grad: ``(grad_rows, query, key, value, grad_query, grad_key, grad_value)``, the backward of
            ``sink_rows``, added in place into the three gradients (``None`` where not wanted).
    """

    segments: list
    local: list
    cuts: list
    sink_key: torch.Tensor
    sink_value: torch.Tensor
    sink_position: torch.Tensor
    span_sum: Callable | None
    segment: Callable
    sink_rows: Callable | None
    add_sink_rows_grad: Callable


def segmented_bidirectional(plan: SegmentPlan, query, key, value, softmax_weight, parameters):
    """The output ``[B, H, L, dv]`` of ``plan`` on ``query`` ``[B, H, L, d]``, ``key`` / ``value``
    ``[B, Hkv, L, .]`` and ``softmax_weight`` (``[H]`` or ``None``), differentiable in those and in
    ``parameters`` (the trainable tensors the plan's functions read: a feature map's). First-order gradients only."""
    return _SegmentedBidirectional.apply(plan, query, key, value, softmax_weight, *parameters)


def _tail_states(sums):
    """The tail sums over the spans before each cut (``before[i]``: spans ``< i``) and from it (``after[i]``)."""
    empty = (torch.zeros_like(sums[0][0]), torch.full_like(sums[0][1], torch.finfo(sums[0][1].dtype).min))
    before, after = [empty], [empty]
    for span_sum, later_sum in zip(sums, reversed(sums)):
        before.append(_merge_tail_sums(before[-1], span_sum))
        after.append(_merge_tail_sums(later_sum, after[-1]))
    after.reverse()
    return before, after


def _leaf(tensor, wanted=True):
    return None if tensor is None else tensor.detach().requires_grad_(wanted and tensor.is_floating_point())


class _SegmentedBidirectional(torch.autograd.Function):
    """See :func:`segmented_bidirectional`. The forward keeps the inputs, the span sums and the sink rows (small);
    the backward replays the merges from leaf span sums, then per segment recomputes its output with leaf pieces of
    the inputs and its two tail sums, then per span its sum, and finally the sink rows' and sink slots' parts."""

    @staticmethod
    def forward(ctx, plan, query, key, value, softmax_weight, *parameters):
        ctx.plan = plan
        ctx.save_for_backward(query, key, value, softmax_weight, *parameters)
        piece = {cut: index for index, cut in enumerate(plan.cuts)}
        sums = None
        if plan.span_sum is not None:
            sums = [plan.span_sum(key[:, :, start:end], value[:, :, start:end], start, end)
                    for start, end in zip(plan.cuts, plan.cuts[1:])]
            before, after = _tail_states(sums)
        sink_rows = None if plan.sink_rows is None else plan.sink_rows(query, key, value)
        ctx.sums, ctx.sink_rows = sums, sink_rows
        out = None
        for (start, end), (low, high) in zip(plan.segments, plan.local):
            left, right = (None, None) if sums is None else (before[piece[low]], after[piece[high]])
            segment_out = plan.segment(query[:, :, start:end], key[:, :, low:high], value[:, :, low:high],
                                       softmax_weight, plan.sink_key, plan.sink_value, sink_rows, left, right,
                                       start, end, low)
            if out is None:
                out = segment_out.new_empty(query.shape[:3] + segment_out.shape[3:])
            out[:, :, start:end] = segment_out
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        plan = ctx.plan
        query, key, value, softmax_weight, *all_parameters = ctx.saved_tensors
        parameters = [p for p in all_parameters if p.requires_grad]
        need_q, need_k, need_v = ctx.needs_input_grad[1:4]
        grad_query = torch.zeros_like(query) if need_q else None
        grad_key = torch.zeros_like(key) if need_k else None
        grad_value = torch.zeros_like(value) if need_v else None
        gamma = _leaf(softmax_weight, bool(ctx.needs_input_grad[4]))
        sink_key, sink_value = _leaf(plan.sink_key, need_k), _leaf(plan.sink_value, need_v)
        sink_rows = _leaf(ctx.sink_rows)
        piece = {cut: index for index, cut in enumerate(plan.cuts)}
        with torch.enable_grad():
            if ctx.sums is not None:  # the merges again, from leaf span sums (small)
                sum_leaves = [(_leaf(span_sum), span_max) for span_sum, span_max in ctx.sums]
                before, after = _tail_states(sum_leaves)
            state_grads = {}  # id of a merged state -> (state, its gradient)
            extra = [t for t in (gamma, sink_key, sink_value, sink_rows) if t is not None and t.requires_grad]
            extra_grads = [None] * len(extra)
            parameter_grads = [None] * len(parameters)
            for (start, end), (low, high) in zip(plan.segments, plan.local):
                pieces = [_leaf(query[:, :, start:end], need_q), _leaf(key[:, :, low:high], need_k),
                          _leaf(value[:, :, low:high], need_v)]
                states = (None, None) if ctx.sums is None else (before[piece[low]], after[piece[high]])
                state_leaves = [None if s is None else (_leaf(s[0]), s[1]) for s in states]
                out = plan.segment(*pieces, gamma, sink_key, sink_value, sink_rows, *state_leaves, start, end, low)
                wanted = ([t for t in pieces if t.requires_grad] + extra
                          + [s[0] for s in state_leaves if s is not None] + parameters)
                found = list(torch.autograd.grad(out, wanted, grad[:, :, start:end], allow_unused=True))
                _add_pieces(found, pieces, (grad_query, grad_key, grad_value), ((start, end), (low, high), (low, high)))
                extra_grads = _add(extra_grads, found[:len(extra)])
                found = found[len(extra):]
                for state in states:
                    if state is None:
                        continue
                    found_grad = found.pop(0)
                    if found_grad is not None:
                        previous = state_grads.get(id(state[0]), (state[0], None))[1]
                        state_grads[id(state[0])] = (state[0], found_grad if previous is None
                                                     else previous + found_grad)
                parameter_grads = _add(parameter_grads, found)
            state_grads = {key_: pair for key_, pair in state_grads.items() if pair[0].requires_grad}
            if ctx.sums is not None and state_grads:  # through the merges to each span's sum, then its keys
                states, state_grad = zip(*state_grads.values())
                leaves = [leaf for leaf, _ in sum_leaves]
                sum_grads = torch.autograd.grad(states, leaves, state_grad, allow_unused=True)
                for (start, end), sum_grad in zip(zip(plan.cuts, plan.cuts[1:]), sum_grads):
                    if sum_grad is None:
                        continue
                    span = [_leaf(key[:, :, start:end], need_k), _leaf(value[:, :, start:end], need_v)]
                    span_sum, _ = plan.span_sum(*span, start, end)
                    wanted = [t for t in span if t.requires_grad] + parameters
                    found = list(torch.autograd.grad(span_sum, wanted, sum_grad, allow_unused=True))
                    _add_pieces(found, span, (grad_key, grad_value), ((start, end),) * 2)
                    parameter_grads = _add(parameter_grads, found)
            extra_grad = dict(zip(map(id, extra), extra_grads))
            rows_grad = extra_grad.get(id(sink_rows))
        if rows_grad is not None:  # the sink queries' rows: every key, accumulated in place
            plan.add_sink_rows_grad(rows_grad, query, key, value, grad_query, grad_key, grad_value)
        index = plan.sink_position[:, None, :, None]
        for target, slots in ((grad_key, sink_key), (grad_value, sink_value)):
            slot_grad = extra_grad.get(id(slots))
            if target is not None and slot_grad is not None:  # the gather of the sink slots, backwards
                target.scatter_add_(2, index.expand(-1, target.shape[1], -1, target.shape[3]), slot_grad)
        grad_gamma = None if gamma is None else extra_grad.get(id(gamma))
        all_parameter_grads = iter(parameter_grads)
        return (None, grad_query, grad_key, grad_value, grad_gamma,
                *(next(all_parameter_grads) if p.requires_grad else None for p in all_parameters))


def _add_pieces(found, pieces, targets, ranges):
    """Pop from ``found`` the gradients of the ``pieces`` that require one (in order) and add each into its
    ``target`` ``[B, H, L, .]`` at positions ``range`` (``(start, end)``)."""
    for piece, target, (start, end) in zip(pieces, targets, ranges):
        if piece.requires_grad:
            piece_grad = found.pop(0)
            if piece_grad is not None:
                target[:, :, start:end] += piece_grad


def _add(totals, new):
    """Element-wise sum of two lists of optional tensors."""
    return [b if a is None else a if b is None else a + b for a, b in zip(totals, new)]
