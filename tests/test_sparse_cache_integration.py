"""The sparse cache of hard keys (issue 33) beyond the operator: convert / update_favor_settings on a loaded model,
`hf-performer evaluate --sparse-cache`, the attention transfer's student and linearize's settings; the one-line
refusals of bad window settings (the sparse cache's and the bounded tail's) on a loaded model."""

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from hf_performer import convert_to_performer
from hf_performer.cli import main as cli_main
from hf_performer.favor_attention import update_favor_settings

from conftest import logits_of

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent (the GPT-2 tokenizer)")




def test_update_favor_settings_equals_converting_with_the_sparse_cache(tiny_llama_lm):
    ids = torch.randint(5, 90, (2, 70), generator=torch.Generator().manual_seed(1))
    settings = dict(feature_map="hedgehog", window=4, sinks=1, seed=0)
    direct = convert_to_performer(tiny_llama_lm, sparse_cache=3, **settings).eval()
    updated = convert_to_performer(tiny_llama_lm, **settings).eval()
    without = logits_of(updated, ids)
    assert update_favor_settings(updated, sparse_cache=3)["sparse_cache"] == 3
    assert updated.config.favor_settings["sparse_cache"] == 3
    torch.testing.assert_close(logits_of(updated, ids), logits_of(direct, ids))
    assert (logits_of(updated, ids) - without).abs().max() > 1e-4  # the cache changes what the model sees
    # generate() with the cache decodes what one pass computes
    with torch.no_grad():
        generated = updated.generate(ids[:1], max_new_tokens=6, do_sample=False)
        again = updated.generate(ids[:1], max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(generated, again)


@pytest.mark.parametrize("tail", [True, False])
def test_the_attention_selection_converts_decodes_and_reports_its_weights(tiny_llama_lm, tail):
    ids = torch.randint(5, 90, (2, 70), generator=torch.Generator().manual_seed(2))
    settings = dict(feature_map="hedgehog", window=4, sinks=1, seed=0, sparse_cache=3, linear_tail=tail)
    by_recall = convert_to_performer(tiny_llama_lm, **settings).eval()
    by_attention = convert_to_performer(tiny_llama_lm, sparse_cache_selection="attention", **settings).eval()
    assert by_attention.config.favor_settings["sparse_cache_selection"] == "attention"
    assert by_recall.config.favor_settings["sparse_cache_selection"] == "recall"  # the default, recorded
    assert (logits_of(by_attention, ids) - logits_of(by_recall, ids)).abs().max() > 1e-4  # other keys kept
    assert update_favor_settings(by_recall, sparse_cache_selection="attention")["sparse_cache_selection"] == "attention"
    torch.testing.assert_close(logits_of(by_recall, ids), logits_of(by_attention, ids))
    with torch.no_grad():  # generate() with the model's cache selects what one pass selects
        generated = by_attention.generate(ids[:1], max_new_tokens=12, do_sample=False)
        again = by_attention.generate(ids[:1], max_new_tokens=12, do_sample=False, use_cache=False)
        output = by_attention(ids, output_attentions=True)
    assert torch.equal(generated, again)
    assert all(torch.isfinite(weights).all() for weights in output.attentions)
    with pytest.raises(ValueError, match="sparse_cache_selection'] must be one of"):
        update_favor_settings(by_attention, sparse_cache_selection="largest")


@pytest.mark.parametrize("changes, message", [
    (dict(sparse_cache=-1), "sparse_cache"),
    (dict(sparse_cache="many"), "sparse_cache"),
    (dict(tail_cap=-1), "tail_cap'] must be an int >= 0"),
    (dict(tail_cap=8, linear_tail=False), "tail_cap'] bounds the linear tail"),
])
def test_update_favor_settings_refuses_bad_values_in_one_line(tiny_llama_lm, changes, message):
    model = convert_to_performer(tiny_llama_lm, feature_map="hedgehog", window=4, sinks=1)
    with pytest.raises(ValueError, match=message) as failure:
        update_favor_settings(model, **changes)
    assert "\n" not in str(failure.value)


def test_update_favor_settings_refuses_a_model_without_favor_attention(tiny_llama_lm):
    with pytest.raises(ValueError, match="has no attention module running favor attention"):
        update_favor_settings(tiny_llama_lm, sparse_cache=3)


def test_a_sparse_cache_on_a_linear_model_is_refused(tiny_llama_lm):
    with pytest.raises(ValueError, match="sparse_cache"):
        convert_to_performer(tiny_llama_lm, nb_features=16, sparse_cache=3)


@needs_shared
def test_evaluate_with_a_sparse_cache_records_the_change(tmp_path, tiny_llama_config, gpt2_tokenizer):
    tokenizer = gpt2_tokenizer
    torch.manual_seed(0)
    source = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=256))
    folder = tmp_path / "hybrid"
    convert_to_performer(source, feature_map="hedgehog", window=4, sinks=1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    text = str(SHARED / "wikitext-2-raw" / "wiki.test.raw")
    records = {}
    for name, extra in (("off", []), ("on", ["--sparse-cache", "8"])):
        output = tmp_path / f"{name}.json"
        assert cli_main(["evaluate", str(folder), "--task", "wikitext", "--text-file", text, "--max-chars", "600",
                         "--context-length", "48", "--stride", "24", "--no-progress", "--output", str(output),
                         *extra]) == 0
        records[name] = json.loads(output.read_text())
    assert records["on"]["favor_settings_changed"] == {"sparse_cache": 8}
    assert "favor_settings_changed" not in records["off"]
    assert records["on"]["metrics"]["perplexity"] != records["off"]["metrics"]["perplexity"]
    # the folder itself is unchanged
    assert json.loads((folder / "config.json").read_text())["favor_settings"]["sparse_cache"] == 0
    # a model without favor attention: one line, nothing written
    plain = tmp_path / "plain"
    source.save_pretrained(plain)
    tokenizer.save_pretrained(plain)
    with pytest.raises(SystemExit, match="cannot evaluate with") as failure:
        cli_main(["evaluate", str(plain), "--task", "wikitext", "--text-file", text, "--max-chars", "600",
                  "--context-length", "48", "--sparse-cache", "8", "--output", str(tmp_path / "plain.json")])
    assert "\n" not in str(failure.value) and not (tmp_path / "plain.json").exists()


@needs_shared
def test_settings_writes_the_model_served_with_other_settings(tmp_path, tiny_llama_config, capsys, gpt2_tokenizer):
    """`hf-performer settings` writes the same weights with another window / sparse cache (a loadable folder and its
    record, no local paths), which evaluates as `hf-performer evaluate --window --sparse-cache` on the original."""
    from transformers import AutoModelForCausalLM

    tokenizer = gpt2_tokenizer
    torch.manual_seed(0)
    source = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=256))
    folder, served = tmp_path / "hybrid", tmp_path / "served"
    convert_to_performer(source, feature_map="hedgehog", window=4, sinks=1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert cli_main(["settings", str(folder), str(served), "--window", "8", "--sparse-cache", "6"]) == 0
    assert "window 4 -> 8, sparse_cache 0 -> 6" in capsys.readouterr().out
    by_attention = tmp_path / "by-attention"
    assert cli_main(["settings", str(served), str(by_attention), "--sparse-cache-selection", "attention"]) == 0
    assert "sparse_cache_selection recall -> attention" in capsys.readouterr().out
    assert json.loads((by_attention / "config.json").read_text())["favor_settings"]["sparse_cache_selection"] == \
        "attention"
    written = (served / "serving_settings.json").read_text()
    record = json.loads(written)
    assert str(tmp_path) not in written and record["command"] == "hf-performer settings hybrid served --window 8 " \
        "--sparse-cache 6"
    card = (served / "README.md").read_text()
    assert "## Serving settings" in card and "window 4 -> 8, sparse_cache 0 -> 6" in card
    memory = record["decoding_state_per_sequence"]
    assert memory["16384"]["state_bytes"] == memory["65536"]["state_bytes"] < memory["16384"]["softmax_bytes"]
    reloaded = AutoModelForCausalLM.from_pretrained(served, trust_remote_code=True).eval()
    assert (reloaded.config.favor_settings["window"], reloaded.config.favor_settings["sparse_cache"]) == (8, 6)
    assert json.loads((folder / "config.json").read_text())["favor_settings"]["window"] == 4  # the source unchanged
    text = str(SHARED / "wikitext-2-raw" / "wiki.test.raw")
    perplexities = []
    for model, extra in ((served, []), (folder, ["--window", "8", "--sparse-cache", "6"]), (by_attention, []),
                         (folder, ["--window", "8", "--sparse-cache", "6", "--sparse-cache-selection", "attention"])):
        output = tmp_path / f"{model.name}.json"
        assert cli_main(["evaluate", str(model), "--task", "wikitext", "--text-file", text, "--max-chars", "600",
                         "--context-length", "48", "--stride", "24", "--no-progress", "--output", str(output),
                         *extra]) == 0
        perplexities.append(json.loads(output.read_text())["metrics"]["perplexity"])
    assert perplexities[0] == pytest.approx(perplexities[1], rel=1e-6)
    assert perplexities[2] == pytest.approx(perplexities[3], rel=1e-6)  # (48 tokens: one boundary, the same keys)
    # bad input: one line, nothing written
    plain = tmp_path / "plain"
    source.save_pretrained(plain)
    tokenizer.save_pretrained(plain)
    for arguments, message in (([str(folder), str(tmp_path / "a")], "nothing to change"),
                               ([str(folder), str(tmp_path / "b"), "--sparse-cache", "-1"], "must be an int >= 0"),
                               ([str(plain), str(tmp_path / "c"), "--window", "8"], "not a window hybrid"),
                               ([str(folder), str(tmp_path / "d"), "--sparse-cache", "1000000"],
                                "sparse_cache 1000000 covers all 256 positions the model takes"),
                               ([str(folder), str(tmp_path / "e"), "--window", "100000"],
                                "window 100000 covers all 256 positions the model takes"),
                               ([str(folder), str(tmp_path / "f"), "--window", "4", "--sparse-cache", "0"],
                                "already has window 4, sparse_cache 0: nothing to change, nothing written")):
        with pytest.raises(SystemExit, match=message) as failure:
            cli_main(["settings", *arguments])
        assert "\n" not in str(failure.value) and not Path(arguments[1]).exists()


def test_the_transfer_student_uses_the_layer_sparse_cache(tiny_llama_lm):
    from hf_performer.conversion.attention_transfer import window_of_layer
    from hf_performer.favor_attention import find_attention_modules

    model = convert_to_performer(tiny_llama_lm, feature_map="hedgehog", window=4, sinks=1, sparse_cache=5,
                                 layer_windows={"1": {"window": 8, "sparse_cache": 0}})
    layers = [window_of_layer(module) for _, module in find_attention_modules(model)]
    assert [(layer.window, layer.sparse_cache) for layer in layers] == [(4, 5), (8, 0)]
    assert all(layer.chunk_size == model.config.favor_settings["chunk_size"] for layer in layers)


def test_linearize_passes_the_sparse_cache_to_the_conversion():
    from hf_performer.recipes.linearize import LinearizeSettings, RecipeError, conversion_arguments

    assert conversion_arguments(LinearizeSettings("source", ["train.txt"], sparse_cache=32))["sparse_cache"] == 32
    with pytest.raises(RecipeError, match="--sparse-cache must be an int >= 0"):
        LinearizeSettings("source", ["train.txt"], sparse_cache=-1).check()
