"""Model cards and Hub upload (``hf_performer.hub``, ``hf-performer card`` / ``hf-performer push``).

Everything runs offline. The card is parsed back with huggingface_hub's own parsers (``metadata_load``,
``ModelCard``, ``model-index`` round trip). The upload is tested end to end against :class:`FakeHub`, a
small threaded HTTP server on 127.0.0.1 that implements the part of the Hub API ``HfApi.create_repo``,
``create_branch`` and ``upload_folder`` use (repo creation, README metadata validation, preupload, NDJSON
commit with inline base64 files, branch creation), checks the token, records every request, and stops by
itself (request cap, lifetime timer, socket timeouts).
"""

import base64
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from huggingface_hub import EvalResult, ModelCard, constants, metadata_load
from huggingface_hub.repocard_data import eval_results_to_model_index, model_index_to_eval_results
from transformers import BertForSequenceClassification
from transformers.utils import logging

from hf_performer import PerformerConfig, PerformerForSequenceClassification, hub
from hf_performer.cli import main as cli_main
from hf_performer.conversion import REPORT_FILE_NAME
from hf_performer.cli import convert as convert_cli
from hf_performer.hub import (
    CARD_TAGS,
    FolderValidationError,
    ModelCardError,
    PushError,
    build_model_card,
    load_metrics,
    push_folder,
    upload_file_list,
    validate_folder,
    write_model_card,
)
from hf_performer.hub.folder import TOKENIZER_FILES
from conftest import tiny_bert_config, word_piece_tokenizer

logging.set_verbosity_error()

TOKEN = "hf_fake_token_for_tests_0123456789"
REPO_ID = "tester/tiny-performer"
VOCAB_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"the quick brown fox jumps over a lazy dog".split(),
                *"abcdefghijklmnopqrstuvwxyz.,"]
CODE_FILES = sorted(["attention_weights.py", "cache.py", "clustered_attention.py", "configuration_performer.py",
                     "decayed_attention.py", "favor_attention.py", "favor_cache_hooks.py", "favor_cache_layer.py",
                     "favor_layer_modules.py", "favor_masks.py", "favor_modules.py", "favor_schema.py",
                     "favor_settings.py", "feature_map_base.py", "feature_maps.py", "feature_maps_learned.py",
                     "linear_attention.py", "linear_attention_autograd.py", "linear_attention_chunks.py",
                     "linear_attention_parallel.py", "modeling_performer.py", "modeling_performer_base.py",
                     "packed_sequences.py", "source_architectures.py", "window_attention.py",
                     "window_bidirectional.py", "window_block_operands.py", "window_blocks.py", "window_boundaries.py",
                     "window_cache_layer.py", "window_causal.py", "window_decode.py", "window_exact_blocks.py",
                     "window_parallel.py", "window_segments.py", "window_selection_kernel.py",
                     "window_sparse_cache.py", "window_state.py", "window_tail.py", "window_tail_cap.py"])


# --------------------------------------------------------------------------------------------
# A converted folder (tiny BERT, converted with the real `convert` command)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny BERT sequence classifier converted by ``hf-performer convert`` (which writes the card)."""
    root = tmp_path_factory.mktemp("hub")
    source = root / "source"
    config = tiny_bert_config(vocab_size=len(VOCAB_TOKENS), max_position_embeddings=64)
    BertForSequenceClassification(config).save_pretrained(source)
    word_piece_tokenizer(root, VOCAB_TOKENS, save_to=source)
    output = root / "tiny-performer"
    assert convert_cli.main([str(source), str(output), "--nb-features", "16", "--task", "sequence-classification",
                             "--text", "the quick brown fox", "--text", "a lazy dog", "--keep-position-table"]) == 0
    return output


@pytest.fixture
def folder(converted, tmp_path):
    """A private copy of the converted folder (tests may break it)."""
    copy = tmp_path / "tiny-performer"
    shutil.copytree(converted, copy)
    return copy


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------------------------
# Model card
# --------------------------------------------------------------------------------------------


def test_convert_writes_a_valid_card(converted):
    card_path = converted / "README.md"
    assert card_path.is_file()
    metadata = metadata_load(card_path)  # huggingface_hub's own YAML front-matter reader
    assert metadata["library_name"] == "transformers"
    assert metadata["pipeline_tag"] == "text-classification"
    assert set(CARD_TAGS) | {"bert"} <= set(metadata["tags"])
    assert "base_model" not in metadata  # the source was a local folder: never written as base_model
    assert "model-index" not in metadata  # no results yet
    card = ModelCard.load(card_path)
    assert card.data.library_name == "transformers"

    text = card.text
    # How to load.
    assert "AutoModelForSequenceClassification.from_pretrained" in text and "trust_remote_code=True" in text
    for code_file in CODE_FILES:
        assert f"`{code_file}`" in text
    # Conversion settings, from config.json.
    settings = json.loads((converted / "config.json").read_text())["favor_settings"]
    assert settings["nb_features"] == 16
    assert "| `nb_features` | 16 |" in text and "| `feature_map` | `favor+` |" in text
    assert "| `softmax_layers` | none |" in text and "| `seed` | 0 |" in text
    # Fidelity table, from conversion_report.json (every layer, same numbers).
    report = json.loads((converted / REPORT_FILE_NAME).read_text())
    assert len(report["layers"]) == 2
    for layer in report["layers"]:
        row = (f"| {layer['layer']} | linear | {layer['own_inputs_relative_error']:.4f} | "
               f"{layer['propagated_relative_error']:.4f} |")
        assert row in text
    assert f"mean cosine similarity {report['final_hidden_state_cosine']:.4f}" in text
    assert f"prediction agreement {100 * report['prediction_agreement']:.1f}%" in text
    assert "2 user texts" in text and str(converted.parent) not in text  # no local path leaks into the card
    # Honest speed notes.
    assert "Converted, not fine-tuned" in text
    assert "At this model's maximum length of 64 tokens FAVOR+ is **not faster**" in text
    assert "797 tokens bidirectional" in text and "2369 tokens causal" in text
    assert "| 512 | 0.61x | 0.56x |" in text and "| 8192 | 9.96x | 2.80x |" in text
    assert "**Memory is O(L)**" in text and "not a causal language model" in text


