"""What a model card says about the attention of the model it sits next to: which layers compute what
(:func:`attention_context`), whether the model is ready to use (:func:`status_warning`), and the measured speed,
memory and decoding state of the kinds it has (:func:`speed_context`).

Everything is derived from the folder's recorded ``favor_settings``, the layer kinds of
:mod:`.capabilities` and the committed measurements of ``model_cards/measured_speed.json``; nothing is said of a kind
the model does not have.
"""

from __future__ import annotations

from ..favor_settings import layer_sparse_cache, layer_window
from ..cache import linear_state_bytes
from ..window_state import window_state_bytes
from .capabilities import LAYER_BEHAVIOURS, layer_kinds, layer_ranges
from .describe import (
    FEATURE_MAP_DESCRIPTIONS,
    LINEAR_KINDS,
    MEASURED_SPEED,
    _map_default,
    _map_kind,
    effective_nb_features,
    map_title,
)
from .folder import _human_bytes

def softmax_weight_mode(settings: dict) -> str:
    """``"calibrated"`` or ``"learned"`` (:func:`hf_performer.favor_settings.softmax_weight_mode`), or the recorded
    mode for a map this installation does not register."""
    from ..favor_settings import softmax_weight_mode as resolved_mode

    try:
        return resolved_mode({"feature_map": "favor+", **settings})
    except KeyError:
        return settings.get("softmax_weight", "auto")


def _kind_phrase(kind: str, settings: dict, layer: int, nb_features) -> str:
    """What one layer of ``kind`` computes, in a phrase."""
    feature_map = settings.get("feature_map", "favor+")
    if kind == "linear":
        description = FEATURE_MAP_DESCRIPTIONS.get(feature_map, f"`{feature_map}`")
        size = f", m = {nb_features} features per head" if nb_features else ""
        return f"**{map_title(feature_map)}** linear attention ({description}{size})"
    if kind in ("window", "window-no-tail"):
        window, sinks = layer_window(settings, layer)
        exact = " and ".join(part for part in (
            f"the first {sinks} token{'s' if sinks != 1 else ''} (sinks)" if sinks else "",
            f"the last {window} keys" if window else "") if part)
        if kind == "window-no-tail":
            return f"**sink + sliding-window softmax**: exact softmax over {exact}; older keys are not attended"
        return (f"a **sink + sliding-window hybrid**: exact softmax over {exact}, **{map_title(feature_map)}** linear "
                f"attention over the older keys ({softmax_weight_mode(settings)} softmax weight)")
    if kind in ("clustered", "improved-clustered"):
        clusters = settings.get("clusters")
        if kind == "clustered":
            return (f"**clustered attention**: the queries of each head are grouped into {clusters} clusters and each "
                    "gets its cluster centroid's softmax attention (no feature map; nothing trained)")
        return (f"**improved clustered attention**: {clusters} query clusters per head, exact softmax over each "
                f"cluster's top {settings.get('topk')} keys and the centroid's attention over the others (no "
                "feature map; nothing trained)")
    return "exact softmax attention, kept as in the source"


def attention_context(settings: dict, num_layers: int | None, head_dim: int | None) -> dict:
    """``attention_intro`` (the phrase after "the same architecture and weights, with"), ``attention_rows`` (one
    ``{layers, text}`` per distinct computation, for a model whose layers differ) and ``kinds`` (each layer's kind)."""
    feature_map = settings.get("feature_map", "favor+")
    nb_features = effective_nb_features(feature_map, settings.get("nb_features"), head_dim)
    kinds = layer_kinds(settings, num_layers or 0)
    groups: dict[str, list[int]] = {}
    for layer, kind in enumerate(kinds):
        groups.setdefault(_kind_phrase(kind, settings, layer, nb_features), []).append(layer)
    rows = [{"layers": layer_ranges(layers, len(kinds)), "text": text} for text, layers in groups.items()]
    softmax_layers = [layer for layer, kind in enumerate(kinds) if kind == "softmax"]
    converted = [text for text, layers in groups.items() if kinds[layers[0]] != "softmax"]
    if not kinds:  # a config without the source's layer count: the model-wide setting
        kind = "window" if settings.get("window") or settings.get("sinks") else settings.get("attention", "linear")
        converted = [_kind_phrase(kind, settings, 0, nb_features)]
    if len(converted) == 1:
        except_ = f" except {', '.join(map(str, softmax_layers))}" if softmax_layers else ""
        full = " full" if "window" in converted[0] else ""
        intro = f"every attention layer{except_} computed by {converted[0]} instead of{full} softmax"
        rows = []
    elif not converted:
        intro = "every attention layer kept on exact softmax"
        rows = []
    else:
        intro = "its attention layers replaced as listed below"
    return {"attention_intro": intro, "attention_rows": rows, "kinds": kinds}


