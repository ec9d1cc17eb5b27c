"""The recipes' command line: the one module of :mod:`hf_performer.recipes` that uses argparse.

:func:`build_parser` declares the flags of ``recipes/text_classification.py`` and ``recipes/causal_lm.py``;
:func:`recipe_command` rebuilds a run's command line from the arguments its ``metrics.json`` recorded (the only
walk over the parser's actions). The favor flags come from their one declaration,
:func:`hf_performer.cli.arguments.add_favor_arguments` (the one import of ``cli`` from below it: that module is a
leaf). Nothing here imports torch at module level (``--help`` stays fast).
"""

from __future__ import annotations

import argparse
import ast
import shlex

LORA_TARGET_MODULES: dict[str, list[str]] = {
    "bert": ["query", "key", "value"],
    "roberta": ["query", "key", "value"],
    "xlm-roberta": ["query", "key", "value"],
    "electra": ["query", "key", "value"],
    "distilbert": ["q_lin", "k_lin", "v_lin"],
    "gpt2": ["c_attn"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
"""Default LoRA target modules by source ``model_type`` (the attention projections); ``--lora-target-modules``
overrides them."""

KINDS = ("text-classification", "causal-lm")
"""The recipe kinds, one per script: ``recipes/text_classification.py`` and ``recipes/causal_lm.py``."""

SCRIPTS = {"text-classification": "recipes/text_classification.py", "causal-lm": "recipes/causal_lm.py"}


class RecipeError(ValueError):
    """Recipe options that do not fit together or a model that cannot be trained as asked."""


# --------------------------------------------------------------------------------------------
# The recipe scripts
# --------------------------------------------------------------------------------------------


def build_parser(kind: str) -> argparse.ArgumentParser:
    """The argument parser of the recipe ``kind`` (``"text-classification"`` or ``"causal-lm"``)."""
    from ..cli.arguments import add_favor_arguments
    from ..favor_schema import FAVOR_DEFAULTS
    from ..tasks.data import LM_DATASETS

    if kind not in KINDS:
        raise RecipeError(f"unknown recipe kind {kind!r}; accepted: {KINDS}")
    script = "text_classification.py" if kind == "text-classification" else "causal_lm.py"
    parser = argparse.ArgumentParser(
        prog=f"recipes/{script}",
        description=(
            "Fine-tune a Performer (FAVOR+) model, or a softmax baseline, with Accelerate. "
            "Run with `accelerate launch recipes/" + script + " ...` or `python recipes/" + script + " ...`. "
            "See recipes/README.md."
        ),
    )
    model = parser.add_argument_group("model")
    model.add_argument("--model", required=True,
                       help="model folder (or offline Hub name): a Performer folder, or a softmax model to convert")
    model.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --model)")
    model.add_argument("--attention", choices=("favor", "softmax"), default="favor",
                       help="favor: train FAVOR+ attention (default); softmax: train the softmax model as it is "
                            "(baselines)")
    model.add_argument("--convert", action=argparse.BooleanOptionalAction, default=None,
                       help="convert a softmax --model to FAVOR+ before training (default: yes for a softmax "
                            "model with --attention favor; a Performer folder is never converted)")
    add_favor_arguments(model, ("feature_map", "nb_features", "softmax_layers", "seed"),
                        defaults={"feature_map": FAVOR_DEFAULTS["feature_map"]}, help_prefix="conversion: ")
    add_favor_arguments(model, ("redraw_interval",), helps={
        "redraw_interval": "training attention calls between projection redraws (0 = never); sets the converted or "
                           "loaded Performer model's favor_settings (default: keep the model's, 0 on conversion)"})
    model.add_argument("--max-position-embeddings", type=int, default=None,
                       help="conversion: extend the learned position table to N positions (long inputs)")
    model.add_argument("--lora", action="store_true", help="train LoRA adapters (PEFT) instead of all weights")
    model.add_argument("--lora-r", type=int, default=8, help="LoRA rank (default: 8)")
    model.add_argument("--lora-alpha", type=int, default=16, help="LoRA alpha (default: 16)")
    model.add_argument("--lora-dropout", type=float, default=0.05, help="LoRA dropout (default: 0.05)")
    model.add_argument("--lora-target-modules", nargs="+", default=None,
                       help="module names to adapt (default: the attention projections of the architecture: "
                            + "; ".join(f"{k}: {' '.join(v)}" for k, v in LORA_TARGET_MODULES.items()) + ")")

    data = parser.add_argument_group("data")
    if kind == "text-classification":
        data.add_argument("--task", required=True,
                          help="cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli or imdb")
        data.add_argument("--train-file", default=None,
                          help="local training file (TSV/CSV/JSON lines, .gz ok); default: the Hub's train split")
        data.add_argument("--validation-file", default=None,
                          help="local validation file; default: the Hub's validation split (IMDB: test)")
        data.add_argument("--max-length", type=int, default=128, help="tokens per example (default: 128)")
        data.add_argument("--metrics-backend", choices=("auto", "evaluate", "local"), default="auto",
                          help="task metrics from `evaluate` (needs the Hub), local scikit-learn/scipy, or auto")
    else:
        data.add_argument("--dataset", default="wikitext",
                          help=f"Hub text dataset when no files are given ({', '.join(LM_DATASETS)}, or any name "
                               "with a 'text' column; default: wikitext = wikitext-2-raw-v1)")
        data.add_argument("--dataset-config", default=None, help="Hub dataset configuration")
        data.add_argument("--train-file", default=None, help="raw training text file (default: the Hub train split)")
        data.add_argument("--validation-file", default=None,
                          help="raw validation text file (default: the Hub validation split)")
        data.add_argument("--block-size", type=int, default=256, help="training tokens per example (default: 256)")
        data.add_argument("--max-train-chars", type=int, default=None, help="use the first N characters of the "
                          "training text")
        data.add_argument("--max-eval-chars", type=int, default=None, help="use the first N characters of the "
                          "validation text")
        data.add_argument("--context-length", type=int, default=None,
                          help="perplexity: tokens per window (default: --block-size)")
        data.add_argument("--stride", type=int, default=None,
                          help="perplexity: tokens between window starts (default: context length / 2)")
    data.add_argument("--max-train-samples", type=int, default=None,
                      help="train on a seeded random subset of N examples (blocks for causal LM)")
    data.add_argument("--max-eval-samples", type=int, default=None,
                      help="evaluate on a seeded random subset of N examples (classification)")

    if kind == "causal-lm":
        parser.add_argument("--window-dropout", type=float, default=0.0, metavar="P",
                            help="window hybrids with a linear tail: at each training forward every window layer "
                                 "attends to its sinks and tail only with probability p, decaying linearly from P to "
                                 "0 over the run (scheduled sliding-window dropout, arXiv 2510.05901; default: 0, off)")
    teacher = parser.add_argument_group("distillation (knowledge distillation from a teacher model)")
    teacher.add_argument("--teacher-model", default=None, metavar="DIR",
                         help="a model with the same tokenizer (and task), e.g. the softmax model --model was "
                              "converted from: its predictions on every training batch are a second target, added "
                              "to the task loss (default: none)")
    teacher.add_argument("--distillation-weight", type=float, default=None,
                         help="weight of the teacher term (default: 1.0)")
    teacher.add_argument("--distillation-temperature", type=float, default=None,
                         help="softmax temperature T of the T^2 KL term over the labels (classification) or the "
                              "vocabulary at every position (causal LM) (default: 2.0); regression tasks match the "
                              "predictions by mean squared error")

    training = parser.add_argument_group("training")
    training.add_argument("--output-dir", required=True, help="folder for the model, metrics and checkpoints")
    training.add_argument("--seed", type=int, default=42, help="seed of everything: init, data order, dropout")
    training.add_argument("--learning-rate", type=float, default=5e-5, help="peak learning rate (default: 5e-5)")
    training.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default: 0.01)")
    training.add_argument("--lr-scheduler", default="linear",
                          choices=("linear", "cosine", "constant", "constant_with_warmup", "polynomial"),
                          help="learning-rate schedule after warmup (default: linear decay to 0)")
    training.add_argument("--warmup-ratio", type=float, default=0.06,
                          help="fraction of the optimizer steps spent warming up (default: 0.06)")
    training.add_argument("--warmup-steps", type=int, default=None, help="warmup steps (overrides --warmup-ratio)")
    training.add_argument("--per-device-train-batch-size", type=int, default=32, help="default: 32")
    training.add_argument("--per-device-eval-batch-size", type=int, default=64, help="default: 64")
    training.add_argument("--gradient-accumulation-steps", type=int, default=1,
                          help="micro-batches per optimizer step (default: 1)")
    training.add_argument("--num-train-epochs", type=float, default=3.0, help="default: 3")
    training.add_argument("--max-train-steps", type=int, default=None,
                          help="optimizer steps in all (overrides --num-train-epochs)")
    training.add_argument("--time-limit", type=float, default=None, metavar="MINUTES",
                          help="stop training after MINUTES of wall time (the run is then evaluated and saved as "
                               "usual; metrics.json records the steps done and why it stopped)")
    training.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: none)")
    training.add_argument("--mixed-precision", choices=("no", "fp16", "bf16"), default=None,
                          help="mixed precision through Accelerate (default: the accelerate config's, else no)")
    training.add_argument("--eval-steps", type=int, default=None,
                          help="evaluate every N optimizer steps (default: only at the end)")
    training.add_argument("--no-evaluation", action="store_true",
                          help="train only: read no validation data and evaluate nothing (metrics.json has no final "
                               "metrics), for a caller that evaluates the saved model itself (hf-performer linearize)")
    training.add_argument("--logging-steps", type=int, default=10, help="log the training loss every N steps")
    training.add_argument("--early-stopping-split", type=float, default=None, metavar="FRACTION",
                          help="carve this fraction of the training examples (seeded by --seed) as a held-out split, "
                               "evaluated with the validation split at every evaluation; --load-best-model-at-end "
                               "and --early-stopping-patience select on it, never on the reported validation split")
    training.add_argument("--metric-for-best-model", default=None, metavar="METRIC",
                          help="held-out metric that decides the best step: a metric of the task or eval_loss "
                               "(default: the task's main metric, metrics.json's main_metric: MRPC and QQP f1, STS-B "
                               "pearson, CoLA matthews_correlation, the others accuracy; perplexity for causal LM); "
                               "losses and perplexity are better lower, the others higher")
    training.add_argument("--load-best-model-at-end", action="store_true",
                          help="save and report the model of the evaluation step with the best held-out metric "
                               "instead of the last step (needs --early-stopping-split and --eval-steps)")
    training.add_argument("--early-stopping-patience", type=int, default=None, metavar="N",
                          help="stop after N evaluations without improvement of the held-out metric (needs "
                               "--early-stopping-split and --eval-steps)")
    training.add_argument("--checkpointing-steps", type=int, default=None,
                          help="save a resumable checkpoint every N optimizer steps in OUTPUT_DIR/checkpoints/")
    training.add_argument("--resume-from-checkpoint", default=None, metavar="DIR|latest",
                          help="continue a run from a checkpoint folder, or the latest one in OUTPUT_DIR/checkpoints "
                               "(with the run's flags: a checkpoint of different data-order or training flags is "
                               "refused)")
    training.add_argument("--overwrite", action="store_true",
                          help="train into a non-empty OUTPUT_DIR: the previous run's checkpoints, metrics and logs "
                               "are deleted first (without it a used folder is refused)")
    training.add_argument("--report-to", choices=("none", "tensorboard"), default="none",
                          help="none (default, as transformers' Trainer) or TensorBoard logs in OUTPUT_DIR/runs "
                               "(needs `pip install tensorboard`)")
    training.add_argument("--no-progress", action="store_true", help="no training progress bar")
    training.add_argument("--num-workers", type=int, default=0, help="dataloader workers (default: 0)")
    training.add_argument("--no-save-model", action="store_true", help="do not save the final model folder")
    parser.set_defaults(kind=kind)
    return parser

