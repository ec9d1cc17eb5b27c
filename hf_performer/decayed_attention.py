"""Decayed causal linear attention, the contract of flash-linear-attention's ``chunk_simple_gla``, in two backends.

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,    o_t = q_t S_t,    S_{-1} = initial_state

for queries and keys ``[B, H, T, K]``, values ``[B, H, T, V]`` and a log decay ``g`` ``[B, H, T]`` (``<= 0``; ``None``:
no decay). It is what every causal linear part of this package reduces to: the running key stabiliser of FAVOR+ is
such a decay (``g_t = c_{t-1} - c_t``, :mod:`.linear_attention_parallel`), and a learned data-dependent decay of a
tail would be one too.

Backends (:func:`decayed_attention` picks one by device and dtype, or ``HF_PERFORMER_LINEAR_BACKEND``):

* ``torch`` (:func:`chunk_decayed_attention`): chunk-parallel, every chunk at once, a fixed number of tensor operations
  whatever ``T`` (no Python loop over the sequence): a masked ``[C, C]`` tile inside each chunk, each chunk's state
  contribution, and the states entering the chunks as one matrix product with the ``[N + 1, N]`` matrix of decays
  between chunks. Runs on any device, differentiable by autograd; the reference the fused kernels are tested against
  (itself tested against the float64 recurrence ``reference.reference_decayed_attention``).
* ``fla``: flash-linear-attention's fused Triton kernels (``fla.ops.simple_gla.chunk_simple_gla``, PyPI
  ``flash-linear-attention``; ``pip install "hf-performer[cuda]"``), used on CUDA for bf16 / fp16 operands when
  installed and safe (not on a Hopper GPU with Triton < 3.7.1: :data:`FLA_HOPPER_TRITON`). Otherwise the CUDA path
  runs the ``torch`` backend after a one-line notice.

Every exponent is a difference of cumulative decays that is ``<= 0`` (no overflow); sums between chunks run in
float32 (float64 for float64 inputs) whatever the operands' dtype.

This module imports only ``torch`` and the standard library (``fla`` is looked up at run time): it is copied next to
saved models for ``trust_remote_code``.
"""

from __future__ import annotations

import functools
import importlib
import math
import os

import torch
import torch.nn.functional as F

BACKEND_VARIABLE = "HF_PERFORMER_LINEAR_BACKEND"
BACKENDS = ("auto", "fla", "torch")
FLA_MODULE = "fla.ops.simple_gla"
MIN_CHUNK, MAX_CHUNK = 64, 512


class DecayedAttentionError(ValueError):
    """Inputs or a backend that :func:`decayed_attention` does not accept."""


