"""A griffe extension (``mkdocs.yml``: mkdocstrings' ``extensions``) that checks every docstring of the package and
prepares it for the API reference.

Once the package is loaded, every docstring of every object (rendered in the site or not) is read:

* Sphinx-style references (``:func:`~.cache.make_favor_cache```, ``:data:`LINEARIZE_FILE```, ...) must name an
  object of the package, and are rewritten as inline code (the last component with ``~``, as Sphinx shows it).
  A reference resolves in the object's own scopes outward, as an absolute name, or (as Sphinx does for a leading
  dot) as the end of any object's name: so references to names imported inside functions, or to inherited members,
  count.
* The parameters an ``Args:`` section documents must be parameters of the function (of ``__init__`` or
  ``__post_init__``, or attributes, for a class). One entry may document several parameters (``key, value: ...``,
  as the package writes them); it is split into one entry each for the page.

A failed check is logged as a warning, which fails ``mkdocs build --strict``: a renamed or deleted function cannot
stay quoted in a docstring, nor a removed parameter stay documented.
"""

from __future__ import annotations

import logging
import re

import griffe

log = logging.getLogger("mkdocs.plugins.hf_performer_docstrings")

ROLE = re.compile(r":(?:py:)?(?:func|class|data|meth|mod|attr|exc|obj|const):`([^`]+)`")
EXTERNAL_PACKAGES = ("torch", "transformers", "accelerate", "peft", "datasets", "evaluate", "huggingface_hub",
                     "safetensors", "numpy", "argparse", "json", "os", "typing")
ARGS_HEADING = re.compile(r"^(\s*)(Args|Arguments|Parameters):\s*$")
# An entry naming several parameters: "    key, value: text" or "    key, value (`int`): text".
SEVERAL_NAMES = re.compile(r"^(\s+)(\*{0,2}\w+(?:,\s*\*{0,2}\w+)+)(\s*\([^)]*\))?:(.*)$")
ENTRY = re.compile(r"^(\s+)(\*{0,2}\w+)(?:\s*\([^)]*\))?:")


def _objects(node):
    """``node`` and every object below it; imported names (aliases) are listed but not entered."""
    yield node
    for member in node.members.values():
        if member.is_alias:
            yield member
        else:
            yield from _objects(member)


def split_entries(docstring: str) -> str:
    """``docstring`` with every ``Args:`` entry that names several parameters written as one entry per name (the
    same text under each)."""
    lines = docstring.split("\n")
    out, index, section_indent = [], 0, None
    while index < len(lines):
        line = lines[index]
        heading = ARGS_HEADING.match(line)
        if heading:
            section_indent = len(heading.group(1))
        elif line.strip() and section_indent is not None and len(line) - len(line.lstrip()) <= section_indent:
            section_indent = None  # the section ended
        several = SEVERAL_NAMES.match(line) if section_indent is not None else None
        if not several:
            out.append(line)
            index += 1
            continue
        indent = several.group(1)
        body = [several.group(4)]
        index += 1
        while index < len(lines) and (not lines[index].strip() or
                                      len(lines[index]) - len(lines[index].lstrip()) > len(indent)):
            body.append("\n" + lines[index])
            index += 1
        for name in re.split(r",\s*", several.group(2)):
            out.append(f"{indent}{name}{several.group(3) or ''}:{''.join(body)}")
    return "\n".join(out)


def documented_parameters(docstring: str) -> list[str]:
    """The names the ``Args:`` sections of ``docstring`` document (after :func:`split_entries`)."""
    names, section_indent, entry_indent = [], None, None
    for line in docstring.split("\n"):
        heading = ARGS_HEADING.match(line)
        if heading:
            section_indent, entry_indent = len(heading.group(1)), None
            continue
        if section_indent is None or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= section_indent:
            section_indent = None
            continue
        entry = ENTRY.match(line)
        if entry and (entry_indent is None or indent == entry_indent):
            entry_indent = indent
            names.append(entry.group(2).lstrip("*"))
    return names


def _parameter_names(function) -> set[str]:
    return {parameter.name for parameter in function.parameters}


def accepted_parameters(obj) -> set[str] | None:
    """The names an ``Args:`` section of ``obj`` may document, or ``None`` when they cannot be known statically."""
    if obj.is_function:
        return _parameter_names(obj)
    if obj.is_class:
        names = set(obj.members)
        for method in ("__init__", "__post_init__"):
            member = obj.members.get(method)
            if member is not None and member.is_function:
                names |= _parameter_names(member)
        return names
    return None


class DocstringChecks(griffe.Extension):
    """Check the references and documented parameters of every docstring of the loaded package (see the module)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        objects = list(_objects(pkg))
        paths = {obj.path for obj in objects}
        exported = set(pkg.exports or ())
        for obj in objects:
            if obj.is_alias or obj.docstring is None:
                continue
            where = f"{obj.relative_filepath}:{obj.docstring.lineno}: docstring of {obj.path}"
            for target in ROLE.findall(obj.docstring.value):
                if not self._resolves(obj, target, paths, exported):
                    log.warning(f"{where} refers to {target!r}, which names nothing in the package")
            text = split_entries(ROLE.sub(self._as_code, obj.docstring.value))
            accepted = accepted_parameters(obj)
            if accepted is not None:
                for name in documented_parameters(text):
                    if name not in accepted:
                        log.warning(f"{where} documents a parameter {name!r} it does not have")
            obj.docstring.value = text

    @staticmethod
    def _as_code(match: re.Match) -> str:
        target = match.group(1)
        if target.startswith("~"):
            target = target.lstrip("~.").rsplit(".", 1)[-1]
        return f"`{target}`"

    @staticmethod
    def _resolves(obj, target: str, paths: set, exported: set) -> bool:
        name = target.lstrip("~").split("(")[0].strip().lstrip(".")
        if name.split(".")[0] in EXTERNAL_PACKAGES:
            return True
        if name.startswith("hf_performer.") and name.split(".")[1] in exported:
            name = name.split(".", 1)[1]  # a public name bound lazily by hf_performer/__init__.py
        scope = obj
        while scope is not None:
            if f"{scope.path}.{name}" in paths:
                return True
            scope = scope.parent
        return name in paths or any(path.endswith("." + name) for path in paths)
