"""Collect the causal-LM attention-transfer experiment (softmax vs learned-feature-map Performer) into one JSON + PNG.

    python benchmarks/scripts/collect_lm_transfer.py \\
        --softmax-base OUT/eval_softmax_base.json --softmax-finetuned OUT/finetune_softmax \\
        --transfer OUT/eval_transfer.json --transfer-folder OUT/transfer_hedgehog \\
        --transfer-finetuned OUT/finetune_transfer \\
        [--favor-base OUT/eval_favor_base.json] [--favor-finetuned OUT/finetune_favor] \\
        --samples OUT/samples.json --protocol "..." --output benchmarks/results/attention_transfer_smollm2.json

Inputs, as the package's tools write them:

* ``hf-performer evaluate MODEL --text-file ... --output EVAL.json`` records (``--softmax-base``, ``--transfer``,
  ``--favor-base``): ``metrics.perplexity``, ``protocol`` (context, stride, windows, scored tokens, max chars),
  ``eval_seconds``;
* recipe output folders (``recipes/causal_lm.py --output-dir RUN_DIR``; ``--softmax-finetuned``,
  ``--transfer-finetuned``, ``--favor-finetuned``): ``metrics.json`` (``final.perplexity``, ``completed_steps``,
  ``train_examples``, ``perplexity_protocol``, ``wall_time_s``, ``args``) and ``eval_curve.json``;
* the folder written by ``hf-performer distill`` (``--transfer-folder``): ``attention_transfer.json`` (settings,
  loss history, per-layer fidelity before / after transfer, command);
* ``benchmarks/scripts/greedy_samples.py --output SAMPLES.json`` (``--samples``).

The JSON holds every run's perplexity, steps, tokens seen, wall time and command, the evaluation protocol (and whether
all runs were scored on the same tokens), the ratio fine-tuned transfer / fine-tuned softmax perplexity against the
target (default <= 1.10), the per-layer transfer fidelity, the generations and the machine. Every number is read from
the input files. A PNG with the same name is written beside it: perplexity per run with the target line, and the
per-layer relative attention error before vs after transfer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
from importlib import metadata

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUTPUT = os.path.join(REPO, "benchmarks", "results", "attention_transfer_smollm2.json")
TARGET_RATIO = 1.10
SCHEMA = "lm-attention-transfer/1"


class CollectError(ValueError):
    """An input file is missing or not shaped like the tool that should have written it."""


# --------------------------------------------------------------------------------------------
# Reading the inputs
# --------------------------------------------------------------------------------------------


def _load_json(path: str, what: str):
    if not os.path.isfile(path):
        raise CollectError(f"{what}: {path} does not exist")
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as error:
        raise CollectError(f"{what}: {path} is not valid JSON ({error})") from None


def _require(record: dict, keys: tuple[str, ...], what: str, path: str):
    value = record
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            raise CollectError(f"{what}: {path} has no {'.'.join(keys)} (is it the right file?)")
        value = value[key]
    return value


def evaluate_command(record: dict) -> str:
    """The ``hf-performer evaluate`` call that wrote ``record`` (the record keeps its settings, not its argv)."""
    protocol = record.get("protocol", {})
    parts = ["hf-performer", "evaluate", str(record.get("model")), "--task", "wikitext"]
    data = record.get("data")
    if data and not str(data).startswith("hub:"):
        parts += ["--text-file", str(data)]
    for flag, key in (("--context-length", "context_length"), ("--stride", "stride"), ("--max-chars", "max_chars")):
        if protocol.get(key) is not None:
            parts += [flag, str(protocol[key])]
    return shlex.join(parts)


def read_evaluation(path: str, what: str) -> dict:
    """A perplexity record of ``hf-performer evaluate``."""
    record = _load_json(path, what)
    perplexity = _require(record, ("metrics", "perplexity"), what, path)
    protocol = _require(record, ("protocol",), what, path)
    return {
        "source": "hf-performer evaluate",
        "file": path,
        "model_folder": record.get("model"),
        "perplexity": perplexity,
        "nll": record["metrics"].get("nll"),
        "protocol": {
            "data": record.get("data"),
            "context_length": protocol.get("context_length"),
            "stride": protocol.get("stride"),
            "windows": protocol.get("windows"),
            "num_tokens": protocol.get("num_tokens"),
            "text_tokens": protocol.get("text_tokens"),
            "max_chars": protocol.get("max_chars"),
        },
        "eval_seconds": record.get("eval_seconds"),
        "device": record.get("device"),
        "command": evaluate_command(record),
        "command_source": "reconstructed from the evaluate record",
    }


def tokens_seen(train_examples: int, block_size: int, batch_size: int, accumulation: int, processes: int,
                steps: int) -> int:
    """Training tokens the recipe consumed in ``steps`` optimizer steps: every epoch is ``ceil(N / B)`` batches (the
    last one short), an optimizer step takes ``accumulation`` batches or the end of the epoch (Accelerate syncs the
    gradients at the end of the dataloader). With several processes, ``B`` is the global batch (approximate)."""
    global_batch = batch_size * max(processes, 1)
    if train_examples < 1 or global_batch < 1 or steps < 1:
        return 0
    per_epoch = math.ceil(train_examples / global_batch)
    last = train_examples - (per_epoch - 1) * global_batch
    examples, done = 0, 0
    while done < steps:
        micro = 0
        for index in range(per_epoch):
            examples += last if index == per_epoch - 1 else global_batch
            micro += 1
            if micro == accumulation or index == per_epoch - 1:
                done += 1
                micro = 0
                if done >= steps:
                    break
    return examples * block_size


def read_recipe(folder: str, what: str) -> dict:
    """A recipe output folder (``metrics.json`` + ``eval_curve.json``)."""
    from hf_performer.recipes.arguments import recipe_command
    from hf_performer.recipes.results import EVAL_CURVE_FILE, METRICS_FILE

    if not os.path.isdir(folder):
        raise CollectError(f"{what}: {folder} is not a folder (a recipe --output-dir)")
    path = os.path.join(folder, METRICS_FILE)
    metrics = _load_json(path, what)
    perplexity = _require(metrics, ("final", "perplexity"), what, path)
    args = _require(metrics, ("args",), what, path)
    steps = _require(metrics, ("completed_steps",), what, path)
    protocol = metrics.get("perplexity_protocol") or {}
    curve_path = os.path.join(folder, EVAL_CURVE_FILE)
    curve = _load_json(curve_path, what) if os.path.isfile(curve_path) else []
    block_size = int(_require(metrics, ("args", "block_size"), what, path))
    batch_size = int(_require(metrics, ("args", "per_device_train_batch_size"), what, path))
    accumulation = int(args.get("gradient_accumulation_steps", 1))
    processes = int(metrics.get("num_processes", 1))
    train_examples = int(metrics.get("train_examples", 0))
    max_chars = args.get("max_eval_chars")
    return {
        "source": "recipes/causal_lm.py",
        "file": path,
        "model_folder": folder,
        "started_from": (metrics.get("model") or {}).get("source", args.get("model")),
        "attention": (metrics.get("model") or {}).get("attention"),
        "favor_settings": (metrics.get("model") or {}).get("favor_settings"),
        "perplexity": perplexity,
        "nll": metrics["final"].get("eval_loss"),
        "steps": steps,
        "train_examples": train_examples,
        "block_size": block_size,
        "batch_size": batch_size,
        "gradient_accumulation_steps": accumulation,
        "num_processes": processes,
        "learning_rate": args.get("learning_rate"),
        "train_file": args.get("train_file"),
        "tokens_seen": tokens_seen(train_examples, block_size, batch_size, accumulation, processes, steps),
        "train_loss_first": metrics.get("train_loss_first"),
        "train_loss_last": metrics.get("train_loss_last"),
        "protocol": {
            "data": args.get("validation_file"),
            "context_length": protocol.get("context_length"),
            "stride": protocol.get("stride"),
            "windows": protocol.get("windows"),
            "num_tokens": protocol.get("num_tokens"),
            "text_tokens": None,
            "max_chars": None if max_chars == "None" else max_chars,
        },
        "eval_curve": [{k: point.get(k) for k in ("step", "perplexity", "eval_loss", "train_loss") if k in point}
                       for point in curve],
        "wall_time_s": metrics.get("wall_time_s"),
        "wall_time_note": "the whole recipe run: loading, training, every evaluation, saving",
        "device": metrics.get("device"),
        "trainable_parameters": metrics.get("trainable_parameters"),
        "command": recipe_command(metrics),
        "command_source": "reconstructed from metrics.json args (the arguments differing from the defaults)",
        "args": args,
    }


def _stats(values: list[float]) -> dict:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return {"mean": None, "median": None, "min": None, "max": None}
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "min": min(values),
            "max": max(values)}


def read_transfer_folder(folder: str) -> dict:
    """``attention_transfer.json`` of a ``hf-performer distill`` folder, summarised."""
    what = "--transfer-folder"
    path = os.path.join(folder, "attention_transfer.json") if os.path.isdir(folder) else folder
    record = _load_json(path, what)
    before = _require(record, ("fidelity_before", "layers"), what, path)
    after = _require(record, ("fidelity_after", "layers"), what, path)
    transfer = _require(record, ("transfer",), what, path)
    data = record.get("data") or {}
    losses_before = transfer.get("layer_losses_before") or {}
    losses_after = transfer.get("layer_losses_after") or {}
    after_by_layer = {entry["layer"]: entry for entry in after}
    layers = []
    for entry in before:
        index = entry["layer"]
        later = after_by_layer.get(index, {})
        kl_before = losses_before.get(str(index), {})
        kl_after = losses_after.get(str(index), {})
        layers.append({
            "layer": index,
            "attention": later.get("attention", entry.get("attention")),
            "transferred": index in (transfer.get("layers") or []),
            "own_inputs_relative_error_before": entry.get("own_inputs_relative_error"),
            "own_inputs_relative_error_after": later.get("own_inputs_relative_error"),
            "propagated_relative_error_before": entry.get("propagated_relative_error"),
            "propagated_relative_error_after": later.get("propagated_relative_error"),
            "weights_kl_before": kl_before.get("weights_kl"),
            "weights_kl_after": kl_after.get("weights_kl"),
            "output_squared_error_before": kl_before.get("output_squared_error"),
            "output_squared_error_after": kl_after.get("output_squared_error"),
        })
    history = transfer.get("history") or []
    steps = transfer.get("steps")
    sequences, batch_size, max_length = data.get("sequences"), data.get("batch_size"), data.get("max_length")
    transfer_tokens = None
    if None not in (sequences, batch_size, max_length, steps):
        # The distill command cycles over ceil(sequences / batch_size) batches of max_length-token blocks.
        transfer_tokens = tokens_seen(sequences, max_length, batch_size, 1, 1, steps)

    def model_level(key):
        return {"before": record["fidelity_before"].get(key), "after": record["fidelity_after"].get(key)}

    return {
        "file": path,
        "source": record.get("source"),
        "feature_map": record.get("feature_map"),
        "favor_settings": record.get("favor_settings"),
        "data": data,
        "steps": steps,
        "learning_rate": transfer.get("learning_rate"),
        "loss": transfer.get("loss"),
        "tokens_seen": transfer_tokens,
        "tokens_seen_exact": data.get("layout") == "text",
        "loss_per_layer_first": history[0]["loss_per_layer"] if history else None,
        "loss_per_layer_last": history[-1]["loss_per_layer"] if history else None,
        "wall_time_s": record.get("wall_time_s"),
        "command": record.get("command"),
        "fidelity_inputs": {key: record["fidelity_before"].get(key) for key in ("inputs", "num_sequences",
                                                                                 "num_tokens")},
        "own_inputs_relative_error": {
            "before": _stats([layer["own_inputs_relative_error_before"] for layer in layers if layer["transferred"]]),
            "after": _stats([layer["own_inputs_relative_error_after"] for layer in layers if layer["transferred"]]),
        },
        "final_hidden_state_cosine": model_level("final_hidden_state_cosine"),
        "logits_kl": model_level("logits_kl"),
        "logits_relative_error": model_level("logits_relative_error"),
        "prediction_agreement": model_level("prediction_agreement"),
        "layers": layers,
    }


def read_samples(path: str) -> dict:
    record = _load_json(path, "--samples")
    models = _require(record, ("models",), "--samples", path)
    return {
        "file": path,
        "prompts": record.get("prompts"),
        "max_new_tokens": record.get("max_new_tokens"),
        "device": record.get("device"),
        "command": record.get("command"),
        "machine": record.get("machine"),
        "models": [
            {
                "name": model.get("name"),
                "folder": model.get("folder"),
                "attention": (model.get("model") or {}).get("attention"),
                "feature_map": (model.get("model") or {}).get("feature_map"),
                "constant_memory_cache": model.get("constant_memory_cache"),
                "samples": [
                    {
                        "prompt": sample.get("prompt"),
                        "continuation": sample.get("continuation"),
                        "new_tokens": sample.get("new_tokens"),
                        "wall_time_s": sample.get("wall_time_s"),
                        "cache_layers": (sample.get("cache") or {}).get("layer_classes"),
                        "cache_bytes": (sample.get("cache") or {}).get("layer_bytes"),
                    }
                    for sample in model.get("samples", [])
                ],
            }
            for model in models
        ],
    }


def machine_info() -> dict:
    """Where the collection ran (the runs themselves record their device): the package's benchmark machine record
    plus the installed versions of the libraries the runs used."""
    import torch

    from hf_performer.bench.machine import machine_info as benchmark_machine_info

    versions = {}
    for package in ("transformers", "accelerate", "hf-performer"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {**benchmark_machine_info(torch.device("cpu")), "platform": platform.platform(), **versions}


# --------------------------------------------------------------------------------------------
# Assembling
# --------------------------------------------------------------------------------------------


PROTOCOL_KEYS = ("context_length", "stride", "windows", "num_tokens")


def check_protocol(runs: list[dict]) -> dict:
    """Whether every run was scored with the same windows on the same number of tokens of the same file."""
    reference = runs[0]
    mismatches = []
    for run in runs[1:]:
        for key in PROTOCOL_KEYS:
            if run["protocol"].get(key) != reference["protocol"].get(key):
                mismatches.append(f"{run['name']}: {key} {run['protocol'].get(key)} != {reference['protocol'].get(key)}"
                                  f" ({reference['name']})")
        data, ref_data = run["protocol"].get("data"), reference["protocol"].get("data")
        if data and ref_data and os.path.basename(str(data)) != os.path.basename(str(ref_data)):
            mismatches.append(f"{run['name']}: data {data} != {ref_data} ({reference['name']})")
    return {"consistent": not mismatches, "mismatches": mismatches,
            **{key: reference["protocol"].get(key) for key in (*PROTOCOL_KEYS, "data", "max_chars")}}


FINE_TUNING_KEYS = ("steps", "tokens_seen", "block_size", "batch_size", "gradient_accumulation_steps",
                    "learning_rate", "train_file")


def compare_fine_tuning(first: dict, second: dict) -> dict:
    differences = [f"{key}: {first.get(key)} vs {second.get(key)}" for key in FINE_TUNING_KEYS
                   if first.get(key) != second.get(key)]
    return {"same_budget": not differences, "differences": differences}


def transfer_config(settings: dict, feature_map: str | None) -> str:
    """``"hedgehog, init favor+, 256 features"``: what was transferred (``None`` fields: the map's defaults)."""
    options = settings.get("feature_map_options") or {}
    nb_features = settings.get("nb_features")
    return ", ".join([settings.get("feature_map") or feature_map or "learned map",
                      f"init {options.get('init', 'identity (not recorded: the default then)')}",
                      f"{nb_features if nb_features is not None else 'default'} features",
                      *(f"{key} {value}" for key, value in sorted(options.items()) if key != "init")])


def trend_point(record: dict, file: str | None) -> dict:
    """One transfer budget's outcome, read from a collected record (this run's or an earlier one's)."""
    by_name = {run["name"]: run for run in record["runs"]}
    transfer = by_name.get("transfer") or {}
    fidelity = record.get("transfer_fidelity") or {}
    error = (fidelity.get("own_inputs_relative_error") or {}).get("after") or {}
    cosine = fidelity.get("final_hidden_state_cosine") or {}
    protocol = record["protocol"]
    fine_tuned = by_name["transfer_finetuned"]
    return {
        "file": file,
        "transfer_config": transfer_config(fidelity.get("favor_settings") or {}, fidelity.get("feature_map")),
        "transfer_steps": fidelity.get("steps", transfer.get("transfer_steps")),
        "transfer_tokens_seen": fidelity.get("tokens_seen", transfer.get("transfer_tokens_seen")),
        "transfer_wall_time_s": fidelity.get("wall_time_s", transfer.get("transfer_wall_time_s")),
        "transfer_perplexity": transfer.get("perplexity"),
        "transfer_finetuned_perplexity": fine_tuned["perplexity"],
        "softmax_finetuned_perplexity": by_name["softmax_finetuned"]["perplexity"],
        "ratio": record["comparison"]["ratio_transfer_finetuned_to_softmax_finetuned"],
        "mean_relative_attention_error_after": error.get("mean"),
        "final_hidden_state_cosine_after": cosine.get("after"),
        "evaluation": [protocol.get(key) for key in ("context_length", "stride", "num_tokens")],
        "fine_tuning": [fine_tuned.get(key) for key in ("steps", "batch_size", "block_size", "learning_rate")],
    }


def transfer_trend(current: dict, previous: list[str]) -> dict:
    """The same pipeline at several attention-transfer budgets, in order of transfer tokens.

    Every earlier record must share this run's evaluation (context, stride, tokens) and fine-tuning budget, or the
    points would not be comparable. Points may differ in the transferred feature map (``transfer_config``, shown
    on every point of the plot): then the trend mixes budget and configuration, and ``same_transfer_config`` says so.
    """
    now = trend_point(current, None)
    points = [now]
    for path in previous:
        earlier = trend_point(_load_json(path, "--previous"), path)
        for key in ("evaluation", "fine_tuning"):
            if earlier[key] != now[key]:
                raise CollectError(f"--previous {path}: its {key.replace('_', '-')} {earlier[key]} differs from "
                                   f"this run's {now[key]}; a trend needs the same protocol")
        points.append(earlier)
    points.sort(key=lambda point: (point["transfer_tokens_seen"] or 0, point["file"] is None))
    configs = sorted({point["transfer_config"] for point in points})
    return {"what": "the fine-tuned transfer's perplexity ratio to fine-tuned softmax as the attention-transfer "
                    "budget grows (same evaluation and fine-tuning)",
            "same_transfer_config": len(configs) == 1, "transfer_configs": configs, "points": points}


def build_record(args: argparse.Namespace) -> dict:
    runs = []

    def add(name, label, stage, fine_tuned, body, extra=None):
        row = {"name": name, "label": label, "short_label": short_labels[name], "stage": stage,
               "fine_tuned": fine_tuned, **body, **(extra or {})}
        runs.append(row)
        return row

    transfer_info = read_transfer_folder(args.transfer_folder) if args.transfer_folder else None
    feature_map = transfer_info["feature_map"] if transfer_info else "learned map"
    short_labels = {"softmax_base": "softmax\nbase", "softmax_finetuned": "softmax\nfine-tuned",
                    "transfer": f"{feature_map}\ntransfer", "transfer_finetuned": f"{feature_map}\ntransfer + FT",
                    "favor_base": "FAVOR+\nbase", "favor_finetuned": "FAVOR+\nfine-tuned"}

    if args.softmax_base:
        body = read_evaluation(args.softmax_base, "--softmax-base")
        add("softmax_base", "softmax, not fine-tuned", "base", False, body,
            {"steps": 0, "tokens_seen": 0, "wall_time_s": body["eval_seconds"],
             "wall_time_note": "evaluation only"})
    softmax_ft = add("softmax_finetuned", "softmax, fine-tuned", "fine-tuned", True,
                     read_recipe(args.softmax_finetuned, "--softmax-finetuned"))
    if args.transfer:
        body = read_evaluation(args.transfer, "--transfer")
        extra = {"steps": 0, "tokens_seen": 0, "wall_time_s": body["eval_seconds"],
                 "wall_time_note": "evaluation only (the transfer's own time is under transfer_*)"}
        if transfer_info:
            extra.update(transfer_steps=transfer_info["steps"], transfer_tokens_seen=transfer_info["tokens_seen"],
                         transfer_wall_time_s=transfer_info["wall_time_s"], transfer_command=transfer_info["command"])
        add("transfer", f"{feature_map} after attention transfer, not fine-tuned", "transfer", False, body, extra)
    transfer_ft_body = read_recipe(args.transfer_finetuned, "--transfer-finetuned")
    extra = {}
    if transfer_info and transfer_info["tokens_seen"] is not None:
        extra["tokens_seen_including_transfer"] = transfer_ft_body["tokens_seen"] + transfer_info["tokens_seen"]
    transfer_ft = add("transfer_finetuned", f"{feature_map} after attention transfer, fine-tuned", "fine-tuned",
                      True, transfer_ft_body, extra)
    if args.favor_base:
        body = read_evaluation(args.favor_base, "--favor-base")
        add("favor_base", "FAVOR+ converted, not fine-tuned", "base", False, body,
            {"steps": 0, "tokens_seen": 0, "wall_time_s": body["eval_seconds"], "wall_time_note": "evaluation only"})
    favor_ft = None
    if args.favor_finetuned:
        favor_ft = add("favor_finetuned", "FAVOR+ converted, fine-tuned", "fine-tuned", True,
                       read_recipe(args.favor_finetuned, "--favor-finetuned"))

    ratio = transfer_ft["perplexity"] / softmax_ft["perplexity"]
    comparison = {
        "ratio_transfer_finetuned_to_softmax_finetuned": ratio,
        "transfer_finetuned_perplexity": transfer_ft["perplexity"],
        "softmax_finetuned_perplexity": softmax_ft["perplexity"],
        "fine_tuning": compare_fine_tuning(softmax_ft, transfer_ft),
    }
    by_name = {run["name"]: run for run in runs}
    if "transfer" in by_name and "softmax_base" in by_name:
        comparison["ratio_transfer_to_softmax_base"] = by_name["transfer"]["perplexity"] / by_name["softmax_base"][
            "perplexity"]
    if favor_ft is not None:
        comparison["ratio_favor_finetuned_to_softmax_finetuned"] = favor_ft["perplexity"] / softmax_ft["perplexity"]
    if "favor_base" in by_name and "softmax_base" in by_name:
        comparison["ratio_favor_base_to_softmax_base"] = by_name["favor_base"]["perplexity"] / by_name[
            "softmax_base"]["perplexity"]
    met = ratio <= args.target_ratio
    target = {
        "rule": f"fine-tuned transfer perplexity <= {args.target_ratio:g} x fine-tuned softmax perplexity",
        "threshold_ratio": args.target_ratio,
        "threshold_perplexity": args.target_ratio * softmax_ft["perplexity"],
        "ratio": ratio,
        "met": met,
        "status": "met" if met else "not met",
    }
    protocol = check_protocol(runs)
    protocol["description"] = args.protocol
    record = {
        "schema": SCHEMA,
        "title": args.title,
        "source_model": (transfer_info or {}).get("source") or softmax_ft["started_from"],
        "protocol": protocol,
        "runs": runs,
        "comparison": comparison,
        "target": target,
        "transfer_fidelity": transfer_info,
        "generations": read_samples(args.samples) if args.samples else None,
        "machine": machine_info(),
        "run_devices": {run["name"]: run.get("device") for run in runs},
        "inputs": {key: getattr(args, key) for key in ("softmax_base", "softmax_finetuned", "transfer",
                                                        "transfer_folder", "transfer_finetuned", "favor_base",
                                                        "favor_finetuned", "samples")},
        "collected_by": shlex.join(["python", "benchmarks/scripts/collect_lm_transfer.py", *args.argv]),
    }
    if args.previous:
        record["transfer_trend"] = transfer_trend(record, args.previous)
    if args.notes:
        record["notes"] = args.notes
    if not protocol["consistent"]:
        record["warnings"] = ["the runs were not scored on the same tokens: " + "; ".join(protocol["mismatches"])]
    if not comparison["fine_tuning"]["same_budget"]:
        record.setdefault("warnings", []).append(
            "the two fine-tuning runs differ: " + "; ".join(comparison["fine_tuning"]["differences"]))
    return record


# --------------------------------------------------------------------------------------------
# Plot and text summary
# --------------------------------------------------------------------------------------------


def plot(record: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = record["runs"]
    trend = (record.get("transfer_trend") or {}).get("points") or []
    if len(trend) > 1:
        fig, (left, right, budget) = plt.subplots(1, 3, figsize=(18, 5.2), gridspec_kw={"width_ratios": [1, 1.3, 0.9]})
        plot_trend(budget, trend, record["target"]["threshold_ratio"])
    else:
        fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1, 1.3]})
    colours = {"softmax_base": "#9ecae1", "softmax_finetuned": "#3182bd", "transfer": "#bcbddc",
               "transfer_finetuned": "#756bb1", "favor_base": "#fdae6b", "favor_finetuned": "#e6550d"}
    values = [run["perplexity"] for run in runs]
    positions = range(len(runs))
    bars = left.bar(positions, values, color=[colours.get(run["name"], "grey") for run in runs])
    left.set_xticks(list(positions), [run["short_label"] for run in runs], fontsize=8)
    finite = [v for v in values if v and math.isfinite(v) and v > 0]
    if finite and max(finite) / min(finite) > 20:
        left.set_yscale("log")
    for bar, value in zip(bars, values):
        left.annotate(f"{value:.3g}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom",
                      fontsize=8)
    target = record["target"]
    left.axhline(target["threshold_perplexity"], color="#756bb1", linestyle="--", linewidth=1,
                 label=f"target: {target['threshold_ratio']:g} x softmax fine-tuned = "
                       f"{target['threshold_perplexity']:.3g}")
    if left.get_yscale() == "linear" and finite:
        left.set_ylim(0, max(max(finite), target["threshold_perplexity"]) * 1.18)
    left.set_ylabel("perplexity (lower is better)")
    protocol = record["protocol"]
    left.set_title(f"perplexity: context {protocol.get('context_length')}, stride {protocol.get('stride')}, "
                   f"{protocol.get('num_tokens')} tokens\nratio {target['ratio']:.3f} -> target {target['status']}",
                   fontsize=9)
    left.legend(fontsize=7, loc="upper right")
    left.grid(axis="y", alpha=0.3)

    fidelity = record.get("transfer_fidelity")
    if fidelity and fidelity["layers"]:
        layers = [layer["layer"] for layer in fidelity["layers"]]
        before = [layer["own_inputs_relative_error_before"] for layer in fidelity["layers"]]
        after = [layer["own_inputs_relative_error_after"] for layer in fidelity["layers"]]
        width = 0.4
        right.bar([x - width / 2 for x in layers], before, width, color="#bdbdbd", label="before transfer")
        right.bar([x + width / 2 for x in layers], after, width, color="#756bb1", label="after transfer")
        cosine = fidelity["final_hidden_state_cosine"]
        right.set_title(f"{fidelity.get('feature_map')}: per-layer relative error of the attention output "
                        f"(own inputs)\n{fidelity.get('steps')} transfer steps; final hidden-state cosine "
                        f"{_fmt(cosine['before'])} -> {_fmt(cosine['after'])}", fontsize=9)
        right.set_xlabel("layer")
        right.set_xticks(layers if len(layers) <= 16 else layers[::2])
        measured = [v for v in before + after if v is not None and math.isfinite(v) and v > 0]
        if measured and max(measured) / min(measured) > 20:
            right.set_yscale("log")
        right.set_ylabel("||a_linear - a_softmax|| / ||a_softmax||")
        right.legend(fontsize=8)
        right.grid(axis="y", alpha=0.3)
    else:
        right.text(0.5, 0.5, "no attention_transfer.json given", ha="center", va="center")
        right.set_axis_off()
    fig.suptitle(record.get("title") or "attention transfer", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_trend(axis, points: list[dict], threshold: float) -> None:
    tokens = [point["transfer_tokens_seen"] for point in points]
    axis.plot(tokens, [point["ratio"] for point in points], "o-", color="#756bb1", label="transfer + FT / softmax FT")
    if all(point["transfer_perplexity"] for point in points):
        axis.plot(tokens, [point["transfer_perplexity"] / point["softmax_finetuned_perplexity"] for point in points],
                  "s--", color="#bcbddc", label="transfer, no FT / softmax FT")
    for point in points:
        axis.annotate(f"{point['transfer_steps']} steps, {point['ratio']:.2f}x\n{point['transfer_config']}",
                      (point["transfer_tokens_seen"], point["ratio"]), textcoords="offset points", xytext=(4, 6),
                      fontsize=7)
    axis.axhline(threshold, color="black", linestyle=":", linewidth=1, label=f"target {threshold:g}x")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("attention-transfer tokens")
    axis.set_ylabel("perplexity / softmax fine-tuned")
    axis.set_title("transfer budget vs perplexity ratio\n(same evaluation and fine-tuning)", fontsize=9)
    axis.legend(fontsize=7)
    axis.grid(alpha=0.3, which="both")


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def format_summary(record: dict) -> str:
    lines = [f"{'run':<52} {'perplexity':>11} {'steps':>6} {'tokens seen':>12} {'wall s':>9}"]
    for run in record["runs"]:
        lines.append(f"{run['label']:<52} {run['perplexity']:>11.3f} {run.get('steps', 0):>6} "
                     f"{run.get('tokens_seen') or 0:>12} {run.get('wall_time_s') or 0:>9.1f}")
    target = record["target"]
    lines.append(f"ratio fine-tuned transfer / fine-tuned softmax: {target['ratio']:.4f} "
                 f"(target <= {target['threshold_ratio']:g}: {target['status']})")
    fidelity = record.get("transfer_fidelity")
    if fidelity:
        error = fidelity["own_inputs_relative_error"]
        lines.append(f"mean per-layer relative attention error: {_fmt(error['before']['mean'])} before, "
                     f"{_fmt(error['after']['mean'])} after transfer")
    trend = (record.get("transfer_trend") or {}).get("points") or []
    if len(trend) > 1:
        lines.append("transfer budget trend (transfer steps, tokens: transfer ppl -> fine-tuned ppl, ratio):")
        for point in trend:
            transfer = point["transfer_perplexity"]
            lines.append(f"  {point['transfer_steps']:>5} steps, {point['transfer_tokens_seen'] or 0:>9} tokens: "
                         f"{'-' if transfer is None else f'{transfer:.1f}'} -> "
                         f"{point['transfer_finetuned_perplexity']:.1f}, {point['ratio']:.2f}x"
                         f"{'' if point['file'] else '  (this run)'}")
    for warning in record.get("warnings", []):
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--softmax-base", metavar="EVAL.json", help="evaluate record of the softmax model, not fine-tuned")
    parser.add_argument("--softmax-finetuned", required=True, metavar="RUN_DIR",
                        help="recipe output folder of the softmax fine-tuning (--attention softmax)")
    parser.add_argument("--transfer", metavar="EVAL.json",
                        help="evaluate record of the attention-transfer folder, not fine-tuned")
    parser.add_argument("--transfer-folder", metavar="DIR",
                        help="the hf-performer distill output folder (its attention_transfer.json)")
    parser.add_argument("--transfer-finetuned", required=True, metavar="RUN_DIR",
                        help="recipe output folder of the fine-tuning of the transfer folder")
    parser.add_argument("--favor-base", metavar="EVAL.json", help="evaluate record of a FAVOR+ conversion (optional)")
    parser.add_argument("--favor-finetuned", metavar="RUN_DIR", help="recipe output folder of a FAVOR+ fine-tuning "
                        "(optional)")
    parser.add_argument("--samples", metavar="SAMPLES.json", help="greedy_samples.py output")
    parser.add_argument("--protocol", default=None, metavar="TEXT", help="free-text description of the protocol")
    parser.add_argument("--previous", action="append", default=[], metavar="FILE.json",
                        help="a record this script wrote for the same pipeline with another attention-transfer budget "
                             "(same evaluation and fine-tuning); adds the budget trend to the record and the figure "
                             "(repeatable)")
    parser.add_argument("--note", dest="notes", action="append", default=[], metavar="TEXT",
                        help="a remark stored in the record's notes (repeatable)")
    parser.add_argument("--title", default="Attention transfer on a causal LM: softmax vs learned feature map",
                        help="title of the record and the figure")
    parser.add_argument("--target-ratio", type=float, default=TARGET_RATIO,
                        help="target: fine-tuned transfer perplexity <= RATIO x fine-tuned softmax (default: "
                             "%(default)s)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, metavar="FILE.json",
                        help="JSON to write; the PNG goes beside it (default: "
                             "benchmarks/results/attention_transfer_smollm2.json)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        record = build_record(args)
    except CollectError as error:
        raise SystemExit(f"collect_lm_transfer: error: {error}") from None
    write_record(record, args.output, plot, format_summary)
    return 0


def write_record(record: dict, output: str, plot_record, summarize) -> None:
    """Write ``record`` to ``output`` (JSON) and its figure next to it (same stem, ``.png``, named in
    ``record["figure"]``), then print ``summarize(record)`` and the two paths."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    png = os.path.splitext(output)[0] + ".png"
    record["figure"] = os.path.basename(png)
    with open(output, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=2, ensure_ascii=False)
        handle.write("\n")
    plot_record(record, png)
    print(summarize(record))
    print(f"wrote {output} and {png}")


if __name__ == "__main__":
    sys.exit(main())