def parallel_chunk_size(length: int) -> int:
    """Tokens per chunk of :func:`chunk_decayed_attention`: about ``2 sqrt(T)`` (a power of two in 64..512), which
    balances the ``[C, C]`` tiles (``T C`` work) against the scan between chunks (``(T / C)^2`` work)."""
    target = 2.0 * math.sqrt(max(length, 1))
    return int(min(MAX_CHUNK, max(MIN_CHUNK, 2 ** math.ceil(math.log2(target)))))


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def chunk_decayed_attention(q, k, v, log_decay=None, initial_state=None, output_final_state=False, chunk_size=None):
    """The ``torch`` backend (module docstring). ``q``, ``k`` ``[B, H, T, K]`` and ``v`` ``[B, H, T, V]`` in one dtype
    (the operands of the matrix products), ``log_decay`` ``[B, H, T]`` or ``None``, ``initial_state`` ``[B, H, K, V]``
    or ``None``. Returns ``o`` ``[B, H, T, V]`` and the final state ``[B, H, K, V]`` (or ``None``), both float32
    (float64 for float64 inputs)."""
    batch, heads, length, features = q.shape
    columns = v.shape[-1]
    acc = _accumulation_dtype(q)
    size = chunk_size or parallel_chunk_size(length)
    chunks = -(-length // size)
    pad = chunks * size - length
    g = q.new_zeros(batch, heads, length, dtype=acc) if log_decay is None else log_decay.to(acc)
    if pad:  # padded keys are zero and do not decay: they change nothing
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g = F.pad(g, (0, pad))
    qc, kc, vc = (t.reshape(batch, heads, chunks, size, t.shape[-1]) for t in (q, k, v))
    cumulative = g.view(batch, heads, chunks, size).cumsum(-1)  # G_i within each chunk
    position = torch.arange(size, device=q.device)
    lower = position[:, None] >= position[None, :]
    inside = torch.where(lower, cumulative[..., :, None] - cumulative[..., None, :], float("-inf")).exp()
    scores = torch.matmul(qc, kc.transpose(-1, -2)).to(acc) * inside  # [B, H, N, C, C]
    out = torch.matmul(scores.to(v.dtype), vc).to(acc)

    chunk_decay = cumulative[..., -1]  # [B, H, N]
    to_end = (chunk_decay[..., None] - cumulative).exp()  # [B, H, N, C], <= 1
    contributions = torch.matmul((kc * to_end[..., None].to(k.dtype)).transpose(-1, -2), vc).to(acc)  # [B, H, N, K, V]
    # The state entering chunk n (n = 0..N; n = N is the final state): sum_{t < n} exp(P_n - P_{t+1}) U_t + exp(P_n) S0,
    # P_n the decay of the chunks before n.
    before = F.pad(chunk_decay.cumsum(-1), (1, 0))  # [B, H, N + 1]
    rows = torch.arange(chunks + 1, device=q.device)
    earlier = rows[:, None] > rows[None, :chunks]  # t < n
    between = torch.where(earlier, before[..., :, None] - before[..., None, 1:], float("-inf")).exp()  # [B, H, N+1, N]
    states = torch.matmul(between, contributions.flatten(3))  # [B, H, N + 1, K V]
    if initial_state is not None:
        states = states + before.exp()[..., None] * initial_state.to(acc).flatten(2)[:, :, None]
    states = states.view(batch, heads, chunks + 1, features, columns)
    decayed_q = qc * cumulative.exp()[..., None].to(q.dtype)
    out = out + torch.matmul(decayed_q, states[:, :, :chunks].to(q.dtype)).to(acc)
    out = out.reshape(batch, heads, chunks * size, columns)[:, :, :length]
    return out, (states[:, :, chunks] if output_final_state else None)


@functools.lru_cache(maxsize=None)
def _fla_module():
    """``fla.ops.simple_gla`` or ``None`` (not installed, or it failed to import: the notice says why, once)."""
    try:
        return importlib.import_module(FLA_MODULE)
    except Exception as error:  # noqa: BLE001 - any failure means the portable path
        from transformers.utils import logging

        logging.get_logger(__name__).warning(
            f"hf-performer: the fused CUDA kernels of flash-linear-attention are unavailable ({type(error).__name__}: "
            f"{error}); linear attention runs its portable chunk-parallel kernels (pip install "
            "'hf-performer[cuda]' for the fused ones)"
        )
        return None


def fla_decayed_attention(q, k, v, log_decay=None, initial_state=None, output_final_state=False):
    """The ``fla`` backend: :func:`chunk_decayed_attention`'s contract on ``chunk_simple_gla`` (layout ``[B, T, H, .]``,
    scale 1). Returns float32 outputs and state like the ``torch`` backend."""
    module = _fla_module()
    if module is None:
        raise DecayedAttentionError("the fla backend needs flash-linear-attention (pip install 'hf-performer[cuda]')")
    layout = lambda t: None if t is None else t.transpose(1, 2).contiguous()  # noqa: E731
    state = None if initial_state is None else initial_state.float().contiguous()
    out, final = module.chunk_simple_gla(layout(q), layout(k), layout(v), g=layout(
        None if log_decay is None else log_decay.float()), scale=1.0, initial_state=state,
        output_final_state=output_final_state)
    return out.transpose(1, 2).float(), final


FLA_HOPPER_TRITON = (3, 7, 1)
"""On Hopper GPUs flash-linear-attention refuses its gated backward with Triton 3.4 to 3.7.0 (wrong results there: its
issue 640); the fla backend is then not used (measured on an H200 with Triton 3.6.0, 2026-11-28)."""


@functools.lru_cache(maxsize=None)
def _fla_refused_on(device_index: int) -> bool:
    """Whether fla's kernels are unsafe on this CUDA device with this Triton (:data:`FLA_HOPPER_TRITON`); says so once."""
    import torch.cuda

    try:
        triton = importlib.import_module("triton")
        version = tuple(int(part) for part in triton.__version__.split("+")[0].split(".")[:3])
    except Exception:  # noqa: BLE001 - no triton: fla cannot run either
        return True
    if torch.cuda.get_device_capability(device_index)[0] != 9 or version >= FLA_HOPPER_TRITON:
        return False
    from transformers.utils import logging

    logging.get_logger(__name__).warning(
        f"hf-performer: flash-linear-attention's gated backward is wrong on Hopper GPUs with Triton {triton.__version__} "
        "(it refuses it: Triton >= 3.7.1 needed); linear attention runs its portable chunk-parallel kernels")
    return True


def requested_backend() -> str:
    """``HF_PERFORMER_LINEAR_BACKEND`` (``auto`` when unset); anything else than :data:`BACKENDS` raises."""
    name = os.environ.get(BACKEND_VARIABLE, "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise DecayedAttentionError(f"{BACKEND_VARIABLE}={name!r}: choose one of {', '.join(BACKENDS)}")
    return name


def backend_for(q: torch.Tensor) -> str:
    """The backend :func:`decayed_attention` runs for operands like ``q``: ``fla`` on CUDA for bf16 / fp16 when it is
    installed (or asked for), else ``torch``."""
    name = requested_backend()
    if name == "torch":
        return "torch"
    if name == "fla":
        return "fla"
    if (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _fla_module() is not None
            and not _fla_refused_on(q.device.index if q.device.index is not None else torch.cuda.current_device())):
        return "fla"
    return "torch"


def decayed_attention(q, k, v, log_decay=None, initial_state=None, output_final_state=False):
    """Decayed causal linear attention (module docstring) on the backend :func:`backend_for` picks."""
    if not (q.shape[:3] == k.shape[:3] == v.shape[:3] and q.shape[-1] == k.shape[-1] and q.dim() == 4):
        raise DecayedAttentionError(
            f"decayed attention needs q, k [B, H, T, K] and v [B, H, T, V]; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}")
    if log_decay is not None and tuple(log_decay.shape) != tuple(q.shape[:3]):
        raise DecayedAttentionError(f"log_decay must be [B, H, T] = {list(q.shape[:3])}; got {tuple(log_decay.shape)}")
    if backend_for(q) == "fla":
        return fla_decayed_attention(q, k, v, log_decay, initial_state, output_final_state)
    return chunk_decayed_attention(q, k, v, log_decay, initial_state, output_final_state)
