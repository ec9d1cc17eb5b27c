"""Performer models: transformers architectures whose attention is FAVOR+ / linear attention.

Each Performer class wraps the *stock* transformers model of the source architecture for its task
(``BertForMaskedLM``, ``GPT2LMHeadModel``, ``LlamaModel``, ...), built from
``PerformerConfig.source_config`` with ``attn_implementation="favor"`` (registered by
:mod:`.favor_attention`), and with its per-layer feature maps created eagerly by
:func:`~.favor_attention.attach_feature_maps`. No layer of the source architecture is re-implemented:
weights, embeddings, heads, losses and outputs are the source model's own.

State-dict layout (what ``save_pretrained`` writes):

* task heads hold the source head model in ``self.performer``: ``performer.bert.encoder.layer.0...``,
  ``performer.classifier.weight``;
* :class:`PerformerModel` holds the source base model under the source's own prefix: ``bert.encoder...``
  (``transformer.h...`` for GPT-2, ``model.layers...`` for Llama).

So ``base_model_prefix = "performer"`` lets transformers load a head checkpoint into ``PerformerModel``
(strip ``performer.``) and a ``PerformerModel`` checkpoint into any head (add ``performer.``), as for stock
models. Feature-map projections are buffers of the attention modules
(``...attention.self.favor_feature_map.projection``) and are saved and reloaded bit-identically.

Importing this module (``import hf_performer``) registers the classes with ``AutoConfig`` / ``AutoModel*``
and marks them for ``save_pretrained`` to copy their code (``auto_map``). The saved code is this package's
own modules, which import only torch, transformers and relative siblings, so
``AutoModel*.from_pretrained(folder, trust_remote_code=True)`` works where ``hf_performer`` is not installed.
"""

from __future__ import annotations

import inspect
import warnings

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    GenerationMixin,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_MASKED_LM_MAPPING,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING,
    MODEL_MAPPING,
)

from transformers import initialization as init

from .configuration_performer import PERFORMER_MODEL_TYPE, PerformerConfig, PerformerConfigError
from .cache import CACHE_ARGUMENT_NAMES, cache_from_kwargs, cache_keyword_among
from .favor_attention import (
    ATTN_IMPLEMENTATION,
    attach_feature_maps,
    find_attention_modules,
    install_favor_cache_layers,
    runs_causal_favor,
)


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
                for performer_class in PERFORMER_CLASSES_BY_TASK.values()
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
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **_auto_map()}
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


class PerformerModel(PerformerPreTrainedModel):
    """The bare source architecture (``BertModel``, ``GPT2Model``, ``LlamaModel``, ...) with FAVOR+ attention.

    The source model is held under the source's own prefix (``self.bert``, ``self.transformer``, ``self.model``)
    so that head checkpoints load into it and its checkpoints load into heads.
    """

    source_model_mapping = MODEL_MAPPING
    task = "base"

    def _source_model_attribute(self, source_class: type[PreTrainedModel]) -> str:
        prefix = source_class.base_model_prefix
        if not prefix or prefix == self.base_model_prefix:
            raise PerformerConfigError(
                f"{source_class.__name__} has base_model_prefix={prefix!r}; PerformerModel cannot hold it"
            )
        return prefix

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        past_key_values=None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache=None,
        **kwargs,
    ):
        r"""
        Runs the source base model. Arguments are those of the source architecture's model (``None`` ones are not
        passed on):

        Args:
            input_ids: ``[batch, seq_len]`` token ids.
            attention_mask: ``[batch, seq_len]``, 1 for tokens and 0 for padding.
            token_type_ids: ``[batch, seq_len]`` segment ids (BERT-like architectures).
            position_ids: ``[batch, seq_len]``; for decoder architectures the default counts real tokens of
                ``attention_mask`` (``cumsum(mask) - 1``, as ``generate()`` does), so a left-padded row gets the
                positions it has alone.
            inputs_embeds: ``[batch, seq_len, hidden_size]`` instead of ``input_ids``.
            past_key_values: a cache (decoder architectures); see ``make_favor_cache``. ``cache`` is the same
                argument under transformers' name since 5.24 (either is handed to the source under its own).

        Returns:
            The source model's output, e.g. ``BaseModelOutputWithPoolingAndCrossAttentions`` with
            ``last_hidden_state`` ``[batch, seq_len, hidden_size]``.
        """
        return self._forward_source(
            dict(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=token_type_ids,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                past_key_values=past_key_values,
                cache=cache,
                use_cache=use_cache,
                output_attentions=output_attentions,
                output_hidden_states=output_hidden_states,
                return_dict=return_dict,
            ),
            kwargs,
        )


