"""The attention benchmark's summary (``hf-performer bench attention``): crossover length and the load warning."""

import os

import pytest

from hf_performer.cli import bench
from hf_performer.bench import machine
from hf_performer.bench.report import crossover_length, format_speed_table, summarize_speed


def _rows(mode, speedups):
    """Synthetic records: SDPA takes 1 s at every length, FAVOR+ ``1 / speedup`` s."""
    rows = []
    for length, speedup in speedups.items():
        rows.append(dict(length=length, mode=mode, implementation="sdpa", seconds=1.0, gflops_per_s=1.0))
        rows.append(dict(length=length, mode=mode, implementation="favor", seconds=1.0 / speedup, gflops_per_s=1.0))
    return rows


def test_crossover_is_where_favor_stays_ahead_not_a_first_lucky_length():
    # The reported case: ahead at 512 (noise), behind at 1024 and 2048: FAVOR+ never stays ahead.
    assert crossover_length(_rows("causal", {512: 1.1, 1024: 0.8, 2048: 0.9}), "causal") is None
    # Ahead at 512, behind at 1024, ahead from 2048 on: the crossing between 1024 and 2048 counts.
    value = crossover_length(_rows("causal", {512: 1.1, 1024: 0.5, 2048: 2.0, 4096: 4.0}), "causal")
    assert 1024 < value < 2048 and value == pytest.approx(1448.15, rel=1e-4)  # log-log midpoint of 0.5 -> 2.0
    # Ahead everywhere: the first measured length; behind everywhere: None.
    assert crossover_length(_rows("causal", {512: 1.5, 1024: 2.0}), "causal") == 512.0
    assert crossover_length(_rows("causal", {512: 0.5, 1024: 0.9}), "causal") is None
    # Rows given in any order.
    rows = _rows("causal", {2048: 2.0, 512: 1.1, 1024: 0.5})
    assert 1024 < crossover_length(rows, "causal") < 2048


def test_summary_line_says_none_when_favor_never_stays_ahead():
    rows = _rows("causal", {512: 1.1, 1024: 0.8, 2048: 0.9}) + _rows("bidirectional", {512: 0.5, 1024: 2.0})
    result = {"records": rows, "matmul_gflops_per_s": 1.0, "machine": {"device_name": "cpu", "torch_threads": 1}}
    result["summary"] = summarize_speed(result)
    line = next(line for line in format_speed_table(result).splitlines() if line.startswith("crossover"))
    assert "causal: none" in line and "bidirectional: 724" in line


def test_crossover_per_implementation_only_for_what_was_measured():
    rows = [{**row, "implementation": "window"} if row["implementation"] == "favor" else row
            for row in _rows("causal", {4096: 1.3, 8192: 2.3})]
    result = {"records": rows, "matmul_gflops_per_s": 1.0, "machine": {"device_name": "cpu", "torch_threads": 1}}
    result["summary"] = summarize_speed(result)
    assert result["summary"]["crossover_length_vs_sdpa_by_implementation"] == {"window": {"causal": 4096.0}}
    lines = [line for line in format_speed_table(result).splitlines() if line.startswith("crossover")]
    assert lines == ["crossover length (window hybrid faster than SDPA at every longer measured length from): "
                     "causal: 4096"]


def test_load_warning_when_the_machine_is_busy(monkeypatch):
    cores = os.cpu_count()
    monkeypatch.setattr(os, "getloadavg", lambda: (0.6 * cores, 0.0, 0.0))
    warning = machine.machine_load_warning()
    assert warning is not None and "\n" not in warning and "noisy" in warning and f"{cores} cores" in warning
    monkeypatch.setattr(os, "getloadavg", lambda: (0.4 * cores, 9.0, 9.0))
    assert machine.machine_load_warning() is None


def test_bench_attention_prints_the_load_warning(monkeypatch, capsys):
    monkeypatch.setattr(os, "getloadavg", lambda: (4.0 * os.cpu_count(), 0.0, 0.0))
    assert bench.run_speed(benchmark_args(lengths=[16])) == 0
    captured = capsys.readouterr()
    assert [line for line in captured.err.splitlines() if "noisy" in line] == [machine.machine_load_warning()]


