"""lmdb:// runs the conformance suite, plus LMDB specifics (real LMDB files, real processes)."""

from __future__ import annotations

import itertools
import pickle
import subprocess
import sys
import textwrap

import lmdb
import numpy as np
import pytest

import embstore
from embstore.errors import (
    BackendError,
    CorruptFileError,
    InvalidInputError,
    ReadOnlyError,
    StoreNotFoundError,
)
from embstore.testing.conformance import (
    FULL_CONFORMANCE,
    LayoutMatrix,
    rows_equal,
    table_of,
)
from tests.dir_store_suite import DirectoryStoreSuite

DIM = 8


@pytest.fixture
def lmdb_url(tmp_path):
    counter = itertools.count()
    return lambda: f"lmdb://{tmp_path}/s{next(counter)}"


class TestLmdbConformance(*FULL_CONFORMANCE):
    @pytest.fixture
    def url_factory(self, lmdb_url):
        return lmdb_url


class TestLmdbLayouts(LayoutMatrix, TestLmdbConformance):
    """The suite over 16-bit layouts."""


class TestLmdbNonDurableConformance(*FULL_CONFORMANCE):
    """The fast setting (no fsync, writable map) must behave identically."""

    open_options = {"durable": False, "writemap": True}

    @pytest.fixture
    def url_factory(self, lmdb_url):
        return lmdb_url

    # The suite is long; the durable class runs all of it. Keep the core here.
    test_state_machine_against_dict_model = None  # type: ignore[assignment]


class TestLmdbDirectory(DirectoryStoreSuite):
    scheme = "lmdb"
    volatile_files = ("lock.mdb",)  # readers register there
    long_key = 400  # LMDB's key limit is 511 bytes

    @pytest.fixture(params=[
        "lmdb://relative/dir", "lmdb:relative", "lmdb://", "lmdb:///", "lmdb:///tmp/x?map_size=1",
        "lmdb:///tmp/x#frag", "lmdb://host/tmp/x",
    ])
    def malformed_url(self, request):
        return request.param

    def make_foreign(self, path: str) -> None:
        env = lmdb.open(path)
        with env.begin(write=True) as txn:
            txn.put(b"somebody", b"else's data")
        env.close()


def test_map_grows_from_tiny_map_size(lmdb_url):
    url = lmdb_url()
    keys = np.arange(30_000, dtype=np.int64) * 7
    vals = np.random.default_rng(0).standard_normal((len(keys), DIM)).astype(np.float32)
    with embstore.open(url, dim=DIM, map_size=64 * 1024) as s:
        for i in range(0, len(keys), 4096):
            s.assign(keys[i:i + 4096], vals[i:i + 4096])
        st = s.stats()
        assert st["map_grows"] >= 3
        assert st["map_size"] > 64 * 1024
    with embstore.open(url, map_size=64 * 1024) as s:
        assert len(s) == len(keys)
        np.testing.assert_array_equal(s.lookup(keys, insert=False), vals)


READER = textwrap.dedent("""
    import sys, numpy as np, embstore
    s = embstore.open(sys.argv[1], read_only=True)
    for line in sys.stdin:
        lo, hi, val = map(int, line.split())
        v = s.lookup(np.arange(lo, hi), insert=False)
        print("ok" if (v == val).all() and s.contains(np.arange(lo, hi)).all() else
              f"bad {v[:2]} {len(s)}", flush=True)
""")


