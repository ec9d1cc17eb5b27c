"""PerformerConfig and the Performer model classes: validation, Auto classes, save / load, remote code, generate.

Tiny random models built offline from configs; nothing is downloaded.
"""

import filecmp
import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hf_performer.linear_attention import DEFAULT_CHUNK_SIZE
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    BertConfig,
    T5Config,
)
from transformers.cache_utils import DynamicLayer
from transformers.dynamic_module_utils import get_imports
from transformers.modeling_outputs import MaskedLMOutput, SequenceClassifierOutput
from transformers.utils import logging

import hf_performer
from hf_performer import (
    FAVOR_DEFAULTS,
    FavorCacheLayer,
    PerformerConfig,
    PerformerConfigError,
    PerformerForCausalLM,
    PerformerForMaskedLM,
    PerformerForSequenceClassification,
    PerformerForTokenClassification,
    PerformerModel,
)
from hf_performer.favor_settings import CLUSTERED_SETTINGS
from hf_performer.feature_maps import FeatureMap
from conftest import TINY_VOCAB, cached, tiny_bert_config, tiny_gpt2_config, tiny_llama_config

logging.set_verbosity_error()

VOCAB = TINY_VOCAB
PACKAGE_DIR = Path(hf_performer.__file__).parent
CODE_FILES = (
    "modeling_performer.py",
    "modeling_performer_base.py",
    "configuration_performer.py",
    "source_architectures.py",
    "favor_attention.py",
    "favor_layer_modules.py",
    "favor_cache_hooks.py",
    "favor_schema.py",
    "favor_settings.py",
    "cache.py",
    "favor_cache_layer.py",
    "window_cache_layer.py",
    "clustered_attention.py",
    "feature_maps.py",
    "feature_map_base.py",
    "feature_maps_learned.py",
    "linear_attention.py",
)


