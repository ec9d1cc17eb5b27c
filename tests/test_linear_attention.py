"""Linear-attention kernels against the float64 references, invariances, numerics, gradients, errors."""

import pytest
import torch

from hf_performer import LinearAttentionError, linear_attention, make_feature_map
from hf_performer.reference import (
    reference_linear_attention,
    reference_recurrent_linear_attention,
    softmax_attention,
)

MAPS = ["favor+", "trig", "relu", "elu+1"]


def _map(name, d, m=32, **kwargs):
    return make_feature_map(name, d, nb_features=None if name == "elu+1" else m, **kwargs)


def _qkv(batch=2, heads=3, length=21, d=8, kv_heads=None, dtype=torch.float32, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    kv_heads = kv_heads or heads
    q = scale * torch.randn(batch, heads, length, d, generator=generator, dtype=dtype)
    k = scale * torch.randn(batch, kv_heads, length, d, generator=generator, dtype=dtype)
    v = torch.randn(batch, kv_heads, length, d, generator=generator, dtype=dtype)
    return q, k, v


def _padding_mask(batch, length, left=(), right=()):
    mask = torch.ones(batch, length, dtype=torch.bool)
    for row, count in left:
        mask[row, :count] = False
    for row, count in right:
        mask[row, length - count :] = False
    return mask


# ---------------------------------------------------------------------------------- fast == reference


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_fast_paths_match_the_float64_reference(name, causal, masked):
    # float64 inputs run the kernels in float64, so any disagreement is a bug, not rounding.
    q, k, v = _qkv(dtype=torch.float64)
    fm = _map(name, 8).double()
    mask = _padding_mask(2, 21, right=[(0, 6)], left=[(1, 4)]) if masked else None
    out = linear_attention(q, k, v, fm, causal=causal, key_padding_mask=mask, chunk_size=5)
    ref = reference_linear_attention(q, k, v, fm, causal=causal, key_padding_mask=mask)
    if causal and masked:  # queries before the first real key of a left-padded row have no keys
        valid = _padding_mask(2, 21, left=[(1, 4)])[:, None, :, None]
        out, ref = out * valid, ref.nan_to_num() * valid
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("causal", [False, True])
def test_float32_fast_paths_match_reference(causal):
    q, k, v = _qkv()
    fm = _map("favor+", 8)
    out = linear_attention(q, k, v, fm, causal=causal)
    ref = reference_linear_attention(q, k, v, fm, causal=causal)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_attention_matches_repeated_heads(causal):
    q, k, v = _qkv(heads=4, kv_heads=2, dtype=torch.float64)
    fm = _map("favor+", 8).double()
    out = linear_attention(q, k, v, fm, causal=causal)
    repeated = linear_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), fm, causal=causal)
    torch.testing.assert_close(out, repeated)
    torch.testing.assert_close(out, reference_linear_attention(q, k, v, fm, causal=causal))


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 64])
def test_chunked_equals_recurrent_equals_reference(name, chunk_size):
    q, k, v = _qkv(length=23, dtype=torch.float64)
    fm = _map(name, 8).double()
    chunked = linear_attention(q, k, v, fm, causal=True, chunk_size=chunk_size)
    recurrent = reference_recurrent_linear_attention(q, k, v, fm)
    torch.testing.assert_close(chunked, recurrent, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(recurrent, reference_linear_attention(q, k, v, fm, causal=True))


@pytest.mark.parametrize("name", MAPS)
def test_prefill_then_decode_equals_one_pass(name):
    q, k, v = _qkv(length=30)
    fm = _map(name, 8)
    full, full_state = linear_attention(q, k, v, fm, causal=True, return_state=True, chunk_size=8)
    out, state = linear_attention(q[:, :, :17], k[:, :, :17], v[:, :, :17], fm, causal=True, return_state=True)
    pieces = [out]
    for t in range(17, 30):  # one token at a time, the recurrent step
        step, state = linear_attention(
            q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], fm,
            causal=True, initial_state=state, return_state=True,
        )
        pieces.append(step)
    tolerance = dict(rtol=1e-4, atol=1e-4) if name == "trig" else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(pieces, dim=2), full, **tolerance)
    for got, expected in zip(state, full_state):
        torch.testing.assert_close(got, expected, **tolerance)


