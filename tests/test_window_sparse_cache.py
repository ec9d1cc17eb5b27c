"""The sparse cache of hard keys in causal window layers (issue 33): the operator against its float64 reference (an
independent, one-boundary-at-a-time selection), the limits G = 0 (today's hybrid) and G >= L (exact softmax), the
same selection in one pass, in prefill + token-by-token decode and after a rollback, constant state size, padded rows
as alone, output_attentions, gradients, and one-line errors."""

import itertools

import pytest
import torch

from hf_performer import make_feature_map, window_linear_attention
from hf_performer.attention_weights import window_attention_weights
from hf_performer.reference import reference_sparse_cache, reference_window_linear_attention, softmax_attention
from hf_performer.window_causal import sparse_cache_membership

from window_cases import GAMMA, on_tokens, padded_mask, refusal, run_in_pieces, small_map, small_qkv


@pytest.mark.parametrize("name, learned", [("hedgehog", True), ("hedgehog", False), ("favor+", False)])
@pytest.mark.parametrize("capacity, window", [(1, 4), (3, 4), (3, 0), (100, 4)])
def test_matches_the_float64_reference(name, learned, capacity, window):
    # GQA 4/2, holes, left padding with two different boundary offsets, chunk 5: the selection of the operator
    # (all boundaries in one loop, blocks batched) against the reference's, one row / head / boundary at a time.
    q, k, v = small_qkv()
    fm, mask = small_map(name), padded_mask()
    kwargs = dict(window=window, sinks=2, softmax_weight=GAMMA if learned else None, chunk_size=5,
                  sparse_cache=capacity, key_padding_mask=mask)
    out = window_linear_attention(q, k, v, fm, **kwargs)
    expected = reference_window_linear_attention(q, k, v, fm, **kwargs)
    torch.testing.assert_close(on_tokens(out, mask), on_tokens(expected, mask), rtol=1e-10, atol=1e-10)
    cached = reference_sparse_cache(k, v, fm, window=window, sinks=2, sparse_cache=capacity, key_padding_mask=mask,
                                    chunk_size=5)
    assert bool(cached.any())  # the cache really holds keys older than the window
    membership = sparse_cache_membership(k, v, fm, window=window, sinks=2, sparse_cache=capacity,
                                         key_padding_mask=mask, scaling=None, chunk_size=5)
    assert torch.equal(membership, cached)


def test_zero_is_the_window_hybrid_and_a_large_cache_is_exact_softmax():
    q, k, v = small_qkv(batch=2, seed=1)
    fm, mask = small_map("hedgehog"), padded_mask(batch=2)
    kwargs = dict(window=3, sinks=1, softmax_weight=GAMMA, chunk_size=4, key_padding_mask=mask)
    without = window_linear_attention(q, k, v, fm, **kwargs)
    torch.testing.assert_close(window_linear_attention(q, k, v, fm, sparse_cache=0, **kwargs), without, rtol=0, atol=0)
    torch.testing.assert_close(on_tokens(without, mask), on_tokens(
        reference_window_linear_attention(q, k, v, fm, **kwargs), mask), rtol=1e-10, atol=1e-10)
    # G >= L: every older token stays exact, nothing folds: exact causal softmax, with and without a tail.
    exact = softmax_attention(q, k, v, causal=True, key_padding_mask=mask)
    for feature_map in (fm, None):
        everything = window_linear_attention(q, k, v, feature_map, sparse_cache=41, **kwargs)
        torch.testing.assert_close(on_tokens(everything, mask), on_tokens(exact, mask), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name, learned", [("hedgehog", True), ("favor+", False)])
@pytest.mark.parametrize("pieces", [[1] * 41, [9] + [1] * 32, [3, 7, 1, 12, 2, 1, 1, 14]])
def test_prefill_and_decode_select_what_one_pass_selects(name, learned, pieces):
    q, k, v = small_qkv(seed=2)
    fm, mask = small_map(name), padded_mask()
    kwargs = dict(window=4, sinks=2, softmax_weight=GAMMA if learned else None, chunk_size=5, sparse_cache=3)
    one_pass = window_linear_attention(q, k, v, fm, key_padding_mask=mask, **kwargs)
    out, state = run_in_pieces(q, k, v, fm, pieces, mask, **kwargs)
    torch.testing.assert_close(on_tokens(out, mask), on_tokens(one_pass, mask), rtol=1e-10, atol=1e-10)
    # The state's cache is the one-pass selection at each row's last boundary (the tokens after `boundary - window`
    # wait for the next selection, exactly, outside the cache).
    membership = sparse_cache_membership(k, v, fm, window=4, sinks=2, sparse_cache=3, key_padding_mask=mask,
                                         scaling=None, chunk_size=5)[:, :, -1]  # [B, Hkv, L] of the last query
    current = state.current
    membership &= torch.arange(41)[None, None, :] <= current.boundary[:, None, None] - 4
    from_state = torch.zeros_like(membership)
    for row, head in itertools.product(range(3), range(2)):
        from_state[row, head, current.cache_position[row, head][current.cache_valid[row, head]]] = True
    assert torch.equal(from_state, membership)


@pytest.mark.parametrize("rejected", [1, 4, 12])
def test_rollback_then_redecode_selects_as_without_the_rejected_tokens(rejected):
    # Drafts with huge keys and values would win every selection; rolling them back (across boundaries when there
    # are more than chunk_size of them) must give the selection of the sequence without them.
    q, k, v = small_qkv(seed=3)
    fm, mask = small_map("hedgehog"), padded_mask()
    kwargs = dict(window=4, sinks=2, softmax_weight=GAMMA, chunk_size=5, sparse_cache=3)
    expected = reference_window_linear_attention(q, k, v, fm, key_padding_mask=mask, **kwargs)
    _, state = run_in_pieces(q[:, :, :20], k[:, :, :20], v[:, :, :20], fm, [20], mask[:, :20], **kwargs)
    junk = small_qkv(length=rejected, seed=4)
    junk = (junk[0], 30 * junk[1], 100 * junk[2])
    _, drafted = run_in_pieces(*junk, fm, [rejected], state=state, max_rollback=rejected, **kwargs)
    restored = drafted.rollback(rejected)
    assert restored.seen == 20 and restored.current is None  # back to the checkpoint, replayed by the next call
    out, _ = run_in_pieces(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], fm, [1, 4, 1] + [1] * 15, mask[:, 20:], state=restored,
                  **kwargs)
    torch.testing.assert_close(out, expected[:, :, 20:], rtol=1e-10, atol=1e-10)


