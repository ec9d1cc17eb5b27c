"""Slow, obvious references for the linear-attention kernels (float64, quadratic or token by token).

Tests check every fast path against these. Nothing here is stabilised or chunked: the features are
``phi = values * exp(log_scale)`` taken literally, so keep test inputs moderate.
"""

from __future__ import annotations

import torch

from .feature_maps import FeatureMap


def _dense_features(features) -> torch.Tensor:
    if features.log_scale is None:
        return features.values
    return features.values * torch.exp(features.log_scale).unsqueeze(-1)


def _prepare(query, key, value, feature_map, scaling):
    scale = (query.shape[-1] ** -0.5 if scaling is None else float(scaling)) ** 0.5
    q, k, v = (t.to(torch.float64) for t in (query, key, value))
    groups = q.shape[1] // k.shape[1]
    phi_q = _dense_features(feature_map.query_features(q * scale))
    phi_k = _dense_features(feature_map.key_features(k * scale)).repeat_interleave(groups, dim=1)
    return phi_q, phi_k, v.repeat_interleave(groups, dim=1)


def reference_linear_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    feature_map: FeatureMap,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``A = phi(Q) phi(K)^T`` ``[B, H, Lq, Lk]`` with masked entries zeroed, ``out = A V / A 1``.

    Same arguments as :func:`~.linear_attention.linear_attention`; returns float64 ``[B, H, Lq, dv]``.
    Does not redraw the feature map's projection.
    """
    scores = reference_linear_attention_scores(
        query, key, feature_map, causal=causal, key_padding_mask=key_padding_mask, scaling=scaling,
        segment_ids=segment_ids,
    )
    v = value.to(torch.float64).repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    return (scores @ v) / scores.sum(-1, keepdim=True)


def reference_linear_attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    feature_map: FeatureMap,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Un-normalised ``phi(Q) phi(K)^T`` ``[B, H, Lq, Lk]`` in float64, masked entries (padding, future keys,
    keys of another packed sequence: different ``segment_ids`` ``[B, L]``) zeroed; queries are the last ``Lq``
    positions. Divided by its row sums it is the reference of
    :func:`~.attention_weights.linear_attention_weights`."""
    phi_q, phi_k, _ = _prepare(query, key, key, feature_map, scaling)
    scores = phi_q @ phi_k.transpose(-1, -2)
    q_len, k_len = scores.shape[-2:]
    if key_padding_mask is not None:
        scores = scores * key_padding_mask.to(torch.bool)[:, None, None, :]
    if causal:
        scores = scores.tril(k_len - q_len)
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        scores = scores * same[:, None, -q_len:, :]
    return scores


def reference_recurrent_linear_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    feature_map: FeatureMap,
    *,
    key_padding_mask: torch.Tensor | None = None,
    scaling: float | None = None,
) -> torch.Tensor:
    """Causal linear attention as an RNN, one token at a time, carrying ``S = sum phi(k) v^T`` and
    ``z = sum phi(k)``: ``out_i = phi(q_i) S_i / phi(q_i) z_i``. Returns float64 ``[B, H, L, dv]``."""
    phi_q, phi_k, v = _prepare(query, key, value, feature_map, scaling)
    if key_padding_mask is not None:
        keep = key_padding_mask.to(torch.bool)[:, None, :, None]
        phi_k, v = phi_k * keep, v * keep
    batch, heads, length, m = phi_k.shape
    kv = phi_k.new_zeros(batch, heads, m, v.shape[-1])
    k_sum = phi_k.new_zeros(batch, heads, m)
    outputs = []
    for i in range(length):
        kv = kv + phi_k[:, :, i, :, None] * v[:, :, i, None, :]
        k_sum = k_sum + phi_k[:, :, i]
        numerator = torch.einsum("bhm,bhmd->bhd", phi_q[:, :, i], kv)
        outputs.append(numerator / torch.einsum("bhm,bhm->bh", phi_q[:, :, i], k_sum).unsqueeze(-1))
    return torch.stack(outputs, dim=2)


