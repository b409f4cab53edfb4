"""Static measures of the code's structure, computed with :mod:`ast` (nothing is imported).

``tests/project/test_architecture.py`` holds the package to these measures, and
``python -m embstore.testing.architecture`` prints them:

- the import graph among the project's modules (top-level and function-level imports; imports
  under ``if TYPE_CHECKING:`` never run and are left out) and its cycles;
- function-level imports of the project's own modules;
- the outside packages importing a module pulls in (optional drivers belong to their backend);
- private-name reaches: ``obj._name`` where ``obj`` is not ``self``/``cls``/``super()``, and
  ``from m import _name`` or an import of a private module from outside the package that owns it;
- top-level private modules of ``embstore/``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from . import class_shape
from .source import PACKAGES, Module, load_modules, repo_root, resolve_from

__all__ = ["PACKAGES", "Module", "load_modules", "repo_root"]

# Underscore names that are public API of the standard library (namedtuple's methods,
# ``os._exit``; ``sys._getframe``'s cousins are not in this list on purpose).
_PUBLIC_UNDERSCORE = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults",
                                "_exit"})


@dataclass(frozen=True)
class Import:
    """One import of a project module by another."""

    importer: str
    target: str
    lineno: int
    function_level: bool
    comment: str  # the source line above the import (where the reason for deferring is given)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


_ImportNode = ast.Import | ast.ImportFrom


def _walk_imports(tree: ast.AST, type_checking: bool = False
                  ) -> Iterator[tuple[_ImportNode, bool]]:
    """Yield ``(import node, inside a function)``, skipping ``if TYPE_CHECKING:`` bodies
    unless ``type_checking``."""

    def visit(node: ast.AST, in_function: bool) -> Iterator[tuple[_ImportNode, bool]]:
        for child in ast.iter_child_nodes(node):
            if (not type_checking and isinstance(child, ast.If)
                    and _is_type_checking(child.test)):
                for sub in child.orelse:
                    yield from visit(sub, in_function)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function
                continue
            nested = in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from visit(child, nested)

    yield from visit(tree, False)


def imports(modules: dict[str, Module], type_checking: bool = False) -> list[Import]:
    """Every import of a project module by a project module (``TYPE_CHECKING`` ones left out
    unless ``type_checking``: a cycle through them is a design cycle all the same)."""
    lines_of: dict[str, list[str]] = {}
    found: list[Import] = []
    for mod in modules.values():
        for node, in_function in _walk_imports(mod.tree, type_checking):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = resolve_from(mod, node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            src = lines_of.setdefault(mod.name, mod.path.read_text(encoding="utf-8").splitlines())
            above = src[node.lineno - 2].strip() if node.lineno >= 2 else ""
            resolved = []
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                # importing a.b.c runs a/b/__init__ first: the packages on the way count too
                # (those holding the importer itself are already being imported)
                parts = target.split(".")
                for i in range(1, len(parts)):
                    package = ".".join(parts[:i])
                    if package in modules and not _inside(mod.name, package):
                        resolved.append(package)
                resolved.append(target)
            for target in dict.fromkeys(resolved):
                if target and target != mod.name:
                    found.append(Import(mod.name, target, node.lineno, in_function, above))
    return found


def import_cycles(modules: dict[str, Module], type_checking: bool = False) -> list[list[str]]:
    """Strongly connected groups of more than one module in the import graph (Tarjan);
    ``type_checking`` adds the imports made only for type checkers."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for imp in imports(modules, type_checking):
        graph[imp.importer].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = 0

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def strongconnect(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(groups)


def function_level_imports(modules: dict[str, Module]) -> list[Import]:
    """Imports of project modules made inside a function body."""
    return [imp for imp in imports(modules) if imp.function_level]


def module_level_dependencies(modules: dict[str, Module]) -> dict[str, set[str]]:
    """Per project module, the top-level names of the outside packages it imports when it is
    imported: its own module-level imports (``try: import x`` included: with ``x`` installed it
    runs) and those of every project module it imports at module level, transitively."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for imp in imports(modules):
        if not imp.function_level:
            graph[imp.importer].add(imp.target)
    direct: dict[str, set[str]] = {name: set() for name in modules}
    for mod in modules.values():
        for node, in_function in _walk_imports(mod.tree):
            if in_function or (isinstance(node, ast.ImportFrom) and node.level):
                continue
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""])
            direct[mod.name] |= {n.split(".")[0] for n in names
                                 if n.split(".")[0] not in PACKAGES}
    closure: dict[str, set[str]] = {}
    for name in modules:
        seen, todo, deps = {name}, [name], set()
        while todo:
            cur = todo.pop()
            deps |= direct[cur]
            for nxt in graph[cur] - seen:
                seen.add(nxt)
                todo.append(nxt)
        closure[name] = deps
    return closure


def _owner_of_private(name: str) -> str | None:
    """The package that owns the first private component of dotted ``name`` (None: all public)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def _selfish(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id == "super":
            return True
        if node.func.id == "type" and len(node.args) == 1:
            return _selfish(node.args[0])
    return False


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in _PUBLIC_UNDERSCORE


@dataclass(frozen=True)
class Reach:
    """One use of another object's or module's private name."""

    module: str
    lineno: int
    text: str


def private_reaches(modules: dict[str, Module]) -> list[Reach]:
    """Every private-name reach (see the module docstring for what counts)."""
    found: list[Reach] = []
    for mod in modules.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                if not _selfish(node.value):
                    found.append(Reach(mod.name, node.lineno, ast.unparse(node)))
            elif isinstance(node, ast.ImportFrom):
                base = resolve_from(mod, node)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in modules:
                        # a module: private when it is private to a package the importer is outside
                        owner = _owner_of_private(full)
                        if owner is not None and not _inside(mod.name, owner):
                            found.append(Reach(mod.name, node.lineno, f"from {base} import "
                                               f"{alias.name}"))
                    elif _private(alias.name):
                        found.append(Reach(mod.name, node.lineno, f"from {base} import "
                                           f"{alias.name}"))
                    else:
                        owner = _owner_of_private(base)
                        if owner is not None and not _inside(mod.name, owner):
                            found.append(Reach(mod.name, node.lineno, f"from {base} import "
                                               f"{alias.name}"))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    owner = _owner_of_private(alias.name)
                    if owner is not None and not _inside(mod.name, owner):
                        found.append(Reach(mod.name, node.lineno, f"import {alias.name}"))
    return found


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def nonblank_lines(modules: dict[str, Module]) -> int:
    """Non-blank source lines of all the project's modules."""
    total = 0
    for mod in modules.values():
        total += sum(1 for line in mod.path.read_text(encoding="utf-8").splitlines()
                     if line.strip())
    return total


def reaches_per_kloc(modules: dict[str, Module]) -> float:
    """Private-name reaches per 1,000 non-blank lines."""
    return 1000.0 * len(private_reaches(modules)) / max(nonblank_lines(modules), 1)


def top_level_private_modules(root: Path | None = None) -> list[str]:
    """Modules and packages directly in ``embstore/`` whose name starts with ``_``."""
    base = (root or repo_root()) / "embstore"
    names = []
    for entry in sorted(base.iterdir()):
        stem = entry.stem if entry.suffix == ".py" else entry.name
        if entry.suffix not in (".py", "") or not stem.startswith("_") or stem.startswith("__"):
            continue
        if entry.is_dir() and not (entry / "__init__.py").exists():
            continue
        names.append(stem)
    return names


def longest_modules(modules: dict[str, Module], limit: int) -> list[tuple[str, int]]:
    """Modules with more than ``limit`` lines, longest first."""
    sizes = [(m.name, len(m.path.read_text(encoding="utf-8").splitlines()))
             for m in modules.values()]
    return sorted(((n, s) for n, s in sizes if s > limit), key=lambda x: -x[1])


def report(root: Path | None = None) -> str:
    """The figures, one per line."""
    modules = load_modules(root)
    cycles = import_cycles(modules)
    tc_cycles = import_cycles(modules, type_checking=True)
    reaches = private_reaches(modules)
    lines = nonblank_lines(modules)
    out = [
        f"modules: {len(modules)}  non-blank lines: {lines}",
        f"import cycles: {len(cycles)} (modules in them: {sum(len(c) for c in cycles)})",
        *(f"  cycle: {' '.join(c)}" for c in cycles),
        f"import cycles counting TYPE_CHECKING imports: {len(tc_cycles)}",
        *(f"  cycle: {' '.join(c)}" for c in tc_cycles),
        "function-level internal import statements: "
        f"{len({(i.importer, i.lineno) for i in function_level_imports(modules)})}",
        f"private reaches: {len(reaches)}  per 1k lines: {1000.0 * len(reaches) / lines:.2f}",
        f"top-level private modules in embstore/: {top_level_private_modules(root)}",
        f"modules over 500 lines: {longest_modules(modules, 500)}",
        *class_shape.report_lines(modules),
    ]
    return "\n".join(out)


if __name__ == "__main__":
    print(report())
    if "-v" in sys.argv:
        mods = load_modules()
        for imp in function_level_imports(mods):
            print(f"F {imp.importer}:{imp.lineno} -> {imp.target}")
        for r in private_reaches(mods):
            print(f"P {r.module}:{r.lineno} {r.text}")
