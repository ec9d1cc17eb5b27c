"""Attention transfer: the two weight matrices, the losses, teacher forcing, ``transfer_attention`` on tiny BERT and
Llama Performers, and the ``hf-performer distill`` command.

Tiny random models built offline from configs; the GPT-2 tokenizer of ../shared/data is used when it is there.
"""

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    BertModel,
    GPT2LMHeadModel,
    LlamaForCausalLM,
)
from transformers.utils import logging

from hf_performer import PerformerForCausalLM, PerformerModel, linear_attention, make_feature_map
from hf_performer.cli import main as cli_main
from hf_performer.conversion import convert_to_performer
from hf_performer.conversion.attention_transfer import (
    TRANSFER_ATTN_IMPLEMENTATION,
    AttentionTransferError,
    AttentionTransferResult,
    allowed_positions,
    collect_transfer_losses,
    layer_transfer_losses,
    linear_attention_weights,
    measure_transfer_losses,
    softmax_attention_weights,
    teacher_forcing,
    trainable_feature_maps,
    transfer_attention,
    transfer_losses,
)
from hf_performer.feature_maps import FeatureMap, Features, HedgehogFeatureMap, T2RFeatureMap
from hf_performer.reference import softmax_attention
from conftest import tiny_bert_config, tiny_gpt2_config, tiny_llama_config, word_piece_tokenizer

logging.set_verbosity_error()

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"

WORDS = (
    "the quick brown fox jumps over lazy dog a cat sat on mat good bad movie film great awful was is and "
    "attention tokens sequence linear memory rain weekend letters box"
).split()
VOCAB_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz.,"]
VOCAB = len(VOCAB_TOKENS)


# --------------------------------------------------------------------------------------------
# Tiny models and batches
# --------------------------------------------------------------------------------------------


def bert_source(scale=8.0):
    """A tiny BERT whose query/key projections are scaled up, so that its softmax attention is peaked (a random
    BERT's attention is almost uniform, which any map imitates)."""
    torch.manual_seed(0)
    source = BertModel(tiny_bert_config(vocab_size=VOCAB)).eval()
    with torch.no_grad():
        for layer in source.encoder.layer:
            layer.attention.self.query.weight.mul_(scale)
            layer.attention.self.key.weight.mul_(scale)
    return source


def llama_source():
    torch.manual_seed(0)
    config = tiny_llama_config(num_hidden_layers=3, vocab_size=VOCAB, pad_token_id=0, initializer_range=0.3)
    return LlamaForCausalLM(config).eval()


