"""The engine's declared seams: capabilities read where they matter, partitions() through
layers, WrapperBackend, shared eviction policies, cache_eviction=, register_backend(replace=),
the version source and the store -> api back-edge."""

from __future__ import annotations

import inspect
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore.backends.base import Backend
from embstore.backends.memory import MemoryBackend
from embstore.errors import CapabilityError, InvalidInputError
from embstore.layers import WrapperBackend
from embstore.layers.cache import CachedBackend
from embstore.layers.cache.slots import SlotTable
from embstore.layers.sharded import ShardedBackend, sharded_url
from embstore.policies import LFU, LRU, Eviction
from embstore.policies.expiry import eviction_victims
from embstore.sampling import sampling_index

DIM = 4
_PUBLIC = sorted(n for n, v in vars(Backend).items()
                 if (not n.startswith("_") or n == "__len__") and n not in ("layout", "key_type")
                 and (callable(v) or isinstance(v, (bool, str))))


def brute_top_k(store, q, k):
    keys = np.concatenate([kb for kb, _ in store.items()])
    vecs = np.concatenate([vb for _, vb in store.items()])
    s = vecs @ q
    order = np.lexsort((keys, -s))[:k]
    return keys[order]


def test_a_cache_in_front_of_shards_does_not_hide_them_from_sampling_and_top_k(monkeypatch):
    s = embstore.open(sharded_url(["memory://"] * 2), dim=DIM, cache="memory://",
                      cache_capacity=1000, optimizer=embstore.optim.SGD(lr=1.0))
    assert isinstance(s.backend, CachedBackend)
    assert isinstance(s.backend.remote, ShardedBackend)
    keys = np.arange(200, dtype=np.int64) * 7
    vecs = np.random.default_rng(0).integers(-8, 8, (200, DIM)).astype(np.float32)
    s.assign(keys, vecs)                              # dirty in the cache (write-back)
    s.update(keys[:50], np.ones((50, DIM), np.float32))
    parts = s.backend.partitions()
    assert len(parts) == 2 and parts == s.backend.remote.shards
    assert sum(len(p) for p in parts) == 200          # the buffered writes reached the shards
    idx = sampling_index(s)
    assert idx.num_shards == 2
    np.testing.assert_array_equal(idx.counts_of(keys), [1] * 50 + [0] * 150)
    scanned = []
    for i, shard in enumerate(parts):
        orig = shard.scan
        monkeypatch.setattr(shard, "scan", lambda b, _o=orig, _i=i: scanned.append(_i) or _o(b))
    q = np.array([[1.0, -2.0, 0.5, 3.0]], dtype=np.float32)
    got, _ = s.top_k(q, 5)
    assert sorted(set(scanned)) == [0, 1]             # per-shard top-k, merged
    np.testing.assert_array_equal(got[0], brute_top_k(s, q[0], 5))
    s.close()


def test_wrapper_backend_forwards_every_method_and_capability():
    missing = [n for n in _PUBLIC if n not in vars(WrapperBackend)]
    assert not missing, f"WrapperBackend does not forward {missing}"
    inner = MemoryBackend("memory://")
    w = WrapperBackend(inner)
    s = embstore.EmbeddingStore(w, dim=DIM, optimizer=embstore.optim.SGD(lr=1.0))
    for flag in ("persistent", "supports_scan", "supports_changes", "supports_row_update",
                 "supports_lookup_insert", "thread_safe", "scheme"):
        assert getattr(w, flag) == getattr(inner, flag), flag
    assert w.supports_lookup_insert  # known after bind: read from the inner backend each time
    v = s.lookup([1, 2, 3])
    s.update([1, 2], np.ones((2, DIM), np.float32))
    np.testing.assert_allclose(s.lookup([1, 2], insert=False), v[:2] - 1.0, rtol=1e-6)
    assert len(inner) == 3 and w.partitions() == [w]
    s.close()


