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

This module imports only ``torch`` (and the torch-free :mod:`.favor_schema`): it is copied next to saved models for
``trust_remote_code``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, NamedTuple

import torch
from torch import nn

from .favor_schema import LEARNED_MAP_DEFAULT_INIT, LEARNED_MAP_INITS


class Features(NamedTuple):
    """Output of a feature map: ``phi(x) = values * exp(log_scale)[..., None]``.

    Attributes:
        values: ``[..., L, m]`` feature values (for exponential maps, at most 1).
        log_scale: ``[..., L]`` per-row log multiplier, or ``None`` when ``values`` is the whole map.
    """

    values: torch.Tensor
    log_scale: torch.Tensor | None


def compute_dtype_for(x: torch.Tensor) -> torch.dtype:
    """Feature maps and linear-attention sums run in float32, or float64 for float64 inputs."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class FeatureMap(nn.Module):
    """Base class of all feature maps.

    Args:
        head_dim: size ``d`` of the query/key vectors.
        nb_features: number ``m`` of features produced per vector.

    Subclasses implement :meth:`features`. Calling the module maps queries and keys together, so
    that both always use the same projection and a redraw happens at most once per attention call.

    Class attributes:
        name: the registry name (``"favor+"``, ...).
        is_positive: ``True`` when every feature is > 0, so denominators cannot vanish.
    """

    name: str = ""
    is_positive: bool = True

    def __init__(self, head_dim: int, nb_features: int):
        super().__init__()
        if head_dim <= 0 or nb_features <= 0:
            raise ValueError(f"head_dim and nb_features must be positive, got {head_dim} and {nb_features}")
        self.head_dim = head_dim
        self.nb_features = nb_features

    @classmethod
    def check_nb_features(cls, nb_features: int) -> None:
        """Raise ``ValueError`` if this map cannot produce ``nb_features`` features whatever the head size (e.g. an
        odd count for the sin/cos pairs of "trig"); lets a configuration be checked before any map is built."""

    def features(self, x: torch.Tensor) -> Features:
        """Map ``x`` ``[..., L, d]`` (already multiplied by ``sqrt(scaling)``) to :class:`Features`."""
        raise NotImplementedError

    def maybe_redraw(self) -> None:
        """Hook called once per attention call; random maps redraw their projection here."""

    def initial_tensors(self) -> dict[str, torch.Tensor]:
        """The values a fresh map of these settings starts from, by parameter / buffer name (on the CPU,
        deterministic for a seed). ``_init_weights`` copies them into tensors a checkpoint did not provide, so a
        model built on the meta device and then materialised gets the same values as one built directly."""
        return {}

    def features_vjp(self, x: torch.Tensor, values: torch.Tensor, grad_values: torch.Tensor) -> torch.Tensor:
        """Optional: the gradient with respect to ``x`` of ``sum(grad_values * values)``.

        ``values`` is ``features(x).values`` times any per-row constant (a stabiliser rescaling).
        Maps whose only inputs are ``x`` (no trainable parameters) may implement it to let the
        bidirectional kernel run a hand-written backward without storing autograd intermediates.
        """
        raise NotImplementedError

    def shifted_key_features(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """``phi(x) exp(-shift)`` ``[..., L, m]`` for a per-row ``shift`` ``[..., L]`` at least ``log_scale`` (a
        kernel's stabiliser, already known): the key features as a kernel uses them. Maps may override it with a
        cheaper form (FAVOR+: one exp); this one rescales :meth:`key_features`."""
        features = self.key_features(x)
        if features.log_scale is None:
            return features.values
        return features.values * torch.exp(features.log_scale - shift)[..., None]

    @property
    def has_features_vjp(self) -> bool:
        return type(self).features_vjp is not FeatureMap.features_vjp and not any(
            p.requires_grad for p in self.parameters()
        )

    def query_features(self, query: torch.Tensor) -> Features:
        """Features of queries ``[B, H, Lq, d]``; the same as :meth:`features` unless queries and keys have their
        own parameters (learned maps)."""
        return self.features(query)

    def key_features(self, key: torch.Tensor) -> Features:
        """Features of keys ``[B, Hkv, Lk, d]`` (see :meth:`query_features`)."""
        return self.features(key)

    def forward(self, query: torch.Tensor, key: torch.Tensor) -> tuple[Features, Features]:
        """Map queries ``[B, H, Lq, d]`` and keys ``[B, Hkv, Lk, d]`` (after one possible redraw)."""
        self.maybe_redraw()
        return self.query_features(query), self.key_features(key)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, nb_features={self.nb_features}"


# --------------------------------------------------------------------------------------------
# Random projections
# --------------------------------------------------------------------------------------------

PROJECTION_KINDS = ("orthogonal", "iid")
ROW_NORMS = ("chi", "fixed")


def gaussian_orthogonal_random_matrix(
    nb_rows: int,
    nb_columns: int,
    *,
    orthogonal: bool = True,
    row_norms: str = "chi",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw the ``[nb_rows, nb_columns]`` projection ``W`` of random-feature maps (float32, on the CPU,
    whatever the default device, so that a seed gives the same matrix everywhere).

    ``orthogonal=True`` stacks independent ``d x d`` blocks whose rows are orthonormal and uniformly
    (Haar) distributed: the QR factor ``Q`` of a Gaussian matrix is multiplied by ``sign(diag(R))``,
    without which it is not uniform. Rows are then rescaled so that their norms follow the chi
    distribution with ``d`` degrees of freedom (``row_norms="chi"``: each row is marginally
    ``N(0, I_d)``, so the estimator stays unbiased) or are all ``sqrt(d)`` (``row_norms="fixed"``).
    ``orthogonal=False`` returns iid ``N(0, I_d)`` rows.
    """
    if row_norms not in ROW_NORMS:
        raise ValueError(f"row_norms must be one of {ROW_NORMS}, got {row_norms!r}")
    d = nb_columns
    if not orthogonal:
        return torch.randn(nb_rows, d, generator=generator, dtype=torch.float64, device="cpu").float()
    blocks = []
    for _ in range(math.ceil(nb_rows / d)):
        gaussian = torch.randn(d, d, generator=generator, dtype=torch.float64, device="cpu")
        q, r = torch.linalg.qr(gaussian)
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)  # columns of q, sign-corrected
        blocks.append(q.T)
    directions = torch.cat(blocks, dim=0)[:nb_rows]
    if row_norms == "fixed":
        norms = torch.full((nb_rows,), math.sqrt(d), dtype=torch.float64, device="cpu")
    else:
        norms = torch.randn(nb_rows, d, generator=generator, dtype=torch.float64, device="cpu").norm(dim=1)
    return (directions * norms.unsqueeze(1)).float()


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
# Learned maps
# --------------------------------------------------------------------------------------------

