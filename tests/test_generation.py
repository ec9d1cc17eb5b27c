"""Constant-memory generation with attn_implementation="favor": FavorCacheLayer, make_favor_cache, generate().

Tiny random models built offline from configs; nothing is downloaded.
"""

import pytest
import torch
from transformers import (
    BertConfig,
    BertLMHeadModel,
    DynamicCache,
    StaticCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, DynamicLayer
from transformers.utils import logging

from hf_performer import (
    FavorCacheLayer,
    LinearAttentionError,
    LinearAttentionState,
    attach_feature_maps,
    make_favor_cache,
)

from conftest import cached

logging.set_verbosity_error()

VOCAB = 99


def gpt2_config():
    # A large init scale gives peaked, input-dependent logits, so that beams and greedy paths really differ.
    return GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, pad_token_id=0, initializer_range=0.3)


def llama_config():
    return LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=37,
        vocab_size=VOCAB,
        pad_token_id=0,
        initializer_range=0.3,
    )


def bert_decoder_config():
    return BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        vocab_size=VOCAB,
        is_decoder=True,
        pad_token_id=0,
    )


MODELS = {
    "gpt2": (gpt2_config, GPT2LMHeadModel),
    "llama": (llama_config, LlamaForCausalLM),
    "bert-decoder": (bert_decoder_config, BertLMHeadModel),
}
DECODERS = ["gpt2", "llama"]


def build(name, favor_settings=None, attach=True, seed=0):
    config_fn, model_cls = MODELS[name]
    config = config_fn()
    # A small chunk size makes prefills span several chunks of the causal scan.
    config.favor_settings = {"nb_features": 32, "chunk_size": 4, **(favor_settings or {})}
    torch.manual_seed(seed)
    model = model_cls._from_config(config, attn_implementation="favor").eval()
    if attach:
        attach_feature_maps(model)
    return model


def tokens(batch=2, length=12, seed=1):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_padded_mask(batch, length, pad):
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :pad] = 0
    return mask


def positions(attention_mask):
    return (attention_mask.cumsum(-1) - 1).clamp_min(0)


def decode_step_by_step(model, input_ids, attention_mask, prefill, cache=None):
    """Logits of a prefill of `prefill` tokens followed by one-token steps, and the cache used."""
    outputs = model(
        input_ids[:, :prefill],
        attention_mask=attention_mask[:, :prefill],
        position_ids=positions(attention_mask)[:, :prefill],
        **cached(model, cache),
        use_cache=True,
    )
    cache, logits = outputs.past_key_values, [outputs.logits]
    for i in range(prefill, input_ids.shape[1]):
        outputs = model(
            input_ids[:, i : i + 1],
            attention_mask=attention_mask[:, : i + 1],
            position_ids=positions(attention_mask)[:, i : i + 1],
            **cached(model, cache),
            use_cache=True,
        )
        logits.append(outputs.logits)
    return torch.cat(logits, dim=1), cache


# --------------------------------------------------------------------------------------------
# Prefill + decode == one full forward
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_then_token_by_token_equals_full_forward(name):
    model = build(name)
    input_ids = tokens(length=13)
    attention_mask = left_padded_mask(2, 13, pad=3)
    with torch.no_grad():
        full = model(input_ids, attention_mask=attention_mask, position_ids=positions(attention_mask), use_cache=False)
        incremental, cache = decode_step_by_step(model, input_ids, attention_mask, prefill=6)
    layers = cache.self_attention_cache.layers if hasattr(cache, "self_attention_cache") else cache.layers
    assert all(isinstance(layer, FavorCacheLayer) for layer in layers)
    assert all(layer.get_seq_length() == 13 and layer.keys is None for layer in layers)
    real = attention_mask.bool()
    torch.testing.assert_close(incremental[real], full.logits[real], atol=1e-5, rtol=1e-5)


def test_full_kv_cache_fallback_is_exact():
    """A cache layer holding full keys/values (no favor cache) is still computed correctly."""
    model = build("gpt2", attach=False)  # lazy: hooks appear during the first forward, after the cache update
    input_ids = tokens(length=10)
    attention_mask = left_padded_mask(2, 10, pad=2)
    with torch.no_grad():
        incremental, cache = decode_step_by_step(model, input_ids, attention_mask, prefill=5)
        full = model(input_ids, attention_mask=attention_mask, position_ids=positions(attention_mask), use_cache=False)
    assert all(type(layer) is DynamicLayer and layer.get_seq_length() == 10 for layer in cache.layers)
    real = attention_mask.bool()
    torch.testing.assert_close(incremental[real], full.logits[real], atol=1e-5, rtol=1e-5)


def test_favor_cache_refuses_tokens_never_folded_into_its_state():
    model = build("gpt2", attach=False)  # the first forward cannot see the cache (no hooks yet)
    cache = make_favor_cache(model)
    input_ids = tokens()
    with torch.no_grad():
        model(input_ids[:, :5], **cached(model, cache), use_cache=True)
        with pytest.raises(RuntimeError, match="never folded"):
            model(input_ids[:, 5:6], **cached(model, cache), use_cache=True)


def test_static_cache_is_refused():
    """A static key buffer (unfilled slots) cannot be read as the tokens seen: clear error, no silent garbage."""
    model = build("gpt2")
    with pytest.raises(LinearAttentionError, match="fixed size"):
        model(tokens(length=6), **cached(model, StaticCache(config=model.config, max_cache_len=16)), use_cache=True)


