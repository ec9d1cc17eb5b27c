"""attn_implementation="favor" on stock transformers models: dispatch, masks, hybrid layers, state, errors.

Tiny random models built offline from configs; nothing is downloaded.
"""

import copy

import pytest
import torch
from transformers import (
    AttentionInterface,
    BertConfig,
    BertModel,
    DistilBertConfig,
    DistilBertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    RobertaConfig,
    RobertaModel,
)
from transformers.masking_utils import AttentionMaskInterface, sliding_window_causal_mask_function
from transformers.utils import logging

import hf_performer
from hf_performer.favor_attention import (
    FavorMaskError,
    attach_feature_maps,
    favor_attention_forward,
    favor_attention_mask,
    find_attention_modules,
)
from hf_performer.favor_settings import FAVOR_DEFAULTS, resolve_favor_settings
from hf_performer.feature_maps import make_feature_map
from hf_performer.reference import reference_linear_attention

logging.set_verbosity_error()

VOCAB = 99


def bert_config():
    return BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, vocab_size=VOCAB
    )


def roberta_config():
    return RobertaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, vocab_size=VOCAB
    )


def distilbert_config():
    return DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=37, vocab_size=VOCAB)


def gpt2_config():
    # Scaling by inverse layer index makes `scaling` differ per layer: it must be reproduced, not assumed.
    return GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, scale_attn_by_inverse_layer_idx=True)


def llama_config():
    return LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=37,
        vocab_size=VOCAB,
    )


# name -> (config builder, model class, causal)
MODELS = {
    "bert": (bert_config, BertModel, False),
    "roberta": (roberta_config, RobertaModel, False),
    "distilbert": (distilbert_config, DistilBertModel, False),
    "gpt2": (gpt2_config, GPT2LMHeadModel, True),
    "llama": (llama_config, LlamaForCausalLM, True),
}


def build(name, attn_implementation="favor", favor_settings=None, seed=0):
    config_fn, model_cls, _ = MODELS[name]
    config = config_fn()
    config.favor_settings = {"nb_features": 32, **(favor_settings or {})}
    torch.manual_seed(seed)
    return model_cls._from_config(config, attn_implementation=attn_implementation).eval()


