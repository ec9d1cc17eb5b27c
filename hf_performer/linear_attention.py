"""Linear attention kernels: bidirectional, causal (chunked prefix sums) and recurrent.

All tensors use one layout, the one of transformers' attention functions: queries ``[B, H, Lq, d]``,
keys ``[B, Hkv, Lk, d]`` and values ``[B, Hkv, Lk, dv]`` (``Hkv`` divides ``H``: grouped-query
attention). With features ``phi`` from a :class:`~.feature_map_base.FeatureMap`,

    out_i = sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j)

over the allowed keys ``j`` (all unpadded keys; in causal mode those with ``j <= i``). Inputs are
multiplied by ``sqrt(scaling)`` first, so that FAVOR+ estimates ``exp(scaling * q.k)`` exactly as
softmax attention with that ``scaling`` would use it.

Numerics (see ``pitfalls.md`` of the project):

* everything after the inputs runs in float32 (float64 for float64 inputs) with autocast disabled;
  the output is cast back to the dtype of ``value`` (on the parallel path, CUDA's, the matrix products of bf16 inputs
  take bf16 operands with float32 accumulation: :mod:`.linear_attention_parallel`);
* query features carry a per-row stabiliser, which cancels between numerator and denominator;
* key features share one stabiliser per (example, head): the maximum over unpadded keys in the
  bidirectional case, and in the causal case the running maximum over the keys seen so far, so that
  appending tokens never changes earlier outputs. Sums are rescaled when the running maximum grows,
  as in an online softmax;
* padded keys are removed from numerator and denominator by zeroing ``phi(k)`` after the map and ``v``.

The slow, obvious float64 references these kernels are tested against live in ``reference.py``.

Which computation runs is chosen by device (:func:`~.linear_attention_parallel.attention_path`): the chunked kernels of
:mod:`.linear_attention_autograd` on the CPU, the parallel ones of :mod:`.linear_attention_parallel` on CUDA.

This module imports only ``torch`` and its siblings ``favor_schema``, ``feature_maps``, ``linear_attention_autograd``,
``linear_attention_chunks`` and ``linear_attention_parallel``: it is copied next to saved models for
``trust_remote_code``.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from .favor_schema import DEFAULT_CHUNK_SIZE
from .feature_maps import FeatureMap, Features, compute_dtype_for
from .linear_attention_autograd import chunked_linear_attention
from .linear_attention_chunks import _finite_min, _repeat_kv, _safe_denominator
from .linear_attention_parallel import attention_path, parallel_linear_attention

# DEFAULT_CHUNK_SIZE: tokens per chunk of the causal scan (declared in favor_schema). The bidirectional kernel, which
# has no [C, C] tile, takes chunks of at least BIDIRECTIONAL_MIN_CHUNK tokens.


class LinearAttentionState(NamedTuple):
    """Recurrent state of causal linear attention after ``n`` tokens, per (example, head).

    With ``c`` the stabiliser (the running maximum of the key log-scales):

    Attributes:
        kv: ``[B, H, m, dv]``, ``sum_j exp(-c) phi(k_j) v_j^T``.
        k_sum: ``[B, H, m]``, ``sum_j exp(-c) phi(k_j)`` (the normaliser).
        stabilizer: ``[B, H]``, ``c`` (``-inf``-like, i.e. the float minimum, before any key).
    """

    kv: torch.Tensor
    k_sum: torch.Tensor
    stabilizer: torch.Tensor

    def reorder(self, index: torch.Tensor) -> "LinearAttentionState":
        """Select batch rows (beam search)."""
        return LinearAttentionState(*(t.index_select(0, index.to(t.device)) for t in self))


class LinearAttentionError(ValueError):
    """Raised for inputs the kernels do not accept (shapes, masks, options)."""


class FavorMaskError(LinearAttentionError):
    """An attention mask that linear attention cannot express (raised instead of ignoring it)."""


def same_segment_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[B, L, L]`` bool, ``True`` where positions ``i`` and ``j`` of a row belong to the same packed sequence
    (equal ids in ``segment_ids`` ``[B, L]``)."""
    return segment_ids[:, :, None] == segment_ids[:, None, :]


