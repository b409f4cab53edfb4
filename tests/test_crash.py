"""Crash consistency: a writer killed with SIGKILL at random moments loses no acknowledged batch
and never leaves one half-applied (real stores, real processes)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import embstore
from embstore.testing.crash import keys_of, run_crash_trials, setup_store, verify_store

TRIALS = 8


def _url(backend: str, tmp_path, request) -> str:
    if backend == "lmdb":
        return f"lmdb://{tmp_path}/store"
    if backend == "rocksdb":
        return f"rocksdb://{tmp_path}/store"
    if importlib.util.find_spec("embstore.backends.sql.backend") is None:
        pytest.skip("the SQL backend (embstore/backends/sql.py) is not available")
    if backend == "sqlite":
        return f"sqlite:///{tmp_path}/store.db"
    try:
        factory = request.getfixturevalue("postgres_url_factory")
    except pytest.FixtureLookupError:
        pytest.skip("the postgres_url_factory fixture (tests/fixtures_postgres.py) is missing")
    return factory()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["lmdb", "rocksdb", "sqlite", "postgres"])
def test_sigkill_never_loses_acknowledged_or_half_applies(backend, tmp_path, request):
    url = _url(backend, tmp_path, request)
    report = run_crash_trials(url, trials=TRIALS, options={"durable": True},
                              seed=len(backend))
    assert report.trials == TRIALS
    assert report.batches_acked > 0, "no batch was acknowledged: the test proved nothing"
    # The store is still a normal, writable store afterwards.
    with embstore.open(url, optimizer=embstore.optim.SGD(lr=1.0), durable=True) as s:
        s.assign([10_000], np.ones((1, s.dim)))
        assert len(s) == 513


def test_verifier_detects_half_applied_and_lost_batches(tmp_path):
    url = f"lmdb://{tmp_path}/store"
    kw = dict(dim=4, keyspace=128, batch=16)
    setup_store(url, dim=4, keyspace=128)
    values = np.zeros(128, dtype=np.int64)
    opts = {"optimizer": embstore.optim.SGD(lr=1.0)}
    with embstore.open(url, **opts) as s:
        k0 = keys_of(0, 128, 16)
        s.assign(k0, np.zeros((16, 4)))  # batch 0 writes value 0: state unchanged
    assert verify_store(url, values, -1, 0, options={}, **kw) is False
    # Batch 1 half applied: half of its keys hold 1.
    with embstore.open(url, **opts) as s:
        k1 = keys_of(1, 128, 16)
        s.assign(k1[:8], np.ones((8, 4)))
    with pytest.raises(AssertionError, match="half-applied"):
        verify_store(url, values, 0, 0, options={}, **kw)
    # Batch 1 complete but acknowledged batch 2 missing: a lost acknowledged write.
    with embstore.open(url, **opts) as s:
        s.assign(k1, np.ones((16, 4)))
    assert verify_store(url, values, 0, 0, options={}, **kw) is True
    with pytest.raises(AssertionError, match="matches neither"):
        verify_store(url, values, 2, 0, options={}, **kw)
    # A torn record (dimensions disagree) is reported as such.
    with embstore.open(url, **opts) as s:
        s.assign([5], np.array([[1.0, 2.0, 3.0, 4.0]]))
    with pytest.raises(AssertionError, match="torn"):
        verify_store(url, values, 0, 0, options={}, **kw)
