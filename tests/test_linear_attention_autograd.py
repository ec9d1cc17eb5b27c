"""The chunked forward/backward of linear attention (issue 17): outputs as before, gradients against the float64
reference and gradcheck for every map kind (learned maps' parameters included), no [B, H, L, m] tensor kept."""

import copy

import pytest
import torch

from hf_performer import linear_attention, make_feature_map
from hf_performer.linear_attention_autograd import ChunkedLinearAttention
from hf_performer.linear_attention_chunks import BIDIRECTIONAL_MIN_CHUNK, ChunkedAttentionSettings
from hf_performer.reference import reference_linear_attention

RANDOM_MAPS = ["favor+", "trig", "relu", "elu+1"]
LEARNED_MAPS = ["hedgehog", "t2r"]


def _map(name, d, m, heads, kv_heads):
    if name in LEARNED_MAPS:
        fm = make_feature_map(name, d, nb_features=m, num_heads=heads, num_key_value_heads=kv_heads)
        with torch.no_grad():  # a non-trivial bias, so that its gradient is checked too
            for name_, p in fm.named_parameters():
                if "bias" in name_:
                    p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name_))))
        return fm.double()
    return make_feature_map(name, d, nb_features=None if name == "elu+1" else m).double()


def _inputs(batch=2, heads=2, kv_heads=2, length=7, d=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, d, generator=generator, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, length, d, generator=generator, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, length, d, generator=generator, dtype=torch.float64)
    return q, k, v


def _mask(batch, length, causal):
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, -2:] = False  # right padding
    if not causal:  # (causal: a left-padded first query has no key at all, the reference divides 0 by 0)
        mask[-1, :1] = False  # left padding
    return mask


# ---------------------------------------------------------------------------------- same outputs as before


CASES = [dict(name="favor+", causal=c, masked=mk, kv_heads=kv) for c in (False, True) for mk in (False, True)
         for kv in (4, 2)]
CASES += [dict(name=n, causal=c, masked=True, kv_heads=kv) for n, kv in (("hedgehog", 2), ("relu", 4))
          for c in (False, True)]


def _float32_case(case):
    """float32 inputs, mask and map of one regression case (the shapes and seeds of the pre-issue-17 checks)."""
    generator = torch.Generator().manual_seed(17)
    batch, heads, length, d = 2, 4, 24, 8
    q = torch.randn(batch, heads, length, d, generator=generator)
    k = torch.randn(batch, case["kv_heads"], length, d, generator=generator)
    v = torch.randn(batch, case["kv_heads"], length, d, generator=generator)
    mask = None
    if case["masked"]:
        mask = torch.ones(batch, length, dtype=torch.bool)
        mask[0, -5:] = False
        # causal: a hole instead of left padding (a query with no key at all is 0 / 0 in the reference)
        mask[1, slice(10, 13) if case["causal"] else slice(0, 3)] = False
    heads_kwargs = dict(num_heads=heads, num_key_value_heads=case["kv_heads"]) if case["name"] == "hedgehog" else {}
    torch.manual_seed(0)
    fm = make_feature_map(case["name"], d, nb_features=16, **heads_kwargs).eval()
    return q, k, v, mask, fm


def _outputs_and_gradients(function, q, k, v, mask, fm, causal):
    """Output and gradients (q, k, v and the map's parameters) of a weighted sum of ``function``'s output."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    fm.zero_grad()
    out = function(q, k, v, fm, causal=causal, key_padding_mask=mask)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    return out.detach(), {"grad_q": q.grad, "grad_k": k.grad, "grad_v": v.grad,
                          **{name: p.grad.clone() for name, p in fm.named_parameters()}}


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_outputs_and_gradients_equal_the_float64_reference_in_float32(case):
    # float32 fast path (chunk 10: several chunks) against the float64 dense reference of the same map
    q, k, v, mask, fm = _float32_case(case)
    out, grads = _outputs_and_gradients(
        lambda *args, **kwargs: linear_attention(*args, chunk_size=10, **kwargs), q, k, v, mask, fm, case["causal"])
    fm64 = copy.deepcopy(fm).double()
    expected_out, expected = _outputs_and_gradients(
        reference_linear_attention, q.double(), k.double(), v.double(), mask, fm64, case["causal"])
    torch.testing.assert_close(out, expected_out.float(), rtol=2e-5, atol=2e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name].float(), rtol=2e-4, atol=2e-5, msg=name)


# ---------------------------------------------------------------------------------- gradients


def _parameter_names(fm):
    return [name for name, p in fm.named_parameters() if p.requires_grad]


def _attention_of(fm, causal, mask, chunk_size, reference=False):
    """``f(q, k, v, *parameters)`` with the map's trainable parameters as explicit inputs."""
    names = _parameter_names(fm)

    def attention(q, k, v, *parameters):
        with torch.nn.utils.stateless._reparametrize_module(fm, dict(zip(names, parameters))):
            if reference:
                return reference_linear_attention(q, k, v, fm, causal=causal, key_padding_mask=mask)
            return linear_attention(q, k, v, fm, causal=causal, key_padding_mask=mask, chunk_size=chunk_size)

    return attention, [p.detach().clone().requires_grad_() for _, p in fm.named_parameters() if p.requires_grad]


