"""Constant-memory generation: per-token decode latency and cache memory, FAVOR+ against softmax + KV cache.

What is measured (``hf-performer bench decode``):

* Model: GPT-2 small geometry by default (12 layers, 12 heads, 768 dims, vocabulary 50257), random weights
  from ``GPT2LMHeadModel(GPT2Config(...))``, ``eval()``, under ``torch.inference_mode()``. ``n_positions`` is
  set large enough for the longest context plus the decode steps. **One** model (one set of weights) runs both
  implementations: it is switched with ``model.set_attn_implementation("favor" | "sdpa")``.
* The two implementations, measured in the same run, interleaved step by step at every length:

  - ``favor``: ``attn_implementation="favor"`` (FAVOR+, settings ``config.favor_settings``, defaults
    :data:`hf_performer.FAVOR_DEFAULTS`) with the recurrent-state cache of :func:`hf_performer.make_favor_cache`:
    every layer is a :class:`hf_performer.FavorCacheLayer` holding ``kv [B, H, m, d]``, ``k_sum [B, H, m]`` and
    ``stabilizer [B, H]`` (float32), whatever the context length;
  - ``softmax``: ``attn_implementation="sdpa"`` with transformers' standard ``DynamicCache`` (every layer a
    ``DynamicLayer`` holding keys and values ``[B, H, L, d]``, grown by ``torch.cat`` at every step).

* The cache of a context of ``L`` tokens is built *synthetically* (a 16k-token prefill of 12 layers is not what
  is measured, and takes long on a CPU), at exactly the size and type a prefill leaves:

  - softmax: per layer, random keys and values ``[B, H, L, d]`` in the model dtype, put in through
    ``DynamicCache.update``;
  - favor: per layer, the state the engine's causal kernel (:func:`hf_performer.linear_attention` with
    ``causal=True, return_state=True``, the layer's own feature map and ``scaling``, carried block by block with
    ``initial_state``) returns after ``L`` random tokens, and a token counter of ``L``. States of longer
    contexts continue those of shorter ones (the same random token stream), so building them costs one pass
    over the longest context.

  Random keys/values/queries are ``N(0, sigma^2)`` with ``sigma = initializer_range * sqrt(n_embd)``, the scale
  of a randomly initialised GPT-2's projections of layer-normalised inputs. The decode step does not depend
  on the values in the cache, only on its size and type.

* One **decode step** = one call ``model(input_ids [B, 1], attention_mask=ones [B, L + 1], position_ids,
  cache=cache, use_cache=True)`` (``past_key_values=`` before transformers 5.24) through the full model (embeddings,
  12 blocks with the cache update and attention over the whole context, final layer norm, LM head over the
  vocabulary) plus the greedy ``argmax`` that picks the next token, which is fed to the next step (as ``generate()``
  does). For softmax it includes ``DynamicLayer``'s concatenation of the new key/value onto ``[B, H, L, d]``; for
  favor the recurrent update of the state (the favor model never sees past keys).
* Timing, per context length ``L`` (lengths in increasing order): ``warmup`` untimed steps of the favor
  stream, then of the softmax stream, then ``repeats`` rounds in which the favor stream at ``L``, the softmax
  stream at ``L`` and the favor stream of the *shortest* context (kept alive from the first length) each take
  one timed step in turn. The latency reported is the **median** seconds per step (a step decodes one token
  for each of the ``B`` sequences). Stepping the streams in turn exposes them to the same machine state (a shared
  machine's speed drifts by tens of percent over minutes), so the ratios are also given *paired*: the median
  over rounds of the ratio of two streams' times in the same round (``paired_ratio_to_shortest`` for FAVOR+
  flatness, ``paired_ratio_to_favor`` for softmax). Caches grow by one token per step, so the timed steps see
  contexts ``L + warmup`` ... ``L + warmup + repeats - 1`` (recorded; the shortest-context stream keeps
  growing by ``repeats`` per length).
* Cache memory: the sum of ``nbytes`` of the cache tensors before the first step (softmax: keys and values of
  every layer; favor: ``kv``, ``k_sum``, ``stabilizer`` of every layer). Peak memory growth (CPU): growth of
  the process' peak resident set size (``VmHWM``, reset through ``/proc/self/clear_refs``, after glibc's
  ``malloc_trim``) over its resident size before the steps, during each implementation's warm-up steps, with
  the caches already built: the transient memory of decoding as the process sees it (e.g. the ``torch.cat``
  copy of one layer's keys/values, plus allocator effects); CUDA: ``max_memory_allocated`` growth.
* Checks that the measured path is the real one (:func:`verify_decode_paths`, run first, results in the JSON):
  for a short context, a real prefill (``use_cache=True``, the caches the model creates itself) and the
  synthetic cache have the same layer types, tensor shapes and dtypes and token count, a decode step on either
  gives logits of the same shape and leaves caches of the same structure, and their step times are recorded
  side by side. After every measured length, every favor layer must still be a ``FavorCacheLayer`` with no
  keys, no pending tokens, a state of unchanged shape that was replaced by the step (so the attention function
  took the recurrent path), and the token counter ``L + steps``.

Summary targets: FAVOR+ latency at the longest context <= 1.1 x its latency at the shortest (paired ratio);
softmax latency / FAVOR+ latency at the longest context >= 3 (ratio of medians).
"""

