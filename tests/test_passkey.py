"""The passkey-retrieval probe (hf_performer.tasks.passkey): prompt layout and length, seeding, scoring by a model
rigged to copy (n-gram induction: it must find the key in its context) and a random model, the command."""

import json
from pathlib import Path

import pytest
import torch
from transformers import GPT2LMHeadModel, LlamaForCausalLM
from transformers.utils import logging

from hf_performer.cli import main as cli_main
from hf_performer.tasks.evaluation import EvaluationError
from hf_performer.tasks.passkey import (
    CLASSIC_FILLER, PasskeyPrompts, passkey_retrieval, score_passkey_batch, trial_settings,
)
from conftest import save_tiny_llama

logging.set_verbosity_error()

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
pytestmark = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent (the GPT-2 tokenizer)")


@pytest.fixture(scope="module")
def tokenizer(gpt2_tokenizer):
    return gpt2_tokenizer


class InductionCopier(torch.nn.Module):
    """A causal LM rigged to copy: at each position it predicts the token that followed the latest earlier
    occurrence of its last ``n`` tokens (uniform when there is none). It answers the passkey only by reading it."""

    def __init__(self, vocab_size: int, n: int = 3):
        super().__init__()
        self.vocab_size, self.n = vocab_size, n
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # a device for the scorer

    def forward(self, input_ids, **kwargs):
        batch, length = input_ids.shape
        logits = torch.zeros(batch, length, self.vocab_size)
        grams = torch.stack([input_ids[:, i:length - self.n + 1 + i] for i in range(self.n)], -1)  # [B, G, n]
        for row in range(batch):
            same = (grams[row, :, None, :] == grams[row, None, :, :]).all(-1)  # [G, G]: gram t == gram s
            earlier = torch.ones_like(same).tril(-1) & same  # s < t
            index = torch.arange(same.shape[1]).expand_as(same)
            latest = torch.where(earlier, index, -1).max(-1).values  # [G]
            for gram_start, source in enumerate(latest.tolist()):
                if source >= 0:
                    logits[row, gram_start + self.n - 1, input_ids[row, source + self.n]] = 30.0
        return type("Output", (), {"logits": logits})()


def test_prompt_has_the_requested_length_and_the_key_at_the_requested_depth(tokenizer):
    builder = PasskeyPrompts(tokenizer)
    for length in (256, 300, 1024):
        for depth in (0.0, 0.3, 1.0):
            prompt = builder.build(length, depth, "48213")
            ids, key_start = prompt["input_ids"], prompt["key_start"]
            assert len(ids) == length
            assert tokenizer.decode(ids[key_start:key_start + len(prompt["answer_ids"])]) == " 48213"
            budget = prompt["filler_before"] + prompt["filler_after"]
            assert prompt["filler_before"] == round(depth * budget)
            assert tokenizer.decode(ids[prompt["needle_start"]:]).startswith(" The pass key is 48213. Remember it.")
            assert tokenizer.decode(ids).endswith(" What is the pass key? The pass key is")
    assert builder.build(512, 0.0, "11111")["needle_start"] == len(builder.header_ids)
    with pytest.raises(EvaluationError, match="depth must be in \\[0, 1\\]"):
        builder.build(256, 1.5, "11111")
    with pytest.raises(EvaluationError, match="accepted: context lengths >= "):
        builder.build(20, 0.5, "11111")


