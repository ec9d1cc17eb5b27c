"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks``).

* The API reference reads the package's source with griffe. ``pyproject.toml`` installs ``conversion/``,
  ``recipes/`` and ``model_cards/`` as subpackages of ``hf_performer`` (``package-dir``), which griffe cannot follow,
  so :func:`on_startup` lays out ``build/api-source/hf_performer`` as the installed package looks: a copy of
  ``hf_performer/`` with each ``package-dir`` folder copied in as its subpackage (griffe follows a symbolic link to
  its target's folder, so links would not do). ``mkdocs.yml`` points mkdocstrings there.
* Repository files outside ``docs/`` that the pages link to (the committed results, the research log, the recipes'
  README) are published as they are at build time (:data:`PUBLISHED`), not copied into git: a page links them by
  their repository path (``../../benchmarks/results/decode.png`` from ``docs/results/decoding.md``), which is right
  on GitHub and is rewritten here to the published file's place in the site.
* ``<!-- cli-help: VERB -->`` ... ``<!-- /cli-help -->`` in a page holds the ``--help`` of ``hf-performer VERB``:
  committed (so that the page reads on GitHub; ``python docs/_build/hooks.py`` rewrites it) and replaced at build
  time by what the parser itself prints.
* Inline code naming an object of the package (``hf_performer.conversion.convert_to_performer``) must name one that
  exists: a warning otherwise, so that ``mkdocs build --strict`` fails on a stale name.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import re
import shutil
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
API_SOURCE = REPO / "build" / "api-source"
PUBLISHED = ("benchmarks/README.md", "benchmarks/results/**/*.png", "benchmarks/results/**/*.json",
             "recipes/README.md")
"""Repository files (glob patterns from the repository root) published in the site at their repository path."""

log = logging.getLogger("mkdocs.hooks.hf_performer")


def on_startup(command, dirty) -> None:
    package = API_SOURCE / "hf_performer"
    shutil.rmtree(API_SOURCE, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "hf_performer", package, ignore=ignore)
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in package_dirs.items():
        shutil.copytree(REPO / folder, package / name.removeprefix("hf_performer."), ignore=ignore)


def published_files() -> list[str]:
    """The repository paths of :data:`PUBLISHED` (sorted)."""
    return sorted({path.relative_to(REPO).as_posix() for pattern in PUBLISHED for path in REPO.glob(pattern)})


def on_files(files, config):
    from mkdocs.structure.files import File

    for path in published_files():
        files.append(File.generated(config, path, abs_src_path=str(REPO / path)))
    return files


_LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")
_CLI_HELP = re.compile(r"(<!-- cli-help: ([a-z-]+(?: [a-z-]+)*) -->\n)(?:.*?\n)??(<!-- /cli-help -->)", re.S)
CLI_REFERENCE = REPO / "docs" / "reference" / "cli.md"
_PACKAGE_NAME = re.compile(r"`(hf_performer(?:\.\w+)+)(?:\(\))?`")


def _site_link(page, target: str) -> str | None:
    """The link to a published repository file (or, from a published file, to a page of ``docs/``), relative to
    ``page``; ``None`` when ``target`` is neither."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    source_dir = Path(page.file.abs_src_path).parent if page.file.abs_src_path else None
    if source_dir is None:
        return None
    resolved = Path(os.path.normpath(source_dir / target))
    if REPO not in resolved.parents:
        return None
    repo_path = resolved.relative_to(REPO).as_posix()
    if repo_path.startswith("docs/"):
        site_path = repo_path.removeprefix("docs/")  # a published file linking back to a page
    elif repo_path in _published():
        site_path = repo_path
    else:
        return None
    return os.path.relpath(site_path, Path(page.file.src_uri).parent.as_posix() or ".").replace(os.sep, "/")


@functools.cache
def _published() -> frozenset[str]:
    return frozenset(published_files())


def cli_help(verb: str) -> str:
    """``hf-performer VERB --help`` as the parser prints it, 100 columns wide (``verb`` may hold a sub-action)."""
    from hf_performer.cli import build_parser

    words = verb.split()
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        output = io.StringIO()
        with contextlib.redirect_stdout(output), contextlib.suppress(SystemExit):
            build_parser(words[0]).parse_args([*words, "--help"])
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous
    return "```text\n" + output.getvalue().rstrip() + "\n```"


def fill_cli_help(markdown: str) -> str:
    """Every ``cli-help`` block of ``markdown`` with the parser's current ``--help``."""
    return _CLI_HELP.sub(lambda match: match.group(1) + cli_help(match.group(2)) + "\n" + match.group(3), markdown)


@functools.cache
def _package_tree():
    import griffe

    return griffe.load("hf_performer", search_paths=[str(API_SOURCE)], try_relative_path=False)


def names_object(path: str) -> bool:
    """Whether the dotted ``path`` (``hf_performer.x.y``) names a module, class, function or attribute of the
    package, following its members as the source declares them (public names bound lazily by ``hf_performer``'s
    ``__init__`` count by their defining module)."""
    node = _package_tree()
    parts = path.split(".")[1:]
    for index, part in enumerate(parts):
        members = node.all_members if node.is_class else node.members
        if part not in members and node.is_module and (part in (node.exports or ()) or "__getattr__" in members):
            return index == len(parts) - 1 and _defined_below(node, part)  # a lazily bound export
        if part not in members:
            return False
        node = members[part]
        if node.is_alias:
            try:
                node = node.final_target
            except Exception:  # noqa: BLE001 - an alias to another package (torch, transformers) ends the walk
                return True
    return True


def _defined_below(module, name: str) -> bool:
    """Whether a submodule of ``module`` (at any depth) defines ``name``: where a package's ``__getattr__`` binds
    its lazy exports from."""
    return any((name in sub.members and not sub.members[name].is_alias) or _defined_below(sub, name)
               for sub in module.modules.values())


def on_page_markdown(markdown: str, page, config, files) -> str:
    for name in sorted(set(_PACKAGE_NAME.findall(markdown))):
        if not names_object(name):
            log.warning(f"{page.file.src_uri}: `{name}` names nothing in the package")
    markdown = fill_cli_help(markdown)

    def relink(match):
        target = _site_link(page, match.group(2))
        return match.group(0) if target is None else match.group(1) + target + match.group(3)

    return _LINK.sub(relink, markdown)


if __name__ == "__main__":  # rewrite the committed --help texts of docs/reference/cli.md
    text = CLI_REFERENCE.read_text()
    updated = fill_cli_help(text)
    if updated != text:
        CLI_REFERENCE.write_text(updated)
    print(f"{CLI_REFERENCE.relative_to(REPO)}: {'updated' if updated != text else 'up to date'}")
