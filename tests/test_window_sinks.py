"""Per-row sink tokens: a row's sinks are its first ``sinks`` non-padding keys, so that a left-padded row (what
batched generate() builds) gets the answer it gets alone. Operator (parallel and through the decoding state),
reference, and converted tiny Llama / GPT-2 (logits and greedy generate)."""

import pytest
import torch

from hf_performer import window_linear_attention
from hf_performer.attention_weights import window_attention_weights
from hf_performer.reference import reference_window_linear_attention

from test_window_decode import _map
from test_window_decode import _qkv as decoding_qkv
from test_window_generation import MODES, build, tokens

GAMMA = torch.tensor([0.1, 0.5, 0.9, 0.3], dtype=torch.float64)
PAD = 5


def _qkv(batch=3, length=23, seed=0):
    return decoding_qkv(batch, length, seed)


def _left_padded_with_holes(batch=3, length=23):
    """Row 0 unpadded, row 1 left-padded by PAD, row 2 left-padded by 2 with holes among its first tokens
    (a hole between its sinks, one just after them) and later."""
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, :PAD] = False
    mask[2, :2] = False
    mask[2, 3] = False
    mask[2, 6] = False
    mask[2, 15:17] = False
    return mask


def _on_tokens(out, mask):
    """The outputs of queries that see at least one key (a left-padding query sees none: 0/0)."""
    return out[(mask.cumsum(-1) > 0)[:, None, :, None].expand_as(out)]


