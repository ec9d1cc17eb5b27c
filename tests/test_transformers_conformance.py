"""Performer models behave like in-tree transformers models (issue 16): output_attentions, set_attn_implementation,
_init_weights / meta-device loading, assisted generation, packed sequences, retain_grad.

These tests cover the behaviours on tiny BERT / GPT-2 / Llama sources in the normal suite; transformers' own common
tests (ModelTesterMixin, GenerationTesterMixin, ConfigTester) run against the same classes in the opt-in harness
tests/transformers_common/ (see README, "Transformers conformance").
"""

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging

from hf_performer import (
    FavorCacheLayer,
    PerformerConfig,
    PerformerForCausalLM,
    PerformerForMaskedLM,
    PerformerForSequenceClassification,
    PerformerModel,
    favor_attention_forward,
)
from conftest import TINY_VOCAB, cached, tiny_bert_config, tiny_gpt2_config, tiny_llama_config

logging.set_verbosity_error()

gpt2_config = functools.partial(tiny_gpt2_config, bos_token_id=1, eos_token_id=2, pad_token_id=0)
llama_config = functools.partial(tiny_llama_config, bos_token_id=1, eos_token_id=2, pad_token_id=0)
SOURCES = {"bert": tiny_bert_config, "gpt2": gpt2_config, "llama": llama_config}
CAUSAL = ["gpt2", "llama"]


def build(model_class, source, seed=0, source_overrides=None, **settings):
    torch.manual_seed(seed)
    settings = {"nb_features": 16, **settings}
    config = PerformerConfig(source_config=SOURCES[source](**(source_overrides or {})), **settings)
    return model_class(config).eval()


def token_ids(batch=2, length=9, seed=0):
    return torch.randint(3, TINY_VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def model_cases():
    for source in SOURCES:
        head = PerformerForCausalLM if source in CAUSAL else PerformerForMaskedLM
        yield pytest.param(head, source, id=f"{source}-{head.__name__}")
        yield pytest.param(PerformerModel, source, id=f"{source}-PerformerModel")
    yield pytest.param(PerformerForSequenceClassification, "bert", id="bert-PerformerForSequenceClassification")


# ---------------------------------------------------------------------------------- output_attentions


@pytest.mark.parametrize("model_class, source", list(model_cases()))
def test_output_attentions_gives_one_weight_matrix_per_layer(model_class, source):
    model = build(model_class, source)
    input_ids = token_ids()
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -3:] = 0
    outputs = model(input_ids, attention_mask=attention_mask, output_attentions=True)
    heads = model.config.source_config.num_attention_heads
    assert len(outputs.attentions) == model.config.source_config.num_hidden_layers
    for weights in outputs.attentions:
        assert weights.shape == (2, heads, 9, 9)
        assert bool((weights[1, :, :6, -3:] == 0).all())  # padded keys get no weight
        torch.testing.assert_close(weights[:, :, :6].sum(-1), torch.ones(2, heads, 6))
        if source in CAUSAL:
            assert bool((weights.triu(1) == 0).all())
    assert model(input_ids, attention_mask=attention_mask).attentions is None  # only on request


@pytest.mark.parametrize("source", CAUSAL + ["bert"])
def test_attention_weights_times_values_is_the_layer_output(source, monkeypatch):
    # Hybrid: layer 1 stays on softmax attention and returns the softmax weights it applies.
    model = build(PerformerModel, source, softmax_layers=[1])
    recorded = []

    def recording_attention(module, query, key, value, attention_mask, **kwargs):
        out, weights = favor_attention_forward(module, query, key, value, attention_mask, **kwargs)
        recorded.append((value, out, weights))
        return out, weights

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "favor", recording_attention)
    input_ids = token_ids()
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, -2:] = 0
    model(input_ids, attention_mask=attention_mask, output_attentions=True)
    assert len(recorded) == 2
    for value, out, weights in recorded:
        value = value.repeat_interleave(weights.shape[1] // value.shape[1], dim=1)
        applied = (weights @ value).transpose(1, 2)
        torch.testing.assert_close(applied[1], out[1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(applied[0, :7], out[0, :7], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("source", CAUSAL)
def test_output_attentions_while_decoding_from_a_recurrent_state_gives_none(source):
    model = build(PerformerForCausalLM, source)
    prompt = token_ids(batch=1, length=5)
    prefill = model(prompt, use_cache=True, output_attentions=True)
    assert isinstance(prefill.past_key_values.layers[0], FavorCacheLayer)
    assert [w.shape for w in prefill.attentions] == [(1, model.config.source_config.num_attention_heads, 5, 5)] * 2
    step = model(prompt[:, :1], **cached(model, prefill.past_key_values), use_cache=True, output_attentions=True)
    assert step.attentions == ()  # the past keys are gone: None per layer, as transformers' sdpa


@pytest.mark.parametrize("source", CAUSAL)
def test_retain_grad_on_hidden_states_and_attentions(source):
    # transformers' test_retain_grad_hidden_states_attentions
    model = build(PerformerForCausalLM, source).train()
    outputs = model(token_ids(), output_hidden_states=True, output_attentions=True)
    hidden_states, attentions = outputs.hidden_states[0], outputs.attentions[0]
    hidden_states.retain_grad()
    attentions.retain_grad()
    outputs.logits.flatten()[0].backward(retain_graph=True)
    assert hidden_states.grad is not None and attentions.grad is not None


# ---------------------------------------------------------------------------------- packed sequences


def _packed_batch(lengths=(4, 6, 3), seed=0):
    """A padding-free packed row made by DataCollatorWithFlattening, and the sequences it holds."""
    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(3, TINY_VOCAB, (n,), generator=generator).tolist() for n in lengths]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s} for s in sequences])
    return batch, sequences


