"""Compatibility sweep: every model type of the installed transformers that routes attention through its registry.

    nice -n 19 python benchmarks/scripts/compatibility_sweep.py \\
        --output benchmarks/results/compatibility.json --table docs/compatibility.md

For every model type whose modeling code reads ``ALL_ATTENTION_FUNCTIONS`` and that has a causal-LM, masked-LM or
sequence-classification head, and for each of those heads, a tiny random source model is built
(:mod:`tiny_source_models`) and converted three ways: FAVOR+, the sink + sliding-window hybrid (window 4, 1 sink)
and, for bidirectional models (encoders), zero-shot clustered attention. Each conversion is then

1. converted as ``hf-performer convert`` does (``convert_to_performer``, a shorter learned position table extended to
   4096 positions, then ``fidelity_report``): a ``ConversionError`` is a refusal, recorded with its one-line reason;
   anything else is a failure; an extended table then takes an input longer than the source's;
2. run on a padded batch (left padding for causal heads, right padding otherwise): finite outputs, and each row's
   logits equal to that row run alone when the source softmax model has this property too;
3. causal heads: ``generate()`` greedy with and without the cache (equal tokens, a batch of 2 with left padding), and
   assisted decoding with the softmax source as the assistant (equal tokens to plain greedy decoding);
4. saved, then reloaded with ``trust_remote_code=True`` in one child process that cannot import ``hf_performer``
   (equal logits on the padded batch).

A head *works* when every variant not refused passed every step, the FAVOR+ variant included; it is *refused*
when its FAVOR+ conversion was refused; otherwise it *fails* (the step and the error are recorded). A step the softmax
source itself cannot do (assisted decoding of stateful hybrid models) is not run and noted; a tiny source this script
cannot build, or that fails the probe batch itself, is *no tiny source*. An architecture
works when all its heads work, is refused when all are refused, is partial when some work and the others are
refused, and fails otherwise. The denominator of the target is the text-only architectures (no vision / audio
sub-config); multimodal wrappers are listed apart.

Writes the JSON (``--output``) and the markdown table (``--table``); ``--only TYPE ...`` runs a few model types and
writes nothing unless ``--output`` / ``--table`` are given.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_source_models as tiny  # noqa: E402

SEQ_LEN = 8
PADDING = 3
NEW_TOKENS = 5
NB_FEATURES = 16
VARIANTS = {
    "favor+": {"nb_features": NB_FEATURES},
    "window": {"nb_features": NB_FEATURES, "window": 4, "sinks": 1},
    "clustered": {"attention": "clustered", "clusters": 2, "topk": 3},
}
"""Conversion settings of each variant; "clustered" runs on bidirectional models only."""

TOLERANCE = 1e-4
RELOAD_SCRIPT = r"""
import json, sys
sys.meta_path.insert(0, type("Block", (), {"find_spec": staticmethod(
    lambda name, path=None, target=None: (_ for _ in ()).throw(ModuleNotFoundError(name))
    if name == "hf_performer" or name.startswith("hf_performer.") else None)})())
import torch, transformers
from transformers.utils import logging
logging.set_verbosity_error()
AUTO = {"causal-lm": "AutoModelForCausalLM", "masked-lm": "AutoModelForMaskedLM",
        "sequence-classification": "AutoModelForSequenceClassification"}
results = {}
for job in json.load(open(sys.argv[1])):
    try:
        model = getattr(transformers, AUTO[job["head"]]).from_pretrained(job["folder"], trust_remote_code=True).eval()
        if "hf_performer" in type(model).__module__.split(".")[0]:
            raise RuntimeError("loaded hf_performer's own class, not the saved code")
        inputs = torch.load(job["inputs"])
        with torch.no_grad():
            logits = model(**inputs).logits
        expected = torch.load(job["expected"])
        error = (logits - expected).abs().max().item()
        results[job["key"]] = None if error <= job["tolerance"] else f"logits differ by {error:.3g}"
    except Exception as exc:
        text = str(exc).strip().splitlines()
        results[job["key"]] = f"{type(exc).__name__}: {text[0][:300] if text else ''}"
