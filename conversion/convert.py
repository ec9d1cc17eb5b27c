"""Conversion of a pretrained softmax-attention model into a Performer model (FAVOR+ attention).

Every weight of the source model (Q/K/V/O projections, embeddings, norms, feed-forward layers, heads) is
reused unchanged: the Performer model wraps the stock transformers model of the same architecture and
loads the source state dict into it; only the attention function changes (``attn_implementation="favor"``)
and each converted attention module gains its feature map (projection buffers). Optionally:

* ``keep_softmax_layers``: layers that keep exact softmax attention (a hybrid model); the source's layers with a
  bounded span (sliding window, chunks: ``bounded_attention_layers``) always do;
* ``window`` / ``sinks`` (``layer_windows`` per layer): sink + sliding-window exact softmax with the feature map as
  the tail (``softmax_weight``: calibrated or a learned gamma per head, ``linear_tail=False``: no tail);
* ``max_position_embeddings``: a longer learned absolute position table (BERT/RoBERTa 512, GPT-2 1024, ...),
  made by tiling the learned rows, so that the converted model accepts thousands of tokens
  (``hf-performer convert`` extends to :data:`DEFAULT_MAX_POSITION_EMBEDDINGS` unless told otherwise).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel
from transformers.utils import logging

from hf_performer.configuration_performer import (
    PerformerConfig,
    PerformerConfigError,
    bounded_attention_layers,
    check_source_architecture,
)
from hf_performer.clustered_attention import ClusteredAttentionError
from hf_performer.favor_attention import (
    FEATURE_MAP_ATTRIBUTE,
    SOFTMAX_WEIGHT_ATTRIBUTE,
    TAIL_GATE_ATTRIBUTE,
    find_attention_modules,
    layer_index_of,
)
from hf_performer.favor_settings import exact_budget_problem
from hf_performer.feature_maps import default_feature_map_init
from hf_performer.linear_attention import LinearAttentionError
from hf_performer.modeling_performer import PERFORMER_CLASSES_BY_TASK, PerformerPreTrainedModel

from .defaults import DEFAULT_MAX_POSITION_EMBEDDINGS
from .gguf import forget_gguf_quantization, from_pretrained_arguments, is_gguf_file
from .probe import probe_converted_model
from .source import ACCEPTED as SOURCE_ACCEPTED, SourceError, check_source


logger = logging.get_logger(__name__)

TASKS = tuple(PERFORMER_CLASSES_BY_TASK)

LEARNED_ATTRIBUTES = (FEATURE_MAP_ATTRIBUTE, SOFTMAX_WEIGHT_ATTRIBUTE, TAIL_GATE_ATTRIBUTE)
"""The modules conversion adds to an attention module (trained by attention transfer, kept in float32)."""
"""Accepted ``task`` names: "base", "sequence-classification", "token-classification", "masked-lm", "causal-lm"."""

TOKENIZER_VOCAB_FILES = (
    ("tokenizer.json",),
    ("vocab.txt",),
    ("vocab.json", "merges.txt"),
    ("tokenizer.model",),
    ("spiece.model",),
    ("sentencepiece.bpe.model",),
)
"""Alternatives, any one of which gives the tokenizer its vocabulary (next to ``tokenizer_config.json``)."""


TOKENIZER_PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 0123456789"
"""Text a usable tokenizer turns into known tokens (see :func:`tokenizer_is_usable`)."""


class ConversionError(ValueError):
    """The model cannot be converted as asked (unsupported architecture or class, bad option)."""


# --------------------------------------------------------------------------------------------
# Source model and task
# --------------------------------------------------------------------------------------------


def task_of_source_class(model_class: type, config) -> str | None:
    """The task whose transformers Auto mapping gives ``model_class`` for ``config``'s architecture
    (``BertForMaskedLM`` -> "masked-lm", ``BertModel`` -> "base"), or ``None``."""
    for task in TASKS:
        if model_class in _classes_for(task, config):
            return task
    return None


def _check_task(task: str | None) -> None:
    if task is not None and task not in TASKS:
        raise ConversionError(f"unknown task {task!r}; accepted: {', '.join(TASKS)}")


def _task_from_architectures(config) -> str:
    """The task of the class a checkpoint was saved from (``config.architectures``), "base" if none matches."""
    for name in getattr(config, "architectures", None) or ():
        for task, performer_class in PERFORMER_CLASSES_BY_TASK.items():
            try:
                model_class = performer_class.source_model_mapping[type(config)]
            except KeyError:
                continue
            if model_class.__name__ == name:
                return task
    return "base"


def load_source(
    name_or_path: str | os.PathLike, task: str | None = None, **from_pretrained_kwargs
) -> tuple[PreTrainedModel, object | None]:
    """Load a pretrained softmax model and its tokenizer (``None`` when the source has none: no tokenizer files in a
    local folder, or a tokenizer transformers makes up, see :func:`_load_usable_tokenizer`).

    Args:
        name_or_path: a local folder, a local GGUF file (de-quantized to float32, see :mod:`.gguf`), or a Hub name
            available offline.
        task: one of :data:`TASKS`; ``None`` takes the task of the class the checkpoint was saved from
            (``config.architectures``), else "base" ("causal-lm" for a GGUF file, which names no class).
        **from_pretrained_kwargs: passed to ``from_pretrained`` (e.g. ``dtype``).

    Raises:
        ConversionError: no such folder or offline Hub name, unknown task, or an architecture FAVOR+ cannot be
            plugged into.
    """
    _check_task(task)
    config = _load_source_config(name_or_path)
    _check_architecture(config)
    path, gguf = from_pretrained_arguments(name_or_path)
    task = task or ("causal-lm" if gguf and not config.architectures else _task_from_architectures(config))
    performer_class = PERFORMER_CLASSES_BY_TASK[task]
    model_class = performer_class.source_model_class(config)
    model = model_class.from_pretrained(path, **gguf, **from_pretrained_kwargs)
    forget_gguf_quantization(model)
    return model, _load_usable_tokenizer(name_or_path)


def _load_source_config(name_or_path: str | os.PathLike):
    """The config of a source folder or offline Hub name; a one-line :class:`ConversionError` when there is none."""
    try:
        check_source(name_or_path)
    except SourceError as error:
        raise ConversionError(str(error)) from None
    try:
        path, gguf = from_pretrained_arguments(name_or_path)
        return AutoConfig.from_pretrained(path, **gguf)
    except (OSError, ValueError) as error:  # (check_source said what a missing or wrong path is)
        if os.path.isdir(name_or_path):
            reason = f"its config.json cannot be read: {str(error).splitlines()[0]}"
        elif is_gguf_file(name_or_path):
            reason = f"a GGUF file transformers cannot read ({str(error).splitlines()[0]})"
        else:
            reason = f"no such Hub model ({str(error).splitlines()[0]})"
        raise ConversionError(f"{os.fspath(name_or_path)}: {reason}; {SOURCE_ACCEPTED}") from None


def _load_usable_tokenizer(name_or_path: str | os.PathLike):
    """The tokenizer of a source, or ``None`` when it has none: a local folder without tokenizer files, or one that
    transformers makes up (it encodes text to nothing or to unknown tokens only, see :func:`tokenizer_is_usable`).

    A local folder's own tokenizer is kept even when its vocabulary does not cover the probe text (it is the
    source's: it goes to the output folder); :func:`fidelity_report` then measures on random token ids."""
    path, gguf = from_pretrained_arguments(name_or_path)  # a GGUF file holds its tokenizer
    is_local = os.path.isdir(name_or_path) or bool(gguf)
    if os.path.isdir(name_or_path) and not any(
        all(os.path.isfile(os.path.join(name_or_path, name)) for name in option) for option in TOKENIZER_VOCAB_FILES
    ):
        logger.info(f"no tokenizer files in {name_or_path}")
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **gguf)
    except (OSError, ValueError, TypeError) as error:
        logger.info(f"no tokenizer loaded from {name_or_path}: {error}")
        return None
    if not tokenizer_is_usable(tokenizer):
        if not is_local:
            logger.warning(f"the tokenizer of {name_or_path} encodes text to nothing or to unknown tokens only: not used")
            return None
        logger.warning(f"the tokenizer of {name_or_path} encodes sample text to unknown tokens only: fidelity is "
                       "measured on random token ids")
    return tokenizer


