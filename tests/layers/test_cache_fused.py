"""The fused bag path through a cache layer (``embstore.layers.cache.bags``): the conformance
area over caches on LMDB, SQLite and the Bigtable emulator, and what only a cache has: rows
evicted, flushed, read back, more ids in a batch than it holds, write-through and a disk cache
(the general path), and the writer lease."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

import embstore
from embstore.backends.memory import MemoryBackend
from embstore.engine.fused import bag_batch
from embstore.errors import InvalidInputError, LeaseLostError
from embstore.layers.cache import CachedBackend
from embstore.layers.cache import bags as cache_bags
from embstore.layers.cache.lease import modify_leases
from embstore.optim import SGD, Adagrad
from embstore.testing.conformance_fused import FusedBagConformance, pooled_reference


@pytest.fixture
def lmdb_url(tmp_path):
    counter = itertools.count()
    return lambda: f"lmdb://{tmp_path}/f{next(counter)}"


@pytest.fixture
def sqlite_url(tmp_path):
    counter = itertools.count()
    return lambda: f"sqlite:///{tmp_path}/f{next(counter)}.db"


# -- the conformance area --------------------------------------------------------------------------
class Offered(FusedBagConformance):
    offers_fused = True  # each store here must pool in place: a refusal fails


class TestMemoryFused(Offered):
    """The area on a plain memory:// store, the path the cache must match."""

    @pytest.fixture
    def url_factory(self):
        return lambda: "memory://"


class TestCachedLmdbFused(Offered):
    # fewer rows than the run touches: dirty rows are evicted and read back between steps
    open_options = {"cache": "memory://", "cache_capacity": 64}

    @pytest.fixture
    def url_factory(self, lmdb_url):
        return lmdb_url


class TestCachedLmdbLruFused(Offered):
    open_options = {"cache": "memory://", "cache_capacity": 10_000, "cache_eviction": "lru"}

    @pytest.fixture
    def url_factory(self, lmdb_url):
        return lmdb_url


class TestCachedSqliteFused(Offered):
    open_options = {"cache": "memory://", "cache_capacity": 64}

    @pytest.fixture
    def url_factory(self, sqlite_url):
        return sqlite_url


class TestCachedBigtableFused(Offered):
    open_options = {"cache": "memory://", "cache_capacity": 64, "write_behind": False}

    @pytest.fixture
    def url_factory(self, bigtable_url_factory):
        return bigtable_url_factory


class TestCachedBigtableWriteBehindFused(Offered):
    # evicted dirty rows in flight on the write-behind thread: read back from its queue or,
    # once landed, from the emulator, as the thread's timing has it
    open_options = {"cache": "memory://", "cache_capacity": 64}
    timed_counters = ("remote_reads", "remote_read_calls", "remote_writes",
                      "remote_write_calls", "pending_rows", "write_behind_waits",
                      "remote.rows_read", "remote.remote_reads", "remote.rows_written",
                      "remote.remote_writes")

    @pytest.fixture
    def url_factory(self, bigtable_url_factory):
        return bigtable_url_factory


# -- what only a cache has ------------------------------------------------------------------------
DIM = 8


def _open(url: str, **kw) -> embstore.EmbeddingStore:
    kw.setdefault("cache", "memory://")
    kw.setdefault("optimizer", Adagrad(lr=0.1, rowwise=True))
    return embstore.open(url, dim=DIM, seed=7, stochastic_rounding=False, **kw)


def _layer(store: embstore.EmbeddingStore) -> CachedBackend:
    assert isinstance(store.backend, CachedBackend)
    return store.backend


@pytest.fixture
def spied(monkeypatch):
    """What ran, by name: the cache's general update (``update_rows`` / ``modify``), the
    fused step on the cached rows (``step_slots:<its result>``) and the pooling of rows that
    did not all fit in the cache (``apart``)."""
    calls: list[str] = []

    def spy(owner, name, record):
        real = getattr(owner, name)

        def wrapper(*a, **k):
            out = real(*a, **k)
            calls.append(record(out))
            return out

        monkeypatch.setattr(owner, name, wrapper)

    spy(CachedBackend, "update_rows", lambda _: "update_rows")
    spy(CachedBackend, "modify", lambda _: "modify")
    spy(MemoryBackend, "step_slots", lambda done: f"step_slots:{done}")
    spy(cache_bags, "_pool_apart", lambda _: "apart")
    return calls