# --------------------------------------------------------------------------------------------
# generate()
# --------------------------------------------------------------------------------------------


def _generate(model, input_ids, **kwargs):
    kwargs = {"max_new_tokens": 8, "output_scores": True, **kwargs}
    with torch.no_grad():
        return model.generate(input_ids, do_sample=False, return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("name", DECODERS)
def test_greedy_generate_uses_favor_cache_and_matches_no_cache(name):
    model = build(name)
    input_ids = tokens(length=5)
    cached = _generate(model, input_ids)
    uncached = _generate(model, input_ids, use_cache=False)
    assert all(isinstance(layer, FavorCacheLayer) for layer in cached.past_key_values.layers)
    assert torch.equal(cached.sequences, uncached.sequences)
    for a, b in zip(cached.scores, uncached.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", DECODERS)
def test_generate_with_left_padding(name):
    model = build(name)
    input_ids = tokens(length=6)
    attention_mask = left_padded_mask(2, 6, pad=2)
    batched = _generate(model, input_ids, attention_mask=attention_mask)
    uncached = _generate(model, input_ids, attention_mask=attention_mask, use_cache=False)
    alone = _generate(model, input_ids[1:, 2:])
    assert torch.equal(batched.sequences, uncached.sequences)
    assert torch.equal(batched.sequences[1:, 2:], alone.sequences)
    for a, b, c in zip(batched.scores, uncached.scores, alone.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a[1:], c, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", DECODERS)
def test_beam_search_matches_no_cache(name):
    model = build(name)
    input_ids = tokens(length=5)
    # Both beams are returned: a beam that continues from the other one's state must be reordered.
    beam_kwargs = {"num_beams": 2, "num_return_sequences": 2, "max_new_tokens": 6, "output_scores": False}
    cached = _generate(model, input_ids, **beam_kwargs)
    uncached = _generate(model, input_ids, use_cache=False, **beam_kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, atol=1e-5, rtol=1e-5)
    assert all(layer.state.kv.shape[0] == 4 for layer in cached.past_key_values.layers)  # batch 2 x 2 beams


def test_hybrid_model_keeps_full_cache_for_softmax_layers():
    model = build("gpt2", favor_settings={"softmax_layers": [0]})
    input_ids = tokens(length=5)
    explicit = _generate(model, input_ids, **cached(model, make_favor_cache(model)))
    default = _generate(model, input_ids)
    uncached = _generate(model, input_ids, use_cache=False)
    for result in (explicit, default):
        assert [type(layer) for layer in result.past_key_values.layers] == [DynamicLayer, FavorCacheLayer]
        assert torch.equal(result.sequences, uncached.sequences)
        for a, b in zip(result.scores, uncached.scores):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_cache_memory_does_not_grow_with_context():
    model = build("llama")
    sizes = []
    for length in (4, 40):
        result = _generate(model, tokens(length=length), max_new_tokens=3, output_scores=False)
        layers = result.past_key_values.layers
        assert all(layer.get_seq_length() == length + 2 for layer in layers)  # the last token is never fed back
        sizes.append([(tuple(t.shape) for t in layer.state) for layer in layers])
        sizes[-1] = [list(shapes) for shapes in sizes[-1]] + [sum(layer.state_nbytes() for layer in layers)]
    assert sizes[0] == sizes[1]
    # kv [B, H, m, dv], k_sum [B, H, m], stabilizer [B, H]: nothing scales with the number of tokens.
    assert sizes[0][0] == [(2, 4, 32, 8), (2, 4, 32), (2, 4)]


# --------------------------------------------------------------------------------------------
# Cache layer protocol
# --------------------------------------------------------------------------------------------


def test_favor_cache_layer_protocol():
    assert DYNAMIC_LAYER_TYPE_MAPPING["favor"] is FavorCacheLayer
    layer = FavorCacheLayer()
    cache = Cache(layers=[layer])
    key = torch.randn(3, 2, 5, 4)
    returned_key, returned_value = cache.update(key, key + 1, 0)
    assert returned_key is key and layer.keys is None
    assert cache.get_seq_length() == 5 and cache.get_mask_sizes(1, 0) == (6, 0)
    rows = torch.arange(3.0)[:, None, None, None].expand(3, 2, 6, 4)  # kv[b] filled with b
    layer.set_state(LinearAttentionState(rows, torch.zeros(3, 2, 6), torch.zeros(3, 2)))
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert layer.state.kv[:, 0, 0, 0].tolist() == [2.0, 2.0, 0.0]
    cache.batch_select_indices(torch.tensor([2]))
    assert layer.state.kv.shape == (1, 2, 6, 4) and layer.state.kv[0, 0, 0, 0] == 0.0
    cache.batch_repeat_interleave(2)
    assert layer.state.k_sum.shape == (2, 2, 6)
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        cache.crop(-1)  # nothing recorded: a recurrent state cannot be rolled back (see test_transformers_conformance)
    cache.reset()
    assert cache.get_seq_length() == 0 and layer.state is None


def test_make_favor_cache_accepts_config_or_model():
    model = build("llama", favor_settings={"softmax_layers": [1]}, attach=False)
    for source in (model, model.config):
        cache = make_favor_cache(source)
        assert isinstance(cache, DynamicCache)
        assert [type(layer) for layer in cache.layers] == [FavorCacheLayer, DynamicLayer]
