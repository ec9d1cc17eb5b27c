"""Quick test of benchmarks/scripts/packed_window_speed.py on a tiny Llama and its window conversion."""

import json

import pytest
import torch
from conftest import benchmark_script, tiny_llama_config
from transformers import LlamaForCausalLM

from hf_performer import convert_to_performer, favor_attention
from hf_performer.packed_sequences import SegmentRows


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("packed")
    source = LlamaForCausalLM(tiny_llama_config()).eval()
    source.save_pretrained(root / "tiny-softmax")
    convert_to_performer(source, feature_map="hedgehog", window=3, sinks=1, sparse_cache=4,
                         linear_tail=False).save_pretrained(root / "tiny-cache")
    return [root / name for name in ("tiny-softmax", "tiny-cache")]


def test_packed_rows_are_timed_grouped_and_in_one_group_against_softmax(folders, tmp_path):
    script = benchmark_script("packed_window_speed")
    argv = [*map(str, folders), "--lengths", "20,9,8,3", "--repeats", "2", "--precision", "no",
            "--output-dir", str(tmp_path)]
    assert script.main(argv) == 0
    assert favor_attention.SegmentRows is SegmentRows  # put back after the one-group arm
    result = json.loads((tmp_path / f"{script.NAME}.json").read_text())
    assert (tmp_path / f"{script.NAME}.png").is_file()
    assert [r["arm"] for r in result["records"]] == list(script.ARMS)
    assert all(len(r["seconds"]) == 2 and min(r["seconds"]) > 0 for r in result["records"])
    assert result["records"][0]["ratio_to_softmax"] == 1.0
    settings = result["settings"]
    assert settings["groups"] == [[20], [9, 8], [3]] and settings["tokens"] == 40
    assert settings["window_positions"] == {"grouped": 41, "one_group": 80}
    assert str(folders[0].parent) not in json.dumps(result) and "tiny-softmax tiny-cache" in result["command"]
    assert str(tmp_path) not in json.dumps(result)


def test_packed_window_speed_refuses_bad_arguments(folders, capsys):
    script = benchmark_script("packed_window_speed")
    for argv, message in (([*map(str, folders), "--lengths", "4,x"], "comma-separated ints"),
                          ([*map(str, folders), "--lengths", "4,1"], ">= 2 tokens"),
                          ([str(folders[0]), str(folders[0].parent)], "no config.json")):
        with pytest.raises(SystemExit):
            script.main(argv)
        assert message in capsys.readouterr().err
