"""Fidelity report: how closely a converted Performer model reproduces its softmax source model.

On the same inputs (user texts, a few built-in sentences, or random token ids when the source has no usable
tokenizer), both models run side by side and the report gives:

* per layer, the relative error ``||a_performer - a_source|| / ||a_source||`` of the attention module's
  output over all tokens, measured twice: on the layer's *own inputs* (the performer layer is fed the
  exact hidden states the source layer received, which isolates that layer's approximation error) and
  *propagated* (the converted model run end to end, so errors of earlier layers accumulate);
* the mean cosine similarity of the final hidden states, token by token;
* for models with a head: the agreement of the predicted classes / tokens (argmax), the mean
  ``KL(source || performer)`` of the predicted distributions, and the relative error of the logits;
* for models with a learned absolute position table: whether it was extended (and from / to how many positions);
* per layer its kind (linear, window, clustered, softmax) and, for sink + window layers, how many query positions of
  the inputs reached keys through the linear tail: the inputs include a sequence longer than every layer's window +
  sinks, so that the tail is exercised (a report on inputs inside the window would show the exact softmax part only).

:func:`fidelity_report` returns a :class:`FidelityReport`; ``report.save(folder)`` writes
``conversion_report.json`` and ``report.format_table()`` renders it for a terminal.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel

from hf_performer.favor_attention import find_attention_modules, layer_index_of, module_favor_settings, uses_favor
from hf_performer.favor_settings import is_clustered, layer_sparse_cache, layer_window
from hf_performer.modeling_performer import PerformerPreTrainedModel

from .convert import learned_position_count, public_source_name, tokenizer_is_usable


REPORT_FILE_NAME = "conversion_report.json"

DEFAULT_SENTENCES = (
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "Attention mechanisms let every token of a sequence look at every other token, at a quadratic cost.",
    "Rain is expected across the northern regions on Tuesday, with clearer skies arriving by the weekend.",
    "She opened the old wooden box and found a stack of letters tied with a faded blue ribbon.",
    "Linear attention replaces the softmax kernel with random features, so memory grows linearly with length.",
)
"""Sample inputs used when no text is given."""

RANDOM_INPUTS = "random token ids (the source has no usable tokenizer)"
"""``FidelityReport.inputs`` when no usable tokenizer was given."""

TAIL_POSITIONS = 32
"""Query positions past every window layer's window + sinks that the longest sample input reaches (at least)."""


@dataclass
class LayerFidelity:
    """Errors of one attention layer (relative Frobenius norms over all tokens of all samples)."""

    layer: int
    attention: str  # "favor" or "softmax" (kept by keep_softmax_layers)
    own_inputs_relative_error: float
    propagated_relative_error: float
    kind: str | None = None  # "linear", "window", "clustered", "improved-clustered" or "softmax" (None: older reports)
    tail_positions: int | None = None  # window layers: query positions of the inputs that attended keys through the tail