def test_the_state_has_the_same_size_at_any_length():
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, heads, 1500, 16, generator=generator) for heads in (4, 2, 2))
    fm = make_feature_map("hedgehog", 16, num_heads=4, num_key_value_heads=2)
    sizes = {}
    with torch.no_grad():
        state = None
        for start in range(0, 1500, 100):
            _, state = window_linear_attention(q[:, :, start:start + 100], k[:, :, start:start + 100],
                                               v[:, :, start:start + 100], fm, window=16, sinks=4, sparse_cache=24,
                                               initial_state=state, return_state=True)
            sizes[start + 100] = state.nbytes()
        for position in range(1500, 1510):  # and decoding steps across a boundary
            _, state = window_linear_attention(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], fm, window=16, sinks=4,
                                               sparse_cache=24, initial_state=state, return_state=True)
            sizes[position + 1] = state.nbytes()
    assert len(set(sizes.values())) == 1 and state.current.cache_valid.all()


def test_a_left_padded_row_selects_what_it_selects_alone():
    q, k, v = small_qkv(batch=2, seed=6)
    fm, mask = small_map("hedgehog"), padded_mask(batch=2)
    kwargs = dict(window=4, sinks=2, softmax_weight=GAMMA, chunk_size=5, sparse_cache=3)
    batched = window_linear_attention(q, k, v, fm, key_padding_mask=mask, **kwargs)
    alone = window_linear_attention(q[1:, :, 7:], k[1:, :, 7:], v[1:, :, 7:], fm, **kwargs)
    torch.testing.assert_close(batched[1:, :, 7:], alone, rtol=1e-10, atol=1e-10)
    decoded, _ = run_in_pieces(q[1:], k[1:], v[1:], fm, [10] + [1] * 31, mask[1:], **kwargs)
    torch.testing.assert_close(decoded[:, :, 7:], alone, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("tail", [True, False])
def test_output_attentions_are_the_applied_weights(tail):
    q, k, v = small_qkv(batch=2, seed=7)
    fm, mask = small_map("hedgehog"), padded_mask(batch=2)
    kwargs = dict(window=4, sinks=2, softmax_weight=GAMMA, chunk_size=5, sparse_cache=3, key_padding_mask=mask)
    feature_map = fm if tail else None  # without a tail, selection by the distance to the mean value
    out = window_linear_attention(q, k, v, feature_map, **kwargs)
    weights = window_attention_weights(q, k, v, feature_map, **kwargs)
    applied = weights @ v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(on_tokens(applied, mask), on_tokens(out, mask), rtol=1e-10, atol=1e-10)
    if not tail:
        expected = reference_window_linear_attention(q, k, v, None, **kwargs)
        torch.testing.assert_close(on_tokens(out, mask), on_tokens(expected, mask), rtol=1e-10, atol=1e-10)


def test_gradients_reach_the_kept_keys_and_match_finite_differences():
    q, k, v = (t.requires_grad_() for t in small_qkv(batch=2, length=17, seed=8))
    gamma = GAMMA.clone().requires_grad_()
    fm = small_map("hedgehog")
    mask = padded_mask(batch=2, length=17)

    def attention(q, k, v, gamma):
        return window_linear_attention(q, k, v, fm, window=3, sinks=1, softmax_weight=gamma, chunk_size=4,
                                       sparse_cache=2, key_padding_mask=mask)

    assert torch.autograd.gradcheck(attention, (q, k, v, gamma), eps=1e-6, atol=1e-6, fast_mode=True)
    # A key kept in the cache of the last queries (older than their window) gets a gradient through them.
    last = sparse_cache_membership(k.detach(), v.detach(), fm, window=3, sinks=1, sparse_cache=2,
                                   key_padding_mask=mask, scaling=None, chunk_size=4)[0, 0, -1]
    kept = int(torch.nonzero(last)[0])
    grad = torch.autograd.grad(attention(q, k, v, gamma)[0, :, -1].sum(), k)[0]
    assert kept < 17 - 3 and float(grad[0, 0, kept].abs().sum()) > 0


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(sparse_cache=-1), "sparse_cache must be an int >= 0"),
        (dict(sparse_cache=2, causal=False), "sparse_cache needs causal=True"),
        (dict(sparse_cache=1.5), "sparse_cache must be an int >= 0"),
    ],
)
def test_bad_arguments_get_one_line_errors(kwargs, words):
    message = refusal(**kwargs)
    assert words in message and "\n" not in message


