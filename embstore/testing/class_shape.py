"""How the project's classes are assembled, measured with :mod:`ast` (nothing is imported).

- **borrowed private names**: ``self._x`` a class reads without it, or any project class it
  derives from, defining ``_x`` (assigning ``self._x``, or a method, property or class
  attribute of that name). A class that borrows needs a host to be mixed into: such a class
  used as a base of another is counted as a **mixin**.
- **a class with its bases**: the lines of a class plus those of every project class it
  derives from, which is what a reader opens to know what ``self`` is.
- **owner-passing functions**: module-level functions that take an object as their first
  parameter and reach into its state as a method would (read a private name of it, or assign
  an attribute of it); every attribute access on that parameter in such a function counts.

``python -m embstore.testing.architecture`` prints these figures beside the import measures;
``tests/project/test_architecture.py`` holds the package to ceilings on them.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from .source import Module, resolve_from


@dataclass
class ClassInfo:
    """One class of the project."""

    qualname: str
    module: str
    lines: int
    bases: list[str] = field(default_factory=list)   # project classes only
    foreign_base: bool = False  # derives from a class outside the project (names may come from it)
    defines: set[str] = field(default_factory=set)
    uses: set[str] = field(default_factory=set)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _self_attr(node: ast.AST) -> str | None:
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls") and _private(node.attr)):
        return node.attr
    return None


def _class_info(mod: Module, node: ast.ClassDef) -> ClassInfo:
    info = ClassInfo(f"{mod.name}.{node.name}", mod.name,
                     (node.end_lineno or node.lineno) - node.lineno + 1)
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            info.defines.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                if isinstance(t, ast.Name):
                    info.defines.add(t.id)
                    if t.id == "__slots__" and isinstance(stmt.value, (ast.Tuple, ast.List)):
                        info.defines.update(e.value for e in stmt.value.elts
                                            if isinstance(e, ast.Constant)
                                            and isinstance(e.value, str))
        elif (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
              and stmt.value is not None):
            # a bare annotation (``_backend: Backend``) declares a name the host provides: a
            # mixin's way of borrowing it, not a definition
            info.defines.add(stmt.target.id)
    for sub in ast.walk(node):
        if isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    name = _self_attr(el)
                    if name:
                        info.defines.add(name)
        name = _self_attr(sub)
        if name:
            info.uses.add(name)
    return info


def _names_in_scope(mod: Module, modules: dict[str, Module]) -> dict[str, str]:
    """Names bound at module level to a project class: local name -> ``module.Class``."""
    scope: dict[str, str] = {}
    for stmt in mod.tree.body:
        if isinstance(stmt, ast.ClassDef):
            scope[stmt.name] = f"{mod.name}.{stmt.name}"
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.ImportFrom):
            base = resolve_from(mod, node)
            if base in modules:
                for alias in node.names:
                    scope.setdefault(alias.asname or alias.name, f"{base}.{alias.name}")
    return scope


def classes(modules: dict[str, Module]) -> dict[str, ClassInfo]:
    """Every class of the project (nested ones included), its project bases resolved."""
    found: dict[str, ClassInfo] = {}
    n_bases: dict[str, int] = {}
    pending: list[tuple[ClassInfo, list[str], dict[str, str]]] = []
    for mod in modules.values():
        scope = _names_in_scope(mod, modules)
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ClassDef):
                info = _class_info(mod, node)
                found.setdefault(info.qualname, info)
                pending.append((info, [b.id for b in node.bases if isinstance(b, ast.Name)],
                                scope))
                # bases written as attributes or subscripts (abc.ABC, Generic[T]) are foreign
                # unless neutral
                n_bases[info.qualname] = len([b for b in node.bases if isinstance(b, ast.Name)
                                             or not _neutral_expr(b)])
    for info, base_names, scope in pending:
        for name in base_names:
            target = scope.get(name)
            # re-exports: follow a package's import of the class to where it is defined
            for _ in range(5):
                if target is None or target in found:
                    break
                mod_name, _, cls = target.rpartition(".")
                target = (_names_in_scope(modules[mod_name], modules).get(cls)
                          if mod_name in modules else None)
            if target in found and target != info.qualname:
                info.bases.append(target)
            elif name not in _NEUTRAL_BASES:
                info.foreign_base = True
        info.foreign_base |= len(base_names) < n_bases[info.qualname]
    return found


_NEUTRAL_BASES = frozenset({"object", "ABC", "Protocol", "Generic", "NamedTuple", "Exception",
                            "ValueError", "TypeError", "RuntimeError", "OSError", "Enum"})


def _neutral_expr(node: ast.expr) -> bool:
    """``abc.ABC``, ``typing.Protocol``, ``Generic[T]``, ``Protocol[T]``: bases that give a
    class no private state."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr in _NEUTRAL_BASES
    return isinstance(node, ast.Name) and node.id in _NEUTRAL_BASES


