"""One decoding step of causal window attention: one new token per row, constant work whatever was seen before.

What :func:`~.window_causal.causal_window_attention` computes for a block, for a single query ``x`` per row, read
from the :class:`~.window_state.WindowAttentionState`: its exact keys are the row's sinks, its sparse cache and the
last ``w`` tokens (with a cache: every token after ``b - w``, ``b`` the row's boundary); its tail is, with a cache,
the committed tail sums, without one the last query's tail sums plus the token ``x - w`` (the state keeps them). At a
row's boundary (``x = row_start + k C``) the sparse cache is selected first
(:func:`~.window_sparse_cache.select_hard_keys` over the cache and the ``C`` tokens that left the window since the
last boundary, their features recomputed from the buffer), and without a cache the tail is the newly committed one.
So a step costs ``O((sinks + G + w + C) d + m d)`` per head, plus ``O((G + C) m d)`` per key head once every ``C``
tokens. The exact keys form one score tensor and the step runs a few dozen small operations: at batch 1 their
dispatch, not their arithmetic, is its cost.

It serves the states without a checkpoint (``max_rollback == 0``), whose current tail is known: any other state
(after a rollback, or keeping one for rollbacks) goes through the block path, which replays from the checkpoint.

A layer without a linear tail and with a sparse cache (the recommended causal-LM configuration) is exact softmax over
its sinks, cache and band, and between two boundaries only the band moves: :func:`exact_decode_step` keeps the three
side by side in one tensor with free slots after them (:class:`~.window_state.ExactKeys`; the state's sinks, cache
and buffer are views of it; cache slots that no row and head holds yet are left out), so that a step writes its key
and value into the next free slot in place and makes one ``scaled_dot_product_attention`` call over the slots up to
it (the ones that left the buffer masked, in one mask over all slots), a third of :func:`decode_step`'s operations
and no copy of the exact keys; in a generating model :meth:`~.window_cache_layer.WindowCacheLayer.exact_step` calls
it ahead of the attention function's dispatch, which cost as much as the step's own operations.
At a row's boundary the step runs :func:`decode_step`'s selection first (:func:`_after_selection`) and packs a new
record with the new cache (a boundary step used to take :func:`decode_step` whole, and the step after it packed
again). A state never changes: a step writes in place only when its state is the newest of its record (a second
step from the same state packs a copy first), and only into a slot no earlier state's views cover. Autocast,
reduced-precision inputs (whose scores :func:`decode_step` sums in float32) and steps that need gradients take
:func:`decode_step`.

This module imports only ``torch`` and its siblings.
"""

from __future__ import annotations

import torch

from torch.nn.functional import scaled_dot_product_attention

from .feature_maps import compute_dtype_for
from .linear_attention import _no_autocast, _safe_denominator, _with_ones_column
from .linear_attention_parallel import attention_path
from .window_boundaries import tail_key_features
from .window_causal import combine, exact_terms, rows_window
from .window_sparse_cache import attention_scores, fold_into, select_hard_keys
from .window_state import EXACT_HEADROOM, CommittedTail, ExactKeys, buffer_capacity, last_tokens, row_sinks
from .window_tail_cap import eligible_up_to, tail_log_weights, tail_tokens


def can_decode_step(state, length: int, max_rollback: int) -> bool:
    """Whether a call is one token continuing a state this module serves."""
    return (state is not None and length == 1 and max_rollback == 0 and state.current is not None
            and state.checkpoint is None and (state.query_tail is not None or state.sparse_cache > 0))


