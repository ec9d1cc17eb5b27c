"""What the model card says about a model: feature-map descriptions, setting meanings, citations, speed and
attention-transfer context.

The citations and the measured speeds the cards quote are data files of ``hf_performer.model_cards``
(``citations.json``, ``measured_speed.json``), read once at import.
"""

from __future__ import annotations

import inspect
import json
import os
from importlib.resources import files

from .folder import ModelCardError, _human_bytes
from .results import _is_number


def _card_data(name: str) -> dict:
    """A JSON data file of ``hf_performer.model_cards`` (its ``_comment`` key dropped)."""
    data = json.loads((files("hf_performer.model_cards") / name).read_text(encoding="utf-8"))
    data.pop("_comment", None)
    return data


WINDOW_SETTING_MEANINGS = {
    "window": "sliding window of exact softmax attention (keys i-window+1..i; encoders: abs(i-j) < window); 0: none",
    "sinks": "first unpadded tokens of each row always attended with exact softmax (attention sinks; [CLS] for "
             "encoders); 0: none",
    "softmax_weight": "weight of the exact terms against the linear tail (`calibrated`: 1, tail on the softmax scale; "
    "`learned`: a trained gamma per head; `auto`: learned for learned maps)",
    "layer_windows": "per-layer overrides of window / sinks",
    "linear_tail": "keys older than the window attended through the feature map (no: sinks + window only)",
}
"""Meanings of the sink + sliding-window keys, the same for every kind of feature map."""

SETTING_MEANINGS = {
    "feature_map": "feature map (`favor+`: positive random features, unbiased for softmax)",
    "nb_features": "random features per head (`m`)",
    "orthogonal": "orthogonal (rather than iid) random projections",
    "row_norms": "norms of the projection rows (`chi`: unbiased; `fixed`: all sqrt(d))",
    "redraw_interval": "training forward calls between projection redraws (0: never)",
    "seed": "seed of the projections (layer i uses seed + i)",
    "chunk_size": "chunk size of the causal scan",
    "softmax_layers": "layers kept on exact softmax attention",
    "feature_map_options": "the map's own options (e.g. `feature_epsilon` of `relu`; none: its defaults)",
    **WINDOW_SETTING_MEANINGS,
}
"""Meanings of the ``favor_settings`` keys for *random* feature maps (favor+, trig, relu), in the card's row order.
Learned and deterministic maps read the same keys differently: see :func:`setting_meanings`."""

LEARNED_SETTING_MEANINGS = {
    "feature_map": "learned feature map",
    "nb_features": "features per head (`m`), computed from a trainable projection per head",
    "seed": "seed of the `favor+` initialisation of the learned projections (layer i uses seed + i)",
    "chunk_size": SETTING_MEANINGS["chunk_size"],
    "softmax_layers": SETTING_MEANINGS["softmax_layers"],
    "feature_map_options": "the map's own options: `init` (start of the learned projections: `identity` or "
    "`favor+`), `tie_qk` (queries and keys share one set of parameters); none: the map's defaults",
    **WINDOW_SETTING_MEANINGS,
}
"""Meanings of the ``favor_settings`` keys for *learned* feature maps (hedgehog, t2r): no random projection; the seed
only draws the optional ``"favor+"`` initialisation."""

DETERMINISTIC_SETTING_MEANINGS = {
    "feature_map": "deterministic feature map, nothing random or trained",
    "nb_features": "features per head: always the head dimension",
    "chunk_size": SETTING_MEANINGS["chunk_size"],
    "softmax_layers": SETTING_MEANINGS["softmax_layers"],
    "feature_map_options": "the map's own options (none: its defaults)",
    **WINDOW_SETTING_MEANINGS,
}
"""Meanings of the ``favor_settings`` keys for *deterministic* feature maps (elu+1)."""

