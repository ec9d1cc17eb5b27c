"""A softmax causal LM evaluated as it decodes with transformers' quantized KV cache (``QuantizedCache``, the
``quanto`` backend: ``pip install optimum-quanto``), the bounded-precision peer of a bounded-memory converted model.

A quantized cache changes nothing inside one forward pass (the call's own keys are attended in full precision); it
changes what later tokens see. :class:`QuantizedKVCausalLM` therefore feeds every sequence in pieces of
:data:`PREFILL_CHUNK` tokens through one fresh ``QuantizedCache``: each piece attends the earlier pieces through the
cache, whose tokens beyond the last :data:`RESIDUAL_LENGTH` are stored in ``nbits`` (2 or 4) with a scale and zero
point per group of :data:`GROUP_SIZE` values (the head size when smaller: quanto needs groups that divide it), as a decoding model would (a prompt prefilled in one call and its answer
decoded sees the same, give or take the residual). Its logits are scored by the same code as any model's.
"""

from __future__ import annotations

import torch

class QuantizedKVError(ValueError):
    """A quantized-KV evaluation this module cannot run (one line: what is wrong, what is accepted)."""


PREFILL_CHUNK = 512
RESIDUAL_LENGTH = 128
GROUP_SIZE = 64
BITS = (2, 4)


def _head_dim(config) -> int:
    text = config.get_text_config()
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def group_size(config) -> int:
    """Entries per quantization group: :data:`GROUP_SIZE`, or the head size when smaller."""
    return min(GROUP_SIZE, _head_dim(config))


def quantized_kv_state_bytes(config, length: int, nbits: int, dtype_bytes: int = 2) -> int:
    """Bytes of a quantized KV cache of ``length`` tokens: ``nbits`` per key and value entry, a scale and a zero
    point (``dtype_bytes`` each) per group of :func:`group_size` entries, the last :data:`RESIDUAL_LENGTH` tokens in
    ``dtype_bytes`` (transformers' ``QuantizedCache`` layout)."""
    text = config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = _head_dim(config)
    entries = 2 * text.num_hidden_layers * kv_heads * head_dim  # per token, keys and values
    residual = min(length, RESIDUAL_LENGTH)
    quantized = length - residual
    return int(quantized * entries * nbits / 8 + quantized * entries / group_size(config) * 2 * dtype_bytes
               + residual * entries * dtype_bytes)


class QuantizedKVCausalLM(torch.nn.Module):
    """``model`` whose forward runs through a fresh quantized KV cache, :data:`PREFILL_CHUNK` tokens at a time
    (module docstring). Takes ``input_ids`` (no padding mask: one sequence length per batch) and
    ``logits_to_keep``; returns an object with ``logits``."""

    def __init__(self, model, nbits: int):
        super().__init__()
        if nbits not in BITS:
            raise QuantizedKVError(f"quantized KV cache bits must be one of {', '.join(map(str, BITS))}, got {nbits}")
        check_quanto()
        self.model, self.nbits = model, nbits
        self.kv_cache_description = {"class": "transformers.QuantizedCache", "backend": "quanto", "nbits": nbits,
                                     "residual_length": RESIDUAL_LENGTH, "q_group_size": group_size(model.config),
                                     "prefill_chunk": PREFILL_CHUNK}

    @property
    def config(self):
        return self.model.config

    def forward(self, input_ids, use_cache: bool = False, logits_to_keep: int = 0, **kwargs):
        from transformers import QuantizedCache

        from ..cache import cache_argument_name

        if kwargs.get("attention_mask") is not None:
            raise QuantizedKVError("the quantized-KV evaluation takes unpadded batches only")
        cache = QuantizedCache(backend="quanto", config=self.model.config, nbits=self.nbits,
                               residual_length=RESIDUAL_LENGTH, q_group_size=group_size(self.model.config))
        argument = cache_argument_name(self.model.forward)
        pieces = []
        for start in range(0, input_ids.shape[1], PREFILL_CHUNK):
            chunk = input_ids[:, start:start + PREFILL_CHUNK]
            output = self.model(input_ids=chunk, use_cache=True, logits_to_keep=logits_to_keep, **{argument: cache})
            pieces.append(output.logits)
        logits = torch.cat(pieces, dim=1)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return type("QuantizedKVOutput", (), {"logits": logits})()


def check_quanto() -> None:
    """Raise :class:`QuantizedKVError` when the quanto backend does not import."""
    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        raise QuantizedKVError("the quantized KV cache needs the quanto backend: pip install optimum-quanto") from None


def with_quantized_kv(model, nbits: int, model_path: str):
    """``model`` wrapped in :class:`QuantizedKVCausalLM`; a converted (Performer) model is refused: its attention
    keeps no KV cache to quantize."""
    from ..configuration_performer import PERFORMER_MODEL_TYPE

    if getattr(model.config, "model_type", "") == PERFORMER_MODEL_TYPE:
        raise QuantizedKVError(f"{model_path} is a converted model: a quantized KV cache applies to softmax models "
                              "only (their cache grows with the context)")
    return QuantizedKVCausalLM(model, nbits)


__all__ = ["BITS", "group_size", "QuantizedKVCausalLM", "QuantizedKVError", "check_quanto", "quantized_kv_state_bytes", "with_quantized_kv"]
