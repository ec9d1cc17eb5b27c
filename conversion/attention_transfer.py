"""Attention transfer: train learned feature maps so that each layer's linear attention mimics its softmax attention.

Hedgehog (Zhang et al., ICLR 2024) and LoLCATs (Zhang et al. 2024) show that a converted model keeps almost all of
its quality when, before any fine-tuning, the feature maps alone are trained to reproduce the softmax attention of
the same model. This module does that, layer-wise and without labels:

* the model runs its *exact softmax* attention (attention implementation ``"favor_transfer"``), so every layer sees
  the hidden states of the softmax teacher (teacher forcing) and no error accumulates across layers;
* inside each converted layer, the same queries, keys and values also go through the layer's feature map, and the
  linear attention weights ``A_lin = phi(q) phi(k)^T / sum`` are compared with the softmax weights ``A``:

  - ``"weights"``: the soft cross-entropy of Hedgehog, reported as the KL divergence
    ``sum_j A_ij (log A_ij - log A_lin_ij)`` (the same gradient; 0 when the weights match);
  - ``"output"``: the mean squared error between ``A_lin V`` and ``A V`` of LoLCATs;
  - ``"both"`` (default): their sum;

* only feature-map parameters are trained (every other weight is frozen); the losses of all layers are summed, and
  since every layer's inputs come from the teacher, the layers learn independently.

Both weight matrices are formed explicitly (``[batch, heads, L, L]``): attention transfer runs on short sequences
(a few hundred tokens), and any mask transformers builds (padding, causal) is honoured as it is.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_performer.favor_attention import (
    ATTN_IMPLEMENTATION,
    FEATURE_MAP_ATTRIBUTE,
    SOFTMAX_WEIGHT_ATTRIBUTE,
    TAIL_GATE_ATTRIBUTE,
    find_attention_modules,
    layer_index_of,
    module_favor_settings,
)
from hf_performer.favor_settings import layer_sparse_cache, layer_window
from hf_performer.feature_maps import Features, FeatureMap
from hf_performer.linear_attention import _repeat_kv as _repeat_heads
from hf_performer.window_attention import window_linear_attention

from .defaults import TRANSFER_LOSSES as LOSSES, TRANSFER_SCHEDULES as SCHEDULES


TRANSFER_ATTN_IMPLEMENTATION = "favor_transfer"

TRANSFER_FILE_NAME = "attention_transfer.json"
"""The record of an attention transfer (``hf-performer distill`` writes it next to ``conversion_report.json``);
its presence marks a distilled folder."""


class AttentionTransferError(ValueError):
    """Attention transfer cannot run as asked (no trainable feature map, bad option)."""


# --------------------------------------------------------------------------------------------
# The two attention matrices
# --------------------------------------------------------------------------------------------


def allowed_positions(attention_mask: torch.Tensor | None, query_length: int, key_length: int, causal: bool,
                      device: torch.device) -> torch.Tensor:
    """Boolean ``[B or 1, 1 or H, Lq, Lk]`` of the (query, key) pairs attention may use.

    ``attention_mask`` is what transformers gives an attention function: ``None`` (then ``causal`` decides), a
    boolean mask (``True`` = attend) or an additive float mask (0 = attend, large negative = masked).
    """
    if attention_mask is None:
        allowed = torch.ones(query_length, key_length, dtype=torch.bool, device=device)
        if causal and query_length > 1:
            allowed = allowed.tril(key_length - query_length)
        return allowed[None, None]
    if attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    if allowed.dim() != 4:
        raise AttentionTransferError(f"expected a 4-D attention mask, got shape {tuple(attention_mask.shape)}")
    return allowed[..., -key_length:]


def softmax_attention_weights(query: torch.Tensor, key: torch.Tensor, scaling: float,
                              allowed: torch.Tensor) -> torch.Tensor:
    """Exact softmax weights ``softmax(scaling q k^T)`` over the allowed keys, float32 ``[B, H, Lq, Lk]``.

    ``query`` ``[B, H, Lq, d]``, ``key`` ``[B, Hkv, Lk, d]``; rows with no allowed key are all zero.
    """
    key = _repeat_heads(key, query.shape[1] // key.shape[1])
    scores = scaling * torch.matmul(query.float(), key.float().transpose(-1, -2))
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.nan_to_num(weights, nan=0.0)


def _dense(features: Features, key_side: bool) -> torch.Tensor:
    if features.log_scale is None:
        return features.values
    log_scale = features.log_scale
    if key_side:  # one shared constant per (example, head) cancels in the normalisation
        log_scale = log_scale - log_scale.detach().amax(dim=-1, keepdim=True)
        return features.values * torch.exp(log_scale).unsqueeze(-1)
    return features.values  # a per-query constant cancels in the normalisation


def linear_attention_weights(query: torch.Tensor, key: torch.Tensor, feature_map: FeatureMap, scaling: float,
                             allowed: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """The weights linear attention gives each key, ``phi(q_i).phi(k_j) / sum_j' phi(q_i).phi(k_j')``, float32
    ``[B, H, Lq, Lk]`` (what :func:`~hf_performer.linear_attention.linear_attention` computes without forming them).

    ``query`` and ``key`` are scaled by ``sqrt(scaling)`` before the map, as the attention kernels do.
    """
    scale = math.sqrt(scaling)
    phi_q = _dense(feature_map.query_features(query.float() * scale), key_side=False)
    phi_k = _dense(feature_map.key_features(key.float() * scale), key_side=True)
    phi_k = _repeat_heads(phi_k, query.shape[1] // key.shape[1])
    scores = torch.matmul(phi_q, phi_k.transpose(-1, -2)) * allowed
    return scores / scores.sum(-1, keepdim=True).clamp_min(eps)


def transfer_losses(teacher: torch.Tensor, student: torch.Tensor, value: torch.Tensor,
                    allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-layer losses over the query rows that attend to something.

    Args:
        teacher: softmax weights ``[B, H, Lq, Lk]``; student: linear weights of the same shape.
        value: ``[B, H, Lk, dv]`` (already repeated for grouped heads).
        allowed: the boolean mask the weights were computed with.

    Returns:
        ``(KL(teacher || student), output squared error, rows)``: the *sums* over rows (KL) and over rows and value
        channels (squared error, averaged over channels), and the number of rows, so batches average exactly.
    """
    rows = allowed.expand_as(teacher).any(-1)  # [B, H, Lq]
    log_ratio = torch.log(teacher.clamp_min(1e-30)) - torch.log(student.clamp_min(1e-30))
    kl = (teacher * log_ratio).masked_fill(~allowed, 0.0).sum(-1)
    error = torch.matmul(student - teacher, value.float())
    squared = error.square().mean(-1)
    return kl[rows].sum(), squared[rows].sum(), int(rows.sum())


