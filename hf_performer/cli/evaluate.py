"""``hf-performer evaluate``: task metrics (GLUE, IMDB), perplexity, the passkey probe or the synthetic retrieval tasks
of a model folder, printed and optionally written as JSON (the library: :mod:`hf_performer.tasks.evaluation`,
:mod:`hf_performer.tasks.passkey`, :mod:`hf_performer.tasks.synthetic_retrieval`)."""

from __future__ import annotations

import argparse
import json
import os

from . import add_verb_parser
from ._output import check_output_file, portable_evaluation_record

MODEL_CHANGES = ("sparse_cache", "sparse_cache_selection", "sparse_cache_span", "tail_cap", "window", "quantized_kv")
SNAPKV_FLAGS = ("snapkv", "snapkv_window", "snapkv_sinks", "snapkv_pool")
RETRIEVAL = ("text_file", "max_chars", "context_lengths", "depths", "trials") + MODEL_CHANGES + SNAPKV_FLAGS
TASK_FLAGS = {
    "classification": ("validation_file", "max_eval_samples", "max_length", "metrics_backend"),
    "perplexity": ("text_file", "split", "max_chars", "context_length", "stride", "position_ranges") + MODEL_CHANGES,
    "passkey": RETRIEVAL,
    "needles": RETRIEVAL + ("needles", "needle_queries"),
    "variable-tracking": RETRIEVAL + ("hops",),
}
"""The flags each kind of evaluation reads; a flag of another kind is refused (it would be ignored)."""
DEFAULTS = {"max_length": 128, "metrics_backend": "auto", "split": "test", "context_lengths": [1024, 2048],
            "trials": 5, "needles": 4, "needle_queries": "one", "hops": 4}
SYNTHETIC_TRIALS = 8
"""The default trials of the synthetic tasks: a standard error of at most 0.18 a cell."""
"""The values of the task-specific flags whose parser default is ``None`` (so that a given flag is told apart)."""

