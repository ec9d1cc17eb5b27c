"""Kernel level: packed sequences (segment_ids) and the attention weights of output_attentions, against the float64
references and against running each sequence alone."""

import pytest
import torch

from hf_performer import LinearAttentionError, linear_attention, make_feature_map
from hf_performer.attention_weights import linear_attention_weights, softmax_attention_weights
from hf_performer.linear_attention import segment_bounds
from hf_performer.reference import reference_linear_attention, reference_linear_attention_scores, softmax_attention

MAPS = ["favor+", "trig", "relu", "elu+1", "hedgehog"]


def _map(name, d=8, m=32):
    if name == "hedgehog":
        return make_feature_map(name, d, num_heads=4, num_key_value_heads=2)
    return make_feature_map(name, d, nb_features=None if name == "elu+1" else m)


def _qkv(batch=2, heads=4, kv_heads=2, length=13, d=8, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, d, generator=generator, dtype=dtype)
    k = torch.randn(batch, kv_heads, length, d, generator=generator, dtype=dtype)
    v = torch.randn(batch, kv_heads, length, d, generator=generator, dtype=dtype)
    return q, k, v


SEGMENTS = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7]])


def test_segment_bounds_are_the_runs_of_equal_ids():
    assert segment_bounds(SEGMENTS) == [[(0, 4), (4, 9), (9, 13)], [(0, 7), (7, 13)]]


@pytest.mark.parametrize("name", MAPS)
def test_packed_causal_attention_matches_the_float64_reference_and_each_sequence_alone(name):
    q, k, v = _qkv(dtype=torch.float64)
    fm = _map(name).double()
    out = linear_attention(q, k, v, fm, causal=True, segment_ids=SEGMENTS, chunk_size=3)
    ref = reference_linear_attention(q, k, v, fm, causal=True, segment_ids=SEGMENTS)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    for row, bounds in enumerate(segment_bounds(SEGMENTS)):
        for start, end in bounds:
            alone = linear_attention(*(t[row : row + 1, :, start:end] for t in (q, k, v)), fm, causal=True)
            torch.testing.assert_close(out[row : row + 1, :, start:end], alone, rtol=1e-12, atol=1e-12)


def test_packed_attention_gradients_and_padding_match_the_reference():
    q, k, v = (t.requires_grad_() for t in _qkv(dtype=torch.float64, length=9, batch=1))
    segments = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2, 2]])
    padding = torch.ones(1, 9, dtype=torch.bool)
    padding[0, 2] = False
    fm = _map("favor+").double()
    weights = torch.randn(1, 4, 9, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out = linear_attention(q, k, v, fm, causal=True, segment_ids=segments, key_padding_mask=padding, chunk_size=2)
    ref = reference_linear_attention(q, k, v, fm, causal=True, segment_ids=segments, key_padding_mask=padding)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-8, atol=1e-9)


def test_packed_attention_redraws_once_per_call():
    fm = make_feature_map("favor+", 8, nb_features=16, redraw_interval=1).train()
    q, k, v = _qkv(batch=1, heads=2, kv_heads=2)
    linear_attention(q, k, v, fm, causal=True, segment_ids=SEGMENTS[:1])
    linear_attention(q, k, v, fm, causal=True, segment_ids=SEGMENTS[:1])
    assert int(fm.redraws) == 1  # first call draws nothing (calls 0 -> 1), second redraws once


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(causal=False), "causal"),
        (dict(causal=True, return_state=True), "return_state"),
        (dict(causal=True, segment_ids=torch.zeros(2, 5, dtype=torch.long)), "shape"),
        (dict(causal=True, segment_ids=torch.zeros(2, 13)), "integer"),
    ],
)
def test_packed_attention_errors(kwargs, message):
    q, k, v = _qkv()
    kwargs = {"segment_ids": SEGMENTS, **kwargs}
    with pytest.raises(LinearAttentionError, match=message):
        linear_attention(q, k, v, _map("favor+"), **kwargs)


# ---------------------------------------------------------------------------------- attention weights


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("causal", [False, True])
def test_linear_weights_times_values_is_the_kernel_output(name, causal):
    q, k, v = _qkv(length=11)
    q, k = 2 * q, 2 * k  # large logits: the stabilisers matter
    fm = _map(name)
    padding = torch.ones(2, 11, dtype=torch.bool)
    padding[1, :3] = False
    out = linear_attention(q, k, v, fm, causal=causal, key_padding_mask=padding, scaling=0.3)
    weights = linear_attention_weights(q, k, fm, causal=causal, key_padding_mask=padding, scaling=0.3)
    assert weights.shape == (2, 4, 11, 11)
    applied = weights @ v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(applied, out, rtol=1e-4, atol=1e-5)
    assert bool((weights[1, :, :, :3] == 0).all())  # padded keys get no weight
    if causal:
        assert bool((weights.triu(1) == 0).all())