def token_ids(batch=3, length=10, seed=1):
    return torch.randint(5, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def right_padded_batch():
    input_ids = token_ids()
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0
    attention_mask[2, 4:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def left_padded_batch():
    input_ids = token_ids(seed=2)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    attention_mask[2, :6] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def snapshot(model):
    return {key: tensor.detach().clone() for key, tensor in model.state_dict().items()}


def is_feature_map_key(key):
    return ".favor_feature_map." in key


def attention_implementations(model):
    return {module.config._attn_implementation for module in model.modules() if hasattr(module, "config")}


def check_transfer(model, before_state, expected_layers, result):
    """Only feature-map tensors changed (every one of them), and every layer's losses went down."""
    after_state = model.state_dict()
    changed = {key for key, tensor in after_state.items() if not torch.equal(tensor, before_state[key])}
    feature_map_keys = {key for key in after_state if is_feature_map_key(key)}
    assert changed == feature_map_keys
    layers_with_maps = {int(re.search(r"\.layers?\.(\d+)\.", key).group(1)) for key in feature_map_keys}
    assert layers_with_maps == set(expected_layers)
    assert result.layers == expected_layers
    assert sorted(result.layer_losses_before) == sorted(result.layer_losses_after) == expected_layers
    for layer in expected_layers:
        before, after = result.layer_losses_before[layer], result.layer_losses_after[layer]
        assert before["rows"] == after["rows"] > 0
        assert after["weights_kl"] < before["weights_kl"], (layer, before, after)
        assert after["output_squared_error"] < before["output_squared_error"], (layer, before, after)


# --------------------------------------------------------------------------------------------
# The two weight matrices and the losses
# --------------------------------------------------------------------------------------------


def qkv(batch=2, heads=4, kv_heads=2, length=9, d=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, d, generator=generator)
    k = torch.randn(batch, kv_heads, length, d, generator=generator)
    v = torch.randn(batch, kv_heads, length, d, generator=generator)
    return q, k, v


def mask_4d(key_padding_mask, causal):
    length = key_padding_mask.shape[-1]
    allowed = key_padding_mask[:, None, None, :].expand(-1, 1, length, -1)
    if causal:
        allowed = allowed & torch.ones(length, length, dtype=torch.bool).tril()
    return allowed


@torch.no_grad()
def perturbed(feature_map, seed=0, scale=0.3):
    generator = torch.Generator().manual_seed(seed)
    for parameter in feature_map.parameters():
        parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return feature_map


def test_allowed_positions():
    causal = allowed_positions(None, 4, 4, causal=True, device=torch.device("cpu"))
    assert causal.shape == (1, 1, 4, 4) and torch.equal(causal[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())
    # Fewer queries than keys (the last queries of a longer sequence): query i sees keys j <= i + 3.
    offset = allowed_positions(None, 2, 5, causal=True, device=torch.device("cpu"))
    assert torch.equal(offset[0, 0], torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))
    assert allowed_positions(None, 3, 5, causal=False, device=torch.device("cpu")).all()
    padding = torch.tensor([[True, True, False]])
    boolean = mask_4d(padding, causal=False)
    assert torch.equal(allowed_positions(boolean, 3, 3, False, torch.device("cpu")), boolean)
    additive = torch.zeros(1, 1, 3, 3).masked_fill(~boolean, torch.finfo(torch.float32).min)
    assert torch.equal(allowed_positions(additive, 3, 3, False, torch.device("cpu")), boolean)
    longer = torch.ones(1, 1, 2, 6, dtype=torch.bool)
    longer[..., 0] = False
    assert allowed_positions(longer, 2, 4, True, torch.device("cpu")).all()  # the last key_length columns
    with pytest.raises(AttentionTransferError, match="expected a 4-D attention mask"):
        allowed_positions(padding, 3, 3, False, torch.device("cpu"))


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_weights_are_the_softmax_attention(causal):
    q, k, v = qkv()
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[1, 6:] = False
    allowed = mask_4d(padding, causal)
    weights = softmax_attention_weights(q, k, 0.3, allowed)
    assert weights.shape == (2, 4, 9, 9) and weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 9))
    assert not weights.masked_select(~allowed).any()
    expected = softmax_attention(q, k, v, causal=causal, key_padding_mask=padding, scaling=0.3)
    torch.testing.assert_close((weights.double() @ v.double().repeat_interleave(2, 1)), expected, atol=1e-5, rtol=1e-5)
    # A query with no allowed key has an all-zero row (not NaN).
    nothing = allowed.clone().expand(2, 1, 9, 9).clone()
    nothing[0, 0, 2] = False
    weights = softmax_attention_weights(q, k, 0.3, nothing)
    assert torch.isfinite(weights).all() and not weights[0, :, 2].any()


@pytest.mark.parametrize("name", ["hedgehog", "t2r", "favor+"])
@pytest.mark.parametrize("causal", [False, True])
def test_linear_weights_are_what_the_kernel_computes(name, causal):
    q, k, v = qkv()
    if name == "favor+":
        feature_map = make_feature_map(name, 8, nb_features=16, seed=1)  # stabilised features (log_scale)
    else:
        feature_map = perturbed(make_feature_map(name, 8, num_heads=4, num_key_value_heads=2, init="favor+"))
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[0, 7:] = False
    allowed = mask_4d(padding, causal)
    weights = linear_attention_weights(q, k, feature_map, 0.3, allowed)
    assert weights.shape == (2, 4, 9, 9) and weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 9))
    assert not weights.masked_select(~allowed).any() and (weights.masked_select(allowed) > 0).all()
    out = linear_attention(q, k, v, feature_map, causal=causal, key_padding_mask=padding, scaling=0.3)
    torch.testing.assert_close(weights @ v.repeat_interleave(2, 1), out, atol=1e-5, rtol=1e-5)
    # Rows without any allowed key are zero, not NaN.
    nothing = allowed.expand(2, 1, 9, 9).clone()
    nothing[1, 0, 4] = False
    weights = linear_attention_weights(q, k, feature_map, 0.3, nothing)
    assert torch.isfinite(weights).all() and not weights[1, :, 4].any()


