"""What the model card says about a feature map and its settings: descriptions, setting meanings, citations and
the notes on fidelity and quality (the attention's layer kinds, status and speed: :mod:`.summary`; the run records:
:mod:`.runs`).

The citations and the measured speeds the cards quote are data files of ``hf_performer.model_cards``
(``citations.json``, ``measured_speed.json``), read once at import.
"""

from __future__ import annotations

import inspect
import json
from importlib.resources import files


LINEAR_KINDS = ("linear", "window")
"""Layer kinds that run the feature map (the others: no feature map, or none used)."""


def uses_feature_map(kinds: list[str]) -> bool:
    """Whether some layer of these kinds runs the feature map (no kinds: a plain linear-attention model)."""
    return not kinds or any(kind in LINEAR_KINDS for kind in kinds)


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
    "sparse_cache": "causal window layers: per key head, this many older tokens stay exact, the ones the linear tail "
                    "would recall worst (LoLA); 0: none",
    "sparse_cache_selection": "how the sparse cache chooses its tokens (`recall`: the ones the linear tail would recall "
                              "worst; `attention`: the ones the boundary's query attends to most)",
    "sparse_cache_span": "each candidate of the sparse cache ranked by its score averaged over this many neighbouring "
                         "candidates (whole spans; 1: each token on its own)",
    "tail_cap": "causal window layers: a linear tail of n > tail_cap tokens is weighed by tail_cap / n; 0: unbounded",
    "tail_gate": "causal window layers: a learned exponent alpha per head weighs a linear tail of n tokens by "
                 "n ** -alpha (`favor_tail_gate`)",
    "layer_windows": "per-layer overrides of window / sinks / sparse_cache",
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

CLUSTERED_SETTING_MEANINGS = {
    "attention": "attention kind (`clustered`: every query gets its cluster centroid's softmax attention; "
                 "`improved-clustered`: plus exact softmax over each cluster's top keys)",
    "clusters": "query clusters per head (K-means on hashed queries, computed for each input)",
    "topk": "keys per cluster attended with exact softmax (at most the input length)",
    "seed": "seed of the query hashing (layer i uses seed + i)",
    "softmax_layers": SETTING_MEANINGS["softmax_layers"],
}
"""Meanings of the ``favor_settings`` keys of (improved) clustered attention; the feature-map keys a config records
are not used by it and are left out of the card's table."""

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
    (elu+1) :data:`DETERMINISTIC_SETTING_MEANINGS`, (improved) clustered attention
    :data:`CLUSTERED_SETTING_MEANINGS` (its keys only). An ``nb_features`` of ``None`` is explained as the map's
    default size (computed from ``head_dim`` when known)."""
    from ..feature_maps import FEATURE_MAPS

    if settings.get("attention", "linear") != "linear":
        return dict(CLUSTERED_SETTING_MEANINGS)
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


ATTENTION_PAPERS = _CITATIONS["attention_papers"]
"""The paper (a key of :data:`PAPERS`) of each layer kind that is not plain linear attention (clustered attention,
the sink + window hybrid)."""


def _citations(feature_map: str, kinds: list[str], distilled: bool) -> tuple[dict | None, list[str]]:
    """The paper shown next to the model's attention (``None`` if unknown) and the BibTeX entries of the card's
    Citation section: the papers of its layer kinds and of its feature map (when a layer uses it), the Performer
    paper, and with attention transfer the Hedgehog paper."""
    kind_keys = [ATTENTION_PAPERS[kind] for kind in dict.fromkeys(kinds) if kind in ATTENTION_PAPERS]
    map_key = FEATURE_MAP_PAPERS.get(feature_map) if uses_feature_map(kinds) else None
    keys = [*kind_keys, *([map_key] if map_key else []), "choromanski2021", *(["zhang2024"] if distilled else [])]
    keys = list(dict.fromkeys(keys))
    shown = kind_keys[0] if kind_keys else map_key
    return (PAPERS[shown] if shown else None), [PAPERS[key]["bibtex"] for key in keys]


def describe_map(feature_map: str, kinds: list[str], settings: dict, distilled: bool) -> dict:
    """Wording of the card that depends on the feature map and the layer kinds: names, and the notes under the
    fidelity table and on quality."""
    kind = _map_kind(feature_map)
    is_favor = feature_map == "favor+"
    options = settings.get("feature_map_options") or {}
    init = options.get("init", _map_default(feature_map, "init"))
    clustered = any(layer in ("clustered", "improved-clustered") for layer in kinds)
    window = any(layer in ("window", "window-no-tail") for layer in kinds)
    no_map = not uses_feature_map(kinds)
    if no_map and not clustered:
        fidelity_note = (
            "These window layers have no linear tail: they attend exactly to their sinks, their window and (with a\n"
            "sparse cache) the older keys it keeps, and drop the rest; the error is what the dropped keys held.\n"
            "Fine-tune the model to the window (a causal LM: `hf-performer linearize --no-tail`; see Results).")
        quality = ("keys outside the sinks, the window and the sparse cache are dropped, not approximated; check the "
                   "results\n  above for this model.")
    elif clustered:
        fidelity_note = (
            "Clustered attention gives every query of a cluster its centroid's attention (the improved variant adds\n"
            "exact scores on the cluster's top keys): the error grows when fewer clusters must cover more distinct\n"
            "queries, i.e. on longer inputs. Nothing was trained; fine-tuning can recover the rest (see Results)."
        )
        quality = ("clustered attention approximates softmax attention without training; check the results above for "
                   "this\n  model.")
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
            "(`hf-performer distill`; a causal LM: `hf-performer linearize`), then fine-tune (see Results)."
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
        estimator = "the FAVOR+ estimator's variance is large there" if is_favor else \
            f"the `{feature_map}` random-feature approximation is poor there"
        fidelity_note = (
            "A relative error near 1 means the layer output is essentially re-learned: trained softmax attention is peaky\n"
            f"and {estimator}. This is expected after the swap: accuracy has to be\n"
            "recovered by fine-tuning (see Results)."
        )
        estimate = ("estimates softmax attention without bias but with a large variance (and denominators that\n"
                    "  can vanish)" if feature_map == "trig" else "is an approximation of softmax attention")
        quality = (f"{map_name(feature_map)} {estimate}; published conversions with fixed random features\n"
                   "  trail softmax on some tasks (e.g. CoLA) even after fine-tuning. Check the results above for this model.")
    if window and not clustered and not no_map:
        fidelity_note = ("Window layers are exact inside their window and over their sinks; only the query positions "
                         "counted in the\nlast column reached older keys, through the tail: their error is the tail's. "
                         + fidelity_note)
    return {
        "is_favor": is_favor and not clustered and not no_map,
        "feature_map": feature_map,
        "fidelity_note": fidelity_note,
        "quality_note": quality,
    }


def map_title(feature_map: str) -> str:
    """``"FAVOR+"`` or ``"`name`"``: how the card names a feature map."""
    return "FAVOR+" if feature_map == "favor+" else f"`{feature_map}`"


def map_name(feature_map: str) -> str:
    """``"FAVOR+"`` or ``"`name` linear attention"``: how the card's prose names a feature map's attention."""
    return "FAVOR+" if feature_map == "favor+" else f"`{feature_map}` linear attention"