from __future__ import annotations

import gc
import math
import statistics
import time

import torch

from .defaults import DECODE_IMPLEMENTATIONS, FULL_CONTEXT_LENGTHS
from .machine import PeakMemoryGrowth, load_average, machine_info, median_of_fresh_processes, synchronize
from .report import summarize_decode

ATTN_IMPLEMENTATIONS = {"favor": "favor", "softmax": "sdpa"}
STATE_BLOCK = 1024  # tokens per call of the causal kernel when building favor states


# ------------------------------------------------------------------------------------ model


def build_model(
    n_layer: int = 12,
    n_head: int = 12,
    n_embd: int = 768,
    vocab_size: int = 50257,
    n_positions: int = 1024,
    dtype: str = "float32",
    favor_settings: dict | None = None,
    device: str = "cpu",
    seed: int = 0,
):
    """A random-weight GPT-2 (``eval``) with favor feature maps attached, left on ``sdpa``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from ..favor_attention import attach_feature_maps

    special = min(50256, vocab_size - 1)
    config = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size,
                        n_positions=n_positions, bos_token_id=special, eos_token_id=special)
    config.favor_settings = dict(favor_settings or {})
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).eval().to(device=device, dtype=getattr(torch, dtype))
    model.set_attn_implementation("favor")
    attach_feature_maps(model)  # after the dtype cast: projections stay float32
    model.set_attn_implementation("sdpa")
    return model


def use_implementation(model, implementation: str) -> None:
    model.set_attn_implementation(ATTN_IMPLEMENTATIONS[implementation])


def _attention_modules(model):
    return [block.attn for block in model.transformer.h]


def _key_scale(config) -> float:
    return config.initializer_range * math.sqrt(config.n_embd)


# ------------------------------------------------------------------------------------ synthetic caches


def synthetic_softmax_cache(model, batch: int, context: int, generator: torch.Generator):
    """A ``DynamicCache`` holding random keys/values ``[batch, H, context, d]`` in every layer."""
    from transformers import DynamicCache

    config = model.config
    head_dim = config.n_embd // config.n_head
    dtype, device = model.dtype, model.device
    cache = DynamicCache(config=config)
    sigma = _key_scale(config)
    for layer_idx in range(config.n_layer):
        shape = (batch, config.n_head, context, head_dim)
        keys, values = (torch.empty(shape).normal_(0.0, sigma, generator=generator).to(device=device, dtype=dtype)
                        for _ in range(2))
        cache.update(keys, values, layer_idx)
        del keys, values
    return cache


class FavorStateBuilder:
    """Per-layer recurrent states after ``length`` random tokens, extended on demand (:meth:`extend_to`).

    Each layer's state comes from the engine's causal kernel with that layer's feature map and scaling,
    fed ``STATE_BLOCK`` tokens at a time through ``initial_state`` (what a chunked prefill does).
    """

    def __init__(self, model, batch: int, seed: int = 0, block: int = STATE_BLOCK):
        from ..favor_settings import favor_settings_of

        self.model, self.batch, self.block = model, batch, block
        self.generator = torch.Generator().manual_seed(seed)
        self.modules = _attention_modules(model)
        self.chunk_size = favor_settings_of(self.modules[0])["chunk_size"]
        self.states = [None] * len(self.modules)
        self.length = 0

    def extend_to(self, length: int) -> None:
        from ..linear_attention import linear_attention

        if length < self.length:
            raise ValueError(f"states already hold {self.length} tokens, cannot go back to {length}")
        config = self.model.config
        head_dim = config.n_embd // config.n_head
        sigma = _key_scale(config)
        dtype, device = self.model.dtype, self.model.device
        while self.length < length:
            n = min(self.block, length - self.length)
            for layer_idx, module in enumerate(self.modules):
                shape = (self.batch, config.n_head, n, head_dim)
                query, key, value = (torch.empty(shape).normal_(0.0, sigma, generator=self.generator)
                                     .to(device=device, dtype=dtype) for _ in range(3))
                _, self.states[layer_idx] = linear_attention(
                    query, key, value, module.favor_feature_map, causal=True, scaling=module.scaling,
                    initial_state=self.states[layer_idx], return_state=True, chunk_size=self.chunk_size,
                )
            self.length += n

    def cache(self):
        """A fresh cache from :func:`hf_performer.make_favor_cache` holding copies of the states (``length`` tokens)."""
        from ..cache import make_favor_cache
        from ..linear_attention import LinearAttentionState

        cache = make_favor_cache(self.model)
        config = self.model.config
        stub = torch.empty(self.batch, config.n_head, 0, config.n_embd // config.n_head,
                           dtype=self.model.dtype, device=self.model.device)
        for layer, state in zip(cache.layers, self.states):
            layer.lazy_initialization(stub, stub)
            layer.seen_tokens = self.length
            layer.set_state(LinearAttentionState(*(t.clone() for t in state)))
        return cache


def cache_nbytes(cache) -> int:
    """Bytes of the tensors a cache holds: keys/values of ``DynamicLayer``, the state of ``FavorCacheLayer``."""
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "state_nbytes"):
            total += layer.state_nbytes()
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def _describe_state(state) -> dict:
    """Shape/dtype of every tensor of a state (nested named tuples flattened: ``tail.kv``, plain tuples by index:
    ``pending.0``), and its other fields as they are (JSON-able)."""
    described = {}
    for name, item in state._asdict().items():
        if isinstance(item, torch.Tensor):
            described[name] = (list(item.shape), str(item.dtype))
        elif hasattr(item, "_asdict"):
            described.update({f"{name}.{key}": value for key, value in _describe_state(item).items()})
        elif isinstance(item, (tuple, list)):
            described.update({f"{name}.{index}": (list(part.shape), str(part.dtype)) if isinstance(part, torch.Tensor)
                              else part for index, part in enumerate(item)})
        else:
            described[name] = item
    return described


def describe_cache(cache) -> list[dict]:
    """Per layer: type, token count, and shape/dtype of every tensor held."""
    layers = []
    for layer in cache.layers:
        tensors = {}
        if getattr(layer, "state", None) is not None:
            tensors = _describe_state(layer.state)
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                tensors[name] = (list(tensor.shape), str(tensor.dtype))
        layers.append({"type": type(layer).__name__, "seq_length": layer.get_seq_length(), "tensors": tensors})
    return layers


def _check_favor_cache(cache, context: int, state_shapes, previous_states=None) -> None:
    """The favor cache took the recurrent path: state only, replaced by the step, counter ``context``."""
    from ..cache import FavorCacheLayer

    for layer_idx, layer in enumerate(cache.layers):
        if not isinstance(layer, FavorCacheLayer):
            raise AssertionError(f"favor layer {layer_idx} is a {type(layer).__name__}, not a FavorCacheLayer")
        if layer.keys is not None or layer.pending_tokens or layer.get_seq_length() != context:
            raise AssertionError(
                f"favor layer {layer_idx}: keys={layer.keys is not None}, pending={layer.pending_tokens}, "
                f"seq_length={layer.get_seq_length()} (expected no keys, 0 pending, {context})"
            )
        shapes = [tuple(t.shape) for t in layer.state]
        if shapes != state_shapes:
            raise AssertionError(f"favor layer {layer_idx}: state shapes {shapes}, expected {state_shapes}")
        if previous_states is not None and layer.state.kv is previous_states[layer_idx]:
            raise AssertionError(f"favor layer {layer_idx}: the decode step did not replace the recurrent state")





class DecodeStream:
    """One greedy decoding stream: a model implementation, its cache and the next token of each sequence.

    :meth:`step` times one decode step (see the module docstring); the implementation is switched before
    the clock starts, so streams of both implementations can alternate step by step on one model.
    """

    def __init__(self, model, implementation: str, cache, batch: int, context: int, generator: torch.Generator,
                 device: torch.device):
        self.model, self.implementation, self.cache = model, implementation, cache
        self.batch, self.position, self.device = batch, context, device
        self.context = context  # the context it started from
        self.input_ids = torch.randint(model.config.vocab_size, (batch, 1), generator=generator).to(device)
        self.logits = None
        from ..cache import cache_argument_name

        self.cache_argument = cache_argument_name(type(model).forward)  # cache (transformers >= 5.24), past_key_values

    def step(self) -> float:
        use_implementation(self.model, self.implementation)
        batch, position, device = self.batch, self.position, self.device
        synchronize(device)
        start = time.perf_counter()
        attention_mask = torch.ones(batch, position + 1, dtype=torch.long, device=device)
        position_ids = torch.full((batch, 1), position, dtype=torch.long, device=device)
        logits = self.model(input_ids=self.input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=True, **{self.cache_argument: self.cache}).logits
        self.input_ids = logits[:, -1].argmax(-1, keepdim=True)
        synchronize(device)
        seconds = time.perf_counter() - start
        self.logits, self.position = logits, position + 1
        return seconds

    def steps(self, count: int) -> list[float]:
        return [self.step() for _ in range(count)]


def _interleaved_steps(streams: list[DecodeStream], repeats: int) -> list[list[float]]:
    """``repeats`` rounds of one step of every stream in turn: seconds per stream and round."""
    timings = [[] for _ in streams]
    for _ in range(repeats):
        for stream, seconds in zip(streams, timings):
            seconds.append(stream.step())
    return timings


def _timing_fields(seconds: list[float], warmup_seconds: list[float], batch: int) -> dict:
    median = statistics.median(seconds)
    return dict(seconds_per_token=median, seconds_min=min(seconds), seconds_all=seconds, warmup_seconds=warmup_seconds,
                tokens_per_s=batch / median)


def _median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median over rounds of the ratio of two streams' step times measured side by side."""
    return statistics.median(a / b for a, b in zip(numerators, denominators))


