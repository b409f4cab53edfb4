"""LMDB plans cut from the B-tree's top levels: every row still in exactly one part, however
skewed the keys; the parts about equal; anything that does not read as an LMDB branch page
makes the planner walk the keys instead."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embstore
from embstore.backends import lmdb_split
from embstore.backends.lmdb_env import REC_DB
from embstore.backends.ranges import check_plan
from embstore.transfer import plan_parts, run_part, verify_file, verify_store


def _btree_cuts(store: embstore.EmbeddingStore, n: int) -> list[bytes] | None:
    be = store.backend
    env = be.env.require()
    with be.env.begin() as txn:
        return lmdb_split.btree_bounds(txn, env.open_db(None), REC_DB, txn.stat(be.env.records),
                                       os.path.join(env.path(), "data.mdb"), n)


def _parts_keys(store: embstore.EmbeddingStore, n: int) -> list[list]:
    ranges = store.backend.plan_ranges(n)
    check_plan(ranges)
    out = []
    for r in ranges:
        got: list = []
        for keys, _ in store.backend.scan_range(r, 977):
            got += keys.tolist() if keys.dtype == np.int64 else list(keys)
        out.append(got)
    return out


def _check_cover(parts: list[list], keys: list) -> None:
    union = [k for p in parts for k in p]
    assert len(union) == len(set(union)) == len(keys)  # no row twice
    assert sorted(union) == sorted(keys)  # no row missed


def _clustered_int64(clusters: list[tuple[int, int, int]]) -> np.ndarray:
    rng = np.random.default_rng(len(clusters))
    parts = [np.clip(c + rng.integers(0, w + 1, k, dtype=np.int64), -2**63, 2**63 - 1)
             for c, w, k in clusters]
    return np.unique(np.concatenate(parts)).astype(np.int64)


_CLUSTER = st.tuples(st.integers(-2**63, 2**63 - 2**41), st.sampled_from([0, 7, 1 << 12, 1 << 40]),
                     st.integers(1, 1500))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(clusters=st.lists(_CLUSTER, min_size=1, max_size=6), n=st.integers(2, 6),
       batches=st.integers(1, 4))
def test_btree_cuts_of_skewed_int64_keys_cover_every_row_exactly_once(clusters, n, batches):
    keys = _clustered_int64(clusters)
    if len(keys) < 600:  # a tree of one or two levels: nothing to read but the root
        keys = np.unique(np.concatenate([keys, np.arange(600, dtype=np.int64) * 3]))
    with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
        mp.setattr(lmdb_split, "WALK_ROWS", 0)
        with embstore.open(f"lmdb://{d}/s", dim=64, durable=False) as store:
            # several batches in shuffled order: leaves split at random, not only appended
            order = np.random.default_rng(1).permutation(len(keys))
            for chunk in np.array_split(keys[order], batches):
                store.assign(chunk, np.zeros((len(chunk), 64), np.float32))
            cuts = _btree_cuts(store, n)
            assert cuts is not None, "the B-tree was not read"
            assert [r.hi for r in store.backend.plan_ranges(n)[:-1]] == cuts
            parts = _parts_keys(store, n)
    _check_cover(parts, keys.tolist())
    # subtrees are counted as equal and a leaf holds between half a page and a page of
    # rows: no part gets more than about twice its share
    assert max(map(len, parts)) <= 2 * len(keys) / n + 64


@settings(max_examples=10, deadline=None, derandomize=True)
@given(prefix_len=st.integers(0, 400), n=st.integers(2, 5), count=st.integers(700, 2500))
def test_btree_cuts_of_long_shared_prefix_bytes_keys(prefix_len, n, count):
    # long keys: branch pages hold fewer, longer separators
    keys = [b"p" * prefix_len + f"{i:06d}".encode() for i in range(count)] + [b"", b"\xff"]
    with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
        mp.setattr(lmdb_split, "WALK_ROWS", 0)
        with embstore.open(f"lmdb://{d}/s", dim=64, key_type="bytes", durable=False) as store:
            store.assign(keys, np.ones((len(keys), 64), np.float32))
            assert _btree_cuts(store, n) is not None
            parts = _parts_keys(store, n)
    _check_cover(parts, keys)


def test_a_large_table_is_planned_from_the_btree_with_near_equal_parts(tmp_path):
    n_rows = lmdb_split.WALK_ROWS + 5000
    rng = np.random.default_rng(3)
    keys = np.unique(rng.integers(-2**62, 2**62, n_rows + 100))[:n_rows]
    url = f"lmdb://{tmp_path}/big"
    with embstore.open(url, dim=16, durable=False) as store:
        store.assign(keys, rng.standard_normal((len(keys), 16), dtype=np.float32))
        for n in (2, 3, 7):
            cuts = _btree_cuts(store, n)
            assert cuts is not None
            assert [r.hi for r in store.backend.plan_ranges(n)[:-1]] == cuts
            sizes = [len(p) for p in _parts_keys(store, n)]
            assert sum(sizes) == len(keys)
            assert max(sizes) <= 1.1 * len(keys) / n  # many leaves per part: close to equal
    parts = plan_parts(url, 2)
    out = tmp_path / "out"
    for p in parts:
        run_part(p, out, fmt="parquet")
    with embstore.open(url, read_only=True) as store:
        whole = verify_store(store)
    res = verify_file(str(out / "manifest.json"))
    assert res.ok and res.rows == len(keys) and res.digest == whole.digest


def test_a_small_table_is_cut_by_the_exact_key_walk(tmp_path):
    with embstore.open(f"lmdb://{tmp_path}/s", dim=64, durable=False) as store:
        store.assign(np.arange(5000, dtype=np.int64), np.zeros((5000, 64), np.float32))
        assert _btree_cuts(store, 2) is None  # below WALK_ROWS
        sizes = [len(p) for p in _parts_keys(store, 4)]
        assert sizes == [1250] * 4


def test_pages_that_do_not_read_as_the_btree_fall_back_to_the_walk(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_split, "WALK_ROWS", 0)
    with embstore.open(f"lmdb://{tmp_path}/s", dim=64, durable=False) as store:
        store.assign(np.arange(3000, dtype=np.int64), np.zeros((3000, 64), np.float32))
        be = store.backend
        env = be.env.require()
        with be.env.begin() as txn:
            stat, main = txn.stat(be.env.records), env.open_db(None)
            data = os.path.join(env.path(), "data.mdb")
            assert lmdb_split.btree_bounds(txn, main, REC_DB, stat, data, 2) is not None
            # another file where the data file should be: no page is the one expected
            other = tmp_path / "zeros.mdb"
            other.write_bytes(bytes(os.path.getsize(data)))
            assert lmdb_split.btree_bounds(txn, main, REC_DB, stat, str(other), 2) is None
            assert lmdb_split.btree_bounds(txn, main, REC_DB, stat, str(tmp_path / "no"),
                                           2) is None
            # a name that is no named database of this environment
            assert lmdb_split.btree_bounds(txn, main, b"nope", stat, data, 2) is None


@pytest.mark.parametrize("page", [b"", bytes(4096), b"\x07" * 4096])
def test_a_page_that_is_not_a_branch_page_is_refused(page):
    with pytest.raises(ValueError):
        lmdb_split._branch_children(page, 7, 4096)