def benchmark_args(**overrides):
    from hf_performer.cli import build_parser

    args = build_parser("bench").parse_args(["bench", "attention", "--repeats", "1", "--no-memory",
                                             "--heads", "1", "--head-dim", "8", "--nb-features", "8"])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def test_bench_result_records_the_command_line_without_local_paths(monkeypatch, tmp_path):
    import json
    import sys

    from hf_performer.cli import main

    output = tmp_path / "results"
    output.mkdir()
    arguments = ["bench", "attention", "--lengths", "16", "--repeats", "1", "--no-memory", "--heads", "1",
                 "--head-dim", "8", "--nb-features", "8", "--output-dir", str(output), "--name", "speed"]
    monkeypatch.setattr(sys, "argv", ["hf-performer", *arguments])
    assert main(arguments) == 0
    record = json.loads((output / "speed.json").read_text())
    assert record["command"] == ("hf-performer bench attention --lengths 16 --repeats 1 --no-memory --heads 1 "
                                 "--head-dim 8 --nb-features 8 --output-dir results --name speed")
    assert str(tmp_path) not in (output / "speed.json").read_text()
    # Called from Python with its own argv (not as `hf-performer bench ...`): no command is claimed.
    monkeypatch.setattr(sys, "argv", ["pytest"])
    assert main(arguments) == 0
    assert json.loads((output / "speed.json").read_text())["command"] is None


def test_run_in_fresh_process_returns_the_value_or_the_childs_last_error_line():
    assert machine.run_in_fresh_process("json:loads", s="[1, 2]") == [1, 2]
    with pytest.raises(machine.FreshProcessError, match="JSONDecodeError"):
        machine.run_in_fresh_process("json:loads", s="{")


@pytest.mark.parametrize("mode", ["causal", "bidirectional"])
def test_window_row_times_the_hybrid_operator_with_a_hedgehog_tail(mode):
    # The benchmark's "window" call is the sink + sliding-window operator with the learned (Hedgehog) tail and
    # gamma, as the trained hybrids run it: its output is the float64 reference's on the same map.
    import torch

    from hf_performer.bench.attention import WINDOW_GAMMA, make_attention_call
    from hf_performer.feature_maps import make_feature_map
    from hf_performer.reference import reference_window_linear_attention

    torch.manual_seed(0)
    call = make_attention_call("window", mode, 8, 16, 4, torch.device("cpu"), window=3, sinks=1, heads=2)
    q, k, v = (torch.randn(1, 2, 11, 8, dtype=torch.float64) for _ in range(3))
    feature_map = make_feature_map("hedgehog", 8, num_heads=2).double()  # same identity start as the benchmark's
    expected = reference_window_linear_attention(q, k, v, feature_map, window=3, sinks=1, causal=mode == "causal",
                                                 softmax_weight=torch.full((2,), WINDOW_GAMMA, dtype=torch.float64))
    torch.testing.assert_close(call(q.float(), k.float(), v.float()).double(), expected, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="needs heads="):
        make_attention_call("window", mode, 8, 16, 4, torch.device("cpu"))


