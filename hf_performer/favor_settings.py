"""The one schema of the FAVOR+ settings (``config.favor_settings``): what each setting means, its default,
its validation and what it builds.

* :data:`FAVOR_SETTINGS`: one :class:`FavorSetting` per key (name, type, default, one-line meaning), the
  declaration the configuration, the attention function and the command line read (declared, without torch, in
  :mod:`.favor_schema`, so that the command line's parsers need no torch);
* :data:`FAVOR_DEFAULTS`: the defaults, ``{name: default}``;
* :func:`resolve_favor_settings`: the one validation; a given settings dict is validated once and the result
  memoised (the configuration, every layer's attach and the cache factory ask for the same settings);
* :func:`build_feature_map`: the feature map of one layer from resolved settings;
* :func:`effective_nb_features`: the number of features per head a layer really has;
* :func:`feature_map_kind`: ``"random"``, ``"learned"`` or ``"deterministic"``;
* :func:`layer_window`: the resolved ``(window, sinks)`` of a layer (a "window layer" when either is > 0);
* :func:`layer_sparse_cache`: the resolved sparse-cache size of a layer;
* :func:`layer_tail_cap`: the tail cap a window layer runs with;
* :func:`layer_tail_gate`: whether a window layer runs a learned tail gate;
* :func:`softmax_weight_mode`: ``"calibrated"`` or ``"learned"`` (``softmax_weight="auto"`` resolved);
* :func:`is_clustered`: whether the settings select (improved) clustered attention instead of linear attention.

This module imports only relative siblings (and, through them, ``torch``): it is copied next to saved models
for ``trust_remote_code``.
"""

from __future__ import annotations

import inspect

from .favor_schema import (  # the torch-free declaration (FAVOR_SETTINGS, FAVOR_DEFAULTS), re-exported here
    ATTENTION_KINDS,
    FAVOR_DEFAULTS,
    FAVOR_SETTINGS,
    SOFTMAX_WEIGHT_MODES,
    SPARSE_CACHE_SELECTIONS,
    FavorSetting,
)
from .feature_maps import (
    FEATURE_MAPS,
    FeatureMap,
    LearnedFeatureMap,
    RandomFeatureMap,
    available_feature_maps,
    make_feature_map,
)


WINDOW_SETTINGS = ("window", "sinks", "sparse_cache", "sparse_cache_selection", "sparse_cache_span", "tail_cap",
                   "tail_gate", "softmax_weight", "layer_windows", "linear_tail")
"""The sink + sliding-window keys (:func:`layer_window`), recorded for every map kind."""
LAYER_WINDOW_KEYS = ("window", "sinks", "sparse_cache")
CLUSTERED_SETTINGS = ("attention", "clusters", "topk")
"""The attention-kind keys (:func:`is_clustered`). A config records them only for clustered attention (``topk`` only
for improved): a linear-attention config stays as before, and a config without them is linear attention."""

RANDOM_MAP_OPTIONS = ("orthogonal", "row_norms", "redraw_interval", "seed")
LEARNED_MAP_SETTINGS = ("seed",)
"""Top-level settings of random maps that learned maps also take (the seed of their ``"favor+"`` initialisation)."""
_BUILDER_ARGUMENTS = ("head_dim", "nb_features", "num_heads", "num_key_value_heads", *RANDOM_MAP_OPTIONS)
"""Arguments :func:`build_feature_map` passes itself: not accepted in ``feature_map_options``."""

CANONICAL_KEYS = {
    "random": tuple(FAVOR_DEFAULTS),
    # No random projection: the seed only draws a "favor+" initialisation.
    "learned": ("feature_map", "nb_features", "seed", "chunk_size", "softmax_layers", "feature_map_options",
                *WINDOW_SETTINGS),
    # elu+1: its own size and no random-projection options.
    "deterministic": ("feature_map", "chunk_size", "softmax_layers", "feature_map_options", *WINDOW_SETTINGS),
}
"""The keys a config records for each :func:`feature_map_kind` (:func:`canonical_favor_settings`)."""

_RESOLVED: dict[tuple, dict] = {}
_RESOLVED_LIMIT = 256


