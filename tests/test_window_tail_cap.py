"""The bounded tail of causal window layers (issue 33, item 3): ``tail_cap = M`` weighs a tail of ``n > M`` tokens by
``M / n``. The operator against the float64 reference (which counts each query's tail keys from its explicit mask),
with and without a sparse cache, padding, GQA, both weight modes; a cap the tail never reaches changes nothing;
prefill + decode and rollback + re-decode give the one pass; the memory-bounded training path has the one pass's
gradients; output_attentions; the favor setting, the model and its saved folder; one-line errors (the settings'
refusals by update_favor_settings: tests/test_sparse_cache_integration.py)."""

import json

import pytest
import torch

from hf_performer import window_linear_attention
from hf_performer.attention_weights import window_attention_weights
from hf_performer.reference import reference_window_linear_attention

from conftest import logits_of
from window_cases import GAMMA, on_tokens, padded_mask, refusal, run_in_pieces, small_map, small_qkv


@pytest.mark.parametrize("name, learned", [("hedgehog", True), ("favor+", False)])
@pytest.mark.parametrize("capacity", [0, 3])
@pytest.mark.parametrize("cap", [1, 7])
def test_matches_the_float64_reference(name, learned, capacity, cap):
    q, k, v = small_qkv()
    fm, mask = small_map(name), padded_mask()
    kwargs = dict(window=4, sinks=2, softmax_weight=GAMMA if learned else None, chunk_size=5, sparse_cache=capacity,
                  key_padding_mask=mask)
    out = window_linear_attention(q, k, v, fm, tail_cap=cap, **kwargs)
    expected = reference_window_linear_attention(q, k, v, fm, tail_cap=cap, **kwargs)
    torch.testing.assert_close(on_tokens(out, mask), on_tokens(expected, mask), rtol=1e-10, atol=1e-10)
    unbounded = window_linear_attention(q, k, v, fm, **kwargs)
    assert float((out - unbounded).detach().abs().max()) > 1e-3  # the cap binds for the later queries


def test_a_cap_the_tail_never_reaches_changes_nothing():
    q, k, v = small_qkv(seed=1)
    fm, mask = small_map("hedgehog"), padded_mask()
    kwargs = dict(window=4, sinks=2, softmax_weight=GAMMA, chunk_size=5, key_padding_mask=mask)
    for capacity in (0, 3):
        unbounded = window_linear_attention(q, k, v, fm, sparse_cache=capacity, **kwargs)
        capped = window_linear_attention(q, k, v, fm, sparse_cache=capacity, tail_cap=41, **kwargs)
        torch.testing.assert_close(capped, unbounded, rtol=0, atol=0)


@pytest.mark.parametrize("capacity", [0, 3])
@pytest.mark.parametrize("pieces", [[1] * 41, [9] + [1] * 32, [3, 7, 1, 12, 2, 1, 1, 14]])
def test_prefill_and_decode_give_the_one_pass(capacity, pieces):
    q, k, v = small_qkv(seed=2)
    fm, mask = small_map("hedgehog"), padded_mask()
    kwargs = dict(window=4, sinks=2, softmax_weight=GAMMA, chunk_size=5, sparse_cache=capacity, tail_cap=6)
    one_pass = window_linear_attention(q, k, v, fm, key_padding_mask=mask, **kwargs)
    out, state = run_in_pieces(q, k, v, fm, pieces, mask, **kwargs)
    torch.testing.assert_close(on_tokens(out, mask), on_tokens(one_pass, mask), rtol=1e-10, atol=1e-10)
    # The state counts each row's tokens that are neither padding nor sinks.
    assert state.kept_tokens.tolist() == (mask.sum(-1) - 2).tolist()


