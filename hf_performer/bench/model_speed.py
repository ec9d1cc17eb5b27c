"""Whole-model time and extra peak memory against sequence length (``hf-performer bench model``): a converted
model beside its softmax source, measured the same way in the same run.

Each (model, length) point runs in a fresh process (:func:`measure_model_point`): the model's backbone is loaded
(``AutoModel``: no task head, because a causal LM's ``[L, vocab]`` logits would dominate both time and memory at long
lengths), warmed up on a short input, then the peak resident set is reset and one untimed plus ``repeats`` timed
calls run at the full length: an inference forward, or a forward + backward of ``last_hidden_state.sum()`` with
``--backward`` (training memory: activations kept for the backward; the parameters' gradients count too, the same
for every model of a geometry). Memory is the growth of the peak resident set beyond the loaded model, on CPU.
With ``processes`` > 1 the whole interleaved sweep runs that many times, one run after the other; each point's
seconds and memory are the median over the runs, each run's figure kept beside it (``process_seconds``,
``process_peak_memory_bytes``), so that a noisy neighbour during one run does not decide a ratio.
"""

from __future__ import annotations

import os
import statistics

import torch

from .machine import (
    FreshProcessError,
    load_average,
    machine_info,
    peak_resident_bytes,
    reset_peak_resident,
    resident_bytes,
    run_in_fresh_process,
    timed_calls,
)

WARMUP_LENGTH = 128
"""Tokens of the warm-up call made before the peak resident set is reset (library initialisation is not counted)."""


class ModelBenchmarkError(ValueError):
    """A model folder or a setting of the model benchmark that cannot be measured."""


def model_attention(config) -> str:
    """How a model's attention is described in the records: ``softmax (<attn_implementation>)`` for a stock model,
    the feature map (and window / sinks when set) for a Performer model."""
    settings = getattr(config, "favor_settings", None)
    if not settings:
        return f"softmax ({getattr(config, '_attn_implementation', None) or 'sdpa'})"
    words = [f"favor: {settings.get('feature_map')}"]
    if settings.get("nb_features"):
        words.append(f"m={settings['nb_features']}")
    if settings.get("window") or settings.get("sinks"):
        words.append(f"window {settings.get('window')} + {settings.get('sinks')} sinks")
    return ", ".join(words)


def measure_model_point(folder: str, length: int, batch: int = 1, backward: bool = False, repeats: int = 1,
                        seed: int = 0) -> dict:
    """One point, in the calling process: ``{seconds, peak_memory_bytes, attention, parameters}`` of the backbone in
    ``folder`` on ``batch`` random sequences of ``length`` tokens (see the module docstring)."""
    from transformers import AutoConfig, AutoModel

    from .. import modeling_performer  # noqa: F401 - registers the Performer classes, so saved folders need no remote code

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    model = AutoModel.from_pretrained(folder, trust_remote_code=False)
    model.train(False)
    model.requires_grad_(backward)
    text_config = model.config.get_text_config()
    limit = getattr(text_config, "max_position_embeddings", None)
    uses_rotary = getattr(text_config, "rope_parameters", None) is not None or hasattr(text_config, "rope_theta")
    if limit is not None and length > limit and not uses_rotary:
        raise ModelBenchmarkError(f"{os.path.basename(folder)} has a learned position table of {limit} positions; "
                                  f"{length} tokens need a longer one (hf-performer convert --max-position-embeddings)")
    generator = torch.Generator().manual_seed(seed)
    vocab = text_config.vocab_size

    def one_call(tokens: int):
        input_ids = torch.randint(0, vocab, (batch, tokens), generator=generator)
        if not backward:
            with torch.inference_mode():
                return model(input_ids=input_ids, use_cache=False).last_hidden_state
        output = model(input_ids=input_ids, use_cache=False).last_hidden_state
        output.sum().backward()
        return output.detach()

    def clear_gradients():
        model.zero_grad(set_to_none=True)

    one_call(min(WARMUP_LENGTH, length))
    clear_gradients()
    before = resident_bytes()
    reset_peak_resident()
    seconds = statistics.median(timed_calls(lambda: one_call(length), repeats, torch.device("cpu"),
                                            after=clear_gradients))
    return {"seconds": seconds, "peak_memory_bytes": max(peak_resident_bytes() - before, 0),
            "attention": model_attention(config), "parameters": sum(p.numel() for p in model.parameters())}


