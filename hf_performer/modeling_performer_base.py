"""What every Performer class shares (:class:`PerformerPreTrainedModel`): the stock transformers model of the source
architecture built inside it with ``attn_implementation="favor"`` and its feature maps attached, the checks of a
call's arguments and length against that model, and the weights' initialisation. The task classes and their
registration with the Auto classes are in :mod:`.modeling_performer`.

This module imports only ``torch``, ``transformers`` and relative siblings: it is copied next to saved models for
``trust_remote_code``.
"""

from __future__ import annotations

import inspect
import warnings

import torch
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.models.auto.modeling_auto import MODEL_MAPPING

from .configuration_performer import PerformerConfig, PerformerConfigError
from .cache import CACHE_ARGUMENT_NAMES, cache_from_kwargs, cache_keyword_among
from .favor_attention import ATTN_IMPLEMENTATION, attach_feature_maps, find_attention_modules


AUTO_MAP: dict[str, str] = {}
"""``auto_map`` entries of every Performer class, written into each saved config (filled by
:mod:`.modeling_performer` when it registers the classes)."""

# Arguments checked against the source model's forward signature before a call; anything else given as a
# keyword (output_attentions, output_hidden_states, return_dict, num_items_in_batch, ...) is passed through.
_INPUT_ARGUMENTS = (
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "position_ids",
    "inputs_embeds",
    "labels",
    "cache",
    "past_key_values",
    "use_cache",
    "cache_position",
    "logits_to_keep",
)


# Passed by generate() to every model; a source whose forward does not name them but takes **kwargs gets them there,
# as from its own generate().
_GENERATION_CONTROLS = ("use_cache", "cache_position")


def _position_ids_from_mask(call: dict) -> torch.Tensor | None:
    """``[batch, seq_len]`` position ids of the new tokens counted over real tokens only, ``cumsum(mask) - 1``
    clamped at 0 (as ``generate()`` does), from a 2-D ``attention_mask`` ``[batch, past + seq_len]``; ``None``
    without one.

    With left padding the default ``arange`` would give a row different positions than it has alone, and random
    features of rotated / position-embedded queries and keys are not shift-invariant: its output would depend on
    its batch neighbours' padding.
    """
    attention_mask = call.get("attention_mask")
    new_tokens = call.get("input_ids", call.get("inputs_embeds"))
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or new_tokens is None:
        return None
    seq_len = new_tokens.shape[1]
    if attention_mask.shape[1] < seq_len:
        return None  # not a mask of past + new tokens: leave the inputs to the source model's own checks
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    return position_ids[:, -seq_len:]


def _are_mask_positions(position_ids, call: dict) -> bool:
    """Whether ``position_ids`` are those of the real tokens of ``call``'s attention mask (consecutive without one):
    what ``generate()`` passes when the model's forward names ``position_ids``."""
    if not isinstance(position_ids, torch.Tensor):
        return False
    expected = _position_ids_from_mask(call)
    if expected is None:
        return bool((position_ids.diff(dim=-1) == 1).all())
    return position_ids.shape[-1] == expected.shape[-1] and bool((position_ids == expected.to(position_ids.device)).all())


