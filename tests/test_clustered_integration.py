"""(Improved) clustered attention as a model attention kind: favor settings / PerformerConfig, the converter and its
flags, exactness limits on a real (tiny) BERT, padding, causal models refused, save / load with trust_remote_code."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import BertForMaskedLM, BertForSequenceClassification, GPT2LMHeadModel

from conftest import tiny_bert_config, tiny_gpt2_config
from hf_performer import PerformerConfig, PerformerConfigError
from hf_performer.cli import convert as convert_cli
from hf_performer.clustered_attention import ClusteredAttentionError
from hf_performer.conversion import ConversionError, convert_to_performer
from hf_performer.favor_settings import canonical_favor_settings, resolve_favor_settings

LENGTH = 12


def _batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, 99, (2, LENGTH), generator=generator)
    attention_mask = torch.ones(2, LENGTH, dtype=torch.long)
    attention_mask[1, 8:] = 0
    return input_ids, attention_mask


def _bert(cls=BertForMaskedLM, seed=0):
    # A large initialisation gives peaked attention, which clustering with few clusters visibly approximates.
    torch.manual_seed(seed)
    return cls(tiny_bert_config(attn_implementation="eager", num_attention_heads=4, initializer_range=0.5)).eval()


def _close_on_tokens(a, b, mask, atol):
    keep = mask.bool()
    torch.testing.assert_close(a[keep], b[keep], rtol=1e-4, atol=atol)


@pytest.mark.parametrize("attention", ["clustered", "improved-clustered"])
def test_as_many_clusters_as_tokens_reproduces_the_softmax_model(attention):
    source = _bert()
    input_ids, attention_mask = _batch()
    performer = convert_to_performer(source, attention=attention, clusters=LENGTH, topk=3)
    with torch.no_grad():
        expected = source(input_ids=input_ids, attention_mask=attention_mask).logits
        out = performer(input_ids=input_ids, attention_mask=attention_mask).logits
    _close_on_tokens(out, expected, attention_mask, atol=1e-4)


def test_improved_with_topk_at_least_the_length_is_exact_and_clustered_is_not():
    source = _bert(BertForSequenceClassification)
    input_ids, attention_mask = _batch(1)
    improved = convert_to_performer(source, attention="improved-clustered", clusters=2, topk=64)  # capped at L
    clustered = convert_to_performer(source, attention="clustered", clusters=2)
    with torch.no_grad():
        hidden = lambda m: m(input_ids=input_ids, attention_mask=attention_mask,  # noqa: E731
                             output_hidden_states=True).hidden_states[-1]
        expected = hidden(source)
        _close_on_tokens(hidden(improved), expected, attention_mask, atol=1e-4)
        assert (hidden(clustered) - expected)[attention_mask.bool()].abs().max() > 1e-3


def test_padding_does_not_change_the_tokens_outputs():
    # Extra padding tokens neither move a cluster centre nor receive attention.
    performer = convert_to_performer(_bert(), attention="improved-clustered", clusters=3, topk=4)
    input_ids, _ = _batch(2)
    short = input_ids[:1, :8]
    padded = torch.cat([short, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    mask = torch.tensor([[1] * 8 + [0] * 4])
    with torch.no_grad():
        a = performer(input_ids=short).logits
        b = performer(input_ids=padded, attention_mask=mask).logits[:, :8]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_clustered_models_have_no_feature_map_and_are_deterministic():
    performer = convert_to_performer(_bert(), attention="clustered", clusters=3)
    assert not any("favor_feature_map" in name for name in performer.state_dict())
    input_ids, attention_mask = _batch()
    with torch.no_grad():
        first = performer(input_ids=input_ids, attention_mask=attention_mask).logits
        torch.manual_seed(7)
        assert torch.equal(first, performer(input_ids=input_ids, attention_mask=attention_mask).logits)


def test_settings_are_validated_and_recorded():
    settings = canonical_favor_settings({"attention": "improved-clustered", "clusters": 8, "topk": 16})
    assert (settings["attention"], settings["clusters"], settings["topk"]) == ("improved-clustered", 8, 16)
    assert resolve_favor_settings({})["attention"] == "linear"
    for bad, message in [({"attention": "cluster"}, "must be one of"), ({"clusters": 0}, "clusters'] must be an int"),
                         ({"topk": -1}, "topk'] must be an int >= 1")]:
        with pytest.raises(PerformerConfigError, match=message) as error:
            PerformerConfig(source_config=tiny_bert_config(), **bad)
        assert "\n" not in str(error.value)


def test_causal_models_are_refused_with_one_line():
    source = GPT2LMHeadModel(tiny_gpt2_config()).eval()
    with pytest.raises(ConversionError, match="bidirectional models .* only") as error:
        convert_to_performer(source, attention="improved-clustered")
    assert "\n" not in str(error.value)
    # A stock causal model switched to favor with clustered settings refuses in its forward.
    source.config.favor_settings = {"attention": "clustered"}
    source.set_attn_implementation("favor")
    with pytest.raises(ClusteredAttentionError, match="causal"):
        source(input_ids=torch.tensor([[5, 6, 7]]))


# ---------------------------------------------------------------------------------- CLI, save / load


@pytest.fixture
def source_folder(tmp_path):
    folder = tmp_path / "source"
    _bert().save_pretrained(folder)  # no tokenizer: the conversion report runs on random token ids
    return folder


REMOTE_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from transformers import AutoModelForMaskedLM

    folder, output = sys.argv[1], sys.argv[2]
    inputs = torch.load(f"{output}/inputs.pt")
    model = AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    assert not any(name.split(".")[0] == "hf_performer" for name in sys.modules)
    with torch.no_grad():
        torch.save(model(input_ids=inputs["ids"], attention_mask=inputs["mask"]).logits, f"{output}/logits.pt")
    """
)