def is_int(value) -> bool:
    """Whether ``value`` is an ``int`` (``bool`` is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def feature_map_kind(name: str) -> str:
    """``"random"`` (a random projection: favor+, trig, relu), ``"learned"`` (trainable parameters per head:
    hedgehog, t2r) or ``"deterministic"`` (elu+1) for a registered feature-map name."""
    factory = FEATURE_MAPS[name]
    if isinstance(factory, type) and issubclass(factory, RandomFeatureMap):
        return "random"
    if isinstance(factory, type) and issubclass(factory, LearnedFeatureMap):
        return "learned"
    return "deterministic"


def _frozen(value):
    """A hashable image of a settings value that keeps types apart (``True`` vs ``1``, list vs tuple)."""
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(key), _frozen(item)) for key, item in value.items())))
    if isinstance(value, (list, tuple, set)):
        items = tuple(_frozen(item) for item in value)
        return (type(value).__name__, tuple(sorted(items, key=repr)) if isinstance(value, set) else items)
    hash(value)  # TypeError for anything else unhashable: not memoised
    return (type(value).__name__, value)


def _copy(resolved: dict) -> dict:
    """A copy the caller may change without touching the memoised resolution."""
    return {
        **resolved,
        "softmax_layers": list(resolved["softmax_layers"]),
        "feature_map_options": dict(resolved["feature_map_options"]),
        "layer_windows": {layer: dict(values) for layer, values in resolved["layer_windows"].items()},
    }


def resolve_favor_settings(settings: dict | None = None) -> dict:
    """Validate ``favor_settings`` and fill absent keys from :data:`FAVOR_DEFAULTS`.

    Settings equal to ones already resolved (same keys, values and value types, same registered feature map)
    are not validated again: the memoised result is returned as a new dict.

    Args:
        settings: a dict (e.g. ``config.favor_settings``) or ``None`` for all defaults.

    Returns:
        A new dict with every key of :data:`FAVOR_DEFAULTS` (``softmax_layers`` as a sorted list of ints).

    Raises:
        ValueError: unknown key, unknown feature map or out-of-range value. TypeError: wrong type.
    """
    if settings is None:
        settings = {}
    if not isinstance(settings, dict):
        raise TypeError(f"favor_settings must be a dict, got {type(settings).__name__}: {settings!r}")
    try:
        key = (_frozen(settings), FEATURE_MAPS.get(settings.get("feature_map", FAVOR_DEFAULTS["feature_map"])))
    except TypeError:  # an unhashable option value: validate without memoising
        return _validate(settings)
    resolved = _RESOLVED.get(key)
    if resolved is None:
        resolved = _validate(settings)
        if len(_RESOLVED) >= _RESOLVED_LIMIT:
            _RESOLVED.clear()
        _RESOLVED[key] = resolved
        # The canonical form (what a config stores) resolves to the same settings: no second validation.
        _RESOLVED.setdefault((_frozen(_canonical(resolved)), key[1]), resolved)
    return _copy(resolved)


def _canonical(resolved: dict) -> dict:
    keys = [name for name in CANONICAL_KEYS[feature_map_kind(resolved["feature_map"])] if name not in CLUSTERED_SETTINGS]
    if is_clustered(resolved):
        keys += ["attention", "clusters"] + (["topk"] if resolved["attention"] == "improved-clustered" else [])
    return {name: resolved[name] for name in keys}


def canonical_favor_settings(settings: dict | None) -> dict:
    """Validated settings with every default made explicit (so a saved model records them all), except the keys
    the chosen feature map does not take (:data:`CANONICAL_KEYS`)."""
    return _copy(_canonical(resolve_favor_settings(dict(settings or {}))))


def _validate(settings: dict) -> dict:
    """The validation behind :func:`resolve_favor_settings` (run once per distinct settings)."""
    unknown = sorted(set(settings) - set(FAVOR_DEFAULTS))
    if unknown:
        raise ValueError(
            f"unknown favor_settings key(s) {unknown}; accepted keys: {sorted(FAVOR_DEFAULTS)} "
            f"(defaults: {FAVOR_DEFAULTS})"
        )
    resolved = {**FAVOR_DEFAULTS, **settings}

    if resolved["feature_map"] not in FEATURE_MAPS:
        raise ValueError(
            f"favor_settings['feature_map']={resolved['feature_map']!r} is not a known feature map; "
            f"available: {available_feature_maps()}"
        )
    nb_features = resolved["nb_features"]
    if nb_features is not None and not (is_int(nb_features) and nb_features > 0):
        raise ValueError(f"favor_settings['nb_features'] must be a positive int or None, got {nb_features!r}")
    kind = feature_map_kind(resolved["feature_map"])
    if kind == "deterministic" and settings.get("nb_features") is not None:
        raise ValueError(
            f"the {resolved['feature_map']!r} feature map has exactly head_dim features and takes no nb_features "
            f"(got {settings['nb_features']}); leave nb_features unset"
        )
    if not isinstance(resolved["orthogonal"], bool):
        raise TypeError(f"favor_settings['orthogonal'] must be a bool, got {resolved['orthogonal']!r}")
    if resolved["row_norms"] not in ("chi", "fixed"):
        raise ValueError(f"favor_settings['row_norms'] must be 'chi' or 'fixed', got {resolved['row_norms']!r}")
    if not (is_int(resolved["redraw_interval"]) and resolved["redraw_interval"] >= 0):
        raise ValueError(
            f"favor_settings['redraw_interval'] must be an int >= 0 (0 = never), got {resolved['redraw_interval']!r}"
        )
    if not is_int(resolved["seed"]):
        raise TypeError(f"favor_settings['seed'] must be an int, got {resolved['seed']!r}")
    if not (is_int(resolved["chunk_size"]) and resolved["chunk_size"] >= 1):
        raise ValueError(f"favor_settings['chunk_size'] must be an int >= 1, got {resolved['chunk_size']!r}")
    softmax_layers = resolved["softmax_layers"]
    if not isinstance(softmax_layers, (list, tuple)) or not all(is_int(i) and i >= 0 for i in softmax_layers):
        raise ValueError(
            f"favor_settings['softmax_layers'] must be a list of layer indices (ints >= 0), got {softmax_layers!r}"
        )
    resolved["softmax_layers"] = sorted(set(softmax_layers))

    resolved["feature_map_options"] = _check_feature_map_options(resolved["feature_map"], resolved["feature_map_options"])

    _check_window_settings(resolved, kind)
    _check_clustered_settings(resolved)

    if kind != "random":
        allowed = LEARNED_MAP_SETTINGS if kind == "learned" else ()
        explicit = [key for key in RANDOM_MAP_OPTIONS if key in settings and key not in allowed]
        if explicit:
            raise ValueError(
                f"favor_settings {explicit} only apply to random feature maps; {resolved['feature_map']!r} has no "
                "random projection"
            )
        if "nb_features" not in settings:
            resolved["nb_features"] = None  # the map's own size (elu+1: head_dim; hedgehog: 2 * head_dim)
    factory = FEATURE_MAPS[resolved["feature_map"]]
    if resolved["nb_features"] is not None and isinstance(factory, type) and issubclass(factory, FeatureMap):
        factory.check_nb_features(resolved["nb_features"])  # e.g. trig's even count, before any model is built
    return resolved


def _check_window_settings(resolved: dict, kind: str) -> None:
    """Validate the sink + window keys in place (``layer_windows`` normalised to ``{"<int>": {...}}``)."""
    for name in LAYER_WINDOW_KEYS:
        if not (is_int(resolved[name]) and resolved[name] >= 0):
            raise ValueError(f"favor_settings[{name!r}] must be an int >= 0 (0 = none), got {resolved[name]!r}")
    if resolved["sparse_cache_selection"] not in SPARSE_CACHE_SELECTIONS:
        raise ValueError(f"favor_settings['sparse_cache_selection'] must be one of {SPARSE_CACHE_SELECTIONS}, got "
                         f"{resolved['sparse_cache_selection']!r}")
    span = resolved["sparse_cache_span"]
    if not (is_int(span) and span >= 1 and span % 2 == 1):
        raise ValueError(f"favor_settings['sparse_cache_span'] must be an odd int >= 1 (1 = each token on its own), "
                         f"got {span!r}")
    mode = resolved["softmax_weight"]
    if mode not in SOFTMAX_WEIGHT_MODES:
        raise ValueError(f"favor_settings['softmax_weight'] must be one of {SOFTMAX_WEIGHT_MODES}, got {mode!r}")
    if mode == "learned" and kind != "learned":
        raise ValueError(
            f"favor_settings['softmax_weight']='learned' needs a learned feature map (hedgehog, t2r); the "
            f"{resolved['feature_map']!r} map has no trained tail to weigh gamma against: use 'calibrated' or 'auto'"
        )
    if not isinstance(resolved["linear_tail"], bool):
        raise TypeError(f"favor_settings['linear_tail'] must be a bool, got {resolved['linear_tail']!r}")
    if not (is_int(resolved["tail_cap"]) and resolved["tail_cap"] >= 0):
        raise ValueError(f"favor_settings['tail_cap'] must be an int >= 0 (0 = unbounded), got {resolved['tail_cap']!r}")
    if resolved["tail_cap"] and not resolved["linear_tail"]:
        raise ValueError("favor_settings['tail_cap'] bounds the linear tail, but linear_tail=False: set tail_cap=0")
    if not isinstance(resolved["tail_gate"], bool):
        raise TypeError(f"favor_settings['tail_gate'] must be a bool, got {resolved['tail_gate']!r}")
    if resolved["tail_gate"] and not resolved["linear_tail"]:
        raise ValueError("favor_settings['tail_gate'] weighs the linear tail, but linear_tail=False: set "
                         "tail_gate=False")
    overrides = resolved["layer_windows"]
    if not isinstance(overrides, dict):
        raise TypeError(
            'favor_settings[\'layer_windows\'] must be a dict {"<layer index>": {"window": int, "sinks": int, '
            f'"sparse_cache": int}}}}, got {overrides!r}'
        )
    normalised = {}
    for layer, values in overrides.items():
        text = str(layer) if is_int(layer) else layer
        if not (isinstance(text, str) and text.isdigit() and str(int(text)) == text):
            raise ValueError(
                f"favor_settings['layer_windows'] keys must be layer indices (ints >= 0, as strings in JSON), got "
                f"{layer!r}"
            )
        if not isinstance(values, dict) or not values or set(values) - set(LAYER_WINDOW_KEYS):
            raise ValueError(
                f"favor_settings['layer_windows'][{text!r}] must be a non-empty dict with keys among "
                f"{list(LAYER_WINDOW_KEYS)}, got {values!r}"
            )
        for name, value in values.items():
            if not (is_int(value) and value >= 0):
                raise ValueError(
                    f"favor_settings['layer_windows'][{text!r}][{name!r}] must be an int >= 0, got {value!r}"
                )
        if text in normalised:
            raise ValueError(f"favor_settings['layer_windows'] gives layer {text} twice")
        normalised[text] = dict(values)
    resolved["layer_windows"] = dict(sorted(normalised.items(), key=lambda item: int(item[0])))
    layers = [("the default", {}), *((f"layer {k}", v) for k, v in normalised.items())]
    for label, values in layers:
        window, sinks, cache = (values.get(name, resolved[name]) for name in LAYER_WINDOW_KEYS)
        if cache and not (window or sinks):
            raise ValueError(
                f"favor_settings['sparse_cache']={cache} for {label}, which is not a window layer (window=0 and "
                "sinks=0): a sparse cache keeps tokens older than the window exact; give the layer a window and/or "
                "sinks, or sparse_cache=0"
            )
    window_layers = [label for label, values in layers
                     if values.get("window", resolved["window"]) or values.get("sinks", resolved["sinks"])]
    for name, off in (("tail_cap", 0), ("tail_gate", False)):
        if resolved[name] and not window_layers:
            raise ValueError(
                f"favor_settings[{name!r}] weighs a window layer's linear tail, but no layer has a window or sinks "
                f"(nothing would use it): give a window and/or sinks, or {name}={off}")
    if not resolved["linear_tail"]:
        without = [
            label for label, values in [("the default", {}), *((f"layer {k}", v) for k, v in normalised.items())]
            if values.get("window", resolved["window"]) == 0 and values.get("sinks", resolved["sinks"]) == 0
        ]
        if without:
            raise ValueError(
                f"favor_settings['linear_tail']=False leaves {without[0]} with window=0 and sinks=0, i.e. no keys at "
                "all: give a window and/or sinks > 0 (or keep linear_tail=True)"
            )


def layer_window(settings: dict, layer_idx: int) -> tuple[int, int]:
    """The ``(window, sinks)`` of layer ``layer_idx`` from resolved settings: its ``layer_windows`` override, else
    the model-wide ``window`` / ``sinks``. ``(0, 0)`` is plain linear attention."""
    override = settings.get("layer_windows", {}).get(str(layer_idx), {})
    return override.get("window", settings.get("window", 0)), override.get("sinks", settings.get("sinks", 0))


def layer_sparse_cache(settings: dict, layer_idx: int) -> int:
    """The sparse-cache size ``G`` of layer ``layer_idx`` from resolved settings (its ``layer_windows`` override,
    else the model-wide ``sparse_cache``); 0 = none."""
    override = settings.get("layer_windows", {}).get(str(layer_idx), {})
    return override.get("sparse_cache", settings.get("sparse_cache", 0))


def layer_tail_cap(settings: dict, causal: bool) -> int:
    """The ``tail_cap`` a window layer runs with (0 = unbounded); ``ValueError`` for a bidirectional layer."""
    if settings.get("tail_cap", 0) and not causal:
        raise ValueError("favor_settings give a bidirectional window layer a tail_cap (its tail is bounded by its "
                         "input): tail_cap is for causal window layers; set tail_cap=0")
    return settings.get("tail_cap", 0)


def layer_tail_gate(settings: dict, causal: bool) -> bool:
    """Whether a window layer runs a learned tail gate; ``ValueError`` for a bidirectional layer."""
    if settings.get("tail_gate", False) and not causal:
        raise ValueError("favor_settings give a bidirectional window layer a tail_gate (its tail is bounded by its "
                         "input): tail_gate is for causal window layers; set tail_gate=False")
    return bool(settings.get("tail_gate", False))


def largest_window(settings: dict) -> int:
    """The largest ``window`` of any layer of ``settings`` (the model-wide one and the ``layer_windows`` overrides)."""
    overrides = settings.get("layer_windows") or {}
    return max([settings.get("window", 0), *(values.get("window", 0) for values in overrides.values())])


def largest_sparse_cache(settings: dict) -> int:
    """The largest ``sparse_cache`` of any layer of ``settings`` (the model-wide one and the overrides)."""
    overrides = settings.get("layer_windows") or {}
    return max([settings.get("sparse_cache", 0), *(values.get("sparse_cache", 0) for values in overrides.values())])


def exact_budget_problem(settings: dict, positions: int | None) -> str | None:
    """What is wrong with a window or a sparse cache that covers all ``positions`` the model takes (every input would
    be exact softmax, at a higher cost, and a cache's decoding state would be allocated for more tokens than any input
    holds), as a clause naming the setting; ``None`` when both fit or ``positions`` is unknown."""
    if not positions:
        return None
    for name, value in (("window", largest_window(settings)), ("sparse_cache", largest_sparse_cache(settings))):
        if value and value >= positions:
            return f"{name} {value} covers all {positions} positions the model takes"
    return None


def is_window_layer(settings: dict, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` runs sink + window attention (its window or sinks > 0)."""
    return any(value > 0 for value in layer_window(settings, layer_idx))