def test_window_cache_row_is_the_causal_no_tail_configuration_with_a_sparse_cache():
    # "window-cache": sinks + window + a sparse cache of DEFAULT_SPARSE_CACHE keys, no tail (the causal-LM
    # configuration), causal only: the float64 reference's output; a bidirectional call is refused in one line, and
    # the speed benchmark skips it in bidirectional mode.
    import torch

    from hf_performer.bench.attention import make_attention_call, run_speed_benchmark
    from hf_performer.bench.defaults import DEFAULT_SPARSE_CACHE
    from hf_performer.reference import reference_window_linear_attention

    torch.manual_seed(0)
    call = make_attention_call("window-cache", "causal", 8, 16, 4, torch.device("cpu"), window=3, sinks=1, heads=2)
    q, k, v = (torch.randn(1, 2, 11, 8, dtype=torch.float64) for _ in range(3))
    expected = reference_window_linear_attention(q, k, v, None, window=3, sinks=1, causal=True,
                                                 sparse_cache=DEFAULT_SPARSE_CACHE, chunk_size=4)
    torch.testing.assert_close(call(q, k, v), expected, atol=1e-10, rtol=1e-9)
    with pytest.raises(ValueError, match="causal only"):
        make_attention_call("window-cache", "bidirectional", 8, 16, 4, torch.device("cpu"))
    result = run_speed_benchmark(lengths=(32,), heads=2, head_dim=8, nb_features=16, chunk_size=8, repeats=1,
                                 implementations=("window-cache", "sdpa"), window=4, sinks=2, memory=False,
                                 progress=False)
    assert {(r["implementation"], r["mode"]) for r in result["records"]} == {
        ("window-cache", "causal"), ("sdpa", "causal"), ("sdpa", "bidirectional")}
    assert result["settings"]["sparse_cache"] == DEFAULT_SPARSE_CACHE and "window-cache" in format_speed_table(result)


def test_speed_benchmark_window_rows_with_memory_and_their_speedup_over_sdpa():
    from hf_performer.bench.attention import run_speed_benchmark

    result = run_speed_benchmark(lengths=(32,), heads=2, head_dim=8, nb_features=16, chunk_size=8, repeats=1,
                                 implementations=("window", "sdpa"), modes=("causal",), window=4, sinks=2,
                                 progress=False)  # (memory: a fresh process per point, so one mode)
    rows = {(r["implementation"], r["mode"]): r for r in result["records"]}
    assert set(rows) == {(impl, "causal") for impl in ("window", "sdpa")}
    assert all(r["flops"] > 0 and r["peak_memory_bytes"] >= 0 for r in rows.values())
    settings = result["settings"]
    assert (settings["window"], settings["sinks"], settings["window_feature_map"]) == (4, 2, "hedgehog")
    by_impl = result["summary"]["speedup_vs_sdpa_by_implementation"]["window"]
    assert by_impl["causal"]["32"] == pytest.approx(rows[("sdpa", "causal")]["seconds"] / rows[("window", "causal")]["seconds"])
    assert "window" in format_speed_table(result)


def test_each_speed_point_keeps_every_timed_call_beside_its_median():
    """The spread of a point is in its record: the seconds of each timed call, whose median is the point."""
    import statistics

    from hf_performer.bench.attention import run_speed_benchmark

    result = run_speed_benchmark(lengths=(32,), heads=2, head_dim=8, nb_features=16, chunk_size=8, repeats=3,
                                 implementations=("favor", "sdpa"), modes=("causal",), memory=False, progress=False)
    for record in result["records"]:
        assert len(record["runs"]) == 3 and all(t > 0 for t in record["runs"])
        assert record["seconds"] == pytest.approx(statistics.median(record["runs"]), abs=1e-6)


def test_processes_give_each_point_the_median_of_whole_runs_in_fresh_processes(monkeypatch):
    """``--processes N``: N whole runs, each in its own process; a point's seconds is the median of the runs' medians,
    and every run's figure and timed calls stay in the record."""
    from hf_performer.bench import attention, machine

    seen = []

    def fake_fresh_process(target, **arguments):
        seen.append((target, arguments["progress"]))
        run = len(seen)
        records = [dict(length=32, mode="causal", implementation=name, seconds=base * run, flops=1e9,
                        gflops_per_s=1.0 / (base * run), runs=[base * run] * 2)
                   for name, base in (("favor", 1.0), ("sdpa", 2.0))]
        return {"settings": {"repeats": 2}, "machine": {"date": f"run {run}", "load_average": [0.1, 0.1, 0.1]},
                "records": records}

    monkeypatch.setattr(machine, "run_in_fresh_process", fake_fresh_process)
    result = attention.run_speed_benchmark_in_processes(3, lengths=[32], implementations=["favor", "sdpa"])
    assert seen == [("hf_performer.bench.attention:run_speed_benchmark", False)] * 3
    favor = next(r for r in result["records"] if r["implementation"] == "favor")
    assert favor["process_seconds"] == [1.0, 2.0, 3.0] and favor["seconds"] == 2.0 and len(favor["runs"]) == 6
    assert result["settings"]["processes"] == 3 and [run["date"] for run in result["machine"]["runs"]] == \
        ["run 1", "run 2", "run 3"]
    assert "summary" in result