FEATURE_MAP_DESCRIPTIONS = {
    "favor+": "`favor+`: positive random features, unbiased for softmax",
    "trig": "`trig`: random Fourier features, unbiased for softmax but not positive",
    "relu": "`relu`: the Performer's generalised ReLU kernel on random projections, not a softmax estimator",
    "elu+1": "`elu+1`: elu(x) + 1, a different kernel, not an estimator of softmax",
    "hedgehog": "`hedgehog`: [softmax(z), softmax(-z)] with z = x W + b, W and b trainable per head",
    "t2r": "`t2r`: relu(x W + b) + eps, W and b trainable per head",
}
"""What each feature map computes (the ``feature_map`` row of the settings table)."""

_CITATIONS = _card_data("citations.json")

PAPERS = {key: {**paper, "bibtex": "\n".join(paper["bibtex"])} for key, paper in _CITATIONS["papers"].items()}
"""Papers the cards cite (``model_cards/citations.json``): ``cite`` (the link text), ``url`` and a BibTeX entry."""

FEATURE_MAP_PAPERS = _CITATIONS["feature_map_papers"]
"""The paper (a key of :data:`PAPERS`) each feature map comes from. The Performer paper (``choromanski2021``) is
cited by every card; attention transfer adds the Hedgehog paper (its softmax-mimicry loss)."""

TRANSFER_LOSSES = {
    "weights": "KL divergence between the softmax and linear attention weights (Hedgehog)",
    "output": "squared error between the softmax and linear attention outputs (LoLCATs)",
    "both": "KL divergence of the attention weights plus squared error of the attention outputs",
}

MEASURED_SPEED = _card_data("measured_speed.json")
"""The committed CPU measurement (``model_cards/measured_speed.json``, a copy of
``benchmarks/results/attention_speed.json``), quoted in every card; a test keeps the two equal, so re-running the
benchmark means updating the data file."""


def _map_kind(name: str) -> str | None:
    """``"random"``, ``"learned"`` or ``"deterministic"`` (``None`` for a map not registered in this process)."""
    from ..favor_settings import feature_map_kind

    try:
        return feature_map_kind(name)
    except KeyError:
        return None


def _map_default(name: str, option: str):
    """The default of a feature map's keyword ``option`` (``init``, ``nb_features``, ...), or ``None``."""
    from ..feature_maps import FEATURE_MAPS, default_feature_map_init

    factory = FEATURE_MAPS.get(name)
    if factory is None:
        return None
    if option == "init" and default_feature_map_init(name) is not None:  # learned maps resolve init=None to it
        return default_feature_map_init(name)
    try:
        parameter = inspect.signature(factory).parameters.get(option)
    except (TypeError, ValueError):  # pragma: no cover - a factory without a signature
        return None
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return None
    return parameter.default


def effective_nb_features(feature_map: str, nb_features, head_dim: int | None) -> int | None:
    """The number ``m`` of features per head a map really uses (:func:`hf_performer.favor_settings.effective_nb_features`),
    for a card that may not know the head size (``None``) or name a map this installation does not register."""
    from ..favor_settings import effective_nb_features as layer_nb_features
    from ..feature_maps import FEATURE_MAPS

    if nb_features is not None or feature_map not in FEATURE_MAPS:
        return nb_features if nb_features is not None else head_dim
    if head_dim is None and _map_kind(feature_map) != "random":
        return None
    return layer_nb_features({"feature_map": feature_map, "nb_features": None}, head_dim)


