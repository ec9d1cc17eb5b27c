"""The learned tail gate of causal window layers (issue 33, item 3): ``tail_gate = alpha`` ``[H]`` weighs a tail of
``n`` tokens by ``max(n, 1) ** -alpha``. The operator against the float64 reference (which counts each query's tail
keys from its explicit mask), with a sparse cache, a cap, padding, GQA; alpha = 0 is today's operator; gradients
(alpha's included) of one pass and of the memory-bounded segments against the reference's; prefill + decode and
rollback + re-decode give the one pass; output_attentions; the favor setting, a converted model, its cache and saved
folder, the attention transfer training alpha; one-line refusals."""

import json

import pytest
import torch

from hf_performer import window_linear_attention
from hf_performer.attention_weights import window_attention_weights
from hf_performer.reference import reference_window_linear_attention

from conftest import logits_of
from window_cases import GAMMA, on_tokens, padded_mask, refusal, run_in_pieces, small_map, small_qkv

ALPHA = torch.tensor([0.3, 0.9, 0.0, 1.0], dtype=torch.float64)


@pytest.mark.parametrize("name, learned", [("hedgehog", True), ("favor+", False)])
@pytest.mark.parametrize("capacity", [0, 3])
@pytest.mark.parametrize("cap", [0, 7])
def test_matches_the_float64_reference(name, learned, capacity, cap):
    q, k, v = small_qkv()
    fm, mask = small_map(name), padded_mask()
    kwargs = dict(window=4, sinks=2, softmax_weight=GAMMA if learned else None, chunk_size=5, sparse_cache=capacity,
                  key_padding_mask=mask, tail_cap=cap)
    out = window_linear_attention(q, k, v, fm, tail_gate=ALPHA, **kwargs)
    expected = reference_window_linear_attention(q, k, v, fm, tail_gate=ALPHA, **kwargs)
    torch.testing.assert_close(on_tokens(out, mask), on_tokens(expected, mask), rtol=1e-10, atol=1e-10)
    ungated = window_linear_attention(q, k, v, fm, **kwargs)
    assert float((out - ungated).detach().abs().max()) > 1e-3  # the gate changes the later queries
    closed = window_linear_attention(q, k, v, fm, tail_gate=torch.zeros(4, dtype=torch.float64), **kwargs)
    torch.testing.assert_close(closed, ungated, rtol=1e-12, atol=1e-12)  # alpha = 0: today's operator


@pytest.mark.parametrize("length", [41, 300])  # one pass, and the segments of the training path (256 queries each)
@pytest.mark.parametrize("capacity", [0, 8])
def test_gradients_match_the_reference_including_alpha(length, capacity):
    q, k, v = (t.requires_grad_() for t in small_qkv(batch=2, length=length, seed=5))
    fm, mask = small_map("hedgehog"), padded_mask(batch=2, length=length)
    gamma, alpha = GAMMA.clone().requires_grad_(), ALPHA.clone().requires_grad_()
    kwargs = dict(window=8, sinks=2, chunk_size=16, sparse_cache=capacity, tail_cap=50, key_padding_mask=mask,
                  softmax_weight=gamma, tail_gate=alpha)
    out = window_linear_attention(q, k, v, fm, **kwargs)
    expected = reference_window_linear_attention(q, k, v, fm, **kwargs)
    torch.testing.assert_close(on_tokens(out, mask), on_tokens(expected, mask), rtol=1e-9, atol=1e-9)
    probe = torch.randn_like(out) * (mask.cumsum(-1) > 0)[:, None, :, None]
    inputs = (q, k, v, gamma, alpha, *fm.parameters())
    grads = torch.autograd.grad((out * probe).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * probe).sum(), inputs)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-8, atol=1e-8)
    assert float(grads[4].abs().min()) > 0  # every head's alpha learns