def _measure_in_fresh_process(folder: str, length: int, batch: int, backward: bool, repeats: int) -> dict:
    try:
        return run_in_fresh_process("hf_performer.bench.model_speed:measure_model_point", folder=folder,
                                    length=length, batch=batch, backward=backward, repeats=repeats)
    except FreshProcessError as error:
        raise ModelBenchmarkError(f"measuring {os.path.basename(folder)} at {length} tokens failed: {error}") from None


def backbone_geometry(config: dict) -> dict:
    """``{model_type, layers, hidden_size, heads}`` of a saved ``config.json``: a Performer folder's are those of the
    softmax model it was converted from (``source_config``)."""
    source = config.get("source_config") or config
    text = source.get("text_config") or source
    pick = lambda *keys: next((text[key] for key in keys if text.get(key) is not None), None)  # noqa: E731
    return {"model_type": source.get("model_type"),
            "layers": pick("num_hidden_layers", "n_layer", "n_layers"),
            "hidden_size": pick("hidden_size", "n_embd", "dim", "d_model"),
            "heads": pick("num_attention_heads", "n_head", "n_heads")}


def check_same_architecture(folders: list[str], labels: list[str]) -> None:
    """Refuse folders whose backbones differ from the baseline's (the first): their time ratios would compare
    unrelated models (a Llama baseline against a converted BERT)."""
    import json

    geometries = []
    for folder in folders:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
            geometries.append(backbone_geometry(json.load(handle)))
    baseline = geometries[0]
    for label, geometry in zip(labels[1:], geometries[1:]):
        differing = [f"{key} {geometry[key]} (baseline {baseline[key]})" for key in baseline
                     if geometry[key] != baseline[key]]
        if differing:
            raise ModelBenchmarkError(
                f"{label} is not the baseline {labels[0]}'s architecture ({', '.join(differing)}): the ratios would "
                "compare unrelated models; give the softmax source first, then models converted from it")


def run_model_benchmark(folders, lengths=(8192, 16384), batch: int = 1, backward: bool = False, repeats: int = 1,
                        labels=None, progress: bool = True, processes: int = 1) -> dict:
    """Time and extra peak memory of each model folder at each length, interleaved (length by length, every model
    in turn); the first folder is the baseline of the ratios (normally the softmax source).

    Args:
        folders: model folders (a softmax source and its converted models), loadable with ``AutoModel``.
        lengths: tokens per sequence.
        labels: names of the models in the records (default: the folders' base names).
        processes: whole runs of the sweep (each point always in a fresh process); figures are their medians.
    """
    from tqdm.auto import tqdm

    folders = [os.fspath(folder) for folder in folders]
    if len(folders) < 1:
        raise ModelBenchmarkError("give at least one model folder (the first is the baseline of the ratios)")
    missing = [folder for folder in folders if not os.path.isfile(os.path.join(folder, "config.json"))]
    if missing:
        raise ModelBenchmarkError(f"not a model folder (no config.json): {', '.join(missing)}")
    labels = list(labels) if labels is not None else [os.path.basename(os.path.normpath(f)) for f in folders]
    if len(labels) != len(folders) or len(set(labels)) != len(labels):
        raise ModelBenchmarkError(f"need one distinct label per folder, got {labels}")
    if batch < 1 or repeats < 1 or processes < 1 or not lengths or min(lengths) < 1:
        raise ModelBenchmarkError("--batch, --repeats, --processes and every length must be >= 1")
    check_same_architecture(folders, labels)
    jobs = [(run, length, label, folder) for run in range(processes) for length in lengths
            for label, folder in zip(labels, folders)]
    points: dict = {}
    runs = []
    for run, length, label, folder in tqdm(jobs, desc="model benchmark", disable=not progress):
        if len(runs) == run:
            runs.append({"date": machine_info(torch.device("cpu"))["date"], "load_average": load_average()})
        points.setdefault((label, length), []).append(_measure_in_fresh_process(folder, length, batch, backward,
                                                                               repeats))
    records = [_merged_point(label, length, points[(label, length)]) for length in lengths for label in labels]
    result = {
        "benchmark": "model_speed",
        "settings": dict(models=labels, lengths=list(lengths), batch=batch, backward=backward, repeats=repeats,
                         processes=processes,
                         measured="backbone (AutoModel, no task head); " + (
                             "forward + backward of last_hidden_state.sum()" if backward else "inference forward"),
                         memory="growth of the peak resident set (VmHWM) of a fresh process beyond the loaded model"),
        "machine": {**machine_info(torch.device("cpu")), "load_average": runs[0]["load_average"]}
        | ({"runs": runs} if processes > 1 else {}),
        "records": records,
    }
    result["summary"] = summarize_model_speed(result)
    return result


