"""RULER-style synthetic retrieval tasks for causal LMs (Hsieh et al. 2024, arXiv 2404.06654): several needles, and a
chain of variable assignments to follow, hidden in a haystack of exactly ``context_length`` tokens.

* ``needles`` (RULER's multi-key needle in a haystack): ``needles`` statements " One of the special magic numbers
  for WORD is: NNNNNNN." with distinct seeded words and 7-digit numbers sit in the haystack. ``queries="one"``: the
  question asks for one of them, the one placed at ``depth`` (the others at seeded depths, distractors that a model
  must tell apart by their word); ``queries="all"``: the question asks for every word in turn and the answer is
  the numbers in that order, separated by ", " (the needles at seeded depths; ``depth`` only seeds them).
* ``variable-tracking`` (RULER's variable tracking): " VAR X1 = NNNNN ." then ``hops`` statements " VAR Xk+1 = VAR
  Xk ." spread from ``depth`` to the end of the haystack, and a second chain of the same length with another value
  interleaved at seeded depths (a distractor); the question asks for the value of the first chain's last variable.

Both end with a question whose answer is numeric, scored as the passkey is (:func:`~.passkey.score_passkey_batch`:
the greedy continuation is the answer, teacher forced, one forward pass per prompt). Each (context length, depth)
cell reports its accuracy and standard error over ``trials`` seeded prompts; ``needles`` with ``queries="all"`` also
reports ``part_accuracy``, the fraction of all asked numbers recalled. The haystack is the passkey's filler (the
classic repeated sentences, or real text from a seeded offset). Everything is seeded by ``seed``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from .evaluation import EvaluationError, _load_tokenizer, load_causal_lm
from .passkey import PasskeyPrompts, _ids, check_passkey_settings, retrieval_record, run_retrieval_cells

TASKS = ("needles", "variable-tracking")
NEEDLE = " One of the special magic numbers for {word} is: {number}."
NEEDLES_HEADER = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
                  "I will quiz you about the numbers afterwards.")
ONE_QUESTION = " What is the special magic number for {word} mentioned in the provided text? One of the special " \
               "magic numbers for {word} is:"
ALL_QUESTION = " What are the special magic numbers for {words} mentioned in the provided text? The special magic " \
               "numbers for {words} are:"
ASSIGNMENT = " VAR {name} = {value} ."
TRACKING_HEADER = ("Memorize and track the chain(s) of variable assignment hidden in the following text.")
TRACKING_QUESTION = " Question: what is the value of VAR {name}? Answer: the value of VAR {name} is"
WORDS = ("apple", "river", "candle", "forest", "marble", "violin", "harbor", "pepper", "saddle", "lantern", "meadow",
         "rocket", "walnut", "glacier", "velvet", "cactus", "falcon", "anchor", "bamboo", "copper", "dolphin",
         "ember", "quartz", "tulip", "zephyr", "biscuit", "compass", "orchid", "pebble", "thimble", "walrus", "yonder")
NUMBER_DIGITS, VALUE_DIGITS = 7, 5
DEFAULT_NEEDLES, DEFAULT_HOPS = 4, 4
QUERIES = ("one", "all")


def _rng(seed: int, task: str, context_length: int, depth_index: int, trial: int):
    import numpy as np

    return np.random.default_rng([seed, TASKS.index(task), context_length, depth_index, trial])


def _number(rng, digits: int) -> str:
    return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def _name(rng) -> str:
    return "".join(chr(ord("A") + int(letter)) for letter in rng.integers(0, 26, 5))


def _fill(builder: PasskeyPrompts, budget: int, offset: int, inserts: list[tuple[float, list[int]]]) -> list[int]:
    """``budget`` filler tokens with each ``(depth, ids)`` inserted at that fraction of the filler (stable for
    equal depths), the statements' own tokens not counted in the budget."""
    filler = builder.filler(budget, offset)
    ids, taken = [], 0
    for depth, statement in sorted(inserts, key=lambda insert: insert[0]):
        cut = round(depth * budget)
        ids += filler[taken:cut] + statement
        taken = max(taken, cut)
    return ids + filler[taken:]


def _answer_ids(builder: PasskeyPrompts, question: str, answer: str) -> list[int]:
    question_ids = _ids(builder.tokenizer, question)
    both = _ids(builder.tokenizer, question + answer)
    return both[len(question_ids):] if both[:len(question_ids)] == question_ids else _ids(builder.tokenizer, answer)


