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

What every class shares (the wrapped source model, the call checks, the initialisation) is
:class:`~.modeling_performer_base.PerformerPreTrainedModel`, in :mod:`.modeling_performer_base`.

Importing this module (``import hf_performer``) registers the classes with ``AutoConfig`` / ``AutoModel*``
and marks them for ``save_pretrained`` to copy their code (``auto_map``). The saved code is this package's
own modules, which import only torch, transformers and relative siblings, so
``AutoModel*.from_pretrained(folder, trust_remote_code=True)`` works where ``hf_performer`` is not installed.
"""

from __future__ import annotations

import inspect

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

from .configuration_performer import PERFORMER_MODEL_TYPE, PerformerConfig, PerformerConfigError
from .cache import cache_from_kwargs
from .favor_attention import install_favor_cache_layers, runs_causal_favor
from .modeling_performer_base import AUTO_MAP, PerformerPreTrainedModel


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
    layers by :class:`~.favor_cache_layer.FavorCacheLayer` (recurrent state instead of keys and values); layers kept on
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
        """transformers' cache preparation, with the favor layers' :class:`~.favor_cache_layer.FavorCacheLayer` put in
        the new cache right away (instead of at the first forward), so that ``activate_past_recording()``, which
        assisted decoding calls before its first forward, reaches them."""
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
AUTO_MAP.update(_auto_map())
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