def test_convert_cli_writes_a_folder_that_loads_with_trust_remote_code(source_folder, tmp_path,
                                                                     block_hf_performer_source):
    output = tmp_path / "clustered"
    status = convert_cli.main([str(source_folder), str(output), "--attention", "improved-clustered",
                               "--clusters", "25", "--topk", "32"])
    assert status == 0
    config = json.loads((output / "config.json").read_text())
    assert {k: config["favor_settings"][k] for k in ("attention", "clusters", "topk")} == {
        "attention": "improved-clustered", "clusters": 25, "topk": 32}
    assert "clustered_attention.py" in os.listdir(output)

    input_ids, attention_mask = _batch()
    torch.save({"ids": input_ids, "mask": attention_mask}, tmp_path / "inputs.pt")
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(block_hf_performer_source)
    (tmp_path / "load.py").write_text(REMOTE_SCRIPT)
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, str(tmp_path / "load.py"), str(output), str(tmp_path)], env=environment,
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    remote = torch.load(tmp_path / "logits.pt")
    source = BertForMaskedLM.from_pretrained(source_folder).eval()
    with torch.no_grad():  # 25 clusters >= 12 tokens: the softmax model
        expected = source(input_ids=input_ids, attention_mask=attention_mask).logits
    _close_on_tokens(remote, expected, attention_mask, atol=1e-4)


def test_convert_cli_refuses_a_causal_model_and_bad_values(tmp_path):
    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(folder)
    with pytest.raises(SystemExit, match="bidirectional models"):
        convert_cli.main([str(folder), str(tmp_path / "out"), "--attention", "clustered"])
    with pytest.raises(SystemExit):
        convert_cli.main([str(folder), str(tmp_path / "out"), "--attention", "kmeans"])
    assert not (tmp_path / "out").exists()


def test_linear_configs_record_no_cluster_keys_and_clustered_ones_survive_a_fresh_process(tmp_path):
    assert "attention" not in canonical_favor_settings({})
    config = PerformerConfig(source_config=tiny_bert_config(), feature_map="elu+1", attention="clustered", clusters=3)
    assert "topk" not in config.favor_settings and config.favor_settings["clusters"] == 3
    config.save_pretrained(tmp_path)
    code = ("import sys, hf_performer; c = hf_performer.PerformerConfig.from_pretrained(sys.argv[1]); "
            "print(c.favor_settings['attention'], c.favor_settings['clusters'])")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0 and run.stdout.split() == ["clustered", "3"], run.stderr[-2000:]


def test_clustered_attention_takes_no_window():
    with pytest.raises(PerformerConfigError, match="takes no window, sinks or layer_windows") as error:
        PerformerConfig(source_config=tiny_bert_config(), attention="improved-clustered", window=4)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("attention,clusters", [("clustered", 3), ("improved-clustered", 3),
                                                ("improved-clustered", LENGTH)])
def test_output_attentions_returns_the_weights_clustered_attention_applies(attention, clusters):
    """Not a silent ``()``: per layer the ``[B, H, L, L]`` weights whose product with the values is the layer's output
    (rows of real tokens sum to 1, padded keys get none); with as many clusters as tokens they are softmax's."""
    from hf_performer.clustered_attention import (
        clustered_attention,
        clustered_attention_weights,
        improved_clustered_attention,
    )

    source = _bert()
    performer = convert_to_performer(source, attention=attention, clusters=clusters, topk=4)
    input_ids, attention_mask = _batch()
    with torch.no_grad():
        plain = performer(input_ids=input_ids, attention_mask=attention_mask).logits
        outputs = performer(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True)
        expected = source(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True).attentions
    torch.testing.assert_close(outputs.logits, plain, rtol=1e-4, atol=1e-5)
    assert len(outputs.attentions) == 2
    for weights, softmax in zip(outputs.attentions, expected):
        assert weights.shape == (2, 4, LENGTH, LENGTH)
        row_sums = weights.sum(-1).transpose(1, 2)[attention_mask.bool()]  # [tokens, heads]
        torch.testing.assert_close(row_sums, torch.ones_like(row_sums))
        assert float(weights[1, :, :, 8:].abs().max()) == 0.0
        if clusters == LENGTH:
            keep = attention_mask.bool()
            torch.testing.assert_close(weights.transpose(1, 2)[keep], softmax.transpose(1, 2)[keep], atol=1e-5,
                                       rtol=1e-4)
    # the function itself against the kernels (grouped-query heads, padding)
    generator = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(2, heads, 20, 8, generator=generator) for heads in (4, 2, 2))
    padding = torch.ones(2, 20, dtype=torch.bool)
    padding[0, 15:] = False
    for topk, kernel in ((None, clustered_attention), (5, improved_clustered_attention)):
        arguments = dict(clusters=4, key_padding_mask=padding, seed=1, **({} if topk is None else {"topk": topk}))
        weights = clustered_attention_weights(query, key, **arguments)
        torch.testing.assert_close(weights @ value.repeat_interleave(2, dim=1), kernel(query, key, value, **arguments),
                                   rtol=1e-5, atol=1e-5)
