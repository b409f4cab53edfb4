"""The project's source files, parsed with :mod:`ast` (nothing is imported): what the
structure measures of :mod:`embstore.testing.architecture` and
:mod:`embstore.testing.class_shape` read."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

#: Project packages and the folder each lives in, relative to the repository root.
PACKAGES = {
    "embstore": "embstore",
    "embstore_torch": "adapters/torch/embstore_torch",
    "embstore_tf": "adapters/tf/embstore_tf",
}

@dataclass
class Module:
    """One source file of the project."""

    name: str
    path: Path
    is_package: bool
    tree: ast.Module = field(repr=False)

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


def repo_root() -> Path:
    """The repository root (the folder holding ``embstore/``)."""
    return Path(__file__).resolve().parents[2]


def load_modules(root: Path | None = None) -> dict[str, Module]:
    """Parse every ``.py`` file of the project packages."""
    root = root or repo_root()
    modules: dict[str, Module] = {}
    for pkg, folder in PACKAGES.items():
        base = root / folder
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [pkg, *rel.parts]
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join(parts)
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            modules[name] = Module(name, path, is_package, tree)
    return modules



def resolve_from(module: Module, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.package.split(".")
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])
