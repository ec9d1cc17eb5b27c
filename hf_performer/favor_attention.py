"""FAVOR+ / linear attention as a transformers attention implementation (``attn_implementation="favor"``).

Importing this module registers:

* ``AttentionInterface.register("favor", favor_attention_forward)``: stock models that dispatch attention
  through ``ALL_ATTENTION_FUNCTIONS`` (BERT, RoBERTa, DistilBERT, GPT-2, Llama, ... in transformers 5.x)
  accept ``from_pretrained(..., attn_implementation="favor")`` and ``model.set_attn_implementation("favor")``;
* ``AttentionMaskInterface.register("favor", favor_attention_mask)``: without it transformers builds *no*
  mask for an unknown implementation and padding would be silently ignored. The mask is the 2-D key
  padding mask ``[batch, kv_length]`` (``True`` = token) of flash attention, or ``None`` when nothing
  is padded; packed sequences become segment ids (:mod:`.packed_sequences`); other patterns (sliding windows,
  custom ``or``/``and`` mask functions) become sdpa's 4-D mask, which the softmax layers apply (a source's
  sliding-window layers stay softmax) and favor layers refuse;

Behaviour of :func:`favor_attention_forward`:

* causal or bidirectional exactly like transformers' sdpa function: ``kwargs["is_causal"]`` if given,
  else ``module.is_causal``;
* ``exp(scaling * q.k)`` is estimated with the ``scaling`` the model passes (GPT-2 may fold a per-layer
  factor into it); grouped-query attention (fewer key/value heads) is supported;
* attention masks: ``None``, a 2-D key padding mask (bool or 0/1), or a 4-D mask ``[B, 1 or H, Lq, Lk]``
  (bool, or additive float with 0 / large negative values) *only if* it is exactly "key padding AND
  (causal or full)" (fully masked query rows are accepted: they are padding queries). Any other mask
  raises :class:`FavorMaskError`: it is never silently dropped;
* attention dropout cannot be applied to linear attention (there is no attention matrix): a
  ``dropout > 0`` in training is ignored with a one-time warning;
* ``output_attentions`` (or transformers' output collector recording attentions): the ``[B, H, Lq, Lk]`` weights
  the layer applies are formed on request only, in ``O(Lq Lk)`` (:mod:`.attention_weights`): for favor layers
  the normalised ``phi(Q) phi(K)^T`` with the mask (``weights @ V`` is the output), for softmax layers the
  softmax weights. Cached decoding from a recurrent state has no past keys: ``None`` with a one-time warning,
  as transformers' sdpa does;
* packed sequences (``position_ids`` restarting inside a row without a cache, or ``cu_seq_lens_q``): the causal
  state restarts at each sequence (:mod:`.packed_sequences`); window layers (causal or bidirectional) run each
  sequence as its own row, sequences of similar lengths padded into one call (:class:`~.packed_sequences.SegmentRows`);
* layers listed in ``favor_settings["softmax_layers"]`` delegate to transformers' sdpa function (exact
  softmax), with the 2-D padding mask turned into the mask sdpa would have been given, or to the architecture's own
  eager function for options sdpa cannot apply (:data:`SOFTMAX_ONLY_OPTIONS`: soft-capping, attention sinks), which
  favor layers cannot apply either (warned once); a ``position_bias`` (relative positions, ALiBi) is refused;
* "window layers" (``favor_settings`` ``window`` or ``sinks`` > 0 for the layer, :func:`~.favor_settings.layer_window`)
  run :func:`~.window_attention.window_linear_attention`: exact softmax over the sink tokens and a sliding window,
  the feature map for older keys (none with ``linear_tail=False``), one shared normaliser. In learned mode
  (:func:`~.favor_settings.softmax_weight_mode`) the module owns ``favor_softmax_weight``
  (:class:`~.window_attention.SoftmaxWeight`, gamma per head);
* ``favor_settings["attention"]`` ``"clustered"`` / ``"improved-clustered"`` (bidirectional models only) runs
  :func:`~.clustered_attention.clustered_attention` / :func:`~.clustered_attention.improved_clustered_attention`
  with ``clusters`` and ``topk`` (capped at the key length: ``topk >= L`` is exact softmax) and hash seed
  ``seed + layer``: a zero-shot approximation with no feature map and no parameters. Causal layers are refused
  (when the model is built, and in the forward of a stock model switched to favor).

Settings are read from ``module.config.favor_settings`` (validated strictly by
:func:`~.favor_settings.resolve_favor_settings`; absent keys take :data:`~.favor_settings.FAVOR_DEFAULTS`)
once, when the module's feature map is attached, and kept on the module (:func:`module_favor_settings`).
Each favor attention module owns a submodule ``favor_feature_map`` (seed ``settings["seed"] + layer_idx``),
so projections and redraw counters live in the state dict and reload bit-identically.
:func:`attach_feature_maps` creates them eagerly (call it before loading a state dict); a stock model switched
with ``set_attn_implementation("favor")`` gets them lazily on its first forward.

Generation: :func:`attach_feature_maps` also installs a forward pre-hook on the attention modules that hands the
layer's cache (the ``Cache`` among the module's arguments, whatever the architecture names it: ``cache``,
``past_key_values``, ``layer_past``, ...) to the attention function and, for causal
favor layers, replaces an *empty* ``DynamicLayer`` of that cache (the layer ``generate()`` and the models create by
default) by a :class:`~.favor_cache_layer.FavorCacheLayer` (a :class:`~.window_cache_layer.WindowCacheLayer` for
window layers: sinks, recent keys and the tail state, croppable for assisted generation). Prefill and token-by-token
decoding then carry the recurrent state (constant memory, equal to one full forward). A cache layer that already holds
full keys and values (e.g. a ``DynamicCache`` filled before the hook existed) is still handled correctly: the causal
kernel is run over all cached keys at every step (``O(L)`` per token). Static caches (whose key length differs from
the mask length) raise.

The modules each layer owns and :func:`attach_feature_maps` live in :mod:`.favor_layer_modules`, the cache hand-over
in :mod:`.favor_cache_hooks` (both re-exported here). This module imports only ``torch``, ``transformers`` and
relative siblings: it is copied next to saved models for ``trust_remote_code``.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    AttentionMaskInterface,
    bidirectional_mask_function,
    causal_mask_function,
    sdpa_mask,
)
from transformers.utils import logging

from .attention_weights import (
    allowed_attention_pairs,
    apply_attention_weights,
    attention_weights_requested,
    requested_linear_attention_weights,
    softmax_attention_weights,
    window_attention_weights,
)
from .cache import is_favor_cache_layer, is_window_cache_layer, new_tokens_padding_mask, record_for_rollback
from .clustered_attention import (
    clustered_attention_from_settings,
    clustered_attention_weights_from_settings,
    refuse_causal_clustered,
)
from .favor_cache_hooks import (  # noqa: F401  (install_favor_cache_layers, runs_causal_favor: re-exported)
    CACHE_ATTRIBUTE,
    cache_layer_of,
    install_favor_cache_layers,
    reject_fixed_size_cache,
    runs_causal_favor,
)
from .favor_layer_modules import (  # noqa: F401  (the attributes and attach_feature_maps: re-exported)
    FEATURE_MAP_ATTRIBUTE,
    SOFTMAX_WEIGHT_ATTRIBUTE,
    TAIL_GATE_ATTRIBUTE,
    WINDOW_DROPPED_ATTRIBUTE,
    attach_feature_maps,
    feature_map_for,
    softmax_weight_for,
    tail_gate_for,
)
from .favor_masks import favor_attention_mask, key_padding_mask_of
from .favor_modules import (  # noqa: F401  (re-exported: the module walk lives there)
    ATTN_IMPLEMENTATION,
    find_attention_modules,
    is_attention_module,
    layer_index_of,
    module_device,
    module_favor_settings,
    module_head_counts,
    module_head_dim,
    update_favor_settings,
    uses_favor,
)
from .favor_settings import is_clustered, is_window_layer, layer_sparse_cache, layer_tail_cap, layer_window
from .feature_maps import no_redraw
from .linear_attention import FavorMaskError, LinearAttentionError, linear_attention
from .packed_sequences import SegmentRows, packed_sequences_of
from .window_attention import window_linear_attention


logger = logging.get_logger(__name__)

# --------------------------------------------------------------------------------------------
# Attention functions
# --------------------------------------------------------------------------------------------


def _softmax_attention_forward(module, query, key, value, attention_mask, scaling, dropout, causal, kwargs):
    """Exact softmax attention (sdpa) for ``softmax_layers``, given the mask built for favor."""
    cache_layer = cache_layer_of(module, layer_index_of(module))
    if not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4):
        # A 4-D mask was built by transformers for this layer's cache (a sliding window's too); the 2-D one is
        # turned into a causal mask below, which needs the keys to be the tokens seen.
        reject_fixed_size_cache(cache_layer, layer_index_of(module))
    if is_favor_cache_layer(cache_layer) or is_window_cache_layer(cache_layer):
        raise RuntimeError(
            f"layer {layer_index_of(module)} uses softmax attention (favor_settings['softmax_layers']) but its cache "
            f"layer is a {type(cache_layer).__name__}, which does not keep every key/value; build the cache with "
            "make_favor_cache(model)"
        )
    eager = _source_eager_attention(module, kwargs)
    if attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2):
        # The 2-D padding mask of the favor mask builder: build what the model would have given sdpa.
        q_len, kv_len = query.shape[2], key.shape[2]
        if attention_mask is not None and attention_mask.shape[-1] != kv_len:
            raise FavorMaskError(
                f"softmax layer {layer_index_of(module)}: the 2-D mask covers {attention_mask.shape[-1]} keys but "
                f"the layer has {kv_len} keys"
            )
        padding_mask = None if attention_mask is None else attention_mask.to(torch.bool)
        if causal:
            attention_mask = sdpa_mask(
                batch_size=query.shape[0],
                q_length=q_len,
                kv_length=kv_len,
                q_offset=kv_len - q_len,
                mask_function=causal_mask_function,
                attention_mask=padding_mask,
                allow_is_causal_skip=eager is None,
                device=query.device,
            )
        else:
            attention_mask = sdpa_mask(
                batch_size=query.shape[0],
                q_length=q_len,
                kv_length=kv_len,
                mask_function=bidirectional_mask_function,
                attention_mask=padding_mask,
                allow_is_causal_skip=False,
                allow_is_bidirectional_skip=eager is None,
                device=query.device,
            )
    if eager is not None:
        if attention_mask is not None and attention_mask.dtype == torch.bool:  # eager functions add the mask
            attention_mask = torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(
                ~attention_mask, torch.finfo(query.dtype).min)
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if attention_weights_requested(kwargs):
        # As transformers' eager attention, O(Lq Lk): the weights (after dropout) are applied and returned.
        weights = softmax_attention_weights(query, key, attention_mask, causal=causal, scaling=scaling)
        weights = nn.functional.dropout(weights, p=dropout, training=module.training)
        return apply_attention_weights(weights, value).transpose(1, 2).contiguous(), weights
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


SOFTMAX_ONLY_OPTIONS = ("softcap", "s_aux")
"""Options of some architectures' softmax attention that sdpa does not take: logit soft-capping (Gemma 2) and a
learned sink logit per head (GPT-OSS). Softmax layers then run the architecture's own eager function; favor layers
cannot apply them (see :func:`favor_attention_forward`)."""


def _source_eager_attention(module: nn.Module, kwargs: dict):
    """The ``eager_attention_forward`` of ``module``'s modeling file when the call carries an option of
    :data:`SOFTMAX_ONLY_OPTIONS`, else ``None`` (sdpa serves)."""
    if all(kwargs.get(option) is None for option in SOFTMAX_ONLY_OPTIONS):
        return None
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        given = [option for option in SOFTMAX_ONLY_OPTIONS if kwargs.get(option) is not None]
        raise LinearAttentionError(
            f"softmax layer {layer_index_of(module)}: {type(module).__name__} passes {given}, which sdpa cannot apply, "
            "and its modeling file has no eager_attention_forward to run instead"
        )
    return eager


def favor_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FAVOR+ / linear attention with transformers' attention-function contract.

    Args:
        module: the model's attention module (per-layer feature map and settings live there).
        query: ``[B, H, Lq, d]``.
        key, value: ``[B, Hkv, Lk, d]`` with ``H % Hkv == 0`` (after the model's cache update).
        attention_mask: ``None``, a 2-D key padding mask ``[B, Lk]`` (or ``[B, seen + Lq]`` when the layer's
            cache is a :class:`FavorCacheLayer`), or an equivalent 4-D mask (see the module docstring).
        scaling: softmax temperature to reproduce, ``exp(scaling * q.k)``; default ``d ** -0.5``.
        dropout: attention dropout probability (cannot apply to linear attention; warned once in training).
        **kwargs: ``is_causal`` overrides ``module.is_causal``; ``output_attentions`` asks for the weights;
            ``cu_seq_lens_q`` marks packed sequences; others are ignored.

    Returns:
        ``(attn_output [B, Lq, H, d], weights [B, H, Lq, Lk] or None)``: weights only when requested.
    """
    if query.shape[2] == 1:
        out = _exact_decoding_step(module, query, key, value, attention_mask, scaling, kwargs)
        if out is not None:
            return out, None
    is_causal = kwargs.get("is_causal")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    settings = module_favor_settings(module)
    layer_idx = layer_index_of(module)
    segment_ids, attention_mask = packed_sequences_of(attention_mask, query, kwargs)

    if layer_idx in settings["softmax_layers"]:
        if segment_ids is not None:  # within each packed sequence (causally for a decoder), as a 4-D mask for sdpa
            attention_mask = allowed_attention_pairs(
                query.shape[0], query.shape[2], key.shape[2], causal, None, segment_ids, query.device
            )
        return _softmax_attention_forward(
            module, query, key, value, attention_mask, scaling, dropout, causal, kwargs
        )

    if kwargs.get("position_bias") is not None:
        raise FavorMaskError(
            f"favor attention (layer {layer_idx}): {type(module).__name__} adds a position bias to the attention "
            "scores (relative positions or ALiBi), which linear attention cannot express"
        )
    dropped = [option for option in SOFTMAX_ONLY_OPTIONS if kwargs.get(option) is not None]
    if dropped:
        logger.warning_once(
            f"favor attention: {type(module).__name__} passes {dropped} (logit soft-capping / a learned sink logit), "
            "which linear attention cannot apply: its favor layers approximate softmax attention without them (its "
            "softmax layers keep them)."
        )
    if dropout > 0.0 and module.training:
        logger.warning_once(
            "favor attention: attention dropout (p>0) cannot be applied to linear attention, which never forms an "
            "attention matrix; it is ignored (other dropouts of the model still apply)."
        )

    if is_clustered(settings):
        refuse_causal_clustered(settings["attention"], layer_idx, causal)
        if segment_ids is not None:
            raise FavorMaskError(
                f"clustered attention (layer {layer_idx}): packed sequences are not supported (the clusters would mix "
                "sequences); pad the sequences into separate rows instead"
            )
        padding = key_padding_mask_of(attention_mask, False)
        if attention_weights_requested(kwargs):  # the applied weights, as for linear layers
            weights = clustered_attention_weights_from_settings(query, key, padding, scaling, settings, layer_idx)
            return apply_attention_weights(weights, value).transpose(1, 2).contiguous(), weights
        out = clustered_attention_from_settings(query, key, value, padding, scaling, settings, layer_idx)
        return out.transpose(1, 2).contiguous(), None

    feature_map = feature_map_for(module, layer_idx, settings, query, key)
    key_padding_mask = key_padding_mask_of(attention_mask, causal)
    q_len, k_len = query.shape[2], key.shape[2]
    cache_layer = cache_layer_of(module, layer_idx) if causal else None
    reject_fixed_size_cache(cache_layer, layer_idx)
    common = dict(scaling=scaling, chunk_size=settings["chunk_size"])
    window_layer = is_window_layer(settings, layer_idx)
    if segment_ids is not None and ((not causal and not window_layer) or k_len != q_len or
                                    is_favor_cache_layer(cache_layer)):
        raise FavorMaskError(
            f"favor attention (layer {layer_idx}): packed sequences are supported for causal attention (and window "
            f"layers) without a cache (got causal={causal}, {q_len} queries, {k_len} keys, cache layer "
            f"{type(cache_layer).__name__ if cache_layer is not None else None}); run packed batches with "
            "use_cache=False"
        )

    if window_layer:
        if segment_ids is not None:  # each packed sequence as its own row (window, sinks, tail restart), in groups
            rows = SegmentRows(segment_ids)  # of similar lengths (little padding)
            outs, weights = zip(*(_window_attention_forward(
                module, rows.split(query, g), rows.split(key, g), rows.split(value, g), feature_map,
                rows.key_padding_mask(g), causal, None, settings, layer_idx, common, kwargs)
                for g in range(len(rows.groups))))
            return rows.merge(list(outs)), rows.merge_weights(list(weights))
        return _window_attention_forward(module, query, key, value, feature_map, key_padding_mask, causal,
                                         cache_layer, settings, layer_idx, common, kwargs)
    if is_window_cache_layer(cache_layer):
        raise LinearAttentionError(
            f"favor attention (layer {layer_idx}): a WindowCacheLayer on a layer without window or sinks; build the "
            "cache with make_favor_cache(model)"
        )
    if is_favor_cache_layer(cache_layer):
        # Recurrent path: `key`/`value` are only the new tokens; earlier ones are in the layer's state.
        key_padding_mask = new_tokens_padding_mask(key_padding_mask, cache_layer, layer_idx, q_len, k_len)
        with no_redraw(feature_map, active=cache_layer.state is not None):
            out, state = linear_attention(
                query, key, value, feature_map, causal=True, key_padding_mask=key_padding_mask,
                initial_state=cache_layer.state, return_state=True, **common,
            )
        if getattr(cache_layer, "record_past", False):
            record_for_rollback(cache_layer, query.shape[1], key, value, feature_map, key_padding_mask, common)
        cache_layer.set_state(state)
    else:
        if key_padding_mask is not None and key_padding_mask.shape[-1] != k_len:
            raise FavorMaskError(
                f"favor attention (layer {layer_idx}): the attention mask covers {key_padding_mask.shape[-1]} keys "
                f"but there are {k_len} keys (static caches, whose key buffer is longer than the tokens seen, are "
                "not supported: use the default cache or make_favor_cache(model))"
            )
        if causal and k_len > q_len:
            # A cache holding full keys/values: the queries are the last `q_len` positions. Run the causal
            # kernel over all keys with placeholder queries for the past ones (O(L) per step, still exact).
            placeholder = query.new_zeros(query.shape[0], query.shape[1], k_len - q_len, query.shape[3])
            with no_redraw(feature_map, active=True):
                out = linear_attention(
                    torch.cat([placeholder, query], dim=2), key, value, feature_map, causal=True,
                    key_padding_mask=key_padding_mask, **common,
                )
            out = out[:, :, -q_len:]
        elif causal and k_len < q_len:
            raise LinearAttentionError(
                f"favor attention (layer {layer_idx}): causal attention with fewer keys ({k_len}) than queries "
                f"({q_len})"
            )
        else:
            out = linear_attention(
                query, key, value, feature_map, causal=causal, key_padding_mask=key_padding_mask,
                segment_ids=segment_ids, **common,
            )
    weights = requested_linear_attention_weights(
        kwargs, query, key, feature_map, causal=causal, key_padding_mask=key_padding_mask, segment_ids=segment_ids,
        scaling=scaling, decoding_from_state=is_favor_cache_layer(cache_layer) and cache_layer.get_seq_length() > q_len,
    )
    if weights is not None:  # the returned weights are the applied ones (equal outputs; gradients reach them)
        out = apply_attention_weights(weights, value)
    return out.transpose(1, 2).contiguous(), weights


