"""No lost updates: several writers (processes and threads) on one store.

The cross-backend scenarios are
:class:`~embstore.testing.conformance_writers.SeveralWritersConformance`, run here once per
built-in backend (``tests/builtin_backends.py``); below them the checks specific to one backend
or layer (Bigtable's compare-and-set, write-back cache leases).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import embstore
from embstore.errors import LeaseLostError
from embstore.testing.conformance_writers import DIM, SeveralWritersConformance
from tests.builtin_backends import conformance_tests

globals().update(conformance_tests(SeveralWritersConformance))


def _options(kind: str) -> dict:
    opts: dict = {"dim": DIM, "optimizer": embstore.optim.SGD(lr=1.0), "initializer": "zeros"}
    if kind == "sqlite":
        opts["durable"] = False  # fsync per batch is not under test here
    return opts


def test_bigtable_conflicting_write_is_retried_not_lost(bigtable_url_factory):
    """A writer that changes a row between another writer's read and its compare-and-set
    makes that compare-and-set fail; the batch is re-read and re-applied, nothing is lost,
    and rows that already landed are not applied twice."""
    url = bigtable_url_factory()
    a = embstore.open(url, **_options("bigtable"))
    b = embstore.open(url, **_options("bigtable"))
    keys = np.arange(6, dtype=np.int64)
    a.update(keys, np.ones((6, DIM), np.float32))
    backend = a.backend
    calls = []
    real_modify = backend.modify

    def interfering(ks, fn):
        def wrapped(recs, found):
            calls.append(1)
            if len(calls) == 1:  # another writer slips in after this read
                b.update(keys[:2], np.full((2, DIM), 10, np.float32))
            return fn(recs, found)
        return real_modify(ks, wrapped)

    backend.modify = interfering
    a.update(keys, np.ones((6, DIM), np.float32))
    backend.modify = real_modify
    assert len(calls) == 2
    assert backend.stats()["cas_conflicts"] == 2
    recs, found = a.get_records(keys)
    assert found.all()
    np.testing.assert_array_equal(recs["vector"][:, 0], [-12, -12, -2, -2, -2, -2])
    np.testing.assert_array_equal(recs["count"], [3, 3, 2, 2, 2, 2])
    a.close()
    b.close()
    with embstore.open(url) as c:
        assert c.step == 3


def test_bigtable_without_check_and_set_is_a_single_writer_option(bigtable_url_factory):
    url = bigtable_url_factory()
    with embstore.open(url, check_and_set=False, **_options("bigtable")) as s:
        s.update(np.arange(3), np.ones((3, DIM), np.float32))
        assert "check_and_set" in s.backend.reopen_options()
        assert s.backend.stats().get("cas_conflicts", 0) == 0
    with embstore.open(url) as s:
        np.testing.assert_array_equal(s.lookup(np.arange(3))[:, 0], [-1, -1, -1])


def test_bigtable_compare_and_set_survives_lost_answers(bigtable_url_factory):
    """Transient errors on CheckAndMutateRow are retried, including ones raised *after* the
    server applied the mutation (the retry's predicate then fails): such a row is recognized
    on the re-read and not applied twice."""
    import grpc

    from embstore.testing.bigtable_emulator import InjectedRpcError

    class Faults(grpc.UnaryUnaryClientInterceptor):
        """The first 4 calls fail before reaching the server, the next 3 after it applied
        them (the answer is lost)."""

        def __init__(self) -> None:
            self.before = self.lost = 0
            self.armed = False
            self.lock = threading.Lock()  # calls come from several sender threads

        def intercept_unary_unary(self, continuation, details, request):
            if not (self.armed and details.method.endswith("CheckAndMutateRow")):
                return continuation(details, request)
            with self.lock:
                fail_before = self.before < 4
                self.before += fail_before
                lose = not fail_before and self.lost < 3
                self.lost += lose
            if fail_before:
                raise InjectedRpcError(grpc.StatusCode.UNAVAILABLE, "injected")
            out = continuation(details, request)
            if lose:
                out.result()  # the server applied it; the answer never arrives
                raise InjectedRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "answer lost")
            return out

    url = bigtable_url_factory()
    faults = Faults()
    with embstore.open(url, interceptors=[faults], **_options("bigtable")) as s:
        faults.armed = True
        keys = np.arange(5, dtype=np.int64)
        s.update(keys, np.ones((5, DIM), np.float32))
        s.update(keys, np.ones((5, DIM), np.float32))
        s.assign(keys[:1], np.full((1, DIM), 7, np.float32))
        assert faults.lost == 3 and faults.before == 4
        recs, found = s.get_records(keys)
        assert found.all()
        np.testing.assert_array_equal(recs["vector"][:, 0], [7, -2, -2, -2, -2])
        np.testing.assert_array_equal(recs["count"], [2, 2, 2, 2, 2])


# -- caches over a shared remote: one writer per key range, enforced --------------------------
def test_second_write_back_cache_on_the_same_keys_is_refused(tmp_path):
    from embstore._keys import key_hash64
    from embstore.layers.cache.lease import LeaseConflictError

    url = f"sqlite:///{tmp_path}/shared.db"
    embstore.open(url, **_options("sqlite")).close()
    a = embstore.open(url, cache="memory://", **_options("sqlite"))
    b = embstore.open(url, cache="memory://", **_options("sqlite"))
    a.update(np.arange(4), np.ones((4, DIM), np.float32))
    with pytest.raises(LeaseConflictError, match="writer_keys"):
        b.update(np.arange(4), np.ones((4, DIM), np.float32))
    assert b.lookup(np.arange(4), insert=False).shape == (4, DIM)  # reading is fine
    a.close()  # releases the lease
    b.update(np.arange(4), np.ones((4, DIM), np.float32))
    b.close()
    with embstore.open(url) as s:
        np.testing.assert_array_equal(s.get_records(np.arange(4))[0]["count"], [2] * 4)
        assert "writer_leases" not in s.meta

    # disjoint writer_keys: both write; a key of the other range is refused
    keys = np.arange(100, dtype=np.int64)
    owner = (key_hash64(keys) % np.uint64(2)).astype(np.int64)
    c0 = embstore.open(url, cache="memory://", writer_keys=(0, 2))
    c1 = embstore.open(url, cache="memory://", writer_keys=(1, 2))
    c0.update(keys[owner == 0], np.ones((int((owner == 0).sum()), DIM), np.float32))
    c1.update(keys[owner == 1], np.ones((int((owner == 1).sum()), DIM), np.float32))
    with pytest.raises(embstore.errors.InvalidInputError, match="route other keys"):
        c0.update(keys[owner == 1][:1], np.ones((1, DIM), np.float32))
    c0.close()
    c1.close()
    with embstore.open(url) as s:
        assert (s.get_records(keys)[0]["count"] >= 1).all()


def test_a_dead_writers_lease_expires(tmp_path):
    url = f"sqlite:///{tmp_path}/shared.db"
    embstore.open(url, **_options("sqlite")).close()
    a = embstore.open(url, cache="memory://", lease_seconds=0.2)
    a.update(np.arange(2), np.ones((2, DIM), np.float32))  # takes the lease, never closes
    import time

    time.sleep(0.3)
    with embstore.open(url, cache="memory://") as b:
        b.update(np.arange(2), np.ones((2, DIM), np.float32))
    # a comes back: its lease was taken over, so its rows must not overwrite b's (fenced)
    with pytest.raises(LeaseLostError, match="2 updated rows"):
        a.close()
    with embstore.open(url, read_only=True) as r:
        np.testing.assert_array_equal(r.get_records(np.arange(2))[0]["count"], [1, 1])


def test_metadata_merge_keeps_every_writers_share():
    """Unit check of the metadata merge: step summed, version max, expiry counter summed,
    tombstone logs united."""
    from embstore.engine.metadata_merge import merge_meta
    from embstore.policies.tombstones import TombstoneLog

    def tomb(keys, version):
        log = TombstoneLog("int64")
        log.add(np.asarray(keys, np.int64), version)
        return log.to_json()

    stored = {"step": 10, "version": 500, "key_type": "int64",
              "extra": {"policies": {"updates_since_expire": 7, "tombstones": tomb([1, 2], 400)}}}
    mine = {"step": 6, "version": 450, "key_type": "int64",
            "extra": {"policies": {"updates_since_expire": 3, "tombstones": tomb([9], 440)}}}
    out = merge_meta(stored, mine, steps=4, expire_updates=3)
    assert out["step"] == 14 and out["version"] == 500
    pol = out["extra"]["policies"]
    assert pol["updates_since_expire"] == 10
    log = TombstoneLog.from_json("int64", pol["tombstones"], 0)
    assert log.since(0)[0].tolist() == [1, 2, 9]
    # an expiry pass by this writer restarts the counter with its own count
    assert merge_meta(stored, mine, 4, None)["extra"]["policies"]["updates_since_expire"] == 3
    assert merge_meta(None, mine, 4, 3) == mine
