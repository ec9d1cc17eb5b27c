"""What every feature map is (:class:`FeatureMap`, its :class:`Features`), the dtype its sums run in, and the random
projections that random maps draw and learned maps may start from (:func:`gaussian_orthogonal_random_matrix`).
:mod:`.feature_maps` holds the random maps and the registry; :mod:`.feature_maps_learned` the learned ones.

This module imports only ``torch``: it is copied next to saved models for ``trust_remote_code``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn


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
