"""One decoding-memory budget spent where a window hybrid needs exact memory (``hf-performer budget``,
``hf-performer linearize --cache-budget``).

Each causal window layer of a converted model can keep a sparse cache of ``G`` hard keys per key head
(``favor_settings["layer_windows"][layer]["sparse_cache"]``) or go back to exact softmax attention (its key/value
cache grows with the context). What an option buys is measured, not guessed: every layer's attention output error
against exact softmax (the attention transfer's loss, teacher forcing, :func:`measure_option_errors`) for each
candidate ``G``; exact softmax has none. Or, by default in ``hf-performer budget``, by the end metric
(:func:`measure_option_losses`): how much the model's next-token loss on the measurement text rises when that one
layer keeps ``G`` hard keys and every other window layer keeps all of them, which also sees what a dropped token
costs the layers after it. What an option costs is the bytes of the layer's decoding state for one
sequence at the budget's context length (:func:`~hf_performer.window_state.window_state_bytes`; a softmax layer's
keys and values at that length). :func:`allocate_cache_budget` then picks one option per layer that minimises the
summed error under the budget (a multiple-choice knapsack solved exactly by dynamic programming over the budget in
small units, rounding every cost up so the budget is never exceeded).

The unit of choice is the layer: the operator keeps the same ``G`` for every key head of a layer, and the window of a
layer is not allocated (it is what LoRA trained).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import nn

from hf_performer.cache import linear_state_bytes
from hf_performer.favor_attention import (
    find_attention_modules, layer_index_of, module_favor_settings, update_favor_settings, uses_favor,
)
from hf_performer.favor_settings import (effective_nb_features, layer_sparse_cache, layer_window,
                                         resolve_favor_settings)
from hf_performer.window_state import window_state_bytes

CACHE_SIZES = (0, 32, 64, 128, 256, 512)
"""The sparse-cache sizes ``G`` the allocator measures by default."""
CACHE_BUDGET_FILE = "cache_budget.json"
"""The allocation's record in the folder ``hf-performer budget`` writes (:meth:`CacheAllocation.to_dict`)."""
SERVING_SETTINGS_FILE = "serving_settings.json"
"""The record of a folder ``hf-performer settings`` wrote (:func:`serving_settings_record`)."""
SERVING_SETTINGS = ("window", "sparse_cache", "sparse_cache_selection", "sparse_cache_span", "tail_cap")
"""The window settings a trained model can be served with other values of (no weight change)."""
SERVING_CONTEXTS = (1024, 2048, 4096, 16384, 65536)
"""The context lengths a serving record gives the decoding state at."""
SOFTMAX = "softmax"
"""The option name of a layer put back on exact softmax attention."""
BUDGET_UNITS = 20_000
"""The dynamic programme's resolution: the budget is cut into this many units (each cost is rounded up)."""
_SIZE_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_BYTE_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "kib": 1024, "mib": 1024 ** 2,
               "gib": 1024 ** 3}
_TOKEN_UNITS = ("tokens", "token", "tok")


MEASURED_NAMES = {"exact": "every key kept (exact)", "allocation": "this allocation",
                  "uniform": "one G for every layer"}
"""The configurations :func:`measure_allocation_losses` measures, as the table names them."""
METRICS = {
    "loss": "the rise of the model's mean next-token loss on the measurement text when only that layer keeps G hard "
            "keys (every other window layer on exact softmax)",
    "error": "mean squared error of each layer's attention output against exact softmax (teacher forcing)",
}
"""What an allocation minimises (``hf-performer budget --metric``), as its record and card say it."""

NO_TAIL_NOTE = (
    "these window layers have no linear tail: a token a layer's cache does not keep is lost to every later token, "
    "which the layer's output error understates; on SmolLM2-135M without a tail this allocation was worse than one G "
    "for every layer with the same bytes (1.308x against 1.119x softmax perplexity at 1k, benchmarks/README.md): "
    "compare the two before using it")
"""The warning an allocation for layers without a linear tail carries (printed with its table)."""


class CacheBudgetError(ValueError):
    """A budget or option list that cannot be used; the message is one line saying what is accepted."""


