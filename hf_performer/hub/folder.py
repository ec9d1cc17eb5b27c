"""Checking a Performer model folder before upload, and the list of files an upload sends.

:func:`validate_folder` refuses a folder that would not load with ``from_pretrained(folder, trust_remote_code=True)``:
missing ``config.json`` or ``auto_map``, code files named by ``auto_map`` (or imported by them), weights, or
tokenizer; a config that ``PerformerConfig`` does not load, or whose model (built on the meta device) does not have
the tensors and shapes of the safetensors headers. The error lists every problem. :func:`upload_file_list` gives
the files an upload sends (a recipe's ``checkpoints/`` left out unless asked).
"""

from __future__ import annotations

import ast
import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub.constants import REPOCARD_NAME
from huggingface_hub.utils import filter_repo_objects

# The runtime (torch, transformers) is imported in the functions that use it: `push --help` stays fast.


try:  # the patterns upload_folder always adds (private in huggingface_hub; the same list is kept below)
    from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS as _HUB_IGNORE_PATTERNS
except ImportError:  # pragma: no cover - depends on the huggingface_hub version
    _HUB_IGNORE_PATTERNS = [
        ".git", ".git/*", "*/.git", "**/.git/**",
        ".cache/huggingface", ".cache/huggingface/*", "*/.cache/huggingface", "**/.cache/huggingface/**",
    ]

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

_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.\-]{0,95}/)?[A-Za-z0-9][\w.\-]{0,95}$")

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHT_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
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


def _check_tokenizer(folder: Path, problems: list[str], warnings: list[str],
                     without_tokenizer: bool = False) -> list[str]:
    from ..conversion.convert import TOKENIZER_VOCAB_FILES  # lazily: `push --help` imports no torch

    present = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if without_tokenizer and not present:
        warnings.append("no tokenizer (--no-tokenizer): users load the source's tokenizer themselves; say which in the "
                        "card")
        return []
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

    from .. import modeling_performer
    from ..configuration_performer import PERFORMER_MODEL_TYPE, PerformerConfig

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


def validate_folder(folder: str | os.PathLike, include_checkpoints: bool = False,
                    without_tokenizer: bool = False) -> FolderCheck:
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
        without_tokenizer: accept a folder with no tokenizer file at all (a conversion of a source without one),
            with a warning; tokenizer files that are there are checked all the same.

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
    tokenizer_files = _check_tokenizer(path, problems, warnings, without_tokenizer)
    if problems:
        raise FolderValidationError(folder, problems)
    if not (path / REPOCARD_NAME).is_file():
        warnings.append(f"no {REPOCARD_NAME} model card (write one with `hf-performer card {folder}`)")
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