def test_real_text_filler_is_read_from_a_seeded_offset(tokenizer):
    text = (SHARED / "wikitext-2-raw" / "wiki.valid.raw").read_text(encoding="utf-8")[:20000]
    builder = PasskeyPrompts(tokenizer, text)
    assert not builder.classic and CLASSIC_FILLER.strip() not in tokenizer.decode(builder.filler_ids)
    first = trial_settings(0, 512, 1, 0, len(builder.filler_ids), classic=False)
    assert first == trial_settings(0, 512, 1, 0, len(builder.filler_ids), classic=False)  # seeded
    assert first != trial_settings(0, 512, 1, 1, len(builder.filler_ids), classic=False)
    key, offset = first
    assert len(key) == 5 and key[0] != "0" and 0 <= offset < len(builder.filler_ids)
    prompt = builder.build(512, 0.5, key, offset)
    assert len(prompt["input_ids"]) == 512
    before = prompt["input_ids"][len(builder.header_ids):prompt["needle_start"]]
    assert before == builder.filler(len(before), offset)
    # wrapping around a short filler
    assert builder.filler(5, len(builder.filler_ids) - 2) == builder.filler_ids[-2:] + builder.filler_ids[:3]


def test_a_model_that_copies_from_its_context_scores_one(tokenizer):
    result = passkey_retrieval(InductionCopier(len(tokenizer)), tokenizer, [256, 512], depths=[0.0, 0.5, 1.0],
                               trials=2, seed=3, batch_size=2)
    assert result["accuracy"] == 1.0 and result["by_context_length"] == {"256": 1.0, "512": 1.0}
    assert len(result["cells"]) == 6 and result["trials_total"] == 12
    for cell in result["cells"]:
        assert all(text.startswith(f" {key}") and not text[6:7].isdigit()
                   for text, key in zip(cell["greedy"], cell["keys"]))
        assert cell["key_log_likelihood_mean"] > -1.0  # nearly all of the mass on the key's tokens


def test_scores_of_a_random_model_and_a_digit_after_the_key(tokenizer, tiny_gpt2_config):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config(n_layer=1, n_positions=256, vocab_size=len(tokenizer))).eval()
    result = passkey_retrieval(model, tokenizer, [128], depths=[0.5], trials=3, seed=0)
    cell = result["cells"][0]
    assert cell["accuracy"] == 0.0 and len(set(cell["keys"])) == 3
    prompt = PasskeyPrompts(tokenizer).build(128, 0.5, cell["keys"][0])
    with torch.no_grad():  # the log-likelihood is that of the answer tokens after the prompt
        logits = model(torch.tensor([prompt["input_ids"] + prompt["answer_ids"]])).logits[0].double()
    answer = prompt["answer_ids"]
    positions = range(len(prompt["input_ids"]) - 1, len(prompt["input_ids"]) - 1 + len(answer))
    expected = sum(torch.log_softmax(logits[p], -1)[token].item() for p, token in zip(positions, answer))
    assert score_passkey_batch(model, tokenizer, [prompt])[0]["key_log_likelihood"] == pytest.approx(expected,
                                                                                                     rel=1e-5)

    class CopierThenDigit(InductionCopier):  # right key, then one more digit: greedy decoding would say 482137
        def forward(self, input_ids, **kwargs):
            output = super().forward(input_ids)
            output.logits[:, -1] = 0.0
            output.logits[:, -1, tokenizer.convert_tokens_to_ids("7")] = 30.0
            return output

    prompt = PasskeyPrompts(tokenizer).build(256, 0.5, "48213")
    assert score_passkey_batch(InductionCopier(len(tokenizer)), tokenizer, [prompt])[0]["correct"]
    assert not score_passkey_batch(CopierThenDigit(len(tokenizer)), tokenizer, [prompt])[0]["correct"]