# The shared tiny configurations (conftest), with the token ids generate() needs.
bert_config = tiny_bert_config
gpt2_config = functools.partial(tiny_gpt2_config, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                initializer_range=0.3)
llama_config = functools.partial(tiny_llama_config, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def performer_config(source_config, **settings):
    return PerformerConfig(source_config=source_config, nb_features=16, **settings)


def input_batch(batch=2, length=9, padded=True):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, VOCAB, (batch, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    if padded:
        attention_mask[-1, length - 3 :] = 0
    return input_ids, attention_mask


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def test_config_holds_source_config_and_settings():
    config = PerformerConfig(source_config=bert_config().to_dict(), nb_features=32, softmax_layers=[1])
    assert isinstance(config.source_config, BertConfig)
    # Every default is recorded, except the clustered-attention keys of a linear-attention config.
    linear_defaults = {key: value for key, value in FAVOR_DEFAULTS.items() if key not in CLUSTERED_SETTINGS}
    assert config.favor_settings == {**linear_defaults, "nb_features": 32, "softmax_layers": [1]}
    assert config.nb_features == 32 and config.softmax_layers == [1]
    # Source attributes are read and written through the Performer config, stored once (in source_config).
    assert config.hidden_size == 32
    config.pad_token_id = 5
    assert config.source_config.pad_token_id == 5 and "pad_token_id" not in config.__dict__

    serialized = config.to_dict()
    assert serialized["model_type"] == "performer"
    assert serialized["source_config"]["model_type"] == "bert"
    assert "favor_settings" not in serialized["source_config"]
    restored = PerformerConfig.from_dict(serialized)
    assert restored.favor_settings == config.favor_settings
    assert restored.source_config.to_dict() == config.source_config.to_dict()


def test_config_does_not_modify_the_callers_source_config():
    source = bert_config()
    PerformerConfig(source_config=source, nb_features=8)
    assert not hasattr(source, "favor_settings")


def test_config_save_load_with_overrides(tmp_path):
    performer_config(bert_config()).save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path, num_labels=5, nb_features=8, hidden_dropout_prob=0.3)
    assert isinstance(config, PerformerConfig)
    assert config.num_labels == 5 and config.nb_features == 8
    assert config.source_config.hidden_dropout_prob == 0.3
    assert config.source_config.num_labels == 5  # task fields are copied into the source


def test_deterministic_feature_map_records_only_its_settings():
    config = PerformerConfig(source_config=bert_config(), feature_map="elu+1")
    assert config.favor_settings == {
        "feature_map": "elu+1", "chunk_size": DEFAULT_CHUNK_SIZE, "softmax_layers": [], "feature_map_options": {},
        # the sink + window keys are recorded for every map kind
        "window": 0, "sinks": 0, "sparse_cache": 0, "sparse_cache_selection": "recall", "sparse_cache_span": 1,
        "tail_cap": 0, "tail_gate": False,
        "softmax_weight": "auto", "layer_windows": {},
        "linear_tail": True,
    }
    assert isinstance(PerformerModel(config), PerformerModel)


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"nb_feature": 64}, "did you mean 'nb_features'"),
        ({"favor_settings": {"casual": True}}, "unknown favor_settings key"),
        ({"feature_map": "favor++"}, "available: "),
        ({"row_norms": "gaussian"}, "'chi' or 'fixed'"),
        ({"nb_features": 0}, "positive int"),
        ({"softmax_layers": [2]}, "do not exist"),
        ({"favor_settings": {"nb_features": 8}, "nb_features": 16}, "given twice"),
        ({"source_config": {"model_type": "not-a-model"}}, "unknown source architecture 'not-a-model'"),
        ({"source_config": {"hidden_size": 32}}, "no 'model_type'"),
        ({"source_config": T5Config(num_layers=1)}, "bert, distilbert, gpt2, llama, roberta"),
        ({"source_config": "bert"}, "must be a dict"),
    ],
)
def test_config_validation_errors(arguments, message):
    arguments = {"source_config": bert_config(), **arguments}
    with pytest.raises(PerformerConfigError, match=message):
        PerformerConfig(**arguments)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (
            {"feature_map": "trig", "nb_features": 63},
            r"'trig' feature map needs an even nb_features \(sin and cos of each projection\), got 63",
        ),
        ({"feature_map": "hedgehog", "nb_features": 63}, r"'hedgehog' feature map needs nb_features divisible by 2"),
        (
            {"feature_map": "elu+1", "nb_features": 64},
            r"'elu\+1' feature map has exactly head_dim features and takes no nb_features \(got 64\)",
        ),
    ],
)
def test_feature_map_size_rules_are_checked_when_the_config_is_built(arguments, message):
    # Before: accepted here, failing only when a model was built (trig, hedgehog) or silently dropped (elu+1).
    with pytest.raises(PerformerConfigError, match=message) as error:
        PerformerConfig(source_config=bert_config(), **arguments)
    assert "\n" not in str(error.value)
    assert PerformerConfig(source_config=bert_config(), feature_map="trig", nb_features=64).nb_features == 64
    assert PerformerConfig(source_config=bert_config(), feature_map="relu", nb_features=63).nb_features == 63


def test_from_pretrained_refuses_misspelt_keyword_arguments(tmp_path):
    performer_config(bert_config()).save_pretrained(tmp_path)
    for load in (PerformerConfig.from_pretrained, AutoConfig.from_pretrained):
        with pytest.raises(PerformerConfigError, match=r"unknown argument 'nb_featurs'.*did you mean 'nb_features'"):
            load(tmp_path, nb_featurs=16)
        with pytest.raises(PerformerConfigError, match=r"unknown argument 'hiden_dropout_prob'.*'hidden_dropout_prob'"):
            load(tmp_path, hiden_dropout_prob=0.3)
    # Settings, source attributes, generic config arguments and transformers' loading options still work.
    config = PerformerConfig.from_pretrained(
        tmp_path, nb_features=8, hidden_dropout_prob=0.3, num_labels=3, output_attentions=True, local_files_only=True
    )
    assert config.nb_features == 8 and config.source_config.hidden_dropout_prob == 0.3 and config.num_labels == 3
    # With return_unused_kwargs the caller (e.g. a model's from_pretrained) gets the leftovers, as for stock configs;
    # the model refuses them the same way.
    config, unused = PerformerConfig.from_pretrained(tmp_path, foo=1, return_unused_kwargs=True)
    assert unused == {"foo": 1}
    PerformerModel(config).save_pretrained(tmp_path)
    with pytest.raises(PerformerConfigError, match=r"PerformerModel got an unknown argument 'nb_featurs'.*'nb_feat"):
        AutoModel.from_pretrained(tmp_path, nb_featurs=16)
    # Attributes set on a config (transformers' own or arbitrary ones) still survive save / load.
    config = performer_config(bert_config())
    config.use_cache = False
    config.save_pretrained(tmp_path)
    assert PerformerConfig.from_pretrained(tmp_path).use_cache is False