def setting_meanings(settings: dict, head_dim: int | None = None) -> dict[str, str]:
    """What each ``favor_settings`` key means for this feature map (the settings table of the card).

    Random maps (favor+, trig, relu) use :data:`SETTING_MEANINGS`, learned maps (hedgehog, t2r)
    :data:`LEARNED_SETTING_MEANINGS` (with the effective ``init`` and whether the seed is used), deterministic maps
    (elu+1) :data:`DETERMINISTIC_SETTING_MEANINGS`. An ``nb_features`` of ``None`` is explained as the map's default
    size (computed from ``head_dim`` when known)."""
    from ..feature_maps import FEATURE_MAPS

    name = settings.get("feature_map", "favor+")
    kind = _map_kind(name)
    table = {"learned": LEARNED_SETTING_MEANINGS, "deterministic": DETERMINISTIC_SETTING_MEANINGS}.get(kind, SETTING_MEANINGS)
    meanings = dict(table)
    if name == "favor+":
        meanings["feature_map"] = SETTING_MEANINGS["feature_map"]
    elif name in FEATURE_MAP_DESCRIPTIONS:
        prefix = "feature map" if kind == "random" else meanings["feature_map"]
        meanings["feature_map"] = f"{prefix} ({FEATURE_MAP_DESCRIPTIONS[name]})"
    elif kind is None:
        meanings["feature_map"] = f"feature map (`{name}`: not registered here; see its code)"
    options = settings.get("feature_map_options") or {}
    if kind == "learned":
        init = options.get("init", _map_default(name, "init"))
        default_init = _map_default(name, "init")
        meanings["feature_map_options"] = (
            "the map's own options: `init` (start of the learned projections: `identity` or `favor+`; default "
            f"`{default_init}`), `tie_qk` (queries and keys share one set of parameters; default no)"
            + (", `feature_epsilon` (added to every feature)" if _map_default(name, "feature_epsilon") is not None else "")
            + "; none: the map's defaults"
        )
        if init == "identity":
            meanings["seed"] += "; unused here (`init` is `identity`)"
    m = effective_nb_features(name, None, head_dim)
    if settings.get("nb_features", 0) is None:
        if kind == "learned":
            factor = getattr(FEATURE_MAPS.get(name), "features_per_projection", 1)
            size = f"{factor} x head dim" if factor != 1 else "the head dim"
            meanings["nb_features"] += f"; `None`: the map's default size, {size}" + (f" = {m}" if m else "")
        elif kind == "deterministic":
            meanings["nb_features"] = "features per head; `None`: the map's own size, the head dim" + (f" = {m}" if m else "")
        else:
            meanings["nb_features"] += "; `None`: the map's default size" + (f" ({m})" if m else "")
    elif kind == "learned" and getattr(FEATURE_MAPS.get(name), "features_per_projection", 1) == 2:
        meanings["nb_features"] += " (2 features per projection row)"
    return meanings


def window_summary(settings: dict) -> str | None:
    """One phrase on the sink + sliding-window hybrid of ``settings`` (``None`` without window layers), e.g.
    ``"exact softmax over 4 sink tokens and a sliding window of 64 tokens, `hedgehog` for older keys (learned
    softmax weight)"``."""
    overrides = settings.get("layer_windows") or {}
    window, sinks = settings.get("window", 0), settings.get("sinks", 0)
    if not (window or sinks or overrides):
        return None
    exact = " and ".join(
        part for part in (f"{sinks} sink token{'s' if sinks != 1 else ''}" if sinks else "",
                          f"a sliding window of {window} tokens" if window else "") if part
    ) or "no window"
    tail = (f"`{settings.get('feature_map', 'favor+')}` for older keys" if settings.get("linear_tail", True)
            else "no linear tail")
    text = f"exact softmax over {exact}, {tail}"
    if settings.get("linear_tail", True) and (window or sinks):
        mode = settings.get("softmax_weight", "auto")
        if mode == "auto":
            mode = "learned" if _map_kind(settings.get("feature_map", "favor+")) == "learned" else "calibrated"
        text += f" ({mode} softmax weight)"
    if overrides:
        text += "; per-layer overrides " + ", ".join(
            f"layer {layer}: " + ", ".join(f"{key} {value}" for key, value in values.items())
            for layer, values in overrides.items()
        )
    return text