def test_evaluate_command_passkey(tmp_path, capsys, tokenizer):
    folder = save_tiny_llama(tmp_path / "llama", tokenizer, max_positions=512)
    output = tmp_path / "passkey.json"
    arguments = ["evaluate", str(folder), "--task", "passkey", "--context-lengths", "128", "256", "--depths", "0",
                 "1", "--trials", "2", "--text-file", str(SHARED / "wikitext-2-raw" / "wiki.valid.raw"),
                 "--max-chars", "20000", "--batch-size", "2", "--no-progress", "--output", str(output)]
    assert cli_main(arguments) == 0
    record = json.loads(output.read_text())
    assert record["task"] == "passkey" and record["model"] == "llama"  # no local path in the record
    assert record["protocol"]["filler"] == "wiki.valid.raw" and record["protocol"]["context_lengths"] == [128, 256]
    assert [(cell["context_length"], cell["depth"]) for cell in record["cells"]] == [(128, 0), (128, 1), (256, 0),
                                                                                       (256, 1)]
    assert set(record["metrics"]) == {"passkey_accuracy", "passkey_standard_error", "passkey_accuracy_128",
                                      "passkey_accuracy_256"}
    assert "passkey context 256 depth 1: accuracy" in capsys.readouterr().out
    assert cli_main(arguments[:-1] + [str(tmp_path / "again.json")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert [cell["keys"] for cell in again["cells"]] == [cell["keys"] for cell in record["cells"]]  # deterministic
    not_loaded = tmp_path / "not-loaded"  # a folder that is never loaded: the arguments are refused first
    not_loaded.mkdir()
    (not_loaded / "config.json").write_text("{}")
    for extra, message in ((["--depths", "1.5"], "depths must be in \\[0, 1\\].*got \\[1.5\\]"),
                           (["--trials", "0"], "trials must be >= 1")):
        with pytest.raises(SystemExit, match=message):
            cli_main(["evaluate", str(not_loaded), "--task", "passkey", *extra])
    with pytest.raises(SystemExit, match="exceeds the model's 512 positions"):
        cli_main(["evaluate", str(folder), "--task", "passkey", "--context-lengths", "1024", "--no-progress"])


@pytest.mark.parametrize("extra,message", [
    (["--validation-file", "dev.tsv"], "--validation-file would be ignored by --task passkey (passkey)"),
    (["--stride", "8"], "--stride would be ignored by --task passkey"),
    (["--max-length", "64", "--metrics-backend", "local"], "--max-length, --metrics-backend would be ignored"),
])
def test_evaluate_refuses_flags_its_task_would_ignore_before_loading_anything(tmp_path, extra, message):
    with pytest.raises(SystemExit) as failure:
        cli_main(["evaluate", str(tmp_path / "not-loaded"), "--task", "passkey", *extra])
    assert message in str(failure.value) and "\n" not in str(failure.value)


def test_evaluate_checks_output_before_the_run(tmp_path):
    (tmp_path / "file").write_text("x")
    for output, message in ((tmp_path, "is a folder"), (tmp_path / "file" / "out.json", "is a file, not a folder")):
        with pytest.raises(SystemExit, match=message):  # before the (missing) model is loaded
            cli_main(["evaluate", str(tmp_path / "not-loaded"), "--task", "passkey", "--output", str(output)])
    with pytest.raises(SystemExit, match="--context-length would be ignored by --task sst2 \\(classification\\)"):
        cli_main(["evaluate", str(tmp_path / "not-loaded"), "--task", "sst2", "--context-length", "64"])


def test_a_converted_performer_is_scored_on_the_answer_logits_only(tokenizer, tiny_llama_config):
    from hf_performer.conversion import convert_to_performer

    torch.manual_seed(0)
    source = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=512)).eval()
    performer = convert_to_performer(source, nb_features=16).eval()
    prompt = PasskeyPrompts(tokenizer).build(128, 0.5, "48213")
    calls = []
    performer.register_forward_hook(lambda module, args, kwargs, output: calls.append(output.logits.shape),
                                    with_kwargs=True)
    score = score_passkey_batch(performer, tokenizer, [prompt])[0]
    assert calls == [(1, len(prompt["answer_ids"]) + 1, len(tokenizer))]  # logits_to_keep reached the source
    with torch.no_grad():
        logits = performer(torch.tensor([prompt["input_ids"] + prompt["answer_ids"]])).logits[0].double()
    start = len(prompt["input_ids"]) - 1
    expected = sum(torch.log_softmax(logits[start + i], -1)[token].item()
                   for i, token in enumerate(prompt["answer_ids"]))
    assert score["key_log_likelihood"] == pytest.approx(expected, rel=1e-4)