GRADIENT_CASES = [
    (name, causal, masked, kv_heads)
    for name in RANDOM_MAPS + LEARNED_MAPS
    for causal in (False, True)
    for masked, kv_heads in ((False, 2), (True, 2), (True, 1))  # plain, padded, padded + grouped-query
]


@pytest.mark.parametrize("name, causal, masked, kv_heads", GRADIENT_CASES)
def test_gradcheck_and_gradients_equal_the_float64_reference(name, causal, masked, kv_heads):
    q, k, v = _inputs(kv_heads=kv_heads)
    fm = _map(name, 4, 8, heads=2, kv_heads=kv_heads)
    mask = _mask(2, 7, causal) if masked else None
    fast, parameters = _attention_of(fm, causal, mask, chunk_size=3)
    reference, _ = _attention_of(fm, causal, mask, chunk_size=3, reference=True)
    inputs = [t.requires_grad_() for t in (q, k, v, *parameters)]
    # fast_mode checks a random projection of the Jacobian; the full gradient is compared with the reference's below.
    assert torch.autograd.gradcheck(fast, inputs, fast_mode=True)
    weights = torch.randn(q.shape[:3] + (v.shape[-1],), generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    fast_grads = torch.autograd.grad((fast(*inputs) * weights).sum(), inputs)
    reference_grads = torch.autograd.grad((reference(*inputs) * weights).sum(), inputs)
    for index, (a, b) in enumerate(zip(fast_grads, reference_grads)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=f"input {index}")
    if parameters:  # the learned maps' weights and biases get a gradient
        assert all(g.abs().sum() > 0 for g in fast_grads[3:])


def test_random_projection_is_a_buffer_without_gradient():
    fm = make_feature_map("favor+", 4, nb_features=8)
    q, k, v = (t.float().requires_grad_() for t in _inputs())
    linear_attention(q, k, v, fm, causal=True).sum().backward()
    assert not fm.projection.requires_grad and fm.projection.grad is None
    assert all(t.grad is not None for t in (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
def test_features_vjp_path_equals_the_autograd_recompute_path(causal, monkeypatch):
    q, k, v = (t.requires_grad_() for t in _inputs(heads=4, kv_heads=2, length=19, d=8))
    fm = make_feature_map("favor+", 8, nb_features=16).double()
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[1, :3] = False
    results = []
    for use_vjp in (True, False):
        monkeypatch.setattr(type(fm), "has_features_vjp", property(lambda self, use=use_vjp: use))
        out = linear_attention(q, k, v, fm, causal=causal, key_padding_mask=mask, chunk_size=4)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_redraw_between_forward_and_backward_uses_the_forward_projection():
    fm = make_feature_map("favor+", 4, nb_features=8, redraw_interval=1).double().train()
    q, k, v = (t.requires_grad_() for t in _inputs())
    out = linear_attention(q, k, v, fm, causal=True)
    projection = fm.projection.clone()
    expected = torch.autograd.grad(reference_linear_attention(q, k, v, fm, causal=True).sum(), (q, k, v))
    fm.redraw_projection()
    assert not torch.equal(fm.projection, projection)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b)
    assert not torch.equal(fm.projection, projection)  # the new projection is back in place


def test_gradients_through_initial_and_returned_state_match_one_pass():
    q, k, v = (t.requires_grad_() for t in _inputs(heads=2, kv_heads=1, length=13))
    fm = make_feature_map("favor+", 4, nb_features=8).double()

    def two_calls(q, k, v):
        first, state = linear_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], fm, causal=True, return_state=True,
                                        chunk_size=4)
        second, final = linear_attention(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], fm, causal=True,
                                         initial_state=state, return_state=True, chunk_size=3)
        return torch.cat([first, second], dim=2), final

    assert torch.autograd.gradcheck(lambda *x: two_calls(*x)[0], (q, k, v), fast_mode=True)
    out, _ = two_calls(q, k, v)
    torch.testing.assert_close(out, reference_linear_attention(q, k, v, fm, causal=True))
    # The state itself: FAVOR+'s is relative to the non-differentiable stabiliser exp(-c) (it cancels only in the
    # outputs), so its raw entries are checked with a map without log-scales.
    fm = make_feature_map("relu", 4, nb_features=8).double()
    assert torch.autograd.gradcheck(lambda *x: tuple(two_calls(*x)[1][:2]), (q, k, v), fast_mode=True)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_the_caller_state_and_incoming_gradients_are_left_as_they_were(kv_heads):
    # The kernels update the running state and its gradient in place: on their own copies.
    q, k, v = (t.requires_grad_() for t in _inputs(heads=2, kv_heads=kv_heads, length=9))
    fm = make_feature_map("favor+", 4, nb_features=8).double()
    _, state = linear_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], fm, causal=True, return_state=True)
    state = tuple(t.detach().requires_grad_() for t in state)
    before = [t.detach().clone() for t in state]
    out, final = linear_attention(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], fm, causal=True, initial_state=state,
                                  return_state=True, chunk_size=2)
    grad_final = torch.randn_like(final.kv)
    kept = grad_final.clone()
    torch.autograd.backward([out.sum(), final.kv], [None, grad_final])
    for tensor, original in zip(state, before):
        assert torch.equal(tensor.detach(), original)
    assert torch.equal(grad_final, kept)
    assert all(t.grad is not None for t in state[:2])
    # and a second call from the same state gives the same output
    again, _ = linear_attention(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], fm, causal=True, initial_state=state,
                                return_state=True, chunk_size=2)
    torch.testing.assert_close(again, out)


