"""Clustered and improved clustered attention: the fast operator against its float64 dense reference (given the
same assignment), the exact limits (C >= L, topk = L), the clustering itself (Hamming K-means), padding, GQA,
determinism, gradients, errors and the no-L x L cost."""

import time

import pytest
import torch

from hf_performer.clustered_attention import (
    ClusteredAttentionError,
    _cluster_segments,
    cluster_queries,
    clustered_attention,
    improved_clustered_attention,
)
from hf_performer.reference import (
    reference_clustered_attention,
    reference_improved_clustered_attention,
    softmax_attention,
)


def _qkv(batch=2, heads=4, kv_heads=2, length=29, d=8, dtype=torch.float64, seed=0, key_length=None):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, d, generator=generator, dtype=dtype)
    k = torch.randn(batch, kv_heads, key_length or length, d, generator=generator, dtype=dtype)
    v = torch.randn(batch, kv_heads, key_length or length, d, generator=generator, dtype=dtype)
    return q, k, v


def _right_padded(batch, length, pads):
    mask = torch.ones(batch, length, dtype=torch.bool)
    for row, count in pads:
        mask[row, length - count:] = False
    return mask


MASKS = {"none": None, "padded": _right_padded(2, 29, [(0, 6)]), "left+0/1": None}


def _mask(name):
    if name == "left+0/1":  # left padding as a 0/1 long mask
        mask = torch.ones(2, 29, dtype=torch.long)
        mask[1, :4] = 0
        return mask
    return MASKS[name]


# ---------------------------------------------------------------------------------- exact limits


@pytest.mark.parametrize("mask_name", ["none", "padded", "left+0/1"])
@pytest.mark.parametrize("clusters", [29, 40])
def test_as_many_clusters_as_queries_is_exact_softmax(mask_name, clusters):
    q, k, v = _qkv()
    mask = _mask(mask_name)
    exact = softmax_attention(q, k, v, key_padding_mask=mask)
    keep = torch.ones(2, 29, dtype=torch.bool) if mask is None else mask.bool()
    out = clustered_attention(q, k, v, clusters=clusters, key_padding_mask=mask)
    torch.testing.assert_close(out[keep[:, None, :].expand(-1, 4, -1)], exact[keep[:, None, :].expand(-1, 4, -1)],
                               rtol=1e-10, atol=1e-10)
    improved = improved_clustered_attention(q, k, v, clusters=clusters, topk=3, key_padding_mask=mask)
    torch.testing.assert_close(improved[keep[:, None].expand(-1, 4, -1)], exact[keep[:, None].expand(-1, 4, -1)],
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mask_name", ["none", "padded"])
@pytest.mark.parametrize("clusters", [1, 3, 7])
def test_improved_with_topk_equal_to_length_is_exact_softmax(mask_name, clusters):
    q, k, v = _qkv()
    mask = _mask(mask_name)
    out = improved_clustered_attention(q, k, v, clusters=clusters, topk=29, key_padding_mask=mask)
    torch.testing.assert_close(out, softmax_attention(q, k, v, key_padding_mask=mask), rtol=1e-10, atol=1e-10)
    # ... and the clustered approximation alone is not (the test can fail).
    approximate = clustered_attention(q, k, v, clusters=clusters, key_padding_mask=mask)
    assert (approximate - softmax_attention(q, k, v, key_padding_mask=mask)).abs().max() > 0.1


def test_one_cluster_attends_with_the_mean_query():
    q, k, v = _qkv(batch=1, heads=2, kv_heads=2)
    out = clustered_attention(q, k, v, clusters=1)
    mean_query = q.mean(2, keepdim=True)
    expected = softmax_attention(mean_query, k, v).expand_as(out)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------- fast == reference


@pytest.mark.parametrize("mask_name", ["none", "padded", "left+0/1"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("clusters", [1, 5, 11])
def test_matches_the_float64_reference(mask_name, kv_heads, clusters):
    q, k, v = _qkv(kv_heads=kv_heads, seed=clusters)
    mask = _mask(mask_name)
    kwargs = dict(clusters=clusters, key_padding_mask=mask, hash_bits=17, iterations=3, seed=5)
    torch.testing.assert_close(clustered_attention(q, k, v, **kwargs), reference_clustered_attention(q, k, v, **kwargs),
                               rtol=1e-10, atol=1e-10)
    for topk in (1, 4, 13):
        torch.testing.assert_close(improved_clustered_attention(q, k, v, topk=topk, **kwargs),
                                   reference_improved_clustered_attention(q, k, v, topk=topk, **kwargs),
                                   rtol=1e-10, atol=1e-10, msg=f"topk={topk}")


@pytest.mark.parametrize("improved", [False, True])
def test_attention_math_for_an_arbitrary_assignment(improved):
    # Unbalanced clusters (one with most queries, empty ones), cross-attention (Lq != Lk), a non-default scale.
    q, k, v = _qkv(length=70, key_length=23, seed=3)
    generator = torch.Generator().manual_seed(1)
    assignment = torch.where(torch.rand(2, 4, 70, generator=generator) < 0.7, 0,
                             torch.randint(0, 9, (2, 4, 70), generator=generator))
    assignment[..., 0] = 9  # cluster 9 has one member; some of 1..8 may be empty
    kwargs = dict(clusters=10, assignment=assignment, scaling=0.7, key_padding_mask=_right_padded(2, 23, [(1, 5)]))
    if improved:
        fast = improved_clustered_attention(q, k, v, topk=6, **kwargs)
        ref = reference_improved_clustered_attention(q, k, v, topk=6, **kwargs)
    else:
        fast, ref = clustered_attention(q, k, v, **kwargs), reference_clustered_attention(q, k, v, **kwargs)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)


def test_float32_and_bfloat16_match_the_reference():
    q, k, v = _qkv(length=64, d=16, seed=2)
    assignment = cluster_queries(q, clusters=6)
    ref = reference_improved_clustered_attention(q, k, v, clusters=6, topk=8, assignment=assignment)
    out32 = improved_clustered_attention(q.float(), k.float(), v.float(), clusters=6, topk=8, assignment=assignment)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), ref, rtol=1e-5, atol=1e-5)
    out16 = improved_clustered_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), clusters=6, topk=8,
                                         assignment=assignment)
    assert out16.dtype == torch.bfloat16
    assert (out16.double() - ref).abs().max() < 0.05


