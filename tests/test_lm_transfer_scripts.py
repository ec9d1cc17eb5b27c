"""The causal-LM attention-transfer scripts of benchmarks/scripts: greedy_samples.py on tiny random Llama folders
(softmax and a hedgehog Performer), collect_lm_transfer.py on records shaped like the package's tools write them
(built with the tools' own parser and dataclasses where they have them), and the pipeline's shell syntax.

The GPT-2 tokenizer of ../shared/data is used for the tiny models (skipped when absent).
"""

import importlib.util
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

from hf_performer.conversion import convert_to_performer
from hf_performer.conversion.attention_transfer import AttentionTransferResult
from hf_performer.conversion.fidelity import FidelityReport, LayerFidelity
from hf_performer.recipes.arguments import build_parser
from hf_performer.recipes.results import json_safe_args

logging.set_verbosity_error()

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "benchmarks" / "scripts"
SHARED = REPO.parent / "shared" / "data"
GPT2_TOKENIZER = SHARED / "gpt2-tokenizer"


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"_script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


greedy_samples = load_script("greedy_samples")
collect = load_script("collect_lm_transfer")


# --------------------------------------------------------------------------------------------
# Command lines
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [greedy_samples, collect], ids=["greedy_samples", "collect_lm_transfer"])
def test_help(module, capsys):
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and "--output" in out


def test_pipeline_shell_syntax():
    script = SCRIPTS / "smollm2_transfer.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "set -euo pipefail" in text
    for tool in ("dequantize_gguf.py", "evaluate", "distill", "recipes/causal_lm.py", "greedy_samples.py",
                 "collect_lm_transfer.py"):
        assert tool in text