@dataclass
class FidelityReport:
    """Agreement of a Performer model with its softmax source on sample inputs (see the module docstring)."""

    source: str
    source_class: str
    performer_class: str
    favor_settings: dict
    inputs: str
    num_sequences: int
    num_tokens: int
    layers: list[LayerFidelity] = field(default_factory=list)
    final_hidden_state_cosine: float = float("nan")
    prediction_agreement: float | None = None
    logits_kl: float | None = None
    logits_relative_error: float | None = None
    position_table: str | None = None  # None: no learned absolute position table
    untrained_head: bool = False  # the source's head was initialised at load (not in its checkpoint): not compared

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, folder: str | os.PathLike) -> str:
        """Write ``conversion_report.json`` into ``folder``; returns its path."""
        path = os.path.join(folder, REPORT_FILE_NAME)
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.to_dict(), file, indent=2)
            file.write("\n")
        return path

    @classmethod
    def load(cls, folder_or_file: str | os.PathLike) -> "FidelityReport":
        path = folder_or_file
        if os.path.isdir(path):
            path = os.path.join(path, REPORT_FILE_NAME)
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
        data["layers"] = [LayerFidelity(**layer) for layer in data.get("layers", [])]
        return cls(**data)

    def format_table(self) -> str:
        """The report as a plain-text table."""
        tails = any(layer.tail_positions is not None for layer in self.layers)
        lines = [
            f"Fidelity: {self.source} ({self.source_class}) -> {self.performer_class}",
            f"  {describe_attention_settings(self.favor_settings)}",
            f"  inputs: {self.inputs} ({self.num_sequences} sequences, {self.num_tokens} tokens)",
            *([f"  {self.position_table}"] if self.position_table else []),
            "",
            f"  {'layer':>5}  {'attention':<18}  {'rel. error (own inputs)':>23}  {'rel. error (propagated)':>23}"
            + (f"  {'positions via tail':>18}" if tails else ""),
        ]
        for layer in self.layers:
            tail = "" if not tails else f"  {'-' if layer.tail_positions is None else layer.tail_positions:>18}"
            lines.append(
                f"  {layer.layer:>5}  {layer.kind or layer.attention:<18}  {layer.own_inputs_relative_error:>23.4f}  "
                f"{layer.propagated_relative_error:>23.4f}{tail}"
            )
        lines += ["", f"  final hidden states: mean cosine similarity {self.final_hidden_state_cosine:.4f}"]
        if self.untrained_head:
            lines.append("  head: newly initialised (the source checkpoint has no weights for it): not compared; "
                         "train it on the task")
        if self.logits_relative_error is not None:
            head = f"  head: logits rel. error {self.logits_relative_error:.4f}"
            if self.prediction_agreement is not None:
                head += f", prediction agreement {100 * self.prediction_agreement:.1f}%"
            if self.logits_kl is not None:
                head += f", KL(source || performer) {self.logits_kl:.3g} nats"
            lines.append(head)
        return "\n".join(lines)


def describe_attention_settings(settings: dict) -> str:
    """One line on the attention a converted model computes, from its ``favor_settings`` (as recorded)."""
    if is_clustered(settings):
        text = f"{settings['attention']} attention, {settings.get('clusters')} query clusters per head"
        text += f", exact softmax on each cluster's top {settings.get('topk')} keys" if "topk" in settings else ""
    else:
        windowed = settings.get("window") or settings.get("sinks") or settings.get("layer_windows")
        exact = ""
        if windowed:
            exact = (f"window {settings.get('window', 0)}, sinks {settings.get('sinks', 0)}"
                     + (f", a sparse cache of {settings['sparse_cache']} keys per head" if settings.get("sparse_cache")
                        else "")
                     + (f" (per layer: {settings['layer_windows']})" if settings.get("layer_windows") else ""))
        if windowed and not settings.get("linear_tail", True):  # no feature map runs: do not name one
            text = f"exact softmax over {exact}; no linear tail"
        else:
            features = settings.get("nb_features")
            text = (f"feature map {settings.get('feature_map')}"
                    + (f", {features} features" if features is not None else ""))
            text += f", seed {settings['seed']}" if "seed" in settings else ""
            text += f"; {exact}" if exact else ""
    softmax_layers = settings.get("softmax_layers") or []
    return text + (f"; softmax kept in layers {', '.join(map(str, softmax_layers))}" if softmax_layers else "")


def layer_kind(module: nn.Module) -> str:
    """``"linear"``, ``"window"``, ``"clustered"``, ``"improved-clustered"`` or ``"softmax"``: the attention a converted
    model's attention module computes."""
    if not uses_favor(module):
        return "softmax"
    settings = module_favor_settings(module)
    if is_clustered(settings):
        return settings["attention"]
    return "window" if any(layer_window(settings, layer_index_of(module))) else "linear"


