"""Clustered and improved clustered attention (Vyas, Katharopoulos, Fleuret, NeurIPS 2020), bidirectional only.

A zero-shot approximation of softmax attention: queries close to each other have close attention
distributions, so the queries of each (example, head) are grouped into ``C`` clusters and attention is computed
once per cluster. Layouts as :func:`~.linear_attention.linear_attention`: queries ``[B, H, Lq, d]``, keys and
values ``[B, Hkv, Lk, d]`` (``Hkv`` divides ``H``: grouped-query attention).

* Clustering (:func:`cluster_queries`): each query is hashed with ``hash_bits`` random hyperplanes (seeded, so
  deterministic), then ``iterations`` Lloyd iterations of K-means in Hamming space run per (example, head),
  batched. Initial centres are the hashes of ``C`` queries evenly spaced among the unpadded ones; a centre is the
  bitwise majority of its members' hashes (a cluster left empty keeps its centre). With ``C >= Lq`` every query
  is its own cluster (no hashing). Padded queries are assigned to their nearest centre but never move a centre.
* Clustered attention: centroid ``Qc_c`` = mean of the unpadded member queries (zero for an empty cluster),
  ``A^c = softmax(scaling Qc K^T)`` ``[B, H, C, Lk]`` over the unpadded keys, and every member query ``i`` of
  cluster ``c`` gets ``A^c_c V``.
* Improved clustered attention (the paper's Eq. 9-10): ``T_c`` = the ``topk`` keys with the largest ``A^c_c``,
  ``m_c = sum_{j in T_c} A^c_cj``; member ``i`` of cluster ``c`` attends with

      A_ij = m_c softmax_{T_c}(scaling q_i K^T)_j   for j in T_c,     A_ij = A^c_cj   otherwise.

Cost per (example, head): ``O(Lq C bits iterations + Lq d bits)`` for the clustering, ``O(Lk C d)`` for the cluster
attention and ``O(Lq topk d + C topk d)`` for the improved part, whose queries are grouped by cluster into segments
of at most ``MAX_SEGMENT_SIZE`` so that each segment is one ``[S, d] x [d, topk]`` matmul against its cluster's
gathered keys; memory ``O(Lq (C + bits) + C Lk + (Lq + C S) topk)``. No ``Lq x Lk`` tensor is ever built, except by
:func:`clustered_attention_weights` (``output_attentions=True``: the ``[B, H, Lq, Lk]`` weights both kinds apply, on
request only). Sums run in float32 (float64 for float64 inputs) with autocast off; the output is cast to
``value.dtype``. The float64 dense references are in ``reference.py``
(:func:`~.reference.reference_clustered_attention`, :func:`~.reference.reference_improved_clustered_attention`)
and take the same assignment from :func:`cluster_queries`.

This module imports only ``torch`` and its siblings ``feature_maps`` and ``linear_attention``.
"""

from __future__ import annotations

import torch

from .feature_maps import compute_dtype_for
from .linear_attention import FavorMaskError, LinearAttentionError, _as_bool_mask, _no_autocast

DEFAULT_HASH_BITS = 63
DEFAULT_ITERATIONS = 10
MAX_SEGMENT_SIZE = 64  # queries of one cluster per matmul against its top-k keys in the improved part


class ClusteredAttentionError(LinearAttentionError):
    """Raised for inputs clustered attention does not accept."""


def _check_positive_int(name, value, accepted):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ClusteredAttentionError(f"{name} must be {accepted}; got {value!r}")


