"""Quick test of benchmarks/scripts/lora_step_speed.py on a tiny Llama and its window conversions."""

import json

import pytest
import torch
from conftest import benchmark_script, tiny_llama_config
from transformers import LlamaForCausalLM

from hf_performer import convert_to_performer


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("lora_step")
    source = LlamaForCausalLM(tiny_llama_config()).eval()
    source.save_pretrained(root / "tiny-softmax")
    convert_to_performer(source, feature_map="hedgehog", window=3, sinks=1).save_pretrained(root / "tiny-tail")
    convert_to_performer(LlamaForCausalLM(tiny_llama_config()), feature_map="hedgehog", window=3, sinks=1,
                         sparse_cache=4, linear_tail=False).save_pretrained(root / "tiny-cache")
    return [root / name for name in ("tiny-softmax", "tiny-tail", "tiny-cache")]


def test_lora_steps_are_timed_against_the_baseline(folders, tmp_path):
    script = benchmark_script("lora_step_speed")
    argv = [*map(str, folders), "--labels", "softmax", "tail", "cache", "--batch", "1", "--length", "24",
            "--repeats", "2", "--precision", "no", "--output-dir", str(tmp_path)]
    assert script.main(argv) == 0
    result = json.loads((tmp_path / f"{script.NAME}.json").read_text())
    assert (tmp_path / f"{script.NAME}.png").is_file()
    records = {record["label"]: record for record in result["records"]}
    assert list(records) == ["softmax", "tail", "cache"]
    assert all(len(r["seconds"]) == 2 and min(r["seconds"]) > 0 for r in records.values())
    assert records["softmax"]["ratio_to_baseline"] == 1.0
    assert records["softmax"]["attention"].startswith("softmax")
    assert records["tail"]["attention"] == "window 3, 1 sinks, hedgehog tail"
    assert records["cache"]["attention"] == "window 3, 1 sinks, sparse cache 4, no tail"
    assert str(folders[0].parent) not in json.dumps(result) and "tiny-softmax tiny-tail" in result["command"]
    assert str(tmp_path) not in json.dumps(result)


def test_lora_step_speed_refuses_bad_arguments(folders, capsys):
    script = benchmark_script("lora_step_speed")
    for argv, message in (([str(folders[0])], "at least one converted folder"),
                          ([*map(str, folders[:2]), "--labels", "a"], "--labels must name each"),
                          ([*map(str, folders[:2]), "--repeats", "0"], ">= 1"),
                          ([str(folders[0]), str(folders[0].parent)], "no config.json")):
        with pytest.raises(SystemExit):
            script.main(argv)
        assert message in capsys.readouterr().err
