"""The speed benchmark's comparison rows: Reformer-style shared-QK LSH attention (against a dense float64
computation of what it approximates) and the clustered rows (bidirectional only, recorded settings)."""

import pytest
import torch

from hf_performer.bench.attention import make_attention_call, run_speed_benchmark
from hf_performer.bench.lsh_attention import SELF_SCORE, lsh_attention


def _dense_shared_qk(qk, value):
    """Softmax over unit-normalised keys with a token's own score set to SELF_SCORE, dense in float64."""
    qk, value = qk.double(), value.double()
    keys = torch.nn.functional.normalize(qk, dim=-1)
    scores = qk @ keys.transpose(-1, -2) * qk.shape[-1] ** -0.5
    scores = scores.masked_fill(torch.eye(qk.shape[2], dtype=torch.bool), SELF_SCORE)
    return torch.softmax(scores, -1) @ value


def test_one_chunk_is_exact_shared_qk_softmax():
    generator = torch.Generator().manual_seed(0)
    qk, value = (torch.randn(2, 3, 32, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(lsh_attention(qk, value, bucket_size=32), _dense_shared_qk(qk, value))
    torch.testing.assert_close(lsh_attention(qk, value, bucket_size=64), _dense_shared_qk(qk, value))


def test_buckets_attend_within_their_chunk_and_the_previous_one():
    # Eight tight groups of 8 identical directions: with chunks of 8 each token finds its group, so the output is
    # (nearly) the mean of the other group members' values, as dense attention restricted to the group.
    generator = torch.Generator().manual_seed(1)
    directions = torch.nn.functional.normalize(torch.randn(8, 16, generator=generator, dtype=torch.float64), dim=-1)
    qk = 200 * directions.repeat_interleave(8, 0)[None, None]
    value = torch.randn(1, 1, 64, 4, generator=generator, dtype=torch.float64)
    out = lsh_attention(qk, value, bucket_size=8, n_hashes=2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _dense_shared_qk(qk, value), rtol=1e-3, atol=1e-3)


def test_lsh_refuses_a_length_not_a_multiple_of_the_bucket():
    with pytest.raises(ValueError, match="multiple of bucket_size"):
        lsh_attention(torch.randn(1, 1, 30, 4), torch.randn(1, 1, 30, 4), bucket_size=8)


@pytest.mark.parametrize("implementation", ["clustered", "improved-clustered", "lsh"])
def test_comparison_rows_are_bidirectional_only(implementation):
    with pytest.raises(ValueError, match="bidirectional only"):
        make_attention_call(implementation, "causal", 8, 16, 16, torch.device("cpu"))


def test_speed_benchmark_records_the_clustered_rows_and_their_settings():
    result = run_speed_benchmark(lengths=(64,), heads=2, head_dim=8, nb_features=16, repeats=1, memory=False,
                                 implementations=("clustered", "improved-clustered", "lsh", "sdpa"),
                                 clusters=4, topk=8, bucket_size=16, progress=False)
    rows = {(r["implementation"], r["mode"]) for r in result["records"]}
    assert rows == {("clustered", "bidirectional"), ("improved-clustered", "bidirectional"),
                    ("lsh", "bidirectional"), ("sdpa", "bidirectional"), ("sdpa", "causal")}
    assert result["settings"]["clusters"] == 4 and result["settings"]["topk"] == 8
    assert all(r["flops"] > 0 for r in result["records"])
