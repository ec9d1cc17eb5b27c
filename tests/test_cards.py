"""Cards that describe the model they sit next to (issue 36).

1. The capabilities the cards state (``hf_performer.hub.capabilities.LAYER_BEHAVIOURS``) are checked against the
   runtime, kind by kind, on tiny models: a lifted limitation (or a removed feature) fails here, naming the entry.
2. One card per attention kind and flow (convert: FAVOR+, learned maps, window hybrid, clustered, kept softmax
   layers; distill; linearize; a recipe run): it names what the model computes, states what its records say (the
   fidelity report, linearize.json's perplexity and stages, a recipe's metrics) and nothing that belongs to another
   kind.
"""

import json

import pytest
import torch
from transformers import BertModel, LlamaForCausalLM
from transformers.utils import logging

from conftest import tiny_bert_config, tiny_llama_config
from hf_performer.conversion import ConversionError, convert_to_performer
from hf_performer.hub.capabilities import LAYER_BEHAVIOURS, layer_kinds, layer_ranges

logging.set_verbosity_error()

KIND_SETTINGS = {
    "linear": dict(nb_features=16),
    "window": dict(feature_map="hedgehog", window=4, sinks=1),
    "window-no-tail": dict(feature_map="hedgehog", window=4, sinks=1, linear_tail=False),
    "clustered": dict(attention="clustered", clusters=3),
    "improved-clustered": dict(attention="improved-clustered", clusters=3, topk=4),
    "softmax": dict(nb_features=16, keep_softmax_layers=[0, 1]),
}
LENGTH = 12


def _source(causal: bool, dropout: float = 0.0):
    torch.manual_seed(0)
    if causal:
        return LlamaForCausalLM(tiny_llama_config(max_position_embeddings=128, attention_dropout=dropout)).eval()
    return BertModel(tiny_bert_config(attention_probs_dropout_prob=dropout, hidden_dropout_prob=0.0)).eval()


def _converted(kind: str, causal: bool, dropout: float = 0.0):
    model = convert_to_performer(_source(causal, dropout), **KIND_SETTINGS[kind]).eval()
    assert set(layer_kinds(model.config.favor_settings, 2)) == {kind}
    return model


def _ids(length=LENGTH, seed=0):
    return torch.randint(3, 99, (1, length), generator=torch.Generator().manual_seed(seed))


def _output(model, **inputs):
    outputs = model(**inputs)
    return outputs.logits if hasattr(outputs, "logits") else outputs.last_hidden_state