def softmax_weight_mode(settings: dict) -> str:
    """``"calibrated"`` or ``"learned"``: ``settings["softmax_weight"]`` with ``"auto"`` resolved (``"learned"`` for
    learned feature maps, ``"calibrated"`` otherwise)."""
    mode = settings.get("softmax_weight", "auto")
    if mode == "auto":
        return "learned" if feature_map_kind(settings["feature_map"]) == "learned" else "calibrated"
    return mode
def _check_clustered_settings(resolved: dict) -> None:
    """Validate the attention kind and its cluster settings."""
    if resolved["attention"] not in ATTENTION_KINDS:
        raise ValueError(
            f"favor_settings['attention'] must be one of {list(ATTENTION_KINDS)}, got {resolved['attention']!r}"
        )
    for name in ("clusters", "topk"):
        if not (is_int(resolved[name]) and resolved[name] >= 1):
            raise ValueError(f"favor_settings[{name!r}] must be an int >= 1, got {resolved[name]!r}")
    windowed = resolved["window"] or resolved["sinks"] or resolved["layer_windows"]
    if is_clustered(resolved) and windowed:
        raise ValueError(
            f"favor_settings['attention']={resolved['attention']!r} takes no window, sinks or layer_windows (those "
            "are for attention='linear'); got window={}, sinks={}, layer_windows={}".format(
                resolved["window"], resolved["sinks"], resolved["layer_windows"])
        )


