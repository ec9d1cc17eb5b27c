"""The sparse cache's boundary selection of a layer without a linear tail, as one Triton kernel.

:func:`~.window_boundaries.boundary_states` walks a call's boundaries in a Python loop, a few dozen tensor operations
each (:func:`~.window_sparse_cache.select_hard_keys`); on a GPU that loop costs far more in launches than in work. Without a
tail the selection only needs values: the tail sums hold ``S = sum v`` and ``z`` (the count) of the folded tokens
(the constant feature 1), each candidate's recall error is its distance to the mean of the folded tokens and the
candidates, ``err_j = || (S + sum_c v_c) / (z + n) - v_j ||^2``, the ``G`` largest errors stay (ties: the older, i.e.
the earlier candidate) and the others fold. :func:`select_without_tail` runs every boundary of a call inside one
kernel, one program per (example, key head), the ``G + C`` candidates :data:`TILE` at a time (registers do not grow
with ``G``): their values are gathered from the pool, the errors ranked by pairwise comparison (``rank_j = #{k: err_k >
err_j} + #{k < j: err_k = err_j}``, the order of a stable descending sort), the kept ones compacted in candidate order
and the folded ones added to the sums.

Same inputs and outputs as the loop it replaces (tested against it, under ``TRITON_INTERPRET=1`` on the CPU);
:func:`kernel_applies` says when it runs (CUDA tensors with Triton installed, or the interpreter). Triton is imported
under ``try``: a folder loaded with ``trust_remote_code`` where it is missing falls back to the loop.

This module imports only ``torch`` and, when installed, ``triton``.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the loop of window_causal serves
    triton = tl = None

TILE = 64
"""Candidates handled together: a tile's values are ``[TILE, dv]`` registers, whatever ``G``."""


def kernel_applies(pool_values: torch.Tensor) -> bool:
    """Whether :func:`select_without_tail` can run on these tensors: Triton is installed and the tensors are on CUDA,
    or the interpreter is on (``TRITON_INTERPRET=1``, CPU tensors: the tests)."""
    if triton is None:
        return False
    if pool_values.is_cuda:
        return True
    return os.environ.get("TRITON_INTERPRET", "0") == "1" and pool_values.device.type == "cpu"


