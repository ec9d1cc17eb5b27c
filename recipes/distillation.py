"""Knowledge distillation from a teacher model during fine-tuning (``--teacher-model``, both recipes).

The teacher (typically the softmax model a linear-attention student was converted from) predicts every training
batch; the student's loss becomes ``task loss + weight * term`` with, per batch of B examples:

* regression (STS-B): ``term = mean_b (s_b - t_b)^2`` on the raw predictions;
* classification: ``term = T^2 * KL(softmax(t / T) || softmax(s / T))`` averaged over the batch (Hinton et al. 2015;
  the ``T^2`` keeps the gradient's scale independent of the temperature ``T``);
* causal LM: the same KL over the vocabulary at every position that is not padding, averaged over those positions.

The teacher runs in eval mode without gradients, on the training device, under the student's mixed precision
(``--mixed-precision``: a bf16 student gets a bf16-autocast teacher forward), and is checked against the task (number
of labels, problem type) and the student's vocabulary before training starts.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F

from .arguments import RecipeError

DEFAULT_DISTILLATION_WEIGHT = 1.0
DEFAULT_DISTILLATION_TEMPERATURE = 2.0


def check_distillation_options(args) -> None:
    """One-line errors for distillation options that cannot work (given without a teacher, out of range)."""
    teacher = getattr(args, "teacher_model", None)
    weight, temperature = getattr(args, "distillation_weight", None), getattr(args, "distillation_temperature", None)
    if teacher is None:
        given = [flag for flag, value in (("--distillation-weight", weight), ("--distillation-temperature",
                                                                                temperature)) if value is not None]
        if given:
            raise RecipeError(f"{' and '.join(given)} set without --teacher-model: pass the teacher's folder, or "
                              "drop the option")
        return
    if weight is not None and not weight > 0:
        raise RecipeError(f"--distillation-weight must be > 0 (the teacher term's weight), got {weight}")
    if temperature is not None and not temperature > 0:
        raise RecipeError(f"--distillation-temperature must be > 0, got {temperature}")


def distillation_term(student_logits: torch.Tensor, teacher_logits: torch.Tensor, regression: bool,
                      temperature: float) -> torch.Tensor:
    """The teacher term for one batch (float32).

    Args:
        student_logits, teacher_logits: ``[B, num_labels]`` (``[B, 1]`` for regression).
        regression: mean squared difference of the predictions instead of the tempered KL divergence.
        temperature: ``T`` of the classification term (ignored for regression).
    """
    student, teacher = student_logits.float(), teacher_logits.float()
    if regression:
        return F.mse_loss(student, teacher)
    return _TemperedKL.apply(student, teacher.detach(), float(temperature))


class _TemperedKL(torch.autograd.Function):
    """``T^2 KL(softmax(t / T) || softmax(s / T))`` averaged over the rows of ``s`` / ``t`` ``[N, V]``, with its
    gradient ``T (softmax(s / T) - softmax(t / T)) / N`` computed in the forward: the value and gradient of
    ``F.kl_div`` of two ``log_softmax``, in a few passes over the ``[N, V]`` logits instead of autograd's chain (a
    causal LM's vocabulary makes these the size of the logits: 2 x 1024 x 49,152 floats for SmolLM2)."""

    @staticmethod
    def forward(ctx, student, teacher, temperature):
        rows = max(student.shape[0], 1)
        log_student = F.log_softmax(student / temperature, dim=-1)
        log_teacher = F.log_softmax(teacher / temperature, dim=-1)
        teacher_probabilities = log_teacher.exp()
        divergence = torch.sum(teacher_probabilities * log_teacher.sub_(log_student))
        ctx.scale = temperature / rows
        ctx.save_for_backward(log_student.exp_().sub_(teacher_probabilities))  # softmax(s / T) - softmax(t / T)
        return divergence * (temperature**2 / rows)

    @staticmethod
    def backward(ctx, grad_output):
        (difference,) = ctx.saved_tensors
        return difference * (grad_output * ctx.scale), None, None


