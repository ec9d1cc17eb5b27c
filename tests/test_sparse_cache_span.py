"""The sparse cache's span (issue 49): each candidate ranked by its score averaged over ``sparse_cache_span``
neighbouring candidates, so that a run of tokens stays whole. The operator against its float64 reference for both
rules, the same selection after a rollback and in output_attentions (prefill + decode: test_window_sparse_cache.py),
a run kept over single sharper tokens, span 1 as before, and the setting through convert / update_favor_settings /
the CLI with one-line refusals."""

import pytest
import torch

from hf_performer import convert_to_performer, window_linear_attention
from hf_performer.attention_weights import window_attention_weights
from hf_performer.favor_attention import update_favor_settings
from hf_performer.reference import reference_sparse_cache, reference_window_linear_attention
from hf_performer.window_causal import sparse_cache_membership
from hf_performer.window_sparse_cache import span_mean

from conftest import logits_of
from window_cases import GAMMA, on_tokens, padded_mask, refusal, run_in_pieces, small_map, small_qkv


def test_span_mean_averages_over_the_nearest_valid_candidates():
    scores = torch.tensor([[[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]])
    valid = torch.tensor([[[True, False, True, True, False, True]]])
    pooled = span_mean(scores, valid, 3)  # the valid ones are 1, 3, 4, 6: neighbours skip the invalid slots
    torch.testing.assert_close(pooled[valid], torch.tensor([2.0, 8 / 3, 13 / 3, 5.0]))
    assert torch.equal(span_mean(scores, valid, 1), scores)


@pytest.mark.parametrize("name, selection", [("hedgehog", "recall"), ("favor+", "recall"), (None, "recall"),
                                             ("hedgehog", "attention"), (None, "attention")])
@pytest.mark.parametrize("capacity, window, span", [(3, 4, 3), (3, 0, 5), (5, 4, 7)])
def test_matches_the_float64_reference(name, selection, capacity, window, span):
    q, k, v = small_qkv(seed=21)
    fm, mask = (None if name is None else small_map(name)), padded_mask()
    kwargs = dict(window=window, sinks=2, chunk_size=5, sparse_cache=capacity, key_padding_mask=mask,
                  sparse_cache_selection=selection, sparse_cache_span=span,
                  softmax_weight=GAMMA if name == "hedgehog" else None)
    out = window_linear_attention(q, k, v, fm, **kwargs)
    expected = reference_window_linear_attention(q, k, v, fm, **kwargs)
    torch.testing.assert_close(on_tokens(out, mask), on_tokens(expected, mask), rtol=1e-10, atol=1e-10)
    query = q if selection == "attention" else None
    common = dict(window=window, sinks=2, sparse_cache=capacity, key_padding_mask=mask, chunk_size=5)
    cached = reference_sparse_cache(k, v, fm, query=query, span=span, **common)
    membership = sparse_cache_membership(k, v, fm, scaling=None, selection_query=query, span=span, **common)
    assert torch.equal(membership, cached)
    assert not torch.equal(cached, reference_sparse_cache(k, v, fm, query=query, **common))  # other keys kept


def _run_and_outliers(length=48):
    """Values near 0 but one run of five tokens at 5 and two single tokens at 6 (no tail: the recall error is the
    distance to the mean value, so a single token is the sharpest candidate and the run the widest)."""
    generator = torch.Generator().manual_seed(22)
    q, k = (torch.randn(1, heads, length, 8, generator=generator, dtype=torch.float64) for heads in (2, 1))
    v = 0.3 * torch.randn(1, 1, length, 8, generator=generator, dtype=torch.float64)
    v[0, 0, 10:15] = 5.0
    v[0, 0, 4], v[0, 0, 22] = 6.0, 6.0
    return q, k, v


def test_a_wide_span_keeps_the_whole_run_where_single_tokens_keep_its_sharper_neighbours():
    q, k, v = _run_and_outliers()
    kept = {}
    for span in (1, 5):
        membership = sparse_cache_membership(k, v, None, window=4, sinks=1, sparse_cache=5, key_padding_mask=None,
                                             scaling=None, chunk_size=8, span=span)
        seen = torch.nonzero(membership[0, 0, -1]).flatten().tolist()
        kept[span] = {j for j in seen if j < 32}  # (the later ones wait, exact, for the next selection)
    assert {4, 22} <= kept[1] and not set(range(10, 15)) <= kept[1]
    assert kept[5] == set(range(10, 15))


@pytest.mark.parametrize("rejected", [1, 12])
def test_rollback_then_redecode_selects_as_without_the_rejected_tokens(rejected):
    # Drafts with huge values would win every selection, and pull their neighbours' averages up; rolled back (across
    # boundaries when more than chunk_size), the selection is the sequence's without them.
    q, k, v = small_qkv(seed=24)
    fm, mask = small_map("hedgehog"), padded_mask()
    kwargs = dict(window=4, sinks=2, softmax_weight=GAMMA, chunk_size=5, sparse_cache=3, sparse_cache_span=3)
    expected = reference_window_linear_attention(q, k, v, fm, key_padding_mask=mask, **kwargs)
    _, state = run_in_pieces(q[:, :, :20], k[:, :, :20], v[:, :, :20], fm, [20], mask[:, :20], **kwargs)
    junk = small_qkv(length=rejected, seed=4)
    junk = (junk[0], 30 * junk[1], 100 * junk[2])
    _, drafted = run_in_pieces(*junk, fm, [rejected], state=state, max_rollback=rejected, **kwargs)
    out, _ = run_in_pieces(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], fm, [1, 4, 1] + [1] * 15, mask[:, 20:],
                           state=drafted.rollback(rejected), **kwargs)
    torch.testing.assert_close(out, expected[:, :, 20:], rtol=1e-10, atol=1e-10)