def softmax_cache_bytes(kv_heads: int, head_dim: int, dtype_bytes: int, context: int) -> int:
    """Bytes of one softmax layer's key/value cache for one sequence of ``context`` tokens."""
    return 2 * kv_heads * head_dim * dtype_bytes * context


def softmax_token_bytes(config, dtype_bytes: int) -> int:
    """Bytes one token adds to the key/value cache of every layer of a softmax model with ``config`` (a
    transformers config, or a ``PerformerConfig``, which reads its source's geometry)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * softmax_cache_bytes(kv_heads, head_dim, dtype_bytes, 1)


def parse_cache_budget(text: str, bytes_per_softmax_token: int) -> int:
    """Bytes of a budget written ``"12MiB"``, ``"12.5MB"``, ``"500000"`` (bytes) or ``"2048tokens"`` (what the
    source's softmax key/value cache holds for that many tokens: ``bytes_per_softmax_token`` each)."""
    match = _SIZE_PATTERN.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or (unit not in _BYTE_UNITS and unit not in _TOKEN_UNITS):
        raise CacheBudgetError(f"cache budget {text!r} is not a size; accepted: a number of bytes with an optional "
                               "unit (B, KB, MB, GB, KiB, MiB, GiB) or of softmax tokens ('2048tokens')")
    value = float(match.group(1))
    size = value * (bytes_per_softmax_token if unit in _TOKEN_UNITS else _BYTE_UNITS[unit])
    if size <= 0:
        raise CacheBudgetError(f"cache budget {text!r} is not positive; accepted: a size > 0")
    return int(size)


@dataclass
class LayerGeometry:
    """What a layer's decoding state size depends on."""

    layer: int
    kind: str  # "window", "softmax" or "linear"
    kv_heads: int
    heads: int
    head_dim: int
    nb_features: int
    window: int = 0
    sinks: int = 0
    sparse_cache: int = 0
    chunk_size: int = 64
    linear_tail: bool = True


def layer_geometries(model: nn.Module) -> list[LayerGeometry]:
    """One :class:`LayerGeometry` per attention layer of ``model``, in layer order (a layer kept on softmax at
    conversion as :data:`SOFTMAX`)."""
    layers, any_favor = [], False
    for _, module in find_attention_modules(model):
        config = module.config
        head_dim = getattr(module, "head_dim", None) or getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        favor = uses_favor(module)
        any_favor = any_favor or favor
        layers.append(_layer_geometry(layer_index_of(module), module_favor_settings(module) if favor else None,
                                      config, head_dim))
    if not any_favor:
        raise CacheBudgetError(f"{type(model).__name__} has no favor attention layer; a cache budget is for a "
                               "converted window hybrid")
    return layers


def settings_layer_geometries(config, favor_settings: dict) -> list[LayerGeometry]:
    """The :class:`LayerGeometry` of every layer of a model of the source ``config`` (a transformers config) converted
    with ``favor_settings`` (a ``config.json``'s or a result record's; missing keys take their defaults), without
    building it: what :func:`layer_geometries` gives for that model."""
    settings = resolve_favor_settings(favor_settings)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return [_layer_geometry(layer, settings, config, head_dim) for layer in range(config.num_hidden_layers)]


def _layer_geometry(layer: int, settings: dict | None, config, head_dim: int) -> LayerGeometry:
    """``settings`` ``None``: a layer left on softmax at conversion (its key/value cache grows)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if settings is None:
        return LayerGeometry(layer, SOFTMAX, kv_heads, heads, head_dim, 0)
    window, sinks = layer_window(settings, layer)
    if layer in settings["softmax_layers"]:
        kind = SOFTMAX
    elif window or sinks:
        kind = "window"
    else:
        kind = "linear"
    return LayerGeometry(layer, kind, kv_heads, heads, head_dim, effective_nb_features(settings, head_dim), window,
                         sinks, layer_sparse_cache(settings, layer), settings.get("chunk_size", 64),
                         bool(settings.get("linear_tail", True)))


def option_bytes(geometry: LayerGeometry, option: int | str, context: int, dtype_bytes: int) -> int:
    """Bytes of ``geometry``'s decoding state for one sequence of ``context`` tokens with ``option`` (a sparse cache
    size, or :data:`SOFTMAX`)."""
    if option == SOFTMAX:
        return softmax_cache_bytes(geometry.kv_heads, geometry.head_dim, dtype_bytes, context)
    if geometry.kind == "linear":
        return linear_state_bytes(geometry.heads, geometry.head_dim, geometry.nb_features)
    return window_state_bytes(geometry.kv_heads, geometry.head_dim, geometry.nb_features, geometry.window,
                              geometry.sinks, dtype_bytes, sparse_cache=int(option), chunk_size=geometry.chunk_size,
                              linear_tail=geometry.linear_tail)


def configured_bytes(geometry: LayerGeometry, context: int, dtype_bytes: int) -> int:
    """Bytes of ``geometry``'s decoding state at ``context`` tokens with the layer's own setting."""
    return option_bytes(geometry, SOFTMAX if geometry.kind == SOFTMAX else geometry.sparse_cache, context, dtype_bytes)


def settings_state_bytes(config, favor_settings: dict, context: int, dtype_bytes: int = 4) -> int:
    """:func:`model_state_bytes` of a model of the source ``config`` converted with ``favor_settings``, without
    building it (how a result record's state sizes are checked against this accounting)."""
    return sum(configured_bytes(geometry, context, dtype_bytes)
               for geometry in settings_layer_geometries(config, favor_settings))


def model_state_bytes(model: nn.Module, context: int) -> int:
    """Bytes of ``model``'s decoding state for one sequence of ``context`` tokens, every layer as configured."""
    dtype_bytes = torch_dtype_bytes(model)
    return sum(configured_bytes(geometry, context, dtype_bytes) for geometry in layer_geometries(model))


def check_measurement_length(model: nn.Module, length: int, cache_sizes: Sequence[int]) -> str | None:
    """Refuse a measurement length at which no key leaves a window layer's exact part (its sinks and window, and
    everything before the first chunk boundary, where the sparse cache first selects): every option would measure
    the same error. Returns a warning (one line) when the largest cache sizes keep every older key at this length
    (they tie), else ``None``.

    Raises:
        CacheBudgetError: ``length`` does not reach past the exact part of some window layer.
    """
    windows = [g for g in layer_geometries(model) if g.kind == "window"]
    exact = max((max(g.chunk_size, g.sinks + g.window) for g in windows), default=0)
    if length <= exact:
        raise CacheBudgetError(f"--length {length} never reaches past a window layer's exact part (its sinks and "
                               f"window, and the tokens before the first chunk boundary: {exact}): every cache size "
                               f"would measure the same error; give --length > {exact}")
    older = max((length - g.sinks - g.window for g in windows), default=0)  # keys a last query could lose
    tied = sorted(size for size in cache_sizes if size >= older)
    if len(tied) > 1:
        return (f"cache sizes {', '.join(map(str, tied))} keep every older key at --length {length}: they measure "
                f"alike and the allocation takes the cheapest; a longer --length tells them apart")
    return None


def check_budget_reachable(model: nn.Module, budget_bytes: int, context: int, cache_sizes: Sequence[int],
                           dtype_bytes: int = 4) -> None:
    """Refuse, before anything is measured, a budget below the model's smallest decoding state at ``context`` tokens
    (every window layer with the smallest of ``cache_sizes``; other layers as they are).

    Raises:
        CacheBudgetError: one line with the smallest reachable size.
    """
    if context <= 0:
        raise CacheBudgetError(f"budget context {context} is not a number of tokens; accepted: an int > 0")
    smallest = sum(min(option_bytes(g, size, context, dtype_bytes) for size in cache_sizes) if g.kind == "window"
                   else configured_bytes(g, context, dtype_bytes) for g in layer_geometries(model))
    if budget_bytes < smallest:
        raise CacheBudgetError(
            f"cache budget {_mib(budget_bytes)} at {context} tokens is below this model's smallest decoding state "
            f"({_mib(smallest)}: every window layer with its smallest sparse cache among {sorted(cache_sizes)}); "
            f"accepted: >= {_mib(smallest)}")


def _measurement_batches(batches: Iterable[dict], cache_sizes: Sequence[int]) -> list[dict]:
    """``batches`` as a list, after checking their sequences are at least twice the largest ``G`` long.

    Raises:
        CacheBudgetError: a shorter sequence.
    """
    batches = list(batches)
    length = min(batch["input_ids"].shape[-1] for batch in batches)
    if 2 * max(cache_sizes) > length:
        raise CacheBudgetError(
            f"a sparse cache of {max(cache_sizes)} keys needs measurement sequences of at least {2 * max(cache_sizes)} "
            f"tokens (given {length}): a cache holding most of a sequence is exact there and not at longer contexts")
    return batches


def measure_option_errors(model: nn.Module, batches: Iterable[dict], cache_sizes: Sequence[int] = CACHE_SIZES,
                          ) -> dict[int, dict[int, float]]:
    """``{layer: {G: error}}`` for every causal window layer: the mean squared error of its attention output against
    exact softmax with a sparse cache of ``G`` keys (teacher forcing, :func:`measure_transfer_losses`), on
    ``batches``, whose sequences must be at least twice the largest ``G`` long.

    Raises:
        CacheBudgetError: sequences shorter than twice the largest ``G``.
    """
    from .attention_transfer import measure_transfer_losses

    batches = _measurement_batches(batches, cache_sizes)
    errors: dict[int, dict[int, float]] = {}
    for size in sorted(set(int(size) for size in cache_sizes)):
        for layer, entry in measure_transfer_losses(model, batches, sparse_cache=size).items():
            errors.setdefault(layer, {})[size] = entry["output_squared_error"]
    return errors


def window_layers_of(model: nn.Module) -> list[int]:
    """The causal window layers of ``model`` (the layers a budget allocates)."""
    return [geometry.layer for geometry in layer_geometries(model) if geometry.kind == "window"]


def mean_token_loss(model: nn.Module, batches: Sequence[dict], sparse_caches: dict[int, int] | None = None,
                    softmax_layers: Iterable[int] = ()) -> float:
    """``model``'s mean next-token loss over ``batches`` (no cache), for the measurement only (the model's settings
    are restored after) with the window layers of ``sparse_caches`` given those sparse-cache sizes and the layers of
    ``softmax_layers`` on exact softmax attention."""
    before = model.config.favor_settings
    changes = {}
    if sparse_caches:
        overrides = {layer: dict(values) for layer, values in (before.get("layer_windows") or {}).items()}
        for layer, size in sparse_caches.items():
            overrides.setdefault(str(layer), {})["sparse_cache"] = int(size)
        changes["layer_windows"] = overrides
    softmax_layers = sorted(set(softmax_layers) | set(before.get("softmax_layers") or ()))
    if softmax_layers != sorted(before.get("softmax_layers") or ()):
        changes["softmax_layers"] = softmax_layers
    # (restored by assignment: once every layer runs softmax, update_favor_settings finds no favor layer to change)
    configs = [module.config for _, module in find_attention_modules(model)] + [model.config]
    saved = [(config, config.favor_settings) for config in configs if getattr(config, "favor_settings", None)]
    if changes:
        update_favor_settings(model, **changes)
    try:
        with torch.no_grad():
            losses = [float(model(input_ids=batch["input_ids"], labels=batch["input_ids"], use_cache=False).loss)
                      for batch in batches]
    finally:
        for config, settings in saved:
            config.favor_settings = settings
    return sum(losses) / len(losses)


def measure_option_losses(model: nn.Module, batches: Iterable[dict], cache_sizes: Sequence[int] = CACHE_SIZES,
                          progress=None) -> tuple[dict[int, dict[int, float]], float]:
    """``({layer: {G: loss rise}}, exact loss)``: for every causal window layer and size ``G``, the model's mean
    next-token loss on ``batches`` with that layer keeping ``G`` hard keys and every other window layer on exact
    softmax, minus the loss with all of them on softmax. One forward pass per layer and size; ``progress(done,
    total)`` is called after each.

    Raises:
        CacheBudgetError: sequences shorter than twice the largest ``G``, or no window layer.
    """
    batches = _measurement_batches(batches, cache_sizes)
    layers = window_layers_of(model)
    if not layers:
        raise CacheBudgetError("the model has no causal window layer: the cache budget allocates the sparse cache of "
                               "window-hybrid layers")
    exact_loss = mean_token_loss(model, batches, softmax_layers=layers)
    sizes = sorted(set(int(size) for size in cache_sizes))
    rises: dict[int, dict[int, float]] = {}
    for index, (layer, size) in enumerate((layer, size) for layer in layers for size in sizes):
        others = [other for other in layers if other != layer]
        rises.setdefault(layer, {})[size] = mean_token_loss(model, batches, {layer: size}, others) - exact_loss
        if progress is not None:
            progress(index + 1, len(layers) * len(sizes))
    return rises, exact_loss


def measure_allocation_losses(model: nn.Module, batches: Sequence[dict], allocation: "CacheAllocation",
                              exact_loss: float) -> dict:
    """The end metric of the chosen allocation beside the best single ``G`` within the same budget, measured (not
    the sum of per-layer estimates the allocation minimised): mean next-token loss and perplexity on ``batches``."""
    chosen = {layer: entry["option"] for layer, entry in allocation.layers.items() if entry["option"] != SOFTMAX}
    measured = {"exact": exact_loss,
                "allocation": mean_token_loss(model, batches, chosen, allocation.softmax_layers)}
    if allocation.uniform is not None:
        measured["uniform"] = mean_token_loss(model, batches, dict.fromkeys(allocation.layers,
                                                                            allocation.uniform["sparse_cache"]))
    return {name: {"loss": loss, "perplexity": math.exp(loss)} for name, loss in measured.items()}


@dataclass
class CacheAllocation:
    """The chosen option of every layer, what it costs and what the measurement says it buys.

    ``layers`` maps each layer index to ``{"option": G or "softmax", "bytes": ..., "error": ...}``; ``errors`` holds
    every measured option per layer (what ``metric`` of :data:`METRICS` says); ``uniform`` the best single ``G`` for
    all window layers within the same budget (the configuration without an allocator), for comparison; ``measured``
    the end metric of both (:func:`measure_allocation_losses`), where it was measured."""

    budget_bytes: int
    context: int
    dtype_bytes: int
    total_bytes: int
    total_error: float
    layers: dict[int, dict]
    errors: dict[int, dict]
    uniform: dict | None = None
    softmax_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    metric: str = "error"
    measured: dict | None = None

    @property
    def sparse_cache_by_layer(self) -> dict[int, int]:
        return {layer: entry["option"] for layer, entry in self.layers.items() if entry["option"] != SOFTMAX}

    @property
    def softmax_layers(self) -> list[int]:
        return sorted(layer for layer, entry in self.layers.items() if entry["option"] == SOFTMAX)

    def to_dict(self) -> dict:
        record = asdict(self)
        record["layers"] = {str(layer): entry for layer, entry in self.layers.items()}
        record["errors"] = {str(layer): {str(option): value for option, value in options.items()}
                            for layer, options in self.errors.items()}
        record["softmax_layers"] = self.softmax_layers
        return record


def _solve(costs: list[list[int]], errors: list[list[float]], budget: int) -> list[int] | None:
    """The option index per group minimising the summed error with summed cost <= ``budget`` (exact dynamic
    programme over integer costs), or ``None`` when even the cheapest options exceed it."""
    best = np.zeros(budget + 1)
    choices = []
    for group_costs, group_errors in zip(costs, errors):
        new = np.full(budget + 1, np.inf)
        choice = np.full(budget + 1, -1, dtype=np.int64)
        for index, (cost, error) in enumerate(zip(group_costs, group_errors)):
            if cost > budget:
                continue
            candidate = np.full(budget + 1, np.inf)
            candidate[cost:] = best[:budget + 1 - cost] + error
            better = candidate < new
            new[better], choice[better] = candidate[better], index
        best = new
        choices.append(choice)
    if not np.isfinite(best[budget]):
        return None
    picked, remaining = [], budget
    for group_costs, choice in zip(reversed(costs), reversed(choices)):
        index = int(choice[remaining])
        picked.append(index)
        remaining -= group_costs[index]
    return picked[::-1]


def allocate_cache_budget(model: nn.Module, errors: dict[int, dict[int, float]], budget_bytes: int, context: int, *,
                          dtype_bytes: int = 4, allow_softmax: bool = True, metric: str = "error") -> CacheAllocation:
    """Spend ``budget_bytes`` of decoding state for one sequence of ``context`` tokens: per causal window layer one
    sparse-cache size among those measured in ``errors`` (:func:`measure_option_errors`), or exact softmax
    (``allow_softmax``), minimising the summed measured error. Layers without a window (linear, or already softmax)
    keep their state and count against the budget.

    Raises:
        CacheBudgetError: a budget below the cheapest configuration (the message gives it), no measured window
            layer, or a non-positive context.
    """
    geometries = {geometry.layer: geometry for geometry in layer_geometries(model)}
    allocated = [layer for layer in sorted(errors) if layer in geometries and geometries[layer].kind == "window"]
    if not allocated:
        raise CacheBudgetError("no causal window layer was measured: the cache budget allocates the sparse cache of "
                               "window-hybrid layers")
    fixed = sum(configured_bytes(geometry, context, dtype_bytes) for layer, geometry in geometries.items()
                if layer not in allocated)
    options = {layer: sorted(errors[layer]) + ([SOFTMAX] if allow_softmax else []) for layer in allocated}
    layer_costs = {layer: [option_bytes(geometries[layer], option, context, dtype_bytes) for option in options[layer]]
                   for layer in allocated}
    layer_errors = {layer: [0.0 if option == SOFTMAX else float(errors[layer][option]) for option in options[layer]]
                    for layer in allocated}
    check_budget_reachable(model, budget_bytes, context, sorted({size for sizes in errors.values() for size in sizes}),
                           dtype_bytes)
    available = budget_bytes - fixed
    unit = max(1, math.ceil(available / BUDGET_UNITS))
    # a vanishing price on bytes: of options with the same measured error, the cheaper one
    price = 1e-9 * max([max(errors_) for errors_ in layer_errors.values()] + [0.0]) / max(available // unit, 1)
    units = {layer: [math.ceil(cost / unit) for cost in layer_costs[layer]] for layer in allocated}
    picked = _solve([units[layer] for layer in allocated],
                    [[error + price * cost for error, cost in zip(layer_errors[layer], units[layer])]
                     for layer in allocated], available // unit)
    if picked is None:  # the rounding up of every cost made the cheapest configuration too large: use it unrounded
        picked = [int(np.argmin(layer_costs[layer])) for layer in allocated]
    layers = {layer: {"option": options[layer][index], "bytes": layer_costs[layer][index],
                      "error": layer_errors[layer][index]} for layer, index in zip(allocated, picked)}
    total_bytes = fixed + sum(entry["bytes"] for entry in layers.values())
    return CacheAllocation(
        budget_bytes=int(budget_bytes), context=int(context), dtype_bytes=int(dtype_bytes),
        total_bytes=int(total_bytes),
        total_error=float(sum(entry["error"] for entry in layers.values())), layers=layers,
        errors={layer: dict(errors[layer]) for layer in allocated},
        uniform=_best_uniform(errors, allocated, geometries, fixed, budget_bytes, context, dtype_bytes),
        softmax_bytes=sum(softmax_cache_bytes(g.kv_heads, g.head_dim, dtype_bytes, context)
                          for g in geometries.values()),
        notes=[f"error: {METRICS[metric]}, summed over the {len(allocated)} allocated layers; bytes: decoding state of "
               f"one sequence at {context} tokens, {dtype_bytes}-byte keys and values"]
        + ([NO_TAIL_NOTE] if metric == "error" and any(not geometries[layer].linear_tail for layer in allocated)
           else []),
        metric=metric)


def _best_uniform(errors, allocated, geometries, fixed, budget_bytes, context, dtype_bytes) -> dict | None:
    """The largest single sparse-cache size for every allocated layer that fits the budget, with its error."""
    sizes = sorted(set.intersection(*(set(errors[layer]) for layer in allocated)))
    best = None
    for size in sizes:
        total = fixed + sum(option_bytes(geometries[layer], size, context, dtype_bytes) for layer in allocated)
        if total <= budget_bytes:
            best = {"sparse_cache": size, "bytes": int(total),
                    "error": float(sum(errors[layer][size] for layer in allocated))}
    return best


def apply_cache_allocation(model: nn.Module, allocation: CacheAllocation) -> dict:
    """Give ``model`` (a Performer model) the allocation: each window layer's ``sparse_cache`` through
    ``layer_windows``, the softmax layers through :func:`~.convert.keep_softmax_attention`. Returns the new favor
    settings."""
    from .convert import keep_softmax_attention

    settings = dict(model.config.favor_settings)
    overrides = {layer: dict(values) for layer, values in (settings.get("layer_windows") or {}).items()}
    for layer, size in allocation.sparse_cache_by_layer.items():
        overrides.setdefault(str(layer), {})["sparse_cache"] = int(size)
    update_favor_settings(model, layer_windows=overrides)
    if allocation.softmax_layers:
        keep_softmax_attention(model, allocation.softmax_layers)
    return dict(model.config.favor_settings)


def _mib(size: int) -> str:
    return f"{size / 2 ** 20:.2f} MiB"


def allocation_table(allocation: CacheAllocation) -> str:
    """A Markdown table of the allocation (one row per layer) and its totals."""
    lines = ["| layer | option | bytes | error |", "|---:|---:|---:|---:|"]
    for layer, entry in sorted(allocation.layers.items()):
        lines.append(f"| {layer} | {entry['option']} | {entry['bytes']:,} | {entry['error']:.3g} |")
    total = (f"\nTotal {_mib(allocation.total_bytes)} of a {_mib(allocation.budget_bytes)} budget at "
             f"{allocation.context} tokens (softmax: {_mib(allocation.softmax_bytes)}); summed error "
             f"{allocation.total_error:.4g}")
    if allocation.uniform is not None:
        total += (f"; one G = {allocation.uniform['sparse_cache']} for every layer within the budget: "
                  f"{allocation.uniform['error']:.4g}")
    if allocation.measured:
        total += "\nMeasured perplexity on the measurement text: " + ", ".join(
            f"{MEASURED_NAMES[name]} {entry['perplexity']:.3f}" for name, entry in allocation.measured.items())
    return "\n".join(lines + [total] + [f"\nNote: {note}" for note in allocation.notes[1:]])


def torch_dtype_bytes(model: nn.Module) -> int:
    """Bytes of one element of ``model``'s floating-point weights (the dtype its cache keeps keys and values in)."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.element_size()
    return 4  # float32


def serving_settings_record(model: nn.Module, before: dict, changes: dict) -> dict:
    """Change ``model``'s window settings (:data:`SERVING_SETTINGS`) to ``changes`` in place and return the record of
    :data:`SERVING_SETTINGS_FILE`: the settings ``before`` (the loaded ``favor_settings``) and after, and the decoding
    state of one sequence at each of :data:`SERVING_CONTEXTS` against the softmax source's key/value cache.

    Raises:
        ValueError: a key outside :data:`SERVING_SETTINGS`, per-layer settings these model-wide ones would not
            change, or invalid values (one line).
    """
    unknown = sorted(set(changes) - set(SERVING_SETTINGS))
    if unknown:
        raise ValueError(f"cannot change {', '.join(unknown)} at serving time; accepted: {', '.join(SERVING_SETTINGS)}")
    if before.get("layer_windows"):
        raise ValueError("the model has per-layer window settings (layer_windows, e.g. from hf-performer budget), "
                         "which model-wide changes would not reach; change them there")
    after = update_favor_settings(model, **changes)
    dtype_bytes = torch_dtype_bytes(model)
    per_token = softmax_token_bytes(model.config, dtype_bytes)
    shown = (*SERVING_SETTINGS, "sinks", "linear_tail")
    return {
        "before": {name: before.get(name) for name in shown},
        "after": {name: after.get(name) for name in shown},
        "decoding_state_per_sequence": {
            str(context): {"state_bytes": model_state_bytes(model, context), "softmax_bytes": per_token * context}
            for context in SERVING_CONTEXTS},
    }
