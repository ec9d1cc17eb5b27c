"""The sink + sliding-window hybrid as an attention kind of the models (issue 15, integration): settings and their
validation, conversion (Llama with GQA and RoPE, GPT-2, BERT), per-layer overrides, the learned softmax weight gamma,
the convert command line, saved folders (push validation, trust_remote_code), low precision, generation."""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AttentionInterface, BertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from conftest import cached, tiny_bert_config, tiny_gpt2_config, tiny_llama_config
from hf_performer import (
    FAVOR_DEFAULTS,
    FavorCacheLayer,
    PerformerConfig,
    PerformerForCausalLM,
    SoftmaxWeight,
    WindowCacheLayer,
    convert_to_performer,
    layer_window,
    make_favor_cache,
    resolve_favor_settings,
    softmax_weight_mode,
    window_linear_attention,
)
from hf_performer.cli import convert as convert_cli
from hf_performer.conversion import ConversionError
from hf_performer.favor_attention import FEATURE_MAP_ATTRIBUTE, SOFTMAX_WEIGHT_ATTRIBUTE, find_attention_modules
from hf_performer.favor_settings import canonical_favor_settings
from hf_performer.linear_attention import LinearAttentionError
from hf_performer.reference import reference_window_linear_attention

SOURCES = {
    "llama": lambda: LlamaForCausalLM(tiny_llama_config()),
    "gpt2": lambda: GPT2LMHeadModel(tiny_gpt2_config()),
    "bert": lambda: BertForMaskedLM(tiny_bert_config()),
}


def _source(name, seed=0):
    torch.manual_seed(seed)
    return SOURCES[name]().eval()


def _ids(batch=2, length=12, seed=1):
    return torch.randint(5, 99, (batch, length), generator=torch.Generator().manual_seed(seed))


def _attention_modules(model):
    return [module for _, module in find_attention_modules(model)]


# ------------------------------------------------------------------------------------------------ settings


def test_window_settings_defaults_and_resolution():
    resolved = resolve_favor_settings({})
    assert (resolved["window"], resolved["sinks"], resolved["softmax_weight"]) == (0, 0, "auto")
    assert resolved["layer_windows"] == {} and resolved["linear_tail"] is True
    assert softmax_weight_mode(resolved) == "calibrated"
    assert softmax_weight_mode(resolve_favor_settings({"feature_map": "hedgehog"})) == "learned"
    assert softmax_weight_mode(resolve_favor_settings({"feature_map": "hedgehog", "softmax_weight": "calibrated"})) \
        == "calibrated"
    settings = resolve_favor_settings({"window": 64, "sinks": 4, "layer_windows": {0: {"window": 0, "sinks": 0},
                                                                                   "2": {"window": 8}}})
    assert settings["layer_windows"] == {"0": {"window": 0, "sinks": 0}, "2": {"window": 8}}  # int keys -> strings
    assert [layer_window(settings, i) for i in range(3)] == [(0, 0), (64, 4), (8, 4)]


@pytest.mark.parametrize("feature_map", ["favor+", "hedgehog", "elu+1"])
def test_canonical_settings_record_the_window_keys_for_every_map_kind(feature_map):
    canonical = canonical_favor_settings({"feature_map": feature_map, "window": 16, "sinks": 1})
    for key in ("window", "sinks", "softmax_weight", "layer_windows", "linear_tail"):
        assert key in canonical
    assert canonical["window"] == 16 and canonical["sinks"] == 1
    assert canonical_favor_settings(canonical) == canonical
    # JSON round trip (what config.json stores)
    assert canonical_favor_settings(json.loads(json.dumps(canonical))) == canonical


