"""A converted model's probe run: what the architecture does that its static checks cannot see, tried on a few tokens
before anything is written.

Some architectures do things to attention that only running them shows: they add a bias to the scores (relative
positions, ALiBi, dynamic masks), ask for a mask pattern linear attention cannot express, run their layers several
times per forward (looped models: a recurrent cache per layer would fold the same tokens twice), or call the attention
function in a way a recurrent cache cannot follow. :func:`probe_converted_model`
runs the converted model on a padded batch of a few tokens and, for a causal LM, decodes one token from a cache
prefilled with the others, which must give the logits of the full forward. A failure becomes a one-line
:class:`~.convert.ConversionError` naming the cause, unless the softmax source fails the same probe (then the probe
says nothing about the conversion and is skipped).
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from hf_performer.cache import cache_argument_name, cache_of_output
from hf_performer.favor_attention import find_attention_modules

logger = logging.get_logger(__name__)

PROBE_LENGTH = 16
PROBE_PADDING = 2
DECODE_TOLERANCE = 1e-3
"""Largest relative difference between the cached decoding step's logits and the full forward's (float32 models;
lower-precision models are compared with their dtype's resolution)."""


def _probe_batch(model, length: int, left_padding: bool) -> dict:
    """Two rows of ``length`` token ids in the vocabulary, the second padded by :data:`PROBE_PADDING`."""
    config = model.config.get_text_config(decoder=True)
    vocab = getattr(config, "vocab_size", None) or 2
    input_ids = torch.arange(length).repeat(2, 1).add_(torch.tensor([[1], [3]])).remainder_(vocab)
    attention_mask = torch.ones_like(input_ids)
    padded = slice(0, PROBE_PADDING) if left_padding else slice(length - PROBE_PADDING, length)
    attention_mask[1, padded] = 0
    device = next(model.parameters()).device
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


def _logits(model, **inputs):
    output = model(**inputs)
    return output.logits if getattr(output, "logits", None) is not None else output[0]


def _cached_decode_error(model, batch: dict) -> float:
    """Relative difference of the last position's logits: prefill all tokens but the last with a cache, decode the last
    one from it, against one full forward."""
    full = _logits(model, **batch)[:, -1]
    prefix = {name: tensor[:, :-1] for name, tensor in batch.items()}
    output = model(**prefix, use_cache=True)
    cache = cache_of_output(output)
    if cache is None:
        raise RuntimeError("the model returned no cache after a forward with use_cache=True")
    step = model(input_ids=batch["input_ids"][:, -1:], attention_mask=batch["attention_mask"], use_cache=True,
                 **{cache_argument_name(model.forward): cache})
    decoded = step.logits[:, -1]
    scale = full.float().abs().max().clamp_min(1e-6)
    return ((decoded.float() - full.float()).abs().max() / scale).item()


def _error_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


@torch.no_grad()
def probe_converted_model(source, performer, causal_lm: bool) -> str | None:
    """Run ``performer`` (a converted model) as described in the module docstring.

    Returns:
        ``None`` when it passes (or when the source fails the same probe), else the one-line reason it cannot honour
        the architecture.
    """
    causal = any(getattr(module, "is_causal", False) for _, module in find_attention_modules(source))
    batch = _probe_batch(source, PROBE_LENGTH, left_padding=causal)
    modules = find_attention_modules(performer)
    calls = {name: 0 for name, _ in modules}
    handles = [module.register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
               for name, module in modules]
    try:
        _logits(performer, **batch)
    except Exception as error:  # noqa: BLE001 - anything the architecture does that favor attention cannot follow
        if _source_fails(source, lambda: _logits(source, **batch)):
            return None
        return f"the converted model cannot run: {_error_line(error)}"
    finally:
        for handle in handles:
            handle.remove()
    looped = [name for name, count in calls.items() if count > 1]
    if causal and looped:
        return (f"its attention module {looped[0]} runs {calls[looped[0]]} times per forward (a looped model): one "
                "recurrent cache per layer cannot follow it")
    if not causal_lm:
        return None
    try:
        difference = _cached_decode_error(performer, batch)
    except Exception as error:  # noqa: BLE001
        if _source_fails(source, lambda: _cached_decode_error(source, batch)):
            return None
        return f"cached decoding of the converted model fails: {_error_line(error)}"
    dtype = next(performer.parameters()).dtype
    tolerance = max(DECODE_TOLERANCE, 8 * torch.finfo(dtype).eps) if dtype.is_floating_point else DECODE_TOLERANCE
    if difference > tolerance and _cached_decode_error(source, batch) <= tolerance:
        return (f"cached decoding of the converted model does not reproduce its full forward (relative difference "
                f"{difference:.2g}): the architecture feeds its attention in a way a recurrent cache cannot follow "
                "(e.g. one attention module called several times per step)")
    return None


def _source_fails(source, run) -> bool:
    try:
        run()
    except Exception as error:  # noqa: BLE001
        logger.info(f"conversion probe skipped: the softmax source fails it too ({_error_line(error)})")
        return True
    return False