def tokenizer_is_usable(tokenizer) -> bool:
    """Whether ``tokenizer`` turns :data:`TOKENIZER_PROBE_TEXT` into at least one known token.

    transformers 5 builds a tokenizer even for a folder without tokenizer files: an empty one that encodes every
    text to ``[]`` (GPT-2, Qwen2, GPT-NeoX) or a 5-token one that encodes it to ``[UNK]`` only (BERT).
    """
    if tokenizer is None:
        return False
    try:
        input_ids = tokenizer(TOKENIZER_PROBE_TEXT, add_special_tokens=False)["input_ids"]
    except (KeyError, TypeError, ValueError):
        return False
    unknown_id = getattr(tokenizer, "unk_token_id", None)
    return any(token_id != unknown_id for token_id in input_ids)


def public_source_name(name_or_path: str | os.PathLike) -> str:
    """How files meant for the Hub name a source: a Hub id as given, a local folder by its base name (by its Hub
    id for a snapshot folder of the Hugging Face cache, ``.../models--namespace--name/snapshots/<commit>``)."""
    name = os.fspath(name_or_path or "")
    if not name or not (os.path.isabs(name) or os.path.exists(name)):
        return name
    parts = os.path.normpath(os.path.abspath(name)).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/")
    return parts[-1]


