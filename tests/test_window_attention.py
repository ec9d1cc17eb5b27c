"""Sink + sliding-window softmax with a linear tail: the chunked operator against its float64 reference,
limits (exact softmax, plain linear attention), padding, invariances, numerics, gradients, errors."""


import pytest
import torch
import torch.nn.functional as F

from hf_performer import linear_attention, make_feature_map, window_linear_attention
from hf_performer.reference import reference_window_linear_attention, softmax_attention

MAPS = ["favor+", "trig", "relu", "elu+1", "hedgehog"]
GAMMA = torch.tensor([0.1, 0.5, 0.9, 0.3], dtype=torch.float64)


def _map(name, d, m=16, heads=4, kv_heads=2):
    if name == "hedgehog":
        return make_feature_map(name, d, num_heads=heads, num_key_value_heads=kv_heads)
    return make_feature_map(name, d, nb_features=None if name == "elu+1" else m)


def _qkv(batch=2, heads=4, kv_heads=2, length=23, d=8, dtype=torch.float64, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    q = scale * torch.randn(batch, heads, length, d, generator=generator, dtype=dtype)
    k = scale * torch.randn(batch, kv_heads, length, d, generator=generator, dtype=dtype)
    v = torch.randn(batch, kv_heads, length, d, generator=generator, dtype=dtype)
    return q, k, v


def _right_padded(batch, length, pads):
    mask = torch.ones(batch, length, dtype=torch.bool)
    for row, count in pads:
        mask[row, length - count :] = False
    return mask


# ---------------------------------------------------------------------------------- fast == reference


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("learned", [False, True])
def test_matches_the_float64_reference(name, causal, learned):
    # float64 inputs run in float64: disagreement is a bug. L=23 with chunk 5: a ragged last block; GQA 4/2 heads.
    q, k, v = _qkv()
    fm = _map(name, 8).double()
    gamma = GAMMA if learned else None
    mask = _right_padded(2, 23, [(0, 5)])
    for window, sinks in [(0, 0), (1, 0), (1, 2), (3, 0), (4, 3), (7, 1), (23, 0), (40, 4), (0, 3)]:
        kwargs = dict(window=window, sinks=sinks, causal=causal, softmax_weight=gamma, key_padding_mask=mask)
        out = window_linear_attention(q, k, v, fm, chunk_size=5, **kwargs)
        ref = reference_window_linear_attention(q, k, v, fm, **kwargs)
        torch.testing.assert_close(out, ref, rtol=1e-8, atol=1e-8, msg=f"window={window} sinks={sinks}")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 4, 128])