def test_reader_processes_see_commits_while_writer_runs(lmdb_url):
    url = lmdb_url()
    s = embstore.open(url, dim=DIM, map_size=128 * 1024)
    s.assign(np.arange(100), np.full((100, DIM), 1.0))
    readers = [subprocess.Popen([sys.executable, "-c", READER, url], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for r in readers:
            r.stdin.write("0 100 1\n")
            r.stdin.flush()
            assert r.stdout.readline().strip() == "ok"
        # The writer keeps going (and grows the map under the readers' feet).
        for step in range(2, 5):
            lo, hi = step * 5000, step * 5000 + 5000
            s.assign(np.arange(lo, hi), np.full((hi - lo, DIM), float(step)))
            for r in readers:
                r.stdin.write(f"{lo} {hi} {step}\n")
                r.stdin.flush()
                assert r.stdout.readline().strip() == "ok"
        assert s.stats()["map_grows"] >= 1
    finally:
        for r in readers:
            r.stdin.close()
            r.wait(timeout=30)
        s.close()
    assert all(r.returncode == 0 for r in readers)


def test_read_only_environment_refuses_writes(lmdb_url, tmp_path):
    url = lmdb_url()
    with embstore.open(url, dim=DIM) as s:
        s.assign([1, 2], np.ones((2, DIM)))
    ro = embstore.open(url, read_only=True)
    with pytest.raises(ReadOnlyError):
        ro.assign([1], np.zeros((1, DIM)))
    # Below the engine, LMDB itself refuses: the environment is opened read-only.
    with pytest.raises(BackendError):
        ro.backend.put(np.array([3], np.int64), ro.layout.empty(1))
    np.testing.assert_array_equal(ro.lookup([1, 2], insert=False), np.ones((2, DIM)))
    ro.close()
    missing = tmp_path / "missing"
    with pytest.raises(StoreNotFoundError):
        embstore.open(f"lmdb://{missing}", read_only=True)
    assert not missing.exists()


def test_too_long_bytes_key_is_refused_cleanly(lmdb_url):
    with embstore.open(lmdb_url(), dim=DIM, key_type="bytes") as s:
        s.lookup([b"ok"])
        long_key = b"k" * 600
        assert not s.contains([long_key, b"ok"])[0]
        with pytest.raises(InvalidInputError, match="longer than"):
            s.assign([b"ok", long_key], np.ones((2, DIM)))
        assert len(s) == 1
        np.testing.assert_array_equal(s.lookup([b"ok"]), s.initial_vectors([b"ok"]))


def test_options_survive_pickle_and_unknown_options_fail(lmdb_url):
    url = lmdb_url()
    s = embstore.open(url, dim=DIM, durable=False)
    clone = pickle.loads(pickle.dumps(s))
    assert clone.backend.durable is False
    clone.close()
    s.close()
    with pytest.raises(InvalidInputError):
        embstore.open(lmdb_url(), dim=DIM, mapsize=10)
    with pytest.raises(InvalidInputError):
        embstore.open(lmdb_url(), dim=DIM, writemap=True)  # needs durable=False


def test_bulk_import_appends_and_overwrites(lmdb_url, tmp_path):
    src = embstore.open(lmdb_url(), dim=DIM)
    src.assign(np.arange(0, 3000, 3), np.full((1000, DIM), 2.0))
    path = tmp_path / "x.emb"
    src.export(path)
    dst = embstore.open(lmdb_url(), dim=DIM)
    dst.assign([-5, 3, 999_999], np.full((3, DIM), 9.0))
    assert dst.import_(path) == 1000
    assert len(dst) == 1002
    got = dst.lookup([-5, 3, 6, 999_999], insert=False)
    np.testing.assert_array_equal(got[:, 0], [9.0, 2.0, 2.0, 9.0])
    a, b = table_of(src), table_of(dst)
    assert all(rows_equal(a[k], b[k]) for k in a)
    # Duplicate keys across bulk batches: the later batch wins, as with put().
    recs = dst.layout.empty(2)
    recs["vector"] = [[1.0] * DIM, [4.0] * DIM]
    dst.backend.bulk_load(iter([(np.array([7], np.int64), recs[:1]),
                                (np.array([7], np.int64), recs[1:])]))
    assert dst.lookup([7], insert=False)[0, 0] == 4.0
    src.close()
    dst.close()


def _forked_writer(blob: bytes, key: int) -> None:
    store = pickle.loads(blob)
    assert store.lookup([1], insert=False)[0, 0] == 1.0
    store.assign([key], np.full((1, DIM), float(key)))
    store.close()


def test_forked_workers_reopen_by_url(lmdb_url):
    import multiprocessing as mp

    s = embstore.open(lmdb_url(), dim=DIM)
    s.assign([1], np.ones((1, DIM)))
    ctx = mp.get_context("fork")
    with embstore.writable_unpickling():  # the workers write: a writer is asked for explicitly
        blob = pickle.dumps(s)
    procs = [ctx.Process(target=_forked_writer, args=(blob, k)) for k in (10, 11)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    np.testing.assert_array_equal(s.lookup([10, 11], insert=False)[:, 0], [10.0, 11.0])
    s.assign([2], np.ones((1, DIM)))  # the parent's environment still works
    assert len(s) == 4
    s.close()


def test_size_bytes_and_counters(lmdb_url):
    with embstore.open(lmdb_url(), dim=DIM) as s:
        s.lookup(np.arange(5000))
        st = s.stats()
        assert st["size_bytes"] >= 5000 * s.layout.itemsize
        assert st["commits"] >= 2 and st["map_size"] >= 1 << 30


def _native_file(path, store, keys, vectors, chunk=1000):
    from embstore.io.native import NativeWriter

    recs = store.layout.empty(len(keys))
    recs["vector"] = vectors
    recs["version"] = 1
    with NativeWriter(path, store.meta) as w:
        for i in range(0, len(keys), chunk):
            w.write(keys[i:i + chunk], recs[i:i + chunk])


@pytest.mark.parametrize("cap, as_stream", [(1 << 30, False), (0, False), (20_000, True)],
                         ids=["read-once", "read-twice", "unknown-size-over-cap"])
def test_import_checks_whole_file_first_on_every_path(lmdb_url, tmp_path, monkeypatch, cap,
                                                      as_stream):
    # Files that fit the cache are read once, bigger ones twice (the first pass keeps
    # nothing): either way a damaged file, NaN in its last chunk included, imports nothing.
    from embstore.transfer import pipeline as transfer

    monkeypatch.setattr(transfer, "DEFAULT_CACHE_BYTES", cap)
    t = embstore.open(lmdb_url(), dim=DIM)
    t.assign([-1, 5], np.full((2, DIM), 3.0))
    before = table_of(t)
    keys = np.random.default_rng(0).permutation(5000).astype(np.int64) * 3
    vals = np.random.default_rng(1).standard_normal((5000, DIM)).astype(np.float32)

    def run(path):
        if not as_stream:
            return t.import_(path)
        with open(path, "rb") as f:
            return t.import_(f)

    bad = vals.copy()
    bad[4990, 2] = np.nan
    _native_file(tmp_path / "nan.emb", t, keys, bad)
    good = tmp_path / "good.emb"
    _native_file(good, t, keys, vals)
    cut = tmp_path / "cut.emb"
    cut.write_bytes(good.read_bytes()[:-30])
    for path in (tmp_path / "nan.emb", cut):
        with pytest.raises(CorruptFileError):
            run(path)
        after = table_of(t)
        assert after.keys() == before.keys()
        assert all(rows_equal(after[k], before[k]) for k in before)
    assert run(good) == 5000
    assert len(t) == 5002
    np.testing.assert_array_equal(t.lookup(keys, insert=False), vals)
    np.testing.assert_array_equal(t.lookup([-1], insert=False), np.full((1, DIM), 3.0))
    t.close()


def test_scan_batches_and_bulk_load_of_unsorted_duplicates(lmdb_url):
    # bulk_load sorts with a fast unstable sort and falls back to a stable one when a key
    # repeats (the last occurrence must win); scans resume exactly after each batch.
    with embstore.open(lmdb_url(), dim=DIM, map_size=64 * 1024) as s:
        rng = np.random.default_rng(2)
        keys = rng.permutation(20_000).astype(np.int64) - 10_000
        recs = s.layout.empty(len(keys))
        recs["vector"] = rng.standard_normal((len(keys), DIM))
        dup = recs[:100].copy()
        dup["vector"] += 1.0
        n = s.backend.bulk_load(iter([(keys[:7000], recs[:7000]), (keys[7000:], recs[7000:]),
                                      (keys[:100], dup)]))
        assert n == 20_000 and len(s) == 20_000
        assert s.stats()["map_grows"] >= 1
        want = {int(k): r for k, r in zip(keys, recs["vector"])}
        want.update({int(k): r for k, r in zip(keys[:100], dup["vector"])})
        for bs in (1, 4096, 19_999, 20_000, 50_000):
            got_k, got_v = [], []
            for k, r in s.backend.scan(bs):
                assert len(k) == len(r) <= bs
                got_k.append(k)
                got_v.append(r["vector"])
            ks = np.concatenate(got_k)
            assert ks.tolist() == sorted(want)
            np.testing.assert_array_equal(np.concatenate(got_v),
                                          np.array([want[k] for k in ks.tolist()]))


def test_scan_of_bytes_keys(lmdb_url):
    with embstore.open(lmdb_url(), dim=DIM, key_type="bytes") as s:
        keys = [b"", b"\x00", b"\x00\x00", b"a", b"ab", b"b" * 300]
        s.assign(keys, np.arange(len(keys) * DIM).reshape(len(keys), DIM))
        got = [k for ks, _ in s.backend.scan(4) for k in ks.tolist()]
        assert got == sorted(keys)