def layer_transfer_losses(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, feature_map: FeatureMap,
                          scaling: float, allowed: torch.Tensor,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """One layer's teacher output and transfer losses, computed with fewer passes over the ``[B, H, Lq, Lk]``
    matrices than composing :func:`softmax_attention_weights`, :func:`linear_attention_weights` and
    :func:`transfer_losses` (the reference it is tested against).

    The student's weights are never normalised as a matrix: with ``s_ij = phi(q_i).phi(k_j)`` and ``S_i = sum_j s_ij``,
    ``sum_j A_ij log(s_ij / S_i) = sum_j A_ij log s_ij - log S_i`` (each allowed row of ``A`` sums to 1), and the
    student's output is ``(s V) / S``. The teacher's ``sum_j A_ij log A_ij`` and output ``A V`` take no gradient.

    Args:
        query: ``[B, H, Lq, d]``; key, value: ``[B, Hkv, Lk, d]`` / ``[B, Hkv, Lk, dv]`` (grouped heads repeated here).
        allowed: boolean ``[B or 1, 1 or H, Lq, Lk]`` (see :func:`allowed_positions`).

    Returns:
        ``(teacher output [B, H, Lq, dv] float32, KL sum, squared-error sum, rows)`` as :func:`transfer_losses`
        counts them; the losses carry gradients to the feature map's parameters when grad mode is on.
    """
    groups = query.shape[1] // key.shape[1]
    query, key = query.detach(), key.detach()
    with torch.no_grad():
        repeated_value = _repeat_heads(value.detach(), groups).float()
        scores = scaling * torch.matmul(query.float(), _repeat_heads(key, groups).float().transpose(-1, -2))
        # the finite minimum (not -inf) keeps rows with no allowed key finite; they are zeroed below
        scores = scores.masked_fill_(~allowed, torch.finfo(scores.dtype).min)
        log_normaliser = torch.logsumexp(scores, dim=-1, keepdim=True)
        teacher = torch.exp(scores - log_normaliser)
        rows = allowed.any(-1).expand(teacher.shape[:-1])  # [B, H, Lq]
        if not bool(rows.all()):
            teacher = teacher * rows.unsqueeze(-1)
        teacher_output = torch.matmul(teacher, repeated_value)
        # sum_j A_ij log A_ij = sum_j A_ij scores_ij - log_normaliser_i (masked entries: A = 0 times a finite score)
        teacher_neg_entropy = (teacher * scores).sum(-1) - log_normaliser.squeeze(-1)
        del scores

    scale = math.sqrt(scaling)
    phi_q = _dense(feature_map.query_features(query.float() * scale), key_side=False)
    phi_k = _repeat_heads(_dense(feature_map.key_features(key.float() * scale), key_side=True), groups)
    student_scores = torch.matmul(phi_q, phi_k.transpose(-1, -2)).masked_fill(~allowed, 0.0)
    row_sums = student_scores.sum(-1).clamp_min(1e-12)
    cross = torch.xlogy(teacher, student_scores.clamp_min(1e-30)).sum(-1) - torch.log(row_sums)
    kl = teacher_neg_entropy - cross
    student_output = torch.matmul(student_scores, repeated_value) / row_sums.unsqueeze(-1)
    squared = (student_output - teacher_output).square().mean(-1)
    return teacher_output, kl[rows].sum(), squared[rows].sum(), int(rows.sum())


def sdpa_teacher_output(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, causal: bool,
                        key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Exact softmax attention output by ``scaled_dot_product_attention``, float32 ``[B, H, L, dv]``, no gradient.

    ``query`` ``[B, H, L, d]``, ``key`` / ``value`` ``[B, Hkv, L, d]``; ``key_padding_mask`` ``[B, L]`` (``True`` =
    token). Without padding no ``[L, L]`` mask is built (``is_causal``); query rows without any allowed key are 0.
    """
    with torch.no_grad():
        query, key, value = query.float(), key.float(), value.float()
        mask = None
        if key_padding_mask is not None and not bool(key_padding_mask.all()):
            length = query.shape[2]
            mask = key_padding_mask.bool()[:, None, None, :]
            if causal:
                mask = mask & torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=causal and mask is None, scale=scaling,
            enable_gqa=key.shape[1] != query.shape[1])
        return torch.nan_to_num(output, nan=0.0)


def window_layer_transfer_losses(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 feature_map: FeatureMap | None, *, window: int, sinks: int,
                                 softmax_weight: torch.Tensor | None, scaling: float, causal: bool = True,
                                 key_padding_mask: torch.Tensor | None = None, sparse_cache: int = 0,
                                 chunk_size: int = 64, tail_cap: int = 0, tail_gate: torch.Tensor | None = None,
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """One window-hybrid layer's teacher output and output loss (LoLCATs' attention transfer): the teacher is exact
    softmax (:func:`sdpa_teacher_output`), the student :func:`~hf_performer.window_linear_attention` with the
    layer's map (``None``: no tail, the sinks + window alone), ``softmax_weight`` (gamma ``[H]``, or ``None`` for
    the calibrated mode) and ``tail_gate`` (alpha ``[H]`` or ``None``); neither side forms an ``[L, L]`` tensor when
    nothing is padded.

    Args:
        query: ``[B, H, L, d]``; key, value: ``[B, Hkv, L, d]`` (detached here: only the map and gamma learn).
        key_padding_mask: ``[B, L]`` (``True`` = token) or ``None``; padded query rows are not counted.

    Returns:
        ``(teacher output [B, H, L, dv] float32, 0 (no weights loss), squared-error sum, rows)``: the squared error
        of the outputs averaged over value channels and summed over the counted rows, as :func:`transfer_losses`.
    """
    query, key, value = query.detach(), key.detach(), value.detach()
    teacher = sdpa_teacher_output(query, key, value, scaling, causal, key_padding_mask)
    student = window_linear_attention(query.float(), key.float(), value.float(), feature_map, window=window,
                                      sinks=sinks, causal=causal, softmax_weight=softmax_weight,
                                      key_padding_mask=key_padding_mask, scaling=scaling, sparse_cache=sparse_cache,
                                      chunk_size=chunk_size, tail_cap=tail_cap,
                                      tail_gate=tail_gate if feature_map is not None else None)
    squared = (student.float() - teacher).square().mean(-1)  # [B, H, L]
    if key_padding_mask is None:
        return teacher, torch.zeros((), device=query.device), squared.sum(), squared.numel()
    rows = key_padding_mask.bool()[:, None, :].expand(squared.shape)
    return teacher, torch.zeros((), device=query.device), squared[rows].sum(), int(rows.sum())


class WindowLayer(NamedTuple):
    """The window settings of a window-hybrid favor layer, its learned gamma and its tail gate (modules, or
    ``None``)."""

    window: int
    sinks: int
    sparse_cache: int
    chunk_size: int
    softmax_weight: nn.Module | None
    tail_cap: int = 0
    tail_gate: nn.Module | None = None


def window_of_layer(module: nn.Module) -> WindowLayer | None:
    """The :class:`WindowLayer` of a window-hybrid favor layer, ``None`` for a plain linear layer (no window and no
    sinks)."""
    settings = module_favor_settings(module)
    layer = layer_index_of(module)
    window, sinks = layer_window(settings, layer)
    if not window and not sinks:
        return None
    return WindowLayer(window, sinks, layer_sparse_cache(settings, layer), settings["chunk_size"],
                       getattr(module, SOFTMAX_WEIGHT_ATTRIBUTE, None), settings["tail_cap"],
                       getattr(module, TAIL_GATE_ATTRIBUTE, None))


def key_padding_of(attention_mask: torch.Tensor | None, key_length: int) -> torch.Tensor | None:
    """The ``[B, Lk]`` key padding mask (``True`` = token) of the mask transformers gives an attention function
    (``None``, 2-D, or a 4-D boolean / additive mask): a key is a token when some query may attend to it."""
    if attention_mask is None:
        return None
    allowed = attention_mask if attention_mask.dtype == torch.bool else \
        attention_mask > torch.finfo(attention_mask.dtype).min / 2
    if allowed.dim() == 2:
        return allowed[:, -key_length:]
    return allowed[:, 0, :, -key_length:].any(-2)


# --------------------------------------------------------------------------------------------
# The attention function used during transfer
# --------------------------------------------------------------------------------------------


@dataclass
class LayerTransferLoss:
    """Sums of one layer's losses since the last reset (see :func:`transfer_losses`)."""

    kl: torch.Tensor | float = 0.0
    squared_error: torch.Tensor | float = 0.0
    rows: int = 0