def tail_query_positions(length: int, window: int, sinks: int, causal: bool) -> int:
    """Query positions of an unpadded sequence of ``length`` tokens that attend at least one key through the linear
    tail of a sink + window layer: a key that is neither a sink nor inside the window (causal: ``i - window < j``;
    bidirectional: ``|i - j| < window``)."""
    sinks = min(sinks, length)
    if causal:
        return max(0, length - window - sinks)
    return sum(1 for i in range(length) if i - window >= sinks or max(i + window, sinks) <= length - 1)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def _sample_inputs(model: PreTrainedModel, tokenizer, texts, max_length: int, seed: int, long_length: int = 0):
    """A list of single-sequence input dicts and a description of where they come from. ``long_length``: tokens of a
    sequence the inputs must include (past the window layers' windows); a built-in one is added when no text reaches
    it."""
    limit = _position_limit(model, max_length)
    short = ""
    if long_length > limit:  # the probe cannot reach past every exact key: say so
        short = (f"; the model takes {limit} positions, fewer than the {long_length} tokens a sample needs to leave "
                 "keys out of every exact part: some layers' errors cover their exact part only")
    long_length = min(long_length, limit)
    if tokenizer_is_usable(tokenizer):
        description = f"{len(texts)} user texts" if texts else f"{len(DEFAULT_SENTENCES)} built-in sentences"
        texts = list(texts) if texts else list(DEFAULT_SENTENCES)
        encodings = [
            dict(tokenizer(text, return_tensors="pt", truncation=True, max_length=max(max_length, long_length)))
            for text in texts
        ]
        encodings = [encoding for encoding in encodings if encoding["input_ids"].shape[-1] > 0]
        if not encodings:
            raise ValueError("fidelity_report: the sample texts encode to no tokens; give non-empty texts")
        if long_length and max(encoding["input_ids"].shape[-1] for encoding in encodings) < long_length:
            passage = " ".join(DEFAULT_SENTENCES)
            while len(tokenizer(passage)["input_ids"]) < long_length:
                passage += " " + " ".join(DEFAULT_SENTENCES)
            encodings.append(dict(tokenizer(passage, return_tensors="pt", truncation=True, max_length=long_length)))
            description += f" and a {long_length}-token passage of the built-in sentences (longer than the windows)"
        return encodings, description + short
    if texts:
        raise ValueError("fidelity_report: texts were given but no usable tokenizer to encode them")
    vocab_size = model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    low = 5 if vocab_size > 10 else 0  # keep clear of the special ids at the start of most vocabularies
    inputs = []
    for length in (16, 32, 48, *([long_length] if long_length > 48 else [])):
        length = min(length, limit - 2, max(max_length, long_length))
        input_ids = torch.randint(low, vocab_size, (1, length), generator=generator)
        inputs.append({"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)})
    return inputs, RANDOM_INPUTS + short


def _position_limit(model: PreTrainedModel, max_length: int) -> int:
    """The longest input the source takes: its learned position table's size, else its configured maximum (rotary
    models), else ``max_length``."""
    learned = learned_position_count(model)
    if learned is not None:
        return learned
    return getattr(model.config.get_text_config(), "max_position_embeddings", None) or max_length


def _longest_window(performer_modules: list[nn.Module]) -> int:
    """Tokens a sample must exceed for every window layer to leave keys out of its exact part: the largest window +
    sinks (+ the sparse cache's keys and one chunk of tokens waiting for its selection), plus :data:`TAIL_POSITIONS`;
    0 without window layers."""
    spans = []
    for module in performer_modules:
        if layer_kind(module) == "window":
            settings, layer = module_favor_settings(module), layer_index_of(module)
            window, sinks = layer_window(settings, layer)
            cache = layer_sparse_cache(settings, layer)
            spans.append(window + sinks + (cache + settings.get("chunk_size", 64) if cache else 0) + TAIL_POSITIONS)
    return max(spans, default=0)


def _position_table_note(source: PreTrainedModel, performer: PerformerPreTrainedModel) -> str | None:
    """What happened to the learned absolute position table (``None`` without one)."""
    source_positions, performer_positions = learned_position_count(source), learned_position_count(performer)
    if source_positions is None or performer_positions is None:
        return None
    if performer_positions == source_positions:
        return f"learned absolute positions kept at {source_positions}, as in the source"
    return (
        f"learned absolute positions extended from {source_positions} to {performer_positions} "
        "(the new rows repeat the learned ones)"
    )


# --------------------------------------------------------------------------------------------
# Hooks
# --------------------------------------------------------------------------------------------


def _attention_input(args: tuple, kwargs: dict) -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    raise RuntimeError("cannot find the hidden states given to an attention module")


def _attention_output(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


class _Recorder:
    """Forward hooks on attention modules: record inputs / outputs, optionally substitute inputs. A module called
    several times in one forward (looped models run their layers more than once) is measured on its first call."""

    def __init__(self, modules: list[nn.Module], record_inputs=False, substitute_inputs=None):
        self.inputs: list[torch.Tensor | None] = [None] * len(modules)
        self.outputs: list[torch.Tensor | None] = [None] * len(modules)
        self.handles = []
        for index, module in enumerate(modules):
            if record_inputs or substitute_inputs is not None:
                self.handles.append(
                    module.register_forward_pre_hook(
                        self._pre_hook(index, record_inputs, substitute_inputs), with_kwargs=True
                    )
                )
            self.handles.append(module.register_forward_hook(self._hook(index)))

    def _pre_hook(self, index, record_inputs, substitute_inputs):
        def hook(module, args, kwargs):
            if self.outputs[index] is not None:  # a later call of a looped layer: left as it is
                return None
            if record_inputs:
                self.inputs[index] = _attention_input(args, kwargs).detach()
            if substitute_inputs is not None:
                replacement = substitute_inputs[index]
                if args and isinstance(args[0], torch.Tensor):
                    args = (replacement.to(args[0].dtype),) + tuple(args[1:])
                else:
                    kwargs = {**kwargs, "hidden_states": replacement.to(kwargs["hidden_states"].dtype)}
                return args, kwargs
            return None

        return hook

    def _hook(self, index):
        def hook(module, args, output):
            if self.outputs[index] is None:
                self.outputs[index] = _attention_output(output).detach()

        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()


class _ErrorAccumulator:
    """Accumulates ``sum ||a - b||^2`` and ``sum ||b||^2`` for a relative Frobenius error."""

    def __init__(self):
        self.difference = 0.0
        self.reference = 0.0
        self.ran = False

    def add(self, approximation: torch.Tensor | None, reference: torch.Tensor | None):
        if approximation is None or reference is None:  # a module the model did not run (cross-attention)
            return
        self.ran = True
        approximation, reference = approximation.double(), reference.double()
        self.difference += float((approximation - reference).square().sum())
        self.reference += float(reference.square().sum())

    @property
    def value(self) -> float:
        return math.sqrt(self.difference / self.reference) if self.reference > 0 else float("nan")


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def fidelity_report(
    source: PreTrainedModel,
    performer: PerformerPreTrainedModel,
    tokenizer=None,
    texts: list[str] | tuple[str, ...] | None = None,
    max_length: int = 256,
    seed: int = 0,
) -> FidelityReport:
    """Compare ``performer`` with its softmax ``source`` model on sample inputs.

    Args:
        source: the softmax model the Performer model was converted from (same architecture and weights).
        performer: the converted model.
        tokenizer: encodes ``texts``; without a usable one (see ``tokenizer_is_usable``), seeded random token ids
            are used.
        texts: sample texts; default: :data:`DEFAULT_SENTENCES`.
        max_length: tokens kept per text.
        seed: seed of the random token ids.

    Returns:
        A :class:`FidelityReport`.
    """
    source_modules = [module for _, module in find_attention_modules(source)]
    performer_modules = [module for _, module in find_attention_modules(performer.source_model)]
    if len(source_modules) != len(performer_modules) or not source_modules:
        raise ValueError(
            f"the source ({len(source_modules)} attention modules) and the Performer model "
            f"({len(performer_modules)}) do not have the same attention layers"
        )
    inputs, description = _sample_inputs(source, tokenizer, texts, max_length, seed,
                                         long_length=_longest_window(performer_modules))
    untrained_head = _head_is_newly_initialised(source)
    modes = (source.training, performer.training)
    source.eval()
    performer.eval()
    device = next(source.parameters()).device

    own_errors = [_ErrorAccumulator() for _ in source_modules]
    propagated_errors = [_ErrorAccumulator() for _ in source_modules]
    cosines, agreements, kls = [], [], []
    logits_error = _ErrorAccumulator()
    num_tokens = 0
    try:
        for encoding in inputs:
            encoding = {key: value.to(device) for key, value in encoding.items()}
            num_tokens += int(encoding["input_ids"].numel())

            recorder = _Recorder(source_modules, record_inputs=True)
            try:
                source_output = source(**encoding, output_hidden_states=True)
            finally:
                recorder.remove()
            source_inputs, source_attention = recorder.inputs, recorder.outputs

            recorder = _Recorder(performer_modules)
            try:
                performer_output = performer(**encoding, output_hidden_states=True)
            finally:
                recorder.remove()
            for accumulator, approximation, reference in zip(propagated_errors, recorder.outputs, source_attention):
                accumulator.add(approximation, reference)

            recorder = _Recorder(performer_modules, substitute_inputs=source_inputs)
            try:
                performer(**encoding)
            finally:
                recorder.remove()
            for accumulator, approximation, reference in zip(own_errors, recorder.outputs, source_attention):
                accumulator.add(approximation, reference)

            source_hidden = source_output.hidden_states[-1].double()
            performer_hidden = performer_output.hidden_states[-1].double()
            cosines.append(nn.functional.cosine_similarity(performer_hidden, source_hidden, dim=-1).flatten())

            source_logits = getattr(source_output, "logits", None)
            performer_logits = getattr(performer_output, "logits", None)
            if (source_logits is not None and performer_logits is not None and not untrained_head
                    and source_logits.shape == performer_logits.shape):
                logits_error.add(performer_logits, source_logits)
                if source_logits.shape[-1] > 1:  # not a regression head
                    source_log_p = torch.log_softmax(source_logits.double(), dim=-1)
                    performer_log_p = torch.log_softmax(performer_logits.double(), dim=-1)
                    kls.append((source_log_p.exp() * (source_log_p - performer_log_p)).sum(-1).flatten())
                    agreements.append((source_logits.argmax(-1) == performer_logits.argmax(-1)).flatten().double())
    finally:
        source.train(modes[0])
        performer.train(modes[1])

    lengths = [int(encoding["input_ids"].shape[-1]) for encoding in inputs]  # single unpadded sequences
    run = [(module, own, propagated) for module, own, propagated in zip(performer_modules, own_errors, propagated_errors)
           if propagated.ran]  # attention modules the model never called (a decoder's cross-attention) are left out
    layers = []
    for index, (module, own, propagated) in enumerate(run):
        kind, tail = layer_kind(module), None
        if kind == "window" and module_favor_settings(module)["linear_tail"]:
            window, sinks = layer_window(module_favor_settings(module), layer_index_of(module))
            causal = bool(getattr(module, "is_causal", False))
            tail = sum(tail_query_positions(length, window, sinks, causal) for length in lengths)
        layers.append(LayerFidelity(layer=index, attention="favor" if uses_favor(module) else "softmax",
                                    own_inputs_relative_error=own.value, propagated_relative_error=propagated.value,
                                    kind=kind, tail_positions=tail))
    has_logits = logits_error.reference > 0
    return FidelityReport(
        source=public_source_name(getattr(source, "name_or_path", "")) or source.config.model_type,
        source_class=type(source).__name__,
        performer_class=type(performer).__name__,
        favor_settings=dict(performer.config.favor_settings),
        inputs=description,
        num_sequences=len(inputs),
        num_tokens=num_tokens,
        layers=layers,
        final_hidden_state_cosine=float(torch.cat(cosines).mean()),
        prediction_agreement=float(torch.cat(agreements).mean()) if agreements else None,
        logits_kl=float(torch.cat(kls).mean()) if kls else None,
        logits_relative_error=logits_error.value if has_logits else None,
        position_table=_position_table_note(source, performer),
        untrained_head=untrained_head,
    )


def _head_is_newly_initialised(model: PreTrainedModel) -> bool:
    """Whether ``model`` was loaded from a checkpoint without weights for its head: ``from_pretrained`` marks the
    parameters it loaded (``_is_hf_initialized``) and initialises the others randomly. A model built in memory has
    no marks and counts as trained."""
    base_parameters = {id(parameter) for parameter in model.base_model.parameters()}
    head = [parameter for parameter in model.parameters() if id(parameter) not in base_parameters]
    loaded = [getattr(parameter, "_is_hf_initialized", False) for parameter in model.parameters()]
    return bool(head) and any(loaded) and not any(getattr(parameter, "_is_hf_initialized", False) for parameter in head)
