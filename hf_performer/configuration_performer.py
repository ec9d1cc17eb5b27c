"""Configuration of Performer models: a source architecture's configuration plus FAVOR+ settings.

A :class:`PerformerConfig` holds

* ``source_config``: the complete configuration of the architecture being wrapped (a ``BertConfig``,
  ``GPT2Config``, ... object at run time, serialised as a dict with its ``model_type``);
* ``favor_settings``: how attention is approximated (feature map, number of features, projection kind,
  redraw policy, seed, chunk size of the causal scan, layers kept on softmax attention). They are
  validated by :func:`~.favor_settings.resolve_favor_settings`, the one place where the accepted keys and
  their defaults (:data:`~.favor_settings.FAVOR_DEFAULTS`) are defined. Each setting can also be read or
  set as an attribute (``config.nb_features``).

Task fields (``id2label``, ``label2id``, ``problem_type``) belong to the Performer config (pipelines read
them there) and are copied into the source config when a model is built. Any other attribute of the
source architecture can be read and set through the Performer config (``config.hidden_size``,
``config.pad_token_id = 0``): it is forwarded to ``source_config``, so there is one copy of each value.

Unknown or misspelt keyword arguments (to the constructor, to ``from_pretrained`` / ``AutoConfig.from_pretrained``
and to a Performer model's ``from_pretrained``) raise an error listing what is accepted: nothing is ignored.
Feature-map sizes are checked here too (trig needs an even ``nb_features``; elu+1 takes none).

Which source architectures are accepted, and the checks, live in :mod:`.source_architectures`. This module imports
only ``transformers`` and relative siblings: it is copied next to saved models for ``trust_remote_code``.
"""

from __future__ import annotations

import difflib
from dataclasses import fields

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from .favor_settings import FAVOR_DEFAULTS, canonical_favor_settings, resolve_favor_settings
from .source_architectures import (  # noqa: F401  (re-exported: the checks a config runs live there)
    PERFORMER_MODEL_TYPE,
    VERIFIED_SOURCE_MODEL_TYPES,
    PerformerConfigError,
    bounded_attention_layers,
    check_bounded_layers_kept,
    check_source_architecture,
    dispatches_attention_registry,
    reads_attention_registry,
    supported_architectures_message,
)


TASK_FIELDS = ("id2label", "label2id", "problem_type")
"""Fields owned by the Performer config and copied into the source config when a model is built."""

# Keyword arguments that transformers itself passes to or stores on any config (handled by
# `PreTrainedConfig.__post_init__` or written by `save_pretrained` / the Auto classes).
_GENERIC_CONFIG_KWARGS = frozenset(
    {
        "_commit_hash",
        "_name_or_path",
        "attn_implementation",
        "auto_map",
        "custom_pipelines",
        "experts_implementation",
        "name_or_path",
        "num_labels",
        "output_attentions",
        "per_layer_config",
        "torch_dtype",
    }
)


# Options of `from_pretrained` that transformers may leave in the keyword arguments it hands to `from_dict`.
_LOADING_KWARGS = frozenset({"dtype", "gguf_file", "torch_dtype"})

def _close_matches(word: str, candidates) -> str:
    matches = difflib.get_close_matches(word, sorted(candidates), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(repr(m) for m in matches)}?)" if matches else ""


def _favor_setting_property(key: str):
    def getter(self):
        return resolve_favor_settings(self.favor_settings).get(key)

    def setter(self, value):
        self.favor_settings = canonical_favor_settings({**self.favor_settings, key: value})
        self._sync_favor_settings()

    return property(getter, setter, doc=f"``favor_settings[{key!r}]`` (see ``FAVOR_DEFAULTS``).")


