"""The operands of the window blocks' attention (:class:`BlockOperands`, :class:`BlockSpec`) and their layout: blocks
of ``C`` queries against overlapping key tiles, the ``g`` query heads of a key head stacked in a block's rows,
groups of blocks, and how a group's gradients land in the whole operands'; and the reuse of block outputs that a
memory-bounded recomputation takes back instead of computing them again (:func:`reused_outputs`).
:mod:`.window_blocks` computes the attention, :mod:`.window_exact_blocks` its exact-only twin.

This module imports only ``torch`` and its sibling ``linear_attention_parallel``.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import torch

from .linear_attention_parallel import attention_path

GROUP_ROWS = 8192
"""Query rows (examples x key heads x blocks x g C) processed together: the temporaries of a group are a few
``[rows, C + w + G + sinks]`` tensors (8192 rows, window 64: about 5 MiB each)."""

PARALLEL_GROUP_ROWS = 1 << 18
"""The same on the parallel path (CUDA, :func:`~.linear_attention_parallel.attention_path`): one group up to 16k tokens
of 12 heads (a few ``[262144, C + w + G + sinks]`` temporaries, ~100 MiB each with window 64), so that a call is a
fixed number of kernel launches."""

_REUSE = contextvars.ContextVar("window_blocks_reuse", default=None)


@contextlib.contextmanager
def reused_outputs(store: list, record: bool):
    """Within this context, :func:`attend_blocks` appends its outputs and denominators to ``store`` (``record``),
    or takes them from ``store`` instead of computing them (first in, first out; computed again once ``store`` is
    empty, as in a second backward); so does the causal operator with the sparse-cache selection of a layer without a
    tail (``kind="selection"``). A memory-bounded caller that recomputes a piece of its forward to backpropagate
    through it (:mod:`.window_segments`) records the piece's block outputs once and reuses them there: the
    recomputation then costs only the operands' graph."""
    token = _REUSE.set((store, record))
    try:
        yield
    finally:
        _REUSE.reset(token)