def teacher_config(path: str, student_config):
    """The teacher's config; a one-line :class:`RecipeError` if ``path`` is not a model folder or its vocabulary is
    not the student's (cheap: reads config.json only, so callers can check a teacher before hours of training)."""
    from transformers import AutoConfig

    import hf_performer  # noqa: F401 - registers the Performer classes with the Auto classes

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise RecipeError(f"--teacher-model {path!r} is not a model folder ({str(error).splitlines()[0]})") from None
    teacher_vocab = config.get_text_config().vocab_size
    student_vocab = student_config.get_text_config().vocab_size
    if teacher_vocab != student_vocab:
        raise RecipeError(f"--teacher-model {path!r} has a vocabulary of {teacher_vocab} tokens, the student "
                          f"{student_vocab}: teacher and student must share the tokenizer")
    return config


def load_teacher(path: str, num_labels: int | None, problem_type: str | None, student_config,
                 device: torch.device):
    """The teacher, in eval mode, frozen, on ``device``: a sequence classifier, or a causal LM when ``num_labels`` is
    ``None``; a one-line :class:`RecipeError` if it does not fit the task or the student's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = teacher_config(path, student_config)
    if num_labels is not None and (config.num_labels != num_labels
                                   or (config.problem_type or problem_type) != problem_type):
        raise RecipeError(f"--teacher-model {path!r} predicts {config.num_labels} label(s) "
                          f"({config.problem_type or 'problem type unset'}); this task needs {num_labels} "
                          f"({problem_type}): pass a teacher fine-tuned on the same task")
    auto_class = AutoModelForCausalLM if num_labels is None else AutoModelForSequenceClassification
    teacher = auto_class.from_pretrained(path, config=config).to(device).eval()
    teacher.requires_grad_(False)
    return teacher


def teacher_distillation_hook(teacher, regression: bool, weight: float | None = None,
                              temperature: float | None = None,
                              autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
    """A loss hook of :func:`hf_performer.recipes.train.train`: ``weight * term`` (see the module docstring) of the
    teacher's predictions on the batch against the student's ``outputs.logits``; the teacher predicts inside
    ``autocast()`` (the training loop passes its accelerator's, so the teacher runs in the student's precision)."""
    weight = DEFAULT_DISTILLATION_WEIGHT if weight is None else weight
    temperature = DEFAULT_DISTILLATION_TEMPERATURE if temperature is None else temperature

    def hook(model, batch, outputs, step):
        inputs = {name: value for name, value in batch.items() if name != "labels"}
        with torch.no_grad(), autocast():
            teacher_logits = teacher(**inputs).logits
        student_logits = outputs.logits
        if student_logits.dim() == 3:  # causal LM [B, L, V]: one distribution per position that is not padding
            mask = batch.get("attention_mask")
            keep = mask.reshape(-1).bool() if mask is not None else slice(None)
            student_logits = student_logits.reshape(-1, student_logits.shape[-1])[keep]
            teacher_logits = teacher_logits.reshape(-1, teacher_logits.shape[-1])[keep]
        return weight * distillation_term(student_logits, teacher_logits, regression, temperature)

    return hook


def teacher_hooks(args, spec, student_config, device: torch.device,
                  autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> list:
    """The loss hooks ``--teacher-model`` asks for (none without it): ``spec`` is the classification task's
    :class:`~hf_performer.tasks.data.TaskSpec`, ``None`` for the causal-LM recipe; ``autocast`` the training loop's
    mixed-precision context (``accelerator.autocast``), entered around each teacher forward."""
    if getattr(args, "teacher_model", None) is None:
        return []
    num_labels, problem_type = (spec.num_labels, spec.problem_type) if spec is not None else (None, None)
    teacher = load_teacher(args.teacher_model, num_labels, problem_type, student_config, device)
    regression = spec is not None and spec.is_regression
    return [teacher_distillation_hook(teacher, regression, args.distillation_weight, args.distillation_temperature,
                                      autocast)]


__all__ = ["check_distillation_options", "distillation_term", "load_teacher", "teacher_distillation_hook",
           "teacher_hooks"]
