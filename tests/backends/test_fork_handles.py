"""A store handle used in a child made by fork(): an error, or writes that really land.

Before: a RocksDB handle in a forked child reported success and lost the writes; a
PostgreSQL handle in the child used (and on close, ended) the parent's connection. The
scenarios are :class:`~embstore.testing.conformance_fork.ForkConformance`, run here once per
built-in backend (``tests/builtin_backends.py``).
"""

from __future__ import annotations

from embstore.errors import ForkedProcessError
from embstore.testing.conformance_fork import ForkConformance, in_child
from tests.builtin_backends import conformance_tests

globals().update(conformance_tests(ForkConformance, lambda b: b.fork_writes is not None))


def test_rocksdb_fork_error_is_the_documented_type():
    assert issubclass(ForkedProcessError, RuntimeError)


def test_a_backend_thread_pool_serves_a_forked_child():
    """A pool whose worker threads were started in the parent has none in a forked child: a
    plain ThreadPoolExecutor would queue the child's work forever (Bigtable's sharded calls)."""
    from embstore.backends.forks import ForkSafePool

    pool = ForkSafePool(1, "test-pool")
    assert pool.submit(lambda: 1).result(timeout=10) == 1   # a worker thread now exists
    out = in_child(lambda: pool.submit(lambda: 5).result(timeout=10))
    assert out == "ok 5", out
    pool.shutdown()
