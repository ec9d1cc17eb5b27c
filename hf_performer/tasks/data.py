"""Datasets for the recipes and ``hf-performer evaluate``: the GLUE tasks, IMDB and causal-LM text.

Two sources, one result (a ``datasets.Dataset`` with the task's text columns and an integer ``label``,
or a float ``label`` for STS-B):

* the Hugging Face Hub: ``datasets.load_dataset("glue", task)`` / ``load_dataset("imdb")`` /
  ``load_dataset("wikitext", "wikitext-2-raw-v1")`` (needs Hub access);
* local files (offline): ``.tsv``, ``.csv``, ``.jsonl`` / ``.json`` (JSON lines, or one JSON list), each
  optionally gzipped (``.jsonl.gz``, ``.tsv.gz``, ...). The layouts of the original GLUE / IMDB
  distributions are understood: the headerless CoLA TSV (``source, label, original mark, sentence``),
  string labels (RTE / QNLI / MNLI ``entailment`` ..., MNLI ``gold_label``), the STS-B ``score`` column,
  QQP ``is_duplicate``, MRPC ``Quality`` / ``#1 String`` / ``#2 String`` and IMDB ``{"id", "text", "label"}``.

Subsets (``max_samples``) are a seeded random choice of rows kept in file order, not the first rows: the
IMDB files (and the Hub's IMDB splits) are sorted by label, so their first rows are all negative.

Causal-LM text is one string per split (:func:`load_lm_text`): a raw text file as it is, or the Hub
dataset's ``text`` rows joined with ``"\\n\\n"`` (the convention of the transformers perplexity guide).
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import hashlib
import io
import json
import os
import zlib
from dataclasses import dataclass, field, replace

import numpy as np


class DataError(ValueError):
    """A task, file or column that cannot be used as asked (the message says what is accepted)."""


# --------------------------------------------------------------------------------------------
# Task registry
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskSpec:
    """What a text-classification / regression task needs.

    Attributes:
        name: the task name (``"sst2"``, ``"imdb"``, ...).
        text_columns: one column (single sentence) or two (sentence pair), as named on the Hub.
        num_labels: classes; ``1`` for regression (STS-B).
        is_regression: float labels and MSE loss (STS-B, scores 0-5).
        metrics: the metrics reported (names as ``evaluate``'s GLUE metric returns them).
        main_metric: the metric used to compare runs.
        label_names: class names by id (Hub order); string labels in local files are mapped with them.
        hub: ``load_dataset`` arguments, e.g. ``("glue", "sst2")``.
        train_split, validation_split: Hub split names (MNLI: ``validation_matched``; IMDB has no validation
            split: its ``test`` split is the evaluation set).
        column_aliases: other names of a column in the original distributions' files (``score`` -> label).
        headerless_columns: the columns of a header-less TSV layout (CoLA), ``None`` if the task has none.
        display_name: the benchmark's own spelling (``"SST-2"``), for model cards.
    """

    name: str
    text_columns: tuple[str, ...]
    num_labels: int
    metrics: tuple[str, ...]
    main_metric: str
    label_names: tuple[str, ...] | None
    hub: tuple[str, ...]
    is_regression: bool = False
    train_split: str = "train"
    validation_split: str = "validation"
    column_aliases: dict = field(default_factory=dict)
    headerless_columns: tuple[str, ...] | None = None
    display_name: str = ""

    @property
    def hub_dataset_id(self) -> str:
        """The canonical Hub repository of the dataset (``nyu-mll/glue``, ``stanfordnlp/imdb``)."""
        return HUB_DATASET_IDS[self.hub[0]]

    @property
    def hub_config(self) -> str | None:
        """The dataset configuration on the Hub (the GLUE task), ``None`` if there is none."""
        return self.hub[1] if len(self.hub) > 1 else None

    @property
    def is_pair(self) -> bool:
        return len(self.text_columns) == 2

    @property
    def problem_type(self) -> str:
        """``config.problem_type`` of the classification model."""
        return "regression" if self.is_regression else "single_label_classification"

    @property
    def id2label(self) -> dict[int, str]:
        if self.is_regression:
            return {0: "score"}
        return dict(enumerate(self.label_names or [f"LABEL_{i}" for i in range(self.num_labels)]))


_ACC = ("accuracy",)
_ACC_F1 = ("accuracy", "f1")

_DISPLAY_NAMES = {
    "cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "qqp": "QQP", "stsb": "STS-B",
    "mnli": "MNLI", "qnli": "QNLI", "rte": "RTE", "wnli": "WNLI", "imdb": "IMDB",
}

HUB_DATASET_IDS = {"glue": "nyu-mll/glue", "imdb": "stanfordnlp/imdb"}
"""Canonical Hub repositories of the datasets (``load_dataset("glue")`` resolves to ``nyu-mll/glue``)."""

TASKS: dict[str, TaskSpec] = {
    spec.name: replace(spec, display_name=_DISPLAY_NAMES[spec.name])
    for spec in (
        TaskSpec("cola", ("sentence",), 2, ("matthews_correlation",), "matthews_correlation",
                 ("unacceptable", "acceptable"), ("glue", "cola"),
                 headerless_columns=("source", "label", "original_label", "sentence")),
        TaskSpec("sst2", ("sentence",), 2, _ACC, "accuracy", ("negative", "positive"), ("glue", "sst2")),
        TaskSpec("mrpc", ("sentence1", "sentence2"), 2, _ACC_F1, "f1", ("not_equivalent", "equivalent"),
                 ("glue", "mrpc"),
                 column_aliases={"label": ("Quality", "quality"), "sentence1": ("#1 String",),
                                 "sentence2": ("#2 String",)}),
        TaskSpec("qqp", ("question1", "question2"), 2, _ACC_F1, "f1", ("not_duplicate", "duplicate"),
                 ("glue", "qqp"), column_aliases={"label": ("is_duplicate",)}),
        TaskSpec("stsb", ("sentence1", "sentence2"), 1, ("pearson", "spearmanr"), "pearson", None,
                 ("glue", "stsb"), is_regression=True, column_aliases={"label": ("score",)}),
        TaskSpec("mnli", ("premise", "hypothesis"), 3, _ACC, "accuracy",
                 ("entailment", "neutral", "contradiction"), ("glue", "mnli"),
                 validation_split="validation_matched",
                 column_aliases={"label": ("gold_label",), "premise": ("sentence1",),
                                 "hypothesis": ("sentence2",)}),
        TaskSpec("qnli", ("question", "sentence"), 2, _ACC, "accuracy", ("entailment", "not_entailment"),
                 ("glue", "qnli")),
        TaskSpec("rte", ("sentence1", "sentence2"), 2, _ACC, "accuracy", ("entailment", "not_entailment"),
                 ("glue", "rte")),
        TaskSpec("wnli", ("sentence1", "sentence2"), 2, _ACC, "accuracy", ("not_entailment", "entailment"),
                 ("glue", "wnli")),
        TaskSpec("imdb", ("text",), 2, _ACC, "accuracy", ("neg", "pos"), ("imdb",), validation_split="test"),
    )
}
"""Every supported classification / regression task by name: the nine GLUE tasks and IMDB."""

GLUE_TASKS = tuple(name for name, spec in TASKS.items() if spec.hub[0] == "glue")

LM_DATASETS: dict[str, tuple[str, ...]] = {
    "wikitext": ("wikitext", "wikitext-2-raw-v1"),
    "wikitext-2": ("wikitext", "wikitext-2-raw-v1"),
    "wikitext-103": ("wikitext", "wikitext-103-raw-v1"),
}
"""Causal-LM evaluation/training datasets known by name (``load_dataset`` arguments)."""


def get_task(name: str) -> TaskSpec:
    """The :class:`TaskSpec` of ``name`` (case-insensitive; ``sst-2`` / ``sts-b`` accepted).

    Raises:
        DataError: unknown task (the message lists the accepted ones).
    """
    key = name.lower().replace("-", "").replace("_", "")
    if key not in TASKS:
        raise DataError(f"unknown task {name!r}; accepted: {', '.join(TASKS)} (causal LM: {', '.join(LM_DATASETS)})")
    return TASKS[key]


# --------------------------------------------------------------------------------------------
# Local files
# --------------------------------------------------------------------------------------------

_FORMATS = ".tsv, .csv, .jsonl, .json (JSON lines or a JSON list), each optionally .gz"


def _file_format(path: str) -> tuple[str, bool]:
    """``(format, gzipped)`` from the file name: format in ``tsv``, ``csv``, ``json``."""
    name = os.path.basename(path).lower()
    gzipped = name.endswith(".gz")
    if gzipped:
        name = name[:-3]
    for suffix, kind in ((".tsv", "tsv"), (".csv", "csv"), (".jsonl", "json"), (".json", "json")):
        if name.endswith(suffix):
            return kind, gzipped
    raise DataError(f"cannot tell the format of {path!r} from its name; accepted: {_FORMATS}")


def _open_text(path: str, gzipped: bool) -> io.TextIOBase:
    """The file as UTF-8 text; a leading byte-order mark (the original MRPC files have one) is dropped."""
    if not os.path.isfile(path):
        raise DataError(f"data file not found: {path!r}")
    if gzipped:
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")


@contextlib.contextmanager
def _reading(path: str):
    """Turn the errors of reading ``path`` as (gzipped) UTF-8 text into one-line :class:`DataError` s naming it."""
    try:
        yield
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text (byte {error.object[error.start:error.start + 1]!r} at offset "
                        f"{error.start}): a binary file? Text files must be UTF-8 (.gz accepted)") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise DataError(f"{path}: not a readable gzip file ({error}); the name ends in .gz") from None
    except IsADirectoryError:
        raise DataError(f"{path}: a folder, not a file") from None
    except PermissionError:
        raise DataError(f"{path}: not readable (permission denied)") from None


def read_records(path: str | os.PathLike, max_rows: int | None = None, header: bool | None = None,
                 headerless_columns: tuple[str, ...] | None = None) -> list[dict]:
    """Read rows of a local TSV / CSV / JSON-lines file as dicts (values as read: strings for TSV/CSV).

    Args:
        path: the file (format from the name: ``.tsv``, ``.csv``, ``.jsonl``, ``.json``, optionally ``.gz``).
        max_rows: stop after this many rows (reads only the beginning of the file).
        header: TSV/CSV only: whether the first line names the columns. ``None`` detects it: a header is
            assumed unless ``headerless_columns`` is given, the first line has that many fields and none of
            them is a column name (so CoLA's header-less TSV is recognised).
        headerless_columns: column names of a header-less layout (CoLA), used when there is no header.

    Raises:
        DataError: missing file, unknown format, malformed JSON, a row with the wrong number of fields.
    """
    path = os.fspath(path)
    kind, gzipped = _file_format(path)
    with _reading(path), _open_text(path, gzipped) as handle:
        return _read_rows(path, handle, kind, max_rows, header, headerless_columns)


def _read_rows(path: str, handle, kind: str, max_rows: int | None, header: bool | None,
               headerless_columns: tuple[str, ...] | None) -> list[dict]:
    """The rows of :func:`read_records` from an open ``handle``."""
    rows: list[dict] = []
    if kind == "json":
        text_start = handle.read(1)
        while text_start and text_start.isspace():
            text_start = handle.read(1)
        if text_start == "[":  # one JSON list of objects
            try:
                data = json.loads(text_start + handle.read())
            except json.JSONDecodeError as error:
                raise DataError(f"{path}: not valid JSON ({error}); accepted: JSON lines or a list") from None
            rows = list(data[:max_rows] if max_rows is not None else data)
        else:
            first = text_start + handle.readline()
            for line_number, line in enumerate(_chain([first], handle), start=1):
                if not line.strip():
                    continue
                if max_rows is not None and len(rows) >= max_rows:
                    break
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise DataError(
                        f"{path}, line {line_number}: not a JSON object ({error}); JSON lines files hold one "
                        "object per line, e.g. {\"text\": ..., \"label\": 1}"
                    ) from None
        for index, row in enumerate(rows):
            if not isinstance(row, dict):
                raise DataError(f"{path}: row {index} is a {type(row).__name__}, not a JSON object")
        return rows

    # TSV files of GLUE contain unbalanced quote characters: no quoting for TSV.
    reader = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE) if kind == "tsv" else csv.reader(handle)
    first = next(reader, None)
    if first is None:
        return []
    if header is None:
        header = (headerless_columns is None or len(first) != len(headerless_columns)
                  or _looks_like_header(first, headerless_columns))
    if header:
        columns, pending = [c.strip() for c in first], []
    else:
        if headerless_columns is None:
            raise DataError(f"{path}: header=False needs the column names (headerless_columns)")
        columns, pending = list(headerless_columns), [first]
    for line_number, values in enumerate(_chain(pending, reader), start=2 if header else 1):
        if max_rows is not None and len(rows) >= max_rows:
            break
        if not values or (len(values) == 1 and not values[0].strip()):
            continue
        if len(values) != len(columns):
            raise DataError(
                f"{path}, row {line_number}: {len(values)} fields but {len(columns)} columns {columns}"
                + (" (is the header missing or the delimiter wrong?)" if kind == "csv" else "")
            )
        rows.append(dict(zip(columns, values)))
    return rows


def _chain(first, rest):
    yield from first
    yield from rest


def _looks_like_header(first: list[str], headerless_columns: tuple[str, ...]) -> bool:
    """A first row of a would-be header-less file is a header if it holds one of the column names."""
    names = {name.lower() for name in headerless_columns} | {"label", "sentence"}
    return any(value.strip().lower() in names for value in first)


def _find_column(columns: list[str], name: str, spec: TaskSpec) -> str | None:
    for candidate in (name, *spec.column_aliases.get(name, ())):
        if candidate in columns:
            return candidate
    return None


def _convert_label(value, spec: TaskSpec, where: str):
    """An integer class id (float score for regression) from a file's label value."""
    if spec.is_regression:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise DataError(f"{where}: label {value!r} is not a number; {spec.name} labels are scores") from None
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, (int, np.integer)):
        label = int(value)
    elif isinstance(value, float) and value.is_integer():
        label = int(value)
    elif isinstance(value, str):
        text = value.strip()
        names = [n.lower() for n in spec.label_names or ()]
        if text.lower() in names:
            label = names.index(text.lower())
        else:
            try:
                label = int(float(text))
            except ValueError:
                raise DataError(
                    f"{where}: label {value!r} is neither a class id (0..{spec.num_labels - 1}) nor a class name "
                    f"of {spec.name} ({', '.join(spec.label_names or ())})"
                ) from None
    else:
        raise DataError(f"{where}: label {value!r} of type {type(value).__name__} is not a class id or name")
    if not 0 <= label < spec.num_labels:
        raise DataError(f"{where}: label {label} is outside 0..{spec.num_labels - 1} for {spec.name}")
    return label


def records_to_task_columns(records: list[dict], spec: TaskSpec, source: str = "data") -> dict[str, list]:
    """The task's text columns and ``label`` from raw rows, with column aliases and string labels resolved.

    Returns:
        ``{text_column: [str], ..., "label": [int | float]}`` (rows without a label, e.g. ``-`` in MNLI, raise).

    Raises:
        DataError: a needed column is missing (the message lists the columns found and those accepted).
    """
    if not records:
        raise DataError(f"{source}: no rows")
    columns = list(records[0])
    mapping = {}
    for name in (*spec.text_columns, "label"):
        found = _find_column(columns, name, spec)
        if found is None:
            accepted = (name, *spec.column_aliases.get(name, ()))
            raise DataError(
                f"{source}: no {name!r} column for task {spec.name}; found columns {columns}; accepted names: "
                f"{list(accepted)}"
                + (" (CoLA files without a header are read as source, label, original_label, sentence)"
                   if spec.headerless_columns else "")
            )
        mapping[name] = found
    result: dict[str, list] = {name: [] for name in mapping}
    for index, record in enumerate(records):
        for name, column in mapping.items():
            value = record.get(column)
            if name == "label":
                value = _convert_label(value, spec, f"{source}, row {index}")
            elif not isinstance(value, str):
                raise DataError(f"{source}, row {index}: column {column!r} is {value!r}, not text")
            result[name].append(value)
    return result


def load_task_file(path: str | os.PathLike, task: str | TaskSpec, max_rows: int | None = None):
    """A local file of ``task`` as a ``datasets.Dataset`` with the task's text columns and ``label``.

    Args:
        path: TSV / CSV / JSON lines (optionally gzipped), in the task's Hub column names or the original
            distribution's layout (see the module docstring).
        task: a task name or :class:`TaskSpec`.
        max_rows: read only the first ``max_rows`` rows of the file.
    """
    from datasets import Dataset

    spec = task if isinstance(task, TaskSpec) else get_task(task)
    records = read_records(path, max_rows=max_rows, headerless_columns=spec.headerless_columns)
    columns = records_to_task_columns(records, spec, source=os.fspath(path))
    return Dataset.from_dict(columns)


def load_hub_task(task: str | TaskSpec, split: str):
    """``datasets.load_dataset`` of the task's Hub dataset (needs Hub access), split ``split``."""
    from datasets import load_dataset

    spec = task if isinstance(task, TaskSpec) else get_task(task)
    try:
        dataset = load_dataset(*spec.hub, split=split)
    except Exception as error:  # noqa: BLE001 - datasets raises many kinds for an unreachable Hub
        raise DataError(
            f"could not load {'/'.join(spec.hub)} split {split!r} from the Hugging Face Hub ({type(error).__name__}: "
            f"{error}); without Hub access pass local files (--train-file / --validation-file)"
        ) from error
    keep = [*spec.text_columns, "label"]
    return dataset.remove_columns([c for c in dataset.column_names if c not in keep])


def select_subset(dataset, max_samples: int | None, seed: int = 0):
    """At most ``max_samples`` rows: a seeded random choice (``numpy.random.default_rng(seed)``) kept in the
    dataset's order; the whole dataset when it is small enough or ``max_samples`` is ``None``."""
    if max_samples is None or max_samples >= len(dataset):
        return dataset
    if max_samples <= 0:
        raise DataError(f"max samples must be positive, got {max_samples}")
    indices = np.sort(np.random.default_rng(seed).choice(len(dataset), size=max_samples, replace=False))
    return dataset.select(indices.tolist())


def load_task_split(task: str | TaskSpec, split: str, data_file: str | None = None,
                    max_samples: int | None = None, seed: int = 0):
    """One split of a task, from ``data_file`` if given, else from the Hub.

    Args:
        task: task name or spec.
        split: ``"train"`` or ``"validation"`` (mapped to the task's Hub split name).
        data_file: a local file (see :func:`load_task_file`).
        max_samples: subset size (see :func:`select_subset`).
        seed: subset seed.
    """
    spec = task if isinstance(task, TaskSpec) else get_task(task)
    if data_file is not None:
        dataset = load_task_file(data_file, spec)
    else:
        hub_split = {"train": spec.train_split, "validation": spec.validation_split}.get(split, split)
        dataset = load_hub_task(spec, hub_split)
    return select_subset(dataset, max_samples, seed)


# --------------------------------------------------------------------------------------------
# Tokenisation
# --------------------------------------------------------------------------------------------


def tokenize_task_dataset(dataset, tokenizer, task: str | TaskSpec, max_length: int = 128):
    """Tokenise a task dataset (truncation to ``max_length``, no padding: pad per batch with
    ``DataCollatorWithPadding``).

    Returns:
        A dataset with ``input_ids``, ``attention_mask`` (and ``token_type_ids`` when the tokenizer makes them)
        and ``labels`` (int64, float32 for regression); the text columns are removed.
    """
    spec = task if isinstance(task, TaskSpec) else get_task(task)

    def encode(batch):
        texts = [batch[column] for column in spec.text_columns]
        encoded = tokenizer(*texts, truncation=True, max_length=max_length)
        encoded["labels"] = [float(v) for v in batch["label"]] if spec.is_regression else batch["label"]
        return encoded

    return dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc=f"tokenizing {spec.name}")


