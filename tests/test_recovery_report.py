"""``hf-performer results``: collect synthetic runs (in the recipe's and ``evaluate``'s real JSON layouts), the
issue 4 target check, the recovery plot, the markdown table and the README marker replacement."""

import json
from pathlib import Path

import pytest

from hf_performer import recovery_report
from hf_performer.cli import main as cli_main
from hf_performer.recovery_report import README_END, README_START, ResultsError

BASE = "/models/minilm"


def _args(model: str, output_dir: str, attention: str, seed: int = 42, **extra) -> dict:
    """``args`` as the recipe records them (``_json_safe_config``: None and lists as strings)."""
    args = {
        "model": model, "tokenizer": "None", "attention": attention, "convert": "None", "feature_map": "favor+",
        "nb_features": "None", "keep_softmax_layers": "[]", "favor_seed": "None", "redraw_interval": "None",
        "max_position_embeddings": "None", "lora": False, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.05,
        "lora_target_modules": "None", "task": "sst2", "train_file": "data/train.tsv",
        "validation_file": "data/dev.tsv", "max_length": 64, "metrics_backend": "auto", "max_train_samples": 800,
        "max_eval_samples": "None", "output_dir": output_dir, "seed": seed, "learning_rate": 5e-05,
        "weight_decay": 0.01, "lr_scheduler": "linear", "warmup_ratio": 0.06, "warmup_steps": "None",
        "per_device_train_batch_size": 32, "per_device_eval_batch_size": 64, "gradient_accumulation_steps": 1,
        "num_train_epochs": 1.0, "max_train_steps": "None", "max_grad_norm": 1.0, "mixed_precision": "None",
        "eval_steps": 10, "logging_steps": 10, "checkpointing_steps": "None", "resume_from_checkpoint": "None",
        "report_to": "none", "num_workers": 0, "no_save_model": False, "kind": "text-classification",
    }
    args.update(extra)
    return args


def _training_run(folder: Path, accuracies: list[float], attention: str, model: str, converted: bool,
                  seed: int = 42, **extra_args) -> Path:
    folder.mkdir(parents=True)
    curve = [{"step": 10 * (i + 1), "epoch": 0, "accuracy": acc, "eval_loss": 1.0 - acc, "train_loss": 0.5}
             for i, acc in enumerate(accuracies)]
    favor = {"feature_map": "favor+", "nb_features": 256, "redraw_interval": 0, "seed": 0} if attention == "favor" \
        else None
    metrics = {
        "kind": "text-classification", "task": "sst2",
        "model": {"source": model, "attention": attention, "converted": converted, "favor_settings": favor},
        "main_metric": "accuracy",
        "final": {"accuracy": accuracies[-1], "eval_loss": 1.0 - accuracies[-1]},
        "completed_steps": 10 * len(accuracies), "epochs": 1, "train_loss_first": 0.69, "train_loss_last": 0.3,
        "train_examples": 800, "eval_examples": 872, "perplexity_protocol": None, "metrics_backend": "local",
        "metrics_note": None, "trainable_parameters": 10, "total_parameters": 10, "lora": False,
        "mixed_precision": "no", "num_processes": 1, "device": "cpu", "wall_time_s": 123.45, "resumed_from": None,
        "args": _args(model, str(folder), attention, seed, **extra_args),
    }
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2))
    (folder / "eval_curve.json").write_text(json.dumps(curve, indent=2))
    return folder


@pytest.fixture()
def runs(tmp_path: Path) -> dict[str, str]:
    a = _training_run(tmp_path / "a_softmax", [0.78, 0.81, 0.83], "softmax", BASE, False)
    b = tmp_path / "b_converted"
    b.mkdir()
    (b / "conversion_report.json").write_text(json.dumps(
        {"source": str(a), "favor_settings": {"feature_map": "favor+", "nb_features": 256, "seed": 0}}))
    (b / "dev_metrics.json").write_text(json.dumps({
        "task": "sst2", "model": str(b), "data": "data/dev.tsv", "num_examples": 872, "metrics": {"accuracy": 0.75},
        "main_metric": "accuracy", "eval_loss": 0.53, "metrics_backend": "local", "metrics_note": None,
        "eval_seconds": 14.3, "device": "cpu"}))
    c = _training_run(tmp_path / "c_recovered", [0.79, 0.81, 0.82], "favor", str(b), False, seed=7)
    d = _training_run(tmp_path / "d_favor_direct", [0.70, 0.76, 0.79], "favor", BASE, True,
                      convert=True, nb_features=256)
    return {"a": str(a), "b": str(b), "c": str(c / "metrics.json"), "d": str(d)}


