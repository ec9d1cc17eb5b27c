"""The sparse cache of hard keys of causal window attention: which older tokens stay exact (LoLA, arXiv 2505.23666).

Besides its sinks and its window, a causal window layer may keep up to ``G`` older tokens per (example, key head)
exact: the ones its linear tail would recall worst. Selection happens at the row's *boundaries*, every
``chunk_size`` (``C``) positions from the row's first unpadded token (``o_r + k C``, ``o_r`` that token's position
modulo ``C``, so that a left-padded row selects exactly what it selects alone). At boundary ``b`` the candidates are
the tokens of the cache at ``b - C`` and the tokens that left the window since, ``b - C - w < j <= b - w`` (unpadded,
not sinks); each is scored by its self-recall error against the tail sums that would hold every candidate,

    err_j = || phi(k_j)^T S / phi(k_j)^T z - v_j ||^2,    (S, z) = tail sums at b - C + sum over the candidates,

the ``G`` largest stay exact (ties: the older token), and the others fold into the tail sums for good. Queries
``b <= i < b + C`` see the cache of ``b`` exactly, and the tokens that left the window after ``b`` as well: they wait,
exact, for the next selection (as in LoLA, whose window is chunked), so that the tail holds only folded tokens and
``G >= L`` is exact softmax. ``G = 0`` is today's window hybrid: no cache, and the tokens that left the window go to
the tail at once (its sums at ``b`` hold every key ``j <= b - w``, the later ones are added per query).

With ``sparse_cache_selection="attention"`` (the H2O / TOVA family: keep the keys the queries attend to) the score is
instead the attention the boundary's own query gives each candidate, its softmax over the candidates summed over the
query heads that share the key head,

    score_j = sum_h softmax_j(s q_{h,b} . k_j),    s the score scale,

the first query that will read the new cache deciding what it holds (TOVA's rule at a chunk's granularity); the rest
(what folds, ties, the waiting tokens) is the same. :data:`SELECTIONS` names the rules.

With ``sparse_cache_span = s > 1`` (odd) either score is first averaged over each candidate's ``(s - 1) / 2`` nearest
valid candidates on each side in candidate order (fewer at the ends; :func:`span_mean`), as SnapKV pools its
attention before ranking: a retrieved fact is a run of tokens, and ranking single tokens keeps a few of its sharpest
keys but not the run a copy needs. Candidates are in position order (the cache's older tokens, then the ones that
left the window), so the neighbours are the nearest tokens still candidates.

Selection is not differentiated (the error is computed on detached tensors); the tail sums it returns are
differentiable in the folded keys' features and values, and the kept tokens are returned as candidate indices, so
that callers gather their keys and values with gradients.

A tail sum is ``(sums [B, Hkv, m, dv + 1], K [B, Hkv])``: ``sum_j values_j exp(lk_j - K) [v_j, 1]`` with ``K`` the
detached maximum of the summed keys' log-scales (``finfo.min`` for none), as in :mod:`.window_tail`.

This module imports only ``torch`` and its sibling ``window_tail``.
"""

from __future__ import annotations

import torch

from .window_tail import _fold_keys

SELECTIONS = ("recall", "attention")
"""The sparse cache's selection rules: the tail's recall error (LoLA, the default) or the boundary query's attention."""


def check_span(span) -> None:
    """Raise ``ValueError`` for a ``sparse_cache_span`` that is not an odd int >= 1."""
    if isinstance(span, bool) or not isinstance(span, int) or span < 1 or span % 2 == 0:
        raise ValueError(f"sparse_cache_span must be an odd int >= 1 (1 = each token on its own score); got {span!r}")