def _citations(feature_map: str, distilled: bool) -> tuple[dict | None, list[str]]:
    """The feature map's paper (``None`` if unknown) and the BibTeX entries of the card's Citation section: the
    map's paper, the Performer paper, and with attention transfer the Hedgehog paper."""
    key = FEATURE_MAP_PAPERS.get(feature_map)
    keys = [key] if key else []
    keys.append("choromanski2021")
    if distilled:
        keys.append("zhang2024")
    keys = list(dict.fromkeys(keys))
    return (PAPERS[key] if key else None), [PAPERS[k]["bibtex"] for k in keys]


def _describe_map(feature_map: str, kind: str | None, settings: dict, distilled: bool) -> dict:
    """Wording of the card that depends on the feature map: names, warning, fidelity and quality notes."""
    is_favor = feature_map == "favor+"
    options = settings.get("feature_map_options") or {}
    init = options.get("init", _map_default(feature_map, "init"))
    if is_favor:
        fidelity_note = (
            "A relative error near 1 means the layer output is essentially re-learned: trained softmax attention is peaky\n"
            "and the FAVOR+ estimator's variance is large there. This is expected after the swap: accuracy has to be\n"
            "recovered by fine-tuning (see Results)."
        )
        quality = ("FAVOR+ is an approximation of softmax attention; published conversions with fixed random features\n"
                   "  trail softmax on some tasks (e.g. CoLA) even after fine-tuning. Check the results above for this model.")
    elif kind == "learned" and distilled:
        fidelity_note = (
            "These errors remain after attention transfer (the section above gives the values before it): each layer\n"
            "was trained on the softmax model's own inputs, and what it did not learn adds up through the layers (the\n"
            "propagated column). Fine-tune the whole model to recover the rest (see Results)."
        )
        quality = (f"`{feature_map}` features are trained to mimic softmax attention, but remain an approximation of it;\n"
                   "  check the results above for this model.")
    elif kind == "learned":
        fidelity_note = (
            f"The learned `{feature_map}` feature maps of this folder are untrained (initialisation `{init}`), so they do\n"
            "not approximate softmax attention yet and large errors are expected: train them by attention transfer\n"
            "(`hf-performer distill`), then fine-tune (see Results)."
        )
        quality = (f"`{feature_map}` features approximate softmax attention only once trained (attention transfer or\n"
                   "  fine-tuning); check the results above for this model.")
    elif kind == "deterministic" or feature_map == "relu":
        fidelity_note = (
            f"`{feature_map}` is not an estimator of softmax attention but a different kernel, so a relative error near 1\n"
            "is expected after the swap: accuracy has to be recovered by fine-tuning (see Results)."
        )
        quality = (f"`{feature_map}` replaces softmax attention by a different kernel rather than approximating it;\n"
                   "  check the results above for this model.")
        if feature_map == "relu":  # a random map, but not an estimator of softmax
            quality = quality.replace("check the results", "published conversions with fixed random features trail "
                                      "softmax on some\n  tasks (e.g. CoLA) even after fine-tuning. Check the results")
    else:
        fidelity_note = (
            "A relative error near 1 means the layer output is essentially re-learned: trained softmax attention is peaky\n"
            f"and the `{feature_map}` random-feature approximation is poor there. This is expected after the swap: accuracy\n"
            "has to be recovered by fine-tuning (see Results)."
        )
        estimate = ("estimates softmax attention without bias but with a large variance (and denominators that\n"
                    "  can vanish)" if feature_map == "trig" else "is an approximation of softmax attention")
        quality = (f"`{feature_map}` linear attention {estimate}; published conversions with fixed random features\n"
                   "  trail softmax on some tasks (e.g. CoLA) even after fine-tuning. Check the results above for this model.")
    if distilled:
        warning = (
            "> **Attention transfer only, not fine-tuned.** The feature maps were trained to mimic the source's softmax\n"
            "> attention (see Attention transfer below) and every other weight is the source's. This narrows the gap to\n"
            "> the softmax model without closing it (compare before and after below): evaluate the model on your task\n"
            "> and fine-tune it before use."
        )
    elif is_favor:
        warning = (
            "> **Converted, not fine-tuned.** Right after conversion a pretrained model does not reproduce its softmax\n"
            "> outputs (see the fidelity report below): fine-tune it before use. The Performer paper reports 0.07\n"
            "> accuracy right after loading pretrained weights into FAVOR+, recovered in a small fraction of the\n"
            "> original training."
        )
    elif kind == "learned":
        warning = (
            "> **Converted, not fine-tuned.** Right after conversion a pretrained model does not reproduce its softmax\n"
            f"> outputs (see the fidelity report below), and its learned `{feature_map}` feature maps are untrained\n"
            f"> (initialisation `{init}`): train them by attention transfer (`hf-performer distill`) and fine-tune the\n"
            "> model before use."
        )
    else:
        warning = (
            "> **Converted, not fine-tuned.** Right after conversion a pretrained model does not reproduce its softmax\n"
            "> outputs (see the fidelity report below): fine-tune it before use."
        )
    return {
        "is_favor": is_favor,
        "feature_map": feature_map,
        "feature_map_kind": kind or "unknown",
        "feature_map_title": "FAVOR+" if is_favor else f"`{feature_map}`",
        "attention_name": "FAVOR+" if is_favor else "linear attention",
        "features_word": {"random": "random", "learned": "learned", "deterministic": "deterministic"}.get(kind, ""),
        "not_fine_tuned_warning": warning,
        "fidelity_note": fidelity_note,
        "quality_note": quality,
    }