@pytest.mark.parametrize("settings, message", [
    ({"window": -1}, "favor_settings['window'] must be an int >= 0"),
    ({"sinks": -2}, "favor_settings['sinks'] must be an int >= 0"),
    ({"window": True}, "favor_settings['window'] must be an int >= 0"),
    ({"window": 2.5}, "favor_settings['window'] must be an int >= 0"),
    ({"softmax_weight": "gamma"}, "favor_settings['softmax_weight'] must be one of"),
    ({"softmax_weight": "learned"}, "'learned' needs a learned feature map"),
    ({"feature_map": "elu+1", "softmax_weight": "learned"}, "'learned' needs a learned feature map"),
    ({"layer_windows": {"x": {"window": 1}}}, "keys must be layer indices"),
    ({"layer_windows": {"-1": {"window": 1}}}, "keys must be layer indices"),
    ({"layer_windows": {"01": {"window": 1}}}, "keys must be layer indices"),
    ({"layer_windows": {"0": {"widow": 1}}}, "must be a non-empty dict with keys among ['window', 'sinks', 'sparse_cache']"),
    ({"layer_windows": {"0": {}}}, "must be a non-empty dict"),
    ({"layer_windows": {"0": 3}}, "must be a non-empty dict"),
    ({"layer_windows": {"0": {"sinks": -1}}}, "['layer_windows']['0']['sinks'] must be an int >= 0"),
    ({"layer_windows": {0: {"window": 1}, "0": {"window": 2}}}, "gives layer 0 twice"),
    ({"linear_tail": False}, "leaves the default with window=0 and sinks=0"),
    ({"linear_tail": False, "window": 4, "layer_windows": {"1": {"window": 0}}}, "leaves layer 1 with window=0"),
])
def test_bad_window_settings_get_one_line_errors(settings, message):
    with pytest.raises(ValueError) as error:
        resolve_favor_settings(settings)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("settings", [{"layer_windows": [1]}, {"linear_tail": "no"}])
def test_mistyped_window_settings_raise_type_errors(settings):
    with pytest.raises(TypeError, match="layer_windows|linear_tail"):
        resolve_favor_settings(settings)


def test_every_window_setting_is_a_favor_setting_with_a_default():
    for key, default in [("window", 0), ("sinks", 0), ("softmax_weight", "auto"), ("layer_windows", {}),
                         ("linear_tail", True)]:
        assert FAVOR_DEFAULTS[key] == default