def span_mean(scores, candidate_valid, span: int):
    """``scores`` ``[B, Hkv, n]`` of the valid candidates averaged over each one's ``span // 2`` nearest valid
    candidates on each side in candidate order (fewer at the ends); invalid candidates' values are meaningless."""
    if span == 1 or scores.shape[-1] == 0:
        return scores
    order = torch.sort((~candidate_valid).to(torch.uint8), dim=-1, stable=True).indices  # the valid ones first
    valid = candidate_valid.gather(-1, order)
    compact = scores.gather(-1, order).masked_fill(~valid, 0.0)
    kernel = scores.new_ones(1, 1, span)
    flat = lambda t: t.reshape(-1, 1, t.shape[-1])  # noqa: E731
    total = torch.nn.functional.conv1d(flat(compact), kernel, padding=span // 2)
    count = torch.nn.functional.conv1d(flat(valid.to(scores.dtype)), kernel, padding=span // 2)
    pooled = (total / count.clamp_min(1.0)).reshape(scores.shape)
    return torch.empty_like(pooled).scatter_(-1, order, pooled)


def check_selection(selection) -> None:
    """Raise ``ValueError`` for a selection rule that is not one of :data:`SELECTIONS`."""
    if selection not in SELECTIONS:
        raise ValueError(f"sparse_cache_selection must be one of {', '.join(map(repr, SELECTIONS))}; got "
                         f"{selection!r}")


def attention_scores(boundary_query, keys, candidate_valid, scaling: float):
    """``score_j`` (module docstring) ``[B, Hkv, n]`` of candidates with keys ``[B, Hkv, n, d]`` for the boundary's
    queries ``[B, Hkv, g, d]`` (the ``g`` query heads of each key head); 0 for invalid candidates."""
    logits = torch.matmul(boundary_query, keys.transpose(-1, -2)) * scaling  # [B, Hkv, g, n]
    logits = logits.masked_fill(~candidate_valid[:, :, None, :], float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row without a valid candidate: zeros
    return weights.sum(-2)


def empty_tail_sum(batch: int, heads: int, features: int, columns: int, like: torch.Tensor):
    """The tail sum over no key: zeros ``[B, Hkv, m, columns]`` and ``K = finfo.min``."""
    return (like.new_zeros(batch, heads, features, columns),
            like.new_full((batch, heads), torch.finfo(like.dtype).min))


def fold_into(tail, features, log_scale, value_ones, mask):
    """``tail`` plus the keys of ``mask`` ``[B, Hkv, n]`` (bool): their feature values ``features``
    ``[B, Hkv, n, m]``, log-scales ``log_scale`` ``[B, Hkv, n]`` (or ``None``: maps without one) and
    ``value_ones`` ``[B, Hkv, n, dv + 1]``. Differentiable in the features and values."""
    sums, tail_max = tail
    weights = features * mask[..., None].to(features.dtype)
    if log_scale is None:
        return sums + torch.matmul(weights.transpose(-1, -2), value_ones), tail_max
    masked_log_scale = log_scale.masked_fill(~mask, float("-inf"))
    new_max = torch.maximum(tail_max, masked_log_scale.detach().amax(-1)).clamp_min(torch.finfo(sums.dtype).min)
    return _fold_keys(sums, tail_max, weights, masked_log_scale, value_ones, new_max), new_max


def recall_error(features, value_ones, tail, eps: float):
    """Self-recall error ``|| phi(k)^T S / phi(k)^T z - v ||^2`` ``[B, Hkv, n]`` of keys with feature values
    ``features`` ``[B, Hkv, n, m]`` and ``value_ones`` ``[B, Hkv, n, dv + 1]`` against ``tail`` (the keys'
    log-scales and the tail's stabiliser cancel in the ratio)."""
    recalled = torch.matmul(features, tail[0])  # [B, Hkv, n, dv + 1]
    denominator = recalled[..., -1:]
    denominator = torch.where(denominator.abs() < eps, torch.full_like(denominator, eps), denominator)
    return ((recalled[..., :-1] / denominator - value_ones[..., :-1]) ** 2).sum(-1)


def select_hard_keys(tail, features, log_scale, value_ones, candidate_valid, capacity: int, eps: float, scores=None,
                     span: int = 1):
    """One boundary: keep the ``capacity`` candidates the tail would recall worst (or with the largest ``scores``
    ``[B, Hkv, n]``, e.g. :func:`attention_scores`), each score first averaged over ``span`` candidates
    (:func:`span_mean`), fold the others.

    Args:
        tail: the tail sum before the boundary (differentiable or not).
        features: ``[B, Hkv, n, m]`` the candidates' feature values, ``log_scale`` ``[B, Hkv, n]`` or ``None``,
            ``value_ones`` ``[B, Hkv, n, dv + 1]``; candidates in position order (older first).
        candidate_valid: ``[B, Hkv, n]`` bool, ``False`` for empty cache slots, padding, sinks.
        capacity: ``G >= 1``.

    Returns:
        ``(tail', kept [B, Hkv, G] long, kept_valid [B, Hkv, G] bool)``: the tail sum with the folded candidates
        added, and the kept candidates' indices (in candidate order, so older first; invalid slots point at 0).
    """
    with torch.no_grad():
        if scores is None:
            every = fold_into((tail[0].detach(), tail[1]), features.detach(), None if log_scale is None else
                              log_scale.detach(), value_ones.detach(), candidate_valid)
            error = recall_error(features.detach(), value_ones.detach(), every, eps)
        else:
            error = scores.detach()
        error = span_mean(error, candidate_valid, span).masked_fill(~candidate_valid, float("-inf"))
        ranked = torch.sort(error, dim=-1, descending=True, stable=True).indices[..., :capacity]
        kept = ranked.sort(dim=-1).values
        kept_valid = candidate_valid.gather(-1, kept)
        folded = candidate_valid.clone()
        folded.scatter_(-1, kept, False)
        if kept.shape[-1] < capacity:  # fewer candidates than slots: the extra slots are empty
            missing = capacity - kept.shape[-1]
            kept = torch.cat([kept, kept.new_zeros(kept.shape[:-1] + (missing,))], dim=-1)
            kept_valid = torch.cat([kept_valid, kept_valid.new_zeros(kept_valid.shape[:-1] + (missing,))], dim=-1)
    return fold_into(tail, features, log_scale, value_ones, folded), kept, kept_valid
