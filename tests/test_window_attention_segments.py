"""Causal window attention that needs gradients runs in checkpointed segments (memory bounded by one segment's
graph): the same outputs, gradients (inputs, gamma, learned-map parameters) and final state as one pass, in float64,
with padding and GQA; when it segments and when it does not."""

import pytest
import torch

import hf_performer.window_attention as window_attention
from hf_performer import make_feature_map, window_linear_attention
from hf_performer.reference import reference_window_linear_attention

SEGMENT = 8  # tokens per segment in these tests (the module's default is GRADIENT_SEGMENT_LENGTH)


def _inputs(length=29, heads=4, kv_heads=2, d=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, length, d, generator=generator, dtype=torch.float64)
    k = torch.randn(2, kv_heads, length, d, generator=generator, dtype=torch.float64)
    v = torch.randn(2, kv_heads, length, d, generator=generator, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v)]


def _map(name):
    torch.manual_seed(0)
    if name is None:
        return None
    if name == "hedgehog":
        feature_map = make_feature_map(name, 8, num_heads=4, num_key_value_heads=2).double()
        with torch.no_grad():  # away from the identity start: the map's gradients matter
            for parameter in feature_map.parameters():
                parameter.add_(0.2 * torch.randn_like(parameter))
        return feature_map
    return make_feature_map(name, 8, nb_features=16).double()


def _gradients(out, tensors):
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return torch.autograd.grad((out * weights).sum(), tensors)


def _calls(monkeypatch):
    calls = []
    original = window_attention.checkpoint
    monkeypatch.setattr(window_attention, "checkpoint", lambda *a, **k: (calls.append(1), original(*a, **k))[1])
    return calls


@pytest.mark.parametrize("name, learned", [("hedgehog", True), ("favor+", False), (None, False)])
def test_segmented_equals_one_pass_and_the_reference(name, learned, monkeypatch):
    q, k, v = _inputs()
    feature_map = _map(name)
    gamma = torch.tensor([0.1, 0.5, 0.9, 0.3], dtype=torch.float64, requires_grad=True) if learned else None
    mask = torch.ones(2, 29, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    mask[0, 11] = False  # a hole
    kwargs = dict(window=3, sinks=2, softmax_weight=gamma, key_padding_mask=mask, chunk_size=4)
    tensors = [q, k, v] + ([gamma] if learned else []) + ([] if feature_map is None else list(feature_map.parameters()))

    one_pass = window_linear_attention(q, k, v, feature_map, **kwargs)  # 29 <= 512 tokens: not segmented
    expected = _gradients(one_pass, tensors)
    monkeypatch.setattr(window_attention, "GRADIENT_SEGMENT_LENGTH", SEGMENT)
    calls = _calls(monkeypatch)
    segmented = window_linear_attention(q, k, v, feature_map, **kwargs)
    assert len(calls) == 4  # ceil(29 / 8) checkpointed segments
    torch.testing.assert_close(segmented, one_pass, rtol=1e-10, atol=1e-10)
    for got, want in zip(_gradients(segmented, tensors), expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    reference = reference_window_linear_attention(q, k, v, feature_map, window=3, sinks=2, softmax_weight=gamma,
                                                  key_padding_mask=mask)
    valid = mask[:, None, :, None].expand_as(one_pass)  # outputs at padded positions are not defined
    torch.testing.assert_close(segmented[valid], reference[valid], rtol=1e-8, atol=1e-8)


def test_segmented_continues_an_initial_state_and_returns_the_final_one(monkeypatch):
    q, k, v = _inputs(length=30)
    feature_map = _map("hedgehog")
    gamma = torch.full((4,), 0.4, dtype=torch.float64)
    kwargs = dict(window=3, sinks=2, softmax_weight=gamma, chunk_size=4)
    with torch.no_grad():
        _, state = window_linear_attention(q[:, :, :10], k[:, :, :10], v[:, :, :10], feature_map, return_state=True,
                                           **kwargs)
    one_pass, final = window_linear_attention(q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], feature_map,
                                              initial_state=state, return_state=True, **kwargs)
    monkeypatch.setattr(window_attention, "GRADIENT_SEGMENT_LENGTH", SEGMENT)
    calls = _calls(monkeypatch)
    segmented, segmented_final = window_linear_attention(q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], feature_map,
                                                         initial_state=state, return_state=True, **kwargs)
    assert len(calls) == 3
    torch.testing.assert_close(segmented, one_pass, rtol=1e-10, atol=1e-10)
    assert segmented_final.seen == final.seen == 30
    for got, want in zip(segmented_final, final):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        elif isinstance(want, tuple):  # the tail's LinearAttentionState
            for got_part, want_part in zip(got, want):
                torch.testing.assert_close(got_part, want_part, rtol=1e-10, atol=1e-10)


def test_when_it_segments(monkeypatch):
    monkeypatch.setattr(window_attention, "GRADIENT_SEGMENT_LENGTH", SEGMENT)
    calls = _calls(monkeypatch)
    q, k, v = _inputs()
    hedgehog = _map("hedgehog")
    arguments = dict(window=3, sinks=2, softmax_weight=torch.full((4,), 0.4, dtype=torch.float64), chunk_size=4)
    with torch.no_grad():  # inference: one pass
        window_linear_attention(q, k, v, hedgehog, **arguments)
    window_linear_attention(q, k, v, hedgehog, causal=False, **arguments)  # bidirectional: one pass
    window_linear_attention(q[:, :, :SEGMENT], k[:, :, :SEGMENT], v[:, :, :SEGMENT], hedgehog, **arguments)  # short
    assert calls == []
    redrawing = make_feature_map("favor+", 8, nb_features=16, redraw_interval=1).double().train()
    window_linear_attention(q, k, v, redrawing, window=3, sinks=2, chunk_size=4)
    assert calls == []  # a map that may redraw between the forward and the recomputation: one pass
    window_linear_attention(q, k, v, redrawing.eval(), window=3, sinks=2, chunk_size=4)
    assert len(calls) == 4
