"""The parallel path (what the CUDA path runs), tested on the CPU against the float64 references and the chunked path.

``HF_PERFORMER_ATTENTION_PATH=parallel`` runs it on any device: the decayed-attention kernels, the whole-sequence
linear attention, the causal window operator in one pass (SDPA on the gathered blocks, the selection kernel under
Triton's interpreter). Also: a fixed number of tensor operations whatever the length and no host synchronisation
(what makes it fast on a GPU), the fla adapter with a stand-in module, the backend switches' errors.
"""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch
from hf_performer import decayed_attention as decayed
from hf_performer.bench.operations import OperationCounts
from hf_performer.decayed_attention import chunk_decayed_attention, decayed_attention, parallel_chunk_size
from hf_performer.feature_maps import make_feature_map
from hf_performer.linear_attention import linear_attention
from hf_performer.linear_attention_parallel import PATH_VARIABLE, attention_path
from hf_performer.reference import (
    reference_decayed_attention,
    reference_linear_attention,
    reference_window_linear_attention,
)
from hf_performer.window_attention import window_linear_attention

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _relative(a, b, where=None):
    a, b = a.double(), b.double()
    if where is not None:
        a, b = torch.where(where, a, 0.0), torch.where(where, b, 0.0)
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture
def parallel(monkeypatch):
    monkeypatch.setenv(PATH_VARIABLE, "parallel")


# ------------------------------------------------------------------------------------ decayed attention


@pytest.mark.parametrize("length,chunk", [(1, None), (7, 4), (70, 16), (130, 64)])
@pytest.mark.parametrize("decay,start", [(False, False), (True, False), (True, True)])
def test_chunk_decayed_attention_equals_the_recurrence(length, chunk, decay, start):
    generator = torch.Generator().manual_seed(length)
    q, k = (torch.randn(2, 3, length, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 3, length, 5, generator=generator, dtype=torch.float64)
    g = -2 * torch.rand(2, 3, length, generator=generator, dtype=torch.float64) if decay else None
    if decay and length > 2:
        g[:, :, length // 2] = -100.0  # a large jump, as a stabiliser's
    s0 = torch.randn(2, 3, 8, 5, generator=generator, dtype=torch.float64) if start else None
    tensors = [t.requires_grad_() for t in (q, k, v)]
    out, final = chunk_decayed_attention(*tensors, g, s0, True, chunk_size=chunk)
    expected, expected_final = reference_decayed_attention(q, k, v, g, s0)
    assert _relative(out, expected) < 1e-12 and _relative(final, expected_final) < 1e-12
    grads = torch.autograd.grad((out * out.detach()).sum(), tensors)
    expected_grads = torch.autograd.grad((expected * expected.detach()).sum(), tensors)
    assert all(_relative(a, b) < 1e-12 for a, b in zip(grads, expected_grads))


def test_parallel_chunk_size_balances_tiles_and_scan():
    assert [parallel_chunk_size(n) for n in (1, 1024, 4096, 16384, 65536, 10**6)] == [64, 64, 128, 256, 512, 512]


def test_the_fla_backend_maps_layouts_and_arguments(monkeypatch):
    """The fla adapter with a stand-in ``chunk_simple_gla`` (its contract: ``[B, T, H, .]``, ``g``, ``scale``,
    ``initial_state``, ``output_final_state``), computed by the reference: the same as the torch backend."""
    seen = {}

    def chunk_simple_gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False):
        seen.update(layout=tuple(q.shape), scale=scale)
        out, final = reference_decayed_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                 None if g is None else g.transpose(1, 2), initial_state)
        return out.transpose(1, 2).to(v.dtype), final.float()

    monkeypatch.setattr(decayed, "_fla_module", lambda: types.SimpleNamespace(chunk_simple_gla=chunk_simple_gla))
    monkeypatch.setenv(decayed.BACKEND_VARIABLE, "fla")
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=generator) for _ in range(3))
    g = -torch.rand(1, 2, 9, generator=generator)
    s0 = torch.randn(1, 2, 4, 4, generator=generator)
    out, final = decayed_attention(q, k, v, g, s0, output_final_state=True)
    assert seen == {"layout": (1, 9, 2, 4), "scale": 1.0}
    expected, expected_final = chunk_decayed_attention(q, k, v, g, s0, True)
    assert _relative(out, expected) < 1e-5 and _relative(final, expected_final) < 1e-5


