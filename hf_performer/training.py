"""Fine-tuning recipes over the library: an Accelerate training loop for text classification and causal LMs.

The scripts ``recipes/text_classification.py`` and ``recipes/causal_lm.py`` call :func:`main` with their
kind; everything they do lives here. Run them with ``accelerate launch`` (multi-GPU / multi-node, DDP, FSDP,
DeepSpeed through the configs in ``recipes/configs/``), plain ``python`` (one process, CPU or one GPU), or
``ACCELERATE_USE_CPU=true torchrun --nproc_per_node N`` (DDP on CPU processes, gloo; ``accelerate launch --cpu
--num_processes N`` starts one process only). The number of processes is printed at the start.

Stages of :func:`train`:

1. **Model.** ``--model`` is a Performer folder (trained as it is), or a softmax model folder that is
   converted on the fly (``--convert``, the default for softmax folders with ``--attention favor``) with the
   FAVOR+ options (``--feature-map``, ``--nb-features``, ``--keep-softmax-layers``, ``--redraw-interval``, ...),
   or a softmax model trained as softmax (``--attention softmax``: the baselines). ``--lora`` wraps it with
   PEFT LoRA on the attention projections (:data:`LORA_TARGET_MODULES`).
2. **Data.** :mod:`hf_performer.tasks.data`: the Hub or local files, seeded subsets, tokenisation. The training
   order comes from :class:`EpochSeededSampler` (permutation of epoch ``e`` drawn from ``seed + e``), so it
   is known without any saved state.
3. **Loop.** AdamW, linear (or other) schedule with warmup, gradient accumulation and mixed precision
   through Accelerate, gradient clipping, evaluation every ``--eval-steps`` optimizer steps and at the end
   (the curve goes to ``eval_curve.json``), TensorBoard logging (``--report-to tensorboard``, off by default:
   tensorboard is not a dependency), tqdm bars.
   FAVOR+ projections are redrawn during training every ``redraw_interval`` attention calls, per the model's
   ``favor_settings`` (the counters live in the state dict, so checkpoints carry them).
   With ``--early-stopping-split F`` a seeded fraction of the training examples is held out and evaluated too;
   :class:`BestStepSelection` follows ``--metric-for-best-model`` on it, stops after
   ``--early-stopping-patience`` evaluations without improvement and, with ``--load-best-model-at-end``,
   keeps the weights of the best step (saved and reported instead of the last step's).
4. **Checkpoints.** Every ``--checkpointing-steps`` optimizer steps: ``accelerator.save_state`` (model,
   optimizer, scheduler, grad scaler, RNG states) plus ``training_state.json`` (steps, epoch, batches of the
   epoch already consumed, the evaluation curve so far, the run's :func:`run_flags`). A used output folder needs
   ``--overwrite`` (which deletes the previous run's checkpoints and metrics first), and a checkpoint is only
   resumed with the flags it recorded. ``--resume-from-checkpoint DIR|latest`` reloads
   them and skips the consumed batches of the epoch (``accelerate.skip_first_batches``): the resumed run
   continues exactly where the interrupted one stopped and ends with the same weights and metrics.
5. **Output.** The final model folder (``save_pretrained``: Performer folders keep their code and
   ``auto_map``; a LoRA model is merged first and its adapter saved in ``adapter/``), the tokenizer,
   ``metrics.json`` and ``eval_curve.json``.

Extension point (attention distillation): :func:`train` takes ``loss_hooks``, callables
``hook(model, batch, outputs, step) -> torch.Tensor | None`` whose returned tensors are added to the task
loss before the backward pass. The recipes pass none; an attention-distillation term (matching the
source softmax model's attention outputs) would be such a hook and needs no change to the loop.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence

import torch
from torch.utils.data import DataLoader, Sampler

from .tasks.data import DataError, LM_DATASETS, get_task


KINDS = ("text-classification", "causal-lm")

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

CHECKPOINT_PREFIX = "step_"
TRAINING_STATE_FILE = "training_state.json"
BEST_WEIGHTS_FILE = "best_weights.pt"

METRICS_FILE_NAME = "metrics.json"
"""Written at the end of a run into the output folder: ``kind`` (``text-classification`` or ``causal-lm``), ``task``,
``final`` (the final metrics), ``completed_steps``, ``args``, ... It marks a fine-tuned model; the model card reads
its results (:func:`hf_performer.hub.load_metrics`)."""
EVAL_CURVE_FILE_NAME = "eval_curve.json"
"""Written next to :data:`METRICS_FILE_NAME`: the evaluations during the run."""

RUN_OUTPUTS = ("checkpoints", "runs", "adapter", METRICS_FILE_NAME, EVAL_CURVE_FILE_NAME)
"""What ``--overwrite`` deletes from a used output folder before training (the model files are replaced by the
new run's)."""

RESUMABLE_CHANGES = (
    "output_dir", "resume_from_checkpoint", "overwrite", "eval_steps", "logging_steps", "checkpointing_steps",
    "report_to", "num_workers", "per_device_eval_batch_size", "no_save_model", "metrics_backend", "validation_file",
    "max_eval_samples", "max_eval_chars", "context_length", "stride",
)
"""Arguments a resumed run may change (logging, evaluation and output only); every other argument, and the
number of processes, must be those recorded in the checkpoint (they decide the data order and the training)."""

LossHook = Callable[[torch.nn.Module, dict, object, int], "torch.Tensor | None"]


class RecipeError(ValueError):
    """Recipe options that do not fit together or a model that cannot be trained as asked."""


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


def build_parser(kind: str) -> argparse.ArgumentParser:
    """The argument parser of the recipe ``kind`` (``"text-classification"`` or ``"causal-lm"``)."""
    from .favor_settings import FAVOR_DEFAULTS
    from .feature_maps import available_feature_maps

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
    model.add_argument("--feature-map", choices=available_feature_maps(), default=FAVOR_DEFAULTS["feature_map"],
                       help="conversion: feature map (default: %(default)s)")
    model.add_argument("--nb-features", type=int, default=None,
                       help=f"conversion: random features per head (default: {FAVOR_DEFAULTS['nb_features']})")
    model.add_argument("--keep-softmax-layers", type=int, nargs="+", default=[], metavar="LAYER",
                       help="conversion: layers that keep exact softmax attention")
    model.add_argument("--favor-seed", type=int, default=None, help="conversion: seed of the projections")
    model.add_argument("--redraw-interval", type=int, default=None,
                       help="training attention calls between projection redraws (0 = never); sets the converted "
                            "or loaded Performer model's favor_settings (default: keep the model's, 0 on conversion)")
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
    training.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: none)")
    training.add_argument("--mixed-precision", choices=("no", "fp16", "bf16"), default=None,
                          help="mixed precision through Accelerate (default: the accelerate config's, else no)")
    training.add_argument("--eval-steps", type=int, default=None,
                          help="evaluate every N optimizer steps (default: only at the end)")
    training.add_argument("--logging-steps", type=int, default=10, help="log the training loss every N steps")
    training.add_argument("--early-stopping-split", type=float, default=None, metavar="FRACTION",
                          help="carve this fraction of the training examples (seeded by --seed) as a held-out split, "
                               "evaluated with the validation split at every evaluation; --load-best-model-at-end "
                               "and --early-stopping-patience select on it, never on the reported validation split")
    training.add_argument("--metric-for-best-model", default=None, metavar="METRIC",
                          help="held-out metric that decides the best step: a metric of the task or eval_loss "
                               "(default: the task's main metric; perplexity for causal LM); losses and perplexity "
                               "are better lower, the others higher")
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
    training.add_argument("--num-workers", type=int, default=0, help="dataloader workers (default: 0)")
    training.add_argument("--no-save-model", action="store_true", help="do not save the final model folder")
    parser.set_defaults(kind=kind)
    return parser


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def _is_performer_folder(name_or_path: str) -> bool:
    from transformers import AutoConfig

    from . import modeling_performer  # noqa: F401 - registers model_type "performer"

    try:
        return AutoConfig.from_pretrained(name_or_path).model_type == "performer"
    except (OSError, ValueError) as error:
        raise RecipeError(f"cannot load a model configuration from --model {name_or_path!r}: {error}") from None


