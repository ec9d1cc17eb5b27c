"""Window attention that needs gradients runs in segments (memory bounded by one segment's graph): causal calls as
recomputed segments continuing the decoding state (window_segments.segmented_causal), bidirectional calls through
window_segments (tail sums between segments). The same outputs, gradients (inputs, gamma, learned-map parameters)
and final state as one pass and the float64 reference, with padding and GQA; when it segments and when it does not."""

import pytest
import torch

import hf_performer.window_attention as window_attention
import hf_performer.window_bidirectional as window_bidirectional
from hf_performer import make_feature_map, window_linear_attention
from hf_performer.window_state import state_tensors
from hf_performer.reference import reference_window_linear_attention

SEGMENT = 8  # tokens per segment in these tests (the module's: CAUSAL_SEGMENT_LENGTH, BIDIRECTIONAL_SEGMENT_LENGTH)


def _set_segment_length(monkeypatch, length):
    for name in ("CAUSAL_SEGMENT_LENGTH", "BIDIRECTIONAL_SEGMENT_LENGTH"):
        monkeypatch.setattr(window_attention, name, length)
    monkeypatch.setattr(window_bidirectional, "BIDIRECTIONAL_SEGMENT_LENGTH", length)  # (where segments are cut)


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


def _gradients(out, tensors, retain_graph=False):
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return torch.autograd.grad((out * weights).sum(), tensors, retain_graph=retain_graph)


def _counted(monkeypatch, module, name) -> list:
    """A list that grows by one entry at each call of ``module.name`` (patched for the test)."""
    calls = []
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: (calls.append(1), original(*a, **kw))[1])
    return calls