def test_state_reorder_selects_batch_rows():
    q, k, v = _qkv(batch=3)
    _, state = linear_attention(q, k, v, _map("favor+", 8), causal=True, return_state=True)
    reordered = state.reorder(torch.tensor([2, 0]))
    assert torch.equal(reordered.kv, state.kv[[2, 0]]) and torch.equal(reordered.stabilizer, state.stabilizer[[2, 0]])


# ---------------------------------------------------------------------------------- approximation


def _favor_error(d, m, orthogonal, seeds, length=64, scale=0.6):
    torch.manual_seed(1234)
    q, k, v = (scale * torch.randn(1, 1, length, d, dtype=torch.float64) for _ in range(3))
    exact = softmax_attention(q, k, v)
    errors = []
    for seed in seeds:
        fm = make_feature_map("favor+", d, nb_features=m, orthogonal=orthogonal, seed=seed).double()
        errors.append((linear_attention(q, k, v, fm) - exact).square().mean())
    return torch.stack(errors).mean().item()


def test_favor_converges_to_softmax_as_features_grow():
    errors = [_favor_error(64, m, True, range(6)) for m in (16, 64, 256, 1024)]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < errors[0] / 8


def test_orthogonal_features_beat_iid_features():
    # The variance reduction of orthogonal rows is largest for moderate input norms (measured on
    # 30 seeds: ~0.67x the iid error at this scale, ~0.85x at scale 0.6).
    seeds = range(30)
    for m in (64, 128):
        assert _favor_error(64, m, True, seeds, scale=0.3) < 0.8 * _favor_error(64, m, False, seeds, scale=0.3)


def test_temperature_is_reproduced_exactly():
    torch.manual_seed(0)
    q, k, v = (0.5 * torch.randn(1, 1, 32, 16, dtype=torch.float64) for _ in range(3))
    fm = make_feature_map("favor+", 16, nb_features=4096).double()
    for scaling in (0.1, 0.25, 0.5):
        approx = linear_attention(q, k, v, fm, scaling=scaling)
        right = (approx - softmax_attention(q, k, v, scaling=scaling)).abs().mean()
        wrong = (approx - softmax_attention(q, k, v, scaling=2 * scaling)).abs().mean()
        assert right < 0.5 * wrong


# ---------------------------------------------------------------------------------- invariances


@pytest.mark.parametrize("causal", [False, True])
def test_padding_invariance_right_left_and_batch_of_one(causal):
    fm = _map("favor+", 8)
    q, k, v = _qkv(batch=1, length=16)
    alone = linear_attention(q, k, v, fm, causal=causal)
    pad = 5
    garbage = lambda t: 50 * torch.randn(1, t.shape[1], pad, t.shape[3])  # noqa: E731  large-norm pads
    for side in ("right", "left"):
        join = (lambda t: torch.cat([t, garbage(t)], 2)) if side == "right" else (lambda t: torch.cat([garbage(t), t], 2))
        mask = _padding_mask(1, 16 + pad, **({"right": [(0, pad)]} if side == "right" else {"left": [(0, pad)]}))
        out = linear_attention(join(q), join(k), join(v), fm, causal=causal, key_padding_mask=mask)
        real = out[:, :, :16] if side == "right" else out[:, :, pad:]
        torch.testing.assert_close(real, alone, rtol=1e-5, atol=1e-6)
    # In a batch next to a longer unpadded row.
    q2, k2, v2 = _qkv(batch=1, length=16 + pad, seed=9)
    batch = [torch.cat([torch.cat([a, torch.zeros_like(b[:, :, :pad])], 2), b]) for a, b in ((q, q2), (k, k2), (v, v2))]
    mask = torch.cat([_padding_mask(1, 16 + pad, right=[(0, pad)]), _padding_mask(1, 16 + pad)])
    out = linear_attention(*batch, fm, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out[:1, :, :16], alone, rtol=1e-5, atol=1e-6)