def measure_context(model, favor_cache, softmax_cache, context: int, batch: int, warmup: int, repeats: int,
                    generator: torch.Generator, device: torch.device, reference, check_favor, build_seconds: dict):
    """The favor and softmax records of one context length (module docstring: warm-up, interleaved rounds with
    the shortest-context favor stream ``reference``, cache bytes, peak memory growth).

    ``check_favor(end_context)`` asserts the favor cache took its constant-size path; ``build_seconds`` per
    implementation is recorded as ``cache_build_seconds``. Returns the two records and the reference stream (the
    favor stream of this length when ``reference`` is ``None``).
    """
    favor = DecodeStream(model, "favor", favor_cache, batch, context, generator, device)
    softmax = DecodeStream(model, "softmax", softmax_cache, batch, context, generator, device)
    reference = reference or favor
    cache_bytes = {"favor": cache_nbytes(favor_cache), "softmax": cache_nbytes(softmax_cache)}
    warm, peaks = {}, {}
    for stream in (favor, softmax):
        with PeakMemoryGrowth(device) as peak:
            warm[stream.implementation] = stream.steps(warmup)
        peaks[stream.implementation] = peak.growth
    streams = [favor, softmax] + ([reference] if reference is not favor else [])
    reference_start = reference.position
    timings = _interleaved_steps(streams, repeats)

    end_context = context + warmup + repeats
    check_favor(end_context)
    cache_bytes_after = {"favor": cache_nbytes(favor_cache), "softmax": cache_nbytes(softmax_cache)}
    if cache_bytes_after["favor"] != cache_bytes["favor"]:
        raise AssertionError("favor cache memory changed while decoding")
    if softmax_cache.get_seq_length() != end_context:
        raise AssertionError("softmax cache does not hold context + decoded tokens")
    common = dict(context=context, timed_contexts=[context + warmup, end_context - 1])
    favor_seconds, softmax_seconds = timings[0], timings[1]
    reference_seconds = timings[2] if len(timings) > 2 else favor_seconds
    records = [
        dict(
            implementation="favor", **_timing_fields(favor_seconds, warm["favor"], batch), **common,
            cache_bytes=cache_bytes["favor"], cache_bytes_after=cache_bytes_after["favor"],
            peak_memory_growth_bytes=peaks["favor"],
            cache_build_seconds=build_seconds["favor"],  # extending the states from the previous length
            logits_shape=list(favor.logits.shape),
            reference=dict(context=reference.context, timed_contexts=[reference_start, reference.position - 1],
                           seconds_per_token=statistics.median(reference_seconds)),
            paired_ratio_to_shortest=_median_ratio(favor_seconds, reference_seconds),
        ),
        dict(
            implementation="softmax", **_timing_fields(softmax_seconds, warm["softmax"], batch), **common,
            cache_bytes=cache_bytes["softmax"], cache_bytes_after=cache_bytes_after["softmax"],
            peak_memory_growth_bytes=peaks["softmax"],
            cache_build_seconds=build_seconds["softmax"], logits_shape=list(softmax.logits.shape),
            paired_ratio_to_favor=_median_ratio(softmax_seconds, favor_seconds),
        ),
    ]
    return records, reference


