"""Crash consistency: a writer killed with SIGKILL at random moments loses no acknowledged batch
and never leaves one half-applied (real stores, real processes): the scenario is
:class:`~embstore.testing.conformance_crash.CrashConformance`, run here once per built-in backend
that runs kill loops (``tests/builtin_backends.py``), and a check of its verifier."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.testing.conformance_crash import CrashConformance
from embstore.testing.crash import keys_of, setup_store, verify_store
from tests.builtin_backends import conformance_tests

globals().update(conformance_tests(CrashConformance, lambda b: b.crash))


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
