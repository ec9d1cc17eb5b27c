"""The decoding step of a window layer without a tail and with a sparse cache (window_decode.exact_decode_step): one
write into a free slot of a record of the exact keys and one SDPA call per step between boundaries. It must give what
the general step (decode_step) and one pass give, leave a state the general paths continue exactly (a longer call, a
rollback, a batch reorder), never change a state it was given, and serve only the steps it can."""

import pytest
import torch

import hf_performer.window_attention as window_attention
import hf_performer.window_decode as window_decode
from hf_performer import window_linear_attention
from hf_performer.reference import reference_window_linear_attention
from hf_performer.window_state import EXACT_HEADROOM, ExactKeys, WindowAttentionState, window_state_bytes

from window_cases import on_tokens, padded_mask, run_in_pieces, small_qkv

SETTINGS = dict(window=4, sinks=2, sparse_cache=3, chunk_size=5)
LENGTH = 43
DECODE = [9] + [1] * (LENGTH - 9)  # crosses seven boundaries, ends between two


@pytest.fixture
def served(monkeypatch):
    """The steps the exact path served (``served.count``) and a switch to turn it off (``served.off = True``)."""

    class Served:
        count, off = 0, False

    original = window_attention.exact_decode_step

    def counting(*args, **kwargs):
        if Served.off:
            return None
        step = original(*args, **kwargs)
        Served.count += step is not None
        return step

    monkeypatch.setattr(window_attention, "exact_decode_step", counting)
    return Served


def _tensors(state):
    fields = [getattr(state, name) for name in WindowAttentionState._fields[:9]]
    return fields + list(state.current) + [state.seen]


