"""bf16 / fp16 on CPU: 4k-token inputs and large activation norms give no NaN/Inf, bidirectional, causal and decode.

The kernels compute features, sums and recurrent states in float32 whatever the input dtype (pitfalls 1 and 12 of
``pitfalls.md``), so a half-precision run equals the float32 run on the same rounded inputs up to the final rounding.
Positive maps only: the "trig" map's denominators can vanish, so its float32 outputs can exceed the fp16 range
(65504); that is the estimator, not the arithmetic.

Tiny random models built offline from configs; nothing is downloaded.
"""

import pytest
import torch
from transformers import LlamaConfig
from transformers.utils import logging

from hf_performer import (
    FavorCacheLayer,
    PerformerConfig,
    PerformerForCausalLM,
    PerformerForMaskedLM,
    linear_attention,
    make_feature_map,
)
from conftest import cached, tiny_bert_config, tiny_gpt2_config

logging.set_verbosity_error()

LENGTH, HEADS, HEAD_DIM, NB_FEATURES, VOCAB = 4096, 2, 16, 32, 61
HALF_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def _feature_map(name):
    if name == "hedgehog":
        return make_feature_map(name, HEAD_DIM, num_heads=HEADS)
    return make_feature_map(name, HEAD_DIM, None if name == "elu+1" else NB_FEATURES)


def _large_qkv(dtype, scale=50.0):
    """``[1, H, 4096, d]`` queries and keys of norm ~``scale * sqrt(d)`` (exp(q.k) far beyond any float range)."""
    generator = torch.Generator().manual_seed(0)
    shape = (1, HEADS, LENGTH, HEAD_DIM)
    q = (scale * torch.randn(shape, generator=generator)).to(dtype)
    k = (scale * torch.randn(shape, generator=generator)).to(dtype)
    v = torch.randn(shape, generator=generator).to(dtype)
    return q, k, v


def _assert_finite(**tensors):
    for name, tensor in tensors.items():
        assert torch.isfinite(tensor).all(), f"{name} has NaN/Inf"


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("name", ["favor+", "relu", "elu+1", "hedgehog"])
def test_kernels_on_4k_tokens_with_large_norms_stay_finite(name, dtype):
    feature_map = _feature_map(name)
    q, k, v = _large_qkv(dtype)
    mask = torch.ones(1, LENGTH, dtype=torch.bool)
    mask[0, :64] = False  # left padding
    for causal in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = linear_attention(*leaves, feature_map, causal=causal, key_padding_mask=mask, chunk_size=256)
        assert out.dtype == dtype
        _assert_finite(out=out)
        # Float32 sums: the half-precision run is the float32 run on the same (rounded) inputs, rounded once.
        expected = linear_attention(
            q.float(), k.float(), v.float(), feature_map, causal=causal, key_padding_mask=mask, chunk_size=256
        )
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
        out.float().square().sum().backward()
        _assert_finite(**{f"grad of {tensor}": leaf.grad for tensor, leaf in zip("qkv", leaves)})

    # Decode: prefill L-1 tokens, then one recurrent step; the step equals the last row of the full causal run.
    with torch.no_grad():
        _, state = linear_attention(
            q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], feature_map, causal=True, key_padding_mask=mask[:, :-1],
            return_state=True, chunk_size=256,
        )
        step, state = linear_attention(
            q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], feature_map, causal=True, key_padding_mask=mask[:, -1:],
            initial_state=state, return_state=True,
        )
    assert step.dtype == dtype and all(t.dtype == torch.float32 for t in state)
    _assert_finite(step=step, kv=state.kv, k_sum=state.k_sum)
    torch.testing.assert_close(step.float(), expected[:, :, -1:], rtol=2e-2, atol=2e-2)


def _tiny_model(source):
    common = dict(num_hidden_layers=2, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    if source == "bert":
        config = tiny_bert_config(max_position_embeddings=LENGTH, **common)
        model_class = PerformerForMaskedLM
    elif source == "gpt2":
        config = tiny_gpt2_config(n_positions=LENGTH, **common)
        model_class = PerformerForCausalLM
    else:  # 2 heads sharing 1 key/value head: not the shared tiny Llama
        config = LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=37,
                             max_position_embeddings=LENGTH, **common)
        model_class = PerformerForCausalLM
    torch.manual_seed(0)
    model = model_class(PerformerConfig(source_config=config, nb_features=NB_FEATURES)).eval()
    # Large activations inside attention too (the norm layers would undo a scaling of the embeddings alone).
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if parameter_name.endswith(("q_proj.weight", "k_proj.weight", "c_attn.weight", "query.weight",
                                        "key.weight")):
                parameter.mul_(50)
    return model


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("source", ["bert", "gpt2", "llama"])
def test_models_on_4k_tokens_with_embeddings_times_50_stay_finite(source, dtype):
    model = _tiny_model(source).to(dtype)
    input_ids = torch.randint(3, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        embeddings = 50 * model.get_input_embeddings()(input_ids)
        if isinstance(model, PerformerForMaskedLM):  # bidirectional
            logits = model(inputs_embeds=embeddings).logits
            assert logits.dtype == dtype
            _assert_finite(logits=logits)
            return
        # Causal prefill of L-1 tokens, then one decoding step on the constant-memory cache.
        prefill = model(inputs_embeds=embeddings[:, :-1], use_cache=True)
        step = model(inputs_embeds=embeddings[:, -1:], **cached(model, prefill.past_key_values), use_cache=True)
    assert isinstance(step.past_key_values.layers[0], FavorCacheLayer)
    assert prefill.logits.dtype == dtype
    _assert_finite(prefill=prefill.logits, step=step.logits)