@pytest.mark.parametrize("capacity", [0, 3])
@pytest.mark.parametrize("pieces", [[1] * 41, [9] + [1] * 32, [3, 7, 1, 12, 2, 1, 1, 14]])
def test_prefill_and_decode_give_the_one_pass(capacity, pieces):
    q, k, v = small_qkv(seed=2)
    fm, mask = small_map("hedgehog"), padded_mask()
    kwargs = dict(window=4, sinks=2, softmax_weight=GAMMA, chunk_size=5, sparse_cache=capacity, tail_gate=ALPHA)
    one_pass = window_linear_attention(q, k, v, fm, key_padding_mask=mask, **kwargs)
    out, _ = run_in_pieces(q, k, v, fm, pieces, mask, **kwargs)
    torch.testing.assert_close(on_tokens(out, mask), on_tokens(one_pass, mask), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("capacity", [0, 3])
def test_rollback_then_redecode_gives_the_one_pass(capacity):
    q, k, v = small_qkv(seed=3)
    fm, mask = small_map("favor+"), padded_mask()
    kwargs = dict(window=4, sinks=2, chunk_size=5, sparse_cache=capacity, tail_gate=ALPHA)
    expected = reference_window_linear_attention(q, k, v, fm, key_padding_mask=mask, **kwargs)
    _, state = run_in_pieces(q[:, :, :20], k[:, :, :20], v[:, :, :20], fm, [20], mask[:, :20], **kwargs)
    junk = small_qkv(length=7, seed=4)
    _, drafted = run_in_pieces(*junk, fm, [7], state=state, max_rollback=7, **kwargs)
    out, _ = run_in_pieces(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], fm, [1, 4] + [1] * 16, mask[:, 20:],
                           state=drafted.rollback(7), **kwargs)
    torch.testing.assert_close(out, expected[:, :, 20:], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("capacity", [0, 3])
def test_output_attentions_are_the_applied_weights(capacity):
    q, k, v = small_qkv(seed=6)
    fm, mask = small_map("hedgehog"), padded_mask()
    kwargs = dict(window=4, sinks=2, softmax_weight=GAMMA, chunk_size=5, sparse_cache=capacity, tail_gate=ALPHA,
                  tail_cap=6, key_padding_mask=mask)
    weights = window_attention_weights(q, k, v, fm, **kwargs)
    out = window_linear_attention(q, k, v, fm, **kwargs)
    applied = torch.matmul(weights, v.repeat_interleave(2, dim=1))
    torch.testing.assert_close(on_tokens(applied, mask), on_tokens(out, mask), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(tail_gate=torch.zeros(3)), "tail_gate must be a float tensor [num_heads = 4]"),
        (dict(tail_gate=0.5), "tail_gate must be a float tensor [num_heads = 4]"),
        (dict(tail_gate=torch.zeros(4, dtype=torch.long)), "tail_gate must be a float tensor"),
        (dict(tail_gate=torch.zeros(4), causal=False), "tail_gate needs causal=True"),
        (dict(tail_gate=torch.zeros(4), tail_map=None), "tail_gate needs a linear tail"),
    ],
)
def test_bad_arguments_get_one_line_errors(kwargs, words):
    message = refusal(**kwargs)
    assert words in message and "\n" not in message


# ------------------------------------------------------------------------------------------- models and commands


def _set_alpha(model, values):
    from hf_performer.favor_attention import TAIL_GATE_ATTRIBUTE

    gates = [m for m in model.modules() if hasattr(m, TAIL_GATE_ATTRIBUTE)]
    with torch.no_grad():
        for gate in gates:
            getattr(gate, TAIL_GATE_ATTRIBUTE).exponent.copy_(torch.tensor(values))
    return gates


