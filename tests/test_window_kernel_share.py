"""Quick test of benchmarks/scripts/window_kernel_share.py at a tiny length."""

import pytest
import torch
from conftest import benchmark_script

from hf_performer import window_exact_blocks


def test_the_kernels_are_timed_inside_the_call(capsys):
    script = benchmark_script("window_kernel_share")
    args = script.parse_args(["--lengths", "96", "--heads", "2", "--window", "8", "--sinks", "1", "--sparse-cache",
                              "4", "--repeats", "1", "--threads", "1"])
    clock = script.KernelClock(torch)
    window_exact_blocks.torch = clock
    try:
        row = script.measure(96, args, torch, clock)
    finally:
        window_exact_blocks.torch = torch
    seconds = row["median_s"]
    assert 0 < seconds["kernels"] < seconds["window"] and 0 < row["kernel_share"] < 1
    assert row["sdpa_over_kernels"] > row["sdpa_over_window"] > 0
    assert script.main(["--lengths", "64", "--heads", "2", "--window", "8", "--sparse-cache", "4", "--repeats", "1",
                        "--threads", "1"]) == 0
    assert "L 64: window-cache" in capsys.readouterr().out
    assert window_exact_blocks.torch is torch  # put back


def test_window_kernel_share_refuses_bad_arguments(capsys):
    script = benchmark_script("window_kernel_share")
    for argv, message in ((["--lengths", "4,x"], "comma-separated ints"), (["--repeats", "0"], ">= 1")):
        with pytest.raises(SystemExit):
            script.parse_args(argv)
        assert message in capsys.readouterr().err