# --------------------------------------------------------------------------------------------
# Causal-LM text
# --------------------------------------------------------------------------------------------


def load_lm_text(text_file: str | os.PathLike | None = None, dataset: str = "wikitext",
                 dataset_config: str | None = None, split: str = "test", max_chars: int | None = None) -> str:
    """The text of one causal-LM split as one string.

    Args:
        text_file: a raw text file (e.g. ``wiki.test.raw``; ``.gz`` accepted), used as it is, or JSON lines with a
            ``text`` field (:func:`read_text_file`).
        dataset: else a Hub dataset name (``"wikitext"`` -> ``wikitext/wikitext-2-raw-v1``, see
            :data:`LM_DATASETS`) or any dataset with a ``text`` column; its rows are joined with ``"\\n\\n"``.
        dataset_config: the Hub configuration (default from :data:`LM_DATASETS`).
        split: Hub split.
        max_chars: keep only the first ``max_chars`` characters (a quick smoke evaluation).
    """
    if text_file is not None:
        return read_text_file(text_file, max_chars)
    from datasets import load_dataset

    hub = LM_DATASETS.get(dataset, (dataset,))
    if dataset_config is not None:
        hub = (hub[0], dataset_config)
    try:
        rows = load_dataset(*hub, split=split)
    except Exception as error:  # noqa: BLE001
        raise DataError(
            f"could not load {'/'.join(hub)} split {split!r} from the Hugging Face Hub ({type(error).__name__}: "
            f"{error}); without Hub access pass a raw text file (--text-file / --train-file)"
        ) from error
    if "text" not in rows.column_names:
        raise DataError(f"{'/'.join(hub)} has no 'text' column (columns: {rows.column_names})")
    text = "\n\n".join(rows["text"])
    if max_chars is not None:
        text = text[:max_chars]
    if not text.strip():
        raise DataError(f"the causal-LM text ({dataset}) is empty")
    return text


