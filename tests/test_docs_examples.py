"""The code blocks of README.md and docs/ run, page by page, on tiny random models: a guide's example cannot rot.

Each page runs in a folder of its own that holds what the pages name (:func:`sandbox`): tiny random models saved
under the Hub ids the pages use (``sentence-transformers/all-MiniLM-L6-v2`` is a 2-layer BERT of width 32 with a
WordPiece vocabulary, ``HuggingFaceTB/SmolLM2-135M`` a 2-layer Llama; transformers loads a local folder of that
name before it would ask the Hub, and the Hub is offline here) and small files in the layouts of the real data
(``data/sst2/{train,dev}.tsv``, ``data/wikitext-2-raw/wiki.{valid,test}.raw``).

A page's blocks run in order, sharing one namespace (as a reader pastes them into one session):

* ``python`` blocks are executed;
* ``bash`` blocks run command by command (``\\`` continuations joined, comments dropped): ``hf-performer ...`` through
  the command line's ``main`` in this process (status 0 expected), ``python SCRIPT.py ...`` of the repository with
  ``runpy``, ``NAME=value`` lines set a variable for the next lines (``$NAME``); anything else fails the test.

A comment on the line before a block changes that:

* ``<!-- test: parse-only -->``: python is compiled; each command line is checked, not run (:func:`parse_command`;
  for commands that need a real model, a GPU or hours): the flags must exist;
* ``<!-- test: skip: REASON -->``: not run (installation commands); the reason is required;
* ``<!-- test: output -->`` before a ``text`` block: the block is what the python block before it prints.

Blocks of other languages (``text``, ``yaml``) are not run.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

from conftest import tiny_bert_config, tiny_llama_config, word_level_tokenizer, word_piece_tokenizer

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```\s*$", re.DOTALL | re.MULTILINE)
DIRECTIVE = re.compile(r"<!-- test: (parse-only|output|skip: \S.*) -->")
RUN_LANGUAGES = ("python", "bash")

WORDS = tuple(dict.fromkeys((
    "the a an and of to in is was it this that film movie story actors plot music scenes ending time people with for "
    "on at by from not very too so just really quite more most best worst good great fine bad awful boring funny "
    "moving long short new old city river house year day night world life work family friend capital france paris "
    "london language model attention tokens memory context window").split()))
"""The vocabulary of the tiny tokenizers and of the data files."""


def parse_blocks(text: str) -> list[tuple[str, str, str | None]]:
    """``(language, code, directive)`` of every fenced block of ``text``; the directive is the test comment on the
    line before the block (``parse-only``, ``output`` or ``skip: REASON``), if any."""
    blocks = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        directive = DIRECTIVE.fullmatch(before)
        blocks.append((match.group(1), match.group(2), directive.group(1) if directive else None))
    return blocks


def command_lines(code: str) -> list[str]:
    """The commands of a bash block: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    lines = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            lines.append(shlex.join(words))
    return lines


def _recipe_kind(script: str) -> str | None:
    return {"text_classification.py": "text-classification", "causal_lm.py": "causal-lm"}.get(Path(script).name)


def _check_script_mentions(script: Path, names: list[str], line: str) -> None:
    """A script run in a parse-only block: it exists, and its source names every flag (or variable) given."""
    assert script.is_file(), f"no such script in the repository: {script.relative_to(REPO)}"
    source = script.read_text()
    missing = [name for name in names if name not in source]
    assert not missing, f"{script.relative_to(REPO)} does not know {missing}: {line}"


def _without_accelerate_launch(words: list[str]) -> list[str]:
    """``accelerate launch [options] SCRIPT ARGS`` as ``python SCRIPT ARGS`` (a config file must exist)."""
    rest = words[2:]
    while rest and rest[0].startswith("--"):
        option = rest.pop(0)
        if option == "--config_file":
            assert (REPO / rest[0]).is_file(), f"no such accelerate config: {rest[0]}"
        if "=" not in option and option != "--cpu":
            rest.pop(0)
    return ["python", *rest]


def run_command(line: str, variables: dict, parse_only: bool) -> None:
    """Run (or, with ``parse_only``, parse) one command line of a bash block."""
    words = [re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), os.environ.get(m.group(1), m.group(0))), word)
             for word in shlex.split(line)]
    environment = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        environment[name] = value
    if not words:  # NAME=value lines set variables for the next lines
        variables.update(environment)
        return
    if words[:2] == ["accelerate", "launch"]:
        assert parse_only, f"`accelerate launch` runs only in a parse-only block: {line}"
        words = _without_accelerate_launch(words)
    if parse_only:
        parse_command(words, environment, line)
        return
    assert not environment, f"environment variables before a command run only in a parse-only block: {line}"
    if words[0] == "hf-performer":
        from hf_performer.cli import main

        assert main(words[1:]) == 0, f"exit status != 0: {line}"
    elif words[0] == "python" and words[1].endswith(".py"):
        script = REPO / words[1]
        assert script.is_file(), f"no such script in the repository: {words[1]}"
        argv = sys.argv
        sys.argv = [str(script), *words[2:]]
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as exit_:
            assert exit_.code in (0, None), f"exit status {exit_.code}: {line}"
        finally:
            sys.argv = argv
    else:
        pytest.fail(f"a docs block runs a command this test cannot run; mark the block parse-only or skip: {line}")