def test_config_without_source_cannot_build_a_model():
    config = PerformerConfig()
    assert config.source_config is None
    with pytest.raises(PerformerConfigError, match="no source_config"):
        PerformerModel(config)


def test_head_missing_in_source_architecture_is_a_clear_error():
    with pytest.raises(PerformerConfigError, match="tasks available for it"):
        PerformerForMaskedLM(performer_config(gpt2_config()))


# --------------------------------------------------------------------------------------------
# Auto classes, forward
# --------------------------------------------------------------------------------------------


def test_auto_classes_resolve_in_process():
    assert AutoConfig.for_model("performer", source_config=bert_config()).__class__ is PerformerConfig
    config = performer_config(bert_config())
    assert type(AutoModel.from_config(config)) is PerformerModel
    assert type(AutoModelForMaskedLM.from_config(config)) is PerformerForMaskedLM
    assert type(AutoModelForSequenceClassification.from_config(config)) is PerformerForSequenceClassification
    assert type(AutoModelForTokenClassification.from_config(config)) is PerformerForTokenClassification
    assert type(AutoModelForCausalLM.from_config(performer_config(gpt2_config()))) is PerformerForCausalLM


def test_wrapped_model_uses_favor_attention_and_layout():
    model = PerformerForSequenceClassification(performer_config(bert_config(), softmax_layers=[1]))
    source = model.source_model
    assert type(source).__name__ == "BertForSequenceClassification"
    assert source.config is model.config.source_config
    assert source.config._attn_implementation == "favor"
    keys = list(model.state_dict())
    assert all(key.startswith("performer.") for key in keys)
    # One feature map per converted layer, none on the softmax layer.
    assert any(key.startswith("performer.bert.encoder.layer.0.attention.self.favor_feature_map.") for key in keys)
    assert not any("layer.1.attention.self.favor_feature_map" in key for key in keys)
    base = PerformerModel(performer_config(bert_config()))
    assert list(base.state_dict())[0].startswith("bert.")


def test_forward_returns_the_source_output_classes():
    input_ids, attention_mask = input_batch()
    classifier = PerformerForSequenceClassification(performer_config(bert_config())).eval()
    output = classifier(input_ids=input_ids, attention_mask=attention_mask, labels=torch.tensor([0, 1]))
    assert isinstance(output, SequenceClassifierOutput)
    assert output.logits.shape == (2, 2) and output.loss.ndim == 0
    masked_lm = PerformerForMaskedLM(performer_config(bert_config())).eval()
    output = masked_lm(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    assert isinstance(output, MaskedLMOutput)
    assert output.logits.shape == (2, 9, VOCAB) and len(output.hidden_states) == 3
    as_tuple = masked_lm(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], output.logits)


def test_padding_is_respected():
    model = PerformerModel(performer_config(bert_config())).eval()
    input_ids, _ = input_batch(batch=1, length=6, padded=False)
    padded_ids = torch.cat([input_ids, torch.full((1, 3), 7)], dim=1)
    mask = torch.tensor([[1] * 6 + [0] * 3])
    with torch.no_grad():
        alone = model(input_ids=input_ids).last_hidden_state
        padded = model(input_ids=padded_ids, attention_mask=mask).last_hidden_state[:, :6]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)


def test_argument_the_source_does_not_take_is_an_error():
    model = PerformerForCausalLM(performer_config(llama_config()))
    input_ids, _ = input_batch(padded=False)
    with pytest.raises(TypeError, match="token_type_ids"):
        model(input_ids=input_ids, token_type_ids=torch.zeros_like(input_ids))