def set_redraw_interval(model, interval: int) -> int:
    """Set the redraw interval of every random feature map of ``model`` and of its ``favor_settings``.

    Returns:
        How many feature maps were updated.
    """
    from .feature_maps import RandomFeatureMap

    if interval < 0:
        raise RecipeError(f"--redraw-interval must be >= 0, got {interval}")
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "model_type", None) == "performer":
        config.redraw_interval = interval
    updated = 0
    for module in model.modules():
        if isinstance(module, RandomFeatureMap):
            module.redraw_interval = interval
            updated += 1
    return updated


def load_model(args: argparse.Namespace, num_labels: int | None = None, id2label: dict | None = None,
               problem_type: str | None = None):
    """The model to train and a description of how it was obtained.

    Args:
        args: the recipe arguments (``--model``, ``--attention``, ``--convert``, FAVOR+ options).
        num_labels, id2label, problem_type: classification head (``None`` for causal LM).

    Returns:
        ``(model, info)`` with ``info = {"source", "attention", "converted", "favor_settings"}``.

    Raises:
        RecipeError: inconsistent options (``--attention softmax`` on a Performer folder, ``--no-convert`` on a
            softmax model with ``--attention favor``, ``--convert`` on a Performer folder).
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from .conversion import ConversionError, convert_to_performer, load_source

    task = "causal-lm" if args.kind == "causal-lm" else "sequence-classification"
    head_kwargs = {}
    if num_labels is not None:
        head_kwargs = dict(num_labels=num_labels, id2label=id2label,
                           label2id={v: k for k, v in (id2label or {}).items()}, problem_type=problem_type)
    performer_folder = _is_performer_folder(args.model)
    if performer_folder:
        if args.attention == "softmax":
            raise RecipeError(f"{args.model} is a Performer (FAVOR+) folder; --attention softmax needs a softmax model")
        if args.convert:
            raise RecipeError(f"{args.model} is already a Performer folder: --convert does not apply")
        auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
        model = auto.from_pretrained(args.model, **head_kwargs)
        converted = False
    else:
        convert = args.convert if args.convert is not None else args.attention == "favor"
        if args.attention == "favor" and not convert:
            raise RecipeError(f"{args.model} is a softmax model: --attention favor needs --convert (the default)")
        if args.attention == "softmax" and convert:
            raise RecipeError("--attention softmax trains the softmax model: --convert does not apply")
        try:
            source, _ = load_source(args.model, task, **head_kwargs)
            if convert:
                model = convert_to_performer(
                    source, task=task, feature_map=args.feature_map, nb_features=args.nb_features,
                    keep_softmax_layers=args.keep_softmax_layers,
                    max_position_embeddings=args.max_position_embeddings, seed=args.favor_seed,
                    redraw_interval=args.redraw_interval,
                )
            else:
                model = source
        except ConversionError as error:
            raise RecipeError(str(error)) from None
        converted = convert
    is_performer = getattr(model.config, "model_type", None) == "performer"
    if args.redraw_interval is not None:
        if not is_performer:
            raise RecipeError("--redraw-interval applies to FAVOR+ models, not to --attention softmax")
        set_redraw_interval(model, args.redraw_interval)
    if num_labels is not None and problem_type is not None:
        model.config.problem_type = problem_type
    info = {
        "source": args.model,
        "attention": "favor" if is_performer else "softmax",
        "converted": converted,
        "favor_settings": dict(model.config.resolved_favor_settings) if is_performer else None,
    }
    return model.train(), info


def apply_lora(model, args: argparse.Namespace):
    """Wrap ``model`` with PEFT LoRA adapters on its attention projections (see :data:`LORA_TARGET_MODULES`).

    Only the adapters (and, for classification, the newly initialised head) are trainable.
    """
    from peft import LoraConfig, TaskType, get_peft_model

    config = model.config
    model_type = config.source_config.model_type if config.model_type == "performer" else config.model_type
    targets = args.lora_target_modules or LORA_TARGET_MODULES.get(model_type)
    if not targets:
        raise RecipeError(
            f"no default LoRA target modules for model type {model_type!r} (known: {sorted(LORA_TARGET_MODULES)}); "
            "pass --lora-target-modules"
        )
    task_type = TaskType.CAUSAL_LM if args.kind == "causal-lm" else TaskType.SEQ_CLS
    lora_config = LoraConfig(task_type=task_type, r=args.lora_r, lora_alpha=args.lora_alpha,
                             lora_dropout=args.lora_dropout, target_modules=targets,
                             fan_in_fan_out=model_type == "gpt2")
    return get_peft_model(model, lora_config)


# --------------------------------------------------------------------------------------------
# Data order
# --------------------------------------------------------------------------------------------


class EpochSeededSampler(Sampler[int]):
    """A random permutation per epoch, drawn from ``seed + epoch`` alone: the order of any epoch is known
    without saved state (what exact resumption needs). Accelerate calls :meth:`set_epoch` before each
    epoch (``DataLoaderShard.set_epoch``); with several processes, Accelerate shards its batches."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples = num_samples
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.num_samples, generator=generator).tolist())

    def __len__(self) -> int:
        return self.num_samples