def parse_command(words: list[str], environment: dict, line: str) -> None:
    """Check a command without running it: the verb's or recipe's parser accepts its flags; another script of the
    repository exists and names every flag (python) or variable (bash) given; ``python -c`` code compiles."""
    flags = [word.split("=", 1)[0] for word in words if word.startswith("--")]
    if words[0] == "hf-performer":
        from hf_performer.cli import build_parser

        build_parser(words[1]).parse_args(words[1:])
    elif words[:2] == ["python", "-c"]:
        compile(words[2], line, "exec")
    elif words[0] == "python" and _recipe_kind(words[1]):
        from hf_performer.recipes.arguments import build_parser

        assert (REPO / words[1]).is_file(), f"no such script in the repository: {words[1]}"
        build_parser(_recipe_kind(words[1])).parse_args(words[2:])
    elif words[0] == "python":
        _check_script_mentions(REPO / words[1], flags, line)
    elif words[0] == "bash":
        _check_script_mentions(REPO / words[1], list(environment), line)
    else:
        pytest.fail(f"a parse-only block holds a command this test cannot check; mark the block skip: {line}")


def _write_text_data(root: Path) -> None:
    rng = random.Random(0)
    sst2 = root / "data" / "sst2"
    sst2.mkdir(parents=True)
    for name, rows in (("train.tsv", 48), ("dev.tsv", 16)):
        lines = ["sentence\tlabel"]
        for index in range(rows):
            label = index % 2
            words = [rng.choice(WORDS) for _ in range(rng.randint(4, 9))]
            words.insert(rng.randint(0, len(words)), "great" if label else "awful")
            lines.append(f"{' '.join(words)}\t{label}")
        (sst2 / name).write_text("\n".join(lines) + "\n")
    wikitext = root / "data" / "wikitext-2-raw"
    wikitext.mkdir(parents=True)
    for name, count in (("wiki.valid.raw", 3000), ("wiki.test.raw", 800)):
        (wikitext / name).write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(12))
                                               for _ in range(count // 12)) + "\n")


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory) -> Path:
    """A folder with the tiny models under the pages' Hub ids and the data files (see the module docstring)."""
    import torch
    from transformers import BertModel, LlamaForCausalLM

    root = tmp_path_factory.mktemp("docs-sandbox")
    torch.manual_seed(0)
    minilm = root / "sentence-transformers" / "all-MiniLM-L6-v2"
    minilm.mkdir(parents=True)
    vocab = len(word_piece_tokenizer(minilm, WORDS, save_to=minilm))
    BertModel(tiny_bert_config(vocab_size=vocab, max_position_embeddings=128)).save_pretrained(minilm)

    smollm2 = root / "HuggingFaceTB" / "SmolLM2-135M"
    tokenizer = word_level_tokenizer(WORDS)
    config = tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=4096, eos_token_id=1,
                               pad_token_id=1, bos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(smollm2)
    tokenizer.save_pretrained(smollm2)
    _write_text_data(root)
    return root


@pytest.fixture
def one_torch_thread():
    """Tiny models gain nothing from a second thread, and on a loaded machine each of their many small operations
    waits for a descheduled one (measured here: 45 s of a page's blocks with 2 threads, 5 s with 1)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _page_id(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


@pytest.mark.parametrize("page", [page for page in PAGES if any(language in RUN_LANGUAGES for language, _, _ in
                                                                 parse_blocks(page.read_text()))], ids=_page_id)
def test_page_blocks_run(page, sandbox, tmp_path, monkeypatch, one_torch_thread):
    for entry in sandbox.iterdir():
        (tmp_path / entry.name).symlink_to(entry)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace = {"__name__": "__main__"}
    variables: dict[str, str] = {}
    printed = None
    for index, (language, code, directive) in enumerate(parse_blocks(page.read_text())):
        if (language not in RUN_LANGUAGES and directive != "output") or (directive or "").startswith("skip"):
            continue
        where = f"{_page_id(page)}, block {index + 1}"
        if directive == "output":
            assert printed is not None, f"{where}: an output block must follow a python block that ran"
            assert [line.rstrip() for line in printed.strip("\n").splitlines()] == \
                [line.rstrip() for line in code.strip("\n").splitlines()], f"{where}: the page shows another output"
        elif language == "python":
            compiled = compile(code, where, "exec")
            printed = None
            if directive != "parse-only":
                output = io.StringIO()
                with contextlib.redirect_stdout(output):
                    exec(compiled, namespace)  # noqa: S102 - the page's own example
                printed = output.getvalue()
                sys.stdout.write(printed)
        else:
            printed = None
            for line in command_lines(code):
                run_command(line, variables, parse_only=directive == "parse-only")


def test_directives_are_well_formed():
    """Every test comment is one of the known forms and stands right before a block (a typo would run nothing)."""
    for page in PAGES:
        text = page.read_text()
        assert not re.search(r"^[ \t]+```(python|bash)", text, re.MULTILINE), \
            f"{_page_id(page)}: an indented python / bash block (this test reads blocks at the start of a line)"
        for match in re.finditer(r"^<!-- test:.*?-->", text, re.MULTILINE):
            assert DIRECTIVE.fullmatch(match.group(0)), (page, match.group(0))
            following = text[match.end():].lstrip("\n")
            assert following.startswith("```"), f"{_page_id(page)}: {match.group(0)} is not right before a block"
