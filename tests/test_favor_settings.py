"""The favor-settings schema: one declaration, validation once per distinct settings, resolution kept on the
attention modules (no validation per forward), the effective number of features."""

import ast
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, GPT2Config

import hf_performer
from hf_performer import favor_settings as favor_settings_module
from hf_performer import PerformerConfig, PerformerForCausalLM, PerformerForMaskedLM
from hf_performer.favor_attention import find_attention_modules, module_favor_settings
from hf_performer.favor_settings import (
    FAVOR_DEFAULTS,
    FAVOR_SETTINGS,
    build_feature_map,
    canonical_favor_settings,
    effective_nb_features,
    resolve_favor_settings,
)

SETTINGS = [
    {},
    {"nb_features": 16, "seed": 3, "softmax_layers": [1, 0]},
    {"feature_map": "trig", "nb_features": 8, "orthogonal": False, "row_norms": "fixed"},
    {"feature_map": "relu", "feature_map_options": {"feature_epsilon": 0.1}},
    {"feature_map": "hedgehog"},
    {"feature_map": "t2r", "nb_features": 12, "seed": 5},
    {"feature_map": "t2r", "feature_map_options": {"init": "identity"}},
    {"feature_map": "elu+1", "chunk_size": 4},
]


@pytest.fixture
def validations(monkeypatch):
    """Counts the full validations run by resolve_favor_settings (memoised resolutions are not counted)."""
    count = {"n": 0}
    validate = favor_settings_module._validate

    def counting(settings):
        count["n"] += 1
        return validate(settings)

    monkeypatch.setattr(favor_settings_module, "_validate", counting)
    monkeypatch.setattr(favor_settings_module, "_RESOLVED", {})
    return count


def test_schema_declares_every_setting_once():
    names = [setting.name for setting in FAVOR_SETTINGS]
    assert len(names) == len(set(names))
    assert FAVOR_DEFAULTS == {setting.name: setting.default for setting in FAVOR_SETTINGS}
    for setting in FAVOR_SETTINGS:
        assert setting.meaning and "\n" not in setting.meaning
        assert setting.default is None or isinstance(setting.default, setting.type), setting


def test_public_names_stay_importable_from_the_package():
    assert hf_performer.FAVOR_DEFAULTS is FAVOR_DEFAULTS
    assert hf_performer.resolve_favor_settings is resolve_favor_settings


@pytest.mark.parametrize("settings", SETTINGS)
def test_memoised_resolution_equals_a_fresh_one_and_is_a_new_dict(settings, validations):
    first = resolve_favor_settings(settings)
    first["softmax_layers"].append(99)
    first["feature_map_options"]["changed"] = True
    second = resolve_favor_settings(dict(settings))
    assert validations["n"] == 1
    assert second == favor_settings_module._validate(settings)
    assert 99 not in second["softmax_layers"] and "changed" not in second["feature_map_options"]


@pytest.mark.parametrize("settings", SETTINGS)
def test_canonical_settings_resolve_to_the_same_without_a_second_validation(settings, validations):
    canonical = canonical_favor_settings(settings)
    assert resolve_favor_settings(canonical) == resolve_favor_settings(settings)
    assert validations["n"] == 1


def test_values_of_another_type_are_not_taken_from_the_memo():
    resolve_favor_settings({"orthogonal": True, "seed": 1})
    with pytest.raises(TypeError, match="orthogonal"):
        resolve_favor_settings({"orthogonal": 1, "seed": 1})
    with pytest.raises(TypeError, match="seed"):
        resolve_favor_settings({"orthogonal": True, "seed": True})
    resolve_favor_settings({"softmax_layers": [1]})
    with pytest.raises(ValueError, match="softmax_layers"):
        resolve_favor_settings({"softmax_layers": [True]})


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("head_dim", [8, 16])
def test_effective_nb_features_is_the_size_of_the_built_map(settings, head_dim):
    resolved = resolve_favor_settings(settings)
    feature_map = build_feature_map(resolved, head_dim, layer_idx=0, num_heads=2, num_key_value_heads=2)
    assert effective_nb_features(resolved, head_dim) == feature_map.nb_features


def tiny_bert():
    return BertConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=37, vocab_size=99)


def tiny_gpt2():
    return GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=99)


def test_settings_are_validated_once_at_build_and_never_per_forward(validations):
    model = PerformerForMaskedLM(PerformerConfig(source_config=tiny_bert(), nb_features=16)).eval()
    causal = PerformerForCausalLM(PerformerConfig(source_config=tiny_gpt2(), nb_features=16, softmax_layers=[1]))
    assert validations["n"] == 2  # one per distinct settings
    ids = torch.randint(0, 99, (2, 8))
    with torch.no_grad():
        for _ in range(3):
            model(input_ids=ids)
            causal(input_ids=ids)
        causal.generate(ids[:1, :3], max_new_tokens=3, do_sample=False)
    assert validations["n"] == 2


def test_replaced_settings_are_resolved_again():
    source = tiny_bert()
    source.initializer_range = 1.0  # peaked attention, which 16 random features do not reproduce
    model = PerformerForMaskedLM(PerformerConfig(source_config=source, nb_features=16)).eval()
    attention = find_attention_modules(model)[0][1]
    ids = torch.randint(0, 99, (1, 8))
    with torch.no_grad():
        favor = model(input_ids=ids).logits
        model.config.softmax_layers = [0, 1, 2, 3]  # every layer on exact softmax attention
        softmax = model(input_ids=ids).logits
        assert module_favor_settings(attention)["softmax_layers"] == [0, 1, 2, 3]
        model.set_attn_implementation("sdpa")
        reference = model(input_ids=ids).logits
    assert not torch.allclose(favor, reference, atol=1e-3)
    torch.testing.assert_close(softmax, reference)


def test_settings_config_and_cache_do_not_import_the_attention_function():
    """favor_settings is the floor the configuration and the cache stand on (no cycle cache <-> favor_attention)."""
    package = Path(hf_performer.__file__).parent
    for name in ("favor_settings.py", "configuration_performer.py", "cache.py"):
        tree = ast.parse((package / name).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}
        assert "favor_attention" not in imported, name
    tree = ast.parse((package / "favor_settings.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}
    assert imported == {"favor_schema", "feature_maps"}


@pytest.mark.parametrize("settings,name", [({"tail_cap": 5}, "tail_cap"), ({"tail_gate": True}, "tail_gate"),
                                           ({"attention": "clustered", "tail_cap": 5}, "tail_cap")])
def test_a_tail_weight_without_a_window_layer_is_refused_not_stored(settings, name):
    """A tail cap or gate where no layer has a window (plain linear, or clustered attention) would be stored and never
    used: refused in one line naming the setting."""
    from hf_performer.favor_settings import canonical_favor_settings

    with pytest.raises(ValueError, match=f"favor_settings\\['{name}'\\] weighs a window layer's linear tail, but no "
                                         "layer has a window or sinks") as failure:
        canonical_favor_settings({"feature_map": "favor+", **settings})
    assert "\n" not in str(failure.value)
    if "attention" not in settings:  # with a window: kept
        assert canonical_favor_settings({"feature_map": "favor+", "window": 4, **settings})[name]