class _PerformerEncoderHeadModel(PerformerPreTrainedModel):
    """Shared forward of the heads that take ``labels`` and no cache."""

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        r"""
        Runs the source head model (``None`` arguments are not passed on).

        Args:
            input_ids: ``[batch, seq_len]`` token ids.
            attention_mask: ``[batch, seq_len]``, 1 for tokens and 0 for padding.
            token_type_ids: ``[batch, seq_len]`` segment ids (BERT-like architectures).
            position_ids: ``[batch, seq_len]``.
            inputs_embeds: ``[batch, seq_len, hidden_size]`` instead of ``input_ids``.
            labels: the head's labels (``[batch]`` for sequence classification, ``[batch, seq_len]`` for token
                classification and masked LM, -100 = ignored).

        Returns:
            The source head's output (``SequenceClassifierOutput``, ``TokenClassifierOutput``,
            ``MaskedLMOutput``): ``loss`` when ``labels`` are given, ``logits`` ``[batch, num_labels]``,
            ``[batch, seq_len, num_labels]`` or ``[batch, seq_len, vocab_size]``.
        """
        return self._forward_source(
            dict(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=token_type_ids,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                labels=labels,
                output_attentions=output_attentions,
                output_hidden_states=output_hidden_states,
                return_dict=return_dict,
            ),
            kwargs,
        )


class PerformerForSequenceClassification(_PerformerEncoderHeadModel):
    """The source architecture's sequence classification model (``BertForSequenceClassification``, ...) with
    FAVOR+ attention. ``config.num_labels`` / ``id2label`` / ``problem_type`` are those of the Performer config."""

    source_model_mapping = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
    task = "sequence-classification"


class PerformerForTokenClassification(_PerformerEncoderHeadModel):
    """The source architecture's token classification model with FAVOR+ attention."""

    source_model_mapping = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING
    task = "token-classification"


class PerformerForMaskedLM(_PerformerEncoderHeadModel):
    """The source architecture's masked language model (``BertForMaskedLM``, ``RobertaForMaskedLM``, ...) with
    FAVOR+ attention (bidirectional linear attention)."""

    source_model_mapping = MODEL_FOR_MASKED_LM_MAPPING
    task = "masked-lm"


class PerformerForCausalLM(PerformerPreTrainedModel, GenerationMixin):
    """The source architecture's causal language model (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ...) with
    causal FAVOR+ attention.

    ``generate()`` decodes with constant memory per layer: the attention modules replace the default cache
    layers by :class:`~.cache.FavorCacheLayer` (recurrent state instead of keys and values); layers kept on
    softmax attention keep ordinary key/value layers.
    """

    source_model_mapping = MODEL_FOR_CAUSAL_LM_MAPPING
    task = "causal-lm"

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor | None = None,
        cache=None,
        **kwargs,
    ):
        r"""
        Runs the source causal LM (``None`` arguments are not passed on).

        Args:
            input_ids: ``[batch, seq_len]`` token ids (only the new ones when ``past_key_values`` holds the past).
            attention_mask: ``[batch, past + seq_len]``, 1 for tokens and 0 for padding.
            position_ids: ``[batch, seq_len]``; by default counted over the real tokens of ``attention_mask``
                (``cumsum(mask) - 1`` clamped at 0, as ``generate()`` does), so that a left-padded row gets the
                positions it has alone (random features are not shift-invariant).
            past_key_values: the cache of earlier tokens (``make_favor_cache(model)``, or the one ``generate()``
                builds); ``cache`` is the same argument under transformers' name since 5.24.
            inputs_embeds: ``[batch, seq_len, hidden_size]`` instead of ``input_ids``.
            labels: ``[batch, seq_len]`` next-token labels (shifted inside, -100 = ignored).
            use_cache: return the updated cache.
            logits_to_keep: compute the logits of the last ``logits_to_keep`` positions only (an int), or of the
                given positions (a 1-D tensor); ``generate()`` passes 1 at prefill. Sources without it raise.
            **kwargs: e.g. ``cache_position``; passed on.

        Returns:
            ``CausalLMOutputWithPast`` (or the source's equivalent): ``logits`` ``[batch, seq_len, vocab_size]``,
            ``past_key_values``, ``loss`` when ``labels`` are given.
        """
        return self._forward_source(
            dict(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=token_type_ids,
                position_ids=position_ids,
                past_key_values=past_key_values,
                cache=cache,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                output_attentions=output_attentions,
                output_hidden_states=output_hidden_states,
                return_dict=return_dict,
                logits_to_keep=logits_to_keep,
            ),
            kwargs,
        )

    def _supports_logits_to_keep(self) -> bool:
        """Whether the source causal LM takes ``logits_to_keep`` (``generate()`` then computes only the last
        position's logits at prefill); this class's own ``forward`` always names it."""
        return "logits_to_keep" in inspect.signature(type(self.source_model).forward).parameters

    def generate(self, *args, **kwargs):
        """``GenerationMixin.generate``, refusing up front (one-line ``ValueError``) the assisted-decoding
        combinations a recurrent favor cache cannot serve: a linear-attention *assistant* model (its cache would
        have to undo tokens of earlier calls, which is not recorded), and ``output_attentions`` with an assistant
        or prompt lookup (the weights of the verified tokens need the past keys, which the state does not keep).
        Assisted decoding and prompt lookup themselves work: the cache rolls back rejected candidates."""
        generation_config = kwargs.get("generation_config") or self.generation_config
        assistant = kwargs.get("assistant_model")
        lookup = kwargs.get("prompt_lookup_num_tokens", getattr(generation_config, "prompt_lookup_num_tokens", None))
        if (assistant is not None or lookup) and runs_causal_favor(self):
            if assistant is not None and runs_causal_favor(assistant):
                raise ValueError(
                    f"generate(assistant_model={type(assistant).__name__}): a linear-attention (favor) assistant cannot "
                    "roll its recurrent cache back to the tokens the main model accepted; use a softmax assistant "
                    "(e.g. the source model, or this one with set_attn_implementation('sdpa')) or "
                    "prompt_lookup_num_tokens"
                )
            if kwargs.get("output_attentions", getattr(generation_config, "output_attentions", False)):
                raise ValueError(
                    "generate(output_attentions=True) with assisted decoding / prompt lookup: the attention weights of "
                    "verified tokens need the past keys, which a recurrent favor cache does not keep; drop "
                    "output_attentions, or generate without an assistant"
                )
        return super().generate(*args, **kwargs)

    def _supports_default_dynamic_cache(self) -> bool:
        """The source causal LM's answer: transformers decides it by class name (MiniMax builds a cache of its own
        in its forward), which this wrapper's name would hide."""
        return type(self.source_model)._supports_default_dynamic_cache()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs):
        """transformers' cache preparation, with the favor layers' :class:`~.cache.FavorCacheLayer` put in the new
        cache right away (instead of at the first forward), so that ``activate_past_recording()``, which assisted
        decoding calls before its first forward, reaches them."""
        result = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        install_favor_cache_layers(cache_from_kwargs(model_kwargs, "generate"), self)
        return result

    def prepare_inputs_for_generation(self, input_ids, *args, inputs_embeds=None, **kwargs):
        """The source model's own preparation of generation inputs. ``inputs_embeds`` is named here because
        ``generate(inputs_embeds=...)`` looks for it in this signature."""
        return self.source_model.prepare_inputs_for_generation(input_ids, *args, inputs_embeds=inputs_embeds, **kwargs)


