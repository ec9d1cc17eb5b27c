"""The recipes' training loop (Accelerate) for text classification and causal LMs: :func:`train` and the
scripts' entry point :func:`main`.

The scripts ``recipes/text_classification.py`` and ``recipes/causal_lm.py`` call :func:`main` with their
kind; their flags are declared in :mod:`~hf_performer.recipes.arguments`, the model is loaded in
:mod:`~hf_performer.recipes.model`, the outputs are written by :mod:`~hf_performer.recipes.results`. Run them with ``accelerate launch`` (multi-GPU / multi-node, DDP, FSDP,
DeepSpeed through the configs in ``recipes/configs/``), plain ``python`` (one process, CPU or one GPU), or
``ACCELERATE_USE_CPU=true torchrun --nproc_per_node N`` (DDP on CPU processes, gloo; ``accelerate launch --cpu
--num_processes N`` starts one process only). The number of processes is printed at the start.

Stages of :func:`train`:

1. **Model.** ``--model`` is a Performer folder (trained as it is), or a softmax model folder that is
   converted on the fly (``--convert``, the default for softmax folders with ``--attention favor``) with the
   FAVOR+ options (``--feature-map``, ``--nb-features``, ``--keep-softmax-layers``, ``--redraw-interval``, ...),
   or a softmax model trained as softmax (``--attention softmax``: the baselines). ``--lora`` wraps it with
   PEFT LoRA on the attention projections (:data:`hf_performer.recipes.arguments.LORA_TARGET_MODULES`).
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
loss before the backward pass. ``--teacher-model`` adds one: knowledge distillation from
a teacher's predictions (:mod:`hf_performer.recipes.distillation`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence

import torch
from torch.utils.data import DataLoader, Sampler

from ..tasks.data import DataError, get_task
from .arguments import RecipeError, build_parser
from .distillation import check_distillation_options, teacher_hooks
from .model import apply_lora, load_model
from .results import (
    EVAL_CURVE_FILE,
    METRICS_FILE,
    portable_checkpoint,
    portable_name,
    recorded_args,
    without_local_paths,
    write_run_results,
)
from .selection import (
    BestStepSelection,
    carve_early_stopping_split,
    check_selection_options,
    early_stopping_record,
    keep_model,
    selection_metrics,
    training_data_fingerprint,
)


CHECKPOINT_PREFIX = "step_"
TRAINING_STATE_FILE = "training_state.json"
BEST_WEIGHTS_FILE = "best_weights.pt"

RUN_OUTPUTS = ("checkpoints", "runs", "adapter", METRICS_FILE, EVAL_CURVE_FILE)
"""What ``--overwrite`` deletes from a used output folder before training (the model files are replaced by the
new run's)."""

RESUMABLE_CHANGES = (
    "output_dir", "resume_from_checkpoint", "overwrite", "eval_steps", "logging_steps", "checkpointing_steps",
    "report_to", "num_workers", "per_device_eval_batch_size", "no_save_model", "metrics_backend", "validation_file",
    "max_eval_samples", "max_eval_chars", "context_length", "stride", "time_limit", "no_progress", "no_evaluation",
)
"""Arguments a resumed run may change (logging, evaluation and output only); every other argument, and the
number of processes, must be those recorded in the checkpoint (they decide the data order and the training)."""

FSDP_ON_CPU = (
    "an FSDP launch config was given, but Accelerate shards a model with FSDP on accelerator devices only (CUDA, XPU, "
    "NPU, MLU, MUSA, HPU): on CPU processes it ignores the FSDP settings (the run would be plain DDP) or fails for want "
    "of a device; on CPUs launch with recipes/configs/ddp.yaml or ACCELERATE_USE_CPU=true torchrun --nproc_per_node N")
"""Why an FSDP launch on CPUs is refused (measured with accelerate 1.15 and torch 2.13: recipes/README.md)."""

LossHook = Callable[[torch.nn.Module, dict, object, int], "torch.Tensor | None"]


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


def run_flags(args, num_processes: int) -> dict:
    """The flags that identify a run and its data order (recorded in each checkpoint, compared on resume)."""
    flags = {key: value for key, value in recorded_args(args).items() if key not in RESUMABLE_CHANGES}
    flags["num_processes"] = num_processes
    flags["train_data_fingerprint"] = training_data_fingerprint(args)  # the file's contents, not only its name
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
        if key == "train_data_fingerprint" and key not in recorded:  # a checkpoint written before it was recorded
            continue
        old, new = recorded.get(key), flags.get(key)
        if json.dumps(old) != json.dumps(new):
            name = {"num_processes": "processes",
                    "train_data_fingerprint": "the contents of --train-file (fingerprint)"}.get(
                key, "--" + key.replace("_", "-"))
            differing.append(f"{name} {old} (now {new})")
    if differing:
        raise RecipeError(
            f"--resume-from-checkpoint: {checkpoint} belongs to a run with other flags: {', '.join(differing)}; "
            "resume with that run's flags, or start a new run (empty --output-dir or --overwrite)")


def _check_output_dir(args) -> str | None:
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

    from ..tasks.data import load_task_split, tokenize_task_dataset

    spec = get_task(args.task)
    with accelerator.main_process_first():
        train = load_task_split(spec, "train", args.train_file, args.max_train_samples, args.seed)
        train = tokenize_task_dataset(train, tokenizer, spec, args.max_length)
        evaluation = None
        if not args.no_evaluation:
            evaluation = load_task_split(spec, "validation", args.validation_file, args.max_eval_samples, args.seed)
            evaluation = tokenize_task_dataset(evaluation, tokenizer, spec, args.max_length)
    pad_to = 8 if accelerator.mixed_precision in ("fp16", "bf16") else None
    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to)
    return spec, train, evaluation, collator


