"""What the chunked linear-attention kernels share: the settings of one call (:class:`ChunkedAttentionSettings`: the
chunk size from a row budget, the feature map, the scale, the mask), the tensor helpers of grouped-query attention
(:func:`_repeat_kv` and its adjoint), values with their ones column, and denominators kept away from 0.
:mod:`.linear_attention_autograd` holds the passes and the autograd function.

This module imports only ``torch`` and its sibling ``feature_maps``: it ships next to saved models for
``trust_remote_code``.
"""

from __future__ import annotations

import contextlib

import torch

from .feature_maps import FeatureMap


# Rows (examples x heads x tokens) of one chunk's temporaries: with m = 256 float32 features, 512 rows are 0.5 MiB
# per [rows, m] tensor. The budget grows with the length, as SDPA's own extra memory does (O(L d)): L / 4 rows
# (4k tokens: 1024, 8k: 2048) keep a call's extra peak memory below SDPA's from 4k tokens on, and the larger head
# blocks run 10-15% faster at 8k (benchmarks/README.md, issue 17).
BLOCK_ROWS = 512
ROWS_PER_TOKEN = 0.25
# Tokens per bidirectional chunk, at least: that pass has no [C, C] tile, so a smaller chunk only adds per-chunk
# overhead (64 tokens: 6% slower than 128-512 at 8k; its temporaries are bounded by the row budget above).
BIDIRECTIONAL_MIN_CHUNK = 128


def _finite_min(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).min


