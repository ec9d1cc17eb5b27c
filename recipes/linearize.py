"""Linearize a causal LM in one run (the library side of ``hf-performer linearize``; the verb is
:mod:`hf_performer.cli.linearize`): sink + sliding-window softmax with a learned linear tail, trained as LoLCATs.

Stages, each recorded in the staging area when it finishes (:data:`STAGES`), so an interrupted run continues from
the last finished stage (and the LoRA stage from its last checkpoint):

1. ``convert``: the softmax model becomes a Performer model with window settings (``window``, ``sinks``,
   ``linear_tail``, ``tail_cap``: by default the most tokens a tail holds at the training length,
   :func:`.linearize_settings.resolved_tail_cap`)
   and a learned map (hedgehog by default) started at the identity, separate query / key maps
   (``feature_map_options = {"init": "identity", "tie_qk": False}``), gamma learned;
2. ``transfer``: attention transfer of the tail (:func:`~hf_performer.conversion.attention_transfer.transfer_attention`
   with the window-output loss, x1000): only the maps and gamma train, every layer is fed the teacher's hidden
   states; packed ``transfer_length``-token sequences of the training text;
3. ``select`` (only with ``softmax_worst`` K > 0 or a ``cache_budget``): each layer's transfer loss is measured on the
   first :data:`SELECT_SEQUENCES` training sequences (teacher forcing) and the K layers the tail fits worst go back
   to exact softmax (:func:`~hf_performer.conversion.convert.keep_softmax_attention`): a trade of the constant
   decoding memory of those layers (they keep a growing key/value cache) for quality; ``softmax_layers`` names such
   layers up front instead. With ``cache_budget`` (bytes or softmax tokens at ``budget_context`` tokens) the errors
   are measured for every sparse-cache size instead and
   :func:`~hf_performer.conversion.cache_budget.allocate_cache_budget` gives each window layer the sparse cache (or
   softmax) that the budget buys best;
4. ``lora``: the recipe's training loop (:func:`hf_performer.recipes.train.train`: Accelerate, checkpoints,
   resume) with PEFT LoRA on the attention projections (maps and gamma frozen, asserted by
   :func:`~hf_performer.recipes.model.apply_lora`) on packed ``block_size``-token blocks, then merged;
5. ``evaluate``: perplexity of the merged model with the protocol of :mod:`hf_performer.tasks.evaluation`
   (windows of ``eval_context`` tokens every ``eval_context // 2``).

Before any stage (and before the staging area exists), :func:`~.linearize_inputs.check_inputs` reads and checks
everything the stages will need: every training and evaluation file (readable, UTF-8, not empty, JSON lines with
``text``), the evaluation file is not the training text, the source is a causal LM (a bidirectional encoder would be
trained on next tokens it can see), the text holds enough tokens for one transfer batch and one LoRA block; the
contents' fingerprints decide, with the settings, whether a staging area may be continued. A GGUF source is de-quantized once into the staging area
(``source/``) and every stage reads that folder. After the convert stage the run's time on this machine is
estimated (:func:`~.linearize_inputs.estimate_run_seconds`) and printed.

``baseline="softmax"`` skips 1 and 2 and runs the same LoRA stage and evaluation on the softmax model (identical
data, steps and seed). ``linear_tail=False`` (the ablation: sinks + window only) skips the transfer: there is no tail
to transfer into. Zero steps skip a stage. :func:`run_linearize` leaves the finished model folder with its card and
:data:`LINEARIZE_FILE` in ``staging_area/final``; the caller moves it into place.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
import uuid
from dataclasses import asdict, dataclass, field, replace

from .arguments import RecipeError
from .linearize_settings import LinearizeSettings, conversion_arguments
from .linearize_inputs import check_inputs, estimate_run_seconds, format_estimate, load_tokenizer, read_training_text
from .linearize_staging import StagingArea, open_staging_area

LINEARIZE_FILE = "linearize.json"
"""The record of a linearize run in its output folder: settings, every stage, the final perplexity, the curve."""
STAGES = ("convert", "transfer", "select", "lora", "evaluate")
STAGE_FOLDERS = {"convert": "converted", "transfer": "transferred", "select": "selected", "lora": "lora"}
"""The staging-area folder of the model each stage writes (``evaluate`` writes none)."""
SELECT_SEQUENCES = 2
"""Training sequences (of ``transfer_length`` tokens) the ``select`` stage measures each layer's transfer loss on."""
OUTPUT_LOSS_FACTOR = 1000.0
"""The attention-transfer loss is ``OUTPUT_LOSS_FACTOR x`` the mean squared error of the outputs (LoLCATs)."""
GGUF_SOURCE_FOLDER = "source"
"""The staging-area folder a GGUF source is de-quantized into (float32 safetensors and its tokenizer)."""
_FINAL_EXCLUDED = ("checkpoints", "adapter", "runs", "metrics.json", "eval_curve.json", "README.md", "loss_log.jsonl")


