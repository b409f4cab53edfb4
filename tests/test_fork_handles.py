"""A store handle used in a child made by fork(): an error, or writes that really land.

Before: a RocksDB handle in a forked child reported success and lost the writes; a
PostgreSQL handle in the child used (and on close, ended) the parent's connection.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import embstore
from embstore.errors import ForkedProcessError

DIM = 4


def _in_child(fn) -> str:
    """Run ``fn()`` in a forked child; its result (or exception) as text."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(r)
        try:
            msg = f"ok {fn()}"
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            msg = f"{type(e).__name__}: {e}"
        os.write(w, msg.encode()[:4000])
        os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, out)
    return out


def _write_then_close(store):
    def fn():
        store.assign([3], np.full((1, DIM), 7.0, np.float32))
        store.flush()
        store.close()
        return "written"
    return fn


@pytest.mark.parametrize("read_only", [False, True])
def test_rocksdb_handle_in_forked_child_raises(tmp_path, read_only):
    url = f"rocksdb://{tmp_path}/db"
    with embstore.open(url, dim=DIM) as w:
        w.assign([1, 2], np.ones((2, DIM), np.float32))
    s = embstore.open(url, read_only=read_only)
    out = _in_child(lambda: s.lookup([1], insert=False).tolist())
    assert out.startswith("ForkedProcessError") and "forked child" in out, out
    if not read_only:
        out = _in_child(_write_then_close(s))
        assert out.startswith("ForkedProcessError"), out
        # the parent's handle is untouched by the child's attempt and its exit
        s.assign([4], np.ones((1, DIM), np.float32))
        assert len(s) == 3 and not s.contains([3])[0]
    s.close()
    with embstore.open(url, read_only=True) as r:
        assert len(r) == (3 if not read_only else 2)


def test_rocksdb_fork_error_is_the_documented_type():
    assert issubclass(ForkedProcessError, RuntimeError)


@pytest.fixture(params=["lmdb", "sqlite", "postgresql", "bigtable"])
def shared_url(request, tmp_path):
    if request.param == "lmdb":
        return f"lmdb://{tmp_path}/db"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/x.db"
    if request.param == "postgresql":
        return request.getfixturevalue("postgres_url_factory")()
    return request.getfixturevalue("bigtable_url_factory")()


def test_multi_process_backends_in_forked_child_write_for_real(shared_url):
    s = embstore.open(shared_url, dim=DIM)
    s.assign([1, 2], np.ones((2, DIM), np.float32))
    out = _in_child(_write_then_close(s))
    assert out == "ok written", out
    # the parent sees the child's row, and its own connection/environment still works
    np.testing.assert_array_equal(s.lookup([3], insert=False), np.full((1, DIM), 7.0))
    s.assign([4], np.ones((1, DIM), np.float32))
    assert sorted(k for ks, _ in s.items() for k in ks.tolist()) == [1, 2, 3, 4]
    assert s.backend.counters.get("reconnects", 0) == 0   # the child never touched its session
    s.close()


def test_a_backend_thread_pool_serves_a_forked_child():
    """A pool whose worker threads were started in the parent has none in a forked child: a
    plain ThreadPoolExecutor would queue the child's work forever (Bigtable's sharded calls)."""
    from embstore.backends.forks import ForkSafePool

    pool = ForkSafePool(1, "test-pool")
    assert pool.submit(lambda: 1).result(timeout=10) == 1   # a worker thread now exists
    out = _in_child(lambda: pool.submit(lambda: 5).result(timeout=10))
    assert out == "ok 5", out
    pool.shutdown()