def _check_architecture(config) -> None:
    try:
        check_source_architecture(config)
    except PerformerConfigError as error:
        raise ConversionError(str(error)) from None


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------


def convert_to_performer(
    model_or_name_or_path: PreTrainedModel | str | os.PathLike,
    task: str | None = None,
    feature_map: str = "favor+",
    nb_features: int | None = None,
    keep_softmax_layers: Iterable[int] = (),
    max_position_embeddings: int | None = None,
    seed: int | None = None,
    *,
    orthogonal: bool | None = None,
    row_norms: str | None = None,
    redraw_interval: int | None = None,
    chunk_size: int | None = None,
    feature_map_options: dict | None = None,
    window: int | None = None,
    sinks: int | None = None,
    sparse_cache: int | None = None,
    sparse_cache_selection: str | None = None,
    sparse_cache_span: int | None = None,
    tail_cap: int | None = None,
    tail_gate: bool | None = None,
    softmax_weight: str | None = None,
    layer_windows: dict | None = None,
    linear_tail: bool | None = None,
    attention: str | None = None,
    clusters: int | None = None,
    topk: int | None = None,
) -> PerformerPreTrainedModel:
    """Convert a softmax-attention transformers model into the matching Performer model.

    Args:
        model_or_name_or_path: a transformers model (``BertForMaskedLM``, ``GPT2LMHeadModel``, ``BertModel``, ...)
            or a folder / Hub name to load one from (offline).
        task: one of :data:`TASKS`. ``None`` keeps the source model's task. A different task of the same
            architecture reuses the base model's weights and initialises the new head (e.g. "base" MiniLM ->
            "sequence-classification").
        feature_map: one of ``hf_performer.available_feature_maps()`` ("favor+", "trig", "relu", "elu+1", and the
            learned "hedgehog" and "t2r", to be trained by attention transfer: see ``attention_transfer``).
        nb_features: random features per head; ``None`` takes the map's default (``FAVOR_DEFAULTS``: 256 for
            random maps; elu+1 has exactly ``head_dim``).
        keep_softmax_layers: layer indices that keep exact softmax attention.
        max_position_embeddings: extend a learned absolute position table to this many positions (see
            :func:`extend_position_embeddings`); ``None`` keeps it.
        seed: layer ``i`` draws its projection with seed ``seed + i`` (``None``: the default, 0).
        orthogonal, row_norms, redraw_interval, chunk_size: other FAVOR+ settings; ``None`` takes the default.
        feature_map_options: the map's own options (``favor_settings["feature_map_options"]``), e.g.
            ``{"init": "favor+"}`` for a learned map.
        window, sinks: sink + sliding-window attention in every converted layer (any feature map; the map becomes
            the tail for keys older than the window), e.g. ``window=64, sinks=4``; ``None``: 0 (plain linear).
        sparse_cache: causal window layers keep up to this many older tokens per key head exact, the ones their tail
            would recall worst (``favor_settings["sparse_cache"]``); ``None``: 0. Refused for bidirectional models.
        sparse_cache_selection: ``"recall"`` (that rule) or ``"attention"`` (the tokens the boundary's query attends
            to most: ``favor_settings["sparse_cache_selection"]``); ``None``: recall.
        sparse_cache_span: odd; the selection ranks each token by its score averaged over this many neighbouring
            candidates (whole spans: ``favor_settings["sparse_cache_span"]``); ``None``: 1.
        tail_cap: causal window layers weigh a tail of ``n > tail_cap`` tokens by ``tail_cap / n`` (the bounded tail:
            ``favor_settings["tail_cap"]``), e.g. the most tokens the tail held in training; ``None``: 0 (unbounded).
        tail_gate: ``True``: causal window layers get a learned tail gate (``favor_tail_gate``, an exponent per head
            at 0, weighing a tail of ``n`` tokens by ``n ** -alpha`` once attention transfer trains it); ``None``:
            False.
        softmax_weight: ``"auto"`` (default), ``"calibrated"`` or ``"learned"`` (a trained gamma per head; learned
            maps only). Learned-mode layers get ``favor_softmax_weight`` initialised at gamma = 0.1.
        layer_windows: per-layer overrides, ``{"<layer>": {"window": int, "sinks": int, "sparse_cache": int}}``.
        linear_tail: ``False``: window layers attend to the sinks and the window only (no tail).
        attention, clusters, topk: ``"linear"`` (default: the feature map), or the zero-shot ``"clustered"`` /
            ``"improved-clustered"`` attention of bidirectional models with ``clusters`` query clusters per head and
            ``topk`` exact keys per cluster (``None``: 25 and 32). Causal models are refused.

    Returns:
        The Performer model (in eval mode, on the source's device and dtype; feature-map projections in float32).
        Every tensor of the source state dict is copied unchanged into ``performer.source_model``.

    Raises:
        ConversionError: unsupported architecture or model class, unknown task, invalid settings, or a converted
            model that fails its probe run (:func:`~.probe.probe_converted_model`: a position bias, a mask pattern
            linear attention cannot express, cached decoding that does not reproduce the full forward).
    """
    _check_task(task)
    if isinstance(model_or_name_or_path, (str, os.PathLike)):
        source, _ = load_source(model_or_name_or_path, task)
    elif isinstance(model_or_name_or_path, PerformerPreTrainedModel):
        raise ConversionError(f"{type(model_or_name_or_path).__name__} is already a Performer model")
    elif isinstance(model_or_name_or_path, PreTrainedModel):
        source = model_or_name_or_path
    else:
        raise ConversionError(
            "convert_to_performer takes a transformers PreTrainedModel or a model folder / name, got "
            f"{type(model_or_name_or_path).__name__}"
        )

    _check_architecture(source.config)
    source_task = task_of_source_class(type(source), source.config)
    if source_task is None:
        raise ConversionError(
            f"{type(source).__name__} is not a class this package converts: accepted are the {source.config.model_type} "
            f"classes of the tasks {', '.join(TASKS)} (e.g. "
            f"{', '.join(c.__name__ for t in TASKS for c in _classes_for(t, source.config))})"
        )
    task = task or source_task
    if not find_attention_modules(source):
        raise ConversionError(
            f"{type(source).__name__} has no attention module that calls transformers' attention registry "
            "(ALL_ATTENTION_FUNCTIONS): there is no attention to convert"
        )
    bounded = bounded_attention_layers(source.config)
    if bounded:
        logger.info(f"layers {sorted(bounded)} attend over {next(iter(bounded.values()))}: they keep their exact "
                    "softmax attention (constant memory already)")

    settings = {"feature_map": feature_map, "softmax_layers": sorted(set(keep_softmax_layers) | set(bounded))}
    default_init = default_feature_map_init(feature_map)
    if default_init is not None and "init" not in (feature_map_options or {}):
        # Learned maps: the config always names the start, so the folder says how its maps began whatever the
        # defaults become.
        feature_map_options = {**(feature_map_options or {}), "init": default_init}
    optional = dict(nb_features=nb_features, seed=seed, orthogonal=orthogonal, row_norms=row_norms,
                    redraw_interval=redraw_interval, chunk_size=chunk_size,
                    feature_map_options=feature_map_options or None, window=window, sinks=sinks,
                    sparse_cache=sparse_cache, sparse_cache_selection=sparse_cache_selection,
                    sparse_cache_span=sparse_cache_span, tail_cap=tail_cap, tail_gate=tail_gate,
                    softmax_weight=softmax_weight,
                    layer_windows=layer_windows or None, linear_tail=linear_tail,
                    attention=attention, clusters=clusters, topk=topk)
    settings.update({key: value for key, value in optional.items() if value is not None})
    positions = max_position_embeddings or learned_position_count(source) or getattr(
        source.config.get_text_config(), "max_position_embeddings", None)
    problem = exact_budget_problem(settings, positions)
    if problem:
        raise ConversionError(f"{problem}: every input would be exact softmax at a higher cost; give a smaller value "
                              "(or max_position_embeddings above it)")
    try:
        config = PerformerConfig(source_config=source.config, favor_settings=settings)
    except PerformerConfigError as error:
        raise ConversionError(str(error)) from None
    config.dtype = source.dtype

    performer_class = PERFORMER_CLASSES_BY_TASK[task]
    try:
        performer = performer_class(config)
    except (PerformerConfigError, ClusteredAttentionError, LinearAttentionError) as error:
        # e.g. clustered attention on a causal model, a sparse cache on an encoder
        raise ConversionError(str(error)) from None
    _copy_weights(source, performer.source_model, same_task=(task == source_task))
    _cast_like_source(performer, source)
    if max_position_embeddings is not None:
        extend_position_embeddings(performer, max_position_embeddings)
    performer.config.name_or_path = getattr(source, "name_or_path", "") or ""
    # Saved in config.json (meant for the Hub): no local path.
    performer.config.source_config._name_or_path = public_source_name(performer.config.name_or_path)
    performer.eval()
    problem = probe_converted_model(source, performer, causal_lm=task == "causal-lm")
    if problem is not None:
        raise ConversionError(f"{source.config.model_type} cannot be converted: {problem}")
    return performer