class _Collector:
    def __init__(self, compute_student: bool, backward: tuple[str, float] | None = None, with_tail: bool = True,
                 sparse_cache: int | None = None):
        self.compute_student = compute_student
        self.backward = backward
        self.with_tail = with_tail
        self.sparse_cache = sparse_cache
        self.layers: dict[int, LayerTransferLoss] = {}

    def add(self, layer: int, kl, squared_error, rows: int) -> None:
        if self.backward is not None and torch.is_tensor(squared_error) and squared_error.requires_grad:
            # Teacher forcing: a layer's loss depends only on its own map (its inputs are detached), so its backward
            # can run at once: the same gradients as one backward of the sum, with one layer's graph alive at a time.
            _layer_objective(kl, squared_error, rows, *self.backward).backward()
            kl, squared_error = torch.as_tensor(kl).detach(), squared_error.detach()
        entry = self.layers.setdefault(layer, LayerTransferLoss())
        entry.kl = entry.kl + kl
        entry.squared_error = entry.squared_error + squared_error
        entry.rows += rows


_ACTIVE: list[_Collector] = []


def favor_transfer_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Exact softmax attention (the teacher's output is returned), recording the transfer losses of the layer's
    feature map on the side when a collector is active (see :func:`collect_transfer_losses`).

    Arguments are those of every transformers attention function: ``query`` ``[B, H, Lq, d]``, ``key`` / ``value``
    ``[B, Hkv, Lk, d]``. Returns ``([B, Lq, H, dv], None)`` in ``value``'s dtype.
    """
    scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", False) if causal is None else causal
    feature_map = getattr(module, FEATURE_MAP_ATTRIBUTE, None)
    layer = layer_index_of(module)
    window = window_of_layer(module)
    collector = _ACTIVE[-1] if _ACTIVE else None
    trained = feature_map is not None and layer not in module_favor_settings(module)["softmax_layers"]
    # the window-only reference (with_tail=False) exists for window layers alone
    if collector is not None and trained and (collector.with_tail or window is not None):
        with torch.enable_grad() if collector.compute_student else torch.no_grad():
            if window is None:
                allowed = allowed_positions(attention_mask, query.shape[2], key.shape[2], causal, query.device)
                output, *losses = layer_transfer_losses(query, key, value, feature_map, scaling, allowed)
            else:
                padding = key_padding_of(attention_mask, key.shape[2])
                gamma = window.softmax_weight() if window.softmax_weight is not None else None
                output, *losses = window_layer_transfer_losses(
                    query, key, value, feature_map if collector.with_tail else None, window=window.window,
                    sinks=window.sinks, softmax_weight=gamma, scaling=scaling, causal=causal, key_padding_mask=padding,
                    sparse_cache=(window.sparse_cache if collector.sparse_cache is None else collector.sparse_cache)
                    if causal else 0, chunk_size=window.chunk_size,
                    tail_cap=window.tail_cap if causal and collector.with_tail else 0,
                    tail_gate=window.tail_gate() if causal and window.tail_gate is not None else None)
        collector.add(layer, *losses)
    elif window is not None:  # a window-hybrid model: no [L, L] matrix for long sequences
        output = sdpa_teacher_output(query, key, value, scaling, causal, key_padding_of(attention_mask, key.shape[2]))
    else:
        allowed = allowed_positions(attention_mask, query.shape[2], key.shape[2], causal, query.device)
        with torch.no_grad():
            teacher = softmax_attention_weights(query, key, scaling, allowed)
            output = torch.matmul(teacher, _repeat_heads(value, query.shape[1] // value.shape[1]).float())
    return output.to(value.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(TRANSFER_ATTN_IMPLEMENTATION, favor_transfer_attention_forward)
AttentionMaskInterface.register(TRANSFER_ATTN_IMPLEMENTATION, sdpa_mask)


@contextlib.contextmanager
def collect_transfer_losses(compute_student: bool = True, backward: tuple[str, float] | None = None,
                            with_tail: bool = True, sparse_cache: int | None = None,
                            ) -> Iterator[dict[int, LayerTransferLoss]]:
    """Within the block, forwards of a model switched to ``"favor_transfer"`` record each layer's losses into the
    yielded dict ``{layer index: LayerTransferLoss}``. With ``backward=(loss, output_loss_factor)`` each layer's
    objective is back-propagated as soon as it is computed (gradients accumulate; the recorded losses are detached).
    With ``with_tail=False`` only window-hybrid layers are recorded, their student being the sinks + window alone (the
    linear tail dropped): the reference a tail's gain is measured against. ``sparse_cache=G`` measures every causal
    window layer's student with a sparse cache of ``G`` keys instead of its own setting."""
    collector = _Collector(compute_student, backward, with_tail, sparse_cache)
    _ACTIVE.append(collector)
    try:
        yield collector.layers
    finally:
        _ACTIVE.remove(collector)


@contextlib.contextmanager
def teacher_forcing(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` (a Performer model or a stock model using favor) with exact softmax attention and the transfer
    losses, in eval mode; restore its attention implementation and mode afterwards."""
    was_training = model.training
    model.set_attn_implementation(TRANSFER_ATTN_IMPLEMENTATION)
    model.eval()
    try:
        yield model
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        model.train(was_training)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def trainable_feature_maps(model: nn.Module) -> dict[int, FeatureMap]:
    """``{layer index: feature map}`` of the favor layers whose feature map has trainable parameters."""
    maps = {}
    for _, module in find_attention_modules(model):
        feature_map = getattr(module, FEATURE_MAP_ATTRIBUTE, None)
        if feature_map is None or layer_index_of(module) in module_favor_settings(module)["softmax_layers"]:
            continue
        if any(True for _ in feature_map.parameters()):
            maps[layer_index_of(module)] = feature_map
    return maps


@dataclass
class AttentionTransferResult:
    """What :func:`transfer_attention` did: the loss history and each layer's losses before and after."""

    steps: int
    loss: str
    learning_rate: float
    layers: list[int]
    schedule: str = "constant"
    history: list[dict] = field(default_factory=list)
    stop_reason: str | None = None
    output_loss_factor: float = 1.0
    layer_losses_before: dict[int, dict] = field(default_factory=dict)
    layer_losses_after: dict[int, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _layer_objective(kl, squared_error, rows: int, loss: str, output_loss_factor: float = 1.0):
    rows = max(rows, 1)
    total = 0.0
    if loss in ("weights", "both"):
        total = total + kl / rows
    if loss in ("output", "both"):
        total = total + output_loss_factor * squared_error / rows
    return total


def _combine(layers: dict[int, LayerTransferLoss], loss: str, output_loss_factor: float = 1.0) -> torch.Tensor:
    return sum((_layer_objective(entry.kl, entry.squared_error, entry.rows, loss, output_loss_factor)
                for entry in layers.values()), 0.0)


def _run_backbone(model: nn.Module, batch: dict) -> None:
    """Forward ``batch`` through the model without its task head: the losses are collected inside the attention
    layers, and a language model's vocabulary projection is a sizeable share of a step."""
    backbone = getattr(model, "base_model", model)
    backbone(**batch)


@torch.no_grad()
def measure_transfer_losses(model: nn.Module, batches: Iterable[dict], with_tail: bool = True,
                            sparse_cache: int | None = None) -> dict[int, dict]:
    """Each layer's mean weights cross-entropy and output squared error over ``batches`` (no training); with
    ``with_tail=False`` the window-hybrid layers' errors with their linear tail dropped (sinks + window alone), with
    ``sparse_cache=G`` the causal window layers' errors with a sparse cache of ``G`` keys (their setting otherwise)."""
    sums: dict[int, list[float]] = {}
    with teacher_forcing(model), collect_transfer_losses(compute_student=False, with_tail=with_tail,
                                                         sparse_cache=sparse_cache) as layers:
        for batch in batches:
            _run_backbone(model, batch)
    for layer, entry in sorted(layers.items()):
        rows = max(entry.rows, 1)
        sums[layer] = {"weights_kl": float(entry.kl) / rows,
                       "output_squared_error": float(entry.squared_error) / rows, "rows": entry.rows}
    return sums


def transfer_attention(
    model: nn.Module,
    batches: list[dict],
    *,
    steps: int,
    learning_rate: float = 1e-2,
    loss: str = "both",
    evaluation_batches: list[dict] | None = None,
    progress: bool = True,
    output_loss_factor: float = 1.0,
    deadline: float | None = None,
    schedule: str = "constant",
) -> AttentionTransferResult:
    """Train the learned feature maps of ``model`` to mimic its own softmax attention.

    Args:
        model: a Performer model (or a stock model using favor attention) whose favor layers have feature maps with
            trainable parameters (``"hedgehog"``, ``"t2r"``). Its other weights are frozen during the call and
            restored to their ``requires_grad`` afterwards.
        batches: model inputs (``input_ids``, ``attention_mask``, ...; no labels needed), cycled through for ``steps``
            optimizer steps in the given order.
        steps: optimizer steps (AdamW on the feature-map parameters only).
        learning_rate: AdamW learning rate (Hedgehog and LoLCATs use 1e-2).
        loss: ``"weights"``, ``"output"`` or ``"both"`` (see the module docstring).
        evaluation_batches: batches on which each layer's losses are measured before and after (default: ``batches``
            up to 8).
        progress: show a progress bar.
        output_loss_factor: the output loss is multiplied by it (LoLCATs: 1000).
        deadline: a ``time.time()`` after which no further step starts (``result.stop_reason`` says so; the
            history holds the steps done).
        schedule: ``"constant"`` learning rate, or ``"cosine"``: decayed from ``learning_rate`` to 0 over ``steps``
            (no warmup; a run stopped by ``deadline`` ends before the decay does).

    Returns:
        An :class:`AttentionTransferResult`.

    Raises:
        AttentionTransferError: no trainable feature map, unknown loss, no batches, ``steps < 1``.
    """
    if loss not in LOSSES:
        raise AttentionTransferError(f"unknown loss {loss!r}; accepted: {', '.join(LOSSES)}")
    if steps < 1:
        raise AttentionTransferError(f"steps must be >= 1, got {steps}")
    if schedule not in SCHEDULES:
        raise AttentionTransferError(f"unknown learning-rate schedule {schedule!r}; accepted: {', '.join(SCHEDULES)}")
    if not batches:
        raise AttentionTransferError("attention transfer needs at least one batch of inputs")
    feature_maps = trainable_feature_maps(model)
    if not feature_maps:
        raise AttentionTransferError(
            "the model has no favor layer with a trainable feature map; convert it with a learned map "
            "(feature_map='hedgehog' or 't2r') first"
        )
    evaluation_batches = evaluation_batches if evaluation_batches is not None else batches[:8]
    parameters = [p for feature_map in feature_maps.values() for p in feature_map.parameters()]
    for _, module in find_attention_modules(model):
        window = window_of_layer(module) if layer_index_of(module) in feature_maps else None
        if window is not None and loss == "weights":
            raise AttentionTransferError("window-hybrid layers train on their attention outputs: use loss='output'")
        if window is not None and window.softmax_weight is not None:
            parameters.extend(window.softmax_weight.parameters())  # gamma, learned with the maps
        if window is not None and window.tail_gate is not None:
            parameters.extend(window.tail_gate.parameters())
    trainable = {id(p) for p in parameters}
    saved_flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in saved_flags:
        p.requires_grad_(id(p) in trainable)

    result = AttentionTransferResult(steps=steps, loss=loss, learning_rate=learning_rate, schedule=schedule,
                                     layers=sorted(feature_maps), output_loss_factor=output_loss_factor)
    try:
        result.layer_losses_before = measure_transfer_losses(model, evaluation_batches)
        optimizer = torch.optim.AdamW(parameters, lr=learning_rate, weight_decay=0.0)
        bar = _progress(steps, progress)
        loop_started, cpu_started = time.perf_counter(), time.process_time()
        with teacher_forcing(model):
            for step in range(steps):
                if deadline is not None and time.time() >= deadline:
                    result.stop_reason = f"time limit reached after {step} of {steps} steps"
                    break
                batch = batches[step % len(batches)]
                rate = scheduled_learning_rate(learning_rate, step, steps, schedule)
                for group in optimizer.param_groups:
                    group["lr"] = rate
                optimizer.zero_grad(set_to_none=True)
                with collect_transfer_losses(backward=(loss, output_loss_factor)) as layers:
                    _run_backbone(model, batch)  # each layer's backward runs inside (see _Collector.add)
                total = _combine(layers, loss, output_loss_factor)
                optimizer.step()
                value = float(total.detach()) / len(layers)
                result.history.append({"step": step + 1, "loss_per_layer": value, "learning_rate": rate,
                                       "time_s": round(time.perf_counter() - loop_started, 3),
                                       "cpu_s": round(time.process_time() - cpu_started, 3)})
                bar.set_postfix(loss=f"{value:.4f}")
                bar.update(1)
        bar.close()
        result.layer_losses_after = measure_transfer_losses(model, evaluation_batches)
    finally:
        for p, flag in saved_flags:
            p.requires_grad_(flag)
    return result


def scheduled_learning_rate(peak: float, step: int, steps: int, schedule: str) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of ``steps``: ``peak`` throughout for ``"constant"``,
    ``peak * (1 + cos(pi * step / steps)) / 2`` for ``"cosine"`` (``peak`` at the first step, -> 0 at the end)."""
    if schedule == "constant":
        return peak
    return peak * 0.5 * (1.0 + math.cos(math.pi * step / steps))


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="attention transfer", disable=not enabled)


__all__ = [
    "LOSSES",
    "SCHEDULES",
    "TRANSFER_ATTN_IMPLEMENTATION",
    "AttentionTransferError",
    "AttentionTransferResult",
    "allowed_positions",
    "collect_transfer_losses",
    "favor_transfer_attention_forward",
    "layer_transfer_losses",
    "linear_attention_weights",
    "measure_transfer_losses",
    "softmax_attention_weights",
    "teacher_forcing",
    "scheduled_learning_rate",
    "trainable_feature_maps",
    "transfer_attention",
    "transfer_losses",
]
