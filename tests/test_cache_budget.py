"""One decoding-memory budget spent per layer (issue 33, item 2): the measured errors, the exact allocation under the
budget, its application to a model, `hf-performer budget` and `hf-performer linearize --cache-budget`."""

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from hf_performer import convert_to_performer
from hf_performer.cache import make_favor_cache
from hf_performer.cli import main as cli_main
from hf_performer.conversion.cache_budget import (
    SOFTMAX, CacheBudgetError, allocate_cache_budget, apply_cache_allocation, layer_geometries, model_state_bytes,
    measure_option_errors, option_bytes, parse_cache_budget, settings_state_bytes,
)
from hf_performer.favor_settings import layer_sparse_cache

from conftest import benchmark_script, forbid_new_evaluations, save_tiny_hybrid_and_softmax

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent (the GPT-2 tokenizer)")


@pytest.fixture(scope="module")
def hybrid(tiny_llama_config):
    torch.manual_seed(0)
    source = LlamaForCausalLM(tiny_llama_config(max_position_embeddings=256, num_hidden_layers=3)).eval()
    return convert_to_performer(source, feature_map="hedgehog", window=4, sinks=1, seed=0).eval()


@pytest.fixture(scope="module")
def batches():
    ids = torch.randint(5, 90, (2, 96), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": ids}]


@pytest.fixture(scope="module")
def errors(hybrid, batches):
    return measure_option_errors(hybrid, batches, (0, 4, 16, 48))


def _brute_force(hybrid, errors, budget, context, allow_softmax=True):
    """The smallest summed error over every combination of options within the budget."""
    geometries = {g.layer: g for g in layer_geometries(hybrid)}
    choices = {layer: sorted(errors[layer]) + ([SOFTMAX] if allow_softmax else []) for layer in errors}
    best = None
    for combination in itertools.product(*(choices[layer] for layer in sorted(errors))):
        cost = sum(option_bytes(geometries[layer], option, context, 4)
                   for layer, option in zip(sorted(errors), combination))
        error = sum(0.0 if option == SOFTMAX else errors[layer][option]
                    for layer, option in zip(sorted(errors), combination))
        if cost <= budget and (best is None or error < best):
            best = error
    return best


def test_errors_are_measured_for_every_window_layer_and_size(errors, hybrid, batches):
    assert sorted(errors) == [0, 1, 2]
    for layer, by_size in errors.items():
        assert set(by_size) == {0, 4, 16, 48}
        assert by_size[48] < by_size[0]  # half the sequence exact: closer to softmax than no cache
    with pytest.raises(CacheBudgetError, match="at least 128 tokens") as failure:
        measure_option_errors(hybrid, batches, (0, 64))
    assert "\n" not in str(failure.value)


@pytest.mark.parametrize("budget_share", [0.0, 0.3, 0.6, 1.0])
@pytest.mark.parametrize("context", [64, 4096])
def test_the_allocation_is_the_best_combination_within_the_budget(hybrid, errors, budget_share, context):
    geometries = {g.layer: g for g in layer_geometries(hybrid)}
    cheapest = sum(min(option_bytes(g, size, context, 4) for size in errors[g.layer]) for g in geometries.values())
    dearest = sum(option_bytes(g, SOFTMAX, context, 4) + option_bytes(g, 48, context, 4)
                  for g in geometries.values())
    budget = int(cheapest + budget_share * (dearest - cheapest))
    allocation = allocate_cache_budget(hybrid, errors, budget, context)
    assert allocation.total_bytes <= budget
    assert allocation.total_bytes == sum(entry["bytes"] for entry in allocation.layers.values())
    assert allocation.total_error == pytest.approx(_brute_force(hybrid, errors, budget, context), rel=1e-6, abs=1e-15)
    if allocation.uniform is not None:
        assert allocation.total_error <= allocation.uniform["error"] + 1e-15
    record = json.loads(json.dumps(allocation.to_dict()))
    assert record["softmax_layers"] == allocation.softmax_layers


def test_a_budget_below_the_smallest_state_is_refused_in_one_line(hybrid, errors):
    with pytest.raises(CacheBudgetError, match="below this model's smallest decoding state") as failure:
        allocate_cache_budget(hybrid, errors, 1000, 1024)
    assert "\n" not in str(failure.value)
    with pytest.raises(CacheBudgetError, match="no causal window layer"):
        allocate_cache_budget(hybrid, {}, 10 ** 9, 1024)
    with pytest.raises(CacheBudgetError, match="context"):
        allocate_cache_budget(hybrid, errors, 10 ** 9, 0)


def test_an_allocation_for_layers_without_a_tail_warns_that_it_may_be_worse(hybrid, errors, batches,
                                                                            tiny_llama_config):
    from hf_performer.conversion.cache_budget import NO_TAIL_NOTE, allocation_table
    with_tail = allocate_cache_budget(hybrid, errors, 10 ** 9, 1024)
    assert NO_TAIL_NOTE not in with_tail.notes and "Note:" not in allocation_table(with_tail)
    torch.manual_seed(0)
    source = LlamaForCausalLM(tiny_llama_config(max_position_embeddings=256, num_hidden_layers=3)).eval()
    no_tail = convert_to_performer(source, feature_map="hedgehog", window=4, sinks=1, seed=0, linear_tail=False).eval()
    allocation = allocate_cache_budget(no_tail, measure_option_errors(no_tail, batches, (0, 16)), 10 ** 9, 1024)
    assert allocation.notes[-1] == NO_TAIL_NOTE
    assert f"Note: {NO_TAIL_NOTE}" in allocation_table(allocation)
    assert NO_TAIL_NOTE in json.dumps(allocation.to_dict())


@pytest.mark.parametrize("text, expected", [("2MiB", 2 * 2 ** 20), ("1.5MB", 1_500_000), ("4096", 4096),
                                            ("10tokens", 10 * 3072), ("3 KiB", 3072)])
def test_budget_sizes_parse(text, expected):
    assert parse_cache_budget(text, 3072) == expected


@pytest.mark.parametrize("text", ["lots", "-3MiB", "0", "12 parsecs"])
def test_bad_budget_sizes_are_refused_in_one_line(text):
    with pytest.raises(CacheBudgetError, match="cache budget") as failure:
        parse_cache_budget(text, 3072)
    assert "\n" not in str(failure.value)


def test_the_applied_allocation_is_what_the_model_and_its_cache_run(hybrid, errors, batches, tiny_llama_config):
    torch.manual_seed(0)
    source = LlamaForCausalLM(tiny_llama_config(max_position_embeddings=256, num_hidden_layers=3)).eval()
    model = convert_to_performer(source, feature_map="hedgehog", window=4, sinks=1, seed=0).eval()
    geometries = {g.layer: g for g in layer_geometries(model)}
    # room for G = 16 in every layer and one layer on softmax at 1024 tokens
    budget = sum(option_bytes(g, 16, 1024, 4) for g in geometries.values()) + \
        option_bytes(geometries[0], SOFTMAX, 1024, 4)
    allocation = allocate_cache_budget(model, errors, budget, 1024)
    assert allocation.softmax_layers and allocation.sparse_cache_by_layer  # both kinds of choice
    settings = apply_cache_allocation(model, allocation)
    for layer, size in allocation.sparse_cache_by_layer.items():
        assert layer_sparse_cache(settings, layer) == size
    assert settings["softmax_layers"] == allocation.softmax_layers
    ids = batches[0]["input_ids"][:1, :40]
    with torch.no_grad():
        one_pass = model(input_ids=ids).logits
        cache = make_favor_cache(model)
        prefill = model(input_ids=ids[:, :30], cache=cache, use_cache=True).logits
        steps = [model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits
                 for t in range(30, 40)]
    torch.testing.assert_close(torch.cat([prefill, *steps], 1), one_pass, rtol=1e-4, atol=1e-4)


def _saved_window_hybrid(tmp_path, tiny_llama_config, **conversion):
    """A tiny Llama converted to a window hybrid (window 4, 1 sink), saved with the GPT-2 tokenizer, and a training
    text: ``(hybrid, tokenizer, model folder, output folder, text file)``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SHARED / "gpt2-tokenizer")
    torch.manual_seed(0)
    source = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=256))
    hybrid = convert_to_performer(source, window=4, sinks=1, seed=0, chunk_size=16, **conversion)
    model_dir, output = tmp_path / "hybrid", tmp_path / "budgeted"
    hybrid.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    text = tmp_path / "train.txt"
    text.write_text(" ".join(f"word{i % 37} and {i % 11}." for i in range(400)))
    return hybrid, tokenizer, model_dir, output, text


@needs_shared
def test_budget_command_writes_a_loadable_folder_with_its_record(tmp_path, tiny_llama_config):
    hybrid, _, model_dir, output, text = _saved_window_hybrid(tmp_path, tiny_llama_config, feature_map="hedgehog")
    bytes_g4 = sum(option_bytes(g, 4, 2048, 4) for g in layer_geometries(hybrid))
    assert cli_main(["budget", str(model_dir), str(output), "--cache-budget", str(bytes_g4), "--context", "2048",
                     "--text-file", str(text), "--cache-sizes", "0", "4", "16", "--length", "64",
                     "--metric", "error"]) == 0
    written = (output / "cache_budget.json").read_text()
    record = json.loads(written)
    assert record["total_bytes"] <= bytes_g4 and record["measured_on"]["text_file"] == "train.txt"
    assert str(tmp_path) not in written
    reloaded = AutoModelForCausalLM.from_pretrained(output, trust_remote_code=True)
    overrides = reloaded.config.favor_settings["layer_windows"]
    assert {int(layer): values["sparse_cache"] for layer, values in overrides.items()} == \
        {int(layer): entry["option"] for layer, entry in record["layers"].items() if entry["option"] != SOFTMAX}
    assert record["command"].startswith("hf-performer budget hybrid budgeted --cache-budget")
    card = (output / "README.md").read_text()
    assert "## Memory budget" in card and f"Summed measured error: {record['total_error']:.4g}" in card
    # the committed-result collector: JSON with the machine, PNG beside it
    result = tmp_path / "results" / "budget.json"
    assert benchmark_script("cache_budget_result").main([str(output), "--output", str(result)]) == 0
    assert json.loads(result.read_text())["layers"] == record["layers"] and result.with_suffix(".png").is_file()
    with pytest.raises(SystemExit, match="below this model's smallest decoding state") as failure:
        cli_main(["budget", str(model_dir), str(tmp_path / "other"), "--cache-budget", "1KiB",
                  "--text-file", str(text), "--length", "64"])
    assert "\n" not in str(failure.value) and not (tmp_path / "other").exists()


def test_budget_by_the_end_metric_measures_the_choice_beside_one_g_for_every_layer(tmp_path, tiny_llama_config):
    """--metric loss (the default): each layer's options cost the rise of the model's next-token loss with every
    other window layer exact; the chosen allocation and the best single G are then measured, and the card says so.
    The measurement leaves the model's own settings as they were."""
    from hf_performer.conversion.cache_budget import measure_option_losses, mean_token_loss

    hybrid, tokenizer, model_dir, output, text = _saved_window_hybrid(tmp_path, tiny_llama_config, linear_tail=False)
    ids = torch.randint(0, len(tokenizer), (1, 64), generator=torch.Generator().manual_seed(0))
    before = dict(hybrid.config.favor_settings)
    rises, exact = measure_option_losses(hybrid, [{"input_ids": ids}], (0, 8, 32))
    assert hybrid.config.favor_settings == before and set(rises) == {0, 1} and set(rises[0]) == {0, 8, 32}
    # every other layer exact: a layer keeping every older key (G = 64 - 5) adds nothing
    assert mean_token_loss(hybrid, [{"input_ids": ids}], {0: 59, 1: 59}) == pytest.approx(exact, abs=1e-6)
    assert rises[0][0] != pytest.approx(0.0, abs=1e-6)  # a layer that drops every older key changes the loss

    budget = sum(option_bytes(g, 8, 2048, 4) for g in layer_geometries(hybrid))
    assert cli_main(["budget", str(model_dir), str(output), "--cache-budget", str(budget), "--context", "2048",
                     "--text-file", str(text), "--cache-sizes", "0", "8", "16", "--length", "64"]) == 0
    record = json.loads((output / "cache_budget.json").read_text())
    assert record["metric"] == "loss" and "--metric loss" in record["command"] and record["total_bytes"] <= budget
    assert set(record["measured"]) == {"exact", "allocation", "uniform"} and record["uniform"]["sparse_cache"] == 8
    assert all(entry["perplexity"] == pytest.approx(math.exp(entry["loss"])) for entry in record["measured"].values())
    card = (output / "README.md").read_text()
    assert "the measured rise of the model's next-token loss" in card and "Summed measured loss rise" in card
    assert f"this allocation {record['measured']['allocation']['perplexity']:.3f}" in card


def test_hybrid_arms_takes_per_layer_settings_as_json_and_records_them_runnable():
    """``layer_windows={...}`` is parsed as JSON, and the recorded command gives it back shell-quoted, so that
    the command in the result runs as it reads."""
    import shlex

    arms = benchmark_script("hybrid_arms")
    item = 'layer_windows={"3":{"sparse_cache":2048},"7":{"sparse_cache":0}}'
    changes, contexts, passkey, lengths = arms._parse_changes([item, "sparse_cache=256", "linear_tail=false"],
                                                              [8192], [8176])
    assert changes == {"layer_windows": {"3": {"sparse_cache": 2048}, "7": {"sparse_cache": 0}},
                       "sparse_cache": 256, "linear_tail": False}
    recorded = " ".join(arms._setting_text(key, value) for key, value in changes.items())
    assert arms._parse_changes(shlex.split(recorded), [8192], [8176])[0] == changes


def test_hybrid_arms_takes_a_snapkv_peer_for_retrieval_only():
    arms = benchmark_script("hybrid_arms")
    changes, contexts, passkey, lengths = arms._parse_changes(["contexts=none", "snapkv=1024", "snapkv_window=256"],
                                                              [2048, 8192], [8176])
    assert contexts == [] and passkey and lengths == [8176]
    assert arms._snapkv(changes) == {"keys": 1024, "window": 256, "sinks": 4, "pool": 7} and changes == {}
    assert arms._snapkv({"snapkv": 8, "snapkv_pool": 31})["pool"] == 31
    with pytest.raises(SystemExit, match="need snapkv=KEYS"):
        arms._snapkv({"snapkv_sinks": 2})
    with pytest.raises(SystemExit, match="give it contexts=none"):
        arms._evaluate(None, "snap", "folder", {"snapkv": 16}, [2048])


@needs_shared
def test_the_hybrid_arms_collector_writes_its_result(tmp_path, monkeypatch, gpt2_tokenizer):
    arms = benchmark_script("hybrid_arms")
    save_tiny_hybrid_and_softmax(tmp_path, gpt2_tokenizer)
    stages = {"convert": {"status": "done", "wall_time_s": 1.0}, "transfer": {"status": "done", "wall_time_s": 20.5},
              "select": {"status": "skipped"}, "lora": {"status": "done", "wall_time_s": 7.25}}
    (tmp_path / "hybrid" / "linearize.json").write_text(json.dumps({"stages": stages}))  # as linearize writes it
    monkeypatch.chdir(tmp_path)
    output = tmp_path / "results" / "arms.json"
    arguments = ["--baseline", "softmax", "--arm", "tail", "hybrid", "--arm", "window", "hybrid", "linear_tail=false",
                 "--arm", "cache", "hybrid", "sparse_cache=8", "contexts=48", "--arm", "long", "hybrid",
                 "contexts=96", "passkey=false", "--text-file",
                 str(SHARED / "wikitext-2-raw" / "wiki.test.raw"), "--max-chars", "600", "--contexts", "48", "96",
                 "--position-ranges", "0:24", "24:48", "--passkey-lengths", "128", "--depths", "0.5", "--trials", "1",
                 "--memory-lengths", "64", "1024", "--work-dir", str(tmp_path / "work"), "--no-progress",
                 "--output", "results/arms.json"]
    assert arms.main(arguments) == 0
    result = json.loads(output.read_text())
    assert (tmp_path / "results" / "arms.png").is_file()
    assert set(result["arms"]) == {"tail", "window", "cache", "long"}
    long = result["arms"]["long"]  # one context, no passkey, no split by position (that is the first context's)
    assert set(long["perplexity"]) == {"96"} and long["passkey_by_length"] == {} and "perplexity_by_position" not in long
    assert "contexts=96 passkey=false" in result["command"]
    tail, window, cache = (result["arms"][name] for name in ("tail", "window", "cache"))
    assert set(tail["perplexity"]) == {"48", "96"} and set(tail["perplexity_by_position"]) == {"0:24", "24:48"}
    assert tail["perplexity_ratio"]["96"] == pytest.approx(
        tail["perplexity"]["96"] / result["baseline"]["perplexity"]["96"])
    assert window["changes"] == {"linear_tail": False} and window["favor_settings"]["linear_tail"] is False
    assert tail["training_seconds"] == {"transfer": 20.5, "lora": 7.25} and "training_seconds" not in result["baseline"]
    assert window["perplexity"]["48"] != tail["perplexity"]["48"] != cache["perplexity"]["48"]
    assert set(cache["perplexity"]) == {"48"} and "contexts=48" in result["command"]
    # memory: softmax grows with the context, the hybrid's state does not; the sparse cache costs its keys
    assert result["baseline"]["cache_bytes"]["1024"] == 16 * result["baseline"]["cache_bytes"]["64"]
    assert tail["cache_bytes"]["1024"] == tail["cache_bytes"]["64"] < cache["cache_bytes"]["64"]
    assert str(tmp_path) not in output.read_text()
    forbid_new_evaluations(monkeypatch)  # resumed from the work dir: nothing is evaluated again
    assert arms.main(arguments) == 0
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        arms.main([*arguments[:5], "oops", *arguments[5:]])
    for setting, flag in (("contexts=4096", "--contexts"), ("retrieval=8", "--retrieval-lengths")):
        with pytest.raises(SystemExit, match=f"{setting} must name some of {flag}"):
            arms.main([*arguments[:5], setting, *arguments[5:]])
    assert json.loads(output.read_text())["protocol"]["target_ratio"] == 1.05


@pytest.mark.parametrize("verb,arguments", [("settings", ["--sparse-cache", "4"]),
                                            ("budget", ["--cache-budget", "10%", "--text-file", __file__])])
def test_budget_and_settings_refuse_a_bidirectional_window_model_before_any_work(tmp_path, verb, arguments):
    """A converted encoder loads as a causal LM with a random head: refused in one line, nothing written."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    encoder = convert_to_performer(BertModel(BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                                        num_attention_heads=2, intermediate_size=37)).eval(),
                                   feature_map="hedgehog", window=4, sinks=1)
    encoder.save_pretrained(tmp_path / "encoder")
    with pytest.raises(SystemExit, match=f"hf-performer {verb}: error: .* is a bidirectional bert model, not a causal "
                                         "LM: .* an encoder keeps no decoding state") as failure:
        cli_main([verb, str(tmp_path / "encoder"), str(tmp_path / "out"), *arguments])
    assert "\n" not in str(failure.value) and not (tmp_path / "out").exists()


def test_settings_state_bytes_is_the_state_of_the_converted_model(tiny_llama_config):
    source = LlamaForCausalLM(tiny_llama_config(max_position_embeddings=256, num_hidden_layers=3)).eval()
    for settings in (dict(feature_map="hedgehog", window=4, sinks=1, sparse_cache=8, linear_tail=False),
                     dict(feature_map="hedgehog", window=4, sinks=1, layer_windows={"1": {"sparse_cache": 4}},
                          keep_softmax_layers=[2])):
        model = convert_to_performer(source, **settings)
        stored = model.config.favor_settings
        assert settings_state_bytes(source.config, stored, 200) == model_state_bytes(model, 200)


def test_the_committed_state_sizes_follow_the_one_accounting():
    """Every decoding-state size of the committed SmolLM2 arms is what ``model_state_bytes`` gives for the arm's
    settings on the record's source geometry (the numbers the docs quote come from there)."""
    import types

    record = json.loads((REPO / "benchmarks" / "results" / "hybrid_arms_smollm2.json").read_text())
    geometry = dict(record["source_geometry"])
    dtype_bytes = geometry.pop("dtype_bytes")
    config = types.SimpleNamespace(**geometry)
    for name, arm in record["arms"].items():
        expected = {context: settings_state_bytes(config, arm["favor_settings"], int(context), dtype_bytes)
                    for context in arm["cache_bytes"]}
        assert arm["cache_bytes"] == expected, name
