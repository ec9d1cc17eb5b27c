"""Quick test of ``hf-performer bench decode --model FOLDER`` on a tiny converted Llama with window layers."""

import json

import pytest
import torch
from conftest import benchmark_script, tiny_llama_config
from transformers import LlamaForCausalLM

from hf_performer import convert_to_performer
from hf_performer.bench.decode_converted import load_converted_causal_lm, run_converted_decode_benchmark
from hf_performer.bench.report import format_decode_table


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    source = LlamaForCausalLM(tiny_llama_config()).eval()
    path = tmp_path_factory.mktemp("window") / "tiny-window"
    convert_to_performer(source, feature_map="hedgehog", window=3, sinks=1).save_pretrained(path)
    return path


def test_window_layers_are_measured_against_softmax(folder):
    result = run_converted_decode_benchmark(folder, context_lengths=(24, 8), repeats=2, warmup=1, prefill_chunk=5,
                                            verify_context=9, progress=False)
    records = {(r["context"], r["implementation"]): r for r in result["records"]}
    assert sorted(records) == [(8, "favor"), (8, "softmax"), (24, "favor"), (24, "softmax")]
    # Window cache: constant bytes from a full buffer on; softmax keys/values grow with the context.
    assert records[(8, "favor")]["cache_bytes"] == records[(24, "favor")]["cache_bytes"] > 0
    assert records[(24, "softmax")]["cache_bytes"] == 3 * records[(8, "softmax")]["cache_bytes"]
    assert result["verification"]["favor"]["cache_layer_types"] == ["WindowCacheLayer"]
    assert result["verification"]["chunked_vs_one_forward_max_abs_logit_difference"] < 1e-4
    assert result["settings"]["model"]["folder"] == "tiny-window" and str(folder) not in str(result)
    assert result["summary"]["favor_cache_bytes_constant"] is True
    assert "chunked prefill through the window cache" in format_decode_table(result)
    # the record is JSON (the state's plain tuples, e.g. the last query's tail sums, described by index)
    assert "query_tail.0" in result["verification"]["favor"]["cache_layers"][0]["tensors"]
    json.dumps(result)


def test_contexts_below_the_full_buffer_are_refused(folder):
    with pytest.raises(ValueError, match=r"context lengths must be >= sinks \+ 2 x window = 7"):
        run_converted_decode_benchmark(folder, context_lengths=(6,), progress=False)


def test_generation_floor_times_window_softmax_and_no_attention(folder, tmp_path, capsys):
    floor = benchmark_script("generation_floor")
    assert floor.main([str(folder), "--contexts", "6,12", "--repeats", "2", "--prefill-length", "16",
                       "--prefill-repeats", "1", "--output-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / f"{floor.NAME}.json").read_text())
    assert (tmp_path / f"{floor.NAME}.png").is_file()
    assert [record["context"] for record in result["decode"]] == [6, 12]
    for record in result["decode"]:
        assert all(len(times) == 2 and min(times) > 0 for times in record["seconds"].values())
        assert record["cache_bytes"]["favor"] > 0 and record["cache_bytes"]["softmax"] > 0
        assert record["mean_ms"]["favor"] == pytest.approx(1e3 * sum(record["seconds"]["favor"]) / 2)
    row = result["summary"]["decode_context_12_batch_1"]
    record = result["decode"][1]
    assert row["favor_speedup"] == pytest.approx(record["mean_ms"]["softmax"] / record["mean_ms"]["favor"])
    assert row["favor_median_step_speedup"] == pytest.approx(record["median_ms"]["softmax"] /
                                                            record["median_ms"]["favor"])
    assert sorted(result["prefill"]["median_s"]) == ["favor", "floor", "softmax"]
    assert set(result["summary"]) == {"decode_context_6_batch_1", "decode_context_12_batch_1", "prefill_16"}
    assert str(folder) not in json.dumps(result) and "tiny-window" in result["command"]
    assert str(tmp_path) not in json.dumps(result)  # no local path: the output folder by its name
    # The floor's attention does no work: the model's output with it does not depend on the other tokens.
    model = load_converted_causal_lm(folder)
    floor.Runner(model).switch("floor")
    with torch.no_grad():
        first = model(input_ids=torch.tensor([[5, 6, 7]])).logits[0, -1]
        second = model(input_ids=torch.tensor([[9, 2, 7]])).logits[0, -1]
    torch.testing.assert_close(first, second)


def test_generation_floor_refuses_bad_arguments(folder, capsys):
    floor = benchmark_script("generation_floor")
    for argv, message in (([str(folder), "--contexts", "a,b"], "comma-separated ints"),
                          ([str(folder), "--batch", "0"], ">= 1"),
                          ([str(folder.parent)], "no config.json")):
        with pytest.raises(SystemExit):
            floor.main(argv)
        assert message in capsys.readouterr().err
