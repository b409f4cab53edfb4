"""Key-ordered scans assemble each batch from small runs of rows (``SUB_ROWS`` at a time, to
keep the Python objects of a batch few): batches of any size, runs cut by a range's end in
their middle, bytes keys and the int64 extremes still give every row of a range once, in key
order, as whole writable records."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.backends import ranges as ranges_mod
from embstore.backends.sql import rows as sql_rows


def _keys(key_type: str, n: int) -> list:
    rng = np.random.default_rng(3)
    if key_type == "int64":
        ks = np.unique(np.concatenate([rng.integers(-2**62, 2**62, n - 2, dtype=np.int64),
                                       [-2**63, 2**63 - 1]]))
        return ks.tolist()
    return [b"", b"\x00", b"\xff" * 4] + [f"k{i}".encode() for i in range(n - 3)]


@pytest.mark.parametrize("key_type", ["int64", "bytes"])
@pytest.mark.parametrize("kind", ["lmdb", "rocksdb", "sqlite", "postgres"])
def test_batches_built_from_small_runs_hold_every_row_of_a_range_once(
        kind, key_type, new_store_url, monkeypatch):
    # runs of 7 rows: batch sizes and range ends fall in the middle of a run
    monkeypatch.setattr(ranges_mod, "SUB_ROWS", 7)
    monkeypatch.setattr(sql_rows, "SUB_ROWS", 7)
    monkeypatch.setattr(ranges_mod, "_FIRST_ROWS", 10)  # batches grow past their first size
    keys = _keys(key_type, 500)
    with embstore.open(new_store_url(kind), dim=4, key_type=key_type) as store:
        vals = np.arange(len(keys) * 4, dtype=np.float32).reshape(-1, 4)
        store.assign(keys, vals)
        want = dict(zip(keys, vals.tolist()))
        be = store.backend
        for n in (1, 3):
            for batch in (1, 6, 7, 50, 4096):
                seen: list = []
                for r in be.plan_ranges(n):
                    got: list = []
                    for ks, recs in be.scan_range(r, batch):
                        assert 0 < len(ks) == len(recs) <= batch
                        assert recs.flags.writeable and recs.dtype == be.layout.dtype
                        got += ks.tolist() if key_type == "int64" else list(ks)
                        for k, v in zip(ks.tolist() if key_type == "int64" else ks,
                                        recs["vector"].tolist()):
                            assert want[k] == v
                    assert got == sorted(got)  # key order within a range
                    seen += got
                assert len(seen) == len(set(seen)) == len(keys), (n, batch)
                assert set(seen) == set(keys)
        recs = [r for _, r in be.scan(7)]
        assert sum(map(len, recs)) == len(keys) and all(r.flags.writeable for r in recs)


def test_records_of_another_size_are_refused_by_a_scan(tmp_path, monkeypatch):
    """A value of the wrong size in the middle of a run: the scan refuses it
    (``SchemaMismatchError``), it is not cut into records."""
    import lmdb

    from embstore.errors import SchemaMismatchError

    monkeypatch.setattr(ranges_mod, "SUB_ROWS", 7)
    url = f"lmdb://{tmp_path}/s"
    with embstore.open(url, dim=4) as store:
        store.assign(list(range(20)), np.ones((20, 4), np.float32))
    env = lmdb.open(str(tmp_path / "s"), max_dbs=4)
    with env.begin(write=True) as txn:
        db = env.open_db(b"records", txn=txn)
        key = next(iter(txn.cursor(db=db).iternext(values=False)))
        txn.put(key, b"\x00" * 5, db=db)
    env.close()
    with embstore.open(url, read_only=True) as store, pytest.raises(SchemaMismatchError):
        list(store.backend.scan(10))


@pytest.mark.parametrize("key_type", ["int64", "bytes"])
def test_rocksdb_plans_from_one_sampled_walk_keep_every_row_once(key_type, tmp_path):
    """RocksDB cuts at every s-th key of one walk (s from its key-count estimate): the
    parts still chain over every row once, about equal; one row and no rows plan too."""
    keys = _keys(key_type, 30000)
    with embstore.open(f"rocksdb://{tmp_path}/r", dim=4, key_type=key_type) as store:
        for i in range(0, len(keys), 10000):
            store.assign(keys[i:i + 10000], np.ones((len(keys[i:i + 10000]), 4), np.float32))
        store.flush()
        be = store.backend
        for n in (2, 3, 7):
            sizes, seen = [], []
            for r in be.plan_ranges(n):
                got = [k for ks, _ in be.scan_range(r, 4096)
                       for k in (ks.tolist() if key_type == "int64" else list(ks))]
                sizes.append(len(got))
                seen += got
            assert len(seen) == len(set(seen)) == len(keys) and set(seen) == set(keys)
            assert max(sizes) <= len(keys) / n * 1.01, sizes
    with embstore.open(f"rocksdb://{tmp_path}/one", dim=4, key_type=key_type) as one:
        one.assign(keys[:1], np.ones((1, 4), np.float32))
        got = [list(ks) for r in one.backend.plan_ranges(3) for ks, _ in one.backend.scan_range(r)]
        assert [k for ks in got for k in ks] == [keys[0]]
    with embstore.open(f"rocksdb://{tmp_path}/none", dim=4, key_type=key_type) as none:
        assert [list(none.backend.scan_range(r)) for r in none.backend.plan_ranges(2)] == [[], []]
