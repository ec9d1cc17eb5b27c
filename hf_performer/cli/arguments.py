"""The favor flags of every command line, declared once, from the one schema
:data:`hf_performer.favor_schema.FAVOR_SETTINGS` (name, type, default, meaning).

:func:`add_favor_arguments` adds the flags a parser needs, each with one spelling (:data:`FAVOR_FLAGS`); its
``dest`` is the flag without dashes (``--favor-seed`` -> ``args.favor_seed``) and its default ``None`` (the
schema's default applies) unless the verb gives one. :func:`add_deprecated_alias` keeps an old spelling working
for one release: using it prints one warning line naming the new spelling. :func:`favor_settings_from_args`
turns the parsed flags back into ``favor_settings`` keys.

This module is a leaf: it imports only argparse and the torch-free declaration :mod:`hf_performer.favor_schema` (a
parser is built without torch: ``--help`` stays fast), so that the ``hf-performer`` verbs and the recipes' parser
(:mod:`hf_performer.recipes.arguments`, the one module below ``cli`` allowed to import it) share it without importing
each other.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from ..favor_schema import (
    ATTENTION_KINDS,
    BUILTIN_FEATURE_MAPS,
    FAVOR_SETTINGS,
    LEARNED_MAP_INITS,
    SOFTMAX_WEIGHT_MODES,
    SPARSE_CACHE_SELECTIONS,
)


def json_object(text: str) -> dict:
    """argparse type of a JSON object, e.g. ``'{"0": {"window": 0, "sinks": 0}}'``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({error.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {text!r}")
    return value


@dataclass(frozen=True)
class FavorFlag:
    """The command-line flag of one ``favor_settings`` key: its ``setting`` name, its ``flag`` spelling and the
    argparse keywords beyond ``help`` / ``default`` (``type``, ``choices``, ``nargs``, ``metavar``)."""

    setting: str
    flag: str
    keywords: dict

    @property
    def dest(self) -> str:
        """The attribute of the parsed arguments: the flag without its dashes."""
        return self.flag[2:].replace("-", "_")


FAVOR_FLAGS: dict[str, FavorFlag] = {flag.setting: flag for flag in (
    FavorFlag("feature_map", "--feature-map", {"choices": BUILTIN_FEATURE_MAPS}),
    FavorFlag("nb_features", "--nb-features", {"type": int}),
    FavorFlag("seed", "--favor-seed", {"type": int}),
    FavorFlag("orthogonal", "--projection", {"choices": ("orthogonal", "iid")}),
    FavorFlag("row_norms", "--row-norms", {"choices": ("chi", "fixed")}),
    FavorFlag("redraw_interval", "--redraw-interval", {"type": int}),
    FavorFlag("chunk_size", "--chunk-size", {"type": int}),
    FavorFlag("softmax_layers", "--keep-softmax-layers", {"type": int, "nargs": "+", "metavar": "LAYER"}),
    FavorFlag("feature_map_options", "--feature-map-init", {"choices": LEARNED_MAP_INITS}),
    FavorFlag("window", "--window", {"type": int, "metavar": "W"}),
    FavorFlag("sinks", "--sinks", {"type": int, "metavar": "S"}),
    FavorFlag("sparse_cache", "--sparse-cache", {"type": int, "metavar": "G"}),
    FavorFlag("sparse_cache_selection", "--sparse-cache-selection", {"choices": SPARSE_CACHE_SELECTIONS}),
    FavorFlag("sparse_cache_span", "--sparse-cache-span", {"type": int, "metavar": "S"}),
    FavorFlag("tail_cap", "--tail-cap", {"type": int, "metavar": "N"}),
    FavorFlag("tail_gate", "--tail-gate", {"action": "store_const", "const": True}),
    FavorFlag("softmax_weight", "--softmax-weight", {"choices": SOFTMAX_WEIGHT_MODES}),
    FavorFlag("layer_windows", "--layer-windows", {"type": json_object, "metavar": "JSON"}),
    FavorFlag("linear_tail", "--no-tail", {"action": "store_const", "const": False}),
    FavorFlag("attention", "--attention", {"choices": ATTENTION_KINDS}),
    FavorFlag("clusters", "--clusters", {"type": int, "metavar": "C"}),
    FavorFlag("topk", "--topk", {"type": int, "metavar": "K"}),
)}
"""``favor_settings`` key -> its flag. ``--projection orthogonal|iid`` sets ``orthogonal``; ``--feature-map-init``
sets ``feature_map_options["init"]`` (learned maps); ``--layer-windows`` takes JSON; ``--no-tail`` sets
``linear_tail=False`` (``linearize``'s spelling too; ``--no-linear-tail`` is its deprecated one,
:data:`OLD_SPELLINGS`). The recipes declare their own ``--attention favor|softmax`` (what to train) and do not take
``attention``."""

OLD_SPELLINGS = {"linear_tail": "--no-linear-tail"}
"""Deprecated spellings of favor flags, still accepted (with a warning) wherever the flag is declared."""

WINDOW_FLAG_SETTINGS = ("window", "sinks", "sparse_cache", "sparse_cache_selection", "sparse_cache_span", "tail_cap",
                        "tail_gate", "softmax_weight", "layer_windows", "linear_tail")
"""The sink + sliding-window flags, declared together by the verbs that convert (convert, distill, recipes)."""

CLUSTERED_FLAG_SETTINGS = ("attention", "clusters", "topk")
"""The zero-shot clustered-attention flags (``convert``; ``bench attention`` takes ``clusters`` and ``topk``)."""

_SCHEMA = {setting.name: setting for setting in FAVOR_SETTINGS}


def _schema_help(setting: str) -> str:
    schema = _SCHEMA[setting]
    default = "orthogonal" if setting == "orthogonal" and schema.default else schema.default
    if setting == "feature_map_options":
        return "initial projection of a learned map (default: the map's own)"
    if setting == "layer_windows":
        return (f'{schema.meaning} as JSON, e.g. \'{{"0": {{"window": 0, "sinks": 0}}}}\' keeps layer 0 all-linear '
                "(default: none)")
    if setting == "linear_tail":
        return "window layers without the linear tail: sinks + window exact softmax only (ablation)"
    return f"{schema.meaning} (default: {default})"


def add_favor_arguments(parser, settings, defaults: dict | None = None, helps: dict | None = None,
                        help_prefix: str = "") -> dict[str, argparse.Action]:
    """Add the flags of the ``favor_settings`` keys ``settings`` to ``parser`` (a parser or an argument group).

    Args:
        settings: keys of :data:`FAVOR_FLAGS`, in the order the flags are listed.
        defaults: ``{setting: default}`` where the verb has its own (otherwise ``None``: the schema's applies;
            ``softmax_layers``: ``[]``).
        helps: ``{setting: help}`` where the verb says more than the schema's meaning.
        help_prefix: put before every help text (the recipes: ``"conversion: "``).

    Returns:
        ``{setting: the argparse action}``.
    """
    defaults, helps = defaults or {}, helps or {}
    actions = {}
    for setting in settings:
        flag = FAVOR_FLAGS[setting]
        default = defaults.get(setting, [] if setting == "softmax_layers" else None)
        text = helps.get(setting, _schema_help(setting))
        actions[setting] = parser.add_argument(flag.flag, dest=flag.dest, default=default,
                                               help=help_prefix + text, **flag.keywords)
        if setting in OLD_SPELLINGS:
            add_deprecated_alias(parser, OLD_SPELLINGS[setting], actions[setting])
    return actions


class _DeprecatedAlias(argparse.Action):
    """Stores like the flag it aliases, after one warning line on stderr naming the new spelling."""

    def __init__(self, option_strings, dest, new_flag: str, **keywords):
        super().__init__(option_strings, dest, **keywords)
        self.new_flag = new_flag

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string} is deprecated and will be removed in the next release; "
              f"use {self.new_flag}", file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def add_deprecated_alias(parser, old_flag: str, action: argparse.Action) -> None:
    """Accept ``old_flag`` as a deprecated spelling of ``action``'s flag (same ``dest``, type and choices)."""
    parser.add_argument(old_flag, dest=action.dest, action=_DeprecatedAlias, new_flag=action.option_strings[0],
                        type=action.type, choices=action.choices, nargs=action.nargs, const=action.const,
                        metavar=action.metavar, default=argparse.SUPPRESS,
                        help=f"deprecated spelling of {action.option_strings[0]} (removed in the next release)")


def favor_settings_from_args(args: argparse.Namespace, settings) -> dict:
    """The keyword arguments of ``convert_to_performer`` for the flags of ``settings`` that were given (``None``
    values left out, so that the library's defaults apply): ``orthogonal`` as a bool, ``feature_map_options`` as a
    dict, ``softmax_layers`` as ``keep_softmax_layers``."""
    values = {}
    for setting in settings:
        value = getattr(args, FAVOR_FLAGS[setting].dest)
        if value is None:
            continue
        if setting == "orthogonal":
            value = value == "orthogonal"
        elif setting == "feature_map_options":
            value = {"init": value}
        values["keep_softmax_layers" if setting == "softmax_layers" else setting] = value
    return values


FEATURE_MAP_SETTINGS = ("feature_map", "nb_features", "feature_map_options", "orthogonal", "row_norms",
                        "redraw_interval", "chunk_size")
"""Settings that only a feature map uses (no clustered attention)."""


def refuse_ignored_flags(values: dict, command: str) -> None:
    """Refuse favor flags that the combination given would ignore, in one line naming them (``values``: what
    :func:`favor_settings_from_args` returns): ``--clusters`` / ``--topk`` with linear attention, ``--topk`` with plain
    clustered attention, the feature-map flags with clustered attention, ``--softmax-weight`` / ``--no-tail``
    without window layers, the feature-map flags with ``--no-tail``."""
    attention = values.get("attention", "linear")
    problems = []
    if attention == "linear":
        problems.append(([key for key in ("clusters", "topk") if key in values],
                         "they apply to --attention clustered / improved-clustered"))
    else:
        problems.append(([key for key in FEATURE_MAP_SETTINGS if key in values],
                         f"--attention {attention} has no feature map"))
        if attention == "clustered":
            problems.append((["topk"] if "topk" in values else [], "it applies to --attention improved-clustered only"))
    if not (values.get("window") or values.get("sinks") or values.get("layer_windows")):
        problems.append(([key for key in ("softmax_weight", "linear_tail") if key in values],
                         "they apply to window layers (--window / --sinks / --layer-windows)"))
    if values.get("linear_tail") is False:
        problems.append(([key for key in FEATURE_MAP_SETTINGS if key in values and key != "chunk_size"],
                         "--no-tail drops the linear tail, the only part that uses a feature map"))
    for keys, why in problems:
        if keys:
            flags = ", ".join(FAVOR_FLAGS[key].flag for key in keys)
            raise SystemExit(f"hf-performer {command}: error: {flags} would be ignored: {why}; drop "
                             f"{'it' if len(keys) == 1 else 'them'}")


def comma_separated_ints(text: str) -> list[int]:
    """argparse type of ``"512,1024,2048"`` -> ``[512, 1024, 2048]``."""
    try:
        return [int(part) for part in text.split(",") if part]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error