def test_a_state_with_another_cache_size_is_refused():
    q, k, v = small_qkv(batch=1, dtype=torch.float32)
    fm = make_feature_map("favor+", 8)
    _, state = window_linear_attention(q, k, v, fm, window=2, sparse_cache=4, return_state=True)
    with pytest.raises(ValueError, match="built with window=2, sinks=0, sparse_cache=4") as error:
        window_linear_attention(q, k, v, fm, window=2, sparse_cache=8, initial_state=state)
    assert "\n" not in str(error.value)


# ------------------------------------------------------------------ the attention selection (issue 49, H2O / TOVA)

BY_ATTENTION = dict(sparse_cache_selection="attention")


@pytest.mark.parametrize("name", ["hedgehog", "favor+", None])
@pytest.mark.parametrize("capacity, window", [(1, 4), (3, 4), (3, 0)])
def test_attention_selection_matches_the_float64_reference(name, capacity, window):
    # The boundary query's softmax over the candidates, summed over the key head's query heads, ranks them.
    q, k, v = small_qkv(seed=11)
    fm, mask = (None if name is None else small_map(name)), padded_mask()
    kwargs = dict(window=window, sinks=2, chunk_size=5, sparse_cache=capacity, key_padding_mask=mask)
    out = window_linear_attention(q, k, v, fm, **kwargs, **BY_ATTENTION)
    expected = reference_window_linear_attention(q, k, v, fm, **kwargs, **BY_ATTENTION)
    torch.testing.assert_close(on_tokens(out, mask), on_tokens(expected, mask), rtol=1e-10, atol=1e-10)
    cached = reference_sparse_cache(k, v, fm, window=window, sinks=2, sparse_cache=capacity, key_padding_mask=mask,
                                    chunk_size=5, query=q)
    membership = sparse_cache_membership(k, v, fm, window=window, sinks=2, sparse_cache=capacity,
                                         key_padding_mask=mask, scaling=None, chunk_size=5, selection_query=q)
    assert torch.equal(membership, cached)
    by_recall = reference_sparse_cache(k, v, fm, window=window, sinks=2, sparse_cache=capacity,
                                       key_padding_mask=mask, chunk_size=5)
    assert not torch.equal(cached, by_recall)  # another rule, other keys