def untrained_map_advice(feature_map: str, init: str | None, causal: bool, window: bool) -> str:
    """One sentence on learned maps that were never trained: what that means and the command that trains them
    (``hf-performer linearize`` for a causal LM, ``hf-performer distill`` then fine-tuning for an encoder)."""
    what = "the linear tail (keys older than the window)" if window else "its attention"
    start = f" (initialisation `{init}`)" if init else ""
    text = f"the model's learned `{feature_map}` feature maps are untrained{start}, so {what} does not approximate softmax yet"
    if causal:
        text += " and generated text degrades once the context leaves the window" if window else ""
        return text + (": train it with `hf-performer linearize SOURCE OUTPUT --train-file TEXT` (attention transfer, "
                       "then LoRA) before use")
    return text + ": train them by attention transfer (`hf-performer distill`) and fine-tune the model before use"


def _largest_error(report: dict | None) -> float | None:
    errors = [layer["own_inputs_relative_error"] for layer in (report or {}).get("layers", [])
              if (layer.get("kind") or layer.get("attention")) != "softmax"]
    return max(errors) if errors else None


def status_warning(*, kinds: list[str], settings: dict, is_causal: bool, fine_tuned: bool, transfer, linearize,
                   report: dict | None) -> str | None:
    """The card's warning (a blockquote) when the model is not ready to use as it is, ``None`` when it was trained
    after conversion. Derived from the flow that wrote the folder and, for a plain conversion, from the fidelity
    report's numbers (so it never contradicts the table below it)."""
    if fine_tuned:
        return None
    feature_map = settings.get("feature_map", "favor+")
    learned = _map_kind(feature_map) == "learned" and any(kind in LINEAR_KINDS for kind in kinds)
    window = any(kind in ("window", "window-no-tail") for kind in kinds)
    init = (settings.get("feature_map_options") or {}).get("init", _map_default(feature_map, "init"))
    if transfer is not None or (linearize is not None and linearize["transfer_done"]):
        return ("> **Attention transfer only, not fine-tuned.** The feature maps were trained to mimic the source's "
                "softmax\n> attention (see Attention transfer below) and every other weight is the source's. This "
                "narrows the gap to\n> the softmax model without closing it (compare before and after below): "
                "evaluate the model on your task\n> and fine-tune it before use.")
    if learned:
        return f"> **Converted, not trained.** Right after conversion {untrained_map_advice(feature_map, init, is_causal, window)}."
    if any(kind in ("clustered", "improved-clustered") for kind in kinds):
        return ("> **Zero-shot, not fine-tuned.** Clustered attention approximates softmax attention without training "
                "(its\n> clusters are computed for each input): the fidelity report below shows how close this model "
                "stays; evaluate\n> it on your task, and fine-tune it if the gap matters.")
    largest = _largest_error(report)
    close = largest is not None and largest < 0.01
    reproduce = (f"reproduces its softmax outputs closely on the report's inputs (largest layer error {largest:.4f})"
                 if close else "does not reproduce its softmax outputs (see the fidelity report below)")
    warning = f"> **Converted, not fine-tuned.** Right after conversion a pretrained model {reproduce}"
    if close:
        return warning + ", but\n> longer or other inputs may differ more: evaluate it on your task before use."
    if feature_map == "favor+" and not window:
        return warning + (": fine-tune it before use. The Performer paper reports 0.07\n> accuracy right after "
                          "loading pretrained weights into FAVOR+, recovered in a small fraction of the\n> original "
                          "training.")
    return warning + ": fine-tune it before use."