@dataclass
class StageRecord:
    """One stage's record in :data:`LINEARIZE_FILE`."""

    name: str
    status: str  # "done" or "skipped"
    reason: str | None = None
    wall_time_s: float = 0.0
    tokens_seen: int = 0
    details: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------


def transfer_batches(token_ids: list[int], length: int, batch_size: int, seed: int) -> list[dict]:
    """Packed ``[batch_size, length]`` batches (``input_ids``, ``attention_mask``) of consecutive blocks of the token
    stream, in a seeded order; the remainder is dropped."""
    import numpy as np
    import torch

    blocks = len(token_ids) // length
    if blocks < batch_size:
        raise RecipeError(f"the training text has {len(token_ids)} tokens, fewer than one transfer batch of "
                          f"{batch_size} x {length}; give more text or lower --transfer-length / --transfer-batch-size")
    ids = torch.tensor(token_ids[:blocks * length]).view(blocks, length)
    order = torch.from_numpy(np.random.default_rng(seed).permutation(blocks))
    batches = []
    for start in range(0, blocks - batch_size + 1, batch_size):
        chunk = ids[order[start:start + batch_size]]
        batches.append({"input_ids": chunk, "attention_mask": torch.ones_like(chunk)})
    return batches


# --------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------


def _deadline(settings: LinearizeSettings, started: float) -> float | None:
    return None if settings.time_limit is None else started + settings.time_limit * 60


def stage_convert(settings: LinearizeSettings, area: StagingArea) -> StageRecord:
    """Convert the source into a window-hybrid Performer saved in ``converted/``."""
    from ..conversion import ConversionError, convert_to_performer, load_source

    if settings.baseline:
        return StageRecord("convert", "skipped", "--baseline softmax: the softmax model is trained as it is")
    started = time.perf_counter()
    try:
        source, tokenizer = load_source(settings.source, "causal-lm")
        if tokenizer is None:
            raise RecipeError(f"{settings.source} has no usable tokenizer to encode the training text")
        model = convert_to_performer(source, task="causal-lm", **conversion_arguments(settings))
    except (ConversionError, ValueError, TypeError) as error:
        raise RecipeError(str(error)) from None
    if settings.cache_budget is not None:
        _budget_plan(settings, model)  # refused now, not after the transfer
    folder = area.file(STAGE_FOLDERS["convert"])
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return StageRecord("convert", "done", wall_time_s=round(time.perf_counter() - started, 2),
                       details={"favor_settings": dict(model.config.favor_settings)})


def _model_folder(settings: LinearizeSettings, area: StagingArea, state: dict, before: str) -> str:
    """The folder of the model the stage ``before`` starts from: the last stage that wrote one."""
    for stage in reversed(STAGES[:STAGES.index(before)]):
        if stage in STAGE_FOLDERS and state["stages"].get(stage, {}).get("status") == "done":
            return area.file(STAGE_FOLDERS[stage])
    return settings.source


def _packed_training_batches(settings: LinearizeSettings, area: StagingArea, state: dict, stage: str,
                             batch_size: int) -> tuple[str, object, list[dict]]:
    """The folder ``stage`` starts from, its tokenizer and the training text as packed ``[batch_size,
    transfer_length]`` batches in the seeded order (:func:`transfer_batches`)."""
    from ..tasks.data import tokenize_lm_text

    folder = _model_folder(settings, area, state, stage)
    tokenizer = load_tokenizer(folder)
    text = read_training_text(settings.train_files, settings.max_train_chars)
    return folder, tokenizer, transfer_batches(tokenize_lm_text(text, tokenizer), settings.transfer_length,
                                               batch_size, settings.seed)


