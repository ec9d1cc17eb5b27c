"""Greedy continuations of a few prompts by several causal-LM folders, side by side.

    python benchmarks/scripts/greedy_samples.py \\
        --model softmax=/tmp/smollm2_runs/finetune_softmax --model hedgehog=/tmp/smollm2_runs/finetune_transfer \\
        --max-new-tokens 40 --output /tmp/smollm2_runs/samples.json

Each folder is loaded with ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` (Performer
folders carry their code and ``auto_map``; plain Llama / GPT-2 folders load as usual) and its ``AutoTokenizer``, put
in eval mode, and every prompt is continued with greedy decoding (``generate(do_sample=False)``), one prompt at a time
(no padding). Per model and prompt the JSON holds the continuation, the number of new tokens, the wall time of the
``generate`` call (after an untimed 2-token warm-up per model, unless ``--no-warmup``) and the generation cache that
was used: for Performer (FAVOR+ / linear attention) models the cache layers should be ``FavorCacheLayer`` (a
constant-size recurrent state per layer instead of keys and values), and the record says whether every
linear-attention layer used one (``constant_memory_cache``) and the bytes each kind of cache layer held at the end.
The JSON also records torch / transformers versions and the machine; a readable listing is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time

DEFAULT_PROMPTS = (
    "The history of the city begins in",
    "The song was released as a single in",
    "In the early years of the twentieth century , the",
    "The species is found in",
)
"""Short neutral openings in the style of WikiText (its `` , `` spacing included)."""

FAVOR_LAYER_TYPE = "favor"  # FavorCacheLayer._layer_type (compared by value: remote-code copies are other classes)


def machine_info() -> dict:
    """The package's benchmark machine record (CPU, cores, threads, versions, date) plus transformers and CUDA."""
    import torch
    import transformers

    from hf_performer.bench.machine import machine_info as benchmark_machine_info

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {**benchmark_machine_info(device), "platform": platform.platform(), "transformers": transformers.__version__}


def parse_model_spec(spec: str) -> tuple[str, str]:
    """``NAME=FOLDER`` -> ``(NAME, FOLDER)``."""
    name, sep, folder = spec.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"--model expects NAME=FOLDER, got {spec!r}")
    return name, folder


def _cache_layers(past_key_values) -> list:
    cache = getattr(past_key_values, "self_attention_cache", past_key_values)  # encoder-decoder caches
    return list(getattr(cache, "layers", []) or [])


def _layer_nbytes(layer) -> int:
    """Bytes held by one cache layer: the recurrent state of a favor layer, the keys and values of the others."""
    if hasattr(layer, "state_nbytes"):
        return int(layer.state_nbytes())
    total = 0
    for name in ("keys", "values"):
        tensor = getattr(layer, name, None)
        if tensor is not None and hasattr(tensor, "numel"):
            total += tensor.numel() * tensor.element_size()
    return total


def describe_cache(past_key_values, softmax_layers=()) -> dict:
    """Which cache layer classes ``generate`` used, their bytes, and whether every favor layer kept a constant-size
    state (``None`` when the model has no favor layer)."""
    layers = _cache_layers(past_key_values)
    classes = [type(layer).__name__ for layer in layers]
    counts: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    for layer, name in zip(layers, classes):
        counts[name] = counts.get(name, 0) + 1
        nbytes[name] = nbytes.get(name, 0) + _layer_nbytes(layer)
    favor = [getattr(type(layer), "_layer_type", None) == FAVOR_LAYER_TYPE for layer in layers]
    return {
        "cache_class": type(past_key_values).__name__ if past_key_values is not None else None,
        "layer_classes": counts,
        "layer_bytes": nbytes,
        "favor_layers": sum(favor),
        "num_layers": len(layers),
        "softmax_layers": list(softmax_layers),
    }


def model_summary(model) -> dict:
    config = model.config
    is_performer = getattr(config, "model_type", None) == "performer"
    settings = dict(getattr(config, "favor_settings", None) or {}) if is_performer else None
    source_config = getattr(config, "source_config", None)
    return {
        "class": type(model).__name__,
        "model_type": config.model_type,
        "source_model_type": getattr(source_config, "model_type", None) if is_performer else config.model_type,
        "attention": "favor" if is_performer else "softmax",
        "feature_map": settings.get("feature_map") if settings else None,
        "favor_settings": settings,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype),
    }


