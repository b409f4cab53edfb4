"""The cache layer: conformance over real remotes (Bigtable emulator, LMDB), eviction, prefetch,
stats, options. Remote failures and multi-process use are in test_cache_faults.py."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest

import embstore
from embstore.errors import InvalidInputError
from embstore.layers.cache.backend import CachedBackend
from embstore.testing.conformance import (
    DIM,
    FULL_CONFORMANCE,
    LayoutMatrix,
    table_of,
)
from tests.cache_helpers import cached, cached_keys, cached_over_zeros, layer, remote_vectors


@pytest.fixture
def lmdb_url(tmp_path):
    counter = itertools.count()
    return lambda: f"lmdb://{tmp_path}/c{next(counter)}"


# -- conformance -----------------------------------------------------------------------------------
class TestCachedBigtableWriteBack(*FULL_CONFORMANCE):
    # capacity below the suite's 20k-key growth test: evictions of dirty rows are exercised
    open_options = {"cache": "memory://", "cache_capacity": 5000, "write_policy": "back"}

    @pytest.fixture
    def url_factory(self, bigtable_url_factory):
        return bigtable_url_factory


class TestCachedBigtableWriteThrough(*FULL_CONFORMANCE):
    open_options = {"cache": "memory://", "cache_capacity": 64, "write_policy": "through"}

    @pytest.fixture
    def url_factory(self, bigtable_url_factory):
        return bigtable_url_factory


class TestCachedLmdb(*FULL_CONFORMANCE):
    open_options = {"cache": "memory://", "cache_capacity": 100}

    @pytest.fixture
    def url_factory(self, lmdb_url):
        return lmdb_url


class TestCachedLmdbLayouts(LayoutMatrix, TestCachedLmdb):
    """The suite over 16-bit layouts."""


class TestCachedLmdbLru(*FULL_CONFORMANCE):
    open_options = {"cache": "memory://", "cache_capacity": 50, "cache_eviction": "lru"}

    @pytest.fixture
    def url_factory(self, lmdb_url):
        return lmdb_url


# -- eviction / capacity ---------------------------------------------------------------------------
def test_eviction_flushes_dirty_rows_in_one_batch():
    s = cached(cache_capacity=100)
    c = layer(s)
    vals = np.arange(400, dtype=np.float32).reshape(100, 4)
    s.assign(np.arange(100), vals)
    st = s.stats()
    assert st["dirty_rows"] == 100 and st["cache_rows"] == 100
    writes, calls = st["remote_writes"], st["remote_write_calls"]
    assert writes == 0, "write-back must not touch the remote before eviction/flush"
    s.assign(np.arange(100, 150), np.ones((50, 4)))
    st = s.stats()
    assert st["evictions"] == 50 and st["dirty_evictions"] == 50
    assert st["remote_writes"] == 50 and st["remote_write_calls"] == calls + 1
    assert st["cache_rows"] == 100
    # the evicted rows are on the remote with their values
    evicted = np.flatnonzero(~np.array(cached_keys(s, np.arange(100))))
    assert len(evicted) == 50
    got, found = remote_vectors(s, evicted)
    assert found.all()
    np.testing.assert_array_equal(got, vals[evicted])
    assert len(c.remote) == 50
    s.flush()
    assert s.stats()["dirty_rows"] == 0 and len(c.remote) == 150


def test_clean_evictions_write_nothing():
    remote = embstore.open("memory://", dim=4)
    remote.lookup(np.arange(30))
    s = embstore.EmbeddingStore(CachedBackend(remote.backend, capacity=10), dim=4)
    s.lookup(np.arange(10))
    s.lookup(np.arange(10, 20))  # all on the remote: 10 clean rows are evicted
    st = s.stats()
    assert st["evictions"] == 10 and st["dirty_evictions"] == 0 and st["remote_writes"] == 0
    assert st["cache_rows"] == 10


def test_capacity_respected_and_result_equals_uncached_store():
    rng = np.random.default_rng(0)
    ref = embstore.open("memory://", dim=4, optimizer=embstore.optim.SGD(lr=0.3))
    s = cached(cache_capacity=37, optimizer=embstore.optim.SGD(lr=0.3))
    for _ in range(60):
        keys = rng.integers(0, 200, size=rng.integers(1, 30))
        op = rng.integers(0, 4)
        if op == 0:
            np.testing.assert_array_equal(s.lookup(keys), ref.lookup(keys))
        elif op == 1:
            g = rng.standard_normal((len(keys), 4)).astype(np.float32)
            s.update(keys, g)
            ref.update(keys, g)
        elif op == 2:
            v = rng.standard_normal((len(keys), 4)).astype(np.float32)
            s.assign(keys, v)
            ref.assign(keys, v)
        else:
            assert s.delete(keys[:3]) == ref.delete(keys[:3])
        assert layer(s).stats()["cache_rows"] <= 37
    a, b = table_of(s), table_of(ref)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k]["vector"], b[k]["vector"])
        assert a[k]["count"] == b[k]["count"]


def test_batch_larger_than_capacity_goes_to_remote():
    s = cached(cache_capacity=8)
    vals = np.arange(100 * 4, dtype=np.float32).reshape(100, 4)
    s.assign(np.arange(100), vals)
    assert layer(s).stats()["cache_rows"] <= 8
    np.testing.assert_array_equal(s.lookup(np.arange(100), insert=False), vals)
    assert len(s) == 100


def test_lru_evicts_least_recently_used():
    s = cached(cache_capacity=3, cache_eviction="lru")
    for k in (1, 2, 3):
        s.lookup([k])
    s.lookup([1])      # 2 is now the least recently used
    s.lookup([4])
    assert cached_keys(s, [1, 2, 3, 4]) == [True, False, True, True]
    s.update([3], np.ones((1, 4)))  # touches 3 -> 1 is oldest
    s.lookup([5])
    assert cached_keys(s, [1, 3, 4, 5]) == [False, True, True, True]


def test_lfu_evicts_least_frequently_used():
    s = cached(cache_capacity=3, cache_eviction="lfu")
    s.lookup([1, 2, 3])
    for _ in range(3):
        s.lookup([1, 3])
    s.lookup([2])
    s.lookup([2])
    s.lookup([3])      # counts: 1 -> 4, 2 -> 3, 3 -> 5 (2 touched most recently, still evicted)
    s.lookup([9])
    assert cached_keys(s, [1, 2, 3, 9]) == [True, False, True, True]


def test_one_remote_get_per_lookup_batch(lmdb_url):
    url = lmdb_url()
    with embstore.open(url, dim=4) as plain:
        plain.lookup(np.arange(500))
    s = cached(url, cache_capacity=10_000)
    c = layer(s)
    keys = np.random.default_rng(1).integers(0, 1000, 4096)  # half known, many duplicates
    s.lookup(keys, insert=False)
    assert c.counters["remote_read_calls"] == 1
    assert c.counters["remote_reads"] == len(np.unique(keys))  # unique misses only
    s.lookup(keys, insert=False)  # known keys are cached now; unknown ones are asked again
    assert c.counters["remote_read_calls"] == 2


def test_stats_hit_rate_and_counters():
    s = cached(cache_capacity=1000)
    s.lookup(np.arange(100))            # 100 misses
    s.lookup(np.arange(100))            # 100 hits
    s.lookup(np.arange(50, 150))        # 50 hits, 50 misses
    st = s.stats()
    assert st["cache_hits"] == 150 and st["cache_misses"] == 150
    assert st["cache_hit_rate"] == pytest.approx(0.5)
    assert st["remote_read_calls"] == 2 and st["remote_reads"] == 150
    assert st["dirty_rows"] == 150 and st["cache_rows"] == 150 and st["cache_capacity"] == 1000
    assert st["evictions"] == 0 and st["remote_writes"] == 0
    s.flush()
    st = s.stats()
    assert st["dirty_rows"] == 0 and st["remote_writes"] == 150


def test_write_through_writes_remote_before_returning(lmdb_url):
    s = cached(lmdb_url(), write_policy="through", cache_capacity=100)
    s.assign([1, 2], np.full((2, 4), 7.0))
    got, found = remote_vectors(s, [1, 2])
    assert found.all() and (got == 7.0).all()
    assert s.stats()["dirty_rows"] == 0


def test_metadata_goes_through_to_remote(lmdb_url):
    url = lmdb_url()
    s = cached(url, cache_capacity=10)
    s.update([1], np.ones((1, 4)))
    s.flush()
    assert layer(s).remote.read_meta()["step"] == 1
    s.close()
    plain = embstore.open(url)
    assert plain.step == 1 and len(plain) == 1


def test_pickle_keeps_cache_options(lmdb_url):
    s = cached(lmdb_url(), cache_capacity=33, write_policy="through")
    s.assign([5], np.ones((1, 4)))
    clone = pickle.loads(pickle.dumps(s))
    try:
        c = layer(clone)
        assert c.capacity == 33 and c.write_policy == "through"
        np.testing.assert_array_equal(clone.lookup([5], insert=False), np.ones((1, 4)))
    finally:
        clone.close()


def test_disk_cache_over_remote(lmdb_url, tmp_path):
    """A non-memory local store uses the private slot index (generic path)."""
    local = f"lmdb://{tmp_path}/localcache"
    s = embstore.open(lmdb_url(), dim=4, cache=local, cache_capacity=20)
    vals = np.arange(50 * 4, dtype=np.float32).reshape(50, 4)
    s.assign(np.arange(50), vals)
    np.testing.assert_array_equal(s.lookup(np.arange(50)), vals)
    assert layer(s).stats()["cache_rows"] <= 20
    assert len(s) == 50


def test_bad_options_raise():
    with pytest.raises(InvalidInputError):
        cached(write_policy="sideways")
    with pytest.raises(InvalidInputError):
        cached(cache_capacity=0)
    with pytest.raises(InvalidInputError):
        cached(cache_eviction="random")
    with pytest.raises(InvalidInputError):
        embstore.open("memory://", dim=4, cache_capacity=10)  # without cache=


# -- prefetch --------------------------------------------------------------------------------------
def test_prefetch_loads_next_batch_without_remote_calls_in_lookup(lmdb_url):
    url = lmdb_url()
    with embstore.open(url, dim=4) as plain:
        vals = np.random.default_rng(0).standard_normal((1000, 4)).astype(np.float32)
        plain.assign(np.arange(1000), vals)
    s = cached(url, cache_capacity=2000)
    c = layer(s)
    c.prefetch(np.arange(500, 900))
    c.wait_prefetch()
    calls = c.counters["remote_read_calls"]
    np.testing.assert_array_equal(s.lookup(np.arange(500, 900)), vals[500:900])
    assert c.counters["remote_read_calls"] == calls
    assert c.counters["prefetched_rows"] == 400


def test_prefetch_never_overrides_newer_writes(lmdb_url):
    s, c = cached_over_zeros(lmdb_url, 200, 50)
    for i in range(30):
        keys = np.arange(200)[(np.arange(200) + i) % 7 == 0]
        c.prefetch(keys)
        s.assign(keys[:5], np.full((5, 4), float(i + 1)))  # races with the prefetch
        s.delete(keys[5:7])
        np.testing.assert_array_equal(s.lookup(keys[:5], insert=False),
                                      np.full((5, 4), float(i + 1), np.float32))
        assert not s.contains(keys[5:7]).any()
    c.wait_prefetch()
    assert c.stats()["cache_rows"] <= 50


def test_training_with_prefetch_equals_plain_training(lmdb_url):
    rng = np.random.default_rng(5)
    batches = [rng.zipf(1.3, 256) % 3000 for _ in range(25)]
    grads = [rng.standard_normal((256, 4)).astype(np.float32) for _ in range(25)]
    ref = embstore.open("memory://", dim=4)
    s = cached(lmdb_url(), cache_capacity=300)
    c = layer(s)
    for t, (keys, g) in enumerate(zip(batches, grads)):
        for store in (ref, s):
            store.lookup(keys)
        if t + 1 < len(batches):
            c.prefetch(batches[t + 1])   # loads while "the step computes"
        for store in (ref, s):
            store.update(keys, g)
    a, b = table_of(s), table_of(ref)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k]["vector"], b[k]["vector"])


# -- eviction bookkeeping, overlapped reads, write-behind batching ---------------------------------
def test_lfu_history_survives_eviction():
    from embstore.layers.cache.slots import SlotTable

    st = SlotTable("int64", "lfu", capacity=4)
    slots, keys = np.array([0, 1], np.uint32), np.array([10, 11], np.int64)
    st.next_tick()
    st.add(slots, keys, dirty=False)
    for _ in range(5):
        st.next_tick()
        st.touch(slots[:1])                 # key 10 is warm
    st.remember(keys, slots)
    st.remove(slots)
    assert st.live == 0
    st.next_tick()
    st.add(np.array([2, 3], np.uint32), keys, dirty=False)
    assert st.freq[2] == 7 and st.freq[3] == 2  # resumed from the history, plus this use
    st.next_tick()
    assert st.victims(1).tolist() == [3]


def test_prefetch_never_evicts_the_batch_being_computed(lmdb_url):
    """The prefetch makes room among older rows only: the rows of the caller's latest lookup
    (whose update comes next) stay cached even when that leaves less room than asked for."""
    s, c = cached_over_zeros(lmdb_url, 2000, 100)
    s.lookup(np.arange(1000, 1050))            # older rows
    s.lookup(np.arange(50))                    # the batch being computed
    c.prefetch(np.arange(200, 280))            # 80 rows, room for 50
    c.wait_prefetch()
    assert all(cached_keys(s, np.arange(50)))
    assert not any(cached_keys(s, np.arange(1000, 1050)))
    assert c.counters["prefetched_rows"] == 50 and c.stats()["cache_rows"] == 100
    calls = c.counters["remote_read_calls"]
    s.update(np.arange(50), np.ones((50, 4), np.float32))
    assert c.counters["remote_read_calls"] == calls


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_victim_pool_picks_what_a_full_scan_picks(eviction):
    """Victims come from a candidate pool refreshed every few calls; on a random workload of
    touches, evictions (some with an earlier cutoff, as the prefetch asks) and inserts, the
    chosen slots always score exactly like the ``need`` lowest of a full scan."""
    from embstore.layers.cache.slots import SlotTable

    rng = np.random.default_rng(7)
    cap = 2000
    st = SlotTable("int64", eviction, cap)
    free, next_key, rebuilds = list(range(cap)), 0, 0
    build = st._build_pool

    def counting_build(need):
        nonlocal rebuilds
        rebuilds += 1
        build(need)

    st._build_pool = counting_build
    for _ in range(300):
        st.next_tick()
        occ = np.flatnonzero(st.stamp > 0)
        if len(occ):
            st.touch(rng.choice(occ, min(len(occ), 300)).astype(np.uint32))  # with repeats
        m = int(rng.integers(1, 150))
        need = st.live + m - cap
        if need > 0:
            before = st.tick - int(rng.integers(0, 3)) if rng.random() < 0.2 else None
            cutoff = st.tick if before is None else before
            v = st.victims(need, before)
            cand = np.flatnonzero((st.stamp > 0) & (st.stamp < cutoff))
            assert len(v) == min(need, len(cand)) and len(np.unique(v)) == len(v)
            assert ((st.stamp[v] > 0) & (st.stamp[v] < cutoff)).all()
            np.testing.assert_array_equal(np.sort(st._score(v.astype(np.intp))),
                                          np.sort(st._score(cand))[:len(v)])
            st.remember(st.keys[v], v)
            st.remove(v)
            free += v.tolist()
        k = min(m, len(free))
        rng.shuffle(free)
        slots, free = np.array(free[:k], np.uint32), free[k:]
        st.add(slots, np.arange(next_key, next_key + k, dtype=np.int64) % 3000, dirty=False)
        next_key += k
    assert rebuilds < 150  # the full scan is not paid on every eviction


def test_lfu_counts_each_occurrence_off_the_hit_path():
    from embstore.layers.cache.slots import SlotTable

    st = SlotTable("int64", "lfu", capacity=8)
    st.next_tick()
    st.add(np.array([0, 1], np.uint32), np.array([10, 11], np.int64), dirty=False)
    st.next_tick()
    st.touch(np.array([0, 0, 1], np.uint32))      # a key twice in one lookup: two uses
    assert st.freq[0] == 1 and len(st._uses) == 1  # not counted yet
    st.count_uses()
    assert st.freq[0] == 3 and st.freq[1] == 2 and not st._uses
    for _ in range(200):                           # a long run of hits stays bounded
        st.touch(np.array([1], np.uint32))
    assert len(st._uses) < 64
    st.count_uses()
    assert st.freq[1] == 202


def test_write_behind_sends_queued_batches_in_one_put():
    """While the writer is busy, queued evictions pile up; it then writes them all in one
    remote put, a key evicted twice only with its later row."""
    import threading

    from embstore.backends.memory import MemoryBackend
    from embstore.layers.cache.write_behind import WriteBehind
    from embstore.layout import Layout

    lay = Layout(DIM)
    target = MemoryBackend()
    target.bind(lay, "int64")
    gate, calls = threading.Event(), []

    def put(keys, recs):
        gate.wait(30)
        calls.append(keys.copy())
        target.put(keys, recs)

    def rows(keys, v):
        r = lay.empty(len(keys))
        r["vector"] = v
        return np.asarray(keys, np.int64), r

    wb = WriteBehind(put, max_pending=5)
    wb.submit(*rows([1, 2], 1.0))
    for _ in range(200):                # the writer took batch 1 and waits on the gate
        if wb._busy:
            break
        threading.Event().wait(0.01)
    wb.submit(*rows([3, 7], 2.0))
    wb.submit(*rows([7, 8], 3.0))
    assert len(wb) == 6
    gate.set()
    wb.drain()
    wb.close()
    assert [c.tolist() for c in calls] == [[1, 2], [3, 7, 8]]
    recs, found = target.get(np.array([1, 2, 3, 7, 8], np.int64))
    assert found.all()
    np.testing.assert_array_equal(recs["vector"][:, 0], [1, 1, 2, 3, 3])


def test_put_after_get_probes_again_when_rows_changed_in_between():
    """update() is get(keys) then put(same array): put reuses get's slots only while no row
    came or went; a delete in between makes it look the keys up again."""
    s = cached(cache_capacity=100)
    c = layer(s)
    keys = np.arange(10, dtype=np.int64)
    s.assign(keys, np.zeros((10, 4)))
    recs, found = c.get(keys)
    assert found.all()
    c.delete(keys[3:4])                  # key 3's slot is gone (and may be reused)
    c.put(np.arange(100, 102, dtype=np.int64), s.layout.empty(2))
    recs["vector"] = np.arange(10, dtype=np.float32)[:, None]
    c.put(keys, recs)
    got, found = c.get(keys)
    assert found.all()
    np.testing.assert_array_equal(got["vector"][:, 0], np.arange(10))
    assert not c.get(np.arange(100, 102, dtype=np.int64))[0]["vector"].any()
    recs["vector"] += 1                  # the same array again, nothing changed: fast path
    c.get(keys)
    c.put(keys, recs)
    np.testing.assert_array_equal(c.get(keys)[0]["vector"][:, 0], np.arange(1, 11))


def test_prefetch_makes_room_ahead_and_fills_the_cache_exactly(lmdb_url):
    s, c = cached_over_zeros(lmdb_url, 300, 100)
    s.lookup(np.arange(100))                  # full
    s.lookup(np.arange(50))                   # the batch being computed
    c.prefetch(np.arange(200, 230))
    c.wait_prefetch()
    st = c.stats()
    assert st["cache_rows"] == 100 and st["evictions"] == 30 and st["prefetched_rows"] == 30
    assert all(cached_keys(s, np.arange(200, 230))) and all(cached_keys(s, np.arange(50)))


# -- in-place steps on cached rows --------------------------------------------------------------
def test_sgd_steps_on_cached_rows_apply_in_place_and_match_an_uncached_store(lmdb_url):
    # A write-back cache over a memory:// local store steps cached rows where they sit; a batch
    # mixing cached rows, rows only in the remote and new keys ends as on an uncached store.
    url = lmdb_url()
    rng = np.random.default_rng(3)
    start = rng.standard_normal((30, 4)).astype(np.float32)
    with embstore.open(url, dim=4, optimizer=embstore.optim.SGD(lr=0.5)) as plain:
        plain.assign(np.arange(30), start)
    s = cached(url, cache_capacity=20, optimizer=embstore.optim.SGD(lr=0.5))
    ref = embstore.open("memory://", dim=4, optimizer=embstore.optim.SGD(lr=0.5))
    ref.assign(np.arange(30), start)
    c = layer(s)
    assert c.supports_row_update
    s.lookup(np.arange(10), insert=False)                  # rows 0..9 now cached
    grads = rng.standard_normal((10, 4)).astype(np.float32)
    hits = c.counters["cache_hits"]
    s.update(np.arange(10), grads)
    ref.update(np.arange(10), grads)
    assert c.counters["cache_hits"] == hits + 10
    np.testing.assert_array_equal(remote_vectors(s, np.arange(10))[0], start[:10])  # not yet
    assert s.stats()["dirty_rows"] == 10
    mixed = np.array([3, 25, 40, 7, 41])                   # cached, remote only, new
    g2 = rng.standard_normal((5, 4)).astype(np.float32)
    s.update(mixed, g2, counts=[1, 2, 3, 4, 5])
    ref.update(mixed, g2, counts=[1, 2, 3, 4, 5])
    keys = np.arange(42)
    np.testing.assert_array_equal(s.lookup(keys, insert=False), ref.lookup(keys, insert=False))
    np.testing.assert_array_equal(s.get_records(keys)[0]["count"],
                                  ref.get_records(keys)[0]["count"])
    s.flush()
    remote, found = remote_vectors(s, keys)
    assert found.tolist() == ref.contains(keys).tolist()
    np.testing.assert_array_equal(remote[found], ref.lookup(keys[found], insert=False))
    s.close()
    ref.close()


def test_write_through_and_disk_caches_keep_the_general_step_path(lmdb_url, tmp_path):
    through = cached(lmdb_url(), write_policy="through")
    disk = cached(lmdb_url(), cache=f"lmdb://{tmp_path}/local")
    for s in (through, disk):
        assert not layer(s).supports_row_update
        s.assign([1], np.ones((1, 4)))
        s.update([1], np.ones((1, 4)))
        np.testing.assert_allclose(s.lookup([1], insert=False), np.full((1, 4), 1 - 0.01),
                                   rtol=1e-6)
    np.testing.assert_allclose(remote_vectors(through, [1])[0], np.full((1, 4), 0.99),
                               rtol=1e-6)                  # written before the call returned
    through.close()
    disk.close()