print(json.dumps(results))
"""


class StepFailed(Exception):
    def __init__(self, step: str, error: str):
        super().__init__(f"{step}: {error}")
        self.step, self.error = step, error


def _step(name: str, function, *args, **kwargs):
    try:
        return function(*args, **kwargs)
    except StepFailed:
        raise
    except Exception as error:  # noqa: BLE001 - every failure is recorded, the sweep goes on
        raise StepFailed(name, f"{type(error).__name__}: {tiny.first_line(error)}") from error


def probe_inputs(config, causal: bool) -> dict:
    """A batch of 2 rows of :data:`SEQ_LEN` tokens, the second one padded (left for causal heads, else right)."""
    vocab = int(getattr(config, "vocab_size", tiny.VOCAB_SIZE) or tiny.VOCAB_SIZE)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, min(vocab, 200), (2, SEQ_LEN), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    pad = config.pad_token_id if isinstance(getattr(config, "pad_token_id", None), int) else 0
    if causal:
        attention_mask[1, :PADDING] = 0
        input_ids[1, :PADDING] = pad
    else:
        attention_mask[1, -PADDING:] = 0
        input_ids[1, -PADDING:] = pad
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def _alone(inputs: dict) -> dict:
    """The padded row of :func:`probe_inputs` alone, without its padding."""
    real = inputs["attention_mask"][1].bool()
    return {name: tensor[1:2, real] for name, tensor in inputs.items()}


def _logits(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        output = model(**inputs)
    return output.logits


def padding_mismatch(model, inputs: dict, sequence_level: bool) -> float:
    """Largest difference between the padded row's logits in the batch and alone."""
    batched = _logits(model, inputs)
    alone = _logits(model, _alone(inputs))
    real = inputs["attention_mask"][1].bool()
    row = batched[1] if sequence_level else batched[1][real]
    return (row - alone[0]).abs().max().item()


def _long_input(source, performer) -> None:
    """One row longer than the source's learned position table runs through the extended table."""
    from hf_performer.conversion import learned_position_count

    length = learned_position_count(source) + SEQ_LEN
    input_ids = torch.randint(5, min(int(source.config.vocab_size), 200), (1, length),
                              generator=torch.Generator().manual_seed(1))
    if not torch.isfinite(_logits(performer, {"input_ids": input_ids})).all():
        raise AssertionError(f"non-finite outputs for {length} tokens")


def _generate(model, inputs: dict, pad: int, **kwargs):
    return model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=pad, output_scores=True, return_dict_in_generate=True, **kwargs)


def same_tokens(reference, other, what: str) -> None:
    """Equal generated tokens, or a first difference where the reference's top two scores are within
    :data:`TOLERANCE` (a tie that float rounding may break either way)."""
    a, b = reference.sequences, other.sequences
    if a.shape == b.shape and torch.equal(a, b):
        return
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shapes {tuple(a.shape)} and {tuple(b.shape)}")
    row, column = (a != b).nonzero()[0].tolist()
    step = column - (a.shape[1] - len(reference.scores))
    top = reference.scores[step][row].float().topk(2).values
    gap = (top[0] - top[1]).item()
    if gap > TOLERANCE * max(1.0, top[0].abs().item()):
        raise AssertionError(f"{what}: tokens differ at generated position {step} (top-2 score gap {gap:.3g})")


def _source_error(function, *args, **kwargs) -> str | None:
    """``None`` if the softmax source model runs the step, else its error: a step transformers' own model of this
    architecture cannot do is not run on the converted one."""
    try:
        function(*args, **kwargs)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {tiny.first_line(error)}"
    return None