def generate_samples(name: str, folder: str, prompts: list[str], max_new_tokens: int, device: str,
                     warmup: bool = True) -> dict:
    """Load ``folder`` and continue each prompt greedily; returns the model's record. With ``warmup``, an untimed
    2-token generation of the first prompt runs first (first-call overheads stay out of the timings)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load_start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)  # Performer configs carry auto_map
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).to(device).eval()
    load_seconds = time.perf_counter() - load_start
    summary = model_summary(model)
    softmax_layers = (summary["favor_settings"] or {}).get("softmax_layers", []) if summary["favor_settings"] else []
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if warmup and prompts:
        with torch.no_grad():
            model.generate(**tokenizer(prompts[0], return_tensors="pt").to(device), do_sample=False, num_beams=1,
                           max_new_tokens=2, pad_token_id=pad_token_id)
    samples = []
    for prompt in prompts:
        encoded = tokenizer(prompt, return_tensors="pt").to(device)
        prompt_tokens = int(encoded["input_ids"].shape[-1])
        start = time.perf_counter()
        with torch.no_grad():
            output = model.generate(
                **encoded, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
                return_dict_in_generate=True,
            )
        seconds = time.perf_counter() - start
        new_ids = output.sequences[0, prompt_tokens:]
        cache = describe_cache(getattr(output, "past_key_values", None), softmax_layers)
        record = {
            "prompt": prompt,
            "prompt_tokens": prompt_tokens,
            "continuation": tokenizer.decode(new_ids, skip_special_tokens=True),
            "new_tokens": int(new_ids.numel()),
            "stopped_at_eos": bool(
                tokenizer.eos_token_id is not None and new_ids.numel() and int(new_ids[-1]) == tokenizer.eos_token_id
            ),
            "wall_time_s": round(seconds, 4),
            "tokens_per_s": round(new_ids.numel() / seconds, 3) if seconds > 0 else None,
            "cache": cache,
        }
        if summary["attention"] == "favor":
            expected = cache["num_layers"] - len(softmax_layers)
            record["constant_memory_cache"] = cache["num_layers"] > 0 and cache["favor_layers"] == expected
        samples.append(record)
    result = {"name": name, "folder": folder, "model": summary, "load_seconds": round(load_seconds, 3),
              "samples": samples}
    if summary["attention"] == "favor":
        result["constant_memory_cache"] = all(s["constant_memory_cache"] for s in samples)
    del model
    return result


def format_listing(record: dict) -> str:
    """The prompts and every model's continuation, one block per prompt."""
    models = record["models"]
    width = max((len(m["name"]) for m in models), default=0)
    lines = []
    for index, prompt in enumerate(record["prompts"]):
        lines.append(f"=== prompt {index + 1}: {prompt!r}")
        for model in models:
            sample = model["samples"][index]
            cache = ", ".join(f"{k} x{v}" for k, v in sample["cache"]["layer_classes"].items()) or "no cache"
            text = " ".join(sample["continuation"].split())
            lines.append(f"  {model['name']:<{width}} | {text}")
            lines.append(f"  {'':<{width}} | [{sample['new_tokens']} tokens, {sample['wall_time_s']:.2f} s, {cache}]")
        lines.append("")
    for model in models:
        if "constant_memory_cache" in model:
            lines.append(f"{model['name']}: constant-memory FavorCacheLayer used on every linear-attention layer: "
                         f"{model['constant_memory_cache']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", dest="models", action="append", type=parse_model_spec, required=True,
                        metavar="NAME=FOLDER", help="a model folder and the name it is listed under (repeatable)")
    parser.add_argument("--prompt", dest="prompts", action="append", default=None, metavar="TEXT",
                        help="a prompt (repeatable; default: %d WikiText-like openings: %s)"
                             % (len(DEFAULT_PROMPTS), "; ".join(repr(p) for p in DEFAULT_PROMPTS)))
    parser.add_argument("--max-new-tokens", type=int, default=40, help="tokens generated per prompt (default: 40)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the untimed 2-token warm-up generation per model")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--output", default=None, metavar="FILE.json", help="write the record to this JSON file")
    args = parser.parse_args(argv)
    names = [name for name, _ in args.models]
    if len(set(names)) != len(names):
        parser.error(f"model names must be distinct, got {names}")
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    for name, folder in args.models:
        if not os.path.isdir(folder):
            parser.error(f"--model {name}={folder}: no such folder")

    import torch
    from transformers.utils import logging

    logging.set_verbosity_error()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    prompts = list(args.prompts) if args.prompts else list(DEFAULT_PROMPTS)
    started = time.perf_counter()
    models = [generate_samples(name, folder, prompts, args.max_new_tokens, device, not args.no_warmup) for name, folder in args.models]
    record = {
        "description": "greedy decoding (do_sample=False), one prompt at a time, continuation = new tokens only",
        "prompts": prompts,
        "max_new_tokens": args.max_new_tokens,
        "warmup": not args.no_warmup,
        "device": device,
        "models": models,
        "wall_time_s": round(time.perf_counter() - started, 2),
        "command": shlex.join(["python", os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine_info(),
    }
    print(format_listing(record))
    if args.output:
        folder = os.path.dirname(os.path.abspath(args.output))
        os.makedirs(folder, exist_ok=True)
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump(record, handle, indent=2, ensure_ascii=False)
            handle.write("\n")
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