@pytest.mark.parametrize("capacity", [0, 3])
@pytest.mark.parametrize("rejected", [1, 12])
def test_rollback_then_redecode_gives_the_one_pass(capacity, rejected):
    q, k, v = small_qkv(seed=3)
    fm, mask = small_map("favor+"), padded_mask()
    kwargs = dict(window=4, sinks=2, chunk_size=5, sparse_cache=capacity, tail_cap=5)
    expected = reference_window_linear_attention(q, k, v, fm, key_padding_mask=mask, **kwargs)
    _, state = run_in_pieces(q[:, :, :20], k[:, :, :20], v[:, :, :20], fm, [20], mask[:, :20], **kwargs)
    junk = small_qkv(length=rejected, seed=4)
    _, drafted = run_in_pieces(*junk, fm, [rejected], state=state, max_rollback=rejected, **kwargs)
    restored = drafted.rollback(rejected)
    assert torch.equal(restored.kept_tokens, state.kept_tokens)
    out, _ = run_in_pieces(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], fm, [1, 4, 1] + [1] * 15, mask[:, 20:], state=restored,
                  **kwargs)
    torch.testing.assert_close(out, expected[:, :, 20:], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("capacity", [0, 8])
def test_the_segmented_training_path_has_the_one_pass_gradients(capacity):
    # Longer than one causal segment (256 queries): the call runs in segments that continue each other's state,
    # whose kept-token count must carry the tail's count across the cut.
    q, k, v = (t.requires_grad_() for t in small_qkv(batch=2, length=300, seed=5))
    fm, mask = small_map("hedgehog"), padded_mask(batch=2, length=300)
    gamma = GAMMA.clone().requires_grad_()
    kwargs = dict(window=8, sinks=2, chunk_size=16, sparse_cache=capacity, tail_cap=50, key_padding_mask=mask)
    out = window_linear_attention(q, k, v, fm, softmax_weight=gamma, **kwargs)
    expected = reference_window_linear_attention(q, k, v, fm, softmax_weight=gamma, **kwargs)
    torch.testing.assert_close(on_tokens(out, mask), on_tokens(expected, mask), rtol=1e-9, atol=1e-9)
    probe = torch.randn_like(out) * (mask.cumsum(-1) > 0)[:, None, :, None]
    grads = torch.autograd.grad((out * probe).sum(), (q, k, v, gamma))
    expected_grads = torch.autograd.grad((expected * probe).sum(), (q, k, v, gamma))
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("capacity", [0, 3])
def test_output_attentions_are_the_applied_weights(capacity):
    q, k, v = small_qkv(seed=6)
    fm, mask = small_map("hedgehog"), padded_mask()
    kwargs = dict(window=4, sinks=2, softmax_weight=GAMMA, chunk_size=5, sparse_cache=capacity, tail_cap=4,
                  key_padding_mask=mask)
    weights = window_attention_weights(q, k, v, fm, **kwargs)
    out = window_linear_attention(q, k, v, fm, **kwargs)
    applied = torch.matmul(weights, v.repeat_interleave(2, dim=1))
    torch.testing.assert_close(on_tokens(applied, mask), on_tokens(out, mask), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(tail_cap=-1), "tail_cap must be an int >= 0"),
        (dict(tail_cap=True), "tail_cap must be an int >= 0"),
        (dict(tail_cap=8, causal=False), "tail_cap needs causal=True"),
    ],
)
def test_bad_arguments_get_one_line_errors(kwargs, words):
    message = refusal(**kwargs)
    assert words in message and "\n" not in message


def test_a_cap_without_a_tail_is_refused():
    message = refusal(tail_map=None, tail_cap=8)
    assert "tail_cap needs a linear tail" in message and "\n" not in message


@pytest.mark.parametrize("capacity", [0, 3])
def test_the_training_length_tail_is_the_largest_cap_that_changes_nothing(capacity):
    from hf_performer.window_tail_cap import training_tail_tokens

    q, k, v = small_qkv(batch=1, seed=7)
    fm = small_map("favor+")
    kwargs = dict(window=4, sinks=2, chunk_size=5, sparse_cache=capacity)
    most = training_tail_tokens(41, 4, 2, capacity, 5)
    unbounded = window_linear_attention(q, k, v, fm, **kwargs)
    torch.testing.assert_close(window_linear_attention(q, k, v, fm, tail_cap=most, **kwargs), unbounded, rtol=0,
                               atol=0)
    below = window_linear_attention(q, k, v, fm, tail_cap=most - 1, **kwargs)
    assert float((below - unbounded)[:, :, -1].abs().max()) > 1e-6  # the last query's tail held exactly `most`