def test_the_cache_layer_overrides_every_row_path_of_the_wrapper():
    # Anything the cache inherited from WrapperBackend would bypass the cached rows.
    forwarded = [n for n in _PUBLIC if getattr(CachedBackend, n) is getattr(WrapperBackend, n)]
    flags = {"persistent", "supports_scan", "supports_changes", "thread_safe", "scheme",
             "cheap_len", "cheap_size", "supports_slots", "supports_fused_bags",
             "checks_bytes_keys"}
    assert set(forwarded) <= flags | {"partition_of", "plan_ranges", "scan_range"}, forwarded
    # the wrapper's range methods refuse for a layer that declares no ranges (the cache)
    assert CachedBackend.supports_ranges is False
    cache = CachedBackend("memory://")
    for call in (lambda: cache.plan_ranges(2), lambda: list(cache.scan_range(None, 10))):
        with pytest.raises(NotImplementedError):
            call()
    cache.close()
    # Its own: steps in place on the cached rows (write-back over memory://), never the remote's.
    assert isinstance(CachedBackend.supports_row_update, property)
    assert CachedBackend.supports_lookup_insert is False


def test_thread_safe_is_a_declared_capability():
    from embstore.backends.bigtable.backend import BigtableBackend

    assert Backend.thread_safe is False and MemoryBackend.thread_safe is False
    assert BigtableBackend.thread_safe is True
    sh = ShardedBackend(["memory://", "memory://"])
    assert sh.thread_safe is False
    sh.close()


class _NoScan(WrapperBackend):
    supports_scan = False  # type: ignore[assignment]


def test_supports_scan_is_read_where_a_scan_is_needed():
    s = embstore.EmbeddingStore(_NoScan(MemoryBackend("memory://")), dim=DIM)
    s.lookup([1, 2])
    for call in (lambda: list(s.records()), lambda: list(s.items()),
                 lambda: list(s.changes_since(0)), lambda: s.sample([1], 1, "uniform"),
                 lambda: s.top_k(np.ones(DIM), 1)):
        with pytest.raises(CapabilityError):
            call()
    assert s.lookup([1], insert=False).shape == (1, DIM)  # row access is unaffected
    s.close()


def test_changes_since_uses_the_backend_index_only_when_declared(monkeypatch):
    calls = []

    class _Indexed(WrapperBackend):
        supports_changes = True  # type: ignore[assignment]

        def changes_since(self, version, batch_size=4096):
            calls.append(version)
            return super().changes_since(version, batch_size)

    for cls, used in ((WrapperBackend, False), (_Indexed, True)):
        calls.clear()
        s = embstore.EmbeddingStore(cls(MemoryBackend("memory://")), dim=DIM)
        s.lookup([1, 2])
        v = s.version
        s.assign([2], np.ones((1, DIM), np.float32))
        if cls is WrapperBackend:
            monkeypatch.setattr(s.backend, "changes_since", lambda *a: calls.append(a))
        got = np.concatenate([k for k, _ in s.changes_since(v)])
        assert got.tolist() == [2] and bool(calls) == used
        s.close()


def test_eviction_policies_are_shared_objects():
    assert SlotTable("int64", "lfu").policy == LFU() and SlotTable("int64", LRU()).eviction == "lru"
    assert Eviction(10, LFU()).policy == "lfu"
    rng = np.random.default_rng(1)
    keys = np.arange(100, dtype=np.int64)
    recs = embstore.Layout(DIM).empty(100)
    recs["last_step"] = rng.integers(0, 5, 100)
    recs["last_seen"] = rng.random(100)
    recs["count"] = rng.integers(0, 4, 100)
    for name, obj in (("lru", LRU()), ("lfu", LFU())):
        a, _ = eviction_victims(iter([(keys, recs)]), n_evict=30, policy=name, step=9)
        b, _ = eviction_victims(iter([(keys, recs)]), n_evict=30, policy=obj, step=9)
        np.testing.assert_array_equal(a, b)
    with pytest.raises(InvalidInputError):
        SlotTable("int64", "fifo")


def test_cache_eviction_option_and_the_deprecated_spelling():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = embstore.open("memory://", dim=DIM, cache="memory://", cache_eviction="lru")
    assert s.backend.eviction == "lru"
    assert s.backend.reopen_options()["cache_eviction"] == "lru"
    s.close()
    with pytest.warns(DeprecationWarning, match="cache_eviction"):
        s = embstore.open("memory://", dim=DIM, cache="memory://", eviction="lru")
    assert s.backend.eviction == "lru" and s.eviction is None
    s.close()
    # with capacity= the store itself is bounded; the cache keeps its default
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = embstore.open("memory://", dim=DIM, cache="memory://", capacity=100,
                          eviction="lru")
    assert s.eviction.policy == "lru" and s.backend.eviction == "lfu"
    s.close()
    with pytest.raises(InvalidInputError):
        embstore.open("memory://", dim=DIM, cache="memory://", cache_eviction="fifo")