def test_the_cache_under_either_keyword():
    """transformers 5.24 renamed ``past_key_values`` to ``cache``: both reach the source under its own name, with
    the same result; the old one warns where the installed transformers has renamed it (as its models do); both at
    once is an error."""
    import warnings

    from hf_performer import make_favor_cache
    from hf_performer.cache import cache_argument_name, cache_of_output

    model = PerformerForCausalLM(performer_config(llama_config())).eval()
    input_ids, _ = input_batch(padded=False)
    renamed = cache_argument_name(type(model.source_model).forward) == "cache"
    outputs = {}
    for keyword in ("cache", "past_key_values"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            output = model(input_ids=input_ids, use_cache=True, **{keyword: make_favor_cache(model)})
        deprecated = [w for w in caught if "`past_key_values` is deprecated" in str(w.message)]
        assert len(deprecated) == (keyword == "past_key_values" and renamed)
        assert cache_of_output(output).get_seq_length() == input_ids.shape[1]
        outputs[keyword] = output.logits
    torch.testing.assert_close(outputs["cache"], outputs["past_key_values"])
    with pytest.raises(TypeError, match="got the cache twice"):
        model(input_ids=input_ids, cache=make_favor_cache(model), past_key_values=make_favor_cache(model))


# --------------------------------------------------------------------------------------------
# Saving and loading
# --------------------------------------------------------------------------------------------


def test_save_pretrained_writes_auto_map_and_the_package_modules(tmp_path):
    model = PerformerForMaskedLM(performer_config(bert_config()))
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_performer.PerformerConfig",
        "AutoModel": "modeling_performer.PerformerModel",
        "AutoModelForCausalLM": "modeling_performer.PerformerForCausalLM",
        "AutoModelForMaskedLM": "modeling_performer.PerformerForMaskedLM",
        "AutoModelForSequenceClassification": "modeling_performer.PerformerForSequenceClassification",
        "AutoModelForTokenClassification": "modeling_performer.PerformerForTokenClassification",
    }
    assert (tmp_path / "model.safetensors").is_file()
    for name in CODE_FILES:
        # The copies are the package's own modules, not a second implementation.
        assert filecmp.cmp(tmp_path / name, PACKAGE_DIR / name, shallow=False), name
        # What transformers checks before running remote code: only libraries every transformers install has.
        third_party = set(get_imports(tmp_path / name)) - set(sys.stdlib_module_names)
        assert third_party <= {"torch", "transformers", "huggingface_hub"}, (name, third_party)


def test_save_load_round_trip_is_identical(tmp_path):
    model = PerformerForMaskedLM(performer_config(bert_config(), softmax_layers=[1])).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path)
    assert type(loaded) is PerformerForMaskedLM
    assert loaded.config.favor_settings == model.config.favor_settings
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    input_ids, attention_mask = input_batch()
    with torch.no_grad():
        assert torch.equal(
            loaded(input_ids=input_ids, attention_mask=attention_mask).logits,
            model(input_ids=input_ids, attention_mask=attention_mask).logits,
        )


def test_head_checkpoint_loads_into_base_model_and_back(tmp_path):
    masked_lm = PerformerForMaskedLM(performer_config(bert_config())).eval()
    masked_lm.save_pretrained(tmp_path / "mlm")
    base = AutoModel.from_pretrained(tmp_path / "mlm")
    assert type(base) is PerformerModel
    input_ids, attention_mask = input_batch()
    with torch.no_grad():
        expected = masked_lm.source_model.bert(input_ids=input_ids, attention_mask=attention_mask)
        actual = base(input_ids=input_ids, attention_mask=attention_mask)
    assert torch.equal(actual.last_hidden_state, expected.last_hidden_state)

    base.save_pretrained(tmp_path / "base")
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path / "base", num_labels=3)
    assert classifier.source_model.classifier.out_features == 3
    assert torch.equal(
        classifier.source_model.bert.embeddings.word_embeddings.weight,
        base.source_model.embeddings.word_embeddings.weight,
    )


