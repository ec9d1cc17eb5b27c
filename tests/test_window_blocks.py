"""The fused blocked kernel of causal window attention (``window_blocks.attend_blocks``, hand-written backward)
against its autograd reference ``attend_blocks_naive`` (same operands): outputs and every gradient, through the
public operator, for both kinds of tail maps, learned / calibrated gamma, with and without a sparse cache."""

import itertools

import pytest
import torch

from hf_performer import make_feature_map, window_linear_attention
from hf_performer import window_causal, window_exact_blocks
from hf_performer.window_blocks import attend_blocks_naive


def _outputs_and_grads(feature_map, gamma, mask, inputs, **settings):
    q, k, v = (t.detach().requires_grad_() for t in inputs)
    out = window_linear_attention(q, k, v, feature_map, softmax_weight=gamma, key_padding_mask=mask, **settings)
    sees = (mask.cumsum(-1) > 0)[:, None, :, None].expand_as(out)  # left-padding queries see no key
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    params = [q, k, v] + ([gamma] if gamma is not None else []) + (
        [] if feature_map is None else list(feature_map.parameters()))
    grads = torch.autograd.grad((out * weights * sees).sum(), params, allow_unused=True)
    return out.detach()[sees], grads


@pytest.mark.parametrize("name, learned, sparse_cache, window",
                         [(n, lr, g, w) for n, lr, g, w in itertools.product(["hedgehog", "favor+"], [False, True],
                                                                              [0, 3], [0, 4])
                          if not (n == "favor+" and lr)])
def test_the_fused_kernel_matches_its_autograd_reference(monkeypatch, name, learned, sparse_cache, window):
    torch.manual_seed(0)
    feature_map = (make_feature_map(name, 8, num_heads=4, num_key_value_heads=2) if name == "hedgehog"
                   else make_feature_map(name, 8, nb_features=16)).double()
    inputs = (torch.randn(3, 4, 33, 8, dtype=torch.float64), torch.randn(3, 2, 33, 8, dtype=torch.float64),
              torch.randn(3, 2, 33, 8, dtype=torch.float64))
    gamma = torch.tensor([0.1, 0.5, 0.9, 0.3], dtype=torch.float64, requires_grad=True) if learned else None
    mask = torch.ones(3, 33, dtype=torch.bool)
    mask[0, 12:14] = False
    mask[1, :7] = False
    settings = dict(window=window, sinks=2, chunk_size=5, sparse_cache=sparse_cache)
    fused = _outputs_and_grads(feature_map, gamma, mask, inputs, **settings)
    monkeypatch.setattr(window_causal, "attend_blocks", attend_blocks_naive)
    naive = _outputs_and_grads(feature_map, gamma, mask, inputs, **settings)
    torch.testing.assert_close(fused[0], naive[0], rtol=1e-10, atol=1e-12)
    for got, expected in zip(fused[1], naive[1]):
        assert (got is None) == (expected is None)
        if got is not None:
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("sparse_cache, window, sinks", [(0, 4, 2), (3, 4, 2), (3, 0, 2), (0, 4, 0), (5, 6, 1)])
def test_the_fused_exact_kernel_without_a_tail_matches_the_reference(monkeypatch, sparse_cache, window, sinks):
    """Layers without a tail run on SDPA's CPU flash kernel (``window_exact_blocks``): outputs and the query, key
    and value gradients equal the autograd reference's, with GQA, padding and left padding, through segments."""
    torch.manual_seed(1)
    inputs = (torch.randn(3, 4, 33, 8, dtype=torch.float64), torch.randn(3, 2, 33, 8, dtype=torch.float64),
              torch.randn(3, 2, 33, 8, dtype=torch.float64))
    mask = torch.ones(3, 33, dtype=torch.bool)
    mask[0, 12:14] = False
    mask[1, :7] = False
    settings = dict(window=window, sinks=sinks, chunk_size=5, sparse_cache=sparse_cache)
    calls = []
    original = window_exact_blocks._ExactBlocks.apply
    monkeypatch.setattr(window_exact_blocks._ExactBlocks, "apply", lambda *a: (calls.append(1), original(*a))[1])
    fused = _outputs_and_grads(None, None, mask, inputs, **settings)
    assert calls, "the fused exact kernel was not used"
    monkeypatch.setattr(window_causal, "attend_exact_blocks", attend_blocks_naive)
    naive = _outputs_and_grads(None, None, mask, inputs, **settings)
    torch.testing.assert_close(fused[0], naive[0], rtol=1e-10, atol=1e-12)
    for got, expected in zip(fused[1], naive[1]):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)