def test_a_cached_batch_takes_the_fused_step_and_marks_its_rows_dirty(lmdb_url, spied):
    s = _open(lmdb_url(), cache_capacity=1000)
    assert s.fused_bags()
    ids = np.array([[1, 2, 3], [3, 4, 5]])
    out, batch = s.pool_bags(ids)
    st = s.stats()
    assert st["cache_misses"] == 5 and st["dirty_rows"] == 5 and st["remote_writes"] == 0
    s.flush()
    assert s.stats()["dirty_rows"] == 0 and s.stats()["remote_writes"] == 5
    reads = s.stats()["remote_reads"]
    out, batch = s.pool_bags(ids)  # every row cached: the hit path
    assert s.stats()["cache_hits"] == 5 and s.stats()["remote_reads"] == reads
    s.update_bags(batch, np.ones_like(out))
    assert spied == ["step_slots:True"]  # the fused step, not update_rows or modify
    st = s.stats()
    assert st["dirty_rows"] == 5 and st["cache_hits"] == 10 and st["updates"] == 5
    remote, found = _layer(s).remote.get(batch.uniq)
    cached, _ = s.get_records(batch.uniq)
    assert found.all() and not np.array_equal(remote["vector"], cached["vector"])
    s.flush()
    remote, _ = _layer(s).remote.get(batch.uniq)
    assert np.array_equal(remote["vector"], cached["vector"])
    s.close()


@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16"])
def test_more_ids_than_the_cache_holds_pool_and_step_as_the_general_path(lmdb_url, spied,
                                                                         value_dtype):
    """A batch of 60 distinct ids (30 stored, 30 new) through a cache of 8 rows: the rows
    read (or made) are pooled from a scratch table, and the step goes the general way."""
    stores = []
    for _ in range(2):
        url = lmdb_url()
        with _open(url, cache=None, value_dtype=value_dtype) as plain:
            plain.assign(np.arange(30), np.linspace(-1, 1, 30 * DIM).reshape(30, DIM))
        stores.append(_open(url, cache_capacity=8, value_dtype=value_dtype))
    a, b = stores
    ids = np.arange(120).reshape(30, 4) % 60
    got, batch = a.pool_bags(ids)
    vectors = b.lookup(batch.uniq)
    assert "apart" in spied
    assert np.array_equal(got, pooled_reference(vectors, batch.inv, batch.offsets, False))
    grad = np.random.default_rng(0).standard_normal(got.shape).astype(np.float32)
    a.update_bags(batch, grad)
    b.update(batch.uniq, batch.grad_sums(grad), counts=batch.counts)
    assert "update_rows" in spied or "modify" in spied
    ra, _ = a.get_records(np.arange(60))
    rb, _ = b.get_records(np.arange(60))
    for name in ("vector", "accum", "count", "last_step"):
        assert np.array_equal(ra[name], rb[name]), name
    sa, sb = a.stats(), b.stats()
    sa.pop("version"), sb.pop("version")
    assert sa == sb


def test_a_nan_gradient_on_cached_rows_is_refused_by_the_fused_step(lmdb_url, spied):
    s = _open(lmdb_url(), cache_capacity=1000)
    out, batch = s.pool_bags(np.array([[1, 2], [2, 3]]))
    s.flush()
    grad = np.ones_like(out)
    grad[1, 0] = np.nan
    with pytest.raises(InvalidInputError, match="NaN or inf"):
        s.update_bags(batch, grad)
    assert spied == ["step_slots:False"]  # the fused step refused it, nothing else ran
    assert s.stats()["dirty_rows"] == 0
    writes = s.stats()["remote_writes"]
    s.flush()
    assert s.stats()["remote_writes"] == writes


@pytest.mark.parametrize("opts", [{"write_policy": "through"}, {"cache": "lmdb"}],
                         ids=["write-through", "disk-cache"])
def test_caches_that_cannot_pool_in_place_take_the_general_path(lmdb_url, opts, tmp_path):
    opts = dict(opts)
    if opts.get("cache") == "lmdb":
        opts["cache"] = f"lmdb://{tmp_path}/local"
    s = _open(lmdb_url(), **opts)
    assert not s.fused_bags() and not _layer(s).supports_fused_bags
    assert s.pool_bags(np.array([[1, 2]])) is None
    with pytest.raises(embstore.errors.CapabilityError):
        _layer(s).lookup_pool(np.array([1]), None, None)
    s.close()