class ExactOnOneHotKeys(FeatureMap):
    """Query features ``exp(sqrt(s) x)`` and key features ``x``: for one-hot keys ``sqrt(s) e_b``,
    ``phi(q').phi(k') = sqrt(s) exp(s q_b) = sqrt(s) exp(s q.k)``, so the linear weights *are* the softmax weights.
    Both sides are returned stabilised (per-row log-scales) to exercise how they are combined."""

    name = "exact-on-one-hot-keys"

    def __init__(self, head_dim, scaling):
        super().__init__(head_dim, head_dim)
        self.root = math.sqrt(scaling)

    def query_features(self, query):
        logits = self.root * query
        row_max = logits.amax(-1)
        return Features(torch.exp(logits - row_max[..., None]), row_max)

    def key_features(self, key):
        shift = torch.randn(key.shape[:-1], generator=torch.Generator().manual_seed(0))
        return Features(key * torch.exp(-shift)[..., None], shift)


def test_an_exact_map_has_zero_losses_and_the_query_key_roles_are_kept():
    scaling, d = 0.7, 6
    q, _, v = qkv(heads=4, kv_heads=2, length=d, d=d)
    k = torch.eye(d).expand(2, 2, d, d).clone()  # key j is e_j
    padding = torch.ones(2, d, dtype=torch.bool)
    padding[1, 4:] = False
    allowed = mask_4d(padding, causal=True)
    exact = ExactOnOneHotKeys(d, scaling)
    teacher = softmax_attention_weights(q, k, scaling, allowed)
    student = linear_attention_weights(q, k, exact, scaling, allowed)
    torch.testing.assert_close(student, teacher, atol=1e-6, rtol=1e-5)
    repeated_v = v.repeat_interleave(2, 1)
    kl, squared_error, rows = transfer_losses(teacher, student, repeated_v, allowed)
    assert rows == 2 * 4 * d and abs(float(kl)) < 1e-4 and float(squared_error) < 1e-9
    # The same map with the roles swapped is far from softmax.
    swapped = linear_attention_weights(k.repeat_interleave(2, 1), q, exact, scaling, allowed)
    assert not torch.allclose(swapped, teacher, atol=1e-2)