def test_collect_gathers_every_run(runs, tmp_path):
    output = tmp_path / "out" / "recovery_sst2.json"
    argv = ["results", "collect", "--task", "sst2", "--protocol", "synthetic", "--output", str(output),
            "--command", "b=hf-performer evaluate B --task sst2"]
    for label, path in runs.items():
        argv += ["--run", f"{label}={path}"]
    assert cli_main(argv) == 0
    results = json.loads(output.read_text())
    assert results["task"] == "sst2" and results["main_metric"] == "accuracy" and results["protocol"] == "synthetic"
    assert set(results["runs"]) == {"a", "b", "c", "d"}
    assert results["labels"] == recovery_report.LABELS
    assert {"cpu", "torch", "python", "date"} <= set(results["machine"])
    a, b, c, d = (results["runs"][k] for k in "abcd")
    assert a["metric"] == 0.83 and a["steps"] == 30 and a["train_examples"] == 800 and a["seed"] == 42
    assert a["wall_time_s"] == 123.45 and a["metrics_backend"] == "local" and a["kind"] == "fine-tuned"
    assert [p["step"] for p in a["curve"]] == [10, 20, 30] and a["args"]["learning_rate"] == 5e-05
    assert "output_dir" not in a["args"] and a["model"]["attention"] == "softmax"
    # The rebuilt recipe command: non-default options, the required ones and the seed.
    assert a["command"].startswith("python recipes/text_classification.py --model /models/minilm")
    assert "--attention softmax" in a["command"] and "--seed 42" in a["command"]
    assert "--learning-rate" not in a["command"] and "--max-train-samples 800" in a["command"]
    assert "--convert" in d["command"] and "--nb-features 256" in d["command"]
    # (b): an evaluate record found in its folder, with the conversion settings next to it.
    assert b["kind"] == "evaluated" and b["metric"] == 0.75 and b["steps"] == 0 and b["seed"] is None
    assert b["eval_examples"] == 872 and b["wall_time_s"] == 14.3
    assert b["favor_settings"]["nb_features"] == 256 and b["model"]["converted_from"] == runs["a"]
    assert b["command"] == "hf-performer evaluate B --task sst2" and b["command_source"] == "given"
    assert c["seed"] == 7 and c["model"]["favor_settings"]["nb_features"] == 256 and c["metric"] == 0.82
    assert d["model"]["converted"] is True
    # Target: (c) 82.0 vs (a) 83.0 -> 1.0 point gap, within 1.5.
    target = results["target"]
    assert target["met"] is True and target["status"] == "met" and target["gap_points"] == pytest.approx(1.0)
    assert results["notes"] == []


def test_evaluate_command_rebuilt_without_given_command(runs):
    b = recovery_report.load_run("b", runs["b"])
    assert b["command"].startswith("hf-performer evaluate ") and "--validation-file data/dev.tsv" in b["command"]


def test_target_check_not_met_and_missing():
    runs = {"a": {"metric": 0.90}, "c": {"metric": 0.884}}
    check = recovery_report.target_check(runs)
    assert check["met"] is False and check["status"] == "not met" and check["gap_points"] == pytest.approx(1.6)
    assert recovery_report.target_check({"a": {"metric": 0.90}, "c": {"metric": 0.885}})["met"] is True
    better = recovery_report.target_check({"a": {"metric": 0.80}, "c": {"metric": 0.82}})
    assert better["met"] is True and better["gap_points"] == pytest.approx(-2.0)
    missing = recovery_report.target_check({"a": {"metric": 0.9}})
    assert missing["met"] is None and missing["status"] == "not evaluated" and "c" in missing["reason"]


