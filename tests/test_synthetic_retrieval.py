"""The RULER-style synthetic tasks (hf_performer.tasks.synthetic_retrieval) and the quantized-KV peer
(hf_performer.tasks.quantized_kv): exact prompt lengths, answers that the prompt determines, seeding, standard errors,
scoring by a model rigged to copy, the command."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.utils import logging

from hf_performer.cli import main as cli_main
from hf_performer.tasks.evaluation import EvaluationError
from hf_performer.tasks.passkey import standard_error
from hf_performer.tasks.synthetic_retrieval import SyntheticPrompts, synthetic_retrieval
from conftest import save_tiny_llama

logging.set_verbosity_error()

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
pytestmark = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent (the GPT-2 tokenizer)")


@pytest.fixture(scope="module")
def tokenizer(gpt2_tokenizer):
    return gpt2_tokenizer


def test_needle_prompts_have_the_length_the_needles_and_the_asked_one_at_its_depth(tokenizer):
    builder = SyntheticPrompts(tokenizer, needles=4, queries="one")
    for length, depth in ((300, 0.0), (512, 0.5), (700, 1.0)):
        prompt = builder.needles_prompt(length, depth, np.random.default_rng(length), 0)
        assert len(prompt["input_ids"]) == length
        text = tokenizer.decode(prompt["input_ids"])
        found = dict(re.findall(r"magic numbers for (\w+) is: (\d{7})\.", text))
        assert len(found) == 4  # every needle, each word once
        word, answer = prompt["record"]["words"][0], prompt["record"]["answers"][0]
        assert found[word] == answer and tokenizer.decode(prompt["answer_ids"]) == " " + answer
        assert text.endswith(f"for {word} is:")
        where = text.index(f"for {word} is: {answer}") / len(text)
        assert abs(where - depth) < 0.25  # the asked needle sits near its depth (character fraction)


def test_all_needles_are_asked_in_one_answer_with_a_span_per_number(tokenizer):
    prompt = SyntheticPrompts(tokenizer, needles=3, queries="all").needles_prompt(400, 0.5, np.random.default_rng(1), 0)
    answers = prompt["record"]["answers"]
    assert tokenizer.decode(prompt["answer_ids"]) == " " + ", ".join(answers)
    spans = prompt["spans"]
    assert spans[0][0] == 0 and spans[-1][1] == len(prompt["answer_ids"]) and len(spans) == 3
    for (start, end), answer in zip(spans, answers):
        assert answer in tokenizer.decode(prompt["answer_ids"][start:end])


def test_variable_tracking_chain_resolves_to_the_answer_and_has_a_distractor(tokenizer):
    builder = SyntheticPrompts(tokenizer, hops=3)
    for depth in (0.0, 0.6):
        prompt = builder.tracking_prompt(600, depth, np.random.default_rng(7), 0)
        assert len(prompt["input_ids"]) == 600
        text = tokenizer.decode(prompt["input_ids"])
        assignments = dict(re.findall(r"VAR ([A-Z]{5}) = ((?:VAR [A-Z]{5})|\d{5}) \.", text))
        assert len(assignments) == 8  # two chains of 1 + 3 hops
        name = prompt["record"]["variables"][0]
        while not assignments[name].isdigit():  # follow the chain from the asked variable
            name = assignments[name][4:]
        assert assignments[name] == prompt["record"]["answers"][0]
        values = {value for value in assignments.values() if value.isdigit()}
        assert len(values) == 2  # the distractor chain has its own value


def test_a_model_that_copies_reads_the_asked_needle_and_cells_have_standard_errors(tokenizer):
    from test_passkey import InductionCopier

    result = synthetic_retrieval(InductionCopier(len(tokenizer)), tokenizer, "needles", [256, 400], [0.0, 0.5, 1.0],
                                 trials=3, seed=0, needles=3)
    assert result["accuracy"] >= 0.8 and result["trials_total"] == 18  # it finds "for WORD is:" and copies on
    for cell in result["cells"]:
        assert cell["standard_error"] == pytest.approx(math.sqrt(cell["accuracy"] * (1 - cell["accuracy"]) / 3))
        for greedy, answers, correct in zip(cell["greedy"], cell["answers"], cell["correct"]):
            assert greedy.startswith(" " + answers[0]) == correct
    again = synthetic_retrieval(InductionCopier(len(tokenizer)), tokenizer, "needles", [256], [0.0, 0.5], trials=3,
                                seed=0, needles=3)
    assert again["cells"][1]["answers"] == result["cells"][1]["answers"]  # seeded
    assert standard_error(0, 8) == 0.0 and standard_error(4, 8) == pytest.approx(0.5 / math.sqrt(8))


@pytest.mark.parametrize("kwargs,message", [({"needles": 0}, "needles must be in 1..32"),
                                            ({"queries": "some"}, "needle queries must be one of one, all"),
                                            ({"hops": 0}, "hops must be >= 1")])
def test_bad_settings_are_refused_in_one_line(tokenizer, kwargs, message):
    with pytest.raises(EvaluationError, match=message):
        SyntheticPrompts(tokenizer, **kwargs)


def test_evaluate_command_needles_variable_tracking_and_a_quantized_kv_cache(tmp_path, capsys, tokenizer):
    folder = save_tiny_llama(tmp_path / "llama", tokenizer, max_positions=1100)
    for task, extra in (("needles", ["--needles", "2", "--needle-queries", "all"]),
                        ("variable-tracking", ["--hops", "2"])):
        output = tmp_path / f"{task}.json"
        assert cli_main(["evaluate", str(folder), "--task", task, "--context-lengths", "200", "--depths", "0", "1",
                         *extra, "--no-progress", "--output", str(output)]) == 0
        record = json.loads(output.read_text())
        name = task.replace("-", "_")
        assert record["task"] == task and record["protocol"]["trials"] == 8  # the synthetic default
        assert {f"{name}_accuracy", f"{name}_standard_error", f"{name}_accuracy_200"} <= set(
            record["metrics"])
        assert [len(cell["correct"]) for cell in record["cells"]] == [8, 8]
        assert f"{task} context 200 depth 1: accuracy" in capsys.readouterr().out
    assert "needles_part_accuracy" in json.loads((tmp_path / "needles.json").read_text())["metrics"]
    pytest.importorskip("optimum.quanto")
    output = tmp_path / "quantized.json"
    assert cli_main(["evaluate", str(folder), "--task", "passkey", "--context-lengths", "1000", "--depths", "0",
                     "--trials", "1", "--quantized-kv", "2", "--no-progress", "--output", str(output)]) == 0
    assert json.loads(output.read_text())["kv_cache"]["nbits"] == 2
    with pytest.raises(SystemExit, match="--hops would be ignored by --task needles"):
        cli_main(["evaluate", str(folder), "--task", "needles", "--hops", "3"])


def test_a_quantized_kv_cache_changes_what_later_pieces_see_and_nothing_else(tiny_llama_config):
    pytest.importorskip("optimum.quanto")
    from hf_performer.tasks.quantized_kv import (
        PREFILL_CHUNK, QuantizedKVCausalLM, QuantizedKVError, quantized_kv_state_bytes,
    )

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(max_position_embeddings=2048)).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, PREFILL_CHUNK + 200))
    with torch.no_grad():
        full = model(ids).logits
        quantized = QuantizedKVCausalLM(model, 4)(ids).logits
        last = QuantizedKVCausalLM(model, 4)(ids, logits_to_keep=3).logits
    assert torch.allclose(quantized[:, :PREFILL_CHUNK], full[:, :PREFILL_CHUNK], atol=1e-5)  # the first piece: exact
    later = (quantized[:, PREFILL_CHUNK:] - full[:, PREFILL_CHUNK:]).abs().max()
    assert 0 < later < 0.5 * full.abs().max()  # later pieces read the quantized cache: close, not equal
    assert torch.allclose(last, quantized[:, -3:], atol=1e-6)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    entries = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    groups = 1000 * entries // min(64, head_dim)  # quantized tokens' groups, a scale and a zero point each
    assert quantized_kv_state_bytes(config, 1128, 4) == 1000 * entries // 2 + groups * 4 + 128 * entries * 2
    with pytest.raises(QuantizedKVError, match="bits must be one of 2, 4"):
        QuantizedKVCausalLM(model, 3)
