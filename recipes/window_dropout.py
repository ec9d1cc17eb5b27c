"""Scheduled sliding-window dropout (arXiv 2510.05901) for training a window hybrid with a linear tail.

A hybrid trained as LoLCATs leans on its exact window and leaves the tail little to do (benchmarks/README.md: at
window 256 the tail's share was nil). At each training forward, every window layer with a tail independently drops
its band and sparse cache with probability ``p_t`` (attending to its sinks and its tail only:
:data:`hf_performer.favor_attention.WINDOW_DROPPED_ATTRIBUTE`), ``p_t`` decaying linearly from ``probability`` at the
first forward to 0 at the last, so that the tail learns to carry the signal and the model ends trained as it is
served. Evaluation forwards are untouched.
"""

from __future__ import annotations

import random

from torch import nn


def window_layers_with_tail(model: nn.Module) -> list[nn.Module]:
    """The attention modules of ``model`` that run a window layer with a linear tail."""
    from ..favor_attention import find_attention_modules, layer_index_of, module_favor_settings, uses_favor
    from ..favor_settings import is_window_layer

    modules = []
    for _, module in find_attention_modules(model):
        if not uses_favor(module):
            continue
        settings = module_favor_settings(module)
        if settings.get("linear_tail") and is_window_layer(settings, layer_index_of(module)):
            modules.append(module)
    return modules


class WindowDropout:
    """The schedule, installed as a forward pre-hook on the model (:meth:`remove` takes it off).

    Args:
        model: a window hybrid with a linear tail (``ValueError`` if it has no such layer).
        probability: ``p_0`` in ``(0, 1]``.
        total_forwards: training forwards of the whole run (optimizer steps x gradient accumulation).
        done_forwards: forwards already done (a resumed run continues its schedule).
        seed: seed of the draws.
    """

    def __init__(self, model: nn.Module, probability: float, total_forwards: int, done_forwards: int = 0,
                 seed: int = 0):
        if not 0.0 < probability <= 1.0:
            raise ValueError(f"window dropout probability must be in (0, 1], got {probability}")
        self.layers = window_layers_with_tail(model)
        if not self.layers:
            raise ValueError("window dropout needs window layers with a linear tail (a --no-tail or non-window "
                             "model has nothing to drop the window for)")
        self.probability, self.total, self.done = probability, max(1, total_forwards), done_forwards
        self.random = random.Random(seed)
        self.dropped: list[int] = []  # layers dropped at the last training forward (for tests and logs)
        self._handle = model.register_forward_pre_hook(self._before_forward)

    def current_probability(self) -> float:
        return self.probability * max(0.0, 1.0 - self.done / self.total)

    def _before_forward(self, model, args) -> None:
        from ..favor_attention import WINDOW_DROPPED_ATTRIBUTE

        if not model.training:
            return
        p = self.current_probability()
        self.dropped = []
        for index, module in enumerate(self.layers):
            drop = self.random.random() < p
            setattr(module, WINDOW_DROPPED_ATTRIBUTE, drop)
            if drop:
                self.dropped.append(index)
        self.done += 1

    def remove(self) -> None:
        """Take the hook off and clear every layer's flag."""
        from ..favor_attention import WINDOW_DROPPED_ATTRIBUTE

        self._handle.remove()
        for module in self.layers:
            if hasattr(module, WINDOW_DROPPED_ATTRIBUTE):
                delattr(module, WINDOW_DROPPED_ATTRIBUTE)