class LearnedFeatureMap(FeatureMap):
    """A feature map with a trainable affine projection per head, ``z = x W_h + b_h`` (``W_h`` ``[d, p]``).

    Queries and keys have their own parameters (``query_weight`` ``[H, d, p]``, ``query_bias`` ``[H, p]``,
    ``key_weight`` ``[Hkv, d, p]``, ``key_bias`` ``[Hkv, p]``) unless ``tie_qk`` (keys then use the query ones); subclasses choose the
    activation (:meth:`activation`) and how ``m`` relates to ``p`` (:attr:`features_per_projection`).

    Args:
        head_dim: ``d``.
        nb_features: ``m`` features per vector; ``None`` takes the map's default (:meth:`default_nb_features`).
        num_heads: query heads ``H`` (each head has its own projection).
        num_key_value_heads: key heads ``Hkv`` (grouped-query attention); default ``num_heads``.
        init: ``"identity"`` (``W_h = I``, ``b_h = 0``; needs ``p == d``) or ``"favor+"`` (the orthogonal random
            projection FAVOR+ draws, chi row norms, one draw per head from ``seed``); ``None`` takes the map's
            :attr:`default_init`.
        tie_qk: queries and keys share one set of parameters (needs ``Hkv == H``).
        seed: seed of the ``"favor+"`` initialisation.

    The parameters are ordinary ``nn.Parameter`` s: they train with the model (or alone, by attention transfer),
    are saved in the state dict, and are kept in float32 by the converter.
    """

    features_per_projection = 1
    default_init = LEARNED_MAP_DEFAULT_INIT

    def __init__(
        self,
        head_dim: int,
        nb_features: int | None = None,
        *,
        num_heads: int,
        num_key_value_heads: int | None = None,
        init: str | None = None,
        tie_qk: bool = False,
        seed: int = 0,
    ):
        if nb_features is None:
            nb_features = self.default_nb_features(head_dim)
        if init is None:
            init = self.default_init
        super().__init__(head_dim, nb_features)
        num_key_value_heads = num_heads if num_key_value_heads is None else num_key_value_heads
        if num_heads <= 0 or num_key_value_heads <= 0 or num_heads % num_key_value_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a positive multiple of num_key_value_heads ({num_key_value_heads})"
            )
        self.check_nb_features(nb_features)
        if init not in LEARNED_MAP_INITS:
            raise ValueError(f"init must be one of {LEARNED_MAP_INITS}, got {init!r}")
        projection_size = nb_features // self.features_per_projection
        if init == "identity" and projection_size != head_dim:
            raise ValueError(
                f"init='identity' needs a square projection: nb_features={nb_features} gives {projection_size} "
                f"projections per head for head_dim={head_dim}; use nb_features={head_dim * self.features_per_projection} "
                "or init='favor+'"
            )
        if tie_qk and num_key_value_heads != num_heads:
            raise ValueError("tie_qk needs as many key heads as query heads (no grouped-query attention)")
        self.num_heads, self.num_key_value_heads = num_heads, num_key_value_heads
        self.projection_size, self.init, self.tie_qk, self.seed = projection_size, init, tie_qk, seed
        groups = num_heads // num_key_value_heads
        self.query_weight = nn.Parameter(self._initial_weight(num_key_value_heads, seed).repeat_interleave(groups, 0))
        self.query_bias = nn.Parameter(torch.zeros(num_heads, projection_size))
        if not tie_qk:
            # Key head g starts from the projection of the query heads it serves, so the untrained map is symmetric.
            self.key_weight = nn.Parameter(self._initial_weight(num_key_value_heads, seed))
            self.key_bias = nn.Parameter(torch.zeros(num_key_value_heads, projection_size))

    def initial_tensors(self) -> dict[str, torch.Tensor]:
        groups = self.num_heads // self.num_key_value_heads
        key_weight = self._initial_weight(self.num_key_value_heads, self.seed)
        initial = {"query_weight": key_weight.repeat_interleave(groups, 0),
                   "query_bias": torch.zeros(self.num_heads, self.projection_size)}
        if not self.tie_qk:
            initial.update(key_weight=key_weight, key_bias=torch.zeros(self.num_key_value_heads, self.projection_size))
        return initial

    @classmethod
    def default_nb_features(cls, head_dim: int) -> int:
        return head_dim * cls.features_per_projection

    @classmethod
    def check_nb_features(cls, nb_features: int) -> None:
        if nb_features % cls.features_per_projection:
            raise ValueError(
                f"the {cls.name!r} feature map needs nb_features divisible by {cls.features_per_projection}, "
                f"got {nb_features}"
            )

    def _initial_weight(self, heads: int, seed: int) -> torch.Tensor:
        """``[heads, d, p]`` initial projections, on the CPU (deterministic for a seed)."""
        if self.init == "identity":
            return torch.eye(self.head_dim).expand(heads, -1, -1).clone()
        generator = torch.Generator().manual_seed(seed)
        return torch.stack(
            [gaussian_orthogonal_random_matrix(self.projection_size, self.head_dim, generator=generator).T
             for _ in range(heads)]
        )

    def project(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``x W_h + b_h`` in the compute dtype: ``[B, heads, L, d] -> [B, heads, L, p]``."""
        heads = x.shape[-3] if x.dim() >= 3 else 0
        if heads != weight.shape[0]:
            raise ValueError(
                f"the {self.name} feature map has parameters for {weight.shape[0]} heads; got an input of shape "
                f"{tuple(x.shape)} (expected [batch, {weight.shape[0]}, length, {self.head_dim}])"
            )
        dtype = compute_dtype_for(x)
        return torch.matmul(x.to(dtype), weight.to(dtype)) + bias.to(dtype).unsqueeze(-2)

    def activation(self, projected: torch.Tensor) -> Features:
        """Features from the projection ``[..., L, p]``."""
        raise NotImplementedError

    def features(self, x: torch.Tensor) -> Features:
        """Query features (the query parameters); see :meth:`key_features` for keys."""
        return self.query_features(x)

    def query_features(self, query: torch.Tensor) -> Features:
        return self.activation(self.project(query, self.query_weight, self.query_bias))

    def key_features(self, key: torch.Tensor) -> Features:
        if self.tie_qk:
            return self.query_features(key)
        return self.activation(self.project(key, self.key_weight, self.key_bias))

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, num_heads={self.num_heads}, num_key_value_heads={self.num_key_value_heads}, "
            f"init={self.init}, tie_qk={self.tie_qk}"
        )


class HedgehogFeatureMap(LearnedFeatureMap):
    """Hedgehog features: ``phi(x) = [softmax(z), softmax(-z)]`` with ``z = x W_h + b_h`` (``m = 2p``).

    Each half is a softmax over the ``p`` projections, so features are positive and bounded (no stabiliser).
    ``init="favor+"`` (the default) makes the untrained map the self-normalised, antithetic FAVOR+ estimator
    (``softmax(Wx)_i = exp(w_i.x) / sum_j exp(w_j.x)``, whose denominator estimates ``p exp(|x|^2 / 2)``, the
    FAVOR+ correction); ``init="identity"`` is the Hedgehog / LoLCATs start. After the same attention transfer the
    FAVOR+ start fits better (MiniLM-L6 on STS-B, 768 steps, 64 features: dev Pearson 67.2 against 62.5 from
    the identity; ``benchmarks/results/recovery_stsb.json``), and it allows any ``nb_features``.
    """

    name = "hedgehog"
    features_per_projection = 2

    def activation(self, projected: torch.Tensor) -> Features:
        return Features(torch.cat([projected.softmax(-1), (-projected).softmax(-1)], dim=-1), None)


class T2RFeatureMap(LearnedFeatureMap):
    """T2R features: ``phi(x) = relu(x W_h + b_h) + eps`` (``m = p``; ``eps`` keeps features positive).

    ``init="favor+"`` (the default) starts from the Performer's generalised ReLU kernel on an orthogonal
    random projection.
    """

    name = "t2r"

    def __init__(self, head_dim: int, nb_features: int | None = None, *, feature_epsilon: float = 1e-3, **kwargs):
        super().__init__(head_dim, nb_features, **kwargs)
        self.feature_epsilon = feature_epsilon

    def activation(self, projected: torch.Tensor) -> Features:
        return Features(torch.relu(projected) + self.feature_epsilon, None)


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