def segment_bounds(segment_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row of ``segment_ids`` ``[B, L]``, the ``(start, end)`` of each run of equal ids (a packed sequence)."""
    length = segment_ids.shape[1]
    changes = (segment_ids[:, 1:] != segment_ids[:, :-1]).nonzero().tolist()
    bounds = [[0] for _ in range(segment_ids.shape[0])]
    for row, position in changes:
        bounds[row].append(position + 1)
    return [list(zip(starts, starts[1:] + [length])) for starts in bounds]


def _check_inputs(query, key, value, feature_map, causal, key_padding_mask, initial_state):
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.dim() != 4:
            raise LinearAttentionError(
                f"{name} must have shape [batch, heads, length, head_dim]; got {tuple(tensor.shape)}"
            )
    batch, heads, q_len, head_dim = query.shape
    if key.shape[:3] != value.shape[:3] or key.shape[0] != batch:
        raise LinearAttentionError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must share batch, heads and length "
            f"with each other and the batch of query {tuple(query.shape)}"
        )
    if key.shape[-1] != head_dim:
        raise LinearAttentionError(f"query and key head_dim differ: {head_dim} vs {key.shape[-1]}")
    if heads % key.shape[1]:
        raise LinearAttentionError(
            f"query heads ({heads}) must be a multiple of key/value heads ({key.shape[1]})"
        )
    if feature_map is not None and head_dim != feature_map.head_dim:  # None: window attention without a tail
        raise LinearAttentionError(
            f"the feature map was built for head_dim={feature_map.head_dim}, inputs have {head_dim}"
        )
    if causal and q_len != key.shape[2]:
        raise LinearAttentionError(
            f"causal linear attention needs as many queries as keys (pass earlier tokens as "
            f"initial_state); got {q_len} queries and {key.shape[2]} keys"
        )
    if q_len == 0 or key.shape[2] == 0:
        raise LinearAttentionError("linear attention needs at least one query and one key")
    if not causal and initial_state is not None:
        raise LinearAttentionError("initial_state is only meaningful for causal attention")
    if key_padding_mask is not None:
        if key_padding_mask.dim() != 2 or tuple(key_padding_mask.shape) != (batch, key.shape[2]):
            raise LinearAttentionError(
                "linear attention accepts only a 2-D key padding mask of shape [batch, key_length] "
                f"= {[batch, key.shape[2]]} (True/1 = attend); got shape {tuple(key_padding_mask.shape)}. "
                "Causality is set with causal=True; arbitrary (4-D) attention masks cannot be "
                "expressed with linear attention."
            )


def _as_bool_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A bool key padding mask from a bool or 0/1 mask; anything else (additive masks) raises."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise LinearAttentionError(
            "a non-boolean key padding mask must hold only 0 (padding) and 1 (token); got values "
            f"{mask.unique()[:8].tolist()} (additive masks with -inf are not accepted)"
        )
    return mask != 0


def _repeat_features(features: Features, groups: int) -> Features:
    """Key features of ``Hkv`` heads repeated for the ``Hkv * groups`` query heads."""
    log_scale = None if features.log_scale is None else _repeat_kv(features.log_scale, groups)
    return Features(_repeat_kv(features.values, groups), log_scale)


def _masked_key_log_scale(log_scale: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Key log-scales with padded keys at ``-inf`` (they must not set the stabiliser)."""
    if mask is None:
        return log_scale
    return log_scale.masked_fill(~mask[:, None, :], float("-inf"))


def _with_ones_column(value: torch.Tensor) -> torch.Tensor:
    """``[..., dv] -> [..., dv + 1]``: one matmul then gives numerator and denominator together."""
    return torch.cat([value, value.new_ones(value.shape[:-1] + (1,))], dim=-1)


# --------------------------------------------------------------------------------------------
# Decoding: one token at a time (prefill and training run linear_attention_autograd's chunked kernels)
# --------------------------------------------------------------------------------------------


def recurrent_linear_attention_step(
    q_features: Features,
    k_features: Features,
    value: torch.Tensor,
    state: LinearAttentionState,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = 1e-12,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """One decoding step of causal linear attention, the recurrent form (what generation runs).

    ``S' = a S + phi(k) v^T``, ``z' = a z + phi(k)``, ``out = phi(q) S' / phi(q) z'`` with ``a =
    exp(c - c')`` the rescaling when the running stabiliser grows from ``c`` to ``c'``. Reads and
    writes the ``[m, dv]`` state once: no chunking, no concatenation.

    Args:
        q_features, k_features: features of one token, values ``[B, H, 1, m]`` (key log-scale ``[B, H, 1]``).
        value: ``[B, H, 1, dv]`` in the compute dtype.
        state: the state after the previous tokens.
        key_padding_mask: ``[B, 1]`` bool, ``False`` for a padding token (it leaves the state unchanged).

    Returns:
        ``out`` ``[B, H, 1, dv]`` and the new state.
    """
    phi_q, phi_k = q_features.values, k_features.values
    kv, k_sum, stabilizer = (t.to(value.dtype) for t in state)
    if k_features.log_scale is not None:
        log_scale = _masked_key_log_scale(k_features.log_scale, key_padding_mask)[..., 0]  # [B, H]
        new_stabilizer = torch.maximum(stabilizer, log_scale.detach()).clamp_min(_finite_min(value.dtype))
        phi_k = phi_k * torch.exp(log_scale - new_stabilizer)[..., None, None]
        carry = torch.exp(stabilizer - new_stabilizer)[..., None]  # [B, H, 1]
        kv, k_sum = kv * carry.unsqueeze(-1), k_sum * carry
    else:
        new_stabilizer = stabilizer
    if key_padding_mask is not None:
        keep = key_padding_mask[:, None, :, None]
        phi_k = phi_k * keep
        value = value.masked_fill(~keep, 0.0)
    kv = kv + phi_k.transpose(-1, -2) * value  # [B, H, m, 1] * [B, H, 1, dv]
    k_sum = k_sum + phi_k[..., 0, :]
    numerator = torch.matmul(phi_q, kv)
    denominator = (phi_q[..., 0, :] * k_sum).sum(-1)[..., None, None]
    return numerator / _safe_denominator(denominator, eps), LinearAttentionState(kv, k_sum, new_stabilizer)


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------


def _no_autocast(device_type: str):
    try:
        return torch.autocast(device_type=device_type, enabled=False)
    except RuntimeError:  # a device type without autocast support
        return contextlib.nullcontext()


def linear_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    feature_map: FeatureMap,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    eps: float = 1e-12,
    recompute_features: bool = False,
    segment_ids: torch.Tensor | None = None,
):
    """Linear attention ``phi(Q) phi(K)^T V`` normalised per query, in O(L) time and memory.

    Forward and backward run chunk by chunk (:mod:`.linear_attention_autograd`): the ``[B, H, L, m]``
    features are never held for the whole sequence; the backward recomputes them per chunk. Extra memory
    is ``O(L d)`` per head (the output and the gradients) plus ``O(chunk_size * m)``.

    Args:
        query: ``[B, H, Lq, d]``.
        key: ``[B, Hkv, Lk, d]`` with ``H % Hkv == 0`` (grouped-query attention).
        value: ``[B, Hkv, Lk, dv]``.
        feature_map: a :class:`~.feature_map_base.FeatureMap` built for ``d`` (see ``make_feature_map``).
            Called once per call: a random map in training mode may redraw its projection then.
        causal: token ``i`` attends to keys ``<= i`` (needs ``Lq == Lk``).
        key_padding_mask: ``[B, Lk]``, ``True``/1 for tokens and ``False``/0 for padding; padded keys
            leave numerator and denominator. Any other mask shape raises an error.
        scaling: the softmax temperature to reproduce, ``exp(scaling * q.k)``; default ``d ** -0.5``.
        initial_state: causal only; the state returned by an earlier call on the preceding tokens.
        return_state: causal only; also return the state after the last token.
        chunk_size: tokens per chunk of the chunked computation (causal: exact inside a chunk, a running
            state between chunks; bidirectional chunks take at least 128 tokens); any value gives the same
            result, it trades speed for temporary memory. The parallel path (CUDA, :func:`~.linear_attention_parallel.attention_path`)
            chooses its own chunks.
        eps: smallest magnitude of a denominator.
        recompute_features: ignored, kept for compatibility: the features are always recomputed in the
            backward now.
        segment_ids: causal only; ``[B, L]`` ids of packed sequences (padding-free batches, e.g. from
            ``DataCollatorWithFlattening``): a token attends only to earlier tokens with the same id, i.e. the
            state restarts wherever the id changes. Each run of equal ids is one sequence.

    Returns:
        ``[B, H, Lq, dv]`` in ``value.dtype``, and the :class:`LinearAttentionState` if
        ``return_state``.
    """
    del recompute_features  # always recomputed (issue 17)
    _check_inputs(query, key, value, feature_map, causal, key_padding_mask, initial_state)
    if return_state and not causal:
        raise LinearAttentionError("return_state is only meaningful for causal attention")
    if chunk_size < 1:
        raise LinearAttentionError(f"chunk_size must be >= 1, got {chunk_size}")
    mask = _as_bool_mask(key_padding_mask)
    if segment_ids is not None:
        return _packed_linear_attention(
            query, key, value, feature_map, segment_ids, causal=causal, key_padding_mask=mask, scaling=scaling,
            initial_state=initial_state, return_state=return_state, chunk_size=chunk_size, eps=eps,
        )
    head_dim = query.shape[-1]
    scale = (head_dim**-0.5 if scaling is None else float(scaling)) ** 0.5
    groups = query.shape[1] // key.shape[1]
    out_dtype = value.dtype
    dtype = compute_dtype_for(query)
    with _no_autocast(query.device.type):
        if causal and initial_state is not None and query.shape[2] == 1:  # a decoding step
            query, key, value = query.to(dtype) * scale, key.to(dtype) * scale, value.to(dtype)
            q_features, k_features = feature_map(query, key)
            k_features = _repeat_features(k_features, groups)
            out, state = recurrent_linear_attention_step(
                q_features, k_features, _repeat_kv(value, groups), initial_state, mask, eps=eps
            )
            return (out.to(out_dtype), state) if return_state else out.to(out_dtype)
        feature_map.maybe_redraw()
        if attention_path(query) == "parallel":  # CUDA: a fixed number of operations per call
            out, state = parallel_linear_attention(
                query, key, value, feature_map, causal=causal, key_padding_mask=mask, scale=scale,
                initial_state=initial_state, eps=eps,
            )
        else:
            out, state = chunked_linear_attention(
                query, key, value, feature_map, causal=causal, key_padding_mask=mask, scale=scale,
                initial_state=initial_state, chunk_size=chunk_size, eps=eps,
            )
    out = out.to(out_dtype)
    if not return_state:
        return out
    # (The stabiliser is the last of a running maximum over the call's tokens: a copy, not a view keeping them.)
    return out, LinearAttentionState(state[0], state[1], state[2].contiguous())


def _packed_linear_attention(query, key, value, feature_map, segment_ids, *, causal, key_padding_mask, scaling,
                             initial_state, return_state, chunk_size, eps):
    """:func:`linear_attention` of packed sequences: the causal kernel run on each run of equal ``segment_ids``
    (the feature map redrawn at most once for the whole call). Unpacked inputs never come here."""
    batch, length = query.shape[0], query.shape[2]
    if not causal or initial_state is not None or return_state:
        raise LinearAttentionError(
            "segment_ids (packed sequences) is supported for causal attention without initial_state / return_state; "
            f"got causal={causal}, initial_state={'set' if initial_state is not None else None}, "
            f"return_state={return_state}"
        )
    if segment_ids.dim() != 2 or tuple(segment_ids.shape) != (batch, length) or segment_ids.is_floating_point():
        raise LinearAttentionError(
            f"segment_ids must be an integer tensor of shape [batch, length] = {[batch, length]}; got "
            f"{segment_ids.dtype} {tuple(segment_ids.shape)}"
        )
    feature_map.maybe_redraw()
    was_training = feature_map.training
    feature_map.train(False)  # one redraw per call, not one per sequence
    try:
        rows = []
        for row, bounds in enumerate(segment_bounds(segment_ids)):
            pieces = [
                linear_attention(
                    query[row : row + 1, :, start:end], key[row : row + 1, :, start:end],
                    value[row : row + 1, :, start:end], feature_map, causal=True,
                    key_padding_mask=None if key_padding_mask is None else key_padding_mask[row : row + 1, start:end],
                    scaling=scaling, chunk_size=chunk_size, eps=eps,
                )
                for start, end in bounds
            ]
            rows.append(torch.cat(pieces, dim=2))
    finally:
        feature_map.train(was_training)
    return torch.cat(rows, dim=0)
