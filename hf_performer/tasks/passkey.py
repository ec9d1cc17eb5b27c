"""Passkey retrieval: can a causal LM recall a number hidden at a given depth of a long context?

The standard probe (Mohtashami & Jaggi 2023, "Landmark Attention"; LongLoRA's passkey test): a prompt of exactly
``context_length`` tokens

    HEADER  FILLER[:before]  NEEDLE  FILLER[before:]  QUESTION

with ``HEADER`` = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I
will quiz you about the important information there.", ``NEEDLE`` = " The pass key is NNNNN. Remember it. NNNNN
is the pass key." and ``QUESTION`` = " What is the pass key? The pass key is". The filler is either the classic
repeated sentences (:data:`CLASSIC_FILLER`) or real text (a file, e.g. WikiText; each trial starts at a seeded
token offset of it), cut to the token budget. ``depth`` is the fraction of the filler placed before the needle
(0: right after the header, 1: right before the question). The key is a seeded 5-digit number.

Scoring, one forward pass per trial over the prompt followed by the right answer (teacher forcing):

* ``correct``: the greedy continuation of the prompt is the key: at every answer position the argmax is the
  answer's token, and the argmax after the key is not a digit (greedy decoding would emit more digits). Greedy
  decoding follows the teacher-forced path for as long as its argmaxes are right, so this is exactly "greedy
  decoding produces the key" without running ``generate`` (also for models without a cache);
* ``key_log_likelihood``: ``log p(answer tokens | prompt)`` in nats (summed over the answer's tokens);
* ``greedy``: the greedy continuation (the key's tokens and one more), cut after its first wrong token.

Everything is seeded: the same ``seed`` gives the same keys, offsets and prompts on any machine.
"""

from __future__ import annotations

import inspect
import math
import os
import time
from collections.abc import Sequence

from .evaluation import EvaluationError, _load_tokenizer, _no_grad, _progress_bar, load_causal_lm

HEADER = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
          "I will quiz you about the important information there.")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