def check_variant(source, head: str, variant: str, folder: str, reload_jobs: list, key: str) -> dict:
    from hf_performer.conversion import ConversionError, convert_to_performer, fidelity_report
    from hf_performer.conversion.convert import default_position_table_size

    causal = head == "causal-lm"
    positions = default_position_table_size(source)  # as hf-performer convert extends a shorter learned table
    try:
        performer = convert_to_performer(source, max_position_embeddings=positions, **VARIANTS[variant])
        fidelity_report(source, performer, None)
    except ConversionError as error:
        message = str(error)
        return {"status": "refused", "reason": message, "one_line": "\n" not in message}
    except Exception as error:  # noqa: BLE001
        source_error = tiny.own_run_error(source)
        if source_error is not None:  # a malformed tiny source, not a verdict on the converter
            return {"status": "no tiny source", "error": f"the softmax source cannot run alone: {source_error}"}
        return {"status": "fails", "step": "convert", "error": f"{type(error).__name__}: {tiny.first_line(error)}"}
    inputs = probe_inputs(source.config, causal)
    source_error = _source_error(_logits, source, inputs)
    if source_error is not None:  # the probe inputs do not suit this tiny source: nothing is measured
        return {"status": "no tiny source", "error": f"the softmax source fails the probe batch: {source_error}"}
    try:
        sequence_level = head == "sequence-classification"
        mismatch = _step("forward with padding", padding_mismatch, performer, inputs, sequence_level)
        source_mismatch = padding_mismatch(source, inputs, sequence_level)
        if source_mismatch <= TOLERANCE and mismatch > TOLERANCE:
            raise StepFailed("forward with padding", f"the padded row differs from the row alone by {mismatch:.3g}")
        if positions is not None:
            _step("longer than the source's position table", _long_input, source, performer)
        skipped = {}
        if causal:
            pad = inputs["input_ids"][1, 0].item()
            single = _alone(inputs)
            source_error = _source_error(_generate, source, inputs, pad, use_cache=True)
            if source_error is None:
                cached = _step("generate", _generate, performer, inputs, pad, use_cache=True)
                uncached = _step("generate", _generate, performer, inputs, pad, use_cache=False)
                _step("generate", same_tokens, uncached, cached, "cached vs uncached")
            else:
                skipped["generate"] = source_error
            source_error = source_error or _source_error(_generate, source, single, pad,
                                                         assistant_model=copy.deepcopy(source))
            if source_error is None:
                greedy = _step("assisted decoding", _generate, performer, single, pad)
                assisted = _step("assisted decoding", _generate, performer, single, pad, assistant_model=source)
                _step("assisted decoding", same_tokens, greedy, assisted, "assisted vs greedy")
            else:
                skipped["assisted decoding"] = source_error
        _step("save", performer.save_pretrained, folder)
        torch.save(inputs, os.path.join(folder, "sweep_inputs.pt"))
        torch.save(_logits(performer, inputs), os.path.join(folder, "sweep_expected.pt"))
    except StepFailed as failure:
        return {"status": "fails", "step": failure.step, "error": failure.error}
    reload_jobs.append({"key": key, "folder": folder, "head": head, "tolerance": TOLERANCE,
                        "inputs": os.path.join(folder, "sweep_inputs.pt"),
                        "expected": os.path.join(folder, "sweep_expected.pt")})
    outcome = {"status": "works", "padding_mismatch": mismatch,
               "softmax_layers": list(performer.config.favor_settings["softmax_layers"])}
    if skipped:
        outcome["not_run"] = {step: f"the softmax source fails it too: {error}" for step, error in skipped.items()}
    return outcome


def check_head(model_type: str, head: str, workdir: str, reload_jobs: list) -> dict:
    from hf_performer.favor_attention import is_attention_module

    started = time.time()
    try:
        source = tiny.tiny_source_model(model_type, head, is_attention_module)
    except tiny.TinySourceError as error:
        return {"status": "no tiny source", "error": f"{type(error).__name__}: {tiny.first_line(error)}"}
    bidirectional = not any(getattr(module, "is_causal", False) for module in source.modules()
                            if is_attention_module(module))
    result = {"source_class": type(source).__name__, "variants": {}}
    for variant in VARIANTS:
        if variant == "clustered" and not bidirectional:
            continue
        key = f"{model_type}/{head}/{variant}"
        folder = os.path.join(workdir, key.replace("/", "__"))
        result["variants"][variant] = check_variant(source, head, variant, folder, reload_jobs, key)
    result["seconds"] = round(time.time() - started, 2)
    return result