def test_collect_errors(runs, tmp_path):
    with pytest.raises(ResultsError, match="unknown run label"):
        recovery_report.load_run("e", runs["a"])
    with pytest.raises(ResultsError, match="no such file or folder"):
        recovery_report.load_run("a", str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ResultsError, match="holds none of"):
        recovery_report.load_run("a", str(empty))
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"task": "sst2", "final": {"accuracy": 0.8}}))
    with pytest.raises(ResultsError, match="lacks the key"):
        recovery_report.load_run("a", str(broken))
    with pytest.raises(ResultsError, match="not 'imdb'"):
        recovery_report.collect("imdb", {"a": runs["a"]})
    with pytest.raises(ResultsError, match="unknown task"):
        recovery_report.collect("nosuchtask", {"a": runs["a"]})
    with pytest.raises(SystemExit, match="expects LABEL=VALUE"):
        cli_main(["results", "collect", "--task", "sst2", "--run", runs["a"], "--output", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="given twice"):
        cli_main(["results", "collect", "--task", "sst2", "--run", f"a={runs['a']}", "--run", f"a={runs['a']}",
                  "--output", str(tmp_path / "x.json")])


def test_curve_falls_back_to_the_final_point(runs):
    Path(runs["a"], "eval_curve.json").unlink()
    run = recovery_report.load_run("a", runs["a"])
    assert run["curve"] == [{"step": 30, "accuracy": 0.83, "eval_loss": pytest.approx(0.17)}]
    assert "not found" in run["curve_source"]


@pytest.fixture()
def collected(runs, tmp_path) -> Path:
    path = tmp_path / "recovery_sst2.json"
    path.write_text(json.dumps(recovery_report.collect("sst2", runs, "synthetic")))
    return path


def test_plot_writes_png(collected, tmp_path):
    assert cli_main(["results", "plot", str(collected)]) == 0
    png = collected.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    # A subset of the runs plots too.
    results = recovery_report.load_results(str(collected))
    del results["runs"]["a"], results["runs"]["d"]
    other = tmp_path / "sub" / "only_bc.png"
    recovery_report.plot(results, str(other))
    assert other.stat().st_size > 0
    with pytest.raises(SystemExit, match="no such file"):
        cli_main(["results", "plot", str(tmp_path / "missing.json")])


def test_table(collected, capsys):
    assert cli_main(["results", "table", str(collected)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith("| Task | Run | Dev metric | Steps | Train examples |")
    rows = [line for line in lines if line.startswith("| sst2 |")]
    assert len(rows) == 4
    assert "(a) softmax, fine-tuned" in rows[0] and "accuracy 83.00" in rows[0] and "| 30 |" in rows[0]
    assert "| 800 |" in rows[0] and "| 42 |" in rows[0] and "2.1 min" in rows[0]
    assert "accuracy 75.00" in rows[1] and "| 0 |" in rows[1] and "14 s (eval only)" in rows[1]
    assert "**met** (gap +1.00 points" in text and "dev: 872 examples" in text


def test_readme_marker_replacement(collected, tmp_path):
    readme = tmp_path / "README.md"
    before, after = "# Title\n\nIntro text.\n\n", "\n\n## Next section\n\nUntouched.\n"
    readme.write_text(before + README_START + "\nold table\n" + README_END + after)
    assert cli_main(["results", "table", str(collected), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith(before + README_START + "\n| Task |") and text.endswith(README_END + after)
    assert "old table" not in text and text.count("| sst2 |") == 4
    # Idempotent: a second run gives the same file.
    cli_main(["results", "table", str(collected), "--readme", str(readme)])
    assert readme.read_text() == text

    no_markers = tmp_path / "PLAIN.md"
    no_markers.write_text("# Plain\n")
    with pytest.raises(SystemExit, match="must contain the marker"):
        cli_main(["results", "table", str(collected), "--readme", str(no_markers)])
    assert no_markers.read_text() == "# Plain\n"
    swapped = tmp_path / "SWAPPED.md"
    swapped.write_text(README_END + "\n" + README_START + "\n")
    with pytest.raises(ResultsError, match="comes before"):
        recovery_report.replace_in_readme(str(swapped), "x")


def test_help_everywhere(capsys):
    for argv in (["results", "--help"], ["results", "collect", "--help"], ["results", "plot", "--help"],
                 ["results", "table", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(argv)
        assert exit_info.value.code == 0
    assert "--readme" in capsys.readouterr().out
