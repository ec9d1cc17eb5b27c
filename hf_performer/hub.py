"""Model cards and Hub upload for Performer model folders (``hf-performer card`` and ``hf-performer push``).

A Performer model folder (written by ``hf-performer convert``, ``hf-performer distill`` or by ``save_pretrained``
after fine-tuning) holds ``config.json`` (with ``auto_map`` and ``favor_settings``), the weights, the model code
(``modeling_performer.py`` and the modules it imports), the tokenizer, usually ``conversion_report.json`` and, after
attention transfer (``hf-performer distill``), ``attention_transfer.json``.

* :func:`build_model_card` renders ``model_cards/performer_card.md`` with ``huggingface_hub``'s
  ``ModelCard.from_template`` / ``ModelCardData``: metadata (``base_model``, ``library_name``,
  ``pipeline_tag``, tags, ``datasets``, ``model-index`` results), the conversion settings (explained for the
  feature map's kind: random, learned or deterministic, with the map's own paper cited), the attention transfer
  (``attention_transfer.json``: data, steps, per-layer errors before and after), the fidelity report, recovery
  results and measured notes on where FAVOR+ is and is not faster. The card is parsed
  back and validated offline by :func:`validate_model_card` (``model-index`` round trip through
  ``huggingface_hub.repocard_data``). :func:`write_model_card` writes it as the folder's ``README.md``.
* :func:`validate_folder` refuses a folder that would not load with
  ``from_pretrained(folder, trust_remote_code=True)``: missing ``config.json`` or ``auto_map``, code files
  named by ``auto_map`` (or imported by them), weights, or tokenizer; a config that ``PerformerConfig`` does not
  load, or whose model (built on the meta device) does not have the tensors and shapes of the safetensors
  headers. The error lists every problem.
* :func:`push_folder` validates, then ``HfApi.create_repo(exist_ok=True)`` (+ ``create_branch`` for a
  ``revision``) and ``HfApi.upload_folder``; ``dry_run=True`` only lists what would be uploaded. A recipe's
  ``checkpoints/`` is left out unless ``include_checkpoints=True``. The token comes from ``token=``, else the
  usual places (``HF_TOKEN``, the cached ``hf auth login`` token); the endpoint from ``endpoint=``, else
  ``HF_ENDPOINT`` (read at call time), else huggingface.co. Failures (``HF_HUB_OFFLINE`` set, the Hub unreachable,
  a refused token) are a :class:`PushError` of one line saying what to do.
* :func:`write_recipe_card` writes the card of a fine-tuning recipe's output folder, with the results of its
  ``metrics.json`` (which :func:`load_metrics` also reads).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import math
import os
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import EvalResult, HfApi, ModelCard, ModelCardData
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
from huggingface_hub.repocard_data import eval_results_to_model_index, model_index_to_eval_results
from huggingface_hub.utils import filter_repo_objects, get_token

from .data import LM_DATASETS, TASKS, DataError, get_task

# The runtime (torch, transformers) is imported in the functions that use it: `push --help` stays fast.


try:  # the patterns upload_folder always adds (private in huggingface_hub; the same list is kept below)
    from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS as _HUB_IGNORE_PATTERNS
except ImportError:  # pragma: no cover - depends on the huggingface_hub version
    _HUB_IGNORE_PATTERNS = [
        ".git", ".git/*", "*/.git", "**/.git/**",
        ".cache/huggingface", ".cache/huggingface/*", "*/.cache/huggingface", "**/.cache/huggingface/**",
    ]


TEMPLATE_NAME = "performer_card.md"
CARD_FILE_NAME = "README.md"
REPORT_FILE_NAME = "conversion_report.json"  # same name as hf_performer.conversion.fidelity.REPORT_FILE_NAME

CARD_TAGS = ("performer", "favor+", "linear-attention", "hf-performer", "custom_code")
"""Tags of a FAVOR+ card (the source architecture's model type is added). A card of another feature map carries
that map's name (``hedgehog``, ``elu+1``, ...) instead of ``favor+``, and ``attention-transfer`` when distilled."""

REQUIRED_CARD_TAGS = tuple(tag for tag in CARD_TAGS if tag != "favor+")
"""Tags every card must carry, plus the name of its feature map (checked by :func:`validate_model_card`)."""

UPLOAD_IGNORE_PATTERNS = ["__pycache__", "__pycache__/*", "*/__pycache__/*", "*.pyc"]
"""Files never uploaded, on top of huggingface_hub's own (``.git``, ``.cache/huggingface``)."""

CHECKPOINT_PATTERNS = ["checkpoints/*"]
"""Run artefacts not uploaded unless asked (``include_checkpoints=True``, ``--include-checkpoints``): the recipes'
``checkpoints/step_N/`` (optimizer, scheduler and RNG states, pickles: often several times the model's size)."""

ARCHITECTURES = {
    # Performer class: (pipeline tag, Auto class, usage lines for the card)
    "PerformerModel": (
        "feature-extraction",
        "AutoModel",
        'inputs = tokenizer(["A long document ..."], return_tensors="pt", padding=True)\n'
        "hidden_states = model(**inputs).last_hidden_state",
    ),
    "PerformerForSequenceClassification": (
        "text-classification",
        "AutoModelForSequenceClassification",
        'logits = model(**tokenizer("A long review ...", return_tensors="pt")).logits',
    ),
    "PerformerForTokenClassification": (
        "token-classification",
        "AutoModelForTokenClassification",
        'logits = model(**tokenizer("A long document ...", return_tensors="pt")).logits',
    ),
    "PerformerForMaskedLM": (
        "fill-mask",
        "AutoModelForMaskedLM",
        'inputs = tokenizer(f"Paris is the {tokenizer.mask_token} of France.", return_tensors="pt")\n'
        "logits = model(**inputs).logits",
    ),
    "PerformerForCausalLM": (
        "text-generation",
        "AutoModelForCausalLM",
        'input_ids = tokenizer("Once upon a time", return_tensors="pt").input_ids\n'
        "output_ids = model.generate(input_ids, max_new_tokens=50)  # constant-memory FAVOR+ state",
    ),
}

SETTING_MEANINGS = {
    "feature_map": "feature map (`favor+`: positive random features, unbiased for softmax)",
    "nb_features": "random features per head (`m`)",
    "orthogonal": "orthogonal (rather than iid) random projections",
    "row_norms": "norms of the projection rows (`chi`: unbiased; `fixed`: all sqrt(d))",
    "redraw_interval": "training forward calls between projection redraws (0: never)",
    "seed": "seed of the projections (layer i uses seed + i)",
    "chunk_size": "chunk size of the causal scan",
    "softmax_layers": "layers kept on exact softmax attention",
    "feature_map_options": "the map's own options (e.g. `feature_epsilon` of `relu`; none: its defaults)",
}
"""Meanings of the ``favor_settings`` keys for *random* feature maps (favor+, trig, relu), in the card's row order.
Learned and deterministic maps read the same keys differently: see :func:`setting_meanings`."""

LEARNED_SETTING_MEANINGS = {
    "feature_map": "learned feature map",
    "nb_features": "features per head (`m`), computed from a trainable projection per head",
    "seed": "seed of the `favor+` initialisation of the learned projections (layer i uses seed + i)",
    "chunk_size": SETTING_MEANINGS["chunk_size"],
    "softmax_layers": SETTING_MEANINGS["softmax_layers"],
    "feature_map_options": "the map's own options: `init` (start of the learned projections: `identity` or "
    "`favor+`), `tie_qk` (queries and keys share one set of parameters); none: the map's defaults",
}
"""Meanings of the ``favor_settings`` keys for *learned* feature maps (hedgehog, t2r): no random projection; the seed
only draws the optional ``"favor+"`` initialisation."""

DETERMINISTIC_SETTING_MEANINGS = {
    "feature_map": "deterministic feature map, nothing random or trained",
    "nb_features": "features per head: always the head dimension",
    "chunk_size": SETTING_MEANINGS["chunk_size"],
    "softmax_layers": SETTING_MEANINGS["softmax_layers"],
    "feature_map_options": "the map's own options (none: its defaults)",
}
"""Meanings of the ``favor_settings`` keys for *deterministic* feature maps (elu+1)."""

FEATURE_MAP_DESCRIPTIONS = {
    "favor+": "`favor+`: positive random features, unbiased for softmax",
    "trig": "`trig`: random Fourier features, unbiased for softmax but not positive",
    "relu": "`relu`: the Performer's generalised ReLU kernel on random projections, not a softmax estimator",
    "elu+1": "`elu+1`: elu(x) + 1, a different kernel, not an estimator of softmax",
    "hedgehog": "`hedgehog`: [softmax(z), softmax(-z)] with z = x W + b, W and b trainable per head",
    "t2r": "`t2r`: relu(x W + b) + eps, W and b trainable per head",
}
"""What each feature map computes (the ``feature_map`` row of the settings table)."""

PAPERS = {
    "choromanski2021": {
        "cite": "Choromanski et al., 2021",
        "url": "https://arxiv.org/abs/2009.14794",
        "bibtex": r"""@inproceedings{choromanski2021rethinking,
  title     = {Rethinking Attention with Performers},
  author    = {Krzysztof Marcin Choromanski and Valerii Likhosherstov and David Dohan and Xingyou Song and
               Andreea Gane and Tamas Sarlos and Peter Hawkins and Jared Quincy Davis and Afroz Mohiuddin and
               Lukasz Kaiser and David Benjamin Belanger and Lucy J Colwell and Adrian Weller},
  booktitle = {International Conference on Learning Representations},
  year      = {2021},
  url       = {https://openreview.net/forum?id=Ua6zuk0WRH}
}""",
    },
    "katharopoulos2020": {
        "cite": "Katharopoulos et al., 2020",
        "url": "https://arxiv.org/abs/2006.16236",
        "bibtex": r"""@inproceedings{katharopoulos2020transformers,
  title     = {Transformers are {RNNs}: Fast Autoregressive Transformers with Linear Attention},
  author    = {Angelos Katharopoulos and Apoorv Vyas and Nikolaos Pappas and Fran{\c{c}}ois Fleuret},
  booktitle = {Proceedings of the 37th International Conference on Machine Learning (ICML)},
  year      = {2020},
  url       = {https://arxiv.org/abs/2006.16236}
}""",
    },
    "kasai2021": {
        "cite": "Kasai et al., 2021",
        "url": "https://arxiv.org/abs/2103.13076",
        "bibtex": r"""@inproceedings{kasai2021finetuning,
  title     = {Finetuning Pretrained Transformers into {RNNs}},
  author    = {Jungo Kasai and Hao Peng and Yizhe Zhang and Dani Yogatama and Gabriel Ilharco and Nikolaos Pappas and
               Yi Mao and Weizhu Chen and Noah A. Smith},
  booktitle = {Proceedings of the 2021 Conference on Empirical Methods in Natural Language Processing (EMNLP)},
  year      = {2021},
  url       = {https://arxiv.org/abs/2103.13076}
}""",
    },
    "zhang2024": {
        "cite": "Zhang et al., 2024",
        "url": "https://arxiv.org/abs/2402.04347",
        "bibtex": r"""@inproceedings{zhang2024hedgehog,
  title     = {The Hedgehog \& the Porcupine: Expressive Linear Attentions with Softmax Mimicry},
  author    = {Michael Zhang and Kush Bhatia and Hermann Kumbong and Christopher R{\'e}},
  booktitle = {International Conference on Learning Representations},
  year      = {2024},
  url       = {https://arxiv.org/abs/2402.04347}
}""",
    },
}
"""Papers the cards cite: ``cite`` (the link text), ``url`` and a BibTeX entry."""

FEATURE_MAP_PAPERS = {
    "favor+": "choromanski2021",
    "trig": "choromanski2021",
    "relu": "choromanski2021",
    "elu+1": "katharopoulos2020",
    "hedgehog": "zhang2024",
    "t2r": "kasai2021",
}
"""The paper (a key of :data:`PAPERS`) each feature map comes from. The Performer paper (``choromanski2021``) is
cited by every card; attention transfer adds the Hedgehog paper (its softmax-mimicry loss)."""

TRANSFER_FILE_NAME = "attention_transfer.json"
"""Written by ``hf-performer distill`` next to ``conversion_report.json``; its presence marks a distilled folder."""

TRANSFER_LOSSES = {
    "weights": "KL divergence between the softmax and linear attention weights (Hedgehog)",
    "output": "squared error between the softmax and linear attention outputs (LoLCATs)",
    "both": "KL divergence of the attention weights plus squared error of the attention outputs",
}

MEASURED_SPEED = {
    "setup": "one attention layer, forward + backward, 12 heads of dimension 64, m = 256 orthogonal features, "
    "float32, batch 1",
    "machine": "2-core AMD EPYC CPU, torch 2.13 (benchmarks/README.md of hf-performer)",
    "crossover_bidirectional": 797,
    "crossover_causal": 2369,
    "memory_ratio": 4.5,
    "rows": [
        {"length": 512, "bidirectional": 0.61, "causal": 0.56},
        {"length": 1024, "bidirectional": 1.33, "causal": 0.56},
        {"length": 2048, "bidirectional": 2.59, "causal": 0.86},
        {"length": 4096, "bidirectional": 4.69, "causal": 1.80},
        {"length": 8192, "bidirectional": 9.96, "causal": 2.80},
        {"length": 16384, "bidirectional": 15.91, "causal": 4.41},
    ],
}
"""The committed CPU measurement (``benchmarks/results/attention_speed.json``), quoted in every card; a test
keeps the two equal, so re-running the benchmark means updating this."""

TRAINING_FILES = ("trainer_state.json", "training_args.bin", "all_results.json", "train_results.json")
"""Files a ``transformers.Trainer`` run leaves in its output folder: their presence marks a fine-tuned model."""

RECIPE_METRICS_FILE = "metrics.json"
"""Written by the fine-tuning recipes (:mod:`hf_performer.recipes.train`) into their output folder: ``kind``
(``text-classification`` or ``causal-lm``), ``task``, ``final`` (the final metrics), ``completed_steps``, ``args``, ...
It marks a fine-tuned model, and :func:`load_metrics` reads its results."""

LM_HUB_DATASET_IDS = {"wikitext": "Salesforce/wikitext"}
"""Canonical Hub repositories of the causal-LM datasets of :data:`~hf_performer.data.LM_DATASETS`."""

_RESULT_ALIASES = {
    "task": "task_type",
    "dataset": "dataset_type",
    "config": "dataset_config",
    "split": "dataset_split",
    "metric": "metric_type",
    "value": "metric_value",
}
_RESULT_FIELDS = (
    "task_type", "task_name", "dataset_type", "dataset_name", "dataset_config", "dataset_split",
    "dataset_revision", "dataset_args", "metric_type", "metric_name", "metric_value", "metric_config",
    "metric_args", "source_name", "source_url",
)
_RECOVERY_FIELDS = ("setting", "task", "dataset", "metric", "value", "steps", "notes")

_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.\-]{0,95}/)?[A-Za-z0-9][\w.\-]{0,95}$")

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHT_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_VOCAB_FILES = (
    ("tokenizer.json",),
    ("vocab.txt",),
    ("vocab.json", "merges.txt"),
    ("tokenizer.model",),
    ("spiece.model",),
    ("sentencepiece.bpe.model",),
)
"""Alternatives, any one of which gives the tokenizer its vocabulary (next to ``tokenizer_config.json``)."""
TOKENIZER_FILES = (
    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "tokenizer.json", "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model",
)