def _speed_context(settings: dict, geometry: dict, is_causal: bool, dtype_bytes: int) -> dict:
    head_dim = geometry["head_dim"] or 64
    feature_map = settings.get("feature_map", "favor+")
    # nb_features None: the map's own size (elu+1: d; hedgehog: 2d; t2r: d).
    nb_features = effective_nb_features(feature_map, settings.get("nb_features"), head_dim) or head_dim
    name = "FAVOR+" if feature_map == "favor+" else "linear attention"
    crossover = MEASURED_SPEED["crossover_causal" if is_causal else "crossover_bidirectional"]
    max_positions = geometry["max_positions"]
    kind = "causal" if is_causal else "bidirectional"
    measured = kind if feature_map == "favor+" else f"FAVOR+ {kind}"
    if max_positions is not None and max_positions <= crossover:
        note = (
            f"At this model's maximum length of {max_positions} tokens {name} is **not faster** than softmax "
            f"attention (measured {measured} crossover: ~{crossover} tokens); its benefit needs longer inputs."
        )
    else:
        note = (
            f"This model accepts up to {max_positions if max_positions is not None else 'any number of'} tokens; "
            f"{name} pays off only on inputs longer than the {measured} crossover (~{crossover} tokens measured): at "
            "512 tokens softmax attention is faster."
        )
    layers = geometry["num_layers"] or 0
    softmax_layers = settings.get("softmax_layers") or []
    favor_layers = max(layers - len(softmax_layers), 0)
    heads = geometry["num_heads"] or 0
    state_bytes = favor_layers * heads * (nb_features * head_dim + nb_features + 1) * 4
    kv_per_token = 2 * layers * (geometry["num_kv_heads"] or heads) * head_dim * dtype_bytes
    state_note = _human_bytes(state_bytes)
    if softmax_layers:
        state_note += f" (plus a growing key/value cache for the {len(softmax_layers)} softmax layers)"
    return {
        "flop_parity": 2 * nb_features,
        "nb_features": nb_features,
        "max_length_note": note,
        "state_bytes_human": state_note,
        "kv_bytes_per_token_human": _human_bytes(kv_per_token),
        "speed": MEASURED_SPEED,
    }

# --------------------------------------------------------------------------------------------
# Attention transfer (attention_transfer.json of `hf-performer distill`)
# --------------------------------------------------------------------------------------------