def _cache_bytes(value, seen=None) -> int:
    """Bytes of every tensor storage a cache layer holds (attributes, tuples, state objects; views of one storage
    count once)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return 0
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        if ("storage", storage.data_ptr()) in seen:
            return 0
        seen.add(("storage", storage.data_ptr()))
        return storage.nbytes()
    if isinstance(value, (list, tuple)):
        return sum(_cache_bytes(item, seen) for item in value)
    if isinstance(value, dict):
        return sum(_cache_bytes(item, seen) for item in value.values())
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return sum(_cache_bytes(item, seen) for item in vars(value).values())
    return 0


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("kind", list(LAYER_BEHAVIOURS))
def test_the_behaviours_the_cards_state_are_the_runtimes(kind, causal):
    behaviour = LAYER_BEHAVIOURS[kind]
    if causal and not behaviour.causal:
        with pytest.raises(ConversionError):
            convert_to_performer(_source(True), **KIND_SETTINGS[kind])
        return
    model = _converted(kind, causal)
    ids = _ids()

    # output_attentions on a full forward
    with torch.no_grad():
        if behaviour.output_attentions:
            attentions = model(input_ids=ids, output_attentions=True).attentions
            assert attentions is not None and len(attentions) == 2, f"{kind}: LAYER_BEHAVIOURS says weights"
            assert all(a.shape[-2:] == (LENGTH, LENGTH) for a in attentions)
            torch.testing.assert_close(attentions[0].sum(-1), torch.ones_like(attentions[0].sum(-1)))
        else:
            with pytest.raises(Exception, match="output_attentions"):  # noqa: B017 - any one-line refusal
                model(input_ids=ids, output_attentions=True)

    # packed sequences: two sequences of 6 tokens in one row
    packed = behaviour.packed_causal if causal else behaviour.packed_bidirectional
    inputs = dict(input_ids=ids, position_ids=torch.tensor([[*range(6), *range(6)]]))
    if causal:
        inputs["use_cache"] = False
    else:
        lengths = torch.tensor([0, 6, LENGTH], dtype=torch.int32)
        inputs.update(cu_seq_lens_q=lengths, cu_seq_lens_k=lengths, max_length_q=6, max_length_k=6)
    with torch.no_grad():
        if packed:
            together = _output(model, **inputs)
            torch.testing.assert_close(together[:, 6:], _output(model, input_ids=ids[:, 6:]), atol=1e-4, rtol=1e-4)
        else:
            with pytest.raises(Exception, match="packed sequences"):  # noqa: B017
                _output(model, **inputs)

    # attention dropout in training (every other dropout is 0)
    trained = _converted(kind, causal, dropout=0.5).train()
    with torch.no_grad():
        torch.manual_seed(1)
        first = _output(trained, input_ids=ids)
        torch.manual_seed(2)
        second = _output(trained, input_ids=ids)
    assert torch.equal(first, second) != behaviour.attention_dropout, f"{kind}: attention dropout"

    if not causal:
        return
    # decoding: the cache layer generate() uses, its size against the context, prompt lookup
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        assert {type(layer).__name__ for layer in generated.past_key_values.layers} == {behaviour.cache_layer}
        sizes = []
        for length in (16, 48):
            cache = model.generate(_ids(length), max_new_tokens=1, do_sample=False,
                                   return_dict_in_generate=True).past_key_values
            sizes.append(sum(_cache_bytes(layer) for layer in cache.layers))
        assert (sizes[0] == sizes[1]) == behaviour.constant_cache, f"{kind}: cache bytes {sizes}"
        greedy = model.generate(ids, max_new_tokens=6, do_sample=False)
        if behaviour.assisted_decoding:
            assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, prompt_lookup_num_tokens=2),
                               greedy)


def test_layer_kinds_and_ranges_follow_the_recorded_settings():
    settings = {"feature_map": "hedgehog", "window": 64, "sinks": 4, "softmax_layers": [3],
                "layer_windows": {"0": {"window": 0, "sinks": 0}}}
    assert layer_kinds(settings, 5) == ["linear", "window", "window", "softmax", "window"]
    assert layer_kinds({"attention": "clustered", "softmax_layers": [1]}, 3) == ["clustered", "softmax", "clustered"]
    assert layer_ranges([0, 1, 2], 3) == "all 3 layers"
    assert layer_ranges([1, 2, 4], 6) == "layers 1-2, 4" and layer_ranges([3], 6) == "layer 3"


# --------------------------------------------------------------------------------------------
# The measurements the cards quote
# --------------------------------------------------------------------------------------------


def _results(name: str) -> dict:
    from pathlib import Path

    return json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "results" / f"{name}.json").read_text())


def _machine(result: dict) -> str:
    machine = result["machine"]
    return f"{machine['cpu_count']}-core {machine['cpu']} CPU, torch {machine['torch']}, {machine['date'][:10]}"


def _speedups(result: dict, implementation: str, mode: str) -> dict[int, float]:
    sdpa = {r["length"]: r["seconds"] for r in result["records"] if r["implementation"] == "sdpa" and r["mode"] == mode}
    return {r["length"]: round(sdpa[r["length"]] / r["seconds"], 2) for r in result["records"]
            if r["implementation"] == implementation and r["mode"] == mode}


def test_every_measured_figure_a_card_quotes_is_the_committed_benchmarks():
    """model_cards/measured_speed.json, section by section, recomputed from the benchmarks/results file it names."""
    from hf_performer.hub import MEASURED_SPEED as measured

    for section in measured.values():
        assert section["machine"] == _machine(_results(section["source"].split("/")[-1][:-len(".json")]))
    speed = _results("attention_speed")
    crossover = speed["summary"]["crossover_length_vs_sdpa"]
    assert (measured["linear"]["crossover_bidirectional"], measured["linear"]["crossover_causal"]) == \
        (round(crossover["bidirectional"]), round(crossover["causal"]))
    for row in measured["linear"]["rows"]:
        for mode in ("bidirectional", "causal"):
            assert row[mode] == round(speed["summary"]["speedup_vs_sdpa"][mode][str(row["length"])], 2)
    for name, key in (("linear_memory", "attention_memory"), ("window_memory", "attention_memory_window")):
        summary = _results(key)["summary"]
        ratios = summary["favor_over_sdpa"] if name == "linear_memory" else \
            summary["over_sdpa_by_implementation"]["window"]
        for mode in ("bidirectional", "causal"):
            assert measured[name][mode] == round(ratios[mode][str(measured[name]["length"])], 2)
    window = _speedups(_results("attention_speed_window"), "window", "causal")
    assert {row["length"]: row["causal"] for row in measured["window"]["rows"]} == window
    clustered = _results("clustered_speed")
    for kind in ("clustered", "improved-clustered"):
        assert {row["length"]: row[kind] for row in measured["clustered"]["rows"]} == \
            _speedups(clustered, kind, "bidirectional")


# --------------------------------------------------------------------------------------------
# One card per attention kind and flow
# --------------------------------------------------------------------------------------------

STALE_CLAIMS = ("no recurrent cache layer yet", "returns no weights", "packed sequences) raise",
                "assisted / speculative decoding is refused", "4.5x", "Where FAVOR+ is faster")
"""Sentences of earlier cards that the runtime no longer bears out (or that belonged to another kind)."""


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("card-sources")
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(max_position_embeddings=256)).save_pretrained(root / "llama")
    BertModel(tiny_bert_config()).save_pretrained(root / "bert")
    return root


def _convert(sources, tmp_path, source, *flags, capsys=None):
    from hf_performer.cli import main

    output = tmp_path / "model"
    assert main(["convert", str(sources / source), str(output), "--overwrite", *flags]) == 0
    text = (output / "README.md").read_text()
    from hf_performer.hub import validate_model_card

    tags = validate_model_card(text)["tags"]
    for claim in STALE_CLAIMS:
        assert claim not in text, claim
    report = json.loads((output / "conversion_report.json").read_text())
    return text, tags, report


def test_window_hybrid_card_and_report(sources, tmp_path, capsys):
    text, tags, report = _convert(sources, tmp_path, "llama", "--feature-map", "hedgehog", "--window", "16",
                                  "--sinks", "2")
    printed = capsys.readouterr().out
    assert {"hedgehog", "sliding-window-attention", "linear-attention"} <= set(tags) and "favor+" not in tags
    assert ("computed by a **sink + sliding-window hybrid**: exact softmax over the first 2 tokens (sinks) and the last "
            "16 keys, **`hedgehog`** linear attention over the older keys (learned softmax weight)") in text
    assert "[Zhang et al., 2025](https://arxiv.org/abs/2410.10254)" in text and "@inproceedings{zhang2025lolcats" in text
    # what it supports, from LAYER_BEHAVIOURS["window"]
    assert "| decoding cache (`generate`) | `WindowCacheLayer`, constant size |" in text
    assert "| `output_attentions=True` | the `[B, H, L, L]` weights the layer applies" in text
    # the report left the window: every layer sent positions through the tail, and the card shows them
    assert report["num_tokens"] > 0 and all(layer["kind"] == "window" and layer["tail_positions"] > 0
                                            for layer in report["layers"])
    for layer in report["layers"]:
        assert f"| {layer['layer']} | window | {layer['own_inputs_relative_error']:.4f} |" in text
        assert text.count(f" {layer['tail_positions']} |") >= 1
    assert min(layer["own_inputs_relative_error"] for layer in report["layers"]) > 0  # not a table of zeros
    # an untrained learned tail on a causal LM: it needs linearize, said in the card and on the command line
    assert "**Converted, not trained.**" in text and "hf-performer linearize SOURCE OUTPUT --train-file TEXT" in text
    assert "warning: the model's learned `hedgehog` feature maps are untrained" in printed and "linearize" in printed
    assert "positions via tail" in printed
    # its own speed figures, no FAVOR+ crossover table
    assert "- **Sink + window layers**" in text and "tokens bidirectional**" not in text
    assert "the 2 window layers keep a `WindowCacheLayer`" in text


def test_improved_clustered_card_names_clustered_attention_only(sources, tmp_path):
    text, tags, report = _convert(sources, tmp_path, "bert", "--attention", "improved-clustered", "--clusters", "3",
                                  "--topk", "4")
    assert "clustered-attention" in tags and not {"favor+", "linear-attention"} & set(tags)
    assert "**improved clustered attention**: 3 query clusters per head, exact softmax over each cluster's top 4 keys" \
        in text and "[Vyas et al., 2020](https://arxiv.org/abs/2007.04825)" in text
    for wrong in ("FAVOR+ linear attention", "random features per head", "256", "**Converted, not",
                  "hf-performer linearize"):
        assert wrong not in text, wrong
    assert "| `attention` | `improved-clustered` | attention kind (`clustered`:" in text
    assert "| `clusters` | 3 | query clusters per head" in text and "| `topk` | 4 |" in text
    assert "Also recorded but not used by this attention: `chunk_size`, `feature_map`" in text
    assert "**Zero-shot, not fine-tuned.**" in text and "- **Clustered attention**" in text
    assert all(layer["kind"] == "improved-clustered" for layer in report["layers"])
    assert "| `output_attentions=True` | the `[B, H, L, L]` weights" in text


def test_learned_map_cards_say_which_command_trains_them(sources, tmp_path, capsys):
    encoder, _, _ = _convert(sources, tmp_path, "bert", "--feature-map", "hedgehog")
    assert "train them by attention transfer (`hf-performer distill`)" in encoder
    assert "hf-performer linearize SOURCE" not in encoder
    capsys.readouterr()
    decoder, _, _ = _convert(sources, tmp_path, "llama", "--feature-map", "t2r")
    assert "train it with `hf-performer linearize SOURCE OUTPUT --train-file TEXT`" in decoder
    assert "the context leaves the window" not in decoder  # no window here
    assert "warning:" in capsys.readouterr().out
    _convert(sources, tmp_path, "llama", "--nb-features", "16")
    assert "warning:" not in capsys.readouterr().out  # FAVOR+ has nothing to train before fine-tuning


def test_kept_softmax_layers_are_their_own_column_and_grow_a_cache(sources, tmp_path):
    text, _, report = _convert(sources, tmp_path, "llama", "--nb-features", "16", "--keep-softmax-layers", "1")
    assert "every attention layer except 1 computed by **FAVOR+** linear attention" in text
    assert "| | linear attention | exact softmax (kept) |" in text
    assert "| decoding cache (`generate`) | `FavorCacheLayer`, constant size | `DynamicLayer`, grows with every token |" \
        in text
    assert "the 1 linear-attention layer keeps a recurrent state" in text
    assert "the 1 softmax layer keeps a key/value cache that grows by" in text
    assert "decoding memory does not grow with the context" not in text
    assert [layer["kind"] for layer in report["layers"]] == ["linear", "softmax"]


def test_a_sparse_cache_chosen_by_attention_is_carded_without_assisted_decoding(sources, tmp_path):
    """The assisted-decoding cell follows sparse_cache_selection: the attention rule cannot replay its boundaries,
    and generate(prompt_lookup_num_tokens=...) refuses it as the card says."""
    from transformers import AutoModelForCausalLM

    from hf_performer.hub.capabilities import ATTENTION_SELECTION_ROLLBACK

    flags = ["--window", "4", "--sinks", "1", "--sparse-cache", "2", "--no-linear-tail"]
    text, _, _ = _convert(sources, tmp_path, "llama", *flags, "--sparse-cache-selection", "attention")
    assert f"| prompt lookup / assisted decoding | {ATTENTION_SELECTION_ROLLBACK} |" in text
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    with pytest.raises(Exception, match="max_rollback|assisted|roll"):  # noqa: B017 - the one-line refusal
        model.generate(_ids(), max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=2)
    recall, _, _ = _convert(sources, tmp_path, "llama", *flags)
    assert "| prompt lookup / assisted decoding | supported (rejected candidates are rolled back" in recall


def test_layers_of_several_kinds_are_listed_one_by_one(sources, tmp_path):
    text, _, _ = _convert(sources, tmp_path, "llama", "--nb-features", "16", "--window", "8", "--sinks", "1",
                          "--layer-windows", '{"1": {"window": 0, "sinks": 0}}')
    assert "its attention layers replaced as listed below" in text
    assert "- layer 0: a **sink + sliding-window hybrid**: exact softmax over the first 1 token (sinks)" in text
    assert "- layer 1: **FAVOR+** linear attention" in text


def test_decoding_state_sizes_the_cards_state_are_the_caches(sources):
    """The bytes per sequence a card quotes for FavorCacheLayer / WindowCacheLayer are those the caches hold."""
    from hf_performer.hub.summary import linear_state_bytes, window_state_bytes

    for settings, expected in ((dict(nb_features=16), lambda: linear_state_bytes(4, 8, 16)),
                               (dict(feature_map="hedgehog", window=4, sinks=1),
                                lambda: window_state_bytes(2, 8, 16, 4, 1, 4)),
                               (dict(feature_map="hedgehog", window=4, sinks=1, sparse_cache=3),
                                lambda: window_state_bytes(2, 8, 16, 4, 1, 4, sparse_cache=3)),
                               (dict(window=4, sinks=1, linear_tail=False),
                                lambda: window_state_bytes(2, 8, 16, 4, 1, 4, linear_tail=False)),
                               (dict(window=4, sinks=1, linear_tail=False, sparse_cache=3),  # decodes from a record
                                lambda: window_state_bytes(2, 8, 16, 4, 1, 4, sparse_cache=3, linear_tail=False))):
        model = convert_to_performer(LlamaForCausalLM.from_pretrained(sources / "llama"), **settings).eval()
        with torch.no_grad():
            # (100 tokens: past the first boundary, where the sparse cache fills; before it the state is smaller)
            cache = model.generate(_ids(100), max_new_tokens=3, do_sample=False,
                                   return_dict_in_generate=True).past_key_values
        assert _cache_bytes(cache.layers[0]) == expected(), settings


# --------------------------------------------------------------------------------------------
# Flags that would be ignored or dead are refused before any work
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source,flags,message", [
    ("bert", ["--attention", "clustered", "--topk", "8"], "--topk would be ignored: it applies to --attention "
                                                          "improved-clustered only"),
    ("bert", ["--clusters", "8"], "--clusters would be ignored: they apply to --attention clustered"),
    ("bert", ["--attention", "clustered", "--feature-map", "hedgehog"], "--feature-map would be ignored: --attention "
                                                                        "clustered has no feature map"),
    ("bert", ["--attention", "improved-clustered", "--nb-features", "64"], "--nb-features would be ignored"),
    ("llama", ["--softmax-weight", "calibrated"], "--softmax-weight would be ignored: they apply to window layers"),
    ("llama", ["--layer-windows", '{"99": {"window": 4}}'], "layer_windows [99] do not exist: the source model has 2"),
    ("llama", ["--window", "8", "--keep-softmax-layers", "1", "--layer-windows", '{"1": {"window": 4}}'],
     "layers [1] are in both softmax_layers and layer_windows"),
    ("llama", ["--window", "256"], "--window 256 covers all 256 positions the model takes"),
    ("bert", ["--window", "600", "--keep-position-table"], "--window 600 covers all 512 positions"),
])
def test_convert_refuses_flags_the_combination_would_ignore(sources, tmp_path, source, flags, message):
    from hf_performer.cli import main

    with pytest.raises(SystemExit) as failure:
        main(["convert", str(sources / source), str(tmp_path / "out"), *flags])
    assert message in str(failure.value) and "\n" not in str(failure.value)
    assert not (tmp_path / "out").exists()
