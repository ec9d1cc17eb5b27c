"""Counting the tensor operations a call runs, and its host synchronisations: the launch count of a call on a GPU.

On a GPU each operation that is not a view is (at least) one kernel launch, a few microseconds of the host's time
whatever its size, and a host synchronisation (``.item()``, ``bool(tensor)``, ``int(tensor)``) stops the host until
the device has caught up. At short lengths and when decoding, both set the time; the counts are the same on any
device, so they are measured here on the CPU (:func:`count_operations`) and reported beside the GPU timings
(``benchmarks/scripts/launch_counts.py``).
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VIEW_OPERATIONS = frozenset({
    "aten.view", "aten.slice", "aten.unsqueeze", "aten.expand", "aten._unsafe_view", "aten.select", "aten.transpose",
    "aten.t", "aten.squeeze", "aten.permute", "aten.alias", "aten.unfold", "aten.as_strided", "aten.split",
    "aten.unbind", "aten.detach", "aten.reshape", "aten.narrow", "aten.split_with_sizes", "aten.view_as_real",
})
"""Operations that only make a new view of a tensor's memory (no kernel)."""

SYNCHRONISING_OPERATIONS = frozenset({"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.is_nonzero"})
"""Operations that read a device value back on the host."""


class OperationCounts(TorchDispatchMode):
    """Within ``with OperationCounts() as counts:``, every aten operation dispatched is counted by name."""

    def __init__(self):
        super().__init__()
        self.by_name = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_name[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def launches(self) -> int:
        """Operations that are not views: kernel launches on a GPU."""
        return sum(n for name, n in self.by_name.items() if name not in VIEW_OPERATIONS)

    @property
    def synchronisations(self) -> int:
        return sum(self.by_name[name] for name in SYNCHRONISING_OPERATIONS)

    @property
    def total(self) -> int:
        return sum(self.by_name.values())


def count_operations(call) -> OperationCounts:
    """Run ``call()`` once under :class:`OperationCounts` and return the counts."""
    with OperationCounts() as counts:
        call()
    return counts


def attention_call_counts(implementation: str, mode: str, length: int, heads: int = 12, head_dim: int = 64,
                          nb_features: int = 256, backward: bool = True) -> dict:
    """Launches and synchronisations of one attention call (:func:`~.attention.make_attention_call`'s kinds) of
    ``length`` tokens, forward (and backward), on the CPU."""
    from .attention import make_attention_call

    call = make_attention_call(implementation, mode, head_dim, nb_features, 64, torch.device("cpu"), heads=heads)
    q, k, v = (torch.randn(1, heads, length, head_dim, requires_grad=backward) for _ in range(3))

    def run():
        out = call(q, k, v)
        if backward:
            out.backward(torch.ones_like(out))

    counts = count_operations(run)
    return {"launches": counts.launches, "synchronisations": counts.synchronisations, "operations": counts.total}
