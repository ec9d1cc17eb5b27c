"""Quick test of ``hf-performer bench decode --model FOLDER`` on a tiny converted Llama with window layers."""

import json

import pytest
import torch
from conftest import tiny_llama_config
from transformers import LlamaForCausalLM

from hf_performer import convert_to_performer
from hf_performer.bench.decode_converted import run_converted_decode_benchmark
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
    # the record is JSON (the state's plain tuples, e.g. the pending tail sums, described by index)
    assert "pending.0" in result["verification"]["favor"]["cache_layers"][0]["tensors"]
    json.dumps(result)


def test_contexts_below_the_full_buffer_are_refused(folder):
    with pytest.raises(ValueError, match=r"context lengths must be >= sinks \+ 2 x window = 7"):
        run_converted_decode_benchmark(folder, context_lengths=(6,), progress=False)
