"""``hf-performer bench model``: whole-model time and peak memory of a converted model against its softmax source."""

import json

import pytest
import torch

from hf_performer.bench import model_speed


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    """A tiny softmax Llama and its FAVOR+ conversion by ``hf-performer convert`` (a folder that carries its code and
    an ``auto_map``, as users get it)."""
    from transformers import LlamaForCausalLM

    from conftest import tiny_llama_config
    from hf_performer.cli import main

    folder = tmp_path_factory.mktemp("pair")
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(folder / "softmax")
    assert main(["convert", str(folder / "softmax"), str(folder / "favor"), "--nb-features", "16"]) == 0
    assert "auto_map" in json.loads((folder / "favor" / "config.json").read_text())
    return folder / "softmax", folder / "favor"


def test_one_point_measures_the_backbone_forward_and_backward(llama_pair):
    softmax, favor = llama_pair
    point = model_speed.measure_model_point(str(favor), 64, backward=True)
    assert point["seconds"] > 0 and point["peak_memory_bytes"] >= 0
    assert point["attention"].startswith("favor: favor+") and "m=16" in point["attention"]
    assert model_speed.measure_model_point(str(softmax), 64)["attention"] == "softmax (sdpa)"


def test_cli_writes_records_ratios_and_the_command(llama_pair, tmp_path, monkeypatch):
    import sys

    from hf_performer.cli import main

    softmax, favor = llama_pair
    arguments = ["bench", "model", str(softmax), str(favor), "--lengths", "48", "--output-dir", str(tmp_path),
                 "--name", "speed"]
    monkeypatch.setattr(sys, "argv", ["hf-performer", *arguments])
    assert main(arguments) == 0
    record = json.loads((tmp_path / "speed.json").read_text())
    assert [(r["model"], r["length"]) for r in record["records"]] == [("softmax", 48), ("favor", 48)]
    ratios = {r["model"]: r for r in record["summary"]["ratios"]}
    # A tiny model's peak resident set may not grow at all: the ratio is then None, not a division by zero.
    assert ratios["softmax"]["speedup"] == 1.0 and ratios["softmax"]["memory_ratio"] in (1.0, None)
    favor_record = record["records"][1]
    assert ratios["favor"]["speedup"] == pytest.approx(record["records"][0]["seconds"] / favor_record["seconds"])
    assert record["command"].startswith("hf-performer bench model softmax favor --lengths 48")
    assert str(tmp_path) not in (tmp_path / "speed.json").read_text() and (tmp_path / "speed.png").stat().st_size


def test_several_runs_give_each_point_the_median_of_its_runs(llama_pair, monkeypatch):
    softmax, favor = llama_pair
    timings = iter([3.0, 1.0, 9.0, 2.0, 5.0, 1.5])  # (softmax, favor) in run 1, 2, 3

    def fake_point(folder, length, batch, backward, repeats):
        return {"seconds": next(timings), "peak_memory_bytes": 100, "attention": "a", "parameters": 1}

    monkeypatch.setattr(model_speed, "_measure_in_fresh_process", fake_point)
    result = model_speed.run_model_benchmark([str(softmax), str(favor)], lengths=[32], processes=3, progress=False)
    softmax_record, favor_record = result["records"]
    assert softmax_record["process_seconds"] == [3.0, 9.0, 5.0] and softmax_record["seconds"] == 5.0
    assert favor_record["process_seconds"] == [1.0, 2.0, 1.5] and favor_record["seconds"] == 1.5
    assert result["settings"]["processes"] == 3 and len(result["machine"]["runs"]) == 3
    assert "medians of 3 runs" in model_speed.format_model_speed_table(result)
    with pytest.raises(model_speed.ModelBenchmarkError, match="--processes"):
        model_speed.run_model_benchmark([str(softmax)], lengths=[8], processes=0)


def test_bad_inputs_are_one_line_errors(llama_pair, tmp_path, tiny_bert_config):
    from transformers import BertModel

    softmax, _ = llama_pair
    with pytest.raises(model_speed.ModelBenchmarkError, match="no config.json"):
        model_speed.run_model_benchmark([str(tmp_path)], lengths=[8])
    with pytest.raises(model_speed.ModelBenchmarkError, match="one distinct label per folder"):
        model_speed.run_model_benchmark([str(softmax), str(softmax)], lengths=[8])
    BertModel(tiny_bert_config(max_position_embeddings=32)).save_pretrained(tmp_path / "bert")
    with pytest.raises(model_speed.ModelBenchmarkError, match="learned position table of 32 positions"):
        model_speed.measure_model_point(str(tmp_path / "bert"), 64)


def test_a_conversion_of_another_architecture_is_refused_before_any_measurement(llama_pair, tmp_path,
                                                                               tiny_bert_config):
    from transformers import BertModel

    from hf_performer.cli import main

    softmax, favor = llama_pair
    BertModel(tiny_bert_config()).save_pretrained(tmp_path / "bert")
    assert main(["convert", str(tmp_path / "bert"), str(tmp_path / "bert-favor"), "--nb-features", "8"]) == 0
    with pytest.raises(model_speed.ModelBenchmarkError) as failure:
        model_speed.run_model_benchmark([str(softmax), str(favor), str(tmp_path / "bert-favor")], lengths=[8])
    assert "bert-favor is not the baseline softmax's architecture (model_type bert (baseline llama)" in \
        str(failure.value)
    # a Performer folder is compared through the softmax model it was converted from
    assert model_speed.backbone_geometry(json.loads((favor / "config.json").read_text())) == \
        model_speed.backbone_geometry(json.loads((softmax / "config.json").read_text()))