def test_attention_selection_keeps_the_key_the_boundary_query_looks_for():
    q, k, v = small_qkv(batch=1, seed=12)
    target = 3  # an old key (window 4, chunk 5) that the queries at the boundaries 10, 15, ... point at
    for boundary in range(10, 41, 5):
        q[0, :, boundary] = 8 * k[0, :, target].repeat_interleave(2, dim=0)
    cached = sparse_cache_membership(k, v, None, window=4, sinks=1, sparse_cache=1, key_padding_mask=None,
                                     scaling=None, chunk_size=5, selection_query=q)
    assert bool(cached[0, :, 12:, target].all())  # every later query sees it exactly, in both key heads


@pytest.mark.parametrize("rule", [BY_ATTENTION, dict(sparse_cache_span=3), dict(sparse_cache_span=5, **BY_ATTENTION)])
@pytest.mark.parametrize("name", ["hedgehog", None])
@pytest.mark.parametrize("pieces", [[1] * 41, [9] + [1] * 32, [3, 7, 1, 12, 2, 1, 1, 14]])
def test_each_rule_selects_in_prefill_and_decode_what_one_pass_selects(rule, name, pieces):
    # (the attention rule, and either rule over spans: test_sparse_cache_span.py)
    q, k, v = small_qkv(seed=13)
    fm, mask = (None if name is None else small_map(name)), padded_mask()
    kwargs = dict(window=4, sinks=2, chunk_size=5, sparse_cache=3, **rule)
    one_pass = window_linear_attention(q, k, v, fm, key_padding_mask=mask, **kwargs)
    out, _ = run_in_pieces(q, k, v, fm, pieces, mask, **kwargs)
    torch.testing.assert_close(on_tokens(out, mask), on_tokens(one_pass, mask), rtol=1e-10, atol=1e-10)
    q32, k32, v32 = (t.float() for t in (q, k, v))  # float32: the exact decoding step (no tail) serves these
    one_pass = window_linear_attention(q32, k32, v32, fm, key_padding_mask=mask, **kwargs)
    with torch.no_grad():
        out, _ = run_in_pieces(q32, k32, v32, fm, pieces, mask, **kwargs)
    torch.testing.assert_close(on_tokens(out, mask), on_tokens(one_pass, mask), rtol=1e-5, atol=1e-5)


def test_attention_selection_of_a_left_padded_row_and_its_output_attentions():
    q, k, v = small_qkv(batch=2, seed=14)
    fm, mask = small_map("hedgehog"), padded_mask(batch=2)
    kwargs = dict(window=4, sinks=2, softmax_weight=GAMMA, chunk_size=5, sparse_cache=3, **BY_ATTENTION)
    batched = window_linear_attention(q, k, v, fm, key_padding_mask=mask, **kwargs)
    alone = window_linear_attention(q[1:, :, 7:], k[1:, :, 7:], v[1:, :, 7:], fm, **kwargs)
    torch.testing.assert_close(batched[1:, :, 7:], alone, rtol=1e-10, atol=1e-10)
    weights = window_attention_weights(q, k, v, fm, key_padding_mask=mask, **kwargs)
    applied = weights @ v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(on_tokens(applied, mask), on_tokens(batched, mask), rtol=1e-10, atol=1e-10)


def test_attention_selection_refuses_rollbacks_and_unknown_rules_in_one_line():
    q, k, v = small_qkv(batch=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="keeps no queries to replay a selection") as error:
        window_linear_attention(q, k, v, None, window=2, sparse_cache=4, return_state=True, max_rollback=3,
                                **BY_ATTENTION)
    assert "\n" not in str(error.value)
    message = refusal(sparse_cache=2, sparse_cache_selection="largest")
    assert "sparse_cache_selection must be one of 'recall', 'attention'" in message and "\n" not in message


@pytest.mark.parametrize("rule", [BY_ATTENTION, dict(sparse_cache_span=5)])
def test_each_rule_trains_in_segments_with_the_reference_gradients(rule):
    from hf_performer.window_attention import CAUSAL_SEGMENT_LENGTH

    generator = torch.Generator().manual_seed(15)
    length = 2 * CAUSAL_SEGMENT_LENGTH + 37  # three recomputed segments
    q, k, v = (torch.randn(1, heads, length, 16, dtype=torch.float64, generator=generator).requires_grad_()
               for heads in (4, 2, 2))
    kwargs = dict(window=8, sinks=2, sparse_cache=6, chunk_size=16, **rule)
    out = window_linear_attention(q, k, v, None, **kwargs)
    expected = reference_window_linear_attention(q, k, v, None, **kwargs)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    for got, want in zip(torch.autograd.grad(out.square().sum(), (q, k, v)),
                         torch.autograd.grad(expected.square().sum(), (q, k, v))):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