class ModelCardError(ValueError):
    """A model card cannot be built or does not pass validation (bad folder, results or metadata)."""


class FolderValidationError(ValueError):
    """A model folder that would not load; ``problems`` lists every missing or broken piece."""

    def __init__(self, folder: str | os.PathLike, problems: list[str]):
        self.folder = str(folder)
        self.problems = list(problems)
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(
            f"{self.folder} would not load with from_pretrained(..., trust_remote_code=True); refusing it:\n{lines}"
        )


class PushError(RuntimeError):
    """The upload could not be started or failed (no token, bad repo id or revision, Hub error)."""


# --------------------------------------------------------------------------------------------
# Reading a folder
# --------------------------------------------------------------------------------------------


def _read_json(path: Path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except FileNotFoundError:
        raise ModelCardError(f"{path.parent}: no {what} ({path.name})") from None
    except json.JSONDecodeError as error:
        raise ModelCardError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ModelCardError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover


def _looks_like_hub_id(name: str) -> bool:
    """A ``namespace/name`` Hub repository id that is not a local path."""
    return (
        isinstance(name, str)
        and name.count("/") == 1
        and bool(_HUB_ID.match(name))
        and ".." not in name
        and not os.path.exists(name)
    )


def _auto_map_references(auto_map: dict) -> list[tuple[str, str]]:
    """``(auto class, "module.Class")`` pairs of an ``auto_map`` (values may be strings or lists with ``None``)."""
    pairs = []
    for auto_class, value in auto_map.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        for reference in values:
            if reference is not None:
                pairs.append((auto_class, reference))
    return pairs


def _relative_imports(tree: ast.AST) -> list[tuple[str, str]]:
    """``(module file, import statement)`` of every relative import in a parsed module (any nesting level).

    Level-2+ imports (``from ..x import y``) are returned with the file ``".."`` (outside the folder)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            statement = f"from {'.' * node.level}{node.module or ''} import {', '.join(a.name for a in node.names)}"
            if node.level > 1:
                found.append(("..", statement))
            elif node.module:
                found.append((node.module.replace(".", "/") + ".py", statement))
            else:
                found.extend((alias.name + ".py", statement) for alias in node.names)
    return found


def _defines(tree: ast.Module, name: str) -> bool:
    """Whether a module defines (or imports) ``name`` at its top level."""
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return True
    return False


def _check_code(folder: Path, auto_map: dict, where: str, problems: list[str], warnings: list[str]) -> list[str]:
    """Check the modules named by ``auto_map`` and, transitively, their relative imports. Returns the code files."""
    code_files: list[str] = []
    parsed: dict[str, ast.Module | None] = {}
    queue: list[tuple[str, str]] = []  # (file, who needs it)
    for auto_class, reference in _auto_map_references(auto_map):
        if not isinstance(reference, str):
            problems.append(f"{where}: auto_map[{auto_class!r}] = {reference!r} is not a 'module.Class' string")
            continue
        if "--" in reference:
            warnings.append(f"{where}: auto_map[{auto_class!r}] = {reference!r} points to another repository (not checked)")
            continue
        parts = reference.split(".")
        if len(parts) != 2 or not all(parts):
            problems.append(f"{where}: auto_map[{auto_class!r}] = {reference!r} is not of the form 'module.Class'")
            continue
        module_file = parts[0] + ".py"
        queue.append((module_file, f"{where} auto_map[{auto_class!r}]"))
        if module_file not in parsed:
            parsed[module_file] = None
        path = folder / module_file
        if path.is_file():
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            except (SyntaxError, UnicodeDecodeError) as error:
                problems.append(f"{module_file}: cannot be parsed ({error})")
                continue
            parsed[module_file] = tree
            if not _defines(tree, parts[1]):
                problems.append(f"{module_file}: does not define {parts[1]} (named by {where} auto_map[{auto_class!r}])")

    seen: set[str] = set()
    while queue:
        module_file, needed_by = queue.pop(0)
        if module_file in seen:
            continue
        seen.add(module_file)
        if module_file == "..":
            problems.append(f"{needed_by}: imports from outside the model folder")
            continue
        path = folder / module_file
        if not path.is_file():
            problems.append(f"{module_file}: missing (needed by {needed_by})")
            continue
        code_files.append(module_file)
        tree = parsed.get(module_file)
        if tree is None:
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            except (SyntaxError, UnicodeDecodeError) as error:
                problems.append(f"{module_file}: cannot be parsed ({error})")
                continue
        for imported, statement in _relative_imports(tree):
            queue.append((imported, f"{module_file} ({statement})"))
    return code_files


def _check_safetensors(path: Path, name: str) -> str | None:
    """A problem with a safetensors file's header (truncated file, Git LFS pointer, ...), or ``None``."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as file:
            prefix = file.read(8)
            if len(prefix) < 8:
                return f"{name}: not a safetensors file ({size} bytes)"
            (header_length,) = struct.unpack("<Q", prefix)
            if header_length <= 0 or 8 + header_length > size:
                return f"{name}: not a safetensors file (bad header length; a Git LFS pointer or a truncated file?)"
            header = json.loads(file.read(header_length))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        return f"{name}: not a safetensors file ({error})"
    if not isinstance(header, dict):
        return f"{name}: not a safetensors file (header is not an object)"
    ends = [
        entry["data_offsets"][1]
        for key, entry in header.items()
        if key != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets", ())) == 2
    ]
    if not ends:
        return f"{name}: holds no tensors"
    if 8 + header_length + max(ends) > size:
        return f"{name}: truncated ({size} bytes, the header needs {8 + header_length + max(ends)})"
    return None


def _check_weights(folder: Path, problems: list[str]) -> list[str]:
    for index_name in WEIGHT_INDEX_FILES:
        index_path = folder / index_name
        if not index_path.is_file():
            continue
        try:
            weight_map = _read_json(index_path, "weight index")["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ModelCardError, KeyError, AttributeError, TypeError) as error:
            problems.append(f"{index_name}: no valid weight_map ({error})")
            return [index_name]
        files = [index_name]
        for shard in shards:
            shard_path = folder / shard
            if not shard_path.is_file():
                problems.append(f"{shard}: missing weight shard (listed in {index_name})")
                continue
            files.append(shard)
            if shard.endswith(".safetensors"):
                problem = _check_safetensors(shard_path, shard)
                if problem:
                    problems.append(problem)
        return files
    for name in WEIGHT_FILES:
        path = folder / name
        if path.is_file():
            if name.endswith(".safetensors"):
                problem = _check_safetensors(path, name)
                if problem:
                    problems.append(problem)
            elif path.stat().st_size == 0:
                problems.append(f"{name}: empty")
            return [name]
    problems.append(
        f"weights: missing (expected one of {', '.join(WEIGHT_FILES + WEIGHT_INDEX_FILES)})"
    )
    return []


def _check_tokenizer(folder: Path, problems: list[str], warnings: list[str]) -> list[str]:
    present = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if "tokenizer_config.json" not in present:
        problems.append("tokenizer: tokenizer_config.json missing (save the tokenizer with save_pretrained)")
    if not any(all((folder / name).is_file() for name in option) for option in TOKENIZER_VOCAB_FILES):
        options = " or ".join("+".join(option) for option in TOKENIZER_VOCAB_FILES)
        problems.append(f"tokenizer: no vocabulary file (expected {options})")
    if "tokenizer_config.json" in present:
        try:
            tokenizer_config = _read_json(folder / "tokenizer_config.json", "tokenizer config")
        except ModelCardError as error:
            problems.append(f"tokenizer_config.json: {error}")
        else:
            auto_map = tokenizer_config.get("auto_map")
            if isinstance(auto_map, dict) and auto_map:
                present += [
                    name
                    for name in _check_code(folder, auto_map, "tokenizer_config.json", problems, warnings)
                    if name not in present
                ]
    return present


@dataclass
class UploadFile:
    """One file of an upload: its path in the repository (POSIX) and its size in bytes."""

    path: str
    size: int


@dataclass
class FolderCheck:
    """What :func:`validate_folder` found in a loadable folder."""

    folder: Path
    config: dict
    code_files: list[str]
    weight_files: list[str]
    tokenizer_files: list[str]
    files: list[UploadFile]
    warnings: list[str] = field(default_factory=list)

    @property
    def required_files(self) -> list[str]:
        """Every file loading needs: config, code (``auto_map`` modules and their imports), weights, tokenizer."""
        return sorted({"config.json", *self.code_files, *self.weight_files, *self.tokenizer_files})

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def _ignore_patterns(include_checkpoints: bool) -> list[str]:
    """What an upload leaves out: :data:`UPLOAD_IGNORE_PATTERNS`, and :data:`CHECKPOINT_PATTERNS` unless asked."""
    return [*UPLOAD_IGNORE_PATTERNS, *([] if include_checkpoints else CHECKPOINT_PATTERNS)]


def upload_file_list(folder: str | os.PathLike, include_checkpoints: bool = False) -> list[UploadFile]:
    """The files ``push_folder`` would send, in the order ``HfApi.upload_folder`` lists them (sorted paths),
    after huggingface_hub's ignore patterns, :data:`UPLOAD_IGNORE_PATTERNS` and, unless ``include_checkpoints``,
    :data:`CHECKPOINT_PATTERNS`."""
    folder = Path(folder).expanduser().resolve()
    relpaths = {
        path.relative_to(folder).as_posix(): path for path in sorted(folder.glob("**/*")) if path.is_file()
    }
    kept = filter_repo_objects(
        relpaths.keys(), ignore_patterns=[*_ignore_patterns(include_checkpoints), *_HUB_IGNORE_PATTERNS]
    )
    return [UploadFile(path=relpath, size=relpaths[relpath].stat().st_size) for relpath in kept]


def _safetensors_shapes(folder: Path, weight_files: list[str]) -> dict[str, tuple[str, list[int]]] | None:
    """``{tensor name: (file, shape)}`` from the headers of the safetensors weights (no tensor is read), or ``None``
    for ``pytorch_model.bin`` weights (a pickle: not read)."""
    shapes = {}
    for name in weight_files:
        if name in WEIGHT_INDEX_FILES:
            continue
        if not name.endswith(".safetensors"):
            return None
        with open(folder / name, "rb") as file:
            (header_length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(header_length))
        shapes.update({key: (name, entry["shape"]) for key, entry in header.items() if key != "__metadata__"})
    return shapes


def _list_names(names: list[str], limit: int = 3) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_config_and_weights(folder: Path, config: dict, weight_files: list[str], problems: list[str],
                              warnings: list[str]) -> None:
    """Load ``config.json`` as ``from_pretrained`` does (:class:`PerformerConfig`, which refuses unknown or mistyped
    keys), build the model it describes on the meta device (no memory, no weights) and compare its state dict
    (parameters and persistent buffers) with the safetensors headers: every tensor present, none extra, same shapes."""
    import torch

    from . import modeling_performer
    from .configuration_performer import PERFORMER_MODEL_TYPE, PerformerConfig

    if config.get("model_type") != PERFORMER_MODEL_TYPE:
        warnings.append(f"config.json: model_type {config.get('model_type')!r} is not {PERFORMER_MODEL_TYPE!r}; "
                        "the config and the weights' shapes were not checked")
        return
    try:
        performer_config = PerformerConfig.from_pretrained(folder)
    except Exception as error:  # PerformerConfigError, and TypeError / ValueError of values transformers refuses
        problems.append(f"config.json: does not load (PerformerConfig.from_pretrained): {error}")
        return
    architecture = (config.get("architectures") or ["PerformerModel"])[0]
    model_class = getattr(modeling_performer, architecture, None)
    if architecture not in ARCHITECTURES or model_class is None:
        problems.append(f"config.json: unknown architecture {architecture!r} (expected one of {', '.join(ARCHITECTURES)})")
        return
    try:
        with torch.device("meta"):
            model = model_class(performer_config)
    except Exception as error:  # a config that parses but describes no buildable model
        problems.append(f"config.json: {architecture} cannot be built from it: {error}")
        return
    saved = _safetensors_shapes(folder, weight_files)
    if saved is None:
        warnings.append("weights: pytorch_model.bin (a pickle) is not read, so its tensors' shapes were not checked")
        return
    tensors = model.state_dict(keep_vars=True)
    # Tied weights (e.g. an LM head sharing the embeddings) are saved under one of their names.
    names_of = {}
    for name, tensor in tensors.items():
        names_of.setdefault(id(tensor), []).append(name)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    missing = [
        name for name, tensor in tensors.items()
        if name not in saved and name not in tied and not any(alias in saved for alias in names_of[id(tensor)])
    ]
    extra = sorted(name for name in saved if name not in tensors)
    mismatched = [
        f"{saved[name][0]}: {name} has shape {list(saved[name][1])}, config.json builds {list(tensor.shape)}"
        for name, tensor in tensors.items()
        if name in saved and list(saved[name][1]) != list(tensor.shape)
    ]
    files = ", ".join(sorted({file for file, _ in saved.values()}))
    if missing:
        problems.append(f"{files}: lacks {len(missing)} tensor(s) of {architecture}: {_list_names(missing)}")
    if extra:
        problems.append(f"{files}: holds {len(extra)} tensor(s) {architecture} does not have: {_list_names(extra)}")
    if mismatched:
        problems.append(f"{_list_names(mismatched)} (the config does not describe these weights)")


def validate_folder(folder: str | os.PathLike, include_checkpoints: bool = False) -> FolderCheck:
    """Check that ``folder`` would load with ``AutoModel*.from_pretrained(folder, trust_remote_code=True)``
    and ``AutoTokenizer.from_pretrained(folder, trust_remote_code=True)``.

    Checked: ``config.json`` (valid JSON with ``model_type`` and a non-empty ``auto_map`` holding
    ``AutoConfig``); every module named by ``auto_map`` exists, parses and defines the named class; every
    module those import relatively (``from .x import y``), transitively, exists; the weights
    (``model.safetensors``, a sharded index and all its shards, or ``pytorch_model.bin``; safetensors
    headers are read, so Git LFS pointers and truncated files are caught); the config loads
    (``PerformerConfig.from_pretrained``: unknown or mistyped keys are refused) and the model it builds (on the
    meta device: nothing allocated) has exactly the tensors of the safetensors headers, with their shapes; the
    tokenizer (``tokenizer_config.json`` plus a vocabulary file, and the code of a tokenizer ``auto_map``).

    Args:
        folder: the model folder.
        include_checkpoints: list ``checkpoints/`` (:data:`CHECKPOINT_PATTERNS`) in the upload; by default it is
            left out, with a warning.

    Returns:
        A :class:`FolderCheck` (required files, the upload list, warnings such as a missing README.md card).

    Raises:
        FolderValidationError: listing every problem found.
    """
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise FolderValidationError(folder, [f"not a folder: {folder}"])
    problems: list[str] = []
    warnings: list[str] = []
    config: dict = {}
    code_files: list[str] = []

    config_path = path / "config.json"
    if not config_path.is_file():
        problems.append("config.json: missing")
    else:
        try:
            config = _read_json(config_path, "config")
        except ModelCardError as error:
            problems.append(f"config.json: {error}")
        if config:
            if "model_type" not in config:
                problems.append("config.json: no model_type")
            auto_map = config.get("auto_map")
            if not isinstance(auto_map, dict) or not auto_map:
                problems.append(
                    "config.json: auto_map missing (the Auto classes could not find the Performer code; save the "
                    "model with hf_performer's save_pretrained, which registers it)"
                )
            else:
                if "AutoConfig" not in auto_map:
                    problems.append("config.json: auto_map has no AutoConfig entry")
                code_files = _check_code(path, auto_map, "config.json", problems, warnings)

    weight_files = _check_weights(path, problems)
    if config and not problems:  # the files are all there and sound: does the config describe these weights?
        _check_config_and_weights(path, config, weight_files, problems, warnings)
    tokenizer_files = _check_tokenizer(path, problems, warnings)
    if problems:
        raise FolderValidationError(folder, problems)
    if not (path / CARD_FILE_NAME).is_file():
        warnings.append(f"no {CARD_FILE_NAME} model card (write one with `hf-performer card {folder}`)")
    files = upload_file_list(path, include_checkpoints=include_checkpoints)
    left_out = [f for f in upload_file_list(path, include_checkpoints=True) if f not in files]
    if left_out:
        warnings.append(
            f"checkpoints/ not uploaded ({len(left_out)} files, {_human_bytes(sum(f.size for f in left_out))}: "
            "training states); pass --include-checkpoints to upload them"
        )
    return FolderCheck(
        folder=path.resolve(),
        config=config,
        code_files=sorted(code_files),
        weight_files=weight_files,
        tokenizer_files=sorted(tokenizer_files),
        files=files,
        warnings=warnings,
    )


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


def _check_metric_value(value, where: str):
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ModelCardError(f"{where}: the metric value must be a number or a string, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ModelCardError(f"{where}: the metric value is not finite ({value})")
    return value


def normalize_results(results, default_task: str | None = None) -> list[EvalResult]:
    """Evaluation results as ``huggingface_hub.EvalResult`` objects (what ``model-index`` is built from).

    Each result is an ``EvalResult`` or a dict with ``EvalResult``'s fields or their short names:
    ``task`` (``task_type``), ``dataset`` (``dataset_type``), ``config`` (``dataset_config``), ``split``
    (``dataset_split``), ``metric`` (``metric_type``), ``value`` (``metric_value``), plus optional
    ``task_name``, ``dataset_name``, ``metric_name``, ... A GLUE task name as ``task`` (``"sst2"``) means
    task ``text-classification`` on dataset ``nyu-mll/glue`` with that config; ``"imdb"`` means
    ``stanfordnlp/imdb``. A missing ``task`` defaults to ``default_task`` (the card's pipeline tag) and a
    missing ``dataset_name`` to the dataset id (and config). Unknown keys are an error.
    """
    if results is None:
        return []
    if isinstance(results, (EvalResult, dict)):
        results = [results]
    normalized = []
    for index, result in enumerate(results):
        where = f"result {index}"
        if isinstance(result, EvalResult):
            normalized.append(result)
            continue
        if not isinstance(result, dict):
            raise ModelCardError(f"{where}: expected a dict or an EvalResult, got {type(result).__name__}")
        values = {}
        for key, value in result.items():
            name = _RESULT_ALIASES.get(key, key)
            if name not in _RESULT_FIELDS:
                raise ModelCardError(
                    f"{where}: unknown key {key!r}; accepted: {', '.join(_RESULT_FIELDS)} and the short names "
                    f"{', '.join(f'{k} ({v})' for k, v in _RESULT_ALIASES.items())}"
                )
            if name in values:
                raise ModelCardError(f"{where}: {name!r} given twice (as {key!r} and under another name)")
            values[name] = value
        task = values.get("task_type")
        spec = TASKS.get(task.lower()) if isinstance(task, str) else None
        if spec is not None:  # a task of the recipes (GLUE, IMDB): its Hub dataset and name
            values.setdefault("task_name", spec.display_name)
            values.setdefault("dataset_type", spec.hub_dataset_id)
            if spec.hub_config is not None:
                values.setdefault("dataset_config", spec.hub_config)
            values["task_type"] = "text-classification"
        if values.get("task_type") is None:
            values["task_type"] = default_task
        for required in ("task_type", "dataset_type", "metric_type", "metric_value"):
            if values.get(required) is None:
                raise ModelCardError(f"{where}: {required} is required (got keys {sorted(result)})")
        values["metric_value"] = _check_metric_value(values["metric_value"], where)
        if values.get("dataset_name") is None:
            config = values.get("dataset_config")
            values["dataset_name"] = values["dataset_type"] + (f" ({config})" if config else "")
        try:
            normalized.append(EvalResult(**values))
        except (TypeError, ValueError) as error:
            raise ModelCardError(f"{where}: {error}") from None
    return normalized


def normalize_recovery(rows) -> list[dict]:
    """Recovery rows for the card's body (not ``model-index``): dicts with ``setting`` (or ``variant``), ``task``,
    ``dataset``, ``metric``, ``value`` and optional ``steps`` and ``notes``."""
    if rows is None:
        return []
    if isinstance(rows, dict):
        rows = [rows]
    normalized = []
    for index, row in enumerate(rows):
        where = f"recovery row {index}"
        if not isinstance(row, dict):
            raise ModelCardError(f"{where}: expected a dict, got {type(row).__name__}")
        row = dict(row)
        if "variant" in row:
            if "setting" in row:
                raise ModelCardError(f"{where}: give 'setting' or 'variant', not both")
            row["setting"] = row.pop("variant")
        unknown = sorted(set(row) - set(_RECOVERY_FIELDS))
        if unknown:
            raise ModelCardError(f"{where}: unknown keys {unknown}; accepted: {', '.join(_RECOVERY_FIELDS)} (and variant)")
        missing = [key for key in ("setting", "task", "dataset", "metric", "value") if row.get(key) is None]
        if missing:
            raise ModelCardError(f"{where}: missing {', '.join(missing)}")
        value = _check_metric_value(row["value"], where)
        row["value"] = f"{value:.4g}" if isinstance(value, float) else value
        normalized.append({key: row.get(key) for key in _RECOVERY_FIELDS})
    return normalized


def load_metrics(path: str | os.PathLike) -> tuple[list[dict], list[dict]]:
    """Read a metrics JSON file; returns ``(results, recovery)`` (lists of dicts, see :func:`normalize_results`).

    Accepted layouts:

    * a list of result dicts;
    * ``{"results": [...], "recovery": [...]}`` (either key may be absent);
    * one result dict (``{"task": "sst2", "metric": "accuracy", "value": 0.91, ...}``);
    * a run summary ``{"task": ..., "dataset": ..., "split": ..., "metrics": {"accuracy": 0.91, ...}}``: one
      result per numeric metric (a leading ``eval_`` is removed from metric names); other top-level keys of
      the summary (run settings, timings) are not results and are not read;
    * the ``metrics.json`` of a fine-tuning recipe (``{"kind": "text-classification", "task": "sst2", "final":
      {"accuracy": 0.91, "eval_loss": 0.3}, ...}``): one result per final metric but the loss, on the task's
      evaluation split (causal LM: perplexity on the validation split of ``args.dataset``); see
      :func:`recipe_results`.
    """
    from .recipes.arguments import KINDS as RECIPE_KINDS

    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise ModelCardError(f"metrics file not found: {path}") from None
    except json.JSONDecodeError as error:
        raise ModelCardError(f"{path}: not valid JSON ({error})") from None
    if isinstance(data, list):
        return data, []
    if not isinstance(data, dict):
        raise ModelCardError(f"{path}: expected a JSON object or list, got {type(data).__name__}")
    if "results" in data or "recovery" in data:
        extra = sorted(set(data) - {"results", "recovery"})
        if extra:
            raise ModelCardError(f"{path}: unknown top-level keys {extra} next to results/recovery")
        results, recovery = data.get("results") or [], data.get("recovery") or []
        if not isinstance(results, list) or not isinstance(recovery, list):
            raise ModelCardError(f"{path}: 'results' and 'recovery' must be lists")
        return results, recovery
    if data.get("kind") in RECIPE_KINDS and "final" in data:
        return recipe_results(data, str(path)), []
    if isinstance(data.get("metrics"), dict):
        base = {}
        for key in ("task", "task_name", "dataset", "dataset_name", "config", "split", "dataset_config",
                    "dataset_split"):
            if data.get(key) is not None:
                base[key] = data[key]
        results = []
        for name, value in data["metrics"].items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric = name[len("eval_"):] if name.startswith("eval_") else name
            results.append({**base, "metric": metric, "value": value})
        if not results:
            raise ModelCardError(f"{path}: 'metrics' holds no numeric value")
        return results, []
    return [data], []


def recipe_results(metrics: dict, where: str = RECIPE_METRICS_FILE) -> list[dict]:
    """The results (dicts for :func:`normalize_results`) of a recipe's ``metrics.json`` (:mod:`hf_performer.recipes.train`).

    Text classification: one result per finite metric of ``final`` but ``eval_loss``, on the task's evaluation split
    (``validation``; MNLI ``validation_matched``; IMDB ``test``), the task naming its Hub dataset. Causal LM: the
    perplexity on the ``validation`` split of ``args.dataset`` (``wikitext``: ``Salesforce/wikitext``).

    Raises:
        ModelCardError: ``final`` is not an object of numbers, an unknown task, or a causal-LM run evaluated on a
            local text file (which names no Hub dataset: give its result in a results file).
    """
    final = metrics.get("final")
    if not isinstance(final, dict):
        raise ModelCardError(f"{where}: 'final' must be an object of metrics (a recipe's metrics.json), got {final!r}")
    if metrics.get("kind") == "causal-lm":
        run_args = metrics.get("args") or {}
        if run_args.get("validation_file"):
            raise ModelCardError(
                f"{where}: the run evaluated on a local text file, which names no Hub dataset; give its result in a "
                'results file: [{"task": "text-generation", "dataset": "namespace/name", "split": "validation", '
                '"metric": "perplexity", "value": ...}]'
            )
        dataset = run_args.get("dataset") or "wikitext"
        hub_args = LM_DATASETS.get(dataset, (dataset,))
        base = {
            "task": "text-generation",
            "dataset": LM_HUB_DATASET_IDS.get(hub_args[0], hub_args[0]),
            "config": run_args.get("dataset_config") or (hub_args[1] if len(hub_args) > 1 else None),
            "split": "validation",
        }
        base = {key: value for key, value in base.items() if value is not None}
    else:
        try:
            spec = get_task(str(metrics.get("task")))
        except DataError as error:
            raise ModelCardError(f"{where}: {error}") from None
        base = {"task": spec.name, "split": spec.validation_split}
    results = [
        {**base, "metric": name, "value": value}
        for name, value in final.items()
        if name != "eval_loss" and _is_number(value) and math.isfinite(value)
    ]
    if not results:
        raise ModelCardError(f"{where}: 'final' holds no metric but the loss")
    return results


def _is_recipe_run(folder: Path) -> bool:
    """Whether ``folder`` is the output of a fine-tuning recipe that trained (``metrics.json`` with steps)."""
    from .recipes.arguments import KINDS as RECIPE_KINDS

    try:
        metrics = json.loads((folder / RECIPE_METRICS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(metrics, dict) and metrics.get("kind") in RECIPE_KINDS and bool(metrics.get("completed_steps"))


# --------------------------------------------------------------------------------------------
# Model card
# --------------------------------------------------------------------------------------------


def default_template_path() -> Path:
    """``model_cards/performer_card.md``, installed as package data of ``hf_performer.model_cards``."""
    from importlib.resources import files

    path = Path(str(files("hf_performer.model_cards") / TEMPLATE_NAME))
    if not path.is_file():
        raise ModelCardError(f"model card template {TEMPLATE_NAME} not found at {path}; pass template_path=")
    return path


def _source_geometry(config: dict) -> dict:
    source = config.get("source_config") or {}
    layers = source.get("num_hidden_layers") or source.get("n_layer") or source.get("n_layers")
    heads = source.get("num_attention_heads") or source.get("n_head") or source.get("n_heads")
    hidden = source.get("hidden_size") or source.get("n_embd") or source.get("dim")
    head_dim = source.get("head_dim") or (hidden // heads if hidden and heads else None)
    kv_heads = source.get("num_key_value_heads") or heads
    max_positions = source.get("max_position_embeddings") or source.get("n_positions")
    return {
        "source_model_type": source.get("model_type", "unknown"),
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "hidden_size": hidden,
        "head_dim": head_dim,
        "max_positions": max_positions,
        "name_or_path": source.get("_name_or_path"),
        "source_architectures": source.get("architectures") or [],
    }


def _format_setting(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) if value else "none"
    if isinstance(value, dict):
        return ", ".join(f"`{k}`: {_format_setting(v)}" for k, v in value.items()) if value else "none"
    return f"`{value}`" if isinstance(value, str) else str(value)


def _map_kind(name: str) -> str | None:
    """``"random"``, ``"learned"`` or ``"deterministic"`` (``None`` for a map not registered in this process)."""
    from .favor_attention import feature_map_kind

    try:
        return feature_map_kind(name)
    except KeyError:
        return None


def _map_default(name: str, option: str):
    """The default of a feature map's keyword ``option`` (``init``, ``nb_features``, ...), or ``None``."""
    from .feature_maps import FEATURE_MAPS, default_feature_map_init

    factory = FEATURE_MAPS.get(name)
    if factory is None:
        return None
    if option == "init" and default_feature_map_init(name) is not None:  # learned maps resolve init=None to it
        return default_feature_map_init(name)
    try:
        parameter = inspect.signature(factory).parameters.get(option)
    except (TypeError, ValueError):  # pragma: no cover - a factory without a signature
        return None
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return None
    return parameter.default


def effective_nb_features(feature_map: str, nb_features, head_dim: int | None) -> int | None:
    """The number ``m`` of features per head a map really uses: ``nb_features``, or with ``None`` the map's default
    (learned maps: ``2 * head_dim`` for hedgehog, ``head_dim`` for t2r; elu+1: ``head_dim``; random maps: 256)."""
    from .feature_maps import FEATURE_MAPS

    if nb_features is not None:
        return nb_features
    factory = FEATURE_MAPS.get(feature_map)
    kind = _map_kind(feature_map)
    if kind == "learned" and head_dim and hasattr(factory, "default_nb_features"):
        return factory.default_nb_features(head_dim)
    if kind == "random" and isinstance(_map_default(feature_map, "nb_features"), int):
        return _map_default(feature_map, "nb_features")
    return head_dim


def setting_meanings(settings: dict, head_dim: int | None = None) -> dict[str, str]:
    """What each ``favor_settings`` key means for this feature map (the settings table of the card).

    Random maps (favor+, trig, relu) use :data:`SETTING_MEANINGS`, learned maps (hedgehog, t2r)
    :data:`LEARNED_SETTING_MEANINGS` (with the effective ``init`` and whether the seed is used), deterministic maps
    (elu+1) :data:`DETERMINISTIC_SETTING_MEANINGS`. An ``nb_features`` of ``None`` is explained as the map's default
    size (computed from ``head_dim`` when known)."""
    from .feature_maps import FEATURE_MAPS

    name = settings.get("feature_map", "favor+")
    kind = _map_kind(name)
    table = {"learned": LEARNED_SETTING_MEANINGS, "deterministic": DETERMINISTIC_SETTING_MEANINGS}.get(kind, SETTING_MEANINGS)
    meanings = dict(table)
    if name == "favor+":
        meanings["feature_map"] = SETTING_MEANINGS["feature_map"]
    elif name in FEATURE_MAP_DESCRIPTIONS:
        prefix = "feature map" if kind == "random" else meanings["feature_map"]
        meanings["feature_map"] = f"{prefix} ({FEATURE_MAP_DESCRIPTIONS[name]})"
    elif kind is None:
        meanings["feature_map"] = f"feature map (`{name}`: not registered here; see its code)"
    options = settings.get("feature_map_options") or {}
    if kind == "learned":
        init = options.get("init", _map_default(name, "init"))
        default_init = _map_default(name, "init")
        meanings["feature_map_options"] = (
            "the map's own options: `init` (start of the learned projections: `identity` or `favor+`; default "
            f"`{default_init}`), `tie_qk` (queries and keys share one set of parameters; default no)"
            + (", `feature_epsilon` (added to every feature)" if _map_default(name, "feature_epsilon") is not None else "")
            + "; none: the map's defaults"
        )
        if init == "identity":
            meanings["seed"] += "; unused here (`init` is `identity`)"
    m = effective_nb_features(name, None, head_dim)
    if settings.get("nb_features", 0) is None:
        if kind == "learned":
            factor = getattr(FEATURE_MAPS.get(name), "features_per_projection", 1)
            size = f"{factor} x head dim" if factor != 1 else "the head dim"
            meanings["nb_features"] += f"; `None`: the map's default size, {size}" + (f" = {m}" if m else "")
        elif kind == "deterministic":
            meanings["nb_features"] = "features per head; `None`: the map's own size, the head dim" + (f" = {m}" if m else "")
        else:
            meanings["nb_features"] += "; `None`: the map's default size" + (f" ({m})" if m else "")
    elif kind == "learned" and getattr(FEATURE_MAPS.get(name), "features_per_projection", 1) == 2:
        meanings["nb_features"] += " (2 features per projection row)"
    return meanings


def _citations(feature_map: str, distilled: bool) -> tuple[dict | None, list[str]]:
    """The feature map's paper (``None`` if unknown) and the BibTeX entries of the card's Citation section: the
    map's paper, the Performer paper, and with attention transfer the Hedgehog paper."""
    key = FEATURE_MAP_PAPERS.get(feature_map)
    keys = [key] if key else []
    keys.append("choromanski2021")
    if distilled:
        keys.append("zhang2024")
    keys = list(dict.fromkeys(keys))
    return (PAPERS[key] if key else None), [PAPERS[k]["bibtex"] for k in keys]


def _describe_map(feature_map: str, kind: str | None, settings: dict, distilled: bool) -> dict:
    """Wording of the card that depends on the feature map: names, warning, fidelity and quality notes."""
    is_favor = feature_map == "favor+"
    options = settings.get("feature_map_options") or {}
    init = options.get("init", _map_default(feature_map, "init"))
    if is_favor:
        fidelity_note = (
            "A relative error near 1 means the layer output is essentially re-learned: trained softmax attention is peaky\n"
            "and the FAVOR+ estimator's variance is large there. This is expected after the swap: accuracy has to be\n"
            "recovered by fine-tuning (see Results)."
        )
        quality = ("FAVOR+ is an approximation of softmax attention; published conversions with fixed random features\n"
                   "  trail softmax on some tasks (e.g. CoLA) even after fine-tuning. Check the results above for this model.")
    elif kind == "learned" and distilled:
        fidelity_note = (
            "These errors remain after attention transfer (the section above gives the values before it): each layer\n"
            "was trained on the softmax model's own inputs, and what it did not learn adds up through the layers (the\n"
            "propagated column). Fine-tune the whole model to recover the rest (see Results)."
        )
        quality = (f"`{feature_map}` features are trained to mimic softmax attention, but remain an approximation of it;\n"
                   "  check the results above for this model.")
    elif kind == "learned":
        fidelity_note = (
            f"The learned `{feature_map}` feature maps of this folder are untrained (initialisation `{init}`), so they do\n"
            "not approximate softmax attention yet and large errors are expected: train them by attention transfer\n"
            "(`hf-performer distill`), then fine-tune (see Results)."
        )
        quality = (f"`{feature_map}` features approximate softmax attention only once trained (attention transfer or\n"
                   "  fine-tuning); check the results above for this model.")
    elif kind == "deterministic" or feature_map == "relu":
        fidelity_note = (
            f"`{feature_map}` is not an estimator of softmax attention but a different kernel, so a relative error near 1\n"
            "is expected after the swap: accuracy has to be recovered by fine-tuning (see Results)."
        )
        quality = (f"`{feature_map}` replaces softmax attention by a different kernel rather than approximating it;\n"
                   "  check the results above for this model.")
        if feature_map == "relu":  # a random map, but not an estimator of softmax
            quality = quality.replace("check the results", "published conversions with fixed random features trail "
                                      "softmax on some\n  tasks (e.g. CoLA) even after fine-tuning. Check the results")
    else:
        fidelity_note = (
            "A relative error near 1 means the layer output is essentially re-learned: trained softmax attention is peaky\n"
            f"and the `{feature_map}` random-feature approximation is poor there. This is expected after the swap: accuracy\n"
            "has to be recovered by fine-tuning (see Results)."
        )
        estimate = ("estimates softmax attention without bias but with a large variance (and denominators that\n"
                    "  can vanish)" if feature_map == "trig" else "is an approximation of softmax attention")
        quality = (f"`{feature_map}` linear attention {estimate}; published conversions with fixed random features\n"
                   "  trail softmax on some tasks (e.g. CoLA) even after fine-tuning. Check the results above for this model.")
    if distilled:
        warning = (
            "> **Attention transfer only, not fine-tuned.** The feature maps were trained to mimic the source's softmax\n"
            "> attention (see Attention transfer below) and every other weight is the source's. This narrows the gap to\n"
            "> the softmax model without closing it (compare before and after below): evaluate the model on your task\n"
            "> and fine-tune it before use."
        )
    elif is_favor:
        warning = (
            "> **Converted, not fine-tuned.** Right after conversion a pretrained model does not reproduce its softmax\n"
            "> outputs (see the fidelity report below): fine-tune it before use. The Performer paper reports 0.07\n"
            "> accuracy right after loading pretrained weights into FAVOR+, recovered in a small fraction of the\n"
            "> original training."
        )
    elif kind == "learned":
        warning = (
            "> **Converted, not fine-tuned.** Right after conversion a pretrained model does not reproduce its softmax\n"
            f"> outputs (see the fidelity report below), and its learned `{feature_map}` feature maps are untrained\n"
            f"> (initialisation `{init}`): train them by attention transfer (`hf-performer distill`) and fine-tune the\n"
            "> model before use."
        )
    else:
        warning = (
            "> **Converted, not fine-tuned.** Right after conversion a pretrained model does not reproduce its softmax\n"
            "> outputs (see the fidelity report below): fine-tune it before use."
        )
    return {
        "is_favor": is_favor,
        "feature_map": feature_map,
        "feature_map_kind": kind or "unknown",
        "feature_map_title": "FAVOR+" if is_favor else f"`{feature_map}`",
        "attention_name": "FAVOR+" if is_favor else "linear attention",
        "features_word": {"random": "random", "learned": "learned", "deterministic": "deterministic"}.get(kind, ""),
        "not_fine_tuned_warning": warning,
        "fidelity_note": fidelity_note,
        "quality_note": quality,
    }


def _speed_context(settings: dict, geometry: dict, is_causal: bool, dtype_bytes: int) -> dict:
    head_dim = geometry["head_dim"] or 64
    feature_map = settings.get("feature_map", "favor+")
    # nb_features None: the map's own size (elu+1: d; hedgehog: 2d; t2r: d).
    nb_features = effective_nb_features(feature_map, settings.get("nb_features"), head_dim) or head_dim
    name = "FAVOR+" if feature_map == "favor+" else "linear attention"
    crossover = MEASURED_SPEED["crossover_causal" if is_causal else "crossover_bidirectional"]
    max_positions = geometry["max_positions"]
    kind = "causal" if is_causal else "bidirectional"
    measured = kind if feature_map == "favor+" else f"FAVOR+ {kind}"
    if max_positions is not None and max_positions <= crossover:
        note = (
            f"At this model's maximum length of {max_positions} tokens {name} is **not faster** than softmax "
            f"attention (measured {measured} crossover: ~{crossover} tokens); its benefit needs longer inputs."
        )
    else:
        note = (
            f"This model accepts up to {max_positions if max_positions is not None else 'any number of'} tokens; "
            f"{name} pays off only on inputs longer than the {measured} crossover (~{crossover} tokens measured): at "
            "512 tokens softmax attention is faster."
        )
    layers = geometry["num_layers"] or 0
    softmax_layers = settings.get("softmax_layers") or []
    favor_layers = max(layers - len(softmax_layers), 0)
    heads = geometry["num_heads"] or 0
    state_bytes = favor_layers * heads * (nb_features * head_dim + nb_features + 1) * 4
    kv_per_token = 2 * layers * (geometry["num_kv_heads"] or heads) * head_dim * dtype_bytes
    state_note = _human_bytes(state_bytes)
    if softmax_layers:
        state_note += f" (plus a growing key/value cache for the {len(softmax_layers)} softmax layers)"
    return {
        "flop_parity": 2 * nb_features,
        "nb_features": nb_features,
        "max_length_note": note,
        "state_bytes_human": state_note,
        "kv_bytes_per_token_human": _human_bytes(kv_per_token),
        "speed": MEASURED_SPEED,
    }


# --------------------------------------------------------------------------------------------
# Attention transfer (attention_transfer.json of `hf-performer distill`)
# --------------------------------------------------------------------------------------------


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _transfer_field(record: dict, path: str, where: str, check, expected: str, required: bool = True):
    """``record[a][b]...`` for ``path = "a.b"``, checked by ``check`` (raises :class:`ModelCardError`)."""
    value = record
    walked = []
    for part in path.split("."):
        if not isinstance(value, dict):
            raise ModelCardError(f"{where}: '{'.'.join(walked)}' must be an object, got {type(value).__name__}")
        walked.append(part)
        if part not in value:
            if not required:
                return None
            raise ModelCardError(f"{where}: '{path}' is missing (not an attention_transfer.json of hf-performer distill?)")
        value = value[part]
    if not required and value is None:
        return None
    if not check(value):
        raise ModelCardError(f"{where}: '{path}' must be {expected}, got {value!r}")
    return value


def _layer_losses(losses: dict, path: str, where: str) -> dict[int, dict]:
    """``{layer: {"weights_kl": ..., ...}}`` from ``transfer.layer_losses_*`` (JSON keys are strings)."""
    parsed = {}
    for key, entry in losses.items():
        try:
            layer = int(key)
        except (TypeError, ValueError):
            raise ModelCardError(f"{where}: '{path}' keys must be layer indices, got {key!r}") from None
        if not isinstance(entry, dict):
            raise ModelCardError(f"{where}: '{path}.{key}' must be an object, got {entry!r}")
        for name in ("weights_kl", "output_squared_error"):
            if entry.get(name) is not None and not _is_number(entry[name]):
                raise ModelCardError(f"{where}: '{path}.{key}.{name}' must be a number, got {entry[name]!r}")
        parsed[layer] = entry
    return parsed


def _fidelity_layers(record: dict, name: str, where: str) -> dict[int, dict]:
    layers = _transfer_field(record, f"{name}.layers", where, lambda v: isinstance(v, list) and len(v) > 0,
                             "a non-empty list of layers")
    parsed = {}
    for index, entry in enumerate(layers):
        if not (isinstance(entry, dict) and isinstance(entry.get("layer"), int) and not isinstance(entry["layer"], bool)
                and _is_number(entry.get("own_inputs_relative_error"))):
            raise ModelCardError(
                f"{where}: '{name}.layers[{index}]' must hold an int 'layer' and a number "
                f"'own_inputs_relative_error', got {entry!r}"
            )
        parsed[entry["layer"]] = entry
    return parsed


def _format_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds:.1f} s ({seconds / 60:.1f} min)"
    return f"{seconds:.0f} s ({seconds / 3600:.1f} h)"


def _format_number(value) -> str:
    return "–" if value is None else f"{value:.4f}"


def transfer_context(record: dict, where: str = TRANSFER_FILE_NAME, feature_map: str | None = None) -> dict:
    """What the card's "Attention transfer" section shows, read from an ``attention_transfer.json`` record.

    Checked (a :class:`ModelCardError` names the first bad field): ``data`` (``file``, ``layout``, ``sequences``,
    ``max_length``), ``transfer`` (``steps``, ``loss``, ``learning_rate``, ``layer_losses_before`` /
    ``layer_losses_after`` keyed by layer index), ``fidelity_before`` / ``fidelity_after`` (``layers`` with
    ``own_inputs_relative_error``, ``final_hidden_state_cosine``), ``wall_time_s``; ``feature_map``, when present,
    must be the folder's. Only the data file's base name is kept (no local path reaches the card), and neither
    ``source`` nor ``command`` is shown.
    """
    if not isinstance(record, dict):
        raise ModelCardError(f"{where}: expected a JSON object, got {type(record).__name__}")
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    is_str = lambda v: isinstance(v, str) and v != ""  # noqa: E731
    data_file = _transfer_field(record, "data.file", where, is_str, "a file name")
    layout = _transfer_field(record, "data.layout", where, is_str, "a string")
    sequences = _transfer_field(record, "data.sequences", where, is_int, "an int")
    max_length = _transfer_field(record, "data.max_length", where, is_int, "an int")
    batch_size = _transfer_field(record, "data.batch_size", where, is_int, "an int", required=False)
    fidelity_sequences = _transfer_field(record, "data.fidelity_sequences", where, is_int, "an int", required=False)
    steps = _transfer_field(record, "transfer.steps", where, is_int, "an int")
    loss = _transfer_field(record, "transfer.loss", where, is_str, "a string")
    learning_rate = _transfer_field(record, "transfer.learning_rate", where, _is_number, "a number")
    trained = _transfer_field(record, "transfer.layers", where,
                              lambda v: isinstance(v, list) and all(is_int(i) for i in v), "a list of layer indices",
                              required=False)
    is_dict = lambda v: isinstance(v, dict)  # noqa: E731
    losses_before = _layer_losses(_transfer_field(record, "transfer.layer_losses_before", where, is_dict, "an object"),
                                  "transfer.layer_losses_before", where)
    losses_after = _layer_losses(_transfer_field(record, "transfer.layer_losses_after", where, is_dict, "an object"),
                                 "transfer.layer_losses_after", where)
    before = _fidelity_layers(record, "fidelity_before", where)
    after = _fidelity_layers(record, "fidelity_after", where)
    cosine_before = _transfer_field(record, "fidelity_before.final_hidden_state_cosine", where, _is_number, "a number")
    cosine_after = _transfer_field(record, "fidelity_after.final_hidden_state_cosine", where, _is_number, "a number")
    logits_before = _transfer_field(record, "fidelity_before.logits_relative_error", where, _is_number, "a number",
                                    required=False)
    logits_after = _transfer_field(record, "fidelity_after.logits_relative_error", where, _is_number, "a number",
                                   required=False)
    wall_time = _transfer_field(record, "wall_time_s", where, lambda v: _is_number(v) and v >= 0,
                                "a number of seconds")
    recorded_map = _transfer_field(record, "feature_map", where, is_str, "a string", required=False)
    if feature_map is not None and recorded_map is not None and recorded_map != feature_map:
        raise ModelCardError(
            f"{where}: records attention transfer into the {recorded_map!r} feature map, but config.json uses "
            f"{feature_map!r}: the file does not belong to this model"
        )

    rows = []
    for layer in sorted(set(before) | set(after)):
        old, new = before.get(layer), after.get(layer)
        attention = (new or old).get("attention", "favor")
        if attention == "favor" and trained is not None and layer not in trained:
            attention = "favor (not trained)"
        kl_before = (losses_before.get(layer) or {}).get("weights_kl")
        kl_after = (losses_after.get(layer) or {}).get("weights_kl")
        rows.append({
            "layer": layer,
            "attention": attention,
            "error_before": _format_number(old and old["own_inputs_relative_error"]),
            "error_after": _format_number(new and new["own_inputs_relative_error"]),
            "kl_before": _format_number(kl_before),
            "kl_after": _format_number(kl_after),
        })
    return {
        "data_file": os.path.basename(data_file.replace("\\", "/").rstrip("/")) or data_file,
        "layout": layout,
        "sequences": sequences,
        "max_length": max_length,
        "batch_size": batch_size,
        "fidelity_sequences": fidelity_sequences,
        "steps": steps,
        "loss": loss,
        "loss_meaning": TRANSFER_LOSSES.get(loss, ""),
        "learning_rate": f"{learning_rate:g}",
        "layers_trained": trained,
        "wall_time": _format_duration(float(wall_time)),
        "rows": rows,
        "cosine_before": f"{cosine_before:.4f}",
        "cosine_after": f"{cosine_after:.4f}",
        "logits_before": None if logits_before is None else f"{logits_before:.4f}",
        "logits_after": None if logits_after is None else f"{logits_after:.4f}",
        "fidelity_after": record["fidelity_after"],
    }


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def build_model_card(
    folder: str | os.PathLike,
    *,
    base_model: str | list[str] | None = None,
    datasets: str | list[str] | None = None,
    results=None,
    recovery=None,
    model_name: str | None = None,
    repo_id: str | None = None,
    license: str | None = None,
    language: str | list[str] | None = None,
    tags: list[str] | None = None,
    report=None,
    fine_tuned: bool | None = None,
    template_path: str | os.PathLike | None = None,
    transfer=None,
) -> ModelCard:
    """Build the model card of a Performer model folder (validated; see :func:`validate_model_card`).

    Args:
        folder: the model folder (``config.json`` with ``favor_settings``; ``conversion_report.json`` if any).
        base_model: Hub id(s) of the model this one derives from. Default: the conversion source when it is a
            Hub id (a local path is never written as ``base_model``).
        datasets: Hub dataset id(s) used for training. Default: the datasets of ``results``.
        results: evaluation results of *this* model (``model-index``): dicts or ``EvalResult`` objects, see
            :func:`normalize_results`.
        recovery: rows comparing softmax / converted / recovered models, shown in the card body only (see
            :func:`normalize_recovery`).
        model_name: the card's title and ``model-index`` name. Default: the last part of ``repo_id``, else the
            folder name.
        repo_id: the Hub repository the card's loading example uses (default: ``model_name``).
        license, language, tags: extra metadata (``tags`` are added to :data:`CARD_TAGS`).
        report: the fidelity report (a ``FidelityReport`` or its dict); default: the folder's
            ``conversion_report.json`` if present, else the ``fidelity_after`` of the attention-transfer record.
        fine_tuned: whether the model was fine-tuned after conversion (the card warns when it was not).
            Default: whether the folder holds a Trainer's files (:data:`TRAINING_FILES`) or a recipe's
            ``metrics.json`` (:data:`RECIPE_METRICS_FILE`) with completed steps.
        template_path: a Jinja template; default :func:`default_template_path`.
        transfer: the attention-transfer record of ``hf-performer distill`` (the dict it writes as
            ``attention_transfer.json``, or a path to such a file); default: the folder's ``attention_transfer.json``
            if present. With one, the
            card says the model was distilled and gains an "Attention transfer" section (see
            :func:`transfer_context`).

    Returns:
        A ``huggingface_hub.ModelCard``.

    Raises:
        ModelCardError: not a Performer folder, invalid results, a malformed ``attention_transfer.json``, or metadata
            that fails validation.
    """
    folder = Path(folder)
    config = _read_json(folder / "config.json", "config")
    settings = config.get("favor_settings")
    if not isinstance(settings, dict):
        raise ModelCardError(f"{folder}: config.json has no favor_settings: not a Performer model folder")
    architecture = (config.get("architectures") or ["PerformerModel"])[0]
    if architecture not in ARCHITECTURES:
        raise ModelCardError(
            f"{folder}: unknown architecture {architecture!r} (expected one of {', '.join(ARCHITECTURES)})"
        )
    pipeline_tag, auto_class, usage_example = ARCHITECTURES[architecture]
    geometry = _source_geometry(config)
    feature_map = settings.get("feature_map", "favor+")
    kind = _map_kind(feature_map)

    transfer_where = "the attention-transfer record"
    if transfer is None and (folder / TRANSFER_FILE_NAME).is_file():
        transfer = folder / TRANSFER_FILE_NAME
    if isinstance(transfer, (str, os.PathLike)):
        transfer_where = str(transfer)
        transfer = _read_json(Path(transfer), "attention-transfer record")
    transfer_info = transfer_context(transfer, transfer_where, feature_map) if transfer is not None else None
    if transfer_info is not None and kind not in ("learned", None):
        raise ModelCardError(
            f"{transfer_where}: attention transfer trains learned feature maps, but this model's {feature_map!r} map "
            f"is {kind} (no trainable parameters): the record does not belong to this model"
        )

    report_file = f"`{REPORT_FILE_NAME}`"
    if report is None and (folder / REPORT_FILE_NAME).is_file():
        report = _read_json(folder / REPORT_FILE_NAME, "fidelity report")
    elif report is None and transfer_info is not None:
        report, report_file = transfer_info["fidelity_after"], f"`{TRANSFER_FILE_NAME}` (`fidelity_after`)"
    elif report is not None and not isinstance(report, dict):
        report = report.to_dict()
    if report is not None:
        missing = [key for key in ("layers", "final_hidden_state_cosine", "inputs") if key not in report]
        if missing:
            raise ModelCardError(f"the fidelity report lacks {', '.join(missing)}: not a conversion_report.json")
        source = report.get("source")
        # A local path says nothing to a reader of the Hub page (and may expose a home folder): keep Hub ids only.
        report = {**report, "source": source if source and _looks_like_hub_id(source) else None}
    if fine_tuned is None:
        fine_tuned = any((folder / name).is_file() for name in TRAINING_FILES) or _is_recipe_run(folder)

    if base_model is None:
        for candidate in ((report or {}).get("source"), geometry["name_or_path"]):
            if candidate and _looks_like_hub_id(candidate):
                base_model = candidate
                break
    base_model_list = [base_model] if isinstance(base_model, str) else list(base_model or [])
    for name in base_model_list:
        if not _looks_like_hub_id(name) and not _HUB_ID.match(name or ""):
            raise ModelCardError(f"base_model {name!r} is not a Hub model id (namespace/name)")

    eval_results = normalize_results(results, default_task=pipeline_tag)
    recovery_rows = normalize_recovery(recovery)
    if datasets is None and eval_results:
        datasets = sorted({result.dataset_type for result in eval_results})
    dataset_list = [datasets] if isinstance(datasets, str) else list(datasets or [])

    if model_name is None:
        model_name = repo_id.split("/")[-1] if repo_id else folder.resolve().name
    map_tags = CARD_TAGS if feature_map == "favor+" else [
        tag if tag != "favor+" else feature_map for tag in CARD_TAGS
    ]
    if transfer_info is not None:
        map_tags = [*map_tags, "attention-transfer"]
    card_tags = list(dict.fromkeys([*map_tags, geometry["source_model_type"], *(tags or [])]))
    card_data = ModelCardData(
        base_model=base_model if base_model_list else None,
        datasets=dataset_list or None,
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        tags=card_tags,
        license=license,
        language=language,
        eval_results=eval_results or None,
        model_name=model_name if eval_results else None,
    )

    try:
        code_files = sorted(_check_code(folder, config.get("auto_map") or {}, "config.json", [], []))
    except OSError:
        code_files = []
    is_causal = architecture == "PerformerForCausalLM" or any(
        "CausalLM" in name or "LMHead" in name for name in geometry["source_architectures"]
    )
    dtype_bytes = _DTYPE_BYTES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), 4)
    described = _describe_map(feature_map, kind, settings, distilled=transfer_info is not None)
    if not described["is_favor"]:
        usage_example = usage_example.replace("FAVOR+ state", "linear-attention state")
    paper, citations = _citations(feature_map, distilled=transfer_info is not None)
    meanings = setting_meanings(settings, geometry["head_dim"])
    order = list(meanings) + [key for key in SETTING_MEANINGS if key not in meanings]
    context = {
        "model_name": model_name,
        "repo_id": repo_id or model_name,
        "base_model_list": base_model_list,
        "architecture": architecture,
        "auto_class": auto_class,
        "usage_example": usage_example,
        "pipeline_tag": pipeline_tag,
        "code_files": code_files or ["modeling_performer.py"],
        **described,
        "paper": paper,
        "citations": citations,
        "softmax_layers": settings.get("softmax_layers") or [],
        "settings_rows": [
            {"name": key, "value": _format_setting(settings[key]), "meaning": meanings.get(key, "")}
            for key in sorted(settings, key=lambda k: (order.index(k) if k in order else 99, k))
        ],
        **geometry,
        # The record's fidelity_after (local source path included) is read through `fidelity` only.
        "transfer": {k: v for k, v in transfer_info.items() if k != "fidelity_after"} if transfer_info else None,
        "fidelity": report,
        "fidelity_file": report_file,
        "results": eval_results,
        "recovery": recovery_rows,
        "is_causal": is_causal,
        "fine_tuned": fine_tuned,
        **_speed_context(settings, geometry, is_causal, dtype_bytes),
    }
    template = Path(template_path) if template_path is not None else default_template_path()
    try:
        card = ModelCard.from_template(card_data, template_path=str(template), **context)
    except Exception as error:  # jinja2 errors (undefined values, syntax) carry no common base class here
        raise ModelCardError(f"cannot render the model card template {template}: {error}") from error
    validate_model_card(card, expected_results=eval_results)
    return card


def validate_model_card(card: ModelCard | str, expected_results: list[EvalResult] | None = None) -> dict:
    """Validate a card offline with huggingface_hub's own parsing; returns its metadata as a dict.

    The card's text is parsed again as a ``ModelCard`` (YAML block, ``ModelCardData``, ``model-index`` parsed
    by ``model_index_to_eval_results``); ``model-index`` must survive a round trip
    (``model_index_to_eval_results`` then ``eval_results_to_model_index`` gives the same structure) and hold
    ``expected_results`` if given. Also checked: ``library_name: transformers``, a ``pipeline_tag``, the
    :data:`REQUIRED_CARD_TAGS` and a feature-map tag (``favor+``, ``hedgehog``, ...), ``base_model`` / ``datasets``
    as Hub ids.

    Raises:
        ModelCardError: with what is wrong.
    """
    from .feature_maps import FEATURE_MAPS

    text = str(card)
    try:
        parsed = ModelCard(text)
    except Exception as error:  # yaml errors and ValueError from ModelCardData
        raise ModelCardError(f"the card's metadata does not parse: {error}") from error
    if not text.startswith("---\n"):
        raise ModelCardError("the card does not start with a YAML metadata block")
    data = parsed.data.to_dict()
    if data.get("library_name") != "transformers":
        raise ModelCardError(f"library_name must be 'transformers', got {data.get('library_name')!r}")
    if not data.get("pipeline_tag"):
        raise ModelCardError("the card has no pipeline_tag")
    card_tags = data.get("tags") or []
    missing_tags = [tag for tag in REQUIRED_CARD_TAGS if tag not in card_tags]
    if missing_tags:
        raise ModelCardError(f"the card lacks the tags {missing_tags}")
    if not any(tag in FEATURE_MAPS for tag in card_tags):
        raise ModelCardError(f"the card has no feature-map tag (one of {', '.join(sorted(FEATURE_MAPS))})")
    for key in ("base_model", "datasets"):
        value = data.get(key)
        values = [value] if isinstance(value, str) else (value or [])
        if not isinstance(values, list) or not all(isinstance(v, str) and _HUB_ID.match(v) for v in values):
            raise ModelCardError(f"{key} must be Hub ids (namespace/name), got {value!r}")
    model_index = data.get("model-index")
    if model_index is not None:
        try:
            name, results = model_index_to_eval_results(model_index)
        except (KeyError, TypeError, ValueError) as error:
            raise ModelCardError(f"model-index does not parse: {error}") from error
        if eval_results_to_model_index(name, results) != model_index:
            raise ModelCardError("model-index does not survive a round trip through huggingface_hub")
        if expected_results is not None and sorted(map(repr, results)) != sorted(map(repr, expected_results)):
            raise ModelCardError("model-index does not hold the given results")
    elif expected_results:
        raise ModelCardError("results were given but the card has no model-index")
    return data


def write_model_card(folder: str | os.PathLike, **kwargs) -> Path:
    """Build the card (:func:`build_model_card`, same keyword arguments) and write it as ``folder/README.md``
    (replacing an existing one). Returns the path."""
    card = build_model_card(folder, **kwargs)
    path = Path(folder) / CARD_FILE_NAME
    card.save(path)
    return path


def write_recipe_card(output_dir: str | os.PathLike) -> Path | None:
    """Write the model card of a fine-tuning recipe's output folder (called by :func:`hf_performer.recipes.train.train`
    at the end of a run): fine-tuned, with the results of its ``metrics.json`` (:func:`recipe_results`).

    Returns the card's path, or ``None`` when the folder holds no Performer model (a softmax baseline,
    ``--no-save-model``) or the card could not be built (a warning on stderr says why and how to write it).
    """
    folder = Path(output_dir)
    try:
        config = _read_json(folder / "config.json", "config")
    except ModelCardError:
        return None
    if not isinstance(config.get("favor_settings"), dict):
        return None
    results = None
    try:
        results, _ = load_metrics(folder / RECIPE_METRICS_FILE)
    except ModelCardError as error:
        print(f"warning: the model card gets no results: {error}", file=sys.stderr)
    try:
        return write_model_card(folder, results=results, fine_tuned=True)
    except ModelCardError as error:
        print(f"warning: no model card written ({error}); write it with `hf-performer card {folder}`", file=sys.stderr)
        return None


# --------------------------------------------------------------------------------------------
# Push
# --------------------------------------------------------------------------------------------


@dataclass
class PushResult:
    """What :func:`push_folder` sent (or would send, with ``dry_run``)."""

    repo_id: str
    revision: str | None
    files: list[UploadFile]
    dry_run: bool
    repo_url: str | None = None
    commit_url: str | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def format_listing(self) -> str:
        """The file list as a table (path, size), with the total."""
        width = max([len(f.path) for f in self.files] + [4])
        lines = [f"  {f.path:<{width}}  {_human_bytes(f.size):>10}  ({f.size} bytes)" for f in self.files]
        lines.append(f"  {len(self.files)} files, {_human_bytes(self.total_bytes)} ({self.total_bytes} bytes)")
        return "\n".join(lines)


def _check_revision(revision: str | None) -> bool:
    """Whether ``revision`` is a branch to create if needed (``False`` for ``None``, ``main`` and PR refs)."""
    if revision is None or revision == "main" or revision.startswith("refs/pr/"):
        return False
    if re.fullmatch(r"[0-9a-f]{40}", revision):
        raise PushError(f"revision {revision!r} is a commit id: uploads go to a branch; give a branch name")
    if revision.startswith("refs/") or not re.fullmatch(r"[\w.\-/]+", revision) or ".." in revision:
        raise PushError(f"revision {revision!r} is not a valid branch name")
    return True


_OFFLINE_ADVICE = (
    "HF_HUB_OFFLINE is set, so huggingface_hub sends nothing: unset it to upload "
    "(`env -u HF_HUB_OFFLINE hf-performer push ...`); --dry-run lists the files without the network"
)


def _first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


def _hub_refusal(repo_id: str, error: HfHubHTTPError) -> str:
    """One line for an HTTP error of the Hub: the status and reason, and what to do about a token problem."""
    status = getattr(getattr(error, "response", None), "status_code", None)
    reason = _first_line(error)
    if status in (401, 403):
        return (
            f"the Hub refused the upload to {repo_id} ({reason}): the token is invalid or cannot write to "
            f"{repo_id.split('/')[0]}; log in with `hf auth login` or pass --token with a write token"
        )
    return f"the Hub refused the upload to {repo_id}: {reason}"


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    dry_run: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
    endpoint: str | None = None,
    include_checkpoints: bool = False,
) -> PushResult:
    """Validate ``folder`` and upload it to the Hub model repository ``repo_id``.

    Args:
        folder: a Performer model folder (checked by :func:`validate_folder` first; nothing is sent if it fails).
        repo_id: ``namespace/name``.
        private: create the repository private (an existing repository keeps its visibility). Without it the
            Hub's default applies (public, unless the organisation defaults to private).
        revision: branch to upload to; created from ``main`` when it does not exist (``refs/pr/N`` is used as is).
        dry_run: only list what would be uploaded: no network, no token needed.
        token: a Hub token; default: ``HF_TOKEN`` or the cached login (``hf auth login``).
        commit_message: default "Upload Performer model with hf-performer".
        endpoint: the Hub's URL; default ``HF_ENDPOINT`` (read now) or https://huggingface.co.
        include_checkpoints: also upload ``checkpoints/`` (training states; left out by default).

    Returns:
        A :class:`PushResult` listing the files (sent, or that would be sent).

    Raises:
        FolderValidationError: the folder would not load.
        PushError: bad repo id or revision, no token, ``HF_HUB_OFFLINE`` set, the Hub unreachable or refusing the
            upload; the message is one line saying what to do.
    """
    check = validate_folder(folder, include_checkpoints=include_checkpoints)
    if not isinstance(repo_id, str) or repo_id.count("/") != 1 or not _HUB_ID.match(repo_id) or ".." in repo_id:
        raise PushError(f"repo id {repo_id!r} is not of the form namespace/name")
    create_branch = _check_revision(revision)
    result = PushResult(repo_id=repo_id, revision=revision, files=check.files, dry_run=dry_run, warnings=check.warnings)
    if dry_run:
        return result

    if hub_constants.HF_HUB_OFFLINE:
        raise PushError(_OFFLINE_ADVICE)
    if token is None and get_token() is None:
        raise PushError(
            "no Hugging Face token: set HF_TOKEN, log in with `hf auth login`, or pass --token (a write token)"
        )
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    api = HfApi(endpoint=endpoint, token=token)
    try:
        repo_url = api.create_repo(repo_id, private=True if private else None, exist_ok=True, repo_type="model")
        if create_branch:
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(check.folder),
            repo_type="model",
            revision=revision,
            commit_message=commit_message or "Upload Performer model with hf-performer",
            ignore_patterns=_ignore_patterns(include_checkpoints),
        )
    except OfflineModeIsEnabled:
        raise PushError(_OFFLINE_ADVICE) from None
    except HfHubHTTPError as error:
        raise PushError(_hub_refusal(repo_id, error)) from error
    except Exception as error:  # the transport's errors (refused, reset, DNS, timeout) have no common base here
        raise PushError(
            f"could not reach the Hub at {endpoint or hub_constants.ENDPOINT} to upload {repo_id}: "
            f"{_first_line(error)} ({type(error).__name__}); check the network (and HF_ENDPOINT, proxies), then retry"
        ) from error
    result.repo_url = str(repo_url)
    result.commit_url = getattr(info, "commit_url", None)
    return result


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

_PUSH_DESCRIPTION = """Upload a Performer model folder to the Hugging Face Hub.

The folder is checked first: it must load with from_pretrained(..., trust_remote_code=True) (config.json
with auto_map, the code files auto_map names and the modules they import, weights, tokenizer; the config
must load and describe the weights: every tensor, with its shape); a folder that would not load is refused
with the list of what is wrong. checkpoints/ (training states of a recipe run) is left out unless
--include-checkpoints. The repository is created if needed (--private), --revision uploads to a branch
(created from main if needed). The token comes from --token, else HF_TOKEN, else the cached
`hf auth login`; the endpoint from HF_ENDPOINT (default huggingface.co). With HF_HUB_OFFLINE set nothing
can be sent. --dry-run lists the files that would be uploaded, with their sizes, and sends nothing.
"""

_CARD_DESCRIPTION = """(Re)write the README.md model card of a Performer model folder.

Metadata: base_model, library_name (transformers), pipeline_tag, tags, datasets, model-index (from
--metrics). Body: how to load it, the conversion settings (config.json favor_settings, explained for the
feature map's kind), the attention transfer (attention_transfer.json, written by `hf-performer distill`), the
fidelity report (conversion_report.json), results and recovery rows (--metrics) and measured notes on where
linear attention is and is not faster. The card is validated with huggingface_hub before it is written.

--metrics files hold a list of results, {"results": [...], "recovery": [...]}, one result
{"task": "sst2", "metric": "accuracy", "value": 0.91, "split": "validation"}, a run summary
{"task": ..., "metrics": {"accuracy": 0.91}}, or the metrics.json of a recipe run (recipes/; such a
folder counts as fine-tuned) (see model_cards/README.md).
"""


def add_parser(subparsers) -> None:
    """Add the ``push`` and ``card`` subcommands to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    push = subparsers.add_parser(
        "push",
        help="upload a Performer model folder to the Hugging Face Hub (checked first; --dry-run lists files)",
        description=_PUSH_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    push.add_argument("folder", metavar="FOLDER", help="the model folder to upload")
    push.add_argument("repo_id", metavar="REPO_ID", help="the Hub model repository, namespace/name")
    push.add_argument("--private", action="store_true", help="create the repository private")
    push.add_argument("--revision", default=None, metavar="REV", help="branch to upload to (created if needed)")
    push.add_argument("--dry-run", action="store_true", help="list the files that would be uploaded; send nothing")
    push.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the cached login)")
    push.add_argument("--commit-message", default=None, help="commit message")
    push.add_argument("--include-checkpoints", action="store_true",
                      help="also upload checkpoints/ (training states of a recipe run; left out by default)")
    push.set_defaults(func=run_push)

    card = subparsers.add_parser(
        "card",
        help="(re)write the README.md model card of a Performer model folder",
        description=_CARD_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    card.add_argument("folder", metavar="FOLDER", help="the model folder")
    card.add_argument("--base-model", action="append", default=None, metavar="HUB_ID",
                      help="Hub id of the model this one derives from (repeatable; default: the conversion "
                           "source if it is a Hub id)")
    card.add_argument("--dataset", action="append", default=None, metavar="HUB_ID",
                      help="Hub id of a training dataset (repeatable; default: the datasets of --metrics)")
    card.add_argument("--metrics", action="append", default=None, metavar="JSON",
                      help="metrics file with results (model-index) and recovery rows (repeatable)")
    card.add_argument("--model-name", default=None, help="title and model-index name (default: folder name)")
    card.add_argument("--repo-id", default=None, help="Hub repository used in the card's loading example")
    card.add_argument("--license", default=None, help="license identifier (e.g. apache-2.0)")
    card.add_argument("--language", action="append", default=None, help="language code (repeatable)")
    card.add_argument("--tag", action="append", default=None, help="extra tag (repeatable)")
    card.add_argument("--fine-tuned", action=argparse.BooleanOptionalAction, default=None,
                      help="whether the model was fine-tuned after conversion (default: detected from Trainer files)")
    card.add_argument("--template", default=None, help="Jinja template (default: model_cards/performer_card.md)")
    card.set_defaults(func=run_card)


def run_push(args: argparse.Namespace) -> int:
    """Run ``hf-performer push`` (see :func:`add_parser`). Returns the exit status."""
    try:
        result = push_folder(
            args.folder,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            dry_run=args.dry_run,
            token=args.token,
            commit_message=args.commit_message,
            include_checkpoints=args.include_checkpoints,
        )
    except (FolderValidationError, PushError) as error:
        raise SystemExit(f"hf-performer push: error: {error}") from None
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    target = f"{args.repo_id}" + (f" (revision {args.revision})" if args.revision else "")
    if result.dry_run:
        print(f"dry run: would upload to {target}:")
        print(result.format_listing())
        print("nothing was uploaded")
    else:
        print(f"uploaded to {target}:")
        print(result.format_listing())
        print(f"commit: {result.commit_url}")
    return 0


def run_card(args: argparse.Namespace) -> int:
    """Run ``hf-performer card`` (see :func:`add_parser`). Returns the exit status."""
    results: list = []
    recovery: list = []
    try:
        for metrics_path in args.metrics or []:
            file_results, file_recovery = load_metrics(metrics_path)
            results += file_results
            recovery += file_recovery
        base_model = args.base_model
        if base_model is not None and len(base_model) == 1:
            base_model = base_model[0]
        path = write_model_card(
            args.folder,
            base_model=base_model,
            datasets=args.dataset,
            results=results or None,
            recovery=recovery or None,
            model_name=args.model_name,
            repo_id=args.repo_id,
            license=args.license,
            language=args.language,
            tags=args.tag,
            fine_tuned=args.fine_tuned,
            template_path=args.template,
        )
    except ModelCardError as error:
        raise SystemExit(f"hf-performer card: error: {error}") from None
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``push`` / ``card`` alone (``python -m hf_performer.hub push FOLDER REPO_ID ...``)."""
    parser = argparse.ArgumentParser(prog="hf-performer")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "CARD_TAGS",
    "REQUIRED_CARD_TAGS",
    "FolderCheck",
    "FolderValidationError",
    "ModelCardError",
    "PushError",
    "PushResult",
    "UploadFile",
    "build_model_card",
    "load_metrics",
    "normalize_recovery",
    "normalize_results",
    "push_folder",
    "recipe_results",
    "setting_meanings",
    "transfer_context",
    "upload_file_list",
    "validate_folder",
    "validate_model_card",
    "write_model_card",
    "write_recipe_card",
]