def test_bidirectional_chunks_take_at_least_the_minimum_and_causal_chunks_as_given():
    fm = make_feature_map("favor+", 4, nb_features=8)
    make = lambda causal: ChunkedAttentionSettings(fm, causal, 1.0, 16, 1e-6, torch.float32)  # noqa: E731
    assert make(True).chunk_size == 16
    assert make(False).chunk_size == BIDIRECTIONAL_MIN_CHUNK > 16


# ---------------------------------------------------------------------------------- memory


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["favor+", "hedgehog"])
def test_autograd_keeps_no_feature_sized_tensor(causal, name):
    batch, heads, length, d, m = 1, 4, 512, 8, 64
    q, k, v = (torch.randn(batch, heads, length, d, requires_grad=True) for _ in range(3))
    kwargs = dict(num_heads=heads) if name == "hedgehog" else {}
    fm = make_feature_map(name, d, nb_features=m, **kwargs)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = linear_attention(q, k, v, fm, causal=causal, chunk_size=64)
    out.sum().backward()
    inputs = {t.data_ptr() for t in (q, k, v)}
    extra = sum(t.numel() for t in saved if t.data_ptr() not in inputs)
    # Besides q, k, v: the output and its denominators [L, d + 1] (as a flash-style softmax kernel saves its output
    # and log-sum-exp), the [m, d + 1] sums and [L] stabilisers per head, nothing of [L, m].
    assert extra <= batch * heads * (length * (d + 1) + m * (d + 1) + length + 1)
    assert extra < batch * heads * length * m / 4
    assert {t.data_ptr() for t in saved} >= inputs
    assert all(t.grad is not None for t in (q, k, v))


def test_the_function_is_the_default_path():
    q, k, v = (torch.randn(1, 2, 9, 4, requires_grad=True) for _ in range(3))
    out = linear_attention(q, k, v, make_feature_map("favor+", 4, nb_features=8))
    assert type(out.grad_fn).__name__ == ChunkedLinearAttention.__name__ + "Backward"