def _assert_same_state(a, b):
    for x, y in zip(_tensors(a), _tensors(b), strict=True):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
        else:
            assert x == y


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("headroom", [EXACT_HEADROOM, 2])
def test_exact_steps_equal_one_pass_the_reference_and_the_general_step(served, monkeypatch, padded, headroom):
    monkeypatch.setattr(window_decode, "EXACT_HEADROOM", headroom)  # 2: packed again every second step
    q, k, v = small_qkv(length=LENGTH)
    mask = padded_mask(length=LENGTH) if padded else None
    out, state = run_in_pieces(q, k, v, None, DECODE, mask, **SETTINGS)
    # Every step (boundaries too: the selection runs on the record's path) but, when padded, those up to the one
    # that fills the last row's sink slots (its second token, at 14).
    assert served.count == (28 if padded else 34)
    one_pass = window_linear_attention(q, k, v, None, key_padding_mask=mask, **SETTINGS)
    reference = reference_window_linear_attention(q, k, v, None, key_padding_mask=mask, **SETTINGS)
    tokens = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool) if mask is None else mask
    torch.testing.assert_close(on_tokens(out, tokens), on_tokens(one_pass, tokens), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(on_tokens(out, tokens), on_tokens(reference, tokens), rtol=1e-10, atol=1e-10)
    assert isinstance(state.exact_keys, ExactKeys) or padded  # (42 is a boundary of the padded second row)
    served.off = True
    general_out, general_state = run_in_pieces(q, k, v, None, DECODE, mask, **SETTINGS)
    torch.testing.assert_close(out, general_out, rtol=1e-10, atol=1e-10)
    _assert_same_state(state, general_state)
    assert general_state.exact_keys is None
    if not padded:  # the record's free slots and masks are counted, as the documented state size counts them
        extra = state.nbytes() - general_state.nbytes()
        assert extra == state.exact_keys.nbytes() >= 2 * q.shape[0] * k.shape[1] * headroom * k.shape[-1] * 8
        if headroom == EXACT_HEADROOM:
            bytes_of = lambda tail: window_state_bytes(2, 8, 1, 4, 2, 8, sparse_cache=3, chunk_size=5,  # noqa: E731
                                                       linear_tail=tail)
            assert extra == q.shape[0] * (bytes_of(False) - bytes_of(True))


@pytest.mark.parametrize("padded", [False, True])
def test_cache_slots_no_row_holds_yet_are_left_out(served, padded):
    # G = 12 > the candidates of the first boundaries: the record keeps only the slots some row and head holds.
    settings = {**SETTINGS, "sparse_cache": 12}
    q, k, v = small_qkv(length=LENGTH)
    mask = padded_mask(length=LENGTH) if padded else None
    fixed = []
    original = window_decode._exact_keys
    recording = lambda *args: fixed.append(original(*args)) or fixed[-1]  # noqa: E731 (record, state) or None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(window_decode, "_exact_keys", recording)
        out, _ = run_in_pieces(q, k, v, None, DECODE, mask, **settings)
    assert served.count and any(packed[0].fixed < 2 + 12 for packed in fixed if packed is not None)
    served.off = True
    general, _ = run_in_pieces(q, k, v, None, DECODE, mask, **settings)
    torch.testing.assert_close(out, general, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("then", ["a longer call", "a rollback", "a reorder"])
def test_the_general_paths_continue_an_exact_state(served, then):
    q, k, v = small_qkv(length=LENGTH)
    mask = padded_mask(length=LENGTH)
    out, state = run_in_pieces(q[:, :, :30], k[:, :, :30], v[:, :, :30], None, [9] + [1] * 21, mask[:, :30],
                               **SETTINGS)
    assert served.count and state.exact_keys is not None
    rows = torch.arange(q.shape[0])
    if then == "a longer call":
        rest = run_in_pieces(q[:, :, 30:], k[:, :, 30:], v[:, :, 30:], None, [LENGTH - 30], mask[:, 30:], state,
                             **SETTINGS)[0]
        out = torch.cat([out, rest], dim=2)
    elif then == "a rollback":  # (transformers' crop: back to the boundary, then the dropped tokens again)
        dropped = state.rollback_capacity()
        assert dropped > 0
        kept = 30 - dropped
        state = state.rollback(dropped)
        rest = run_in_pieces(q[:, :, kept:], k[:, :, kept:], v[:, :, kept:], None, [1] * (LENGTH - kept),
                             mask[:, kept:], state, **SETTINGS)[0]
        out = torch.cat([out[:, :, :kept], rest], dim=2)
    else:  # beam search's row selection
        rows = torch.tensor([2, 0, 0])
        state = state.map_batch(lambda t: t.index_select(0, rows))
        assert state.exact_keys is None
        q, k, v, mask, out = (t[rows] for t in (q, k, v, mask, out))
        rest = run_in_pieces(q[:, :, 30:], k[:, :, 30:], v[:, :, 30:], None, [1] * (LENGTH - 30), mask[:, 30:], state,
                             **SETTINGS)[0]
        out = torch.cat([out, rest], dim=2)
    one_pass = window_linear_attention(q, k, v, None, key_padding_mask=mask, **SETTINGS)
    torch.testing.assert_close(on_tokens(out, mask), on_tokens(one_pass, mask), rtol=1e-10, atol=1e-10)


def test_a_state_given_to_an_exact_step_is_not_changed(served):
    q, k, v = small_qkv(length=LENGTH)
    _, state = run_in_pieces(q[:, :, :12], k[:, :, :12], v[:, :, :12], None, [11, 1], **SETTINGS)
    assert state.exact_keys is not None
    snapshot = [t.clone() if isinstance(t, torch.Tensor) else t for t in _tensors(state)]
    first, after = run_in_pieces(q[:, :, 12:15], k[:, :, 12:15], v[:, :, 12:15], None, [1, 1, 1], state=state,
                                 **SETTINGS)
    again, _ = run_in_pieces(q[:, :, 12:15], k[:, :, 12:15], v[:, :, 12:15], None, [1, 1, 1], state=state,
                             **SETTINGS)
    assert served.count >= 6
    torch.testing.assert_close(again, first, rtol=1e-12, atol=1e-12)
    for old, new in zip(snapshot, _tensors(state)):
        assert torch.equal(old, new) if isinstance(old, torch.Tensor) else old == new
    assert after.seen == 15


def test_a_record_built_in_inference_mode_is_continued_outside_it(served):
    q, k, v = small_qkv(length=LENGTH)
    with torch.inference_mode():
        first, state = run_in_pieces(q[:, :, :14], k[:, :, :14], v[:, :, :14], None, [11, 1, 1, 1], **SETTINGS)
    assert state.exact_keys is not None and state.exact_keys.key.is_inference()
    with torch.no_grad():  # (an inference tensor cannot be written outside inference mode: the step packs a copy)
        rest, _ = run_in_pieces(q[:, :, 14:], k[:, :, 14:], v[:, :, 14:], None, [1] * (LENGTH - 14), state=state,
                                **SETTINGS)
    assert served.count > LENGTH - 14 - 7
    one_pass = window_linear_attention(q, k, v, None, **SETTINGS)
    torch.testing.assert_close(torch.cat([first, rest], dim=2), one_pass, rtol=1e-10, atol=1e-10)


def test_steps_that_need_gradients_take_the_general_step(served):
    q, k, v = small_qkv(batch=2, length=LENGTH)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = run_in_pieces(*leaves, None, DECODE, padded_mask(batch=2, length=LENGTH), **SETTINGS)
    assert served.count == 0  # (its in-place writes would change what autograd saved)
    out.sum().backward()
    assert all(t.grad is not None for t in leaves)


def test_only_the_steps_it_serves(served):
    q, k, v = small_qkv(batch=2, length=LENGTH, dtype=torch.float32)
    run_in_pieces(q, k, v, None, DECODE, padded_mask(batch=2, length=LENGTH), **SETTINGS)
    assert served.count  # float32: served
    served.count = 0
    for tail_or_settings in ({"sparse_cache": 0}, {"sinks": 0}):  # no cache; no sinks with a padding mask
        run_in_pieces(q, k, v, None, DECODE, padded_mask(batch=2, length=LENGTH), **{**SETTINGS, **tail_or_settings})
    run_in_pieces(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, DECODE, **SETTINGS)  # float32 sums
    with torch.autocast("cpu", dtype=torch.bfloat16):
        run_in_pieces(q, k, v, None, DECODE, **SETTINGS)
    assert served.count == 0
    out, _ = run_in_pieces(q, k, v, None, DECODE, **{**SETTINGS, "sinks": 0})  # no sinks, no padding: served
    assert served.count
    torch.testing.assert_close(out, window_linear_attention(q, k, v, None, **{**SETTINGS, "sinks": 0}), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_one_several_and_as_many_key_heads_as_query_heads(served, kv_heads):
    # (Each key head's query heads are the rows of one SDPA problem.)
    q, k, v = small_qkv(length=LENGTH)
    k, v = (t[:, :1].repeat(1, kv_heads, 1, 1) + 0.1 * torch.arange(kv_heads, dtype=t.dtype)[:, None, None]
            for t in (k, v))
    mask = padded_mask(length=LENGTH)
    out, _ = run_in_pieces(q, k, v, None, DECODE, mask, **SETTINGS)
    assert served.count == 28
    one_pass = window_linear_attention(q, k, v, None, key_padding_mask=mask, **SETTINGS)
    torch.testing.assert_close(on_tokens(out, mask), on_tokens(one_pass, mask), rtol=1e-10, atol=1e-10)