class SyntheticPrompts:
    """Builds ``needles`` / ``variable-tracking`` prompts of an exact token length (module docstring).

    Args:
        tokenizer: the model's tokenizer; filler_text: the haystack (``None``: the classic repeated sentences).
        needles: needles per prompt (``needles`` task); queries: ``"one"`` or ``"all"``.
        hops: assignments after the first in each chain (``variable-tracking``).
    """

    def __init__(self, tokenizer, filler_text: str | None = None, needles: int = DEFAULT_NEEDLES, queries: str = "one",
                 hops: int = DEFAULT_HOPS):
        check_synthetic_settings(needles, queries, hops)
        self.haystack = PasskeyPrompts(tokenizer, filler_text)
        self.needles, self.queries, self.hops = needles, queries, hops

    def _finish(self, header: str, inserts, question: str, answer_parts: list[str], context_length: int,
                offset: int, separator: str = ", ") -> dict:
        builder = self.haystack
        header_ids, question_ids = _ids(builder.tokenizer, header), _ids(builder.tokenizer, question)
        statements = sum(len(ids) for _, ids in inserts)
        budget = context_length - len(header_ids) - statements - len(question_ids)
        if budget < 0:
            raise EvaluationError(
                f"context length {context_length} is shorter than the prompt without filler ({context_length - budget} "
                f"tokens); accepted: context lengths >= {context_length - budget}")
        input_ids = header_ids + _fill(builder, budget, offset, inserts) + question_ids
        answer = " " + separator.join(answer_parts)
        answer_ids = _answer_ids(builder, question, answer)
        spans, start = [], 0  # the tokens of each part: the answer's prefix up to the part's end, tokenised
        for index in range(len(answer_parts)):
            end = len(_answer_ids(builder, question, " " + separator.join(answer_parts[:index + 1])))
            spans.append((start, min(end, len(answer_ids))))
            start = spans[-1][1]
        return {"input_ids": input_ids, "answer_ids": answer_ids, "spans": spans}

    def needles_prompt(self, context_length: int, depth: float, rng, offset: int) -> dict:
        words = [WORDS[int(i)] for i in rng.permutation(len(WORDS))[:self.needles]]
        numbers = [_number(rng, NUMBER_DIGITS) for _ in words]
        depths = [float(d) for d in rng.uniform(0.0, 1.0, self.needles)]
        statement = lambda i: _ids(self.haystack.tokenizer, NEEDLE.format(word=words[i], number=numbers[i]))  # noqa: E731
        if self.queries == "one":
            depths[0] = depth
            question, asked = ONE_QUESTION.format(word=words[0]), [0]
        else:
            asked = [int(i) for i in rng.permutation(self.needles)]
            listed = ", ".join(words[i] for i in asked[:-1]) + " and " + words[asked[-1]] if len(asked) > 1 \
                else words[asked[0]]
            question = ALL_QUESTION.format(words=listed)
        inserts = [(depths[i], statement(i)) for i in range(self.needles)]
        prompt = self._finish(NEEDLES_HEADER, inserts, question, [numbers[i] for i in asked], context_length, offset)
        return prompt | {"record": {"answers": [numbers[i] for i in asked], "words": [words[i] for i in asked]}}

    def tracking_prompt(self, context_length: int, depth: float, rng, offset: int) -> dict:
        chains = []
        for _ in range(2):  # the asked chain, then the distractor
            names = [_name(rng) for _ in range(self.hops + 1)]
            value = _number(rng, VALUE_DIGITS)
            chains.append((names, value))
        steps = self.hops + 1
        asked_depths = [depth + (1.0 - depth) * k / steps for k in range(steps)]
        other_depths = sorted(float(d) for d in rng.uniform(0.0, 1.0, steps))
        inserts = []
        for (names, value), depths in zip(chains, (asked_depths, other_depths)):
            for k, at in enumerate(depths):
                right = value if k == 0 else f"VAR {names[k - 1]}"
                inserts.append((at, _ids(self.haystack.tokenizer, ASSIGNMENT.format(name=names[k], value=right))))
        names, value = chains[0]
        question = TRACKING_QUESTION.format(name=names[-1])
        prompt = self._finish(TRACKING_HEADER, inserts, question, [value], context_length, offset)
        return prompt | {"record": {"answers": [value], "variables": [names[-1]]}}


def check_synthetic_settings(needles: int, queries: str, hops: int) -> None:
    """Raise :class:`EvaluationError` (what is wrong, what is accepted) before any model is loaded."""
    if not 1 <= needles <= len(WORDS):
        raise EvaluationError(f"needles must be in 1..{len(WORDS)} (one word each), got {needles}")
    if queries not in QUERIES:
        raise EvaluationError(f"needle queries must be one of {', '.join(QUERIES)}, got {queries!r}")
    if hops < 1:
        raise EvaluationError(f"variable-tracking hops must be >= 1, got {hops}")