def test_card_with_results_round_trips_through_huggingface_hub(folder, tmp_path):
    results = [
        {"task": "sst2", "metric": "accuracy", "value": 0.8853, "split": "validation", "metric_name": "Dev accuracy"},
        {"task": "text-classification", "dataset": "stanfordnlp/imdb", "dataset_name": "IMDB", "split": "test",
         "metric": "accuracy", "value": 0.871},
    ]
    recovery = [
        {"setting": "(a) softmax fine-tuned", "task": "sst2", "dataset": "glue", "metric": "accuracy",
         "value": 0.9014, "steps": 2000},
        {"variant": "(b) converted, no training", "task": "sst2", "dataset": "glue", "metric": "accuracy",
         "value": 0.5092, "steps": 0, "notes": "the collapse"},
    ]
    card = build_model_card(folder, base_model="sentence-transformers/all-MiniLM-L6-v2", results=results,
                            recovery=recovery, repo_id=REPO_ID, license="apache-2.0", fine_tuned=True)
    path = tmp_path / "README.md"
    card.save(path)

    metadata = metadata_load(path)
    assert metadata["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert metadata["datasets"] == ["nyu-mll/glue", "stanfordnlp/imdb"]
    assert metadata["license"] == "apache-2.0"
    model_index = metadata["model-index"]
    name, eval_results = model_index_to_eval_results(model_index)
    assert name == "tiny-performer"
    assert eval_results_to_model_index(name, eval_results) == model_index  # round trip
    assert eval_results == [
        EvalResult(task_type="text-classification", task_name="SST-2", dataset_type="nyu-mll/glue",
                   dataset_name="nyu-mll/glue (sst2)", dataset_config="sst2", dataset_split="validation",
                   metric_type="accuracy", metric_name="Dev accuracy", metric_value=0.8853),
        EvalResult(task_type="text-classification", dataset_type="stanfordnlp/imdb", dataset_name="IMDB",
                   dataset_split="test", metric_type="accuracy", metric_value=0.871),
    ]
    loaded = ModelCard.load(path)
    assert loaded.data.eval_results == eval_results and loaded.data.model_name == "tiny-performer"

    text = loaded.text
    assert "Converted, not fine-tuned" not in text and "then fine-tuned" in text
    assert f'from_pretrained("{REPO_ID}", trust_remote_code=True)' in text
    assert "| SST-2 | nyu-mll/glue (sst2) | validation | Dev accuracy | 0.8853 |" in text
    assert "| (a) softmax fine-tuned | sst2 | glue | accuracy | 0.9014 | 2000 |  |" in text
    assert "| (b) converted, no training | sst2 | glue | accuracy | 0.5092 | 0 | the collapse |" in text
    assert "[sentence-transformers/all-MiniLM-L6-v2](https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2)" in text


def test_causal_card_describes_constant_memory_decoding(folder):
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["PerformerForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    card = build_model_card(folder)
    assert card.data.pipeline_tag == "text-generation"
    text = card.text
    assert "AutoModelForCausalLM" in text and "model.generate(" in text
    # 2 layers x 2 heads x (m*d + m + 1) float32 with m=16, d=16: 2*2*273*4 bytes.
    assert "**Decoding.** Per sequence, the 2 linear-attention layers keep a recurrent state" in text
    assert "4.3 KiB in all (float32), whatever the context length" in text
    assert "decoding memory does not grow with the context" in text
    assert "| decoding cache (`generate`) | `FavorCacheLayer`, constant size |" in text
    assert "| prompt lookup / assisted decoding | supported (rejected candidates are rolled back" in text
    assert "(measured causal crossover: ~2369 tokens)" in text


def test_card_rejects_bad_input(folder):
    with pytest.raises(ModelCardError, match="unknown key 'acc'"):
        build_model_card(folder, results=[{"task": "sst2", "metric": "accuracy", "acc": 0.9}])
    with pytest.raises(ModelCardError, match="metric_value is required"):
        build_model_card(folder, results=[{"task": "sst2", "metric": "accuracy"}])
    with pytest.raises(ModelCardError, match="not finite"):
        build_model_card(folder, results=[{"task": "sst2", "metric": "accuracy", "value": float("nan")}])
    with pytest.raises(ModelCardError, match="dataset_type is required"):
        build_model_card(folder, results=[{"task": "text-classification", "metric": "accuracy", "value": 0.5}])
    with pytest.raises(ModelCardError, match="missing value"):
        build_model_card(folder, recovery=[{"setting": "a", "task": "sst2", "dataset": "glue", "metric": "acc"}])
    with pytest.raises(ModelCardError, match="not a Hub model id"):
        build_model_card(folder, base_model="/home/me/models/bert")
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(ModelCardError, match="no favor_settings: not a Performer model folder"):
        build_model_card(folder)


# --------------------------------------------------------------------------------------------
# Cards of other feature maps (learned, deterministic) and of distilled folders (attention transfer)
# --------------------------------------------------------------------------------------------

HEDGEHOG_INTRO = "instead of softmax\n([Zhang et al., 2024](https://arxiv.org/abs/2402.04347))."
FAVOR_INTRO = "instead of softmax\n([Choromanski et al., 2021](https://arxiv.org/abs/2009.14794))."


def performer_folder(path: Path, feature_map: str, **settings) -> Path:
    """A tiny (untrained) Performer sequence classifier saved with ``save_pretrained``: 2 layers, 2 heads of dim 16."""
    source = tiny_bert_config(vocab_size=len(VOCAB_TOKENS), max_position_embeddings=64)
    config = PerformerConfig(source_config=source, feature_map=feature_map, **settings)
    PerformerForSequenceClassification(config).save_pretrained(path)
    return path


@pytest.fixture
def hedgehog(tmp_path):
    return performer_folder(tmp_path / "tiny-hedgehog", "hedgehog")


def fake_transfer_record(feature_map: str = "hedgehog") -> dict:
    """An ``attention_transfer.json`` of ``hf-performer distill`` with made-up, recognisable numbers."""
    def fidelity(errors, cosine, logits):
        return {"source": "/home/someone/models/bert-sst2", "source_class": "BertForSequenceClassification",
                "performer_class": "PerformerForSequenceClassification", "favor_settings": {"feature_map": feature_map},
                "inputs": "4 user texts", "num_sequences": 4, "num_tokens": 37,
                "layers": [{"layer": i, "attention": "favor", "own_inputs_relative_error": e,
                            "propagated_relative_error": e + 0.01 * i} for i, e in enumerate(errors)],
                "final_hidden_state_cosine": cosine, "prediction_agreement": None, "logits_kl": None,
                "logits_relative_error": logits}
    return {
        "source": "/home/someone/models/bert-sst2",
        "feature_map": feature_map,
        "favor_settings": {"feature_map": feature_map, "nb_features": None, "seed": 0, "chunk_size": 128,
                           "softmax_layers": [], "feature_map_options": {}},
        "data": {"file": "/home/someone/data/glue/SST-2/train.tsv", "layout": "sst2", "sequences": 24,
                 "max_length": 12, "batch_size": 4, "seed": 0, "fidelity_sequences": 4},
        "transfer": {"steps": 6, "loss": "both", "learning_rate": 0.02, "layers": [0, 1],
                     "history": [{"step": k + 1, "loss_per_layer": 1.0 / (k + 1)} for k in range(6)],
                     "layer_losses_before": {"0": {"weights_kl": 0.61, "output_squared_error": 0.02, "rows": 96},
                                             "1": {"weights_kl": 1.1855, "output_squared_error": 0.06, "rows": 96}},
                     "layer_losses_after": {"0": {"weights_kl": 0.051, "output_squared_error": 0.003, "rows": 96},
                                            "1": {"weights_kl": 0.0739, "output_squared_error": 0.007, "rows": 96}}},
        "fidelity_before": fidelity([0.8123, 0.9056], 0.7565, 0.5473),
        "fidelity_after": fidelity([0.2345, 0.3646], 0.9252, 0.5263),
        "wall_time_s": 75.5,
        "command": "hf-performer distill /home/someone/models/bert-sst2 /home/someone/out --feature-map hedgehog",
    }


def transfer_rows(record: dict) -> list[str]:
    """The per-layer rows the card's Attention transfer table must show, computed from the record."""
    rows = []
    before = {entry["layer"]: entry for entry in record["fidelity_before"]["layers"]}
    for entry in record["fidelity_after"]["layers"]:
        layer = entry["layer"]
        kl_before = record["transfer"]["layer_losses_before"].get(str(layer), {}).get("weights_kl")
        kl_after = record["transfer"]["layer_losses_after"].get(str(layer), {}).get("weights_kl")
        rows.append(f"| {layer} | {entry['attention']} | {before[layer]['own_inputs_relative_error']:.4f} | "
                    f"{entry['own_inputs_relative_error']:.4f} | "
                    f"{'–' if kl_before is None else f'{kl_before:.4f}'} | {'–' if kl_after is None else f'{kl_after:.4f}'} |")
    return rows


def test_favor_card_keeps_its_favor_wording(converted):
    """A FAVOR+ card (from `hf-performer convert`) keeps its FAVOR+ citation, meanings, warning and fidelity notes."""
    text = (converted / "README.md").read_text()
    metadata = metadata_load(converted / "README.md")
    assert "favor+" in metadata["tags"] and "attention-transfer" not in metadata["tags"]
    assert FAVOR_INTRO in text and "hf-performer (`hf-performer convert`)." in text
    assert "Zhang et al." not in text and "zhang2024hedgehog" not in text and "@inproceedings{choromanski2021rethinking" in text
    assert "| `nb_features` | 16 | random features per head (`m`) |" in text
    assert "| `seed` | 0 | seed of the projections (layer i uses seed + i) |" in text
    assert ("| `feature_map_options` | none | the map's own options (e.g. `feature_epsilon` of `relu`; none: its "
            "defaults) |") in text
    assert "Converted, not fine-tuned" in text and "The Performer paper reports 0.07" in text
    assert "## Fidelity right after conversion" in text and "the FAVOR+ estimator's variance is large there" in text
    assert "## Attention transfer" not in text and "hf-performer distill" not in text
    assert "## Speed and memory: where this attention is faster, and where it is not" in text
    assert "- **Sink + window layers**" not in text and "- **Clustered attention**" not in text


def test_hedgehog_card_without_attention_transfer(hedgehog):
    card = build_model_card(hedgehog)
    metadata = hub.validate_model_card(str(card))
    assert "hedgehog" in metadata["tags"] and "favor+" not in metadata["tags"]
    assert "attention-transfer" not in metadata["tags"]
    text = card.text
    assert HEDGEHOG_INTRO in text and "Choromanski et al., 2021](" not in text
    assert "@inproceedings{zhang2024hedgehog" in text and "@inproceedings{choromanski2021rethinking" in text
    assert "hf-performer (`hf-performer convert`)." in text and "## Attention transfer" not in text
    # Settings: meanings of a learned map (no random projection); nb_features None = the map's default 2 x d.
    assert ("| `feature_map` | `hedgehog` | learned feature map (`hedgehog`: [softmax(z), softmax(-z)] with "
            "z = x W + b, W and b trainable per head) |") in text
    assert ("| `nb_features` | None | features per head (`m`), computed from a trainable projection per head; "
            "`None`: the map's default size, 2 x head dim = 32 |") in text
    assert ("| `seed` | 0 | seed of the `favor+` initialisation of the learned projections (layer i uses seed + i) |"
            in text)  # favor+ is the default init, so the seed is used
    assert "| `feature_map_options` | none | the map's own options: `init` (start of the learned projections" in text
    assert "random features per head" not in text and "seed of the projections" not in text
    assert "| `orthogonal` |" not in text and "| `row_norms` |" not in text
    # Untrained learned maps: a warning that says so (an encoder: distill, then fine-tune), not the FAVOR+ one.
    assert "**Converted, not trained.**" in text and "(initialisation `favor+`)" in text
    assert "train them by attention transfer (`hf-performer distill`)" in text and "hf-performer linearize SOURCE" \
        not in text
    assert "The Performer paper reports 0.07" not in text and "FAVOR+ estimator" not in text
    assert "## Fidelity right after conversion" in text and "This folder has no `conversion_report.json`" in text
    # Speed notes use the map's real size (2 x 16 features), and say the timings are of FAVOR+.
    assert "With `m = 32` features and head dimension `d = 16`" in text and "These timings are of FAVOR+" in text


@pytest.mark.parametrize(
    "feature_map, settings, intro, rows",
    [
        ("t2r", {"nb_features": 8},
         "([Kasai et al., 2021](https://arxiv.org/abs/2103.13076)).",
         ["| `nb_features` | 8 | features per head (`m`), computed from a trainable projection per head |",
          "| `seed` | 0 | seed of the `favor+` initialisation of the learned projections (layer i uses seed + i) |"]),
        ("hedgehog", {"nb_features": 32, "feature_map_options": {"init": "favor+", "tie_qk": True}},
         "([Zhang et al., 2024](https://arxiv.org/abs/2402.04347)).",
         ["| `feature_map_options` | `init`: `favor+`, `tie_qk`: yes | the map's own options: `init`",
          "| `seed` | 0 | seed of the `favor+` initialisation of the learned projections (layer i uses seed + i) |"]),
        ("hedgehog", {"feature_map_options": {"init": "identity"}},
         "([Zhang et al., 2024](https://arxiv.org/abs/2402.04347)).",
         ["| `seed` | 0 | seed of the `favor+` initialisation of the learned projections (layer i uses seed + i); "
          "unused here (`init` is `identity`) |", "(initialisation `identity`)"]),
        ("elu+1", {},
         "([Katharopoulos et al., 2020](https://arxiv.org/abs/2006.16236)).",
         ["| `feature_map` | `elu+1` | deterministic feature map, nothing random or trained (`elu+1`: elu(x) + 1, "
          "a different kernel, not an estimator of softmax) |",
          "| `feature_map_options` | none | the map's own options (none: its defaults) |"]),
        ("trig", {"nb_features": 16},
         "([Choromanski et al., 2021](https://arxiv.org/abs/2009.14794)).",
         ["| `feature_map` | `trig` | feature map (`trig`: random Fourier features, unbiased for softmax but not "
          "positive) |",
          "| `seed` | 0 | seed of the projections (layer i uses seed + i) |"]),
    ],
)
def test_every_map_kind_cites_its_paper_and_explains_its_settings(tmp_path, feature_map, settings, intro, rows):
    folder = performer_folder(tmp_path / "tiny", feature_map, **settings)
    card = build_model_card(folder)
    assert feature_map in hub.validate_model_card(str(card))["tags"]
    text = card.text
    assert f"instead of softmax\n{intro}" in text
    for row in rows:
        assert row in text
    warning = "**Converted, not trained.**" if feature_map in ("t2r", "hedgehog") else "**Converted, not fine-tuned.**"
    assert "The Performer paper reports 0.07" not in text and warning in text
    if feature_map == "t2r":
        assert "unused here" not in text and "(initialisation `favor+`)" in text


def test_hedgehog_card_with_attention_transfer(hedgehog, tmp_path):
    record = fake_transfer_record()
    (hedgehog / "attention_transfer.json").write_text(json.dumps(record))
    card = build_model_card(hedgehog, model_name="tiny-hedgehog")
    metadata = hub.validate_model_card(str(card))
    assert {"hedgehog", "attention-transfer"} <= set(metadata["tags"]) and "favor+" not in metadata["tags"]
    text = card.text
    # Who wrote it and how.
    assert HEDGEHOG_INTRO in text
    assert ("hf-performer (`hf-performer distill`: attention transfer, the learned `hedgehog` feature maps were "
            "trained to\nmimic the source's softmax attention, every other weight unchanged).") in text
    assert "`hf-performer convert`" not in text
    # A milder warning: still "fine-tune it", no FAVOR+ claim.
    assert "**Attention transfer only, not fine-tuned.**" in text and "fine-tune it before use" in text
    assert "Converted, not fine-tuned" not in text and "The Performer paper reports 0.07" not in text
    assert "FAVOR+ estimator" not in text
    # The Attention transfer section, with the record's numbers (and no local path).
    assert "## Attention transfer" in text and "(layers 0, 1)" in text
    assert "- Data: `train.tsv` (layout `sst2`), 24 sequences of at most 12 tokens, batches of 4." in text
    assert ("- Training: 6 steps, loss `both` (KL divergence of the attention weights plus squared error of the "
            "attention outputs), learning rate 0.02.") in text
    assert "- Wall time: 75.5 s (1.3 min) for the whole run" in text
    assert "on 4 held-out texts" in text
    for row in transfer_rows(record):
        assert row in text, row
    assert "| 0 | favor | 0.8123 | 0.2345 | 0.6100 | 0.0510 |" in text  # the same row, spelled out
    assert "- Final hidden states: mean cosine similarity 0.7565 before -> 0.9252 after." in text
    assert "- Head: logits relative error 0.5473 before -> 0.5263 after." in text
    assert "/home/someone" not in text and "train.tsv" in text
    # Fidelity: after transfer (no conversion_report.json here: the record's fidelity_after is shown).
    assert "## Fidelity after attention transfer" in text and "Fidelity right after conversion" not in text
    assert "From `attention_transfer.json` (`fidelity_after`): the model after attention transfer" in text
    assert "| 1 | favor | 0.3646 | 0.3746 |" in text and "mean cosine similarity 0.9252." in text
    assert "These errors remain after attention transfer" in text
    assert "@inproceedings{zhang2024hedgehog" in text and "@inproceedings{choromanski2021rethinking" in text
    # Written as README.md, it loads back with huggingface_hub.
    path = write_model_card(hedgehog, model_name="tiny-hedgehog")
    assert "attention-transfer" in metadata_load(path)["tags"] and "## Attention transfer" in ModelCard.load(path).text

    tuned = build_model_card(hedgehog, fine_tuned=True).text
    assert "every other weight unchanged; then fine-tuned)." in tuned and "not fine-tuned" not in tuned
    # The record can also be passed directly (what `hf-performer distill` can do before writing the file).
    (hedgehog / "attention_transfer.json").unlink()
    assert build_model_card(hedgehog, model_name="tiny-hedgehog", transfer=record).text == text


def _set(path: str, value):
    def breaker(record):
        *parents, last = path.split(".")
        target = record
        for part in parents:
            target = target[part]
        target[last] = value
        return record
    return breaker


def _delete(path: str):
    def breaker(record):
        *parents, last = path.split(".")
        target = record
        for part in parents:
            target = target[part]
        del target[last]
        return record
    return breaker


@pytest.mark.parametrize(
    "breaker, message",
    [
        (lambda record: "{not json", "not valid JSON"),
        (lambda record: [record], "expected a JSON object, got list"),
        (_delete("transfer"), "'transfer.steps' is missing"),
        (_delete("data.file"), "'data.file' is missing"),
        (_set("data", "train.tsv"), "'data' must be an object"),
        (_set("transfer.steps", "six"), "'transfer.steps' must be an int, got 'six'"),
        (_set("transfer.learning_rate", None), "'transfer.learning_rate' must be a number"),
        (_set("transfer.layer_losses_before", {"first": {"weights_kl": 0.1}}),
         "'transfer.layer_losses_before' keys must be layer indices, got 'first'"),
        (_set("transfer.layer_losses_after", {"0": {"weights_kl": "low"}}),
         "'transfer.layer_losses_after.0.weights_kl' must be a number"),
        (_set("fidelity_after.layers", []), "'fidelity_after.layers' must be a non-empty list"),
        (_set("fidelity_before.layers", [{"layer": 0}]), "'fidelity_before.layers\\[0\\]' must hold an int 'layer'"),
        (_delete("fidelity_after.final_hidden_state_cosine"), "'fidelity_after.final_hidden_state_cosine' is missing"),
        (_set("wall_time_s", -1), "'wall_time_s' must be a number of seconds"),
        (_set("feature_map", "t2r"), "into the 't2r' feature map, but config.json uses 'hedgehog'"),
    ],
)
def test_a_malformed_attention_transfer_record_is_an_error(hedgehog, breaker, message):
    broken = breaker(fake_transfer_record())
    path = hedgehog / "attention_transfer.json"
    path.write_text(broken if isinstance(broken, str) else json.dumps(broken))
    with pytest.raises(ModelCardError, match=message) as error:
        build_model_card(hedgehog)
    assert "attention_transfer.json" in str(error.value)
    with pytest.raises(SystemExit, match="hf-performer card: error: .*attention_transfer.json"):
        cli_main(["card", str(hedgehog)])


def test_a_transfer_record_next_to_a_favor_model_is_an_error(folder):
    (folder / "attention_transfer.json").write_text(json.dumps(fake_transfer_record("favor+")))
    with pytest.raises(ModelCardError, match="'favor\\+' map is random \\(no trainable parameters\\)"):
        build_model_card(folder)


def test_a_card_needs_a_feature_map_tag(converted):
    text = (converted / "README.md").read_text()
    with pytest.raises(ModelCardError, match="no feature-map tag"):
        hub.validate_model_card(text.replace("- favor+\n", ""))


@pytest.fixture(scope="module")
def distilled(converted):
    """A tiny hedgehog BERT distilled by the real ``hf-performer distill`` from the converted folder's source."""
    root = converted.parent
    data = root / "train.tsv"
    sentences = ["the quick brown fox", "a lazy dog", "the dog jumps over a fox", "quick brown dog", "a fox",
                 "the lazy fox jumps", "over the dog", "a quick dog jumps over the lazy brown fox"] * 2
    data.write_text("sentence\tlabel\n" + "".join(f"{s}\t{i % 2}\n" for i, s in enumerate(sentences)))
    output = root / "tiny-distilled"
    arguments = ["distill", root / "source", output, "--feature-map", "hedgehog", "--data", data, "--data-task", "sst2",
                 "--max-samples", 8, "--fidelity-samples", 4, "--max-length", 12, "--batch-size", 4, "--steps", 4,
                 "--no-progress"]
    assert cli_main([str(a) for a in arguments]) == 0
    return output


def test_card_of_a_really_distilled_folder(distilled, tmp_path):
    folder = tmp_path / "tiny-distilled"
    shutil.copytree(distilled, folder)
    record = json.loads((folder / "attention_transfer.json").read_text())
    report = json.loads((folder / REPORT_FILE_NAME).read_text())
    assert cli_main(["card", str(folder)]) == 0  # (re)written with attention_transfer.json in the folder
    text = (folder / "README.md").read_text()
    hub.validate_model_card(text)
    assert "`hf-performer distill`" in text and "## Attention transfer" in text
    assert f"- Data: `train.tsv` (layout `sst2`), {record['data']['sequences']} sequences of at most 12 tokens" in text
    assert f"- Training: {record['transfer']['steps']} steps, loss `both`" in text
    for row in transfer_rows(record):
        assert row in text, row
    cosines = (record["fidelity_before"]["final_hidden_state_cosine"], record["fidelity_after"]["final_hidden_state_cosine"])
    assert f"mean cosine similarity {cosines[0]:.4f} before -> {cosines[1]:.4f} after." in text
    # The fidelity section is conversion_report.json, i.e. the fidelity after transfer.
    assert "## Fidelity after attention transfer" in text and "From `conversion_report.json`: the model after" in text
    for layer in report["layers"]:
        assert (f"| {layer['layer']} | {layer['kind']} | {layer['own_inputs_relative_error']:.4f} | "
                f"{layer['propagated_relative_error']:.4f} |") in text
    assert "The Performer paper reports 0.07" not in text and "Attention transfer only, not fine-tuned" in text
    assert str(distilled.parent) not in text  # no local path (source, data file, command) leaks into the card


def test_load_metrics_layouts(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps([{"task": "sst2", "metric": "accuracy", "value": 0.9}]))
    assert load_metrics(path) == ([{"task": "sst2", "metric": "accuracy", "value": 0.9}], [])
    path.write_text(json.dumps({"results": [{"task": "rte", "metric": "accuracy", "value": 0.6}],
                                "recovery": [{"setting": "s", "task": "rte", "dataset": "glue", "metric": "accuracy",
                                              "value": 0.6}]}))
    results, recovery = load_metrics(path)
    assert results[0]["task"] == "rte" and recovery[0]["setting"] == "s"
    path.write_text(json.dumps({"task": "stsb", "split": "validation", "train_runtime": 12.5, "seed": 0,
                                "metrics": {"eval_pearson": 0.81, "eval_spearmanr": 0.8, "note": "text"}}))
    results, recovery = load_metrics(path)
    assert results == [
        {"task": "stsb", "split": "validation", "metric": "pearson", "value": 0.81},
        {"task": "stsb", "split": "validation", "metric": "spearmanr", "value": 0.8},
    ] and recovery == []
    path.write_text(json.dumps({"results": [], "extra": 1}))
    with pytest.raises(ModelCardError, match="unknown top-level keys"):
        load_metrics(path)
    with pytest.raises(ModelCardError, match="not found"):
        load_metrics(tmp_path / "absent.json")


def test_card_command_rewrites_the_card(folder, tmp_path, capsys):
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"task": "sst2", "split": "validation", "metrics": {"accuracy": 0.88}}))
    assert cli_main(["card", str(folder), "--metrics", str(metrics), "--base-model", "google-bert/bert-base-uncased",
                     "--repo-id", REPO_ID, "--fine-tuned"]) == 0
    assert f"wrote {folder / 'README.md'}" in capsys.readouterr().out
    metadata = metadata_load(folder / "README.md")
    assert metadata["base_model"] == "google-bert/bert-base-uncased"
    name, results = model_index_to_eval_results(metadata["model-index"])
    assert name == "tiny-performer" and results[0].metric_value == 0.88 and results[0].dataset_config == "sst2"

    metrics.write_text(json.dumps([{"task": "sst2", "metric": "accuracy", "value": True}]))
    with pytest.raises(SystemExit, match="hf-performer card: error: result 0: the metric value must be a number"):
        cli_main(["card", str(folder), "--metrics", str(metrics)])
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["card", "--help"])
    assert exit_info.value.code == 0 and "model-index" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# Folder validation
