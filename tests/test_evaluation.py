"""Evaluation and data loading: task metrics (evaluate or the local fallback), the perplexity protocol checked
against a hand computation, local file loaders on each layout of ../shared/data (a few rows; skipped when the
folder is absent) and on synthetic files, and the ``hf-performer evaluate`` command.
"""

import gzip
import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import BertForSequenceClassification, GPT2LMHeadModel
from transformers.utils import logging

from conftest import word_piece_tokenizer

from hf_performer.tasks import evaluation
from hf_performer.cli import build_parser as cli_build_parser
from hf_performer.cli import main as cli_main
from hf_performer.conversion import convert_to_performer
from hf_performer.tasks.data import (
    TASKS,
    DataError,
    get_task,
    load_lm_text,
    load_task_file,
    read_records,
    select_subset,
    tokenize_task_dataset,
)
from hf_performer.tasks.evaluation import EvaluationError, compute_task_metrics, perplexity, perplexity_windows

logging.set_verbosity_error()

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent")


# --------------------------------------------------------------------------------------------
# Task registry and metrics
# --------------------------------------------------------------------------------------------


def test_registry_covers_glue_and_imdb():
    assert set(TASKS) == {"cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli", "imdb"}
    assert get_task("SST-2") is TASKS["sst2"] and get_task("sts-b").is_regression
    assert TASKS["stsb"].num_labels == 1 and TASKS["mnli"].num_labels == 3
    assert TASKS["mnli"].validation_split == "validation_matched" and TASKS["imdb"].validation_split == "test"
    assert TASKS["cola"].metrics == ("matthews_correlation",) and TASKS["mrpc"].metrics == ("accuracy", "f1")
    assert all(TASKS[t].is_pair for t in ("mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"))
    with pytest.raises(DataError, match="unknown task 'sst3'.*accepted: cola, sst2"):
        get_task("sst3")


def test_local_metrics_match_hand_computation():
    predictions, references = [1, 0, 1, 1, 0, 1], [1, 0, 0, 1, 1, 1]
    metrics, backend, _ = compute_task_metrics("mrpc", predictions, references, backend="local")
    assert backend == "local"
    tp, fp, fn = 3, 1, 1
    assert metrics == pytest.approx({"accuracy": 4 / 6, "f1": 2 * tp / (2 * tp + fp + fn)})
    tn = 1
    mcc = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert compute_task_metrics("cola", predictions, references, "local")[0] == pytest.approx(
        {"matthews_correlation": mcc})
    x, y = np.array([0.1, 2.0, 3.5, 4.0, 1.0]), np.array([0.0, 2.5, 3.0, 5.0, 0.5])
    pearson = np.corrcoef(x, y)[0, 1]
    spearman = np.corrcoef(np.argsort(np.argsort(x)), np.argsort(np.argsort(y)))[0, 1]
    assert compute_task_metrics("stsb", x, y, "local")[0] == pytest.approx(
        {"pearson": pearson, "spearmanr": spearman})
    with pytest.raises(EvaluationError, match="must be"):
        compute_task_metrics("sst2", [1, 0], [1], "local")


def test_auto_backend_uses_evaluate_when_it_loads_else_falls_back(monkeypatch):
    class FakeMetric:
        def compute(self, predictions, references):
            return {"accuracy": 0.25}

    monkeypatch.setitem(evaluation._EVALUATE_CACHE, "sst2", FakeMetric())
    assert compute_task_metrics("sst2", [1, 0], [1, 1], "auto") == ({"accuracy": 0.25}, "evaluate", None)
    monkeypatch.setitem(evaluation._EVALUATE_CACHE, "sst2", FileNotFoundError("no glue script offline"))
    metrics, backend, note = compute_task_metrics("sst2", [1, 0], [1, 1], "auto")
    assert (metrics, backend) == ({"accuracy": 0.5}, "local")
    # one short line: what was done and why, no exception text (it names local paths)
    assert note == ("metrics computed locally with scikit-learn / scipy (the same formulas): evaluate.load('glue', "
                    "'sst2') is not available here (FileNotFoundError); --metrics-backend local skips the attempt")
    with pytest.raises(EvaluationError, match="evaluate.load failed"):
        compute_task_metrics("sst2", [1, 0], [1, 1], "evaluate")


