"""Generation with window layers (exact softmax over sinks + a sliding window, a linear tail): converted tiny
Llama (GQA, RoPE) and GPT-2, both modes. generate() with the WindowCacheLayer equals generate(use_cache=False),
with left padding; assisted generation and prompt lookup (which roll the cache back) give plain greedy's tokens;
beam search; the cache's size does not grow with the context."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer
from transformers.utils import logging

from hf_performer import FavorCacheLayer, WindowCacheLayer, attach_feature_maps, make_favor_cache

logging.set_verbosity_error()

VOCAB = 99
# window 3, chunk 4: prompts of 9+ tokens fold tokens into the tail while generating.
WINDOW = {"window": 3, "sinks": 2}
MODES = {
    "calibrated": {"feature_map": "favor+", "nb_features": 32, "softmax_weight": "calibrated"},
    "learned": {"feature_map": "hedgehog", "softmax_weight": "learned"},
}


def _config(name, **overrides):
    # A large init scale gives peaked, input-dependent logits, so that greedy paths really depend on the attention.
    if name == "llama":
        return LlamaConfig(**{**dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=37, vocab_size=VOCAB, pad_token_id=0, initializer_range=0.3),
                              **overrides})
    return GPT2Config(**{**dict(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, pad_token_id=0,
                                initializer_range=0.3), **overrides})


def build(name, mode="calibrated", seed=0, **settings):
    config = _config(name)
    config.favor_settings = {**WINDOW, **MODES[mode], "chunk_size": 4, **settings}
    torch.manual_seed(seed)
    model_cls = LlamaForCausalLM if name == "llama" else GPT2LMHeadModel
    model = model_cls._from_config(config, attn_implementation="favor").eval()
    attach_feature_maps(model)
    if mode == "learned":  # move gamma away from its initial value: both terms matter
        for module in model.modules():
            if hasattr(module, "favor_softmax_weight"):
                with torch.no_grad():
                    for parameter in module.favor_softmax_weight.parameters():
                        parameter.uniform_(-1.0, 1.0)
    return model


def tokens(batch=2, length=12, seed=1):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, input_ids, **kwargs):
    kwargs = {"max_new_tokens": 8, "output_scores": True, **kwargs}
    with torch.no_grad():
        return model.generate(input_ids, do_sample=False, return_dict_in_generate=True, **kwargs)


def _tail_holds_tokens(state):
    """Whether tokens left the window into the tail sums (committed or pending)."""
    pending = 0.0 if state.query_tail is None else float(state.query_tail[0].abs().sum())
    return float(state.current.tail_sums.abs().sum()) + pending > 0


def _window_layers(cache):
    return [layer for layer in cache.layers if isinstance(layer, WindowCacheLayer)]


CASES = [(name, mode) for name in ("llama", "gpt2") for mode in MODES]


@pytest.mark.parametrize("name, mode", CASES)
def test_greedy_generate_with_left_padding_equals_no_cache(name, mode):
    model = build(name, mode)
    input_ids = tokens(length=10)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    cached = _generate(model, input_ids, attention_mask=attention_mask)
    uncached = _generate(model, input_ids, attention_mask=attention_mask, use_cache=False)
    layers = _window_layers(cached.past_key_values)
    assert len(layers) == 2 and all(_tail_holds_tokens(layer.state) for layer in layers)  # the tail was used
    assert torch.equal(cached.sequences, uncached.sequences)
    for a, b in zip(cached.scores, uncached.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name, mode", CASES)
def test_assisted_generation_gives_the_greedy_tokens(name, mode, monkeypatch):
    model = build(name, mode)
    assistant = LlamaForCausalLM(_config("llama", num_hidden_layers=1)).eval()  # same vocabulary, softmax
    input_ids = tokens(batch=1, length=9, seed=2)
    crops = []
    original_crop = WindowCacheLayer.crop
    monkeypatch.setattr(WindowCacheLayer, "crop", lambda self, n: (crops.append(n), original_crop(self, n))[1])
    greedy = _generate(model, input_ids, max_new_tokens=12)
    # The default schedule drafts 20 tokens, more than the default max_rollback (0): the verifying forward is kept
    # croppable (activate_past_recording) whatever its length.
    assisted = _generate(model, input_ids, max_new_tokens=12, assistant_model=assistant)
    assert torch.equal(assisted.sequences, greedy.sequences)
    assert any(n < 0 for n in crops)  # rejected drafts were rolled back


@pytest.mark.parametrize("name, mode", CASES[:2])
def test_prompt_lookup_gives_the_greedy_tokens(name, mode):
    model = build(name, mode)
    pattern = tokens(batch=1, length=4, seed=3)
    input_ids = torch.cat([pattern, pattern, pattern[:, :2], pattern], dim=1)  # n-grams to look up
    greedy = _generate(model, input_ids, max_new_tokens=10)
    lookup = _generate(model, input_ids, max_new_tokens=10, prompt_lookup_num_tokens=3)
    assert torch.equal(lookup.sequences, greedy.sequences)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_beam_search_matches_no_cache(name):
    model = build(name)
    input_ids = tokens(length=9)
    beam_kwargs = {"num_beams": 2, "num_return_sequences": 2, "max_new_tokens": 6, "output_scores": False}
    cached = _generate(model, input_ids, **beam_kwargs)
    uncached = _generate(model, input_ids, use_cache=False, **beam_kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, atol=1e-4, rtol=1e-4)
    assert all(layer.state.sink_key.shape[0] == 4 for layer in _window_layers(cached.past_key_values))


def test_cache_bytes_do_not_grow_with_the_context():
    model = build("llama")
    sizes = []
    for length in (12, 40):
        result = _generate(model, tokens(length=length), max_new_tokens=3, output_scores=False)
        layers = _window_layers(result.past_key_values)
        assert [layer.get_seq_length() for layer in layers] == [length + 2] * 2
        sizes.append(sum(layer.state_nbytes() for layer in layers))
    assert sizes[0] == sizes[1] > 0


def test_make_favor_cache_picks_the_layer_kind_per_layer():
    model = build("llama", softmax_layers=[0])
    assert [type(layer) for layer in make_favor_cache(model).layers] == [DynamicLayer, WindowCacheLayer]
    plain = build("gpt2", window=0, sinks=0)
    assert [type(layer) for layer in make_favor_cache(plain).layers] == [FavorCacheLayer, FavorCacheLayer]
    assert all(layer.max_rollback == 8 for layer in make_favor_cache(model, max_rollback=8).layers[1:])


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_prompt_shorter_than_the_sinks_generates(use_cache):
    model = build("llama", sinks=4)
    input_ids = tokens(batch=1, length=1, seed=4)
    result = _generate(model, input_ids, max_new_tokens=6, use_cache=use_cache)
    reference = _generate(model, input_ids, max_new_tokens=6, use_cache=not use_cache)
    assert result.sequences.shape == (1, 7) and torch.equal(result.sequences, reference.sequences)


def _decode_by_hand(model, input_ids, attention_mask, steps, **step_kwargs):
    """Prefill, then ``steps`` greedy one-token forwards through a make_favor_cache cache: the logits of each."""
    cache = make_favor_cache(model)
    logits = []
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, cache=cache, use_cache=True)
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(token)], dim=1)
            out = model(input_ids=token, attention_mask=attention_mask, cache=cache, use_cache=True, **step_kwargs)
            logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


def test_the_exact_step_ahead_of_the_dispatch_equals_the_general_path(monkeypatch):
    """favor_attention_forward's early exact step (WindowCacheLayer.exact_step) gives the general path's logits
    bit for bit, with left padding; weights requested or a rollback window take the general path."""
    import hf_performer.favor_attention as favor_attention

    model = build("llama", linear_tail=False, sparse_cache=2, chunk_size=8)
    input_ids, attention_mask = tokens(length=10), torch.ones(2, 10, dtype=torch.long)
    attention_mask[1, :3] = 0
    ahead = []
    original = favor_attention._exact_decoding_step
    monkeypatch.setattr(favor_attention, "_exact_decoding_step",
                        lambda *args: ahead.append(original(*args)) or ahead[-1])
    fast = _decode_by_hand(model, input_ids, attention_mask, 12)
    assert sum(out is not None for out in ahead) >= 8  # 2 layers x the steps after each boundary's packing
    monkeypatch.setattr(favor_attention, "_exact_decoding_step", lambda *args: None)
    general = _decode_by_hand(model, input_ids, attention_mask, 12)
    assert torch.equal(fast, general)
    monkeypatch.setattr(favor_attention, "_exact_decoding_step",
                        lambda *args: ahead.append(original(*args)) or ahead[-1])
    ahead.clear()
    _decode_by_hand(model, input_ids, attention_mask, 6, output_attentions=True)
    assert ahead and all(out is None for out in ahead)
    cache = make_favor_cache(model, max_rollback=2)
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=attention_mask, cache=cache, use_cache=True)
        ahead.clear()
        model(input_ids=input_ids[:, :1], attention_mask=torch.cat([attention_mask, attention_mask[:, :1]], 1),
              cache=cache, use_cache=True)
    assert ahead and all(out is None for out in ahead)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_greedy_generate_without_a_tail_takes_the_exact_step_and_equals_no_cache(name, monkeypatch):
    import hf_performer.window_cache_layer as cache_module
    import hf_performer.window_attention as window_attention

    model = build(name, linear_tail=False, sparse_cache=2)
    served, served_ahead = [], []  # through the general dispatch; through the cache layer's exact_step, ahead of it
    original = window_attention.exact_decode_step
    monkeypatch.setattr(window_attention, "exact_decode_step",
                        lambda *args, **kwargs: served.append(original(*args, **kwargs)) or served[-1])
    monkeypatch.setattr(cache_module, "exact_decode_step",
                        lambda *args, **kwargs: served_ahead.append(original(*args, **kwargs)) or served_ahead[-1])
    input_ids = tokens(length=10)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    cached = _generate(model, input_ids, attention_mask=attention_mask, max_new_tokens=12)
    uncached = _generate(model, input_ids, attention_mask=attention_mask, use_cache=False, max_new_tokens=12)
    # 2 layers, steps between the rows' boundaries: the first after a boundary packs the record (general dispatch),
    # the next ones continue it (ahead of the dispatch).
    ahead = sum(step is not None for step in served_ahead)
    assert ahead >= 4 and sum(step is not None for step in served) + ahead >= 10
    assert torch.equal(cached.sequences, uncached.sequences)
    for a, b in zip(cached.scores, uncached.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_assisted_generation_and_beam_search_without_a_tail_match_greedy_and_no_cache():
    # The exact step's records meet a crop (assisted decoding) and a beam reorder: both take the general paths.
    model = build("llama", linear_tail=False, sparse_cache=2)
    assistant = LlamaForCausalLM(_config("llama", num_hidden_layers=1)).eval()
    input_ids = tokens(batch=1, length=9, seed=2)
    greedy = _generate(model, input_ids, max_new_tokens=12)
    assisted = _generate(model, input_ids, max_new_tokens=12, assistant_model=assistant)
    assert torch.equal(assisted.sequences, greedy.sequences)
    beam_kwargs = {"num_beams": 2, "num_return_sequences": 2, "max_new_tokens": 10, "output_scores": False}
    cached = _generate(model, tokens(length=9), **beam_kwargs)
    uncached = _generate(model, tokens(length=9), use_cache=False, **beam_kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
