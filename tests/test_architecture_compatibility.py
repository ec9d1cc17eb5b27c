"""The architecture mechanisms of the compatibility sweep (issue 35), one tiny random model each, configs built here.

Each architecture stands for a mechanism the converter must handle or refuse in one line before anything is written:
the cache under another argument name (GPT-NeoX's ``layer_past``, GPT-BigCode), partial rotary embeddings (GPT-NeoX,
Phi), fused QKV projections (GPT-NeoX, GPT-BigCode, Phi-3), parallel residual blocks (GPT-NeoX, Phi), sliding-window
layers (Gemma 2 with logit soft-capping, ModernBERT's bidirectional local layers; Mistral with every layer sliding is
refused), multi-head latent attention (DeepSeek V3), an architecture that builds its own cache (MiniMax), an
encoder-decoder family (BART: its decoder-only causal LM converts, the seq2seq heads are refused), an architecture
whose attention goes through the registry without the class flag saying so (BioGPT), older additive masks (MarkupLM),
masks with biases on the scores (Doge) and an attention module that a recurrent cache cannot follow (DiffLlama),
multimodal wrappers, the source's RoPE scaling, and learned position tables extended with their causal-mask buffers
(GPT-BigCode) or their own embedding class (Blenderbot). The full sweep over every architecture is
``benchmarks/scripts/compatibility_sweep.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers.utils import logging

from hf_performer import PerformerConfig
from hf_performer.cache import is_favor_cache_layer
from hf_performer.configuration_performer import PerformerConfigError, check_source_architecture
from hf_performer.conversion import ConversionError, convert_to_performer
from hf_performer.cli import convert as convert_cli

REPO = Path(__file__).resolve().parents[1]

logging.set_verbosity_error()

VOCAB = 97
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.2)


def tiny(config_name: str, model_name: str, **overrides):
    """A tiny random ``transformers.<model_name>`` from ``transformers.<config_name>(**SMALL, **overrides)``."""
    config = getattr(transformers, config_name)(**{**SMALL, **overrides})
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).eval()


CAUSAL_SOURCES = {
    # layer_past, rotary on a quarter of the head, fused query_key_value, parallel residual
    "gpt_neox": lambda: tiny("GPTNeoXConfig", "GPTNeoXForCausalLM", rotary_pct=0.25, use_parallel_residual=True),
    # fused c_attn with one key/value head (multi-query), layer_past
    "gpt_bigcode": lambda: tiny("GPTBigCodeConfig", "GPTBigCodeForCausalLM", multi_query=True, n_positions=64),
    # rotary on half the head, attention and MLP in parallel
    "phi": lambda: tiny("PhiConfig", "PhiForCausalLM", partial_rotary_factor=0.5),
    # fused qkv_proj and gate_up_proj
    "phi3": lambda: tiny("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=2),
    # sliding-window and full layers alternating, attention logit soft-capping
    "gemma2": lambda: tiny("Gemma2Config", "Gemma2ForCausalLM", num_hidden_layers=4, num_key_value_heads=2,
                           head_dim=8, sliding_window=3, layer_types=["sliding_attention", "full_attention"] * 2),
    # multi-head latent attention: queries / keys of qk_head_dim = nope + rope, values of another size
    "deepseek_v3": lambda: tiny("DeepseekV3Config", "DeepseekV3ForCausalLM", num_key_value_heads=4, kv_lora_rank=16,
                                q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                                n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                moe_intermediate_size=16, first_k_dense_replace=1),
    # builds its own cache (MiniMaxCache) in its forward; lightning (linear) and softmax layers alternate
    "minimax": lambda: tiny("MiniMaxConfig", "MiniMaxForCausalLM", num_key_value_heads=2, head_dim=8, intermediate_size=32,
                            num_local_experts=2, num_experts_per_tok=1,
                            layer_types=["linear_attention", "full_attention"]),
    # the decoder of an encoder-decoder family: self-attention (and unused cross-attention), no position_ids
    "bart_decoder": lambda: tiny("BartConfig", "BartForCausalLM", d_model=32, decoder_layers=2, encoder_layers=2,
                                 decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=37,
                                 encoder_ffn_dim=37, max_position_embeddings=64, forced_eos_token_id=None),
    # dispatches through ALL_ATTENTION_FUNCTIONS without _supports_attention_backend
    "biogpt": lambda: tiny("BioGptConfig", "BioGptForCausalLM", max_position_embeddings=64),
}


def _padded_batch(left: bool):
    """Two rows of 7 tokens, the second padded by 2 (on the left for decoders, on the right for encoders)."""
    input_ids = (torch.arange(14).view(2, 7) * 7).remainder(VOCAB - 3) + 3
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, slice(0, 2) if left else slice(5, 7)] = 0
    return input_ids, attention_mask


def _greedy(model, input_ids, attention_mask, **kwargs):
    return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, min_new_tokens=5,
                          do_sample=False, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("name", list(CAUSAL_SOURCES))
def test_causal_architecture_converts_runs_and_generates(name):
    source = CAUSAL_SOURCES[name]()
    performer = convert_to_performer(source, nb_features=16)
    input_ids, attention_mask = _padded_batch(left=True)
    with torch.no_grad():
        batched = performer(input_ids=input_ids, attention_mask=attention_mask).logits
        alone = performer(input_ids=input_ids[1:, 2:]).logits
    assert torch.isfinite(batched).all()
    if name != "bart_decoder":  # BART counts positions over padding too (as its softmax source does)
        torch.testing.assert_close(batched[1:, 2:], alone, atol=1e-4, rtol=1e-4)
    cached = _greedy(performer, input_ids, attention_mask)
    uncached = _greedy(performer, input_ids, attention_mask, use_cache=False)
    assert torch.equal(cached, uncached)
    # The cache reached the attention function: favor layers hold a recurrent state, whatever the argument name.
    output = performer(input_ids=input_ids, attention_mask=attention_mask, use_cache=True)
    cache = getattr(output, "cache", None) or output.past_key_values
    favor_layers = [layer for layer in getattr(cache, "layers", []) if is_favor_cache_layer(layer)]
    assert favor_layers and all(layer.state is not None for layer in favor_layers)
    if name != "minimax":  # its own cache cannot be cropped (transformers refuses assisted decoding for it)
        single = input_ids[1:, 2:]
        assert torch.equal(_greedy(performer, single, None, assistant_model=source), _greedy(performer, single, None))


def test_sliding_window_layers_keep_exact_softmax_with_soft_capping():
    # Gemma 2's sliding layers stay softmax with their window (and its eager soft-capping); with its full layers kept
    # on softmax too, the converted model is the source exactly, padding and cached decoding included.
    source = CAUSAL_SOURCES["gemma2"]()
    performer = convert_to_performer(source, nb_features=16)
    assert performer.config.favor_settings["softmax_layers"] == [0, 2]
    exact = convert_to_performer(source, keep_softmax_layers=[1, 3])
    input_ids, attention_mask = _padded_batch(left=True)
    with torch.no_grad():
        torch.testing.assert_close(exact(input_ids=input_ids, attention_mask=attention_mask).logits,
                                   source(input_ids=input_ids, attention_mask=attention_mask).logits)
    assert torch.equal(_greedy(exact, input_ids, attention_mask), _greedy(source, input_ids, attention_mask))


def test_bidirectional_sliding_layers_and_clustered_attention():
    source = tiny("ModernBertConfig", "ModernBertForMaskedLM", num_hidden_layers=2, global_attn_every_n_layers=2,
                  local_attention=4, max_position_embeddings=64, cls_token_id=1, sep_token_id=2)
    input_ids, attention_mask = _padded_batch(left=False)
    exact = convert_to_performer(source, keep_softmax_layers=[0])
    assert exact.config.favor_settings["softmax_layers"] == [0, 1]  # layer 1 is a local (sliding) layer
    with torch.no_grad():
        torch.testing.assert_close(exact(input_ids=input_ids, attention_mask=attention_mask).logits,
                                   source(input_ids=input_ids, attention_mask=attention_mask).logits)
    for settings in ({"nb_features": 16}, {"attention": "clustered", "clusters": 2, "topk": 3}):
        performer = convert_to_performer(source, **settings)
        with torch.no_grad():
            batched = performer(input_ids=input_ids, attention_mask=attention_mask).logits
            alone = performer(input_ids=input_ids[1:, :5]).logits
        torch.testing.assert_close(batched[1:, :5], alone, atol=1e-4, rtol=1e-4)


def test_older_additive_masks_are_padding_masks():
    # MarkupLM builds its own (1 - mask) * -10000 mask: the favor layers read it as key padding.
    source = tiny("MarkupLMConfig", "MarkupLMForSequenceClassification", max_position_embeddings=64)
    performer = convert_to_performer(source, nb_features=16)
    input_ids, attention_mask = _padded_batch(left=False)
    with torch.no_grad():
        batched = performer(input_ids=input_ids, attention_mask=attention_mask).logits
        alone = performer(input_ids=input_ids[1:, :5]).logits
    torch.testing.assert_close(batched[1:], alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: tiny("MistralConfig", "MistralForCausalLM", num_key_value_heads=2, sliding_window=16),
         "every layer of source architecture 'mistral' attends over a sliding window of 16 tokens.*sliding_window=None"),
        (lambda: tiny("DogeConfig", "DogeForCausalLM", num_key_value_heads=2),
         "'doge' cannot be converted: its attention adds a learned, input-dependent bias to the attention scores"),
        (lambda: tiny("DiffLlamaConfig", "DiffLlamaForCausalLM", num_key_value_heads=2),
         "diffllama cannot be converted: cached decoding of the converted model does not reproduce its full forward"),
        (lambda: tiny("BartConfig", "BartForConditionalGeneration", d_model=32, decoder_layers=1, encoder_layers=1,
                      decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=37, encoder_ffn_dim=37,
                      forced_eos_token_id=None),
         "'bart' is an encoder-decoder model"),
    ],
    ids=["all-sliding", "score-bias-mask", "attention-called-twice", "encoder-decoder"],
)
def test_architectures_that_cannot_be_honoured_are_refused_before_writing(build, message, tmp_path):
    source = build()
    with pytest.raises(ConversionError, match=message) as error:
        convert_to_performer(source, nb_features=16)
    assert "\n" not in str(error.value)
    source.save_pretrained(tmp_path / "source")
    with pytest.raises(SystemExit, match=message):
        convert_cli.main([str(tmp_path / "source"), str(tmp_path / "out"), "--nb-features", "16"])
    assert sorted(os.listdir(tmp_path)) == ["source"]


def test_mistral_without_its_window_converts():
    performer = convert_to_performer(tiny("MistralConfig", "MistralForCausalLM", num_key_value_heads=2,
                                          sliding_window=None), nb_features=16)
    assert performer.config.favor_settings["softmax_layers"] == []


def test_multimodal_wrappers_are_refused_and_their_text_model_accepted():
    text = transformers.Gemma3TextConfig(**{**SMALL, "num_key_value_heads": 2, "head_dim": 8,
                                            "layer_types": ["sliding_attention", "full_attention"]})
    wrapper = transformers.Gemma3Config(text_config=text.to_dict(), vision_config={"hidden_size": 16,
                                        "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16})
    with pytest.raises(PerformerConfigError, match="'gemma3' is a multimodal model \\(.*vision_config"):
        check_source_architecture(wrapper)
    check_source_architecture(wrapper.get_text_config())
    git = transformers.GitConfig(vision_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2})
    with pytest.raises(PerformerConfigError, match="multimodal"):
        check_source_architecture(git)


def test_rope_scaling_survives_conversion_and_reload(tmp_path, block_hf_performer_source):
    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 32}
    source = tiny("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, max_position_embeddings=128,
                  rope_parameters=rope)
    scaled = tiny("GPTNeoXConfig", "GPTNeoXForCausalLM", rotary_pct=0.25,
                  rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    folders = {}
    for name, model in (("llama", source), ("gpt_neox", scaled)):
        performer = convert_to_performer(model, nb_features=16)
        assert performer.config.source_config.rope_parameters == model.config.rope_parameters
        rotary = [module for module in performer.modules() if hasattr(module, "inv_freq")]
        source_rotary = [module for module in model.modules() if hasattr(module, "inv_freq")]
        assert torch.equal(rotary[0].inv_freq, source_rotary[0].inv_freq)
        assert rotary[0].attention_scaling == source_rotary[0].attention_scaling
        performer.save_pretrained(tmp_path / name)
        input_ids, attention_mask = _padded_batch(left=True)
        torch.save({"input_ids": input_ids, "attention_mask": attention_mask}, tmp_path / "inputs.pt")
        with torch.no_grad():
            torch.save(performer(input_ids=input_ids, attention_mask=attention_mask).logits, tmp_path / f"{name}.pt")
        folders[name] = str(tmp_path / name)
    # Reloaded where hf_performer cannot be imported: the same scaling, the same logits.
    script = block_hf_performer_source + (
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "inputs = torch.load(sys.argv[1])\n"
        "for name, folder in json.loads(sys.argv[2]).items():\n"
        "    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()\n"
        "    with torch.no_grad():\n"
        "        logits = model(**inputs).logits\n"
        "    expected = torch.load(folder + '.pt')\n"
        "    assert torch.allclose(logits, expected, atol=1e-5), name\n"
        "    print(name, json.dumps(model.config.source_config.rope_parameters, sort_keys=True))\n"
        "assert 'hf_performer' not in sys.modules\n"
    )
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "inputs.pt"), json.dumps(folders)],
                         env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert '"rope_type": "yarn"' in run.stdout and '"factor": 4.0' in run.stdout
    assert '"rope_type": "linear"' in run.stdout


def test_performer_config_requires_bounded_layers_on_softmax():
    source = CAUSAL_SOURCES["gemma2"]().config
    with pytest.raises(PerformerConfigError, match="layers \\[0, 2\\] of 'gemma2' attend over a sliding window"):
        PerformerConfig(source_config=source)
    assert PerformerConfig(source_config=source, softmax_layers=[0, 2]).favor_settings["softmax_layers"] == [0, 2]


def test_position_tables_are_extended_with_their_class_and_buffers():
    # GPT-BigCode keeps a causal-mask buffer with one row per position beside its table (rebuilt for the new length);
    # Blenderbot's table subclasses nn.Embedding with a forward of its own (kept: the table is resized in place).
    bigcode = CAUSAL_SOURCES["gpt_bigcode"]()
    blenderbot = tiny("BlenderbotConfig", "BlenderbotForCausalLM", d_model=32, decoder_layers=2, encoder_layers=1,
                      decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=37, encoder_ffn_dim=37,
                      max_position_embeddings=32, forced_eos_token_id=None)
    for source, table_of, length in ((bigcode, lambda model: model.transformer.wpe, 100),
                                     (blenderbot, lambda model: model.model.decoder.embed_positions, 48)):
        performer = convert_to_performer(source, nb_features=16, max_position_embeddings=length)
        table = table_of(performer.source_model)
        assert type(table) is type(table_of(source)) and table.num_embeddings == length
        with torch.no_grad():
            logits = performer(input_ids=torch.arange(length - 2)[None].remainder(VOCAB - 3) + 3).logits
        assert torch.isfinite(logits).all()
    extended = convert_to_performer(bigcode, nb_features=16, max_position_embeddings=100)
    assert torch.equal(extended.source_model.transformer.bias, torch.ones(100, 100, dtype=torch.bool).tril())


@pytest.mark.parametrize("model_type", ["dbrx", "lfm2_moe", "longcat_flash", "cohere_compass_text", "blt"])
def test_the_tester_values_give_the_sweep_a_tiny_source_that_runs(model_type):
    """benchmarks/scripts/tiny_source_models.py: the values read from transformers' own testers (TESTER_VALUES) make
    architectures whose shrunk defaults cannot run build and run alone."""
    from conftest import benchmark_script

    from hf_performer.favor_attention import is_attention_module

    tiny_sources = benchmark_script("tiny_source_models")
    if model_type not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    source = tiny_sources.tiny_source_model(model_type, "causal-lm", is_attention_module)
    assert tiny_sources.own_run_error(source) is None


def test_the_sweep_tells_a_refusal_by_mechanism_from_a_plain_error():
    """A refusal whose reason is a plain Python error raised inside the converted model is counted apart, and the
    share the issue targets counts only working architectures and refusals that name their mechanism."""
    from conftest import benchmark_script

    sweep = benchmark_script("compatibility_sweep")

    def entry(status, reason=None):
        variant = {"status": status, **({"reason": reason} if reason else {})}
        return {"multimodal": False, "status": status, "heads": {"causal-lm": {"variants": {"favor+": variant}}}}

    architectures = {
        "a": entry("works"), "b": entry("refused", "b cannot be converted: it has indexed_attention layers"),
        "c": entry("refused", "c cannot be converted: the converted model cannot run: IndexError: too many indices"),
        "d": entry("works"),
    }
    summary = sweep.totals(architectures)
    assert summary["refused_without_mechanism"] == ["c"] and summary["working_or_refused_by_mechanism_share"] == 0.75
    committed = json.loads((REPO / "benchmarks" / "results" / "compatibility.json").read_text())["totals"]
    assert committed["refused_without_mechanism"] == [] and committed["working_or_refused_by_mechanism_share"] >= 0.9