PERFORMER_CLASSES_BY_TASK: dict[str, type[PerformerPreTrainedModel]] = {
    cls.task: cls
    for cls in (
        PerformerModel,
        PerformerForSequenceClassification,
        PerformerForTokenClassification,
        PerformerForMaskedLM,
        PerformerForCausalLM,
    )
}
"""Performer class of each task name (``"base"``, ``"sequence-classification"``, ``"token-classification"``,
``"masked-lm"``, ``"causal-lm"``)."""

AUTO_CLASSES = {
    PerformerModel: AutoModel,
    PerformerForSequenceClassification: AutoModelForSequenceClassification,
    PerformerForTokenClassification: AutoModelForTokenClassification,
    PerformerForMaskedLM: AutoModelForMaskedLM,
    PerformerForCausalLM: AutoModelForCausalLM,
}
"""The transformers Auto class each Performer class is registered with."""


def _auto_map() -> dict[str, str]:
    """``auto_map`` entries of every Performer class (``"AutoModelForMaskedLM": "modeling_performer.Perf..."``)."""
    module = __name__.rsplit(".", 1)[-1]
    config_module = PerformerConfig.__module__.rsplit(".", 1)[-1]
    auto_map = {"AutoConfig": f"{config_module}.{PerformerConfig.__name__}"}
    auto_map.update({auto.__name__: f"{module}.{cls.__name__}" for cls, auto in AUTO_CLASSES.items()})
    return auto_map


# Marks the classes so that save_pretrained copies this module (and its relative imports) and writes auto_map.
PerformerConfig.register_for_auto_class()
for _cls, _auto in AUTO_CLASSES.items():
    _cls.register_for_auto_class(_auto.__name__)

# In-process registration. A copy of this file loaded as remote code (trust_remote_code=True) is reached through
# auto_map instead; transformers registers it itself.
if __name__.startswith("hf_performer."):
    AutoConfig.register(PERFORMER_MODEL_TYPE, PerformerConfig, exist_ok=True)
    for _cls, _auto in AUTO_CLASSES.items():
        _auto.register(PerformerConfig, _cls, exist_ok=True)


__all__ = [
    "PERFORMER_CLASSES_BY_TASK",
    "PerformerForCausalLM",
    "PerformerForMaskedLM",
    "PerformerForSequenceClassification",
    "PerformerForTokenClassification",
    "PerformerModel",
    "PerformerPreTrainedModel",
]
