"""The package's structure, measured with ``ast`` (``embstore.testing.architecture``)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from embstore.testing import architecture as arch
from embstore.testing import class_shape as shape
from tests.paths import REPO_ROOT


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "embstore" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return root


def test_scanner_sees_a_cycle_through_a_function_level_import(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "a.py": "from . import b\n",
        "b.py": "def f():\n    from .a import x\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",
    })
    modules = arch.load_modules(root)
    assert arch.import_cycles(modules) == [["embstore.a", "embstore.b"]]
    assert [(i.importer, i.target) for i in arch.function_level_imports(modules)] == [
        ("embstore.b", "embstore.a")]


def test_scanner_counts_private_reaches(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "_hidden.py": "def _f(): pass\n",
        "pub/__init__.py": "",
        "pub/m.py": """
            from .._hidden import _f      # a private name of another module
            class A:
                def g(self, other):
                    self._x = other._y    # other._y counts, self._x does not
                    return super()._z, type(self)._w, other._replace()
        """,
    })
    modules = arch.load_modules(root)
    texts = sorted(r.text for r in arch.private_reaches(modules))
    assert texts == ["from embstore._hidden import _f", "other._y"]
    assert arch.top_level_private_modules(root) == ["_hidden"]


def test_scanner_sees_mixins_borrowed_names_class_sizes_and_owner_passing(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "base.py": """
            class Base:
                def __init__(self):
                    self._own = 1
        """,
        "mix.py": """
            from .base import Base
            class Reads:
                _declared: int            # a bare annotation borrows, it does not define
                def f(self):
                    return self._host_thing + self._declared
            class Host(Reads, Base):
                _declared = 3
                def __init__(self):
                    super().__init__()
                    self._host_thing = 2
                def g(self):
                    return self._own
            class Torchy(Foreign):        # a foreign base may hold any private name
                def h(self):
                    return self._parameters
            def poke(owner, x):
                owner._state = x          # reaches in: both accesses on owner count
                return owner.public
            def use(store, x):
                return store.lookup(x)    # public use only: not owner-passing
        """,
    })
    modules = arch.load_modules(root)
    table = shape.classes(modules)
    assert table["embstore.mix.Host"].bases == ["embstore.mix.Reads", "embstore.base.Base"]
    assert shape.mixins(table) == {"embstore.mix.Reads": {"_host_thing", "_declared"}}
    sizes = dict(shape.with_bases(table))
    assert sizes["embstore.mix.Host"] == (sizes["embstore.mix.Reads"]
                                          + sizes["embstore.base.Base"] + 7)
    assert [(p.function, p.accesses) for p in shape.owner_passing(modules)] == [("poke", 2)]


def test_scanner_sees_a_cycle_through_type_checking_imports_when_asked(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "a.py": "from . import b\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",
    })
    modules = arch.load_modules(root)
    assert arch.import_cycles(modules) == []
    assert arch.import_cycles(modules, type_checking=True) == [["embstore.a", "embstore.b"]]


def test_classes_are_composed_of_owned_parts():
    """No class is assembled from mixins that use its host's private names, no module-level
    function reaches into the object it is handed, and no class with its project bases is
    over 500 lines (docs/architecture.md): what a class is can be read in one place."""
    modules = arch.load_modules()
    table = shape.classes(modules)
    assert shape.mixins(table) == {}
    assert shape.borrowed(table) == {}
    biggest = shape.with_bases(table)[:3]
    assert biggest[0][1] <= 500, biggest
    assert shape.owner_passing(modules) == []
    assert arch.import_cycles(modules, type_checking=True) == []


def test_no_import_cycles_among_the_packages_modules():
    modules = arch.load_modules()
    assert arch.import_cycles(modules) == []


def test_function_level_imports_only_defer_a_heavy_dependency_and_say_so():
    # the line above each one says why it is deferred ("# deferred: <dependency> ...")
    found = arch.function_level_imports(arch.load_modules())
    unexplained = [f"{i.importer}:{i.lineno}" for i in found
                   if not i.comment.startswith("# deferred:")]
    assert unexplained == []
    # statements (one deferred import of a.b.c also counts its packages as imports):
    # pyarrow for Parquet files (2), for des:// clients and for `embstore serve` (1 each)
    assert len({(i.importer, i.lineno) for i in found}) <= 4


def test_codecs_know_no_store_and_the_engine_imports_no_layer_above_it():
    imports = arch.imports(arch.load_modules())
    above_engine = ("embstore.api", "embstore.transfer", "embstore.cli", "embstore_torch",
                    "embstore_tf")
    for imp in imports:
        if imp.importer.startswith("embstore.io."):
            assert not imp.target.startswith(("embstore.store", "embstore.engine",
                                              "embstore.transfer", "embstore.api")), imp
        if imp.importer.startswith(("embstore.store", "embstore.engine", "embstore.backends",
                                    "embstore.layers", "embstore._cython")):
            assert not imp.target.startswith(above_engine), imp


def test_no_private_name_reaches_into_other_objects_or_modules():
    reaches = arch.private_reaches(arch.load_modules())
    assert reaches == [], "\n".join(f"{r.module}:{r.lineno} {r.text}" for r in reaches)


def test_modules_stay_small():
    too_long = arch.longest_modules(arch.load_modules(), 530)
    assert too_long == []


def test_the_documented_backend_flags_are_the_declared_ones():
    """docs/architecture.md holds the one description of the backend contract: its flag table
    names exactly the capability flags ``Backend`` declares, with their defaults."""
    import re

    from embstore.backends.base import Backend

    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    table = text.split("<!-- backend-flags -->")[1].split("<!-- /backend-flags -->")[0]
    documented = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, flags=re.M))
    declared = {name: getattr(Backend, name) for name in Backend.__annotations__
                # key_type, fence and layout are state set on an instance, not capabilities
                if not name.startswith("_") and name not in ("key_type", "fence", "layout")}
    assert set(documented) == set(declared)
    for name, default in documented.items():
        assert default == repr(declared[name]).replace("'", '"'), name


# An optional driver (an extra of pyproject.toml, or an engine a recipe runs on) -> the modules
# that may import it when they are imported: the backend, codec or adapter it serves. Anything
# else imports it inside the function that needs it, so `import embstore` and memory:// run on
# numpy + tqdm alone (tests/project/test_bare_install.py runs that with the drivers made
# unimportable).
_DRIVER_HOMES = {
    "lmdb": ("embstore.backends.lmdb", "embstore.backends.lmdb_env"),
    "rocksdict": ("embstore.backends.rocksdb", "embstore.backends.rocksdb_handles"),
    "sqlalchemy": ("embstore.backends.sql",),
    "psycopg": ("embstore.backends.sql",),
    "psycopg2": ("embstore.backends.sql",),
    "google": ("embstore.backends.bigtable", "embstore.testing.bigtable_emulator"),
    "grpc": ("embstore.backends.bigtable", "embstore.testing.bigtable_emulator"),
    "pyarrow": ("embstore.io.parquet", "embstore.service"),
    "pybloom_live": (),
    "usearch": ("embstore.service.ann",),
    "torch": ("embstore_torch",),
    "tensorflow": ("embstore_tf",),
    "keras": ("embstore_tf",),
    "tf_keras": ("embstore_tf",),
    "dask": (),
    "distributed": (),
    "apache_beam": (),
    "ray": (),
}


def _at_home(module: str, homes: tuple[str, ...]) -> bool:
    return any(module == h or module.startswith(h + ".") for h in homes)


def test_optional_drivers_are_imported_only_by_the_modules_they_serve():
    deps = arch.module_level_dependencies(arch.load_modules())
    strays = sorted(f"{module} imports {driver}" for module, found in deps.items()
                    for driver in found & set(_DRIVER_HOMES)
                    if not _at_home(module, _DRIVER_HOMES[driver]))
    assert strays == [], ("import the driver inside the function that needs it (or, for a new "
                          "driver module, add it to _DRIVER_HOMES)")
    assert "lmdb" not in deps["embstore"] and "pyarrow" not in deps["embstore.cli"]


def test_the_driver_scan_follows_imports_through_project_modules(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "from . import core\n",
        "core.py": "from .base import X\n",
        "base.py": "from .drv import Y\n\ndef f():\n    import torch\n",
        "drv.py": "try:\n    import lmdb\nexcept ImportError:\n    lmdb = None\nY = 1\n",
    })
    deps = arch.module_level_dependencies(arch.load_modules(root))
    assert deps["embstore"] >= {"lmdb"} and deps["embstore.core"] >= {"lmdb"}
    assert "torch" not in deps["embstore.base"]  # function level: runs only when called
