"""Window attention with a decoding state: prefill + decode == one pass (any split), rollback, constant size,
batch reordering, errors. Operator level; the cache layer is tested in test_window_cache.py."""

import pytest
import torch

from hf_performer import make_feature_map, window_linear_attention
from hf_performer.reference import reference_window_linear_attention
from hf_performer.window_attention import WindowAttentionState
from hf_performer.window_state import buffer_capacity

GAMMA = torch.tensor([0.1, 0.5, 0.9, 0.3], dtype=torch.float64)
SPLITS = {
    "one pass": [31],
    "prefill + decode": [9] + [1] * 22,
    "decode from the first token": [1] * 31,
    "chunked prefill": [3, 7, 1, 12, 2, 6],
}


def _map(name, d=8):
    if name == "hedgehog":
        return make_feature_map(name, d, num_heads=4, num_key_value_heads=2).double()
    return make_feature_map(name, d, nb_features=None if name == "elu+1" else 16).double()


def _qkv(batch=2, length=31, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 4, length, 8, generator=generator, dtype=dtype)
    k = torch.randn(batch, 2, length, 8, generator=generator, dtype=dtype)
    v = torch.randn(batch, 2, length, 8, generator=generator, dtype=dtype)
    return q, k, v


def _padding(batch=2, length=31):
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, :4] = False  # left padding, as generate() pads a batch
    mask[0, 12:14] = False  # holes, including inside the window and the buffer
    return mask


def _assert_close_on_tokens(out, expected, mask, **tolerance):
    """Compare the outputs of queries that see at least one key (left-padding queries see none: 0/0)."""
    sees_a_key = mask.cumsum(-1) > 0
    rows = sees_a_key[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[rows], expected[rows], **tolerance)


def _run(q, k, v, fm, pieces, mask=None, state=None, **kwargs):
    """Outputs of consecutive calls over the pieces (lengths), carrying the state."""
    outputs, start = [], 0
    for size in pieces:
        piece = slice(start, start + size)
        piece_mask = None if mask is None else mask[:, piece]
        out, state = window_linear_attention(q[:, :, piece], k[:, :, piece], v[:, :, piece], fm, initial_state=state,
                                             return_state=True, key_padding_mask=piece_mask, **kwargs)
        outputs.append(out)
        start += size
    return torch.cat(outputs, dim=2), state


@pytest.mark.parametrize("name", ["favor+", "relu", "elu+1", "hedgehog"])
@pytest.mark.parametrize("learned", [False, True])
@pytest.mark.parametrize("split", list(SPLITS))
def test_consecutive_calls_equal_one_pass_and_the_reference(name, learned, split):
    # float64: disagreement is a bug. GQA 4/2 heads, padding holes and left padding, chunk 5 (ragged blocks);
    # window 4 + max_rollback 3 < 31 tokens: tokens are folded into the tail sums along the way.
    q, k, v = _qkv()
    fm, mask = _map(name), _padding()
    kwargs = dict(window=4, sinks=2, softmax_weight=GAMMA if learned else None, chunk_size=5)
    out, state = _run(q, k, v, fm, SPLITS[split], mask, max_rollback=3, **kwargs)
    expected = reference_window_linear_attention(q, k, v, fm, key_padding_mask=mask, **kwargs)
    _assert_close_on_tokens(out, expected, mask, rtol=1e-8, atol=1e-8)
    # The buffer has its constant size (window - 1 + chunk + max_rollback tokens).
    assert state.seen == 31 and state.buffer_key.shape[2] == buffer_capacity(4, 5, 3) == 11
    assert state.sink_position.tolist() == [[0, 1], [4, 5]] and state.sink_valid.all()


@pytest.mark.parametrize("window, sinks", [(0, 0), (0, 3), (1, 0), (6, 5), (40, 2)])
def test_limits_and_sinks_longer_than_the_first_calls(window, sinks):
    # window 0 (pure tail), window 1 (only the token itself), sinks > first call, window > sequence.
    q, k, v = _qkv(batch=1, seed=1)
    fm = _map("favor+")
    out, _ = _run(q, k, v, fm, [2, 1, 1, 5, 1, 22], window=window, sinks=sinks, chunk_size=4)
    expected = reference_window_linear_attention(q, k, v, fm, window=window, sinks=sinks)
    torch.testing.assert_close(out, expected, rtol=1e-8, atol=1e-8)