def stage_transfer(settings: LinearizeSettings, area: StagingArea, state: dict, deadline: float | None) -> StageRecord:
    """Attention transfer of the tail (maps and gamma only) on packed sequences; saved in ``transferred/``."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..conversion.attention_transfer import transfer_attention

    if settings.baseline:
        return StageRecord("transfer", "skipped", "--baseline softmax: no conversion, nothing to transfer")
    if not settings.linear_tail:
        return StageRecord("transfer", "skipped", "--no-tail: sinks + window exact softmax only, no linear tail to "
                                                  "transfer into (gamma cancels without a tail)")
    if settings.transfer_steps == 0:
        return StageRecord("transfer", "skipped", "--transfer-steps 0")
    started = time.perf_counter()
    folder, tokenizer, batches = _packed_training_batches(settings, area, state, "transfer",
                                                          settings.transfer_batch_size)
    torch.manual_seed(settings.seed)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=settings.mixed_precision == "bf16"):
        result = transfer_attention(model, batches, steps=settings.transfer_steps,
                                learning_rate=settings.transfer_learning_rate, schedule=settings.transfer_schedule,
                                    loss="output", output_loss_factor=OUTPUT_LOSS_FACTOR, evaluation_batches=[],
                                    progress=settings.progress, deadline=deadline)
    target = area.file(STAGE_FOLDERS["transfer"])
    shutil.rmtree(target, ignore_errors=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    tokens_per_step = settings.transfer_length * settings.transfer_batch_size
    done = len(result.history)
    curve = [{"step": point["step"], "tokens_seen": point["step"] * tokens_per_step, "loss": point["loss_per_layer"],
              "step_time_s": round(point["time_s"] - previous["time_s"], 3),
              "step_cpu_s": round(point["cpu_s"] - previous["cpu_s"], 3)}
             for previous, point in zip([{"time_s": 0.0, "cpu_s": 0.0}, *result.history], result.history)]
    return StageRecord(
        "transfer", "done", reason=result.stop_reason, wall_time_s=round(time.perf_counter() - started, 2),
        tokens_seen=done * tokens_per_step,
        details={"steps_requested": settings.transfer_steps, "steps_done": done, "sequences": len(batches) *
                 settings.transfer_batch_size, "loss": f"mean over layers of {OUTPUT_LOSS_FACTOR:g} x MSE of the "
                 "per-head attention outputs (before o_proj), teacher forcing", "layers": result.layers,
                 "trained": "feature maps and softmax weights (gamma) only", "schedule": settings.transfer_schedule,
                 "curve": curve},
    )


class _LossLog:
    """A recipe loss hook that appends each micro-batch's loss to ``loss_log.jsonl`` (kept across a resume)."""

    def __init__(self, path: str, is_main_process: bool):
        self.path, self.is_main_process = path, is_main_process
        self.attempt = uuid.uuid4().hex  # this run of the stage; a resumed stage's log holds several

    def __call__(self, model, batch, outputs, step):
        if self.is_main_process:
            with open(self.path, "a") as handle:
                handle.write(json.dumps({"step": step + 1, "loss": float(outputs.loss.detach()),
                                         "time": time.time(), "cpu": time.process_time(),
                                         "attempt": self.attempt}) + "\n")
        return None

    def earlier_attempts_seconds(self) -> float:
        """Training time of the interrupted runs this one resumes, from their kept steps: each run's span between its
        first and last logged step plus one median step for its first (model loading and the steps redone after the
        last checkpoint are not counted)."""
        spans: dict[str, list[float]] = {}
        for entry in self.entries():
            if entry["attempt"] != self.attempt:
                spans.setdefault(entry["attempt"], []).append(entry["time"])
        step_times = [point["step_time_s"] for point in self.steps() if "step_time_s" in point]
        first_step = statistics.median(step_times) if step_times else 0.0
        return sum(max(times) - min(times) + first_step for times in spans.values())

    def entries(self) -> list[dict]:
        if not os.path.isfile(self.path):
            return []
        with open(self.path) as handle:
            return [json.loads(line) for line in handle if line.strip()]

    def keep_steps_up_to(self, step: int) -> None:
        """Drop the entries of steps after ``step`` (a resumed run redoes them)."""
        kept = [entry for entry in self.entries() if entry["step"] <= step]
        with open(self.path, "w") as handle:
            handle.writelines(json.dumps(entry) + "\n" for entry in kept)

    def steps(self) -> list[dict]:
        """``[{"step", "loss", "step_time_s", "step_cpu_s"}]``, one per optimizer step (micro-batches averaged; the
        wall and process CPU time since the previous step, none for the first step of a run)."""
        by_step: dict[int, list[dict]] = {}
        for entry in self.entries():
            by_step.setdefault(entry["step"], []).append(entry)
        points, previous = [], None
        for step, entries in sorted(by_step.items()):
            point = {"step": step, "loss": sum(e["loss"] for e in entries) / len(entries)}
            if previous is not None and previous["step"] == step - 1 and previous["attempt"] == entries[-1]["attempt"]:
                point["step_time_s"] = round(entries[-1]["time"] - previous["time"], 3)
                point["step_cpu_s"] = round(entries[-1]["cpu"] - previous["cpu"], 3)
            points.append(point)
            previous = {"step": step, **entries[-1]}
        return points