def test_float32_matches_reference_across_chunk_sizes(causal, chunk_size):
    q, k, v = _qkv(batch=1, length=37, dtype=torch.float32, seed=1)
    fm = _map("favor+", 8, m=32)
    out = window_linear_attention(q, k, v, fm, window=6, sinks=2, causal=causal, chunk_size=chunk_size)
    ref = reference_window_linear_attention(q, k, v, fm, window=6, sinks=2, causal=causal)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------- limits


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("learned", [False, True])
def test_a_window_covering_the_sequence_is_exact_softmax(causal, sinks, learned):
    q, k, v = _qkv(length=19, dtype=torch.float32)
    gamma = torch.ones(4) if learned else None  # gamma = 1: both modes are plain softmax
    mask = _right_padded(2, 19, [(1, 4)])
    out = window_linear_attention(q, k, v, _map("favor+", 8), window=19, sinks=sinks, causal=causal,
                                  softmax_weight=gamma, key_padding_mask=mask, chunk_size=4)
    expected = softmax_attention(q, k, v, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    sdpa_mask = mask[:, None, None, :] & (torch.ones(19, 19, dtype=torch.bool).tril() if causal else True)
    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=sdpa_mask)
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["favor+", "relu", "elu+1"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("learned", [False, True])
def test_no_window_and_no_sinks_is_linear_attention(name, causal, learned):
    q, k, v = _qkv(dtype=torch.float32, seed=2)
    fm = _map(name, 8)
    mask = _right_padded(2, 23, [(0, 6)])
    out = window_linear_attention(q, k, v, fm, window=0, causal=causal, key_padding_mask=mask,
                                  softmax_weight=torch.full((4,), 0.5) if learned else None, chunk_size=5)
    expected = linear_attention(q, k, v, fm, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_favor_tail_approaches_softmax_as_features_grow():
    # Calibrated mode: the tail is on the softmax scale, so many features give nearly exact softmax.
    q, k, v = _qkv(batch=1, length=40, dtype=torch.float32, scale=0.5)
    expected = softmax_attention(q, k, v, causal=True)
    errors = []
    for m in (16, 4096):
        out = window_linear_attention(q, k, v, make_feature_map("favor+", 8, nb_features=m), window=4, sinks=1)
        errors.append((out.double() - expected).abs().mean().item())
    assert errors[1] < errors[0] / 3 and errors[1] < 0.03


# ---------------------------------------------------------------------------------- padding and invariances


@pytest.mark.parametrize("causal", [True, False])
def test_padded_keys_contribute_nothing(causal):
    q, k, v = _qkv(batch=1, length=30, dtype=torch.float32)
    fm = _map("favor+", 8)
    kwargs = dict(window=5, sinks=2, causal=causal, chunk_size=7)
    alone = window_linear_attention(q[:, :, :24], k[:, :, :24], v[:, :, :24], fm, **kwargs)
    k_junk, v_junk = k.clone(), v.clone()
    k_junk[:, :, 24:] *= 50
    v_junk[:, :, 24:] = 1e4
    out = window_linear_attention(q, k_junk, v_junk, fm, key_padding_mask=_right_padded(1, 30, [(0, 6)]), **kwargs)
    torch.testing.assert_close(out[:, :, :24], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["favor+", "trig"])
def test_causal_prefix_invariance_even_with_huge_future_tokens(name):
    fm = _map(name, 8)
    q, k, v = _qkv(batch=1, length=40, dtype=torch.float32)
    kwargs = dict(window=3, sinks=2, chunk_size=8)
    prefix = window_linear_attention(q[:, :, :25], k[:, :, :25], v[:, :, :25], fm, **kwargs)
    k_future = k.clone()
    k_future[:, :, 25:] *= 30
    out = window_linear_attention(q, k_future, v, fm, **kwargs)
    torch.testing.assert_close(out[:, :, :25], prefix, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_batch_invariance(causal):
    q, k, v = _qkv(batch=1, dtype=torch.float32)
    fm = _map("favor+", 8)
    alone = window_linear_attention(q, k, v, fm, window=4, sinks=1, causal=causal)
    big = [20 * t for t in _qkv(batch=1, dtype=torch.float32, seed=3)]
    out = window_linear_attention(*(torch.cat([a, b]) for a, b in zip((q, k, v), big)), fm, window=4, sinks=1,
                                  causal=causal)
    torch.testing.assert_close(out[:1], alone)


# ---------------------------------------------------------------------------------- numerics and gradients


@pytest.mark.parametrize("causal", [True, False])
def test_bfloat16_inputs_are_finite_and_close_to_float32(causal):
    q, k, v = (t.bfloat16() for t in _qkv(batch=1, length=300, d=16, dtype=torch.float32, scale=3))
    fm = _map("favor+", 16, m=32)
    kwargs = dict(window=16, sinks=4, causal=causal, chunk_size=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = window_linear_attention(q, k, v, fm, **kwargs)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    expected = window_linear_attention(q.float(), k.float(), v.float(), fm, **kwargs)
    assert (out.float() - expected).abs().max() < 0.05


@pytest.mark.parametrize("name", ["favor+", "hedgehog"])
@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck_query_key_value_and_gamma(name, causal):
    q, k, v = _qkv(batch=1, heads=2, kv_heads=1, length=9, d=4)
    gamma = torch.tensor([0.2, 0.7], dtype=torch.float64)
    fm = _map(name, 4, m=8, heads=2, kv_heads=1).double()
    mask = _right_padded(1, 9, [(0, 2)])
    inputs = tuple(t.requires_grad_() for t in (q, k, v, gamma))

    def fn(q, k, v, gamma):
        return window_linear_attention(q, k, v, fm, window=2, sinks=1, causal=causal, softmax_weight=gamma,
                                       key_padding_mask=mask, chunk_size=4)

    assert torch.autograd.gradcheck(fn, inputs)


def test_gradients_reach_a_learned_feature_map():
    q, k, v = _qkv(dtype=torch.float32)
    fm = _map("hedgehog", 8)
    window_linear_attention(q, k, v, fm, window=3, sinks=1, softmax_weight=torch.full((4,), 0.1)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in fm.parameters())


def test_long_sequence_runs_without_a_quadratic_tensor():
    # An L x L float32 tile at L=8192 would be 256 MiB per head; the operator needs O(L (m + d)). Every tensor any
    # op produces is inspected (no timing): none may hold L * L / 8 elements or more.
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestOutput(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self.largest = max(self.largest, tensor.numel())
            return out

    length = 8192
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, length, 16, generator=generator) for _ in range(3))
    fm = make_feature_map("favor+", 16, nb_features=32)
    with torch.no_grad(), LargestOutput() as recorder:
        out = window_linear_attention(q, k, v, fm, window=64, sinks=4)
    assert torch.isfinite(out).all()
    assert recorder.largest < length * length // 8, recorder.largest


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(window=-1), "window must be an int >= 0"),
        (dict(window=2, sinks=-1), "sinks must be an int in [0, sequence length = 23]"),
        (dict(window=2, sinks=24), "sinks must be an int in [0, sequence length = 23]"),
        (dict(window=2, softmax_weight=torch.ones(3)), "softmax_weight must be None (calibrated) or a tensor"),
        (dict(window=2, softmax_weight=torch.zeros(4)), "softmax_weight must be None (calibrated) or hold values"),
        (dict(window=2, chunk_size=0), "chunk_size must be an int >= 1"),
    ],
)
def test_clear_errors_for_bad_arguments(kwargs, words):
    q, k, v = _qkv(dtype=torch.float32)
    with pytest.raises(ValueError) as error:
        window_linear_attention(q, k, v, _map("favor+", 8), **kwargs)
    message = str(error.value)
    assert words in message and "\n" not in message
