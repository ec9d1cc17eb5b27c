"""WindowCacheLayer without a model: the attention function's calls (update, then attend) over prefill + decode
equal one parallel pass; crop (rollback) then re-decode equals decoding without the rejected tokens; constant
bytes; beam reorder / contrastive select / repeat; reset; errors."""

import pytest
import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING

from hf_performer import WindowCacheLayer, make_feature_map, window_linear_attention
from hf_performer.reference import reference_window_linear_attention
from hf_performer.window_state import buffer_capacity

SETTINGS = dict(window=3, sinks=2, chunk_size=4)


def _qkv(batch=2, length=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 4, length, 8, generator=generator, dtype=torch.float64)
    k = torch.randn(batch, 2, length, 8, generator=generator, dtype=torch.float64)
    v = torch.randn(batch, 2, length, 8, generator=generator, dtype=torch.float64)
    return q, k, v


def _feature_map():
    return make_feature_map("hedgehog", 8, num_heads=4, num_key_value_heads=2).double()


def _forward(layer, q, k, v, fm, mask=None, gamma=None):
    """What a model's attention module does with its cache layer: update (count), then the attention function."""
    key, value = layer.update(k, v)
    return layer.attend(q, key, value, fm, key_padding_mask=mask, softmax_weight=gamma, **SETTINGS)


def _decode(layer, q, k, v, fm, pieces, mask=None, gamma=None, start=0):
    outputs = []
    for size in pieces:
        piece = slice(start, start + size)
        outputs.append(_forward(layer, q[:, :, piece], k[:, :, piece], v[:, :, piece], fm,
                                None if mask is None else mask[:, piece], gamma))
        start += size
    return torch.cat(outputs, dim=2)


@pytest.mark.parametrize("pieces", [[24], [10] + [1] * 14, [5, 2, 1, 9, 1, 6]])
@pytest.mark.parametrize("learned", [False, True])
def test_prefill_and_decode_through_the_layer_equal_one_pass(pieces, learned):
    q, k, v = _qkv()
    fm, gamma = _feature_map(), torch.tensor([0.2, 0.4, 0.6, 0.8], dtype=torch.float64) if learned else None
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    layer = WindowCacheLayer()
    out = _decode(layer, q, k, v, fm, pieces, mask, gamma)
    expected = reference_window_linear_attention(q, k, v, fm, key_padding_mask=mask, softmax_weight=gamma, **SETTINGS)
    torch.testing.assert_close(out[0], expected[0], rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(out[1, :, 3:], expected[1, :, 3:], rtol=1e-8, atol=1e-8)
    assert layer.get_seq_length() == 24 and layer.get_mask_sizes(1) == (25, 0)


@pytest.mark.parametrize("rejected", [1, 2, 3])
def test_crop_then_redecode_equals_decoding_without_the_rejected_tokens(rejected):
    # Assisted generation: verify `rejected` draft tokens in one forward, crop them, decode the right ones.
    q, k, v = _qkv(seed=1)
    fm = _feature_map()
    layer = WindowCacheLayer(max_rollback=3)
    _decode(layer, q, k, v, fm, [12, 1])
    drafts = [30 * t for t in _qkv(length=rejected, seed=2)]
    _forward(layer, *drafts, fm)
    layer.crop(-rejected)
    assert layer.get_seq_length() == 13
    out = _decode(layer, q, k, v, fm, [1, 3, 1, 6], start=13)
    expected = reference_window_linear_attention(q, k, v, fm, **SETTINGS)[:, :, 13:]
    torch.testing.assert_close(out, expected, rtol=1e-8, atol=1e-8)


def test_crop_conventions_and_errors():
    q, k, v = _qkv(seed=3)
    fm = _feature_map()
    layer = WindowCacheLayer(max_rollback=2)
    assert layer.is_croppable and DYNAMIC_LAYER_TYPE_MAPPING["favor_window"] is WindowCacheLayer
    layer.crop(0)  # nothing seen: a no-op, as DynamicLayer
    _decode(layer, q, k, v, fm, [20])
    before = layer.state
    layer.crop(0)
    assert layer.state is before and layer.get_seq_length() == 20
    layer.crop(-2)
    assert layer.get_seq_length() == 18
    for bad, words in [(3, "takes a negative int"), (-20, "cannot remove the last 20 tokens, at most")]:
        with pytest.raises(ValueError) as error:
            layer.crop(bad)
        assert words in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ValueError, match="max_rollback must be None"):
        WindowCacheLayer(max_rollback=-1)