# --------------------------------------------------------------------------------------------
# Perplexity
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gpt2(tiny_gpt2_config):
    torch.manual_seed(0)
    config = tiny_gpt2_config(vocab_size=50)
    return GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("num_tokens,context,stride", [(23, 8, 3), (23, 8, 7), (20, 6, 5), (9, 16, 4), (30, 4, 1)])
def test_windows_score_every_token_once(num_tokens, context, stride):
    windows = perplexity_windows(num_tokens, context, stride)
    scored = [t for begin, end, first in windows for t in range(first, end)]
    assert scored == list(range(1, num_tokens))
    for begin, end, first in windows:
        assert end - begin <= context and begin % stride == 0
        if begin > 0:
            assert first - begin >= context - stride  # at least context - stride tokens of left context


def _hand_perplexity(model, ids, context, stride):
    """Token by token: NLL of token t given the tokens of its window before it (protocol of the docstring)."""
    total, count = 0.0, 0
    starts = list(range(0, len(ids), stride))
    for t in range(1, len(ids)):
        begin = next(s for s in starts if min(s + context, len(ids)) > t)  # the first window containing t
        with torch.no_grad():
            logits = model(torch.tensor([ids[begin:t]])).logits[0, -1].double()
        total -= torch.log_softmax(logits, -1)[ids[t]].item()
        count += 1
    return math.exp(total / count), count