# ------------------------------------------------------------------------------------------- models and commands


def test_a_converted_model_runs_its_cap_in_forward_generate_and_its_saved_folder(tiny_llama_lm, tmp_path):
    from hf_performer import convert_to_performer
    from hf_performer.favor_attention import update_favor_settings
    from transformers import AutoModelForCausalLM

    ids = torch.randint(5, 90, (2, 70), generator=torch.Generator().manual_seed(1))
    settings = dict(feature_map="hedgehog", window=4, sinks=1, seed=0, sparse_cache=2)
    direct = convert_to_performer(tiny_llama_lm, tail_cap=6, **settings).eval()
    assert direct.config.favor_settings["tail_cap"] == 6
    updated = convert_to_performer(tiny_llama_lm, **settings).eval()
    unbounded = logits_of(updated, ids)
    assert update_favor_settings(updated, tail_cap=6)["tail_cap"] == 6
    torch.testing.assert_close(logits_of(updated, ids), logits_of(direct, ids))
    assert (logits_of(direct, ids) - unbounded).abs().max() > 1e-4
    with torch.no_grad():
        generated = direct.generate(ids[:1], max_new_tokens=6, do_sample=False)
        again = direct.generate(ids[:1], max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(generated, again)
    direct.save_pretrained(tmp_path / "capped")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "capped").eval()
    assert reloaded.config.favor_settings["tail_cap"] == 6
    torch.testing.assert_close(logits_of(reloaded, ids), logits_of(direct, ids))
    assert (tmp_path / "capped" / "window_tail_cap.py").is_file()  # the folder carries the code it runs


def test_an_encoder_window_layer_refuses_a_cap(tiny_bert_config):
    from transformers import BertModel

    from hf_performer import convert_to_performer
    from hf_performer.conversion.convert import ConversionError

    with pytest.raises(ConversionError, match="tail_cap is for causal window layers") as failure:
        convert_to_performer(BertModel(tiny_bert_config()), window=4, sinks=1, tail_cap=8)
    assert "\n" not in str(failure.value)


def test_the_commands_take_the_cap(tiny_llama_lm, tmp_path):
    from hf_performer.cli import main as cli_main
    from hf_performer.cli.linearize import add_parser as linearize_parser
    from hf_performer.recipes.linearize import LinearizeSettings, RecipeError, conversion_arguments
    from hf_performer.window_tail_cap import training_tail_tokens

    tiny_llama_lm.save_pretrained(tmp_path / "source")
    assert cli_main(["convert", str(tmp_path / "source"), str(tmp_path / "out"), "--feature-map", "hedgehog",
                     "--window", "4", "--sinks", "1", "--tail-cap", "9"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["favor_settings"]["tail_cap"] == 9
    # linearize: by default the most tokens a tail held at the longest training length; a given cap; refusals
    default = LinearizeSettings("source", ["train.txt"], sparse_cache=32, transfer_length=512, block_size=2048)
    assert conversion_arguments(default)["tail_cap"] == training_tail_tokens(2048, 64, 4, 32, 64)
    assert conversion_arguments(LinearizeSettings("source", ["train.txt"], tail_cap=0))["tail_cap"] == 0
    assert conversion_arguments(LinearizeSettings("source", ["train.txt"], linear_tail=False))["tail_cap"] == 0
    with pytest.raises(RecipeError, match="--tail-cap bounds the linear tail"):
        LinearizeSettings("source", ["train.txt"], tail_cap=5, linear_tail=False).check()
    import argparse

    parser = linearize_parser(argparse.ArgumentParser().add_subparsers())
    with pytest.raises(SystemExit, match="it takes no --tail-cap"):
        from hf_performer.cli.linearize import settings_from_args

        settings_from_args(parser.parse_args(["src", "out", "--train-file", "t.txt", "--baseline", "softmax",
                                              "--tail-cap", "5"]))
