"""Whole-model timings on a CUDA GPU: a SmolLM2-135M-shaped Llama (random weights) against its conversions.

Measures, for the softmax source (SDPA) and each conversion in the same run, interleaved point by point:

* ``train``: one training step (forward + backward of the LM loss, bf16 autocast over float32 weights, ``1 x L``
  tokens), median of ``--repeats`` after a warm-up;
* ``prefill``: ``generate`` of one new token after ``L`` prompt tokens (bf16 weights), median;
* ``decode``: milliseconds per generated token after a prompt of ``L`` tokens, batch ``B``: (time of ``1 + n`` new
  tokens - time of 1) / ``n``, medians.

SmolLM2-135M's real weights are too large to carry to a lent GPU; random weights of its shape time the same work
(greedy decoding is forced to ``n`` tokens: no end-of-sequence stop). Each point runs under its own ``try``: a point
that fails is recorded with its error, and the JSON is rewritten after every point (a stage cut short keeps what it
measured).

    python benchmarks/scripts/gpu_model_speed.py --output benchmarks/results/gpu_model_speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

CONVERSIONS = {
    # the recommended causal-LM conversion (docs: window 64 + 4 sinks + a sparse cache of 256 keys, no tail)
    "window64_g256": dict(feature_map="hedgehog", window=64, sinks=4, sparse_cache=256, linear_tail=False),
    # the hybrid with a learned Hedgehog tail
    "window64_tail": dict(feature_map="hedgehog", window=64, sinks=4),
    # plain FAVOR+ (m = 256), causal
    "favor": dict(feature_map="favor+", nb_features=256),
}


def smollm2_shaped(max_positions: int, layers: int = 30):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=max_positions,
                         rope_theta=100000.0, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


DEVICE = torch.device("cuda")


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _median_seconds(call, repeats: int) -> list[float]:
    call()  # warm-up
    _sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        _sync()
        times.append(time.perf_counter() - start)
    return times


def train_step_seconds(model, length: int, repeats: int) -> list[float]:
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (1, length), device=DEVICE)

    def step():
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    try:
        return _median_seconds(step, repeats)
    finally:
        model.eval()


def _generate(model, ids, new_tokens: int):
    with torch.inference_mode():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)


def prefill_seconds(model, length: int, repeats: int, batch: int = 1) -> list[float]:
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=DEVICE)
    return _median_seconds(lambda: _generate(model, ids, 1), repeats)


def decode_ms_per_token(model, context: int, batch: int, new_tokens: int, repeats: int) -> list[float]:
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=DEVICE)
    one = _median_seconds(lambda: _generate(model, ids, 1), repeats)
    many = _median_seconds(lambda: _generate(model, ids, 1 + new_tokens), repeats)
    return [1000.0 * (b - a) / new_tokens for a, b in zip(sorted(one), sorted(many))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="the JSON to write (rewritten after each point)")
    parser.add_argument("--conversions", nargs="+", choices=sorted(CONVERSIONS), default=["window64_g256"])
    parser.add_argument("--train-lengths", type=lambda s: [int(x) for x in s.split(",") if x], default=[2048, 8192])
    parser.add_argument("--prefill-lengths", type=lambda s: [int(x) for x in s.split(",") if x], default=[16384])
    parser.add_argument("--decode-contexts", type=lambda s: [int(x) for x in s.split(",") if x],
                        default=[512, 4096, 16384])
    parser.add_argument("--decode-batches", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stages", nargs="+", default=["train", "prefill", "decode"],
                        choices=["train", "prefill", "decode"])
    parser.add_argument("--device", default="cuda", help="cuda (the measurement); cpu only checks the script")
    parser.add_argument("--layers", type=int, default=30, help="fewer layers only to check the script quickly")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print("gpu_model_speed.py: no CUDA device (pass --device cpu to check the script)", file=sys.stderr)
        return 2

    from hf_performer.bench.machine import machine_info
    from hf_performer.conversion import convert_to_performer
    from hf_performer.decayed_attention import backend_for
    from transformers.utils import logging

    logging.set_verbosity_error()
    longest = max(args.train_lengths + args.prefill_lengths + args.decode_contexts) + args.new_tokens + 8
    source = smollm2_shaped(longest, args.layers)
    models = {"softmax_sdpa": source}
    for name in args.conversions:
        models[name] = convert_to_performer(source, task="causal-lm", **CONVERSIONS[name])
    result = {
        "benchmark": "gpu_model_speed",
        # (the output as a repository path: the record carries no local folder)
        "command": "python benchmarks/scripts/gpu_model_speed.py " + " ".join(
            f"benchmarks/results/{Path(word).name}" if word.endswith(".json") else word
            for word in (argv if argv is not None else sys.argv[1:])),
        "model": f"SmolLM2-135M-shaped Llama ({args.layers} layers, hidden 576, 9 heads, 3 KV heads), random weights",
        "conversions": {name: CONVERSIONS[name] for name in args.conversions},
        "machine": machine_info(DEVICE),
        "linear_backend": backend_for(torch.zeros(1, device=DEVICE, dtype=torch.bfloat16)),
        "records": [],
    }

    def record(**fields):
        result["records"].append(fields)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")
        value = fields.get("median_s", fields.get("median_ms_per_token"))
        print(f"{fields['stage']:8s} {fields['model']:14s} L={fields['length']:6d} B={fields.get('batch', 1)} "
              f"{value if value is not None else fields.get('error')}", flush=True)

    def measure(stage, name, length, batch, call, unit="s"):
        try:
            values = call()
            key = "median_s" if unit == "s" else "median_ms_per_token"
            record(stage=stage, model=name, length=length, batch=batch, **{key: statistics.median(values)},
                   runs=values)
        except Exception as error:  # noqa: BLE001 - a failed point is a result too
            if DEVICE.type == "cuda":
                torch.cuda.empty_cache()
            record(stage=stage, model=name, length=length, batch=batch, error=f"{type(error).__name__}: {error}"[:400])

    if "train" in args.stages:
        for name, model in models.items():
            model.to(DEVICE, torch.float32)
        for length in args.train_lengths:
            for name, model in models.items():
                measure("train", name, length, 1, lambda: train_step_seconds(model, length, args.repeats))
    for name, model in models.items():
        model.to(DEVICE, torch.bfloat16).eval()
    if "prefill" in args.stages:
        for length in args.prefill_lengths:
            for name, model in models.items():
                measure("prefill", name, length, 1, lambda: prefill_seconds(model, length, args.repeats))
    if "decode" in args.stages:
        for batch in args.decode_batches:
            for context in args.decode_contexts:
                for name, model in models.items():
                    measure("decode", name, context, batch, lambda: decode_ms_per_token(
                        model, context, batch, args.new_tokens, args.repeats), unit="ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