def test_memory_summary_per_implementation_and_its_table():
    from hf_performer.bench.report import format_memory_table, summarize_memory

    mib = 2**20
    records = [dict(length=length, mode="causal", implementation=impl, peak_memory_bytes=value * mib)
               for length, values in ((2048, (30, 90, 40)), (4096, (60, 200, 70)))
               for impl, value in zip(("favor", "window", "sdpa"), values)]
    summary = summarize_memory({"records": records})
    assert summary["favor_over_sdpa"] == {"causal": {"2048": 0.75, "4096": pytest.approx(60 / 70)}}
    assert summary["over_sdpa_by_implementation"]["window"] == {"causal": {"2048": 2.25, "4096": pytest.approx(200 / 70)}}
    assert summary["at_most_sdpa_from_4096_by_implementation"] == {"favor": {"causal": True},
                                                                   "window": {"causal": False}}
    table = format_memory_table({"records": records, "summary": summary})
    assert "window hybrid at most SDPA's extra peak at every L >= 4096: causal: False" in table
    assert "  4096 causal        window       200.0      70.0   2.86" in table


def test_memory_table_and_plot_without_an_sdpa_point(tmp_path):
    # `bench memory --implementations window-cache` alone: the points are printed and drawn, the ratios left out
    # (the plot used to fail on its empty ratio panel after the measurement).
    from hf_performer.bench.report import format_memory_table, plot_memory, summarize_memory

    records = [dict(length=length, mode="causal", implementation="window-cache", peak_memory_bytes=value * 2**20)
               for length, value in ((4096, 150), (8192, 220))]
    result = {"records": records, "settings": dict(batch=1, heads=12, head_dim=64, dtype="float32"),
              "machine": {"device_name": "CPU"}}
    result["summary"] = summarize_memory(result)
    table = format_memory_table(result)
    assert "  8192 causal        window-cache     220.0         -      -" in table
    assert "add sdpa to --implementations" in table and "at most SDPA's" not in table
    plot_memory(result, tmp_path / "memory.png")
    assert (tmp_path / "memory.png").stat().st_size > 0
    records.append(dict(length=4096, mode="causal", implementation="sdpa", peak_memory_bytes=75 * 2**20))
    result["summary"] = summarize_memory(result)
    table = format_memory_table(result)
    assert "  4096 causal        window-cache     150.0      75.0   2.00" in table
    assert "  8192 causal        window-cache     220.0         -      -" in table
    assert "add sdpa" not in table
    plot_memory(result, tmp_path / "memory.png")


def test_memory_benchmark_takes_the_median_of_fresh_processes(monkeypatch):
    import hf_performer.bench.attention as attention

    figures = iter([100, 300, 10, 200, 50, 20, 150, 250, 30])  # rounds of (window, window-cache, sdpa) at one length
    calls = []
    monkeypatch.setattr(attention, "peak_memory_bytes",
                        lambda implementation, *args: (calls.append(implementation), next(figures))[1])
    result = attention.run_memory_benchmark(lengths=(64,), heads=2, head_dim=8, modes=("causal",),
                                            implementations=("window", "window-cache", "sdpa"), repeats=3,
                                            progress=False)
    assert calls == ["window", "window-cache", "sdpa"] * 3  # rounds interleaved
    by_implementation = {r["implementation"]: r for r in result["records"]}
    assert by_implementation["window"] == dict(length=64, mode="causal", implementation="window",
                                               peak_memory_bytes=150, runs=[100, 200, 150])
    assert by_implementation["sdpa"]["peak_memory_bytes"] == 20 and result["settings"]["repeats"] == 3
    assert result["summary"]["over_sdpa_by_implementation"]["window-cache"] == {"causal": {"64": 250 / 20}}
