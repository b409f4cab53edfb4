"""The cache layer when the remote fails: a killed Bigtable emulator, injected gRPC faults,
writes that cannot land, and two processes sharing one Bigtable table through their caches."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

import embstore
from embstore.errors import BackendError
from embstore.testing.conformance import DIM, table_of
from tests.cache_helpers import cached_keys, layer


def remote_deadline(store: embstore.EmbeddingStore, seconds: float) -> None:
    """Set how long the remote retries: short only while a fault is on (so the failure comes
    quickly), generous otherwise (so a loaded machine cannot turn healthy calls into failures)."""
    layer(store).remote.retry_deadline = seconds


def assert_remote_matches(url: str, ref: embstore.EmbeddingStore, **open_kw) -> None:
    """The store at ``url`` holds exactly ``ref``'s keys, with the same vectors."""
    with embstore.open(url, **open_kw) as plain:
        a, b = table_of(plain), table_of(ref)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k]["vector"], b[k]["vector"])


# -- a remote that fails ---------------------------------------------------------------------------
def _train(store, keys, t):
    g = np.full((len(keys), DIM), 0.01 * (t + 1), np.float32)
    store.lookup(keys)
    store.update(keys, g)


def test_killed_emulator_loses_no_acknowledged_write(bigtable_private_emulator):
    """Guarantee: rows written since the last successful flush stay dirty in the cache until
    the remote confirms them; after the remote lost everything, resync() rewrites every cached
    row, so with a cache that holds the working set nothing acknowledged is lost."""
    emu = bigtable_private_emulator
    url = "bigtable://p/i/fault"
    opts = dict(cache="memory://", cache_capacity=10_000, emulator_host=emu.host)
    ref = embstore.open("memory://", dim=DIM)
    s = embstore.open(url, dim=DIM, **opts)
    keys = np.arange(300)
    for t in range(3):
        for store in (ref, s):
            _train(store, keys, t)
    s.flush()
    for store in (ref, s):
        _train(store, keys[:100], 3)          # acknowledged, dirty, not flushed
    remote_deadline(s, 1.0)
    emu.stop()
    with pytest.raises(BackendError, match="gave up|cannot reach|failed"):
        s.flush()
    assert layer(s).stats()["dirty_rows"] == 100   # still held for a later flush
    with pytest.raises(BackendError):
        s.lookup(np.arange(1000, 1010))       # a miss needs the remote: clear error
    for store in (ref, s):                    # cached keys keep training during the outage
        _train(store, keys[:50], 4)
    emu.restart()                             # fresh and empty
    remote_deadline(s, 30.0)
    for store in (ref, s):                    # training continues, new keys included
        _train(store, np.arange(250, 350), 5)
    assert s.backend.resync() == len(ref)
    s.close()
    plain = embstore.open(url, emulator_host=emu.host)
    try:
        a, b = table_of(plain), table_of(ref)
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k]["vector"], b[k]["vector"])
            assert a[k]["count"] == b[k]["count"]
    finally:
        plain.close()


def test_write_through_failure_leaves_cache_unchanged(bigtable_private_emulator):
    emu = bigtable_private_emulator
    s = embstore.open("bigtable://p/i/wt", dim=DIM, cache="memory://", write_policy="through",
                      emulator_host=emu.host)
    s.assign([1, 2], np.ones((2, DIM)))
    remote_deadline(s, 0.5)
    emu.stop()
    with pytest.raises(BackendError):
        s.assign([1, 2], np.full((2, DIM), 5.0))
    np.testing.assert_array_equal(s.lookup([1, 2], insert=False), np.ones((2, DIM)))
    emu.restart()
    remote_deadline(s, 30.0)
    s.backend.resync()
    s.assign([1], np.full((1, DIM), 5.0))
    s.close()
    with embstore.open("bigtable://p/i/wt", emulator_host=emu.host) as plain:
        np.testing.assert_array_equal(plain.lookup([1, 2], insert=False),
                                      np.array([[5.0] * DIM, [1.0] * DIM], np.float32))


# -- two processes on one table --------------------------------------------------------------------
def _owned_keys(rank: int) -> np.ndarray:
    """300 keys owned by ``rank`` of 2 (``key_hash64(k) % 2 == rank``)."""
    from embstore._keys import key_hash64

    cand = np.arange(rank * 10_000, rank * 10_000 + 2_000, dtype=np.int64)
    return cand[key_hash64(cand) % np.uint64(2) == np.uint64(rank)][:300]


def _worker(url: str, host: str, lo: int, steps: int) -> None:
    rank = lo // 10_000
    keys = _owned_keys(rank)
    # each cache declares the keys it writes: their leases do not overlap
    with embstore.open(url, cache="memory://", cache_capacity=120, emulator_host=host,
                       writer_keys=(rank, 2)) as s:
        for t in range(steps):
            batch = keys[(np.arange(300) * 7 + t * 31) % 300][:100]
            s.lookup(batch)
            s.update(batch, np.full((100, DIM), 0.01 * (t + 1) + lo, np.float32))