def block_layout(operands: BlockOperands, spec: BlockSpec) -> tuple[int, int, tuple]:
    """``(blocks, blocks per group, output shape [B, Hkv, n, g C, dv])`` of a call: a group's temporaries stay near
    :data:`GROUP_ROWS` query rows."""
    kv_heads = operands.keys.shape[1]
    blocks = operands.query.shape[2] // spec.size
    rows = operands.query.shape[0] * kv_heads * spec.groups * spec.size
    budget = PARALLEL_GROUP_ROWS if attention_path(operands.query) == "parallel" else GROUP_ROWS
    expected = operands.query.shape[:1] + (kv_heads, blocks, spec.groups * spec.size, operands.values.shape[-1])
    return blocks, max(1, budget // rows), expected


def take_reused(expected_shape: tuple, kind: str = "outputs") -> tuple | None:
    """The next recorded tensors of ``kind`` of a :func:`reused_outputs` context that reuses (``(out, per-row
    tensor)`` for ``"outputs"``), the first checked against ``expected_shape``; ``None`` when there is none (compute
    it)."""
    reuse = _REUSE.get()
    if reuse is None or reuse[1] or not reuse[0]:
        return None
    recorded_kind, recorded = reuse[0].pop(0)
    if recorded_kind != kind or tuple(recorded[0].shape) != tuple(expected_shape):
        raise RuntimeError(f"window attention: the reused {recorded_kind} are {tuple(recorded[0].shape)}, the call "
                           f"needs {kind} {tuple(expected_shape)} (the recomputation differs from the pass that "
                           "recorded them)")
    return recorded


def record_for_reuse(*tensors: torch.Tensor, kind: str = "outputs") -> None:
    """Record a call's tensors of ``kind`` (its outputs and per-row denominators or log-sum-exps) in a recording
    :func:`reused_outputs` context; nothing otherwise."""
    reuse = _REUSE.get()
    if reuse is not None and reuse[1]:
        reuse[0].append((kind, tensors))


class BlockOperands(NamedTuple):
    """The tensors of :func:`attend_blocks` for ``n`` query blocks of ``C`` rows per query head.

    Attributes:
        query: ``[B, H, n C, d]`` the blocks' queries (shifted frame; compute dtype).
        keys: ``[B, Hkv, n C + w - 1, d]`` and ``values`` ``[B, Hkv, n C + w - 1, dv]``: block ``j``'s tile is
            ``[j C, j C + C + w - 1)`` (its first ``C`` keys are the block's pending tokens).
        band_keep: ``[B, n, C + w - 1]`` bool, the tile keys that are tokens (unpadded, not sinks).
        sink_key: ``[B, Hkv, s, d]``, ``sink_value`` ``[B, Hkv, s, dv]``, ``sink_allowed`` ``[B, n, g C, s]`` bool.
        cache_key: ``[B, Hkv, n, G, d]``, ``cache_value`` ``[B, Hkv, n, G, dv]``, ``cache_valid`` ``[B, Hkv, n, G]``
            (``None`` without a sparse cache).
        tail_sums: ``[B, Hkv, n, m, dv + 1]`` each block's tail sums, ``tail_max`` ``[B, Hkv, n]`` their stabiliser
            (``None`` without a tail).
        tile_features: ``[B, Hkv, n, C, m]`` the pending tokens' feature values, ``tile_log_scale`` ``[B, Hkv, n, C]``
            or ``None``; ``None`` when the pending tokens are exact (sparse cache) or there is no tail.
        tile_keep: ``[B, n, C]`` bool, the pending tokens that are tokens.
        gamma: ``[H]`` (learned mode) or ``None`` (calibrated).
        tail_log_weight: ``[B, 1 or Hkv, n, g C]`` the log of each query's tail weight (the bounded tail and the
            learned gate of :mod:`.window_tail_cap`; differentiable), or ``None`` (weight 1).
    """

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    band_keep: torch.Tensor
    sink_key: torch.Tensor
    sink_value: torch.Tensor
    sink_allowed: torch.Tensor
    cache_key: torch.Tensor | None
    cache_value: torch.Tensor | None
    cache_valid: torch.Tensor | None
    tail_sums: torch.Tensor | None
    tail_max: torch.Tensor | None
    tile_features: torch.Tensor | None
    tile_log_scale: torch.Tensor | None
    tile_keep: torch.Tensor
    gamma: torch.Tensor | None
    tail_log_weight: torch.Tensor | None = None


class BlockSpec(NamedTuple):
    """The non-tensor settings of :func:`attend_blocks`: block size ``C``, window ``w``, ``groups`` (query heads per
    key head), the score scale, ``root`` = ``sqrt(scaling)`` (the feature map's input scale), the feature map
    (``None``: no tail), whether the band starts at the block's pending tokens (a sparse cache keeps them exact)
    and the denominator guard ``eps``."""

    size: int
    window: int
    groups: int
    scaling: float
    root: float
    feature_map: object
    pending_in_band: bool
    eps: float

    @property
    def span(self) -> int:
        return self.size + self.window - 1

    @property
    def has_band(self) -> bool:
        """Whether the blocks have band keys (a window, or the pending tokens kept exact by a sparse cache)."""
        return self.window > 0 or (self.pending_in_band and self.size > 1)

    def band_mask(self, device) -> torch.Tensor:
        """``[g C, span]``: row ``r`` (query ``r % C`` of the block) sees tile keys ``[r % C, r % C + w)`` (with the
        pending tokens in the band: ``[0, r % C + w)``)."""
        row = torch.arange(self.size, device=device).repeat(self.groups)[:, None]
        column = torch.arange(self.span, device=device)[None, :]
        return ((column >= 0) if self.pending_in_band else (column >= row)) & (column < row + self.window)

    def pending_mask(self, device) -> torch.Tensor:
        """``[g C, C]``: row ``r`` has the tile's first ``r % C`` keys in its tail (when they are not exact)."""
        row = torch.arange(self.size, device=device).repeat(self.groups)[:, None]
        return torch.arange(self.size, device=device)[None, :] < row


def _blocks_of(tensor, start, end, dim=2):
    return None if tensor is None else tensor.narrow(dim, start, end - start)


def _group(operands: BlockOperands, spec: BlockSpec, start: int, end: int) -> BlockOperands:
    """The operands of blocks ``[start, end)``."""
    size, overlap = spec.size, max(spec.window - 1, 0)
    return operands._replace(
        query=operands.query[:, :, start * size:end * size],
        keys=operands.keys[:, :, start * size:end * size + overlap],
        values=operands.values[:, :, start * size:end * size + overlap],
        band_keep=operands.band_keep[:, start:end], sink_allowed=operands.sink_allowed[:, start:end],
        cache_key=_blocks_of(operands.cache_key, start, end), cache_value=_blocks_of(operands.cache_value, start, end),
        cache_valid=_blocks_of(operands.cache_valid, start, end), tail_sums=_blocks_of(operands.tail_sums, start, end),
        tail_max=_blocks_of(operands.tail_max, start, end),
        tile_features=_blocks_of(operands.tile_features, start, end),
        tile_log_scale=_blocks_of(operands.tile_log_scale, start, end), tile_keep=operands.tile_keep[:, start:end],
        tail_log_weight=_blocks_of(operands.tail_log_weight, start, end))


def _per_block(x, kv_heads, groups, size):
    """``[B, H, n C, e] -> [B, Hkv, n, g C, e]`` (the ``g`` query heads of a key head stacked in a block's rows)."""
    batch, _, length, last = x.shape
    blocks = length // size
    return x.view(batch, kv_heads, groups, blocks, size, last).transpose(2, 3).reshape(
        batch, kv_heads, blocks, groups * size, last)


def _from_blocks(x, groups, size):
    """The inverse of :func:`_per_block`."""
    batch, kv_heads, blocks, _, last = x.shape
    return x.view(batch, kv_heads, blocks, groups, size, last).transpose(2, 3).reshape(
        batch, kv_heads * groups, blocks * size, last)


def _accumulate(grads: dict, group_grads: dict, spec: BlockSpec, start: int, end: int) -> None:
    """Add a group's gradients into the whole operands' (tiles overlap by ``w - 1`` keys)."""
    size, overlap = spec.size, max(spec.window - 1, 0)
    for name, grad in group_grads.items():
        if name not in grads or grad is None:
            continue
        if name == "query":
            grads[name][:, :, start * size:end * size] += grad
        elif name in ("keys", "values"):
            grads[name][:, :, start * size:end * size + overlap] += grad
        elif name in ("sink_key", "sink_value", "gamma"):
            grads[name] += grad
        else:  # per-block operands
            grads[name][:, :, start:end] += grad


def _fold_tiles(tile_grad: torch.Tensor, spec: BlockSpec, length: int) -> torch.Tensor:
    """The gradient ``[B, Hkv, length, e]`` of the keys / values laid out in overlapping tiles, from the tiles'
    ``[B, Hkv, n, span, e]`` (tile ``j`` covers ``[j C, j C + span)``)."""
    batch, kv_heads, blocks, span, last = tile_grad.shape
    size = spec.size
    chunks = -(-span // size)
    padded = torch.nn.functional.pad(tile_grad, (0, 0, 0, chunks * size - span))
    padded = padded.view(batch, kv_heads, blocks, chunks, size, last)
    result = tile_grad.new_zeros(batch, kv_heads, (blocks + chunks - 1) * size, last)
    for chunk in range(chunks):
        result[:, :, chunk * size:(chunk + blocks) * size] += padded[:, :, :, chunk].reshape(
            batch, kv_heads, blocks * size, last)
    return result[:, :, :length]