def run_reloads(jobs: list, workdir: str) -> dict:
    """Reload every saved folder in one child process that cannot import hf_performer."""
    if not jobs:
        return {}
    job_file = os.path.join(workdir, "reload_jobs.json")
    with open(job_file, "w") as handle:
        json.dump(jobs, handle)
    environment = {**os.environ, "HF_MODULES_CACHE": os.path.join(workdir, "modules"), "HF_HUB_OFFLINE": "1",
                   "PYTHONPATH": ""}
    completed = subprocess.run([sys.executable, "-c", RELOAD_SCRIPT, job_file], capture_output=True, text=True,
                               env=environment, cwd=workdir)
    if completed.returncode != 0:
        raise SystemExit(f"the reload process failed:\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def summarise_head(result: dict) -> tuple[str, str]:
    """``(status, detail)`` of one head (see the module docstring)."""
    if "variants" not in result:
        return result["status"], result["error"]
    variants = result["variants"]
    if variants["favor+"]["status"] == "no tiny source":
        return "no tiny source", variants["favor+"]["error"]
    failures = [f"{name} {outcome['step']}: {outcome['error']}" for name, outcome in variants.items()
                if outcome["status"] == "fails"]
    if failures:
        return "fails", "; ".join(failures)
    if variants["favor+"]["status"] == "refused":
        return "refused", variants["favor+"]["reason"]
    notes = []
    kept = variants["favor+"].get("softmax_layers")
    if kept:
        notes.append(f"layers {kept} keep softmax (sliding window or chunks)")
    for step, reason in variants["favor+"].get("not_run", {}).items():
        notes.append(f"{step} not run: {reason}")
    notes += [f"{name}: {outcome['reason']}" for name, outcome in variants.items() if outcome["status"] == "refused"]
    return "works", "; ".join(notes)


def summarise_architecture(heads: dict) -> str:
    statuses = {summarise_head(result)[0] for result in heads.values()}
    if statuses == {"works"}:
        return "works"
    if statuses == {"refused"}:
        return "refused"
    if statuses == {"works", "refused"}:
        return "partial"
    if "fails" in statuses:
        return "fails"
    return "no tiny source"


def run_sweep(model_types: list[str], workdir: str) -> dict:
    reload_jobs: list = []
    architectures = {}
    for model_type in model_types:
        heads = {}
        for head in tiny.heads_of(model_type):
            heads[head] = check_head(model_type, head, workdir, reload_jobs)
            print(f"{model_type:28s} {head:24s} {summarise_head(heads[head])[0]:8s} "
                  f"{summarise_head(heads[head])[1][:150]}", flush=True)
        architectures[model_type] = {"multimodal": tiny.is_multimodal(model_type), "heads": heads}
    for key, error in run_reloads(reload_jobs, workdir).items():
        model_type, head, variant = key.split("/")
        outcome = architectures[model_type]["heads"][head]["variants"][variant]
        if error is not None:
            outcome.update(status="fails", step="reload", error=error)
        else:
            outcome["reloaded"] = True
    for entry in architectures.values():
        entry["status"] = summarise_architecture(entry["heads"])
    return architectures


UNEXPLAINED = re.compile(r"cannot run: (IndexError|KeyError|TypeError|AttributeError|RuntimeError|ValueError)\b")
"""A refusal whose reason is a plain Python error raised inside the converted model, not a named mechanism."""


def refused_without_mechanism(entry: dict) -> bool:
    """Whether a refused architecture's reason, for some head, is an unexplained error (:data:`UNEXPLAINED`)."""
    summaries = [summarise_head(result) for result in entry["heads"].values()]
    return any(status == "refused" and UNEXPLAINED.search(detail or "") for status, detail in summaries)


def totals(architectures: dict) -> dict:
    text = {name: entry for name, entry in architectures.items() if not entry["multimodal"]}
    by_status: dict[str, list[str]] = {}
    for name, entry in text.items():
        by_status.setdefault(entry["status"], []).append(name)
    converting = len(by_status.get("works", [])) + len(by_status.get("partial", []))
    unexplained = sorted(name for name in by_status.get("refused", []) if refused_without_mechanism(text[name]))
    accounted = converting + len(by_status.get("refused", [])) - len(unexplained)
    tested = len(text) - len(by_status.get("no tiny source", []))
    pairs = [summarise_head(result)[0] for entry in text.values() for result in entry["heads"].values()]
    return {
        "text_architectures": len(text),
        "by_status": {status: sorted(names) for status, names in sorted(by_status.items())},
        "converting_share": round(converting / len(text), 4) if text else None,
        "tested_architectures": tested,
        "converting_share_of_tested": round(converting / tested, 4) if tested else None,
        "refused_without_mechanism": unexplained,
        "working_or_refused_by_mechanism_share": round(accounted / len(text), 4) if text else None,
        "text_heads": len(pairs),
        "text_heads_by_status": {status: pairs.count(status) for status in sorted(set(pairs))},
        "multimodal_by_status": {name: entry["status"] for name, entry in architectures.items() if entry["multimodal"]},
    }


def write_table(result: dict, path: str) -> None:
    summary = result["totals"]
    lines = [
        "# Compatibility with transformers' architectures",
        "",
        f"Generated by `{result['command']}` (transformers {result['transformers']}, torch {result['torch']}); do not "
        "edit by hand. Every model type of the installed transformers whose attention goes through its registry "
        "(`ALL_ATTENTION_FUNCTIONS`) and that has a causal-LM, masked-LM or sequence-classification head, each head "
        "on a tiny random model: converted with FAVOR+, the sink + sliding-window hybrid and (bidirectional models) "
        "clustered attention, a shorter learned position table extended as `hf-performer convert` does; run on a "
        "padded batch; `generate()` with and without the cache and assisted decoding "
        "(causal heads); saved and reloaded with `trust_remote_code=True` where hf-performer cannot be imported.",
        "",
        f"**{summary['text_architectures']} text architectures**: "
        + ", ".join(f"{len(names)} {status}" for status, names in summary["by_status"].items())
        + f". {summary['converting_share']:.1%} of them convert, run, generate and reload (every head, or every head "
        f"not refused); {summary['converting_share_of_tested']:.1%} of the {summary['tested_architectures']} that "
        f"had a tiny source. Working, or refused by a named mechanism: "
        f"{summary['working_or_refused_by_mechanism_share']:.1%} of the {summary['text_architectures']}"
        + (f" (refused by a plain error, not a mechanism: {', '.join(summary['refused_without_mechanism'])})"
           if summary["refused_without_mechanism"] else "") + ". Heads: "
        + ", ".join(f"{count} {status}" for status, count in summary["text_heads_by_status"].items()) + ".",
        "",
        "works: every step passed; refused: `hf-performer convert` stops with the one-line reason shown, before "
        "writing anything; partial: some heads work, the others are refused; fails: the step and the error; no tiny "
        "source: the sweep could not build a small random model of this type from its config class's defaults (a "
        "limit of the sweep, not a verdict on the architecture).",
        "",
        "| architecture | status | head | head status | detail |",
        "|---|---|---|---|---|",
    ]
    for multimodal in (False, True):
        if multimodal:
            lines += ["", "## Multimodal wrappers (not in the denominator)", "",
                      "| architecture | status | head | head status | detail |", "|---|---|---|---|---|"]
        for name, entry in sorted(result["architectures"].items()):
            if entry["multimodal"] != multimodal:
                continue
            for index, (head, head_result) in enumerate(entry["heads"].items()):
                status, detail = summarise_head(head_result)
                detail = detail.replace("|", "\\|").replace("\n", " ")
                first = (f"`{name}`", entry["status"]) if index == 0 else ("", "")
                lines.append(f"| {first[0]} | {first[1]} | {head} | {status} | {detail} |")
    with open(path, "w") as handle:
        handle.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", help="JSON file to write (e.g. benchmarks/results/compatibility.json)")
    parser.add_argument("--table", help="markdown table to write (e.g. docs/compatibility.md)")
    parser.add_argument("--only", nargs="+", metavar="MODEL_TYPE", help="sweep these model types only")
    args = parser.parse_args(argv)

    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    candidates = [name for name in tiny.model_types_dispatching_attention() if tiny.heads_of(name)]
    if args.only:
        unknown = sorted(set(args.only) - set(candidates))
        if unknown:
            raise SystemExit(f"--only: {unknown} are not registry-routed model types with a causal-LM, masked-LM or "
                             "sequence-classification head")
        candidates = [name for name in candidates if name in args.only]
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="compatibility_sweep_") as workdir:
        architectures = run_sweep(candidates, workdir)
    command = "python benchmarks/scripts/compatibility_sweep.py" + (
        " --output " + args.output if args.output else "") + (" --table " + args.table if args.table else "")
    result = {
        "command": command, "transformers": transformers.__version__, "torch": torch.__version__,
        "python": platform.python_version(), "wall_time_s": round(time.time() - started, 1),
        "variants": VARIANTS, "totals": None, "architectures": architectures,
    }
    result["totals"] = totals(architectures)
    print(json.dumps(result["totals"], indent=1))
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(result, handle, indent=1)
            handle.write("\n")
    if args.table:
        write_table(result, args.table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