@pytest.mark.parametrize("name", ["favor+", "hedgehog"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("learned", [False, True])
def test_operator_matches_the_reference_with_left_padding_and_holes(name, causal, learned):
    q, k, v = _qkv()
    fm, mask = _map(name), _left_padded_with_holes()
    for window, sinks in [(3, 2), (4, 3), (1, 1), (0, 2), (6, 4), (30, 2)]:
        kwargs = dict(window=window, sinks=sinks, causal=causal, softmax_weight=GAMMA if learned else None,
                      key_padding_mask=mask)
        out = window_linear_attention(q, k, v, fm, chunk_size=5, **kwargs)
        expected = reference_window_linear_attention(q, k, v, fm, **kwargs)
        torch.testing.assert_close(_on_tokens(out, mask), _on_tokens(expected, mask), rtol=1e-8, atol=1e-8,
                                   msg=f"window={window} sinks={sinks}")
        weights = window_attention_weights(q, k, v, fm, **kwargs)  # output_attentions: the weights applied
        applied = weights @ v.repeat_interleave(2, dim=1)
        torch.testing.assert_close(_on_tokens(applied, mask), _on_tokens(expected, mask), rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("learned", [False, True])
@pytest.mark.parametrize("implementation", ["operator", "reference", "weights"])
def test_a_left_padded_row_equals_the_same_row_unpadded(causal, learned, implementation):
    q, k, v = _qkv(batch=1, length=18, seed=1)
    fm = _map("hedgehog" if learned else "favor+")
    padded = [torch.cat([torch.randn(1, t.shape[1], PAD, 8, dtype=t.dtype), t], dim=2) for t in (q, k, v)]
    mask = torch.ones(1, 18 + PAD, dtype=torch.bool)
    mask[:, :PAD] = False
    kwargs = dict(window=3, sinks=2, causal=causal, softmax_weight=GAMMA if learned else None)

    def run(q, k, v, **extra):
        if implementation == "weights":
            return window_attention_weights(q, k, v, fm, **kwargs, **extra) @ v.repeat_interleave(2, dim=1)
        function = window_linear_attention if implementation == "operator" else reference_window_linear_attention
        return function(q, k, v, fm, chunk_size=4, **kwargs, **extra)

    alone = run(q, k, v)
    batched = run(*padded, key_padding_mask=mask)[:, :, PAD:]
    torch.testing.assert_close(batched, alone, rtol=1e-8, atol=1e-8)


def test_rows_with_fewer_kept_keys_than_sinks():
    q, k, v = _qkv(batch=2, length=9, seed=2)
    fm = _map("favor+")
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, 7] = True  # one token, sinks 3
    mask[1, 2:] = True
    for causal in (True, False):
        kwargs = dict(window=2, sinks=3, causal=causal, key_padding_mask=mask)
        out = window_linear_attention(q, k, v, fm, chunk_size=4, **kwargs)
        expected = reference_window_linear_attention(q, k, v, fm, **kwargs)
        torch.testing.assert_close(_on_tokens(out, mask), _on_tokens(expected, mask), rtol=1e-8, atol=1e-8)


def test_the_reference_sinks_are_the_first_kept_keys():
    # Causal, window 1, no tail: query i sees exactly the row's sinks and itself. Row with keys 0, 1 padded and
    # sinks 2: query 5 attends exactly keys {2, 3, 5} (softmax over them), nothing else.
    q, k, v = _qkv(batch=1, length=6, seed=3)
    mask = torch.tensor([[False, False, True, True, True, True]])
    out = reference_window_linear_attention(q, k, v, None, window=1, sinks=2, key_padding_mask=mask)
    keys = torch.tensor([2, 3, 5])
    kk, vv = k.repeat_interleave(2, dim=1)[:, :, keys], v.repeat_interleave(2, dim=1)[:, :, keys]
    scores = (q[:, :, 5:6] @ kk.transpose(-1, -2)) * 8**-0.5
    torch.testing.assert_close(out[:, :, 5:6], torch.softmax(scores, -1) @ vv)


# ---------------------------------------------------------------------------------- decoding state


def _run(q, k, v, fm, pieces, mask, state=None, **kwargs):
    outputs, start = [], 0
    for size in pieces:
        piece = slice(start, start + size)
        out, state = window_linear_attention(q[:, :, piece], k[:, :, piece], v[:, :, piece], fm, initial_state=state,
                                             return_state=True, key_padding_mask=mask[:, piece], **kwargs)
        outputs.append(out)
        start += size
    return torch.cat(outputs, dim=2), state


def _late_sinks_mask(batch=3, length=23):
    """Row 1's first kept token arrives at position 10 (after a 9-token prefill: its sinks fill while decoding);
    row 2 has one kept token in the prefill and holes between the later ones."""
    mask = _left_padded_with_holes(batch, length)
    mask[1, :10] = False
    mask[2, :8] = False
    mask[2, 9:11] = False
    return mask


@pytest.mark.parametrize("learned", [False, True])
@pytest.mark.parametrize("pieces", [[9] + [1] * 14, [1] * 23, [4, 7, 1, 2, 9]])
def test_prefill_and_decode_with_left_padding_equal_one_pass(learned, pieces):
    q, k, v = _qkv()
    fm, mask = _map("hedgehog" if learned else "favor+"), _late_sinks_mask()
    kwargs = dict(window=3, sinks=3, softmax_weight=GAMMA if learned else None, chunk_size=4)
    out, state = _run(q, k, v, fm, pieces, mask, max_rollback=2, **kwargs)
    parallel = window_linear_attention(q, k, v, fm, key_padding_mask=mask, **kwargs)
    expected = reference_window_linear_attention(q, k, v, fm, key_padding_mask=mask, **kwargs)
    torch.testing.assert_close(_on_tokens(out, mask), _on_tokens(parallel, mask), rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(_on_tokens(out, mask), _on_tokens(expected, mask), rtol=1e-8, atol=1e-8)
    assert state.sink_key.shape[2] == 3 and state.sink_valid.all()
    assert state.sink_position.tolist() == [[0, 1, 2], [10, 11, 12], [8, 11, 12]]


@pytest.mark.parametrize("learned", [False, True])
def test_rollback_across_a_sink_fill(learned):
    # Row 1's sinks fill at positions 10, 11, 12 during the drafts; rolling back to 11 keeps only its first sink.
    # The redecoded tokens differ from the rejected drafts (and row 1's token 11 is padding on the second try).
    q, k, v = _qkv(seed=4)
    fm = _map("hedgehog" if learned else "favor+")
    mask = _late_sinks_mask()
    redecoded_mask = mask.clone()
    redecoded_mask[1, 11] = False
    kwargs = dict(window=3, sinks=3, softmax_weight=GAMMA if learned else None, chunk_size=4)
    _, state = _run(q, k, v, fm, [11], mask, **kwargs)
    junk = tuple(t[:, :, :4] * scale for t, scale in zip(_qkv(seed=5), (1.0, 3.0, 100.0)))
    _, drafted = _run(*junk, fm, [2, 1, 1], torch.ones(3, 4, dtype=torch.bool), state=state, max_rollback=4,
                      **kwargs)
    assert drafted.sink_valid[1].tolist() == [True, True, True]
    restored = drafted.rollback(4)
    assert restored.seen == 11 and restored.sink_valid[1].tolist() == [True, False, False]
    out, _ = _run(q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], fm, [1, 3, 1, 7], redecoded_mask[:, 11:],
                  state=restored, **kwargs)
    expected = reference_window_linear_attention(q, k, v, fm, key_padding_mask=redecoded_mask, **kwargs)
    torch.testing.assert_close(out, expected[:, :, 11:], rtol=1e-8, atol=1e-8)


# ---------------------------------------------------------------------------------- models


def _left_pad(input_ids, pad):
    padded = torch.cat([torch.zeros(input_ids.shape[0], pad, dtype=input_ids.dtype), input_ids], dim=1)
    mask = torch.cat([torch.zeros(input_ids.shape[0], pad, dtype=torch.long), torch.ones_like(input_ids)], dim=1)
    return padded, mask


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", list(MODES))
def test_model_left_padded_row_gives_its_unpadded_logits_and_greedy_tokens(name, mode):
    model = build(name, mode)
    input_ids = tokens(batch=1, length=10)
    padded, mask = _left_pad(input_ids, 3)
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        alone = model(input_ids).logits
        batched = model(padded, attention_mask=mask, position_ids=position_ids).logits[:, 3:]
        greedy = model.generate(input_ids, max_new_tokens=8, do_sample=False)[:, 10:]
        # Batched with a longer unpadded row: the padded row's tokens are its own.
        other = tokens(batch=1, length=13, seed=5)
        batch_ids = torch.cat([padded, other])
        batch_mask = torch.cat([mask, torch.ones_like(other)])
        batch_greedy = model.generate(batch_ids, attention_mask=batch_mask, max_new_tokens=8, do_sample=False)
    torch.testing.assert_close(batched, alone, rtol=1e-4, atol=1e-4)
    assert batch_greedy[0, 13:].tolist() == greedy[0].tolist()


# ---------------------------------------------------------------------------------- gradients, cache layer


@pytest.mark.parametrize("causal", [True, False])
def test_gradients_with_left_padding_match_the_reference(causal):
    # Gradients reach the gathered sink keys / values and gamma exactly as in the dense reference.
    q, k, v = _qkv(batch=2, length=11, seed=6)
    gamma = GAMMA.clone()
    fm = _map("hedgehog")
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, :3] = False
    mask[1, 4] = False
    kwargs = dict(window=2, sinks=2, causal=causal, key_padding_mask=mask)
    grads = []
    for function in (window_linear_attention, reference_window_linear_attention):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, gamma)]
        out = function(*inputs[:3], fm, softmax_weight=inputs[3], chunk_size=4, **kwargs)
        (_on_tokens(out, mask) * torch.linspace(-1, 1, _on_tokens(out, mask).numel(), dtype=out.dtype)).sum().backward()
        grads.append([t.grad for t in inputs])
    for fast, reference in zip(*grads):
        torch.testing.assert_close(fast, reference, rtol=1e-8, atol=1e-10)
    assert grads[0][1][1, :, 3].abs().sum() > 0 and grads[0][1][1, :, :3].abs().sum() == 0  # row 1's 1st sink