def keep_softmax_attention(model: PerformerPreTrainedModel, layers: Iterable[int]) -> list[int]:
    """Put the attention of ``layers`` of a converted model back on exact softmax: they join
    ``favor_settings["softmax_layers"]`` and lose their feature maps and softmax weights (so that the folder saved
    next holds no weight its config does not use); every other weight is unchanged.

    Returns:
        The model's softmax layers, sorted.

    Raises:
        ConversionError: a layer index the model does not have.
    """
    layers = {int(layer) for layer in layers}
    modules = {layer_index_of(module): module for _, module in find_attention_modules(model)}
    missing = sorted(layers - set(modules))
    if missing:
        raise ConversionError(f"layers {missing} do not exist: the model's attention layers are "
                              f"{min(modules)}..{max(modules)}")
    combined = sorted(set(model.config.favor_settings.get("softmax_layers", [])) | layers)
    model.config.softmax_layers = combined  # a new favor_settings dict: every module resolves its settings again
    for layer in layers:
        for attribute in LEARNED_ATTRIBUTES:
            modules[layer]._modules.pop(attribute, None)
    return combined


def _classes_for(task: str, config) -> list[type]:
    """The transformers classes of ``config``'s architecture for ``task`` (empty if it has none)."""
    try:
        classes = PERFORMER_CLASSES_BY_TASK[task].source_model_class(config)
    except PerformerConfigError:
        return []
    return list(classes) if isinstance(classes, (tuple, list)) else [classes]


