"""The window-hybrid benchmark (issue 15): collect_window_hybrid.py on records written by the package's own evaluate
command (tiny random models) and linearize.json records shaped like ``hf-performer linearize`` writes them, and the
pipeline's shell syntax and profiles. The GPT-2 tokenizer of ../shared/data is used (skipped when absent)."""

import copy
import importlib.util
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM
from transformers.utils import logging

from hf_performer.cli import main as cli_main

logging.set_verbosity_error()

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "benchmarks" / "scripts"
SHARED = REPO.parent / "shared" / "data"
pytestmark = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent")

spec = importlib.util.spec_from_file_location("_script_collect_window_hybrid", SCRIPTS / "collect_window_hybrid.py")
collect = importlib.util.module_from_spec(spec)
spec.loader.exec_module(collect)


def test_pipeline_shell_syntax_and_profiles():
    script = SCRIPTS / "smollm2_window_hybrid.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "set -euo pipefail" in text and "pipeline_steps.sh" in text
    for needle in ("linearize", "--baseline softmax", "--no-tail", "--transfer-steps 0 --lora-steps 0", "--no-tail --lora-steps 0",
                   "--task passkey", "--position-ranges", "collect_window_hybrid.py", "PROFILE", "full)", "short)",
                   "tiny)"):
        assert needle in text
    result = subprocess.run(["bash", str(script)], env={"PROFILE": "huge", "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True)
    assert result.returncode == 2 and "PROFILE must be full, short or tiny" in result.stderr
    result = subprocess.run(["bash", str(script)], env={"TEACHER_MODEL": "softmax_lora", "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True)
    assert result.returncode == 2 and "TEACHER_MODEL=softmax_lora needs TEACHER_WEIGHT" in result.stderr


@pytest.fixture(scope="module")
def records(tmp_path_factory, tiny_llama_config):
    """Real evaluate records (perplexity at 1024 with the position split, at 256, and passkey) of a tiny random
    Llama, written by the command itself."""
    folder = tmp_path_factory.mktemp("records")
    tokenizer = AutoTokenizer.from_pretrained(SHARED / "gpt2-tokenizer")
    torch.manual_seed(0)
    model_dir = folder / "tiny"
    LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=2048)).save_pretrained(
        model_dir)
    tokenizer.save_pretrained(model_dir)
    text = str(SHARED / "wikitext-2-raw" / "wiki.test.raw")
    written = {}
    for name, extra in (("ctx1024", ["--context-length", "1024", "--position-ranges", "0:512", "512:1024"]),
                        ("ctx256", ["--context-length", "256"])):
        output = folder / f"{name}.json"
        assert cli_main(["evaluate", str(model_dir), "--task", "wikitext", "--text-file", text, "--max-chars",
                         "2500", "--batch-size", "1", "--no-progress", *extra, "--output", str(output)]) == 0
        written[name] = json.loads(output.read_text())
    output = folder / "passkey.json"
    assert cli_main(["evaluate", str(model_dir), "--task", "passkey", "--context-lengths", "128", "256", "--depths",
                     "0.5", "--trials", "1", "--no-progress", "--output", str(output)]) == 0
    written["passkey"] = json.loads(output.read_text())
    return written


def _scaled(record, factor, far_factor=None):
    """The record with every perplexity multiplied (the far positions by ``far_factor``)."""
    record = copy.deepcopy(record)
    record["metrics"]["perplexity"] *= factor
    record["metrics"]["nll"] = math.log(record["metrics"]["perplexity"])
    for entry in record.get("position_ranges", []):
        entry["perplexity"] *= far_factor if far_factor and entry["start"] >= 512 else factor
    return record


def _linearize_record(kind, transfer_tokens, lora_losses, tokens_per_step=2048):
    """A linearize.json as ``hf-performer linearize`` writes it (kind, settings, stages, curve, ...)."""
    lora_tokens = len(lora_losses) * tokens_per_step
    curve = [{"stage": "transfer", "step": 1, "tokens_seen": transfer_tokens, "loss": [0.5, 0.4]}] if transfer_tokens \
        else []
    curve += [{"stage": "lora", "step": i + 1, "loss": loss, "tokens_seen": transfer_tokens + (i + 1) * tokens_per_step}
              for i, loss in enumerate(lora_losses)]

    def stage(name, tokens, wall):
        return {"name": name, "status": "done" if tokens else "skipped", "reason": None, "wall_time_s": wall,
                "tokens_seen": tokens, "details": {"steps_done": tokens // tokens_per_step}}

    return {"kind": kind, "settings": {"source": "smollm2", "train_files": ["wiki.valid.raw"], "window": 64,
                                       "sinks": 4, "linear_tail": kind != "window-only", "lora_steps": len(lora_losses),
                                       "baseline": "softmax" if kind == "baseline-softmax" else None},
            "stages": {"convert": stage("convert", 0, 1.0), "transfer": stage("transfer", transfer_tokens, 30.0),
                       "lora": stage("lora", lora_tokens, 60.0), "evaluate": stage("evaluate", 0, 0.0)},
            "perplexity": None, "tokens_seen": transfer_tokens + lora_tokens, "wall_time_s": 91.0, "curve": curve,
            "machine": {"cpu": "test"}, "command": "hf-performer linearize /tmp/secret/smollm2 /tmp/secret/out"}


@pytest.fixture
def experiment(tmp_path, records):
    """All eight arms: hybrid + LoRA 1.08x softmax + LoRA, window-only 1.3x at the far positions; the hybrid after
    its transfer (evaluation records only, no linearize folder) 1.6x softmax zero-shot; the hybrid with its worst
    layer (1) back on softmax 1.03x."""
    runs = tmp_path / "runs"
    (runs / "eval").mkdir(parents=True)
    factors = {"softmax_zeroshot": (1.0, None), "hybrid_zeroshot": (1.9, None), "window_zeroshot": (1.95, 2.2),
               "softmax_lora": (0.9, None), "hybrid_transfer": (1.6, None), "hybrid_lora": (0.9 * 1.08, None),
               "window_lora": (0.9 * 1.2, 0.9 * 1.3),
               "hybrid_worst_softmax_lora": (0.9 * 1.03, None)}
    losses = {"softmax_lora": [3.0, 2.9, 2.8], "hybrid_lora": [3.5, 3.2, 2.9], "window_lora": [3.6, 3.3, 3.1],
              "hybrid_worst_softmax_lora": [3.4, 3.1, 2.85]}
    kinds = {"hybrid_zeroshot": "hybrid", "window_zeroshot": "window-only", "softmax_lora": "baseline-softmax",
             "hybrid_lora": "hybrid", "window_lora": "window-only", "hybrid_worst_softmax_lora": "hybrid"}
    argv = []
    for arm, (factor, far) in factors.items():
        if arm not in ("softmax_zeroshot", "hybrid_transfer"):
            (runs / arm).mkdir()
            transfer = 4096 if arm in ("hybrid_lora", "hybrid_worst_softmax_lora") else 0
            record = _linearize_record(kinds[arm], transfer, losses.get(arm, []))
            if arm == "hybrid_worst_softmax_lora":
                record["stages"]["select"] = {"name": "select", "status": "done", "reason": None, "wall_time_s": 2.0,
                                              "tokens_seen": 0, "details": {"worst_layers": [1],
                                                                            "softmax_layers": [1]}}
            (runs / arm / "linearize.json").write_text(json.dumps(record))
            argv += ["--arm", f"{arm}={runs / arm}"]
        for name in ("ctx1024", "ctx256", "passkey"):
            if name == "ctx256" and arm not in ("softmax_lora", "hybrid_lora"):
                continue
            if name == "passkey" and arm == "hybrid_transfer":
                continue
            record = records[name] if name == "passkey" else _scaled(records[name], factor, far)
            if name == "passkey" and arm == "hybrid_lora":
                record = copy.deepcopy(record)
                record["metrics"]["passkey_accuracy_128"] = 1.0
            path = runs / "eval" / f"{arm}_{name}.json"
            path.write_text(json.dumps(record))
            argv += ["--eval", f"{arm}={path}"]
    (runs / "timings.tsv").write_text("linearize_hybrid_lora\t91\neval_hybrid_lora_ctx1024\t12\n")
    return runs, argv + ["--timings", str(runs / "timings.tsv"), "--runs-dir", str(runs), "--profile", "short",
                         "--command", f"OUT={runs} PROFILE=short bash benchmarks/scripts/smollm2_window_hybrid.sh"]


def test_collect_every_arm(experiment, records, capsys):
    runs, argv = experiment
    output = runs / "result.json"
    assert collect.main(argv + ["--output", str(output)]) == 0
    text = output.read_text()
    record = json.loads(text)
    assert str(runs) not in text and "/tmp/" not in text  # relative or base names only
    assert (runs / "result.png").stat().st_size > 10_000 and record["figure"] == "result.png"
    base = records["ctx1024"]["metrics"]["perplexity"]
    arms = record["arms"]
    assert list(arms) == list(collect.ARMS)
    assert arms["hybrid_lora"]["perplexity"]["1024"]["perplexity"] == pytest.approx(base * 0.9 * 1.08)
    assert arms["hybrid_lora"]["perplexity"]["1024"]["file"] == "eval/hybrid_lora_ctx1024.json"
    assert record["target"]["ratio"] == pytest.approx(1.08) and record["target"]["status"] == "met"
    assert record["target"]["stretch_met"] is False
    assert record["ratios"]["hybrid_lora_to_softmax_lora_256"]["ratio"] == pytest.approx(1.08)
    assert record["ratios"]["hybrid_zeroshot_to_softmax_zeroshot_1024"]["ratio"] == pytest.approx(1.9)
    assert set(record["contexts"]) == {"256", "1024"} and set(record["contexts"]["256"]) == {"softmax_lora",
                                                                                             "hybrid_lora"}
    ablation = record["tail_ablation"]
    assert ablation["trained_overall"]["ratio"] == pytest.approx(1.2 / 1.08)
    assert ablation["trained_far_positions"]["ratio"] == pytest.approx(1.3 / 1.08)
    assert ablation["trained_far_positions"]["position_range"] == "512:1024"
    assert ablation["zero_shot_far_positions"]["ratio"] == pytest.approx(2.2 / 1.9)
    assert ablation["tail_measurably_better"] is True
    near = arms["window_lora"]["perplexity"]["1024"]["position_ranges"]["0:512"]["perplexity"]
    assert near == pytest.approx(records["ctx1024"]["position_ranges"][0]["perplexity"] * 0.9 * 1.2)
    passkey = {(row["arm"], row["context_length"]): row["accuracy"] for row in record["passkey"]}
    assert passkey[("hybrid_lora", 128)] == 1.0 and len(passkey) == 14
    worst = record["ratios"]["hybrid_worst_softmax_lora_to_softmax_lora_1024"]
    assert worst["ratio"] == pytest.approx(1.03) and arms["hybrid_worst_softmax_lora"]["trained"]
    assert arms["hybrid_worst_softmax_lora"]["linearize"]["softmax_layers"] == [1]
    assert arms["hybrid_lora"]["linearize"]["softmax_layers"] == []
    assert arms["softmax_lora"]["passkey"]["cells"][0]["depth"] == 0.5
    curve = record["ratio_vs_tokens_seen"]
    assert [p["tokens_seen"] for p in curve["evaluated"]] == [0, 4096, 4096 + 3 * 2048]
    assert [p["ratio"] for p in curve["evaluated"]] == pytest.approx([1.9, 1.6, 1.08])
    assert record["ratios"]["window_zeroshot_to_hybrid_transfer_1024"]["ratio"] == pytest.approx(1.95 / 1.6)
    assert [p["tokens_seen"] for p in curve["training_loss"]] == [4096 + 2048, 4096 + 4096, 4096 + 6144]
    assert curve["training_loss"][0]["ratio"] == pytest.approx(math.exp(0.5))
    assert arms["hybrid_lora"]["tokens_seen"] == 4096 + 3 * 2048
    assert record["wall_times"]["pipeline_steps_s"]["linearize_hybrid_lora"] == 91
    assert record["wall_times"]["arms"]["hybrid_lora"]["training_s"] == 91.0
    assert record["machine"]["cpu_count"] >= 1 and record["command"].startswith("OUT=runs PROFILE=short")
    assert "warnings" not in record
    out = capsys.readouterr().out
    assert "hybrid + LoRA / softmax + LoRA at 1024: 1.08 (target <= 1.1: met" in out
    assert "passkey hybrid_lora" in out


def test_collect_partial_and_mismatched_runs(experiment, records):
    runs, argv = experiment
    keep = [a for pair in zip(argv[::2], argv[1::2]) if "hybrid_lora=" not in pair[1] for a in pair]
    record = collect.build_record(collect.build_parser().parse_args(keep + ["--output", str(runs / "r.json")]))
    assert record["target"]["status"] == "not measured" and record["target"]["ratio"] is None
    assert "hybrid_lora" not in record["arms"] and record["tail_ablation"]["tail_measurably_better"] is None
    other = _scaled(records["ctx1024"], 1.0)
    other["protocol"]["num_tokens"] -= 5
    (runs / "eval" / "softmax_zeroshot_ctx1024.json").write_text(json.dumps(other))
    record = collect.build_record(collect.build_parser().parse_args(argv + ["--output", str(runs / "r.json")]))
    assert record["ratios"]["hybrid_zeroshot_to_softmax_zeroshot_1024"]["ratio"] is None
    assert any("not comparable (different evaluation: num_tokens" in w for w in record["warnings"])
    assert record["target"]["status"] == "met"  # the trained arms still share their protocol


def test_collect_names_an_arm_linked_from_another_run(experiment, tmp_path):
    runs, argv = experiment
    other = tmp_path / "earlier_run"
    other.mkdir()
    (runs / "softmax_lora").rename(other / "softmax_lora")
    (runs / "softmax_lora").symlink_to(other / "softmax_lora")
    record = collect.build_record(collect.build_parser().parse_args(argv + ["--output", str(runs / "r.json")]))
    assert record["arms"]["softmax_lora"]["reused_from"] == "earlier_run/softmax_lora"
    assert "reused_from" not in record["arms"]["hybrid_lora"]
    assert [note for note in record["notes"] if note.startswith("softmax_lora: reused from another run's folder "
                                                                "(earlier_run/softmax_lora)")]
    assert record["target"]["ratio"] == pytest.approx(1.08)


def test_collect_reports_bad_inputs(experiment, tmp_path):
    runs, argv = experiment
    for extra, message in (
            (["--arm", "hybrid=somewhere"], "unknown arm 'hybrid'; accepted: softmax_zeroshot"),
            (["--eval", "no-equals"], "--eval expects NAME=PATH"),
            (["--eval", f"hybrid_lora={tmp_path / 'missing.json'}"], "does not exist"),
            (["--eval", f"hybrid_lora={runs / 'eval' / 'hybrid_lora_ctx1024.json'}"], "two perplexity records")):
        with pytest.raises(SystemExit, match=message):
            collect.main(argv + extra + ["--output", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="nothing to collect"):
        collect.main(["--output", str(tmp_path / "x.json")])


def test_tail_error_probe_measures_with_and_without_the_tail(tmp_path, tiny_llama_config):
    from hf_performer.conversion import convert_to_performer

    spec = importlib.util.spec_from_file_location("_script_tail_error_probe", SCRIPTS / "tail_error_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    tokenizer = AutoTokenizer.from_pretrained(SHARED / "gpt2-tokenizer")
    torch.manual_seed(0)
    source = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=256))
    folder = tmp_path / "transferred"
    convert_to_performer(source, feature_map="hedgehog", feature_map_options={"init": "identity", "tie_qk": False},
                         window=8, sinks=1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    output = tmp_path / "probe.json"
    text = str(SHARED / "wikitext-2-raw" / "wiki.test.raw")
    assert probe.main([f"tiny={folder}", "--text-file", text, "--max-chars", "4000", "--length", "64",
                       "--sequences", "2", "--output", str(output)]) == 0
    record = json.loads(output.read_text())
    model = record["models"]["tiny"]
    assert (model["window"], model["sinks"], model["sequences"]) == (8, 1, 2)
    assert sorted(model["errors"]["hybrid"]) == sorted(model["errors"]["window_only"]) == ["0", "1"]
    for layer, ratio in model["ratio_hybrid_to_window_only"].items():
        assert ratio == pytest.approx(model["errors"]["hybrid"][layer] / model["errors"]["window_only"][layer])
        assert model["errors"]["window_only"][layer] > 0
    assert not [part for part in record["command"].split() if part.split("=")[-1].startswith("/")]
    assert f'"{tmp_path}' not in json.dumps(record)  # paths are relative
    assert (tmp_path / "probe.png").is_file() and not (tmp_path / "probe.json.partial").exists()
    with pytest.raises(SystemExit, match="expected NAME=FOLDER"):
        probe.main(["no-equals", "--text-file", text, "--output", str(output)])
    with pytest.raises(SystemExit, match="no config.json"):
        probe.main([f"x={tmp_path}", "--text-file", text, "--output", str(output)])