def test_cache_layer_crop_across_a_sink_fill_and_beam_reorder():
    from hf_performer import WindowCacheLayer

    q, k, v = _qkv(seed=7)
    fm = _map("hedgehog")
    mask = _late_sinks_mask()
    settings = dict(window=3, sinks=3, chunk_size=4)

    def forward(layer, q, k, v, mask):
        key, value = layer.update(k, v)
        return layer.attend(q, key, value, fm, key_padding_mask=mask, **settings)

    layer = WindowCacheLayer(max_rollback=3)
    forward(layer, q[:, :, :11], k[:, :, :11], v[:, :, :11], mask[:, :11])
    drafts = [t[:, :, :3] * scale for t, scale in zip(_qkv(seed=8), (1.0, 3.0, 100.0))]
    forward(layer, *drafts, torch.ones(3, 3, dtype=torch.bool))  # fills row 1's 2nd and 3rd sink slots
    layer.crop(-3)
    assert layer.state.sink_valid[1].tolist() == [True, False, False]
    order = torch.tensor([1, 2, 1])  # beams: rows with different sink positions
    layer.reorder_cache(order)
    outputs = [forward(layer, q[order, :, i:i + 1], k[order, :, i:i + 1], v[order, :, i:i + 1], mask[order, i:i + 1])
               for i in range(11, 23)]
    expected = reference_window_linear_attention(q[order], k[order], v[order], fm, key_padding_mask=mask[order],
                                                 **settings)
    torch.testing.assert_close(torch.cat(outputs, dim=2), expected[:, :, 11:], rtol=1e-8, atol=1e-8)
