"""``hf-performer linearize``: the window-hybrid transfer loss, the stages (convert -> attention transfer -> LoRA ->
evaluation), resume, the baseline and the ablation, bad input.

Tiny random Llama (GQA) and GPT-2 models from conftest, saved to tmp_path with a tiny word-level tokenizer, and a
few hundred characters of text.
"""

import torch

from hf_performer.conversion.attention_transfer import sdpa_teacher_output, window_layer_transfer_losses
from hf_performer.feature_maps import make_feature_map
from hf_performer.reference import softmax_attention


def _qkv(batch=2, heads=4, kv_heads=2, length=24, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, length, dim, generator=generator)
    key = torch.randn(batch, kv_heads, length, dim, generator=generator)
    value = torch.randn(batch, kv_heads, length, dim, generator=generator)
    return query, key, value


def _hedgehog(dim=8, heads=4, kv_heads=2):
    return make_feature_map("hedgehog", dim, num_heads=heads, num_key_value_heads=kv_heads, init="identity",
                            tie_qk=False)


def test_sdpa_teacher_matches_float64_softmax_with_padding_and_gqa():
    query, key, value = _qkv()
    padding = torch.ones(2, 24, dtype=torch.bool)
    padding[1, 20:] = False
    teacher = sdpa_teacher_output(query, key, value, 8**-0.5, True, padding)
    expected = softmax_attention(query.double(), key.double(), value.double(), causal=True,
                                 key_padding_mask=padding)
    torch.testing.assert_close(teacher.double(), expected, atol=1e-5, rtol=1e-5)


def test_window_transfer_loss_is_zero_when_the_window_covers_the_sequence():
    query, key, value = _qkv()
    gamma = torch.full((4,), 0.1)
    for weight in (None, gamma):
        teacher, _, squared, rows = window_layer_transfer_losses(
            query, key, value, _hedgehog(), window=24, sinks=2, softmax_weight=weight, scaling=8**-0.5)
        assert rows == 2 * 4 * 24
        assert float(squared.detach()) / rows < 1e-10
    # a short window: the tail differs from softmax
    _, _, squared, rows = window_layer_transfer_losses(query, key, value, _hedgehog(), window=4, sinks=1,
                                                       softmax_weight=gamma, scaling=8**-0.5)
    assert float(squared.detach()) / rows > 1e-4


def test_window_transfer_loss_decreases_when_the_maps_and_gamma_train():
    query, key, value = _qkv(length=32)
    feature_map = _hedgehog()
    logit = torch.nn.Parameter(torch.full((4,), -2.1972))
    optimizer = torch.optim.AdamW([*feature_map.parameters(), logit], lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(15):
        _, _, squared, rows = window_layer_transfer_losses(query, key, value, feature_map, window=4, sinks=1,
                                                           softmax_weight=torch.sigmoid(logit), scaling=8**-0.5)
        loss = 1000 * squared / rows
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < 0.9 * losses[0], losses
    assert logit.grad is not None