def test_two_processes_disjoint_ranges_share_one_table(bigtable_emulator, bigtable_url_factory):
    url = bigtable_url_factory()
    host = bigtable_emulator.host
    embstore.open(url, dim=DIM, emulator_host=host).close()
    ctx = multiprocessing.get_context("spawn")
    steps = 6
    procs = [ctx.Process(target=_worker, args=(url, host, lo, steps)) for lo in (0, 10_000)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    ref = embstore.open("memory://", dim=DIM)
    for lo in (0, 10_000):
        keys = _owned_keys(lo // 10_000)
        for t in range(steps):
            batch = keys[(np.arange(300) * 7 + t * 31) % 300][:100]
            ref.lookup(batch)
            ref.update(batch, np.full((100, DIM), 0.01 * (t + 1) + lo, np.float32))
    with embstore.open(url, emulator_host=host) as plain:
        a, b = table_of(plain), table_of(ref)
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k]["vector"], b[k]["vector"])
            assert a[k]["count"] == b[k]["count"]


def test_write_behind_failure_keeps_evicted_rows(bigtable_url_factory):
    """Evicted dirty rows written in the background are kept until the remote confirms them;
    MutateRows failures (injected in front of the real emulator) surface on flush()."""
    from embstore.testing.bigtable_emulator import FaultInjector

    url = bigtable_url_factory()
    inj = FaultInjector(failures=0, methods=["MutateRows"])
    s = embstore.open(url, dim=DIM, cache="memory://", cache_capacity=50, interceptors=[inj])
    ref = embstore.open("memory://", dim=DIM)
    for store in (ref, s):
        _train(store, np.arange(50), 0)
    remote_deadline(s, 0.3)
    inj.failures = 10**9                      # every write fails from now on
    for store in (ref, s):
        _train(store, np.arange(50, 100), 1)  # evicts the 50 dirty rows of keys 0..49
    with pytest.raises(BackendError):
        s.flush()
    st = layer(s).stats()
    assert st["pending_rows"] + st["dirty_rows"] == 100 and st["cache_rows"] == 50
    remote_deadline(s, 30.0)
    inj.failures = 0                          # the remote recovers
    s.close()
    assert_remote_matches(url, ref)


def _full_dirty_cache(url, remote_keys, method):
    """A cache over Bigtable whose ``len(remote_keys)`` rows are all dirty (keys 0..n-1),
    a memory:// reference trained alike, and a fault injector (off) on ``method`` calls.
    ``remote_keys`` exist on the remote with vectors of ones; the remote deadline is short."""
    from embstore.testing.bigtable_emulator import FaultInjector

    n = len(remote_keys)
    with embstore.open(url, dim=DIM) as plain:
        plain.assign(remote_keys, np.ones((n, DIM)))
    inj = FaultInjector(failures=0, methods=[method])
    s = embstore.open(url, cache="memory://", cache_capacity=n, interceptors=[inj])
    ref = embstore.open("memory://", dim=DIM)
    ref.assign(remote_keys, np.ones((n, DIM)))
    for store in (ref, s):
        _train(store, np.arange(n), 0)            # n dirty rows fill the cache
    remote_deadline(s, 0.3)
    return s, layer(s), ref, inj


def test_rows_pending_in_write_behind_are_read_back_without_the_remote(bigtable_url_factory):
    """A miss on a row evicted dirty whose background write has not landed takes the row from
    the writer's queue (no remote read, no wait for the writer); it comes back dirty and
    reaches the remote on close."""
    url = bigtable_url_factory()
    s, c, ref, inj = _full_dirty_cache(url, np.arange(100, 150), "MutateRows")
    inj.failures = 10**9                          # background writes cannot land now
    s.lookup(np.arange(100, 150))                 # clean rows evict the 50 dirty ones
    assert c.stats()["pending_rows"] == 50 and cached_keys(s, [0, 49]) == [False, False]
    calls = c.counters["remote_read_calls"]
    np.testing.assert_array_equal(s.lookup(np.arange(50), insert=False),
                                  ref.lookup(np.arange(50)))
    assert c.counters["remote_read_calls"] == calls
    assert c.stats()["dirty_rows"] == 50          # back in the cache, still owed to the remote
    for store in (ref, s):
        _train(store, np.arange(50), 1)
    remote_deadline(s, 30.0)
    inj.failures = 0                              # the remote recovers
    s.close()
    assert_remote_matches(url, ref)


def test_failed_miss_read_after_making_room_loses_nothing(bigtable_url_factory):
    """With a thread-safe remote a lookup's misses are read on a helper thread while room is
    made for them (dirty victims go to the write-behind). When that read fails the lookup
    raises, and the evicted rows still reach the remote."""
    url = bigtable_url_factory()
    s, c, ref, inj = _full_dirty_cache(url, np.arange(1000, 1100), "ReadRows")
    inj.failures = 10**9
    with pytest.raises(BackendError):
        s.lookup(np.arange(1000, 1100))           # 100 misses: read on the helper thread
    assert c.counters["evictions"] == 100
    remote_deadline(s, 30.0)
    inj.failures = 0
    for store in (ref, s):
        _train(store, np.arange(1000, 1100), 1)
    s.close()
    assert_remote_matches(url, ref)
