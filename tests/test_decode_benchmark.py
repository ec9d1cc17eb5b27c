"""Quick test of the constant-memory decode benchmark (``hf-performer bench decode``) at a tiny geometry."""

import json

import pytest

from hf_performer import cli
from hf_performer.bench.decode import run_decode_benchmark
from hf_performer.bench.defaults import DECODE_IMPLEMENTATIONS as IMPLEMENTATIONS
from hf_performer.bench.report import format_decode_table, plot_decode, write_result

LAYERS, HEADS, EMBD, FEATURES, BATCH = 2, 2, 32, 16, 2


@pytest.fixture(scope="module")
def result():
    return run_decode_benchmark(
        context_lengths=(64, 16), batch=BATCH, repeats=2, warmup=1, n_layer=LAYERS, n_head=HEADS, n_embd=EMBD,
        vocab_size=97, favor_settings={"nb_features": FEATURES, "chunk_size": 8}, verify_context=8, progress=False,
    )


def _record(result, context, implementation):
    [record] = [r for r in result["records"] if r["context"] == context and r["implementation"] == implementation]
    return record


def test_records_for_every_length_and_implementation(result):
    assert result["settings"]["context_lengths"] == [16, 64]
    assert len(result["records"]) == 4
    for context in (16, 64):
        for implementation in IMPLEMENTATIONS:
            record = _record(result, context, implementation)
            assert record["seconds_per_token"] > 0 and len(record["seconds_all"]) == 2
            assert record["logits_shape"] == [BATCH, 1, 97]
            assert record["timed_contexts"] == [context + 1, context + 2]
    assert result["machine"]["cpu_count"] >= 1
    # the shortest-context favor stream is stepped alongside the longer one (paired ratios)
    favor_long = _record(result, 64, "favor")
    assert favor_long["reference"]["context"] == 16 and favor_long["reference"]["timed_contexts"] == [19, 20]
    assert favor_long["paired_ratio_to_shortest"] > 0 and _record(result, 16, "favor")["paired_ratio_to_shortest"] == 1
    assert _record(result, 64, "softmax")["paired_ratio_to_favor"] > 0
    verification = result["verification"]
    assert verification["favor"]["cache_layer_types"] == ["FavorCacheLayer"]
    assert verification["softmax"]["cache_layer_types"] == ["DynamicLayer"]


def test_favor_cache_is_constant_and_softmax_cache_grows(result):
    head_dim = EMBD // HEADS
    favor = [_record(result, n, "favor")["cache_bytes"] for n in (16, 64)]
    softmax = [_record(result, n, "softmax")["cache_bytes"] for n in (16, 64)]
    # kv [B, H, m, d] + k_sum [B, H, m] + stabilizer [B, H], float32, per layer
    assert favor == [LAYERS * BATCH * HEADS * (FEATURES * head_dim + FEATURES + 1) * 4] * 2
    assert softmax == [LAYERS * 2 * BATCH * HEADS * n * head_dim * 4 for n in (16, 64)]
    assert _record(result, 64, "favor")["cache_bytes_after"] == favor[1]
    decoded = 64 + 1 + 2  # context + warm-up + timed steps
    assert _record(result, 64, "softmax")["cache_bytes_after"] == LAYERS * 2 * BATCH * HEADS * decoded * head_dim * 4
    summary = result["summary"]
    assert summary["favor_cache_bytes_constant"] is True
    for key in ("favor_latency_longest_over_shortest", "softmax_over_favor_latency_at_longest"):
        assert isinstance(summary[key]["met"], bool) and summary[key]["value"] > 0


def test_json_png_and_table(result, tmp_path):
    paths = write_result(result, tmp_path, "decode", plot_decode)
    assert [p.name for p in paths] == ["decode.json", "decode.png"]
    assert json.loads(paths[0].read_text())["summary"] == json.loads(json.dumps(result["summary"]))
    assert paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = format_decode_table(result)
    assert "favor latency at 64 / at 16" in table and "softmax / favor latency at 64" in table


def test_cli_subcommand():
    args = cli.build_parser().parse_args(
        ["bench", "decode", "--context-lengths", "16,64", "--batch", "2", "--repeats", "2", "--name", "x"]
    )
    assert (args.context_lengths, args.batch, args.repeats, args.name, args.dtype) == ([16, 64], 2, 2, "x", "float32")
    assert args.output_dir is None and callable(args.func)
