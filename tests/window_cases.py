"""Small float64 inputs shared by the causal window-operator tests (sparse cache, bounded tail): GQA 4 / 2 heads of
dimension 8, rows with holes and two left paddings (different boundary offsets), and a runner that feeds a sequence
to the operator in pieces, continuing its state."""

import pytest
import torch

from hf_performer import make_feature_map, window_linear_attention

GAMMA = torch.tensor([0.1, 0.5, 0.9, 0.3], dtype=torch.float64)


def small_map(name):
    if name == "hedgehog":
        return make_feature_map(name, 8, num_heads=4, num_key_value_heads=2).double()
    return make_feature_map(name, 8, nb_features=16).double()


def small_qkv(batch=3, length=41, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 4, length, 8, generator=generator, dtype=dtype),
            torch.randn(batch, 2, length, 8, generator=generator, dtype=dtype),
            torch.randn(batch, 2, length, 8, generator=generator, dtype=dtype))


def padded_mask(batch=3, length=41):
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, 12:14] = False  # holes
    if batch > 1:
        mask[1, :7] = False  # left padding: boundaries 7 + 5k, shifted from the others'
    if batch > 2:
        mask[2, :13] = False
    return mask


def on_tokens(out, mask):
    """Outputs of the queries that see a key (left-padding queries see none)."""
    return out.transpose(1, 2)[mask.cumsum(-1) > 0]


def run_in_pieces(q, k, v, fm, pieces, mask=None, state=None, **kwargs):
    outputs, start = [], 0
    for size in pieces:
        piece = slice(start, start + size)
        out, state = window_linear_attention(q[:, :, piece], k[:, :, piece], v[:, :, piece], fm,
                                             key_padding_mask=None if mask is None else mask[:, piece],
                                             initial_state=state, return_state=True, **kwargs)
        outputs.append(out)
        start += size
    return torch.cat(outputs, dim=2), state


def refusal(tail_map="favor+", **kwargs) -> str:
    """The ``ValueError`` message of a window-2 call on small float32 inputs with ``kwargs`` (``tail_map``: the tail's
    map name, or ``None`` for no tail); fails the test when the call is accepted."""
    q, k, v = small_qkv(batch=1, dtype=torch.float32)
    feature_map = None if tail_map is None else make_feature_map(tail_map, 8)
    with pytest.raises(ValueError) as error:
        window_linear_attention(q, k, v, feature_map, window=2, **kwargs)
    return str(error.value)
