"""The Bigtable backend is assembled from owned parts (issue #31): a connection, a CAS writer
and a staged restore, each with its own state and a public interface, none a mixin."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.testing import architecture as arch
from embstore.testing import class_shape as shape

PACKAGE = "embstore.backends.bigtable"


def _inside(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def test_the_bigtable_package_has_no_mixins_reaches_or_owner_passing_functions():
    modules = arch.load_modules()
    table = shape.classes(modules)
    assert [q for q in shape.mixins(table) if _inside(q)] == []
    assert [f"{r.module}:{r.lineno} {r.text}" for r in arch.private_reaches(modules)
            if _inside(r.module)] == []
    assert [f"{p.module}.{p.function}" for p in shape.owner_passing(modules)
            if _inside(p.module)] == []
    ours = {q: info for q, info in table.items() if _inside(q)}
    # BigtableBackend derives from Backend only; its parts derive from nothing of the project
    assert ours[f"{PACKAGE}.backend.BigtableBackend"].bases == ["embstore.backends.base.Backend"]
    assert {q: info.bases for q, info in ours.items() if info.bases and "Backend" not in q} == {}
    assert {q: info.lines for q, info in ours.items() if info.lines > 350} == {}


def test_the_parts_hold_no_reference_to_the_backend(bigtable_url_factory):
    with embstore.open(bigtable_url_factory(), dim=4) as s:
        be = s.backend
        for part in (be.conn, be.cas, be.restore):
            assert all(v is not be for v in vars(part).values()), type(part).__name__
        # one counters dict, the backend's, incremented by the parts
        assert be.conn.counters is be.counters
        s.lookup(np.arange(5))
        assert be.stats()["remote_writes"] > 0


def test_control_documents_round_trip_through_the_cas_writer(bigtable_url_factory):
    with embstore.open(bigtable_url_factory(), dim=4) as s:
        cas = s.backend.cas
        row = b"m"  # the metadata row: modify keeps the fields it is given
        before = cas.read_doc(row)
        new = cas.modify_doc(lambda doc: {**doc, "extra": 1}, row)
        assert new["extra"] == 1 and new["ts_high"] > before["ts_high"]
        assert cas.read_doc(row) == new
        ts = cas.next_ts()
        cas.observe_ts(ts + 10**9)  # a stamp read back from the table: never written below
        assert cas.next_ts() > ts + 10**9


def test_a_recreated_table_gets_the_lease_record_back_as_it_was_written(bigtable_url_factory):
    pytest.importorskip("google.cloud.bigtable")
    url = bigtable_url_factory()
    with embstore.open(url, dim=4) as s:
        be = s.backend
        written = be.modify_leases(lambda old: {"epoch": 3, "leases": {}})
        s.assign(np.arange(3), np.ones((3, 4), np.float32))
        # the table vanishes (an emulator restart): the next write recreates it
        be.conn.admin_client().delete_table(name=be.table_name)
        s.assign(np.arange(2), np.ones((2, 4), np.float32))
        assert be.stats()["tables_recreated"] == 1
        assert be.read_leases() == written  # not re-stamped: the fence sees what it wrote
        assert be.read_meta() is not None and len(s) == 2