REMOTE_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    try:
        import hf_performer
    except ImportError:
        pass
    else:
        raise SystemExit("hf_performer is importable: the blocker did not work")
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

    folder, output = sys.argv[1], sys.argv[2]
    inputs = torch.load(f"{output}/inputs.pt")
    masked_lm = AutoModelForMaskedLM.from_pretrained(f"{folder}/mlm", trust_remote_code=True)
    base = AutoModel.from_pretrained(f"{folder}/mlm", trust_remote_code=True)
    causal_lm = AutoModelForCausalLM.from_pretrained(f"{folder}/clm", trust_remote_code=True)
    assert type(masked_lm).__module__.startswith("transformers_modules."), type(masked_lm).__module__
    assert not any(name.split(".")[0] == "hf_performer" for name in sys.modules)
    with torch.no_grad():
        results = {
            "mlm": masked_lm(input_ids=inputs["ids"], attention_mask=inputs["mask"]).logits,
            "base": base(input_ids=inputs["ids"], attention_mask=inputs["mask"]).last_hidden_state,
            "clm": causal_lm(input_ids=inputs["ids"], attention_mask=inputs["mask"]).logits,
            "generated": causal_lm.generate(inputs["prompt"], max_new_tokens=6, do_sample=False),
        }
    torch.save(results, f"{output}/results.pt")
    """
)



def test_trust_remote_code_loads_where_the_package_is_not_installed(tmp_path, block_hf_performer_source):
    masked_lm = PerformerForMaskedLM(performer_config(bert_config())).eval()
    # The causal LM uses a learned map whose parameters were moved from their initialisation: the remote copy must
    # load them from the weights (favor+ is covered by the masked LM).
    causal_lm = PerformerForCausalLM(
        PerformerConfig(source_config=gpt2_config(), feature_map="hedgehog", softmax_layers=[1])
    ).eval()
    with torch.no_grad():
        for name, parameter in causal_lm.named_parameters():
            if "favor_feature_map" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    masked_lm.save_pretrained(tmp_path / "models" / "mlm")
    causal_lm.save_pretrained(tmp_path / "models" / "clm")
    input_ids, attention_mask = input_batch()
    prompt = input_ids[:1, :4]
    torch.save({"ids": input_ids, "mask": attention_mask, "prompt": prompt}, tmp_path / "inputs.pt")

    blocker_dir = tmp_path / "blocker"
    blocker_dir.mkdir()
    (blocker_dir / "sitecustomize.py").write_text(block_hf_performer_source)
    script = tmp_path / "load_remote.py"
    script.write_text(REMOTE_SCRIPT)
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(blocker_dir), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / "modules_cache"),
    }
    check = subprocess.run(
        [sys.executable, "-c", "import hf_performer"], env=environment, cwd=tmp_path, capture_output=True, text=True
    )
    assert check.returncode != 0 and "blocked for this test" in check.stderr

    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "models"), str(tmp_path)],
        env=environment,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    remote = torch.load(tmp_path / "results.pt")
    base = PerformerModel.from_pretrained(tmp_path / "models" / "mlm")
    with torch.no_grad():
        assert torch.equal(remote["mlm"], masked_lm(input_ids=input_ids, attention_mask=attention_mask).logits)
        assert torch.equal(remote["base"], base(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state)
        assert torch.equal(remote["clm"], causal_lm(input_ids=input_ids, attention_mask=attention_mask).logits)
    assert torch.equal(remote["generated"], causal_lm.generate(prompt, max_new_tokens=6, do_sample=False))


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source_config", [gpt2_config, llama_config], ids=["gpt2", "llama"])
def test_generate_uses_the_constant_memory_cache(source_config):
    model = PerformerForCausalLM(performer_config(source_config(), softmax_layers=[1])).eval()
    prompt, _ = input_batch(batch=2, length=5, padded=False)
    output = model.generate(
        prompt, max_new_tokens=8, do_sample=False, return_dict_in_generate=True, pad_token_id=0
    )
    layers = output.past_key_values.layers
    assert isinstance(layers[0], FavorCacheLayer)  # converted layer: recurrent state only
    assert type(layers[1]) is DynamicLayer  # softmax layer keeps its keys and values
    assert layers[0].get_seq_length() == 5 + 8 - 1
    without_cache = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False, pad_token_id=0)
    assert torch.equal(output.sequences, without_cache)


def test_feature_maps_are_fixed_in_eval_and_saved():
    model = PerformerModel(performer_config(bert_config(), redraw_interval=1))
    feature_maps = [m for m in model.modules() if isinstance(m, FeatureMap)]
    assert len(feature_maps) == 2
    projection = feature_maps[0].projection.clone()
    input_ids, _ = input_batch(padded=False)
    model.eval()
    model(input_ids=input_ids)
    model(input_ids=input_ids)
    assert torch.equal(feature_maps[0].projection, projection)
    model.train()
    model(input_ids=input_ids)
    model(input_ids=input_ids)
    assert not torch.equal(feature_maps[0].projection, projection)


# --------------------------------------------------------------------------------------------
# Left padding: position ids from the attention mask
# --------------------------------------------------------------------------------------------


def _left_padded_batch(pad=4, length=11):
    input_ids, attention_mask = input_batch(batch=2, length=length, padded=False)
    attention_mask[1, :pad] = 0
    input_ids[1, :pad] = 0
    return input_ids, attention_mask


@pytest.mark.parametrize("source_config", [gpt2_config, llama_config], ids=["gpt2", "llama"])
def test_left_padded_row_equals_the_row_run_alone(source_config):
    # Random features of rotated (Llama) or position-shifted (GPT-2) queries and keys are not shift-invariant: a row
    # padded on the left must get the positions it has alone (as generate() gives them), not 4..10.
    torch.manual_seed(0)
    model = PerformerForCausalLM(performer_config(source_config(), chunk_size=4)).eval()
    pad = 4
    input_ids, attention_mask = _left_padded_batch(pad)
    with torch.no_grad():
        batched = model(input_ids, attention_mask=attention_mask).logits
        alone = model(input_ids[1:, pad:]).logits
    torch.testing.assert_close(batched[1, pad:], alone[0], atol=2e-5, rtol=1e-5)
    base = PerformerModel(model.config).eval()  # the bare decoder too
    with torch.no_grad():
        torch.testing.assert_close(
            base(input_ids, attention_mask=attention_mask).last_hidden_state[1, pad:],
            base(input_ids[1:, pad:]).last_hidden_state[0],
            atol=2e-5, rtol=1e-5,
        )

    # Prefill then one token at a time, with the mask of all tokens so far and no position ids: the same logits.
    with torch.no_grad():
        outputs = model(input_ids[:, :6], attention_mask=attention_mask[:, :6], use_cache=True)
        steps = [outputs.logits]
        for i in range(6, input_ids.shape[1]):
            outputs = model(
                input_ids[:, i : i + 1], attention_mask=attention_mask[:, : i + 1],
                **cached(model, outputs.past_key_values), use_cache=True,
            )
            steps.append(outputs.logits)
    assert isinstance(outputs.past_key_values.layers[0], FavorCacheLayer)
    torch.testing.assert_close(torch.cat(steps, dim=1)[1, pad:], alone[0], atol=2e-5, rtol=1e-5)

    # generate() with left padding: the padded row continues as it does alone.
    batched_generation = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, do_sample=False)
    alone_generation = model.generate(input_ids[1:, pad:], max_new_tokens=5, do_sample=False)
    assert torch.equal(batched_generation[1, pad:], alone_generation[0])


def test_explicit_position_ids_and_bidirectional_models_are_left_alone():
    torch.manual_seed(0)
    model = PerformerForCausalLM(performer_config(llama_config())).eval()
    input_ids, attention_mask = _left_padded_batch()
    default_positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.no_grad():
        explicit = model(input_ids, attention_mask=attention_mask, position_ids=default_positions).logits
        derived = model(input_ids, attention_mask=attention_mask).logits
    assert not torch.allclose(explicit[1], derived[1], atol=1e-4)  # the given position ids were used
    # An encoder (bidirectional) is not given derived positions: BERT left padding behaves as in transformers.
    masked_lm = PerformerForMaskedLM(performer_config(bert_config())).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            masked_lm(input_ids, attention_mask=attention_mask).logits,
            masked_lm(input_ids, attention_mask=attention_mask, position_ids=default_positions).logits,
        )


# --------------------------------------------------------------------------------------------
# Inputs longer than a learned position table
# --------------------------------------------------------------------------------------------


def roberta_config(**overrides):
    from transformers import RobertaConfig

    settings = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, vocab_size=VOCAB,
        pad_token_id=1, max_position_embeddings=16 + 2,
    )
    return RobertaConfig(**{**settings, **overrides})


@pytest.mark.parametrize(
    "model_class, source_config",
    [
        (PerformerForMaskedLM, lambda: bert_config(max_position_embeddings=16)),
        (PerformerForMaskedLM, roberta_config),  # the table starts at padding_idx + 1: 18 rows, 16 tokens
        (PerformerModel, lambda: gpt2_config(n_positions=16)),
    ],
    ids=["bert", "roberta", "gpt2"],
)
def test_input_longer_than_the_position_table_is_a_one_line_error(model_class, source_config):
    model = model_class(performer_config(source_config())).eval()
    input_ids = torch.randint(3, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids[:, :16])  # the longest input the table holds
        with pytest.raises(ValueError) as error:
            model(input_ids)
    message = str(error.value)
    assert "\n" not in message and "must match the size" not in message
    assert "17 tokens" in message and "max_position_embeddings=" in message
    assert "hf-performer convert ... --max-position-embeddings N" in message
    # What the message suggests: a longer table (the converter's helper) makes the same model accept the input.
    from hf_performer.conversion import extend_position_embeddings

    extend_position_embeddings(model, 24)
    with torch.no_grad():
        model(input_ids)


def test_decoding_past_the_position_table_is_a_one_line_error():
    model = PerformerForCausalLM(performer_config(gpt2_config(n_positions=16))).eval()
    input_ids = torch.randint(3, VOCAB, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        outputs = model(input_ids[:, :15], use_cache=True)
        outputs = model(input_ids[:, 15:16], **cached(model, outputs.past_key_values), use_cache=True)
        with pytest.raises(ValueError, match=r"17 tokens .*max_position_embeddings=16"):
            model(input_ids[:, 16:], **cached(model, outputs.past_key_values), use_cache=True)
        # Left padding does not use positions: 4 pads + 16 tokens fit a 16-position table.
        padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), input_ids[:, :16]], dim=1)
        mask = (padded != 0).long()
        model(padded, attention_mask=mask)


def test_rotary_models_have_no_position_table_to_check():
    model = PerformerForCausalLM(performer_config(llama_config(max_position_embeddings=8))).eval()
    input_ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert model(input_ids).logits.shape == (1, 12, VOCAB)


def test_an_attribute_set_on_the_config_survives_save_and_load(tmp_path):
    """Issue 16 (75 of transformers' common-test failures): an attribute set on a config (as transformers' test
    utilities do, e.g. ``config.batch_norm_eps``) is saved and loads again, as with stock configs; favor settings
    and keyword arguments stay strict."""
    from transformers import AutoConfig, BertConfig

    config = PerformerConfig(source_config=BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                      intermediate_size=37), nb_features=16)
    config.batch_norm_eps = 1e-5
    config.layer_norm_eps = 1e-7  # an attribute of the source: set there, as before
    config.save_pretrained(tmp_path)
    for loaded in (PerformerConfig.from_pretrained(tmp_path), AutoConfig.from_pretrained(tmp_path)):
        assert loaded.batch_norm_eps == 1e-5 and loaded.layer_norm_eps == 1e-7 and loaded.nb_features == 16
    reloaded = PerformerConfig.from_pretrained(tmp_path)
    reloaded.save_pretrained(tmp_path / "again")
    assert PerformerConfig.from_pretrained(tmp_path / "again").batch_norm_eps == 1e-5
    PerformerModel(reloaded)  # the folder's config still builds a model
    with pytest.raises(PerformerConfigError):
        PerformerConfig.from_pretrained(tmp_path, nb_featurs=8)
