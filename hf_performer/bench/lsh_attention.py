"""Reformer-style LSH attention (Kitaev, Kaiser, Levskaya 2020), a comparison row of the speed benchmark only.

Shared-QK: queries and keys are the same vectors (the keys unit-normalised), so it cannot reuse a pretrained
model's separate ``W_Q`` / ``W_K`` and is not a model attention kind here. Per hash round: random rotations
``R`` ``[d, n_buckets / 2]`` (seeded) put each vector in bucket ``argmax([xR, -xR])``; tokens are sorted by
(bucket, position) and cut into chunks of ``bucket_size``; each chunk attends to itself and the previous chunk
(wrapping around), a token never attends to itself unless it has no other key (score ``-1e5``, as in the paper).
Rounds are combined with their log-sum-exp weights (a key found in several rounds counts several times; the
paper's duplicate correction is left out). Cost ``O(n_hashes L bucket_size d)``, never ``L x L``.
"""

from __future__ import annotations

import torch

SELF_SCORE = -1e5


def lsh_attention(shared_qk: torch.Tensor, value: torch.Tensor, *, bucket_size: int = 64, n_hashes: int = 1,
                  seed: int = 0) -> torch.Tensor:
    """Bidirectional shared-QK LSH attention.

    Args:
        shared_qk: ``[B, H, L, d]``, queries; the keys are these vectors unit-normalised.
        value: ``[B, H, L, dv]``.
        bucket_size: chunk length ``c``; ``L`` must be a multiple of it. ``c >= L``: one chunk, exact shared-QK
            softmax (with the self-score rule).
        n_hashes: hash rounds.
        seed: seed of the rotations.

    Returns:
        ``[B, H, L, dv]``.
    """
    batch, heads, length, head_dim = shared_qk.shape
    if bucket_size < 1 or n_hashes < 1:
        raise ValueError(f"bucket_size and n_hashes must be >= 1; got {bucket_size}, {n_hashes}")
    bucket_size = min(bucket_size, length)
    if length % bucket_size:
        raise ValueError(f"the sequence length ({length}) must be a multiple of bucket_size ({bucket_size})")
    n_chunks = length // bucket_size
    n_buckets = max(2, n_chunks + n_chunks % 2)
    keys = torch.nn.functional.normalize(shared_qk, dim=-1)
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(length, device=shared_qk.device)
    outputs, log_normalisers = [], []
    for _ in range(n_hashes):
        rotations = torch.randn(head_dim, n_buckets // 2, generator=generator).to(shared_qk)
        rotated = torch.matmul(shared_qk, rotations)
        buckets = torch.cat([rotated, -rotated], dim=-1).argmax(-1)  # [B, H, L]
        order = (buckets * length + positions).argsort(dim=-1)  # by bucket, then position
        gather = lambda t: torch.gather(t, 2, order[..., None].expand(-1, -1, -1, t.shape[-1]))  # noqa: E731
        q_chunks = gather(shared_qk).reshape(batch, heads, n_chunks, bucket_size, head_dim)
        k_chunks = gather(keys).reshape(batch, heads, n_chunks, bucket_size, head_dim)
        v_chunks = gather(value).reshape(batch, heads, n_chunks, bucket_size, -1)
        p_chunks = order.reshape(batch, heads, n_chunks, bucket_size)
        if n_chunks > 1:  # look one chunk back
            look_back = lambda t: torch.cat([t, t.roll(1, dims=2)], dim=3)  # noqa: E731
            k_chunks, v_chunks, key_positions = look_back(k_chunks), look_back(v_chunks), look_back(p_chunks)
        else:
            key_positions = p_chunks
        scores = torch.matmul(q_chunks, k_chunks.transpose(-1, -2)) * head_dim**-0.5
        scores = scores.masked_fill(p_chunks[..., :, None] == key_positions[..., None, :], SELF_SCORE)
        log_normaliser = scores.logsumexp(-1, keepdim=True)
        sorted_out = torch.matmul((scores - log_normaliser).exp(), v_chunks).reshape(batch, heads, length, -1)
        undo = order.argsort(dim=-1)
        outputs.append(torch.gather(sorted_out, 2, undo[..., None].expand_as(sorted_out)))
        log_normalisers.append(torch.gather(log_normaliser.reshape(batch, heads, length, 1), 2, undo[..., None]))
    if n_hashes == 1:
        return outputs[0]
    weights = torch.softmax(torch.stack(log_normalisers), dim=0)
    return (torch.stack(outputs) * weights).sum(0)