def _dataloader(dataset, batch_size: int, collate_fn, sampler=None, num_workers: int = 0, seed: int = 0):
    # A private generator: creating an iterator must not consume the global torch RNG (dropout), or a resumed
    # run would diverge from the uninterrupted one.
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      num_workers=num_workers, generator=torch.Generator().manual_seed(seed))


def carve_early_stopping_split(dataset, fraction: float, seed: int):
    """Split ``dataset`` (the training examples) into ``(train, held_out)``: ``round(fraction * n)`` examples
    drawn with ``numpy.random.default_rng(seed)`` are held out, both parts keep the dataset's order.

    Raises:
        RecipeError: a fraction that leaves either part empty.
    """
    import numpy as np

    total = len(dataset)
    held_out = round(fraction * total)
    if not 1 <= held_out < total:
        raise RecipeError(f"--early-stopping-split {fraction} of {total} training examples holds out {held_out}: "
                          "both the held-out and the training part need at least one example")
    order = np.random.default_rng(seed).permutation(total)
    return dataset.select(np.sort(order[held_out:]).tolist()), dataset.select(np.sort(order[:held_out]).tolist())


class BestStepSelection:
    """The best evaluation step on the held-out split (``--metric-for-best-model``), the evaluations since it
    improved (early stopping), and, when ``keep_weights``, a CPU copy of the weights of that step."""

    def __init__(self, metric: str, patience: int | None, keep_weights: bool):
        self.metric = metric
        self.greater_is_better = metric not in ("eval_loss", "perplexity")
        self.patience = patience
        self.keep_weights = keep_weights
        self.best_step: int | None = None
        self.best_value: float | None = None
        self.evaluations_without_improvement = 0
        self.best_weights: dict[str, torch.Tensor] | None = None

    def update(self, step: int, value: float, model_weights: Callable[[], dict]) -> bool:
        """Record the held-out ``value`` of ``step``; ``model_weights()`` is called only on improvement."""
        improved = not math.isnan(value) and (
            self.best_value is None
            or (value > self.best_value if self.greater_is_better else value < self.best_value))
        if improved:
            self.best_step, self.best_value, self.evaluations_without_improvement = step, value, 0
            if self.keep_weights:
                self.best_weights = model_weights()
        else:
            self.evaluations_without_improvement += 1
        return improved

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.evaluations_without_improvement >= self.patience

    def state(self) -> dict:
        return {"best_step": self.best_step, "best_value": self.best_value,
                "evaluations_without_improvement": self.evaluations_without_improvement}

    def load_state(self, state: dict, best_weights: dict | None) -> None:
        self.best_step, self.best_value = state["best_step"], state["best_value"]
        self.evaluations_without_improvement = state["evaluations_without_improvement"]
        self.best_weights = best_weights