def _count(number: int, noun: str) -> str:
    """``"2 window layers keep"`` / ``"1 window layer keeps"``."""
    return f"{number} {noun}s keep" if number != 1 else f"{number} {noun} keeps"


def speed_context(kinds: list[str], settings: dict, geometry: dict, is_causal: bool, dtype_bytes: int) -> dict:
    """The measured speed, memory and decoding notes of the kinds present (``model_cards/measured_speed.json``)."""
    head_dim = geometry["head_dim"] or 64
    heads = geometry["num_heads"] or 0
    kv_heads = geometry["num_kv_heads"] or heads
    feature_map = settings.get("feature_map", "favor+")
    nb_features = effective_nb_features(feature_map, settings.get("nb_features"), head_dim) or head_dim
    present = set(kinds) or {"linear"}
    max_positions = geometry["max_positions"]
    crossover = MEASURED_SPEED["linear"]["crossover_causal" if is_causal else "crossover_bidirectional"]
    mode = "causal" if is_causal else "bidirectional"
    name = "FAVOR+" if feature_map == "favor+" else "linear attention"
    measured = mode if feature_map == "favor+" else f"FAVOR+ {mode}"
    if max_positions is not None and max_positions <= crossover:
        length_note = (f"At this model's maximum length of {max_positions} tokens {name} is **not faster** than "
                       f"softmax attention (measured {measured} crossover: ~{crossover} tokens); its benefit needs "
                       "longer inputs.")
    else:
        length_note = (f"This model accepts up to {max_positions if max_positions is not None else 'any number of'} "
                       f"tokens; {name} pays off only on inputs longer than the {measured} crossover (~{crossover} "
                       "tokens measured): at 512 tokens softmax attention is faster.")
    decoding = []
    if is_causal:
        linear_layers = kinds.count("linear")
        if linear_layers:
            state = linear_layers * linear_state_bytes(heads, head_dim, nb_features)
            decoding.append(f"the {_count(linear_layers, 'linear-attention layer')} a "
                            f"recurrent state (`FavorCacheLayer`: `S [heads, m, d]`, `z [heads, m]`) of "
                            f"{_human_bytes(state)} in all (float32), whatever the context length")
        window_layers = [layer for layer, kind in enumerate(kinds) if kind in ("window", "window-no-tail")]
        if window_layers:
            state = sum(window_state_bytes(kv_heads, head_dim, nb_features, *layer_window(settings, layer), dtype_bytes,
                                           sparse_cache=layer_sparse_cache(settings, layer),
                                           chunk_size=settings.get("chunk_size", 64),
                                           linear_tail=kinds[layer] == "window") for layer in window_layers)
            decoding.append(f"the {_count(len(window_layers), 'window layer')} a "
                            f"`WindowCacheLayer` (sink and window keys/values, the sparse cache's kept keys, the tail sums) of "
                            f"{_human_bytes(state)} in all once the context is longer than the window")
        softmax_layers = kinds.count("softmax")
        if softmax_layers:
            per_token = 2 * softmax_layers * kv_heads * head_dim * dtype_bytes
            decoding.append(f"the {_count(softmax_layers, 'softmax layer')} a key/value cache that grows by {_human_bytes(per_token)} per token")
    kv_per_token = 2 * (geometry["num_layers"] or 0) * kv_heads * head_dim * dtype_bytes
    return {
        "speed": MEASURED_SPEED,
        "speed_linear": bool(present & {"linear"}) or not (present - {"softmax"}),
        "speed_window": bool(present & {"window", "window-no-tail"}),
        "speed_clustered": bool(present & {"clustered", "improved-clustered"}),
        "nb_features": nb_features,
        "flop_parity": 2 * nb_features,
        "max_length_note": length_note,
        "decoding_notes": decoding,
        "kv_bytes_per_token_human": _human_bytes(kv_per_token),
        "constant_decoding": is_causal and all(LAYER_BEHAVIOURS[kind].constant_cache for kind in kinds if kind),
    }