def test_integer_padding_masks_are_accepted():
    q, k, v = _qkv()
    fm = _map("favor+", 8)
    mask = _padding_mask(2, 21, right=[(0, 3)])
    torch.testing.assert_close(
        linear_attention(q, k, v, fm, key_padding_mask=mask.long()),
        linear_attention(q, k, v, fm, key_padding_mask=mask),
    )


@pytest.mark.parametrize("causal", [False, True])
def test_batch_invariance(causal):
    fm = _map("favor+", 8)
    q, k, v = _qkv(batch=1)
    alone = linear_attention(q, k, v, fm, causal=causal)
    big = [20 * t for t in _qkv(batch=1, seed=3)]  # a neighbour with huge logits
    out = linear_attention(*(torch.cat([a, b]) for a, b in zip((q, k, v), big)), fm, causal=causal)
    torch.testing.assert_close(out[:1], alone)


@pytest.mark.parametrize("name", MAPS)
def test_causal_prefix_invariance_even_with_huge_future_tokens(name):
    fm = _map(name, 8)
    q, k, v = _qkv(length=40)
    prefix = linear_attention(q[:, :, :25], k[:, :, :25], v[:, :, :25], fm, causal=True)
    k_future = k.clone()
    k_future[:, :, 25:] *= 30  # would dominate a sequence-wide stabiliser
    out = linear_attention(q, k_future, v, fm, causal=True)
    torch.testing.assert_close(out[:, :, :25], prefix, rtol=1e-5, atol=1e-6)


def test_eval_is_deterministic_and_training_redraws():
    fm = make_feature_map("favor+", 8, nb_features=32, redraw_interval=1)
    q, k, v = _qkv()
    fm.eval()
    first = linear_attention(q, k, v, fm)
    assert torch.equal(linear_attention(q, k, v, fm), first)
    fm.train()
    linear_attention(q, k, v, fm)
    second = linear_attention(q, k, v, fm)
    assert not torch.equal(second, first)


# ---------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_autocast_long_inputs_with_large_norms_stay_finite(dtype, causal):
    length, d = 16384, 64
    generator = torch.Generator().manual_seed(0)
    q = (8 * torch.randn(1, 2, length, d, generator=generator)).to(dtype)
    k = (8 * torch.randn(1, 2, length, d, generator=generator)).to(dtype)
    v = torch.randn(1, 2, length, d, generator=generator).to(dtype)
    fm = make_feature_map("favor+", d, nb_features=64)
    with torch.autocast("cpu", dtype=dtype):
        out = linear_attention(q, k, v, fm, causal=causal, chunk_size=256)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    # fp32 sums: the half-precision run agrees with the fp32 run on the same rounded inputs.
    expected = linear_attention(q.float(), k.float(), v.float(), fm, causal=causal, chunk_size=256)
    assert (out.float() - expected).abs().max() < 0.05


def test_half_inputs_without_autocast_compute_in_float32():
    q, k, v = (t.half() for t in _qkv(scale=10))
    out = linear_attention(q, k, v, _map("favor+", 8), causal=True)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()


# ---------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(name, causal):
    q, k, v = (t.requires_grad_() for t in _qkv(batch=2, heads=1, length=7, d=4, dtype=torch.float64))
    fm = _map(name, 4, m=8).double()
    mask = _padding_mask(2, 7, right=[(0, 2)])
    fn = lambda q, k, v: linear_attention(q, k, v, fm, causal=causal, key_padding_mask=mask, chunk_size=3)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_gradcheck_through_the_recurrent_state():
    q, k, v = (t.requires_grad_() for t in _qkv(batch=1, heads=1, length=11, d=4, dtype=torch.float64))
    fm = _map("favor+", 4, m=8).double()

    def two_calls(q, k, v):
        first, state = linear_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], fm, causal=True, return_state=True, chunk_size=4)
        second = linear_attention(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], fm, causal=True, initial_state=state, chunk_size=3)
        return torch.cat([first, second], dim=2)

    assert torch.autograd.gradcheck(two_calls, (q, k, v))