def _selection_metrics(args: argparse.Namespace) -> tuple[str, ...]:
    """The metrics ``--metric-for-best-model`` accepts for the recipe's task."""
    if args.kind == "causal-lm":
        return ("perplexity", "eval_loss")
    return (*get_task(args.task).metrics, "eval_loss")


def _check_selection_options(args: argparse.Namespace) -> None:
    selects = args.load_best_model_at_end or args.early_stopping_patience is not None
    if args.early_stopping_split is not None and not 0 < args.early_stopping_split < 1:
        raise RecipeError(f"--early-stopping-split must be in (0, 1) (a fraction of the training examples), "
                          f"got {args.early_stopping_split}")
    if (selects or args.metric_for_best_model is not None) and args.early_stopping_split is None:
        raise RecipeError("--load-best-model-at-end, --early-stopping-patience and --metric-for-best-model select on "
                          "a split carved from the training data, never on the reported validation split: pass "
                          "--early-stopping-split FRACTION (e.g. 0.1)")
    if selects and not args.eval_steps:
        raise RecipeError("--load-best-model-at-end and --early-stopping-patience choose among evaluations: pass "
                          "--eval-steps N")
    if args.early_stopping_patience is not None and args.early_stopping_patience < 1:
        raise RecipeError(f"--early-stopping-patience must be >= 1, got {args.early_stopping_patience}")
    accepted = _selection_metrics(args)
    if args.metric_for_best_model is not None and args.metric_for_best_model not in accepted:
        raise RecipeError(f"--metric-for-best-model {args.metric_for_best_model!r} is not a metric of this task; "
                          f"accepted: {', '.join(accepted)}")


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, "checkpoints", f"{CHECKPOINT_PREFIX}{step}")


def find_checkpoint(output_dir: str, which: str) -> str:
    """The checkpoint folder ``which`` names: a folder, or ``"latest"`` (highest step in OUTPUT_DIR/checkpoints).

    Raises:
        RecipeError: no such (complete) checkpoint.
    """
    if which != "latest":
        if not os.path.isfile(os.path.join(which, TRAINING_STATE_FILE)):
            raise RecipeError(f"{which} is not a checkpoint folder of this recipe (no {TRAINING_STATE_FILE})")
        return which
    root = os.path.join(output_dir, "checkpoints")
    steps = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            match = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", name)
            if match and os.path.isfile(os.path.join(root, name, TRAINING_STATE_FILE)):
                steps.append(int(match.group(1)))
    if not steps:
        raise RecipeError(f"--resume-from-checkpoint latest: no checkpoint in {root}")
    return checkpoint_dir(output_dir, max(steps))


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def _json_safe_config(args: argparse.Namespace) -> dict:
    """Hyperparameters for TensorBoard (scalars and strings only)."""
    config = {}
    for key, value in vars(args).items():
        if key == "func":
            continue
        config[key] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return config


PATH_ARGS = ("model", "tokenizer", "train_file", "validation_file", "output_dir")
"""Recipe arguments that may be local paths: recorded by :func:`portable_name` (metrics.json goes to the Hub)."""


def portable_name(name_or_path: str | None) -> str | None:
    """``name_or_path`` as a file meant for the Hub may record it: a Hub id (``org/name``, not a local path) is
    kept, a local path becomes its base name (no ``/home/...``, ``/tmp/...`` reaches a shared file)."""
    if name_or_path is None:
        return None
    text = str(name_or_path)
    if os.path.exists(text) or os.path.isabs(text) or "\\" in text or text.startswith((".", "~")):
        return os.path.basename(os.path.normpath(os.path.abspath(os.path.expanduser(text.replace("\\", "/")))))
    return text


_LOCAL_PATH = re.compile(r"(?<![\w.:/~-])[~/][^\s'\"(),;:]*")


def without_local_paths(text: str | None) -> str | None:
    """``text`` (e.g. an error message quoted in metrics.json) with each absolute or ``~`` path replaced by its
    base name; URLs and fractions such as ``1/2`` are left alone."""
    if not text:
        return text

    def base_name(match: re.Match) -> str:
        path = match.group(0)
        stripped = path.rstrip(".")  # a sentence's full stop is not part of the path
        return (os.path.basename(stripped.rstrip("/")) or stripped) + path[len(stripped):]

    return _LOCAL_PATH.sub(base_name, text)


def _portable_checkpoint(path: str | None, output_dir: str) -> str | None:
    """A checkpoint folder relative to the output folder when inside it (``checkpoints/step_N``), else its base
    name; ``latest`` as it is."""
    if path is None or path == "latest":
        return path
    relative = os.path.relpath(os.path.abspath(path), os.path.abspath(output_dir))
    return relative if not relative.startswith("..") else portable_name(path)


def _recorded_args(args: argparse.Namespace) -> dict:
    """The arguments as ``metrics.json`` and TensorBoard record them: scalars and strings, no local paths."""
    config = _json_safe_config(args)
    for key in PATH_ARGS:
        if key in config and config[key] is not None:
            config[key] = portable_name(config[key])
    if "resume_from_checkpoint" in config:
        config["resume_from_checkpoint"] = _portable_checkpoint(args.resume_from_checkpoint, args.output_dir)
    return config


def run_flags(args: argparse.Namespace, num_processes: int) -> dict:
    """The flags that identify a run and its data order (recorded in each checkpoint, compared on resume)."""
    flags = {key: value for key, value in _recorded_args(args).items() if key not in RESUMABLE_CHANGES}
    flags["num_processes"] = num_processes
    return flags


