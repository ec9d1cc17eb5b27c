"""Cards that describe the model they sit next to (issue 36).

1. The capabilities the cards state (``hf_performer.hub.capabilities.LAYER_BEHAVIOURS``) are checked against the
   runtime, kind by kind, on tiny models: a lifted limitation (or a removed feature) fails here, naming the entry.
2. One card per attention kind and flow (convert: FAVOR+, learned maps, window hybrid, clustered, kept softmax
   layers; distill; linearize; a recipe run): it names what the model computes, states what its records say (the
   fidelity report, linearize.json's perplexity and stages, a recipe's metrics) and nothing that belongs to another
   kind.
"""

import json
import shutil

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
    """Bytes of every tensor a cache layer holds (attributes, tuples, state objects)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return 0
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
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