CLASSIC_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""The classic filler, repeated to length."""

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
KEY_DIGITS = 5


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class PasskeyPrompts:
    """Builds passkey prompts of an exact token length from one tokenizer and one filler.

    Args:
        tokenizer: the model's tokenizer.
        filler_text: text to hide the key in (``None``: :data:`CLASSIC_FILLER` repeated). Real text is tokenised
            once; each trial reads it from a seeded offset (wrapping around when it is short).
    """

    def __init__(self, tokenizer, filler_text: str | None = None):
        from .data import tokenize_lm_text

        self.tokenizer = tokenizer
        self.classic = filler_text is None
        self.header_ids = _ids(tokenizer, HEADER)
        self.question_ids = _ids(tokenizer, QUESTION)
        self.filler_ids = tokenize_lm_text(CLASSIC_FILLER if self.classic else filler_text, tokenizer)
        if not self.filler_ids:
            raise EvaluationError("the passkey filler text is empty")

    def answer_ids(self, key: str) -> list[int]:
        """Tokens of `` NNNNN`` as they follow the question (the tokenisation of question + answer, minus the
        question's tokens; the answer alone when the question's tokens are not a prefix of it)."""
        both = _ids(self.tokenizer, QUESTION + " " + key)
        if both[:len(self.question_ids)] == self.question_ids and len(both) > len(self.question_ids):
            return both[len(self.question_ids):]
        return _ids(self.tokenizer, " " + key)

    def filler(self, length: int, offset: int) -> list[int]:
        """``length`` filler tokens from ``offset`` (cyclic)."""
        ids, taken = self.filler_ids, []
        position = offset % len(ids)
        while len(taken) < length:
            taken += ids[position:position + length - len(taken)]
            position = 0
        return taken

    def build(self, context_length: int, depth: float, key: str, offset: int = 0) -> dict:
        """One prompt of exactly ``context_length`` tokens.

        Returns:
            ``{"input_ids": [context_length], "answer_ids": [a], "needle_start", "key_start", "filler_before",
            "filler_after"}``: ``input_ids[key_start:key_start + len(key tokens)]`` spell the key's first mention.
        """
        if not 0.0 <= depth <= 1.0:
            raise EvaluationError(f"passkey depth must be in [0, 1] (fraction of the filler before the key), "
                                  f"got {depth}")
        needle_ids = _ids(self.tokenizer, NEEDLE.format(key=key))
        budget = context_length - len(self.header_ids) - len(needle_ids) - len(self.question_ids)
        if budget < 0:
            raise EvaluationError(
                f"passkey context length {context_length} is shorter than the prompt without filler "
                f"({context_length - budget} tokens); accepted: context lengths >= {context_length - budget}")
        before = round(depth * budget)
        filler = self.filler(budget, offset)
        input_ids = self.header_ids + filler[:before] + needle_ids + filler[before:] + self.question_ids
        prefix_ids = _ids(self.tokenizer, NEEDLE.split("{key}")[0].rstrip())
        return {"input_ids": input_ids, "answer_ids": self.answer_ids(key),
                "needle_start": len(self.header_ids) + before,
                "key_start": len(self.header_ids) + before + _common_prefix(prefix_ids, needle_ids),
                "filler_before": before, "filler_after": budget - before}


def _common_prefix(first: list[int], second: list[int]) -> int:
    length = 0
    while length < min(len(first), len(second)) and first[length] == second[length]:
        length += 1
    return length


def trial_settings(seed: int, context_length: int, depth_index: int, trial: int, filler_tokens: int,
                   classic: bool) -> tuple[str, int]:
    """The seeded key (5 digits, no leading zero) and filler offset of one trial."""
    import numpy as np

    rng = np.random.default_rng([seed, context_length, depth_index, trial])
    key = str(int(rng.integers(10 ** (KEY_DIGITS - 1), 10 ** KEY_DIGITS)))
    offset = 0 if classic else int(rng.integers(0, filler_tokens))
    return key, offset


def _starts_with_digit(tokenizer, token_id: int) -> bool:
    text = tokenizer.decode([token_id]).lstrip()
    return bool(text) and text[0].isdigit()


@_no_grad
def score_passkey_batch(model, tokenizer, prompts: list[dict]) -> list[dict]:
    """Score prompts of one length in one forward pass (module docstring).

    Args:
        model: a causal LM (``logits`` ``[B, L, vocab]``).
        prompts: :meth:`PasskeyPrompts.build` outputs with the same ``len(input_ids)`` and answer length.

    Returns:
        per prompt ``{"correct", "key_log_likelihood", "greedy", "matches"}`` (``matches``: per answer token,
        whether it is the argmax).
    """
    import torch

    answer_length = len(prompts[0]["answer_ids"])
    if any(len(p["input_ids"]) != len(prompts[0]["input_ids"]) or len(p["answer_ids"]) != answer_length
           for p in prompts):
        raise EvaluationError("a passkey batch needs prompts and answers of one length each")
    device = next(model.parameters()).device
    batch = torch.tensor([p["input_ids"] + p["answer_ids"] for p in prompts], device=device)  # [B, L + a]
    kwargs = {"use_cache": False}
    parameters = inspect.signature(model.forward).parameters
    if "logits_to_keep" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        # The vocabulary is large: only the answer's logits (a model that ignores it returns all; sliced below).
        # Performer models pass it on when their source model takes it.
        kwargs["logits_to_keep"] = answer_length + 1
    logits = model(input_ids=batch, **kwargs).logits[:, -(answer_length + 1):].float()  # [B, a + 1, vocab]
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    answers = batch[:, -answer_length:]  # [B, a]
    answer_log_probs = log_probs[:, :-1].gather(-1, answers[..., None]).squeeze(-1)  # [B, a]
    greedy = logits.argmax(dim=-1)  # [B, a + 1]: the argmax at each answer position, then after the key
    results = []
    for row, prompt in enumerate(prompts):
        matches = (greedy[row, :-1] == answers[row]).tolist()
        wrong = matches.index(False) if False in matches else answer_length
        after_key = int(greedy[row, -1])
        greedy_ids = prompt["answer_ids"][:wrong] + [int(greedy[row, wrong])]
        correct = wrong == answer_length and not _starts_with_digit(tokenizer, after_key)
        results.append({"correct": bool(correct), "key_log_likelihood": float(answer_log_probs[row].sum()),
                        "greedy": tokenizer.decode(greedy_ids), "matches": matches})
    return results


def check_passkey_settings(context_lengths: Sequence[int], depths: Sequence[float], trials: int) -> None:
    """Raise :class:`EvaluationError` (what is wrong, what is accepted) before any model is loaded."""
    if trials < 1:
        raise EvaluationError(f"passkey trials must be >= 1, got {trials}")
    if not context_lengths or not depths:
        raise EvaluationError("passkey needs at least one context length and one depth")
    bad_depths = [depth for depth in depths if not 0.0 <= float(depth) <= 1.0]
    if bad_depths:
        raise EvaluationError(f"passkey depths must be in [0, 1] (fraction of the filler before the key), got "
                              f"{bad_depths}")
    if min(context_lengths) < 1:
        raise EvaluationError(f"passkey context lengths must be positive token counts, got {list(context_lengths)}")


def passkey_retrieval(model, tokenizer, context_lengths: Sequence[int], depths: Sequence[float] = DEFAULT_DEPTHS,
                      trials: int = 5, seed: int = 0, filler_text: str | None = None, batch_size: int = 1,
                      show_progress: bool = False) -> dict:
    """Passkey accuracy per (context length, depth) (module docstring).

    Args:
        model: a causal LM; tokenizer: its tokenizer.
        context_lengths: prompt lengths in tokens (e.g. ``[1024, 2048]``).
        depths: fractions of the filler before the key, each in ``[0, 1]``.
        trials: prompts per (length, depth), each with its own seeded key (and filler offset for real text).
        seed: the seed of the keys and offsets.
        filler_text: real text to use as filler (``None``: the classic repeated sentences).
        batch_size: prompts per forward pass.
        show_progress: a tqdm bar over prompts (on a terminal only).

    Returns:
        ``{"cells": [{"context_length", "depth", "trials", "accuracy", "standard_error", "key_log_likelihood_mean",
        "keys", "correct", "key_positions"}], "by_context_length": {length: accuracy}, "accuracy", "standard_error",
        "trials_total"}`` (:func:`run_retrieval_cells`).
    """
    check_passkey_settings(context_lengths, depths, trials)
    builder = PasskeyPrompts(tokenizer, filler_text)

    def make_prompt(context_length, depth_index, depth, trial):
        key, offset = trial_settings(seed, context_length, depth_index, trial, len(builder.filler_ids),
                                     builder.classic)
        prompt = builder.build(context_length, depth, key, offset)
        return prompt | {"record": {"keys": key, "key_positions": prompt["key_start"]}}

    return run_retrieval_cells(model, tokenizer, make_prompt, context_lengths, depths, trials, batch_size,
                               "passkey", show_progress)


def standard_error(successes: int, trials: int) -> float:
    """The standard error ``sqrt(p (1 - p) / n)`` of an accuracy of ``successes`` out of ``trials``."""
    p = successes / trials
    return math.sqrt(p * (1.0 - p) / trials)


def run_retrieval_cells(model, tokenizer, make_prompt, context_lengths: Sequence[int], depths: Sequence[float],
                        trials: int, batch_size: int, description: str, show_progress: bool = False,
                        answer_spans: bool = False) -> dict:
    """Score ``trials`` prompts per (context length, depth) with :func:`score_passkey_batch`: the loop of every
    retrieval probe (passkey, :mod:`.synthetic_retrieval`).

    Args:
        make_prompt: ``(context_length, depth_index, depth, trial) -> prompt``, a dict with ``input_ids`` (exactly
            ``context_length`` tokens), ``answer_ids`` and ``record`` (per-trial values listed in the cell, e.g. the
            key), and with ``answer_spans`` ``spans``: ``[(start, end)]`` of the answer's parts (one per needle).
        answer_spans: also report ``part_accuracy``, the fraction of answer parts whose every token is the argmax.

    Returns:
        ``{"cells", "by_context_length", "accuracy", "standard_error", "trials_total"}``: each cell holds
        ``context_length``, ``depth``, ``trials``, ``accuracy``, its ``standard_error``, the mean answer
        log-likelihood, ``correct``, ``greedy`` and the records' values as lists.
    """
    was_training = model.training
    model.eval()
    progress = _progress_bar(len(context_lengths) * len(depths) * trials, description, show_progress)
    cells = []
    for context_length in context_lengths:
        for depth_index, depth in enumerate(depths):
            prompts = [make_prompt(int(context_length), depth_index, float(depth), trial) for trial in range(trials)]
            groups: dict[int, list[dict]] = {}  # answers of different token lengths cannot share a batch
            for prompt in prompts:
                groups.setdefault(len(prompt["answer_ids"]), []).append(prompt)
            by_prompt = {}
            for group in groups.values():
                for begin in range(0, len(group), batch_size):
                    chunk = group[begin:begin + batch_size]
                    for prompt, score in zip(chunk, score_passkey_batch(model, tokenizer, chunk)):
                        by_prompt[id(prompt)] = score
                    progress.update(len(chunk))
            scores = [by_prompt[id(prompt)] for prompt in prompts]
            successes = sum(score["correct"] for score in scores)
            cell = {"context_length": int(context_length), "depth": float(depth), "trials": trials,
                    "accuracy": successes / trials, "standard_error": standard_error(successes, trials),
                    "key_log_likelihood_mean": math.fsum(score["key_log_likelihood"] for score in scores) / trials,
                    "correct": [score["correct"] for score in scores],
                    "greedy": [score["greedy"] for score in scores]}
            if answer_spans:
                parts = [all(score["matches"][start:end]) for prompt, score in zip(prompts, scores)
                         for start, end in prompt["spans"]]
                cell["part_accuracy"] = sum(parts) / len(parts)
            for name in prompts[0]["record"]:
                cell[name] = [prompt["record"][name] for prompt in prompts]
            cells.append(cell)
    progress.close()
    model.train(was_training)
    by_length = {}
    for context_length in context_lengths:
        mine = [cell for cell in cells if cell["context_length"] == context_length]
        by_length[str(int(context_length))] = sum(cell["accuracy"] for cell in mine) / len(mine)
    total = trials * len(cells)
    successes = sum(sum(cell["correct"]) for cell in cells)
    return {"cells": cells, "by_context_length": by_length, "accuracy": successes / total,
            "standard_error": standard_error(successes, total), "trials_total": total}


def retrieval_record(task: str, model_path: str, model, metrics: dict, cells: list, protocol: dict, seconds: float,
                     device, favor_changes: dict | None) -> dict:
    """The record a retrieval evaluation writes (the model by base name: the record may be shared; a KV-cache peer,
    :mod:`.quantized_kv` or :mod:`.snapkv`, by its ``kv_cache_description``)."""
    return {
        "task": task,
        "model": os.path.basename(os.path.normpath(model_path)) if os.path.exists(model_path) else model_path,
        "metrics": metrics,
        "cells": cells,
        "protocol": protocol,
        "eval_seconds": round(seconds, 3),
        "device": str(device),
    } | ({"favor_settings_changed": dict(favor_changes)} if favor_changes else {}) | (
        {"kv_cache": model.kv_cache_description} if hasattr(model, "kv_cache_description") else {})


def evaluate_passkey_model(model_path: str, context_lengths: Sequence[int], depths: Sequence[float] = DEFAULT_DEPTHS,
                           trials: int = 5, seed: int = 0, filler_file: str | None = None,
                           max_chars: int | None = None, batch_size: int = 1, tokenizer_path: str | None = None,
                           device: str | None = None, trust_remote_code: bool = False,
                           show_progress: bool = True, favor_changes: dict | None = None,
                           kv_bits: int | None = None, snapkv: dict | None = None) -> dict:
    """The passkey probe on a causal LM folder (``hf-performer evaluate MODEL --task passkey``). Returns the record
    the command writes: ``metrics`` (overall accuracy and per context length), ``cells``, the ``protocol``.
    Paths are recorded by base name (the record may be shared)."""
    import torch

    from .. import modeling_performer  # noqa: F401 - registers the Performer classes with the Auto classes
    from .data import load_lm_text

    check_passkey_settings(context_lengths, depths, trials)
    tokenizer = _load_tokenizer(tokenizer_path or model_path)
    filler_text = load_lm_text(filler_file, max_chars=max_chars) if filler_file is not None else None
    model = load_causal_lm(model_path, trust_remote_code, favor_changes, kv_bits=kv_bits, snapkv=snapkv)
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    longest = max(context_lengths)
    if positions is not None and longest + KEY_DIGITS + 2 > positions:
        raise EvaluationError(f"passkey context length {longest} (+ the key's tokens) exceeds the model's "
                              f"{positions} positions; accepted: context lengths <= {positions - KEY_DIGITS - 2}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    start = time.perf_counter()
    result = passkey_retrieval(model, tokenizer, context_lengths, depths, trials, seed, filler_text, batch_size,
                               show_progress)
    metrics = {"passkey_accuracy": result["accuracy"], "passkey_standard_error": result["standard_error"]}
    metrics |= {f"passkey_accuracy_{length}": value for length, value in result["by_context_length"].items()}
    protocol = {"context_lengths": [int(length) for length in context_lengths],
                "depths": [float(depth) for depth in depths], "trials": trials, "seed": seed,
                "filler": "classic repeated sentences" if filler_file is None else
                os.path.basename(os.fspath(filler_file)),
                "max_chars": max_chars, "key_digits": KEY_DIGITS,
                "scoring": "greedy continuation == key (teacher-forced argmax, no further digit); "
                           "log-likelihood of the key's tokens in nats"}
    return retrieval_record("passkey", model_path, model, metrics, result["cells"], protocol,
                            time.perf_counter() - start, device, favor_changes)


__all__ = [
    "CLASSIC_FILLER",
    "DEFAULT_DEPTHS",
    "PasskeyPrompts",
    "check_passkey_settings",
    "evaluate_passkey_model",
    "passkey_retrieval",
    "retrieval_record",
    "run_retrieval_cells",
    "score_passkey_batch",
    "standard_error",
    "trial_settings",
]