def recorded_value(value):
    """A recorded argument read back: the recipe stores ``None`` as the string ``"None"`` in ``args``."""
    return None if value in (None, "None") else value


def recipe_command(metrics: dict) -> str | None:
    """The recipe command line that reproduces a training run, rebuilt from its recorded ``args`` (the options
    that differ from the recipe's defaults, plus the required ones and the seed). ``None`` if it cannot be rebuilt.

    Args:
        metrics: a recipe's ``metrics.json`` (``args`` as :func:`hf_performer.recipes.results.recorded_args`
            writes them: scalars, other values as strings; ``kind``, ``num_processes``).
    """
    try:
        args = metrics["args"]
        kind = args.get("kind", metrics.get("kind", "text-classification"))
        parser = build_parser(kind)
    except Exception:  # noqa: BLE001 - a record from another version: no command rather than no results
        return None
    launcher = "accelerate launch" if (metrics.get("num_processes") or 1) > 1 else "python"
    parts = [launcher, SCRIPTS[kind]]
    for action in parser._actions:  # noqa: SLF001 - argparse offers no public list
        if not action.option_strings or action.dest not in args:
            continue
        value = args[action.dest]
        default = action.default if isinstance(action.default, (int, float, str, bool)) else str(action.default)
        if value == default and not action.required and action.dest != "seed":
            continue
        option = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            if value in (True, "True"):
                parts.append(option)
            elif value in (False, "False"):
                parts.append("--no-" + option[2:])
        elif action.nargs == 0:  # store_true
            if value in (True, "True"):
                parts.append(option)
        elif recorded_value(value) is None:
            continue
        elif action.nargs in ("+", "*"):
            items = ast.literal_eval(value) if isinstance(value, str) else value
            if items:
                parts.append(option)
                parts.extend(shlex.quote(str(item)) for item in items)
        else:
            parts.extend([option, shlex.quote(str(value))])
    return " ".join(parts)
