"""The cache layer of a window-hybrid layer: its :class:`~.window_state.WindowAttentionState` (sink slots, a buffer
of recent keys and values, the sparse cache, the tail sums), of constant size, croppable by up to ``max_rollback``
tokens (:mod:`.cache` gives the whole picture).

This module imports only ``torch``, ``transformers`` and relative siblings: it is copied next to saved models for
``trust_remote_code``.
"""

from __future__ import annotations

import torch

from .favor_cache_layer import FavorCacheLayer
from .linear_attention_parallel import attention_path
from .window_attention import window_linear_attention
from .window_decode import exact_decode_step


class WindowCacheLayer(FavorCacheLayer):
    """Cache layer of one causal window layer (sinks + sliding window exact, linear tail): constant size, croppable.

    ``update`` counts tokens exactly as :class:`FavorCacheLayer` does; the attention function then calls
    :meth:`attend`, which runs :func:`~.window_attention.window_linear_attention` from :attr:`state` and stores
    the new state.

    Args:
        max_rollback: tokens :meth:`crop` can always remove (assisted / speculative decoding); ``None`` = 0. Each
            token of it adds a key and a value to the state's buffer, and any value > 0 a second set of tail sums
            (:mod:`.window_state`). After :meth:`activate_past_recording` (which ``generate(assistant_model=...)``
            calls) the tokens of the last forward are kept croppable on top of that, however many.

    Attributes:
        state: the :class:`~.window_attention.WindowAttentionState` after all tokens seen (``None`` before). On the
            parallel path (CUDA) the first call of a layer computes its outputs without a state and the state only when
            something reads it (a decoding step, ``crop``, its size): a training forward, which builds a cache by
            default (``use_cache``) and never reads it, pays nothing for it.
    """

    _layer_type = "favor_window"
    # Back to the state's checkpoint, replayed by the next call: exact within max_rollback tokens.
    is_croppable = True

    def __init__(self, max_rollback: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if max_rollback is not None and (isinstance(max_rollback, bool) or not isinstance(max_rollback, int)
                                         or max_rollback < 0):
            raise ValueError(f"max_rollback must be None (0) or an int >= 0; got {max_rollback!r}")
        self.max_rollback = max_rollback
        # Set by Cache.activate_past_recording() (assisted generation): the tokens of each forward also stay
        # unfolded until the next one, so that any number of rejected draft tokens can be cropped.
        self.record_past = False

    @property
    def state(self):
        pending = self.__dict__.get("_pending_state")
        if pending is not None:
            self.__dict__["_pending_state"] = None
            self.__dict__["_state"] = pending()
        return self.__dict__.get("_state")

    @state.setter
    def state(self, value) -> None:
        self.__dict__["_pending_state"] = None
        self.__dict__["_state"] = value

    def _defers_state(self, query, key, feature_map) -> bool:
        """Whether :meth:`attend` computes this call's outputs now and its state when read: the parallel path, the
        layer's first call over a whole prompt, no recording for assisted decoding, a map that cannot redraw."""
        return (self.__dict__.get("_state") is None and self.__dict__.get("_pending_state") is None
                and not self.record_past and query.shape[-2] == key.shape[-2] > 1
                and attention_path(query) == "parallel"
                and (feature_map is None or not (feature_map.training and getattr(feature_map, "redraw_interval", 0))))

    def activate_past_recording(self) -> None:
        """Keep every token of the last forward croppable, however many (transformers' assisted generation)."""
        self.record_past = True

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, feature_map, *, window: int,
               key_padding_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Window attention of the new tokens given everything this layer has seen; stores the new state.

        Args:
            query: ``[B, H, q, d]``; key, value: ``[B, Hkv, q, d]``, the tokens of the last :meth:`update`.
            feature_map: the layer's map (must not redraw between calls).
            window: the layer's window; ``kwargs`` go to :func:`~.window_attention.window_linear_attention`
                (``sinks``, ``softmax_weight``, ``scaling``, ``chunk_size``).
            key_padding_mask: ``[B, q]`` for the new tokens (``True`` = token), or ``None``.

        Returns:
            ``[B, H, q, dv]``.
        """
        if key.shape[-2] != self.pending_tokens:
            raise RuntimeError(
                f"WindowCacheLayer.attend: expected the {self.pending_tokens} token(s) of the last update, got "
                f"{key.shape[-2]}"
            )
        max_rollback = self.max_rollback or 0
        if self.record_past:
            max_rollback += key.shape[-2]
        if self._defers_state(query, key, feature_map):
            grad = torch.is_grad_enabled()

            def state_of_the_call():  # the same call with its state, as it would have run (grad mode included)
                with torch.set_grad_enabled(grad):
                    return window_linear_attention(
                        query, key, value, feature_map, window=window, key_padding_mask=key_padding_mask,
                        return_state=True, max_rollback=max_rollback, **kwargs)[1]

            out = window_linear_attention(query, key, value, feature_map, window=window,
                                          key_padding_mask=key_padding_mask, **kwargs)
            self.pending_tokens = 0
            self.__dict__["_pending_state"] = state_of_the_call
            return out
        out, state = window_linear_attention(
            query, key, value, feature_map, window=window, key_padding_mask=key_padding_mask,
            initial_state=self.state, return_state=True, max_rollback=max_rollback, **kwargs,
        )
        self.set_state(state)
        return out

    @property
    def holds_exact_record(self) -> bool:
        """Whether the next one-token step may continue an exact decoding record (a layer without a tail and with
        a sparse cache, keeping no rollback: :func:`~.window_decode.exact_decode_step`)."""
        return (self.state is not None and self.state.exact_keys is not None and not self.max_rollback
                and not self.record_past)

    def exact_step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                   key_padding_mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor | None:
        """:meth:`attend` for one token continuing a state that :attr:`holds_exact_record`, without the general
        call's dispatch; ``None`` (nothing done) for any other call, which :meth:`attend` then serves."""
        if (not self.holds_exact_record or self.pending_tokens != 1 or key.shape[-2] != 1
                or key.shape[:2] != self.state.buffer_key.shape[:2] or query.shape[0] != key.shape[0]):
            return None
        step = exact_decode_step(query, key, value, state=self.state, key_padding_mask=key_padding_mask,
                                 scaling=scaling)
        if step is None:
            return None
        self.set_state(step[1])
        return step[0]

    def _map_state(self, fn) -> None:
        if self.state is not None:
            self.state = self.state.map_batch(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows of the state (beam search)."""
        self._map_state(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count; 0 is a
        no-op). Exact up to ``max_rollback`` tokens after any forward; beyond what the buffer holds, an error."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
            raise ValueError(
                f"WindowCacheLayer.crop takes a negative int, the number of last tokens to remove (as DynamicLayer); "
                f"got {tokens_to_remove!r}"
            )
        if tokens_to_remove == 0:
            return
        if self.pending_tokens:
            raise RuntimeError("WindowCacheLayer.crop: the last update was never attended to; crop after the forward")
        tokens = -tokens_to_remove
        if self.state is None or tokens > self.state.rollback_capacity():
            capacity = 0 if self.state is None else self.state.rollback_capacity()
            raise ValueError(
                f"WindowCacheLayer: cannot remove the last {tokens} tokens, at most {capacity} can be removed exactly "
                f"(max_rollback={self.max_rollback}, None = 0); build the cache with a larger max_rollback"
            )
        self.state = self.state.rollback(tokens)
        self.seen_tokens -= tokens

    def state_nbytes(self) -> int:
        """Bytes held by the state (set by the layer's settings and max_rollback, not by the number of tokens seen)."""
        return 0 if self.state is None else self.state.nbytes()