def verify_decode_paths(model, batch: int, context: int = 64, steps: int = 5, seed: int = 0,
                        device: torch.device = torch.device("cpu")) -> dict:
    """Real prefill vs synthetic cache at a short ``context``, for both implementations.

    Asserts equal cache structure (layer types, tensor shapes/dtypes, token counts) before and after a decode
    step, and equal logits shapes; returns the structures and the median step times of both.
    """
    from ..cache import cache_of_output

    generator = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(model.config.vocab_size, (batch, context), generator=generator).to(device)
    builder = FavorStateBuilder(model, batch, seed=seed + 2)
    builder.extend_to(context)
    report = {"context": context, "steps": steps}
    for implementation in DECODE_IMPLEMENTATIONS:
        use_implementation(model, implementation)
        real = cache_of_output(model(input_ids=input_ids, use_cache=True))
        synthetic = (builder.cache() if implementation == "favor"
                     else synthetic_softmax_cache(model, batch, context, generator))
        before = (describe_cache(real), describe_cache(synthetic))
        if before[0] != before[1]:
            raise AssertionError(
                f"{implementation}: synthetic cache {before[1]} differs from a real prefill's {before[0]}")
        streams = [DecodeStream(model, implementation, cache, batch, context, generator, device)
                   for cache in (real, synthetic)]
        for stream in streams:
            stream.step()  # warm-up
        seconds = _interleaved_steps(streams, steps)
        timings = {name: dict(seconds_per_token=statistics.median(times), logits_shape=list(stream.logits.shape))
                   for name, times, stream in zip(("real", "synthetic"), seconds, streams)}
        after = (describe_cache(real), describe_cache(synthetic))
        if after[0] != after[1] or timings["real"]["logits_shape"] != timings["synthetic"]["logits_shape"]:
            raise AssertionError(f"{implementation}: after decoding, synthetic {after[1]} differs from real {after[0]}")
        report[implementation] = dict(
            cache_layers_before=before[0][:1] + ([f"... x{len(before[0])}"] if len(before[0]) > 1 else []),
            cache_layer_types=sorted({layer["type"] for layer in before[0]}),
            same_structure=True,
            real=timings["real"],
            synthetic=timings["synthetic"],
            synthetic_over_real_time=_median_ratio(seconds[1], seconds[0]),
        )
        del real, synthetic
    return report