def is_json_lines(path: str | os.PathLike) -> bool:
    """Whether a causal-LM text file is JSON (lines) by its name (``.jsonl`` / ``.json``, optionally ``.gz``)."""
    name = os.fspath(path).lower()
    return name.removesuffix(".gz").endswith((".jsonl", ".json"))


def read_text_file(path: str | os.PathLike, max_chars: int | None = None) -> str:
    """The text of a causal-LM file: raw UTF-8 text as it is, or the ``text`` fields of a JSON lines file joined by
    blank lines (``.gz`` accepted); only the first ``max_chars`` characters when given.

    Raises:
        DataError: one line naming the file: missing, a folder, unreadable, not UTF-8 (a binary file), a broken gzip
            file, a JSON row without ``text``, or no text at all.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"text file not found: {path!r}" if not os.path.isdir(path) else f"{path}: a folder, not a "
                        "text file")
    if is_json_lines(path):
        rows = read_records(path)
        missing = next((index for index, row in enumerate(rows, start=1) if "text" not in row), None)
        if missing is not None:
            raise DataError(f"{path}: row {missing} has no 'text' field (keys {sorted(rows[missing - 1])}); JSON lines "
                            'text files hold one {"text": ...} object per line')
        text = "\n\n".join(str(row["text"]) for row in rows)
        text = text if max_chars is None else text[:max_chars]
    else:
        opener = gzip.open if path.endswith(".gz") else open
        with _reading(path), opener(path, "rt", encoding="utf-8-sig") as handle:  # a byte-order mark is not text
            text = handle.read(max_chars) if max_chars is not None else handle.read()
    if "\x00" in text:
        raise DataError(f"{path}: holds NUL bytes: a binary file, not text")
    if not text.strip():
        raise DataError(f"{path}: no text (the file is empty or blank)")
    return text


def file_fingerprint(paths) -> str:
    """A content fingerprint of data files (SHA-256 of their bytes in order, first 16 hex digits): what a record
    keeps of its training data, so that a resumed run or a later one can tell the same data from other data whatever
    the file names."""
    digest = hashlib.sha256()
    for path in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def tokenize_lm_text(text: str, tokenizer) -> list[int]:
    """Token ids of the whole text (no special tokens added, no truncation)."""
    # Long texts exceed model_max_length on purpose: windows are cut later; silence the length warning.
    saved = tokenizer.model_max_length
    tokenizer.model_max_length = int(1e30)
    try:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    finally:
        tokenizer.model_max_length = saved


def group_into_blocks(ids: list[int], block_size: int):
    """Consecutive blocks of ``block_size`` tokens (the remainder is dropped) as a ``datasets.Dataset`` with
    ``input_ids`` and ``labels`` (equal: the model shifts them), for causal-LM training."""
    from datasets import Dataset

    if block_size < 2:
        raise DataError(f"block size must be >= 2, got {block_size}")
    n_blocks = len(ids) // block_size
    if n_blocks == 0:
        raise DataError(f"the text has {len(ids)} tokens, fewer than one block of {block_size}")
    blocks = [ids[i * block_size:(i + 1) * block_size] for i in range(n_blocks)]
    return Dataset.from_dict({"input_ids": blocks, "attention_mask": [[1] * block_size] * n_blocks,
                              "labels": [list(b) for b in blocks]})


__all__ = [
    "DataError",
    "GLUE_TASKS",
    "LM_DATASETS",
    "TASKS",
    "TaskSpec",
    "get_task",
    "group_into_blocks",
    "load_hub_task",
    "file_fingerprint",
    "is_json_lines",
    "load_lm_text",
    "load_task_file",
    "load_task_split",
    "read_records",
    "read_text_file",
    "records_to_task_columns",
    "select_subset",
    "tokenize_lm_text",
    "tokenize_task_dataset",
]