CLI_DESCRIPTION = """Evaluate a model folder (Performer or softmax) on a task and write its metrics.

Classification (GLUE tasks, IMDB):
  hf-performer evaluate MODEL --task sst2 --validation-file ../shared/data/glue/SST-2/dev.tsv --output metrics.json
  (without --validation-file the Hub's validation split is loaded: needs Hub access)

Perplexity (causal LMs):
  hf-performer evaluate MODEL --task wikitext --text-file ../shared/data/wikitext-2-raw/wiki.test.raw \\
      --context-length 1024 --stride 512
  Windows of --context-length tokens start every --stride tokens; every token is scored once, with at least
  context-length - stride tokens of left context after the first window; token-weighted.
  --position-ranges 0:512 512:1024 also reports the perplexity of the tokens at those positions inside each window
  (every window's predictions count there: positions >= 512 measure the use of context far behind the token).

Passkey retrieval (causal LMs):
  hf-performer evaluate MODEL --task passkey --context-lengths 1024 2048 --depths 0 0.25 0.5 0.75 1 --trials 5
  A 5-digit key hidden at each depth of a prompt of exactly each length (filler: the classic repeated sentences,
  or --text-file text from a seeded offset); accuracy = the greedy continuation is the key; seeded by --seed.

Synthetic retrieval (causal LMs, RULER-style; default 8 trials a depth, each cell with its standard error):
  hf-performer evaluate MODEL --task needles --needles 4 --needle-queries one --context-lengths 4096 8192
  hf-performer evaluate MODEL --task variable-tracking --hops 4 --context-lengths 4096 8192
  needles: 4 "special magic number for WORD" statements in the haystack, one (at each depth) or all asked for;
  variable-tracking: a chain VAR A = 12345, VAR B = VAR A, ... from each depth to the end, a distractor chain beside.

A softmax model's KV cache quantized (transformers' QuantizedCache, quanto backend: pip install optimum-quanto):
  hf-performer evaluate SOURCE --task passkey --quantized-kv 4 --context-lengths 8192
  the text runs through the cache 512 tokens at a time, as decoding sees it (the peer of a bounded-memory model).

A softmax model's KV cache cut after the prompt (SnapKV: sinks + window + the KEYS older tokens the prompt's last 32
queries attend to most, per layer and key head; retrieval tasks only):
  hf-performer evaluate SOURCE --task passkey --snapkv 1024 --snapkv-window 512 --snapkv-sinks 4 --context-lengths 8192
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``evaluate`` subcommand to ``subparsers``."""
    from hf_performer.tasks.data import LM_DATASETS
    from hf_performer.tasks.evaluation import METRIC_BACKENDS

    parser = add_verb_parser(subparsers, "evaluate", CLI_DESCRIPTION)
    parser.add_argument("model", metavar="MODEL", help="model folder (or offline Hub name)")
    parser.add_argument("--task", required=True,
                        help="a GLUE task (cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli), imdb, a causal-LM "
                             f"text dataset ({', '.join(LM_DATASETS)}) for perplexity, passkey (retrieval probe), "
                             "needles or variable-tracking (synthetic retrieval)")
    parser.add_argument("--validation-file", default=None,
                        help="local evaluation file (TSV/CSV/JSON lines, .gz accepted) instead of the Hub split")
    parser.add_argument("--max-eval-samples", type=int, default=None,
                        help="evaluate a seeded random subset of N examples (default: all)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the --max-eval-samples subset, or of the passkey keys and offsets (default: 0)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="classification: tokens per example (default: 128)")
    parser.add_argument("--batch-size", type=int, default=32, help="examples (or windows) per batch (default: 32)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: MODEL)")
    parser.add_argument("--metrics-backend", choices=METRIC_BACKENDS, default=None,
                        help="evaluate (Hub), local (scikit-learn/scipy) or auto: evaluate when it loads (default)")
    parser.add_argument("--text-file", default=None,
                        help="perplexity: raw text file instead of the Hub dataset; passkey: filler text (default: the "
                             "classic repeated sentences)")
    parser.add_argument("--split", default=None, help="perplexity: Hub split (default: test)")
    parser.add_argument("--max-chars", type=int, default=None,
                        help="perplexity (passkey filler): use the first N characters of the text only")
    parser.add_argument("--context-length", type=int, default=None,
                        help="perplexity: tokens per window (default: the model's max positions, at most 1024)")
    parser.add_argument("--stride", type=int, default=None,
                        help="perplexity: tokens between window starts (default: context length / 2)")
    parser.add_argument("--position-ranges", nargs="+", default=None, metavar="START:END",
                        help="perplexity: also report the perplexity of window positions START..END-1 (e.g. 0:512 "
                             "512:1024; every window's predictions count)")
    parser.add_argument("--context-lengths", nargs="+", type=int, default=None, metavar="N",
                        help="passkey: prompt lengths in tokens (default: 1024 2048)")
    parser.add_argument("--depths", nargs="+", type=float, default=None, metavar="FRACTION",
                        help="passkey: fractions of the filler before the key, in [0, 1] (default: 0 0.25 0.5 0.75 1)")
    parser.add_argument("--trials", type=int, default=None,
                        help="passkey / needles / variable-tracking: prompts (seeded) per context length and depth "
                             f"(default: 5 for passkey, {SYNTHETIC_TRIALS} for the others)")
    parser.add_argument("--needles", type=int, default=None, metavar="N",
                        help="needles: key-value statements hidden in each prompt (default: 4)")
    parser.add_argument("--needle-queries", choices=("one", "all"), default=None,
                        help="needles: ask for the one at each depth (the others are distractors), or for all of them "
                             "in one answer (default: one)")
    parser.add_argument("--hops", type=int, default=None,
                        help="variable-tracking: assignments after the first in the asked chain (default: 4)")
    parser.add_argument("--quantized-kv", type=int, choices=(2, 4), default=None, metavar="BITS",
                        help="perplexity / retrieval of a softmax causal LM decoding through a BITS-bit quantized KV "
                             "cache (transformers' QuantizedCache, quanto backend; 512 tokens a call)")
    parser.add_argument("--snapkv", type=int, default=None, metavar="KEYS",
                        help="retrieval of a softmax causal LM whose KV cache is cut after the prompt to the sinks, "
                             "the window and the KEYS older tokens the prompt's last queries attend to most (SnapKV)")
    parser.add_argument("--snapkv-window", type=int, default=None, metavar="W",
                        help="with --snapkv: the latest prompt tokens always kept (default: 512)")
    parser.add_argument("--snapkv-sinks", type=int, default=None, metavar="S",
                        help="with --snapkv: the first prompt tokens always kept (default: 4)")
    parser.add_argument("--snapkv-pool", type=int, default=None, metavar="N",
                        help="with --snapkv: each key's score averaged over the N keys centred on it, odd (default: 7, "
                             "the paper's; wider keeps whole spans)")
    parser.add_argument("--sparse-cache", type=int, default=None, metavar="G",
                        help="perplexity / passkey of a window-hybrid causal LM: evaluate it with a sparse cache of G "
                             "hard keys per key head in every window layer (no retraining, as LoLA; default: the "
                             "model's own setting)")
    parser.add_argument("--sparse-cache-selection", choices=("recall", "attention"), default=None,
                        help="perplexity / retrieval of a window-hybrid causal LM: evaluate it with its sparse cache "
                             "choosing by the tail's recall error or by the boundary query's attention (H2O / "
                             "TOVA-style; default: the model's own setting)")
    parser.add_argument("--sparse-cache-span", type=int, default=None, metavar="S",
                        help="perplexity / retrieval of a window-hybrid causal LM: evaluate it with its sparse cache "
                             "ranking each token by its score averaged over S neighbouring candidates, odd (whole "
                             "spans rather than their sharpest keys; default: the model's own setting, 1 = none)")
    parser.add_argument("--window", type=int, default=None, metavar="W",
                        help="perplexity / passkey of a window-hybrid causal LM: evaluate it with a band of W exact "
                             "recent tokens in every window layer (default: the model's own setting; hf-performer "
                             "settings writes a folder with it)")
    parser.add_argument("--tail-cap", type=int, default=None, metavar="N",
                        help="perplexity / passkey of a window-hybrid causal LM: evaluate it with its causal window "
                             "layers' tails bounded to the weight of N tokens (0 = unbounded; default: the model's own "
                             "setting)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="load the model's own code (not needed for Performer folders: hf_performer registers them)")
    parser.add_argument("--output", default=None,
                        help="write the metrics to this JSON file (checked before the evaluation runs)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (it is shown only when stderr is a terminal)")
    parser.set_defaults(func=run_evaluate)
    return parser


def _snapkv_settings(args: argparse.Namespace) -> dict | None:
    """``--snapkv`` and its window and sinks as :func:`~hf_performer.tasks.evaluation.load_causal_lm` takes them."""
    if args.snapkv is None:
        if any(getattr(args, flag) is not None for flag in SNAPKV_FLAGS[1:]):
            raise SystemExit("hf-performer evaluate: error: --snapkv-window / --snapkv-sinks / --snapkv-pool need "
                             "--snapkv KEYS")
        return None
    if args.quantized_kv is not None:
        raise SystemExit("hf-performer evaluate: error: --snapkv and --quantized-kv are two peers; give one")
    from hf_performer.tasks.snapkv import SnapKVError, snapkv_settings

    try:
        return snapkv_settings(args.snapkv, args.snapkv_window, args.snapkv_sinks, args.snapkv_pool)
    except SnapKVError as error:
        raise SystemExit(f"hf-performer evaluate: error: {error}") from None


def run_evaluate(args: argparse.Namespace) -> int:
    """Run ``hf-performer evaluate`` (see :func:`add_parser`). Returns the exit status."""
    from hf_performer.conversion.cache_budget import SERVING_SETTINGS
    from hf_performer.conversion.source import SourceError, check_source
    from hf_performer.tasks.data import LM_DATASETS, TASKS, DataError
    from hf_performer.tasks.evaluation import (
        EvaluationError, evaluate_classification_model, evaluate_perplexity_model,
    )
    from hf_performer.tasks.passkey import DEFAULT_DEPTHS, evaluate_passkey_model
    from hf_performer.tasks.synthetic_retrieval import TASKS as SYNTHETIC_TASKS, evaluate_synthetic_model

    task = args.task.lower()
    kind = (task if task in ("passkey",) + SYNTHETIC_TASKS else "perplexity" if task in LM_DATASETS else
            "classification" if task.replace("-", "").replace("_", "") in TASKS or args.text_file is None
            else "perplexity")
    ignored = [name for other, names in TASK_FLAGS.items() if other != kind for name in names
               if name not in TASK_FLAGS[kind] and getattr(args, name) is not None]
    if ignored:
        flags = ", ".join("--" + name.replace("_", "-") for name in dict.fromkeys(ignored))
        raise SystemExit(f"hf-performer evaluate: error: {flags} would be ignored by --task {args.task} ({kind}); "
                         f"it reads {', '.join('--' + name.replace('_', '-') for name in TASK_FLAGS[kind])}")
    values = {name: DEFAULTS[name] if getattr(args, name) is None else getattr(args, name) for name in DEFAULTS}
    if kind in SYNTHETIC_TASKS and args.trials is None:
        values["trials"] = SYNTHETIC_TRIALS
    if args.output:
        check_output_file(args.output, "evaluate")
    try:
        check_source(args.model)
    except SourceError as error:
        raise SystemExit(f"hf-performer evaluate: error: {error}") from None
    snapkv = _snapkv_settings(args)
    favor_changes = {name: getattr(args, name) for name in SERVING_SETTINGS if getattr(args, name) is not None}
    try:
        if kind == "passkey":
            record = evaluate_passkey_model(
                args.model, values["context_lengths"], args.depths or DEFAULT_DEPTHS, values["trials"], args.seed,
                args.text_file, args.max_chars, args.batch_size, args.tokenizer, args.device, args.trust_remote_code,
                show_progress=not args.no_progress, favor_changes=favor_changes, kv_bits=args.quantized_kv,
                snapkv=snapkv)
        elif kind in SYNTHETIC_TASKS:
            record = evaluate_synthetic_model(
                args.model, kind, values["context_lengths"], args.depths or DEFAULT_DEPTHS, values["trials"], args.seed,
                args.text_file, args.max_chars, values["needles"], values["needle_queries"], values["hops"],
                args.batch_size, args.tokenizer, args.device, args.trust_remote_code,
                show_progress=not args.no_progress, favor_changes=favor_changes, kv_bits=args.quantized_kv,
                snapkv=snapkv)
        elif kind == "perplexity":
            record = evaluate_perplexity_model(
                args.model, task, args.text_file, values["split"], args.max_chars, args.context_length,
                args.stride, args.batch_size, args.tokenizer, args.device, args.trust_remote_code,
                show_progress=not args.no_progress, position_ranges=args.position_ranges, favor_changes=favor_changes,
                kv_bits=args.quantized_kv)
        else:
            record = evaluate_classification_model(
                args.model, args.task, args.validation_file, args.max_eval_samples, args.seed, values["max_length"],
                args.batch_size, args.tokenizer, values["metrics_backend"], args.device, args.trust_remote_code,
                show_progress=not args.no_progress)
    except (DataError, EvaluationError) as error:
        raise SystemExit(f"hf-performer evaluate: error: {error}") from None
    for name, value in record["metrics"].items():
        print(f"{name}: {value:.6g}")
    for cell in record.get("cells", ()):  # retrieval: one line per (context length, depth)
        print(f"{kind} context {cell['context_length']} depth {cell['depth']:g}: accuracy {cell['accuracy']:.3g} "
              f"+- {cell['standard_error']:.2g} ({cell['trials']} trials), mean answer log-likelihood "
              f"{cell['key_log_likelihood_mean']:.4g}")
    if record.get("metrics_note"):
        print(f"note: {record['metrics_note']}")
    if args.output:
        folder = os.path.dirname(os.path.abspath(args.output))
        os.makedirs(folder, exist_ok=True)
        with open(args.output, "w") as handle:
            json.dump(portable_evaluation_record(record, args.output), handle, indent=2)
        print(f"wrote {args.output}")
    return 0
