"""The cache layer of a causal linear-attention (FAVOR+) layer: its recurrent state instead of keys and values,
rolled back for assisted decoding from the recorded calls (:mod:`.cache` gives the whole picture).

This module imports only ``torch``, ``transformers`` and relative siblings: it is copied next to saved models for
``trust_remote_code``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers.cache_utils import CacheLayerMixin

from .linear_attention import LinearAttentionState


class FavorCacheLayer(CacheLayerMixin):
    """Cache layer of one causal linear-attention layer: a token counter and the recurrent state.

    Attributes:
        state: the :class:`LinearAttentionState` after all tokens seen so far (``None`` before the first
            forward): ``kv [B, H, m, dv]``, ``k_sum [B, H, m]``, ``stabilizer [B, H]``, in float32.
        seen_tokens: number of tokens (padding included) passed through ``update``.
        pending_tokens: tokens given to ``update`` whose contribution is not yet in ``state``.
    """

    _layer_type = "favor"
    is_sliding = False
    is_compileable = False
    # Croppable while recording (activate_past_recording): the tokens of the calls since the last crop can be undone.
    is_croppable = True

    def __init__(self, **kwargs):
        super().__init__()
        self.state: LinearAttentionState | None = None
        self.seen_tokens = 0
        self.pending_tokens = 0
        self.dtype = None
        self.device = None
        self.record_past = False
        self._record: _RollbackRecord | None = None

    def __repr__(self):
        return f"{self.__class__.__name__}(seen_tokens={self.seen_tokens})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Count the new tokens and return ``key_states`` / ``value_states`` ``[B, Hkv, q_len, d]`` as is."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending_tokens:
            raise RuntimeError(
                f"{type(self).__name__}: the previous {self.pending_tokens} token(s) given to this cache layer were never "
                "folded into its recurrent state by the favor attention function, so continuing would silently drop "
                "them. Use this cache only with attn_implementation='favor' on a model prepared with "
                "hf_performer.attach_feature_maps(model) (it lets attention modules see the cache), and do not use "
                "it for layers listed in favor_settings['softmax_layers']."
            )
        new_tokens = key_states.shape[-2]
        self.seen_tokens += new_tokens
        self.pending_tokens = new_tokens
        return key_states, value_states

    def set_state(self, state: LinearAttentionState) -> None:
        """Store the state after the tokens of the last ``update`` (called by the attention function)."""
        self.state = state
        self.pending_tokens = 0

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: 2-D padding masks cover every token seen, plus the new ones."""
        return self.seen_tokens + query_length, 0

    def _map_state(self, fn) -> None:
        if self.state is not None:
            self.state = LinearAttentionState(*(fn(t) for t in self.state))
        if self._record is not None:
            self._record = self._record.map_rows(fn)

    def activate_past_recording(self) -> None:
        """Keep what is needed to undo the tokens of the next calls (until ``crop``), as transformers' protocol for
        caches with fixed-size states; ``generate()`` calls it before assisted decoding."""
        self.record_past = True

    def record_call(self, start_state, keys, values, key_padding_mask, fold) -> None:
        """Called by the attention function before :meth:`set_state` when ``record_past``: remember the state
        before the call and the call's keys / values ``[B, Hkv, n, d]`` and key padding mask ``[B, n]`` (or
        ``None``). ``fold(start_state, keys, values, key_padding_mask)`` returns the state after those tokens."""
        if self._record is None:
            self._record = _RollbackRecord(start_state, keys, values, key_padding_mask, fold)
        else:
            self._record = self._record.extended(keys, values, key_padding_mask, fold)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows of the state (beam search)."""
        if self.state is not None:
            self.state = self.state.reorder(beam_idx)
        if self._record is not None:
            self._record = self._record.map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_state(lambda t: t[indices, ...])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_state(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        self.state = None
        self.seen_tokens = 0
        self.pending_tokens = 0
        self._record = None

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (a count ``<= 0``, as for transformers' linear-attention
        layers) by rebuilding the state from the recorded calls, then forget the record (``crop(0)`` only forgets).

        Raises:
            RuntimeError: a positive count, or more tokens than were recorded since the last crop (recording off:
                none).
        """
        if tokens_to_remove > 0:
            raise RuntimeError(
                f"FavorCacheLayer.crop({tokens_to_remove}): pass a negative count of tokens to remove (a recurrent "
                "state has no key positions to cut at)"
            )
        record, self._record = self._record, None
        remove = -tokens_to_remove
        if remove == 0:
            return
        recorded = 0 if record is None else record.keys.shape[-2]
        if remove > recorded:
            raise RuntimeError(
                f"FavorCacheLayer: cannot remove {remove} token(s): a recurrent state can only undo the tokens recorded "
                f"since the last crop ({recorded}; recording is {'on' if self.record_past else 'off'}: "
                "activate_past_recording() turns it on). Assisted decoding needs this for the main model; a "
                "linear-attention assistant model cannot roll back: use a softmax assistant, prompt lookup, or "
                "window layers (issue 15)."
            )
        keep = recorded - remove
        if keep == 0:
            self.state = record.start_state
        else:
            mask = None if record.key_padding_mask is None else record.key_padding_mask[:, :keep]
            self.state = record.fold(
                record.start_state, record.keys[..., :keep, :], record.values[..., :keep, :], mask
            )
        self.seen_tokens -= remove

    def offload(self):
        self._map_state(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.device is not None:
            self._map_state(lambda t: t.to(self.device, non_blocking=True))

    def state_nbytes(self) -> int:
        """Bytes held by the state (independent of the number of tokens seen)."""
        return 0 if self.state is None else sum(t.numel() * t.element_size() for t in self.state)


class _RollbackRecord(NamedTuple):
    """What :meth:`FavorCacheLayer.crop` needs to undo recorded tokens: the state before them (``None`` = empty),
    their keys / values ``[B, Hkv, n, d]``, key padding mask ``[B, n]`` or ``None``, and the function that folds
    tokens into a state (given by the attention function: it has the feature map and the scaling)."""

    start_state: LinearAttentionState | None
    keys: torch.Tensor
    values: torch.Tensor
    key_padding_mask: torch.Tensor | None
    fold: Callable

    def extended(self, keys, values, key_padding_mask, fold) -> "_RollbackRecord":
        if self.key_padding_mask is None and key_padding_mask is None:
            mask = None
        else:
            ones = lambda t: torch.ones(t.shape[0], t.shape[-2], dtype=torch.bool, device=t.device)  # noqa: E731
            old = ones(self.keys) if self.key_padding_mask is None else self.key_padding_mask
            new = ones(keys) if key_padding_mask is None else key_padding_mask
            mask = torch.cat([old, new.to(old.device)], dim=-1)
        return _RollbackRecord(
            self.start_state, torch.cat([self.keys, keys], dim=-2), torch.cat([self.values, values], dim=-2), mask, fold
        )

    def map_rows(self, fn) -> "_RollbackRecord":
        start = None if self.start_state is None else LinearAttentionState(*(fn(t) for t in self.start_state))
        mask = None if self.key_padding_mask is None else fn(self.key_padding_mask)
        return _RollbackRecord(start, fn(self.keys), fn(self.values), mask, self.fold)
