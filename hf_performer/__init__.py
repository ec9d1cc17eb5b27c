"""hf-performer: FAVOR+ and linear attention for Hugging Face transformers.

The functional API::

    import hf_performer
    feature_map = hf_performer.make_feature_map("favor+", head_dim=64, nb_features=256)
    out = hf_performer.linear_attention(q, k, v, feature_map, causal=True)   # q, k, v: [B, H, L, d]
"""

import importlib
import os
import sys

# The public names by the runtime module that defines them. Importing favor_attention registers
# attn_implementation="favor" (attention function and mask) in transformers; importing modeling_performer registers
# PerformerConfig / Performer* with transformers' Auto classes.
_PUBLIC_NAMES = {
    "feature_maps": ("FeatureMap", "Features", "available_feature_maps", "gaussian_orthogonal_random_matrix",
                     "make_feature_map", "register_feature_map"),
    "linear_attention": ("LinearAttentionError", "LinearAttentionState", "linear_attention"),
    "window_attention": ("SoftmaxWeight", "TailGate", "WindowAttentionState", "window_linear_attention"),
    "clustered_attention": ("ClusteredAttentionError", "cluster_queries", "clustered_attention",
                            "improved_clustered_attention"),
    "favor_settings": ("FAVOR_DEFAULTS", "layer_window", "resolve_favor_settings", "softmax_weight_mode"),
    "cache": ("FavorCacheLayer", "WindowCacheLayer", "make_favor_cache"),
    "favor_attention": ("FavorMaskError", "attach_feature_maps", "favor_attention_forward", "favor_attention_mask"),
    "configuration_performer": ("PerformerConfig", "PerformerConfigError"),
    "modeling_performer": ("PerformerForCausalLM", "PerformerForMaskedLM", "PerformerForSequenceClassification",
                           "PerformerForTokenClassification", "PerformerModel", "PerformerPreTrainedModel"),
}


def import_runtime() -> None:
    """Import the runtime (torch, transformers) and bind the public names; registers "favor" and the Auto classes."""
    for module_name, names in _PUBLIC_NAMES.items():
        module = importlib.import_module(f".{module_name}", __name__)
        globals().update({name: getattr(module, name) for name in names})


def _started_by_console_script() -> bool:
    """Whether this process is the ``hf-performer`` console script, which imports this package before its ``main``
    runs: the command line imports the runtime only for the verb it runs, so ``hf-performer --help`` stays fast."""
    script = os.path.basename((getattr(sys, "argv", None) or [""])[0])
    return script.removesuffix(".exe").removesuffix("-script.py") == "hf-performer"


# Product entry points of subpackages, imported on first use (the runtime never imports a subpackage).
_LAZY_NAMES = {
    "convert_to_performer": "hf_performer.conversion.convert",
    "fidelity_report": "hf_performer.conversion.fidelity",
    "transfer_attention": "hf_performer.conversion.attention_transfer",
}


def __getattr__(name: str):
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    if any(name in names for names in _PUBLIC_NAMES.values()):  # the console script imports the runtime lazily
        import_runtime()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not _started_by_console_script():
    import_runtime()

__version__ = "0.1.0"

__all__ = [
    "convert_to_performer",
    "fidelity_report",
    "transfer_attention",
    "PerformerConfig",
    "PerformerConfigError",
    "PerformerForCausalLM",
    "PerformerForMaskedLM",
    "PerformerForSequenceClassification",
    "PerformerForTokenClassification",
    "PerformerModel",
    "PerformerPreTrainedModel",
    "FAVOR_DEFAULTS",
    "ClusteredAttentionError",
    "FavorCacheLayer",
    "FavorMaskError",
    "FeatureMap",
    "Features",
    "LinearAttentionError",
    "LinearAttentionState",
    "SoftmaxWeight",
    "TailGate",
    "WindowAttentionState",
    "WindowCacheLayer",
    "attach_feature_maps",
    "available_feature_maps",
    "cluster_queries",
    "clustered_attention",
    "favor_attention_forward",
    "favor_attention_mask",
    "gaussian_orthogonal_random_matrix",
    "improved_clustered_attention",
    "linear_attention",
    "make_favor_cache",
    "make_feature_map",
    "layer_window",
    "register_feature_map",
    "resolve_favor_settings",
    "softmax_weight_mode",
    "window_linear_attention",
]