def _assert_gradients(first, second, expected):
    for got, again, want in zip(first, second, expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(again, want, rtol=1e-9, atol=1e-10)


def _calls(monkeypatch):
    """One entry per causal segment run by the forward of a segmented call."""
    calls = []
    original = window_attention.segmented_causal
    monkeypatch.setattr(window_attention, "segmented_causal",
                        lambda plan, *a: (calls.extend([1] * len(plan.segments)), original(plan, *a))[1])
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

    one_pass = window_linear_attention(q, k, v, feature_map, **kwargs)  # 29 tokens, one segment: not segmented
    expected = _gradients(one_pass, tensors)
    _set_segment_length(monkeypatch, SEGMENT)
    calls = _calls(monkeypatch)
    segmented = window_linear_attention(q, k, v, feature_map, **kwargs)
    assert len(calls) == 4  # ceil(29 / 8) segments
    torch.testing.assert_close(segmented, one_pass, rtol=1e-10, atol=1e-10)
    for got, want in zip(_gradients(segmented, tensors), expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    reference = reference_window_linear_attention(q, k, v, feature_map, window=3, sinks=2, softmax_weight=gamma,
                                                  key_padding_mask=mask)
    valid = mask[:, None, :, None].expand_as(one_pass)  # outputs at padded positions are not defined
    torch.testing.assert_close(segmented[valid], reference[valid], rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("sparse_cache", [0, 3])
def test_the_backward_reuses_the_forward_block_outputs(sparse_cache, monkeypatch):
    """Each segment's block outputs are computed once by the forward and once by the backward's hand-written block
    gradient, not a third time by the recomputation of the segment; a second backward computes them again."""
    import hf_performer.window_blocks as window_blocks

    q, k, v = _inputs()
    feature_map = _map("hedgehog")
    gamma = torch.tensor([0.1, 0.5, 0.9, 0.3], dtype=torch.float64, requires_grad=True)
    kwargs = dict(window=3, sinks=2, softmax_weight=gamma, sparse_cache=sparse_cache, chunk_size=4)
    tensors = [q, k, v, gamma] + list(feature_map.parameters())
    one_pass = window_linear_attention(q, k, v, feature_map, **kwargs)
    expected = _gradients(one_pass, tensors)
    _set_segment_length(monkeypatch, SEGMENT)
    computed = _counted(monkeypatch, window_blocks, "_forward_pieces")
    segmented = window_linear_attention(q, k, v, feature_map, **kwargs)
    assert len(computed) == 4  # the forward: one group of blocks per segment
    first = _gradients(segmented, tensors, retain_graph=True)
    assert len(computed) == 8  # + the block gradient's recomputation, not the segment's forward again
    second = _gradients(segmented, tensors)
    assert len(computed) == 16  # the recorded outputs were used up: computed again
    _assert_gradients(first, second, expected)


@pytest.mark.parametrize("sparse_cache", [0, 3])
def test_the_backward_reuses_the_fused_exact_outputs(sparse_cache, monkeypatch):
    """Without a tail (SDPA's CPU kernel, ``window_exact_blocks``) the same: the recomputation of a segment takes the
    forward's outputs, the backward runs the kernel's own backward; a second backward computes them again."""
    import hf_performer.window_exact_blocks as window_exact_blocks

    q, k, v = _inputs()
    kwargs = dict(window=3, sinks=2, sparse_cache=sparse_cache, chunk_size=4)
    one_pass = window_linear_attention(q, k, v, None, **kwargs)
    expected = _gradients(one_pass, [q, k, v])
    _set_segment_length(monkeypatch, SEGMENT)
    computed = _counted(monkeypatch, window_exact_blocks, "_run_group")
    segmented = window_linear_attention(q, k, v, None, **kwargs)
    assert len(computed) == 4  # the forward: one group of blocks per segment
    torch.testing.assert_close(segmented, one_pass, rtol=1e-10, atol=1e-12)
    first = _gradients(segmented, [q, k, v], retain_graph=True)
    assert len(computed) == 4  # the segments' recomputation reused the forward's outputs
    second = _gradients(segmented, [q, k, v])
    assert len(computed) == 8  # used up: computed again
    _assert_gradients(first, second, expected)


def test_the_backward_reuses_the_sparse_cache_selection_without_a_tail(monkeypatch):
    """Without a tail the selection takes no gradient to the output: a segment's recomputation takes the forward's
    chosen slots instead of choosing again (the tail's layers choose again: their tail sums are differentiable)."""
    import hf_performer.window_boundaries as window_boundaries

    q, k, v = _inputs()
    kwargs = dict(window=3, sinks=2, sparse_cache=3, chunk_size=4)
    one_pass = window_linear_attention(q, k, v, None, **kwargs)
    expected = _gradients(one_pass, [q, k, v])
    _set_segment_length(monkeypatch, SEGMENT)
    chosen = _counted(monkeypatch, window_boundaries, "select_hard_keys")
    segmented = window_linear_attention(q, k, v, None, **kwargs)
    selections = len(chosen)
    assert selections > 0
    first = _gradients(segmented, [q, k, v], retain_graph=True)
    assert len(chosen) == selections  # the recomputation chose nothing again
    second = _gradients(segmented, [q, k, v])
    assert len(chosen) == 2 * selections  # used up: chosen again
    _assert_gradients(first, second, expected)


def test_reused_block_outputs_of_another_shape_are_refused():
    import hf_performer.window_blocks as window_blocks

    q, k, v = _inputs()
    store = []
    with window_blocks.reused_outputs(store, record=True):
        window_linear_attention(q, k, v, None, window=3, sinks=2, chunk_size=4)
    assert len(store) == 1
    with window_blocks.reused_outputs(store, record=False), pytest.raises(RuntimeError, match="reused outputs"):
        window_linear_attention(q[:, :, :20], k[:, :, :20], v[:, :, :20], None, window=3, sinks=2, chunk_size=4)


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
    _set_segment_length(monkeypatch, SEGMENT)
    calls = _calls(monkeypatch)
    segmented, segmented_final = window_linear_attention(q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], feature_map,
                                                         initial_state=state, return_state=True, **kwargs)
    assert len(calls) == 3
    torch.testing.assert_close(segmented, one_pass, rtol=1e-10, atol=1e-10)
    assert segmented_final.seen == final.seen == 30
    for got, want in zip(segmented_final, final):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        elif isinstance(want, tuple):  # a committed tail, the pending sums
            for got_part, want_part in zip(got, want):
                torch.testing.assert_close(got_part, want_part, rtol=1e-10, atol=1e-10)
        else:
            assert got == want


def _state_loss(state):
    """A loss on every floating-point tensor of a decoding state (random weights)."""
    generator = torch.Generator().manual_seed(2)
    tensors = [t for t in state_tensors(state) if t is not None]
    return sum((t * torch.randn(t.shape, generator=generator, dtype=t.dtype)).sum() for t in tensors)


@pytest.mark.parametrize("max_rollback", [None, 0, 5])
def test_segmented_gradients_through_a_differentiable_initial_state_and_the_final_state(max_rollback, monkeypatch):
    """Training across calls (truncated back-propagation through the decoding state): the initial state carries
    gradients back to the earlier call's inputs, and a loss on the returned final state reaches every input."""
    q, k, v = _inputs(length=31)
    feature_map = _map("hedgehog")
    gamma = torch.tensor([0.2, 0.6, 0.8, 0.4], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 31, dtype=torch.bool)
    mask[1, :4] = False  # left padding: the second row's sinks arrive in the second call
    kwargs = dict(window=3, sinks=2, softmax_weight=gamma, chunk_size=4, max_rollback=max_rollback)
    tensors = [q, k, v, gamma, *feature_map.parameters()]

    def loss():
        first_out, state = window_linear_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], feature_map,
                                                   key_padding_mask=mask[:, :6], return_state=True, **kwargs)
        out, final = window_linear_attention(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], feature_map,
                                             key_padding_mask=mask[:, 6:], initial_state=state, return_state=True,
                                             **kwargs)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
        return (out * weights).sum() + first_out.sum() + _state_loss(final), final

    expected_loss, expected_final = loss()  # 25 tokens, one segment: one pass
    expected = torch.autograd.grad(expected_loss, tensors)
    _set_segment_length(monkeypatch, SEGMENT)
    calls = _calls(monkeypatch)
    got_loss, got_final = loss()
    assert len(calls) == 4  # the 25-token call: ceil(25 / 8) segments; the 6-token call: one pass
    assert got_final.rollback_capacity() == expected_final.rollback_capacity()
    torch.testing.assert_close(got_loss, expected_loss, rtol=1e-10, atol=1e-10)
    for got, want in zip(torch.autograd.grad(got_loss, tensors), expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_segmented_causal_gradcheck(monkeypatch):
    _set_segment_length(monkeypatch, 4)
    q, k, v = (t.detach()[:1, :, :11].requires_grad_() for t in _inputs())
    feature_map = _map("hedgehog")
    gamma = torch.tensor([0.3, 0.5, 0.7, 0.2], dtype=torch.float64, requires_grad=True)

    def call(q, k, v, gamma):
        return window_linear_attention(q, k, v, feature_map, window=3, sinks=2, softmax_weight=gamma, chunk_size=2)

    calls = _calls(monkeypatch)
    assert torch.autograd.gradcheck(call, (q, k, v, gamma), eps=1e-6, atol=1e-6, fast_mode=True)
    assert calls and set(calls) == {1}


def test_when_it_segments(monkeypatch):
    _set_segment_length(monkeypatch, SEGMENT)
    calls = _calls(monkeypatch)
    q, k, v = _inputs()
    hedgehog = _map("hedgehog")
    arguments = dict(window=3, sinks=2, softmax_weight=torch.full((4,), 0.4, dtype=torch.float64), chunk_size=4)
    with torch.no_grad():  # inference: one pass
        window_linear_attention(q, k, v, hedgehog, **arguments)
        window_linear_attention(q, k, v, hedgehog, causal=False, **arguments)
    window_linear_attention(q[:, :, :SEGMENT], k[:, :, :SEGMENT], v[:, :, :SEGMENT], hedgehog, **arguments)  # short
    window_linear_attention(q[:, :, :SEGMENT], k[:, :, :SEGMENT], v[:, :, :SEGMENT], hedgehog, causal=False,
                            **arguments)
    assert calls == []
    redrawing = make_feature_map("favor+", 8, nb_features=16, redraw_interval=1).double().train()
    window_linear_attention(q, k, v, redrawing, window=3, sinks=2, chunk_size=4)
    assert calls == []  # a map that may redraw between the forward and the recomputation: one pass
    window_linear_attention(q, k, v, redrawing.eval(), window=3, sinks=2, chunk_size=4)
    assert len(calls) == 4


# ------------------------------------------------------------------------------------ bidirectional


def _bidirectional_calls(monkeypatch):
    calls = []
    original = window_bidirectional.segmented_bidirectional
    monkeypatch.setattr(window_bidirectional, "segmented_bidirectional",
                        lambda plan, *a: (calls.append(len(plan.segments)), original(plan, *a))[1])
    return calls


def _padded_mask(length):
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    mask[0, -4:] = False  # right padding
    mask[0, 11] = False  # a hole
    return mask


@pytest.mark.parametrize("name, learned, window, sinks", [
    (name, learned, window, sinks)
    for name, learned in [("hedgehog", True), ("favor+", False), (None, False)]
    for window in (0, 1, 64) for sinks in (0, 1, 4)
    if name is not None or window or sinks  # no feature map needs window or sinks (a ValueError)
])
def test_bidirectional_segmented_equals_one_pass_and_the_reference(name, learned, window, sinks, monkeypatch):
    q, k, v = _inputs()
    feature_map = _map(name)
    gamma = torch.tensor([0.1, 0.5, 0.9, 0.3], dtype=torch.float64, requires_grad=True) if learned else None
    mask = _padded_mask(29)
    kwargs = dict(window=window, sinks=sinks, causal=False, softmax_weight=gamma, key_padding_mask=mask, chunk_size=4)
    tensors = [q, k, v] + ([gamma] if learned else []) + ([] if feature_map is None else list(feature_map.parameters()))

    def gradients(out, valid=None):
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
        if valid is not None:  # outputs at padded positions are not defined
            weights = weights * valid
        return torch.autograd.grad((out * weights).sum(), tensors, retain_graph=True, allow_unused=True,
                                   materialize_grads=True)

    one_pass = window_linear_attention(q, k, v, feature_map, **kwargs)  # 29 tokens, one segment: not segmented
    expected = gradients(one_pass)
    _set_segment_length(monkeypatch, SEGMENT)
    calls = _bidirectional_calls(monkeypatch)
    segmented = window_linear_attention(q, k, v, feature_map, **kwargs)
    assert calls == [4]  # ceil(29 / 8) segments
    torch.testing.assert_close(segmented, one_pass, rtol=1e-10, atol=1e-10)
    for got, want in zip(gradients(segmented), expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    valid = mask[:, None, :, None].double()
    reference = reference_window_linear_attention(q, k, v, feature_map, window=window, sinks=sinks, causal=False,
                                                  softmax_weight=gamma, key_padding_mask=mask)
    torch.testing.assert_close(segmented * valid, reference * valid, rtol=1e-8, atol=1e-8)
    for got, want in zip(gradients(segmented, valid), gradients(reference, valid)):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-8)


def test_bidirectional_segments_when_the_window_spans_several_segments(monkeypatch):
    """A halo longer than a segment: the local keys of a segment cover several spans, the tail sums skip them."""
    q, k, v = _inputs(length=40)
    feature_map = _map("hedgehog")
    gamma = torch.full((4,), 0.3, dtype=torch.float64, requires_grad=True)
    kwargs = dict(window=12, sinks=2, causal=False, softmax_weight=gamma, key_padding_mask=_padded_mask(40),
                  chunk_size=4)
    tensors = [q, k, v, gamma, *feature_map.parameters()]
    one_pass = window_linear_attention(q, k, v, feature_map, **kwargs)
    expected = _gradients(one_pass, tensors)
    _set_segment_length(monkeypatch, 5)
    calls = _bidirectional_calls(monkeypatch)
    segmented = window_linear_attention(q, k, v, feature_map, **kwargs)
    assert calls == [8]
    torch.testing.assert_close(segmented, one_pass, rtol=1e-10, atol=1e-10)
    for got, want in zip(_gradients(segmented, tensors), expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def _gradcheck_bidirectional(monkeypatch, fast_mode):
    """Float64 gradcheck of query, key, value and gamma through the segmented path (3 segments of 4 tokens, GQA,
    a sink, right padding)."""
    _set_segment_length(monkeypatch, 4)
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, heads, 12, 4, generator=generator, dtype=torch.float64, requires_grad=True)
               for heads in (2, 1, 1))
    torch.manual_seed(0)
    feature_map = make_feature_map("hedgehog", 4, num_heads=2, num_key_value_heads=1).double()
    gamma = torch.tensor([0.3, 0.7], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[0, -2:] = False
    calls = _bidirectional_calls(monkeypatch)

    def call(query, key, value, weight):
        out = window_linear_attention(query, key, value, feature_map, window=2, sinks=1, causal=False,
                                      softmax_weight=weight, key_padding_mask=mask, chunk_size=2)
        return out[:, :, :10]  # the unpadded queries

    assert torch.autograd.gradcheck(call, (q, k, v, gamma), eps=1e-6, atol=1e-6, fast_mode=fast_mode)
    assert calls and set(calls) == {3}


def test_bidirectional_segmented_gradcheck(monkeypatch):
    _gradcheck_bidirectional(monkeypatch, fast_mode=True)


@pytest.mark.slow
def test_bidirectional_segmented_gradcheck_full_jacobian(monkeypatch):
    _gradcheck_bidirectional(monkeypatch, fast_mode=False)


def test_bidirectional_segmented_in_float32(monkeypatch):
    """The benchmark's dtype: the segmented outputs and gradients equal one pass to float32 rounding."""
    q, k, v = (t.detach().float().requires_grad_() for t in _inputs(length=40))
    torch.manual_seed(0)
    feature_map = make_feature_map("hedgehog", 8, num_heads=4, num_key_value_heads=2)
    gamma = torch.full((4,), 0.1)
    kwargs = dict(window=4, sinks=4, causal=False, softmax_weight=gamma, chunk_size=4)
    tensors = [q, k, v, *feature_map.parameters()]
    one_pass = window_linear_attention(q, k, v, feature_map, **kwargs)
    expected = _gradients(one_pass, tensors)
    _set_segment_length(monkeypatch, SEGMENT)
    segmented = window_linear_attention(q, k, v, feature_map, **kwargs)
    torch.testing.assert_close(segmented, one_pass, rtol=1e-5, atol=1e-6)
    for got, want in zip(_gradients(segmented, tensors), expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_when_bidirectional_segments(monkeypatch):
    _set_segment_length(monkeypatch, SEGMENT)
    calls = _bidirectional_calls(monkeypatch)
    q, k, v = _inputs()
    hedgehog = _map("hedgehog")
    arguments = dict(window=3, sinks=2, causal=False, chunk_size=4)
    with torch.no_grad():  # inference: one pass
        window_linear_attention(q, k, v, hedgehog, **arguments)
    window_linear_attention(q[:, :, :SEGMENT], k[:, :, :SEGMENT], v[:, :, :SEGMENT], hedgehog, **arguments)  # short
    frozen = [t.detach() for t in (q, k, v)]
    with torch.no_grad():
        for parameter in hedgehog.parameters():
            parameter.requires_grad_(False)
    window_linear_attention(*frozen, hedgehog, **arguments)  # nothing wants a gradient
    assert calls == []
    redrawing = make_feature_map("favor+", 8, nb_features=16, redraw_interval=1).double().train()
    window_linear_attention(q, k, v, redrawing, **arguments)
    assert calls == []  # a map that may redraw between the forward and the recomputation: one pass
    window_linear_attention(q, k, v, redrawing.eval(), **arguments)
    assert calls == [4]


def test_a_converted_encoder_trains_through_the_segments(monkeypatch):
    """End to end: a tiny BERT converted to the bidirectional hybrid (Hedgehog tail, learned gamma, a sink), padded
    on both sides; the masked-LM loss's gradients of every parameter are the same through the segments."""
    from transformers import BertForMaskedLM

    from conftest import tiny_bert_config
    from hf_performer import convert_to_performer
    from hf_performer.favor_attention import FEATURE_MAP_ATTRIBUTE, SOFTMAX_WEIGHT_ATTRIBUTE

    torch.manual_seed(0)
    performer = convert_to_performer(BertForMaskedLM(tiny_bert_config()).eval(), feature_map="hedgehog", window=3,
                                      sinks=1).double().eval()  # eval: no dropout, the gradients still flow
    ids = torch.randint(5, 99, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, -5:] = 0

    def gradients():
        performer.zero_grad()
        out = performer(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        out.loss.backward()
        return out.loss.detach(), {name: p.grad.clone() for name, p in performer.named_parameters()
                                   if p.grad is not None}

    loss, expected = gradients()  # 20 tokens, one segment: one pass
    _set_segment_length(monkeypatch, SEGMENT)
    calls = _bidirectional_calls(monkeypatch)
    segmented_loss, got = gradients()
    assert calls and set(calls) == {3}  # every layer, ceil(20 / 8) segments
    torch.testing.assert_close(segmented_loss, loss, rtol=1e-10, atol=1e-10)
    assert got.keys() == expected.keys()
    assert any(SOFTMAX_WEIGHT_ATTRIBUTE in name for name in got) and any(FEATURE_MAP_ATTRIBUTE in name for name in got)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-8, atol=1e-10, msg=name)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("segment_length", [SEGMENT, 512])
def test_a_fully_padded_row_gives_zeros_and_finite_gradients(causal, segment_length, monkeypatch):
    """A batch row with no unpadded token (e.g. an all-padding sequence in an evenly split batch) must not turn the
    other rows' gradients, or the weights', into NaN: its outputs are zeros, every gradient finite."""
    _set_segment_length(monkeypatch, segment_length)
    q, k, v = _inputs()
    feature_map = _map("hedgehog")
    mask = torch.ones(2, 29, dtype=torch.bool)
    mask[1] = False
    out = window_linear_attention(q, k, v, feature_map, window=3, sinks=2, causal=causal, key_padding_mask=mask,
                                  chunk_size=4)
    gradients = _gradients(out, [q, k, v, *feature_map.parameters()])
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert all(torch.isfinite(gradient).all() for gradient in gradients)
    alone = window_linear_attention(*(t[:1] for t in (q, k, v)), feature_map, window=3, sinks=2, causal=causal,
                                    key_padding_mask=mask[:1], chunk_size=4)
    torch.testing.assert_close(out[:1], alone)


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("continued", [False, True])
def test_the_states_between_segments_keep_indices_into_the_keys_not_copies(tail, continued, monkeypatch):
    """The forward keeps of each state entering a segment its buffer and sparse cache as positions in the call's keys
    (window_state.without_key_copies) where they are exactly those tokens, else the tensors (a cache with empty slots
    or still holding tokens of an earlier call): the same outputs and gradients as keeping every state whole."""
    from hf_performer.window_state import KeyCopies

    q, k, v = _inputs(length=40)
    feature_map = _map("hedgehog") if tail else None
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :5] = False
    kwargs = dict(window=3, sinks=2, sparse_cache=3, chunk_size=4)
    start = 12 if continued else 0
    state = None
    if continued:
        with torch.no_grad():
            _, state = window_linear_attention(q[:, :, :start], k[:, :, :start], v[:, :, :start], feature_map,
                                               key_padding_mask=mask[:, :start], return_state=True, **kwargs)
    tensors = [q, k, v] + ([] if feature_map is None else list(feature_map.parameters()))

    def run():
        out = window_linear_attention(q[:, :, start:], k[:, :, start:], v[:, :, start:], feature_map,
                                      key_padding_mask=mask[:, start:], initial_state=state, **kwargs)
        return out, _gradients(out, tensors)

    _set_segment_length(monkeypatch, SEGMENT)
    original = window_attention.without_key_copies
    with monkeypatch.context() as patch:  # every state kept whole, as before
        patch.setattr(window_attention, "without_key_copies", lambda s, *_: (s, KeyCopies(None, (None, None))))
        expected_out, expected = run()
    stored = []
    monkeypatch.setattr(window_attention, "without_key_copies",
                        lambda *a: (stored.append(original(*a)), stored[-1])[1])
    out, got = run()
    assert len(stored) == (40 - start + SEGMENT - 1) // SEGMENT - 1
    assert all(kept.buffer_key is None and copies.buffer is not None for kept, copies in stored)
    held = [copies.caches[0] is not None for _, copies in stored]
    # A cache with empty slots (the first segment's), or holding an earlier call's tokens (here to the end), stays.
    assert not held[0] and held[-1] != continued
    assert all((kept.current.cache_key is None) == cached for (kept, _), cached in zip(stored, held))
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    for g, want in zip(got, expected):
        torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-12)