def check_clustered_inputs(query, key, value, *, clusters, topk=None, key_padding_mask=None, hash_bits=63,
                           iterations=10, causal=False, assignment=None):
    """One-line :class:`ClusteredAttentionError` for anything clustered attention does not accept."""
    if causal:
        raise ClusteredAttentionError(
            "clustered attention is bidirectional only (a cluster mixes past and future queries); got causal=True. "
            "Use attention 'favor' for causal models"
        )
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ClusteredAttentionError(f"{name} must have shape [batch, heads, length, head_dim]; got {shape}")
    batch, heads, q_len, head_dim = query.shape
    if key.shape[:3] != value.shape[:3] or key.shape[0] != batch or key.shape[-1] != head_dim:
        raise ClusteredAttentionError(
            f"key {tuple(key.shape)} must be [batch, kv_heads, key_length, head_dim] with the batch and head_dim of "
            f"query {tuple(query.shape)}, and value {tuple(value.shape)} must share its first three sizes"
        )
    if heads % key.shape[1]:
        raise ClusteredAttentionError(f"query heads ({heads}) must be a multiple of key/value heads ({key.shape[1]})")
    if q_len == 0 or key.shape[2] == 0:
        raise ClusteredAttentionError("clustered attention needs at least one query and one key")
    _check_positive_int("clusters", clusters, "an int >= 1 (the number of query clusters per head)")
    _check_positive_int("hash_bits", hash_bits, "an int >= 1 (hyperplanes of the query hash)")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
        raise ClusteredAttentionError(f"iterations must be an int >= 0 (Lloyd iterations); got {iterations!r}")
    if topk is not None:
        _check_positive_int("topk", topk, f"an int in [1, key length = {key.shape[2]}]")
        if topk > key.shape[2]:
            raise ClusteredAttentionError(f"topk must be an int in [1, key length = {key.shape[2]}]; got {topk}")
    if key_padding_mask is not None and (key_padding_mask.dim() != 2
                                         or tuple(key_padding_mask.shape) != (batch, key.shape[2])):
        raise ClusteredAttentionError(
            f"key_padding_mask must have shape [batch, key_length] = {[batch, key.shape[2]]} (True/1 = token); got "
            f"{tuple(key_padding_mask.shape)}"
        )
    if assignment is not None and (assignment.dtype != torch.long or tuple(assignment.shape) != (batch, heads, q_len)
                                   or (q_len and (int(assignment.min()) < 0 or int(assignment.max()) >= clusters))):
        raise ClusteredAttentionError(
            f"assignment must be a long tensor [batch, heads, query_length] = {[batch, heads, q_len]} with values in "
            f"[0, clusters = {clusters}); got {assignment.dtype} {tuple(assignment.shape)}"
        )


def _query_keep(query, key_padding_mask):
    """``[B, Lq]`` bool: unpadded queries (the key padding mask when queries and keys are the same tokens)."""
    batch, _, q_len, _ = query.shape
    mask = _as_bool_mask(key_padding_mask)
    if mask is None or mask.shape[1] != q_len:
        return torch.ones(batch, q_len, dtype=torch.bool, device=query.device)
    return mask.to(query.device)


