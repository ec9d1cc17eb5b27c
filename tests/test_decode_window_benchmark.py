"""Quick tests of ``hf-performer bench decode --model FOLDER`` and ``bench generation`` on a tiny converted Llama
with window layers."""

import json
import sys

import pytest
import torch
from conftest import tiny_llama_config
from transformers import LlamaForCausalLM

from hf_performer import convert_to_performer
from hf_performer.bench.decode import run_decode_benchmark_in_processes
from hf_performer.bench.decode_converted import load_converted_causal_lm, run_converted_decode_benchmark
from hf_performer.bench.generation import Runner, format_generation_table, run_generation_benchmark_in_processes
from hf_performer.bench.report import format_decode_table
from hf_performer.cli import main


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


def test_generation_times_window_softmax_and_no_attention(folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["hf-performer", "bench", "generation", str(folder)])
    assert main(["bench", "generation", str(folder), "--context-lengths", "6,12", "--repeats", "2",
                 "--prefill-length", "16", "--prefill-repeats", "1", "--output-dir", "out"]) == 0
    result = json.loads((tmp_path / "out" / "generation.json").read_text())
    assert (tmp_path / "out" / "generation.png").is_file()
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
    assert str(folder) not in json.dumps(result) and result["settings"]["model"] == "tiny-window"
    assert result["command"].startswith("hf-performer bench generation") and str(tmp_path) not in json.dumps(result)
    # The floor's attention does no work: the model's output with it does not depend on the other tokens.
    model = load_converted_causal_lm(folder)
    Runner(model).switch("floor")
    with torch.no_grad():
        first = model(input_ids=torch.tensor([[5, 6, 7]])).logits[0, -1]
        second = model(input_ids=torch.tensor([[9, 2, 7]])).logits[0, -1]
    torch.testing.assert_close(first, second)


def test_generation_medians_over_fresh_processes(folder):
    """--processes 3: each figure is the median of three whole runs, each run's value kept beside it."""
    result = run_generation_benchmark_in_processes(3, model_path=str(folder), contexts=[6], repeats=2,
                                                   prefill_length=8, prefill_repeats=1)
    record = result["decode"][0]
    assert result["settings"]["processes"] == 3 and len(result["machine"]["runs"]) == 3
    for name in ("favor", "softmax", "floor"):
        runs = [run[name] for run in record["process_mean_ms"]]
        assert len(runs) == 3 and record["mean_ms"][name] == pytest.approx(sorted(runs)[1])
    assert len(result["prefill"]["process_median_s"]) == 3
    row = result["summary"]["decode_context_6_batch_1"]
    assert len(row["favor_speedup_by_process"]) == 3
    assert "medians of 3 fresh-process runs" in format_generation_table(result)


def test_decode_medians_over_fresh_processes(folder):
    result = run_decode_benchmark_in_processes(
        "hf_performer.bench.decode_converted:run_converted_decode_benchmark", 2, model_path=str(folder),
        context_lengths=[8], repeats=2, warmup=1, prefill_chunk=5, verify_context=0)
    for record in result["records"]:
        runs = record["process_seconds_per_token"]
        assert len(runs) == 2 and record["seconds_per_token"] == pytest.approx(sum(runs) / 2)
        assert len(record["seconds_all"]) == 4  # every timed step of both runs
    assert result["settings"]["processes"] == 2
    assert len(result["summary"]["softmax_over_favor_latency_at_longest"]["by_process"]) == 2
    assert "medians of 2 fresh-process runs" in format_decode_table(result)


def test_generation_refuses_bad_arguments(folder, capsys):
    for argv, message in ((["--context-lengths", "a,b"], "comma-separated"),
                          (["--batch", "0"], ">= 1"),
                          (["--prefill-length", "-1"], ">= 0")):
        with pytest.raises(SystemExit) as error:
            main(["bench", "generation", str(folder), *argv])
        assert message in str(error.value) + capsys.readouterr().err
    with pytest.raises(SystemExit, match="no config.json"):
        main(["bench", "generation", str(folder.parent)])