@pytest.mark.parametrize("context,stride,batch_size", [(8, 3, 2), (8, 7, 1), (40, 10, 1)])
def test_perplexity_matches_hand_computation(tiny_gpt2, context, stride, batch_size):
    ids = torch.randint(0, 50, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    result = perplexity(tiny_gpt2, ids, context, stride, batch_size=batch_size)
    expected, count = _hand_perplexity(tiny_gpt2, ids, context, stride)
    assert result["num_tokens"] == count == 28
    assert result["perplexity"] == pytest.approx(expected, rel=1e-5)
    if context >= len(ids):  # one window: the model's own mean loss
        with torch.no_grad():
            loss = tiny_gpt2(torch.tensor([ids]), labels=torch.tensor([ids])).loss
        assert result["perplexity"] == pytest.approx(math.exp(loss.item()), rel=1e-5)


def test_perplexity_of_a_converted_performer_matches_hand_computation(tiny_gpt2):
    performer = convert_to_performer(tiny_gpt2, nb_features=16)
    ids = torch.randint(0, 50, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    expected, _ = _hand_perplexity(performer, ids, 8, 4)
    assert perplexity(performer, ids, 8, 4, batch_size=3)["perplexity"] == pytest.approx(expected, rel=1e-4)
    with pytest.raises(EvaluationError, match="stride must be in 1..context length - 1"):
        perplexity(performer, ids, 8, 8)


# --------------------------------------------------------------------------------------------
# Local files: the layouts of ../shared/data (a few rows) and synthetic ones
# --------------------------------------------------------------------------------------------


@needs_shared
@pytest.mark.parametrize("task,path,columns,labels", [
    ("sst2", "glue/SST-2/dev.tsv", ["sentence"], [1, 0, 1, 1]),
    ("cola", "glue/CoLA/dev.tsv", ["sentence"], [1, 1, 1, 1]),  # no header: source, label, mark, sentence
    ("rte", "glue/RTE/dev.tsv", ["sentence1", "sentence2"], [1, 0, 1, 1]),  # entailment / not_entailment
    ("stsb", "glue/STS-B/dev.tsv", ["sentence1", "sentence2"], [5.0, 4.75, 5.0, 2.4]),  # the score column
    ("imdb", "imdb/test.jsonl.gz", ["text"], [0, 0, 0, 0]),
])
def test_shared_data_layouts(task, path, columns, labels):
    dataset = load_task_file(SHARED / path, task, max_rows=4)
    assert dataset.column_names == [*columns, "label"] and dataset["label"] == labels
    assert all(isinstance(dataset[0][c], str) and dataset[0][c] for c in columns)
    if task == "cola":
        assert dataset[0]["sentence"] == "The sailors rode the breeze clear of the rocks."


@needs_shared
def test_shared_wikitext_and_subset():
    text = load_lm_text(SHARED / "wikitext-2-raw" / "wiki.valid.raw", max_chars=300)
    assert len(text) == 300 and "Homarus gammarus" in text
    dataset = load_task_file(SHARED / "imdb" / "test.jsonl.gz", "imdb", max_rows=40)
    subset = select_subset(dataset, 10, seed=0)
    assert len(subset) == 10 and subset["label"] == select_subset(dataset, 10, seed=0)["label"]


def test_synthetic_formats_aliases_and_errors(tmp_path):
    (tmp_path / "mnli.tsv").write_text("index\tsentence1\tsentence2\tgold_label\n0\tA man.\tA person.\tentailment\n"
                                       "1\tA cat.\tA dog.\tcontradiction\n")
    mnli = load_task_file(tmp_path / "mnli.tsv", "mnli")
    assert mnli.column_names == ["premise", "hypothesis", "label"] and mnli["label"] == [0, 2]
    (tmp_path / "qqp.csv").write_text('question1,question2,is_duplicate\n"How, why?",Why?,1\nA?,B?,0\n')
    assert load_task_file(tmp_path / "qqp.csv", "qqp")["question1"] == ["How, why?", "A?"]
    (tmp_path / "sst.json").write_text(json.dumps([{"sentence": "good", "label": 1}, {"sentence": "bad", "label": 0}]))
    assert load_task_file(tmp_path / "sst.json", "sst2")["label"] == [1, 0]
    with gzip.open(tmp_path / "imdb.jsonl.gz", "wt") as handle:
        handle.write('{"text": "fine", "label": 1}\n\n{"text": "poor", "label": 0}\n')
    assert load_task_file(tmp_path / "imdb.jsonl.gz", "imdb")["text"] == ["fine", "poor"]

    with pytest.raises(DataError, match=r"no 'sentence2' column for task rte; found columns \['sentence1', 'label'\]"):
        (tmp_path / "rte.tsv").write_text("sentence1\tlabel\nx\tentailment\n")
        load_task_file(tmp_path / "rte.tsv", "rte")
    with pytest.raises(DataError, match="neither a class id.*entailment, not_entailment"):
        (tmp_path / "rte2.tsv").write_text("sentence1\tsentence2\tlabel\nx\ty\tmaybe\n")
        load_task_file(tmp_path / "rte2.tsv", "rte")
    with pytest.raises(DataError, match="cannot tell the format.*accepted: .tsv, .csv"):
        read_records(tmp_path / "data.parquet")
    with pytest.raises(DataError, match="line 2: not a JSON object"):
        (tmp_path / "bad.jsonl").write_text('{"text": "a", "label": 1}\n{oops\n')
        read_records(tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match="3 fields but 2 columns"):
        (tmp_path / "ragged.tsv").write_text("sentence\tlabel\na\t1\tx\n")
        read_records(tmp_path / "ragged.tsv")


def test_a_byte_order_mark_is_ignored_by_every_text_reader(tmp_path):
    """The original MRPC TSVs start with a UTF-8 byte-order mark; so may any file saved by a Windows editor."""
    from hf_performer.hub import load_metrics
    from hf_performer.recipes.results import load_results

    bom = "\ufeff"
    mrpc = (f"{bom}Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
            "1\t1\t2\tHe said so.\tHe told us.\n0\t3\t4\tIt rained.\tIt was sunny.\n")
    (tmp_path / "msr_paraphrase_test.tsv").write_text(mrpc, encoding="utf-8")
    with gzip.open(tmp_path / "mrpc.tsv.gz", "wt", encoding="utf-8") as handle:
        handle.write(mrpc)
    for name in ("msr_paraphrase_test.tsv", "mrpc.tsv.gz"):
        dataset = load_task_file(tmp_path / name, "mrpc")
        assert dataset.column_names == ["sentence1", "sentence2", "label"] and dataset["label"] == [1, 0]
    (tmp_path / "qqp.csv").write_text(f"{bom}question1,question2,is_duplicate\nA?,B?,1\n", encoding="utf-8")
    assert load_task_file(tmp_path / "qqp.csv", "qqp")["label"] == [1]
    (tmp_path / "sst.jsonl").write_text(f'{bom}{{"sentence": "good", "label": 1}}\n', encoding="utf-8")
    assert load_task_file(tmp_path / "sst.jsonl", "sst2")["label"] == [1]
    (tmp_path / "sst.json").write_text(bom + json.dumps([{"sentence": "bad", "label": 0}]), encoding="utf-8")
    assert load_task_file(tmp_path / "sst.json", "sst2")["label"] == [0]

    (tmp_path / "wiki.raw").write_text(f"{bom} = Title = \n", encoding="utf-8")
    with gzip.open(tmp_path / "wiki.raw.gz", "wt", encoding="utf-8") as handle:
        handle.write(f"{bom} = Title = \n")
    assert load_lm_text(tmp_path / "wiki.raw") == load_lm_text(tmp_path / "wiki.raw.gz") == " = Title = \n"

    (tmp_path / "metrics.json").write_text(bom + json.dumps({"task": "sst2", "metric": "accuracy", "value": 0.9}),
                                           encoding="utf-8")
    assert load_metrics(tmp_path / "metrics.json")[0][0]["value"] == 0.9
    (tmp_path / "results.json").write_text(bom + json.dumps({"task": "sst2", "main_metric": "accuracy", "runs": {}}),
                                           encoding="utf-8")
    assert load_results(str(tmp_path / "results.json"))["task"] == "sst2"


# --------------------------------------------------------------------------------------------
# The evaluate command
# --------------------------------------------------------------------------------------------


def test_evaluate_command_classification(tmp_path, capsys, tiny_bert_config):
    tokenizer = word_piece_tokenizer(tmp_path, ["good", "bad", "movie", "film"])
    torch.manual_seed(0)
    source = BertForSequenceClassification(tiny_bert_config(num_hidden_layers=1, vocab_size=len(tokenizer))).eval()
    folder = tmp_path / "performer"
    convert_to_performer(source, nb_features=16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rows = ["good movie\t1", "bad film\t0", "good film\t1", "bad movie\t0", "movie\t1"]
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    output = tmp_path / "out" / "metrics.json"
    assert cli_main(["evaluate", str(folder), "--task", "sst2", "--validation-file", str(tmp_path / "dev.tsv"),
                     "--max-eval-samples", "4", "--batch-size", "3", "--metrics-backend", "local",
                     "--output", str(output)]) == 0
    record = json.loads(output.read_text())
    assert record["num_examples"] == 4 and record["metrics_backend"] == "local"
    # No local absolute path in the file (it may be pushed with the model); the model folder is relative to it.
    assert str(tmp_path) not in output.read_text()
    assert record["data"] == "dev.tsv" and (output.parent / record["model"]).resolve() == folder.resolve()
    assert set(record["metrics"]) == {"accuracy"} and f"accuracy: {record['metrics']['accuracy']:.6g}" in (
        capsys.readouterr().out)

    # The same accuracy, computed directly from the reloaded model's predictions on the same subset.
    from torch.utils.data import DataLoader
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

    data = tokenize_task_dataset(select_subset(load_task_file(tmp_path / "dev.tsv", "sst2"), 4, 0), tokenizer, "sst2")
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    loader = DataLoader(data, batch_size=2, collate_fn=DataCollatorWithPadding(tokenizer))
    predictions, references, loss = evaluation.predict_classification(model, loader, get_task("sst2"))
    assert record["metrics"]["accuracy"] == pytest.approx(float(np.mean(predictions == references)))
    with torch.no_grad():  # the mean per-example loss is the head's own loss over all examples
        expected_loss = model.eval()(**DataCollatorWithPadding(tokenizer)([data[i] for i in range(4)])).loss
    assert loss == pytest.approx(expected_loss.item(), rel=1e-5) and record["eval_loss"] == pytest.approx(loss)

    with pytest.raises(SystemExit, match="the model has 2 output labels but task stsb needs 1"):
        cli_main(["evaluate", str(folder), "--task", "stsb", "--validation-file", str(tmp_path / "dev.tsv")])


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_classification_progress_bar_on_a_terminal_only(tmp_path, monkeypatch, tiny_bert_config):
    from torch.utils.data import DataLoader
    from transformers import DataCollatorWithPadding

    tokenizer = word_piece_tokenizer(tmp_path, ["good", "bad", "movie"])
    model = BertForSequenceClassification(tiny_bert_config(num_hidden_layers=1, vocab_size=len(tokenizer)))
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\ngood movie\t1\nbad movie\t0\nmovie\t1\n")
    data = tokenize_task_dataset(load_task_file(tmp_path / "dev.tsv", "sst2"), tokenizer, "sst2")
    loader = DataLoader(data, batch_size=2, collate_fn=DataCollatorWithPadding(tokenizer))
    spec = get_task("sst2")
    for stderr_class, show_progress, shown in ((_Terminal, True, True), (io.StringIO, True, False),
                                               (_Terminal, False, False)):
        stderr = stderr_class()
        monkeypatch.setattr(sys, "stderr", stderr)
        predictions, _, _ = evaluation.predict_classification(model, loader, spec, show_progress=show_progress)
        assert len(predictions) == 3
        assert ("evaluating sst2" in stderr.getvalue() and "2/2" in stderr.getvalue()) == shown, stderr.getvalue()
    assert cli_build_parser("evaluate").parse_args(["evaluate", "m", "--task", "sst2", "--no-progress"]).no_progress


def test_evaluate_refuses_a_model_without_trained_task_head(tmp_path, capsys, tiny_bert_config):
    """A base encoder folder loads as a classifier whose head transformers initialises randomly: no accuracy."""
    from transformers import BertModel

    tokenizer = word_piece_tokenizer(tmp_path, ["good", "bad", "movie"])
    config = tiny_bert_config(num_hidden_layers=1, vocab_size=len(tokenizer))
    for name, model in (("bert-base", BertModel(config)),
                        ("performer-base", convert_to_performer(BertModel(config), nb_features=16))):
        folder = tmp_path / name
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (tmp_path / "dev.tsv").write_text("sentence\tlabel\ngood movie\t1\nbad movie\t0\n")
        with pytest.raises(EvaluationError, match=r"no trained weights for .*classifier\.weight"):
            evaluation.evaluate_classification_model(str(folder), "sst2", str(tmp_path / "dev.tsv"))
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["evaluate", str(folder), "--task", "sst2", "--validation-file", str(tmp_path / "dev.tsv")])
        assert exit_info.value.code == 2
        captured = capsys.readouterr()
        [error] = [line for line in captured.err.splitlines() if "error:" in line]  # transformers logs its load report
        assert "accuracy" not in captured.out and error.startswith("hf-performer evaluate: error: ")
        assert "classifier.weight" in error and "fine-tuned on the task" in error


def test_evaluate_refuses_a_converted_folder_whose_new_head_was_never_trained(tmp_path, capsys, tiny_bert_config):
    """Converting a base encoder to sequence classification saves a random head: the folder loads completely, but
    its conversion report says the head is new and nothing in the folder records a training run."""
    from transformers import BertModel

    from hf_performer.cli.convert import main as convert_main

    tokenizer = word_piece_tokenizer(tmp_path, ["good", "bad", "movie"], save_to=tmp_path / "base")
    BertModel(tiny_bert_config(num_hidden_layers=1, vocab_size=len(tokenizer))).save_pretrained(tmp_path / "base")
    folder = tmp_path / "converted"
    assert convert_main([str(tmp_path / "base"), str(folder), "--task", "sequence-classification",
                         "--nb-features", "16"]) == 0
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\ngood movie\t1\nbad movie\t0\n")
    with pytest.raises(EvaluationError, match="head .*never trained.*conversion_report.json"):
        evaluation.evaluate_classification_model(str(folder), "sst2", str(tmp_path / "dev.tsv"))
    (folder / "metrics.json").write_text("{}")  # a recipe fine-tuned it in place
    record = evaluation.evaluate_classification_model(str(folder), "sst2", str(tmp_path / "dev.tsv"),
                                                      metrics_backend="local", show_progress=False)
    assert record["num_examples"] == 2


@needs_shared
def test_evaluate_command_perplexity_on_wikitext_file(tmp_path, capsys, tiny_gpt2, tiny_gpt2_config, gpt2_tokenizer):
    tokenizer = gpt2_tokenizer
    torch.manual_seed(0)
    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(tiny_gpt2_config(n_layer=1, vocab_size=len(tokenizer))).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    output = tmp_path / "ppl.json"
    assert cli_main(["evaluate", str(folder), "--task", "wikitext", "--text-file",
                     str(SHARED / "wikitext-2-raw" / "wiki.test.raw"), "--max-chars", "600", "--context-length", "32",
                     "--stride", "16", "--batch-size", "4", "--output", str(output)]) == 0
    record = json.loads(output.read_text())
    assert str(tmp_path) not in output.read_text() and str(SHARED) not in output.read_text()
    assert record["data"] == "wiki.test.raw" and (output.parent / record["model"]).resolve() == folder.resolve()
    ids = tokenizer(load_lm_text(SHARED / "wikitext-2-raw" / "wiki.test.raw", max_chars=600),
                    add_special_tokens=False)["input_ids"]
    assert record["protocol"]["num_tokens"] == len(ids) - 1 and record["protocol"]["stride"] == 16
    assert math.isfinite(record["metrics"]["perplexity"]) and record["metrics"]["perplexity"] > 1

    # --position-ranges: the same protocol, plus the perplexity of window positions 0..15 and 16..31
    split_output = tmp_path / "ppl_split.json"
    text_file = str(SHARED / "wikitext-2-raw" / "wiki.test.raw")
    assert cli_main(["evaluate", str(folder), "--task", "wikitext", "--text-file", text_file, "--max-chars", "600",
                     "--context-length", "32", "--stride", "16", "--position-ranges", "0:16", "16:32",
                     "--output", str(split_output)]) == 0
    split = json.loads(split_output.read_text())
    assert split["metrics"]["perplexity"] == pytest.approx(record["metrics"]["perplexity"], rel=1e-6)
    assert [(e["start"], e["end"]) for e in split["position_ranges"]] == [(0, 16), (16, 32)]
    assert split["metrics"]["perplexity_positions_16_32"] == split["position_ranges"][1]["perplexity"]
    assert "perplexity_positions_0_16: " in capsys.readouterr().out
    with pytest.raises(SystemExit, match="position range 0:64 must satisfy"):
        cli_main(["evaluate", str(folder), "--task", "wikitext", "--text-file", text_file, "--max-chars", "600",
                  "--context-length", "32", "--position-ranges", "0:64"])
    with pytest.raises(SystemExit, match="--position-ranges would be ignored by --task sst2 \\(classification\\)"):
        cli_main(["evaluate", str(folder), "--task", "sst2", "--position-ranges", "0:16"])


# --------------------------------------------------------------------------------------------
# Perplexity by position inside the window
# --------------------------------------------------------------------------------------------


def _hand_position_perplexity(model, ids, context, stride, start, end):
    """Every window's predictions of the tokens at window positions start..end-1, one prefix at a time."""
    total, count = 0.0, 0
    for begin, window_end, _ in perplexity_windows(len(ids), context, stride):
        for position in range(max(start, 1), min(end, window_end - begin)):
            with torch.no_grad():
                logits = model(torch.tensor([ids[begin:begin + position]])).logits[0, -1].double()
            total -= torch.log_softmax(logits, -1)[ids[begin + position]].item()
            count += 1
    return math.exp(total / count), count


@pytest.mark.parametrize("context,stride,batch_size", [(8, 4, 2), (8, 3, 1)])
def test_perplexity_by_window_position_matches_hand_computation(tiny_gpt2, context, stride, batch_size):
    ids = torch.randint(0, 50, (29,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = perplexity(tiny_gpt2, ids, context, stride, batch_size=batch_size)
    result = perplexity(tiny_gpt2, ids, context, stride, batch_size=batch_size,
                        position_ranges=["0:4", (4, context), "2:3"])
    assert result["perplexity"] == pytest.approx(plain["perplexity"], rel=1e-12)  # the protocol is unchanged
    assert [(entry["start"], entry["end"]) for entry in result["position_ranges"]] == [(0, 4), (4, context), (2, 3)]
    for entry in result["position_ranges"]:
        expected, count = _hand_position_perplexity(tiny_gpt2, ids, context, stride, entry["start"], entry["end"])
        assert entry["num_predictions"] == count
        assert entry["perplexity"] == pytest.approx(expected, rel=1e-5)
        assert entry["nll"] == pytest.approx(math.log(expected), rel=1e-5)
    assert "position_ranges" not in plain


def test_position_ranges_errors():
    assert evaluation.parse_position_ranges(["0:512", "512:", ":8"], 1024) == [(0, 512), (512, 1024), (0, 8)]
    for bad, message in (("5", "not START:END"), ("a:b", "not START:END"), ("512:512", "0 <= START < END"),
                         ("0:2048", "<= context length \\(1024\\)"), ("-1:4", "0 <= START")):
        with pytest.raises(EvaluationError, match=message):
            evaluation.parse_position_ranges([bad], 1024)
