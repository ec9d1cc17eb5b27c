"""Learned feature maps (hedgehog, t2r): kernels against the float64 references, gradients, initialisation,
parameters per head, the ``feature_map_options`` setting, save / load of trained parameters, generation.

Tiny random models built offline from configs; nothing is downloaded.
"""

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModel, BertConfig
from transformers.utils import logging

import hf_performer
from hf_performer import (
    FavorCacheLayer,
    PerformerConfig,
    PerformerConfigError,
    PerformerForCausalLM,
    PerformerModel,
    linear_attention,
    make_feature_map,
)
from hf_performer.favor_settings import build_feature_map, feature_map_kind, resolve_favor_settings
from hf_performer.feature_maps import (
    LEARNED_MAP_INITS,
    FeatureMap,
    HedgehogFeatureMap,
    T2RFeatureMap,
    gaussian_orthogonal_random_matrix,
)
from hf_performer.reference import reference_linear_attention, reference_recurrent_linear_attention

logging.set_verbosity_error()

LEARNED = ["hedgehog", "t2r"]
VOCAB = 61


def learned_map(name, d=8, heads=3, kv_heads=None, nb_features=None, perturb=True, seed=0, dtype=torch.float64,
                **options):
    """A learned map in ``dtype`` whose parameters were moved away from their init (queries and keys differ)."""
    feature_map = make_feature_map(
        name, d, nb_features, num_heads=heads, num_key_value_heads=kv_heads, seed=seed, **options
    ).to(dtype)
    if perturb:
        perturb_parameters(feature_map, seed=seed + 100)
    return feature_map


@torch.no_grad()
def perturb_parameters(module, seed=0, scale=0.3):
    generator = torch.Generator().manual_seed(seed)
    for parameter in module.parameters():
        parameter.add_(scale * torch.randn(parameter.shape, generator=generator, dtype=torch.float64).to(parameter))


def qkv(batch=2, heads=3, kv_heads=None, length=13, d=8, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    kv_heads = kv_heads or heads
    q = torch.randn(batch, heads, length, d, generator=generator, dtype=dtype)
    k = torch.randn(batch, kv_heads, length, d, generator=generator, dtype=dtype)
    v = torch.randn(batch, kv_heads, length, d, generator=generator, dtype=dtype)
    return q, k, v


def padding_mask(batch, length, right=(), left=()):
    mask = torch.ones(batch, length, dtype=torch.bool)
    for row, count in right:
        mask[row, length - count:] = False
    for row, count in left:
        mask[row, :count] = False
    return mask


def assert_query_and_key_maps_differ(feature_map, heads, kv_heads, d=8):
    """The test inputs really tell query parameters from key parameters."""
    x = torch.randn(1, kv_heads, 4, d, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    groups = heads // kv_heads
    query_side = feature_map.query_features(x.repeat_interleave(groups, 1)).values[:, ::groups]
    key_side = feature_map.key_features(x).values
    assert (query_side - key_side).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------
# Kernels == float64 references
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LEARNED)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("heads, kv_heads", [(3, 3), (4, 2)], ids=["mha", "gqa"])
def test_kernels_match_the_reference_with_separate_query_and_key_parameters(name, causal, masked, heads, kv_heads):
    q, k, v = qkv(heads=heads, kv_heads=kv_heads)
    feature_map = learned_map(name, heads=heads, kv_heads=kv_heads)
    assert_query_and_key_maps_differ(feature_map, heads, kv_heads)
    mask = padding_mask(2, 13, right=[(0, 4)], left=[(1, 3)] if not causal else ()) if masked else None
    out = linear_attention(q, k, v, feature_map, causal=causal, key_padding_mask=mask, chunk_size=5)
    ref = reference_linear_attention(q, k, v, feature_map, causal=causal, key_padding_mask=mask)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", LEARNED)
@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_causal_chunks_equal_the_recurrent_reference(name, chunk_size):
    q, k, v = qkv(heads=4, kv_heads=2, length=11)
    feature_map = learned_map(name, heads=4, kv_heads=2)
    mask = padding_mask(2, 11, right=[(1, 3)])
    out = linear_attention(q, k, v, feature_map, causal=True, key_padding_mask=mask, chunk_size=chunk_size)
    recurrent = reference_recurrent_linear_attention(q, k, v, feature_map, key_padding_mask=mask)
    quadratic = reference_linear_attention(q, k, v, feature_map, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(out, recurrent, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out, quadratic, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", LEARNED)
def test_prefill_then_decode_equals_one_causal_pass(name):
    q, k, v = qkv(heads=4, kv_heads=2, length=10)
    feature_map = learned_map(name, heads=4, kv_heads=2)
    full = linear_attention(q, k, v, feature_map, causal=True, chunk_size=3)
    prefill = 6
    out, state = linear_attention(
        q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], feature_map, causal=True, chunk_size=3,
        return_state=True,
    )
    outputs = [out]
    for i in range(prefill, 10):
        step, state = linear_attention(
            q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], feature_map, causal=True, initial_state=state,
            return_state=True,
        )
        outputs.append(step)
    torch.testing.assert_close(torch.cat(outputs, dim=2), full, rtol=1e-9, atol=1e-9)
    # A second prefill continuing the state (several tokens at once) is exact too.
    rest = linear_attention(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], feature_map, causal=True, chunk_size=2,
                            initial_state=linear_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], feature_map,
                                                           causal=True, return_state=True)[1])
    torch.testing.assert_close(rest, full[:, :, 4:], rtol=1e-9, atol=1e-9)