if triton is not None:

    @triton.jit
    def _candidates(index_ptr, valid_ptr, keep_ptr, program, row, n, blocks, slots, j, G: tl.constexpr,
                    C: tl.constexpr):
        """Candidates ``j`` of block ``n``'s boundary: the cache of block ``n - 1`` (``j < G``), then the tile's
        tokens. Returns their pool index, whether they are valid tokens, and whether ``j`` is a candidate at all."""
        in_cache = j < G
        in_tile = (j >= G) & (j < G + C)
        previous = program * blocks * G + (n - 1) * G
        cached = tl.load(index_ptr + previous + j, mask=in_cache, other=0)
        cached_valid = tl.load(valid_ptr + previous + j, mask=in_cache, other=0)
        tile_keep = tl.load(keep_ptr + row * blocks * C + (n - 1) * C + (j - G), mask=in_tile, other=0)
        candidate = tl.where(in_cache, cached, tl.where(in_tile, slots + (n - 1) * C + (j - G), 0))
        valid = tl.where(in_cache, cached_valid, tl.where(in_tile, tile_keep, 0)) != 0
        return candidate, valid, in_cache | in_tile

    @triton.jit
    def _rows(pool, candidate, rows, d, d_ok, pool_stride):
        """The pool's values ``[TILE, BD]`` of ``candidate`` where ``rows``, zeros elsewhere."""
        return tl.load(pool + candidate.to(tl.int64)[:, None] * pool_stride + d[None, :],
                       mask=rows[:, None] & d_ok[None, :], other=0.0)

    @triton.jit
    def _select_kernel(pool_ptr, index0_ptr, valid0_ptr, sums0_ptr, count0_ptr, keep_ptr, active_ptr, error_ptr,
                       index_ptr, valid_ptr, sums_ptr, count_ptr, kv_heads, pool_size, pool_stride, blocks, slots, eps,
                       G: tl.constexpr, C: tl.constexpr, DV: tl.constexpr, TILE: tl.constexpr, BD: tl.constexpr):
        program = tl.program_id(0)  # example * kv_heads + key head
        row = program // kv_heads
        total = G + C  # candidates per boundary
        width = ((total + TILE - 1) // TILE) * TILE
        t = tl.arange(0, TILE)
        d = tl.arange(0, BD)
        d_ok = d < DV
        pool = pool_ptr + program.to(tl.int64) * pool_size * pool_stride
        errors = error_ptr + program * width
        # Block 0: what the call entered with.
        start = 0
        while start < G:
            slot = start + t
            inside = slot < G
            tl.store(index_ptr + program * blocks * G + slot,
                     tl.load(index0_ptr + program * G + slot, mask=inside, other=0), mask=inside)
            tl.store(valid_ptr + program * blocks * G + slot,
                     tl.load(valid0_ptr + program * G + slot, mask=inside, other=0), mask=inside)
            start += TILE
        sums = tl.load(sums0_ptr + program * DV + d, mask=d_ok, other=0.0)
        count = tl.load(count0_ptr + program)
        tl.store(sums_ptr + program * blocks * DV + d, sums, mask=d_ok)
        tl.store(count_ptr + program * blocks, count)
        n = 1
        while n < blocks:  # (while loops: Triton's interpreter cannot take a run-time bound in range())
            tl.debug_barrier()
            # The mean of the folded tokens and every candidate.
            every = sums
            every_count = count
            start = 0
            while start < total:
                candidate, valid, _ = _candidates(index_ptr, valid_ptr, keep_ptr, program, row, n, blocks, slots,
                                                  start + t, G, C)
                values = _rows(pool, candidate, valid, d, d_ok, pool_stride)
                every += tl.sum(values, axis=0)
                every_count += tl.sum(valid.to(values.dtype), axis=0)
                start += TILE
            mean = every / tl.where(tl.abs(every_count) < eps, eps, every_count)
            # Each candidate's recall error (-inf for empty slots, padding, sinks; and past the candidates).
            start = 0
            while start < width:
                candidate, valid, real = _candidates(index_ptr, valid_ptr, keep_ptr, program, row, n, blocks, slots,
                                                     start + t, G, C)
                values = _rows(pool, candidate, real, d, d_ok, pool_stride)
                difference = tl.where(d_ok[None, :], mean[None, :] - values, 0.0)
                error = tl.where(valid, tl.sum(difference * difference, axis=1), float("-inf"))
                tl.store(errors + start + t, error)
                start += TILE
            tl.debug_barrier()
            # Rank (a stable descending sort's order), keep the G first, compact them in candidate order, fold the rest.
            active = tl.load(active_ptr + row * blocks + (n - 1)) != 0
            here = program * blocks * G + n * G
            kept_before = 0
            fold_sums = sums * 0.0
            fold_count = count * 0.0
            start = 0
            while start < total:
                j = start + t
                candidate, valid, real = _candidates(index_ptr, valid_ptr, keep_ptr, program, row, n, blocks, slots,
                                                     j, G, C)
                error = tl.load(errors + j)
                rank = tl.zeros([TILE], dtype=tl.int32)
                other_start = 0
                while other_start < width:
                    k = other_start + t
                    other = tl.load(errors + k)
                    before = (other[None, :] > error[:, None]) | ((other[None, :] == error[:, None])
                                                                  & (k[None, :] < j[:, None]))
                    rank += tl.sum(before.to(tl.int32), axis=1)
                    other_start += TILE
                kept = (rank < G) & real
                slot = kept_before + tl.cumsum(kept.to(tl.int32), axis=0) - 1
                tl.store(index_ptr + here + slot, candidate, mask=kept & active)
                tl.store(valid_ptr + here + slot, valid.to(tl.int8), mask=kept & active)
                kept_before += tl.sum(kept.to(tl.int32), axis=0)
                folded = valid & ~kept
                values = _rows(pool, candidate, folded, d, d_ok, pool_stride)
                fold_sums += tl.sum(values, axis=0)
                fold_count += tl.sum(folded.to(values.dtype), axis=0)
                start += TILE
            # An inactive row (its tiles were folded by an earlier call) keeps what it had.
            start = 0
            while start < G:
                slot = start + t
                inside = (slot < G) & ~active
                previous = program * blocks * G + (n - 1) * G
                tl.store(index_ptr + here + slot, tl.load(index_ptr + previous + slot, mask=inside, other=0),
                         mask=inside)
                tl.store(valid_ptr + here + slot, tl.load(valid_ptr + previous + slot, mask=inside, other=0),
                         mask=inside)
                start += TILE
            sums = tl.where(active, sums + fold_sums, sums)
            count = tl.where(active, count + fold_count, count)
            tl.store(sums_ptr + program * blocks * DV + n * DV + d, sums, mask=d_ok)
            tl.store(count_ptr + program * blocks + n, count)
            n += 1


def _power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def select_without_tail(pool_values, index, valid, tail_sums, candidate_keep, active, *, slots: int, capacity: int,
                        size: int, eps: float):
    """Every boundary's sparse cache and tail sums of a call without a tail, as the loop of
    :func:`~.window_boundaries.boundary_states` computes them (its names).

    Args:
        pool_values: ``[B, Hkv, P, dv + 1]`` the values (and ones) of the entering cache's slots, then the tiles'.
        index, valid: ``[B, Hkv, G]`` the entering cache (pool indices, valid flags).
        tail_sums: ``[B, Hkv, 1, dv + 1]`` the entering tail sums (the values' sum and the count).
        candidate_keep: ``[B, blocks, C]`` which tile tokens are candidates; ``active`` ``[B, blocks]``: whether a
            row selects at each block's boundary.
        slots: the entering cache's slot count (tile ``t``'s tokens are pool slots ``slots + t C + i``).

    Returns:
        ``(index [B, Hkv, blocks, G], valid [B, Hkv, blocks, G], tail sums [B, Hkv, blocks, 1, dv + 1])``: block
        ``0`` holds the entering cache and sums, block ``n`` those after the selection at its boundary.
    """
    batch, kv_heads, pool_size, columns = pool_values.shape
    blocks = candidate_keep.shape[1]
    value_dim = columns - 1
    dtype = pool_values.dtype
    pool = pool_values.contiguous()
    programs = batch * kv_heads
    device = pool.device
    width = -(-(capacity + size) // TILE) * TILE
    out_index = torch.empty(batch, kv_heads, blocks, capacity, dtype=torch.int64, device=device)
    out_valid = torch.empty(batch, kv_heads, blocks, capacity, dtype=torch.int8, device=device)
    out_sums = torch.empty(batch, kv_heads, blocks, value_dim, dtype=dtype, device=device)
    out_count = torch.empty(batch, kv_heads, blocks, dtype=dtype, device=device)
    errors = torch.empty(programs, width, dtype=dtype, device=device)
    _select_kernel[(programs,)](
        pool, index.to(torch.int64).contiguous(), valid.to(torch.int8).contiguous(),
        tail_sums[..., 0, :value_dim].contiguous(), tail_sums[..., 0, value_dim].contiguous(),
        candidate_keep.to(torch.int8).contiguous(), active.to(torch.int8).contiguous(), errors,
        out_index, out_valid, out_sums, out_count, kv_heads, pool_size, columns, blocks, slots, eps,
        G=capacity, C=size, DV=value_dim, TILE=TILE, BD=_power_of_two(value_dim), num_warps=4)
    sums = torch.cat([out_sums, out_count[..., None]], dim=-1)[..., None, :]
    return out_index, out_valid.bool(), sums