_GENERAL_PATH_OPTIONS = ("position_bias", "cu_seq_lens_q", *SOFTMAX_ONLY_OPTIONS)
"""Keyword arguments that :func:`_exact_decoding_step` leaves to the general path (which refuses or warns)."""


def _exact_decoding_step(module, query, key, value, attention_mask, scaling, kwargs) -> torch.Tensor | None:
    """The output ``[B, 1, H, dv]`` of a window layer's decoding step from an exact record
    (:meth:`~.window_cache_layer.WindowCacheLayer.exact_step`), ahead of :func:`favor_attention_forward`'s dispatch:
    the step a generating model without a tail takes once per layer and token, where that dispatch cost as much as
    the step's own operations. ``None`` for any other call (a plain padding mask or none; no weights, no packed
    sequences, not training), which the general path serves with the same result."""
    cache = getattr(module, CACHE_ATTRIBUTE, None)
    is_causal = kwargs.get("is_causal")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if (cache is None or module.training or not causal
            or any(kwargs.get(option) is not None for option in _GENERAL_PATH_OPTIONS)
            or (attention_mask is not None and not (
                isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
                and attention_mask.dtype == torch.bool))
            or attention_weights_requested(kwargs)):
        return None
    layer_idx = layer_index_of(module)
    cache_layer = cache_layer_of(module, layer_idx)
    if not (is_window_cache_layer(cache_layer) and cache_layer.holds_exact_record):
        return None
    key_padding_mask = new_tokens_padding_mask(key_padding_mask_of(attention_mask, True), cache_layer, layer_idx,
                                               1, key.shape[2])
    out = cache_layer.exact_step(query, key, value, key_padding_mask=key_padding_mask, scaling=scaling)
    return None if out is None else out.transpose(1, 2).contiguous()


