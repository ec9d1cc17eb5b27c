"""The blocks of causal window attention without a linear tail, on SDPA's fused CPU kernel.

Without a tail, a query row's output in :mod:`.window_blocks` is ``E_i[:dv] / E_i[dv]``: plain softmax attention over
its sinks, its sparse cache and its band (``gamma`` and the stabilisers cancel). So each query block is one small
softmax attention problem, and PyTorch's flash kernel for the CPU
(``aten._scaled_dot_product_flash_attention_for_cpu``, which fuses the scores, the exponentials and the weighted sum
per tile instead of materialising them) computes all of a group's blocks in one call, the blocks as its batch: the
keys of block ``n`` are ``[sinks, cache of n, tile of n]`` (the ``g`` query heads of a key head stacked as the
block's ``g C`` query rows), what each row may see an additive mask. Its backward is the kernel's own backward,
recomputed group by group from the saved outputs and log-sum-exps, and the key gradients go back to the sinks (summed
over the blocks), the per-block cache and the overlapping tiles (folded), as :mod:`.window_blocks` does.

Same operands, outputs and reference as :func:`~.window_blocks.attend_blocks` (``attend_blocks_naive``); the
reuse of recorded outputs by a recomputing caller (:func:`~.window_block_operands.reused_outputs`) works the same way.

On the parallel path (CUDA, :func:`~.linear_attention_parallel.attention_path`), :func:`attend_sdpa_blocks` hands
every block to one ``scaled_dot_product_attention`` call (the blocks as its batch, the allowed keys a boolean mask:
the memory-efficient kernel on CUDA) and leaves the backward to autograd, in the inputs' bf16 / fp16 when they have it.

This module imports only ``torch`` and its sibling ``window_block_operands``.
"""

from __future__ import annotations

import torch

from .window_block_operands import (
    BlockOperands, BlockSpec, _accumulate, _fold_tiles, _from_blocks, _group, _per_block, block_layout,
    record_for_reuse, take_reused,
)

_KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def fused_exact_applies(operands: BlockOperands, spec: BlockSpec) -> bool:
    """Whether :func:`attend_exact_blocks` computes this call: no tail, CPU, a dtype the kernel takes, keys and
    values of one width (the kernel's condition)."""
    query = operands.query
    return (spec.feature_map is None and query.device.type == "cpu" and query.dtype in _KERNEL_DTYPES
            and operands.values.shape[-1] == query.shape[-1]
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def attend_exact_blocks(operands: BlockOperands, spec: BlockSpec) -> torch.Tensor:
    """The outputs ``[B, Hkv, n, g C, dv]`` of the query blocks of a layer without a tail
    (:func:`fused_exact_applies`), differentiable in the queries, keys, values, sinks and cache."""
    names = [name for name in ("query", "keys", "values", "sink_key", "sink_value", "cache_key", "cache_value")
             if getattr(operands, name) is not None]
    return _ExactBlocks.apply(spec, operands, names, *(getattr(operands, name) for name in names))


def _kinds(operands: BlockOperands, spec: BlockSpec) -> list[str]:
    """The key sets of each block, in the order they are concatenated."""
    return ((["sinks"] if operands.sink_key.shape[2] else []) + (["cache"] if operands.cache_key is not None else [])
            + (["band"] if spec.has_band else []))


def _block_problem(operands: BlockOperands, spec: BlockSpec):
    """A group's blocks as the kernel's batch: queries ``[N, 1, g C, d]``, keys and values ``[N, 1, K, d]``, which key
    each row may see ``[N, 1, g C, K]`` bool (``N = B Hkv n``, ``K`` = sinks + cache + tile), and each kind's key
    count."""
    kv_heads = operands.keys.shape[1]
    query = _per_block(operands.query, kv_heads, spec.groups, spec.size)  # [B, Hkv, n, gC, d]
    key_sets = []
    for kind in _kinds(operands, spec):
        if kind == "sinks":
            key_sets.append((operands.sink_key[:, :, None], operands.sink_value[:, :, None],
                             operands.sink_allowed[:, None]))  # [B, 1, n, gC, s]
        elif kind == "cache":
            key_sets.append((operands.cache_key, operands.cache_value, operands.cache_valid[:, :, :, None, :]))
        else:
            key_sets.append((operands.keys.unfold(2, spec.span, spec.size).transpose(-1, -2),  # [B, Hkv, n, span, d]
                             operands.values.unfold(2, spec.span, spec.size).transpose(-1, -2),
                             spec.band_mask(query.device) & operands.band_keep[:, None, :, None, :]))
    keys, values, allowed, counts = stack_key_sets(key_sets, query.shape[:4])
    return query.flatten(0, 2)[:, None], keys, values, allowed, counts


def stack_key_sets(key_sets, shape):
    """Every block's keys as one batch: ``key_sets`` of ``(keys [B, Hkv, n or 1, k, d], values [.., k, dv], allowed
    [B, Hkv or 1, n or 1, g C or 1, k] bool)`` for blocks of ``shape = (B, Hkv, n, g C)`` query rows. Returns keys
    ``[N, 1, K, d]``, values ``[N, 1, K, dv]``, allowed ``[N, 1, g C, K]`` (``N = B Hkv n``) and each set's ``k``."""
    batch, kv_heads, blocks, rows = shape
    expand = lambda t: t.expand(batch, kv_heads, blocks, *t.shape[3:])  # noqa: E731
    keys = torch.cat([expand(k) for k, _, _ in key_sets], dim=3).flatten(0, 2)[:, None]
    values = torch.cat([expand(v) for _, v, _ in key_sets], dim=3).flatten(0, 2)[:, None]
    allowed = torch.cat([a.expand(batch, kv_heads, blocks, rows, a.shape[-1]) for _, _, a in key_sets], dim=-1)
    return keys, values, allowed.flatten(0, 2)[:, None], [k.shape[-2] for k, _, _ in key_sets]


def softmax_over_blocks(query, keys, values, allowed, scaling: float, dtype: torch.dtype,
                        guard_empty: bool = True) -> torch.Tensor:
    """One ``scaled_dot_product_attention`` call over every block (:func:`stack_key_sets`' layout, operands in
    ``dtype``), differentiable by autograd: ``[N, 1, g C, dv]`` in ``query``'s dtype. With ``guard_empty`` a row that
    may see no key (padding) gets 0, as the reference, and finite gradients."""
    empty = None
    if guard_empty:
        empty = ~allowed.any(-1, keepdim=True)
        allowed = allowed | empty
    out = torch.nn.functional.scaled_dot_product_attention(query.to(dtype), keys.to(dtype), values.to(dtype),
                                                           attn_mask=allowed, scale=scaling)
    return (out if empty is None else out.masked_fill(empty, 0.0)).to(query.dtype)


def _additive(allowed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The CPU kernel's additive mask (0 where allowed, -inf elsewhere) in ``like``'s dtype."""
    zero = like.new_zeros(())
    return torch.where(allowed, zero, zero - float("inf"))


def attend_sdpa_blocks(operands: BlockOperands, spec: BlockSpec, dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`attend_exact_blocks`'s outputs ``[B, Hkv, n, g C, d]`` from one ``scaled_dot_product_attention`` call
    over every block (operands in ``dtype``, default theirs; :func:`softmax_over_blocks`): the parallel path, a fixed
    number of operations per call."""
    expected = block_layout(operands, spec)[2]
    if not _kinds(operands, spec):
        return operands.query.new_zeros(expected)
    query, key, value, allowed, _ = _block_problem(operands, spec)
    return softmax_over_blocks(query, key, value, allowed, spec.scaling, dtype or query.dtype).view(expected)


def _run_group(operands: BlockOperands, spec: BlockSpec):
    """One group's outputs ``[B, Hkv, n, g C, d]`` and log-sum-exps ``[B, Hkv, n, g C]``."""
    query, key, value, allowed, _ = _block_problem(operands, spec)
    out, log_sum_exp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, False, attn_mask=_additive(allowed, query), scale=spec.scaling)
    shape = operands.query.shape[:1] + (operands.keys.shape[1], -1, query.shape[2])
    return out.view(*shape, out.shape[-1]), log_sum_exp.view(shape)


class _ExactBlocks(torch.autograd.Function):
    """See :func:`attend_exact_blocks`. Inputs after the spec: the operands (for their masks and ``None`` parts), the
    names of the tensors given next, those tensors."""

    @staticmethod
    def forward(ctx, spec, operands, names, *tensors):
        operands = operands._replace(**dict(zip(names, tensors)))
        blocks, per_group, expected = block_layout(operands, spec)
        reused = take_reused(expected)
        if reused is not None:
            out, log_sum_exp = reused
        elif not _kinds(operands, spec):  # nothing to attend to: zero rows, as the reference's empty sums
            out = operands.query.new_zeros(expected)
            log_sum_exp = out.new_zeros(expected[:-1], dtype=torch.float32)
        else:
            pieces = [_run_group(_group(operands, spec, start, min(start + per_group, blocks)), spec)
                      for start in range(0, blocks, per_group)]
            out = torch.cat([piece[0] for piece in pieces], dim=2)
            log_sum_exp = torch.cat([piece[1] for piece in pieces], dim=2)
            record_for_reuse(out, log_sum_exp)
        ctx.spec, ctx.names, ctx.per_group = spec, names, per_group
        ctx.operands = operands._replace(**{name: None for name in names})
        ctx.save_for_backward(out, log_sum_exp, *tensors)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        spec, names = ctx.spec, ctx.names
        out, log_sum_exp, *tensors = ctx.saved_tensors
        operands = ctx.operands._replace(**dict(zip(names, tensors)))
        wanted = dict(zip(names, ctx.needs_input_grad[3:]))
        # Disjoint per group (concatenated): the queries and the per-block cache; overlapping tiles and the shared
        # sinks: added up.
        added = {name: torch.zeros_like(getattr(operands, name))
                 for name in ("keys", "values", "sink_key", "sink_value") if wanted.get(name)}
        pieces = {name: [] for name in ("query", "cache_key", "cache_value") if wanted.get(name)}
        blocks = operands.query.shape[2] // spec.size
        if not _kinds(operands, spec):
            return (None, None, None, *(torch.zeros_like(tensor) if wanted[name] else None
                                        for name, tensor in zip(names, tensors)))
        for start in range(0, blocks, ctx.per_group):
            end = min(start + ctx.per_group, blocks)
            group_grads = _backward_group(_group(operands, spec, start, end), spec, out[:, :, start:end],
                                          log_sum_exp[:, :, start:end], grad_out[:, :, start:end])
            _accumulate(added, group_grads, spec, start, end)
            for name, parts in pieces.items():
                parts.append(group_grads[name])
        grads = {**added, **{name: parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
                             for name, parts in pieces.items()}}
        return (None, None, None, *(grads.get(name) for name in names))


def _backward_group(operands: BlockOperands, spec: BlockSpec, out, log_sum_exp, grad_out) -> dict:
    """The gradients of one group's operands (tiles folded, sinks summed over the blocks)."""
    query, key, value, allowed, counts = _block_problem(operands, spec)
    flat = query.shape[:2]
    d_query, d_key, d_value = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.reshape(*flat, *grad_out.shape[-2:]).contiguous(), query, key, value,
        out.reshape(*flat, *out.shape[-2:]), log_sum_exp.reshape(*flat, -1), 0.0, False,
        attn_mask=_additive(allowed, query), scale=spec.scaling)
    batch, kv_heads = operands.keys.shape[:2]
    blocks = operands.query.shape[2] // spec.size
    grads = {"query": _from_blocks(d_query.view(batch, kv_heads, blocks, *d_query.shape[-2:]), spec.groups,
                                   spec.size)}
    d_key = d_key.view(batch, kv_heads, blocks, -1, d_key.shape[-1]).split(counts, dim=3)
    d_value = d_value.view(batch, kv_heads, blocks, -1, d_value.shape[-1]).split(counts, dim=3)
    for kind, key_part, value_part in zip(_kinds(operands, spec), d_key, d_value):
        if kind == "sinks":
            grads["sink_key"], grads["sink_value"] = key_part.sum(2), value_part.sum(2)
        elif kind == "cache":
            grads["cache_key"], grads["cache_value"] = key_part, value_part
        else:
            length = operands.keys.shape[2]
            grads["keys"] = _fold_tiles(key_part, spec, length)
            grads["values"] = _fold_tiles(value_part, spec, length)
    return grads
