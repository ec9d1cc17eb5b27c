"""Learned feature maps: a trainable affine projection per head, separate for queries and keys, trained to mimic
softmax by attention transfer (``hf_performer.conversion.attention_transfer``):

* ``hedgehog`` (Zhang et al. 2024, "The Hedgehog & the Porcupine"; LoLCATs 2024):
  ``phi(x) = [softmax(x W + b), softmax(-(x W + b))]`` over the feature dimension.
* ``t2r`` (Kasai et al. 2021, "Finetuning Pretrained Transformers into RNNs"): ``phi(x) = relu(x W + b) + eps``.

Registered in :mod:`.feature_maps`. This module imports only ``torch`` (and the torch-free :mod:`.favor_schema`): it
is copied next to saved models for ``trust_remote_code``.
"""

from __future__ import annotations

import torch
from torch import nn

from .favor_schema import LEARNED_MAP_DEFAULT_INIT, LEARNED_MAP_INITS
from .feature_map_base import FeatureMap, Features, compute_dtype_for, gaussian_orthogonal_random_matrix


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