def test_greedy_samples_rejects_bad_model_spec(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        greedy_samples.main(["--model", "no-equals-sign"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        greedy_samples.main(["--model", f"a={tmp_path / 'missing'}"])
    assert "no such folder" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# greedy_samples.py on tiny random models
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    if not GPT2_TOKENIZER.is_dir():
        pytest.skip("../shared/data/gpt2-tokenizer is absent")
    root = tmp_path_factory.mktemp("tiny_lm")
    tokenizer = AutoTokenizer.from_pretrained(GPT2_TOKENIZER)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=24, vocab_size=len(tokenizer), max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    source = LlamaForCausalLM(config).eval()
    softmax, performer = root / "llama", root / "hedgehog"
    source.save_pretrained(softmax)
    tokenizer.save_pretrained(softmax)
    convert_to_performer(source, feature_map="hedgehog").save_pretrained(performer)
    tokenizer.save_pretrained(performer)
    return {"softmax": softmax, "hedgehog": performer, "source": source, "tokenizer": tokenizer}


def test_greedy_samples_on_tiny_models(tiny_folders, tmp_path, capsys):
    output = tmp_path / "out" / "samples.json"
    status = greedy_samples.main([
        "--model", f"softmax={tiny_folders['softmax']}", "--model", f"hedgehog={tiny_folders['hedgehog']}",
        "--max-new-tokens", "3", "--output", str(output),
    ])
    assert status == 0
    record = json.loads(output.read_text())
    prompts = list(greedy_samples.DEFAULT_PROMPTS)
    assert record["prompts"] == prompts and len(prompts) == 4
    assert record["max_new_tokens"] == 3
    assert record["machine"]["torch"] == torch.__version__ and record["machine"]["transformers"]
    assert record["machine"]["cpu"] and record["machine"]["cpu_count"]
    softmax, hedgehog = record["models"]
    assert (softmax["name"], hedgehog["name"]) == ("softmax", "hedgehog")
    assert softmax["model"]["attention"] == "softmax" and hedgehog["model"]["attention"] == "favor"
    assert hedgehog["model"]["feature_map"] == "hedgehog"
    for model in (softmax, hedgehog):
        assert [s["prompt"] for s in model["samples"]] == prompts
        for sample in model["samples"]:
            assert 1 <= sample["new_tokens"] <= 3 and isinstance(sample["continuation"], str)
            assert sample["wall_time_s"] > 0
            assert sample["cache"]["num_layers"] == 2
    # The softmax model keeps keys and values; the Performer model used the constant-memory favor cache layer.
    assert all(s["cache"]["layer_classes"] == {"DynamicLayer": 2} for s in softmax["samples"])
    assert "constant_memory_cache" not in softmax
    assert all(s["cache"]["layer_classes"] == {"FavorCacheLayer": 2} for s in hedgehog["samples"])
    assert hedgehog["constant_memory_cache"] is True
    assert all(s["constant_memory_cache"] for s in hedgehog["samples"])

    # The recorded continuation is the greedy one.
    tokenizer, source = tiny_folders["tokenizer"], tiny_folders["source"]
    encoded = tokenizer(prompts[0], return_tensors="pt")
    with torch.no_grad():
        ids = source.generate(**encoded, do_sample=False, max_new_tokens=3, pad_token_id=tokenizer.eos_token_id)
    expected = tokenizer.decode(ids[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True)
    assert softmax["samples"][0]["continuation"] == expected

    out = capsys.readouterr().out
    assert prompts[0] in out and "softmax " in out and "hedgehog " in out and "FavorCacheLayer" in out


# --------------------------------------------------------------------------------------------
# collect_lm_transfer.py on records shaped like the tools' outputs
# --------------------------------------------------------------------------------------------


PROTOCOL = {"context_length": 32, "stride": 16, "windows": 42, "num_tokens": 675}


def write_json(path, record):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    return path


def evaluate_record(model, perplexity, protocol=PROTOCOL):
    """What ``hf-performer evaluate --text-file`` writes (hf_performer.tasks.evaluation.evaluate_perplexity_model)."""
    return {
        "task": "perplexity", "model": model, "data": "/data/wiki.test.raw",
        "metrics": {"perplexity": perplexity, "nll": math.log(perplexity)},
        "protocol": dict(protocol) | {"text_tokens": protocol["num_tokens"] + 1, "max_chars": 3000},
        "eval_seconds": 1.25, "device": "cpu",
    }


def recipe_folder(path, model, perplexity, attention="softmax", steps=5, wall=12.5, protocol=PROTOCOL):
    """What ``recipes/causal_lm.py`` writes (hf_performer.recipes.train.train): metrics.json and eval_curve.json."""
    argv = ["--model", model, "--train-file", "/data/wiki.valid.raw", "--validation-file", "/data/wiki.test.raw",
            "--block-size", "8", "--max-train-steps", str(steps), "--per-device-train-batch-size", "4",
            "--learning-rate", "1e-4", "--context-length", "32", "--stride", "16", "--max-eval-chars", "3000",
            "--eval-steps", "2", "--seed", "42", "--report-to", "none", "--output-dir", str(path)]
    if attention == "softmax":
        argv += ["--attention", "softmax"]
    args = build_parser("causal-lm").parse_args(argv)
    curve = [{"step": 2, "epoch": 0, "perplexity": perplexity * 1.5, "eval_loss": 3.0, "train_loss": 3.1},
             {"step": steps, "epoch": 1, "perplexity": perplexity, "eval_loss": math.log(perplexity),
              "train_loss": 2.9}]
    metrics = {
        "kind": "causal-lm", "task": "causal-lm",
        "model": {"source": model, "attention": "favor" if attention != "softmax" else "softmax", "converted": False,
                  "favor_settings": {"feature_map": "hedgehog"} if attention != "softmax" else None},
        "main_metric": "perplexity", "final": {"perplexity": perplexity, "eval_loss": math.log(perplexity)},
        "completed_steps": steps, "epochs": 2, "train_loss_first": 3.5, "train_loss_last": 2.9,
        "train_examples": 10, "eval_examples": None, "perplexity_protocol": dict(protocol),
        "metrics_backend": None, "metrics_note": None, "trainable_parameters": 1000, "total_parameters": 1000,
        "lora": False, "mixed_precision": "no", "num_processes": 1, "device": "cpu", "wall_time_s": wall,
        "resumed_from": None, "args": json_safe_args(args),
    }
    write_json(path / "metrics.json", metrics)
    write_json(path / "eval_curve.json", curve)
    return path


def transfer_folder(path, errors_before, errors_after):
    """What ``hf-performer distill`` writes in attention_transfer.json (conversion/distill.py)."""
    def report(errors, cosine):
        return FidelityReport(
            source="/models/smol", source_class="LlamaForCausalLM", performer_class="PerformerForCausalLM",
            favor_settings={"feature_map": "hedgehog"}, inputs="2 user texts", num_sequences=2, num_tokens=64,
            layers=[LayerFidelity(layer=i, attention="favor", own_inputs_relative_error=e,
                                  propagated_relative_error=2 * e) for i, e in enumerate(errors)],
            final_hidden_state_cosine=cosine, prediction_agreement=0.5, logits_kl=0.25, logits_relative_error=0.5,
        ).to_dict()

    layers = list(range(len(errors_before)))
    result = AttentionTransferResult(
        steps=3, loss="both", learning_rate=0.01, layers=layers,
        history=[{"step": s, "loss_per_layer": 1.0 / s} for s in (1, 2, 3)],
        layer_losses_before={i: {"weights_kl": 0.5 + i, "output_squared_error": 0.1, "rows": 64} for i in layers},
        layer_losses_after={i: {"weights_kl": 0.05 + i, "output_squared_error": 0.01, "rows": 64} for i in layers},
    )
    record = {
        "source": "/models/smol", "feature_map": "hedgehog", "favor_settings": {"feature_map": "hedgehog"},
        "data": {"file": "/data/wiki.valid.raw", "layout": "text", "sequences": 10, "max_length": 8, "batch_size": 4,
                 "seed": 0, "fidelity_sequences": 2},
        "transfer": result.to_dict(), "fidelity_before": report(errors_before, 0.75),
        "fidelity_after": report(errors_after, 0.98), "wall_time_s": 42.5,
        "command": "hf-performer distill /models/smol /runs/transfer_hedgehog --feature-map hedgehog --steps 3",
    }
    write_json(path / "attention_transfer.json", record)  # json turns the int layer keys into strings, as distill's
    return path


def samples_record():
    sample = {"prompt": "The species is found in", "prompt_tokens": 5, "continuation": " the north of",
              "new_tokens": 3, "stopped_at_eos": False, "wall_time_s": 0.5, "tokens_per_s": 6.0,
              "cache": {"cache_class": "DynamicCache", "layer_classes": {"FavorCacheLayer": 2},
                        "layer_bytes": {"FavorCacheLayer": 4096}, "favor_layers": 2, "num_layers": 2,
                        "softmax_layers": []}, "constant_memory_cache": True}
    return {"prompts": ["The species is found in"], "max_new_tokens": 3, "device": "cpu",
            "models": [{"name": "transfer_finetuned", "folder": "/runs/finetune_transfer",
                        "model": {"attention": "favor", "feature_map": "hedgehog"}, "samples": [sample],
                        "constant_memory_cache": True}],
            "command": "python benchmarks/scripts/greedy_samples.py ...", "machine": {"cpu": "test cpu"}}


@pytest.fixture
def experiment(tmp_path):
    return {
        "softmax_base": write_json(tmp_path / "eval_softmax_base.json", evaluate_record("/models/smol", 20.0)),
        "softmax_ft": recipe_folder(tmp_path / "finetune_softmax", "/models/smol", 16.0),
        "transfer": write_json(tmp_path / "eval_transfer.json", evaluate_record("/runs/transfer", 80.0)),
        "transfer_folder": transfer_folder(tmp_path / "transfer_hedgehog", [0.9, 0.8, 0.7], [0.3, 0.2, 0.1]),
        "samples": write_json(tmp_path / "samples.json", samples_record()),
        "root": tmp_path,
    }


def run_collect(experiment, transfer_ft_perplexity, *extra, protocol=PROTOCOL):
    root = experiment["root"]
    transfer_ft = recipe_folder(root / "finetune_transfer", "/runs/transfer", transfer_ft_perplexity,
                                attention="favor", wall=30.0, protocol=protocol)
    output = root / "results" / "lm_transfer.json"
    status = collect.main([
        "--softmax-base", str(experiment["softmax_base"]), "--softmax-finetuned", str(experiment["softmax_ft"]),
        "--transfer", str(experiment["transfer"]), "--transfer-folder", str(experiment["transfer_folder"]),
        "--transfer-finetuned", str(transfer_ft), "--samples", str(experiment["samples"]),
        "--protocol", "tiny protocol", "--output", str(output), *extra,
    ])
    assert status == 0
    return json.loads(output.read_text()), output


def test_collect_target_met(experiment, capsys):
    record, output = run_collect(experiment, 16.8)
    png = output.with_suffix(".png")
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert record["figure"] == png.name

    runs = {run["name"]: run for run in record["runs"]}
    assert list(runs) == ["softmax_base", "softmax_finetuned", "transfer", "transfer_finetuned"]
    assert [runs[n]["perplexity"] for n in runs] == [20.0, 16.0, 80.0, 16.8]
    assert runs["softmax_finetuned"]["steps"] == 5 and runs["softmax_base"]["steps"] == 0
    # 10 blocks in batches of 4 (4, 4, 2 per epoch): 5 steps take 4+4+2+4+4 = 18 blocks of 8 tokens.
    assert runs["softmax_finetuned"]["tokens_seen"] == 18 * 8
    assert runs["softmax_finetuned"]["wall_time_s"] == 12.5 and runs["transfer_finetuned"]["wall_time_s"] == 30.0
    assert runs["softmax_base"]["wall_time_s"] == 1.25
    assert "--attention softmax" in runs["softmax_finetuned"]["command"]
    assert "--max-train-steps 5" in runs["transfer_finetuned"]["command"]
    assert "--attention" not in runs["transfer_finetuned"]["command"]
    assert runs["softmax_base"]["command"].startswith("hf-performer evaluate /models/smol --task wikitext")
    assert "--max-chars 3000" in runs["softmax_base"]["command"]
    assert runs["transfer"]["transfer_command"].startswith("hf-performer distill /models/smol")
    assert runs["transfer"]["transfer_steps"] == 3
    assert runs["transfer"]["transfer_tokens_seen"] == (4 + 4 + 2) * 8  # 3 steps over the 3 batches of 10 blocks
    assert runs["transfer_finetuned"]["tokens_seen_including_transfer"] == 18 * 8 + 10 * 8
    assert [p["step"] for p in runs["transfer_finetuned"]["eval_curve"]] == [2, 5]

    assert record["protocol"]["consistent"] is True and record["protocol"]["description"] == "tiny protocol"
    assert record["protocol"]["num_tokens"] == 675 and record["protocol"]["context_length"] == 32
    assert "warnings" not in record

    assert record["comparison"]["ratio_transfer_finetuned_to_softmax_finetuned"] == pytest.approx(16.8 / 16.0)
    assert record["comparison"]["ratio_transfer_to_softmax_base"] == pytest.approx(80.0 / 20.0)
    assert record["comparison"]["fine_tuning"]["same_budget"] is True
    assert record["target"]["status"] == "met" and record["target"]["met"] is True
    assert record["target"]["threshold_perplexity"] == pytest.approx(1.10 * 16.0)

    fidelity = record["transfer_fidelity"]
    assert [layer["own_inputs_relative_error_before"] for layer in fidelity["layers"]] == [0.9, 0.8, 0.7]
    assert [layer["own_inputs_relative_error_after"] for layer in fidelity["layers"]] == [0.3, 0.2, 0.1]
    assert [layer["weights_kl_after"] for layer in fidelity["layers"]] == [0.05, 1.05, 2.05]
    assert fidelity["own_inputs_relative_error"]["before"]["mean"] == pytest.approx(0.8)
    assert fidelity["own_inputs_relative_error"]["after"]["max"] == 0.3
    assert fidelity["final_hidden_state_cosine"] == {"before": 0.75, "after": 0.98}
    assert fidelity["loss_per_layer_first"] == 1.0 and fidelity["loss_per_layer_last"] == pytest.approx(1 / 3)

    generations = record["generations"]
    assert generations["models"][0]["samples"][0]["continuation"] == " the north of"
    assert generations["models"][0]["constant_memory_cache"] is True
    assert record["machine"]["cpu"] and record["machine"]["python"]
    assert "met" in capsys.readouterr().out


def test_collect_target_not_met_and_protocol_mismatch(experiment):
    other = dict(PROTOCOL, num_tokens=600, windows=40)
    record, _ = run_collect(experiment, 17.8, protocol=other)
    assert record["target"]["ratio"] == pytest.approx(17.8 / 16.0)
    assert record["target"]["status"] == "not met" and record["target"]["met"] is False
    assert record["protocol"]["consistent"] is False
    assert any("num_tokens" in m and "transfer_finetuned" in m for m in record["protocol"]["mismatches"])
    assert any("same tokens" in w for w in record["warnings"])


def test_collect_target_ratio_option_and_favor_rows(experiment):
    root = experiment["root"]
    favor_base = write_json(root / "eval_favor_base.json", evaluate_record("/runs/favor_base", 500.0))
    favor_ft = recipe_folder(root / "finetune_favor", "/models/smol", 40.0, attention="favor")
    record, _ = run_collect(experiment, 17.8, "--target-ratio", "1.2", "--favor-base", str(favor_base),
                            "--favor-finetuned", str(favor_ft))
    assert record["target"]["status"] == "met" and record["target"]["threshold_ratio"] == 1.2
    runs = {run["name"]: run for run in record["runs"]}
    assert runs["favor_base"]["perplexity"] == 500.0 and runs["favor_finetuned"]["perplexity"] == 40.0
    assert record["comparison"]["ratio_favor_finetuned_to_softmax_finetuned"] == pytest.approx(40.0 / 16.0)
    assert record["comparison"]["ratio_favor_base_to_softmax_base"] == pytest.approx(500.0 / 20.0)


def test_collect_transfer_budget_trend(experiment, capsys):
    """--previous adds earlier budgets of the same pipeline, sorted by transfer tokens; a different protocol is
    refused."""
    earlier, output = run_collect(experiment, 30.0)
    earlier_path = output.with_name("earlier.json")
    earlier["transfer_fidelity"]["steps"], earlier["transfer_fidelity"]["tokens_seen"] = 1, 8
    earlier_path.write_text(json.dumps(earlier))
    record, output = run_collect(experiment, 17.8, "--previous", str(earlier_path), "--note", "a remark")
    trend = record["transfer_trend"]
    points = trend["points"]
    assert trend["same_transfer_config"] and trend["transfer_configs"] == ["hedgehog, init identity (not recorded: the default then), default features"]
    assert [p["transfer_steps"] for p in points] == [1, 3]
    assert [p["file"] for p in points] == [str(earlier_path), None]
    assert points[0]["ratio"] == pytest.approx(30.0 / 16.0) and points[1]["ratio"] == pytest.approx(17.8 / 16.0)
    assert points[1]["transfer_perplexity"] == 80.0 and points[1]["mean_relative_attention_error_after"] == pytest.approx(0.2)
    assert record["notes"] == ["a remark"]
    assert output.with_suffix(".png").is_file()
    assert "(this run)" in capsys.readouterr().out

    # A point with another feature-map configuration is kept, and the trend says the configurations differ.
    earlier["transfer_fidelity"]["favor_settings"] = {"feature_map": "hedgehog", "nb_features": 256,
                                                      "feature_map_options": {"init": "favor+"}}
    earlier_path.write_text(json.dumps(earlier))
    trend = run_collect(experiment, 17.8, "--previous", str(earlier_path))[0]["transfer_trend"]
    assert not trend["same_transfer_config"]
    assert trend["points"][0]["transfer_config"] == "hedgehog, init favor+, 256 features"

    earlier["protocol"]["num_tokens"] = 600
    earlier_path.write_text(json.dumps(earlier))
    with pytest.raises(SystemExit, match="evaluation .* differs"):
        run_collect(experiment, 17.8, "--previous", str(earlier_path))


def test_collect_reports_missing_inputs(experiment, tmp_path):
    with pytest.raises(SystemExit, match="metrics.json does not exist"):
        collect.main(["--softmax-finetuned", str(tmp_path), "--transfer-finetuned", str(tmp_path),
                      "--output", str(tmp_path / "x.json")])
    bad = write_json(tmp_path / "not_an_eval.json", {"metrics": {}})
    with pytest.raises(SystemExit, match="has no metrics.perplexity"):
        collect.main(["--softmax-base", str(bad), "--softmax-finetuned", str(experiment["softmax_ft"]),
                      "--transfer-finetuned", str(experiment["softmax_ft"]), "--output", str(tmp_path / "x.json")])