def _merged_point(label: str, length: int, runs: list[dict]) -> dict:
    """One (model, length) record from its runs: the median seconds and memory, each run's kept when several."""
    record = dict(model=label, length=length, **runs[0])
    if len(runs) > 1:
        for field in ("seconds", "peak_memory_bytes"):
            record[f"process_{field}"] = [run[field] for run in runs]
            record[field] = statistics.median(record[f"process_{field}"])
    return record


def summarize_model_speed(result: dict) -> dict:
    """Per length and model: seconds and peak memory as ratios to the first model's (``speedup`` = baseline seconds
    / model seconds; ``memory_ratio`` = model bytes / baseline bytes, ``None`` when the baseline grew by nothing)."""
    baseline = result["settings"]["models"][0]
    by_key = {(r["model"], r["length"]): r for r in result["records"]}
    rows = []
    for record in result["records"]:
        base = by_key.get((baseline, record["length"]))
        if base is None:
            continue
        rows.append(dict(model=record["model"], length=record["length"],
                         speedup=base["seconds"] / record["seconds"],
                         memory_ratio=record["peak_memory_bytes"] / base["peak_memory_bytes"]
                         if base["peak_memory_bytes"] else None))
    return {"baseline": baseline, "ratios": rows}


def format_model_speed_table(result: dict) -> str:
    """The records of :func:`run_model_benchmark` as a table with the ratios to the baseline."""
    settings = result["settings"]
    ratios = {(r["model"], r["length"]): r for r in result["summary"]["ratios"]}
    runs = settings.get("processes", 1)
    lines = [f"{settings['measured']}, batch {settings['batch']}, {result['machine']['device_name']}; "
             f"ratios against {result['summary']['baseline']}" + (f"; medians of {runs} runs" if runs > 1 else ""),
             f"{'model':<24} {'tokens':>7} {'seconds':>9} {'peak MiB':>9} {'speedup':>8} {'memory':>7}"]
    for record in result["records"]:
        ratio = ratios.get((record["model"], record["length"]), {})
        memory_ratio = ratio.get("memory_ratio")
        memory_text = f"{memory_ratio:6.2f}x" if memory_ratio is not None else f"{'-':>7}"
        lines.append(f"{record['model']:<24} {record['length']:>7} {record['seconds']:9.2f} "
                     f"{record['peak_memory_bytes'] / 2 ** 20:9.0f} {ratio.get('speedup', float('nan')):7.2f}x "
                     + memory_text)
    return "\n".join(lines)


def plot_model_speed(result: dict, path) -> None:
    """Seconds and extra peak memory against length, one line per model (log-log)."""
    from .report import _log_log_axes, _pyplot, _save

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label in result["settings"]["models"]:
        rows = sorted((r for r in result["records"] if r["model"] == label), key=lambda r: r["length"])
        lengths = [r["length"] for r in rows]
        axes[0].plot(lengths, [r["seconds"] for r in rows], marker="o", label=f"{label} ({rows[0]['attention']})")
        axes[1].plot(lengths, [r["peak_memory_bytes"] / 2 ** 20 for r in rows], marker="o", label=label)
    _log_log_axes(axes, "tokens", ["seconds per call", "extra peak memory (MiB)"])
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{result['settings']['measured']}, batch {result['settings']['batch']}\n"
                 f"{result['machine']['device_name']}, {result['machine']['torch_threads']} threads", fontsize=9)
    _save(plt, fig, path)
