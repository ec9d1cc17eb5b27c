"""The tail's weight by its token count in causal window attention: a fixed cap, and a learned gate.

The tail sums of a window layer grow with every token that leaves the window, while its exact part (sinks, window,
sparse cache) holds a constant number of keys: a layer trained at ``L`` tokens sees at most ``L - w - sinks - G`` folded
tokens, and beyond that the tail takes a growing share of the shared normaliser that training never showed it.
With ``tail_cap = M``, query ``i`` whose tail holds ``n_i`` tokens weighs its tail by

    a_i = min(1, M / n_i),    y_i = (E_i + a_i T_i) / (E_i^den + a_i T_i^den)

(``E`` the exact terms, ``T`` the tail's numerator and denominator): up to ``M`` folded tokens nothing changes;
beyond, the tail is the mean of its tokens at the weight of ``M`` of them. ``n_i`` depends on the row's tokens only:
without a sparse cache the eligible (unpadded, not sink) keys ``j <= i - w``; with ``G`` the eligible keys up to
``b_i - w`` (``b_i`` the query's boundary) less the ``G`` the cache keeps, since a cache fills before it folds.

The learned tail gate (``tail_gate``, an exponent ``alpha_h`` in ``[0, 1]`` per query head, trained with the
feature map) weighs the same tail by ``max(n_i, 1) ** -alpha_h``: ``alpha = 0`` is the plain sum, ``alpha = 1``
the tail's mean at the weight of one token; in between the tail's share of the normaliser grows as ``n ** (1 -
alpha)``. Both factors multiply. The gate's gradient reaches ``alpha`` through the log weight ``-alpha log n``.

This module imports only ``torch``.
"""

from __future__ import annotations

import math

import torch


def check_tail_cap(tail_cap, causal: bool, has_tail: bool) -> None:
    """One-line errors for a bad ``tail_cap`` (an int >= 0, 0 = unbounded; causal layers with a tail)."""
    if isinstance(tail_cap, bool) or not isinstance(tail_cap, int) or tail_cap < 0:
        raise ValueError(f"tail_cap must be an int >= 0 (tokens the tail weighs at most, 0 = unbounded); got "
                         f"{tail_cap!r}")
    if tail_cap and not causal:
        raise ValueError("tail_cap needs causal=True (a bidirectional window layer's tail is bounded by its input)")
    if tail_cap and not has_tail:
        raise ValueError("tail_cap needs a linear tail (a feature map); this layer has none")


def check_tail_gate(tail_gate, causal: bool, has_tail: bool, heads: int) -> None:
    """One-line errors for a bad ``tail_gate`` (``None``, or a float tensor ``[H]`` with values in ``[0, 1]``; causal
    layers with a tail)."""
    if tail_gate is None:
        return
    if not isinstance(tail_gate, torch.Tensor) or not tail_gate.is_floating_point() or tail_gate.shape != (heads,):
        shape = tuple(tail_gate.shape) if isinstance(tail_gate, torch.Tensor) else type(tail_gate).__name__
        raise ValueError(f"tail_gate must be a float tensor [num_heads = {heads}] of exponents in [0, 1] (or None); "
                         f"got {shape}")
    if not causal:
        raise ValueError("tail_gate needs causal=True (a bidirectional window layer's tail is bounded by its input)")
    if not has_tail:
        raise ValueError("tail_gate needs a linear tail (a feature map); this layer has none")


def tail_log_weights(tokens: torch.Tensor, tail_cap: int, exponent: torch.Tensor | None,
                     dtype: torch.dtype) -> torch.Tensor | None:
    """The log weight of each query's tail from its token count ``tokens`` (long): ``log min(1, cap / n)`` (with a
    cap) plus ``-alpha log max(n, 1)`` (with a gate; ``exponent`` already shaped to broadcast against ``tokens``);
    ``None`` when neither applies."""
    weight = tail_log_weight(tokens, tail_cap, dtype) if tail_cap else None
    if exponent is not None:
        gated = -exponent.to(dtype) * tokens.to(dtype).clamp_min(1.0).log()
        weight = gated if weight is None else weight + gated
    return weight


def eligible_up_to(local_keep: torch.Tensor, local_start: int, kept_before: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """Eligible tokens at absolute positions ``<= positions`` per row.

    ``local_keep`` ``[B, n]`` flags the eligible tokens at positions ``local_start .. local_start + n - 1``,
    ``kept_before`` ``[B]`` counts those before ``local_start``; ``positions`` ``[B, ...]`` long (at least
    ``local_start - 1``). Returns a long tensor shaped as ``positions``."""
    cumulative = torch.cat([kept_before[:, None], kept_before[:, None] + local_keep.long().cumsum(-1)], dim=1)
    index = (positions - local_start + 1).clamp(0, cumulative.shape[1] - 1)
    return cumulative.gather(1, index.reshape(index.shape[0], -1)).view(positions.shape)


def tail_tokens(eligible: torch.Tensor, sparse_cache: int) -> torch.Tensor:
    """Tokens in a query's tail from the eligible tokens up to its tail's edge: all of them, less the ``G`` a sparse
    cache keeps."""
    return (eligible - sparse_cache).clamp_min(0)


def tail_log_weight(tokens: torch.Tensor, tail_cap: int, dtype: torch.dtype) -> torch.Tensor:
    """``log min(1, cap / n)`` per query (0 where ``n <= cap``, including an empty tail)."""
    return -(tokens.to(dtype).clamp_min(1.0).log() - math.log(tail_cap)).clamp_min(0.0)


def training_tail_tokens(length: int, window: int, sinks: int, sparse_cache: int, chunk_size: int) -> int:
    """The most tokens a causal window layer's tail holds on one unpadded ``length``-token sequence: a layer trained
    at that length never saw a longer tail (the natural ``tail_cap`` of a model trained there)."""
    if sparse_cache:  # the last query's tail: its boundary's folded tokens
        edge = (length - 1) // chunk_size * chunk_size - window
    else:
        edge = length - 1 - window
    return max(0, edge + 1 - sinks - sparse_cache)