def test_output_attentions_are_the_applied_weights():
    q, k, v = small_qkv(batch=2, seed=25)
    fm, mask = small_map("hedgehog"), padded_mask(batch=2)
    kwargs = dict(window=4, sinks=2, softmax_weight=GAMMA, chunk_size=5, sparse_cache=3, sparse_cache_span=5,
                  key_padding_mask=mask)
    out = window_linear_attention(q, k, v, fm, **kwargs)
    applied = window_attention_weights(q, k, v, fm, **kwargs) @ v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(on_tokens(applied, mask), on_tokens(out, mask), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("span", [0, 2, -1, True, 3.0])
def test_a_span_that_is_not_an_odd_positive_int_is_refused_in_one_line(span):
    message = refusal(sparse_cache=2, sparse_cache_span=span)
    assert "sparse_cache_span must be an odd int >= 1" in message and "\n" not in message


def test_the_span_converts_updates_and_decodes(tiny_llama_lm):
    ids = torch.randint(5, 90, (2, 70), generator=torch.Generator().manual_seed(26))
    settings = dict(feature_map="hedgehog", window=4, sinks=1, seed=0, sparse_cache=3, linear_tail=False)
    single = convert_to_performer(tiny_llama_lm, **settings).eval()
    spans = convert_to_performer(tiny_llama_lm, sparse_cache_span=5, **settings).eval()
    assert spans.config.favor_settings["sparse_cache_span"] == 5
    assert single.config.favor_settings["sparse_cache_span"] == 1  # the default, recorded
    assert (logits_of(spans, ids) - logits_of(single, ids)).abs().max() > 1e-4  # other keys kept
    assert update_favor_settings(single, sparse_cache_span=5)["sparse_cache_span"] == 5
    torch.testing.assert_close(logits_of(single, ids), logits_of(spans, ids))
    with torch.no_grad():  # generate() with the model's cache selects what one pass selects
        generated = spans.generate(ids[:1], max_new_tokens=12, do_sample=False)
        again = spans.generate(ids[:1], max_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(generated, again)
    with pytest.raises(ValueError, match="sparse_cache_span'] must be an odd int >= 1") as failure:
        update_favor_settings(spans, sparse_cache_span=4)
    assert "\n" not in str(failure.value)


def test_the_cli_and_linearize_carry_the_span():
    from hf_performer.cli import build_parser
    from hf_performer.recipes.linearize import LinearizeSettings, RecipeError, conversion_arguments

    parser = build_parser()
    for verb in (["convert", "source", "out"], ["settings", "model", "out"], ["evaluate", "model", "--task", "passkey"],
                 ["linearize", "source", "out", "--train-file", "train.txt"]):
        assert parser.parse_args([*verb, "--sparse-cache-span", "31"]).sparse_cache_span == 31
    assert conversion_arguments(LinearizeSettings("source", ["train.txt"], sparse_cache_span=31))[
        "sparse_cache_span"] == 31
    with pytest.raises(RecipeError, match="--sparse-cache-span must be an odd int >= 1"):
        LinearizeSettings("source", ["train.txt"], sparse_cache_span=4).check()
