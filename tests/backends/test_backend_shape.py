"""The row-store backends (memory://, LMDB, RocksDB) and ``Backend`` keep the shape of issue #31:
every piece of state has one owner. Their classes are no larger than 500 lines together with
``Backend``, which stays about 150 lines; no mixin, no borrowed private name, no private reach
into another object and no module-level function that treats its first argument as ``self``."""

from __future__ import annotations

import pytest

from embstore.testing import architecture as arch
from embstore.testing import class_shape as shape

_AREA = ("embstore.backends.base", "embstore.backends.defaults", "embstore.backends.rows",
         "embstore.backends.capabilities", "embstore.backends.memory",
         "embstore.backends.memory_rows", "embstore.backends.memory_url",
         "embstore.backends.lmdb", "embstore.backends.lmdb_env", "embstore.backends.rocksdb",
         "embstore.backends.rocksdb_handles", "embstore.backends._replace",
         "embstore.backends._localdir", "embstore.backends._txn",
         "embstore.backends.ordered_keys", "embstore.backends.ranges", "embstore.io.npz",
         "embstore.policies.tombstones", "embstore.sampling.candidate")


@pytest.fixture(scope="module")
def modules():
    return arch.load_modules()


@pytest.fixture(scope="module")
def table(modules):
    return shape.classes(modules)


def test_backend_is_about_150_lines(table):
    assert table["embstore.backends.base.Backend"].lines <= 170


def test_every_class_fits_500_lines_with_its_bases(table):
    sizes = {q: n for q, n in shape.with_bases(table) if table[q].module in _AREA}
    assert max(sizes.values()) <= 500, sorted(sizes.items(), key=lambda x: -x[1])[:3]
    assert table["embstore.backends.memory.MemoryBackend"].bases == [
        "embstore.backends.base.Backend"]
    for name in ("lmdb.LmdbBackend", "rocksdb.RocksDBBackend"):  # reads from one _fetch
        assert table[f"embstore.backends.{name}"].bases == [
            "embstore.backends._localdir.FetchedRows"]
    assert table["embstore.backends._localdir.FetchedRows"].bases == [
        "embstore.backends.base.Backend"]


def test_no_mixins_or_borrowed_names(table):
    assert {q: v for q, v in shape.borrowed(table).items() if table[q].module in _AREA} == {}


def test_no_private_reaches(modules):
    reaches = [f"{r.module}:{r.lineno} {r.text}" for r in arch.private_reaches(modules)
               if r.module in _AREA]
    assert reaches == []


def test_no_owner_passing_functions(modules):
    assert [p for p in shape.owner_passing(modules) if p.module in _AREA] == []
