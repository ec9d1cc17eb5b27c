"""The SnapKV peer (hf_performer.tasks.snapkv): a KV cache cut after the prompt to sinks + window + the keys the
prompt's last queries attend to most, answers read at their true positions, its bytes and its refusals."""

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.utils import logging

from hf_performer.tasks.snapkv import (
    OBSERVATION, SnapKVCausalLM, SnapKVError, select_kept_positions, snapkv_state_bytes, with_snapkv,
)
from conftest import save_tiny_llama

logging.set_verbosity_error()


@pytest.fixture(name="model")
def tiny_model(tiny_llama_config):
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(max_position_embeddings=512)).eval()


def test_a_cache_that_keeps_every_key_changes_nothing(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 150))
    with torch.no_grad():
        full = model(input_ids=ids, logits_to_keep=6).logits
        snap = SnapKVCausalLM(model, keys=150, window=64, sinks=4)(input_ids=ids, logits_to_keep=6).logits
    assert snap.shape == full.shape
    assert torch.allclose(snap, full, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"  # the eager observation pass is undone


def test_the_answer_sees_exactly_the_sinks_the_window_and_itself_when_no_key_is_chosen(model):
    """keys=0 keeps the same positions whatever the scores: the answer's logits equal a full forward whose answer
    rows are masked to sinks + the prompt's last window + the answer so far, at their true positions."""
    sinks, window, prompt, answer = 2, 40, 120, 5
    total = prompt + answer
    ids = torch.randint(0, model.config.vocab_size, (1, total))
    allowed = torch.ones(total, total).tril().bool()
    cut = torch.zeros(total, dtype=torch.bool)
    cut[sinks:prompt - window] = True
    allowed[prompt:, :] &= ~cut  # (the last prompt token's own row attends to the whole prompt, as in prefill)
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, logits_to_keep=answer + 1).logits
        snap = SnapKVCausalLM(model, keys=0, window=window, sinks=sinks)(input_ids=ids,
                                                                          logits_to_keep=answer + 1).logits
    assert torch.allclose(snap, reference, atol=1e-5)
    with torch.no_grad():
        unmasked = model(input_ids=ids, logits_to_keep=answer + 1).logits
    assert not torch.allclose(unmasked[:, 1:], reference[:, 1:], atol=1e-3)  # the cut is seen by the answer


def test_selection_keeps_sinks_window_and_the_best_scored_neighbourhood():
    positions = torch.arange(100.0)
    scores = torch.stack([torch.exp(-(positions - 50) ** 2 / 18), torch.exp(-(positions - 20) ** 2 / 18)])[None]
    scores[0, :, 95] = 100.0  # inside the window: kept anyway, never chosen
    kept = select_kept_positions(scores, keys=3, window=10, sinks=2)
    assert kept.shape == (1, 2, 15)
    assert kept[0, 0].tolist() == [0, 1, 49, 50, 51, *range(90, 100)]
    assert kept[0, 1].tolist() == [0, 1, 19, 20, 21, *range(90, 100)]
    short = select_kept_positions(torch.rand(1, 2, 12), keys=3, window=10, sinks=2)
    assert short[0, 0].tolist() == list(range(12))  # everything fits: everything is kept


def test_a_wider_pool_keeps_a_whole_span_over_its_single_sharpest_key():
    scores = torch.zeros(1, 1, 100)
    scores[0, 0, 30] = 1.0  # one sharp key
    scores[0, 0, 60:65] = 0.5  # a five-token span (a number), each token less attended than the sharp key
    narrow = select_kept_positions(scores, keys=5, window=10, sinks=0, pool=1)[0, 0].tolist()
    wide = select_kept_positions(scores, keys=5, window=10, sinks=0, pool=5)[0, 0].tolist()
    assert 30 in narrow and not set(range(60, 65)) <= set(narrow)
    assert set(range(60, 65)) <= set(wide) and 30 not in wide


def test_bytes_refusals_and_a_converted_model(model):
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    assert snapkv_state_bytes(config, keys=100, window=50, sinks=4) == per_token * 154
    snap = SnapKVCausalLM(model, keys=8, window=OBSERVATION, sinks=1)
    ids = torch.randint(0, config.vocab_size, (1, 100))
    with pytest.raises(SnapKVError, match="not a perplexity stream"):
        snap(input_ids=ids)
    with pytest.raises(SnapKVError, match="unpadded"):
        snap(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=3)
    with pytest.raises(SnapKVError, match="window >= its 32 observation"):
        SnapKVCausalLM(model, keys=8, window=8, sinks=1)
    with pytest.raises(SnapKVError, match="an odd pool >= 1; .* pool 4"):
        SnapKVCausalLM(model, keys=8, window=OBSERVATION, sinks=1, pool=4)
    from hf_performer.conversion import convert_to_performer

    converted = convert_to_performer(model, window=8, sinks=1)
    with pytest.raises(SnapKVError, match="is a converted model"):
        with_snapkv(converted, 8, 32, 1, "folder")


def test_evaluate_command_runs_a_snapkv_peer_and_refuses_what_it_cannot_read(tmp_path, gpt2_tokenizer):
    import json

    from hf_performer.cli import main as cli_main

    folder = save_tiny_llama(tmp_path / "llama", gpt2_tokenizer, max_positions=400)
    output = tmp_path / "snapkv.json"
    assert cli_main(["evaluate", str(folder), "--task", "passkey", "--context-lengths", "300", "--depths", "0.5",
                     "--trials", "2", "--snapkv", "16", "--snapkv-window", "64", "--snapkv-pool", "3",
                     "--batch-size", "2", "--no-progress", "--output", str(output)]) == 0
    record = json.loads(output.read_text())
    assert {name: record["kv_cache"][name] for name in ("keys", "window", "sinks", "pool")} == {
        "keys": 16, "window": 64, "sinks": 4, "pool": 3}
    assert len(record["cells"][0]["correct"]) == 2
    for extra, message in ((["--task", "wikitext", "--text-file", str(output), "--snapkv", "16"], "would be ignored"),
                           (["--task", "passkey", "--snapkv-window", "64"], "need --snapkv KEYS"),
                           (["--task", "passkey", "--snapkv-pool", "5"], "need --snapkv KEYS"),
                           (["--task", "passkey", "--snapkv", "16", "--quantized-kv", "4"], "two peers")):
        with pytest.raises(SystemExit, match=message):
            cli_main(["evaluate", str(folder), *extra])