# --------------------------------------------------------------------------------------------


def test_a_converted_folder_is_valid(converted):
    check = validate_folder(converted)
    assert check.code_files == CODE_FILES
    assert check.weight_files == ["model.safetensors"]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(check.tokenizer_files)
    assert set(check.required_files) == {"config.json", "model.safetensors", *CODE_FILES, *check.tokenizer_files}
    assert [f.path for f in check.files] == sorted(folder_bytes(converted))
    assert check.warnings == []


def _drop_auto_map(folder):
    config = json.loads((folder / "config.json").read_text())
    del config["auto_map"]
    (folder / "config.json").write_text(json.dumps(config))


def _lfs_pointer(folder):
    (folder / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:0000\nsize 123456\n")


def _truncate_weights(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def _rename_class(folder):
    path = folder / "modeling_performer.py"
    path.write_text(path.read_text().replace("class PerformerForSequenceClassification(", "class Renamed("))


def _remove(*names):
    def breaker(folder):
        for name in names:
            (folder / name).unlink()
    return breaker


@pytest.mark.parametrize(
    "breaker, message",
    [
        (_remove("config.json"), "config.json: missing"),
        (_drop_auto_map, "config.json: auto_map missing"),
        (_remove("modeling_performer.py"), "modeling_performer.py: missing (needed by config.json auto_map['AutoModel'])"),
        (_remove("configuration_performer.py"), "configuration_performer.py: missing (needed by config.json auto_map['AutoConfig'])"),
        # favor_attention.py is named by no auto_map entry: only the relative imports reach it.
        (_remove("favor_attention.py"), "favor_attention.py: missing (needed by modeling_performer.py "
                                        "(from .favor_attention import install_favor_cache_layers, runs_causal_favor"),
        (_remove("linear_attention.py"), "linear_attention.py: missing (needed by cache.py (from .linear_attention"),
        (_rename_class, "modeling_performer.py: does not define PerformerForSequenceClassification"),
        (_remove("model.safetensors"), "weights: missing (expected one of model.safetensors"),
        (_lfs_pointer, "model.safetensors: not a safetensors file (bad header length; a Git LFS pointer"),
        (_truncate_weights, "model.safetensors: truncated"),
        (_remove("tokenizer_config.json"), "tokenizer: tokenizer_config.json missing"),
        (_remove("tokenizer.json"), "tokenizer: no vocabulary file (expected tokenizer.json or vocab.txt"),
    ],
)
def test_validate_folder_names_what_is_missing(folder, breaker, message):
    breaker(folder)
    with pytest.raises(FolderValidationError) as error:
        validate_folder(folder)
    assert message in str(error.value), str(error.value)
    assert "would not load with from_pretrained(..., trust_remote_code=True)" in str(error.value)


def test_validate_folder_lists_every_problem(folder):
    _remove("feature_maps.py", "model.safetensors", "tokenizer.json")(folder)
    with pytest.raises(FolderValidationError) as error:
        validate_folder(folder)
    problems = error.value.problems
    assert any(p.startswith("feature_maps.py: missing") for p in problems)
    assert any(p.startswith("weights: missing") for p in problems)
    assert any(p.startswith("tokenizer: no vocabulary file") for p in problems)
    with pytest.raises(FolderValidationError, match="not a folder"):
        validate_folder(folder / "absent")


def test_missing_card_is_a_warning(folder):
    (folder / "README.md").unlink()
    assert any("no README.md model card" in w for w in validate_folder(folder).warnings)


# --------------------------------------------------------------------------------------------
# A fake Hub on 127.0.0.1
# --------------------------------------------------------------------------------------------


class FakeHub:
    """Enough of the Hub's HTTP API for ``create_repo``, ``create_branch`` and ``upload_folder``.

    Endpoints: ``POST /api/repos/create``, ``POST /api/validate-yaml`` (parses the README with
    huggingface_hub's ``ModelCard``), ``POST /api/models/{repo}/preupload/{rev}`` (files "regular", sent
    inline, except those ending with one of ``lfs_suffixes``: "lfs"), ``POST /api/models/{repo}/commit/{rev}``
    (NDJSON; base64 ``file`` lines and ``lfsFile`` lines of uploaded LFS objects are stored; deletions are
    refused), ``POST /api/models/{repo}/branch/{name}`` and, for LFS files, the basic transfer of the Git LFS
    batch API: ``POST /{repo}.git/info/lfs/objects/batch``, ``PUT /lfs-upload/{oid}`` (the sha256 is
    checked) and ``POST /lfs-verify/{oid}``. Every request but the LFS ``PUT`` (a pre-signed URL on the real
    Hub) needs the bearer token. Requests are recorded in ``self.requests``; repositories are dicts of branches of
    ``{path: bytes}``. Bounded: at most ``max_requests`` requests, a lifetime after which the server
    shuts itself down, and socket timeouts on every connection.
    """

    def __init__(self, token: str = TOKEN, max_requests: int = 40, lifetime_s: float = 60.0,
                 lfs_suffixes: tuple[str, ...] = ()):
        self.token = token
        self.lfs_suffixes = lfs_suffixes
        self.lfs_objects: dict[str, bytes] = {}
        self.max_requests = max_requests
        self.requests: list[dict] = []
        self.repos: dict[str, dict] = {}
        self.commits: list[dict] = []
        self.lock = threading.Lock()
        hub_server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 10  # seconds of socket inactivity before a connection is dropped

            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_GET(self):
                hub_server._handle(self)

            def do_POST(self):
                hub_server._handle(self)

            def do_PUT(self):
                hub_server._handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.timer = threading.Timer(lifetime_s, self.server.shutdown)
        self.timer.daemon = True

    def __enter__(self):
        self.thread.start()
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.cancel()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    # ----------------------------------------------------------------------------------------

    def _reply(self, handler, status: int, payload, headers: dict | None = None):
        body = json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            handler.send_header(key, value)
        handler.end_headers()
        handler.wfile.write(body)

    @staticmethod
    def _read_body(handler) -> bytes:
        if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(handler.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    handler.rfile.readline()  # the empty line after the last chunk
                    return b"".join(chunks)
                chunks.append(handler.rfile.read(size))
                handler.rfile.readline()  # CRLF after each chunk
        length = int(handler.headers.get("Content-Length") or 0)
        return handler.rfile.read(length) if length else b""

    def _handle(self, handler):
        body = self._read_body(handler)
        url = urllib.parse.urlsplit(handler.path)
        record = {"method": handler.command, "path": url.path, "query": url.query,
                  "headers": {k.lower(): v for k, v in handler.headers.items()}, "body": body}
        with self.lock:
            if len(self.requests) >= self.max_requests:
                return self._reply(handler, 429, {"error": "FakeHub: request limit reached"})
            self.requests.append(record)
        is_lfs_put = handler.command == "PUT" and url.path.startswith("/lfs-upload/")
        if not is_lfs_put and record["headers"].get("authorization") != f"Bearer {self.token}":
            return self._reply(handler, 401, {"error": "Invalid credentials in Authorization header"})
        try:
            status, payload, headers = self._route(handler.command, url.path, body)
        except Exception as error:  # a bug in the fake server must show up as a failed request
            status, payload, headers = 500, {"error": f"FakeHub: {type(error).__name__}: {error}"}, {}
        return self._reply(handler, status, payload, headers)

    def _route(self, method: str, path: str, body: bytes):
        not_found = (404, {"error": f"FakeHub: no route for {method} {path}"}, {})
        if method == "PUT" and path.startswith("/lfs-upload/"):
            oid = path.rsplit("/", 1)[1]
            if hashlib.sha256(body).hexdigest() != oid:
                return 400, {"error": "FakeHub: the uploaded bytes do not match the oid"}, {}
            with self.lock:
                self.lfs_objects[oid] = body
            return 200, {}, {}
        if method != "POST":
            return not_found
        if path.startswith("/lfs-verify/"):
            data = json.loads(body)
            stored = self.lfs_objects.get(data["oid"])
            if stored is None or len(stored) != data["size"]:
                return 404, {"error": "FakeHub: LFS object not uploaded"}, {}
            return 200, {}, {}
        if path.endswith(".git/info/lfs/objects/batch"):
            repo_id = path[1:-len(".git/info/lfs/objects/batch")]
            if repo_id not in self.repos:
                return 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}
            data = json.loads(body)
            objects = [
                {"oid": o["oid"], "size": o["size"], "authenticated": True,
                 "actions": {"upload": {"href": f"{self.url}/lfs-upload/{o['oid']}"},
                             "verify": {"href": f"{self.url}/lfs-verify/{o['oid']}"}}}
                for o in data["objects"]
            ]
            return 200, {"transfer": "basic", "objects": objects}, {}
        if path == "/api/repos/create":
            data = json.loads(body)
            repo_id = f"{data['organization']}/{data['name']}" if data.get("organization") else data["name"]
            with self.lock:
                if repo_id in self.repos:
                    return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}, {}
                self.repos[repo_id] = {"visibility": data.get("visibility"), "branches": {"main": {}}}
            return 200, {"url": f"{self.url}/{repo_id}", "name": repo_id}, {}
        if path == "/api/validate-yaml":
            data = json.loads(body)
            try:
                ModelCard(data["content"])
            except Exception as error:
                return 400, {"errors": [{"message": str(error)}], "warnings": []}, {}
            return 200, {"errors": [], "warnings": []}, {}

        parts = path.split("/")  # ["", "api", "models", namespace, name, action, revision...]
        if len(parts) < 7 or parts[:3] != ["", "api", "models"]:
            return not_found
        repo_id, action = f"{parts[3]}/{parts[4]}", parts[5]
        revision = urllib.parse.unquote("/".join(parts[6:]))
        repo = self.repos.get(repo_id)
        if repo is None:
            return 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}
        if action == "branch":
            with self.lock:
                if revision in repo["branches"]:
                    return 409, {"error": f"Branch {revision} already exists"}, {}
                start = json.loads(body or b"{}").get("startingPoint") or "main"
                repo["branches"][revision] = dict(repo["branches"][start])
            return 200, {}, {}
        if revision not in repo["branches"]:
            return 404, {"error": f"Invalid rev id: {revision}"}, {"X-Error-Code": "RevisionNotFound"}
        if action == "preupload":
            files = json.loads(body)["files"]
            return 200, {"files": [{"path": f["path"], "shouldIgnore": False, "oid": None,
                                    "uploadMode": "lfs" if f["path"].endswith(self.lfs_suffixes) else "regular"}
                                   for f in files]}, {}
        if action == "commit":
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            if not lines or lines[0]["key"] != "header":
                return 400, {"error": "FakeHub: the commit payload must start with a header line"}, {}
            files = {}
            for line in lines[1:]:
                value = line["value"]
                if line["key"] == "file" and value.get("encoding") == "base64":
                    files[value["path"]] = base64.b64decode(value["content"])
                elif line["key"] == "lfsFile" and value.get("algo") == "sha256":
                    stored = self.lfs_objects.get(value["oid"])
                    if stored is None or len(stored) != value["size"]:
                        return 422, {"error": f"FakeHub: LFS object of {value['path']} was not uploaded"}, {}
                    files[value["path"]] = stored
                else:
                    return 422, {"error": f"FakeHub: unsupported commit operation {line['key']}"}, {}
            with self.lock:
                repo["branches"][revision].update(files)
                oid = f"{len(self.commits) + 1:040x}"
                self.commits.append({"repo_id": repo_id, "revision": revision, "header": lines[0]["value"],
                                     "files": files, "oid": oid,
                                     "kinds": {line["value"]["path"]: line["key"] for line in lines[1:]}})
            return 200, {"commitUrl": f"{self.url}/{repo_id}/commit/{oid}", "commitOid": oid,
                         "pullRequestUrl": None}, {}
        return not_found


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """A running FakeHub; ``HF_ENDPOINT`` points at it, ``HF_TOKEN`` holds its token, no cached login."""
    with FakeHub() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-cached-token"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # CI runs with HF_HUB_OFFLINE=1
        yield server


