"""The declaration of the FAVOR+ settings and of the names the command line offers, without torch.

:data:`FAVOR_SETTINGS` names every key of ``config.favor_settings`` with its type, default and meaning;
:mod:`.favor_settings` validates and resolves them (and re-exports these names). The choices below are declared here,
not next to the code that uses them, so that ``hf-performer VERB --help`` builds its parser without importing torch
(a test holds each of them equal to what the runtime registers).

This module imports nothing: it is copied next to saved models for ``trust_remote_code`` with the rest of the
runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CHUNK_SIZE = 64
"""Tokens per chunk of the causal scan (its [C, C] tiles): 64 runs fwd+bwd 10-15% faster than 128 at 8k-16k tokens
on a 2-core CPU (FAVOR+, 12 heads; benchmarks/README.md, issue 17)."""

SOFTMAX_WEIGHT_MODES = ("auto", "calibrated", "learned")
SPARSE_CACHE_SELECTIONS = ("recall", "attention")
"""The sparse cache's selection rules (``window_sparse_cache.SELECTIONS``, which the runtime checks)."""
ATTENTION_KINDS = ("linear", "clustered", "improved-clustered")
LEARNED_MAP_INITS = ("identity", "favor+")
"""Starting projections of the learned feature maps (``feature_map_options["init"]``)."""
LEARNED_MAP_DEFAULT_INIT = "favor+"
"""The start of a learned map when none is given (``LearnedFeatureMap.default_init``)."""

BUILTIN_FEATURE_MAPS = ("elu+1", "favor+", "hedgehog", "relu", "t2r", "trig")
"""The feature maps :mod:`.feature_maps` registers (a process may register more with ``register_feature_map``)."""

PERFORMER_TASKS = ("base", "sequence-classification", "token-classification", "masked-lm", "causal-lm")
"""The tasks a Performer model class exists for (``modeling_performer.PERFORMER_CLASSES_BY_TASK``)."""


@dataclass(frozen=True)
class FavorSetting:
    """One key of ``favor_settings``: its ``name``, the Python ``type`` of its values (``nb_features`` also takes
    ``None``), its ``default`` and a one-line ``meaning``."""

    name: str
    type: type
    default: object
    meaning: str


FAVOR_SETTINGS: tuple[FavorSetting, ...] = (
    FavorSetting("feature_map", str, "favor+",
                 'a name of available_feature_maps() ("favor+", "trig", "relu", "elu+1", "hedgehog", "t2r", ...)'),
    FavorSetting("nb_features", int, 256,
                 "features m per head; None lets the map choose (hedgehog 2 * head_dim, t2r and elu+1 head_dim)"),
    FavorSetting("orthogonal", bool, True, "random maps: orthogonal (True) or iid (False) projection rows"),
    FavorSetting("row_norms", str, "chi", 'random maps: projection row norms, "chi" (sampled) or "fixed" (sqrt(d))'),
    FavorSetting("redraw_interval", int, 0, "random maps: training calls between redraws of the projection, 0 = never"),
    FavorSetting("seed", int, 0,
                 'layer i draws its projection (random maps) or its "favor+" initialisation (learned maps) with '
                 "seed + i"),
    FavorSetting("chunk_size", int, DEFAULT_CHUNK_SIZE,
                 "tokens per chunk of the causal scan (window layers with a sparse cache: tokens between its selections)"),
    FavorSetting("softmax_layers", list, [], "layer indices kept on exact softmax attention (sdpa)"),
    FavorSetting("feature_map_options", dict, {},
                 'the map\'s own keyword options, e.g. {"init": "favor+", "tie_qk": False} (learned maps)'),
    FavorSetting("window", int, 0,
                 "exact softmax over the last `window` keys (encoders: the band |i-j| < window), the feature map for "
                 "older keys; 0 = none. A layer with window or sinks > 0 runs window_linear_attention"),
    FavorSetting("sinks", int, 0,
                 "each row's first `sinks` unpadded tokens are always attended with exact softmax (causal LMs: 4; "
                 "encoders: 1, [CLS])"),
    FavorSetting("softmax_weight", str, "auto",
                 'weight of the exact terms against the linear tail in window layers: "calibrated" (1, tail on the '
                 'softmax scale), "learned" (a trained gamma per head, LoLCATs; learned maps only) or "auto" '
                 '(learned for hedgehog/t2r, calibrated otherwise)'),
    FavorSetting("sparse_cache", int, 0,
                 "causal window layers: per key head, up to this many tokens older than the window stay exact, the ones "
                 "the linear tail would recall worst, chosen every chunk_size tokens (LoLA); 0 = none"),
    FavorSetting("sparse_cache_selection", str, "recall",
                 'how the sparse cache chooses its tokens: "recall" (the ones the linear tail would recall worst; '
                 'without a tail, the farthest from the mean value) or "attention" (the ones the boundary\'s query '
                 "attends to most, H2O / TOVA-style; not with assisted decoding)"),
    FavorSetting("sparse_cache_span", int, 1,
                 "odd; the sparse cache ranks each token by its score averaged over this many neighbouring candidates, "
                 "so that whole runs of tokens (a fact to copy) stay rather than their sharpest keys (SnapKV's "
                 "pooling); 1 = each token on its own score"),
    FavorSetting("tail_cap", int, 0,
                 "causal window layers: a query whose linear tail holds n > tail_cap tokens weighs it by tail_cap / n "
                 "(the tail's mean at the weight of tail_cap tokens), so that it stops taking normaliser mass from the "
                 "exact keys past the lengths the layer was trained at; 0 = unbounded"),
    FavorSetting("tail_gate", bool, False,
                 "causal window layers: a learned exponent alpha per head in [0, 1] weighs a linear tail of n tokens "
                 "by n ** -alpha (0 at conversion, trained by attention transfer), so that the tail's share of the "
                 "normaliser can stop growing with the context; False = none"),
    FavorSetting("layer_windows", dict, {},
                 'per-layer overrides of window / sinks / sparse_cache, {"<layer index>": {"window": int, "sinks": '
                 'int, "sparse_cache": int}}'),
    FavorSetting("linear_tail", bool, True,
                 "window layers attend to keys older than the window through the feature map; False = sinks + "
                 "window exact softmax only (ablation)"),
    FavorSetting("attention", str, "linear",
                 '"linear" (the feature map), or the zero-shot "clustered" / "improved-clustered" attention of '
                 "bidirectional models (no feature map; the seed of layer i hashes its queries with seed + i)"),
    FavorSetting("clusters", int, 25, "(improved-)clustered attention: query clusters per head"),
    FavorSetting("topk", int, 32,
                 "improved-clustered attention: keys per cluster attended exactly (at most the sequence length)"),
)

FAVOR_DEFAULTS: dict = {setting.name: setting.default for setting in FAVOR_SETTINGS}
"""Defaults of ``config.favor_settings``, ``{name: default}`` of :data:`FAVOR_SETTINGS`.

* ``nb_features``: ``None`` lets the map choose (learned maps: ``2 * head_dim`` for hedgehog, ``head_dim``
  for t2r; elu+1 always has ``head_dim`` and refuses an explicit value).
* ``orthogonal``, ``row_norms``, ``redraw_interval``: options of random feature maps only.
* ``feature_map_options``: checked against the map's signature, e.g. ``{"feature_epsilon": 1e-3}`` for relu.
"""