def _prepare_causal_lm(args, accelerator, tokenizer):
    from transformers import default_data_collator

    from ..tasks.data import group_into_blocks, load_lm_text, select_subset, tokenize_lm_text

    with accelerator.main_process_first():
        train_text = load_lm_text(args.train_file, args.dataset, args.dataset_config, "train", args.max_train_chars)
        train = group_into_blocks(tokenize_lm_text(train_text, tokenizer), args.block_size)
        train = select_subset(train, args.max_train_samples, args.seed)
        eval_ids = None
        if not args.no_evaluation:
            eval_text = load_lm_text(args.validation_file, args.dataset, args.dataset_config, "validation",
                                     args.max_eval_chars)
            eval_ids = tokenize_lm_text(eval_text, tokenizer)
    return train, eval_ids, default_data_collator


def _check_validation_is_not_training(args) -> None:
    """Warn (one line) when ``--validation-file`` has the contents of ``--train-file``: its metrics measure the
    training data (a deliberate overfitting check may want that; a reported result does not)."""
    from ..tasks.data import file_fingerprint

    if args.no_evaluation or not (args.train_file and args.validation_file) or not all(
            os.path.isfile(path) for path in (args.train_file, args.validation_file)):
        return
    if file_fingerprint(args.validation_file) == training_data_fingerprint(args):
        print(f"warning: --validation-file {os.path.basename(args.validation_file)} has the same contents as "
              "--train-file: the reported metrics measure the training data, not held-out data", file=sys.stderr)


def _start_run(args):
    """Check the options and the output folder, start Accelerate, check a checkpoint to resume against the run's
    flags, clear a previous run with ``--overwrite`` and seed everything.

    Returns:
        ``(accelerator, checkpoint, flags)``: the checkpoint folder to resume from (or ``None``) and the run's
        :func:`run_flags`.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    _check_report_to(args.report_to)
    _check_validation_is_not_training(args)
    check_selection_options(args)
    check_distillation_options(args)
    checkpoint = _check_output_dir(args)  # every process, before any of them writes
    os.makedirs(args.output_dir, exist_ok=True)
    accelerator_kwargs = dict(gradient_accumulation_steps=args.gradient_accumulation_steps)
    if args.mixed_precision is not None:
        accelerator_kwargs["mixed_precision"] = args.mixed_precision
    if args.report_to == "tensorboard":
        accelerator_kwargs.update(log_with="tensorboard", project_dir=args.output_dir)
    fsdp_asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    try:
        accelerator = Accelerator(**accelerator_kwargs)
    except RuntimeError as error:
        if fsdp_asked and "no available devices" in str(error):
            raise RecipeError(FSDP_ON_CPU) from None
        raise
    if fsdp_asked and accelerator.distributed_type.value != "FSDP":
        raise RecipeError(f"{FSDP_ON_CPU} (this launch would run {accelerator.distributed_type.value})")
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
            check_resumable(portable_checkpoint(checkpoint, args.output_dir), json.load(handle), flags)
    if args.overwrite and accelerator.is_main_process:
        _clear_run_outputs(args.output_dir)
    accelerator.wait_for_everyone()
    set_seed(args.seed)
    return accelerator, checkpoint, flags


def _load_tokenizer(args):
    """The tokenizer of ``--tokenizer`` (default ``--model``); GPT-2-like tokenizers pad with EOS (the model's
    ``pad_token_id`` is set from it)."""
    from transformers import AutoTokenizer

    tokenizer_path = args.tokenizer or args.model
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except (OSError, ValueError, TypeError) as error:
        raise RecipeError(f"no tokenizer could be loaded from {tokenizer_path!r} ({error}); pass --tokenizer") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _build_optimizer(model, args) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, without weight decay on biases and normalisation weights."""
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight", "ln_", "norm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and not any(k in n for k in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=args.learning_rate)