def assert_upload_is_complete(uploaded: dict[str, bytes], folder: Path):
    """The recorded upload holds every file of the folder, byte for byte, including all a load needs."""
    local = folder_bytes(folder)
    assert sorted(uploaded) == sorted(local)
    for path, data in local.items():
        assert uploaded[path] == data, f"{path}: uploaded bytes differ"
    required = {"config.json", "model.safetensors", "README.md", "tokenizer.json", "tokenizer_config.json",
                *CODE_FILES}
    assert required <= set(uploaded)
    auto_map = json.loads(uploaded["config.json"])["auto_map"]
    for reference in auto_map.values():
        assert f"{reference.split('.')[0]}.py" in uploaded


# --------------------------------------------------------------------------------------------
# Push
# --------------------------------------------------------------------------------------------


def test_dry_run_lists_every_file_and_sends_nothing(folder, fake_hub, capsys):
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "modeling_performer.cpython-311.pyc").write_bytes(b"\0" * 10)
    result = push_folder(folder, REPO_ID, dry_run=True)
    expected = {path: len(data) for path, data in folder_bytes(folder).items() if not path.startswith("__pycache__")}
    assert {f.path: f.size for f in result.files} == expected
    assert result.dry_run and result.commit_url is None and result.total_bytes == sum(expected.values())

    assert cli_main(["push", str(folder), REPO_ID, "--dry-run", "--revision", "experiments"]) == 0
    out = capsys.readouterr().out
    assert f"dry run: would upload to {REPO_ID} (revision experiments)" in out and "nothing was uploaded" in out
    for path, size in expected.items():
        assert f"({size} bytes)" in next(line for line in out.splitlines() if line.strip().startswith(path + " "))
    assert f"{len(expected)} files" in out
    assert fake_hub.requests == []  # nothing was sent


