"""The layout rules of ``shared/docs/architecture.md``, checked statically on the source (nothing is imported).

The imports of every module of the installed packages (the folders with an ``__init__.py`` under
``hf_performer/``, ``conversion/``, ``recipes/``, named as pyproject's ``package-dir`` installs them) are read with
:mod:`ast`, at every level: module level, and inside functions (lazy imports, which keep ``--help`` fast), but not
under ``if TYPE_CHECKING:`` (annotations only, never run). The rules:

1. No import cycle among the modules' **module-level** imports: such a cycle breaks depending on which module is
   imported first. A cycle closed by a function-level import is legal Python (the lazy import runs after both
   modules loaded), but still a sign of a missing floor, so it is checked too: every such cycle must go through an
   import of :data:`ALLOWED_LAZY_CYCLE_IMPORTS` or :data:`ALLOWED_UPWARD`, today's known offenders.
2. A runtime module (the flat files at the root of ``hf_performer/`` that ship beside the weights) imports only
   torch, transformers, the standard library and single-dot siblings: transformers copies a saved model's code by
   following ``from .name import`` to sibling files, so anything else is missing where the model is loaded.
3. argparse is imported only by ``hf_performer.cli`` (and its modules) and ``hf_performer.recipes.arguments``.
4. No module is over :data:`MAX_LINES` lines, and no runtime module over :data:`RUNTIME_MAX_LINES` (a runtime file
   holds one concept: split a longer one by concept, as docs/concepts says where each lives).
5. Every package folder is listed in pyproject's ``packages``: otherwise a wheel (``pip install .``) misses it.
6. Subpackages import each other downward only: tasks < conversion < hub < cli; bench < cli;
   tasks, conversion < recipes < cli (a layer that does not exist yet is skipped).

The allow-lists name today's offenders, each with the step of issue 14 that removes it; an entry that no longer
offends fails :func:`test_allow_lists_name_only_current_offenders`, so that the step that fixes it deletes it.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "hf_performer"

# The runtime that ships with the weights: flat files at the root of hf_performer/ (those present are checked).
RUNTIME_MODULES = ("favor_schema", "feature_maps", "linear_attention", "linear_attention_autograd", "window_attention",
                   "clustered_attention", "reference", "favor_settings", "cache", "attention_weights",
                   "packed_sequences", "configuration_performer", "favor_attention", "modeling_performer",
                   "window_tail", "window_segments", "window_state", "window_sparse_cache", "window_causal",
                   "window_decode", "window_blocks", "window_exact_blocks", "window_tail_cap", "favor_masks",
                   "favor_modules", "favor_layer_modules", "favor_cache_hooks", "decayed_attention",
                   "linear_attention_parallel", "window_selection_kernel", "window_parallel", "window_bidirectional",
                   "feature_map_base", "modeling_performer_base", "source_architectures", "favor_cache_layer",
                   "window_cache_layer", "feature_maps_learned", "window_block_operands", "linear_attention_chunks",
                   "window_boundaries")
RUNTIME_THIRD_PARTY = ("torch", "transformers")
ALLOWED_RUNTIME_IMPORTS = {
    ("hf_performer.window_selection_kernel", "triton"):
        "the selection kernel, imported under try: without Triton the boundary loop serves (a CUDA install has it)",
    ("hf_performer.window_selection_kernel", "triton.language"): "the same kernel's language module, under try",
    ("hf_performer.configuration_performer", "huggingface_hub.dataclasses"):
        "@strict, as transformers' own configurations use it (huggingface_hub is installed with transformers)",
}

# Modules allowed to import argparse: the command line and the recipes' argument module.
ARGPARSE_HOMES = ("hf_performer.cli", "hf_performer.recipes.arguments")
ALLOWED_ARGPARSE: dict[str, str] = {}

MAX_LINES = 800
RUNTIME_MAX_LINES = 500
ALLOWED_LONG_MODULES: dict[str, str] = {}

# Function-level imports that close a cycle, as (importing module, imported module).
ALLOWED_LAZY_CYCLE_IMPORTS: dict[tuple[str, str], str] = {}

# Layers of subpackages (a root module of the same name counts: hub.py is the hub layer until hub/ exists), and the
# layers each may import (besides the runtime and itself).
LAYER_IMPORTS = {
    "tasks": set(),
    "conversion": {"tasks"},
    "hub": {"tasks", "conversion"},
    "bench": set(),
    "recipes": {"tasks", "conversion", "hub", "bench"},  # a run writes its model card and records the machine
    "cli": {"tasks", "conversion", "hub", "bench", "recipes"},
}
# Upward imports as (importing module, imported module).
ALLOWED_UPWARD = {
    ("hf_performer.recipes.arguments", "hf_performer.cli.arguments"):
        "the favor flags are declared once, in cli/arguments.py (a leaf: argparse and the runtime only)",
    ("hf_performer.tasks.evaluation", "hf_performer.conversion.fidelity"):
        "check_head_was_trained refuses a converted folder whose new head was never trained: it reads the "
        "conversion report, whose name its writer declares (lazy import)",
    ("hf_performer.hub.card", "hf_performer.recipes.results"):
        "the card reads a recipe's metrics.json, whose name its writer declares (lazy import)",
    ("hf_performer.hub.card", "hf_performer.recipes.linearize"):
        "the card reads linearize.json, whose name its writer declares (lazy import)",
    ("hf_performer.hub.results", "hf_performer.recipes.results"):
        "the card reads a recipe's metrics.json, whose name its writer declares (lazy import)",
    ("hf_performer.hub.results", "hf_performer.recipes.arguments"):
        "the recipe kinds of a metrics.json, declared by the recipes (lazy import)",
}


# --------------------------------------------------------------------------------------------
# Reading the source
# --------------------------------------------------------------------------------------------


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def package_folders() -> dict[str, Path]:
    """Installed package name -> its folder, for every folder with an ``__init__.py`` under the package roots
    (``hf_performer/`` and the folders pyproject's ``package-dir`` installs inside it, such as ``conversion/``)."""
    roots = {PACKAGE: ROOT / PACKAGE}
    roots.update({name: ROOT / folder for name, folder in _setuptools().get("package-dir", {}).items()})
    for folder in ("conversion", "recipes"):  # a package there that pyproject does not map is named by its folder
        if (ROOT / folder / "__init__.py").is_file() and ROOT / folder not in roots.values():
            roots[folder] = ROOT / folder
    packages = {}
    for root_name, root in roots.items():
        for init in sorted(root.rglob("__init__.py")):
            relative = init.parent.relative_to(root).parts
            packages[".".join((root_name, *relative))] = init.parent
    return packages


@dataclass(frozen=True)
class Import:
    target: str  # absolute dotted name, as written (a module, or a package whose attribute is imported)
    names: tuple[str, ...]  # for `from target import a, b`: a, b (they may be submodules)
    level: int  # leading dots of a relative import (0: absolute)
    lineno: int
    in_function: bool


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[Import]:
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for branch in child.orelse:
                    visit(ast.Module(body=[branch], type_ignores=[]), in_function)
                continue
            if isinstance(child, ast.Import):
                found.extend(Import(alias.name, (), 0, child.lineno, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".")
                    base = base[:len(base) - child.level + (1 if is_package else 0)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module
                found.append(Import(target, tuple(alias.name for alias in child.names), child.level, child.lineno,
                                    in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


@dataclass
class Module:
    name: str
    path: Path
    lines: int
    imports: list[Import]


def read_modules() -> dict[str, Module]:
    modules = {}
    for package, folder in package_folders().items():
        for path in sorted(folder.glob("*.py")):
            is_package = path.name == "__init__.py"
            name = package if is_package else f"{package}.{path.stem}"
            source = path.read_text(encoding="utf-8")
            modules[name] = Module(name, path, source.count("\n"),
                                   _imports(ast.parse(source, str(path)), name, is_package))
    return modules


MODULES = read_modules()


def imported_modules(found: Import) -> list[str]:
    """The package modules an import loads: ``from package import submodule`` names the submodule."""
    targets = [f"{found.target}.{name}" for name in found.names if f"{found.target}.{name}" in MODULES]
    if len(targets) < len(found.names) or not found.names:
        targets.append(found.target)
    return [target for target in targets if target in MODULES]


def import_graph(include_function_level: bool) -> dict[str, set[str]]:
    return {name: {target for found in module.imports if include_function_level or not found.in_function
                   for target in imported_modules(found) if target != name}
            for name, module in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted tuple."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(tuple(sorted(component)))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def layer_of(module: str) -> str | None:
    """``hf_performer.<layer>...`` -> layer, for the layers of :data:`LAYER_IMPORTS` (others: None)."""
    parts = module.split(".")
    return parts[1] if parts[0] == PACKAGE and len(parts) > 1 and parts[1] in LAYER_IMPORTS else None


# --------------------------------------------------------------------------------------------
# The rules
# --------------------------------------------------------------------------------------------


def test_the_source_is_found():
    assert {"hf_performer", "hf_performer.tasks.evaluation", "hf_performer.conversion.convert"} <= set(MODULES)


def test_no_import_cycle_at_module_level():
    assert cycles(import_graph(include_function_level=False)) == []


def function_level_imports() -> set[tuple[str, str]]:
    return {(name, target) for name, module in MODULES.items() for found in module.imports if found.in_function
            for target in imported_modules(found)}


def test_no_import_cycle_through_function_level_imports():
    graph = import_graph(include_function_level=True)
    for importer, imported in set(ALLOWED_LAZY_CYCLE_IMPORTS) | set(ALLOWED_UPWARD):
        graph[importer].discard(imported)
    assert cycles(graph) == []


def test_imports_are_read_at_every_level_but_type_checking():
    source = ("from ..tasks import data\nimport argparse\nif TYPE_CHECKING:\n    import torch\n"
              "def f():\n    from .cache import FavorCacheLayer\n")
    read = _imports(ast.parse(source), "hf_performer.a.b", is_package=False)
    found = [(i.target, i.names, i.level, i.in_function) for i in read]
    assert found == [("hf_performer.tasks", ("data",), 2, False), ("argparse", (), 0, False),
                     ("hf_performer.a.cache", ("FavorCacheLayer",), 1, True)]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]


def runtime_violations() -> list[str]:
    violations = []
    standard_library = sys.stdlib_module_names
    for short_name in RUNTIME_MODULES:
        module = MODULES.get(f"{PACKAGE}.{short_name}")
        if module is None:  # not in this tree (yet)
            continue
        for found in module.imports:
            top = found.target.split(".")[0]
            if found.level == 1:
                sibling_modules = [f"{PACKAGE}.{name}" for name in found.names] if found.target == PACKAGE else \
                    [found.target]
                if all(name.removeprefix(f"{PACKAGE}.") in RUNTIME_MODULES for name in sibling_modules):
                    continue
            elif found.level == 0 and (top in RUNTIME_THIRD_PARTY or top in standard_library
                                       or (module.name, found.target) in ALLOWED_RUNTIME_IMPORTS):
                continue
            names = f" ({', '.join(found.names)})" if found.names else ""
            violations.append(f"{module.path.relative_to(ROOT)}:{found.lineno}: imports {found.target}{names}")
    return violations


def test_runtime_imports_only_torch_transformers_stdlib_and_runtime_siblings():
    assert runtime_violations() == []


def argparse_users() -> set[str]:
    return {name for name, module in MODULES.items()
            if any(found.target == "argparse" for found in module.imports)
            and not any(name == home or name.startswith(home + ".") for home in ARGPARSE_HOMES)}


def test_argparse_only_in_the_command_line():
    assert sorted(argparse_users() - set(ALLOWED_ARGPARSE)) == []


def long_modules() -> set[str]:
    return {name for name, module in MODULES.items()
            if module.lines > (RUNTIME_MAX_LINES if _is_runtime(name) else MAX_LINES)}


def _is_runtime(name: str) -> bool:
    return name.count(".") == 1 and name.split(".")[1] in RUNTIME_MODULES


def test_no_module_over_the_line_limit():
    assert {name: MODULES[name].lines for name in sorted(long_modules() - set(ALLOWED_LONG_MODULES))} == {}


def test_every_package_folder_is_installed():
    listed = set(_setuptools()["packages"])
    missing = {name: str(folder.relative_to(ROOT)) for name, folder in package_folders().items()
               if name not in listed}
    assert missing == {}, "add them to [tool.setuptools] packages (and package-dir) in pyproject.toml"


def upward_imports() -> set[tuple[str, str]]:
    found = set()
    for name, module in MODULES.items():
        layer = layer_of(name)
        if layer is None:
            continue
        for statement in module.imports:
            for target in imported_modules(statement):
                target_layer = layer_of(target)
                if target_layer not in (None, layer) and target_layer not in LAYER_IMPORTS[layer]:
                    found.add((name, target))
    return found


def test_subpackages_import_only_downward():
    assert sorted(upward_imports() - set(ALLOWED_UPWARD)) == []


def test_runtime_imports_no_subpackage_nor_other_package_module():
    """Also the runtime's own floor: no runtime module imports a non-runtime module of the package."""
    runtime = {f"{PACKAGE}.{name}" for name in RUNTIME_MODULES}
    offending = {(name, target) for name in runtime & set(MODULES) for found in MODULES[name].imports
                 for target in imported_modules(found) if target not in runtime}
    assert offending == set()


@pytest.mark.parametrize("allow_list,current", [
    ("ALLOWED_ARGPARSE", argparse_users),
    ("ALLOWED_LONG_MODULES", long_modules),
    ("ALLOWED_LAZY_CYCLE_IMPORTS", function_level_imports),
    ("ALLOWED_RUNTIME_IMPORTS", lambda: {(name, found.target) for name, module in MODULES.items()
                                         for found in module.imports}),
    ("ALLOWED_UPWARD", upward_imports),
])
def test_allow_lists_name_only_current_offenders(allow_list, current):
    stale = sorted(set(globals()[allow_list]) - current())
    assert stale == [], f"no longer offending: delete these entries from {allow_list} in tests/test_layering.py"