def test_register_backend_refuses_to_clobber_a_scheme_unless_asked(monkeypatch):
    from embstore import registry

    monkeypatch.setattr(registry, "_registry", dict(registry._registry))

    class Other(MemoryBackend):
        pass

    with pytest.raises(InvalidInputError, match="replace=True"):
        embstore.register_backend("memory", Other)
    embstore.register_backend("memory", "embstore.backends.memory:MemoryBackend")  # same: ok
    embstore.register_backend("memtest", Other)
    embstore.register_backend("memtest", Other)                                   # same: ok
    with pytest.raises(InvalidInputError):
        embstore.register_backend("memtest", MemoryBackend)
    embstore.register_backend("memory", Other, replace=True)
    assert registry.backend_class("memory://") is Other


def test_one_version_source():
    from embstore import _version

    assert embstore.__version__ == _version.__version__
    pyproject = (Path(embstore.__file__).parent.parent / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject
    assert '\nversion = "' not in pyproject


def test_the_store_reopens_without_importing_the_api(tmp_path):
    import embstore.store

    assert ".api" not in inspect.getsource(embstore.store)
    s = embstore.open(f"lmdb://{tmp_path}/p", dim=DIM)
    s.lookup([5])
    s.flush()
    t = pickle.loads(pickle.dumps(s))
    np.testing.assert_array_equal(t.lookup([5], insert=False), s.lookup([5], insert=False))
    t.close()
    s.close()


class _RetriedOnce(WrapperBackend):
    """A backend whose first modify runs ``fn`` twice, as an optimistic backend retrying
    after a conflict: between the two calls another writer creates ``keys[0]``."""

    raced = False

    def modify(self, keys, fn):
        if self.raced:
            return Backend.modify(self, keys, fn)
        self.raced = True
        recs, found = self.inner.get(keys)
        fn(recs, found.copy())                    # this attempt loses the race: discarded
        if not found[0]:
            rec = self.layout.empty(1)
            rec["count"] = 5
            self.inner.put(keys[:1], rec)         # the other writer's row
        return Backend.modify(self, keys, fn)


def test_side_effects_follow_the_last_call_of_a_retried_modify():
    from embstore.policies import FrequencyCutoff

    s = embstore.EmbeddingStore(_RetriedOnce(MemoryBackend("memory://")), dim=DIM,
                                admission=FrequencyCutoff(2))
    idx = sampling_index(s)
    s.update([10, 11], np.ones((2, DIM), np.float32))
    st = s.stats()
    # key 10 was created by the other writer: stepped, not inserted; key 11 stays rejected,
    # counted once, and its sighting was counted once by the policy
    assert st["inserts"] == 0 and st["gradients_dropped"] == 1
    assert st["admission_rejected"] == 1
    recs, found = s.get_records([10, 11])
    assert found.tolist() == [True, False] and recs["count"][0] == 6
    assert idx.counts_of(np.array([10], dtype=np.int64)).tolist() == [6]
    s.update([11], np.ones((1, DIM), np.float32))  # second sighting: admitted now
    assert s.stats()["inserts"] == 1 and s.contains([11]).all()
    s.close()


def test_capability_flags_are_declared_on_backend_and_layers_declare_theirs(tmp_path):
    for flag, default in (("cheap_len", False), ("cheap_size", True), ("max_key_bytes", None),
                          ("accepted_options", None), ("supports_slots", False)):
        assert getattr(Backend, flag) == default, flag
    from embstore.backends.base import SlotAddressed
    from embstore.backends.lmdb import LmdbBackend

    assert MemoryBackend.supports_slots and isinstance(MemoryBackend("memory://"), SlotAddressed)
    lm = LmdbBackend(f"lmdb://{tmp_path}/a")
    sh = ShardedBackend([MemoryBackend("memory://"), lm])
    assert sh.max_key_bytes == LmdbBackend.max_key_bytes and sh.cheap_len
    cached = CachedBackend(lm, "memory://")
    assert cached.max_key_bytes == LmdbBackend.max_key_bytes and cached.cheap_len
    assert cached.supports_slots is False  # the slot methods are not forwarded
    cached.close()
    sh.close()
