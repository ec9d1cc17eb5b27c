"""The ``hf-performer`` entry point: a fast top-level ``--help`` and one-line errors."""

import argparse
import os
import subprocess
import sys
import textwrap

import pytest

from hf_performer import cli
from hf_performer.bench import attention


@pytest.fixture(autouse=True)
def idle_machine(monkeypatch):
    """No "machine is loaded" warning from the benchmark verbs: these tests count stderr lines."""
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))


def _run_console_script(*arguments: str) -> subprocess.CompletedProcess:
    """Run ``hf-performer ARGUMENTS`` as the installed console script does (``sys.argv[0]`` names the script when the
    package is imported) and print, last, which heavy modules the process imported."""
    code = textwrap.dedent(f"""
        import sys
        sys.argv = ["/venv/bin/hf-performer", *{list(arguments)!r}]
        from hf_performer.cli import main
        try:
            status = main()
        except SystemExit as error:
            status = error.code
        print("imported:", sorted(name for name in ("torch", "transformers", "numpy") if name in sys.modules))
        sys.exit(status)
    """)
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120)


def test_top_level_help_imports_neither_torch_nor_transformers():
    result = _run_console_script("--help")
    assert result.returncode == 0, result.stderr
    for name, help_text, _ in cli.VERBS:
        assert name in result.stdout
    assert "--debug" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "imported: []"


@pytest.mark.parametrize("verb,expected", [("results", "collect"), ("evaluate", "--validation-file"),
                                           ("push", "--dry-run"), ("card", "--base-model"),
                                           ("convert", "--feature-map"), ("distill", "--loss"),
                                           ("quickstart", "--lengths"), ("linearize", "--train-file"),
                                           ("bench", "BENCHMARK")])
def test_verb_help_imports_neither_torch_nor_transformers(verb, expected):
    result = _run_console_script(verb, "--help")
    assert result.returncode == 0 and expected in result.stdout, result.stderr
    assert "torch" not in result.stdout.strip().splitlines()[-1]
    assert "transformers" not in result.stdout.strip().splitlines()[-1]