def check_resumable(checkpoint: str, state: dict, flags: dict) -> None:
    """Refuse to continue the run of ``checkpoint`` with other flags than those it recorded.

    Raises:
        RecipeError: one line naming each differing flag with the checkpoint's and the current value.
    """
    recorded = state.get("run")
    if recorded is None:  # a checkpoint of an older version: nothing to compare
        return
    differing = []
    for key in sorted(set(recorded) | set(flags)):
        old, new = recorded.get(key), flags.get(key)
        if json.dumps(old) != json.dumps(new):
            name = "processes" if key == "num_processes" else "--" + key.replace("_", "-")
            differing.append(f"{name} {old} (now {new})")
    if differing:
        raise RecipeError(
            f"--resume-from-checkpoint: {checkpoint} belongs to a run with other flags: {', '.join(differing)}; "
            "resume with that run's flags, or start a new run (empty --output-dir or --overwrite)")


def _check_output_dir(args: argparse.Namespace) -> str | None:
    """Refuse to mix two runs in one output folder; returns the checkpoint to resume from (or ``None``).

    A non-empty folder is accepted when resuming from one of its own checkpoints, or with ``--overwrite`` (the
    caller then deletes :data:`RUN_OUTPUTS`).
    """
    checkpoint = find_checkpoint(args.output_dir, args.resume_from_checkpoint) if args.resume_from_checkpoint else None
    output = os.path.abspath(args.output_dir)
    inside = checkpoint is not None and os.path.abspath(checkpoint).startswith(output + os.sep)
    if inside and args.overwrite:
        raise RecipeError(f"--overwrite would delete {checkpoint}, which --resume-from-checkpoint continues: "
                          "pass one of them")
    used = os.path.isdir(output) and os.listdir(output)
    if used and not inside and not args.overwrite:
        shown = ", ".join(sorted(used)[:4]) + (", ..." if len(used) > 4 else "")
        resume = ", --resume-from-checkpoint latest to continue it" if "checkpoints" in used else ""
        raise RecipeError(f"--output-dir {args.output_dir} is not empty ({shown}): pass --overwrite to replace the "
                          f"run there{resume}, or choose a new folder")
    return checkpoint


def _clear_run_outputs(output_dir: str) -> None:
    for name in RUN_OUTPUTS:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def _check_report_to(report_to: str) -> None:
    """Fail before any work when the chosen tracker's package is missing (accelerate would only warn)."""
    if report_to == "tensorboard":
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise RecipeError("--report-to tensorboard needs the tensorboard package (not a dependency of "
                              "hf-performer): pip install tensorboard, or use --report-to none") from None


def _prepare_classification(args, accelerator, tokenizer):
    from transformers import DataCollatorWithPadding

    from .tasks.data import load_task_split, tokenize_task_dataset

    spec = get_task(args.task)
    with accelerator.main_process_first():
        train = load_task_split(spec, "train", args.train_file, args.max_train_samples, args.seed)
        evaluation = load_task_split(spec, "validation", args.validation_file, args.max_eval_samples, args.seed)
        train = tokenize_task_dataset(train, tokenizer, spec, args.max_length)
        evaluation = tokenize_task_dataset(evaluation, tokenizer, spec, args.max_length)
    pad_to = 8 if accelerator.mixed_precision in ("fp16", "bf16") else None
    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to)
    return spec, train, evaluation, collator


def _prepare_causal_lm(args, accelerator, tokenizer):
    from transformers import default_data_collator

    from .tasks.data import group_into_blocks, load_lm_text, select_subset, tokenize_lm_text

    with accelerator.main_process_first():
        train_text = load_lm_text(args.train_file, args.dataset, args.dataset_config, "train", args.max_train_chars)
        eval_text = load_lm_text(args.validation_file, args.dataset, args.dataset_config, "validation",
                                 args.max_eval_chars)
        train = group_into_blocks(tokenize_lm_text(train_text, tokenizer), args.block_size)
        train = select_subset(train, args.max_train_samples, args.seed)
        eval_ids = tokenize_lm_text(eval_text, tokenizer)
    return train, eval_ids, default_data_collator


