"""Feature maps phi for linear attention: softmax(q.k) ~ phi(q).phi(k).

Every map turns a tensor ``x`` of shape ``[..., L, d]`` into :class:`Features` of shape
``[..., L, m]``. Exponential maps return their features in a stabilised form,
``phi(x) = values * exp(log_scale)`` with ``values <= 1``; the attention kernels choose how the
per-row ``log_scale`` is shared between keys (one constant per example and head, or a running
maximum in causal mode) so that nothing overflows and no future token changes a past output.

Maps implemented here:

* ``favor+`` (Choromanski et al. 2021, "Rethinking Attention with Performers"): positive random
  features ``phi(x) = exp(w_i.x - |x|^2 / 2) / sqrt(m)``, an unbiased estimator of ``exp(q.k)``.
  Orthogonal projections (block-orthogonal rows, Haar-distributed thanks to the sign correction of
  the QR factorisation, row norms drawn from the chi distribution or fixed to ``sqrt(d)``) or iid
  Gaussian rows.
* ``trig``: random Fourier features ``exp(|x|^2 / 2) [sin(w.x), cos(w.x)] / sqrt(m)``, the
  unbiased but not positive estimator of the same kernel (kept for comparison: its denominators
  can vanish or turn negative).
* ``relu``: the generalised kernel ``relu(w.x) + eps`` of the Performer paper.
* ``elu+1``: ``elu(x) + 1`` of Katharopoulos et al. 2020 ("Transformers are RNNs"), no projection.

Learned maps (trainable, per head, separate parameters for queries and keys; trained to mimic softmax by
attention transfer, see ``hf_performer.conversion.attention_transfer``):

* ``hedgehog`` (Zhang et al. 2024, "The Hedgehog & the Porcupine"; LoLCATs 2024):
  ``phi(x) = [softmax(x W + b), softmax(-(x W + b))]`` over the feature dimension.
* ``t2r`` (Kasai et al. 2021, "Finetuning Pretrained Transformers into RNNs"): ``phi(x) = relu(x W + b) + eps``.

Random maps keep their projection in a persistent buffer (saved in the state dict) and redraw it
only in training mode, every ``redraw_interval`` forward calls, from ``seed`` and the redraw count.

New maps (learned ones included) subclass :class:`FeatureMap` and register a name with
:func:`register_feature_map`; trainable parameters are ordinary ``nn.Parameter`` s.

The random maps and the registry live here; the base class and the random projections in :mod:`.feature_map_base`,
the learned maps in :mod:`.feature_maps_learned` (all re-exported here). This module imports only ``torch`` and
those siblings: it is copied next to saved models for ``trust_remote_code``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
from torch import nn

from .favor_schema import LEARNED_MAP_DEFAULT_INIT, LEARNED_MAP_INITS  # noqa: F401  (re-exported)
from .feature_map_base import (  # noqa: F401  (re-exported: the base every map and kernel imports from here)
    PROJECTION_KINDS,
    ROW_NORMS,
    FeatureMap,
    Features,
    compute_dtype_for,
    gaussian_orthogonal_random_matrix,
)
from .feature_maps_learned import HedgehogFeatureMap, LearnedFeatureMap, T2RFeatureMap


# --------------------------------------------------------------------------------------------
# Random maps
# --------------------------------------------------------------------------------------------

class RandomFeatureMap(FeatureMap):
    """A feature map built on a random projection ``W`` of shape ``[m, d]``.

    Args:
        head_dim: ``d``.
        nb_features: ``m``.
        orthogonal: block-orthogonal rows (default) or iid Gaussian rows.
        row_norms: ``"chi"`` (unbiased, default) or ``"fixed"`` (all rows of norm ``sqrt(d)``).
        redraw_interval: in training mode, draw a new projection every this many calls; ``0`` never.
        seed: seed of the draws; draw number ``k`` uses ``seed + k`` so every draw is reproducible.

    Buffers (saved in the state dict): ``projection`` ``[m, d]``, ``redraws`` (how many draws
    were made after the first) and ``calls`` (training calls since the last draw).
    """

    projection_rows_per_feature = 1

    def __init__(
        self,
        head_dim: int,
        nb_features: int = 256,
        *,
        orthogonal: bool = True,
        row_norms: str = "chi",
        redraw_interval: int = 0,
        seed: int = 0,
    ):
        super().__init__(head_dim, nb_features)
        if row_norms not in ROW_NORMS:
            raise ValueError(f"row_norms must be one of {ROW_NORMS}, got {row_norms!r}")
        if redraw_interval < 0:
            raise ValueError(f"redraw_interval must be >= 0 (0 = never), got {redraw_interval}")
        self.orthogonal = orthogonal
        self.row_norms = row_norms
        self.redraw_interval = redraw_interval
        self.seed = seed
        self.register_buffer("redraws", torch.zeros((), dtype=torch.long))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("projection", self.draw_projection(0))

    def initial_tensors(self) -> dict[str, torch.Tensor]:
        return {"projection": self.draw_projection(0), "redraws": torch.zeros((), dtype=torch.long),
                "calls": torch.zeros((), dtype=torch.long)}

    @property
    def nb_projection_rows(self) -> int:
        return self.nb_features // self.projection_rows_per_feature

    def draw_projection(self, draw_index: int) -> torch.Tensor:
        """The ``draw_index``-th projection of this map's seed (deterministic)."""
        generator = torch.Generator().manual_seed(self.seed + draw_index)
        return gaussian_orthogonal_random_matrix(
            self.nb_projection_rows,
            self.head_dim,
            orthogonal=self.orthogonal,
            row_norms=self.row_norms,
            generator=generator,
        )

    @torch.no_grad()
    def redraw_projection(self) -> None:
        """Draw the next projection now (whatever the mode)."""
        self.redraws += 1
        self.calls.zero_()
        new = self.draw_projection(int(self.redraws))
        # A new tensor, not an in-place copy: a forward whose backward is still to run keeps the projection it used.
        self.projection = new.to(self.projection.device, self.projection.dtype)

    @torch.no_grad()
    def maybe_redraw(self) -> None:
        if not self.training or self.redraw_interval == 0:
            return
        if int(self.calls) >= self.redraw_interval:
            self.redraw_projection()
        self.calls += 1

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` in the compute dtype: ``[..., L, d] -> [..., L, m_rows]``."""
        dtype = compute_dtype_for(x)
        return torch.matmul(x.to(dtype), self.projection.to(dtype).T)

    def extra_repr(self) -> str:
        kind = "orthogonal" if self.orthogonal else "iid"
        return (
            f"{super().extra_repr()}, projection={kind}, row_norms={self.row_norms}, "
            f"redraw_interval={self.redraw_interval}, seed={self.seed}"
        )


class FavorPlusFeatureMap(RandomFeatureMap):
    """Positive random features (FAVOR+): ``phi(x)_i = exp(w_i.x - |x|^2 / 2) / sqrt(m)``.

    ``E[phi(q).phi(k)] = exp(q.k)`` for ``w_i ~ N(0, I_d)``. Returned stabilised: ``values =
    exp(w.x - |x|^2/2 - max_i(...))`` and ``log_scale = max_i(...) - log(m)/2`` (the row maximum is
    a constant of the computation, so it carries no gradient; the kernels cancel or share it).
    """

    name = "favor+"

    def _half_squared_norm(self, x: torch.Tensor) -> torch.Tensor:
        """``|x|^2 / 2`` ``[..., L, 1]`` in the compute dtype (the per-row term of the exponent)."""
        return 0.5 * x.to(compute_dtype_for(x)).square().sum(-1, keepdim=True)

    def features(self, x: torch.Tensor) -> Features:
        # In place on the fresh [..., L, m] product: one allocation of that size instead of four.
        logits = self.project(x).sub_(self._half_squared_norm(x))
        row_max = logits.detach().amax(dim=-1, keepdim=True)
        values = logits.sub_(row_max).exp_()
        return Features(values, row_max.squeeze(-1) - 0.5 * math.log(self.nb_features))

    def shifted_key_features(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        # exp(Wx - |x|^2/2 - log(m)/2 - shift): one shift and one exp over the [..., L, m] product (no row maximum).
        row_shift = self._half_squared_norm(x).add_(shift[..., None]).add_(0.5 * math.log(self.nb_features))
        return self.project(x).sub_(row_shift).exp_()

    def features_vjp(self, x: torch.Tensor, values: torch.Tensor, grad_values: torch.Tensor) -> torch.Tensor:
        # values = exp(Wx - |x|^2/2 - const): d/dx = (grad * values) W - x * sum(grad * values).
        grad_logits = grad_values.mul_(values)
        grad_x = torch.matmul(grad_logits, self.projection.to(grad_logits.dtype))
        return grad_x.sub_(x * grad_logits.sum(-1, keepdim=True))


class TrigFeatureMap(RandomFeatureMap):
    """Random Fourier features: ``phi(x) = exp(|x|^2/2) [sin(Wx), cos(Wx)] / sqrt(m/2)``.

    Unbiased for ``exp(q.k)`` but not positive: the attention denominator can be ~0 or negative,
    which is why FAVOR+ exists. ``nb_features`` must be even (``m/2`` projections).
    """

    name = "trig"
    is_positive = False
    projection_rows_per_feature = 2

    def __init__(self, head_dim: int, nb_features: int = 256, **kwargs):
        self.check_nb_features(nb_features)
        super().__init__(head_dim, nb_features, **kwargs)

    @classmethod
    def check_nb_features(cls, nb_features: int) -> None:
        if nb_features % 2:
            raise ValueError(
                f"the {cls.name!r} feature map needs an even nb_features (sin and cos of each projection), got "
                f"{nb_features}"
            )

    def features(self, x: torch.Tensor) -> Features:
        projected = self.project(x)
        values = torch.cat([torch.sin(projected), torch.cos(projected)], dim=-1)
        log_scale = 0.5 * x.to(projected.dtype).square().sum(-1) - 0.5 * math.log(self.nb_projection_rows)
        return Features(values, log_scale)


class ReluFeatureMap(RandomFeatureMap):
    """Generalised-kernel features of the Performer paper: ``phi(x) = relu(Wx) + eps``.

    ``eps`` (default 1e-3, as in the paper's code) keeps every feature positive.
    """

    name = "relu"

    def __init__(self, head_dim: int, nb_features: int = 256, *, feature_epsilon: float = 1e-3, **kwargs):
        super().__init__(head_dim, nb_features, **kwargs)
        self.feature_epsilon = feature_epsilon

    def features(self, x: torch.Tensor) -> Features:
        return Features(torch.relu(self.project(x)) + self.feature_epsilon, None)


class EluPlusOneFeatureMap(FeatureMap):
    """``phi(x) = elu(x) + 1`` (Katharopoulos et al. 2020): deterministic, ``m = d``."""

    name = "elu+1"

    def __init__(self, head_dim: int, nb_features: int | None = None):
        if nb_features is not None and nb_features != head_dim:
            raise ValueError(
                f"the elu+1 feature map has exactly head_dim={head_dim} features; got nb_features={nb_features}"
            )
        super().__init__(head_dim, head_dim)

    def features(self, x: torch.Tensor) -> Features:
        return Features(nn.functional.elu(x.to(compute_dtype_for(x))) + 1.0, None)


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

FEATURE_MAPS: dict[str, Callable[..., FeatureMap]] = {}


def register_feature_map(name: str, factory: Callable[..., FeatureMap]) -> None:
    """Make ``make_feature_map(name, head_dim, ...)`` build ``factory(head_dim, ...)``."""
    FEATURE_MAPS[name] = factory


for _cls in (FavorPlusFeatureMap, TrigFeatureMap, ReluFeatureMap, EluPlusOneFeatureMap, HedgehogFeatureMap,
             T2RFeatureMap):
    register_feature_map(_cls.name, _cls)


def make_feature_map(name: str, head_dim: int, nb_features: int | None = None, **kwargs) -> FeatureMap:
    """Build the feature map registered as ``name``.

    Args:
        name: one of ``available_feature_maps()`` (``"favor+"``, ``"trig"``, ``"relu"``, ``"elu+1"``,
            ``"hedgehog"``, ``"t2r"``).
        head_dim: ``d``.
        nb_features: ``m``; ``None`` takes the map's default (256 for random maps, ``d`` for elu+1).
        **kwargs: the map's options, e.g. ``orthogonal``, ``row_norms``, ``redraw_interval``, ``seed`` (random
            maps) or ``num_heads``, ``num_key_value_heads``, ``init``, ``tie_qk`` (learned maps).

    Raises:
        ValueError: for an unknown name.
        TypeError: for an option the map does not take, or a learned map without ``num_heads``.
    """
    if name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature map {name!r}; available: {', '.join(available_feature_maps())}")
    factory = FEATURE_MAPS[name]
    if isinstance(factory, type) and issubclass(factory, LearnedFeatureMap) and kwargs.get("num_heads") is None:
        raise TypeError(
            f"the learned feature map {name!r} has trainable parameters per attention head: pass num_heads=H (query "
            f"heads) and, for grouped-query attention, num_key_value_heads=Hkv, e.g. make_feature_map({name!r}, "
            f"{head_dim}, num_heads=12)"
        )
    if nb_features is not None:
        kwargs["nb_features"] = nb_features
    try:
        return factory(head_dim, **kwargs)
    except TypeError as error:
        raise TypeError(f"bad option for feature map {name!r}: {error}") from error


def default_feature_map_init(name: str) -> str | None:
    """The ``init`` a learned map registered as ``name`` takes when none is given; ``None`` for other maps."""
    return getattr(FEATURE_MAPS.get(name), "default_init", None)


def available_feature_maps() -> list[str]:
    return sorted(FEATURE_MAPS)


@contextlib.contextmanager
def no_redraw(feature_map: FeatureMap, active: bool):
    """Continuing a recurrent state needs exactly the features used before: no redraw, even in training."""
    if not active or not feature_map.training:
        yield
        return
    feature_map.train(False)
    try:
        yield
    finally:
        feature_map.train(True)
