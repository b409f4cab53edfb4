"""The ``.pyi`` stubs of the compiled modules name everything the modules define.

Cython functions carry no signature a type checker can read, so the stubs are all mypy knows
of them: a function or method added to a ``.pyx`` without its stub would be invisible to it.
(``python -m mypy.stubtest embstore._cython.<module>`` compares them in more depth.)
"""

from __future__ import annotations

import ast
import importlib

import pytest

from tests.paths import REPO_ROOT

CYTHON_DIR = REPO_ROOT / "embstore" / "_cython"
MODULES = sorted(p.stem for p in CYTHON_DIR.glob("*.pyx"))
# Cython's own additions to every module and cdef class
_CYTHON_NAMES = {"__test__", "__pyx_capi__", "__reduce_cython__", "__setstate_cython__"}


def _public(names):
    return {n for n in names
            if n not in _CYTHON_NAMES and (not n.startswith("__") or n == "__len__")}


def _stub_names(tree: ast.Module) -> tuple[set[str], dict[str, set[str]]]:
    functions, classes = set(), {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            functions.add(node.name)
        elif isinstance(node, ast.ClassDef):
            members = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
            classes[node.name] = members
    return functions, classes


@pytest.mark.parametrize("name", MODULES)
def test_every_compiled_module_has_a_stub_naming_all_it_defines(name):
    stub = CYTHON_DIR / f"{name}.pyi"
    assert stub.exists(), f"embstore/_cython/{name}.pyx has no {name}.pyi"
    functions, classes = _stub_names(ast.parse(stub.read_text()))
    module = importlib.import_module(f"embstore._cython.{name}")
    for attr in _public(vars(module)):
        value = getattr(module, attr)
        if isinstance(value, type) and value.__module__ == module.__name__:
            assert attr in classes, f"{name}.pyi lacks class {attr}"
            own = _public(n for n in vars(value) if n != "__doc__")
            missing = own - classes[attr] - {"__init__"}
            assert not missing, f"{name}.pyi: {attr} lacks {sorted(missing)}"
        elif callable(value) and getattr(value, "__module__", None) == module.__name__:
            assert attr in functions, f"{name}.pyi lacks function {attr}"
