"""Atomic restores on Bigtable (``embstore/backends/bigtable/restore.py``), on the emulator.

A crash is simulated by failing one step of the restore (the emulator cannot be killed in the
middle of a call on demand): after it, the next open for writing must show exactly the old
table or exactly the new one, with no staging table left behind.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

import embstore
from embstore.backends.bigtable import restore
from embstore.backends.bigtable.restore import StagedRestore
from embstore.errors import BackendError
from embstore.testing.conformance import table_of


class Crash(Exception):
    pass


def _table(store) -> dict:
    """Every record of ``store`` as {key: record bytes}."""
    return {k: r.tobytes() for k, r in table_of(store).items()}


def _old_and_new(url: str, key_type: str = "int64", **opts):
    """A store holding the *old* table, the snapshot of the *new* one, and both contents.

    New: 40 rows (0..39). Old: rows 20..59 with other values (so the restore overwrites 20
    rows, adds 20 and deletes 20)."""
    s = embstore.open(url, dim=4, key_type=key_type, optimizer="adagrad", **opts)
    keys = np.arange(0, 40)
    if key_type == "bytes":
        keys = [b"k%d" % k for k in keys]
    s.lookup(keys)
    s.update(keys, np.ones((40, 4), np.float32))
    buf = io.BytesIO()
    s.export(buf)
    new = (_table(s), s.step)
    old_keys = np.arange(20, 60)
    if key_type == "bytes":
        old_keys = [b"k%d" % k for k in old_keys]
    s.lookup(old_keys)
    s.update(old_keys, np.full((40, 4), 3.0, np.float32))
    s.delete(keys[:20])
    s.flush()  # the old step reaches the stored metadata, as a crash would find it
    old = (_table(s), s.step)
    assert old != new and len(old[0]) == 40
    return s, buf.getvalue(), old, new


def _stage_exists(url: str) -> bool:
    with embstore.open(url, read_only=True) as s:
        return s.backend.restore.staging_exists()


@pytest.mark.parametrize("key_type", ["int64", "bytes"])
def test_a_restore_replaces_the_table_and_leaves_no_staging_table(bigtable_url_factory,
                                                                  key_type):
    url = bigtable_url_factory()
    s, snap, old, new = _old_and_new(url, key_type, write_batch=8)
    assert s.backend.replace_mechanism == "staging-table"
    assert s.import_(snap, replace=True) == 40
    assert (_table(s), s.step) == new
    s.close()
    with embstore.open(url) as again:
        assert (_table(again), again.step) == new
    assert not _stage_exists(url)


def _fail_on_call(monkeypatch, name: str, call: int = 1) -> None:
    """Make the restore step ``name`` raise ``Crash`` on its ``call``-th call."""
    real = getattr(StagedRestore, name)
    calls = [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise Crash(f"crash in {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(StagedRestore, name, failing)


# (step that fails, which call of it, the table a writer open must show afterwards)
PHASES = [
    ("stage_rows", 1, "old"),       # before anything was staged
    ("set_marker", 1, "old"),       # staged, not committed
    ("copy_rows", 1, "new"),        # committed, nothing copied
    ("send_rows", 2, "new"),        # half the staged rows copied
    ("delete_stale", 1, "new"),     # every row copied, stale rows still there
    ("write_new_meta", 1, "new"),   # rows exactly new, old metadata + marker
    ("drop_staging", 1, "new"),     # all done but the staging table is left
]


@pytest.mark.parametrize("step,call,expect", PHASES)
def test_a_crash_at_each_step_leaves_the_old_or_the_new_table(bigtable_url_factory, monkeypatch,
                                                              step, call, expect):
    url = bigtable_url_factory()
    # write_batch=8, inflight=1: the copy sends 5 requests, so "send_rows" fails mid-way
    s, snap, old, new = _old_and_new(url, write_batch=8, inflight=1)
    _fail_on_call(monkeypatch, step, call)
    with pytest.raises((Crash, BackendError)):
        s.import_(snap, replace=True)
    monkeypatch.undo()
    s.backend.close()  # the process dies: no orderly close of the store
    if expect == "new" and step != "drop_staging":
        with pytest.raises(BackendError, match="restore .* interrupted"):
            embstore.open(url, read_only=True)  # a reader cannot see the mix
    with embstore.open(url) as again:  # the writer open recovers
        assert (_table(again), again.step) == (old if expect == "old" else new)
    assert not _stage_exists(url)
    with embstore.open(url, read_only=True) as reader:
        assert (_table(reader), reader.step) == (old if expect == "old" else new)


def test_a_restore_that_fails_after_committing_keeps_the_marker_through_a_clean_close(
        bigtable_url_factory, monkeypatch):
    url = bigtable_url_factory()
    s, snap, old, new = _old_and_new(url, write_batch=8)
    _fail_on_call(monkeypatch, "delete_stale")
    with pytest.raises(BackendError, match="committed but could not be finished"):
        s.import_(snap, replace=True)
    monkeypatch.undo()
    s.backend.write_meta(s.meta)  # a blind metadata write must not drop the marker
    s.close()
    with embstore.open(url) as again:
        assert (_table(again), again.step) == new


def test_a_staging_table_without_marker_is_dropped_on_a_writer_open(bigtable_url_factory):
    url = bigtable_url_factory()
    s, snap, old, new = _old_and_new(url)
    # a staging table as a crash during step 1 leaves it: rows, no marker in the live table
    s.backend.restore.stage_rows(iter([(np.arange(100, 103), s.get_records(np.arange(20, 23))[0])]),
                         s.meta)
    s.close()
    assert _stage_exists(url)
    with embstore.open(url, read_only=True) as reader:  # nothing pending: a reader may open
        assert (_table(reader), reader.step) == old
    with embstore.open(url) as again:
        assert (_table(again), again.step) == old
    assert not _stage_exists(url)


def test_staging_table_names_fit_bigtable_limits():
    assert restore.staging_table_id("emb") == "emb__restore"
    long_a, long_b = "a" * 45 + "x", "a" * 45 + "y"
    sa, sb = restore.staging_table_id(long_a), restore.staging_table_id(long_b)
    assert len(sa) <= 50 and len(sb) <= 50 and sa != sb
    assert restore.is_staging_table(sa)
