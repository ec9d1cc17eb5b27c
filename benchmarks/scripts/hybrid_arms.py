"""Window-hybrid arms against softmax at several context lengths: perplexity, passkey and decoding memory.

Each ``--arm NAME FOLDER [KEY=VALUE ...]`` is a trained causal LM folder, optionally with favor settings changed at
load time (``sparse_cache=256``, ``linear_tail=false``, JSON for per-layer ones: ``layer_windows={"4":
{"sparse_cache":2048}}``; :func:`hf_performer.favor_attention.update_favor_settings`) and ``contexts=1024,2048`` to evaluate its perplexity at a subset of ``--contexts`` only (``retrieval=8176``: its
retrieval tasks at a subset of ``--retrieval-lengths``), ``passkey=false`` to skip its retrieval tasks; ``kv_bits=2`` (or 4) makes a softmax folder the quantized-KV peer (transformers'
``QuantizedCache``: :mod:`hf_performer.tasks.quantized_kv`); ``snapkv=1024 snapkv_window=512 snapkv_sinks=4
snapkv_pool=7`` the peer whose KV cache is cut after the prompt (:mod:`hf_performer.tasks.snapkv`; retrieval only: give it
``contexts=none``).
Every arm and the ``--baseline`` (softmax after the same LoRA, or the source model for training-free arms:
``--baseline-name``) get the one protocol of the window-hybrid results: perplexity with windows of each
``--contexts`` length every half window on the first ``--max-chars`` characters of ``--text-file`` (the first context
also split by ``--position-ranges``), and each retrieval ``--tasks`` (passkey, needles, variable-tracking: accuracy and
standard error) at each ``--retrieval-lengths``. The decoding state of one sequence is computed from each arm's configuration at
``--memory-lengths`` (:func:`hf_performer.conversion.cache_budget.option_bytes`, the formula the tests hold equal to
the cache layers' bytes) and the training time read from its ``linearize.json`` when present.

    python benchmarks/scripts/hybrid_arms.py --baseline ../runs/r33/softmax \\
        --arm tail ../runs/r33/hybrid --arm tail+cache ../runs/r33/hybrid_g256 \\
        --text-file ../shared/data/wikitext-2-raw/wiki.test.raw --output benchmarks/results/hybrid_arms_smollm2.json

Every evaluation is kept in ``--work-dir`` as it finishes (an interrupted run resumes there); the JSON (paths relative,
the command, the machine) and a PNG beside it are written at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile


def _parse_changes(items: list[str], contexts: list[int], lengths: list[int]) -> tuple[dict, list[int], bool, list]:
    changes, passkey = {}, True  # (passkey: whether the arm runs the retrieval tasks)
    for item in items:
        key, _, text = item.partition("=")
        if not key or not text:
            raise SystemExit(f"hybrid_arms: --arm settings are KEY=VALUE (e.g. sparse_cache=256), got {item!r}")
        if key == "contexts" and text == "none":
            contexts = []
            continue
        if key in ("contexts", "retrieval"):
            among, flag = (contexts, "--contexts") if key == "contexts" else (lengths, "--retrieval-lengths")
            subset = [int(value) for value in text.split(",") if value.strip().isdigit()]
            if not subset or not set(subset) <= set(among):
                raise SystemExit(f"hybrid_arms: {key}={text} must name some of {flag} {among}")
            if key == "contexts":
                contexts = subset
            else:
                lengths = subset
            continue
        if key == "passkey":
            passkey = text.lower() != "false"
            continue
        json_value = text.lower() in ("true", "false") or text.isdigit() or text[0] in "{["  # layer_windows={...}
        changes[key] = json.loads(text.lower() if text[0] not in "{[" else text) if json_value else text
    return changes, contexts, passkey, lengths


def _setting_text(key: str, value) -> str:
    """``KEY=VALUE`` as the command line gave it: booleans and per-layer dicts as (shell-quoted) JSON."""
    if isinstance(value, (dict, list)):
        return shlex.quote(f"{key}={json.dumps(value, separators=(',', ':'))}")
    return f"{key}={json.dumps(value) if isinstance(value, bool) else value}"


def _kept(work_dir: str, name: str, compute) -> dict:
    """The record ``name`` of the work dir, computed (and kept) when it is missing."""
    path = os.path.join(work_dir, f"{name}.json")
    if os.path.isfile(path):
        with open(path) as handle:
            return json.load(handle)
    print(f"{name} ...", flush=True)
    record = compute()
    with open(path + ".partial", "w") as handle:
        json.dump(record, handle, indent=2)
    os.replace(path + ".partial", path)
    return record


def _evaluate(args, name: str, folder: str, changes: dict, contexts: list[int], passkey: bool = True,
              lengths: list[int] | None = None) -> dict:
    from hf_performer.tasks.evaluation import evaluate_perplexity_model
    from hf_performer.tasks.passkey import evaluate_passkey_model
    from hf_performer.tasks.synthetic_retrieval import evaluate_synthetic_model

    changes = dict(changes)
    kv_bits, snapkv = changes.pop("kv_bits", None), _snapkv(changes)
    if snapkv and contexts:
        raise SystemExit(f"hybrid_arms: arm {name}: snapkv cuts the cache after a prompt, which a perplexity stream "
                         "does not have; give it contexts=none")
    summary = {"perplexity": {}, "eval_seconds": 0.0}
    for context in contexts:
        ranges = args.position_ranges if context == args.contexts[0] else None
        record = _kept(args.work_dir, f"{name}_perplexity_{context}", lambda: evaluate_perplexity_model(
            folder, "wikitext", args.text_file, max_chars=args.max_chars, context_length=context,
            stride=context // 2, batch_size=args.batch_size, show_progress=not args.no_progress,
            position_ranges=ranges, favor_changes=changes, kv_bits=kv_bits))
        summary["perplexity"][str(context)] = record["metrics"]["perplexity"]
        summary["eval_seconds"] += record["eval_seconds"]
        if ranges and record.get("position_ranges"):  # (a kept record of a later context has none)
            summary["perplexity_by_position"] = {f"{r['start']}:{r['end']}": r["perplexity"]
                                                 for r in record["position_ranges"]}
    lengths = lengths or args.retrieval_lengths
    for task in args.tasks:
        key = task.replace("-", "_")
        if not passkey:
            summary[f"{key}_by_length"] = {}
            continue
        suffix = "" if task == "passkey" else f"_{task}"
        if task == "passkey":
            record = _kept(args.work_dir, f"{name}_passkey", lambda: evaluate_passkey_model(
                folder, lengths, args.depths, args.trials, args.seed, batch_size=args.batch_size,
                show_progress=not args.no_progress, favor_changes=changes, kv_bits=kv_bits, snapkv=snapkv))
        else:
            record = _kept(args.work_dir, f"{name}{suffix}", lambda: evaluate_synthetic_model(
                folder, task, lengths, args.depths, args.trials, args.seed, batch_size=args.batch_size,
                show_progress=not args.no_progress, favor_changes=changes, kv_bits=kv_bits, snapkv=snapkv))
        summary[f"{key}_by_length"] = {
            length: value for length, value in ((name.rsplit("_", 1)[1], value) for name, value in
                                                record["metrics"].items() if name.startswith(f"{key}_accuracy_"))
            if length.isdigit()}
        summary[f"{key}_standard_error_by_length"] = _standard_errors(record)
        summary["eval_seconds"] = round(summary["eval_seconds"] + record["eval_seconds"], 1)
    return summary


def _snapkv(changes: dict) -> dict | None:
    """The SnapKV peer's settings popped from an arm's ``changes`` (``snapkv=KEYS``, ``snapkv_window``,
    ``snapkv_sinks``, ``snapkv_pool``), or ``None``."""
    from hf_performer.tasks.snapkv import SnapKVError, snapkv_settings

    keys, window, sinks, pool = (changes.pop(name, None) for name in
                                 ("snapkv", "snapkv_window", "snapkv_sinks", "snapkv_pool"))
    if keys is None:
        if (window, sinks, pool) != (None, None, None):
            raise SystemExit("hybrid_arms: snapkv_window / snapkv_sinks / snapkv_pool need snapkv=KEYS")
        return None
    try:
        return snapkv_settings(keys, window, sinks, pool)
    except SnapKVError as error:
        raise SystemExit(f"hybrid_arms: {error}") from None


def _standard_errors(record: dict) -> dict:
    """The standard error of each length's accuracy, its cells' trials pooled."""
    from hf_performer.tasks.passkey import standard_error

    pooled: dict = {}
    for cell in record["cells"]:
        successes, trials = pooled.get(str(cell["context_length"]), (0, 0))
        pooled[str(cell["context_length"])] = (successes + sum(cell["correct"]), trials + cell["trials"])
    return {length: standard_error(*counts) for length, counts in pooled.items()}


def _source_geometry(folder: str) -> dict:
    """What the decoding state's size depends on in the softmax model (with each arm's favor_settings, the record's
    cache_bytes follow from it: ``settings_state_bytes``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    geometry = {name: getattr(config, name, None) for name in
                ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")}
    return {name: value for name, value in geometry.items() if value is not None} | {"dtype_bytes": 4}


def _memory_and_training(folder: str, changes: dict, lengths: list[int]) -> dict:
    """Bytes of the decoding state of one sequence at each length, the favor settings, the training record."""
    from transformers import AutoModelForCausalLM

    from hf_performer.conversion.cache_budget import model_state_bytes, softmax_token_bytes, torch_dtype_bytes
    from hf_performer.favor_attention import update_favor_settings
    from hf_performer.tasks.quantized_kv import quantized_kv_state_bytes
    from hf_performer.tasks.snapkv import snapkv_description, snapkv_state_bytes

    changes = dict(changes)
    kv_bits, snapkv = changes.pop("kv_bits", None), _snapkv(changes)
    model = AutoModelForCausalLM.from_pretrained(folder)
    info: dict = {}
    if snapkv:
        info["cache_bytes"] = {str(length): snapkv_state_bytes(model.config, snapkv["keys"], snapkv["window"],
                                                               snapkv["sinks"], torch_dtype_bytes(model))
                               for length in lengths}
        info["kv_cache"] = snapkv_description(**snapkv)
    elif kv_bits:
        info["cache_bytes"] = {str(length): quantized_kv_state_bytes(model.config, length, kv_bits,
                                                                     torch_dtype_bytes(model)) for length in lengths}
    elif getattr(model.config, "favor_settings", None) is not None:
        if changes:
            update_favor_settings(model, **changes)
        info["favor_settings"] = {key: model.config.favor_settings[key] for key in
                                  ("feature_map", "nb_features", "chunk_size", "window", "sinks", "sparse_cache",
                                   "sparse_cache_selection", "sparse_cache_span", "tail_cap", "linear_tail",
                                   "layer_windows", "softmax_layers")}
        info["cache_bytes"] = {str(length): model_state_bytes(model, length) for length in lengths}
    else:
        per_token = softmax_token_bytes(model.config, torch_dtype_bytes(model))
        info["cache_bytes"] = {str(length): per_token * length for length in lengths}
    record_path = os.path.join(folder, "linearize.json")
    if os.path.isfile(record_path):
        with open(record_path) as handle:
            record = json.load(handle)
        info["training_seconds"] = {name: stage.get("wall_time_s") for name, stage in record["stages"].items()
                                    if name in ("transfer", "select", "lora") and stage.get("status") == "done"}
    return info


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, (ppl_axis, key_axis, memory_axis) = plt.subplots(1, 3, figsize=(16, 4.6))
    contexts = [int(c) for c in result["protocol"]["contexts"]]
    task = result["protocol"].get("tasks", ["passkey"])[0]
    by_length = f"{task.replace('-', '_')}_by_length"
    lengths = [int(n) for n in result["protocol"].get("retrieval_lengths", result["protocol"].get("passkey_lengths"))]
    baseline = result["baseline"]
    names = list(result["arms"])
    width = 0.8 / (len(names) + 1)
    colours = plt.get_cmap("tab20").colors  # distinct for up to 20 arms (the default cycle repeats after 10)
    baseline_name = result.get("baseline_name", "softmax + LoRA")
    for index, name in enumerate(names + [baseline_name]):
        arm = result["arms"].get(name, baseline)
        colour = "black" if name == baseline_name else colours[index % len(colours)]
        if name in result["arms"]:
            measured = [c for c in contexts if str(c) in arm["perplexity_ratio"]]
            ppl_axis.plot(measured, [arm["perplexity_ratio"][str(c)] for c in measured], "-o", label=name, color=colour)
        if arm.get(by_length):
            errors = arm.get(f"{task.replace('-', '_')}_standard_error_by_length")
            shown = [i for i, n in enumerate(lengths) if str(n) in arm[by_length]]
            key_axis.bar([i + index * width for i in shown], [arm[by_length][str(lengths[i])] for i in shown], width,
                         label=name, color=colour, capsize=2,
                         yerr=[errors[str(lengths[i])] for i in shown] if errors else None)
        memory_axis.plot([int(n) for n in arm["cache_bytes"]], [b / 2 ** 20 for b in arm["cache_bytes"].values()],
                         "-o", label=name, color=colour)
    target = result["protocol"].get("target_ratio", 1.05)
    ppl_axis.axhline(target, color="grey", lw=0.8, ls=":", label=f"{target:.2f}x (target)")
    ppl_axis.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel=f"perplexity / {baseline_name}'s",
                 title="perplexity ratio")
    ppl_axis.set_xticks(contexts, [str(c) for c in contexts])
    ppl_axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    key_axis.set_xticks([i + width * len(names) / 2 for i in range(len(lengths))], [str(n) for n in lengths])
    key_axis.set(xlabel="prompt length (tokens)", ylabel=f"{task} accuracy", ylim=(0, 1.05),
                 title=f"{task} (bars: standard error)" if task != "passkey" else "passkey")
    memory_axis.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="MiB per sequence",
                    title="decoding state")
    for axis in (ppl_axis, key_axis, memory_axis):
        axis.grid(alpha=0.3)
    ppl_axis.legend(fontsize=7)  # the same colours in every panel
    memory_axis.legend(handles=memory_axis.get_lines()[-1:], fontsize=7)
    figure.suptitle(f"window-hybrid arms vs {baseline_name} ({result['protocol']['text_file']})")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", nargs="+", action="append", required=True, metavar="NAME FOLDER [KEY=VALUE]",
                        help="an arm: its name, its model folder, favor settings changed at load time")
    parser.add_argument("--baseline", required=True, help="the softmax model after the same LoRA")
    parser.add_argument("--baseline-name", default="softmax + LoRA",
                        help="the baseline's name in the plot (default: %(default)s; 'softmax' for training-free arms)")
    parser.add_argument("--text-file", required=True, help="evaluation text (e.g. wiki.test.raw)")
    parser.add_argument("--max-chars", type=int, default=200_000, help="characters evaluated (default: %(default)s)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096], metavar="N",
                        help="perplexity windows (default: 1024 2048 4096)")
    parser.add_argument("--position-ranges", nargs="+", default=["0:512", "512:1024"], metavar="START:END")
    parser.add_argument("--tasks", nargs="+", default=["passkey"], choices=("passkey", "needles", "variable-tracking"),
                        help="retrieval tasks (default: passkey)")
    parser.add_argument("--retrieval-lengths", "--passkey-lengths", dest="retrieval_lengths", type=int, nargs="+",
                        default=[1024, 2048, 4096], metavar="N", help="retrieval prompt lengths")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--trials", type=int, default=4, help="retrieval prompts per length and depth (default: 4)")
    parser.add_argument("--memory-lengths", type=int, nargs="+", default=[1024, 2048, 4096, 16384, 65536])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-ratio", type=float, default=1.05,
                        help="the perplexity ratio drawn as the target (default: issue 49's %(default)s)")
    parser.add_argument("--batch-size", type=int, default=2, help="windows / prompts per forward (default: 2)")
    parser.add_argument("--work-dir", default=None, help="where each finished evaluation is kept (default: a folder "
                                                         "in the system's temp dir named after the output)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--output", required=True, help="the JSON to write (the PNG goes beside it)")
    args = parser.parse_args(argv)
    if not args.output.endswith(".json"):
        raise SystemExit(f"hybrid_arms: --output must end in .json, got {args.output!r}")
    arms = {}
    for entry in args.arm:
        if len(entry) < 2:
            raise SystemExit(f"hybrid_arms: --arm takes NAME FOLDER [KEY=VALUE ...], got {entry}")
        arms[entry[0]] = (entry[1], *_parse_changes(entry[2:], args.contexts, args.retrieval_lengths))
    for folder in [args.baseline] + [folder for folder, *_ in arms.values()]:
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise SystemExit(f"hybrid_arms: no config.json in {folder} (a saved model folder is expected)")
    args.work_dir = args.work_dir or os.path.join(
        tempfile.gettempdir(), f"hybrid_arms_{os.path.splitext(os.path.basename(args.output))[0]}")
    os.makedirs(args.work_dir, exist_ok=True)
    print(f"evaluations kept in {args.work_dir}")

    from pathlib import Path

    import torch

    from hf_performer.bench.machine import load_average, machine_info
    from hf_performer.bench.report import write_result

    baseline = {**_evaluate(args, "baseline", args.baseline, {}, args.contexts),
                **_memory_and_training(args.baseline, {}, args.memory_lengths)}
    results = {}
    for name, (folder, changes, contexts, passkey, lengths) in arms.items():
        arm = {"model": os.path.relpath(folder), "changes": changes,
               **_evaluate(args, name, folder, changes, contexts, passkey, lengths),
               **_memory_and_training(folder, changes, args.memory_lengths)}
        arm["perplexity_ratio"] = {c: arm["perplexity"][c] / baseline["perplexity"][c] for c in arm["perplexity"]}
        for task in args.tasks:
            key = task.replace("-", "_")
            arm[f"{key}_fraction_of_baseline"] = {
                n: (value / baseline[f"{key}_by_length"][n] if baseline[f"{key}_by_length"].get(n) else None)
                for n, value in arm[f"{key}_by_length"].items()}
        arm["cache_fraction_of_baseline"] = {n: arm["cache_bytes"][n] / baseline["cache_bytes"][n]
                                             for n in arm["cache_bytes"]}
        results[name] = arm
    command = ["python benchmarks/scripts/hybrid_arms.py", f"--baseline {os.path.relpath(args.baseline)}",
               f"--baseline-name '{args.baseline_name}'"]
    for name, (folder, changes, contexts, passkey, lengths) in arms.items():
        subset = ([] if contexts == args.contexts else [f"contexts={','.join(map(str, contexts)) or 'none'}"]) + \
            ([] if lengths == args.retrieval_lengths else [f"retrieval={','.join(map(str, lengths))}"]) + \
            ([] if passkey else ["passkey=false"])
        command.append(" ".join(["--arm", name, os.path.relpath(folder), *subset,
                                 *(_setting_text(k, v) for k, v in changes.items())]))
    command += [f"--text-file {os.path.relpath(args.text_file)}", f"--max-chars {args.max_chars}",
                "--contexts", *map(str, args.contexts), "--position-ranges", *args.position_ranges,
                "--tasks", *args.tasks, "--retrieval-lengths", *map(str, args.retrieval_lengths),
                "--depths", *map(str, args.depths),
                f"--trials {args.trials}", f"--seed {args.seed}", f"--output {os.path.relpath(args.output)}"]
    result = {
        "what": "window-hybrid arms (ablations, sparse caches, budgets) against softmax with the same LoRA, at several "
                "context lengths",
        "protocol": {"text_file": os.path.basename(args.text_file), "max_chars": args.max_chars,
                     "contexts": args.contexts, "stride": "half the context", "position_ranges": args.position_ranges,
                     "tasks": args.tasks, "retrieval_lengths": args.retrieval_lengths, "depths": args.depths,
                     "trials": args.trials,
                     "seed": args.seed, "memory_lengths": args.memory_lengths, "target_ratio": args.target_ratio},
        "baseline_model": os.path.relpath(args.baseline), "baseline_name": args.baseline_name, "baseline": baseline,
        "arms": results,
        "source_geometry": _source_geometry(args.baseline),
        "state_accounting": "cache_bytes: hf_performer.conversion.cache_budget.model_state_bytes of each arm's model",
        "machine": {**machine_info(torch.device("cpu")), "load_average": load_average()},
        "command": " ".join(command),
    }
    output = Path(args.output)
    write_result(result, output.parent, output.stem, _plot)
    for name, arm in results.items():
        ratios = ", ".join(f"{c}: {r:.3f}x" for c, r in arm["perplexity_ratio"].items())
        retrieval = "; ".join(f"{task} {arm[task.replace('-', '_') + '_by_length']}" for task in args.tasks)
        print(f"{name}: perplexity {ratios}; {retrieval}; "
              f"{arm['cache_bytes'][str(args.memory_lengths[-1])] / 2 ** 20:.1f} MiB at {args.memory_lengths[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