def stage_select(settings: LinearizeSettings, area: StagingArea, state: dict) -> StageRecord:
    """With ``softmax_worst`` K > 0: put the K layers with the largest transfer loss back on exact softmax; saved in
    ``selected/`` with every layer's loss in the record."""
    from transformers import AutoModelForCausalLM

    from ..conversion import keep_softmax_attention
    from ..conversion.attention_transfer import measure_transfer_losses

    if settings.baseline:
        return StageRecord("select", "skipped", "--baseline softmax: every layer is softmax")
    if settings.softmax_worst == 0 and settings.cache_budget is None:
        return StageRecord("select", "skipped", "--softmax-worst 0: no layer goes back to softmax")
    started = time.perf_counter()
    folder, tokenizer, batches = _packed_training_batches(settings, area, state, "select", 1)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    if settings.cache_budget is not None:
        details = _allocate_budget(settings, model, batches[:SELECT_SEQUENCES])
        _save_stage_model(area, "select", model, tokenizer)
        return StageRecord("select", "done", wall_time_s=round(time.perf_counter() - started, 2), details=details)
    measured = measure_transfer_losses(model, batches[:SELECT_SEQUENCES])
    losses = {layer: OUTPUT_LOSS_FACTOR * entry["output_squared_error"] for layer, entry in measured.items()}
    if settings.softmax_worst > len(losses):
        raise RecipeError(f"--softmax-worst {settings.softmax_worst} is more than the {len(losses)} layers with a "
                          f"window / tail; accepted: 0 to {len(losses)}")
    worst = sorted(sorted(losses, key=losses.get, reverse=True)[:settings.softmax_worst])
    softmax_layers = keep_softmax_attention(model, worst)  # the layers come from the model: no index to refuse
    _save_stage_model(area, "select", model, tokenizer)
    return StageRecord(
        "select", "done", wall_time_s=round(time.perf_counter() - started, 2),
        details={"loss": f"{OUTPUT_LOSS_FACTOR:g} x MSE of each layer's attention output against exact softmax, "
                         f"teacher forcing, on the first {min(SELECT_SEQUENCES, len(batches))} training sequences "
                         f"of {settings.transfer_length} tokens",
                 "layer_losses": {str(layer): round(value, 4) for layer, value in sorted(losses.items())},
                 "worst_layers": worst, "softmax_layers": softmax_layers},
    )


