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