def test_a_missing_fla_is_announced_once_and_the_torch_backend_serves(monkeypatch, caplog):
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")

    decayed._fla_module.cache_clear()
    monkeypatch.setattr(decayed.importlib, "import_module", missing)
    try:
        with caplog.at_level("WARNING"):
            assert decayed._fla_module() is None and decayed._fla_module() is None
        notices = [r.getMessage() for r in caplog.records if "flash-linear-attention" in r.getMessage()]
        assert len(notices) == 1 and "hf-performer[cuda]" in notices[0]
    finally:
        decayed._fla_module.cache_clear()
    assert decayed.backend_for(torch.zeros(1, dtype=torch.bfloat16)) == "torch"


@pytest.mark.parametrize("capability,triton_version,refused", [
    ((9, 0), "3.6.0", True), ((9, 0), "3.7.1", False), ((9, 0), "3.8.0+git1234", False), ((8, 0), "3.6.0", False)])
def test_fla_is_not_used_on_hopper_with_an_old_triton(monkeypatch, caplog, capability, triton_version, refused):
    """flash-linear-attention refuses its gated backward on Hopper with Triton < 3.7.1 (measured on an H200): the
    torch backend serves there, after one notice."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    real_import = decayed.importlib.import_module
    monkeypatch.setattr(decayed.importlib, "import_module", lambda name: types.SimpleNamespace(
        __version__=triton_version) if name == "triton" else real_import(name))
    decayed._fla_refused_on.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert decayed._fla_refused_on(0) is refused and decayed._fla_refused_on(0) is refused
        notices = [r.getMessage() for r in caplog.records if "Hopper" in r.getMessage()]
        assert len(notices) == (1 if refused else 0)
    finally:
        decayed._fla_refused_on.cache_clear()


@pytest.mark.parametrize("variable,value", [(decayed.BACKEND_VARIABLE, "triton"), (PATH_VARIABLE, "gpu")])
def test_bad_switches_are_refused_in_one_line(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"{variable}={value!r}: choose one of") as error:
        decayed.backend_for(torch.zeros(1)) if variable == decayed.BACKEND_VARIABLE else attention_path(torch.zeros(1))
    assert "\n" not in str(error.value)


def test_the_default_path_is_chosen_by_device(monkeypatch):
    monkeypatch.delenv(PATH_VARIABLE, raising=False)
    assert attention_path(torch.zeros(1)) == "chunked"
    meta = torch.zeros(1, device="meta")
    assert attention_path(meta) == "chunked"  # only CUDA tensors take the parallel path by default


# ------------------------------------------------------------------------------------ linear attention


MAPS = [("favor+", dict(nb_features=32)), ("hedgehog", dict(num_heads=4, num_key_value_heads=2)),
        ("trig", dict(nb_features=16)), ("elu+1", {})]


@pytest.mark.parametrize("name,options", MAPS, ids=[m[0] for m in MAPS])
@pytest.mark.parametrize("causal", [False, True])
def test_parallel_linear_attention_equals_the_reference_and_the_chunked_gradients(parallel, monkeypatch, name, options,
                                                                                  causal):
    generator = torch.Generator().manual_seed(1)
    feature_map = make_feature_map(name, 8, **options).double()
    q = 0.5 * torch.randn(2, 4, 37, 8, generator=generator, dtype=torch.float64)
    k, v = (0.5 * torch.randn(2, 2, 37, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, :5] = False  # left padding
    mask[0, -3:] = False  # right padding
    rows = mask[:, None, :, None]
    expected = reference_linear_attention(q, k, v, feature_map, causal=causal, key_padding_mask=mask)
    grads = {}
    for path in ("parallel", "chunked"):
        monkeypatch.setenv(PATH_VARIABLE, path)
        tensors = [t.clone().requires_grad_() for t in (q, k, v)]
        out = linear_attention(*tensors, feature_map, causal=causal, key_padding_mask=mask, chunk_size=8)
        if path == "parallel":
            assert _relative(out, expected, rows) < 1e-12
        grads[path] = torch.autograd.grad((torch.where(rows, out, 0.0) ** 2).sum(), tensors)
    assert all(_relative(a, b) < 1e-12 for a, b in zip(grads["parallel"], grads["chunked"]))


@pytest.mark.parametrize("name,options", MAPS[:2], ids=[m[0] for m in MAPS[:2]])
def test_parallel_causal_state_continues_exactly(parallel, name, options):
    generator = torch.Generator().manual_seed(2)
    feature_map = make_feature_map(name, 8, **options).double()
    q = torch.randn(2, 4, 50, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 50, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    whole, whole_state = linear_attention(q, k, v, feature_map, causal=True, return_state=True)
    first, state = linear_attention(q[:, :, :20], k[:, :, :20], v[:, :, :20], feature_map, causal=True,
                                    return_state=True)
    second, state = linear_attention(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], feature_map, causal=True,
                                     initial_state=state, return_state=True)
    assert _relative(torch.cat([first, second], dim=2), whole) < 1e-12
    for a, b in zip(state, whole_state):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_long_inputs_with_large_norms_stay_finite_and_close(parallel, causal):
    """Pitfalls 1 and 12 on the parallel path: bf16 operands, float32 exponents and sums, 8k tokens of large norms."""
    generator = torch.Generator().manual_seed(0)
    q, k = ((8 * torch.randn(1, 2, 8192, 64, generator=generator)).bfloat16() for _ in range(2))
    v = torch.randn(1, 2, 8192, 64, generator=generator).bfloat16()
    feature_map = make_feature_map("favor+", 64, nb_features=64)
    out = linear_attention(q, k, v, feature_map, causal=causal)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    expected = linear_attention(q.float(), k.float(), v.float(), feature_map, causal=causal)
    assert (out.float() - expected).abs().max() < 0.05


@pytest.mark.parametrize("causal", [False, True])
def test_parallel_linear_attention_runs_a_fixed_number_of_operations_without_host_sync(parallel, causal):
    feature_map = make_feature_map("favor+", 16, nb_features=32)
    totals = []
    for length in (128, 2048):
        q, k, v = (torch.randn(1, 2, length, 16, requires_grad=True) for _ in range(3))
        with OperationCounts() as ops:
            linear_attention(q, k, v, feature_map, causal=causal).sum().backward()
        assert ops.synchronisations == 0
        totals.append(ops.total)
    assert totals[0] == totals[1] < 300


# ------------------------------------------------------------------------------------ window attention


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the dev extra installs it)")
@pytest.mark.parametrize("tail,causal,cache", [(False, True, 16), (True, True, 0), (True, False, 0)],
                         ids=["window-cache", "tail-causal", "tail-bidirectional"])
def test_parallel_window_attention_runs_a_fixed_number_of_operations(parallel, monkeypatch, tail, causal, cache):
    """Every block at once (window_parallel): the same operations at every length; no host read without a tail (with
    one, a learned gamma is checked once)."""
    from torch.utils._python_dispatch import _disable_current_modes

    from hf_performer import window_parallel

    kernel = window_parallel.select_without_tail

    def one_launch(*args, **kwargs):  # the interpreted kernel's own operations are not the GPU's
        with _disable_current_modes():
            return kernel(*args, **kwargs)

    monkeypatch.setattr(window_parallel, "select_without_tail", one_launch)
    feature_map = make_feature_map("hedgehog", 16, num_heads=4, num_key_value_heads=2) if tail else None
    gamma = torch.full((4,), 0.1) if tail and causal else None
    totals = []
    for length in (96, 400):
        q = torch.randn(1, 4, length, 16, requires_grad=True)
        k, v = (torch.randn(1, 2, length, 16, requires_grad=True) for _ in range(2))
        with OperationCounts() as ops:
            window_linear_attention(q, k, v, feature_map, window=8, sinks=2, causal=causal, sparse_cache=cache,
                                    softmax_weight=gamma, chunk_size=16).sum().backward()
        assert ops.synchronisations == (1 if gamma is not None else 0)
        totals.append(ops.total)
    assert totals[0] == totals[1]


WINDOW_CASES = [  # (feature map, window, sinks, sparse cache, learned gamma)
    (None, 8, 2, 0, False), (None, 8, 2, 5, False), ("hedgehog", 8, 2, 0, True), ("favor+", 8, 1, 0, False),
    ("hedgehog", 4, 1, 3, True),
]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: f"{c[0]}-w{c[1]}-s{c[2]}-G{c[3]}-{'learned' if c[4] else 'cal'}")
def test_parallel_causal_window_equals_the_reference_and_the_chunked_gradients(parallel, monkeypatch, case):
    name, window, sinks, cache, learned = case
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 45, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 45, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    feature_map = None if name is None else make_feature_map(
        name, 8, **({"num_heads": 4, "num_key_value_heads": 2} if name == "hedgehog" else {"nb_features": 16})).double()
    gamma = torch.full((4,), 0.3, dtype=torch.float64) if learned else None
    mask = torch.ones(2, 45, dtype=torch.bool)
    mask[1, :6] = False
    rows = mask[:, None, :, None]
    options = dict(window=window, sinks=sinks, sparse_cache=cache, key_padding_mask=mask, chunk_size=8)
    expected = reference_window_linear_attention(q, k, v, feature_map, softmax_weight=gamma, **options)
    grads = {}
    for path in ("parallel", "chunked"):
        monkeypatch.setenv(PATH_VARIABLE, path)
        tensors = [t.clone().requires_grad_() for t in (q, k, v)]
        out = window_linear_attention(*tensors, feature_map, softmax_weight=gamma, **options)
        assert _relative(out, expected, rows) < 1e-10
        grads[path] = torch.autograd.grad((torch.where(rows, out, 0.0) ** 2).sum(), tensors)
    assert all(_relative(a, b) < 1e-10 for a, b in zip(grads["parallel"], grads["chunked"]))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the dev extra installs it)")
@pytest.mark.parametrize("length,window,cache,chunk", [(61, 4, 5, 8), (150, 8, 70, 16)],
                         ids=["one-tile", "several-tiles"])
def test_the_selection_kernel_equals_the_boundary_loop(parallel, monkeypatch, length, window, cache, chunk):
    """Under Triton's interpreter (conftest sets TRITON_INTERPRET=1 without a GPU): the sparse cache a layer without a
    tail keeps at every boundary, and its outputs, equal the loop's, for left-padded rows (whose boundaries are
    shifted: some rows skip a block's selection) and for a call continuing a state (an entering cache)."""
    from hf_performer import window_boundaries
    from hf_performer.window_causal import sparse_cache_membership
    from hf_performer.window_selection_kernel import kernel_applies

    generator = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, length, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, length, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    v[:, :, 20:30] = v[:, :, 20:21]  # equal values: tied errors, the older candidate first
    if not kernel_applies(v):
        pytest.skip("TRITON_INTERPRET is off and there is no GPU")
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, :6] = False
    options = dict(window=window, sinks=1, sparse_cache=cache, chunk_size=chunk)
    calls = []
    kernel = window_boundaries.select_without_tail
    monkeypatch.setattr(window_boundaries, "select_without_tail", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))

    def run():
        member = sparse_cache_membership(k, v, None, key_padding_mask=mask, scaling=None, **options)
        whole = window_linear_attention(q, k, v, None, key_padding_mask=mask, **options)
        cut = length // 2 - 1
        first, state = window_linear_attention(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], None,
                                               key_padding_mask=mask[:, :cut], return_state=True, **options)
        second = window_linear_attention(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], None, initial_state=state,
                                         key_padding_mask=mask[:, cut:], **options)
        return member, whole, torch.cat([first, second], dim=2)

    with_kernel = run()
    assert len(calls) == 4  # the membership, the whole call, both halves
    monkeypatch.setattr(window_boundaries, "kernel_applies", lambda _: False)
    with_loop = run()
    assert len(calls) == 4
    assert torch.equal(with_kernel[0], with_loop[0]) and with_kernel[0].any()
    rows = mask[:, None, :, None]
    for got, expected in zip(with_kernel[1:], with_loop[1:]):
        assert _relative(got, expected, rows) < 1e-12
    assert _relative(with_kernel[2], with_kernel[1], rows) < 1e-12  # the continued call equals the whole one