def _resume(accelerator, checkpoint: str | None, output_dir: str, selection: BestStepSelection | None):
    """Reload ``checkpoint`` (``accelerator.load_state``, ``training_state.json``, the best step's weights) if any.

    Returns:
        ``(completed_steps, start_epoch, skip_batches, curve, resumed_from)``: where the run continues (the
        batches of ``start_epoch`` already consumed), the evaluation curve so far and the checkpoint as recorded.
    """
    completed_steps, start_epoch, skip_batches, curve = 0, 0, 0, []
    resumed_from = None
    if checkpoint is not None:
        path = checkpoint
        resumed_from = portable_checkpoint(path, output_dir)
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
    return completed_steps, start_epoch, skip_batches, curve, resumed_from


def train(args, loss_hooks: Sequence[LossHook] = ()) -> dict:
    """Run a recipe (see the module docstring for the stages).

    Args:
        args: arguments from :func:`build_parser` (``args.kind`` says which recipe).
        loss_hooks: extension point: ``hook(model, batch, outputs, step) -> Tensor | None`` added to the loss;
            ``--teacher-model`` appends the teacher's (:func:`.distillation.teacher_distillation_hook`).

    Returns:
        The content of ``metrics.json``.
    """
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    from ..tasks.evaluation import compute_task_metrics, perplexity, predict_classification

    started = time.perf_counter()
    if not 0.0 <= getattr(args, "window_dropout", 0.0) <= 1.0:
        raise RecipeError(f"--window-dropout must be a probability in [0, 1], got {args.window_dropout}")
    accelerator, checkpoint, flags = _start_run(args)

    tokenizer = _load_tokenizer(args)

    # ---- data and model
    if args.kind == "text-classification":
        spec, train_set, eval_set, collator = _prepare_classification(args, accelerator, tokenizer)
        model, model_info = load_model(args, spec.num_labels, spec.id2label, spec.problem_type)
        for config in (model.config, getattr(model.config, "source_config", None)):
            if config is not None and getattr(config, "pad_token_id", None) is None:
                config.pad_token_id = tokenizer.pad_token_id
        eval_loader = None if eval_set is None else _dataloader(eval_set, args.per_device_eval_batch_size, collator,
                                                                seed=args.seed)
    else:
        spec = None
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
        selection = BestStepSelection(args.metric_for_best_model or selection_metrics(args)[0],
                                      args.early_stopping_patience, args.load_best_model_at_end)
        if args.load_best_model_at_end and accelerator.distributed_type.value in ("FSDP", "DEEPSPEED"):
            raise RecipeError("--load-best-model-at-end keeps full weights per process: use it with one process "
                              "or DDP, not FSDP/DeepSpeed")
    loss_hooks = [*loss_hooks, *teacher_hooks(args, spec, model.config, accelerator.device, accelerator.autocast)]
    if args.lora:
        model = apply_lora(model, args)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())

    sampler = EpochSeededSampler(len(train_set), args.seed)
    train_loader = _dataloader(train_set, args.per_device_train_batch_size, collator, sampler, args.num_workers,
                               args.seed)

    optimizer = _build_optimizer(model, args)

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
        accelerator.init_trackers("runs", config=recorded_args(args))

    # ---- resume
    completed_steps, start_epoch, skip_batches, curve, resumed_from = _resume(accelerator, checkpoint, args.output_dir,
                                                                              selection)
    if getattr(args, "window_dropout", 0.0):
        from .window_dropout import WindowDropout

        accumulation = accelerator.gradient_accumulation_steps
        try:
            WindowDropout(model, args.window_dropout, max_train_steps * accumulation, completed_steps * accumulation,
                          seed=args.seed)
        except ValueError as error:
            raise RecipeError(f"--window-dropout: {error}") from None

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
                    disable=not accelerator.is_local_main_process or getattr(args, "no_progress", False))
    running_loss, running_count, last_train_loss, first_losses = 0.0, 0, None, []
    stopped_at = time_limit_reason = None
    time_limit_s = getattr(args, "time_limit", None) and args.time_limit * 60
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
            over_time = bool(time_limit_s) and time.perf_counter() - started > time_limit_s
            if time_limit_s and accelerator.num_processes > 1:  # the same decision on every rank
                over_time = bool(accelerator.reduce(torch.tensor(float(over_time), device=accelerator.device), "max"))
            if over_time and completed_steps < max_train_steps:
                time_limit_reason = f"--time-limit {args.time_limit:g} min reached after {completed_steps} steps"
            if completed_steps >= max_train_steps or stopped_at is not None or time_limit_reason:
                break
        skip_batches = 0
        if time_limit_reason:
            break

    progress.close()
    if args.no_evaluation:  # the caller evaluates the saved model (hf-performer linearize)
        last_result = {"_backend": None, "_note": None}
    elif stopped_at is None:
        record_eval(epoch, last_train_loss)
    final_result = last_result

    # ---- the kept model: the last step, or the best held-out step with --load-best-model-at-end
    kept_point, kept_reason = keep_model(accelerator, model, args, selection, curve, completed_steps, stopped_at)
    early_stopping = early_stopping_record(args, selection, heldout_set, kept_point, stopped_at)

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
        "time_limit_reason": time_limit_reason,
        "kept_step": kept_point["step"],
        "kept_reason": kept_reason,
        "early_stopping": early_stopping,
        "epochs": num_epochs,
        "train_loss_first": first_losses[0] if first_losses else None,
        "train_loss_last": last_train_loss,
        "train_examples": len(train_set),
        "eval_examples": len(eval_set) if spec is not None and eval_set is not None else None,
        "train_data_fingerprint": flags["train_data_fingerprint"],
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
        "args": recorded_args(args),
    }
    accelerator.wait_for_everyone()
    if not args.no_save_model:
        _save_model(accelerator, model, tokenizer, args)
    if accelerator.is_main_process:
        write_run_results(args.output_dir, metrics, curve)
        from ..hub import write_recipe_card

        write_recipe_card(args.output_dir)  # README.md model card of a Performer folder, results from metrics.json
        print(f"recipe: {completed_steps} steps, " + (", ".join(f"{k} {v:.4g}" for k, v in final.items()) or
                                                      "not evaluated") + f"; wrote {args.output_dir}")
    # Last: end_training closes the trackers and, with several processes, the process group.
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return metrics