def synthetic_retrieval(model, tokenizer, task: str, context_lengths: Sequence[int], depths: Sequence[float],
                        trials: int = 8, seed: int = 0, filler_text: str | None = None, needles: int = DEFAULT_NEEDLES,
                        queries: str = "one", hops: int = DEFAULT_HOPS, batch_size: int = 1,
                        show_progress: bool = False) -> dict:
    """Accuracy per (context length, depth) of ``task`` (``"needles"`` or ``"variable-tracking"``, module
    docstring); the result of :func:`~.passkey.run_retrieval_cells`."""
    if task not in TASKS:
        raise EvaluationError(f"synthetic task must be one of {', '.join(TASKS)}, got {task!r}")
    check_passkey_settings(context_lengths, depths, trials)
    prompts = SyntheticPrompts(tokenizer, filler_text, needles, queries, hops)
    filler_tokens = len(prompts.haystack.filler_ids)

    def make_prompt(context_length, depth_index, depth, trial):
        rng = _rng(seed, task, context_length, depth_index, trial)
        offset = 0 if prompts.haystack.classic else int(rng.integers(0, filler_tokens))
        build = prompts.needles_prompt if task == "needles" else prompts.tracking_prompt
        return build(context_length, depth, rng, offset)

    return run_retrieval_cells(model, tokenizer, make_prompt, context_lengths, depths, trials, batch_size, task,
                               show_progress, answer_spans=task == "needles" and queries == "all")


def evaluate_synthetic_model(model_path: str, task: str, context_lengths: Sequence[int], depths: Sequence[float],
                             trials: int = 8, seed: int = 0, filler_file: str | None = None,
                             max_chars: int | None = None, needles: int = DEFAULT_NEEDLES, queries: str = "one",
                             hops: int = DEFAULT_HOPS, batch_size: int = 1, tokenizer_path: str | None = None,
                             device: str | None = None, trust_remote_code: bool = False, show_progress: bool = True,
                             favor_changes: dict | None = None, kv_bits: int | None = None,
                             snapkv: dict | None = None) -> dict:
    """``task`` on a causal LM folder (``hf-performer evaluate MODEL --task needles|variable-tracking``). Returns the
    record the command writes: ``metrics`` (accuracy, its standard error, per context length), ``cells``,
    ``protocol``. Paths are recorded by base name."""
    import torch

    from .. import modeling_performer  # noqa: F401 - registers the Performer classes with the Auto classes
    from .data import load_lm_text

    if task not in TASKS:
        raise EvaluationError(f"synthetic task must be one of {', '.join(TASKS)}, got {task!r}")
    check_passkey_settings(context_lengths, depths, trials)
    check_synthetic_settings(needles, queries, hops)
    tokenizer = _load_tokenizer(tokenizer_path or model_path)
    filler_text = load_lm_text(filler_file, max_chars=max_chars) if filler_file is not None else None
    model = load_causal_lm(model_path, trust_remote_code, favor_changes, kv_bits=kv_bits, snapkv=snapkv)
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    longest = max(context_lengths)
    answer_room = needles * (NUMBER_DIGITS + 2) if task == "needles" and queries == "all" else NUMBER_DIGITS + 2
    if positions is not None and longest + answer_room > positions:
        raise EvaluationError(f"{task} context length {longest} (+ the answer's tokens) exceeds the model's "
                              f"{positions} positions; accepted: context lengths <= {positions - answer_room}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    start = time.perf_counter()
    result = synthetic_retrieval(model, tokenizer, task, context_lengths, depths, trials, seed, filler_text, needles,
                                 queries, hops, batch_size, show_progress)
    name = task.replace("-", "_")
    metrics = {f"{name}_accuracy": result["accuracy"], f"{name}_standard_error": result["standard_error"]}
    metrics |= {f"{name}_accuracy_{length}": value for length, value in result["by_context_length"].items()}
    if task == "needles" and queries == "all":
        parts = [cell["part_accuracy"] for cell in result["cells"]]
        metrics["needles_part_accuracy"] = sum(parts) / len(parts)
    protocol = {"context_lengths": [int(length) for length in context_lengths],
                "depths": [float(depth) for depth in depths], "trials": trials, "seed": seed,
                "filler": "classic repeated sentences" if filler_file is None else
                os.path.basename(os.fspath(filler_file)), "max_chars": max_chars,
                "scoring": "greedy continuation == the answer (teacher-forced argmax, no further digit); standard "
                           "error sqrt(p (1 - p) / trials)"}
    protocol |= ({"needles": needles, "queries": queries} if task == "needles" else {"hops": hops})
    return retrieval_record(task, model_path, model, metrics, result["cells"], protocol, time.perf_counter() - start,
                            device, favor_changes)


__all__ = [
    "QUERIES",
    "SyntheticPrompts",
    "TASKS",
    "check_synthetic_settings",
    "evaluate_synthetic_model",
    "synthetic_retrieval",
]