def test_gradients_match_the_reference():
    q, k, v = _qkv(batch=1, length=17, seed=4)
    assignment = cluster_queries(q, clusters=4)
    for fast, slow, extra in ((clustered_attention, reference_clustered_attention, {}),
                              (improved_clustered_attention, reference_improved_clustered_attention, {"topk": 5})):
        grads = []
        for function in (fast, slow):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            function(*inputs, clusters=4, assignment=assignment, **extra).square().sum().backward()
            grads.append([t.grad for t in inputs])
        for fast_grad, slow_grad in zip(*grads):
            torch.testing.assert_close(fast_grad, slow_grad, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------------- clustering


def _hamming_kmeans_loop(query, clusters, hash_bits, iterations, seed, keep):
    """Lloyd's K-means on LSH bits written as plain loops over (example, head, query, cluster)."""
    generator = torch.Generator().manual_seed(seed)
    planes = torch.randn(query.shape[-1], hash_bits, generator=generator, dtype=torch.float64)
    batch, heads, length, _ = query.shape
    result = torch.zeros(batch, heads, length, dtype=torch.long)
    for b in range(batch):
        valid = [i for i in range(length) if keep[b, i]]
        starts = [valid[(c * len(valid)) // clusters] for c in range(clusters)]
        for h in range(heads):
            bits = [tuple(int(x) for x in (query[b, h, i].double() @ planes > 0)) for i in range(length)]
            centres = [bits[i] for i in starts]
            for step in range(iterations + 1):
                nearest = [min(range(clusters), key=lambda c: (sum(x != y for x, y in zip(bits[i], centres[c])), c))
                           for i in range(length)]
                if step == iterations:
                    break
                for c in range(clusters):
                    members = [bits[i] for i in valid if nearest[i] == c]
                    if members:
                        centres[c] = tuple(int(2 * sum(column) > len(members)) for column in zip(*members))
            result[b, h] = torch.tensor(nearest)
    return result


@pytest.mark.parametrize("iterations", [0, 1, 4])
def test_cluster_queries_is_lloyd_kmeans_in_hamming_space(iterations):
    q, _, _ = _qkv(batch=2, heads=2, kv_heads=2, length=31, seed=7)
    mask = _right_padded(2, 31, [(1, 9)])
    fast = cluster_queries(q, clusters=5, key_padding_mask=mask, hash_bits=12, iterations=iterations, seed=3)
    slow = _hamming_kmeans_loop(q, 5, 12, iterations, 3, mask)
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("shuffled", [False, True])
def test_close_queries_share_a_cluster(shuffled):
    # Four tight groups of 10 queries. In order, the evenly spaced initial centres fall one in each group and Lloyd
    # recovers the groups exactly; shuffled, two initial centres may share a group (a local optimum merges two
    # groups), but close queries still never split.
    generator = torch.Generator().manual_seed(0)
    centres = 5 * torch.randn(4, 16, generator=generator)
    labels = torch.arange(4).repeat_interleave(10)
    if shuffled:
        labels = labels[torch.randperm(40, generator=generator)]
    q = (centres[labels] + 0.01 * torch.randn(40, 16, generator=generator))[None, None]
    assignment = cluster_queries(q, clusters=4)[0, 0]
    groups = [tuple(assignment[labels == label].unique().tolist()) for label in range(4)]
    assert all(len(group) == 1 for group in groups)
    if not shuffled:
        assert len(set(groups)) == 4


def test_padded_queries_do_not_move_the_clusters():
    q, _, _ = _qkv(batch=1, heads=2, kv_heads=2, length=20, seed=8)
    mask = _right_padded(1, 20, [(0, 5)])
    noisy = q.clone()
    noisy[:, :, 15:] = 100 * torch.randn(1, 2, 5, 8, dtype=torch.float64)
    a = cluster_queries(q, clusters=4, key_padding_mask=mask)
    b = cluster_queries(noisy, clusters=4, key_padding_mask=mask)
    assert torch.equal(a[..., :15], b[..., :15])


def test_deterministic_and_seeded():
    q, k, v = _qkv(length=64, seed=9)
    first = improved_clustered_attention(q, k, v, clusters=6, topk=4, seed=1)
    torch.manual_seed(123)  # the global RNG plays no part
    assert torch.equal(first, improved_clustered_attention(q, k, v, clusters=6, topk=4, seed=1))
    assert not torch.equal(cluster_queries(q, clusters=6, seed=1), cluster_queries(q, clusters=6, seed=2))


def test_cluster_segments_cover_every_query_once_within_its_cluster():
    generator = torch.Generator().manual_seed(0)
    assignment = torch.randint(0, 5, (3, 40), generator=generator)
    assignment[0] = 2  # one cluster holds everything
    positions, segment_cluster = _cluster_segments(assignment, 5, 4)
    for row in range(3):
        used = positions[row][positions[row] < 40]
        assert sorted(used.tolist()) == list(range(40))
        for segment in range(positions.shape[1]):
            members = positions[row, segment][positions[row, segment] < 40]
            assert bool((assignment[row, members] == segment_cluster[row, segment]).all())


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs, message", [
    (dict(clusters=0), "clusters must be an int >= 1"),
    (dict(clusters=-3), "clusters must be an int >= 1"),
    (dict(clusters=2.5), "clusters must be an int >= 1"),
    (dict(clusters=4, topk=30), r"topk must be an int in \[1, key length = 29\]; got 30"),
    (dict(clusters=4, topk=0), r"topk must be an int in \[1, key length = 29\]; got 0"),
    (dict(clusters=4, topk=2, causal=True), "clustered attention is bidirectional only"),
    (dict(clusters=4, topk=2, hash_bits=0), "hash_bits must be an int >= 1"),
    (dict(clusters=4, topk=2, key_padding_mask=torch.ones(2, 5)), r"key_padding_mask must have shape \[batch"),
])
def test_bad_input_is_a_one_line_error(kwargs, message):
    q, k, v = _qkv()
    function = improved_clustered_attention if "topk" in kwargs else clustered_attention
    with pytest.raises(ClusteredAttentionError, match=message) as error:
        function(q, k, v, **kwargs)
    assert "\n" not in str(error.value)
    with pytest.raises(ClusteredAttentionError, match=message):  # the references refuse the same input
        (reference_improved_clustered_attention if "topk" in kwargs else reference_clustered_attention)(
            q, k, v, **kwargs)


def test_causal_use_is_refused_by_both_kinds():
    q, k, v = _qkv()
    for call in (lambda: clustered_attention(q, k, v, clusters=3, causal=True),
                 lambda: improved_clustered_attention(q, k, v, clusters=3, topk=2, causal=True)):
        with pytest.raises(ClusteredAttentionError, match="bidirectional only"):
            call()


# ---------------------------------------------------------------------------------- cost


def test_never_builds_a_length_by_length_tensor():
    # At L = 16k an [L, L] float32 score matrix per head is 1 GiB: a quick run at small d shows it is never built.
    length = 16384
    q, k, v = _qkv(batch=1, heads=1, kv_heads=1, length=length, d=4, dtype=torch.float32, seed=0)
    largest = []
    start = time.perf_counter()
    with torch.profiler.profile(profile_memory=True, record_shapes=True) as profile:
        out = improved_clustered_attention(q, k, v, clusters=100, topk=32)
    elapsed = time.perf_counter() - start
    assert out.shape == (1, 1, length, 4) and torch.isfinite(out).all()
    for event in profile.key_averages(group_by_input_shape=True):
        for shape in event.input_shapes or []:
            if shape:
                largest.append(torch.Size(shape).numel())
    assert max(largest) <= 128 * length  # [C, L] and [L, C] are the largest tensors, never [L, L]
    assert elapsed < 30