# ------------------------------------------------------------------------------------------------ limits


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
@pytest.mark.parametrize("feature_map", ["favor+", "hedgehog"])
def test_a_window_covering_the_sequence_gives_the_softmax_model(name, feature_map):
    # window >= L: every key is exact, in calibrated (favor+) and learned (hedgehog: gamma cancels) mode. (Below the
    # tiny sources' 64 positions: a window covering every position the model takes is refused.)
    source = _source(name)
    performer = convert_to_performer(source, feature_map=feature_map, window=32, sinks=2)
    ids = _ids(length=12)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    with torch.no_grad():
        expected = source(input_ids=ids, attention_mask=mask).logits
        got = performer(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], expected[keep], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_window_0_sinks_0_is_todays_favor_model_bit_for_bit(name):
    source = _source(name)
    ids = _ids()
    plain = convert_to_performer(source)
    explicit = convert_to_performer(source, window=0, sinks=0, layer_windows={})
    assert all(not hasattr(module, SOFTMAX_WEIGHT_ATTRIBUTE) for module in _attention_modules(explicit))
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, explicit(input_ids=ids).logits)


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_layer_windows_reach_only_their_layer(name):
    # Layer 1 alone is a window layer: layer 0 stays today's favor layer bit for bit, layer 1 changes.
    source = _source(name)
    ids = _ids()
    plain = convert_to_performer(source, feature_map="hedgehog")
    hybrid = convert_to_performer(source, feature_map="hedgehog", layer_windows={"1": {"window": 3, "sinks": 1}})
    modules = _attention_modules(hybrid)
    assert not hasattr(modules[0], SOFTMAX_WEIGHT_ATTRIBUTE) and hasattr(modules[1], SOFTMAX_WEIGHT_ATTRIBUTE)
    calls = []
    original = window_linear_attention

    def recording(*args, **kwargs):
        calls.append((kwargs["window"], kwargs["sinks"]))
        return original(*args, **kwargs)

    import hf_performer.favor_attention as favor_attention

    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(favor_attention, "window_linear_attention", recording)
        # Without a cache: with one, a window layer runs the operator through its WindowCacheLayer (cache.py).
        hidden_plain = plain(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        hidden_hybrid = hybrid(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    assert calls == [(3, 1)]
    assert torch.equal(hidden_plain[1], hidden_hybrid[1])
    assert not torch.allclose(hidden_plain[2], hidden_hybrid[2])


# --------------------------------------------------------------- layer 0 against the operator on q/k/v hooked out


_CAPTURED = {}


def _capturing_sdpa(module, query, key, value, attention_mask, **kwargs):
    _CAPTURED[getattr(module, "layer_idx", 0) or 0] = (query, key, value, kwargs.get("scaling"))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("window_test_capture", _capturing_sdpa)
AttentionMaskInterface.register("window_test_capture", sdpa_mask)


def _attention_output_of_layer_0(performer, ids, mask):
    """``[B, L, H * d]``: what layer 0's attention function returned (input of its output projection)."""
    module = _attention_modules(performer)[0]
    projection = getattr(module, "o_proj", None)
    seen = {}
    if projection is not None:  # Llama: the attention function's output enters o_proj
        handle = projection.register_forward_pre_hook(lambda _, args: seen.setdefault("out", args[0]))
    else:  # BERT: the self-attention module returns it
        handle = module.register_forward_hook(lambda _, args, output: seen.setdefault("out", output[0]))
    try:
        with torch.no_grad():
            performer(input_ids=ids, attention_mask=mask)
    finally:
        handle.remove()
    return seen["out"]


@pytest.mark.parametrize("name, causal, window, sinks, feature_map", [
    ("llama", True, 3, 2, "hedgehog"),  # GQA 4/2 heads, RoPE, learned gamma
    ("llama", True, 4, 0, "favor+"),  # calibrated
    ("bert", False, 2, 1, "hedgehog"),  # bidirectional band, [CLS] as a sink
    ("bert", False, 3, 1, "favor+"),
])
def test_layer_0_equals_the_operator_on_the_softmax_models_post_rope_qkv(name, causal, window, sinks, feature_map):
    source = _source(name)
    performer = convert_to_performer(source, feature_map=feature_map, window=window, sinks=sinks, chunk_size=4)
    module = _attention_modules(performer)[0]
    gamma_module = getattr(module, SOFTMAX_WEIGHT_ATTRIBUTE, None)
    assert (gamma_module is not None) == (feature_map == "hedgehog")
    if gamma_module is not None:  # a gamma away from its init, different per head
        with torch.no_grad():
            gamma_module.logit.copy_(torch.linspace(-2.0, 1.0, gamma_module.logit.numel()))
    ids = _ids(length=11)
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0
    source.set_attn_implementation("window_test_capture")
    _CAPTURED.clear()
    with torch.no_grad():
        source(input_ids=ids, attention_mask=mask)
    query, key, value, scaling = _CAPTURED[0]  # after RoPE (Llama), keys with 2 heads (GQA)
    feature_map_module = getattr(module, FEATURE_MAP_ATTRIBUTE)
    gamma = None if gamma_module is None else gamma_module().detach()
    arguments = dict(window=window, sinks=sinks, causal=causal, softmax_weight=gamma, key_padding_mask=mask.bool(),
                     scaling=scaling)
    expected = reference_window_linear_attention(query, key, value, feature_map_module, **arguments)
    got = _attention_output_of_layer_0(performer, ids, mask)
    batch, length = ids.shape
    expected = expected.transpose(1, 2).reshape(batch, length, -1).to(got.dtype)
    keep = mask.bool()
    torch.testing.assert_close(got[keep], expected[keep], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------ gamma


def test_learned_gamma_is_attached_trained_saved_and_reloaded(tmp_path):
    source = _source("llama")
    performer = convert_to_performer(source, feature_map="hedgehog", window=3, sinks=1)
    names = [name for name, _ in performer.named_parameters() if SOFTMAX_WEIGHT_ATTRIBUTE in name]
    assert names == [f"performer.model.layers.{i}.self_attn.{SOFTMAX_WEIGHT_ATTRIBUTE}.logit" for i in range(2)]
    modules = _attention_modules(performer)
    for module in modules:
        weight = getattr(module, SOFTMAX_WEIGHT_ATTRIBUTE)
        assert isinstance(weight, SoftmaxWeight) and weight.logit.shape == (4,)  # query heads
        assert weight.logit.dtype == torch.float32 and weight.logit.requires_grad
        torch.testing.assert_close(weight.logit, torch.full((4,), math.log(0.1 / 0.9)))
        torch.testing.assert_close(weight(), torch.full((4,), 0.1))
    assert abs(math.log(0.1 / 0.9) - (-2.1972)) < 1e-4

    performer.train()
    optimizer = torch.optim.SGD([p for n, p in performer.named_parameters() if SOFTMAX_WEIGHT_ATTRIBUTE in n], lr=1.0)
    ids = _ids(length=16)
    before = [getattr(m, SOFTMAX_WEIGHT_ATTRIBUTE).logit.detach().clone() for m in modules]
    performer(input_ids=ids, labels=ids).loss.backward()
    for module in modules:
        grad = getattr(module, SOFTMAX_WEIGHT_ATTRIBUTE).logit.grad
        assert grad is not None and bool(grad.abs().gt(0).all())
    optimizer.step()
    after = [getattr(m, SOFTMAX_WEIGHT_ATTRIBUTE).logit.detach().clone() for m in modules]
    assert all(not torch.equal(b, a) for b, a in zip(before, after))

    performer.eval().save_pretrained(tmp_path / "model")
    reloaded = PerformerForCausalLM.from_pretrained(tmp_path / "model").eval()
    for module, expected in zip(_attention_modules(reloaded), after):
        assert torch.equal(getattr(module, SOFTMAX_WEIGHT_ATTRIBUTE).logit, expected)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, performer(input_ids=ids).logits)


def test_gamma_init_is_deterministic_and_survives_the_meta_device():
    config = PerformerConfig(source_config=tiny_llama_config(), feature_map="t2r", window=2)
    with torch.device("meta"):
        on_meta = PerformerForCausalLM(config)
    built = PerformerForCausalLM(config)
    for module_meta, module in zip(_attention_modules(on_meta), _attention_modules(built)):
        # created on the CPU even under a meta-device context (from_pretrained builds models on meta)
        assert getattr(module_meta, SOFTMAX_WEIGHT_ATTRIBUTE).logit.device.type == "cpu"
        assert torch.equal(getattr(module_meta, SOFTMAX_WEIGHT_ATTRIBUTE).logit,
                           getattr(module, SOFTMAX_WEIGHT_ATTRIBUTE).logit)


def test_calibrated_mode_and_no_tail_have_no_gamma_and_learned_needs_a_learned_map():
    source = _source("gpt2")
    for kwargs in (dict(feature_map="favor+", window=2), dict(feature_map="hedgehog", window=2,
                                                                softmax_weight="calibrated")):
        performer = convert_to_performer(source, **kwargs)
        assert not any(SOFTMAX_WEIGHT_ATTRIBUTE in name for name in performer.state_dict())
    with pytest.raises(ConversionError, match="'learned' needs a learned feature map"):
        convert_to_performer(source, feature_map="trig", window=2, softmax_weight="learned")


def test_no_linear_tail_is_sinks_and_window_softmax_only():
    source = _source("llama")
    performer = convert_to_performer(source, feature_map="favor+", window=3, sinks=2, linear_tail=False)
    ids = _ids(length=10)
    module = _attention_modules(performer)[0]
    source.set_attn_implementation("window_test_capture")
    _CAPTURED.clear()
    with torch.no_grad():
        source(input_ids=ids)
    query, key, value, scaling = _CAPTURED[0]
    got = _attention_output_of_layer_0(performer, ids, None)
    # Exact softmax over keys {0, 1} and i-2..i, nothing else: the dense masked softmax.
    i, j = torch.arange(10)[:, None], torch.arange(10)[None, :]
    allowed = (j <= i) & ((j < 2) | (j > i - 3))
    keys, values = key.repeat_interleave(2, 1), value.repeat_interleave(2, 1)
    scores = (query @ keys.transpose(-1, -2) * scaling).masked_fill(~allowed, float("-inf"))
    expected = (scores.softmax(-1) @ values).transpose(1, 2).reshape(2, 10, -1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert getattr(module, FEATURE_MAP_ATTRIBUTE) is not None  # the map is kept (state dict), just unused


# ------------------------------------------------------------------------------------------------ operator


@pytest.mark.parametrize("causal", [True, False])
def test_operator_without_feature_map_matches_the_reference(causal):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 13, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 13, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, -3:] = False
    for window, sinks in [(1, 0), (3, 2), (0, 2), (20, 0)]:
        kwargs = dict(window=window, sinks=sinks, causal=causal, key_padding_mask=mask)
        out = window_linear_attention(q, k, v, None, chunk_size=4, **kwargs)
        ref = reference_window_linear_attention(q, k, v, None, **kwargs)
        # Padded queries of a window without sinks may see no key at all: their output is undefined (0/0).
        assert bool(torch.isfinite(out).all())
        torch.testing.assert_close(out.transpose(1, 2)[mask], ref.transpose(1, 2)[mask], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="needs window, sinks or sparse_cache > 0"):
        window_linear_attention(q, k, v, None, window=0, sinks=0)


# ------------------------------------------------------------------------------------------------ command line


def test_convert_flags_end_up_in_config_json(tmp_path, capsys):
    source = _source("llama")
    source.save_pretrained(tmp_path / "source")
    output = tmp_path / "out"
    assert convert_cli.main([str(tmp_path / "source"), str(output), "--feature-map", "hedgehog", "--window", "5",
                             "--sinks", "2", "--softmax-weight", "learned", "--layer-windows",
                             '{"0": {"window": 0, "sinks": 0}}']) == 0
    settings = json.loads((output / "config.json").read_text())["favor_settings"]
    assert (settings["window"], settings["sinks"], settings["softmax_weight"]) == (5, 2, "learned")
    assert settings["layer_windows"] == {"0": {"window": 0, "sinks": 0}} and settings["linear_tail"] is True
    assert "window 5, sinks 2" in capsys.readouterr().out  # the fidelity table's settings line
    card = (output / "README.md").read_text()
    assert "- layer 1: a **sink + sliding-window hybrid**: exact softmax over the first 2 tokens (sinks) and the last " \
        "5 keys" in card and "- layer 0: **`hedgehog`** linear attention" in card and "| `window` | 5 |" in card
    assert "the 1 window layer keeps a `WindowCacheLayer`" in card and "the 1 linear-attention layer keeps" in card
    assert "decoding memory does not grow with the context" in card
    # Layer 1 is a window layer with gamma; layer 0 (override 0/0) is not.
    from safetensors import safe_open

    with safe_open(str(output / "model.safetensors"), "pt") as weights:
        gamma_keys = sorted(key for key in weights.keys() if SOFTMAX_WEIGHT_ATTRIBUTE in key)
    assert gamma_keys == [f"performer.model.layers.1.self_attn.{SOFTMAX_WEIGHT_ATTRIBUTE}.logit"]

    no_tail = tmp_path / "no_tail"
    assert convert_cli.main([str(tmp_path / "source"), str(no_tail), "--window", "4", "--no-tail"]) == 0
    assert json.loads((no_tail / "config.json").read_text())["favor_settings"]["linear_tail"] is False
    card = (no_tail / "README.md").read_text()  # no layer uses a feature map: the card does not describe one
    assert "Also recorded but not used by this attention: `feature_map`" in card and "| `nb_features` |" not in card
    assert "0.07" not in card and "estimator" not in card and "These window layers have no linear tail" in card
    with pytest.raises(SystemExit, match="--feature-map, --nb-features would be ignored: --no-tail drops the linear "
                                         "tail"):
        convert_cli.main([str(tmp_path / "source"), str(tmp_path / "mapped"), "--window", "4", "--no-tail",
                          "--feature-map", "hedgehog", "--nb-features", "64"])
    assert not (tmp_path / "mapped").exists()
    old_spelling = tmp_path / "old_spelling"  # the deprecated spelling still works, with a warning
    assert convert_cli.main([str(tmp_path / "source"), str(old_spelling), "--window", "4", "--no-linear-tail"]) == 0
    assert json.loads((old_spelling / "config.json").read_text())["favor_settings"]["linear_tail"] is False


@pytest.mark.parametrize("flags, message", [
    (["--window", "-1"], "favor_settings['window'] must be an int >= 0"),
    (["--window", "4", "--softmax-weight", "learned"], "needs a learned feature map"),
    (["--softmax-weight", "learned"], "--softmax-weight would be ignored: they apply to window layers"),
    (["--layer-windows", "[1]"], "expected a JSON object"),
    (["--layer-windows", "{bad"], "expected a JSON object"),
])
def test_convert_refuses_bad_window_flags_in_one_line(tmp_path, capsys, flags, message):
    source = _source("gpt2")
    source.save_pretrained(tmp_path / "source")
    with pytest.raises(SystemExit) as exit_info:
        convert_cli.main([str(tmp_path / "source"), str(tmp_path / "out"), *flags])
    # argparse prints its usage error; the verb's own errors are the SystemExit message
    text = capsys.readouterr().err if exit_info.value.code == 2 else str(exit_info.value.code)
    error = [line for line in text.splitlines() if "error" in line]
    assert len(error) == 1 and message in error[0]
    assert not (tmp_path / "out").exists()


def test_distill_declares_the_window_flags():
    from hf_performer import cli

    args = cli.build_parser("distill").parse_args(["distill", "src", "out", "--data", "x.txt", "--window", "32",
                                                   "--sinks", "1", "--softmax-weight", "calibrated"])
    from hf_performer.cli.arguments import favor_settings_from_args
    from hf_performer.cli.distill import DISTILL_SETTINGS

    values = favor_settings_from_args(args, DISTILL_SETTINGS)
    assert (values["window"], values["sinks"], values["softmax_weight"]) == (32, 1, "calibrated")
    assert "linear_tail" not in values and "layer_windows" not in values


# ------------------------------------------------------------------------------------------------ folders


def test_push_validation_accepts_a_folder_with_gamma(tmp_path):
    from hf_performer.hub import validate_folder

    from transformers import BertTokenizerFast

    performer = convert_to_performer(_source("llama"), feature_map="hedgehog", window=3, sinks=1)
    performer.save_pretrained(tmp_path)
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat"]))
    BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    check = validate_folder(tmp_path)  # builds the model on meta and compares the safetensors headers
    text = repr(check)
    assert "favor_softmax_weight" not in text, text
    assert (tmp_path / "window_attention.py").is_file()


REMOTE_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    folder, output = sys.argv[1], sys.argv[2]
    inputs = torch.load(f"{output}/inputs.pt")
    assert "hf_performer" not in sys.modules
    clm = AutoModelForCausalLM.from_pretrained(f"{folder}/clm", trust_remote_code=True).eval()
    mlm = AutoModelForMaskedLM.from_pretrained(f"{folder}/mlm", trust_remote_code=True).eval()
    with torch.no_grad():
        results = {
            "clm": clm(input_ids=inputs["ids"], attention_mask=inputs["mask"]).logits,
            "mlm": mlm(input_ids=inputs["ids"], attention_mask=inputs["mask"]).logits,
            "generated": clm.generate(inputs["ids"][:1, :4], max_new_tokens=5, do_sample=False, use_cache=False),
        }
    assert "hf_performer" not in sys.modules
    torch.save(results, f"{output}/results.pt")
    """
)


@pytest.mark.slow  # ~20 s (a subprocess importing transformers); the fast variant: the push-validation test above
def test_window_layers_load_with_trust_remote_code_without_the_package(tmp_path, block_hf_performer_source):
    clm = convert_to_performer(_source("llama"), feature_map="hedgehog", window=3, sinks=1,
                               layer_windows={"1": {"window": 2}})
    with torch.no_grad():  # gamma away from its init: the remote copy must load it
        for module in _attention_modules(clm):
            getattr(module, SOFTMAX_WEIGHT_ATTRIBUTE).logit.add_(0.5)
    mlm = convert_to_performer(_source("bert"), feature_map="favor+", window=2, sinks=1)
    clm.save_pretrained(tmp_path / "models" / "clm")
    mlm.save_pretrained(tmp_path / "models" / "mlm")
    ids = _ids(length=9)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    torch.save({"ids": ids, "mask": mask}, tmp_path / "inputs.pt")
    (tmp_path / "blocker").mkdir()
    (tmp_path / "blocker" / "sitecustomize.py").write_text(block_hf_performer_source)
    (tmp_path / "remote.py").write_text(REMOTE_SCRIPT)
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "blocker"), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / "modules_cache"),
    }
    run = subprocess.run([sys.executable, str(tmp_path / "remote.py"), str(tmp_path / "models"), str(tmp_path)],
                         env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    remote = torch.load(tmp_path / "results.pt")
    with torch.no_grad():
        assert torch.equal(remote["clm"], clm(input_ids=ids, attention_mask=mask).logits)
        assert torch.equal(remote["mlm"], mlm(input_ids=ids, attention_mask=mask).logits)
        assert torch.equal(remote["generated"],
                           clm.generate(ids[:1, :4], max_new_tokens=5, do_sample=False, use_cache=False))


# ------------------------------------------------------------------------------------------------ precision


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_tiny_llama_runs_finite_and_close_to_float32(dtype):
    source = _source("llama")
    reference = convert_to_performer(source, feature_map="hedgehog", window=3, sinks=1)
    low = convert_to_performer(source.to(dtype), feature_map="hedgehog", window=3, sinks=1)
    gamma = [getattr(m, SOFTMAX_WEIGHT_ATTRIBUTE).logit for m in _attention_modules(low)]
    assert all(g.dtype == torch.float32 for g in gamma)  # float32 island, as the feature maps
    ids = _ids(length=20)
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0
    with torch.no_grad():
        got = low(input_ids=ids, attention_mask=mask).logits
        expected = reference(input_ids=ids, attention_mask=mask).logits
    assert got.dtype == dtype and bool(torch.isfinite(got).all())
    keep = mask.bool()
    assert (got.float()[keep] - expected[keep]).abs().max() < 0.1 * expected[keep].abs().max()
    low.train()
    low(input_ids=ids, labels=ids).loss.backward()  # backward through the float32 islands in low precision
    assert all(g.grad is not None and bool(torch.isfinite(g.grad).all()) for g in gamma)


# ------------------------------------------------------------------------------------------------ generation


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_generation_without_cache_and_with_the_default_cache_agree(name):
    performer = convert_to_performer(_source(name), feature_map="hedgehog", window=3, sinks=1)
    prompt = _ids(batch=1, length=4)
    no_cache = performer.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False)
    default_cache = performer.generate(prompt, max_new_tokens=8, do_sample=False)
    assert no_cache.shape == (1, 12)
    assert torch.equal(no_cache, default_cache)


def test_a_favor_cache_layer_on_a_window_layer_is_refused_in_one_line():
    performer = convert_to_performer(_source("llama"), window=3, sinks=1)
    ids = _ids(batch=1, length=5)
    cache = make_favor_cache(performer)
    assert all(isinstance(layer, WindowCacheLayer) for layer in cache.layers)
    performer(input_ids=ids, **cached(performer, cache), use_cache=True)  # the window layers' own cache layer works
    wrong = make_favor_cache(performer)
    wrong.layers[0] = FavorCacheLayer()
    with pytest.raises(LinearAttentionError, match="window layer with a FavorCacheLayer") as error:
        performer(input_ids=ids, **cached(performer, wrong), use_cache=True)
    assert "\n" not in str(error.value)