def test_a_converted_model_runs_its_gate_in_forward_generate_and_its_saved_folder(tiny_llama_lm, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_performer import convert_to_performer

    ids = torch.randint(5, 90, (2, 70), generator=torch.Generator().manual_seed(1))
    settings = dict(feature_map="hedgehog", window=4, sinks=1, seed=0, sparse_cache=2)
    plain = convert_to_performer(tiny_llama_lm, **settings).eval()
    gated = convert_to_performer(tiny_llama_lm, tail_gate=True, **settings).eval()
    assert gated.config.favor_settings["tail_gate"] is True
    torch.testing.assert_close(logits_of(gated, ids), logits_of(plain, ids))  # alpha starts at 0: unchanged
    heads = tiny_llama_lm.config.num_attention_heads
    assert len(_set_alpha(gated, [0.5] * heads)) == tiny_llama_lm.config.num_hidden_layers
    assert (logits_of(gated, ids) - logits_of(plain, ids)).abs().max() > 1e-4
    with torch.no_grad():
        generated = gated.generate(ids[:1], max_new_tokens=6, do_sample=False)
        again = gated.generate(ids[:1], max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(generated, again)
    gated.save_pretrained(tmp_path / "gated")
    saved = load_file(tmp_path / "gated" / "model.safetensors")
    assert any(name.endswith("favor_tail_gate.exponent") for name in saved)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "gated").eval()
    torch.testing.assert_close(logits_of(reloaded, ids), logits_of(gated, ids))


def test_the_setting_is_refused_where_it_cannot_apply(tiny_bert_config, tiny_llama_lm):
    from transformers import BertModel

    from hf_performer import convert_to_performer
    from hf_performer.conversion.convert import ConversionError

    with pytest.raises(ConversionError, match="tail_gate is for causal window layers") as failure:
        convert_to_performer(BertModel(tiny_bert_config()), window=4, sinks=1, tail_gate=True)
    assert "\n" not in str(failure.value)
    with pytest.raises(ConversionError, match="linear_tail=False: set tail_gate=False") as failure:
        convert_to_performer(tiny_llama_lm, window=4, sinks=1, tail_gate=True, linear_tail=False)
    assert "\n" not in str(failure.value)
    with pytest.raises(ConversionError, match="tail_gate'] must be a bool"):
        convert_to_performer(tiny_llama_lm, window=4, sinks=1, tail_gate=1)


def test_the_attention_transfer_trains_alpha(tiny_llama_lm):
    from hf_performer import convert_to_performer
    from hf_performer.conversion.attention_transfer import transfer_attention

    model = convert_to_performer(tiny_llama_lm, feature_map="hedgehog", window=4, sinks=1, tail_gate=True, seed=0)
    # start inside [0, 1] so that a step either way moves it (at 0 the clamp passes only increases)
    gates = _set_alpha(model, [0.5] * tiny_llama_lm.config.num_attention_heads)
    before = [g.favor_tail_gate.exponent.detach().clone() for g in gates]
    batches = [{"input_ids": torch.randint(5, 90, (2, 48), generator=torch.Generator().manual_seed(2))}]
    transfer_attention(model, batches, steps=3, learning_rate=5e-2, loss="output", progress=False)
    after = [g.favor_tail_gate.exponent.detach() for g in gates]
    assert all(not torch.equal(a, b) for a, b in zip(before, after))


def test_the_commands_take_the_gate(tiny_llama_lm, tmp_path):
    import argparse

    from hf_performer.cli import main as cli_main
    from hf_performer.cli.linearize import add_parser as linearize_parser
    from hf_performer.cli.linearize import settings_from_args
    from hf_performer.recipes.linearize import LinearizeSettings, RecipeError, conversion_arguments

    tiny_llama_lm.save_pretrained(tmp_path / "source")
    assert cli_main(["convert", str(tmp_path / "source"), str(tmp_path / "out"), "--feature-map", "hedgehog",
                     "--window", "4", "--sinks", "1", "--tail-gate"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["favor_settings"]["tail_gate"] is True
    parser = linearize_parser(argparse.ArgumentParser().add_subparsers())
    settings = settings_from_args(parser.parse_args(["src", "out", "--train-file", "t.txt", "--tail-gate"]))
    assert settings.tail_gate and conversion_arguments(settings)["tail_gate"] is True
    (tmp_path / "t.txt").write_text("some text")
    train = [str(tmp_path / "t.txt")]
    assert "tail_gate" not in LinearizeSettings("src", train).identity()  # runs staged before it continue
    assert LinearizeSettings("src", train, tail_gate=True).identity()["tail_gate"] is True
    with pytest.raises(RecipeError, match="--tail-gate weighs the linear tail"):
        LinearizeSettings("src", ["t.txt"], tail_gate=True, linear_tail=False).check()
    with pytest.raises(SystemExit, match="it takes no --tail-gate"):
        settings_from_args(parser.parse_args(["src", "out", "--train-file", "t.txt", "--baseline", "softmax",
                                              "--tail-gate"]))