def exact_decode_step(query, key, value, *, state, key_padding_mask, scaling, eps: float = 1e-12,
                      by_attention: bool = False, span: int = 1):
    """:func:`decode_step` of a layer without a tail (no feature map; a ``softmax_weight`` cancels without a tail)
    and with a sparse cache: ``(out [B, H, 1, dv], state)``, or ``None`` when the step is not one it serves (module
    docstring) and :func:`decode_step` runs instead. ``eps``: the selection's smallest denominator; ``by_attention``:
    the cache selects by the boundary query's attention (:mod:`.window_sparse_cache`); ``span``: its
    ``sparse_cache_span``."""
    packed = _exact_keys(state, query, key, value, key_padding_mask, eps,
                         _selection_query(query, key.shape[1], scaling) if by_attention else None, span)
    if packed is None:
        return None
    exact, state = packed
    batch, heads, _, head_dim = query.shape
    kv_heads, value_dim = key.shape[1], value.shape[-1]
    sinks, fixed, size = state.sinks, exact.fixed, state.buffer_key.shape[2]
    keep = exact.ones if key_padding_mask is None else key_padding_mask
    # The new token goes to the first free slot (whose mask entry is 0 until written); the buffer's first token
    # leaves (masked, until the next packing). (narrow: these run once per layer and token, where indexing's parsing
    # shows.)
    end = exact.start + size
    exact.key.narrow(2, fixed + end, 1).copy_(key)
    exact.value.narrow(2, fixed + end, 1).copy_(value)
    if key_padding_mask is not None:  # (-inf for padding)
        exact.mask.narrow(3, fixed + end, 1).copy_(keep.to(exact.mask.dtype).log()[:, None, None])
    exact.mask.narrow(3, fixed + exact.start, 1).fill_(float("-inf"))
    exact.written[0] = end + 1
    start, count = exact.start + 1, fixed + end + 1
    out = scaled_dot_product_attention(query.reshape(batch, kv_heads, heads // kv_heads, head_dim),
                                       exact.key.narrow(2, 0, count), exact.value.narrow(2, 0, count),
                                       attn_mask=exact.mask.narrow(3, 0, count),
                                       scale=head_dim**-0.5 if scaling is None else float(scaling))
    sink_key, sink_value, current = state.sink_key, state.sink_value, state.current
    if exact is not state.exact_keys:  # packed now: the sinks and the (whole) cache are views of the new record
        sink_key, sink_value = exact.key.narrow(2, 0, sinks), exact.value.narrow(2, 0, sinks)
        if fixed - sinks == state.sparse_cache:
            current = current._replace(cache_key=exact.key.narrow(2, sinks, fixed - sinks),
                                       cache_value=exact.value.narrow(2, sinks, fixed - sinks))
    buffer_key, buffer_value = exact.key.narrow(2, fixed + start, size), exact.value.narrow(2, fixed + start, size)
    buffer_keep = torch.cat([state.buffer_keep.narrow(1, 1, size - 1), keep], dim=1)
    new_state = state._replace(
        sink_key=sink_key, sink_value=sink_value, buffer_key=buffer_key, buffer_value=buffer_value,
        buffer_keep=buffer_keep, kept_tokens=state.kept_tokens + (1 if key_padding_mask is None else keep[:, 0]),
        current=current, seen=state.seen + 1)
    return out.reshape(batch, heads, 1, value_dim), new_state._replace(
        exact_keys=exact._replace(start=start, parts=ExactKeys.parts_of(new_state)))


def _selection_query(query, kv_heads: int, scaling):
    """The step's query ``[B, H, 1, d]`` as the attention selection takes it: ``[B, Hkv, g, d]``, scaled."""
    batch, heads, _, head_dim = query.shape
    scale = head_dim**-0.5 if scaling is None else float(scaling)
    return query.reshape(batch, kv_heads, heads // kv_heads, head_dim) * scale


def _exact_keys(state, query, key, value, key_padding_mask, eps, selection_query=None, span=1):
    """``(record, state)``: the :class:`~.window_state.ExactKeys` query ``state.seen`` writes to (the state's own
    record when it is the newest of its record and has a free slot, else the state packed into a new one) and the
    state it continues (at a row's boundary, the state after that boundary's selection); ``None`` when
    :func:`exact_decode_step` does not serve the step."""
    dtype = query.dtype
    # float32 / float64 everywhere; bf16 / fp16 on the parallel path (CUDA), where the step is SDPA in the model's
    # dtype as a softmax model's (float32 accumulation in the kernel) instead of decode_step's float32 sums.
    served_dtypes = (torch.float32, torch.float64) + (
        (torch.bfloat16, torch.float16) if attention_path(query) == "parallel" else ())
    if (state.sparse_cache == 0 or dtype not in served_dtypes or key.dtype != dtype
            or value.dtype != dtype or state.buffer_key.dtype != dtype or torch.is_autocast_enabled(query.device.type)
            or (state.sinks == 0 and key_padding_mask is not None)
            or (torch.is_grad_enabled() and any(t.requires_grad for t in (
                query, key, value, state.sink_key, state.sink_value, state.buffer_key, state.buffer_value,
                state.current.cache_key, state.current.cache_value)))):
        # (Reduced precision on the CPU: decode_step sums its scores in float32. Without sinks a padded new token could
        # leave a row no key: decode_step's zero output. Gradients: the in-place writes would change what autograd
        # saved.)
        return None
    batch, kv_heads, size = state.buffer_key.shape[:3]
    exact, current = state.exact_keys, state.current
    if exact is not None and not exact.stands_for(state):
        exact = None
    if exact is not None and state.seen > exact.last_query:  # a boundary: the cache changes, a new record
        state, exact = _after_selection(state, eps, selection_query, span), None
        current = state.current
    if exact is not None:
        if exact.written[0] == exact.start + size and exact.fixed + exact.start + size < exact.key.shape[2] and (
                torch.is_inference_mode_enabled() or not exact.key.is_inference()):
            return exact, state
        # Another step continued this state already, no free slot, or a record built in inference mode met outside
        # it (which may not write into it): pack it again. (The sinks' and the cache's slots and mask entries never
        # change; the buffer's entries are the newest state's.)
        fixed_mask, last_query = exact.mask.narrow(3, 0, exact.fixed), exact.last_query
        cache_key = exact.key.narrow(2, state.sinks, exact.fixed - state.sinks)
        cache_value = exact.value.narrow(2, state.sinks, exact.fixed - state.sinks)
    else:
        if not (bool((state.row_start >= 0).all()) and bool(state.sink_valid.all())):
            return None  # a row without tokens yet, or sink slots still to fill: decode_step's bookkeeping
        if state.seen > int(current.boundary.min()) + state.chunk_size - 1:
            state = _after_selection(state, eps, selection_query, span)
            current = state.current
        last_query = int(current.boundary.min()) + state.chunk_size - 1
        cache_key, cache_value, cache_valid = current.cache_key, current.cache_value, current.cache_valid
        used = int(cache_valid.sum(-1).max())
        if used < state.sparse_cache:  # slots no row and head holds yet (the first window + G tokens) stay out
            order = torch.sort((~cache_valid).to(torch.uint8), dim=-1, stable=True).indices[..., :used]
            take = lambda t: t.gather(2, order[..., None].expand(order.shape + t.shape[-1:]))  # noqa: E731
            cache_key, cache_value, cache_valid = take(cache_key), take(cache_value), cache_valid.gather(-1, order)
        fixed_mask = torch.cat([state.sink_valid[:, None].expand(batch, kv_heads, -1), cache_valid],
                               dim=-1).to(dtype).log()[:, :, None]
    positions = state.buffer_start + torch.arange(size, device=key.device)
    band = state.buffer_keep & (positions > (current.boundary - state.window)[:, None])
    band_mask = band.to(dtype).log()[:, None, None].expand(batch, kv_heads, 1, size)
    free = lambda t: t.new_zeros(t.shape[:-2] + (EXACT_HEADROOM, t.shape[-1]))  # noqa: E731
    keys = torch.cat([state.sink_key, cache_key, state.buffer_key, free(state.buffer_key)], dim=2)
    values = torch.cat([state.sink_value, cache_value, state.buffer_value, free(state.buffer_value)], dim=2)
    mask = torch.cat([fixed_mask, band_mask, band_mask.new_zeros(batch, kv_heads, 1, EXACT_HEADROOM)], dim=-1)
    return ExactKeys(keys, values, state.sinks + cache_key.shape[2], mask, 0, [size], last_query, (),
                     torch.ones(batch, 1, dtype=torch.bool, device=key.device)), state


def _after_selection(state, eps, selection_query=None, span=1):
    """``state`` past the boundary its next query ``x = state.seen`` reaches in some rows (every row has a token and
    its sinks): their sparse cache selected from the cache and the ``C`` oldest buffer tokens (which left the window
    since the last boundary: :func:`_select_at_boundary`, without a feature map), their boundary moved to ``x``; what
    :func:`decode_step` does before its query, so that the step stays on the exact record."""
    x, size, w, current = state.seen, state.chunk_size, state.window, state.current
    crossing = ((x - state.row_start) % size == 0) & (x > current.boundary)
    dtype = state.buffer_key.dtype

    def tokens(start: int, length: int):  # as decode_step's, over the buffer (which ends at x - 1)
        return _tokens_at(state.buffer_key, state.buffer_value, state.buffer_keep, state.buffer_start, start, length)

    cache, (sums, tail_max) = _select_at_boundary(current, (current.tail_sums.to(dtype), current.tail_max), crossing,
                                                  tokens, None, 1.0, x, size, w, state.sparse_cache, eps,
                                                  selection_query, span)
    return state._replace(current=cache._replace(boundary=torch.where(crossing, x, current.boundary), tail_sums=sums,
                                                 tail_max=tail_max), exact_keys=None)


def decode_step(query, key, value, feature_map, *, state, softmax_weight, key_padding_mask, scaling, eps, tail_cap=0,
                tail_gate=None, by_attention=False, span=1):
    """Outputs ``[B, H, 1, dv]`` of one new token per row and the state after it (arguments as
    :func:`~.window_attention.window_linear_attention`, already validated; ``state`` passes
    :func:`can_decode_step`)."""
    batch, heads, _, head_dim = query.shape
    kv_heads, value_dim = key.shape[1], value.shape[-1]
    groups = heads // kv_heads
    size, w, capacity, sinks = state.chunk_size, state.window, state.sparse_cache, state.sinks
    scaling = head_dim**-0.5 if scaling is None else float(scaling)
    root = scaling**0.5
    dtype = compute_dtype_for(query)
    device = query.device
    x = state.seen
    with _no_autocast(device.type):
        gamma = None if softmax_weight is None else softmax_weight.to(dtype)
        unpadded = (torch.ones(batch, 1, dtype=torch.bool, device=device) if key_padding_mask is None
                    else key_padding_mask)
        sink_key, sink_value, sink_position, sink_valid, is_sink = row_sinks(key, value, unpadded, sinks, state, x)
        local_key = torch.cat([state.buffer_key.to(key.dtype), key], dim=2)
        local_value = torch.cat([state.buffer_value.to(value.dtype), value], dim=2)
        local_keep = torch.cat([state.buffer_keep, unpadded & ~is_sink], dim=1)
        local_start = state.buffer_start
        fresh = (state.row_start < 0) & unpadded[:, 0]
        row_start = torch.where(fresh, x, state.row_start)
        known = row_start >= 0
        current = state.current
        crossing = known & ((x - row_start) % size == 0) & (fresh | (x > current.boundary))
        current_sums = (current.tail_sums.to(dtype), current.tail_max)

        def tokens(start: int, length: int):
            return _tokens_at(local_key.to(dtype), local_value.to(dtype), local_keep, local_start, start, length)

        cache = current
        # (Known row starts tell on the host whether any row may cross a boundary: no device read between them.)
        starts = None if state.host is None else state.host.row_starts
        may_cross = starts is None or any((x - start) % size == 0 for start in starts)
        if may_cross and bool(crossing.any()):
            cache, current_sums = _select_at_boundary(
                current, current_sums, crossing, tokens, feature_map, root, x, size, w, capacity, eps,
                _selection_query(query.to(dtype), kv_heads, scaling) if by_attention else None, span)
        # Without a cache the tokens that left the window since the boundary are in the tail (the state keeps the last
        # query's tail sums); with one they wait exactly for the next selection, in the band.
        query_tail = None if capacity else _query_tail(state, current, crossing, known, tokens, feature_map, root, x,
                                                       w, current_sums, may_cross)
        boundary = torch.where(crossing, x, current.boundary)

        # Exact keys: sinks, cache, the last w tokens (with a cache, every token after the boundary's window edge),
        # in one score tensor.
        query_rows = query.to(dtype).view(batch, kv_heads, groups, head_dim)
        exact_keys, exact_values, exact_valid = [], [], []  # [B, Hkv, n, d], [B, Hkv, n, dv], [B, 1 or Hkv, n]
        if sinks:
            exact_keys.append(sink_key), exact_values.append(sink_value), exact_valid.append(sink_valid[:, None])
        if capacity:
            exact_keys.append(cache.cache_key), exact_values.append(cache.cache_value)
            exact_valid.append(cache.cache_valid)
        span = w if not capacity else w + size - 1
        if span:
            begin = x - span + 1 - local_start
            band_keep = rows_window(local_keep, begin, span, 1, fill=False)
            if capacity:
                band_keep = band_keep & (x - span + 1 + torch.arange(span, device=device) > boundary[:, None] - w)
            exact_keys.append(rows_window(local_key, begin, span, 2))
            exact_values.append(rows_window(local_value, begin, span, 2))
            exact_valid.append(band_keep[:, None])
        scores = exact_value_ones = None
        if exact_keys:
            keys = torch.cat([t.to(dtype) for t in exact_keys], dim=2)
            exact_value_ones = _with_ones_column(torch.cat([t.to(dtype) for t in exact_values], dim=2))
            valid = torch.cat([t.expand(batch, kv_heads, -1) for t in exact_valid], dim=-1)
            scores = torch.matmul(query_rows * scaling, keys.transpose(-1, -2))
            scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
        exact, row_max = exact_terms(scores, exact_value_ones, gamma, query_rows[..., 0], value_dim)
        if gamma is not None:
            exact = exact * gamma.view(kv_heads, groups, 1)
        tail = log_factor = None
        if feature_map is not None:
            q_features = feature_map.query_features(query.to(dtype) * root)
            sums, tail_max = current_sums if query_tail is None else query_tail
            tail = torch.matmul(q_features.values.view(batch, kv_heads, groups, -1), sums)
            if q_features.log_scale is not None:
                log_factor = q_features.log_scale.view(batch, kv_heads, groups) + tail_max[..., None]
            if tail_cap or tail_gate is not None:  # the tail's edge: x - w, or with a sparse cache the boundary's
                edge = (boundary if capacity else torch.full_like(boundary, x)) - w
                tokens_in_tail = tail_tokens(eligible_up_to(local_keep, local_start, state.kept_before_buffer, edge),
                                             capacity)
                weight = tail_log_weights(tokens_in_tail[:, None, None], tail_cap,
                                          None if tail_gate is None else tail_gate.view(1, kv_heads, groups), dtype)
                log_factor = weight if log_factor is None else log_factor + weight
        total = combine(exact, row_max, tail, log_factor, calibrated=gamma is None)
        out = (total[..., :-1] / _safe_denominator(total[..., -1:], eps)).reshape(batch, heads, 1, value_dim)

        new_current = cache._replace(boundary=boundary, tail_sums=current_sums[0], tail_max=current_sums[1])
        buffer_key, buffer_value, buffer_keep = last_tokens(local_key, local_value, local_keep,
                                                            buffer_capacity(w, size, 0))
        new_state = state._replace(
            sink_key=sink_key, sink_value=sink_value, sink_position=sink_position, sink_valid=sink_valid,
            buffer_key=buffer_key, buffer_value=buffer_value, buffer_keep=buffer_keep,
            row_start=row_start, kept_tokens=state.kept_tokens + local_keep[:, -1].long(), current=new_current,
            query_tail=query_tail, seen=x + 1, exact_keys=None)
    return out.to(value.dtype), new_state.with_host_facts()


def _tokens_at(key, value, keep, first: int, start: int, length: int):
    """Positions ``start .. start + length - 1`` of tokens ``key`` / ``value`` ``[B, Hkv, n, .]`` and ``keep``
    ``[B, n]`` whose first is at position ``first``: keys, values with a ones column (zero where not kept) and keep
    (``False`` outside)."""
    begin = start - first
    kept = rows_window(keep, begin, length, 1, fill=False)
    values = _with_ones_column(rows_window(value, begin, length, 2))
    return rows_window(key, begin, length, 2), values.masked_fill(~kept[:, None, :, None], 0.0), kept


def _select_at_boundary(current, current_sums, crossing, tokens, feature_map, root, x, size, w, capacity, eps,
                        selection_query=None, span=1):
    """The cache and tail sums of the rows at a boundary ``x`` (``crossing`` ``[B]``) after its selection; the other
    rows keep theirs. Candidates: the cache slots and the tokens ``x - C - w < j <= x - w`` of the buffer;
    ``selection_query`` ``[B, Hkv, g, d]`` (scaled): select by its attention instead of the recall error; ``span``:
    each score averaged over that many candidates first."""
    batch, kv_heads = current.cache_valid.shape[:2]
    tile_key, tile_value_ones, tile_keep = tokens(x - size - w + 1, size)
    tile_features = tail_key_features(feature_map, tile_key, root)
    keep = tile_keep[:, None].expand(-1, kv_heads, -1)
    if capacity == 0:
        new_sums = fold_into(current_sums, *tile_features, tile_value_ones, keep)
        cache = current
    else:
        cache_features = tail_key_features(feature_map, current.cache_key.to(tile_key.dtype), root)
        features = torch.cat([cache_features.values, tile_features.values], dim=2)
        log_scale = (None if tile_features.log_scale is None
                     else torch.cat([cache_features.log_scale, tile_features.log_scale], dim=2))
        value_ones = torch.cat([_with_ones_column(current.cache_value.to(tile_key.dtype)), tile_value_ones], dim=2)
        valid = torch.cat([current.cache_valid, keep], dim=-1)
        keys = torch.cat([current.cache_key.to(tile_key.dtype), tile_key], dim=2)
        scores = None if selection_query is None else attention_scores(selection_query.to(keys.dtype), keys, valid,
                                                                       1.0)
        new_sums, kept, kept_valid = select_hard_keys(current_sums, features, log_scale, value_ones, valid, capacity,
                                                      eps, scores, span)
        positions = torch.cat([current.cache_position,
                               (x - size - w + 1 + torch.arange(size, device=keys.device)).expand(batch, kv_heads, -1)],
                              dim=-1)
        picked = lambda t: t.gather(2, kept[..., None].expand(kept.shape + t.shape[-1:]))  # noqa: E731
        selected = CommittedTail(current.boundary, picked(keys).to(current.cache_key.dtype),
                                 picked(value_ones)[..., :-1].to(current.cache_value.dtype).contiguous(),
                                 positions.gather(-1, kept), kept_valid, *new_sums)
        cache = selected.select_rows(crossing, current)
    rows = crossing.view(-1, 1, 1, 1)
    return cache, (torch.where(rows, new_sums[0], current_sums[0]), torch.where(crossing[:, None], new_sums[1],
                                                                                current_sums[1]))


def _query_tail(state, current, crossing, known, tokens, feature_map, root, x, w, current_sums, may_cross=True):
    """The tail sums of query ``x`` without a sparse cache: the committed tail at a boundary (or before the row's first
    token), else the last query's plus token ``x - w``. ``may_cross`` ``False``: the host knows that every row has a
    token (``known``) and none is at a boundary (``crossing``): no device read."""
    key, value_ones, keep = tokens(x - w, 1)
    keep = keep & (x > current.boundary)[:, None]
    last_sums, last_max = state.query_tail
    tail = fold_into((last_sums.to(value_ones.dtype), last_max), *tail_key_features(feature_map, key, root), value_ones,
                     keep[:, None].expand(-1, key.shape[1], -1))
    rows = crossing | ~known
    if not may_cross or not bool(rows.any()):
        return tail
    return (torch.where(rows.view(-1, 1, 1, 1), current_sums[0], tail[0]),
            torch.where(rows[:, None], current_sums[1], tail[1]))
