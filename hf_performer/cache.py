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

The layers live in :mod:`.favor_cache_layer` and :mod:`.window_cache_layer` (re-exported here); this module holds
what finds, builds and checks them. It imports only ``torch``, ``transformers`` and relative siblings: it is copied
next to saved models for ``trust_remote_code``.
"""

from __future__ import annotations

import inspect

from transformers.cache_utils import DynamicCache

from .favor_settings import is_window_layer, resolve_favor_settings
from .feature_maps import no_redraw
from .linear_attention import FavorMaskError, LinearAttentionError, linear_attention
from .favor_cache_layer import FavorCacheLayer
from .window_cache_layer import WindowCacheLayer


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
