"""Zero-shot swaps of a fine-tuned softmax classifier: clustered, improved clustered and FAVOR+ attention, no training.

Loads the fine-tuned softmax folder once, tokenises the validation split once, and evaluates the softmax model and
every swap on the same examples (``convert_to_performer`` with ``attention=...``; nothing is trained after the
swap). Writes ``NAME.json`` (settings, machine, command, every metric, and each swap's agreement with the softmax
model's own predictions) and ``NAME.png`` (the main metric against the number of clusters).

    python benchmarks/scripts/clustered_zero_shot.py --model $TMPDIR/stsb/a_softmax --task stsb \
        --validation-file ../shared/data/glue/STS-B/dev.tsv --clusters 1,2,4,8,16,32 --topk 32 \
        --output-dir benchmarks/results --name clustered_zero_shot_stsb
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch


def _relative(path: str) -> str:
    """A path for the committed JSON: relative to the checkout, or with $TMPDIR / the MiniLM package named."""
    path = os.path.abspath(path)
    tmp = os.environ.get("TMPDIR", "/tmp")
    if path.startswith(tmp.rstrip("/") + "/"):
        return "$TMPDIR/" + path[len(tmp.rstrip("/")) + 1:]
    return os.path.relpath(path, Path(__file__).resolve().parents[2])


def _variants(clusters: list[int], improved_clusters: list[int], topk: int, extra_topk: list[int],
              headline: int) -> list[dict]:
    variants = [dict(name="softmax", attention="softmax"), dict(name="favor+", attention="linear")]
    for count in clusters:
        variants.append(dict(name=f"clustered C={count}", attention="clustered", clusters=count))
    for count in improved_clusters:
        variants.append(dict(name=f"improved C={count} k={topk}", attention="improved-clustered", clusters=count,
                             topk=topk))
    for k in extra_topk:
        variants.append(dict(name=f"improved C={headline} k={k}", attention="improved-clustered", clusters=headline,
                             topk=k))
    return variants


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="fine-tuned softmax sequence-classification folder")
    parser.add_argument("--task", default="stsb")
    parser.add_argument("--validation-file", required=True)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--max-eval-samples", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the --max-eval-samples subset (hf-performer evaluate's --seed; the IMDB recovery "
                             "table used 42)")
    parser.add_argument("--clusters", default="1,2,4,8,16,32", help="comma-separated cluster counts")
    parser.add_argument("--improved-clusters", default=None,
                        help="comma-separated cluster counts of the improved rows (default: --clusters)")
    parser.add_argument("--topk", type=int, default=32)
    parser.add_argument("--extra-topk", default="", help="comma-separated extra topk values at --headline-clusters")
    parser.add_argument("--headline-clusters", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--name", default="clustered_zero_shot")
    args = parser.parse_args(argv)

    from torch.utils.data import DataLoader
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    from hf_performer.bench.machine import machine_info
    from hf_performer.conversion import convert_to_performer
    from hf_performer.tasks.data import get_task, load_task_split, tokenize_task_dataset
    from hf_performer.tasks.evaluation import compute_task_metrics, predict_classification

    spec = get_task(args.task)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset = load_task_split(spec, "validation", args.validation_file, args.max_eval_samples, args.seed)
    tokenized = tokenize_task_dataset(dataset, tokenizer, spec, args.max_length)
    lengths = [len(ids) for ids in tokenized["input_ids"]]
    loader = DataLoader(tokenized, batch_size=args.batch_size, collate_fn=DataCollatorWithPadding(tokenizer))
    source = AutoModelForSequenceClassification.from_pretrained(args.model).eval()

    clusters = [int(c) for c in args.clusters.split(",") if c]
    improved_clusters = clusters if args.improved_clusters is None else [
        int(c) for c in args.improved_clusters.split(",") if c]
    extra_topk = [int(k) for k in args.extra_topk.split(",") if k]
    records, softmax_predictions = [], None
    for variant in _variants(clusters, improved_clusters, args.topk, extra_topk, args.headline_clusters):
        if variant["attention"] == "softmax":
            model = source
        else:
            settings = {key: variant[key] for key in ("attention", "clusters", "topk") if key in variant}
            model = convert_to_performer(source, **settings).eval()
        start = time.perf_counter()
        predictions, references, loss = predict_classification(model, loader, spec, show_progress=False)
        seconds = time.perf_counter() - start
        metrics, _, _ = compute_task_metrics(spec, predictions, references, "local")
        predictions = np.asarray(predictions, dtype=np.float64)  # [n]: scores (regression) or class ids
        if softmax_predictions is None:
            softmax_predictions = predictions
        agreement = (float(np.corrcoef(predictions, softmax_predictions)[0, 1]) if spec.is_regression
                     else float((predictions == softmax_predictions).mean()))
        record = dict(variant, metrics=metrics, main_metric=metrics[spec.main_metric], eval_loss=loss,
                      agreement_with_softmax=agreement, eval_seconds=round(seconds, 2))
        records.append(record)
        print(f"{variant['name']:<24} {spec.main_metric} {record['main_metric']:.4f}  vs softmax {agreement:.4f}  "
              f"({seconds:.0f} s)", flush=True)

    result = dict(
        benchmark="clustered_zero_shot", task=spec.name, main_metric=spec.main_metric,
        agreement_metric="Pearson r with the softmax model's predictions" if spec.is_regression
        else "fraction of examples where the prediction equals the softmax model's",
        settings=dict(model=_relative(args.model), validation_file=_relative(args.validation_file),
                      max_length=args.max_length, num_examples=len(lengths), subset_seed=args.seed, mean_tokens=float(np.mean(lengths)),
                      max_tokens=int(max(lengths)), clusters=clusters, improved_clusters=improved_clusters, topk=args.topk, extra_topk=extra_topk,
                      headline_clusters=args.headline_clusters, hash_bits=63, iterations=10),
        command="python benchmarks/scripts/clustered_zero_shot.py " + " ".join(
            _relative(a) if os.path.exists(a) else a for a in (argv if argv is not None else sys.argv[1:])),
        machine=machine_info(torch.device("cpu")),
        records=records,
    )
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(result, args.output_dir / f"{args.name}.png")
    print(f"wrote {args.output_dir / args.name}.json and .png")
    return 0


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = result["records"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    s = result["settings"]
    for ax, key, ylabel in ((axes[0], "main_metric", f"{result['task']} {result['main_metric']} (zero-shot swap)"),
                            (axes[1], "agreement_with_softmax", "agreement with the softmax model's predictions")):
        for attention, style, label in (("clustered", "-o", "clustered"),
                                        ("improved-clustered", "-s", f"improved, top-{s['topk']}")):
            points = sorted((r["clusters"], r[key]) for r in records
                            if r["attention"] == attention and r.get("topk", s["topk"]) == s["topk"])
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
        for name, color in (("softmax", "black"), ("favor+", "tab:red")):
            record = next(r for r in records if r["name"] == name)
            ax.axhline(record[key], color=color, linestyle="--",
                       label=f"{'FAVOR+ (256 features)' if name == 'favor+' else name}: {record[key]:.3f}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("clusters per head")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['task']}: {s['num_examples']} dev examples, mean {s['mean_tokens']:.0f} tokens "
                 f"(max {s['max_tokens']}); no training after the swap", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