def test_gradients_flow_to_trainable_feature_maps():
    fm = _map("relu", 4, m=8)
    fm.projection = torch.nn.Parameter(fm.projection.clone())  # a learnable projection
    q, k, v = _qkv(batch=1, heads=1, length=6, d=4)
    linear_attention(q, k, v, fm, causal=True).sum().backward()
    assert fm.projection.grad is not None and fm.projection.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------- errors


def test_clear_errors_for_bad_inputs():
    fm = _map("favor+", 8)
    q, k, v = _qkv()
    with pytest.raises(LinearAttentionError, match=r"\[batch, heads, length, head_dim\]"):
        linear_attention(q[0], k, v, fm)
    with pytest.raises(LinearAttentionError, match="head_dim=16"):
        linear_attention(q, k, v, _map("favor+", 16))
    with pytest.raises(LinearAttentionError, match="multiple of key/value heads"):
        linear_attention(q, k[:, :2], v[:, :2], fm)
    with pytest.raises(LinearAttentionError, match="2-D key padding mask"):
        linear_attention(q, k, v, fm, key_padding_mask=torch.ones(2, 1, 21, 21, dtype=torch.bool))
    with pytest.raises(LinearAttentionError, match="only 0 \\(padding\\) and 1"):
        linear_attention(q, k, v, fm, key_padding_mask=torch.zeros(2, 21).masked_fill(torch.rand(2, 21) > 0.5, float("-inf")))
    with pytest.raises(LinearAttentionError, match="as many queries as keys"):
        linear_attention(q[:, :, :3], k, v, fm, causal=True)
    with pytest.raises(LinearAttentionError, match="only meaningful for causal"):
        linear_attention(q, k, v, fm, return_state=True)
    with pytest.raises(LinearAttentionError, match="chunk_size"):
        linear_attention(q, k, v, fm, causal=True, chunk_size=0)


@pytest.mark.parametrize("causal", [False, True])
def test_recompute_features_is_accepted_and_changes_nothing(causal):
    # Features are always recomputed in the backward now (issue 17); the keyword stays for compatibility.
    fm = _map("favor+", 8)
    q, k, v = (t.requires_grad_() for t in _qkv())
    mask = _padding_mask(2, 21, right=[(0, 4)])
    results = []
    for recompute in (False, True):
        out = linear_attention(q, k, v, fm, causal=causal, key_padding_mask=mask, recompute_features=recompute)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_decoding_step_gradients_and_a_growing_stabiliser():
    q, k, v = (t.requires_grad_() for t in _qkv(batch=1, heads=2, length=6, d=4, dtype=torch.float64))
    fm = _map("favor+", 4, m=8).double()

    def prefill_then_step(q, k, v):
        first, state = linear_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], fm, causal=True, return_state=True)
        step = linear_attention(q[:, :, 5:], 3 * k[:, :, 5:], v[:, :, 5:], fm, causal=True, initial_state=state)
        return torch.cat([first, step], dim=2)

    assert torch.autograd.gradcheck(prefill_then_step, (q, k, v))
    k_big = torch.cat([k[:, :, :5], 3 * k[:, :, 5:]], dim=2)
    torch.testing.assert_close(prefill_then_step(q, k, v), reference_linear_attention(q, k_big, v, fm, causal=True))


def test_a_padding_token_leaves_the_decoding_state_unchanged():
    q, k, v = _qkv(batch=2, length=8)
    fm = _map("favor+", 8)
    _, state = linear_attention(q[:, :, :7], k[:, :, :7], v[:, :, :7], fm, causal=True, return_state=True)
    mask = torch.tensor([[True], [False]])
    _, new = linear_attention(q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], fm, causal=True, initial_state=state,
                              key_padding_mask=mask, return_state=True)
    torch.testing.assert_close(new.kv[1], state.kv[1])
    torch.testing.assert_close(new.k_sum[1], state.k_sum[1])
    assert not torch.allclose(new.kv[0], state.kv[0])