def test_state_bytes_do_not_grow_with_the_tokens_seen():
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, heads, 2000, 16, generator=generator) for heads in (4, 2, 2))
    fm = make_feature_map("favor+", 16, nb_features=32)
    layer, sizes = WindowCacheLayer(), []
    with torch.no_grad():
        for start in range(0, 2000, 100):
            piece = slice(start, start + 100)
            layer.update(k[:, :, piece], v[:, :, piece])
            layer.attend(q[:, :, piece], k[:, :, piece], v[:, :, piece], fm, window=16, sinks=4)
            sizes.append(layer.state_nbytes())
    assert sizes[0] == sizes[-1] > 0  # after 100 and after 2000 tokens


def test_beam_reorder_select_and_repeat_follow_the_batch_rows():
    q, k, v = _qkv(batch=3, seed=5)
    fm = _feature_map()
    expected = reference_window_linear_attention(q, k, v, fm, **SETTINGS)

    def continued(edit, rows):
        layer = WindowCacheLayer()
        _decode(layer, q, k, v, fm, [15])
        edit(layer)
        return _decode(layer, q[rows], k[rows], v[rows], fm, [1, 1, 7], start=15), expected[rows, :, 15:]

    beams = torch.tensor([2, 2, 0])
    for edit, rows in [(lambda layer: layer.reorder_cache(beams), beams),
                       (lambda layer: layer.batch_select_indices(torch.tensor([1])), torch.tensor([1])),
                       (lambda layer: layer.batch_repeat_interleave(2), torch.tensor([0, 0, 1, 1, 2, 2]))]:
        out, target = continued(edit, rows)
        torch.testing.assert_close(out, target, rtol=1e-8, atol=1e-8)


def test_reset_and_a_forgotten_attend_raise_or_restart():
    q, k, v = _qkv(seed=6)
    fm = _feature_map()
    layer = WindowCacheLayer()
    _decode(layer, q, k, v, fm, [5])
    layer.reset()
    assert layer.state is None and layer.get_seq_length() == 0
    torch.testing.assert_close(_decode(layer, q, k, v, fm, [7]),
                               window_linear_attention(q[:, :, :7], k[:, :, :7], v[:, :, :7], fm, **SETTINGS))
    layer.update(k[:, :, 7:8], v[:, :, 7:8])  # the attention function never ran for this token
    with pytest.raises(RuntimeError, match="WindowCacheLayer: the previous 1 token"):
        layer.update(k[:, :, 8:9], v[:, :, 8:9])


def test_past_recording_makes_a_whole_forward_croppable():
    # generate(assistant_model=...) calls cache.activate_past_recording(), then verifies any number of drafts in
    # one forward and crops the rejected ones: more than max_rollback must be croppable then.
    q, k, v = _qkv(seed=7)
    fm = _feature_map()
    layer = WindowCacheLayer(max_rollback=1)
    _decode(layer, q, k, v, fm, [12])
    layer.activate_past_recording()
    _forward(layer, *[30 * t for t in _qkv(length=7, seed=8)], fm)  # 7 drafts, all rejected
    layer.crop(-7)
    out = _decode(layer, q, k, v, fm, [1, 5, 1, 5], start=12)
    expected = reference_window_linear_attention(q, k, v, fm, **SETTINGS)[:, :, 12:]
    torch.testing.assert_close(out, expected, rtol=1e-8, atol=1e-8)
    layer.record_past = False  # generate() turns it off at the end: the buffer shrinks back at the next forward
    _forward(layer, q[:, :, :1], k[:, :, :1], v[:, :, :1], fm)
    assert layer.state.buffer_key.shape[2] == buffer_capacity(SETTINGS["window"], SETTINGS["chunk_size"], 1)