def test_every_parser_and_help_text_is_built_without_torch():
    """Every ``--help`` is fast (under 0.5 s on a loaded 2-core machine, where importing torch alone takes 1-2 s):
    building every verb's parser and formatting every help text, the recipes' parsers too, imports no torch,
    transformers or matplotlib."""
    code = textwrap.dedent("""
        import argparse, sys
        sys.argv = ["/venv/bin/hf-performer"]
        from hf_performer.cli import build_parser
        from hf_performer.recipes.arguments import KINDS, build_parser as recipe_parser

        def helps(parser):
            yield parser.format_help()
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    for child in action.choices.values():
                        yield from helps(child)

        texts = [*helps(build_parser()), *(recipe_parser(kind).format_help() for kind in KINDS)]
        assert len(texts) > 15, len(texts)
        print(sorted(name for name in ("torch", "transformers", "matplotlib", "accelerate") if name in sys.modules))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_torch_free_declarations_match_what_the_runtime_registers():
    from hf_performer import favor_schema, feature_maps
    from hf_performer.modeling_performer import PERFORMER_CLASSES_BY_TASK

    builtin_modules = {feature_maps.__name__, feature_maps.__name__ + "_learned"}  # the random and the learned maps
    registered_here = sorted(name for name, factory in feature_maps.FEATURE_MAPS.items()
                             if getattr(factory, "__module__", None) in builtin_modules)
    assert list(favor_schema.BUILTIN_FEATURE_MAPS) == registered_here
    assert favor_schema.PERFORMER_TASKS == tuple(PERFORMER_CLASSES_BY_TASK)
    assert feature_maps.LearnedFeatureMap.default_init == favor_schema.LEARNED_MAP_DEFAULT_INIT


def test_a_verb_that_runs_finds_the_runtime_imported(tmp_path):
    # As in a library session: the "favor" attention and the Performer Auto classes registered.
    result = _run_console_script("results", "table", str(tmp_path / "missing.json"))
    assert result.returncode == 2
    assert "torch" in result.stdout.strip().splitlines()[-1] and "transformers" in result.stdout


def test_verb_table_matches_the_verbs_parsers():
    parser = cli.build_parser()
    subparsers = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    registered = {choice.dest: choice.help for choice in subparsers._choices_actions}
    assert registered == {name: help_text for name, help_text, _ in cli.VERBS}


def test_an_exception_deep_inside_a_verb_is_one_line_with_status_2(capsys, monkeypatch):
    # An error raised inside the benchmark, not in the parser or the checks of its arguments.
    def run_speed_benchmark(**settings):
        raise RuntimeError(f"cannot measure on {settings['device']}")

    monkeypatch.setattr(attention, "run_speed_benchmark", run_speed_benchmark)
    monkeypatch.setattr("hf_performer.bench.machine.check_device", lambda device: device)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "attention", "--device", "nosuchdevice", "--lengths", "16"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("hf-performer bench: error: RuntimeError: ") and "nosuchdevice" in lines[0]
    assert lines[0].endswith(cli.DEBUG_HINT) and "Traceback" not in captured.err

    for arguments in (["--debug", "bench", "attention"], ["bench", "attention", "--debug"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([*arguments, "--device", "nosuchdevice", "--lengths", "16"])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err
        assert "Traceback (most recent call last)" in error and "run_speed_benchmark" in error
        assert error.strip().splitlines()[-1].startswith("hf-performer bench: error: RuntimeError: ")


def test_a_system_exit_message_is_one_line_with_status_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["results", "table", str(tmp_path / "missing.json")])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hf-performer results table: error: ") and "missing.json" in lines[0]
    # argparse's own usage errors and --help keep their messages and status.
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "attention", "--lengths", "x"])
    assert exit_info.value.code == 2 and "expected comma-separated integers" in capsys.readouterr().err


def test_interrupt_is_one_line_with_status_130(monkeypatch, capsys):
    def interrupted(**_):
        raise KeyboardInterrupt

    monkeypatch.setattr(attention, "run_speed_benchmark", interrupted)
    assert cli.main(["bench", "attention"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["hf-performer bench: interrupted"]


def test_favor_flags_have_one_spelling_across_the_verbs_and_the_recipes():
    from hf_performer.cli.arguments import FAVOR_FLAGS
    from hf_performer.recipes.arguments import build_parser as recipe_parser

    parsers = {"recipes": recipe_parser("text-classification")}
    for verb in ("convert", "distill", "quickstart"):
        parser = cli.build_parser(verb)
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parsers[verb] = subparsers.choices[verb]
    spellings = {flag.flag for flag in FAVOR_FLAGS.values()}
    for name, parser in parsers.items():
        favor = {option for option in parser._option_string_actions
                 if parser._option_string_actions[option].dest in {f.dest for f in FAVOR_FLAGS.values()}}
        assert favor - spellings <= {"--seed", "--no-linear-tail"}, name  # the deprecated aliases only
    args = cli.build_parser("convert").parse_args(["convert", "src", "out", "--favor-seed", "3", "--projection", "iid"])
    assert args.favor_seed == 3 and args.projection == "iid"


def test_a_deprecated_flag_spelling_warns_once_and_still_works(capsys):
    args = cli.build_parser("convert").parse_args(["convert", "src", "out", "--seed", "5"])
    assert args.favor_seed == 5
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--seed is deprecated" in lines[0] and "use --favor-seed" in lines[0]
    # Not given: no warning, the default.
    assert cli.build_parser("convert").parse_args(["convert", "src", "out"]).favor_seed is None
    assert capsys.readouterr().err == ""


def test_the_favor_arguments_module_is_a_leaf():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(cli.__file__).with_name("arguments.py").read_text())
    imported = {(node.level, node.module) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {(0, alias.name) for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert imported <= {(0, "__future__"), (0, "argparse"), (0, "json"), (0, "sys"), (0, "dataclasses"),
                        (2, "favor_schema")}


def test_documented_entry_points_keep_working():
    """Issue 14: the public names plus the conversion entry points (lazily), and the old recipes path (deprecated)."""
    import importlib
    import sys

    import hf_performer
    from hf_performer.conversion.attention_transfer import transfer_attention
    from hf_performer.conversion.convert import convert_to_performer
    from hf_performer.conversion.fidelity import fidelity_report
    from hf_performer.hub import build_model_card  # noqa: F401 - a documented path
    from hf_performer.recipes import train as recipes_train

    assert hf_performer.convert_to_performer is convert_to_performer
    assert hf_performer.fidelity_report is fidelity_report
    assert hf_performer.transfer_attention is transfer_attention
    assert all(hasattr(hf_performer, name) for name in hf_performer.__all__)
    sys.modules.pop("hf_performer.training", None)
    with pytest.warns(FutureWarning, match="hf_performer.recipes"):
        training = importlib.import_module("hf_performer.training")
    assert training.train is recipes_train.train and training.main is recipes_train.main


@pytest.mark.parametrize("arguments,message", [
    (["attention", "--lengths", "-64"], "--lengths must be integers >= 1, got -64"),
    (["attention", "--lengths", "0,512"], "--lengths must be integers >= 1, got 0"),
    (["attention", "--lengths", ""], "--lengths is empty"),
    (["attention", "--heads", "0"], "--heads must be an integer >= 1, got 0"),
    (["attention", "--repeats", "0"], "--repeats must be an integer >= 1, got 0"),
    (["attention", "--window", "-1"], "--window must be an integer >= 0, got -1"),
    (["memory", "--batch", "0"], "--batch must be an integer >= 1"),
    (["approximation", "--seeds", "0"], "--seeds must be an integer >= 1"),
    (["decode", "--context-lengths", "-5"], "--context-lengths must be integers >= 1"),
    (["decode", "--device", "nonsense"], "--device nonsense: not a torch device name"),
    (["model", "a", "--repeats", "0"], "--repeats must be an integer >= 1"),
    (["attention", "--implementations", "clustered", "--modes", "causal"], "none of --implementations clustered runs "
     "in --modes causal (clustered, improved-clustered, lsh are bidirectional only, window-cache causal only)"),
    (["memory", "--implementations", "window-cache", "--modes", "bidirectional"], "none of --implementations"),
])
def test_bench_sizes_are_checked_before_any_work_in_one_line(arguments, message, capsys):
    with pytest.raises(cli.CommandFailed) as failure:
        cli.main(["bench", *arguments])
    line = str(failure.value)
    assert message in line and "\n" not in line and line.startswith(f"hf-performer bench {arguments[0]}: error:")
    assert capsys.readouterr().out == ""


def test_bench_refuses_a_cuda_device_this_torch_does_not_have():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    with pytest.raises(cli.CommandFailed, match="--device cuda: .*use --device cpu"):
        cli.main(["bench", "attention", "--device", "cuda"])


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (a folder no one can write in, root included)")
def test_an_unwritable_output_is_refused_before_any_work_even_as_root(capsys):
    """Permission bits say nothing to root: the check writes (and removes) a probe file; /proc refuses it for anyone."""
    with pytest.raises(cli.CommandFailed, match="--output /proc/metrics.json: /proc is not writable") as failure:
        cli.main(["evaluate", "no-such-model", "--task", "sst2", "--output", "/proc/metrics.json"])
    assert "\n" not in str(failure.value) and capsys.readouterr().out == ""


@pytest.mark.parametrize("verb,extra", [
    ("convert", []), ("linearize", ["out", "--train-file", __file__, "--eval-file", __file__]),
    ("budget", ["out", "--cache-budget", "10%", "--text-file", __file__]), ("settings", ["out", "--window", "8"]),
    ("evaluate", ["--task", "sst2", "--validation-file", __file__]), ("quickstart", [])])
def test_a_source_that_cannot_load_is_named_for_what_it_is_at_once(verb, extra, tmp_path, monkeypatch):
    """A missing folder, a folder without config.json, and a Hub name neither cached nor reachable: one line each,
    before any network retry (the Hub probe is one connection attempt; here it fails at once)."""
    import socket

    from huggingface_hub import constants

    def unreachable(*args, **kwargs):
        raise OSError(-2, "Name or service not known")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # CI runs offline: that case is below
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "empty").mkdir()
    cases = {str(tmp_path / "missing"): "no such folder; SOURCE must be",
             str(tmp_path / "empty"): "the folder has no config.json",
             "no-such-namespace/no-such-model": "not in the local Hugging Face cache, and the Hub is unreachable: "
                                                "cannot reach huggingface.co"}
    if verb == "convert":
        extra = [str(tmp_path / "out")]
    for source, message in cases.items():
        arguments = [verb, source, *extra]
        if verb in ("linearize", "budget", "settings"):
            arguments[2] = str(tmp_path / "out")
        with pytest.raises((SystemExit, cli.CommandFailed)) as failure:
            cli.main(arguments)
        text = str(failure.value)
        assert message in text and "\n" not in text, (verb, source, text)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    arguments = [verb, "no-such-namespace/no-such-model", *extra]
    if verb in ("linearize", "budget", "settings"):
        arguments[2] = str(tmp_path / "out")
    with pytest.raises((SystemExit, cli.CommandFailed), match="the Hub is unreachable: offline mode is on"):
        cli.main(arguments)
    assert not (tmp_path / "out").exists()
