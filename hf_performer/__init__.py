"""hf-performer: FAVOR+ and linear attention for Hugging Face transformers.

The functional API::

    import hf_performer
    feature_map = hf_performer.make_feature_map("favor+", head_dim=64, nb_features=256)
    out = hf_performer.linear_attention(q, k, v, feature_map, causal=True)   # q, k, v: [B, H, L, d]
"""

from .feature_maps import (
    FeatureMap,
    Features,
    available_feature_maps,
    gaussian_orthogonal_random_matrix,
    make_feature_map,
    register_feature_map,
)
from .linear_attention import LinearAttentionError, LinearAttentionState, linear_attention

# Importing favor_attention registers attn_implementation="favor" (attention function and mask) in transformers.
from .cache import FavorCacheLayer, make_favor_cache
from .favor_attention import (
    FAVOR_DEFAULTS,
    FavorMaskError,
    attach_feature_maps,
    favor_attention_forward,
    favor_attention_mask,
    resolve_favor_settings,
)

# Importing modeling_performer registers PerformerConfig / Performer* with transformers' Auto classes.
from .configuration_performer import PerformerConfig, PerformerConfigError
from .modeling_performer import (
    PerformerForCausalLM,
    PerformerForMaskedLM,
    PerformerForSequenceClassification,
    PerformerForTokenClassification,
    PerformerModel,
    PerformerPreTrainedModel,
)

__version__ = "0.1.0"

__all__ = [
    "PerformerConfig",
    "PerformerConfigError",
    "PerformerForCausalLM",
    "PerformerForMaskedLM",
    "PerformerForSequenceClassification",
    "PerformerForTokenClassification",
    "PerformerModel",
    "PerformerPreTrainedModel",
    "FAVOR_DEFAULTS",
    "FavorCacheLayer",
    "FavorMaskError",
    "FeatureMap",
    "Features",
    "LinearAttentionError",
    "LinearAttentionState",
    "attach_feature_maps",
    "available_feature_maps",
    "favor_attention_forward",
    "favor_attention_mask",
    "gaussian_orthogonal_random_matrix",
    "linear_attention",
    "make_favor_cache",
    "make_feature_map",
    "register_feature_map",
    "resolve_favor_settings",
]