@pytest.mark.parametrize("causal", [False, True])
def test_linear_weights_match_the_float64_reference(causal):
    q, k, _ = _qkv(dtype=torch.float64, length=9)
    fm = _map("favor+").double()
    weights = linear_attention_weights(q, k, fm, causal=causal, segment_ids=SEGMENTS[:, :9] if causal else None)
    scores = reference_linear_attention_scores(q, k, fm, causal=causal, segment_ids=SEGMENTS[:, :9] if causal else None)
    torch.testing.assert_close(weights, scores / scores.sum(-1, keepdim=True), rtol=1e-10, atol=1e-12)


def test_linear_weights_of_the_last_queries_are_the_last_rows():
    q, k, _ = _qkv(length=9)
    fm = _map("favor+")
    full = linear_attention_weights(q, k, fm, causal=True)
    last = linear_attention_weights(q[:, :, -2:], k, fm, causal=True)
    torch.testing.assert_close(last, full[:, :, -2:])


def test_softmax_weights_match_the_float64_reference():
    q, k, v = _qkv(length=7)
    weights = softmax_attention_weights(q, k, None, causal=True, scaling=0.5)
    torch.testing.assert_close(
        (weights.double() @ v.double().repeat_interleave(2, dim=1)),
        softmax_attention(q, k, v, causal=True, scaling=0.5),
        rtol=1e-5, atol=1e-6,
    )


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("learned", [False, True], ids=["calibrated", "learned"])
def test_window_weights_times_values_is_the_window_kernel_output(causal, learned):
    from hf_performer import window_linear_attention
    from hf_performer.attention_weights import window_attention_weights
    from hf_performer.reference import reference_window_linear_attention

    q, k, v = _qkv(length=12)
    fm = _map("favor+")
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[1, -3:] = False
    gamma = torch.tensor([0.2, 0.5, 0.7, 0.9]) if learned else None
    kwargs = dict(window=3, sinks=2, causal=causal, softmax_weight=gamma, key_padding_mask=padding, scaling=0.4)
    weights = window_attention_weights(q, k, v, fm, **kwargs)
    assert weights.shape == (2, 4, 12, 12) and bool((weights[1, :, :, -3:] == 0).all())
    applied = weights @ v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(applied, window_linear_attention(q, k, v, fm, chunk_size=5, **kwargs), rtol=1e-4,
                               atol=1e-5)
    weights64 = window_attention_weights(q.double(), k.double(), v.double(), fm.double(), **kwargs)
    torch.testing.assert_close(
        weights64 @ v.double().repeat_interleave(2, dim=1),
        reference_window_linear_attention(q.double(), k.double(), v.double(), fm, **kwargs),
        rtol=1e-9, atol=1e-10,
    )


def test_segment_rows_group_similar_lengths_and_round_trip():
    """SegmentRows: sequences of similar lengths share a group, padded by at most GROUP_PADDING of its tokens;
    split then merge gives the packed tensor back (padding positions 0), with gradients."""
    from hf_performer.packed_sequences import GROUP_PADDING, SegmentRows, _length_groups

    assert _length_groups([6, 4, 3], 0.25) == [[0, 1], [2]]
    assert _length_groups([5, 5, 5], 0.0) == [[0, 1, 2]]
    assert _length_groups([1000, 10, 9, 10], 0.25) == [[0], [1, 3, 2]]
    assert _length_groups([3, 9], None) == [[1, 0]] and _length_groups([], 0.25) == [[]]
    lengths = [[700, 40, 35], [300, 300, 8, 0]]  # two packed rows (the second ends with padding)
    segment_ids = torch.zeros(2, 775, dtype=torch.long)
    for row, row_lengths in enumerate(lengths):
        start = 0
        for index, n in enumerate(row_lengths):
            segment_ids[row, start:start + n] = index + 1 if n else 0
            start += n
    rows = SegmentRows(segment_ids)  # sequences 700, 40, 35 | 300, 300, 8
    assert rows.groups == [[0], [3, 4], [1, 2], [5]] and rows.lengths == [700, 300, 40, 8]
    tokens = int((segment_ids != 0).sum())
    padded_positions = sum(len(group) * length for group, length in zip(rows.groups, rows.lengths))
    assert padded_positions == tokens + 5 <= (1 + GROUP_PADDING) * tokens  # one group: 6 rows of 700
    x = torch.randn(2, 3, 775, 4, requires_grad=True)
    pieces = [rows.split(x, g) for g in range(len(rows.groups))]
    assert [piece.shape for piece in pieces] == [(1, 3, 700, 4), (2, 3, 300, 4), (2, 3, 40, 4), (1, 3, 8, 4)]
    assert [rows.key_padding_mask(g) is None for g in range(4)] == [True, True, False, True]
    assert rows.key_padding_mask(2).sum(-1).tolist() == [40, 35]
    torch.testing.assert_close(pieces[2][1, :, :35], x[0, :, 740:775].detach())
    assert bool((pieces[2][1, :, 35:] == 0).all())
    merged = rows.merge([piece.transpose(1, 2) for piece in pieces])
    expected = (x * (segment_ids != 0)[:, None, :, None]).transpose(1, 2)
    assert torch.equal(merged, expected)
    merged.sum().backward()
    assert torch.equal(x.grad, (segment_ids != 0)[:, None, :, None].expand_as(x).float())
