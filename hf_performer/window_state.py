"""The decoding state of causal window attention: sink slots, a buffer of recent tokens, the committed tail.

A causal window layer (:mod:`.window_attention`) needs, for the next query, each row's sinks, the keys of its window,
the tokens that left the window since its last boundary (the *pending* tokens, in its tail until the next boundary),
its sparse cache of hard keys and the tail sums of every other older token (:mod:`.window_sparse_cache`). So the
state holds, per row:

* the sink slots (its first ``sinks`` unpadded tokens, with their positions);
* a buffer of the last tokens' keys and values (:func:`buffer_capacity` of them, empty ones first while fewer were
  seen), reaching ``w - 1`` tokens before the oldest boundary it may return to (the checkpoint's, or the current
  one's): the window, the pending tokens, and what a rollback replays;
* the *current* :class:`CommittedTail` (sparse cache and tail sums at the boundary of the last query) and, without
  a sparse cache, the last query's whole tail sums (the committed ones plus the pending tokens), which the next
  decoding step extends by one token;
* with ``max_rollback > 0``, a *checkpoint* :class:`CommittedTail` at a boundary old enough that dropping the last
  ``max_rollback`` tokens never goes before it: :meth:`WindowAttentionState.rollback` returns to it and the next
  call replays the selection over the buffered tokens.

Its size depends on ``window``, ``sinks``, the cache ``G``, ``chunk_size`` and ``max_rollback``, not on the tokens
seen. Features are never stored: the next call recomputes those of the few buffered tokens it needs.

This module imports only ``torch``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


EXACT_HEADROOM = 32
"""Buffer slots an :class:`ExactKeys` record keeps free after its newest token: that many decoding steps write their
key and value in place before the record is packed again (one copy of the exact keys)."""


def window_state_bytes(kv_heads: int, head_dim: int, nb_features: int, window: int, sinks: int, dtype_bytes: int,
                       sparse_cache: int = 0, chunk_size: int = 64, max_rollback: int = 0,
                       linear_tail: bool = True) -> int:
    """Bytes of one window layer's decoding state (``WindowCacheLayer``) per sequence once the context is longer
    than its buffer and has filled its sparse cache (the most it holds): the sink slots (keys, values, positions,
    flags), the buffer of the last ``window - 1 + chunk_size + max_rollback`` keys and values (the selection runs at
    chunk boundaries), and per committed tail (the current one, and a rollback checkpoint when ``max_rollback > 0``)
    the sparse cache's ``G`` keys, values, positions and flags and the float32 tail sums, plus the last query's tail
    sums without a sparse cache, and two counters (the row's start and its kept tokens); without a tail but with a
    sparse cache, the free slots and masks of the :class:`ExactKeys` record it decodes from (:data:`EXACT_HEADROOM`)."""
    sink_slots = sinks * (2 * kv_heads * head_dim * dtype_bytes + 8 + 1)
    buffer = max(window - 1, 0) + chunk_size + max_rollback
    buffer_bytes = buffer * (2 * kv_heads * head_dim * dtype_bytes + 1)
    features = nb_features if linear_tail else 1  # without a tail the sums keep one empty feature
    sums = kv_heads * (features * (head_dim + 1) + 1) * 4
    committed = 8 + sparse_cache * kv_heads * (2 * head_dim * dtype_bytes + 8 + 1) + sums
    query_tail = sums if sparse_cache == 0 else 0  # with a sparse cache the pending tokens stay exact, in the buffer
    tails = committed * (2 if max_rollback > 0 else 1) + query_tail
    exact_keys = 0  # between two boundaries a layer without a tail decodes from an ExactKeys record
    if not linear_tail and sparse_cache and max_rollback == 0:
        exact_keys = EXACT_HEADROOM * 2 * kv_heads * head_dim * dtype_bytes + 1 + \
            kv_heads * (sinks + sparse_cache + buffer + EXACT_HEADROOM) * dtype_bytes
    return sink_slots + buffer_bytes + 16 + tails + exact_keys



class CommittedTail(NamedTuple):
    """The sparse cache and the tail sums of each row at one of its boundaries.

    Attributes:
        boundary: ``[B]`` long, the boundary's absolute position per row.
        cache_key: ``[B, Hkv, G, d]``, ``cache_value`` ``[B, Hkv, G, dv]``: the kept tokens (input dtype).
        cache_position: ``[B, Hkv, G]`` long, their absolute positions; ``cache_valid`` ``[B, Hkv, G]`` bool.
        tail_sums: ``[B, Hkv, m, dv + 1]`` ``sum_j values_j exp(lk_j - K) [v_j, 1]`` over the folded tokens
            (compute dtype), ``tail_max`` ``[B, Hkv]`` their stabiliser ``K``.
    """

    boundary: torch.Tensor
    cache_key: torch.Tensor
    cache_value: torch.Tensor
    cache_position: torch.Tensor
    cache_valid: torch.Tensor
    tail_sums: torch.Tensor
    tail_max: torch.Tensor

    def map_batch(self, fn) -> "CommittedTail":
        return CommittedTail(*(fn(t) for t in self))

    def select_rows(self, rows: torch.Tensor, other: "CommittedTail") -> "CommittedTail":
        """This tail where ``rows`` ``[B]`` (bool) is True, ``other`` elsewhere."""
        return CommittedTail(*(torch.where(rows.view((-1,) + (1,) * (mine.dim() - 1)), mine, theirs)
                               for mine, theirs in zip(self, other)))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)


class ExactKeys(NamedTuple):
    """A state's exact keys side by side, for the decoding steps of a layer without a linear tail
    (:func:`~.window_decode.exact_decode_step`), whose output is softmax attention over them.

    Attributes:
        key: ``[B, Hkv, F + b + E, d]``, ``value`` ``[B, Hkv, F + b + E, dv]``: the sink slots and the sparse cache
            (``F = sinks + G``, or fewer cache slots while no row and head holds ``G``: the held ones first, a copy),
            then the buffer region: slots ``start .. start + b - 1`` of it are the state's buffer
            (the state's tensors are views of these), the slots before them tokens that left it, the ones after free
            (``E`` = :data:`EXACT_HEADROOM` at packing).
        fixed: ``F``, the sinks and the cache slots kept here.
        mask: ``[B, Hkv, 1, F + b + E]`` the additive mask of every slot (0 seen, ``-inf`` not: sinks and cache
            slots no row holds, padding, tokens that left the buffer; free slots 0 until written).
        start: where the state's buffer starts in the buffer region; ``written`` ``[n]``: the buffer region's slots
            written so far, shared by the states of this record (only the newest may write the next slot).
        last_query: the last position before a row's next boundary (where a selection changes the cache).
        parts: the state tensors these stand for (:meth:`parts_of`): a state holding others (replaced since) packs a
            new record.
        ones: ``[B, 1]`` True: a new unpadded token's flag.
    """

    key: torch.Tensor
    value: torch.Tensor
    fixed: int
    mask: torch.Tensor
    start: int
    written: list
    last_query: int
    parts: tuple
    ones: torch.Tensor

    @staticmethod
    def parts_of(state) -> tuple:
        """The tensors of ``state`` a record stands for (:data:`_EXACT_PARTS`)."""
        return tuple(getattr(state, name) for name in _EXACT_PARTS)

    def stands_for(self, state) -> bool:
        """Whether ``state`` holds the tensors this record was made for (a state replaced since packs a new one)."""
        return all(getattr(state, name) is part for name, part in zip(_EXACT_PARTS, self.parts))

    def nbytes(self) -> int:
        """Bytes of the record beyond the state's own views: the free and left slots, the masks."""
        tensors = (self.key, self.value, self.mask, self.ones)
        total = sum(t.numel() * t.element_size() for t in tensors)
        storages = {self.key.untyped_storage().data_ptr(), self.value.untyped_storage().data_ptr()}
        parts = dict(zip(_EXACT_PARTS, self.parts))
        views = [parts[name] for name in ("sink_key", "sink_value", "buffer_key", "buffer_value")] + \
            [parts["current"].cache_key, parts["current"].cache_value]
        return total - sum(t.numel() * t.element_size() for t in views if t.untyped_storage().data_ptr() in storages)


_EXACT_PARTS = ("buffer_key", "current", "sink_key", "sink_value", "buffer_value", "buffer_keep", "sink_valid",
                "row_start")
"""The fields of a :class:`WindowAttentionState` an :class:`ExactKeys` record stands for (the ones a step replaces
first, first)."""


FLOAT_FIELDS = ("cache_key", "cache_value", "tail_sums")
"""The differentiable tensors of a :class:`CommittedTail` (``tail_max`` is a detached stabiliser)."""


class HostFacts(NamedTuple):
    """What a decoding step would otherwise read back from the device each token, kept as Python values."""

    sinks_filled: bool  # every row's sink slots hold a token
    row_starts: tuple | None  # each row's first unpadded position; None while a row has no token


class WindowAttentionState(NamedTuple):
    """State of causal window attention after ``seen`` tokens (module docstring): constant size.

    Attributes:
        sink_key: ``[B, Hkv, sinks, d]``, ``sink_value`` ``[B, Hkv, sinks, dv]``: slot ``t`` holds the row's
            ``t``-th unpadded token; ``sink_position`` ``[B, sinks]`` long; ``sink_valid`` ``[B, sinks]`` bool (the
            filled slots, a prefix).
        buffer_key: ``[B, Hkv, b, d]``, ``buffer_value``, ``buffer_keep`` ``[B, b]`` (``False`` for padding and the
            rows' sinks): the tokens at positions ``[seen - b, seen)``.
        row_start: ``[B]`` long, the position of the row's first unpadded token (its boundaries are
            ``row_start + k chunk_size``), ``-1`` while the row has none.
        kept_tokens: ``[B]`` long, the row's tokens seen that are neither padding nor sinks (a bounded tail counts
            its tokens from it: :mod:`.window_tail_cap`).
        current: the :class:`CommittedTail` at the boundary of the last query, or ``None`` after a rollback (the next
            call rebuilds it from ``checkpoint``).
        query_tail: ``(sums, K)`` the tail sums of the last query without a sparse cache: ``current``'s plus the
            pending tokens (those that left the window after its boundary, up to position ``seen - 1 - window``);
            ``None`` with a sparse cache and after a rollback (a decoding step then takes the block path).
        checkpoint: a :class:`CommittedTail` at an older boundary that rollbacks return to, or ``None`` when
            ``max_rollback == 0`` (then ``current`` is the only one).
        seen: tokens seen (padding included); window, sinks, sparse_cache (``G``), chunk_size, max_rollback: the
            settings the state was built with.
        host: the :class:`HostFacts` of the state, or ``None`` (a rollback or a batch change drops them).
        exact_keys: the :class:`ExactKeys` of a layer without a tail between two boundaries while decoding, or
            ``None`` (rebuilt on demand).
    """

    sink_key: torch.Tensor
    sink_value: torch.Tensor
    sink_position: torch.Tensor
    sink_valid: torch.Tensor
    buffer_key: torch.Tensor
    buffer_value: torch.Tensor
    buffer_keep: torch.Tensor
    row_start: torch.Tensor
    kept_tokens: torch.Tensor
    current: CommittedTail | None
    query_tail: tuple | None
    checkpoint: CommittedTail | None
    seen: int
    window: int
    sinks: int
    sparse_cache: int
    chunk_size: int
    max_rollback: int
    exact_keys: ExactKeys | None = None
    host: HostFacts | None = None

    def sinks_filled(self) -> bool:
        """Whether every row's sink slots hold a token (from :attr:`host` once it says so: no device read)."""
        return (self.host is not None and self.host.sinks_filled) or bool(self.sink_valid.all())

    def with_host_facts(self) -> "WindowAttentionState":
        """This state with :attr:`host` filled in: read once from the device (two reads), then carried by the decoding
        steps, which then need no device read between boundaries."""
        if self.host is not None and self.host.sinks_filled and self.host.row_starts is not None:
            return self
        starts = self.row_start.tolist()
        return self._replace(host=HostFacts(bool(self.sink_valid.all()), tuple(starts) if min(starts) >= 0 else None))

    @property
    def buffer_start(self) -> int:
        """Absolute position of the first buffered token."""
        return self.seen - self.buffer_key.shape[2]

    @property
    def kept_before_buffer(self) -> torch.Tensor:
        """``[B]`` the row's kept tokens (neither padding nor sinks) before the first buffered one."""
        return self.kept_tokens - self.buffer_keep.sum(-1)

    @property
    def oldest(self) -> CommittedTail:
        """The tail a rollback can return to: the checkpoint, else the current one."""
        return self.current if self.checkpoint is None else self.checkpoint

    def rollback_capacity(self) -> int:
        """How many of the last tokens :meth:`rollback` can drop exactly (at least ``max_rollback``).

        After dropping ``r`` tokens the last remaining query ``seen - r - 1`` must not be before the boundary of
        :attr:`oldest` in any row that has one."""
        known = self.row_start >= 0
        if not bool(known.any()):
            return self.seen
        return int((self.seen - 1 - self.oldest.boundary[known]).min().clamp_min(0))

    def rollback(self, tokens: int) -> "WindowAttentionState":
        """The state without the last ``tokens`` tokens (assisted / speculative decoding): back to :attr:`oldest`,
        the buffer and the sink slots cut; the next call replays the selection from there."""
        capacity = self.rollback_capacity()
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= capacity:
            raise ValueError(
                f"window attention state: can drop between 0 and {capacity} of its last tokens exactly (window "
                f"{self.window}, chunk_size {self.chunk_size}, max_rollback {self.max_rollback}, {self.seen} seen); "
                f"got {tokens!r}"
            )
        if tokens == 0:
            return self
        seen = self.seen - tokens
        buffer = self.buffer_key.shape[2] - tokens
        # (A row keeps at least the query at its first boundary, its first unpadded token: it stays known.)
        return self._replace(
            sink_valid=self.sink_valid & (self.sink_position < seen), buffer_key=self.buffer_key[:, :, :buffer],
            buffer_value=self.buffer_value[:, :, :buffer], buffer_keep=self.buffer_keep[:, :buffer],
            kept_tokens=self.kept_tokens - self.buffer_keep[:, buffer:].sum(-1), current=None, query_tail=None,
            checkpoint=self.oldest, seen=seen, exact_keys=None, host=None,
        )

    def map_batch(self, fn) -> "WindowAttentionState":
        """Apply ``fn`` to every tensor (all have the batch first): select / repeat / move rows."""
        tensors = {name: fn(getattr(self, name)) for name in _ROW_TENSORS}
        query_tail = None if self.query_tail is None else tuple(fn(t) for t in self.query_tail)
        return self._replace(
            current=None if self.current is None else self.current.map_batch(fn), query_tail=query_tail,
            checkpoint=None if self.checkpoint is None else self.checkpoint.map_batch(fn), exact_keys=None, host=None,
            **tensors)

    def nbytes(self) -> int:
        """Bytes held by the tensors (bounded by the settings, not by ``seen``)."""
        total = sum(getattr(self, name).numel() * getattr(self, name).element_size() for name in _ROW_TENSORS)
        for tail in (self.current, self.checkpoint):
            total += 0 if tail is None else tail.nbytes()
        if self.query_tail is not None:
            total += sum(t.numel() * t.element_size() for t in self.query_tail)
        if self.exact_keys is not None:
            total += self.exact_keys.nbytes()
        return total


_ROW_TENSORS = ("sink_key", "sink_value", "sink_position", "sink_valid", "buffer_key", "buffer_value", "buffer_keep",
                "row_start", "kept_tokens")
_STATE_FLOATS = ("sink_key", "sink_value", "buffer_key", "buffer_value")


def buffer_capacity(window: int, chunk_size: int, max_rollback: int) -> int:
    """Tokens a state's buffer holds: everything after the oldest boundary it may return to, ``w - 1`` tokens before
    it (the next queries' windows and tiles start there) and up to ``chunk_size - 1 + max_rollback`` after it."""
    return max(window - 1, 0) + chunk_size + max_rollback


def last_tokens(key, value, keep, capacity: int):
    """The last ``capacity`` tokens of ``key`` / ``value`` ``[B, Hkv, n, .]`` and ``keep`` ``[B, n]`` (copies), with
    empty (not kept) tokens before them when there are fewer: a buffer of constant size."""
    missing = capacity - key.shape[2]
    if missing <= 0:
        return key[:, :, -capacity:].clone(), value[:, :, -capacity:].clone(), keep[:, -capacity:].clone()
    pad = lambda t, dim: torch.cat([t.new_zeros(t.shape[:dim] + (missing,) + t.shape[dim + 1:]), t], dim=dim)  # noqa
    return pad(key, 2), pad(value, 2), pad(keep, 1)


def state_tensors(state: WindowAttentionState) -> list:
    """The floating-point tensors of ``state`` that gradients flow through, in a fixed order (``None`` for an absent
    part): the sink slots, the buffer, the current and checkpoint tails' cache keys / values and sums, the last
    query's tail sums."""
    tensors = [getattr(state, name) for name in _STATE_FLOATS]
    for tail in (state.current, state.checkpoint):
        tensors += [None] * len(FLOAT_FIELDS) if tail is None else [getattr(tail, name) for name in FLOAT_FIELDS]
    tensors.append(None if state.query_tail is None else state.query_tail[0])
    return tensors


def with_state_tensors(state: WindowAttentionState, tensors) -> WindowAttentionState:
    """``state`` with the tensors of :func:`state_tensors` replaced by ``tensors`` (same order)."""
    tensors = list(tensors)
    named = {name: tensors.pop(0) for name in _STATE_FLOATS}
    tails = []
    for tail in (state.current, state.checkpoint):
        replaced = [tensors.pop(0) for _ in FLOAT_FIELDS]
        tails.append(None if tail is None else tail._replace(**dict(zip(FLOAT_FIELDS, replaced))))
    query_tail_sums = tensors.pop(0)
    query_tail = None if state.query_tail is None else (query_tail_sums, state.query_tail[1])
    return state._replace(current=tails[0], checkpoint=tails[1], query_tail=query_tail, exact_keys=None, **named)


class KeyCopies(NamedTuple):
    """Where the copies of keys and values a :class:`WindowAttentionState` holds sit in one call's own keys and values
    (:func:`without_key_copies`): ``buffer`` the index of the buffer's first token, ``caches`` per committed tail
    (``current``, ``checkpoint``) the ``[B, Hkv, G]`` indices of its cache slots; ``None`` for a part kept as is."""

    buffer: int | None
    caches: tuple


def without_key_copies(state: WindowAttentionState, key: torch.Tensor, value: torch.Tensor, first: int):
    """``(state', copies)``: ``state`` without the buffer's and the sparse caches' keys and values (``None`` in their
    place) where they are tokens of ``key`` / ``value`` ``[B, Hkv, L, .]`` (positions ``first .. first + L - 1``,
    the same dtype), and :class:`KeyCopies` saying where; :func:`with_key_copies` puts them back. What a long call
    keeps of the states between its segments then grows by their indices, not by ``(b + G)`` keys and values per key
    head. A buffer is the last ``b`` tokens as given, a cache slot the token at its position (both copies, never
    transformed): a buffer reaching before ``first`` (padding zeros, an earlier call's tokens) and a cache with an
    empty slot or an earlier call's token stay as they are."""
    length = key.shape[2]
    same_dtype = state.buffer_key.dtype == key.dtype and state.buffer_value.dtype == value.dtype
    buffer = state.buffer_start - first
    if same_dtype and 0 <= buffer and buffer + state.buffer_key.shape[2] <= length:
        state = state._replace(buffer_key=None, buffer_value=None)
    else:
        buffer = None
    tails, caches = [], []
    for tail in (state.current, state.checkpoint):
        index = None
        if tail is not None and tail.cache_key.shape[2] and tail.cache_key.dtype == key.dtype and \
                tail.cache_value.dtype == value.dtype:
            index = tail.cache_position - first
            if bool((tail.cache_valid & (index >= 0) & (index < length)).all()):
                tail = tail._replace(cache_key=None, cache_value=None)
            else:
                index = None
        tails.append(tail)
        caches.append(index)
    return state._replace(current=tails[0], checkpoint=tails[1]), KeyCopies(buffer, tuple(caches))


def with_key_copies(state: WindowAttentionState, copies: KeyCopies, key: torch.Tensor, value: torch.Tensor):
    """The state :func:`without_key_copies` was given (the same tensors' values), from ``key`` / ``value``."""
    if copies.buffer is not None:
        size = state.buffer_keep.shape[1]
        state = state._replace(buffer_key=key.narrow(2, copies.buffer, size),
                               buffer_value=value.narrow(2, copies.buffer, size))
    tails = [tail if index is None else tail._replace(cache_key=_take(key, index), cache_value=_take(value, index))
             for tail, index in zip((state.current, state.checkpoint), copies.caches)]
    return state._replace(current=tails[0], checkpoint=tails[1])


def _take(tensor, index):
    """``tensor`` ``[B, Hkv, L, .]`` at ``index`` ``[B, Hkv, n]``: ``[B, Hkv, n, .]``."""
    return tensor.gather(2, index[..., None].expand(index.shape + tensor.shape[-1:]))


def row_sinks(key, value, keep, sinks, initial_state, seen):
    """Each row's sinks after the new tokens: its first ``sinks`` unpadded tokens, stored or new.

    Args:
        key: ``[B, Hkv, L, d]``, value ``[B, Hkv, L, dv]``, keep ``[B, L]``: the new tokens (positions
            ``seen..seen+L-1``; ``keep`` = unpadded).
        initial_state: the :class:`WindowAttentionState` before them, or ``None``.

    Returns:
        ``(sink_key [B, Hkv, sinks, d], sink_value [B, Hkv, sinks, dv], sink_position [B, sinks] long,
        sink_valid [B, sinks] bool, is_sink [B, L] bool)``: the slots (gathered, so gradients reach the new keys)
        and which new tokens are sinks.
    """
    batch, kv_heads, length, _ = key.shape
    if initial_state is not None and initial_state.sinks_filled():  # every slot taken: no new sink
        return (initial_state.sink_key.to(key.dtype), initial_state.sink_value.to(value.dtype),
                initial_state.sink_position, initial_state.sink_valid, torch.zeros_like(keep))
    positions = torch.arange(seen, seen + length, device=key.device)
    if initial_state is None:
        stored_key, stored_value = key[:, :, :0], value[:, :, :0]
        stored_position = positions.new_zeros(batch, 0)
        filled = positions.new_zeros(batch)
    else:
        stored_key = initial_state.sink_key.to(key.dtype)
        stored_value = initial_state.sink_value.to(value.dtype)
        stored_position = initial_state.sink_position
        filled = initial_state.sink_valid.sum(-1)
    stored = stored_key.shape[2]  # `sinks` slots in a state, none before it
    rank = filled[:, None] + keep.long().cumsum(-1)  # 1-based count of the row's unpadded tokens so far
    is_sink = keep & (rank <= sinks)
    # Slot t takes candidate index[t] among [stored slots, new tokens]: a stored slot keeps its token, the new
    # sink of rank r fills slot r - 1 (non-sinks go to a discarded extra column).
    index = torch.arange(sinks, device=key.device).clamp_max(max(stored - 1, 0)).repeat(batch, 1)
    index = torch.cat([index, index.new_zeros(batch, 1)], dim=1)
    index = index.scatter(1, torch.where(is_sink, rank - 1, sinks), (stored + torch.arange(length, device=key.device))
                          .repeat(batch, 1))[:, :sinks]
    sink_valid = torch.arange(sinks, device=key.device)[None, :] < (filled + keep.sum(-1))[:, None]

    def gather(stored_tensor, new_tensor):
        # Without stored slots, gather from the input itself: autograd then saves no copy of the sequence.
        candidates = torch.cat([stored_tensor, new_tensor], dim=2) if stored else new_tensor
        return candidates.gather(2, index[:, None, :, None].expand(batch, kv_heads, sinks, candidates.shape[-1]))

    sink_position = torch.cat([stored_position, positions.repeat(batch, 1)], dim=1).gather(1, index)
    return gather(stored_key, key), gather(stored_value, value), sink_position, sink_valid, is_sink