def _transfer_field(record: dict, path: str, where: str, check, expected: str, required: bool = True):
    """``record[a][b]...`` for ``path = "a.b"``, checked by ``check`` (raises :class:`ModelCardError`)."""
    value = record
    walked = []
    for part in path.split("."):
        if not isinstance(value, dict):
            raise ModelCardError(f"{where}: '{'.'.join(walked)}' must be an object, got {type(value).__name__}")
        walked.append(part)
        if part not in value:
            if not required:
                return None
            raise ModelCardError(f"{where}: '{path}' is missing (not an attention_transfer.json of hf-performer distill?)")
        value = value[part]
    if not required and value is None:
        return None
    if not check(value):
        raise ModelCardError(f"{where}: '{path}' must be {expected}, got {value!r}")
    return value


def _layer_losses(losses: dict, path: str, where: str) -> dict[int, dict]:
    """``{layer: {"weights_kl": ..., ...}}`` from ``transfer.layer_losses_*`` (JSON keys are strings)."""
    parsed = {}
    for key, entry in losses.items():
        try:
            layer = int(key)
        except (TypeError, ValueError):
            raise ModelCardError(f"{where}: '{path}' keys must be layer indices, got {key!r}") from None
        if not isinstance(entry, dict):
            raise ModelCardError(f"{where}: '{path}.{key}' must be an object, got {entry!r}")
        for name in ("weights_kl", "output_squared_error"):
            if entry.get(name) is not None and not _is_number(entry[name]):
                raise ModelCardError(f"{where}: '{path}.{key}.{name}' must be a number, got {entry[name]!r}")
        parsed[layer] = entry
    return parsed


def _fidelity_layers(record: dict, name: str, where: str) -> dict[int, dict]:
    layers = _transfer_field(record, f"{name}.layers", where, lambda v: isinstance(v, list) and len(v) > 0,
                             "a non-empty list of layers")
    parsed = {}
    for index, entry in enumerate(layers):
        if not (isinstance(entry, dict) and isinstance(entry.get("layer"), int) and not isinstance(entry["layer"], bool)
                and _is_number(entry.get("own_inputs_relative_error"))):
            raise ModelCardError(
                f"{where}: '{name}.layers[{index}]' must hold an int 'layer' and a number "
                f"'own_inputs_relative_error', got {entry!r}"
            )
        parsed[entry["layer"]] = entry
    return parsed


def _format_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds:.1f} s ({seconds / 60:.1f} min)"
    return f"{seconds:.0f} s ({seconds / 3600:.1f} h)"


def _format_number(value) -> str:
    return "–" if value is None else f"{value:.4f}"