def test_settings_beyond_the_input_cost_what_the_input_holds():
    """A call without a state clips its window and sparse cache to its tokens (the same outputs): a cost bounded by
    the input, not by a setting of a million."""
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 150, 16, generator=generator) for _ in range(3))
    huge = window_linear_attention(q, k, v, None, window=8, sinks=1, sparse_cache=10**6)
    assert torch.equal(huge, window_linear_attention(q, k, v, None, window=8, sinks=1, sparse_cache=150))
    wide = window_linear_attention(q, k, v, None, window=10**5, sinks=1)
    assert torch.equal(wide, window_linear_attention(q, k, v, None, window=150, sinks=1))


@pytest.mark.parametrize("changes", [{"sparse_cache": 10**6}, {"window": 600},
                                     {"layer_windows": {"1": {"sparse_cache": 512}}}])
def test_settings_covering_every_position_are_refused_in_one_line(tiny_llama_lm, changes):
    """convert_to_performer and update_favor_settings refuse a window or a sparse cache that covers every position the
    model takes (exact softmax at a higher cost; a decoding state sized by the setting), and change nothing."""
    from hf_performer.conversion import ConversionError, convert_to_performer
    from hf_performer.favor_attention import update_favor_settings

    positions = tiny_llama_lm.config.max_position_embeddings
    with pytest.raises(ConversionError, match=f"covers all {positions} positions the model takes") as failure:
        convert_to_performer(tiny_llama_lm, feature_map="hedgehog", **{"window": 8, **changes})
    assert "\n" not in str(failure.value)
    model = convert_to_performer(tiny_llama_lm, feature_map="hedgehog", window=8, sinks=1)
    before = dict(model.config.favor_settings)
    with pytest.raises(ValueError, match=f"update_favor_settings: .* covers all {positions} positions"):
        update_favor_settings(model, **changes)
    assert model.config.favor_settings == before