def test_push_uploads_everything_the_folder_needs(folder, fake_hub):
    result = push_folder(folder, REPO_ID, private=True)
    methods_paths = [(r["method"], r["path"]) for r in fake_hub.requests]
    assert methods_paths == [
        ("POST", "/api/repos/create"),
        ("POST", "/api/validate-yaml"),
        ("POST", f"/api/models/{REPO_ID}/preupload/main"),
        ("POST", f"/api/models/{REPO_ID}/commit/main"),
    ]
    assert all(r["headers"]["authorization"] == f"Bearer {TOKEN}" for r in fake_hub.requests)
    create = json.loads(fake_hub.requests[0]["body"])
    assert create == {"name": "tiny-performer", "organization": "tester", "visibility": "private", "type": "model"}
    assert fake_hub.requests[3]["headers"]["content-type"] == "application/x-ndjson"

    assert len(fake_hub.commits) == 1 and fake_hub.commits[0]["header"]["summary"].startswith("Upload Performer")
    uploaded = fake_hub.repos[REPO_ID]["branches"]["main"]
    assert_upload_is_complete(uploaded, folder)
    assert sorted(uploaded) == [f.path for f in result.files] == [f.path for f in upload_file_list(folder)]
    assert result.commit_url == f"{fake_hub.url}/{REPO_ID}/commit/{fake_hub.commits[0]['oid']}"
    assert result.repo_url == f"{fake_hub.url}/{REPO_ID}"


