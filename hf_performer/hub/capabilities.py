"""What each kind of converted attention layer supports today, as the model card states it.

A Performer model's layers are of a few kinds (:func:`layer_kinds`): linear attention through a feature map, the
sink + sliding-window hybrid (with or without its linear tail), (improved) clustered attention, and layers kept on
exact softmax. :data:`LAYER_BEHAVIOURS` declares, per kind, what ``output_attentions``, packed sequences and decoding
do; the card's "What the attention supports" table is rendered from it. ``tests/test_cards.py`` builds a tiny model
of every kind and checks each declared behaviour against the runtime, so a card cannot keep stating a limitation
that was lifted (or promise what was removed): change the runtime, and that test says which entry to change here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerBehaviour:
    """What one kind of attention layer does (checked against the runtime by ``tests/test_cards.py``).

    Attributes:
        title: the kind's name in the card.
        output_attentions: a full forward with ``output_attentions=True`` returns the ``[B, H, L, L]`` weights the
            layer applies (``False``: it raises an error saying so).
        packed_causal: packed sequences (``DataCollatorWithFlattening``: ``position_ids`` restarting in a row) are
            attended sequence by sequence in a causal model without a cache (``False``: refused with an error).
        packed_bidirectional: the same in a bidirectional model (``cu_seq_lens_q`` / ``cu_seq_lens_k``).
        causal: causal models (decoders) can be converted to this kind.
        cache_layer: the cache layer ``generate()`` gives the layer in a causal model (``None``: not causal).
        constant_cache: that cache layer keeps the same size whatever the context length.
        assisted_decoding: ``generate(prompt_lookup_num_tokens=...)`` / a softmax assistant work (the cache rolls
            rejected candidates back).
        attention_dropout: the source's attention dropout is applied in training.
    """

    title: str
    output_attentions: bool
    packed_causal: bool
    packed_bidirectional: bool
    causal: bool
    cache_layer: str | None
    constant_cache: bool
    assisted_decoding: bool
    attention_dropout: bool


LAYER_BEHAVIOURS: dict[str, LayerBehaviour] = {
    "linear": LayerBehaviour("linear attention", output_attentions=True, packed_causal=True,
                             packed_bidirectional=False, causal=True, cache_layer="FavorCacheLayer",
                             constant_cache=True, assisted_decoding=True, attention_dropout=False),
    "window": LayerBehaviour("sink + window softmax with a linear tail", output_attentions=True, packed_causal=True,
                             packed_bidirectional=True, causal=True, cache_layer="WindowCacheLayer",
                             constant_cache=True, assisted_decoding=True, attention_dropout=False),
    "window-no-tail": LayerBehaviour("sink + window softmax, no tail", output_attentions=True, packed_causal=True,
                                     packed_bidirectional=True, causal=True, cache_layer="WindowCacheLayer",
                                     constant_cache=True, assisted_decoding=True, attention_dropout=False),
    "clustered": LayerBehaviour("clustered attention", output_attentions=True, packed_causal=False,
                                packed_bidirectional=False, causal=False, cache_layer=None, constant_cache=False,
                                assisted_decoding=False, attention_dropout=False),
    "improved-clustered": LayerBehaviour("improved clustered attention", output_attentions=True, packed_causal=False,
                                         packed_bidirectional=False, causal=False, cache_layer=None,
                                         constant_cache=False, assisted_decoding=False, attention_dropout=False),
    "softmax": LayerBehaviour("exact softmax (kept)", output_attentions=True, packed_causal=True,
                              packed_bidirectional=True, causal=True, cache_layer="DynamicLayer",
                              constant_cache=False, assisted_decoding=True, attention_dropout=True),
}
"""Every layer kind :func:`layer_kinds` names, with what it supports today."""


def layer_kinds(settings: dict, num_layers: int) -> list[str]:
    """The kind of each of ``num_layers`` layers (a key of :data:`LAYER_BEHAVIOURS`) from a config's recorded
    ``favor_settings``: kept softmax layers, (improved) clustered attention, window layers (window or sinks > 0, with
    or without the linear tail) and plain linear attention."""
    from ..favor_settings import layer_window

    softmax_layers = set(settings.get("softmax_layers") or [])
    kinds = []
    for layer in range(num_layers):
        window, sinks = layer_window(settings, layer)
        if layer in softmax_layers:
            kinds.append("softmax")
        elif settings.get("attention", "linear") != "linear":
            kinds.append(settings["attention"])
        elif window or sinks:
            kinds.append("window" if settings.get("linear_tail", True) else "window-no-tail")
        else:
            kinds.append("linear")
    return kinds


def layer_ranges(layers: list[int], num_layers: int) -> str:
    """``"all 6 layers"``, ``"layers 0-3"``, ``"layers 1, 4-5"`` or ``"layer 2"``."""
    if len(layers) == num_layers and num_layers > 1:
        return f"all {num_layers} layers"
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    text = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
    return f"layer{'s' if len(layers) > 1 else ''} {text}"


ATTENTION_SELECTION_ROLLBACK = ("refused: the sparse cache chosen by attention scores cannot replay its boundaries "
                                "(`sparse_cache_selection=\"recall\"` can)")
"""The assisted-decoding cell of window layers whose sparse cache is chosen by attention (their boundary queries are
not kept, so rejected candidates cannot be rolled back)."""


def behaviour_rows(kinds: list[str], is_causal: bool, settings: dict | None = None) -> tuple[list[str], list[dict]]:
    """The card's "What the attention supports" table for the kinds present: ``(column titles, rows)``, each row
    ``{"name": ..., "cells": [...]}`` in the columns' order. ``settings`` (the recorded ``favor_settings``) says
    whether window layers choose their sparse cache by attention (:data:`ATTENTION_SELECTION_ROLLBACK`)."""
    from ..favor_settings import layer_sparse_cache

    present = list(dict.fromkeys(kinds))
    behaviours = [LAYER_BEHAVIOURS[kind] for kind in present]

    def yes_no(flag: bool, yes: str, no: str) -> str:
        return yes if flag else no

    rows = [
        {"name": "padding masks", "cells": ["honoured: padded keys get no weight"] * len(present)},
        {"name": "`output_attentions=True`", "cells": [
            yes_no(b.output_attentions, "the `[B, H, L, L]` weights the layer applies, formed on request (O(L^2))",
                   "refused with an error (no weights to return)") for b in behaviours]},
        {"name": "packed sequences (`DataCollatorWithFlattening`)", "cells": [
            yes_no(b.packed_causal if is_causal else b.packed_bidirectional,
                   "attended sequence by sequence (use_cache=False)",
                   "refused with an error: pad the sequences into rows") for b in behaviours]},
        {"name": "attention dropout", "cells": [
            yes_no(b.attention_dropout, "applied in training", "not applied (no attention matrix; warned once)")
            for b in behaviours]},
    ]
    if is_causal:
        rows.append({"name": "decoding cache (`generate`)", "cells": [
            f"`{b.cache_layer}`, " + ("constant size" if b.constant_cache else "grows with every token")
            for b in behaviours]})
        settings = settings or {}
        selected = settings.get("sparse_cache_selection") == "attention" and any(
            layer_sparse_cache(settings, layer) for layer, kind in enumerate(kinds) if kind.startswith("window"))
        rows.append({"name": "prompt lookup / assisted decoding", "cells": [
            ATTENTION_SELECTION_ROLLBACK if selected and kind.startswith("window") else
            yes_no(b.assisted_decoding, "supported (rejected candidates are rolled back; a linear-attention "
                   "assistant model is refused)", "not supported") for kind, b in zip(present, behaviours)]})
    return [LAYER_BEHAVIOURS[kind].title for kind in present], rows