def _safe_denominator(denominator: torch.Tensor, eps: float) -> torch.Tensor:
    """Move denominators away from 0 by ``eps`` keeping their sign (trig features can be < 0)."""
    tiny = denominator.abs() < eps
    return torch.where(tiny, torch.where(denominator < 0, -eps, eps), denominator)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, Hkv, ...] -> [B, Hkv * groups, ...]`` (grouped-query attention)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, Hkv * groups, ...] -> [B, Hkv, ...]``: the adjoint of :func:`_repeat_kv`."""
    if groups == 1:
        return x
    return x.unflatten(1, (x.shape[1] // groups, groups)).sum(2)


class ChunkedAttentionSettings:
    """What one call of :class:`ChunkedLinearAttention` needs besides its tensors.

    Args:
        feature_map: the map (called for queries and keys of ``chunk_size`` tokens at a time).
        causal: token ``i`` attends to keys ``<= i``.
        scale: inputs are multiplied by this (``sqrt(scaling)``) before the map.
        chunk_size: tokens per chunk ``C`` of the causal scan (bounds its temporaries: ``[B, H, C, m]`` and
            ``[B, H, C, C]``); bidirectional chunks take at least ``BIDIRECTIONAL_MIN_CHUNK`` tokens.
        eps: smallest magnitude of a denominator.
        dtype: compute dtype (float32, or float64 for float64 inputs).
    """

    def __init__(self, feature_map: FeatureMap, causal: bool, scale: float, chunk_size: int, eps: float,
                 dtype: torch.dtype):
        self.feature_map, self.causal, self.scale = feature_map, causal, scale
        self.chunk_size = chunk_size if causal else max(chunk_size, BIDIRECTIONAL_MIN_CHUNK)
        self.eps, self.dtype = eps, dtype
        self.use_features_vjp = feature_map.has_features_vjp
        # (module, "parameters" or "buffers", name, tensor): what the forward computed with.
        self.slots = []
        if torch.is_grad_enabled():
            self.slots = [(module, "_parameters", name, p) for module in feature_map.modules()
                          for name, p in module._parameters.items() if p is not None and p.requires_grad]
        self.parameters = [slot[3] for slot in self.slots]
        projection = getattr(feature_map, "projection", None)
        if isinstance(projection, torch.Tensor) and "projection" in feature_map._buffers:
            # a random map may redraw its projection buffer (in place) before the backward
            self.slots.append((feature_map, "_buffers", "projection", projection.detach().clone()))
        self.parameter_grads: list[torch.Tensor | None] = [None] * len(self.parameters)

    @contextlib.contextmanager
    def tensors_of_the_forward(self):
        """Inside: the map holds the parameters and projection it had in the forward (a redraw since, or a
        ``torch.func.functional_call`` that swapped the parameters and has returned, is undone meanwhile)."""
        swapped = []
        for module, kind, name, tensor in self.slots:
            current = getattr(module, kind)[name]
            if current is not tensor and not (kind == "_buffers" and torch.equal(current, tensor)):
                getattr(module, kind)[name] = tensor
                swapped.append((module, kind, name, current))
        try:
            yield
        finally:
            for module, kind, name, current in swapped:
                getattr(module, kind)[name] = current

    def head_blocks(self, query: torch.Tensor, key: torch.Tensor) -> list[tuple[slice, slice]]:
        """``(key heads, query heads)`` slices processed together: as many whole key/value heads as keep a chunk's
        ``[B, heads, C, m]`` features within ``max(BLOCK_ROWS, ROWS_PER_TOKEN * L)`` rows; all heads for maps with
        per-head parameters (learned maps), which need them together."""
        batch, heads, length = query.shape[:3]
        kv_heads = key.shape[1]
        groups = heads // kv_heads
        rows_per_kv_head = batch * groups * min(self.chunk_size, length)
        budget = max(BLOCK_ROWS, int(ROWS_PER_TOKEN * length))
        per_block = kv_heads if getattr(self.feature_map, "num_heads", None) else max(1, budget // rows_per_kv_head)
        return [(slice(h, min(h + per_block, kv_heads)), slice(h * groups, min(h + per_block, kv_heads) * groups))
                for h in range(0, kv_heads, per_block)]

    # ---------------------------------------------------------------------------- features of a chunk

    def _tracked(self, x: torch.Tensor, track: bool) -> torch.Tensor:
        x = x.to(self.dtype)
        return x.detach().requires_grad_() if track else x

    def query_features(self, query: torch.Tensor, track: bool = False):
        """``x`` (the chunk in the compute dtype, an autograd leaf if ``track``) and ``phi(x * scale)``
        values ``[B, H, C, m]`` (the query log-scale cancels between numerator and denominator)."""
        x = self._tracked(query, track)
        with torch.set_grad_enabled(track):
            return x, self.feature_map.query_features(x * self.scale).values

    def key_features(self, key: torch.Tensor, track: bool = False):
        """``x`` as in :meth:`query_features`, values ``[B, Hkv, C, m]`` and log-scales ``[B, Hkv, C]`` or ``None``."""
        x = self._tracked(key, track)
        with torch.set_grad_enabled(track):
            features = self.feature_map.key_features(x * self.scale)
        return x, features.values, features.log_scale

    def shifted_key_features(self, key: torch.Tensor, shift: torch.Tensor, keep: torch.Tensor | None,
                             track: bool = False):
        """``x`` as in :meth:`query_features` and the key features relative to a known stabiliser, as the kernel
        uses them: ``phi(x * scale) exp(-shift)`` ``[B, Hkv, C, m]`` (``shift`` ``[B, Hkv, C]``, at least the rows'
        log-scales), padded keys (``keep`` ``[B, 1, C]`` False) zeroed."""
        x = self._tracked(key, track)
        if keep is not None:
            shift = shift.masked_fill(~keep, float("inf"))  # no overflow in the rows the stabiliser left out
        with torch.set_grad_enabled(track):
            values = self.feature_map.shifted_key_features(x * self.scale, shift)
            return x, values if keep is None else _scale_rows(values, keep[..., None])

    @property
    def track(self) -> bool:
        """Whether the backward recomputes features under autograd (maps without ``features_vjp``)."""
        return not self.use_features_vjp

    def features_backward(self, x: torch.Tensor, used: torch.Tensor, grad_used: torch.Tensor,
                          groups: int = 1) -> torch.Tensor:
        """Gradient w.r.t. the unscaled chunk ``x`` ``[B, heads, C, d]`` of ``sum(grad_used * used)``, where
        ``used`` ``[B, heads * groups, C, m]`` are the features as the kernel used them (rescaled per row,
        masked, repeated for grouped heads); accumulates the map parameters' gradients."""
        if self.use_features_vjp:
            scaled = _repeat_kv(x * self.scale, groups)
            return _sum_groups(self.feature_map.features_vjp(scaled, used, grad_used), groups).mul_(self.scale)
        inputs = [x, *self.parameters]
        grads = torch.autograd.grad(used, inputs, grad_used, allow_unused=True)
        for index, grad in enumerate(grads[1:]):
            if grad is not None:
                total = self.parameter_grads[index]
                self.parameter_grads[index] = grad if total is None else total.add_(grad)
        return torch.zeros_like(x) if grads[0] is None else grads[0]


def _values_with_ones(value: torch.Tensor, keep: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``[B, h, C, dv] -> [B, h, C, dv + 1]`` in ``dtype`` with a column of ones (the normaliser), padded keys
    (``keep`` ``[B, 1, C]`` False) zeroed."""
    value = value.to(dtype)
    ones = torch.cat([value, value.new_ones(value.shape[:-1] + (1,))], dim=-1)
    return ones if keep is None else ones.masked_fill_(~keep[..., None], 0.0)


def _add_matmul_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out += a @ b`` in place for ``[B, H, p, q]`` tensors (no temporary of ``out``'s size)."""
    flat = lambda t: t.reshape(-1, *t.shape[-2:])  # noqa: E731
    out.view(-1, *out.shape[-2:]).baddbmm_(flat(a), flat(b))
    return out


def _chunks(length: int, chunk_size: int):
    return [(start, min(start + chunk_size, length)) for start in range(0, length, chunk_size)]


def _keep(mask: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    return None if mask is None else mask[:, None, start:end]


def _scale_rows(values: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``values * factor``; in place on the fresh feature tensor when autograd is off (one ``[C, m]`` buffer less)."""
    return values * factor if torch.is_grad_enabled() else values.mul_(factor)