def train(args: argparse.Namespace, loss_hooks: Sequence[LossHook] = ()) -> dict:
    """Run a recipe (see the module docstring for the stages).

    Args:
        args: arguments from :func:`build_parser` (``args.kind`` says which recipe).
        loss_hooks: extension point: ``hook(model, batch, outputs, step) -> Tensor | None`` added to the loss
            (e.g. a future attention-distillation term). None are used by the recipes.

    Returns:
        The content of ``metrics.json``.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer, get_scheduler

    from .tasks.evaluation import compute_task_metrics, perplexity, predict_classification

    started = time.perf_counter()
    _check_report_to(args.report_to)
    _check_selection_options(args)
    checkpoint = _check_output_dir(args)  # every process, before any of them writes
    os.makedirs(args.output_dir, exist_ok=True)
    accelerator_kwargs = dict(gradient_accumulation_steps=args.gradient_accumulation_steps)
    if args.mixed_precision is not None:
        accelerator_kwargs["mixed_precision"] = args.mixed_precision
    if args.report_to == "tensorboard":
        accelerator_kwargs.update(log_with="tensorboard", project_dir=args.output_dir)
    accelerator = Accelerator(**accelerator_kwargs)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > accelerator.num_processes:
        raise RecipeError(
            f"WORLD_SIZE={launched} in the environment (torchrun?) but Accelerate runs {accelerator.num_processes} "
            "process: each process would train alone into the same folder; on CPU set ACCELERATE_USE_CPU=true "
            "(ACCELERATE_USE_CPU=true torchrun --nproc_per_node N recipes/...), on GPUs make them visible")
    processes = accelerator.num_processes
    accelerator.print(f"training with {processes} process{'es' if processes > 1 else ''} ("
                      + (f"{accelerator.distributed_type.value} on " if processes > 1 else "")
                      + f"{accelerator.device.type})")
    flags = run_flags(args, accelerator.num_processes)
    if checkpoint is not None:
        with open(os.path.join(checkpoint, TRAINING_STATE_FILE)) as handle:
            check_resumable(_portable_checkpoint(checkpoint, args.output_dir), json.load(handle), flags)
    if args.overwrite and accelerator.is_main_process:
        _clear_run_outputs(args.output_dir)
    accelerator.wait_for_everyone()
    set_seed(args.seed)

    tokenizer_path = args.tokenizer or args.model
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except (OSError, ValueError, TypeError) as error:
        raise RecipeError(f"no tokenizer could be loaded from {tokenizer_path!r} ({error}); pass --tokenizer") from None

    # ---- data and model
    if args.kind == "text-classification":
        if tokenizer.pad_token is None:  # GPT-2-like tokenizers: pad with EOS (the model is told below)
            tokenizer.pad_token = tokenizer.eos_token
        spec, train_set, eval_set, collator = _prepare_classification(args, accelerator, tokenizer)
        model, model_info = load_model(args, spec.num_labels, spec.id2label, spec.problem_type)
        for config in (model.config, getattr(model.config, "source_config", None)):
            if config is not None and getattr(config, "pad_token_id", None) is None:
                config.pad_token_id = tokenizer.pad_token_id
        eval_loader = _dataloader(eval_set, args.per_device_eval_batch_size, collator, seed=args.seed)
    else:
        spec = None
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        train_set, eval_ids, collator = _prepare_causal_lm(args, accelerator, tokenizer)
        model, model_info = load_model(args)
        eval_loader = None
    heldout_set = heldout_loader = heldout_ids = selection = None
    if args.early_stopping_split is not None:
        train_set, heldout_set = carve_early_stopping_split(train_set, args.early_stopping_split, args.seed)
        if spec is not None:
            heldout_loader = _dataloader(heldout_set, args.per_device_eval_batch_size, collator, seed=args.seed)
        else:  # the held-out blocks, joined again: scored with the same perplexity protocol
            heldout_ids = [token for block in heldout_set["input_ids"] for token in block]
        selection = BestStepSelection(args.metric_for_best_model or _selection_metrics(args)[0],
                                      args.early_stopping_patience, args.load_best_model_at_end)
        if args.load_best_model_at_end and accelerator.distributed_type.value in ("FSDP", "DEEPSPEED"):
            raise RecipeError("--load-best-model-at-end keeps full weights per process: use it with one process "
                              "or DDP, not FSDP/DeepSpeed")
    if args.lora:
        model = apply_lora(model, args)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())

    sampler = EpochSeededSampler(len(train_set), args.seed)
    train_loader = _dataloader(train_set, args.per_device_train_batch_size, collator, sampler, args.num_workers,
                               args.seed)

    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight", "ln_", "norm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and not any(k in n for k in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=args.learning_rate)

    # ---- schedule (in optimizer steps)
    batches_per_epoch = math.ceil(len(train_set) / (args.per_device_train_batch_size * accelerator.num_processes))
    # accelerator.gradient_accumulation_steps: a DeepSpeed config (ACCELERATE_GRADIENT_ACCUMULATION_STEPS) overrides the flag.
    steps_per_epoch = math.ceil(batches_per_epoch / accelerator.gradient_accumulation_steps)
    max_train_steps = args.max_train_steps or math.ceil(args.num_train_epochs * steps_per_epoch)
    num_epochs = math.ceil(max_train_steps / steps_per_epoch)
    warmup = args.warmup_steps if args.warmup_steps is not None else math.ceil(args.warmup_ratio * max_train_steps)
    # The prepared scheduler steps once per process per optimizer step (accelerate): scale the counts.
    scheduler = get_scheduler(args.lr_scheduler, optimizer, num_warmup_steps=warmup * accelerator.num_processes,
                              num_training_steps=max_train_steps * accelerator.num_processes)

    if eval_loader is not None and heldout_loader is not None:
        model, optimizer, train_loader, eval_loader, heldout_loader, scheduler = accelerator.prepare(
            model, optimizer, train_loader, eval_loader, heldout_loader, scheduler)
    elif eval_loader is not None:
        model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
            model, optimizer, train_loader, eval_loader, scheduler)
    else:
        model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)

    if args.report_to == "tensorboard":
        accelerator.init_trackers("runs", config=_recorded_args(args))

    # ---- resume
    completed_steps, start_epoch, skip_batches, curve = 0, 0, 0, []
    resumed_from = None
    if checkpoint is not None:
        path = checkpoint
        resumed_from = _portable_checkpoint(path, args.output_dir)
        accelerator.load_state(path)
        with open(os.path.join(path, TRAINING_STATE_FILE)) as handle:
            state = json.load(handle)
        completed_steps, start_epoch = state["completed_steps"], state["epoch"]
        skip_batches, curve = state["batches_in_epoch"], state["eval_curve"]
        accelerator.step = state.get("accumulation_step", 0)
        if selection is not None and state.get("selection") is not None:
            weights_file = os.path.join(path, BEST_WEIGHTS_FILE)
            best_weights = (torch.load(weights_file, map_location="cpu", weights_only=True)
                            if os.path.isfile(weights_file) else None)
            selection.load_state(state["selection"], best_weights)
        accelerator.print(f"resumed from {path}: step {completed_steps}, epoch {start_epoch}, "
                          f"skipping {skip_batches} batches of it")

    def evaluate_now(heldout: bool = False) -> dict:
        if spec is not None:
            loader = heldout_loader if heldout else eval_loader
            predictions, references, loss = predict_classification(model, loader, spec, accelerator)
            metrics, backend, note = compute_task_metrics(spec, predictions, references, args.metrics_backend)
            return {**metrics, "eval_loss": loss, "_backend": backend, "_note": note}
        context = args.context_length or args.block_size
        stride = args.stride or max(context // 2, 1)
        result = perplexity(model, heldout_ids if heldout else eval_ids, context, stride,
                            args.per_device_eval_batch_size, accelerator)
        return {"perplexity": result["perplexity"], "eval_loss": result["nll"], "_backend": None, "_note": None,
                "_protocol": {k: result[k] for k in ("context_length", "stride", "windows", "num_tokens")}}

    def model_weights() -> dict:
        return {k: v.detach().to("cpu", copy=True) for k, v in accelerator.unwrap_model(model).state_dict().items()}

    last_result = None

    def record_eval(epoch: int, train_loss: float | None) -> dict:
        nonlocal last_result
        result = last_result = evaluate_now()
        point = {"step": completed_steps, "epoch": epoch,
                 **{k: v for k, v in result.items() if not k.startswith("_")}}
        if selection is not None:
            heldout = evaluate_now(heldout=True)
            point.update({f"heldout_{k}": v for k, v in heldout.items() if not k.startswith("_")})
            selection.update(completed_steps, point[f"heldout_{selection.metric}"], model_weights)
        if train_loss is not None:
            point["train_loss"] = train_loss
        curve.append(point)
        accelerator.log({f"eval/{k}": v for k, v in point.items() if k not in ("step", "epoch")},
                        step=completed_steps)
        accelerator.print(f"step {completed_steps}: " + ", ".join(
            f"{k}={v:.4f}" for k, v in point.items() if k not in ("step", "epoch") and isinstance(v, float)))
        return result

    progress = tqdm(total=max_train_steps, initial=completed_steps, desc="training",
                    disable=not accelerator.is_local_main_process)
    running_loss, running_count, last_train_loss, first_losses = 0.0, 0, None, []
    stopped_at = None
    model.train()
    epoch = start_epoch
    for epoch in range(start_epoch, num_epochs):
        if completed_steps >= max_train_steps or stopped_at is not None:
            break
        train_loader.set_epoch(epoch)
        loader = train_loader
        if epoch == start_epoch and skip_batches:
            loader = accelerator.skip_first_batches(train_loader, skip_batches)
            loader.set_epoch(epoch)
        batches_in_epoch = skip_batches if epoch == start_epoch else 0
        for batch in loader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                for hook in loss_hooks:
                    extra = hook(model, batch, outputs, completed_steps)
                    if extra is not None:
                        loss = loss + extra
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            batches_in_epoch += 1
            running_loss += loss.detach().float().item()
            running_count += 1
            if not accelerator.sync_gradients:
                continue
            completed_steps += 1
            progress.update(1)
            step_loss = running_loss / running_count
            running_loss, running_count = 0.0, 0
            last_train_loss = step_loss
            first_losses.append(step_loss)
            progress.set_postfix(loss=f"{step_loss:.4f}")
            if completed_steps % args.logging_steps == 0 or completed_steps == 1:
                accelerator.log({"train/loss": step_loss, "train/learning_rate": scheduler.get_last_lr()[0]},
                                step=completed_steps)
            if args.eval_steps and completed_steps % args.eval_steps == 0 and completed_steps < max_train_steps:
                record_eval(epoch, step_loss)
                model.train()
                if selection is not None and selection.should_stop:
                    stopped_at = completed_steps
            if args.checkpointing_steps and completed_steps % args.checkpointing_steps == 0:
                _save_checkpoint(accelerator, args.output_dir, completed_steps, epoch, batches_in_epoch, curve, flags,
                                 selection)
            if completed_steps >= max_train_steps or stopped_at is not None:
                break
        skip_batches = 0

    progress.close()
    if stopped_at is None:
        record_eval(epoch, last_train_loss)
    final_result = last_result

    # ---- the kept model: the last step, or the best held-out step with --load-best-model-at-end
    kept_point = curve[-1]
    if stopped_at is not None:
        kept_reason = (f"last step: early stopping after {selection.patience} evaluations without improvement of "
                       f"the held-out {selection.metric} (best {selection.best_value:.4f} at step "
                       f"{selection.best_step})")
    else:
        kept_reason = "last step"
    if args.load_best_model_at_end and selection.best_step is not None:
        kept_point = next(point for point in curve if point["step"] == selection.best_step)
        if selection.best_step != completed_steps:
            accelerator.unwrap_model(model).load_state_dict(selection.best_weights)
        evaluated = ", ".join(str(point["step"]) for point in curve)
        kept_reason = (f"--load-best-model-at-end: best held-out {selection.metric} ({selection.best_value:.4f}) at "
                       f"step {selection.best_step} among the evaluations at steps {evaluated} on the early-stopping "
                       f"split" + (f" (stopped early at step {stopped_at})" if stopped_at is not None else ""))
    early_stopping = None
    if selection is not None:
        early_stopping = {
            "split_fraction": args.early_stopping_split,
            "split_examples": len(heldout_set),
            "seed": args.seed,
            "metric": selection.metric,
            "greater_is_better": selection.greater_is_better,
            "patience": selection.patience,
            "load_best_model_at_end": bool(args.load_best_model_at_end),
            "best_step": selection.best_step,
            "best_value": selection.best_value,
            "stopped_at_step": stopped_at,
            "kept_heldout": {k[len("heldout_"):]: v for k, v in kept_point.items() if k.startswith("heldout_")},
        }

    # ---- outputs
    final = {k: v for k, v in kept_point.items()
             if k not in ("step", "epoch", "train_loss") and not k.startswith("heldout_")}
    metrics = {
        "kind": args.kind,
        "task": spec.name if spec is not None else "causal-lm",
        "model": {**model_info, "source": portable_name(model_info["source"])},
        "main_metric": spec.main_metric if spec is not None else "perplexity",
        "final": final,
        "completed_steps": completed_steps,
        "kept_step": kept_point["step"],
        "kept_reason": kept_reason,
        "early_stopping": early_stopping,
        "epochs": num_epochs,
        "train_loss_first": first_losses[0] if first_losses else None,
        "train_loss_last": last_train_loss,
        "train_examples": len(train_set),
        "eval_examples": len(eval_set) if spec is not None else None,
        "perplexity_protocol": final_result.get("_protocol"),
        "metrics_backend": final_result["_backend"],
        "metrics_note": without_local_paths(final_result["_note"]),
        "trainable_parameters": trainable,
        "total_parameters": total,
        "lora": bool(args.lora),
        "mixed_precision": accelerator.mixed_precision,
        "num_processes": accelerator.num_processes,
        "device": str(accelerator.device),
        "wall_time_s": round(time.perf_counter() - started, 2),
        "resumed_from": resumed_from,
        "args": _recorded_args(args),
    }
    accelerator.wait_for_everyone()
    if not args.no_save_model:
        _save_model(accelerator, model, tokenizer, args)
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, METRICS_FILE_NAME), "w") as handle:
            json.dump(metrics, handle, indent=2)
        with open(os.path.join(args.output_dir, EVAL_CURVE_FILE_NAME), "w") as handle:
            json.dump(curve, handle, indent=2)
        from .hub import write_recipe_card

        write_recipe_card(args.output_dir)  # README.md model card of a Performer folder, results from metrics.json
        print(json.dumps({"final": final, "completed_steps": completed_steps}, indent=2))
    # Last: end_training closes the trackers and, with several processes, the process group.
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return metrics


def _save_checkpoint(accelerator, output_dir: str, step: int, epoch: int, batches_in_epoch: int, curve: list,
                     flags: dict, selection: BestStepSelection | None = None):
    """``accelerator.save_state`` + ``training_state.json`` (position, curve, the run's :func:`run_flags`, the
    best-step selection) and the best step's weights, written to a temporary folder then renamed."""
    final = checkpoint_dir(output_dir, step)
    staging = final + ".partial"
    if accelerator.is_main_process and os.path.isdir(staging):
        shutil.rmtree(staging)
    accelerator.wait_for_everyone()
    accelerator.save_state(staging)
    if accelerator.is_main_process:
        state = {"completed_steps": step, "epoch": epoch, "batches_in_epoch": batches_in_epoch,
                 "accumulation_step": accelerator.step, "eval_curve": curve, "run": flags,
                 "selection": selection.state() if selection is not None else None}
        if selection is not None and selection.best_weights is not None:
            torch.save(selection.best_weights, os.path.join(staging, BEST_WEIGHTS_FILE))
        with open(os.path.join(staging, TRAINING_STATE_FILE), "w") as handle:
            json.dump(state, handle, indent=2)
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(staging, final)
    accelerator.wait_for_everyone()