# --------------------------------------------------------------------------------------------
# Gradients reach the map's parameters
# --------------------------------------------------------------------------------------------


class _Attention(nn.Module):
    """Wraps a feature map so that ``torch.func.functional_call`` can substitute its parameters."""

    def __init__(self, feature_map, causal):
        super().__init__()
        self.feature_map, self.causal = feature_map, causal

    def forward(self, q, k, v):
        return linear_attention(q, k, v, self.feature_map, causal=self.causal, chunk_size=2)


@pytest.mark.parametrize("name", LEARNED)
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_through_the_map_parameters(name, causal):
    heads, kv_heads, d = 2, 1, 3
    q, k, v = qkv(batch=1, heads=heads, kv_heads=kv_heads, length=5, d=d, seed=3)
    feature_map = learned_map(name, d=d, heads=heads, kv_heads=kv_heads, nb_features=4, init="favor+")
    module = _Attention(feature_map, causal)
    names = [f"feature_map.{n}" for n, _ in feature_map.named_parameters()]
    assert sorted(names) == sorted(f"feature_map.{n}" for n in ("query_weight", "query_bias", "key_weight", "key_bias"))
    params = [p.detach().clone().requires_grad_(True) for p in feature_map.parameters()]
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]

    def f(*tensors):
        substituted = dict(zip(names, tensors[:len(names)]))
        return torch.func.functional_call(module, substituted, tuple(tensors[len(names):]))

    assert torch.autograd.gradcheck(f, (*params, *inputs), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", LEARNED)
@pytest.mark.parametrize("causal", [False, True])
def test_float32_training_gives_every_parameter_a_gradient(name, causal):
    q, k, v = qkv(heads=4, kv_heads=2, dtype=torch.float32)
    feature_map = learned_map(name, heads=4, kv_heads=2, dtype=torch.float32)
    assert all(p.requires_grad and p.dtype == torch.float32 for p in feature_map.parameters())
    out = linear_attention(q, k, v, feature_map, causal=causal, key_padding_mask=padding_mask(2, 13, right=[(0, 3)]))
    (out * torch.randn_like(out)).sum().backward()
    for parameter_name, parameter in feature_map.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, parameter_name
    assert not feature_map.has_features_vjp  # the hand-written fused backward would drop parameter gradients


# --------------------------------------------------------------------------------------------
# The maps themselves
# --------------------------------------------------------------------------------------------


def test_learned_maps_are_registered_with_their_kind():
    assert {"hedgehog", "t2r"} <= set(hf_performer.available_feature_maps())
    assert LEARNED_MAP_INITS == ("identity", "favor+")
    assert {name: feature_map_kind(name) for name in ("favor+", "trig", "relu", "elu+1", "hedgehog", "t2r")} == {
        "favor+": "random", "trig": "random", "relu": "random", "elu+1": "deterministic",
        "hedgehog": "learned", "t2r": "learned",
    }
    assert isinstance(make_feature_map("hedgehog", 8, num_heads=2), HedgehogFeatureMap)
    assert isinstance(make_feature_map("t2r", 8, num_heads=2), T2RFeatureMap)


def test_default_sizes_and_inits():
    hedgehog = make_feature_map("hedgehog", 8, num_heads=3)
    assert hedgehog.nb_features == 16 and hedgehog.projection_size == 8 and hedgehog.init == "favor+"
    assert hedgehog.query_weight.shape == (3, 8, 8) and hedgehog.key_bias.shape == (3, 8)
    t2r = make_feature_map("t2r", 8, num_heads=4, num_key_value_heads=2)
    assert t2r.nb_features == 8 and t2r.init == "favor+"
    assert t2r.query_weight.shape == (4, 8, 8) and t2r.query_bias.shape == (4, 8)
    assert t2r.key_weight.shape == (2, 8, 8) and t2r.key_bias.shape == (2, 8)
    wide = make_feature_map("hedgehog", 8, nb_features=40, num_heads=2, init="favor+")
    assert wide.query_weight.shape == (2, 8, 20)
    assert wide.query_features(torch.randn(1, 2, 3, 8)).values.shape == (1, 2, 3, 40)


def test_hedgehog_features_are_positive_and_each_half_is_a_distribution():
    feature_map = learned_map("hedgehog", heads=4, kv_heads=2, dtype=torch.float32)
    q, k, _ = qkv(heads=4, kv_heads=2, dtype=torch.float32)
    for features in (feature_map.query_features(5 * q), feature_map.key_features(5 * k)):
        assert features.log_scale is None
        values = features.values
        assert values.shape[-1] == 16 and (values > 0).all()
        torch.testing.assert_close(values[..., :8].sum(-1), torch.ones(values.shape[:-1]))
        torch.testing.assert_close(values[..., 8:].sum(-1), torch.ones(values.shape[:-1]))
    # At the identity init the halves are softmax(x) and softmax(-x).
    x = torch.randn(1, 2, 5, 8)
    identity = make_feature_map("hedgehog", 8, num_heads=2, init="identity")
    torch.testing.assert_close(identity.query_features(x).values, torch.cat([x.softmax(-1), (-x).softmax(-1)], -1))
    torch.testing.assert_close(identity.key_features(x).values, identity.query_features(x).values)


def test_t2r_features_are_relu_plus_epsilon():
    feature_map = make_feature_map("t2r", 4, num_heads=1, init="identity", feature_epsilon=0.25)
    x = torch.tensor([[[[1.0, -2.0, 0.0, 3.0]]]])
    assert torch.equal(feature_map.query_features(x).values, torch.tensor([[[[1.25, 0.25, 0.25, 3.25]]]]))
    assert feature_map.feature_epsilon == 0.25


def test_forward_uses_query_parameters_for_queries_and_key_parameters_for_keys():
    feature_map = learned_map("hedgehog", heads=2)
    q, k, _ = qkv(heads=2)
    fq, fk = feature_map(q, k)
    assert torch.equal(fq.values, feature_map.query_features(q).values)
    assert torch.equal(fk.values, feature_map.key_features(k).values)
    assert not torch.allclose(fk.values, feature_map.query_features(k).values)
    z = k @ feature_map.key_weight + feature_map.key_bias[:, None]
    torch.testing.assert_close(fk.values, torch.cat([z.softmax(-1), (-z).softmax(-1)], -1))


@pytest.mark.parametrize("name, nb_features, message", [
    ("hedgehog", 10, r"init='identity' needs a square projection: nb_features=10 gives 5 projections per head for "
                     r"head_dim=8; use nb_features=16 or init='favor\+'"),
    ("t2r", 12, r"init='identity' needs a square projection.*use nb_features=8"),
])
def test_identity_init_needs_a_square_projection(name, nb_features, message):
    with pytest.raises(ValueError, match=message):
        make_feature_map(name, 8, nb_features, num_heads=2, init="identity")
    assert make_feature_map(name, 8, nb_features, num_heads=2, init="favor+").nb_features == nb_features


def test_option_errors():
    with pytest.raises(ValueError, match="divisible by 2, got 9"):
        make_feature_map("hedgehog", 8, 9, num_heads=2, init="favor+")
    with pytest.raises(ValueError, match=r"init must be one of \('identity', 'favor\+'\), got 'orthogonal'"):
        make_feature_map("hedgehog", 8, num_heads=2, init="orthogonal")
    with pytest.raises(ValueError, match=r"num_heads \(3\) must be a positive multiple of num_key_value_heads \(2\)"):
        make_feature_map("t2r", 8, num_heads=3, num_key_value_heads=2)
    with pytest.raises(TypeError, match="num_heads"):
        make_feature_map("hedgehog", 8)  # learned maps have parameters per head
    with pytest.raises(TypeError, match="bad option for feature map 'hedgehog'"):
        make_feature_map("hedgehog", 8, num_heads=2, orthogonal=True)


def test_learned_map_without_num_heads_says_what_to_pass():
    # Learned maps have parameters per head: there is no sensible default, so the error names the argument.
    with pytest.raises(TypeError) as error:
        make_feature_map("hedgehog", 64, nb_features=64)
    message = str(error.value)
    assert "\n" not in message
    assert "'hedgehog' has trainable parameters per attention head" in message
    assert "num_heads=" in message and "num_key_value_heads" in message
    assert "missing 1 required" not in message


def test_identity_init():
    feature_map = make_feature_map("hedgehog", 8, num_heads=4, num_key_value_heads=2, init="identity")
    assert torch.equal(feature_map.query_weight, torch.eye(8).expand(4, 8, 8))
    assert torch.equal(feature_map.key_weight, torch.eye(8).expand(2, 8, 8))
    assert not feature_map.query_bias.any() and not feature_map.key_bias.any()


def test_favor_init_is_seeded_orthogonal_and_symmetric_for_grouped_heads():
    def build(seed):
        return make_feature_map("t2r", 8, 16, num_heads=4, num_key_value_heads=2, init="favor+", seed=seed)

    a, b, c = build(3), build(3), build(4)
    for name, parameter in a.named_parameters():
        assert torch.equal(parameter, dict(b.named_parameters())[name]), name
    assert not torch.equal(a.query_weight, c.query_weight)
    # Query head h starts from the projection of key head h // groups (so the untrained map is symmetric) ...
    for head in range(4):
        assert torch.equal(a.query_weight[head], a.key_weight[head // 2])
    # ... and the two key heads have their own draws.
    assert not torch.allclose(a.key_weight[0], a.key_weight[1])
    assert not a.query_bias.any() and not a.key_bias.any()
    x = torch.randn(1, 2, 5, 8)
    torch.testing.assert_close(a.query_features(x.repeat_interleave(2, 1)).values[:, ::2], a.key_features(x).values)
    # The projection FAVOR+ draws: each head is d x d blocks of orthogonal directions (chi row norms), drawn in turn.
    generator = torch.Generator().manual_seed(3)
    expected = [gaussian_orthogonal_random_matrix(16, 8, generator=generator).T for _ in range(2)]
    assert torch.equal(a.key_weight, torch.stack(expected))
    directions = a.key_weight[0, :, :8] / a.key_weight[0, :, :8].norm(dim=0)
    torch.testing.assert_close(directions.T @ directions, torch.eye(8), atol=1e-5, rtol=0)


def test_tie_qk_has_no_key_parameters_and_refuses_grouped_heads():
    tied = learned_map("hedgehog", heads=3, tie_qk=True)
    assert sorted(tied.state_dict()) == ["query_bias", "query_weight"]
    assert sorted(n for n, _ in tied.named_parameters()) == ["query_bias", "query_weight"]
    _, k, _ = qkv(heads=3)
    assert torch.equal(tied.key_features(k).values, tied.query_features(k).values)
    q, k, v = qkv(heads=3)
    torch.testing.assert_close(
        linear_attention(q, k, v, tied, causal=True),
        reference_linear_attention(q, k, v, tied, causal=True), rtol=1e-9, atol=1e-9,
    )
    with pytest.raises(ValueError, match="tie_qk needs as many key heads as query heads"):
        make_feature_map("hedgehog", 8, num_heads=4, num_key_value_heads=2, tie_qk=True)


def test_wrong_head_count_is_a_clear_error():
    feature_map = make_feature_map("hedgehog", 8, num_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"parameters for 4 heads; got an input of shape \(1, 3, 5, 8\) "
                                         r"\(expected \[batch, 4, length, 8\]\)"):
        feature_map.query_features(torch.randn(1, 3, 5, 8))
    with pytest.raises(ValueError, match="parameters for 2 heads"):
        feature_map.key_features(torch.randn(1, 4, 5, 8))
    q, k, v = qkv(heads=2, d=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="parameters for 4 heads"):
        linear_attention(q, k, v, feature_map)


def test_parameters_are_saved_in_the_state_dict_and_reload():
    trained = learned_map("t2r", heads=4, kv_heads=2, dtype=torch.float32)
    fresh = make_feature_map("t2r", 8, num_heads=4, num_key_value_heads=2)
    assert sorted(trained.state_dict()) == ["key_bias", "key_weight", "query_bias", "query_weight"]
    fresh.load_state_dict(trained.state_dict())
    x = torch.randn(1, 4, 3, 8)
    assert torch.equal(fresh.query_features(x).values, trained.query_features(x).values)
    assert "num_heads=4, num_key_value_heads=2, init=favor+, tie_qk=False" in repr(trained)


# --------------------------------------------------------------------------------------------
# Settings and configuration
# --------------------------------------------------------------------------------------------


def test_feature_map_options_typos_list_the_accepted_options():
    with pytest.raises(ValueError, match=r"has option\(s\) \['inti'\] that the 'hedgehog' feature map does not take; "
                                         r"accepted: \['init', 'tie_qk'\]"):
        resolve_favor_settings({"feature_map": "hedgehog", "feature_map_options": {"inti": "favor+"}})
    with pytest.raises(ValueError, match=r"accepted: \['feature_epsilon', 'init', 'tie_qk'\]"):
        resolve_favor_settings({"feature_map": "t2r", "feature_map_options": {"feature_eps": 0.1}})
    with pytest.raises(ValueError, match=r"\['seed'\].*accepted: \['init', 'tie_qk'\]"):
        resolve_favor_settings({"feature_map": "hedgehog", "feature_map_options": {"seed": 3}})  # top-level setting
    with pytest.raises(ValueError, match=r"\['init'\] that the 'favor\+' feature map does not take"):
        resolve_favor_settings({"feature_map_options": {"init": "favor+"}})
    with pytest.raises(TypeError, match="must be a dict"):
        resolve_favor_settings({"feature_map": "hedgehog", "feature_map_options": ["init"]})
    with pytest.raises(PerformerConfigError, match=r"accepted: \['init', 'tie_qk'\]"):
        PerformerConfig(source_config=BertConfig(), feature_map="hedgehog", feature_map_options={"tie": True})
    assert resolve_favor_settings({"feature_map": "relu", "feature_map_options": {"feature_epsilon": 0.1}})[
        "feature_map_options"] == {"feature_epsilon": 0.1}
    assert resolve_favor_settings()["feature_map_options"] == {}


@pytest.mark.parametrize("setting, value", [("orthogonal", False), ("orthogonal", True), ("row_norms", "fixed"),
                                            ("redraw_interval", 5)])
def test_random_projection_settings_are_refused_for_learned_maps(setting, value):
    with pytest.raises(ValueError, match=rf"\['{setting}'\] only apply to random feature maps; 'hedgehog' has no "
                                         "random projection"):
        resolve_favor_settings({"feature_map": "hedgehog", setting: value})


def test_learned_maps_take_seed_and_nb_features():
    resolved = resolve_favor_settings({"feature_map": "t2r", "seed": 5, "nb_features": 12})
    assert resolved["seed"] == 5 and resolved["nb_features"] == 12
    assert resolve_favor_settings({"feature_map": "hedgehog"})["nb_features"] is None  # the map's own size
    settings = resolve_favor_settings({"feature_map": "t2r", "seed": 5, "feature_map_options": {"init": "identity"}})
    layer_2 = build_feature_map(settings, 8, 2, num_heads=4, num_key_value_heads=2)
    assert isinstance(layer_2, T2RFeatureMap) and layer_2.seed == 7 and layer_2.init == "identity"
    assert layer_2.num_heads == 4 and layer_2.num_key_value_heads == 2 and layer_2.nb_features == 8
    seeded = build_feature_map(resolve_favor_settings({"feature_map": "t2r", "seed": 5}), 8, 2, num_heads=4)
    assert torch.equal(seeded.query_weight, make_feature_map("t2r", 8, num_heads=4, seed=7).query_weight)
    with pytest.raises(ValueError, match="needs the layer's number of heads"):
        build_feature_map(settings, 8, 0)


def test_performer_config_with_hedgehog_round_trips(tmp_path, tiny_bert_config):
    config = PerformerConfig(
        source_config=tiny_bert_config(),
        feature_map="hedgehog", feature_map_options={"init": "favor+"}, seed=4,
    )
    expected = {"feature_map": "hedgehog", "nb_features": None, "seed": 4, "chunk_size": config.chunk_size,
                "softmax_layers": [], "feature_map_options": {"init": "favor+"},
                "window": 0, "sinks": 0, "sparse_cache": 0, "sparse_cache_selection": "recall", "sparse_cache_span": 1,
                "tail_cap": 0, "tail_gate": False,
                "softmax_weight": "auto", "layer_windows": {},
                "linear_tail": True}
    assert config.favor_settings == expected
    assert config.feature_map_options == {"init": "favor+"}
    assert config.source_config.favor_settings == expected  # what the attention function reads
    serialized = config.to_dict()
    assert serialized["favor_settings"] == expected and "favor_settings" not in serialized["source_config"]
    assert PerformerConfig.from_dict(serialized).favor_settings == expected
    config.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).favor_settings == expected
    assert PerformerConfig.from_pretrained(tmp_path).favor_settings == expected


# Overrides of the shared tiny Llama (conftest): this file's vocabulary, the token ids generate() needs, a large
# init scale.
LLAMA_OVERRIDES = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.3)


def feature_maps_of(model):
    return [module for module in model.modules() if isinstance(module, FeatureMap)]


def test_models_build_one_learned_map_per_layer_with_the_layer_head_counts(tiny_llama_config):
    config = PerformerConfig(source_config=tiny_llama_config(**LLAMA_OVERRIDES), feature_map="hedgehog",
                             feature_map_options={"init": "favor+"}, seed=2)
    model = PerformerForCausalLM(config)
    maps = feature_maps_of(model)
    assert len(maps) == 2 and all(isinstance(m, HedgehogFeatureMap) for m in maps)
    assert [(m.num_heads, m.num_key_value_heads, m.head_dim, m.nb_features, m.seed) for m in maps] == [
        (4, 2, 8, 16, 2), (4, 2, 8, 16, 3)]
    assert not torch.equal(maps[0].query_weight, maps[1].query_weight)
    learned = [name for name, _ in model.named_parameters() if "favor_feature_map" in name]
    assert len(learned) == 8 and all(name.rsplit(".", 1)[-1] in ("query_weight", "query_bias", "key_weight", "key_bias")
                                      for name in learned)


def test_tie_qk_setting_with_grouped_heads_is_refused_when_the_model_is_built(tiny_llama_config):
    config = PerformerConfig(source_config=tiny_llama_config(**LLAMA_OVERRIDES), feature_map="hedgehog",
                             feature_map_options={"tie_qk": True})
    with pytest.raises(ValueError, match="tie_qk needs as many key heads"):
        PerformerForCausalLM(config)


def test_trained_parameters_are_saved_and_reloaded(tmp_path, tiny_bert_config):
    torch.manual_seed(0)
    config = PerformerConfig(source_config=tiny_bert_config(vocab_size=VOCAB, initializer_range=0.3),
                             feature_map="hedgehog", feature_map_options={"init": "favor+"})
    model = PerformerModel(config).eval()
    initial = PerformerModel(config).eval()
    initial.load_state_dict({k: v for k, v in model.state_dict().items() if "favor_feature_map" not in k},
                            strict=False)
    perturb_parameters(nn.ModuleList(feature_maps_of(model)), seed=1, scale=0.5)
    input_ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    with torch.no_grad():
        expected = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        at_init = initial(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    assert (expected - at_init).abs().max() > 1e-2  # the changed parameters matter

    model.save_pretrained(tmp_path)
    assert "HedgehogFeatureMap" in (tmp_path / "feature_maps.py").read_text()  # the code remote loading uses
    for loaded in (PerformerModel.from_pretrained(tmp_path),
                   AutoModel.from_pretrained(tmp_path, trust_remote_code=True)):
        loaded.eval()
        state = loaded.state_dict()
        for key, tensor in model.state_dict().items():
            assert torch.equal(state[key], tensor), key
        with torch.no_grad():
            output = loaded(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        assert torch.equal(output, expected)


def test_llama_with_t2r_generates_greedily_with_the_constant_memory_cache(tiny_llama_config):
    torch.manual_seed(0)
    # No end-of-sequence token: every row generates all its tokens.
    source = tiny_llama_config(**{**LLAMA_OVERRIDES, "eos_token_id": None})
    model = PerformerForCausalLM(PerformerConfig(source_config=source, feature_map="t2r", chunk_size=4)).eval()
    perturb_parameters(nn.ModuleList(feature_maps_of(model)), seed=2, scale=0.2)
    prompt = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
                                output_scores=True, pad_token_id=0)
        uncached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False,
                                  return_dict_in_generate=True, output_scores=True, pad_token_id=0)
        full = model(cached.sequences).logits
    assert all(isinstance(layer, FavorCacheLayer) for layer in cached.past_key_values.layers)
    assert all(layer.get_seq_length() == 6 + 8 - 1 for layer in cached.past_key_values.layers)
    assert torch.equal(cached.sequences, uncached.sequences)
    for a, b in zip(cached.scores, uncached.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # Every generated token is the argmax of one full (no-cache) forward over the sequence so far.
    generated = cached.sequences[:, 6:]
    assert torch.equal(full[:, 5:-1].argmax(-1), generated)
    assert len(set(generated.flatten().tolist())) > 1  # not a degenerate constant output