WINDOW_LAYERS = dict(feature_map="hedgehog", nb_features=None, window=2, sinks=1)
PACKED_LAYERS = {"linear": {}, "hybrid": dict(softmax_layers=[1]), "window": WINDOW_LAYERS,
                 "window-cache": dict(WINDOW_LAYERS, sparse_cache=1, chunk_size=2),
                 "window-no-tail": dict(WINDOW_LAYERS, linear_tail=False)}


@pytest.mark.parametrize("source", CAUSAL)
@pytest.mark.parametrize("layers", list(PACKED_LAYERS))
@pytest.mark.parametrize("marker", ["position_ids", "cu_seq_lens"])
def test_packed_sequences_equal_each_sequence_alone(source, layers, marker):
    model = build(PerformerForCausalLM, source, **PACKED_LAYERS[layers])
    batch, sequences = _packed_batch()
    if marker == "position_ids":
        kwargs = dict(position_ids=batch["position_ids"])
    else:  # flash-attention style boundaries only (positions then count from 0 over the row: GPT-2 absolute
        # positions would differ from the sequences alone, so compare with the packed positions given too)
        kwargs = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
        kwargs["position_ids"] = batch["position_ids"]
        kwargs["attention_mask"] = torch.ones_like(batch["input_ids"])  # no packed mask: only cu_seq_lens mark it
    packed = model(batch["input_ids"], use_cache=False, **kwargs).logits
    alone = torch.cat([model(torch.tensor([s]), use_cache=False).logits for s in sequences], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("source", CAUSAL)
@pytest.mark.parametrize("layers", ["linear", "window-cache"])
def test_packed_training_loss_and_gradients_equal_each_sequence_alone(source, layers):
    # eval: no dropout, so both runs are deterministic; same backward
    model = build(PerformerForCausalLM, source, **PACKED_LAYERS[layers])
    batch, sequences = _packed_batch()
    packed_loss = model(
        batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"], use_cache=False
    ).loss
    packed_loss.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # The collator masks each sequence's first label: the packed loss is the mean over all predicted tokens.
    count = sum(len(s) - 1 for s in sequences)
    alone_loss = sum(
        model(torch.tensor([s]), labels=torch.tensor([s])).loss * (len(s) - 1) for s in sequences
    ) / count
    alone_loss.backward()
    torch.testing.assert_close(packed_loss, alone_loss, rtol=1e-5, atol=1e-6)
    for packed_grad, parameter in zip(packed_grads, model.parameters()):
        torch.testing.assert_close(packed_grad, parameter.grad, rtol=1e-4, atol=1e-6)


def test_packed_sequences_in_a_window_encoder_equal_each_sequence_alone():
    model = build(PerformerForMaskedLM, "bert", **dict(WINDOW_LAYERS, window=3))
    batch, sequences = _packed_batch()
    lengths = batch["cu_seq_lens_q"]
    packed = model(batch["input_ids"], cu_seq_lens_q=lengths, cu_seq_lens_k=lengths,
                   max_length_q=batch["max_length_q"], max_length_k=batch["max_length_k"],
                   position_ids=batch["position_ids"]).logits
    alone = torch.cat([model(torch.tensor([s])).logits for s in sequences], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layers", ["linear", "window-cache"])
def test_packed_attention_weights_are_each_sequence_alone_on_its_block(layers):
    model = build(PerformerForCausalLM, "llama", **PACKED_LAYERS[layers])
    batch, sequences = _packed_batch()
    packed = model(batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                   output_attentions=True).attentions
    start = 0
    for sequence in sequences:
        alone = model(torch.tensor([sequence]), use_cache=False, output_attentions=True).attentions
        end = start + len(sequence)
        for packed_weights, alone_weights in zip(packed, alone):
            torch.testing.assert_close(packed_weights[:, :, start:end, start:end], alone_weights, rtol=1e-4,
                                       atol=1e-5)
            assert bool((packed_weights[:, :, start:end, :start] == 0).all())
            assert bool((packed_weights[:, :, start:end, end:] == 0).all())
        start = end


def test_mask_builder_turns_packed_and_chunked_patterns_into_segment_ids():
    from transformers import masking_utils
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        chunked_causal_mask_function,
        find_packed_sequence_indices,
        sliding_window_causal_mask_function,
    )

    from hf_performer import favor_attention_mask

    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]])
    packed_indices = find_packed_sequence_indices(position_ids)
    if hasattr(masking_utils, "packed_sequence_mask_function"):  # transformers >= 5.24: how create_causal_mask packs
        packed = and_masks(causal_mask_function, masking_utils.packed_sequence_mask_function(packed_indices))
    else:
        packed = masking_utils.packed_sequence_compatibility_function(causal_mask_function, position_ids,
                                                                      packed_indices)
    segment_ids = favor_attention_mask(2, 7, 7, mask_function=packed)
    assert segment_ids.tolist() == [[1, 1, 1, 2, 2, 2, 2], [1] * 7]
    chunked = favor_attention_mask(1, 7, 7, mask_function=chunked_causal_mask_function(3, torch.tensor([0])))
    assert chunked.tolist() == [[1, 1, 1, 2, 2, 2, 3]]
    padding = torch.tensor([[0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    chunked = favor_attention_mask(
        1, 7, 7, mask_function=chunked_causal_mask_function(3, torch.tensor([0])), attention_mask=padding
    )
    assert chunked.tolist() == [[0, 1, 1, 2, 2, 2, 3]]
    sliding = favor_attention_mask(1, 7, 7, mask_function=sliding_window_causal_mask_function(3))
    assert sliding.shape == (1, 1, 7, 7) and sliding.dtype == torch.bool  # for softmax layers (a favor layer raises)


def test_packed_sequences_with_a_cache_follow_transformers():
    # With a cache transformers does not look for packing (create_causal_mask): as for stock sdpa models, the row is
    # one sequence; cu_seq_lens with a recurrent cache is refused (a state cannot be split by sequence).
    model = build(PerformerForCausalLM, "llama")
    batch, _ = _packed_batch()
    with pytest.raises(ValueError, match="use_cache=False"):
        model(batch["input_ids"], cu_seq_lens_q=batch["cu_seq_lens_q"], use_cache=True)


# ---------------------------------------------------------------------------------- set_attn_implementation


def _stock_twin(model):
    """The stock transformers model of the source architecture with the Performer model's weights, on sdpa."""
    source = model.source_model
    stock = type(source)._from_config(type(source.config)(**source.config.to_dict()), attn_implementation="sdpa")
    missing, unexpected = stock.load_state_dict(source.state_dict(), strict=False)
    assert not missing and all("favor_feature_map" in key for key in unexpected)
    return stock.eval()


@pytest.mark.parametrize("model_class, source", list(model_cases()))
def test_set_attn_implementation_switches_between_softmax_and_favor(model_class, source):
    model = build(model_class, source, source_overrides=dict(initializer_range=0.3))  # softmax far from uniform
    input_ids = token_ids()
    assert model.config._attn_implementation == "favor" == model.source_model.config._attn_implementation
    favor_output = model(input_ids)[0]
    teacher_output = _stock_twin(model)(input_ids)[0]
    assert (favor_output - teacher_output).abs().max() > 1e-3
    projections = [b.clone() for n, b in model.named_buffers() if n.endswith("projection")]
    for implementation in ("sdpa", "eager"):
        model.set_attn_implementation(implementation)
        assert model.config._attn_implementation == implementation == model.source_model.config._attn_implementation
        torch.testing.assert_close(model(input_ids)[0], teacher_output, rtol=1e-5, atol=1e-5)
    model.set_attn_implementation("favor")  # the feature maps survived: same projections, same output as before
    after = [b for n, b in model.named_buffers() if n.endswith("projection")]
    assert len(after) == len(projections) == 2 and all(torch.equal(a, b) for a, b in zip(projections, after))
    torch.testing.assert_close(model(input_ids)[0], favor_output, rtol=0, atol=0)


@pytest.mark.parametrize("source", ["bert", "llama"])
def test_config_setter_switches_the_wrapped_model(source):
    model = build(PerformerModel, source)
    input_ids = token_ids()
    favor_output = model(input_ids)[0]
    model.config._attn_implementation = "sdpa"
    assert model.source_model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(model(input_ids)[0], _stock_twin(model)(input_ids)[0], rtol=1e-5, atol=1e-5)
    model.config._attn_implementation = "favor"
    torch.testing.assert_close(model(input_ids)[0], favor_output, rtol=0, atol=0)


def test_from_pretrained_with_attn_implementation_gives_the_teacher(tmp_path):
    model = build(PerformerForCausalLM, "llama")
    model.save_pretrained(tmp_path)
    input_ids = token_ids()
    loaded = PerformerForCausalLM.from_pretrained(tmp_path)
    assert loaded.config._attn_implementation == "favor"
    torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)
    teacher = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert teacher.source_model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(teacher(input_ids).logits, _stock_twin(model)(input_ids).logits, rtol=1e-5, atol=1e-5)
    teacher.set_attn_implementation("favor")
    torch.testing.assert_close(teacher(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="not supported"):
        model.set_attn_implementation("favour")


# ---------------------------------------------------------------------------------- _init_weights / meta device

FEATURE_MAP_SETTINGS = {"favor+": dict(nb_features=16), "hedgehog": dict(feature_map="hedgehog", nb_features=16)}


def _feature_map_tensors(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items() if "favor_feature_map" in name}


@pytest.mark.parametrize("feature_map", list(FEATURE_MAP_SETTINGS))
def test_meta_device_model_materialised_gets_the_default_feature_maps(feature_map):
    config = PerformerConfig(source_config=llama_config(), **FEATURE_MAP_SETTINGS[feature_map])
    expected = _feature_map_tensors(PerformerForCausalLM(config))
    with torch.device("meta"):
        model = PerformerForCausalLM(config)
    model.to_empty(device="cpu")  # uninitialised memory everywhere
    model.initialize_weights()
    actual = _feature_map_tensors(model)
    assert actual.keys() == expected.keys() and len(actual) >= 6
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


@pytest.mark.parametrize("feature_map", list(FEATURE_MAP_SETTINGS))
@pytest.mark.parametrize("load_kwargs", [{}, {"device_map": "cpu"}, {"low_cpu_mem_usage": True}],
                         ids=["default", "device_map", "low_cpu_mem_usage"])
def test_from_pretrained_gives_the_saved_feature_maps(tmp_path, feature_map, load_kwargs):
    model = build(PerformerForCausalLM, "llama", **FEATURE_MAP_SETTINGS[feature_map])
    with torch.no_grad():  # saved values that differ from the defaults: a redrawn projection, trained parameters
        for module in model.modules():
            if hasattr(module, "redraw_projection"):
                module.redraw_projection()
            elif hasattr(module, "query_weight"):
                module.query_weight.add_(0.5)
                module.key_bias.add_(0.25)
    saved = _feature_map_tensors(model)
    model.save_pretrained(tmp_path)
    loaded = _feature_map_tensors(PerformerForCausalLM.from_pretrained(tmp_path, **load_kwargs))
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name


def test_checkpoint_without_feature_maps_loads_the_default_ones(tmp_path):
    from safetensors.torch import load_file, save_file

    model = build(PerformerForCausalLM, "gpt2")
    defaults = _feature_map_tensors(model)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "favor_feature_map" not in k}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    loaded = PerformerForCausalLM.from_pretrained(tmp_path)
    for name, tensor in _feature_map_tensors(loaded).items():
        assert torch.equal(tensor, defaults[name]), name


# ---------------------------------------------------------------------------------- assisted decoding, beam search


def _stock_assistant(source, seed):
    """A softmax model of the source architecture with other weights: it proposes candidates the main model rejects."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(SOURCES[source](), attn_implementation="sdpa").eval()


@pytest.mark.parametrize("source", CAUSAL)
@pytest.mark.parametrize("helper", ["assistant_model", "prompt_lookup"])
def test_assisted_generation_equals_greedy_and_rolls_the_cache_back(source, helper, monkeypatch):
    model = build(PerformerForCausalLM, source)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    crops = []
    original_crop = FavorCacheLayer.crop
    monkeypatch.setattr(FavorCacheLayer, "crop", lambda self, n: (crops.append(n), original_crop(self, n))[1])
    if helper == "assistant_model":
        kwargs = dict(assistant_model=_stock_assistant(source, seed=1))
    else:
        kwargs = dict(prompt_lookup_num_tokens=3)
    greedy = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assisted = model.generate(prompt, max_new_tokens=8, do_sample=False, **kwargs)
    assert torch.equal(assisted, greedy)
    assert any(n < 0 for n in crops)  # candidates were rejected and undone


def test_crop_rebuilds_the_state_without_the_removed_tokens():
    model = build(PerformerForCausalLM, "llama")
    tokens = token_ids(batch=2, length=9)
    prefill = model(tokens[:, :5], use_cache=True)
    cache = prefill.past_key_values
    cache.activate_past_recording()
    model(tokens[:, 5:9], **cached(model, cache), use_cache=True)  # 4 candidates ...
    cache.crop(-3)  # ... 3 rejected
    assert cache.get_seq_length() == 6
    next_logits = model(tokens[:, 6:7], **cached(model, cache), use_cache=True).logits
    expected = model(tokens[:, :7], use_cache=False).logits[:, -1:]
    torch.testing.assert_close(next_logits, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="recorded since the last crop \\(1;"):
        cache.crop(-2)  # the crop consumed the record: only the token decoded since can be undone


def test_crop_without_recording_is_a_clear_error():
    model = build(PerformerForCausalLM, "gpt2")
    cache = model(token_ids(batch=1, length=4), use_cache=True).past_key_values
    cache.crop(0)  # nothing to undo: fine
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        cache.crop(-1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(assistant_model="favor"), "favor\\) assistant"),
        (dict(prompt_lookup_num_tokens=2, output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    ],
)
def test_assisted_generation_that_cannot_work_is_refused_up_front(kwargs, message):
    model = build(PerformerForCausalLM, "gpt2")
    if kwargs.get("assistant_model") == "favor":
        kwargs["assistant_model"] = build(PerformerForCausalLM, "gpt2", seed=1)
    with pytest.raises(ValueError, match=message):
        model.generate(token_ids(batch=1, length=5), max_new_tokens=3, do_sample=False, **kwargs)


@pytest.mark.parametrize("source", CAUSAL)
def test_beam_search_reorders_the_recurrent_cache(source):
    model = build(PerformerForCausalLM, source)
    prompt = token_ids(batch=2, length=5)
    beams = model.generate(prompt, max_new_tokens=6, num_beams=3, do_sample=False, return_dict_in_generate=True)
    no_cache = model.generate(prompt, max_new_tokens=6, num_beams=3, do_sample=False, use_cache=False)
    assert isinstance(beams.past_key_values.layers[0], FavorCacheLayer)
    assert torch.equal(beams.sequences, no_cache)


# ---------------------------------------------------------------------------------- generate(inputs_embeds), logits_to_keep
# Found by transformers' own GenerationTesterMixin (tests/transformers_common): both were read from the wrapper's
# signatures, which hid the source model's parameters.


@pytest.mark.parametrize("source", CAUSAL)
def test_generate_from_inputs_embeds_equals_generate_from_input_ids(source):
    model = build(PerformerForCausalLM, source)
    prompt = token_ids(batch=2, length=5)
    from_ids = model.generate(prompt, max_new_tokens=4, do_sample=False)
    from_embeds = model.generate(inputs_embeds=model.get_input_embeddings()(prompt), max_new_tokens=4, do_sample=False)
    assert torch.equal(from_embeds, from_ids[:, prompt.shape[1]:])  # only the new tokens, as for stock models


@pytest.mark.parametrize("source", CAUSAL)
def test_logits_to_keep_computes_only_the_last_logits(source):
    model = build(PerformerForCausalLM, source)
    prompt = token_ids(batch=2, length=6)
    full = model(prompt).logits
    last = model(prompt, logits_to_keep=1).logits
    assert last.shape == (2, 1, full.shape[-1])
    torch.testing.assert_close(last, full[:, -1:])
    assert model._supports_logits_to_keep()  # so that generate() computes one position's logits at prefill


def test_meta_device_loading_initialises_the_wrapped_model_as_transformers_does():
    # GPT-2 initialises c_proj with std initializer_range / sqrt(2 * n_layer) from its attention and MLP modules, which
    # have no parameters of their own; transformers skips such modules for "custom code" (any class outside its
    # package), so weights missing from a checkpoint got the plain 0.02 instead (found by transformers'
    # test_can_init_all_missing_weights).
    config = PerformerConfig(source_config=gpt2_config(), nb_features=16)
    model = PerformerModel.from_pretrained(None, config=config, state_dict={})
    expected = config.source_config.initializer_range / (2 * config.source_config.n_layer) ** 0.5
    for layer in model.source_model.h:
        for weight in (layer.attn.c_proj.weight, layer.mlp.c_proj.weight):
            assert abs(float(weight.detach().std()) - expected) < 0.2 * expected