# ------------------------------------------------------------------------------------ benchmark


def run_decode_benchmark(
    context_lengths=FULL_CONTEXT_LENGTHS,
    batch: int = 4,
    dtype: str = "float32",
    repeats: int = 10,
    warmup: int = 2,
    n_layer: int = 12,
    n_head: int = 12,
    n_embd: int = 768,
    vocab_size: int = 50257,
    favor_settings: dict | None = None,
    device: str = "cpu",
    verify_context: int = 64,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Per-token decode latency and cache memory of FAVOR+ (recurrent state) and softmax (KV cache).

    See the module docstring for exactly what is measured. Returns a JSON-able dict with ``settings``,
    ``machine``, ``verification``, ``records`` (one per context length and implementation) and ``summary``.
    """
    from tqdm.auto import tqdm

    from ..favor_settings import resolve_favor_settings

    context_lengths = sorted(int(length) for length in context_lengths)
    if not context_lengths or context_lengths[0] < 1 or repeats < 1 or warmup < 1:
        raise ValueError("need context lengths >= 1, repeats >= 1 and warmup >= 1")
    device_ = torch.device(device)
    settings = resolve_favor_settings(favor_settings)
    # The shortest-context stream grows by `repeats` tokens per length.
    n_positions = max(context_lengths[-1] + warmup + repeats,
                      context_lengths[0] + warmup + repeats * len(context_lengths), verify_context + 8) + 8
    model = build_model(n_layer, n_head, n_embd, vocab_size, n_positions, dtype, settings, device, seed)
    head_dim = n_embd // n_head
    nb_features = model.transformer.h[0].attn.favor_feature_map.nb_features
    state_shapes = [(batch, n_head, nb_features, head_dim), (batch, n_head, nb_features), (batch, n_head)]

    records = []
    load_start = load_average()
    with torch.inference_mode():
        verification = None
        if verify_context:
            verification = verify_decode_paths(model, batch, verify_context, seed=seed, device=device_)
        builder = FavorStateBuilder(model, batch, seed=seed + 3)
        generator = torch.Generator().manual_seed(seed + 4)
        reference = None  # the favor stream of the shortest context, stepped alongside every longer one
        for context in tqdm(context_lengths, desc="decode benchmark", disable=not progress):
            start = time.perf_counter()
            builder.extend_to(context)
            favor_cache = builder.cache()
            favor_build = time.perf_counter() - start
            _check_favor_cache(favor_cache, context, state_shapes)
            states_before = [layer.state.kv for layer in favor_cache.layers]
            start = time.perf_counter()
            softmax_cache = synthetic_softmax_cache(model, batch, context, generator)
            softmax_build = time.perf_counter() - start
            favor_records, reference = measure_context(
                model, favor_cache, softmax_cache, context, batch, warmup, repeats, generator, device_, reference,
                check_favor=lambda end: _check_favor_cache(favor_cache, end, state_shapes, states_before),
                build_seconds={"favor": favor_build, "softmax": softmax_build},
            )
            records.extend(favor_records)
            del favor_cache, softmax_cache
            gc.collect()

    result_settings = dict(
        context_lengths=context_lengths, batch=batch, dtype=dtype, repeats=repeats, warmup=warmup,
        model=dict(architecture="GPT2LMHeadModel (random weights)", n_layer=n_layer, n_head=n_head,
                   n_embd=n_embd, head_dim=head_dim, vocab_size=vocab_size, n_positions=n_positions,
                   parameters=sum(p.numel() for p in model.parameters())),
        favor_settings=settings, favor_state_shapes_per_layer=[list(s) for s in state_shapes],
        implementations={
            "favor": "attn_implementation='favor' + make_favor_cache (FavorCacheLayer: recurrent state)",
            "softmax": "attn_implementation='sdpa' + DynamicCache (keys/values, torch.cat per step)",
        },
        measured=("median seconds of one decode step (B new tokens, one per sequence) through the full model "
                  "incl. cache update, LM head and greedy argmax, from a synthetic cache of `context` tokens; per "
                  "length, after `warmup` steps of each, the favor, softmax and shortest-context favor streams "
                  "take one step in turn for `repeats` rounds; paired ratios are medians over rounds of the "
                  "ratio of two streams' step times in the same round; cache_bytes = nbytes of the cache tensors "
                  "before the first step; peak_memory_growth_bytes = peak memory growth during the warm-up steps"),
        seed=seed,
    )
    return decode_result(result_settings, device_, load_start, verification, records)


def decode_result(settings: dict, device: torch.device, load_start, verification, records: list[dict]) -> dict:
    """The JSON-able result of a decode benchmark: settings, machine (and its load at start and end),
    verification, records and :func:`.report.summarize_decode` summary."""
    result = {
        "benchmark": "decode",
        "settings": settings,
        "machine": {**machine_info(device), "load_average_1_5_15min": {"start": load_start, "end": load_average()}},
        "verification": verification,
        "records": records,
    }
    result["summary"] = summarize_decode(result)
    return result


DECODE_MEDIAN_FIELDS = ("seconds_per_token", "tokens_per_s", "paired_ratio_to_shortest", "paired_ratio_to_favor")


def run_decode_benchmark_in_processes(target: str, processes: int, **arguments) -> dict:
    """A decode benchmark (``target``: :func:`run_decode_benchmark` or
    :func:`.decode_converted.run_converted_decode_benchmark`) in ``processes`` fresh processes: each record's step
    time, tokens per second and paired ratios the median over the runs (their values in ``process_*``), every timed
    step in ``seconds_all`` (:func:`.machine.median_of_fresh_processes`)."""
    merged = median_of_fresh_processes(target, processes, {"records": DECODE_MEDIAN_FIELDS},
                                       ("context", "implementation"), pooled=("seconds_all",), **arguments)
    merged["summary"] = summarize_decode(merged)
    return merged