def _hash_planes(head_dim: int, hash_bits: int, seed: int, device, dtype) -> torch.Tensor:
    """``[d, bits]`` Gaussian hyperplanes from a CPU generator seeded with ``seed`` (same on every device)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(head_dim, hash_bits, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)


def _initial_members(keep: torch.Tensor, clusters: int) -> torch.Tensor:
    """``[B, C]`` positions of ``C`` queries evenly spaced among the unpadded ones (rank ``floor(c n / C)``)."""
    counts = keep.sum(-1, keepdim=True).clamp_min(1)  # [B, 1]
    ranks = torch.arange(clusters, device=keep.device)[None, :] * counts // clusters  # [B, C]
    cumulative = keep.long().cumsum(-1)  # [B, L]; position p is the (cumulative[p] - 1)-th unpadded query
    positions = torch.searchsorted(cumulative.contiguous(), (ranks + 1).contiguous())
    return positions.clamp_max(keep.shape[1] - 1)


def cluster_queries(query: torch.Tensor, *, clusters: int, key_padding_mask: torch.Tensor | None = None,
                    hash_bits: int = DEFAULT_HASH_BITS, iterations: int = DEFAULT_ITERATIONS,
                    seed: int = 0) -> torch.Tensor:
    """Cluster index of every query: LSH with random hyperplanes, then Lloyd's K-means in Hamming space.

    Args:
        query: ``[B, H, Lq, d]``.
        clusters: ``C >= 1``. With ``C >= Lq`` query ``i`` is cluster ``i``.
        key_padding_mask: ``[B, Lq]`` (True/1 = token) or ``None``; padded queries never move a centre.
        hash_bits: hyperplanes of the hash.
        iterations: Lloyd iterations (assign to the nearest centre, centre = bitwise majority of its members).
        seed: seed of the hyperplanes (the result depends on nothing else: deterministic).

    Returns:
        ``[B, H, Lq]`` long in ``[0, C)``, ties broken towards the lowest cluster index.
    """
    batch, heads, q_len, head_dim = query.shape
    if clusters >= q_len:
        return torch.arange(q_len, device=query.device).expand(batch, heads, q_len).clone()
    keep = _query_keep(query, key_padding_mask)
    with torch.no_grad(), _no_autocast(query.device.type):
        dtype = compute_dtype_for(query)
        planes = _hash_planes(head_dim, hash_bits, seed, query.device, dtype)
        # Bits as signs +-1: signs.centre = bits - 2 hamming, so the nearest centre is the largest product.
        signs = torch.matmul(query.detach().to(dtype), planes).gt(0).to(dtype) * 2 - 1  # [B, H, Lq, bits]
        start = _initial_members(keep, clusters)  # [B, C]
        centres = torch.gather(signs, 2, start[:, None, :, None].expand(batch, heads, clusters, hash_bits))
        voters = signs * keep[:, None, :, None]  # padded queries do not vote
        for step in range(iterations + 1):
            assignment = torch.matmul(signs, centres.transpose(-1, -2)).argmax(-1)  # [B, H, Lq], first on ties
            if step == iterations:
                break
            index = assignment[..., None].expand(batch, heads, q_len, hash_bits)
            votes = signs.new_zeros(batch, heads, clusters, hash_bits).scatter_add_(2, index, voters)
            members = signs.new_zeros(batch, heads, clusters).scatter_add_(
                2, assignment, keep[:, None, :].to(dtype).expand(batch, heads, q_len))
            majority = votes.gt(0).to(dtype) * 2 - 1  # a tied bit becomes -1
            centres = torch.where(members[..., None] > 0, majority, centres)
    return assignment


def _cluster_attention(query, key, value, assignment, clusters, keep_queries, keep_keys, scaling):
    """Centroids and their softmax attention.

    Returns:
        ``weights`` ``[B, H, C, Lk]`` (``A^c``, zero on padded keys) and ``outputs`` ``[B, H, C, dv]`` (``A^c V``).
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    weight = keep_queries[:, None, :, None].to(query.dtype)
    index = assignment[..., None]
    sums = query.new_zeros(batch, heads, clusters, head_dim).scatter_add_(
        2, index.expand(batch, heads, q_len, head_dim), query * weight)
    counts = query.new_zeros(batch, heads, clusters, 1).scatter_add_(2, index, weight.expand(batch, heads, q_len, 1))
    centroids = sums / counts.clamp_min(1)
    # Grouped-query attention without copying keys: the g query heads of one kv head share a matmul.
    grouped = centroids.reshape(batch, kv_heads, groups * clusters, head_dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)) * scaling  # [B, Hkv, g C, Lk]
    scores = scores.masked_fill(~keep_keys[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    outputs = torch.matmul(weights, value).reshape(batch, heads, clusters, value.shape[-1])
    return weights.reshape(batch, heads, clusters, key.shape[2]), outputs


def _broadcast_to_members(per_cluster: torch.Tensor, assignment: torch.Tensor) -> torch.Tensor:
    """``[B, H, C, n]`` -> ``[B, H, Lq, n]``: each query takes its cluster's row."""
    batch, heads, q_len = assignment.shape
    return torch.gather(per_cluster, 2, assignment[..., None].expand(batch, heads, q_len, per_cluster.shape[-1]))


def _cluster_segments(assignment: torch.Tensor, clusters: int, segment_size: int):
    """Queries grouped by cluster into segments of ``S = segment_size`` slots, each segment within one cluster.

    Args:
        assignment: ``[N, Lq]`` cluster of every query.

    Returns:
        ``positions`` ``[N, G, S]``, the query in each slot (``Lq`` for an unused slot), and ``segment_cluster``
        ``[N, G]``, the cluster of each segment. ``G = max_n sum_c ceil(n_c / S) <= Lq / S + C``.
    """
    n_rows, q_len = assignment.shape
    sorted_clusters, order = assignment.sort(dim=-1, stable=True)
    counts = torch.zeros(n_rows, clusters, dtype=torch.long, device=assignment.device).scatter_add_(
        1, assignment, torch.ones_like(assignment))
    cluster_start = counts.cumsum(-1) - counts  # first sorted position of each cluster
    segments = (counts + segment_size - 1) // segment_size
    segment_start = segments.cumsum(-1) - segments
    n_segments = int(segments.sum(-1).max())
    rank = torch.arange(q_len, device=assignment.device)[None, :] - cluster_start.gather(1, sorted_clusters)
    segment = segment_start.gather(1, sorted_clusters) + rank // segment_size  # [N, Lq]
    positions = torch.full((n_rows, n_segments * segment_size), q_len, dtype=torch.long, device=assignment.device)
    positions.scatter_(1, segment * segment_size + rank % segment_size, order)
    segment_cluster = torch.zeros(n_rows, n_segments, dtype=torch.long, device=assignment.device)
    segment_cluster.scatter_(1, segment, sorted_clusters)
    return positions.reshape(n_rows, n_segments, segment_size), segment_cluster


def _prepare(query, key, value, key_padding_mask, scaling, clusters, topk, hash_bits, iterations, seed, causal,
             assignment):
    check_clustered_inputs(query, key, value, clusters=clusters, topk=topk, key_padding_mask=key_padding_mask,
                           hash_bits=hash_bits, iterations=iterations, causal=causal, assignment=assignment)
    if assignment is None:
        assignment = cluster_queries(query, clusters=clusters, key_padding_mask=key_padding_mask,
                                     hash_bits=hash_bits, iterations=iterations, seed=seed)
        clusters = min(clusters, query.shape[2])
    mask = _as_bool_mask(key_padding_mask)
    keep_keys = (torch.ones(key.shape[0], key.shape[2], dtype=torch.bool, device=key.device) if mask is None
                 else mask.to(key.device))
    scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    return assignment, clusters, _query_keep(query, key_padding_mask), keep_keys, scaling


def clustered_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    clusters: int,
    key_padding_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    hash_bits: int = DEFAULT_HASH_BITS,
    iterations: int = DEFAULT_ITERATIONS,
    seed: int = 0,
    causal: bool = False,
    assignment: torch.Tensor | None = None,
) -> torch.Tensor:
    """Clustered attention: each query gets the softmax attention of its cluster's centroid (module docstring).

    Args:
        query: ``[B, H, Lq, d]``.
        key: ``[B, Hkv, Lk, d]`` with ``H % Hkv == 0``.
        value: ``[B, Hkv, Lk, dv]``.
        clusters: ``C >= 1`` clusters per (example, head); ``C >= Lq`` is exact softmax.
        key_padding_mask: ``[B, Lk]``, True/1 = token (when ``Lq == Lk`` it also marks the padded queries).
        scaling: score scale, default ``d ** -0.5``.
        hash_bits, iterations, seed: of :func:`cluster_queries`.
        causal: must be ``False`` (refused with an error: clustered attention is bidirectional only).
        assignment: ``[B, H, Lq]`` cluster indices in ``[0, C)`` to use instead of :func:`cluster_queries`.

    Returns:
        ``[B, H, Lq, dv]`` in ``value.dtype``.
    """
    assignment, clusters, keep_queries, keep_keys, scaling = _prepare(
        query, key, value, key_padding_mask, scaling, clusters, None, hash_bits, iterations, seed, causal, assignment)
    dtype, out_dtype = compute_dtype_for(query), value.dtype
    with _no_autocast(query.device.type):
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        _, cluster_outputs = _cluster_attention(query, key, value, assignment, clusters, keep_queries, keep_keys,
                                                scaling)
        out = _broadcast_to_members(cluster_outputs, assignment)
    return out.to(out_dtype)


def improved_clustered_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    clusters: int,
    topk: int,
    key_padding_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    hash_bits: int = DEFAULT_HASH_BITS,
    iterations: int = DEFAULT_ITERATIONS,
    seed: int = 0,
    causal: bool = False,
    assignment: torch.Tensor | None = None,
) -> torch.Tensor:
    """Improved clustered attention: exact scores on each cluster's top-k keys (module docstring).

    Arguments as :func:`clustered_attention`, plus ``topk`` in ``[1, Lk]`` (``topk = Lk`` is exact softmax).

    Returns:
        ``[B, H, Lq, dv]`` in ``value.dtype``.
    """
    assignment, clusters, keep_queries, keep_keys, scaling = _prepare(
        query, key, value, key_padding_mask, scaling, clusters, topk, hash_bits, iterations, seed, causal, assignment)
    dtype, out_dtype = compute_dtype_for(query), value.dtype
    batch, heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    with _no_autocast(query.device.type):
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        weights, _ = _cluster_attention(query, key, value, assignment, clusters, keep_queries, keep_keys, scaling)
        top_weights, top_index = weights.topk(topk, dim=-1)  # [B, H, C, k]
        mass = top_weights.sum(-1, keepdim=True)  # [B, H, C, 1]
        # The centroid's attention on the keys outside its top-k.
        rest = weights.scatter(-1, top_index, 0.0)
        groups = heads // kv_heads
        rest = torch.matmul(rest.reshape(batch, kv_heads, groups * clusters, k_len), value)
        rest = rest.reshape(batch, heads, clusters, value.shape[-1])
        # The top-k keys and values of every cluster, [B, H, C, k, d] (flat rows: no [B, H, Lk, d] copy for GQA).
        head_rows = (torch.arange(batch, device=query.device)[:, None] * kv_heads
                     + torch.arange(heads, device=query.device)[None, :] // groups) * k_len  # [B, H]
        rows = (head_rows[..., None, None] + top_index).reshape(-1)
        top_keys = key.reshape(-1, head_dim).index_select(0, rows).reshape(batch * heads, clusters, topk, head_dim)
        top_values = value.reshape(-1, value.shape[-1]).index_select(0, rows).reshape(
            batch * heads, clusters, topk, -1)
        top_keep = keep_keys[:, None, :].expand(batch, kv_heads, k_len).reshape(-1).index_select(0, rows).reshape(
            batch * heads, clusters, 1, topk)
        # Queries grouped by cluster into segments of equal size: one [S, d] x [d, k] matmul per segment.
        segment_size = max(1, min(MAX_SEGMENT_SIZE, -(-q_len // clusters)))
        positions, segment_cluster = _cluster_segments(assignment.reshape(batch * heads, q_len), clusters,
                                                       segment_size)  # [N, G, S], [N, G]
        n_rows, n_segments = positions.shape[:2]

        def per_segment(per_cluster):  # [N, C, ...] -> [N, G, ...]
            return per_cluster[torch.arange(n_rows, device=query.device)[:, None], segment_cluster]

        padded_queries = torch.cat([query.reshape(n_rows, q_len, head_dim), query.new_zeros(n_rows, 1, head_dim)], 1)
        flat_positions = positions.reshape(n_rows, -1, 1)
        segment_queries = torch.gather(padded_queries, 1, flat_positions.expand(-1, -1, head_dim)).reshape(
            n_rows, n_segments, segment_size, head_dim)
        scores = torch.matmul(segment_queries, per_segment(top_keys).transpose(-1, -2)) * scaling  # [N, G, S, k]
        valid = per_segment(top_keep)  # [N, G, 1, k]
        scores = scores.masked_fill(~valid, torch.finfo(dtype).min)
        probabilities = torch.softmax(scores, dim=-1) * valid
        exact = torch.matmul(probabilities, per_segment(top_values))  # [N, G, S, dv]
        segment_out = (per_segment(mass.reshape(n_rows, clusters, 1, 1)) * exact
                       + per_segment(rest.reshape(n_rows, clusters, 1, -1)))
        dv = value.shape[-1]
        out = query.new_zeros(n_rows, q_len + 1, dv).scatter(
            1, flat_positions.expand(-1, -1, dv), segment_out.reshape(n_rows, -1, dv))  # row q_len: unused slots
        out = out[:, :q_len].reshape(batch, heads, q_len, dv)
    return out.to(out_dtype)


def clustered_attention_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    clusters: int,
    topk: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    hash_bits: int = DEFAULT_HASH_BITS,
    iterations: int = DEFAULT_ITERATIONS,
    seed: int = 0,
    assignment: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``[B, H, Lq, Lk]`` weights (in ``query.dtype``) that clustered attention (``topk=None``) or improved
    clustered attention applies: ``weights @ V`` is :func:`clustered_attention` / :func:`improved_clustered_attention`
    of the same arguments (the same seeded clusters). Built on request only (``output_attentions=True``), in
    ``O(Lq Lk)`` per head.

    Clustered: query ``i`` of cluster ``c`` has its centroid's row ``A^c_c``. Improved: ``m_c`` times the softmax of
    ``scaling q_i K^T`` over the cluster's top-k keys, ``A^c_c`` on the other keys (module docstring).
    """
    value = key  # _prepare checks a value's layout; the weights do not depend on it
    assignment, clusters, keep_queries, keep_keys, scaling = _prepare(
        query, key, value, key_padding_mask, scaling, clusters, topk, hash_bits, iterations, seed, False, assignment)
    dtype, out_dtype = compute_dtype_for(query), query.dtype
    batch, heads, q_len, _ = query.shape
    with _no_autocast(query.device.type):
        query, key = query.to(dtype), key.to(dtype)
        centroid_weights, _ = _cluster_attention(query, key, key, assignment, clusters, keep_queries, keep_keys,
                                                 scaling)  # [B, H, C, Lk]
        if topk is None:
            return _broadcast_to_members(centroid_weights, assignment).to(out_dtype)
        top_weights, top_index = centroid_weights.topk(topk, dim=-1)  # [B, H, C, k]
        rest = _broadcast_to_members(centroid_weights.scatter(-1, top_index, 0.0), assignment)  # [B, H, Lq, Lk]
        mass = _broadcast_to_members(top_weights.sum(-1, keepdim=True), assignment)  # [B, H, Lq, 1]
        top_index = _broadcast_to_members(top_index, assignment)  # [B, H, Lq, k]
        keys = key.repeat_interleave(heads // key.shape[1], dim=1)  # [B, H, Lk, d]
        scores = torch.matmul(query, keys.transpose(-1, -2)).gather(-1, top_index) * scaling  # [B, H, Lq, k]
        valid = keep_keys[:, None, None, :].expand(batch, heads, q_len, key.shape[2]).gather(-1, top_index)
        probabilities = torch.softmax(scores.masked_fill(~valid, torch.finfo(dtype).min), dim=-1) * valid
        return rest.scatter_add(-1, top_index, mass * probabilities).to(out_dtype)


def refuse_causal_clustered(kind: str, layer_idx: int, causal: bool) -> None:
    """One-line :class:`ClusteredAttentionError` for a causal layer set to (improved) clustered attention."""
    if causal:
        raise ClusteredAttentionError(
            f"favor_settings attention={kind!r} is for bidirectional models (encoders) only, and layer {layer_idx} is "
            "causal (a decoder); use attention='linear' (a feature map) for causal models"
        )


def _arguments_from_settings(key, key_padding_mask, scaling, settings, layer_idx) -> dict:
    """The keyword arguments of one layer's (improved) clustered attention from its resolved settings."""
    k_len = key.shape[2]
    if key_padding_mask is not None and key_padding_mask.shape[-1] != k_len:
        raise FavorMaskError(
            f"clustered attention (layer {layer_idx}): the attention mask covers {key_padding_mask.shape[-1]} keys "
            f"but there are {k_len} keys"
        )
    arguments = dict(clusters=settings["clusters"], key_padding_mask=key_padding_mask, scaling=scaling,
                     seed=settings["seed"] + layer_idx)
    if settings["attention"] == "improved-clustered":
        arguments["topk"] = min(settings["topk"], k_len)
    return arguments


def clustered_attention_from_settings(query, key, value, key_padding_mask, scaling, settings, layer_idx) -> torch.Tensor:
    """(Improved) clustered attention of one bidirectional layer, ``[B, H, Lq, dv]``."""
    arguments = _arguments_from_settings(key, key_padding_mask, scaling, settings, layer_idx)
    if "topk" in arguments:
        return improved_clustered_attention(query, key, value, **arguments)
    return clustered_attention(query, key, value, **arguments)


def clustered_attention_weights_from_settings(query, key, key_padding_mask, scaling, settings,
                                              layer_idx) -> torch.Tensor:
    """The ``[B, H, Lq, Lk]`` weights of one bidirectional layer's (improved) clustered attention
    (:func:`clustered_attention_weights`)."""
    return clustered_attention_weights(query, key, **_arguments_from_settings(key, key_padding_mask, scaling, settings,
                                                                              layer_idx))