def ancestors(info: ClassInfo, table: dict[str, ClassInfo]) -> list[ClassInfo]:
    """The project classes ``info`` derives from, each once."""
    seen: dict[str, ClassInfo] = {}
    stack = list(info.bases)
    while stack:
        q = stack.pop()
        if q not in seen and q in table:
            seen[q] = table[q]
            stack.extend(table[q].bases)
    return list(seen.values())


def borrowed(table: dict[str, ClassInfo]) -> dict[str, set[str]]:
    """Per class, the private names it reads that neither it nor its project bases define."""
    out: dict[str, set[str]] = {}
    for q, info in table.items():
        if info.foreign_base or any(a.foreign_base for a in ancestors(info, table)):
            continue
        defined = set(info.defines)
        for a in ancestors(info, table):
            defined |= a.defines
        missing = info.uses - defined
        if missing:
            out[q] = missing
    return out


def mixins(table: dict[str, ClassInfo]) -> dict[str, set[str]]:
    """Classes that borrow private names and are bases of another project class."""
    used_as_base = {b for info in table.values() for b in info.bases}
    return {q: names for q, names in borrowed(table).items() if q in used_as_base}


def with_bases(table: dict[str, ClassInfo]) -> list[tuple[str, int]]:
    """Every class's lines together with its project bases', largest first."""
    sizes = [(q, info.lines + sum(a.lines for a in ancestors(info, table)))
             for q, info in table.items()]
    return sorted(sizes, key=lambda x: -x[1])


@dataclass(frozen=True)
class OwnerPassing:
    """A module-level function that reaches into the object it is handed first."""

    module: str
    function: str
    parameter: str
    accesses: int


def owner_passing(modules: dict[str, Module]) -> list[OwnerPassing]:
    """Module-level functions that treat their first parameter's state as their own."""
    found: list[OwnerPassing] = []
    for mod in modules.values():
        for fn in mod.tree.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = fn.args.posonlyargs + fn.args.args
            if not params:
                continue
            owner = params[0].arg
            accesses = 0
            reaches_in = False
            for node in ast.walk(fn):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id == owner):
                    accesses += 1
                    if _private(node.attr) or isinstance(node.ctx, ast.Store):
                        reaches_in = True
            if reaches_in:
                found.append(OwnerPassing(mod.name, fn.name, owner, accesses))
    return found


def report_lines(modules: dict[str, Module]) -> list[str]:
    """The figures, one per line, for :func:`embstore.testing.architecture.report`."""
    table = classes(modules)
    mix = mixins(table)
    borrowed_names = sum(len(v) for v in mix.values())
    largest = with_bases(table)[:1]
    passing = owner_passing(modules)
    return [
        f"mixins: {len(mix)}  borrowed private names: {borrowed_names}",
        *(f"  mixin {q}: {' '.join(sorted(v))}" for q, v in sorted(mix.items())),
        f"largest class with its bases: {largest[0][0]} {largest[0][1]} lines" if largest
        else "largest class with its bases: none",
        f"owner-passing functions: {len(passing)}  accesses: "
        f"{sum(p.accesses for p in passing)}",
    ]