def is_clustered(settings: dict) -> bool:
    """Whether resolved ``settings`` select clustered or improved clustered attention (no feature map)."""
    return settings.get("attention", "linear") != "linear"


def _keyword_options(factory) -> list[str]:
    """Keyword options a feature-map factory takes (its signature, the base class's for ``**kwargs``)."""
    names, targets = [], [factory]
    while targets:
        target = targets.pop()
        parameters = inspect.signature(target).parameters.values()
        names += [p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if any(p.kind == p.VAR_KEYWORD for p in parameters) and isinstance(target, type):
            targets += [base for base in target.__mro__[1:2] if issubclass(base, FeatureMap)]
    return sorted(set(names) - set(_BUILDER_ARGUMENTS))


def _check_feature_map_options(name: str, options) -> dict:
    if not isinstance(options, dict):
        raise TypeError(f"favor_settings['feature_map_options'] must be a dict, got {options!r}")
    accepted = _keyword_options(FEATURE_MAPS[name])
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"favor_settings['feature_map_options'] has option(s) {unknown} that the {name!r} feature map does not "
            f"take; accepted: {accepted or 'none'}"
        )
    return dict(options)


def favor_settings_of(module_or_config) -> dict:
    """Resolved settings of an attention module (``module.config.favor_settings``) or of a config."""
    config = getattr(module_or_config, "config", module_or_config)
    return resolve_favor_settings(getattr(config, "favor_settings", None))