def test_fused_and_general_runs_write_the_same_rows_to_the_backing_store(lmdb_url):
    got = []
    for fused in (True, False):
        url = lmdb_url()
        s = _open(url, cache_capacity=32)
        _steps(s, fused, seed=4)
        assert s.stats()["dirty_evictions"] > 0
        s.close()
        with embstore.open(url) as plain:
            got.append(plain.get_records(np.arange(400)))
    (ra, fa), (rb, fb) = got
    assert np.array_equal(fa, fb) and fa.sum() > 32  # more rows than the cache held
    for name in ("vector", "accum", "count", "last_step"):
        assert np.array_equal(ra[name], rb[name]), name


def _steps(store, fused: bool, seed: int, prefetch: bool = False) -> None:
    """Five steps of 16 bags of 4 Zipf ids, fused or through lookup + update (the general
    path, ids in the same first-seen order); ``prefetch``: the next batch's ids are loaded in
    the background during each step."""
    rng = np.random.default_rng(seed)
    batches = [rng.zipf(1.3, (16, 4)) % (60 * (i + 1)) for i in range(5)]
    grads = [rng.standard_normal((16, DIM)).astype(np.float32) for _ in batches]
    for i, (ids, grad) in enumerate(zip(batches, grads, strict=True)):
        if prefetch and i + 1 < len(batches):
            store.prefetch(batches[i + 1].reshape(-1))
        if fused:
            _, batch = store.pool_bags(ids)
            store.update_bags(batch, grad)
        else:
            batch = bag_batch(ids, None, None, False)
            store.lookup(batch.uniq)
            store.update(batch.uniq, batch.grad_sums(grad), counts=batch.counts)


def test_prefetched_batches_train_the_same_rows_fused_and_general(bigtable_url_factory):
    """Rows loaded by a background prefetch (the Bigtable emulator, a thread-safe remote) are
    waited for, then pooled and stepped in place: the rows of the general path."""
    got = []
    for fused in (True, False):
        url = bigtable_url_factory()
        s = _open(url, cache_capacity=40)
        _steps(s, fused, seed=6, prefetch=True)
        assert s.stats()["prefetched_rows"] > 0
        s.close()
        with embstore.open(url) as plain:
            got.append(plain.get_records(np.arange(300)))
    (ra, fa), (rb, fb) = got
    assert np.array_equal(fa, fb)
    for name in ("vector", "accum", "count", "last_step"):
        assert np.array_equal(ra[name], rb[name]), name


def test_keys_outside_writer_keys_are_refused_by_the_fused_step(lmdb_url):
    """The fused step claims its keys as the general update does: rows another writer owns
    are read (and pooled) but not stepped, and nothing is marked."""
    url = lmdb_url()
    with _open(url, cache=None) as plain:
        plain.assign(np.arange(20), np.ones((20, DIM)))
    s = _open(url, writer_keys=(0, 2))
    out, batch = s.pool_bags(np.arange(20).reshape(5, 4))  # stored rows: read, not written
    with pytest.raises(InvalidInputError, match="writer_keys"):
        s.update_bags(batch, np.ones_like(out))
    assert s.stats()["dirty_rows"] == 0 and s.step == 0
    s.close()


def test_a_lease_taken_over_fences_the_fused_steps_out(bigtable_url_factory):
    """As with ``update``: a step after another writer took the lease over lands in the
    cache, its flush is refused, every later step is refused at once, no dirty row is lost."""
    url = bigtable_url_factory()
    embstore.open(url, dim=DIM, optimizer=SGD(lr=1.0), initializer="zeros").close()
    a = embstore.open(url, cache="memory://", lease_seconds=301.0)
    ids = np.array([[1, 2], [3, 4]])
    out, batch = a.pool_bags(ids)
    a.update_bags(batch, np.ones_like(out))
    a.flush()
    remote = a.backend.remote
    modify_leases(remote, lambda epoch, leases: (   # as a taker whose clock runs ahead sees it
        epoch, {k: {**v, "expires": time.time() - 1} for k, v in leases.items()}))
    b = embstore.open(url, cache="memory://")
    b.update(np.arange(1, 5), np.ones((4, DIM), np.float32))
    b.flush()
    out, batch = a.pool_bags(ids)
    a.update_bags(batch, np.ones_like(out))  # a still believes it holds the lease
    with pytest.raises(LeaseLostError):
        a.flush()
    with pytest.raises(LeaseLostError):
        a.update_bags(batch, np.ones_like(out))
    assert a.stats()["dirty_rows"] == 4  # kept, not lost
    b.close()
    with embstore.open(url, read_only=True) as r:
        assert r.get_records(np.arange(1, 5))[0]["count"].tolist() == [2] * 4
    with pytest.raises(LeaseLostError):
        a.close()