@strict
class PerformerConfig(PreTrainedConfig):
    r"""
    Configuration of a Performer model: a transformers architecture (BERT, RoBERTa, GPT-2, DistilBERT, Llama, ...)
    whose attention is computed by FAVOR+ / linear attention.

    Args:
        source_config (`dict` or `PreTrainedConfig`, *optional*):
            The complete configuration of the wrapped architecture. A dict must hold its `model_type`. It is
            copied (the caller's object is never modified) and stored as a config object. `None` gives an empty
            config that cannot build a model.
        favor_settings (`dict`, *optional*):
            FAVOR+ settings; accepted keys and defaults are those of `FAVOR_DEFAULTS`: `feature_map` (one of
            `available_feature_maps()`), `nb_features`, `orthogonal` (orthogonal or iid projections), `row_norms`
            ("chi" or "fixed"), `redraw_interval` (training calls between redraws, 0 = never), `seed` (layer `i`
            uses `seed + i`), `chunk_size` (causal scan), `softmax_layers` (layer indices kept on softmax attention),
            `feature_map_options` (the map's own options, e.g. `{"init": "favor+"}` for the learned "hedgehog" and
            "t2r" maps), and the sink + sliding-window hybrid: `window`, `sinks` (exact softmax over each row's first `sinks`
            unpadded tokens and the last `window` keys, the feature map for older keys), `softmax_weight` ("auto",
            "calibrated" or "learned"), `layer_windows` (per-layer overrides) and `linear_tail`.
            Every one of these keys may also be passed as a keyword argument of its own.
        kwargs:
            Generic `PreTrainedConfig` arguments (`id2label`, `num_labels`, `problem_type`, ...) and attributes of
            the source architecture (forwarded to `source_config`). Anything else raises an error.

    Example:

    ```python
    >>> from transformers import BertConfig
    >>> from hf_performer import PerformerConfig, PerformerModel
    >>> config = PerformerConfig(source_config=BertConfig(num_hidden_layers=2), nb_features=128, softmax_layers=[1])
    >>> model = PerformerModel(config)
    ```
    """

    model_type = PERFORMER_MODEL_TYPE

    source_config: dict | PreTrainedConfig | None = None
    favor_settings: dict | None = None

    def __post_init__(self, **kwargs):
        model_type = kwargs.pop("model_type", PERFORMER_MODEL_TYPE)  # written by to_dict; the class fixes it
        if model_type != PERFORMER_MODEL_TYPE:
            raise PerformerConfigError(
                f"this is a {model_type!r} configuration, not a Performer one; wrap it as "
                "PerformerConfig(source_config=...) or convert the model with "
                "hf_performer.conversion.convert_to_performer"
            )

        # FAVOR+ settings given as keyword arguments of their own.
        settings = dict(self.favor_settings or {})
        for key in FAVOR_DEFAULTS:
            if key in kwargs:
                value = kwargs.pop(key)
                if key in settings and settings[key] != value:
                    raise PerformerConfigError(
                        f"FAVOR+ setting {key!r} given twice with different values: favor_settings[{key!r}]="
                        f"{settings[key]!r} and {key}={value!r}"
                    )
                settings[key] = value
        try:
            self.favor_settings = canonical_favor_settings(settings)
        except (ValueError, TypeError) as error:
            raise PerformerConfigError(f"invalid FAVOR+ settings: {error}") from error

        self.source_config = self._build_source_config(self.source_config)

        # Task fields: take the source's unless given here.
        source = self.source_config
        if source is not None and self.id2label is None and "num_labels" not in kwargs:
            for field_name in TASK_FIELDS:
                if getattr(source, field_name, None) is not None:
                    setattr(self, field_name, getattr(source, field_name))

        # Keyword arguments that are neither generic nor FAVOR+ settings must be attributes of the source.
        forwarded = {}
        for key in list(kwargs):
            if key in _GENERIC_CONFIG_KWARGS or key.startswith("_"):
                continue
            if source is not None and hasattr(source, key):
                forwarded[key] = kwargs.pop(key)
                continue
            raise PerformerConfigError(self._unknown_argument_message("PerformerConfig", key))
        super().__post_init__(**kwargs)
        for key, value in forwarded.items():
            setattr(source, key, value)
        self._check_softmax_layers()
        self._sync_task_fields()
        self._sync_favor_settings()

    def _unknown_argument_message(self, caller: str, key: str) -> str:
        source = self.__dict__.get("source_config")
        candidates = set(FAVOR_DEFAULTS) | {f.name for f in fields(self)} | set(_GENERIC_CONFIG_KWARGS)
        if isinstance(source, PreTrainedConfig):
            candidates |= set(source.to_dict())
        return (
            f"{caller} got an unknown argument {key!r}{_close_matches(key, candidates)}. Accepted: "
            f"source_config, favor_settings, the FAVOR+ settings {sorted(FAVOR_DEFAULTS)}, the generic "
            "PreTrainedConfig arguments (id2label, num_labels, problem_type, ...) and attributes of the source "
            f"architecture{f' ({source.model_type})' if source is not None else ' (no source_config given)'}."
        )

    @classmethod
    def _split_extra_attributes(cls, config_dict: dict) -> tuple[dict, dict]:
        """``config_dict`` without, and with only, the saved attributes the constructor does not take: ones set on
        a config after it was built (``config.batch_norm_eps = 1e-5``), which ``save_pretrained`` writes at the top
        level. FAVOR+ settings are never extra: they stay validated."""
        source = config_dict.get("source_config")
        source_keys = set(source) if isinstance(source, dict) else set()
        accepted = set(FAVOR_DEFAULTS) | {f.name for f in fields(cls)} | set(_GENERIC_CONFIG_KWARGS) | source_keys
        extra = {key: value for key, value in config_dict.items()
                 if key not in accepted and not key.startswith("_") and key != "model_type"}
        return {key: value for key, value in config_dict.items() if key not in extra}, extra

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """``PreTrainedConfig.from_dict`` (what ``from_pretrained`` and ``AutoConfig`` call), except that a keyword
        argument that sets nothing (``nb_featurs=16``) raises :class:`PerformerConfigError` instead of being ignored.
        With ``return_unused_kwargs=True`` the leftovers are returned as usual (a model's ``from_pretrained`` hands
        them to the model)."""
        return_unused_kwargs = kwargs.pop("return_unused_kwargs", False)
        config_dict, extra_attributes = cls._split_extra_attributes(config_dict)
        config, unused = super().from_dict(config_dict, return_unused_kwargs=True, **kwargs)
        for key, value in extra_attributes.items():  # saved attributes set on an earlier config: kept, as stock
            setattr(config, key, value)              # configs keep them (the keyword arguments stay strict)
        if return_unused_kwargs:
            return config, unused
        unknown = [key for key in unused if key not in _LOADING_KWARGS and not key.startswith("_")]
        if unknown:
            raise PerformerConfigError(config._unknown_argument_message(f"{cls.__name__}.from_pretrained", unknown[0]))
        return config

    # ----------------------------------------------------------------------------------------
    # Source configuration
    # ----------------------------------------------------------------------------------------

    def _build_source_config(self, source) -> PreTrainedConfig | None:
        if source is None:
            return None
        if isinstance(source, PreTrainedConfig):
            source = source.to_dict()
        elif not isinstance(source, dict):
            raise PerformerConfigError(
                f"source_config must be a dict (with its model_type) or a PreTrainedConfig, got {type(source).__name__}"
            )
        source = dict(source)
        model_type = source.pop("model_type", None)
        if model_type is None:
            raise PerformerConfigError(
                "source_config has no 'model_type': say which architecture it configures "
                f"({supported_architectures_message()})"
            )
        stored_settings = source.pop("favor_settings", None)
        if stored_settings is not None and canonical_favor_settings(stored_settings) != self.favor_settings:
            raise PerformerConfigError(
                f"source_config carries favor_settings {stored_settings} that differ from the Performer config's "
                f"{self.favor_settings}; give the settings once, as PerformerConfig(favor_settings=...)"
            )
        source.pop("transformers_version", None)
        if model_type not in CONFIG_MAPPING:
            raise PerformerConfigError(
                f"unknown source architecture {model_type!r}: it is not a transformers model type. Supported: "
                f"{supported_architectures_message()}."
            )
        config = CONFIG_MAPPING[model_type].from_dict(source)  # as from_pretrained reads a saved config
        check_source_architecture(config)
        return config

    def _check_softmax_layers(self) -> None:
        """The layers ``softmax_layers`` and ``layer_windows`` name exist, and no layer is in both (a softmax layer
        has no window: its override would be silently dead)."""
        layers = self.favor_settings.get("softmax_layers", [])
        windowed = [int(layer) for layer in self.favor_settings.get("layer_windows") or {}]
        if self.source_config is None:
            return
        num_layers = getattr(self.source_config, "num_hidden_layers", None)
        if isinstance(num_layers, int):
            for name, named in (("softmax_layers", layers), ("layer_windows", windowed)):
                out_of_range = [i for i in named if i >= num_layers]
                if out_of_range:
                    raise PerformerConfigError(
                        f"{name} {out_of_range} do not exist: the source model has {num_layers} layers "
                        f"(indices 0..{num_layers - 1})"
                    )
        both = sorted(set(layers) & set(windowed))
        if both:
            raise PerformerConfigError(
                f"layers {both} are in both softmax_layers and layer_windows: a softmax layer has no window or sinks; "
                "drop them from one of the two"
            )
        check_bounded_layers_kept(self.source_config, layers)

    def _sync_task_fields(self) -> None:
        """Copy ``id2label`` / ``label2id`` / ``problem_type`` into the source config (this config owns them)."""
        source = self.__dict__.get("source_config")
        if isinstance(source, PreTrainedConfig):
            for field_name in TASK_FIELDS:
                setattr(source, field_name, getattr(self, field_name))

    def _sync_favor_settings(self) -> None:
        """Give the source config the settings the attention function reads (``module.config.favor_settings``)."""
        source = self.__dict__.get("source_config")
        if isinstance(source, PreTrainedConfig):
            source.favor_settings = dict(self.favor_settings)

    def prepare_source_config(self) -> PreTrainedConfig:
        """The source config, ready to build the wrapped model: task fields copied from this config, FAVOR+
        settings attached and attention implementation set to "favor". Returns ``self.source_config`` itself
        (one object shared by the Performer config and the wrapped model).

        Raises:
            PerformerConfigError: no ``source_config`` was given.
        """
        source = self.source_config
        if source is None:
            raise PerformerConfigError(
                "this PerformerConfig has no source_config: build it with PerformerConfig(source_config=...) or "
                "convert a model with hf_performer.conversion.convert_to_performer"
            )
        self._sync_task_fields()
        self._check_softmax_layers()
        self._sync_favor_settings()
        source._attn_implementation = "favor"
        return source

    @property
    def resolved_favor_settings(self) -> dict:
        """Every FAVOR+ setting, defaults included (the dict the attention function works with)."""
        return resolve_favor_settings(self.favor_settings)

    def validate_architecture(self) -> None:
        """The source config validated its own architecture when it was built; the attributes read here through
        forwarding are its (a heterogeneous per-layer config would raise on them)."""

    def validate_layer_type(self) -> None:
        """As :meth:`validate_architecture`: the source's ``layer_types`` (forwarded) were validated by the source
        config, which may also expose layer kinds of its own (NemotronH's "mlp")."""

    def _get_generation_parameters(self) -> dict:
        """Generation parameters set on the config (``generate()`` refuses them), judged by the source config: its own
        declared fields (e.g. BART's ``forced_eos_token_id``), read here through attribute forwarding, are not."""
        source = self.__dict__.get("source_config")
        if isinstance(source, PreTrainedConfig):
            return source._get_generation_parameters()
        return super()._get_generation_parameters()

    def get_text_config(self, decoder=None, encoder=None) -> PreTrainedConfig:
        """The source config (what generation, caches and embedding resizing need), or ``self`` without one."""
        source = self.__dict__.get("source_config")
        if isinstance(source, PreTrainedConfig):
            return source.get_text_config(decoder=decoder, encoder=encoder)
        return self

    # ----------------------------------------------------------------------------------------
    # Serialisation and attribute forwarding
    # ----------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        output = super().to_dict()
        source = output.get("source_config")
        if isinstance(source, dict):
            source.pop("favor_settings", None)  # recorded once, at the top level
        return output

    def __getattr__(self, name):
        # Only called when normal lookup fails: read the attribute from the source config.
        if name.startswith("_"):
            raise AttributeError(name)
        source = self.__dict__.get("source_config")
        try:
            if isinstance(source, PreTrainedConfig) and hasattr(source, name):
                return getattr(source, name)
        except RuntimeError as error:  # a per-layer attribute of a heterogeneous source config, read globally
            raise AttributeError(f"{type(self).__name__}.{name}: {str(error).splitlines()[0]}") from None
        raise AttributeError(f"{type(self).__name__} (and its source_config) has no attribute {name!r}")

    @property
    def _attn_implementation(self):
        return self._attn_implementation_internal

    @_attn_implementation.setter
    def _attn_implementation(self, value):
        """The config setter, as on stock configs; a name given here also switches the wrapped model's attention
        (``config._attn_implementation = "sdpa"`` on a Performer model runs exact softmax, ``"favor"`` linear)."""
        PreTrainedConfig._attn_implementation.fset(self, value)
        source = self.__dict__.get("source_config")
        if isinstance(source, PreTrainedConfig) and isinstance(value, str):
            source._attn_implementation = value

    def __setattr__(self, key, value):
        source = self.__dict__.get("source_config")
        if (
            isinstance(source, PreTrainedConfig)
            and not key.startswith("_")
            and key not in _OWN_ATTRIBUTES
            and key not in self.__dict__
            and hasattr(source, key)
        ):
            setattr(source, key, value)
            return
        super().__setattr__(key, value)


for _key in FAVOR_DEFAULTS:
    setattr(PerformerConfig, _key, _favor_setting_property(_key))

_OWN_ATTRIBUTES = frozenset(
    {f.name for f in fields(PerformerConfig)}
    | {name for klass in PerformerConfig.__mro__ for name in vars(klass)}
)


__all__ = [
    "PerformerConfig",
    "PerformerConfigError",
    "VERIFIED_SOURCE_MODEL_TYPES",
    "bounded_attention_layers",
    "check_source_architecture",
]