def effective_nb_features(settings: dict, head_dim: int) -> int:
    """The number ``m`` of features per head that :func:`build_feature_map` gives a layer of ``head_dim``:
    ``settings["nb_features"]``, or with ``None`` the map's own size (hedgehog ``2 * head_dim``, t2r and elu+1
    ``head_dim``, a random map its default)."""
    if settings["nb_features"] is not None:
        return settings["nb_features"]
    name = settings["feature_map"]
    factory = FEATURE_MAPS[name]
    kind = feature_map_kind(name)
    if kind == "learned":
        return factory.default_nb_features(head_dim)
    if kind == "random":
        return inspect.signature(factory).parameters["nb_features"].default
    return head_dim


def build_feature_map(
    settings: dict, head_dim: int, layer_idx: int, num_heads: int | None = None, num_key_value_heads: int | None = None
) -> FeatureMap:
    """The feature map of layer ``layer_idx`` from resolved settings (seed ``settings["seed"] + layer_idx``).

    ``num_heads`` / ``num_key_value_heads`` (query / key heads of the layer) are needed by learned maps, which
    have parameters per head.
    """
    name = settings["feature_map"]
    options = dict(settings.get("feature_map_options") or {})
    kind = feature_map_kind(name)
    if kind == "random":
        return make_feature_map(
            name,
            head_dim,
            settings["nb_features"],
            orthogonal=settings["orthogonal"],
            row_norms=settings["row_norms"],
            redraw_interval=settings["redraw_interval"],
            seed=settings["seed"] + layer_idx,
            **options,
        )
    if kind == "learned":
        if num_heads is None:
            raise ValueError(f"the learned feature map {name!r} needs the layer's number of heads")
        return make_feature_map(
            name,
            head_dim,
            settings["nb_features"],
            num_heads=num_heads,
            num_key_value_heads=num_key_value_heads,
            seed=settings["seed"] + layer_idx,
            **options,
        )
    # Deterministic maps (elu+1) have a fixed size; an nb_features other than theirs is rejected by the map.
    return make_feature_map(name, head_dim, settings["nb_features"], **options)


__all__ = [
    "FAVOR_DEFAULTS",
    "FAVOR_SETTINGS",
    "FavorSetting",
    "build_feature_map",
    "canonical_favor_settings",
    "effective_nb_features",
    "favor_settings_of",
    "feature_map_kind",
    "layer_window",


    "is_clustered",
    "resolve_favor_settings",
    "softmax_weight_mode",
]