def _save_stage_model(area: StagingArea, stage: str, model, tokenizer) -> None:
    target = area.file(STAGE_FOLDERS[stage])
    shutil.rmtree(target, ignore_errors=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def _budget_plan(settings: LinearizeSettings, model) -> tuple[int, list[int], int]:
    """``(budget bytes, sparse-cache sizes to measure, dtype bytes)`` of ``--cache-budget`` for ``model``, refused in
    one line when the budget is below the model's smallest decoding state (checked right after the conversion)."""
    from ..conversion.cache_budget import (
        CACHE_SIZES, CacheBudgetError, check_budget_reachable, parse_cache_budget, softmax_token_bytes,
        torch_dtype_bytes,
    )

    dtype_bytes = torch_dtype_bytes(model)
    sizes = [size for size in sorted({*CACHE_SIZES, settings.sparse_cache}) if 2 * size <= settings.transfer_length]
    try:
        budget = parse_cache_budget(settings.cache_budget, softmax_token_bytes(model.config, dtype_bytes))
        check_budget_reachable(model, budget, settings.budget_context, sizes, dtype_bytes)
    except CacheBudgetError as error:
        raise RecipeError(str(error)) from None
    return budget, sizes, dtype_bytes


def _allocate_budget(settings: LinearizeSettings, model, batches: list[dict]) -> dict:
    """``--cache-budget``: each window layer's sparse cache (or softmax) chosen by
    :func:`~hf_performer.conversion.cache_budget.allocate_cache_budget` from its measured errors; the model gets it."""
    from ..conversion.cache_budget import allocate_cache_budget, apply_cache_allocation, measure_option_errors

    budget, sizes, dtype_bytes = _budget_plan(settings, model)
    errors = measure_option_errors(model, batches, sizes)
    allocation = allocate_cache_budget(model, errors, budget, settings.budget_context, dtype_bytes=dtype_bytes)
    apply_cache_allocation(model, allocation)
    return {"cache_budget": allocation.to_dict(),
            "loss": f"mean squared error of each layer's attention output against exact softmax, teacher forcing, on "
                    f"the first {len(batches)} training sequences of {settings.transfer_length} tokens"}


def stage_lora(settings: LinearizeSettings, area: StagingArea, state: dict, deadline: float | None) -> StageRecord:
    """The recipe's LoRA fine-tuning (merged at the end) in ``lora/``, resumed from its last checkpoint."""
    from accelerate import PartialState

    from .arguments import build_parser
    from .train import train

    if settings.lora_steps == 0:
        return StageRecord("lora", "skipped", "--lora-steps 0")
    started = time.perf_counter()
    folder = area.file(STAGE_FOLDERS["lora"])
    model = _model_folder(settings, area, state, "lora")
    processes = PartialState()
    train_text = area.file("train.txt")
    if processes.is_main_process and not os.path.isfile(train_text):
        with open(train_text + ".tmp", "w", encoding="utf-8") as handle:
            handle.write(read_training_text(settings.train_files, settings.max_train_chars))
        os.replace(train_text + ".tmp", train_text)
    checkpoints = os.path.join(folder, "checkpoints")
    resume = os.path.isdir(checkpoints) and any(name.startswith("step_") and not name.endswith(".partial")
                                                 for name in os.listdir(checkpoints))
    every = settings.checkpoint_interval
    argv = [  # --no-evaluation: the evaluate stage scores the merged model, once
        "--model", model, "--attention", "softmax" if settings.baseline else "favor", "--lora",
        "--lora-r", str(settings.lora_r), "--lora-alpha", str(settings.lora_alpha),
        "--train-file", train_text, "--no-evaluation", "--block-size", str(settings.block_size),
        "--per-device-train-batch-size", str(settings.batch_size),
        "--gradient-accumulation-steps", str(settings.gradient_accumulation_steps),
        "--learning-rate", str(settings.learning_rate), "--max-train-steps", str(settings.lora_steps),
        "--seed", str(settings.seed), "--output-dir", folder, "--checkpointing-steps", str(every),
        "--mixed-precision", settings.mixed_precision,
    ]
    if settings.lora_target_modules:
        argv += ["--lora-target-modules", *settings.lora_target_modules]
    if settings.window_dropout:
        argv += ["--window-dropout", str(settings.window_dropout)]
    if settings.teacher_weight is not None:  # knowledge distillation on every batch (default teacher: the source)
        argv += ["--teacher-model", settings.teacher_model or settings.source,
                 "--distillation-weight", str(settings.teacher_weight)]
    if deadline is not None:
        argv += ["--time-limit", f"{max(deadline - time.time(), 1.0) / 60:.4f}"]
    argv += ["--resume-from-checkpoint", "latest"] if resume else ["--overwrite"]
    argv += [] if settings.progress else ["--no-progress"]
    args = build_parser("causal-lm").parse_args(argv)
    log = _LossLog(os.path.join(folder, "loss_log.jsonl"), processes.is_main_process)
    if not processes.is_main_process:
        pass
    elif not resume and os.path.isfile(log.path):
        os.remove(log.path)
    elif resume:
        from .train import TRAINING_STATE_FILE, find_checkpoint

        with open(os.path.join(find_checkpoint(folder, "latest"), TRAINING_STATE_FILE)) as handle:
            log.keep_steps_up_to(json.load(handle)["completed_steps"])
    os.makedirs(folder, exist_ok=True)
    processes.wait_for_everyone()
    metrics = train(args, loss_hooks=[log])
    tokens_per_step = settings.block_size * settings.batch_size * settings.gradient_accumulation_steps * \
        metrics["num_processes"]
    done = metrics["completed_steps"]
    curve = [{**point, "tokens_seen": point["step"] * tokens_per_step} for point in log.steps() if point["step"] <= done]
    if processes.is_main_process:
        shutil.rmtree(checkpoints, ignore_errors=True)  # the merged model is saved; checkpoints are large
    earlier = log.earlier_attempts_seconds()
    return StageRecord(
        "lora", "done", reason=metrics.get("time_limit_reason"),
        wall_time_s=round(time.perf_counter() - started + earlier, 2), tokens_seen=done * tokens_per_step,
        details={"steps_requested": settings.lora_steps, "steps_done": done, "resumed_from": metrics["resumed_from"],
                 "earlier_attempts_s": round(earlier, 2),
                 "train_blocks": metrics["train_examples"], "trainable_parameters": metrics["trainable_parameters"],
                 "total_parameters": metrics["total_parameters"], "learning_rate": settings.learning_rate,
                 "schedule": {k: metrics["args"][k] for k in ("lr_scheduler", "warmup_ratio", "weight_decay",
                                                              "lora_dropout", "max_grad_norm")},
                 "lora_target_modules": metrics["args"].get("lora_target_modules"), "merged": True,
                 "train_loss_first": metrics["train_loss_first"], "train_loss_last": metrics["train_loss_last"],
                 "num_processes": metrics["num_processes"], "curve": curve},
    )


def stage_evaluate(settings: LinearizeSettings, area: StagingArea, state: dict) -> StageRecord:
    """Perplexity of the final (merged) model on the evaluation text, protocol of :mod:`~hf_performer.tasks.evaluation`."""
    from transformers import AutoModelForCausalLM

    from ..tasks.data import load_lm_text, tokenize_lm_text
    from ..tasks.evaluation import perplexity

    if not settings.eval_file:
        return StageRecord("evaluate", "skipped", "no --eval-file")
    started = time.perf_counter()
    folder = _model_folder(settings, area, state, "evaluate")
    tokenizer = load_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tokenize_lm_text(load_lm_text(settings.eval_file, max_chars=settings.max_eval_chars), tokenizer)
    stride = max(settings.eval_context // 2, 1)
    result = perplexity(model, ids, settings.eval_context, stride, settings.eval_batch_size,
                        show_progress=settings.progress)
    return StageRecord("evaluate", "done", wall_time_s=round(time.perf_counter() - started, 2),
                       details={**result, "eval_file": os.path.basename(settings.eval_file),
                                "max_eval_chars": settings.max_eval_chars})


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def run_linearize(settings: LinearizeSettings, staging_path: str, *, stop_after: str | None = None,
                  command: str | None = None, model_name: str | None = None) -> dict | None:
    """Run (or continue) every unfinished stage in the staging area, then write ``staging_path/final``: the model
    folder, its tokenizer, its card and :data:`LINEARIZE_FILE`.

    Args:
        settings: the run (checked first: :meth:`LinearizeSettings.check`).
        staging_path: the staging area (see :func:`open_staging_area`).
        stop_after: stop once this stage is finished (an interruption between stages, for tests).
        command: the command line to record (no absolute paths).
        model_name: the title of the model card (default: the source's name and the run's kind).

    Returns:
        The content of :data:`LINEARIZE_FILE`, or ``None`` when stopped by ``stop_after``.
    """
    from accelerate import PartialState

    if stop_after is not None and stop_after not in STAGES:
        raise RecipeError(f"stop_after must be one of {STAGES}, got {stop_after!r}")
    processes = PartialState()  # under accelerate launch / torchrun: only the LoRA stage runs in every process
    with processes.main_process_first():
        conversion = None if settings.baseline else conversion_arguments(settings)
        inputs = check_inputs(settings, conversion) if processes.is_main_process else None  # before staging exists
        area, state = open_staging_area(staging_path, settings)
    try:
        staged = _stage_settings(settings, area, processes)
        record = _run_stages(staged, area, state, processes, inputs, stop_after)
        if record is None:
            return None
    except BaseException as error:
        if processes.is_main_process and not state["stages"] and not isinstance(error, KeyboardInterrupt):
            shutil.rmtree(area.path, ignore_errors=True)  # nothing finished: nothing to resume, nothing to block
        raise
    return _write_final(settings, staged, area, state, command, model_name)


def _stage_settings(settings: LinearizeSettings, area: StagingArea, processes) -> LinearizeSettings:
    """The settings the stages run with: a GGUF source is de-quantized once into the staging area's ``source/``
    (float32 safetensors and tokenizer) and read from there; the record keeps the file's name."""
    from ..conversion.gguf import forget_gguf_quantization, from_pretrained_arguments, is_gguf_file

    if not is_gguf_file(settings.source):
        return settings
    folder = area.file(GGUF_SOURCE_FOLDER)
    if processes.is_main_process and not os.path.isfile(os.path.join(folder, "config.json")):
        from transformers import AutoModelForCausalLM

        path, gguf = from_pretrained_arguments(settings.source)
        print(f"linearize: de-quantizing {os.path.basename(settings.source)} into the staging area (once)")
        model = AutoModelForCausalLM.from_pretrained(path, **gguf)
        forget_gguf_quantization(model)
        shutil.rmtree(folder + ".partial", ignore_errors=True)
        model.save_pretrained(folder + ".partial")
        load_tokenizer(settings.source).save_pretrained(folder + ".partial")
        os.replace(folder + ".partial", folder)
    processes.wait_for_everyone()
    return replace(settings, source=folder)


def _run_stages(settings: LinearizeSettings, area: StagingArea, state: dict, processes, inputs: dict | None,
                stop_after: str | None) -> dict | None:
    """Run every unfinished stage; ``state`` when all are done, ``None`` when stopped (``stop_after``, or a process
    other than the main one after the LoRA stage). After the convert stage the main process estimates the run's time
    on this machine (once, recorded in the staging area)."""
    deadline = _deadline(settings, time.time())
    runners = {
        "convert": lambda: stage_convert(settings, area),
        "transfer": lambda: stage_transfer(settings, area, state, deadline),
        "select": lambda: stage_select(settings, area, state),
        "lora": lambda: stage_lora(settings, area, state, deadline),
        "evaluate": lambda: stage_evaluate(settings, area, state),
    }
    for name in STAGES:
        if name == "lora" and processes.num_processes > 1:
            processes.wait_for_everyone()
            state.update(area.read())  # the stages the main process ran
        if name in state["stages"]:
            processes.print(f"linearize: stage {name} already finished ({state['stages'][name]['status']}): skipped")
        elif processes.is_main_process or name == "lora":
            record = runners[name]()
            if processes.is_main_process:
                state["stages"][name] = asdict(record)
                area.write(state)
                print(f"linearize: stage {name} {record.status}" + (f" ({record.reason})" if record.reason else ""))
        if name == "convert" and processes.is_main_process and "estimate" not in state and inputs is not None:
            convert = state["stages"]["convert"]
            state["estimate"] = estimate_run_seconds(
                settings, _model_folder(settings, area, state, "transfer"), inputs["eval_tokens"],
                stage_overhead_s=convert["wall_time_s"] if convert["status"] == "done" else None)
            area.write(state)
            print(format_estimate(state["estimate"], settings))
        if name == stop_after or (name == "lora" and not processes.is_main_process):
            return None  # the recipe ended the process group: the main process evaluates and writes alone
    return state


def _write_final(settings: LinearizeSettings, staged: LinearizeSettings, area: StagingArea, state: dict,
                 command: str | None, model_name: str | None) -> dict:
    """Write ``final/``: the model the last stage left (``staged``: the settings the stages ran with), its
    tokenizer, :data:`LINEARIZE_FILE` (``settings``: as given) and the model card."""
    from ..hub import write_model_card
    from .results import portable_name

    final = area.file("final")
    shutil.rmtree(final, ignore_errors=True)
    model_folder = _model_folder(staged, area, state, "evaluate")
    if model_folder == staged.source:  # baseline without LoRA: the source as it is
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(model_folder).save_pretrained(final)
        load_tokenizer(model_folder).save_pretrained(final)
    else:
        shutil.copytree(model_folder, final, ignore=lambda _, names: [n for n in names if n in _FINAL_EXCLUDED])
    record = linearize_record(settings, state, command)
    with open(os.path.join(final, LINEARIZE_FILE), "w") as handle:
        json.dump(record, handle, indent=2)
    with open(os.path.join(final, "config.json")) as handle:
        is_performer = "favor_settings" in json.load(handle)
    if is_performer:
        name = model_name or f"{portable_name(settings.source)}-{record['kind']}"
        write_model_card(final, model_name=name, fine_tuned=state["stages"]["lora"]["status"] == "done")
    else:
        perplexity = record["perplexity"]
        with open(os.path.join(final, "README.md"), "w") as handle:
            handle.write(f"# {portable_name(settings.source)}: softmax baseline of `hf-performer linearize`\n\n"
                         "The softmax model after the same LoRA stage (data, steps, seed) as the linearized models it is "
                         f"compared with. Perplexity: {perplexity if perplexity is not None else 'not evaluated'} "
                         f"(see `{LINEARIZE_FILE}`).\n")
    return record


def linearize_record(settings: LinearizeSettings, state: dict, command: str | None) -> dict:
    """The content of :data:`LINEARIZE_FILE`: settings (paths by base name), stages, perplexity, the curve."""
    import torch

    from ..bench.machine import machine_info
    from .results import portable_name

    recorded = asdict(settings)
    recorded["source"] = portable_name(settings.source)
    recorded["teacher_model"] = portable_name(settings.teacher_model)
    recorded["train_files"] = [os.path.basename(path) for path in settings.train_files]
    recorded["eval_file"] = os.path.basename(settings.eval_file) if settings.eval_file else None
    stages = {name: dict(state["stages"][name]) for name in STAGES}
    curve, tokens = [], 0
    for name in ("transfer", "lora"):
        for point in stages[name].get("details", {}).get("curve", []):
            curve.append({"stage": name, **point, "tokens_seen": tokens + point["tokens_seen"]})
        tokens += stages[name]["tokens_seen"]
    evaluation = stages["evaluate"]
    perplexity = evaluation["details"].get("perplexity") if evaluation["status"] == "done" else None
    if perplexity is not None:
        curve.append({"stage": "evaluate", "tokens_seen": tokens, "perplexity": perplexity})
    return {
        "kind": "baseline-softmax" if settings.baseline else ("window-only" if not settings.linear_tail else "hybrid"),
        "settings": recorded,
        "stages": stages,
        "perplexity": perplexity,
        "perplexity_protocol": None if perplexity is None else {
            k: evaluation["details"][k] for k in ("context_length", "stride", "windows", "num_tokens")},
        "tokens_seen": tokens,
        "wall_time_s": round(sum(stage["wall_time_s"] for stage in stages.values()), 2),
        "estimate_s": state.get("estimate"),
        "curve": curve,
        "machine": machine_info(torch.device("cpu")),
        "command": command,
    }


__all__ = [
    "LINEARIZE_FILE",
    "STAGES",
    "STAGE_FOLDERS",
    "LinearizeSettings",
    "StageRecord",
    "open_staging_area",
    "read_training_text",
    "run_linearize",
    "transfer_batches",
]