def _is_feature_map_key(key: str) -> bool:
    """Whether a state-dict key belongs to what conversion adds (feature maps, learned softmax weights): the
    source has no such tensor, so it keeps its own initialisation."""
    return any(f".{attribute}." in f".{key}" for attribute in LEARNED_ATTRIBUTES)


def _copy_weights(source: PreTrainedModel, target: PreTrainedModel, same_task: bool) -> None:
    """Load ``source``'s tensors into ``target`` (same architecture) unchanged; raise on any mismatch.

    With a different task, only the base model is copied and the target's head keeps its fresh initialisation.
    """
    if not same_task:
        source, target = source.base_model, target.base_model
        logger.warning(
            f"converting to another task: the base model's weights are reused; the head of "
            f"{type(target).__name__} is newly initialised and must be trained"
        )
    missing, unexpected = target.load_state_dict(source.state_dict(), strict=False)
    missing = [key for key in missing if not _is_feature_map_key(key)]
    if missing or unexpected:
        raise ConversionError(
            f"the weights of {type(source).__name__} do not match {type(target).__name__}: missing {missing}, "
            f"unexpected {unexpected}"
        )


def _cast_like_source(performer: PerformerPreTrainedModel, source: PreTrainedModel) -> None:
    """Move the Performer model to the source's device and dtype, keeping feature maps and softmax weights in
    float32."""
    parameter = next(source.parameters(), None)
    if parameter is None:
        return
    performer.to(device=parameter.device, dtype=parameter.dtype)
    for module in performer.modules():
        for attribute in LEARNED_ATTRIBUTES:
            added = getattr(module, attribute, None)
            if isinstance(added, nn.Module):
                added.float()


