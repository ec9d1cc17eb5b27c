"""Constant-memory generation cache for FAVOR+ / linear attention.

Softmax attention caches every past key and value (memory ``O(L)``). Causal linear attention only
needs its recurrent state after the past tokens (see :class:`~.linear_attention.LinearAttentionState`):

* ``kv``         ``[B, H, m, dv]``: ``sum_j exp(-c) phi(k_j) v_j^T``,
* ``k_sum``      ``[B, H, m]``:     ``sum_j exp(-c) phi(k_j)`` (the normaliser),
* ``stabilizer`` ``[B, H]``:        ``c``, the running maximum of the key log-scales,

whose size does not depend on the number of tokens. :class:`FavorCacheLayer` is a transformers cache
layer that holds this state instead of keys and values:

* ``update(key, value)`` (called by the model *before* the attention function) returns the new keys
  and values unchanged and only counts tokens, so ``get_seq_length()`` (position ids) and
  ``get_mask_sizes()`` (2-D padding masks over all seen tokens) keep working;
* the favor attention function (``favor_attention.py``) runs the causal kernel from ``state`` and
  stores the new state with :meth:`FavorCacheLayer.set_state`;
* ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave`` select rows of the state
  (beam search, contrastive search);
* rollback (assisted / speculative decoding, prompt lookup): after ``activate_past_recording()`` (which
  ``generate()`` calls before assisted decoding, as for transformers' own linear-attention layers) the layer
  keeps, until the next ``crop``, the state before the recorded calls and their keys and values (only the
  candidate tokens, a few per step); ``crop(-n)`` rebuilds the state without the last ``n`` tokens from them
  (exact: the same kernel over the kept tokens). Without recording, a state cannot be rolled back and ``crop``
  of a positive count raises.

A layer that received tokens the attention function never folded into its state (the model does not
run favor attention on it, or the attention module cannot see the cache) raises at the next
``update`` instead of silently attending to the new tokens only.

Window layers (exact softmax over sinks and a sliding window, a linear tail; ``window_attention.py``) use
:class:`WindowCacheLayer` instead: it holds a :class:`~.window_attention.WindowAttentionState` (each row's
sink slots: the keys/values of its first unpadded tokens, a buffer of the last keys/values, its sparse cache of hard
keys and the float32 tail sums), of constant size too, and can be cropped by up to ``max_rollback`` tokens (assisted /
speculative decoding).

The class sets ``_layer_type = "favor"``, which registers it in transformers'
``DYNAMIC_LAYER_TYPE_MAPPING`` (so ``Cache(layers=[FavorCacheLayer(), ...])`` and
``DYNAMIC_LAYER_TYPE_MAPPING["favor"]`` work). Note that transformers 5.23 validates
``config.layer_types`` against a closed list, so ``config.layer_types = ["favor", ...]`` is rejected
by the config; ``generate()`` instead gets this layer through the attention modules' pre-hook
installed by ``attach_feature_maps`` (see ``favor_cache_hooks.py``), or explicitly with
``cache=make_favor_cache(model)`` (``past_key_values=`` before transformers 5.24).

This module imports only ``torch``, ``transformers`` and relative siblings: it is copied next to saved
models for ``trust_remote_code``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicCache

from .favor_settings import is_window_layer, resolve_favor_settings
from .feature_maps import no_redraw
from .linear_attention import FavorMaskError, LinearAttentionError, LinearAttentionState, linear_attention
from .linear_attention_parallel import attention_path
from .window_attention import window_linear_attention
from .window_decode import exact_decode_step


CACHE_ARGUMENT_NAMES = ("cache", "past_key_values")
"""The keyword of the cache in model and attention-module forwards: ``cache`` from transformers 5.24 on,
``past_key_values`` before (5.24 still takes the old keyword, with a warning, until 5.40)."""


def cache_argument_name(forward) -> str:
    """The keyword under which ``forward`` (a model's or a module's, or its class's) takes the cache."""
    return cache_keyword_among(inspect.signature(forward).parameters)


def cache_keyword_among(parameter_names) -> str:
    """The first of :data:`CACHE_ARGUMENT_NAMES` among ``parameter_names`` (``past_key_values`` if neither: the older
    convention)."""
    return next((name for name in CACHE_ARGUMENT_NAMES if name in parameter_names), "past_key_values")


def cache_from_kwargs(kwargs: dict, where: str = "forward"):
    """The cache given in ``kwargs`` under either name of :data:`CACHE_ARGUMENT_NAMES` (``None`` if neither);
    both at once raise a one-line ``TypeError``."""
    given = [name for name in CACHE_ARGUMENT_NAMES if kwargs.get(name) is not None]
    if len(given) > 1:
        raise TypeError(f"{where}: got the cache twice, as cache= and past_key_values=; pass it once (cache=)")
    return kwargs[given[0]] if given else None


def cache_of_output(output):
    """The cache a model returned (``output.cache`` from transformers 5.24 on, ``output.past_key_values`` before)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def linear_state_bytes(heads: int, head_dim: int, nb_features: int) -> int:
    """Bytes of one linear layer's decoding state (``FavorCacheLayer``: ``S [H, m, d]``, ``z [H, m]`` and the
    stabiliser ``[H]``, float32) per sequence."""
    return heads * (nb_features * head_dim + nb_features + 1) * 4


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


def cache_layer_class(settings: dict, layer_idx: int):
    """The constant-size cache layer class of favor layer ``layer_idx`` (resolved ``settings``):
    :class:`WindowCacheLayer` for window layers (window or sinks > 0), else :class:`FavorCacheLayer`."""
    return WindowCacheLayer if is_window_layer(settings, layer_idx) else FavorCacheLayer


def make_favor_cache(config_or_model, max_rollback: int | None = None) -> DynamicCache:
    """A :class:`~transformers.DynamicCache` whose favor layers have constant-size cache layers.

    Args:
        config_or_model: a transformers model or its config. The layers listed in
            ``config.favor_settings["softmax_layers"]`` keep transformers' own cache layer (full keys and values);
            window layers (``window`` or ``sinks`` > 0) get a :class:`WindowCacheLayer`, every other layer a
            :class:`FavorCacheLayer` (recurrent state).
        max_rollback: of the window layers: how many last tokens ``crop`` can always remove (``None``: 0);
            ``generate(assistant_model=...)`` needs none (it records the drafts' forward).

    Use it as ``model.generate(..., cache=make_favor_cache(model))`` (``past_key_values=`` before transformers
    5.24) or in a manual decoding loop.
    The model must run ``attn_implementation="favor"`` and have been prepared with
    ``attach_feature_maps(model)``.
    """
    config = getattr(config_or_model, "config", config_or_model)
    text_config = config.get_text_config(decoder=True)
    favor_settings = getattr(text_config, "favor_settings", None) or getattr(config, "favor_settings", None)
    settings = resolve_favor_settings(favor_settings)
    cache = DynamicCache(config=text_config)
    for layer_idx in range(len(cache.layers)):
        if layer_idx not in settings["softmax_layers"]:
            layer_class = cache_layer_class(settings, layer_idx)
            cache.layers[layer_idx] = (WindowCacheLayer(max_rollback) if layer_class is WindowCacheLayer
                                       else FavorCacheLayer())
    return cache


def is_favor_cache_layer(layer) -> bool:
    # By layer type rather than isinstance: a copy of this package loaded as remote code defines its own class.
    return getattr(type(layer), "_layer_type", None) == FavorCacheLayer._layer_type


def is_window_cache_layer(layer) -> bool:
    return getattr(type(layer), "_layer_type", None) == WindowCacheLayer._layer_type


def new_tokens_padding_mask(key_padding_mask, cache_layer, layer_idx: int, q_len: int, k_len: int):
    """The ``[B, k_len]`` padding mask of the new tokens, from the mask of every token a constant-size cache layer
    has seen (``update`` has counted the new ones): ``key``/``value`` are the new tokens only."""
    if k_len != q_len:
        raise LinearAttentionError(
            f"favor cache layer {layer_idx}: expected as many new keys as queries, got {k_len} and {q_len}"
        )
    if key_padding_mask is None:
        return None
    if key_padding_mask.shape[-1] != cache_layer.get_seq_length():
        raise FavorMaskError(
            f"favor cache layer {layer_idx}: the 2-D attention mask covers {key_padding_mask.shape[-1]} "
            f"tokens but the cache has seen {cache_layer.get_seq_length()} (past + new); pass the mask of "
            "all tokens so far"
        )
    return key_padding_mask[:, -k_len:]


def record_for_rollback(cache_layer, query_heads: int, key, value, feature_map, key_padding_mask, common: dict):
    """Let a recording :class:`FavorCacheLayer` undo this call's tokens (assisted decoding): it keeps the state
    before the call, the new keys / values, and a function folding kept tokens into that state with this layer's
    features (placeholder queries: only the state is used)."""

    def fold(start_state, keys, values, mask):
        placeholder = keys.new_zeros(keys.shape[0], query_heads, keys.shape[2], keys.shape[3])
        with no_redraw(feature_map, active=True):
            _, state = linear_attention(
                placeholder, keys, values, feature_map, causal=True, key_padding_mask=mask, initial_state=start_state,
                return_state=True, **common,
            )
        return state

    cache_layer.record_call(cache_layer.state, key, value, key_padding_mask, fold)
