"""A softmax causal LM whose KV cache is cut once the prompt is read (SnapKV, arXiv 2404.14469): the sinks, the latest
window and the ``keys`` older tokens the prompt's last queries attend to most, per layer and key head. The peer of a
bounded-memory converted model that selects *after* the question: its decoding state is the same size as a window
hybrid's with ``sinks + window + keys`` exact tokens, but the prompt is read with the full KV cache once (memory that
grows with the prompt during prefill), where the window hybrid's state stays bounded while it reads and selects each
key before any later token is seen.

:class:`SnapKVCausalLM` scores a sequence as a decoding model would answer a prompt: the prompt (every token but the
last ``logits_to_keep - 1``, the answer's) is prefilled with sdpa into a ``DynamicCache`` except its last
:data:`OBSERVATION` tokens, which run with eager attention to return their attention to every prompt key; per layer
and key head the older keys (after the sinks, before the window) are scored by that attention summed over the
observation queries and the query heads of the group, smoothed over ``pool`` neighbouring keys (default
:data:`POOL`, the paper's; a kept key keeps its neighbours: a number spans several tokens, and on SmolLM2 at 8k a pool
of 31 is what makes the cut answer as the full cache does), and the ``keys`` best kept; the answer tokens then run
through the cut cache at their true positions. Retrieval tasks only: a perplexity stream has no prompt to cut after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

OBSERVATION = 32
"""The prompt's last tokens whose attention chooses the kept keys (SnapKV's observation window)."""
POOL = 7
"""Keys a kept key's score is averaged over by default (SnapKV's pooling kernel); an odd count, centred on the key."""
DEFAULT_WINDOW, DEFAULT_SINKS = 512, 4
"""The window and sinks kept when only the number of selected keys is given."""


class SnapKVError(ValueError):
    """A SnapKV evaluation this module cannot run (one line: what is wrong, what is accepted)."""


def snapkv_settings(keys: int, window: int | None = None, sinks: int | None = None, pool: int | None = None) -> dict:
    """``{"keys", "window", "sinks", "pool"}`` with the defaults filled in, checked (before any model is loaded).

    Raises:
        SnapKVError: a negative count, a window shorter than the :data:`OBSERVATION` tokens, or an even pool.
    """
    settings = {"keys": int(keys), "window": int(DEFAULT_WINDOW if window is None else window),
                "sinks": int(DEFAULT_SINKS if sinks is None else sinks), "pool": int(POOL if pool is None else pool)}
    if min(settings.values()) < 0 or settings["window"] < OBSERVATION or settings["pool"] % 2 == 0:
        raise SnapKVError(f"SnapKV needs keys >= 0, sinks >= 0, a window >= its {OBSERVATION} observation tokens "
                          f"and an odd pool >= 1; got keys {settings['keys']}, window {settings['window']}, sinks "
                          f"{settings['sinks']}, pool {settings['pool']}")
    return settings


def snapkv_description(keys: int, window: int, sinks: int, pool: int = POOL) -> dict:
    """What a result records of the peer (``kv_cache``): its counts, its pooling and the fixed observation."""
    return {"class": "SnapKV (cut after the prompt)", "keys": keys, "window": window, "sinks": sinks,
            "observation": OBSERVATION, "pool": pool}


def snapkv_state_bytes(config, keys: int, window: int, sinks: int, dtype_bytes: int = 4) -> int:
    """Bytes of the cut KV cache of one sequence after the prompt: ``sinks + window + keys`` tokens in every layer."""
    text = config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype_bytes * (sinks + window + keys)


def select_kept_positions(scores: torch.Tensor, keys: int, window: int, sinks: int, pool: int = POOL) -> torch.Tensor:
    """Positions to keep, ``[B, KV, n]`` sorted, from ``scores`` ``[B, KV, P]`` (the observation's attention to each
    of ``P`` prompt keys): the first ``sinks``, the last ``window`` and the ``keys`` best of the rest after averaging
    each score over the ``pool`` keys centred on it.
    Every position is kept when ``P <= sinks + window + keys``."""
    batch, kv_heads, length = scores.shape
    if length <= sinks + window + keys:
        return torch.arange(length, device=scores.device).expand(batch, kv_heads, length)
    middle = scores[..., sinks:length - window]
    pooled = F.avg_pool1d(middle.reshape(batch * kv_heads, 1, -1), pool, stride=1, padding=pool // 2,
                          count_include_pad=False).reshape(batch, kv_heads, -1)
    chosen = pooled.topk(keys, dim=-1).indices + sinks
    fixed = torch.cat([torch.arange(sinks), torch.arange(length - window, length)]).to(scores.device)
    kept = torch.cat([fixed.expand(batch, kv_heads, -1), chosen], dim=-1)
    return kept.sort(dim=-1).values


class SnapKVCausalLM(torch.nn.Module):
    """``model`` scored through a KV cache cut after the prompt (module docstring). Takes ``input_ids`` (no padding
    mask) and ``logits_to_keep`` (the answer's length + 1: what tells the prompt from the answer); returns an object
    with ``logits``."""

    def __init__(self, model, keys: int, window: int, sinks: int, pool: int = POOL):
        super().__init__()
        settings = snapkv_settings(keys, window, sinks, pool)
        self.model, self.keys, self.window, self.sinks, self.pool = model, *settings.values()
        self.kv_cache_description = snapkv_description(**settings)

    @property
    def config(self):
        return self.model.config

    def _run(self, input_ids, cache, **kwargs):
        from ..cache import cache_argument_name

        return self.model(input_ids=input_ids, use_cache=True, **{cache_argument_name(self.model.forward): cache},
                          **kwargs)

    def forward(self, input_ids, use_cache: bool = False, logits_to_keep: int = 0, **kwargs):
        from transformers import DynamicCache

        if kwargs.get("attention_mask") is not None:
            raise SnapKVError("the SnapKV evaluation takes unpadded batches only")
        total = input_ids.shape[1]
        prompt = total - (logits_to_keep - 1)
        if logits_to_keep < 1 or prompt <= OBSERVATION:
            raise SnapKVError("SnapKV cuts the cache after a prompt: it scores retrieval answers (logits_to_keep = "
                              f"the answer's length + 1, after a prompt of more than {OBSERVATION} tokens), not a "
                              "perplexity stream")
        cache = DynamicCache(config=self.model.config)
        self._run(input_ids[:, :prompt - OBSERVATION], cache, logits_to_keep=1)
        implementation = self.model.config._attn_implementation
        self.model.set_attn_implementation("eager")
        try:
            observed = self._run(input_ids[:, prompt - OBSERVATION:prompt], cache, logits_to_keep=1,
                                 output_attentions=True)
        finally:
            self.model.set_attn_implementation(implementation)
        for layer, attention in zip(cache.layers, observed.attentions):
            batch, kv_heads, length, head_dim = layer.keys.shape
            scores = attention.float().sum(dim=2).reshape(batch, kv_heads, -1, length).mean(dim=2)  # [B, KV, P]
            kept = select_kept_positions(scores, self.keys, self.window, self.sinks, self.pool)[..., None]
            layer.keys = layer.keys.gather(2, kept.expand(-1, -1, -1, head_dim))
            layer.values = layer.values.gather(2, kept.expand(-1, -1, -1, layer.values.shape[-1]))
        pieces = [observed.logits[:, -1:]]
        if total > prompt:
            positions = torch.arange(prompt, total, device=input_ids.device)[None]
            pieces.append(self._run(input_ids[:, prompt:], cache, position_ids=positions).logits)
        return type("SnapKVOutput", (), {"logits": torch.cat(pieces, dim=1)})()


def with_snapkv(model, keys: int, window: int, sinks: int, model_path: str, pool: int = POOL):
    """``model`` wrapped in :class:`SnapKVCausalLM`; a converted (Performer) model is refused: its attention keeps no
    KV cache to cut."""
    from ..configuration_performer import PERFORMER_MODEL_TYPE

    if getattr(model.config, "model_type", "") == PERFORMER_MODEL_TYPE:
        raise SnapKVError(f"{model_path} is a converted model: SnapKV cuts a softmax model's KV cache")
    return SnapKVCausalLM(model, keys, window, sinks, pool)


__all__ = ["DEFAULT_SINKS", "DEFAULT_WINDOW", "OBSERVATION", "POOL", "SnapKVCausalLM", "SnapKVError",
           "select_kept_positions", "snapkv_description", "snapkv_settings", "snapkv_state_bytes", "with_snapkv"]
