"""What a linearize run reads and how long it takes (:mod:`hf_performer.recipes.linearize`): the training text, the
checks of everything the stages will read, run before any stage and before the staging area exists
(:func:`check_inputs`), and the estimate of the run's time on this machine (:func:`estimate_run_seconds`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .arguments import RecipeError

if TYPE_CHECKING:
    from .linearize import LinearizeSettings


def read_training_text(files: list[str], max_chars: int | None = None) -> str:
    """The training text: the files in order (JSON lines: their ``text`` fields), joined by blank lines, cut to the
    first ``max_chars`` characters."""
    from ..tasks.data import read_text_file

    parts, remaining = [], max_chars
    for path in files:
        if remaining is not None and remaining <= 0:
            break
        text = read_text_file(path, max_chars=remaining)
        parts.append(text)
        remaining = None if remaining is None else remaining - len(text) - 2
    return "\n\n".join(parts)


LINEARIZE_NEEDS_CAUSAL = "linearize trains next-token prediction, which needs causal attention"


def check_causal_source(source: str, needs: str = LINEARIZE_NEEDS_CAUSAL,
                        instead: str = "convert an encoder with `hf-performer convert` or `hf-performer distill`"):
    """Refuse a source that is not a causal LM: its attention must be causal (a BERT encoder has a causal-LM head
    class, but trained through bidirectional attention its next-token predictions see the tokens they predict).
    ``source`` may be a softmax model or a converted (Performer) folder; ``needs`` and ``instead`` say why a causal LM
    is needed and what to do with the model instead. Returns the source's config.

    Raises:
        RecipeError: one line naming the source and what it is.
    """
    import torch
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from ..configuration_performer import PerformerConfigError
    from ..conversion.gguf import from_pretrained_arguments
    from ..conversion.source import SourceError, check_source
    from ..favor_attention import find_attention_modules
    from ..modeling_performer import PERFORMER_CLASSES_BY_TASK

    try:
        check_source(source)
    except SourceError as error:
        raise RecipeError(str(error)) from None
    path, gguf = from_pretrained_arguments(source)
    try:
        config = AutoConfig.from_pretrained(path, **gguf)
        model_class = PERFORMER_CLASSES_BY_TASK["causal-lm"].source_model_class(config)
    except (OSError, ValueError, PerformerConfigError) as error:
        raise RecipeError(f"{source}: not a causal LM this package converts ({' '.join(str(error).split())[:300]})") \
            from None
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # BertLMHeadModel warns that a standalone causal LM needs is_decoder=True
    try:
        with torch.device("meta"):
            modules = find_attention_modules(model_class(config))
    finally:
        hf_logging.set_verbosity(verbosity)
    if not modules or not all(getattr(module, "is_causal", False) for _, module in modules):
        source_config = getattr(config, "source_config", None)  # a converted folder: say what it was converted from
        kind = source_config.model_type if source_config is not None else config.model_type
        raise RecipeError(
            f"{source} is a bidirectional {kind} model, not a causal LM: {needs} (Llama, GPT-2, Qwen2, Mistral, ...); "
            f"{instead}")
    return config


def check_conversion(arguments: dict, config) -> None:
    """Build the converted model on the meta device (no weights, no time) so that settings the convert stage would
    refuse are refused now (a projection the map's init cannot have, a softmax layer the model lacks), and refuse a
    window or a sparse cache that covers every position the model takes (every layer would be exact softmax at a
    higher cost)."""
    import torch

    from ..configuration_performer import PerformerConfig, PerformerConfigError
    from ..favor_settings import exact_budget_problem
    from ..modeling_performer import PERFORMER_CLASSES_BY_TASK

    favor = {("softmax_layers" if key == "keep_softmax_layers" else key): value for key, value in arguments.items()
             if value is not None}
    try:
        with torch.device("meta"):
            PERFORMER_CLASSES_BY_TASK["causal-lm"](PerformerConfig(source_config=config, favor_settings=favor))
    except (PerformerConfigError, ValueError, TypeError) as error:
        raise RecipeError(" ".join(str(error).split())) from None
    problem = exact_budget_problem(favor, getattr(config.get_text_config(), "max_position_embeddings", None))
    if problem:
        flag = problem.split()[0].replace("_", "-")
        raise RecipeError(f"--{problem}: every input would be exact softmax at a higher cost; give a smaller --{flag}")


def load_tokenizer(source: str):
    """The tokenizer of a model folder or GGUF file, padding with EOS when it has no pad token."""
    from transformers import AutoTokenizer

    from ..conversion.gguf import from_pretrained_arguments

    path, gguf = from_pretrained_arguments(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **gguf)
    except (OSError, ValueError, TypeError) as error:
        raise RecipeError(f"{source}: no tokenizer could be loaded ({' '.join(str(error).split())[:200]})") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_inputs(settings: LinearizeSettings, conversion: dict | None) -> dict:
    """Everything the stages will read, checked before any stage runs (and before the staging area exists, so a
    refused run leaves nothing behind): the source is a causal LM, every file reads as text
    (:func:`~hf_performer.tasks.data.read_text_file`: one line naming the file otherwise), the evaluation text is not
    the training text, and the training text holds one transfer batch and one LoRA block of tokens; ``conversion``
    (the convert stage's arguments, ``None`` without one) builds a model (:func:`check_conversion`).

    Returns:
        ``{"train_tokens", "eval_tokens"}``: the token counts, for :func:`estimate_run_seconds`.

    Raises:
        RecipeError, DataError: what is wrong, in one line.
    """
    from ..tasks.data import file_fingerprint, read_text_file, tokenize_lm_text

    settings.check()
    config = check_causal_source(settings.source)
    if conversion is not None:
        check_conversion(conversion, config)
    train_text = read_training_text(settings.train_files, settings.max_train_chars)
    eval_text = read_text_file(settings.eval_file, settings.max_eval_chars) if settings.eval_file else None
    if settings.eval_file and file_fingerprint(settings.eval_file) in {file_fingerprint(path)
                                                                        for path in settings.train_files}:
        raise RecipeError(f"--eval-file {settings.eval_file} has the same contents as a --train-file: the perplexity "
                          "would measure the training text, not the model; evaluate on held-out text (e.g. "
                          "wiki.test.raw when training on wiki.valid.raw)")
    tokenizer = load_tokenizer(settings.source)
    train_tokens = len(tokenize_lm_text(train_text, tokenizer))
    needs = []
    if not settings.baseline and settings.linear_tail and settings.transfer_steps:
        needs.append((settings.transfer_length * settings.transfer_batch_size,
                      f"one transfer batch of {settings.transfer_batch_size} x {settings.transfer_length} tokens "
                      "(--transfer-batch-size x --transfer-length)"))
    if settings.lora_steps:
        needs.append((settings.block_size, f"one LoRA block of {settings.block_size} tokens (--block-size)"))
    for tokens, what in needs:
        if train_tokens < tokens:
            raise RecipeError(f"the training text has {train_tokens} tokens, fewer than {what}: give more text or "
                              "smaller sizes")
    eval_tokens = len(tokenize_lm_text(eval_text, tokenizer)) if eval_text is not None else 0
    return {"train_tokens": train_tokens, "eval_tokens": eval_tokens}


def estimate_run_seconds(settings: LinearizeSettings, folder: str, eval_tokens: int,
                         stage_overhead_s: float | None = None) -> dict:
    """The run's time on this machine, from one timed training step and one timed evaluation window of the model in
    ``folder`` at batch 1: ``{"transfer", "lora", "evaluate", "total", "train_step_s", "eval_window_s",
    "stage_overhead_s"}`` in seconds. A rough guide: the transfer stage is counted as the training step at its length
    (it also runs a softmax teacher per layer); each stage adds the loading and saving of a model
    (``stage_overhead_s``, default: the time this call takes to load it), the LoRA stage also its checkpoints; the
    optimizer's own cost and the load of a shared machine changing during the run are not foreseen."""
    import torch
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder)
    overhead = time.perf_counter() - started if stage_overhead_s is None else stage_overhead_s
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(settings.seed)

    def seconds(length: int, train: bool) -> float:
        ids = torch.randint(0, vocab, (1, length), generator=generator)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.mixed_precision == "bf16" and train):
            started = time.perf_counter()
            if train:
                model(input_ids=ids, labels=ids).loss.backward()
            else:
                with torch.no_grad():
                    model(input_ids=ids)
            return time.perf_counter() - started

    seconds(min(16, settings.block_size), True)  # warm-up: first-call allocations and kernel selection
    train_step = seconds(settings.block_size, True)
    transfer_step = train_step * settings.transfer_length / settings.block_size
    transfer = 0.0
    if not settings.baseline and settings.linear_tail and settings.transfer_steps:
        transfer = settings.transfer_steps * settings.transfer_batch_size * transfer_step + overhead
    lora = 0.0
    if settings.lora_steps:
        checkpoints = settings.lora_steps // settings.checkpoint_interval
        lora = (settings.lora_steps * settings.batch_size * settings.gradient_accumulation_steps * train_step
                + (2 + checkpoints) * overhead)  # load, checkpoints, merge and save
    evaluate, eval_window = 0.0, 0.0
    if settings.eval_file and eval_tokens:
        eval_window = seconds(min(settings.eval_context, eval_tokens), False)
        stride = max(settings.eval_context // 2, 1)
        evaluate = (1 + max(0, -(-(eval_tokens - settings.eval_context) // stride))) * eval_window + overhead
    return {"transfer": round(transfer, 1), "lora": round(lora, 1), "evaluate": round(evaluate, 1),
            "total": round(transfer + lora + evaluate, 1), "train_step_s": round(train_step, 3),
            "eval_window_s": round(eval_window, 3), "stage_overhead_s": round(overhead, 2)}


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def format_estimate(estimate: dict, settings: LinearizeSettings) -> str:
    """One line for the console."""
    return (f"linearize: estimated time on this machine ~{_minutes(estimate['total'])} (transfer "
            f"~{_minutes(estimate['transfer'])}, LoRA ~{_minutes(estimate['lora'])}, evaluation "
            f"~{_minutes(estimate['evaluate'])}), from one timed training step of {settings.block_size} tokens "
            f"({estimate['train_step_s']:.2f} s) scaled by the steps and batch sizes; --time-limit MINUTES bounds the "
            "training stages (--preset cpu: the protocol of the committed SmolLM2-135M runs, about 35 min there)")
