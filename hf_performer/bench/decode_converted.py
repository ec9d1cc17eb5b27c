"""Decode latency of a converted causal LM with window layers against the same weights with softmax attention.

``hf-performer bench decode --model FOLDER`` (the folder written by ``hf-performer convert SRC OUT --window W
--sinks S``, e.g. SmolLM2-135M). Same measurement and record schema as :mod:`.decode` (whose helpers it uses:
interleaved streams, paired ratios, cache bytes, peak memory growth; same summary, table and plot), with these
differences:

* Model: the converted folder, loaded with ``AutoModelForCausalLM.from_pretrained`` (``eval()``, under
  ``torch.inference_mode()``). One model, two implementations switched with ``set_attn_implementation``:
  ``favor`` (its window layers: exact softmax over the sinks and the last ``window`` tokens, the linear tail,
  each with a constant-size :class:`~hf_performer.window_cache_layer.WindowCacheLayer` from ``make_favor_cache``) and
  ``softmax`` (``sdpa``, transformers' ``DynamicCache``): the source model's own attention, same weights.
* Contexts of the favor stream are **real**: a prefill through the model and its cache, in chunks of
  ``prefill_chunk`` tokens (random token ids, ``logits_to_keep=1``), continued from one length to the next;
  its time is recorded as ``cache_build_seconds``. Chunked prefill through the cache is exact (checked at
  ``verify_context``: the same last-token logits as one forward without cache).
* The softmax cache of ``L`` tokens is synthetic, as in :mod:`.decode`: random keys and values
  ``[B, Hkv, L, d]`` in every layer of a ``DynamicCache`` (the cost of a decode step does not depend on the
  values), checked to have the structure a real prefill leaves.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from .decode import decode_result, describe_cache, measure_context, use_implementation
from .machine import load_average

DEFAULT_CONTEXT_LENGTHS = (512, 16384)
PREFILL_CHUNK = 1024
WINDOW_LAYER_TYPE = "favor_window"


def load_converted_causal_lm(path, dtype: str = "float32", device: str = "cpu"):
    """The converted causal LM of ``path`` (``eval()``), on ``favor``."""
    from transformers import AutoModelForCausalLM

    from .. import modeling_performer  # noqa: F401  (registers the Performer classes with the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model = model.eval().to(device)
    use_implementation(model, "favor")
    return model


def _text_config(model):
    return model.config.get_text_config(decoder=True)


def window_layer_indices(model) -> list[int]:
    """Layers whose generation cache is a window cache layer (``make_favor_cache``)."""
    from ..cache import make_favor_cache

    return [i for i, layer in enumerate(make_favor_cache(model).layers)
            if getattr(type(layer), "_layer_type", None) == WINDOW_LAYER_TYPE]


def synthetic_kv_cache(model, batch: int, context: int, generator: torch.Generator):
    """A ``DynamicCache`` holding random keys/values ``[batch, Hkv, context, head_dim]`` in every layer."""
    from transformers import DynamicCache

    config = _text_config(model)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = DynamicCache(config=config)
    for layer_idx in range(config.num_hidden_layers):
        keys, values = (torch.randn(batch, kv_heads, context, head_dim, generator=generator)
                        .to(device=model.device, dtype=model.dtype) for _ in range(2))
        cache.update(keys, values, layer_idx)
    return cache


def prefill(model, cache, input_ids: torch.Tensor, start: int, chunk: int) -> torch.Tensor:
    """Feed ``input_ids[:, start:]`` ``[B, L]`` through ``model`` and ``cache`` (holding ``start`` tokens) in
    chunks of ``chunk`` tokens; returns the logits of the last token ``[B, vocab]``."""
    from ..cache import cache_argument_name

    batch, end = input_ids.shape
    logits, keyword = None, cache_argument_name(type(model).forward)
    for begin in range(start, end, chunk):
        stop = min(begin + chunk, end)
        positions = torch.arange(begin, stop, device=input_ids.device).expand(batch, -1)
        logits = model(input_ids=input_ids[:, begin:stop], attention_mask=torch.ones_like(input_ids[:, :stop]),
                       position_ids=positions, use_cache=True, logits_to_keep=1,
                       **{keyword: cache}).logits
    return logits[:, -1]


def check_window_cache(cache, context: int, window_layers: list[int]) -> None:
    """Window layers hold a window state only (no keys), nothing pending, ``context`` tokens counted."""
    for layer_idx in window_layers:
        layer = cache.layers[layer_idx]
        if getattr(type(layer), "_layer_type", None) != WINDOW_LAYER_TYPE:
            raise AssertionError(f"window layer {layer_idx} is a {type(layer).__name__}, not a WindowCacheLayer")
        if layer.keys is not None or layer.pending_tokens or layer.get_seq_length() != context:
            raise AssertionError(
                f"window layer {layer_idx}: keys={layer.keys is not None}, pending={layer.pending_tokens}, "
                f"seq_length={layer.get_seq_length()} (expected no keys, 0 pending, {context})")
        if layer.state is None or layer.state.seen != context:
            raise AssertionError(f"window layer {layer_idx}: its state does not hold the {context} tokens")


def verify_window_decode(model, batch: int, context: int, chunk: int, seed: int, device: torch.device) -> dict:
    """At a short ``context``: chunked prefill through the window cache == one forward without cache (last-token
    logits), the window layers hold WindowCacheLayers; a real softmax prefill and the synthetic softmax cache have
    the same structure."""
    from ..cache import cache_of_output

    generator = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(_text_config(model).vocab_size, (batch, context), generator=generator).to(device)
    use_implementation(model, "favor")
    full = model(input_ids=input_ids, use_cache=False).logits[:, -1]
    from ..cache import make_favor_cache

    cache = make_favor_cache(model)
    chunked = prefill(model, cache, input_ids, 0, chunk)
    difference = (chunked - full).abs().max().item()
    if not difference <= 1e-3 * max(1.0, full.abs().max().item()):
        raise AssertionError(f"chunked prefill through the window cache differs from one forward by {difference}")
    layer_types = sorted({type(layer).__name__ for layer in cache.layers})
    use_implementation(model, "softmax")
    real = describe_cache(cache_of_output(model(input_ids=input_ids, use_cache=True)))
    synthetic = describe_cache(synthetic_kv_cache(model, batch, context, generator))
    if real != synthetic:
        raise AssertionError(f"softmax: synthetic cache {synthetic} differs from a real prefill's {real}")
    use_implementation(model, "favor")
    return dict(context=context, prefill_chunk=chunk, chunked_vs_one_forward_max_abs_logit_difference=difference,
                favor=dict(cache_layer_types=layer_types, cache_layers=describe_cache(cache)[:1]),
                softmax=dict(cache_layer_types=sorted({layer["type"] for layer in real}), same_structure=True))


def run_converted_decode_benchmark(
    model_path,
    context_lengths=DEFAULT_CONTEXT_LENGTHS,
    batch: int = 1,
    dtype: str = "float32",
    repeats: int = 10,
    warmup: int = 2,
    prefill_chunk: int = PREFILL_CHUNK,
    device: str = "cpu",
    verify_context: int = 64,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Per-token decode latency and cache memory of a converted model's window layers against softmax.

    See the module docstring. Returns the JSON-able dict of :func:`.decode.run_decode_benchmark` (``settings``,
    ``machine``, ``verification``, ``records`` with implementations ``favor`` = the window layers and
    ``softmax``, ``summary``); the model is named by its folder name only (no local path).
    """
    from tqdm.auto import tqdm

    from ..cache import make_favor_cache
    from ..favor_settings import resolve_favor_settings

    context_lengths = sorted(int(length) for length in context_lengths)
    if not context_lengths or context_lengths[0] < 1 or repeats < 1 or warmup < 1 or prefill_chunk < 1:
        raise ValueError("need context lengths >= 1, repeats >= 1, warmup >= 1 and prefill_chunk >= 1")
    device_ = torch.device(device)
    model = load_converted_causal_lm(model_path, dtype, device)
    config = _text_config(model)
    window_layers = window_layer_indices(model)
    if not window_layers:
        raise ValueError(
            f"bench decode --model: {Path(model_path).name} has no window layers; convert it with "
            "hf-performer convert SRC OUT --window W --sinks S")
    from ..favor_settings import layer_window

    favor_settings = resolve_favor_settings(getattr(config, "favor_settings", None) or model.config.favor_settings)
    # The buffer (window + max_rollback = 2 window keys) fills up first; from then on the cache size is constant.
    full_state = max(sum(layer_window(favor_settings, i)) + layer_window(favor_settings, i)[0] for i in window_layers)
    if context_lengths[0] < full_state:
        raise ValueError(f"bench decode --model: context lengths must be >= sinks + 2 x window = {full_state} (the "
                         f"window cache is still filling up below that); got {context_lengths[0]}")
    generator = torch.Generator().manual_seed(seed)
    token_stream = torch.randint(config.vocab_size, (batch, context_lengths[-1]), generator=generator).to(device_)
    records = []
    load_start = load_average()
    with torch.inference_mode():
        verification = None
        if verify_context:
            verification = verify_window_decode(model, batch, verify_context, max(1, verify_context // 3), seed,
                                                device_)
        favor_cache, prefilled, reference = make_favor_cache(model), 0, None
        for context in tqdm(context_lengths, desc="decode benchmark (window layers)", disable=not progress):
            use_implementation(model, "favor")
            start = time.perf_counter()
            prefill(model, favor_cache, token_stream[:, :context], prefilled, prefill_chunk)
            favor_build, prefilled = time.perf_counter() - start, context
            stream_cache = copy.deepcopy(favor_cache)  # the prefill continues from favor_cache
            check_window_cache(stream_cache, context, window_layers)
            start = time.perf_counter()
            softmax_cache = synthetic_kv_cache(model, batch, context, generator)
            softmax_build = time.perf_counter() - start
            length_records, reference = measure_context(
                model, stream_cache, softmax_cache, context, batch, warmup, repeats, generator, device_, reference,
                check_favor=lambda end, cache=stream_cache: check_window_cache(cache, end, window_layers),
                build_seconds={"favor": favor_build, "softmax": softmax_build},
            )
            length_records[0]["prefill_tokens"] = context
            records.extend(length_records)
            del softmax_cache

    settings = dict(
        context_lengths=context_lengths, batch=batch, dtype=dtype, repeats=repeats, warmup=warmup,
        prefill_chunk=prefill_chunk,
        model=dict(folder=Path(model_path).name, architecture=type(model).__name__,
                   source_architecture=(getattr(config, "architectures", None) or ["?"])[0],
                   num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
                   num_key_value_heads=getattr(config, "num_key_value_heads", None),
                   parameters=sum(p.numel() for p in model.parameters()), window_layers=window_layers),
        favor_settings=favor_settings,
        favor_label="window layers (sinks + window exact, linear tail; WindowCacheLayer)",
        implementations={
            "favor": "attn_implementation='favor', window layers + make_favor_cache (WindowCacheLayer: sinks, "
                     "a buffer of window + max_rollback keys/values, the float32 tail state)",
            "softmax": "attn_implementation='sdpa' + DynamicCache (keys/values, torch.cat per step), same weights",
        },
        measured=("median seconds of one decode step (B new tokens) through the full model incl. cache update, "
                  "LM head and greedy argmax; favor contexts from a real chunked prefill through the cache "
                  "(cache_build_seconds: the prefill from the previous length), softmax contexts synthetic; "
                  "interleaving, paired ratios, cache_bytes and peak memory as in `bench decode`"),
        seed=seed,
    )
    return decode_result(settings, device_, load_start, verification, records)