class PerformerPreTrainedModel(PreTrainedModel):
    """Base class of the Performer models: builds and holds the source architecture's model for the task.

    Class attributes:
        source_model_mapping: the transformers Auto mapping (config class -> model class) giving the source
            model class for this task.
        task: the task name used by the converter and the error messages.
    """

    config_class = PerformerConfig
    base_model_prefix = "performer"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    # The wrapper has no attention of its own: these let `set_attn_implementation("sdpa")` switch the wrapped model
    # to exact softmax attention (same weights) and `set_attn_implementation("favor")` switch it back. "favor" is the
    # default implementation of these classes (see _check_and_adjust_attn_implementation).
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    source_model_mapping = MODEL_MAPPING
    task = "base"

    def __init__(self, config: PerformerConfig, **kwargs):
        if kwargs:  # what `from_pretrained(folder, nb_featurs=16)` leaves after the config took its own arguments
            raise PerformerConfigError(config._unknown_argument_message(f"{type(self).__name__}", next(iter(kwargs))))
        super().__init__(config)
        requested_implementation = config._attn_implementation  # "favor" unless e.g. attn_implementation="sdpa"
        source_config = config.prepare_source_config()
        source_class = self.source_model_class(source_config)
        source_model = source_class(source_config)
        attach_feature_maps(source_model)  # feature maps exist whatever runs now: switching back to favor keeps them
        source_config._attn_implementation_internal = requested_implementation
        self._source_attribute = self._source_model_attribute(source_class)
        self.add_module(self._source_attribute, source_model)
        # Decoders (GPT-2, Llama, BERT with is_decoder) get position ids counted from the attention mask.
        self._source_is_causal = any(
            getattr(module, "is_causal", False) for _, module in find_attention_modules(source_model)
        )
        if self.can_generate():
            self.generation_config = source_model.generation_config
        self.post_init()

    # ----------------------------------------------------------------------------------------
    # The wrapped source model
    # ----------------------------------------------------------------------------------------

    @classmethod
    def source_model_class(cls, source_config) -> type[PreTrainedModel]:
        """The transformers class of ``source_config``'s architecture for this class's task.

        Raises:
            PerformerConfigError: the architecture has no model for this task in transformers.
        """
        try:
            return cls.source_model_mapping[type(source_config)]
        except KeyError:
            offered = [
                performer_class.task
                for performer_class in _task_classes(PerformerPreTrainedModel)
                if type(source_config) in performer_class.source_model_mapping
            ]
            raise PerformerConfigError(
                f"{cls.__name__} needs a {cls.task!r} model of the source architecture, but transformers has none "
                f"for {source_config.model_type!r}; tasks available for it: {offered}"
            ) from None

    def _source_model_attribute(self, source_class: type[PreTrainedModel]) -> str:
        return self.base_model_prefix

    def initialize_weights(self) -> None:
        """transformers' initialisation (the source model's own ``_init_weights`` for its modules), then the
        feature maps' parameters and buffers (projections, learned maps) set to their deterministic initial values
        (seed + layer, :meth:`~.feature_map_base.FeatureMap.initial_tensors`). Like every ``transformers.initialization``
        function, tensors loaded from a checkpoint (``_is_hf_initialized``) are left alone: a model materialised
        from the meta device gets the saved values where the checkpoint has them and valid fresh ones elsewhere."""
        # transformers treats any class outside its package as custom code and then skips modules without parameters
        # of their own (a guard for remote code writing parameters in place). The wrapped model is transformers' own
        # code, whose inits may come from such modules (GPT-2 scales c_proj from its attention / MLP modules): it is
        # initialised as transformers initialises its in-tree models. Our feature maps use transformers.initialization.
        type(self)._initializing_as_in_tree = True
        try:
            super().initialize_weights()
        finally:
            type(self)._initializing_as_in_tree = False
        for module in self.modules():
            initial_tensors = getattr(module, "initial_tensors", None)
            if not callable(initial_tensors) or not hasattr(module, "nb_features"):
                continue
            for name, value in initial_tensors().items():
                tensor = getattr(module, name)
                init.copy_(tensor, value.to(device=tensor.device, dtype=tensor.dtype))

    _initializing_as_in_tree = False

    @classmethod
    def is_custom_code(cls) -> bool:
        """transformers' answer (True: this class is not in its package), except while :meth:`initialize_weights`
        runs."""
        return False if cls._initializing_as_in_tree else super().is_custom_code()

    def _check_and_adjust_attn_implementation(
        self, attn_implementation: str | None, is_init_check: bool = False, allow_all_kernels: bool = False
    ) -> str:
        """As for stock models, with "favor" (linear attention) the default instead of "sdpa": ``from_pretrained``
        / ``_from_config`` without ``attn_implementation`` run favor, ``attn_implementation="sdpa"`` or ``"eager"``
        run exact softmax attention with the same weights (the teacher)."""
        if attn_implementation is None or attn_implementation == ATTN_IMPLEMENTATION:
            return ATTN_IMPLEMENTATION
        return super()._check_and_adjust_attn_implementation(attn_implementation, is_init_check, allow_all_kernels)

    @property
    def source_model(self) -> PreTrainedModel:
        """The wrapped transformers model (e.g. ``BertForMaskedLM``) running FAVOR+ attention."""
        return getattr(self, self._source_attribute)

    @property
    def accepts_loss_kwargs(self) -> bool:
        """Whether the source model's loss uses ``num_items_in_batch`` (read by ``Trainer``)."""
        source = self.source_model
        if hasattr(source, "accepts_loss_kwargs"):
            return source.accepts_loss_kwargs
        parameters = inspect.signature(source.forward).parameters.values()
        return any(parameter.kind == inspect.Parameter.VAR_KEYWORD for parameter in parameters)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained``, with every Performer class written into ``auto_map`` so that any
        Auto class (e.g. ``AutoModel`` on a saved masked LM) loads the folder with ``trust_remote_code=True``."""
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **AUTO_MAP}
        return super().save_pretrained(save_directory, *args, **kwargs)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.source_model.get_input_embeddings()

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.source_model.set_input_embeddings(value)

    def get_output_embeddings(self) -> torch.nn.Module | None:
        return self.source_model.get_output_embeddings()

    def set_output_embeddings(self, new_embeddings: torch.nn.Module) -> None:
        self.source_model.set_output_embeddings(new_embeddings)

    def _position_table_limits(self) -> tuple[int, int, bool] | None:
        """``(rows, first_position, per_position_buffers)`` of the source model's learned absolute position table
        (BERT, RoBERTa, DistilBERT, GPT-2), or ``None`` (rotary, relative or sinusoidal positions).

        Found as the converter finds it: the one embedding of ``max_position_embeddings`` rows named ``*position*``
        or ``wpe``. ``first_position`` is ``padding_idx + 1`` for RoBERTa-like tables, else 0;
        ``per_position_buffers``: the embeddings module also slices ``position_ids`` / ``token_type_ids`` buffers of
        that length. Looked up again when the size changes (a table extended in place).
        """
        source_config = self.source_model.config
        size = getattr(source_config, "max_position_embeddings", None)
        cached = self.__dict__.get("_position_table_lookup")
        if cached is not None and cached[0] == size:
            return cached[1]
        limits = None
        if isinstance(size, int) and not getattr(source_config, "sinusoidal_pos_embds", False):
            tables = [
                (name, module)
                for name, module in self.source_model.named_modules()
                if isinstance(module, torch.nn.Embedding)
                and module.num_embeddings == size
                and ("position" in name.rsplit(".", 1)[-1] or name.rsplit(".", 1)[-1] == "wpe")
            ]
            if len(tables) == 1:
                name, table = tables[0]
                parent = self.source_model.get_submodule(name.rpartition(".")[0])
                buffers = any(buffer.shape[-1:] == (size,) for buffer in parent.buffers(recurse=False))
                limits = (size, 0 if table.padding_idx is None else table.padding_idx + 1, buffers)
        self.__dict__["_position_table_lookup"] = (size, limits)
        return limits

    def _check_input_length(self, call: dict) -> None:
        """Raise a one-line ``ValueError`` for inputs longer than the learned position table (transformers reports
        them as a size mismatch or an index error deep inside the embeddings)."""
        limits = self._position_table_limits()
        new_tokens = call.get("input_ids", call.get("inputs_embeds"))
        if limits is None or new_tokens is None or new_tokens.dim() < 2:
            return
        rows, first_position, buffers = limits
        limit = rows - first_position
        cache = cache_from_kwargs(call, type(self).__name__)
        past = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
        needed, detail = past + new_tokens.shape[1], f" ({past} cached + {new_tokens.shape[1]} new)" if past else ""
        position_ids = call.get("position_ids")
        if position_ids is not None and not buffers:
            needed, detail = 0, ""  # only the positions used count (left padding uses none)
        if position_ids is not None and position_ids.numel() and int(position_ids.max()) + 1 - first_position > needed:
            needed, detail = int(position_ids.max()) + 1 - first_position, " (largest position id + 1)"
        if needed > limit:
            raise ValueError(
                f"{type(self).__name__}: the input needs {needed} tokens{detail} but the learned position table of "
                f"this {self.config.source_config.model_type!r} model holds {limit} (max_position_embeddings={rows}); "
                f"truncate inputs to {limit} tokens, or convert the model with a longer table: hf-performer convert "
                "... --max-position-embeddings N"
            )

    def _forward_source(self, arguments: dict, kwargs: dict):
        """Call the source model with the given (not ``None``) arguments.

        Raises:
            TypeError: an input argument the source architecture does not take (e.g. ``token_type_ids`` for
                GPT-2's causal LM head is fine, for Llama it is not).
        """
        call = {name: value for name, value in arguments.items() if value is not None}
        accepted = inspect.signature(type(self.source_model).forward).parameters
        # The cache under either keyword (transformers renamed past_key_values to cache in 5.24), handed to the
        # source under the one its forward declares; the old one warns where the source has the new one, as
        # transformers' own models do.
        given = {**call, **kwargs}
        cache = cache_from_kwargs(given, type(self).__name__)
        source_cache_name = cache_keyword_among(accepted)
        if source_cache_name == "cache" and given.get("past_key_values") is not None:
            warnings.warn(f"`past_key_values` is deprecated and will be removed in version 5.40.0 for "
                          f"`{type(self).__name__}.forward`. Use `cache` instead.", FutureWarning, stacklevel=3)
        for name in CACHE_ARGUMENT_NAMES:
            call.pop(name, None)
            kwargs.pop(name, None)
        if cache is not None:
            call[source_cache_name] = cache
        if "position_ids" not in accepted and _are_mask_positions(call.get("position_ids"), call):
            # What generate() derives from the mask because this class's forward names position_ids; a source that
            # does not take them counts positions itself, as under its own generate().
            del call["position_ids"]
        takes_any_keyword = any(parameter.kind == inspect.Parameter.VAR_KEYWORD for parameter in accepted.values())
        unsupported = [name for name in call if name in _INPUT_ARGUMENTS and name not in accepted
                       and not (takes_any_keyword and name in _GENERATION_CONTROLS)]
        if unsupported:
            raise TypeError(
                f"{type(self.source_model).__name__} (source architecture {self.config.source_config.model_type!r}) "
                f"does not take {unsupported}; it takes {[n for n in accepted if n in _INPUT_ARGUMENTS]}"
            )
        if "position_ids" not in call and "position_ids" in accepted and self._source_is_causal:
            position_ids = _position_ids_from_mask(call)
            if position_ids is not None:
                call["position_ids"] = position_ids
        self._check_input_length(call)
        for flag in ("output_attentions", "output_hidden_states"):
            if call.get(flag) is None and getattr(self.config, flag, False):
                call[flag] = True
        if call.get("return_dict") is None and not self.config.return_dict:
            call["return_dict"] = False
        return self.source_model(**call, **kwargs)


def _task_classes(root: type) -> list[type]:
    """The Performer classes with a task below ``root``, in definition order (what ``PERFORMER_CLASSES_BY_TASK`` of
    :mod:`.modeling_performer` lists)."""
    found = []
    for subclass in root.__subclasses__():
        if "task" in vars(subclass):
            found.append(subclass)
        found.extend(_task_classes(subclass))
    return found
