"""The documentation site builds in strict mode, its results tables match the committed JSON, and its checks catch
what they are meant to catch (the guides' code blocks run in tests/test_docs_examples.py)."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_site_builds_in_strict_mode(tmp_path):
    """Every link, anchor, API entry, docstring reference and named package object is valid (mkdocs.yml)."""
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=REPO, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    site = tmp_path / "site"
    for page in ("index.html", "api/conversion/index.html", "results/kernels/index.html", "benchmarks/index.html"):
        assert (site / page).is_file(), page
    assert (site / "benchmarks/results/attention_speed_chunked.png").is_file()  # published at build time
    assert "convert_to_performer" in (site / "api/conversion/index.html").read_text()
    assert "usage: hf-performer convert" in (site / "reference/cli/index.html").read_text()


def test_the_committed_command_reference_lists_every_flag():
    """docs/reference/cli.md reads on GitHub: each verb's block holds its --help, every option of the parser in it
    (the exact wrapping depends on Python's argparse; the site is built from the parsers themselves)."""
    import argparse
    import re

    from hf_performer.cli import build_parser

    hooks = _load(REPO / "docs" / "_build" / "hooks.py", "_docs_hooks_reference")
    text = hooks.CLI_REFERENCE.read_text()
    blocks = {match.group(2): match.group(0) for match in hooks._CLI_HELP.finditer(text)}
    assert blocks and set(blocks) == set(re.findall(r"<!-- cli-help: ([a-z -]+?) -->", text))
    for verb, block in blocks.items():
        words = verb.split()
        parser = build_parser(words[0])
        for word in words:
            parser = next(action for action in parser._actions
                          if isinstance(action, argparse._SubParsersAction)).choices[word]
        options = [option for action in parser._actions for option in action.option_strings
                   if action.help != argparse.SUPPRESS]
        missing = [option for option in options if option not in block]
        assert f"usage: hf-performer {verb}" in block and not missing, \
            f"{verb}: {missing} (run python docs/_build/hooks.py)"


def test_generated_tables_match_the_committed_results():
    """The tables between <!-- NAME:start --> / <!-- NAME:end --> in README.md and docs/ are what the JSON gives."""
    update = _load(REPO / "benchmarks" / "scripts" / "update_readme_results.py", "_update_readme_results_docs")
    stale = {str(page.relative_to(REPO)): changed for page in update.pages() for changed in [update.regenerate(page)[1]]
             if changed}
    assert not stale, f"stale generated blocks (run python benchmarks/scripts/update_readme_results.py): {stale}"
    tables = _load(REPO / "benchmarks" / "scripts" / "results_tables.py", "_results_tables_docs")
    used = "".join(page.read_text() for page in update.pages())
    assert [name for name in tables.TABLES if f"<!-- {name}:start -->" not in used] == []


def test_every_committed_command_names_a_script_that_exists_or_the_commit_that_had_it():
    """A result's recorded command is its reproduction: each benchmarks/scripts file it names is in the tree, or in
    results_tables.REMOVED_SCRIPTS with the last commit that had it (and the results index says so)."""
    import json
    import re

    tables = _load(REPO / "benchmarks" / "scripts" / "results_tables.py", "_results_tables_scripts")
    scripts = REPO / "benchmarks" / "scripts"
    missing = {}
    for path in sorted((REPO / "benchmarks" / "results").glob("*.json")):
        command = tables._command(json.loads(path.read_text())) or ""
        for script in re.findall(r"benchmarks/scripts/([\w.-]+\.(?:py|sh))", command):
            if not (scripts / script).is_file() and script not in tables.REMOVED_SCRIPTS:
                missing[path.name] = script
    assert not missing, f"commands naming a script that is neither present nor in REMOVED_SCRIPTS: {missing}"
    assert not [script for script in tables.REMOVED_SCRIPTS if (scripts / script).exists()]
    index = tables.results_index("../..")
    assert "window_hybrid_smollm2_tail512" in index and "run it from a checkout of 72868fe" in index


def test_readme_is_a_landing_page():
    """Under ~150 lines, its first bash block holding the two commands CI runs (.ci/run reads them)."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.rsplit("#", 1)[1].strip() for line in first_block] == ["main job", "tests"]


@pytest.fixture
def docstring_checks():
    return _load(REPO / "docs" / "_build" / "griffe_docstrings.py", "_griffe_docstrings")


def test_docstring_checks_flag_a_dangling_reference_and_an_unknown_parameter(docstring_checks, tmp_path, caplog):
    import griffe

    package = tmp_path / "fakepkg"
    package.mkdir()
    (package / "__init__.py").write_text('''
def helper(x):
    """A helper."""


def documented(key, value, *, scale=1.0):
    """Calls :func:`helper` and :func:`~fakepkg.helper`, then :func:`removed_function`.

    Args:
        key, value: the inputs.
        scale: a factor.
        offset: a parameter that is gone.
    """
''')
    with caplog.at_level(logging.WARNING):
        loaded = griffe.load("fakepkg", search_paths=[str(tmp_path)], try_relative_path=False,
                             extensions=griffe.load_extensions(docstring_checks.DocstringChecks()))
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2, messages
    assert "'removed_function', which names nothing" in messages[0] and "parameter 'offset'" in messages[1]
    docstring = loaded["documented"].docstring.value
    assert "`helper`" in docstring and ":func:" not in docstring  # rendered as code
    assert "key: the inputs." in docstring and "value: the inputs." in docstring  # one entry per parameter