def test_push_to_a_branch_creates_it_once(folder, fake_hub):
    push_folder(folder, REPO_ID, revision="experiments")
    (folder / "README.md").write_text(str(build_model_card(folder, repo_id=REPO_ID)).replace("tiny-performer is", "It is"))
    push_folder(folder, REPO_ID, revision="experiments", commit_message="second")  # repo and branch exist: 409s
    paths = [r["path"] for r in fake_hub.requests if "/branch/" in r["path"]]
    assert paths == [f"/api/models/{REPO_ID}/branch/experiments"] * 2
    assert [c["revision"] for c in fake_hub.commits] == ["experiments", "experiments"]
    assert fake_hub.commits[1]["header"]["summary"] == "second"
    assert fake_hub.repos[REPO_ID]["branches"]["main"] == {}  # main untouched
    assert_upload_is_complete(fake_hub.repos[REPO_ID]["branches"]["experiments"], folder)
    assert fake_hub.repos[REPO_ID]["visibility"] is None  # no --private: the Hub's default


def test_push_command_end_to_end_with_explicit_token(folder, fake_hub, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN")
    fake_hub.token = "hf_explicit_token_given_on_the_command_line"
    assert cli_main(["push", str(folder), REPO_ID, "--token", fake_hub.token, "--private"]) == 0
    out = capsys.readouterr().out
    assert f"uploaded to {REPO_ID}" in out and f"commit: {fake_hub.url}/{REPO_ID}/commit/" in out
    assert all(r["headers"]["authorization"] == f"Bearer {fake_hub.token}" for r in fake_hub.requests)
    assert_upload_is_complete(fake_hub.repos[REPO_ID]["branches"]["main"], folder)


def test_push_refuses_a_broken_folder_and_sends_nothing(folder, fake_hub):
    (folder / "favor_attention.py").unlink()
    with pytest.raises(FolderValidationError, match="favor_attention.py: missing"):
        push_folder(folder, REPO_ID)
    with pytest.raises(SystemExit, match="hf-performer push: error: .* would not load"):
        cli_main(["push", str(folder), REPO_ID, "--dry-run"])
    assert fake_hub.requests == []


def test_a_folder_without_a_tokenizer_is_pushed_only_when_asked(folder, fake_hub, capsys):
    """A conversion of a source without tokenizer has none: refused by default, accepted with --no-tokenizer (a
    warning); a half tokenizer is refused either way."""
    for path in folder.iterdir():
        if path.name in TOKENIZER_FILES:
            path.unlink()
    with pytest.raises(SystemExit, match="tokenizer_config.json missing"):
        cli_main(["push", str(folder), REPO_ID, "--dry-run"])
    assert cli_main(["push", str(folder), REPO_ID, "--dry-run", "--no-tokenizer"]) == 0
    assert "warning: no tokenizer (--no-tokenizer)" in capsys.readouterr().err
    (folder / "tokenizer_config.json").write_text("{}")
    with pytest.raises(SystemExit, match="no vocabulary file"):
        cli_main(["push", str(folder), REPO_ID, "--dry-run", "--no-tokenizer"])
    assert fake_hub.requests == []


def test_push_errors_are_clear(folder, fake_hub, monkeypatch):
    with pytest.raises(PushError, match="not of the form namespace/name"):
        push_folder(folder, "no-namespace")
    with pytest.raises(PushError, match="is a commit id"):
        push_folder(folder, REPO_ID, revision="a" * 40)
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(PushError, match="no Hugging Face token"):
        push_folder(folder, REPO_ID)
    assert fake_hub.requests == []
    with pytest.raises(PushError, match="the Hub refused the upload"):
        push_folder(folder, REPO_ID, token="hf_wrong_token")
    # create_repo answered 401; huggingface_hub then checks whether the repo exists (GET) before raising.
    assert [r["path"] for r in fake_hub.requests] == ["/api/repos/create", f"/api/models/{REPO_ID}"]
    assert fake_hub.commits == [] and fake_hub.repos == {}


def test_push_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["push", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    for option in ("--private", "--revision", "--dry-run", "--token", "FOLDER", "REPO_ID"):
        assert option in out


def test_write_model_card_replaces_readme(folder):
    (folder / "README.md").write_text("old")
    path = write_model_card(folder, model_name="renamed")
    assert path == folder / "README.md" and metadata_load(path)["library_name"] == "transformers"
    assert "# renamed" in path.read_text()
    assert hub.validate_model_card(path.read_text())["pipeline_tag"] == "text-classification"
    (folder / REPORT_FILE_NAME).unlink()
    assert "This folder has no `conversion_report.json`" in write_model_card(folder).read_text()


@pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")  # raised inside huggingface_hub's LFS PUT
def test_push_large_files_through_git_lfs(folder, monkeypatch):
    """Without hf_xet (or with it disabled), files the Hub marks "lfs" go through the Git LFS batch API."""
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # CI runs with HF_HUB_OFFLINE=1
    with FakeHub(lfs_suffixes=(".safetensors",)) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        push_folder(folder, REPO_ID)
    weights = (folder / "model.safetensors").read_bytes()
    oid = hashlib.sha256(weights).hexdigest()
    requests = [(r["method"], r["path"]) for r in server.requests]
    assert ("POST", f"/{REPO_ID}.git/info/lfs/objects/batch") in requests
    assert [path for method, path in requests if method == "PUT"] == [f"/lfs-upload/{oid}"]
    assert ("POST", f"/lfs-verify/{oid}") in requests
    assert server.lfs_objects == {oid: weights}
    (commit,) = server.commits
    assert commit["kinds"]["model.safetensors"] == "lfsFile" and commit["kinds"]["config.json"] == "file"
    assert_upload_is_complete(server.repos[REPO_ID]["branches"]["main"], folder)


def test_fake_hub_is_local_and_bounded():
    """The test server binds 127.0.0.1 only, refuses requests past its cap and shuts itself down."""
    import urllib.error
    import urllib.request

    with FakeHub(max_requests=2, lifetime_s=1.0) as server:
        assert server.server.server_address[0] == "127.0.0.1"
        statuses = []
        for _ in range(3):
            request = urllib.request.Request(f"{server.url}/api/validate-yaml", method="POST",
                                             data=json.dumps({"content": "---\nlicense: mit\n---\n"}).encode(),
                                             headers={"Authorization": f"Bearer {TOKEN}"})
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    statuses.append(response.status)
            except urllib.error.HTTPError as error:
                statuses.append(error.code)
        assert statuses == [200, 200, 429] and len(server.requests) == 2
        server.thread.join(timeout=5)  # the lifetime timer stops serve_forever by itself
        assert not server.thread.is_alive()


def test_card_data_files_are_read_and_quoted_in_the_card(converted):
    """The citations and measured speeds are package data (model_cards/*.json), read by hub.describe and quoted
    in every card."""
    from importlib.resources import files

    from hf_performer.hub import describe

    data = files("hf_performer.model_cards")
    citations = json.loads((data / "citations.json").read_text(encoding="utf-8"))
    measured = json.loads((data / "measured_speed.json").read_text(encoding="utf-8"))
    assert describe.FEATURE_MAP_PAPERS == citations["feature_map_papers"]
    for key, paper in citations["papers"].items():
        assert describe.PAPERS[key] == {**paper, "bibtex": "\n".join(paper["bibtex"])}
    assert describe.MEASURED_SPEED == {key: value for key, value in measured.items() if key != "_comment"}

    text = (converted / "README.md").read_text(encoding="utf-8")
    performer = citations["papers"]["choromanski2021"]
    assert f"[{performer['cite']}]({performer['url']})" in text
    assert "\n".join(performer["bibtex"]) in text
    linear = measured["linear"]
    assert f"({linear['setup']}; {linear['machine']})" in text
    assert f"about **{linear['crossover_bidirectional']} tokens bidirectional**" in text
    assert f"**{linear['crossover_causal']} tokens causal**" in text
    for row in linear["rows"]:
        assert f"| {row['length']} | {row['bidirectional']:.2f}x | {row['causal']:.2f}x |" in text
    memory = measured["linear_memory"]
    assert (f"was {memory['bidirectional']}x SDPA's bidirectional and\n  {memory['causal']}x causal at "
            f"{memory['length']} tokens") in text


# --------------------------------------------------------------------------------------------
# A new user's first run: the card's snippet, the recipe's card, push failures, folders that would not load
# --------------------------------------------------------------------------------------------


def loading_snippet(card_text: str) -> str:
    """The python code block of the card's "How to load" section, verbatim."""
    section = card_text.split("## How to load", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_card_loading_snippet_trusts_the_code_for_every_auto_class(converted):
    """Fast check of the snippet: every ``from_pretrained`` call (AutoTokenizer too, which reads config.json and its
    auto_map) passes ``trust_remote_code=True``, else transformers asks on stdin (the slow test below runs it)."""
    import ast

    calls = [node for node in ast.walk(ast.parse(loading_snippet((converted / "README.md").read_text())))
             if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "from_pretrained"]
    assert [call.func.value.id for call in calls] == ["AutoTokenizer", "AutoModelForSequenceClassification"]
    for call in calls:
        assert any(k.arg == "trust_remote_code" and getattr(k.value, "value", None) is True for k in call.keywords), \
            f"{call.func.value.id}.from_pretrained without trust_remote_code=True"


@pytest.mark.slow
def test_card_loading_snippet_runs_unattended_where_the_package_is_not_installed(converted, tmp_path,
                                                                                 block_hf_performer_source):
    """The card's snippet, run as a script (stdin closed, no hf_performer) must not stop at the "Do you wish to run
    the custom code? [y/N]" prompt, which blocks scripts and servers (AutoTokenizer reads config.json's auto_map)."""
    snippet = loading_snippet((converted / "README.md").read_text())
    assert 'from_pretrained("tiny-performer"' in snippet  # the repo id defaults to the folder name
    user = tmp_path / "user"
    shutil.copytree(converted, user / "tiny-performer")
    script = user / "load.py"
    script.write_text(block_hf_performer_source + snippet + '\nassert "hf_performer" not in sys.modules\n'
                      'print("loaded", type(model).__module__.split(".")[0], tuple(logits.shape))\n')
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                   "HF_MODULES_CACHE": str(tmp_path / "modules_cache")}
    run = subprocess.run([sys.executable, "-I", str(script)], cwd=user, env=environment, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert "Do you wish to run the custom code" not in output, output[-3000:]
    assert "loaded transformers_modules (1, 2)" in run.stdout


def _sst2_rows(n: int, seed: int) -> str:
    import random

    rng = random.Random(seed)
    words = "the quick brown fox jumps over a lazy dog".split()
    lines = ["sentence\tlabel"]
    for i in range(n):
        lines.append(f"{' '.join(rng.choice(words) for _ in range(rng.randint(3, 7)))}\t{i % 2}")
    return "\n".join(lines) + "\n"


def test_recipe_run_writes_a_card_that_card_and_push_accept(converted, tmp_path, capsys):
    """Fine-tune (recipe) -> card -> push, without hand edits: the recipe writes README.md, `hf-performer card
    --metrics <run>/metrics.json` reads the recipe's own metrics file, and the folder passes validation."""
    from hf_performer.recipes import train as training

    (tmp_path / "train.tsv").write_text(_sst2_rows(16, 0))
    (tmp_path / "dev.tsv").write_text(_sst2_rows(8, 1))
    output = tmp_path / "run"
    args = training.build_parser("text-classification").parse_args([
        "--model", str(converted.parent / "source"), "--task", "sst2", "--train-file", str(tmp_path / "train.tsv"),
        "--validation-file", str(tmp_path / "dev.tsv"), "--output-dir", str(output), "--nb-features", "16",
        "--metrics-backend", "local", "--report-to", "none", "--max-train-steps", "2",
        "--per-device-train-batch-size", "8", "--checkpointing-steps", "1",
    ])
    metrics = training.train(args)
    accuracy = metrics["final"]["accuracy"]

    card_path = output / "README.md"
    assert card_path.is_file(), "the recipe wrote no model card"
    text = card_path.read_text()
    metadata = hub.validate_model_card(text)
    name, results = model_index_to_eval_results(metadata["model-index"])
    assert name == "run"
    assert [(r.task_type, r.dataset_type, r.dataset_config, r.dataset_split, r.metric_type, r.metric_value)
            for r in results] == [("text-classification", "nyu-mll/glue", "sst2", "validation", "accuracy", accuracy)]
    assert "then fine-tuned" in text and "Converted, not fine-tuned" not in text
    assert str(tmp_path) not in text  # no local path in a file meant for the Hub

    # The documented command accepts the recipe's own metrics.json (it refused it: unknown key 'kind').
    results, recovery = load_metrics(output / "metrics.json")
    assert results == [{"task": "sst2", "split": "validation", "metric": "accuracy", "value": accuracy}]
    assert recovery == []
    assert cli_main(["card", str(output), "--metrics", str(output / "metrics.json"), "--repo-id", REPO_ID]) == 0
    text = card_path.read_text()
    assert "then fine-tuned" in text and "Converted, not fine-tuned" not in text  # detected from the recipe's files
    assert model_index_to_eval_results(metadata_load(card_path)["model-index"])[1][0].metric_value == accuracy

    check = validate_folder(output)
    paths = [f.path for f in check.files]
    assert "README.md" in paths and "model.safetensors" in paths
    assert not any(path.startswith("checkpoints/") for path in paths)  # optimizer states stay local
    assert (output / "checkpoints" / "step_2").is_dir()


def test_recipe_metrics_of_a_causal_lm_run(tmp_path):
    """The causal-LM recipe's metrics.json gives a perplexity result on the named Hub dataset."""
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps({
        "kind": "causal-lm", "task": "causal-lm", "main_metric": "perplexity", "completed_steps": 3,
        "final": {"perplexity": 41.5, "eval_loss": 3.7}, "model": {"source": str(tmp_path)},
        "args": {"dataset": "wikitext", "dataset_config": None, "train_file": None, "validation_file": None},
    }))
    results, recovery = load_metrics(path)
    assert results == [{"task": "text-generation", "dataset": "Salesforce/wikitext", "config": "wikitext-2-raw-v1",
                        "split": "validation", "metric": "perplexity", "value": 41.5}] and recovery == []
    path.write_text(json.dumps({"kind": "text-classification", "task": "cola", "final": {
        "matthews_correlation": float("nan"), "accuracy": 0.7, "eval_loss": 0.6}}))
    assert load_metrics(path)[0] == [{"task": "cola", "split": "validation", "metric": "accuracy", "value": 0.7}]
    path.write_text(json.dumps({"kind": "text-classification", "task": "sst2", "final": "0.9"}))
    with pytest.raises(ModelCardError, match="'final' must be an object"):
        load_metrics(path)


def test_push_while_offline_says_what_to_do_in_one_line(folder, fake_hub, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(PushError) as error:
        push_folder(folder, REPO_ID)
    message = str(error.value)
    assert "\n" not in message and "HF_HUB_OFFLINE" in message and "unset" in message and "--dry-run" in message
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["push", str(folder), REPO_ID])
    assert str(exit_info.value).startswith("hf-performer push: error: HF_HUB_OFFLINE")
    assert "\n" not in str(exit_info.value)
    assert fake_hub.requests == []
    assert cli_main(["push", str(folder), REPO_ID, "--dry-run"]) == 0  # listing needs no network


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_push_network_and_auth_failures_are_one_line(folder, fake_hub, monkeypatch):
    with pytest.raises(PushError) as error:
        push_folder(folder, REPO_ID, endpoint=f"http://127.0.0.1:{_closed_port()}")
    message = str(error.value)
    assert "\n" not in message and "could not reach the Hub" in message and "Connection refused" in message

    def failing_upload(*args, **kwargs):
        raise ConnectionResetError(104, "Connection reset by peer")

    with monkeypatch.context() as patch:
        patch.setattr(hub.push.HfApi, "upload_folder", failing_upload)
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["push", str(folder), REPO_ID])
    message = str(exit_info.value)
    assert message.startswith("hf-performer push: error: ") and "\n" not in message
    assert "Connection reset by peer" in message and "retry" in message

    with pytest.raises(PushError) as error:
        push_folder(folder, REPO_ID, token="hf_wrong_token", endpoint=fake_hub.url)
    message = str(error.value)
    assert "\n" not in message and "401" in message and "hf auth login" in message and "--token" in message


def _set_favor_setting(key, value):
    def breaker(folder):
        config = json.loads((folder / "config.json").read_text())
        config["favor_settings"][key] = value
        (folder / "config.json").write_text(json.dumps(config))
    return breaker


def test_an_attribute_set_on_a_saved_config_is_accepted(folder):
    """An attribute set on a config after it was built is saved at the top level and loads again (issue 16)."""
    config = json.loads((folder / "config.json").read_text())
    config["batch_norm_eps"] = 1e-5
    (folder / "config.json").write_text(json.dumps(config))
    validate_folder(folder)


def _misspell_favor_setting(folder):
    config = json.loads((folder / "config.json").read_text())
    config["favor_settings"]["nb_featurs"] = 64
    (folder / "config.json").write_text(json.dumps(config))


def _drop_tensor(folder):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors["performer.bert.encoder.layer.1.attention.self.query.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "breaker, message",
    [
        (_set_favor_setting("nb_features", "64"),
         "config.json: does not load (PerformerConfig.from_pretrained): invalid FAVOR+ settings: "
         "favor_settings['nb_features'] must be a positive int or None, got '64'"),
        (_set_favor_setting("nb_features", 32),
         "model.safetensors: performer.bert.encoder.layer.0.attention.self.favor_feature_map.projection has shape "
         "[16, 16], config.json builds [32, 16]"),
        (_misspell_favor_setting, "config.json: does not load (PerformerConfig.from_pretrained): invalid FAVOR+ "
                                  "settings"),
        (_drop_tensor, "model.safetensors: lacks 1 tensor(s) of PerformerForSequenceClassification: "
                       "performer.bert.encoder.layer.1.attention.self.query.weight"),
    ],
    ids=["nb_features-string", "nb_features-mismatch", "misspelt-favor-setting", "missing-tensor"],
)
def test_push_refuses_a_config_that_would_not_load_with_its_weights(folder, fake_hub, breaker, message):
    validate_folder(folder)
    breaker(folder)
    with pytest.raises(FolderValidationError) as error:
        validate_folder(folder)
    assert message in str(error.value), str(error.value)
    with pytest.raises(FolderValidationError):
        push_folder(folder, REPO_ID)
    assert fake_hub.requests == []


def test_checkpoints_are_not_uploaded_unless_asked(folder, fake_hub, capsys):
    step = folder / "checkpoints" / "step_10"
    step.mkdir(parents=True)
    (step / "optimizer.bin").write_bytes(b"\0" * 2048)
    (step / "training_state.json").write_text("{}")
    result = push_folder(folder, REPO_ID, dry_run=True)
    assert not any(f.path.startswith("checkpoints/") for f in result.files)
    assert any("checkpoints/" in w and "--include-checkpoints" in w for w in result.warnings)
    assert cli_main(["push", str(folder), REPO_ID, "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert "optimizer.bin" not in captured.out and "--include-checkpoints" in captured.err

    result = push_folder(folder, REPO_ID, dry_run=True, include_checkpoints=True)
    assert {"checkpoints/step_10/optimizer.bin", "checkpoints/step_10/training_state.json"} <= {f.path for f in result.files}
    assert cli_main(["push", str(folder), REPO_ID, "--dry-run", "--include-checkpoints"]) == 0
    assert "checkpoints/step_10/optimizer.bin" in capsys.readouterr().out

    push_folder(folder, REPO_ID)
    uploaded = fake_hub.repos[REPO_ID]["branches"]["main"]
    assert "config.json" in uploaded and not any(path.startswith("checkpoints/") for path in uploaded)