def padded_batch(causal, length=9, pad=3):
    """Two rows: row 0 full, row 1 padded on the left (causal models) or on the right (encoders)."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, VOCAB, (2, length), generator=generator)
    attention_mask = torch.ones(2, length, dtype=torch.long)
    if causal:
        attention_mask[1, :pad] = 0
    else:
        attention_mask[1, length - pad :] = 0
    return input_ids, attention_mask


def forward(model, input_ids, attention_mask=None, **kwargs):
    """Main output of a model (logits or last hidden state); causal models get padding-aware positions."""
    if isinstance(model, (GPT2LMHeadModel, LlamaForCausalLM)):
        if attention_mask is not None and "position_ids" not in kwargs:
            kwargs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        return model(input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits
    return model(input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state


# --------------------------------------------------------------------------------------------
# Registration and dispatch
# --------------------------------------------------------------------------------------------


def test_favor_is_registered_as_attention_and_mask():
    assert AttentionInterface._global_mapping["favor"] is favor_attention_forward
    assert AttentionMaskInterface._global_mapping["favor"] is favor_attention_mask
    assert hf_performer.favor_attention_forward is favor_attention_forward


@pytest.mark.parametrize("name", list(MODELS))
def test_stock_model_output_equals_engine_reference(name, monkeypatch):
    """Every attention call of a padded forward equals the quadratic reference on the same q/k/v."""
    model = build(name)
    calls = []

    def spy(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        output, weights = favor_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        calls.append((module, query, key, value, attention_mask, scaling, output))
        return output, weights

    monkeypatch.setitem(AttentionInterface._global_mapping, "favor", spy)
    causal = MODELS[name][2]
    input_ids, attention_mask = padded_batch(causal)
    with torch.no_grad():
        forward(model, input_ids, attention_mask)

    assert len(calls) == 2
    for module, query, key, value, mask, scaling, output in calls:
        assert mask is not None and mask.dim() == 2, "the 2-D key padding mask must reach the attention function"
        assert scaling == module.scaling
        if name == "llama":
            assert key.shape[1] == 2 and query.shape[1] == 4  # grouped-query attention
        expected = reference_linear_attention(
            query, key, value, module.favor_feature_map, causal=causal, key_padding_mask=mask, scaling=scaling
        )
        real = attention_mask.bool()  # outputs at padded queries are meaningless
        torch.testing.assert_close(output.double()[real], expected.transpose(1, 2)[real], atol=1e-5, rtol=1e-5)
    if name == "gpt2":
        assert calls[0][5] != calls[1][5]  # per-layer scaling was passed through


@pytest.mark.parametrize("name", list(MODELS))
def test_set_attn_implementation_matches_from_config(name):
    """Lazy feature maps (set_attn_implementation) == from_config(favor) == attach_feature_maps."""
    reference = build(name, attn_implementation="favor")
    switched = build(name, attn_implementation="sdpa")
    switched.load_state_dict(reference.state_dict())
    switched.set_attn_implementation("favor")
    attached = build(name, attn_implementation="favor")
    attached.load_state_dict(reference.state_dict())
    assert attach_feature_maps(attached) == [0, 1]

    input_ids, attention_mask = padded_batch(MODELS[name][2])
    with torch.no_grad():
        expected = forward(reference, input_ids, attention_mask)
        torch.testing.assert_close(forward(switched, input_ids, attention_mask), expected, atol=0, rtol=0)
        torch.testing.assert_close(forward(attached, input_ids, attention_mask), expected, atol=0, rtol=0)
    modules = [module for _, module in find_attention_modules(switched)]
    assert len(modules) == 2 and all(hasattr(module, "favor_feature_map") for module in modules)


def test_favor_differs_from_softmax():
    """Sanity: the favor path is really taken (outputs differ from sdpa with the same weights)."""
    favor = build("bert")
    sdpa = build("bert", attn_implementation="sdpa")
    sdpa.load_state_dict(favor.state_dict(), strict=False)
    input_ids, _ = padded_batch(False)
    with torch.no_grad():
        assert not torch.allclose(forward(favor, input_ids), forward(sdpa, input_ids), atol=1e-4)


# --------------------------------------------------------------------------------------------
# Padding
# --------------------------------------------------------------------------------------------


def _padded_row_error(model, causal):
    """Max difference between the padded row of a batch and the same tokens run alone, unpadded."""
    input_ids, attention_mask = padded_batch(causal)
    real = attention_mask[1].bool()
    with torch.no_grad():
        batched = forward(model, input_ids, attention_mask)[1][real]
        alone = forward(model, input_ids[1:, real], torch.ones(1, int(real.sum()), dtype=torch.long))[0]
    return (batched - alone).abs().max().item()


@pytest.mark.parametrize("name", ["bert", "distilbert"])
def test_right_padding_matches_unpadded(name):
    assert _padded_row_error(build(name), causal=False) < 1e-5


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_left_padding_matches_unpadded(name):
    assert _padded_row_error(build(name), causal=True) < 1e-5


@pytest.mark.parametrize("name,causal", [("bert", False), ("gpt2", True)])
def test_padding_needs_the_registered_mask_function(name, causal, monkeypatch):
    """Without the AttentionMaskInterface entry transformers passes no mask: the padding tests above fail."""
    model = build(name)
    monkeypatch.delitem(AttentionMaskInterface._global_mapping, "favor")
    assert _padded_row_error(model, causal) > 1e-3


def test_equivalent_4d_mask_is_accepted_and_matches_2d():
    model = build("bert")
    input_ids, attention_mask = padded_batch(False)
    mask_4d = attention_mask.bool()[:, None, None, :].expand(2, 1, 9, 9)
    with torch.no_grad():
        expected = forward(model, input_ids, attention_mask)
        torch.testing.assert_close(forward(model, input_ids, mask_4d), expected, atol=0, rtol=0)


# --------------------------------------------------------------------------------------------
# Hybrid softmax layers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_softmax_layers_equal_sdpa_exactly(name):
    sdpa = build(name, attn_implementation="sdpa")
    hybrid = build(name, favor_settings={"softmax_layers": [0]})
    hybrid.load_state_dict(sdpa.state_dict())
    all_softmax = build(name, favor_settings={"softmax_layers": [0, 1]})
    all_softmax.load_state_dict(sdpa.state_dict())
    assert attach_feature_maps(hybrid) == [1]

    input_ids, attention_mask = padded_batch(MODELS[name][2])
    kwargs = {"output_hidden_states": True}
    with torch.no_grad():
        expected = sdpa(input_ids, attention_mask=attention_mask, **kwargs).hidden_states
        got = hybrid(input_ids, attention_mask=attention_mask, **kwargs).hidden_states
        every = all_softmax(input_ids, attention_mask=attention_mask, **kwargs).hidden_states
    assert torch.equal(got[1], expected[1])  # layer 0: exact softmax
    assert not torch.allclose(got[2], expected[2], atol=1e-4)  # layer 1: favor
    assert all(torch.equal(a, b) for a, b in zip(every, expected))


# --------------------------------------------------------------------------------------------
# Feature-map state: seeds, state dict, redraws
# --------------------------------------------------------------------------------------------


def _projections(model):
    state = model.state_dict()
    return {name: buffer for name, buffer in state.items() if name.endswith("favor_feature_map.projection")}


def test_projections_seeded_per_layer_and_reproducible():
    model = build("gpt2", favor_settings={"seed": 7})
    assert attach_feature_maps(model) == [0, 1]
    projections = list(_projections(model).values())
    assert len(projections) == 2 and not torch.equal(projections[0], projections[1])
    for layer_idx, projection in enumerate(projections):
        expected = make_feature_map("favor+", 8, 32, seed=7 + layer_idx).projection
        assert torch.equal(projection, expected)
    other = build("gpt2", favor_settings={"seed": 7}, seed=123)  # other weights, same settings
    attach_feature_maps(other)
    assert all(torch.equal(a, b) for a, b in zip(projections, _projections(other).values()))


def test_state_dict_reloads_bit_identically_after_redraws():
    model = build("bert", favor_settings={"redraw_interval": 1})
    attach_feature_maps(model)
    initial = {k: v.clone() for k, v in _projections(model).items()}
    input_ids, attention_mask = padded_batch(False)
    model.train()
    for _ in range(3):
        forward(model, input_ids, attention_mask)
    model.eval()
    assert all(not torch.equal(initial[k], v) for k, v in _projections(model).items()), "training must redraw"

    state = copy.deepcopy(model.state_dict())
    assert len(_projections(model)) == 2 and any(k.endswith("favor_feature_map.redraws") for k in state)
    fresh = build("bert", favor_settings={"redraw_interval": 1}, seed=99)
    attach_feature_maps(fresh)
    fresh.load_state_dict(state)  # strict: the feature-map buffers exist before loading
    for key, value in state.items():
        assert torch.equal(fresh.state_dict()[key], value), key
    with torch.no_grad():
        torch.testing.assert_close(
            forward(fresh, input_ids, attention_mask), forward(model, input_ids, attention_mask), atol=0, rtol=0
        )


def test_eval_is_deterministic_and_redraws_only_in_training():
    model = build("gpt2", favor_settings={"redraw_interval": 1})
    attach_feature_maps(model)
    input_ids, attention_mask = padded_batch(True)
    before = {k: v.clone() for k, v in _projections(model).items()}
    with torch.no_grad():
        first = forward(model, input_ids, attention_mask)
        for _ in range(3):
            torch.testing.assert_close(forward(model, input_ids, attention_mask), first, atol=0, rtol=0)
    assert all(torch.equal(before[k], v) for k, v in _projections(model).items())

    model.train()
    forward(model, input_ids, attention_mask)
    forward(model, input_ids, attention_mask)
    assert all(not torch.equal(before[k], v) for k, v in _projections(model).items())


def test_attention_dropout_is_not_applied_in_training():
    model = build("bert")
    model.config.attention_probs_dropout_prob = 0.5
    attach_feature_maps(model)
    module = find_attention_modules(model)[0][1]
    module.train()
    query, key, value = torch.randn(3, 2, 4, 6, 8).unbind(0)
    first, weights = favor_attention_forward(module, query, key, value, None, scaling=0.3, dropout=0.5)
    second, _ = favor_attention_forward(module, query, key, value, None, scaling=0.3, dropout=0.5)
    assert weights is None and first.shape == (2, 6, 4, 8)
    torch.testing.assert_close(first, second, atol=0, rtol=0)


def test_elu_feature_map_setting():
    model = build("gpt2", favor_settings={"feature_map": "elu+1", "nb_features": None})
    attach_feature_maps(model)
    module = find_attention_modules(model)[0][1]
    assert module.favor_feature_map.name == "elu+1" and module.favor_feature_map.nb_features == 8
    input_ids, attention_mask = padded_batch(True)
    with torch.no_grad():
        assert torch.isfinite(forward(model, input_ids, attention_mask)).all()


# --------------------------------------------------------------------------------------------
# Clear errors
# --------------------------------------------------------------------------------------------


def test_unexpressible_4d_mask_raises():
    model = build("bert")
    input_ids, _ = padded_batch(False)
    arbitrary = torch.rand(2, 1, 9, 9, generator=torch.Generator().manual_seed(0)) > 0.5
    with pytest.raises(FavorMaskError, match="4-D attention mask"):
        forward(model, input_ids, arbitrary)
    bias = torch.randn(2, 1, 9, 9)
    with pytest.raises(FavorMaskError, match="biases"):
        forward(model, input_ids, bias)


def test_unexpressible_mask_patterns_raise_in_favor_layers():
    # A sliding window becomes the 4-D mask sdpa would get (softmax layers apply it: the source's sliding layers keep
    # softmax); a favor layer given it raises instead of attending over every key.
    mask = favor_attention_mask(1, 4, 4, mask_function=sliding_window_causal_mask_function(2))
    assert mask.shape == (1, 1, 4, 4) and mask[0, 0].tolist() == [
        [True, False, False, False], [True, True, False, False], [False, True, True, False], [False, False, True, True]]
    model = build("llama")
    query = torch.randn(1, 4, 4, 8)
    module = model.model.layers[0].self_attn
    with pytest.raises(FavorMaskError, match="not 'key padding AND causal'"):
        favor_attention_forward(module, query, query, query, mask)
    # Packed sequences (positions restarting inside a row) are expressible: see test_transformers_conformance.py.


def test_bad_favor_settings_key_raises():
    with pytest.raises(ValueError, match="accepted keys") as error:
        resolve_favor_settings({"nb_feature": 64})
    assert "nb_feature" in str(error.value) and "nb_features" in str(error.value)
    model = build("bert", favor_settings={"casual": True})
    input_ids, _ = padded_batch(False)
    with pytest.raises(ValueError, match="casual"):
        forward(model, input_ids)


def test_unknown_feature_map_raises():
    with pytest.raises(ValueError, match="favor\\+"):
        resolve_favor_settings({"feature_map": "softmax++"})
    with pytest.raises(ValueError, match="random"):
        resolve_favor_settings({"feature_map": "elu+1", "orthogonal": False})
    with pytest.raises(ValueError, match="chunk_size"):
        resolve_favor_settings({"chunk_size": 0})


def test_defaults_and_attach_requires_favor():
    assert resolve_favor_settings() == FAVOR_DEFAULTS
    assert resolve_favor_settings() is not FAVOR_DEFAULTS
    with pytest.raises(ValueError, match="set_attn_implementation"):
        attach_feature_maps(build("bert", attn_implementation="sdpa"))
