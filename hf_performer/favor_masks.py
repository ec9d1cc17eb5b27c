"""The masks of favor attention: the mask builder registered for "favor" and the reading of the masks the attention
function receives.

:func:`favor_attention_mask` (registered in ``AttentionMaskInterface`` by :mod:`.favor_attention`) gives the 2-D key
padding mask linear attention works with, segment ids for packed sequences, or sdpa's 4-D mask for any other pattern
(the softmax layers apply it); :func:`key_padding_mask_of` turns what a layer receives into a 2-D key padding mask, or
raises :class:`~.linear_attention.FavorMaskError` for what linear attention cannot express.

This module imports only ``torch``, ``transformers`` and relative siblings: it is copied next to saved models for
``trust_remote_code``.
"""

from __future__ import annotations

import torch
from transformers.masking_utils import (
    bidirectional_mask_function,
    causal_mask_function,
    flash_attention_mask,
    sdpa_mask,
)

from .linear_attention import FavorMaskError
from .packed_sequences import packed_segment_ids




def favor_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask builder registered in ``AttentionMaskInterface`` for "favor": the 2-D key padding mask
    ``[batch_size, kv_length]`` (bool, ``True`` = token) of flash attention, or ``None`` without padding.
    Packed sequences (causal attention within consecutive blocks: ``position_ids`` restarting inside a row) give
    a 2-D int64 mask of segment ids instead (``0`` = padding, ``1, 2, ...`` = sequences; see
    :mod:`.packed_sequences`).

    Any other pattern (a sliding window, chunks during decoding, custom ``or``/``and`` mask functions) gives the 4-D
    mask sdpa would get: the layers with a bounded span (sliding window, chunks) keep softmax attention
    (:func:`~.source_architectures.check_bounded_layers_kept`) and apply it exactly; a favor layer given such a
    mask raises :class:`FavorMaskError` (:func:`_key_padding_from_4d`), as linear attention cannot express it.
    """
    if mask_function not in (causal_mask_function, bidirectional_mask_function):
        segment_ids = packed_segment_ids(
            mask_function, batch_size, q_length, kv_length, q_offset, attention_mask, kwargs.get("device")
        )
        if segment_ids is not None:
            return segment_ids
        kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)  # eager layers need it whole
        return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                         **kwargs)
    return flash_attention_mask(
        batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs
    )


def _key_padding_from_4d(mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """``[B, Lk]`` key padding mask equal to a 4-D mask ``[B, 1 or H, Lq, Lk]``, or raise."""
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask == 0
        blocked_values = mask.masked_select(~allowed)
        # Masked entries hold a large negative value: the dtype's minimum, or one constant such as the -10000 of
        # older models' "extended attention masks" (MarkupLM, ...); anything else is a bias on the scores.
        old_style = blocked_values.numel() and bool((blocked_values == blocked_values[0]).all()) and \
            float(blocked_values[0]) <= -1e4
        if blocked_values.numel() and not old_style and \
                bool((blocked_values > torch.finfo(mask.dtype).min / 2).any()):
            raise FavorMaskError(
                "favor attention got a 4-D float mask holding biases other than 0 (attend) and a large negative "
                "value (masked); linear attention cannot add a bias to attention scores. Pass a 2-D key padding "
                "mask [batch, key_length] instead."
            )
    else:
        allowed = mask != 0
    q_len, k_len = allowed.shape[-2:]
    key_padding = allowed.any(dim=(1, 2))  # [B, Lk]
    expected = key_padding[:, None, None, :].expand(allowed.shape)
    if causal:
        query_positions = torch.arange(q_len, device=mask.device)[:, None] + (k_len - q_len)
        expected = expected & (torch.arange(k_len, device=mask.device)[None, :] <= query_positions)
    padding_queries = ~allowed.any(dim=-1, keepdim=True)  # rows that attend to nothing
    if not bool(((allowed == expected) | padding_queries).all()):
        raise FavorMaskError(
            f"favor attention got a 4-D attention mask of shape {tuple(mask.shape)} that is not "
            f"'key padding AND {'causal' if causal else 'full'}': linear attention can only express a key padding "
            "mask (plus causality). Pass a 2-D attention_mask [batch, key_length] (True/1 = token), or use "
            "attn_implementation='sdpa' for arbitrary masks."
        )
    return key_padding


def key_padding_mask_of(attention_mask, causal: bool) -> torch.Tensor | None:
    """The 2-D bool key padding mask ``[B, M]`` described by ``attention_mask`` (``None`` if nothing is padded)."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise FavorMaskError(
            f"favor attention accepts None, a 2-D key padding mask or an equivalent 4-D mask; got "
            f"{type(attention_mask).__name__}"
        )
    if attention_mask.dim() == 4:
        mask = _key_padding_from_4d(attention_mask, causal)
    elif attention_mask.dim() == 2:
        mask = attention_mask
        if mask.dtype != torch.bool:
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise FavorMaskError(
                    "a 2-D attention mask for favor attention must hold only 0 (padding) and 1 (token), or be bool; "
                    f"got values {mask.unique()[:8].tolist()} (additive masks are not accepted)"
                )
            mask = mask != 0
    else:
        raise FavorMaskError(
            f"favor attention accepts a 2-D key padding mask [batch, key_length] or an equivalent 4-D mask; got a "
            f"{attention_mask.dim()}-D mask of shape {tuple(attention_mask.shape)}"
        )
    return None if bool(mask.all()) else mask
