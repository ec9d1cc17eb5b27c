"""The CUDA path on a GPU (skipped without one): the fused and portable kernels against the float64 references, in
float32 and bf16, and a converted model's logits and greedy generation against the CPU's.

Run by ``benchmarks/scripts/gpu_check.sh`` on a lent GPU (``pytest -m cuda``); CI has none and skips them all.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hf_performer.decayed_attention import backend_for, chunk_decayed_attention, fla_decayed_attention
from hf_performer.feature_maps import make_feature_map
from hf_performer.linear_attention import linear_attention
from hf_performer.linear_attention_parallel import PATH_VARIABLE
from hf_performer.reference import reference_linear_attention, reference_window_linear_attention
from hf_performer.window_attention import window_linear_attention

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/scripts/gpu_check.sh)")]
HAS_FLA = importlib.util.find_spec("fla") is not None


def _relative(a, b, where=None):
    a, b = a.double().cpu(), b.double().cpu()
    if where is not None:
        a, b = torch.where(where.cpu(), a, 0.0), torch.where(where.cpu(), b, 0.0)
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name", ["favor+", "hedgehog"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_linear_attention_on_cuda_matches_the_reference(name, causal, dtype, tolerance):
    generator = torch.Generator().manual_seed(0)
    options = {"nb_features": 64} if name == "favor+" else {"num_heads": 4, "num_key_value_heads": 2}
    feature_map = make_feature_map(name, 32, **options)
    q = 0.5 * torch.randn(2, 4, 1000, 32, generator=generator)
    k, v = (0.5 * torch.randn(2, 2, 1000, 32, generator=generator) for _ in range(2))
    mask = torch.ones(2, 1000, dtype=torch.bool)
    mask[1, :37] = False
    expected = reference_linear_attention(q, k, v, feature_map.double(), causal=causal, key_padding_mask=mask)
    feature_map = feature_map.float().cuda()
    tensors = [t.cuda().to(dtype).requires_grad_() for t in (q, k, v)]
    out = linear_attention(*tensors, feature_map, causal=causal, key_padding_mask=mask.cuda())
    assert out.dtype == dtype and torch.isfinite(out).all()
    rows = mask[:, None, :, None]
    assert _relative(out, expected, rows) < tolerance
    out.float().pow(2).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in tensors)


@pytest.mark.skipif(not HAS_FLA, reason="flash-linear-attention is not installed")
def test_fla_backend_matches_the_portable_kernels():
    from hf_performer.decayed_attention import _fla_refused_on

    if _fla_refused_on(torch.cuda.current_device()):
        pytest.skip("fla's gated backward is refused on this GPU with this Triton (Hopper, Triton < 3.7.1)")
    generator = torch.Generator().manual_seed(1)
    q, k = (torch.rand(2, 3, 4096, 128, generator=generator).cuda().bfloat16() / 8 for _ in range(2))
    v = torch.randn(2, 3, 4096, 65, generator=generator).cuda().bfloat16()
    g = -torch.rand(2, 3, 4096, generator=generator).cuda() / 4
    s0 = torch.rand(2, 3, 128, 65, generator=generator).cuda()
    tensors = [t.clone().requires_grad_() for t in (q, k, v)]
    fast, fast_final = fla_decayed_attention(*tensors, g, s0, True)
    portable, portable_final = chunk_decayed_attention(q.float(), k.float(), v.float(), g, s0, True)
    assert _relative(fast, portable) < 2e-2 and _relative(fast_final, portable_final) < 2e-2
    fast.pow(2).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in tensors)
    assert backend_for(q) == "fla"


@pytest.mark.parametrize("case", [(None, 64, 4, 256), (None, 16, 2, 0), ("hedgehog", 16, 2, 0), ("favor+", 16, 1, 0)],
                         ids=lambda c: f"{c[0]}-w{c[1]}-s{c[2]}-G{c[3]}")
def test_causal_window_on_cuda_matches_the_reference(case):
    """float64 on the GPU (the selection kernel, SDPA on the blocks, the tail) against the float64 reference."""
    name, window, sinks, cache = case
    generator = torch.Generator().manual_seed(2)
    length = 700
    q = torch.randn(2, 4, length, 32, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, length, 32, generator=generator, dtype=torch.float64) for _ in range(2))
    feature_map = None if name is None else make_feature_map(
        name, 32, **({"num_heads": 4, "num_key_value_heads": 2} if name == "hedgehog" else {"nb_features": 32})).double()
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, :21] = False
    options = dict(window=window, sinks=sinks, sparse_cache=cache, key_padding_mask=mask, chunk_size=64)
    expected = reference_window_linear_attention(q, k, v, feature_map, **options)
    options["key_padding_mask"] = mask.cuda()
    out = window_linear_attention(q.cuda(), k.cuda(), v.cuda(), None if feature_map is None else feature_map.cuda(),
                                  **options)
    assert _relative(out, expected, mask[:, None, :, None]) < 1e-9
    bf16 = window_linear_attention(*(t.cuda().bfloat16() for t in (q, k, v)), None if feature_map is None else
                                   feature_map.float().cuda(), **options)
    assert torch.isfinite(bf16).all() and _relative(bf16, expected, mask[:, None, :, None]) < 5e-2


@pytest.mark.parametrize("settings", [dict(feature_map="favor+"), dict(feature_map="hedgehog", window=16, sinks=2),
                                      dict(feature_map="hedgehog", window=16, sinks=2, sparse_cache=8,
                                           linear_tail=False)], ids=["favor", "window-tail", "window-cache"])
def test_a_converted_llama_on_cuda_matches_the_cpu(settings, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_performer.conversion import convert_to_performer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=99, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    performer = convert_to_performer(LlamaForCausalLM(config).eval(), task="causal-lm", **settings)
    ids = torch.randint(0, 99, (2, 300))
    with torch.no_grad():
        cpu = performer(input_ids=ids).logits
        cpu_tokens = performer.generate(input_ids=ids[:, :40], max_new_tokens=12, do_sample=False)
        performer.cuda()
        gpu = performer(input_ids=ids.cuda()).logits
        gpu_tokens = performer.generate(input_ids=ids[:, :40].cuda(), max_new_tokens=12, do_sample=False)
    assert _relative(gpu, cpu) < 1e-4
    assert torch.equal(gpu_tokens.cpu(), cpu_tokens)
    monkeypatch.setenv(PATH_VARIABLE, "chunked")  # the CPU path's kernels on the GPU give the same
    with torch.no_grad():
        assert _relative(performer(input_ids=ids.cuda()).logits, cpu) < 1e-4
