"""SQLite plans cut from the top levels of the rowid B-tree: no row counted or stepped over,
every row still in exactly one part (keys at the cuts, the int64 extremes, rows still in the
write-ahead log), the parts about equal; anything that does not read as a rowid B-tree makes
the planner count instead."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import embstore
from embstore.backends.ranges import check_plan
from embstore.backends.sql import sqlite_split

DIM = 64  # ~300-byte rows: 13 a leaf page, so a few tens of thousands make a deep tree


def _fill(url: str, keys: np.ndarray, **kw) -> embstore.EmbeddingStore:
    store = embstore.open(url, dim=DIM, **kw)
    vals = np.random.default_rng(1).standard_normal((len(keys), DIM)).astype(np.float32)
    for i in range(0, len(keys), 20000):
        store.assign(keys[i:i + 20000], vals[i:i + 20000])
    return store


def _statements(store: embstore.EmbeddingStore) -> list[str]:
    seen: list[str] = []
    store.backend.sql.ops.conn.set_trace_callback(seen.append)
    return seen


def _parts(store: embstore.EmbeddingStore, n: int) -> list[list[int]]:
    ranges = store.backend.plan_ranges(n)
    check_plan(ranges)
    out = []
    for r in ranges:
        got: list[int] = []
        for ks, recs in store.backend.scan_range(r, 4999):
            assert len(ks) == len(recs)
            got += ks.tolist()
            lo = -2**63 if r.lo is None else r.lo
            assert all(lo <= k and (r.hi is None or k < r.hi) for k in ks.tolist())
        out.append(got)
    return out


def _check(parts: list[list[int]], keys: np.ndarray, slack: float) -> None:
    union = [k for p in parts for k in p]
    assert len(union) == len(set(union)) == len(keys)  # no row twice
    assert sorted(union) == sorted(keys.tolist())  # no row missed
    ideal = len(keys) / len(parts)
    assert max(len(p) for p in parts) <= ideal * (1 + slack), [len(p) for p in parts]


@pytest.fixture(scope="module")
def consecutive(tmp_path_factory):
    """60k consecutive keys and the int64 extremes: every cut falls on a key that exists."""
    path = tmp_path_factory.mktemp("split") / "c.db"
    keys = np.concatenate([np.arange(60000, dtype=np.int64),
                           np.array([-2**63, 2**63 - 1], dtype=np.int64)])
    with _fill(f"sqlite:///{path}", keys):
        pass
    return path, keys


@pytest.mark.parametrize("n", [2, 3, 8])
def test_cuts_from_the_btree_read_no_row_and_keep_every_row_once(consecutive, n):
    path, keys = consecutive
    with embstore.open(f"sqlite:///{path}", read_only=True) as store:
        seen = _statements(store)
        cuts = store.backend.sql.ops.btree_cuts(n)
        ranges = store.backend.plan_ranges(n)
        assert cuts is not None and [r.lo for r in ranges[1:]] == cuts
        assert not [s for s in seen if "count(" in s.lower() or "offset" in s.lower()], seen
        # the cuts are keys of the table: the row at a cut is the first of its part
        assert set(cuts) <= set(keys.tolist())
        _check(_parts(store, n), keys, 0.02)


def test_rows_still_in_the_write_ahead_log_are_planned_for(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/w.db"
    first = np.arange(0, 40000, dtype=np.int64)
    with _fill(url, first):
        pass  # the last connection's close moves everything into the database file
    later = np.arange(10**9, 10**9 + 40000, dtype=np.int64)
    store = embstore.open(url)
    try:
        store.backend.sql.ops.conn.execute("PRAGMA wal_autocheckpoint = 0")
        vals = np.ones((len(later), DIM), np.float32)
        for i in range(0, len(later), 20000):
            store.assign(later[i:i + 20000], vals[i:i + 20000])
        assert (tmp_path / "w.db-wal").stat().st_size > 4 << 20  # the new pages are there
        with embstore.open(url, read_only=True) as reader:
            cuts = reader.backend.sql.ops.btree_cuts(2)
            assert cuts is not None
            # read from the database file alone, the cut would fall among the first keys
            assert 35000 <= cuts[0] <= 10**9 + 5000, cuts
            _check(_parts(reader, 2), np.concatenate([first, later]), 0.1)
            # a log too long to index (one read per frame header): the planner counts
            monkeypatch.setattr(sqlite_split, "_MAX_WAL_FRAMES", 10)
            assert reader.backend.sql.ops.btree_cuts(2) is None
            _check(_parts(reader, 2), np.concatenate([first, later]), 0.001)
    finally:
        store.close()


def test_small_bytes_and_empty_tables_are_counted(tmp_path):
    with _fill(f"sqlite:///{tmp_path}/s.db", np.arange(3000, dtype=np.int64)) as small:
        assert small.backend.sql.ops.btree_cuts(2) is None  # a few leaves: counting is exact
        assert [len(p) for p in _parts(small, 2)] == [1500, 1500]
    with embstore.open(f"sqlite:///{tmp_path}/b.db", dim=DIM, key_type="bytes") as b:
        b.assign([b"a", b"b", b"c"], np.ones((3, DIM), np.float32))
        assert b.backend.sql.ops.btree_cuts(2) is None
        assert sorted(k for p in b.backend.plan_ranges(2)
                      for ks, _ in b.backend.scan_range(p) for k in ks) == [b"a", b"b", b"c"]
    with embstore.open(f"sqlite:///{tmp_path}/e.db", dim=DIM) as empty:
        assert empty.backend.sql.ops.btree_cuts(2) is None
        assert [list(empty.backend.scan_range(r)) for r in empty.backend.plan_ranges(3)] == \
            [[], [], []]


def test_pages_that_are_not_a_rowid_btree_make_the_planner_count(consecutive, tmp_path):
    path, keys = consecutive
    with embstore.open(f"sqlite:///{path}", read_only=True) as store:
        root = store.backend.sql.ops.conn.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = 'embeddings'").fetchone()[0]
    assert sqlite_split.rowid_bounds(str(path), root, 2) is not None
    assert sqlite_split.rowid_bounds(str(tmp_path / "missing.db"), root, 2) is None
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database" * 1000)
    assert sqlite_split.rowid_bounds(str(junk), root, 2) is None
    # the root page overwritten: the planner counts, and the plan still holds every row once
    bad = tmp_path / "bad.db"
    shutil.copyfile(path, bad)
    with open(bad, "r+b") as f:
        psize = int.from_bytes(f.read(18)[16:18], "big")
        f.seek((root - 1) * psize)
        f.write(b"\x0d" + b"\xff" * (psize - 1))  # a "leaf" full of garbage
    assert sqlite_split.rowid_bounds(str(bad), root, 2) is None
    assert sqlite_split.rowid_bounds(str(path), 1, 2) is None  # the schema page: no table's
    # a root page number past the end of the file
    assert sqlite_split.rowid_bounds(str(path), 10**9, 2) is None


def test_a_separate_key_index_is_no_rowid_and_is_counted(tmp_path):
    """A table whose int64 key has an index of its own (``BIGINT PRIMARY KEY``: the rowid is
    not the key): its rowid B-tree says nothing about the key order, so no cuts from it."""
    import sqlite3

    from embstore.backends.sql.sqlite import SQLiteOps

    con = sqlite3.connect(tmp_path / "x.db")
    con.execute("CREATE TABLE other (k BIGINT PRIMARY KEY, rec BLOB, version BIGINT)")
    con.executemany("INSERT INTO other VALUES (?, zeroblob(300), 0)",
                    [(int(k),) for k in np.arange(30000)])
    con.commit()
    ops = SQLiteOps(con, "other", "other_meta", lambda s: f'"{s}"', "int64", 300)
    assert ops.btree_cuts(2) is None
    con.close()