# --------------------------------------------------------------------------------------------
# Longer learned position tables
# --------------------------------------------------------------------------------------------


def learned_position_count(model: PreTrainedModel) -> int | None:
    """Token positions of the learned absolute position table of ``model`` (a Performer or transformers model), or
    ``None`` when it has none (rotary, relative or sinusoidal positions)."""
    target = model.source_model if isinstance(model, PerformerPreTrainedModel) else model
    try:
        _, _, table = _learned_position_table(target)
    except ConversionError:
        return None
    return table.num_embeddings - _position_offset(table)


def default_position_table_size(model: PreTrainedModel) -> int | None:
    """:data:`DEFAULT_MAX_POSITION_EMBEDDINGS` when ``model`` has a shorter learned absolute position table, else
    ``None`` (nothing to extend)."""
    positions = learned_position_count(model)
    if positions is None or positions >= DEFAULT_MAX_POSITION_EMBEDDINGS:
        return None
    return DEFAULT_MAX_POSITION_EMBEDDINGS


def _position_offset(table: nn.Embedding) -> int:
    """Rows before the first position: RoBERTa-like tables start at ``padding_idx + 1``."""
    return 0 if table.padding_idx is None else table.padding_idx + 1


def _learned_position_table(model: PreTrainedModel) -> tuple[nn.Module, str, nn.Embedding]:
    """``(parent module, attribute name, embedding)`` of the learned absolute position table of ``model``."""
    config = model.config
    size = getattr(config, "max_position_embeddings", None)
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding)
        and module.weight.requires_grad  # a frozen table is computed (sinusoidal), not learned
        and module.num_embeddings == size
        and ("position" in name.rsplit(".", 1)[-1] or name.rsplit(".", 1)[-1] == "wpe")
    ]
    if getattr(config, "sinusoidal_pos_embds", False):
        raise ConversionError(
            f"{config.model_type} uses fixed sinusoidal position embeddings (sinusoidal_pos_embds=True), not a learned "
            "table; extending it is not supported"
        )
    if len(candidates) != 1:
        raise ConversionError(
            f"max_position_embeddings: {type(model).__name__} has no single learned absolute position table of "
            f"{size} rows (found {[name for name, _ in candidates]}); only architectures with one, such as BERT, "
            "RoBERTa, DistilBERT and GPT-2, can be extended. Rotary or relative positions (Llama, ...) need no table."
        )
    name, embedding = candidates[0]
    parent_name, _, attribute = name.rpartition(".")
    return model.get_submodule(parent_name), attribute, embedding