def test_transfer_losses_by_hand():
    q, k, v = qkv()
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[1, 5:] = False
    allowed = mask_4d(padding, causal=True).expand(2, 4, 9, 9).clone()
    allowed[0, 1, 3] = False  # a query row that attends to nothing: not counted
    teacher = softmax_attention_weights(q, k, 0.35, allowed)
    value = v.repeat_interleave(2, 1)
    kl, squared_error, rows = transfer_losses(teacher, teacher, value, allowed)
    assert float(kl) == 0.0 and float(squared_error) == 0.0 and rows == 2 * 4 * 9 - 1

    feature_map = perturbed(make_feature_map("hedgehog", 8, num_heads=4, num_key_value_heads=2))
    with torch.no_grad():
        student = linear_attention_weights(q, k, feature_map, 0.35, allowed)
    kl, squared_error, rows = transfer_losses(teacher, student, value, allowed)
    t, s = teacher.double(), student.double()
    row_kl = torch.where(allowed, t * (t.clamp_min(1e-30).log() - s.clamp_min(1e-30).log()), 0.0).sum(-1)
    row_error = ((s - t) @ value.double()).square().mean(-1)
    counted = allowed.any(-1)
    torch.testing.assert_close(float(kl), float(row_kl[counted].sum()), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(float(squared_error), float(row_error[counted].sum()), rtol=1e-4, atol=1e-6)
    assert float(kl) > 0 and float(squared_error) > 0 and rows == 2 * 4 * 9 - 1


@pytest.mark.parametrize("name", ["hedgehog", "t2r", "favor+"])
@pytest.mark.parametrize("causal", [False, True])
def test_layer_transfer_losses_match_the_reference(name, causal):
    """The fast path used during transfer gives the reference's output, losses, row count and gradients."""
    q, k, v = qkv()
    if name == "favor+":
        feature_map = make_feature_map(name, 8, nb_features=16, seed=1)
    else:
        feature_map = perturbed(make_feature_map(name, 8, num_heads=4, num_key_value_heads=2, init="favor+"))
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[1, 6:] = False
    allowed = mask_4d(padding, causal).expand(2, 4, 9, 9).clone()
    allowed[0, 2, 5] = False  # a query row with no allowed key: zero output, not counted

    def reference():
        teacher = softmax_attention_weights(q, k, 0.3, allowed)
        student = linear_attention_weights(q, k, feature_map, 0.3, allowed)
        value = v.repeat_interleave(2, 1)
        return (teacher @ value, *transfer_losses(teacher, student, value, allowed))

    results = []
    for compute in (reference, lambda: layer_transfer_losses(q, k, v, feature_map, 0.3, allowed)):
        feature_map.zero_grad()
        output, kl, squared_error, rows = compute()
        grads = []
        if any(True for _ in feature_map.parameters()):
            (kl + squared_error).backward()
            grads = [p.grad.clone() for p in feature_map.parameters()]
        results.append((output, kl.detach(), squared_error.detach(), rows, grads))
    (output, kl, squared_error, rows, grads), (fast_output, fast_kl, fast_error, fast_rows, fast_grads) = results
    assert fast_rows == rows == 2 * 4 * 9 - 1 and fast_output.shape == (2, 4, 9, 8)
    assert torch.isfinite(fast_output).all() and not fast_output[0, 2, 5].any()
    torch.testing.assert_close(fast_output, output, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fast_kl, kl, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(fast_error, squared_error, atol=1e-6, rtol=1e-4)
    assert float(kl) > 0 and float(squared_error) > 0
    assert len(fast_grads) == len(grads)
    for fast, slow in zip(fast_grads, grads):
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------------------------
# Teacher forcing
# --------------------------------------------------------------------------------------------


def test_conversion_records_the_start_of_learned_maps():
    """The config names the init of a learned map even when it was left to the default, and keeps a given one."""
    source = bert_source()
    default = convert_to_performer(source, feature_map="hedgehog")
    assert default.config.favor_settings["feature_map_options"] == {"init": "favor+"}
    identity = convert_to_performer(source, feature_map="hedgehog", feature_map_options={"init": "identity", "tie_qk": True})
    assert identity.config.favor_settings["feature_map_options"] == {"init": "identity", "tie_qk": True}
    assert convert_to_performer(source).config.favor_settings["feature_map_options"] == {}  # FAVOR+: no init


@pytest.mark.parametrize("model", ["bert", "llama"])
def test_teacher_forcing_returns_the_softmax_model_output(model):
    if model == "bert":
        source, batch, layers = bert_source(), right_padded_batch(), [0, 1]
        performer = convert_to_performer(source, feature_map="hedgehog")
    else:
        source, batch, layers = llama_source(), left_padded_batch(), [0, 2]
        performer = convert_to_performer(source, feature_map="t2r", keep_softmax_layers=[1])
    output_of = (lambda out: out.last_hidden_state) if model == "bert" else (lambda out: out.logits)
    real = batch["attention_mask"].bool()
    performer.train()
    with torch.no_grad():
        expected = output_of(source(**batch))
        favor = output_of(performer.eval()(**batch))
        performer.train()
        with teacher_forcing(performer) as forced, collect_transfer_losses(compute_student=False) as losses:
            assert forced is performer and not performer.training
            assert attention_implementations(performer.source_model) == {TRANSFER_ATTN_IMPLEMENTATION}
            output = output_of(performer(**batch))
    torch.testing.assert_close(output[real], expected[real], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(favor[real], expected[real], atol=1e-3)  # favor really is another attention
    assert sorted(losses) == layers and all(entry.rows > 0 and float(entry.kl) > 0 for entry in losses.values())
    assert performer.training and attention_implementations(performer.source_model) == {"favor"}
    with torch.no_grad():
        torch.testing.assert_close(output_of(performer.eval()(**batch)), favor)
    # Without an active collector, the transfer attention only computes the teacher.
    with teacher_forcing(performer), torch.no_grad():
        torch.testing.assert_close(output_of(performer(**batch))[real], expected[real], atol=1e-5, rtol=1e-5)


def test_measured_rows_skip_padding_queries_of_causal_models():
    performer = convert_to_performer(llama_source(), feature_map="hedgehog", keep_softmax_layers=[1])
    batch = left_padded_batch()
    losses = measure_transfer_losses(performer, [batch, batch])
    real_queries = int(batch["attention_mask"].sum())
    assert sorted(losses) == [0, 2]
    assert all(entry["rows"] == 2 * 4 * real_queries for entry in losses.values())  # 2 batches x 4 heads
    assert all(math.isfinite(entry["weights_kl"]) and entry["weights_kl"] > 0 for entry in losses.values())
    assert attention_implementations(performer.source_model) == {"favor"} and not performer.training


# --------------------------------------------------------------------------------------------
# transfer_attention
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss", ["both", "weights", "output"])
def test_transfer_on_bert_trains_only_the_feature_maps(loss):
    source = bert_source()
    performer = convert_to_performer(source, feature_map="hedgehog")
    batch = right_padded_batch()
    performer.train()
    embeddings = performer.source_model.embeddings.word_embeddings.weight
    embeddings.requires_grad_(False)  # a mix of flags, all restored afterwards
    flags = {name: p.requires_grad for name, p in performer.named_parameters()}
    before = snapshot(performer)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = source(**batch).last_hidden_state[real]
        error_before = (performer.eval()(**batch).last_hidden_state[real] - expected).norm()
    performer.train()

    result = transfer_attention(performer, [batch], steps=12, learning_rate=1e-2, loss=loss, progress=False)

    assert isinstance(result, AttentionTransferResult)
    assert (result.steps, result.loss, result.learning_rate) == (12, loss, 1e-2)
    check_transfer(performer, before, [0, 1], result)
    assert [entry["step"] for entry in result.history] == list(range(1, 13))
    assert result.history[-1]["loss_per_layer"] < result.history[0]["loss_per_layer"]
    json.dumps(result.to_dict())
    assert {name: p.requires_grad for name, p in performer.named_parameters()} == flags
    assert not embeddings.requires_grad
    assert performer.training and all(module.training for module in performer.modules())
    assert attention_implementations(performer.source_model) == {"favor"}
    with torch.no_grad():
        error_after = (performer.eval()(**batch).last_hidden_state[real] - expected).norm()
    assert error_after < error_before  # the converted model itself is closer to its softmax source


def test_transfer_on_llama_with_grouped_heads_padding_and_a_softmax_layer():
    performer = convert_to_performer(llama_source(), feature_map="hedgehog", keep_softmax_layers=[1],
                                     feature_map_options={"init": "favor+"})
    assert sorted(trainable_feature_maps(performer)) == [0, 2]
    assert all(m.num_heads == 4 and m.num_key_value_heads == 2 for m in trainable_feature_maps(performer).values())
    before = snapshot(performer)
    flags = {name: p.requires_grad for name, p in performer.named_parameters()}
    batches = [left_padded_batch(), right_padded_batch()]
    result = transfer_attention(performer, batches, steps=12, learning_rate=2e-2, progress=False)
    check_transfer(performer, before, [0, 2], result)
    assert 1 not in result.layers and 1 not in result.layer_losses_after
    assert {name: p.requires_grad for name, p in performer.named_parameters()} == flags
    assert not performer.training  # it was in eval mode
    assert attention_implementations(performer.source_model) == {"favor"}
    with torch.no_grad():  # still generates with its constant-memory cache
        generated = performer.generate(batches[1]["input_ids"][:1, :4], max_new_tokens=3, do_sample=False,
                                       pad_token_id=0)
    assert generated.shape == (1, 7)


def test_evaluation_batches_are_used_for_the_before_and_after_losses():
    performer = convert_to_performer(bert_source(), feature_map="t2r")
    train, held_out = right_padded_batch(), {"input_ids": token_ids(batch=2, length=6, seed=9)}
    result = transfer_attention(performer, [train], steps=1, evaluation_batches=[held_out], progress=False)
    assert all(entry["rows"] == 2 * 2 * 6 for entry in result.layer_losses_after.values())
    assert result.layer_losses_after == measure_transfer_losses(performer, [held_out])


def test_models_without_a_trainable_map_and_bad_options_are_refused():
    source = bert_source()
    favor = convert_to_performer(source, nb_features=16)
    batch = right_padded_batch()
    before = snapshot(favor)
    with pytest.raises(AttentionTransferError, match="no favor layer with a trainable feature map"):
        transfer_attention(favor, [batch], steps=2, progress=False)
    all_softmax = convert_to_performer(source, feature_map="hedgehog", keep_softmax_layers=[0, 1])
    with pytest.raises(AttentionTransferError, match="no favor layer with a trainable feature map"):
        transfer_attention(all_softmax, [batch], steps=2, progress=False)
    hedgehog = convert_to_performer(source, feature_map="hedgehog")
    with pytest.raises(AttentionTransferError, match="unknown loss 'kl'; accepted: weights, output, both"):
        transfer_attention(hedgehog, [batch], steps=2, loss="kl", progress=False)
    with pytest.raises(AttentionTransferError, match="steps must be >= 1"):
        transfer_attention(hedgehog, [batch], steps=0, progress=False)
    with pytest.raises(AttentionTransferError, match="at least one batch"):
        transfer_attention(hedgehog, [], steps=2, progress=False)
    assert all(torch.equal(tensor, before[key]) for key, tensor in favor.state_dict().items())
    assert attention_implementations(favor.source_model) == {"favor"}
    assert all(p.requires_grad for p in hedgehog.parameters())


# --------------------------------------------------------------------------------------------
# hf-performer distill
# --------------------------------------------------------------------------------------------


SENTENCES = [
    "the quick brown fox jumps over the lazy dog", "a cat sat on the mat", "good movie", "bad film was awful",
    "the film was great and the movie was good", "attention tokens sequence linear memory",
    "rain on the weekend", "letters in a box", "the dog was lazy and the fox was quick", "a great movie",
    "awful rain", "the cat is good", "linear attention memory is a sequence of tokens", "the box was bad",
]


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("distill") / "bert"
    word_piece_tokenizer(folder.parent, VOCAB_TOKENS, save_to=folder)
    bert_source().save_pretrained(folder)
    sst2 = folder.parent / "train.tsv"
    sst2.write_text("sentence\tlabel\n" + "".join(f"{s}\t{i % 2}\n" for i, s in enumerate(SENTENCES)))
    return folder


def distill(*arguments):
    return cli_main(["distill", *map(str, arguments), "--no-progress"])


def test_distill_a_bert_on_an_sst2_file(bert_folder, tmp_path, capsys):
    output = tmp_path / "hedgehog-bert"
    status = distill(bert_folder, output, "--feature-map", "hedgehog", "--data", bert_folder.parent / "train.tsv",
                     "--data-task", "sst2", "--max-samples", 8, "--fidelity-samples", 4, "--max-length", 12,
                     "--batch-size", 4, "--steps", 6, "--learning-rate", 2e-2, "--feature-map-init", "favor+")
    assert status == 0
    printed = capsys.readouterr().out
    assert "weights KL before" in printed and "attention transfer: 6 steps on 8 sequences" in printed
    files = set(os.listdir(output))
    assert {"config.json", "model.safetensors", "attention_transfer.json", "conversion_report.json", "README.md",
            "feature_maps.py", "tokenizer_config.json"} <= files
    assert not [name for name in os.listdir(tmp_path) if name != "hedgehog-bert"]  # no staging folder left
    card = (output / "README.md").read_text()
    assert "hf-performer distill" in card and "## Attention transfer" in card and "Fidelity after attention transfer" in card

    record = json.loads((output / "attention_transfer.json").read_text())
    assert record["feature_map"] == "hedgehog"
    assert record["favor_settings"]["feature_map_options"] == {"init": "favor+"}
    assert record["data"]["sequences"] == 8 and record["data"]["fidelity_sequences"] == 4
    transfer = record["transfer"]
    assert transfer["steps"] == 6 and transfer["layers"] == [0, 1] and len(transfer["history"]) == 6
    for layer in ("0", "1"):
        before, after = transfer["layer_losses_before"][layer], transfer["layer_losses_after"][layer]
        assert set(before) == set(after) == {"weights_kl", "output_squared_error", "rows"}
        assert before["rows"] == after["rows"] > 0
        assert after["weights_kl"] < before["weights_kl"]
    assert len(record["fidelity_before"]["layers"]) == len(record["fidelity_after"]["layers"]) == 2

    loaded = AutoModel.from_pretrained(output, trust_remote_code=True).eval()
    assert isinstance(loaded, PerformerModel)
    maps = [m for m in loaded.modules() if isinstance(m, HedgehogFeatureMap)]
    assert len(maps) == 2 and maps[0].init == "favor+"
    fresh = convert_to_performer(bert_source(), feature_map="hedgehog", feature_map_options={"init": "favor+"})
    fresh_map = [m for m in fresh.modules() if isinstance(m, HedgehogFeatureMap)][0]
    assert not torch.equal(maps[0].query_weight, fresh_map.query_weight)  # the trained parameters were saved
    with torch.no_grad():
        assert torch.isfinite(loaded(**right_padded_batch()).last_hidden_state).all()


def test_distill_refuses_an_existing_output_and_a_map_without_parameters(bert_folder, tmp_path):
    data = ["--data", bert_folder.parent / "train.tsv", "--data-task", "sst2", "--max-samples", 4,
            "--fidelity-samples", 2, "--max-length", 8, "--batch-size", 2, "--steps", 1]
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="already exists; pass --overwrite to replace it"):
        distill(bert_folder, existing, *data)
    assert os.listdir(existing) == ["keep.txt"]

    with pytest.raises(SystemExit, match="has no trainable parameters to transfer attention into"):
        distill(bert_folder, tmp_path / "favor", "--feature-map", "favor+", "--nb-features", 16, *data)
    with pytest.raises(SystemExit, match="has no trainable parameters to transfer attention into"):
        distill(bert_folder, tmp_path / "favor", "--feature-map", "favor+", "--feature-map-init", "identity", *data)
    assert sorted(os.listdir(tmp_path)) == ["existing"]  # nothing written, no staging left behind

    assert distill(bert_folder, existing, "--overwrite", *data) == 0
    assert "keep.txt" not in os.listdir(existing) and "attention_transfer.json" in os.listdir(existing)


def test_distill_a_gpt2_on_raw_text(tmp_path, capsys, gpt2_tokenizer):
    tokenizer = gpt2_tokenizer
    source = tmp_path / "gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(tiny_gpt2_config(vocab_size=len(tokenizer), initializer_range=0.3)).save_pretrained(source)
    tokenizer.save_pretrained(source)
    text = tmp_path / "train.raw"
    text.write_text(" ".join(SENTENCES * 3) + "\n")
    output = tmp_path / "t2r-gpt2"
    status = distill(source, output, "--feature-map", "t2r", "--data", text, "--data-task", "text",
                     "--max-samples", 6, "--fidelity-samples", 2, "--max-length", 16, "--batch-size", 3,
                     "--steps", 4, "--keep-softmax-layers", 1)
    assert status == 0
    assert "softmax" in capsys.readouterr().out  # the kept layer is reported in the table
    record = json.loads((output / "attention_transfer.json").read_text())
    assert record["data"]["layout"] == "text" and record["data"]["sequences"] == 6
    transfer = record["transfer"]
    assert transfer["layers"] == [0] and sorted(transfer["layer_losses_after"]) == ["0"]
    assert 0 < transfer["layer_losses_before"]["0"]["rows"] <= 2 * 2 * 16  # 2 held-out blocks x 2 heads x <= 16
    assert all(math.isfinite(v) for v in transfer["layer_losses_after"]["0"].values())
    assert record["favor_settings"]["softmax_layers"] == [1]

    loaded = AutoModelForCausalLM.from_pretrained(output, trust_remote_code=True).eval()
    assert isinstance(loaded, PerformerForCausalLM)
    maps = [m for m in loaded.modules() if isinstance(m, FeatureMap)]
    assert len(maps) == 1 and isinstance(maps[0], T2RFeatureMap)
    prompt = tokenizer("the quick brown fox", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        generated = loaded.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, prompt.shape[1] + 3)
