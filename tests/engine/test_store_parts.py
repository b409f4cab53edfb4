"""The engine is one package of composed parts (``embstore/store/``), opened only by
``embstore.api``: its shape measured with ``ast``, and the parts working through the store."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import embstore
from embstore.api import open_backend, open_store
from embstore.errors import InvalidInputError, StoreClosedError
from embstore.layers.wrapper import WrapperBackend
from embstore.testing import architecture as arch
from embstore.testing import class_shape as shape
from tests.paths import REPO_ROOT

ENGINE = ("embstore.store", "embstore.engine", "embstore.api")


def _in_engine(name: str) -> bool:
    return name == "embstore.api" or name.startswith(("embstore.store", "embstore.engine"))


def test_the_engine_is_composed_not_mixed():
    """No mixin, no borrowed private name, no private reach and no owner-passing function in
    the engine; every class in it is at most 500 lines with its bases."""
    modules = arch.load_modules()
    table = shape.classes(modules)
    assert {q for q in shape.mixins(table) if _in_engine(q)} == set()
    assert {q: v for q, v in shape.borrowed(table).items() if _in_engine(q)} == {}
    big = [(q, n) for q, n in shape.with_bases(table) if _in_engine(q) and n > 500]
    assert big == []
    assert [r.text for r in arch.private_reaches(modules) if _in_engine(r.module)] == []
    assert [p.function for p in shape.owner_passing(modules) if _in_engine(p.module)] == []
    assert "embstore.store.core.EmbeddingStore" in table
    assert table["embstore.store.core.EmbeddingStore"].bases == []


def test_no_import_cycle_even_through_type_checking_imports_in_the_engine():
    cycles = arch.import_cycles(arch.load_modules(), type_checking=True)
    assert [c for c in cycles if any(_in_engine(m) for m in c)] == []


def test_only_the_api_builds_stores_from_backends():
    """Adapters open through ``embstore.api`` (``open`` or ``open_backend`` + ``open_store``),
    never by constructing the engine over a backend themselves."""
    root = REPO_ROOT / "adapters"
    strays = [str(p) for p in root.rglob("*.py")
              if "EmbeddingStore(" in p.read_text(encoding="utf-8")
              or "engine.opening" in p.read_text(encoding="utf-8")]
    assert strays == []


def test_public_import_paths_of_the_store():
    from embstore.store import EmbeddingStore

    assert embstore.EmbeddingStore is EmbeddingStore
    assert embstore.open is embstore.api.open


def test_open_in_two_halves_checks_options_and_wraps_the_backend(tmp_path):
    with pytest.raises(InvalidInputError, match="map_sise"):
        open_backend(f"lmdb://{tmp_path}/a", map_sise=1 << 20)
    backend, engine = open_backend(f"lmdb://{tmp_path}/a", optimizer="adagrad")
    assert engine["read_only"] is False and engine["optimizer"] == "adagrad"
    store = open_store(WrapperBackend(backend), 3, **engine)
    with store:
        store.update([1, 2], np.ones((2, 3), np.float32))
        assert store.step == 1
    with embstore.open(f"lmdb://{tmp_path}/a") as again:
        assert again.step == 1 and again.optimizer.config()["name"] == "adagrad"


def test_open_store_closes_the_backend_when_the_schema_does_not_match(tmp_path):
    embstore.open(f"lmdb://{tmp_path}/b", dim=3).close()
    closed = []

    class Watched(WrapperBackend):
        def close(self):
            closed.append(True)
            super().close()

    backend, engine = open_backend(f"lmdb://{tmp_path}/b")
    with pytest.raises(embstore.errors.SchemaMismatchError):
        open_store(Watched(backend), 4, **engine)
    assert closed == [True]


def test_the_writer_owns_counters_version_and_observers():
    store = embstore.open("memory://", dim=2)
    seen = []

    class Recorder:
        def on_write(self, keys, records): seen.append(("write", len(keys)))
        def on_insert(self, keys, vectors, template): seen.append(("insert", len(keys)))
        def on_row_update(self, keys, update, found): seen.append(("row", len(keys)))
        def on_delete(self, keys): seen.append(("delete", len(keys)))
        def on_bulk_load(self): seen.append(("bulk", 0))
        def stats(self): return {"recorded": len(seen)}

    rec = Recorder()
    store.add_observer(rec)
    assert store.observers == (rec,)
    store.lookup([1, 2, 2])
    store.assign([3], [[1.0, 2.0]])
    assert store.delete([1, 9]) == 1
    assert seen == [("insert", 2), ("write", 1), ("delete", 1)]
    assert store.counters["lookups"] == 3 and store.counters["deletes"] == 1
    assert store.stats()["recorded"] == 3
    assert store.version == store.writer.version > 0
    with pytest.raises(InvalidInputError):
        store.add_observer(object())
    store.remove_observer(rec)
    store.remove_observer(rec)  # not registered: a no-op
    assert store.observers == ()
    store.close()
    with pytest.raises(StoreClosedError):
        store.lookup([1])


def test_step_set_from_outside_reaches_the_writer_and_the_metadata(tmp_path):
    """A distributed rank sets its local store's step to the global one: the stamps and the
    stored metadata follow it."""
    url = f"lmdb://{tmp_path}/c"
    with embstore.open(url, dim=2, optimizer="adam") as s:
        s.step = 41
        s.update([5], np.ones((1, 2), np.float32))
        assert s.get_records([5])[0]["last_step"][0] == 42
        assert s.meta["step"] == 42
    with embstore.open(url) as s:
        assert s.step == 42


def test_a_pickled_store_reopens_by_url(tmp_path):
    s = embstore.open(f"lmdb://{tmp_path}/d", dim=2)
    s.lookup([7])
    s.flush()
    t = pickle.loads(pickle.dumps(s))
    assert t.read_only and t.url == s.url
    np.testing.assert_array_equal(t.lookup([7], insert=False), s.lookup([7], insert=False))
    t.close()
    s.close()
    with pytest.raises(pickle.PicklingError, match="memory"):
        pickle.dumps(embstore.open("memory://", dim=2))