def _buffer_for_positions(buffer: torch.Tensor, old_rows: int, new_rows: int) -> torch.Tensor | None:
    """``buffer`` (one entry per position along its last dimension) made for ``new_rows`` positions, from what it
    holds: position ids (``arange``), zeros (token type ids) or a causal mask (lower-triangular ``[.., n, n]``, as
    GPT-BigCode keeps beside its position table); ``None`` for anything else."""
    device, dtype, leading = buffer.device, buffer.dtype, buffer.shape[:-1]
    if buffer.dim() >= 2 and buffer.shape[-2] == old_rows:
        causal = torch.ones(old_rows, old_rows, dtype=torch.bool, device=device).tril()
        if torch.equal(buffer.to(torch.bool), causal.expand_as(buffer)) and bool(((buffer == 0) | (buffer == 1)).all()):
            mask = torch.ones(new_rows, new_rows, dtype=torch.bool, device=device).tril().to(dtype)
            return mask.expand(*buffer.shape[:-2], new_rows, new_rows).contiguous()
    if torch.equal(buffer, torch.arange(old_rows, device=device).to(dtype).expand_as(buffer)):
        return torch.arange(new_rows, device=device).to(dtype).expand(*leading, new_rows)
    if not bool(buffer.any()):
        return torch.zeros(*leading, new_rows, dtype=dtype, device=device)
    return None


@torch.no_grad()
def extend_position_embeddings(model: PreTrainedModel, max_position_embeddings: int) -> PreTrainedModel:
    """Extend the learned absolute position table of ``model`` so that sequences of
    ``max_position_embeddings`` tokens are accepted.

    The new rows repeat the learned ones: position ``p`` gets the learned row ``p mod L`` (``L`` learned
    positions), the usual initialisation for long-context fine-tuning. Rows before the first position are kept:
    RoBERTa-like tables start at ``padding_idx + 1`` (their config counts those extra rows, so its
    ``max_position_embeddings`` becomes ``max_position_embeddings + padding_idx + 1``). The table is resized in place
    (it keeps its class), the buffers with one entry per position beside it (position ids, token type ids, a causal
    mask: :func:`_buffer_for_positions`) are rebuilt, and the config is updated.

    Args:
        model: a Performer model or a transformers model with one learned absolute position table.
        max_position_embeddings: number of token positions to support; at least the current number.

    Raises:
        ConversionError: no learned table (rotary / relative / sinusoidal positions), or a smaller size.
    """
    target = model.source_model if isinstance(model, PerformerPreTrainedModel) else model
    parent, attribute, old = _learned_position_table(target)
    offset = _position_offset(old)
    learned = old.num_embeddings - offset
    if not isinstance(max_position_embeddings, int) or max_position_embeddings < learned:
        raise ConversionError(
            f"max_position_embeddings must be an int >= the {learned} positions the model already has, got "
            f"{max_position_embeddings!r}"
        )
    new_rows = max_position_embeddings + offset
    old_rows = old.num_embeddings
    positions = torch.arange(max_position_embeddings, device=old.weight.device)
    weight = old.weight.new_empty(new_rows, old.embedding_dim)
    weight[:offset] = old.weight[:offset]
    weight[offset:] = old.weight[offset + positions % learned]
    # Resized in place: the table keeps its class (some architectures subclass nn.Embedding with their own forward).
    old.weight = nn.Parameter(weight, requires_grad=old.weight.requires_grad)
    old.num_embeddings = new_rows

    for name, buffer in list(parent.named_buffers(recurse=False)):
        if buffer.dim() == 0 or buffer.shape[-1] != old_rows:
            continue
        replacement = _buffer_for_positions(buffer, old_rows, new_rows)
        if replacement is None:
            raise ConversionError(
                f"{type(parent).__name__}.{name} has one entry per position and holds neither position ids, zeros nor "
                "a causal mask, so this converter cannot extend it"
            )
        parent.register_buffer(name, replacement, persistent=name not in parent._non_persistent_buffers_set)

    target.config.max_position_embeddings = new_rows
    return model