def reference_decayed_attention(q, k, v, log_decay=None, initial_state=None):
    """``S_t = exp(g_t) S_{t-1} + k_t v_t^T``, ``o_t = q_t S_t`` one token at a time in float64 (the contract of
    :func:`~.decayed_attention.decayed_attention`). Returns ``o`` ``[B, H, T, V]`` and the final state."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    state = q.new_zeros(q.shape[:2] + (q.shape[-1], v.shape[-1])) if initial_state is None else \
        initial_state.to(torch.float64)
    outputs = []
    for t in range(q.shape[2]):
        if log_decay is not None:
            state = state * log_decay[:, :, t].to(torch.float64).exp()[..., None, None]
        state = state + k[:, :, t, :, None] * v[:, :, t, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    return torch.stack(outputs, dim=2), state


def softmax_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scaling: float | None = None,
) -> torch.Tensor:
    """Exact softmax attention in float64, the quantity FAVOR+ estimates. ``[B, H, Lq, dv]``."""
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    q, k, v = (t.to(torch.float64) for t in (query, key, value))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = scale * q @ k.transpose(-1, -2)
    if key_padding_mask is not None:
        scores = scores.masked_fill(~key_padding_mask.to(torch.bool)[:, None, None, :], float("-inf"))
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def reference_window_linear_attention(
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
    chunk_size: int = 128,
    tail_cap: int = 0,
    tail_gate: torch.Tensor | None = None,
    sparse_cache_selection: str = "recall",
    sparse_cache_span: int = 1,
) -> torch.Tensor:
    """Sink + window softmax with a linear tail, dense ``[B, H, L, L]`` in float64.

    Same arguments as :func:`~.window_attention.window_linear_attention`. Builds the exact mask ``E``
    and the tail mask ``T`` per (row, query, key) explicitly, a row's sinks being its first ``sinks`` unpadded
    keys; ``c_i`` = max exact score (0 if none);
    calibrated: ``W = exp(s - c) E + phi_q.phi_k exp(-c) T``; learned (``gamma``):
    ``W = gamma exp(s - c) E + phi_q.phi_k T``; ``out = W V / W 1`` (0 for a query without keys);
    ``feature_map=None``: no tail term. With ``sparse_cache`` (causal), the keys of
    :func:`reference_sparse_cache` at each query's boundary move from ``T`` to ``E``; ``chunk_size`` is then the
    interval between boundaries (unused otherwise). With ``tail_cap = M``, row ``i``'s tail weights are multiplied by
    ``min(1, M / n_i)``, ``n_i`` the number of its tail keys (``T`` counted); with ``tail_gate`` (``alpha`` ``[H]``),
    head ``h``'s by ``max(n_i, 1) ** -alpha_h``.
    Returns ``[B, H, L, dv]``.
    """
    if feature_map is None:
        v = value.to(torch.float64).repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    else:
        phi_q, phi_k, v = _prepare(query, key, value, feature_map, scaling)
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    q = query.to(torch.float64)
    k = key.to(torch.float64).repeat_interleave(q.shape[1] // key.shape[1], dim=1)
    batch, length = q.shape[0], q.shape[2]
    keep = torch.ones(batch, length, dtype=torch.bool)
    if key_padding_mask is not None:
        keep = key_padding_mask.to(torch.bool)
    # A row's sinks: its first `sinks` kept keys, whatever their positions.
    is_sink = torch.zeros(batch, length, dtype=torch.bool)
    for row in range(batch):
        is_sink[row, torch.nonzero(keep[row]).flatten()[:sinks]] = True
    i = torch.arange(length)[None, :, None]
    j = torch.arange(length)[None, None, :]
    sink_key, sink_query = is_sink[:, None, :], is_sink[:, :, None]
    band = (i - j).abs() < window
    if causal:
        exact = (j <= i) & (sink_key | band)
        tail = (j <= i) & ~exact
    else:
        exact = sink_key | sink_query | band
        tail = ~exact
    exact, tail = (exact & keep[:, None, :])[:, None], (tail & keep[:, None, :])[:, None]
    if sparse_cache:
        cached = reference_sparse_cache(key, value, feature_map, window=window, sinks=sinks, sparse_cache=sparse_cache,
                                        key_padding_mask=key_padding_mask, scaling=scaling, chunk_size=chunk_size,
                                        query=query if sparse_cache_selection == "attention" else None,
                                        span=sparse_cache_span)
        cached = cached.repeat_interleave(q.shape[1] // key.shape[1], dim=1)  # [B, H, L, L]
        exact, tail = exact | cached, tail & ~cached
    scores = scale * q @ k.transpose(-1, -2)
    row_max = scores.masked_fill(~exact, float("-inf")).amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exact_weights = torch.exp(scores - row_max) * exact
    tail_weights = 0.0 if feature_map is None else (phi_q @ phi_k.transpose(-1, -2)) * tail
    tail_keys = tail.sum(-1, keepdim=True).to(torch.float64)
    if tail_cap and feature_map is not None:
        tail_weights = tail_weights * torch.where(tail_keys > tail_cap, tail_cap / tail_keys.clamp_min(1.0), 1.0)
    if tail_gate is not None and feature_map is not None:
        tail_weights = tail_weights * tail_keys.clamp_min(1.0) ** -tail_gate.to(torch.float64)[None, :, None, None]
    if softmax_weight is None:
        weights = exact_weights + tail_weights * torch.exp(-row_max)
    else:
        weights = softmax_weight.to(torch.float64)[None, :, None, None] * exact_weights + tail_weights
    total = weights.sum(-1, keepdim=True)
    # A query that sees no key (left padding) gets 0, as the operator, with finite gradients.
    return (weights @ v) / torch.where(total == 0, torch.ones_like(total), total)


def reference_sparse_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    feature_map: FeatureMap | None,
    *,
    window: int,
    sinks: int,
    sparse_cache: int,
    key_padding_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    chunk_size: int = 64,
    eps: float = 1e-12,
    query: torch.Tensor | None = None,
    span: int = 1,
) -> torch.Tensor:
    """Which older keys each query sees exactly through the sparse cache, ``[B, Hkv, L, L]`` bool, one boundary at a
    time in float64.

    Per row and key head: boundaries every ``chunk_size`` positions from the row's first unpadded token; at boundary
    ``b`` the candidates are the cache of ``b - chunk_size`` and the keys ``b - chunk_size - window < j <= b -
    window`` (unpadded, not among the row's first ``sinks`` unpadded keys); each scores
    ``|| phi_j S / (phi_j . z) - v_j ||^2`` against the sums ``(S, z)`` of every folded key and every candidate
    (``phi = 1`` without a feature map); the ``sparse_cache`` largest stay (the older first on ties), the others
    fold. Query ``i`` sees the cache of its boundary ``b <= i`` and the keys waiting for the next selection,
    ``b - window < j <= i - window``. With ``query`` ``[B, H, L, d]`` (the attention selection) a candidate's score is
    instead the sum over the key head's query heads ``h`` of ``softmax_j(s q_{h,b} . k_j)`` over the candidates.
    With ``span`` the scores are then averaged, each over the candidates ``span // 2`` before and after it in the
    list (fewer at its ends), before the ranking.
    """
    k, v = key.to(torch.float64), value.to(torch.float64)
    batch, kv_heads, length, _ = k.shape
    boundary_queries = query  # (the loop below names each query position `query`)
    if feature_map is None:
        phi = torch.ones(batch, kv_heads, length, 1, dtype=torch.float64)
    else:
        scale = (key.shape[-1] ** -0.5 if scaling is None else float(scaling)) ** 0.5
        phi = _dense_features(feature_map.key_features(k * scale))
    unpadded = torch.ones(batch, length, dtype=torch.bool) if key_padding_mask is None else key_padding_mask.bool()
    cached = torch.zeros(batch, kv_heads, length, length, dtype=torch.bool)
    for row in range(batch):
        tokens = torch.nonzero(unpadded[row]).flatten().tolist()
        if not tokens:
            continue
        eligible = set(tokens[sinks:])
        start = tokens[0]
        for head in range(kv_heads):
            cache: list[int] = []
            sums = torch.zeros(phi.shape[-1], v.shape[-1] + 1, dtype=torch.float64)
            boundary = start
            while boundary < length:
                new = [j for j in range(boundary - chunk_size - window + 1, boundary - window + 1) if j in eligible]
                candidates = cache + new
                rows = torch.cat([v[row, head, candidates], torch.ones(len(candidates), 1, dtype=torch.float64)],
                                 dim=-1) if candidates else torch.zeros(0, v.shape[-1] + 1, dtype=torch.float64)
                if boundary_queries is None:
                    every = sums + phi[row, head, candidates].T @ rows
                    recalled = phi[row, head, candidates] @ every
                    denominator = recalled[:, -1:]
                    denominator = torch.where(denominator.abs() < eps, torch.full_like(denominator, eps), denominator)
                    error = ((recalled[:, :-1] / denominator - v[row, head, candidates]) ** 2).sum(-1).tolist()
                else:
                    groups = boundary_queries.shape[1] // kv_heads
                    asking = boundary_queries[row, head * groups:(head + 1) * groups, boundary].to(torch.float64)
                    logits = (k.shape[-1] ** -0.5 if scaling is None else float(scaling)) * (
                        asking @ k[row, head, candidates].T)
                    error = torch.softmax(logits, dim=-1).sum(0).tolist() if candidates else []
                half = span // 2
                neighbours = [error[max(0, index - half):index + half + 1] for index in range(len(error))]
                error = [sum(near) / len(near) for near in neighbours]
                ranked = sorted(range(len(candidates)), key=lambda index: (-error[index], index))
                kept = sorted(ranked[:sparse_cache])
                folded = [candidates[index] for index in range(len(candidates)) if index not in kept]
                cache = [candidates[index] for index in kept]
                if folded:
                    rows = torch.cat([v[row, head, folded], torch.ones(len(folded), 1, dtype=torch.float64)], -1)
                    sums = sums + phi[row, head, folded].T @ rows
                for query in range(boundary, min(boundary + chunk_size, length)):
                    waiting = [j for j in range(boundary - window + 1, query - window + 1) if j in eligible]
                    cached[row, head, query, cache + waiting] = True
                boundary += chunk_size
    return cached


# ------------------------------------------------------------------------------------ clustered attention


def _reference_cluster_weights(query, key, key_padding_mask, scaling, clusters, assignment):
    """Dense float64 pieces of clustered attention for a given assignment: the member matrix ``M`` ``[B, H, Lq, C]``
    (``M_ic = 1`` if query ``i`` is in cluster ``c``), the centroid attention ``A^c`` ``[B, H, C, Lk]``, the keys
    ``[B, H, Lk, d]`` repeated for grouped-query heads, the key mask ``[B, 1, 1, Lk]`` and the scale."""
    from .clustered_attention import _query_keep

    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    q, k = query.to(torch.float64), key.to(torch.float64).repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    members = torch.nn.functional.one_hot(assignment, clusters).to(torch.float64)  # [B, H, Lq, C]
    voters = members * _query_keep(query, key_padding_mask)[:, None, :, None]  # padded queries excluded
    centroids = (voters.transpose(-1, -2) @ q) / voters.sum(2)[..., None].clamp_min(1)  # mean of members
    keep = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool) if key_padding_mask is None else (
        key_padding_mask.to(torch.bool))
    keep = keep[:, None, None, :]
    cluster_scores = (scale * centroids @ k.transpose(-1, -2)).masked_fill(~keep, float("-inf"))
    return members, torch.softmax(cluster_scores, dim=-1), k, keep, scale


def _reference_assignment(query, key, value, clusters, topk, key_padding_mask, hash_bits, iterations, seed, causal,
                          assignment):
    from .clustered_attention import check_clustered_inputs, cluster_queries

    check_clustered_inputs(query, key, value, clusters=clusters, topk=topk, key_padding_mask=key_padding_mask,
                           hash_bits=hash_bits, iterations=iterations, causal=causal, assignment=assignment)
    if assignment is not None:
        return assignment, clusters
    assignment = cluster_queries(query, clusters=clusters, key_padding_mask=key_padding_mask, hash_bits=hash_bits,
                                 iterations=iterations, seed=seed)
    return assignment, min(clusters, query.shape[2])


def reference_clustered_attention(query, key, value, *, clusters, key_padding_mask=None, scaling=None, hash_bits=63,
                                  iterations=10, seed=0, causal=False, assignment=None):
    """Clustered attention, dense float64: ``out = M A^c V`` (every query takes its cluster's centroid attention).

    Same arguments as :func:`~.clustered_attention.clustered_attention`, same assignment (from
    :func:`~.clustered_attention.cluster_queries` unless given). Returns float64 ``[B, H, Lq, dv]``.
    """
    assignment, clusters = _reference_assignment(query, key, value, clusters, None, key_padding_mask, hash_bits,
                                                 iterations, seed, causal, assignment)
    members, cluster_weights, _, _, _ = _reference_cluster_weights(query, key, key_padding_mask, scaling, clusters,
                                                                   assignment)
    v = value.to(torch.float64).repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    return members @ cluster_weights @ v


def reference_improved_clustered_attention(query, key, value, *, clusters, topk, key_padding_mask=None, scaling=None,
                                           hash_bits=63, iterations=10, seed=0, causal=False, assignment=None):
    """Improved clustered attention, dense ``[B, H, Lq, Lk]`` in float64.

    Same arguments as :func:`~.clustered_attention.improved_clustered_attention`. Per query ``i`` of cluster ``c``
    builds the full row ``A_ij = m_c softmax_{T_c}(s_i)_j`` on the top-k set ``T_c`` of ``A^c_c`` and
    ``A_ij = A^c_cj`` elsewhere (``m_c = sum_{T_c} A^c_cj``), then ``out = A V``. Returns ``[B, H, Lq, dv]``.
    """
    assignment, clusters = _reference_assignment(query, key, value, clusters, topk, key_padding_mask, hash_bits,
                                                 iterations, seed, causal, assignment)
    members, cluster_weights, k, keep, scale = _reference_cluster_weights(query, key, key_padding_mask, scaling,
                                                                          clusters, assignment)
    v = value.to(torch.float64).repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    top = torch.zeros_like(cluster_weights, dtype=torch.bool).scatter(
        -1, cluster_weights.topk(topk, dim=-1).indices, True)  # T_c, [B, H, C, Lk]
    query_top = (members @ top.to(torch.float64)).to(torch.bool) & keep  # T_c(i), [B, H, Lq, Lk]
    query_cluster_weights = members @ cluster_weights  # A^c_c(i), [B, H, Lq, Lk]
    mass = (query_cluster_weights * query_top).sum(-1, keepdim=True)
    scores = (scale * query.to(torch.float64) @ k.transpose(-1, -2)).masked_fill(~query_top, float("-inf"))
    weights = torch.where(query_top, mass * torch.softmax(scores, dim=-1), query_cluster_weights)
    return weights @ v