def _window_attention_forward(module, query, key, value, feature_map, key_padding_mask, causal, cache_layer, settings,
                              layer_idx, common, kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sink + window attention of a window layer: ``(out [B, Lq, H, d], weights [B, H, Lq, Lk] or None)`` (see
    :func:`favor_attention_forward`)."""
    out = _window_attention_output(module, query, key, value, feature_map, key_padding_mask, causal, cache_layer,
                                   settings, layer_idx, common)
    weights = None
    if attention_weights_requested(kwargs) and is_window_cache_layer(cache_layer) and \
            cache_layer.get_seq_length() > query.shape[2]:
        logger.warning_once(
            "favor attention: output_attentions during cached decoding of a window layer: the keys folded into the "
            "linear state are gone, so the weights of these steps are returned as None."
        )
    elif attention_weights_requested(kwargs):
        window, sinks = layer_window(settings, layer_idx)
        sinks = min(sinks, key.shape[2])
        if query.shape[2] != key.shape[2]:
            raise LinearAttentionError(
                f"favor attention (layer {layer_idx}): output_attentions of a window layer is available for a full "
                "forward pass (no cached decoding step)"
            )
        weights = window_attention_weights(
            query, key, value, feature_map if settings["linear_tail"] else None, window=window, sinks=sinks,
            causal=causal, softmax_weight=softmax_weight_for(module, layer_idx, settings, query.shape[1],
                                                              query.device),
            key_padding_mask=key_padding_mask, scaling=common["scaling"],
            sparse_cache=layer_sparse_cache(settings, layer_idx), chunk_size=common["chunk_size"],
            tail_cap=layer_tail_cap(settings, causal),
            tail_gate=tail_gate_for(module, layer_idx, settings, query.shape[1], query.device),
            **{name: settings[name] for name in ("sparse_cache_selection", "sparse_cache_span")})
        out = apply_attention_weights(weights, value)
    return out.transpose(1, 2).contiguous(), weights


def _window_attention_output(module, query, key, value, feature_map, key_padding_mask, causal, cache_layer, settings,
                             layer_idx, common) -> torch.Tensor:
    """The window operator's output ``[B, H, Lq, d]`` for :func:`_window_attention_forward`."""
    window, sinks = layer_window(settings, layer_idx)
    sparse_cache, tail_cap = layer_sparse_cache(settings, layer_idx), layer_tail_cap(settings, causal)
    tail_map = feature_map if settings["linear_tail"] else None
    # (Without a tail gamma weighs every term of the output alike: it cancels.)
    gamma = None if tail_map is None else softmax_weight_for(module, layer_idx, settings, query.shape[1],
                                                              query.device)
    tail_gate = tail_gate_for(module, layer_idx, settings, query.shape[1], query.device)
    rule = {name: settings[name] for name in ("sparse_cache_selection", "sparse_cache_span")}
    if tail_map is not None and module.training and getattr(module, WINDOW_DROPPED_ATTRIBUTE, False):
        window, sparse_cache = 0, 0  # sliding-window dropout: the sinks and the tail only
    q_len, k_len = query.shape[2], key.shape[2]
    if is_favor_cache_layer(cache_layer):
        raise LinearAttentionError(
            f"favor attention (layer {layer_idx}): window layer with a FavorCacheLayer (the cache of plain linear "
            "layers); build the cache with make_favor_cache(model)"
        )
    if is_window_cache_layer(cache_layer):
        # Constant-size path: `key`/`value` are the new tokens; sinks, recent keys and the tail sums are in the state.
        key_padding_mask = new_tokens_padding_mask(key_padding_mask, cache_layer, layer_idx, q_len, k_len)
        with no_redraw(feature_map, active=cache_layer.state is not None):
            return cache_layer.attend(query, key, value, tail_map, window=window, sinks=sinks,
                                      sparse_cache=sparse_cache, tail_cap=tail_cap, tail_gate=tail_gate,
                                      softmax_weight=gamma, key_padding_mask=key_padding_mask, **rule, **common)
    sinks = min(sinks, k_len)  # a sequence shorter than `sinks` has all its tokens as sinks
    if key_padding_mask is not None and key_padding_mask.shape[-1] != k_len:
        raise FavorMaskError(
            f"favor window attention (layer {layer_idx}): the attention mask covers {key_padding_mask.shape[-1]} "
            f"keys but there are {k_len} keys"
        )
    if causal and k_len < q_len:
        raise LinearAttentionError(
            f"favor attention (layer {layer_idx}): causal attention with fewer keys ({k_len}) than queries ({q_len})"
        )
    arguments = dict(window=window, sinks=sinks, causal=causal, softmax_weight=gamma,
                     key_padding_mask=key_padding_mask, sparse_cache=sparse_cache, tail_cap=tail_cap,
                     tail_gate=tail_gate, **rule, **common)
    if causal and k_len > q_len:
        if sparse_cache and settings["sparse_cache_selection"] == "attention":
            raise LinearAttentionError(f"favor attention (layer {layer_idx}): a sparse cache that selects by attention "
                                       "needs past queries, which a key/value cache lacks; use make_favor_cache(model)")
        # A cache holding full keys/values (the default layer): the queries are the last `q_len` positions; run
        # the operator over all keys with placeholder queries for the past ones (exact, O(L) per step).
        placeholder = query.new_zeros(query.shape[0], query.shape[1], k_len - q_len, query.shape[3])
        with no_redraw(feature_map, active=True):
            out = window_linear_attention(torch.cat([placeholder, query], dim=2), key, value, tail_map, **arguments)
        return out[:, :, -q_len:]
    return window_linear_attention(query, key, value, tail_map, **arguments)


AttentionInterface.register(ATTN_IMPLEMENTATION, favor_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, favor_attention_mask)