def transfer_context(record: dict, where: str | None = None, feature_map: str | None = None) -> dict:
    """What the card's "Attention transfer" section shows, read from an ``attention_transfer.json`` record.

    Checked (a :class:`ModelCardError` names the first bad field): ``data`` (``file``, ``layout``, ``sequences``,
    ``max_length``), ``transfer`` (``steps``, ``loss``, ``learning_rate``, ``layer_losses_before`` /
    ``layer_losses_after`` keyed by layer index), ``fidelity_before`` / ``fidelity_after`` (``layers`` with
    ``own_inputs_relative_error``, ``final_hidden_state_cosine``), ``wall_time_s``; ``feature_map``, when present,
    must be the folder's. Only the data file's base name is kept (no local path reaches the card), and neither
    ``source`` nor ``command`` is shown.
    """
    if where is None:
        from ..conversion.attention_transfer import TRANSFER_FILE_NAME as where
    if not isinstance(record, dict):
        raise ModelCardError(f"{where}: expected a JSON object, got {type(record).__name__}")
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    is_str = lambda v: isinstance(v, str) and v != ""  # noqa: E731
    data_file = _transfer_field(record, "data.file", where, is_str, "a file name")
    layout = _transfer_field(record, "data.layout", where, is_str, "a string")
    sequences = _transfer_field(record, "data.sequences", where, is_int, "an int")
    max_length = _transfer_field(record, "data.max_length", where, is_int, "an int")
    batch_size = _transfer_field(record, "data.batch_size", where, is_int, "an int", required=False)
    fidelity_sequences = _transfer_field(record, "data.fidelity_sequences", where, is_int, "an int", required=False)
    steps = _transfer_field(record, "transfer.steps", where, is_int, "an int")
    loss = _transfer_field(record, "transfer.loss", where, is_str, "a string")
    learning_rate = _transfer_field(record, "transfer.learning_rate", where, _is_number, "a number")
    trained = _transfer_field(record, "transfer.layers", where,
                              lambda v: isinstance(v, list) and all(is_int(i) for i in v), "a list of layer indices",
                              required=False)
    is_dict = lambda v: isinstance(v, dict)  # noqa: E731
    losses_before = _layer_losses(_transfer_field(record, "transfer.layer_losses_before", where, is_dict, "an object"),
                                  "transfer.layer_losses_before", where)
    losses_after = _layer_losses(_transfer_field(record, "transfer.layer_losses_after", where, is_dict, "an object"),
                                 "transfer.layer_losses_after", where)
    before = _fidelity_layers(record, "fidelity_before", where)
    after = _fidelity_layers(record, "fidelity_after", where)
    cosine_before = _transfer_field(record, "fidelity_before.final_hidden_state_cosine", where, _is_number, "a number")
    cosine_after = _transfer_field(record, "fidelity_after.final_hidden_state_cosine", where, _is_number, "a number")
    logits_before = _transfer_field(record, "fidelity_before.logits_relative_error", where, _is_number, "a number",
                                    required=False)
    logits_after = _transfer_field(record, "fidelity_after.logits_relative_error", where, _is_number, "a number",
                                   required=False)
    wall_time = _transfer_field(record, "wall_time_s", where, lambda v: _is_number(v) and v >= 0,
                                "a number of seconds")
    recorded_map = _transfer_field(record, "feature_map", where, is_str, "a string", required=False)
    if feature_map is not None and recorded_map is not None and recorded_map != feature_map:
        raise ModelCardError(
            f"{where}: records attention transfer into the {recorded_map!r} feature map, but config.json uses "
            f"{feature_map!r}: the file does not belong to this model"
        )

    rows = []
    for layer in sorted(set(before) | set(after)):
        old, new = before.get(layer), after.get(layer)
        attention = (new or old).get("attention", "favor")
        if attention == "favor" and trained is not None and layer not in trained:
            attention = "favor (not trained)"
        kl_before = (losses_before.get(layer) or {}).get("weights_kl")
        kl_after = (losses_after.get(layer) or {}).get("weights_kl")
        rows.append({
            "layer": layer,
            "attention": attention,
            "error_before": _format_number(old and old["own_inputs_relative_error"]),
            "error_after": _format_number(new and new["own_inputs_relative_error"]),
            "kl_before": _format_number(kl_before),
            "kl_after": _format_number(kl_after),
        })
    return {
        "data_file": os.path.basename(data_file.replace("\\", "/").rstrip("/")) or data_file,
        "layout": layout,
        "sequences": sequences,
        "max_length": max_length,
        "batch_size": batch_size,
        "fidelity_sequences": fidelity_sequences,
        "steps": steps,
        "loss": loss,
        "loss_meaning": TRANSFER_LOSSES.get(loss, ""),
        "learning_rate": f"{learning_rate:g}",
        "layers_trained": trained,
        "wall_time": _format_duration(float(wall_time)),
        "rows": rows,
        "cosine_before": f"{cosine_before:.4f}",
        "cosine_after": f"{cosine_after:.4f}",
        "logits_before": None if logits_before is None else f"{logits_before:.4f}",
        "logits_after": None if logits_after is None else f"{logits_after:.4f}",
        "fidelity_after": record["fidelity_after"],
    }