def test_float32_decode_matches_the_float64_reference():
    q, k, v = _qkv(seed=2, dtype=torch.float32)
    fm = make_feature_map("favor+", 8, nb_features=32)
    out, _ = _run(q, k, v, fm, [10] + [1] * 21, _padding(), window=5, sinks=2)
    expected = reference_window_linear_attention(q, k, v, fm, window=5, sinks=2, key_padding_mask=_padding())
    _assert_close_on_tokens(out.double(), expected, _padding(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("learned", [False, True])
@pytest.mark.parametrize("rejected_pieces", [[1], [3], [1, 1, 1], [1, 2]])
def test_rollback_then_redecode_equals_decoding_without_the_rejected_tokens(learned, rejected_pieces):
    # Speculative decoding: draft tokens (one chunk or several decode steps) are rejected, the state drops them,
    # decoding resumes with the right tokens. Junk drafts with huge keys would change the tail's stabiliser.
    q, k, v = _qkv(batch=2, seed=3)
    fm, mask = _map("hedgehog"), _padding()
    kwargs = dict(window=3, sinks=1, softmax_weight=GAMMA if learned else None, chunk_size=4)
    expected = reference_window_linear_attention(q, k, v, fm, key_padding_mask=mask, **kwargs)
    _, state = _run(q, k, v, fm, [15], mask, **kwargs)
    junk = _qkv(batch=2, length=sum(rejected_pieces), seed=4)
    junk = (junk[0], 30 * junk[1], 1e3 * junk[2])
    _, drafted = _run(*junk, fm, rejected_pieces, state=state, max_rollback=sum(rejected_pieces), **kwargs)
    assert drafted.checkpoint is not None and drafted.rollback_capacity() >= sum(rejected_pieces)
    restored = drafted.rollback(sum(rejected_pieces))
    assert restored.seen == 15
    out, _ = _run(q[:, :, 15:], k[:, :, 15:], v[:, :, 15:], fm, [1, 4, 1, 10], mask[:, 15:], state=restored,
                  **kwargs)
    _assert_close_on_tokens(out, expected[:, :, 15:], mask[:, 15:] | True, rtol=1e-8, atol=1e-8)


def test_rollback_capacity_and_errors():
    q, k, v = _qkv(batch=1, seed=5)
    fm = _map("favor+")
    _, state = _run(q, k, v, fm, [20], window=4, sinks=2, max_rollback=3)
    assert state.rollback_capacity() >= 3
    assert state.rollback(state.rollback_capacity()).seen == 20 - state.rollback_capacity()
    for bad in (state.rollback_capacity() + 1, -1, 1.5):
        with pytest.raises(ValueError) as error:
            state.rollback(bad)
        assert "can drop between 0 and" in str(error.value) and "\n" not in str(error.value)
    _, short = _run(q, k, v, fm, [5], window=4, sinks=2, max_rollback=3)  # back to the first query at most
    assert short.rollback_capacity() == 4 and short.rollback(4).seen == 1


def test_state_size_does_not_grow_with_length():
    generator = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 4 // h, 2000, 16, generator=generator) for h in (1, 2, 2))
    fm = make_feature_map("favor+", 16, nb_features=32)
    sizes = {}
    with torch.no_grad():
        state = None
        for start in range(0, 2000, 100):  # chunked prefill through the state, then a few decode steps
            _, state = window_linear_attention(q[:, :, start:start + 100], k[:, :, start:start + 100],
                                               v[:, :, start:start + 100], fm, window=16, sinks=4,
                                               initial_state=state, return_state=True)
            if start + 100 in (100, 2000):
                sizes[start + 100] = state.nbytes()
    assert sizes[100] == sizes[2000] > 0
    assert state.buffer_key.shape[2] == buffer_capacity(16, 64, 0) and state.sink_key.shape[2] == 4


def test_batch_rows_can_be_reordered_like_beams():
    q, k, v = _qkv(batch=3, seed=7)
    fm = _map("favor+")
    kwargs = dict(window=3, sinks=2, chunk_size=4)
    _, state = _run(q, k, v, fm, [20], **kwargs)
    order = torch.tensor([2, 0, 0])
    out, _ = _run(q[order, :, 20:], k[order, :, 20:], v[order, :, 20:], fm, [1, 1, 9],
                  state=state.map_batch(lambda t: t[order]), **kwargs)
    expected = reference_window_linear_attention(q[order], k[order], v[order], fm, **kwargs)[:, :, 20:]
    torch.testing.assert_close(out, expected, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(causal=False, return_state=True), "need causal=True"),
        (dict(return_state=True, max_rollback=-1), "max_rollback must be an int >= 0"),
        (dict(initial_state="state"), "initial_state must be a WindowAttentionState"),
    ],
)
def test_clear_errors_for_bad_state_arguments(kwargs, words):
    q, k, v = _qkv(dtype=torch.float32)
    with pytest.raises(ValueError) as error:
        window_linear_attention(q, k, v, make_feature_map("favor+", 8), window=2, **kwargs)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_a_state_from_other_settings_is_refused():
    q, k, v = _qkv(dtype=torch.float32)
    fm = make_feature_map("favor+", 8)
    _, state = window_linear_attention(q, k, v, fm, window=2, sinks=1, return_state=True)
    assert isinstance(state, WindowAttentionState)
    for kwargs, words in [(dict(window=3, sinks=1), "built with window=2, sinks=1"),
                          (dict(window=2, sinks=1, query=q[:1], key=k[:1], value=v[:1]), "the inputs have")]:
        inputs = dict(query=q, key=k, value=v) | {n: kwargs.pop(n) for n in ("query", "key", "value") if n in kwargs}
        with pytest.raises(ValueError) as error:
            window_linear_attention(inputs["query"], inputs["key"], inputs["value"], fm, initial_state=state, **kwargs)
        assert words in str(error.value) and "\n" not in str(error.value)


def test_no_tail_state_decodes_like_one_pass():
    # linear_tail=False (feature_map=None): sinks + window exact softmax only, also through the state.
    q, k, v = _qkv(seed=9)
    mask = _padding()
    out, state = _run(q, k, v, None, [9] + [1] * 22, mask, window=4, sinks=2, chunk_size=5)
    expected = window_linear_attention(q, k, v, None, window=4, sinks=2, key_padding_mask=mask, chunk_size=5)
    _assert_close_on_tokens(out, expected, mask, rtol=1e-8, atol=1e-8)
    assert state.current.tail_sums.shape[2] == 1  # the constant feature (no map)
