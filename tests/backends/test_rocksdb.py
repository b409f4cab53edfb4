"""rocksdb:// runs the conformance suite, plus RocksDB specifics (real RocksDB directories)."""

from __future__ import annotations

import itertools
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import rocksdict

import embstore
from embstore.errors import (
    BackendError,
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
def rocks_url(tmp_path):
    counter = itertools.count()
    return lambda: f"rocksdb://{tmp_path}/s{next(counter)}"


class TestRocksDBConformance(*FULL_CONFORMANCE):
    open_options = {"block_cache_mb": 8}

    @pytest.fixture
    def url_factory(self, rocks_url):
        return rocks_url


class TestRocksDBLayouts(LayoutMatrix, TestRocksDBConformance):
    """The suite over 16-bit layouts."""


class TestRocksDBDirectory(DirectoryStoreSuite):
    scheme = "rocksdb"
    long_key = 4000

    @pytest.fixture(params=[
        "rocksdb://relative/dir", "rocksdb:relative", "rocksdb://", "rocksdb:///",
        "rocksdb:///tmp/x?sync=1", "rocksdb://host/tmp/x",
    ])
    def malformed_url(self, request):
        return request.param

    def make_foreign(self, path: str) -> None:
        db = rocksdict.Rdict(path, rocksdict.Options(raw_mode=True))
        db[b"somebody"] = b"else's data"
        db.close()


def test_sst_bulk_import_overwrites_and_keeps_last(rocks_url, tmp_path):
    src = embstore.open(rocks_url(), dim=DIM)
    src.assign(np.arange(0, 30_000, 3), np.full((10_000, DIM), 2.0))
    path = tmp_path / "x.emb"
    src.export(path, batch_size=3000)
    dst = embstore.open(rocks_url(), dim=DIM)
    dst.assign([-5, 3, 999_999], np.full((3, DIM), 9.0))
    assert dst.import_(path) == 10_000
    assert dst.stats()["sst_ingests"] >= 1
    assert len(dst) == 10_002
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
    dst.close()
    with embstore.open(dst.url) as again:
        assert len(again) == 10_003
    src.close()


def test_read_only_refuses_writes_below_the_engine(rocks_url, tmp_path):
    url = rocks_url()
    with embstore.open(url, dim=DIM) as s:
        s.assign([1, 2], np.ones((2, DIM)))
    ro = embstore.open(url, read_only=True)
    with pytest.raises(ReadOnlyError):
        ro.assign([1], np.zeros((1, DIM)))
    with pytest.raises(BackendError):
        ro.backend.put(np.array([3], np.int64), ro.layout.empty(1))
    np.testing.assert_array_equal(ro.lookup([1, 2], insert=False), np.ones((2, DIM)))
    ro.close()
    missing = tmp_path / "missing"
    with pytest.raises(StoreNotFoundError):
        embstore.open(f"rocksdb://{missing}", read_only=True)
    assert not missing.exists()


READER = textwrap.dedent("""
    import sys, numpy as np, embstore
    s = embstore.open(sys.argv[1], read_only=True)
    v = s.lookup(np.arange(100), insert=False)
    print("ok" if (v == 1.0).all() and len(s) == 100 else "bad", flush=True)
""")


def test_read_only_process_alongside_writer(rocks_url):
    url = rocks_url()
    s = embstore.open(url, dim=DIM)
    s.assign(np.arange(100), np.full((100, DIM), 1.0))
    out = subprocess.run([sys.executable, "-c", READER, url], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
    s.close()


def test_options_survive_pickle_and_unknown_options_fail(rocks_url):
    s = embstore.open(rocks_url(), dim=DIM, durable=False, block_cache_mb=4)
    clone = pickle.loads(pickle.dumps(s))
    assert clone.backend.durable is False
    assert clone.backend.reopen_options()["block_cache_mb"] == 4
    clone.close()
    s.close()
    with pytest.raises(InvalidInputError):
        embstore.open(rocks_url(), dim=DIM, cache_mb=10)


WRITER = textwrap.dedent("""
    import sys, embstore
    try:
        embstore.open(sys.argv[1])
        print("opened")
    except embstore.errors.BackendError as e:
        print("refused", "read_only=True" in str(e))
""")


def test_second_writer_process_is_refused_with_a_hint(rocks_url):
    url = rocks_url()
    s = embstore.open(url, dim=DIM)
    s.assign([1], np.ones((1, DIM)))
    out = subprocess.run([sys.executable, "-c", WRITER, url], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "refused True", out.stderr
    assert s.lookup([1], insert=False)[0, 0] == 1.0
    s.close()


def test_size_bytes_and_counters(rocks_url):
    with embstore.open(rocks_url(), dim=DIM, durable=False) as s:
        s.lookup(np.arange(5000))
        st = s.stats()
        assert st["size_bytes"] >= 5000 * s.layout.itemsize
        assert st["write_batches"] >= 1