def _save_model(accelerator, model, tokenizer, args) -> None:
    """The final model folder: merged weights (LoRA: adapter also in ``adapter/``), code, tokenizer."""
    unwrapped = accelerator.unwrap_model(model)
    if args.lora:
        if accelerator.is_main_process:
            unwrapped.save_pretrained(os.path.join(args.output_dir, "adapter"))
            unwrapped = unwrapped.merge_and_unload()
            unwrapped.save_pretrained(args.output_dir)
    else:
        unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                                  save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)


def main(kind: str, argv: list[str] | None = None, loss_hooks: Sequence[LossHook] = ()) -> int:
    """Entry point of the recipe scripts. Returns the exit status."""
    args = build_parser(kind).parse_args(argv)
    try:
        train(args, loss_hooks=loss_hooks)
    except (RecipeError, DataError) as error:
        raise SystemExit(f"recipes ({kind}): error: {error}") from None
    return 0


__all__ = [
    "KINDS",
    "LORA_TARGET_MODULES",
    "BestStepSelection",
    "EpochSeededSampler",
    "RecipeError",
    "apply_lora",
    "build_parser",
    "carve_early_stopping_split",
    "check_resumable",
    "find_checkpoint",
    "load_model",
    "main",
    "portable_name",
    "run_flags",
    "set_redraw_interval",
    "train",
    "without_local_paths",
]