class _SharedTensorNote(logging.Filter):
    """Drops accelerate's "Removed shared tensor {...} while saving" warning: a checkpoint stores tied weights (an LM
    head tied to the embeddings) once, and ``load_state`` restores them into the same tied model, so the line said
    nothing at every checkpoint."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Removed shared tensor" not in record.getMessage()


@contextlib.contextmanager
def _shared_tensor_notes_dropped():
    note_logger, note_filter = logging.getLogger("accelerate.utils.other"), _SharedTensorNote()
    note_logger.addFilter(note_filter)
    try:
        yield
    finally:
        note_logger.removeFilter(note_filter)


def _save_checkpoint(accelerator, output_dir: str, step: int, epoch: int, batches_in_epoch: int, curve: list,
                     flags: dict, selection: BestStepSelection | None = None):
    """``accelerator.save_state`` + ``training_state.json`` (position, curve, the run's :func:`run_flags`, the
    best-step selection) and the best step's weights, written to a temporary folder then renamed."""
    final = checkpoint_dir(output_dir, step)
    staging = final + ".partial"
    if accelerator.is_main_process and os.path.isdir(staging):
        shutil.rmtree(staging)
    accelerator.wait_for_everyone()
    with _shared_tensor_notes_dropped():
        accelerator.save_state(staging)
    accelerator.wait_for_everyone()  # every rank has written its own files (RNG states) before the rename
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
    "BestStepSelection",
    "EpochSeededSampler",
    "carve_early_stopping_split",
    "check_resumable",
    "find_checkpoint",
    "main",
    "run_flags",
    "train",
]
