"""memory:// runs the conformance suite, plus cuckoo-table specifics."""

from __future__ import annotations

import itertools
import os
import pickle

import numpy as np
import pytest

import embstore
from embstore._cython.arena import RecordArena, release_pool
from embstore._cython.cuckoo import CuckooTable, find_or_insert
from embstore.errors import InvalidInputError
from embstore.testing.conformance import FULL_CONFORMANCE, LayoutMatrix
from tests.stores import run_in_threads


class TestMemoryConformance(*FULL_CONFORMANCE):
    @pytest.fixture
    def url_factory(self):
        return lambda: "memory://"


class TestMemoryLayouts(LayoutMatrix, TestMemoryConformance):
    """The suite over 16-bit layouts."""


def test_memory_store_refuses_to_pickle():
    s = embstore.open("memory://", dim=4)
    with pytest.raises(pickle.PicklingError, match="not pickled"):
        pickle.dumps(s)


def test_cuckoo_never_drops_a_key_through_many_rehashes():
    t = CuckooTable(16)
    rng = np.random.default_rng(3)
    keys = rng.choice(2**63 - 1, 200_000, replace=False).astype(np.int64)
    keys[:5] = [0, -1, -(2**63), 2**63 - 1, 42]
    vals = np.arange(len(keys), dtype=np.uint32)
    for i in range(0, len(keys), 7777):
        t.insert_new(keys[i:i + 7777], vals[i:i + 7777])
    assert len(t) == len(keys) and t.rehashes >= 3
    out = np.empty(len(keys), np.uint32)
    assert t.find(keys, out) == len(keys)
    np.testing.assert_array_equal(out, vals)


@pytest.mark.parametrize("prefault", [True, False])
def test_cuckoo_grows_past_its_address_reservations_keeping_every_key(prefault):
    # From 1 KiB of buckets to 32 MiB: the table outgrows its reserved address range twice
    # (1 MiB, then 16x that), so the buckets move, and from 16384 buckets on, the half each
    # doubling grows into is committed and faulted in ahead (or not, with prefault=False).
    t = CuckooTable(16, prefault=prefault)
    rng = np.random.default_rng(5)
    keys = rng.choice(2**63 - 1, 1_500_000, replace=False).astype(np.int64)
    vals = rng.permutation(len(keys)).astype(np.uint32)
    arena = RecordArena(8, prefault=False)
    slots = np.empty(len(keys), np.uint32)
    for i in range(0, len(keys), 65536):
        t.insert_new(keys[i:i + 65536], vals[i:i + 65536])
    assert t.nbytes >= 32 << 20 and t.rehashes >= 15
    out = np.empty(len(keys), np.uint32)
    assert t.find(keys, out) == len(keys)
    np.testing.assert_array_equal(out, vals)
    # find_or_insert on the grown table finds them all and inserts none
    assert find_or_insert(t, arena, keys, slots) == 0
    np.testing.assert_array_equal(slots, vals)


def test_cuckoo_random_inserts_and_erases_match_a_dict():
    # Mixed growth, erasure and re-insertion against a dict: the emptier-bucket placement,
    # the one-step move and the random walk must never lose or duplicate a key.
    rng = np.random.default_rng(9)
    for seed in range(8):
        t, model = CuckooTable(16), {}
        pool = rng.choice(2**40, 30_000, replace=False).astype(np.int64)
        next_val = 0
        for _ in range(12):
            fresh = np.array([k for k in rng.choice(pool, 3000) if int(k) not in model],
                             dtype=np.int64)
            fresh = np.unique(fresh)
            vals = np.arange(next_val, next_val + len(fresh), dtype=np.uint32)
            next_val += len(fresh)
            t.insert_new(fresh, vals)
            model.update(zip(fresh.tolist(), vals.tolist()))
            gone = rng.choice(np.array(sorted(model), dtype=np.int64), len(model) // 4,
                              replace=False)
            removed = np.empty(len(gone), np.uint32)
            assert t.erase(gone, removed) == len(gone)
            assert removed.tolist() == [model.pop(k) for k in gone.tolist()]
        assert len(t) == len(model), seed
        ks = np.array(sorted(model), dtype=np.int64)
        out = np.empty(len(ks), np.uint32)
        assert t.find(ks, out) == len(ks)
        assert out.tolist() == [model[k] for k in ks.tolist()]
        absent = np.setdiff1d(pool, ks)
        miss = np.empty(len(absent), np.uint32)
        assert t.find(absent, miss) == 0


def test_cuckoo_adversarial_keys_sharing_hash_buckets():
    # Keys whose mixed hashes collide in low bits stress the kick walk and growth.
    t = CuckooTable(16)
    keys = (np.arange(50_000, dtype=np.int64) << 20)
    t.insert_new(keys, np.arange(len(keys), dtype=np.uint32))
    out = np.empty(len(keys), np.uint32)
    assert t.find(keys, out) == len(keys)
    np.testing.assert_array_equal(out, np.arange(len(keys)))


def test_cuckoo_erase_and_items():
    t = CuckooTable(16)
    keys = np.arange(1000, dtype=np.int64) * 3
    t.insert_new(keys, np.arange(1000, dtype=np.uint32))
    removed = np.empty(500, np.uint32)
    assert t.erase(keys[:500], removed) == 500
    np.testing.assert_array_equal(removed, np.arange(500))
    ks, vs = np.empty(500, np.int64), np.empty(500, np.uint32)
    assert t.items(ks, vs) == 500
    assert sorted(ks.tolist()) == keys[500:].tolist()


def test_arena_reuses_freed_slots_and_gathers_fields():
    a = RecordArena(16, chunk_shift=4)
    slots = np.empty(40, np.uint32)
    a.alloc(slots)
    assert slots.tolist() == list(range(40))
    src = np.arange(40 * 16, dtype=np.uint8).reshape(40, 16)
    a.scatter(slots, src)
    out = np.empty((40, 4), np.uint8)
    a.gather(slots, out, 8, 4)
    np.testing.assert_array_equal(out, src[:, 8:12])
    a.release(slots[:3])
    again = np.empty(3, np.uint32)
    a.alloc(again)
    assert set(again.tolist()) == {0, 1, 2}
    assert a.live == 40


def test_memory_bytes_keys_are_collisionless_across_many_keys():
    s = embstore.open("memory://", dim=2, key_type="bytes")
    words = [f"w{i}".encode() for i in range(5000)] + [b"w1\x00", b"W1"]
    vals = np.arange(len(words) * 2, dtype=np.float32).reshape(-1, 2)
    s.assign(words, vals)
    assert len(s) == len(words)
    np.testing.assert_array_equal(s.lookup(words, insert=False), vals)


def test_memory_size_reported():
    s = embstore.open("memory://", dim=64)
    s.lookup(np.arange(10_000))
    st = s.stats()
    assert st["size_bytes"] >= 10_000 * s.layout.itemsize
    assert st["table_capacity"] >= 10_000


def test_fresh_memory_urls_are_independent():
    counter = itertools.count()
    a = embstore.open("memory://", dim=2)
    b = embstore.open("memory://", dim=2)
    a.lookup([next(counter)])
    assert len(b) == 0


def test_find_or_insert_places_new_keys_once_and_finds_old_ones():
    t, a = CuckooTable(16), RecordArena(8, chunk_shift=4)
    keys = np.array([5, 9, 5, -3, 9, 11], dtype=np.int64)  # repeats inside one batch
    out = np.empty(len(keys), np.uint32)
    assert find_or_insert(t, a, keys, out) == 4
    assert out[0] == out[2] and out[1] == out[4] and len(set(out.tolist())) == 4
    again = np.empty(len(keys), np.uint32)
    assert find_or_insert(t, a, keys, again) == 0
    np.testing.assert_array_equal(again, out)
    assert len(t) == 4 and a.live == 4


@pytest.mark.parametrize("prefault", [True, False, "off", "1"])
def test_arena_spare_chunks_keep_every_record(prefault):
    # 70k records span five 16384-row chunks: the spare mapped at four (faulted in by a background
    # thread when prefault is on) is taken into use while records are being written.
    s = embstore.open("memory://", dim=4, prefault=prefault)
    keys = np.arange(70_000, dtype=np.int64) * 7
    vals = np.repeat(np.arange(70_000, dtype=np.float32)[:, None], 4, axis=1)
    for i in range(0, len(keys), 5000):
        s.assign(keys[i:i + 5000], vals[i:i + 5000])
    np.testing.assert_array_equal(s.lookup(keys, insert=False), vals)
    assert s.stats()["size_bytes"] >= 70_000 * s.layout.itemsize
    s.backend.clear()
    assert len(s) == 0
    s.assign(keys[:10], vals[:10])
    np.testing.assert_array_equal(s.lookup(keys[:10], insert=False), vals[:10])


def test_memory_rejects_a_bad_prefault_flag():
    with pytest.raises(InvalidInputError, match="prefault"):
        embstore.open("memory://", dim=4, prefault="sometimes")


def test_update_after_lookup_of_a_reused_key_buffer_steps_the_new_keys():
    # The slots found by a lookup are reused by the next update only when the keys match:
    # a caller refilling one key buffer between the two calls must update the new keys.
    s = embstore.open("memory://", dim=4, optimizer=embstore.optim.SGD(lr=1.0))
    buf = np.array([1, 2, 3], dtype=np.int64)
    s.lookup(np.array([10, 20, 30], dtype=np.int64))
    v = s.lookup(buf)
    buf[:] = [10, 20, 30]
    s.update(buf, np.ones((3, 4), np.float32))
    np.testing.assert_array_equal(s.lookup([1, 2, 3], insert=False), v)
    np.testing.assert_allclose(s.lookup([10, 20, 30], insert=False),
                               s.initial_vectors([10, 20, 30]) - 1.0, rtol=1e-6)


def test_in_place_update_matches_the_copy_path_bit_for_bit():
    rng = np.random.default_rng(5)
    keys = rng.choice(10_000, 3000, replace=False).astype(np.int64)
    stores = [embstore.open("memory://", dim=16, optimizer=embstore.optim.SGD(lr=0.1))
              for _ in range(2)]
    stores[1].backend.supports_row_update = False  # the general get -> step -> put path
    touched = [keys[:1000]]
    for st in stores:
        st.lookup(keys[:1000])
    for _ in range(3):  # batches of known and new keys, with repeats
        b = rng.choice(keys, 2000)
        g = rng.standard_normal((2000, 16), dtype=np.float32)
        touched.append(b)
        for st in stores:
            st.update(b, g)
    ks = np.unique(np.concatenate(touched))
    a, fa = stores[0].get_records(ks)
    b, fb = stores[1].get_records(ks)
    assert fa.all() and fb.all()
    for f in ("vector", "count", "last_step"):
        np.testing.assert_array_equal(a[f], b[f])


def test_arena_chunks_reused_after_close_carry_nothing_over():
    # Chunks of a closed store go to a process-wide pool and back into the next arena: the
    # new store must see only what it wrote itself.
    keys = np.arange(70_000, dtype=np.int64)
    a = embstore.open("memory://", dim=4)
    a.assign(keys, np.full((len(keys), 4), 7.0, np.float32))
    a.close()
    b = embstore.open("memory://", dim=4)
    np.testing.assert_array_equal(b.lookup(keys), b.initial_vectors(keys))
    recs, found = b.get_records(keys)
    assert found.all() and (recs["count"] == 0).all()
    assert len(b) == len(keys)
    b.close()
    assert release_pool() > 0 and release_pool() == 0


def test_threads_sharing_one_store_lose_nothing():
    # Four threads insert disjoint keys while the table and the arena keep growing, read back
    # each other's keys and step their own; every key ends where a single thread would put it.
    store = embstore.open("memory://", dim=8, optimizer=embstore.optim.SGD(lr=0.5))
    per, batch = 60_000, 2048

    def work(t: int) -> None:
        mine = np.arange(t * per, (t + 1) * per, dtype=np.int64)
        other = np.arange(((t + 1) % 4) * per, ((t + 1) % 4) * per + batch, dtype=np.int64)
        for i in range(0, per, batch):
            k = mine[i:i + batch]
            store.lookup(k)
            store.update(k, np.ones((len(k), 8), np.float32))
            store.lookup(other, insert=False)

    assert run_in_threads(work, 4) == []
    keys = np.arange(4 * per, dtype=np.int64)
    assert len(store) == len(keys)
    np.testing.assert_array_equal(store.lookup(keys, insert=False),
                                  store.initial_vectors(keys) - 0.5)


def test_lookup_fast_path_with_repeated_keys_counts_every_occurrence():
    s = embstore.open("memory://", dim=4)
    v = s.lookup([5, 5, 6, 7, 7])
    np.testing.assert_array_equal(v[0], v[1])
    np.testing.assert_array_equal(v[3], v[4])
    st = s.stats()
    assert (st["hits"], st["misses"], st["inserts"], st["rows"]) == (0, 5, 3, 3)
    s.lookup([5, 8, 8, 9])
    st = s.stats()
    assert (st["hits"], st["misses"], st["inserts"], st["rows"]) == (1, 8, 5, 5)
    np.testing.assert_array_equal(s.lookup([8], insert=False), s.initial_vectors([8]))


def test_fast_paths_stay_on_after_sample_and_keep_the_sampling_index_exact(monkeypatch):
    from embstore.backends.memory import MemoryBackend
    from embstore.sampling import sampling_index

    calls = {"update_rows": 0, "lookup_insert": 0}
    for name in calls:
        orig = getattr(MemoryBackend, name)

        def spy(self, *a, _orig=orig, _name=name, **kw):
            calls[_name] += 1
            return _orig(self, *a, **kw)

        monkeypatch.setattr(MemoryBackend, name, spy)
    s = embstore.open("memory://", dim=4)
    rng = np.random.default_rng(3)
    s.lookup(np.arange(100))
    s.sample([1], 10, "uniform", seed=0)  # the sampling index now observes every write
    calls.update(update_rows=0, lookup_insert=0)
    for _ in range(5):
        b = rng.integers(0, 150, 64)  # repeats, known and new keys
        s.lookup(b)
        s.update(b, np.ones((64, 4), np.float32))
    assert calls["update_rows"] == 5 and calls["lookup_insert"] == 5
    idx = sampling_index(s)
    keys = np.concatenate([k for k, _ in s.records()])
    recs, _ = s.get_records(keys)
    np.testing.assert_array_equal(idx.counts_of(keys), recs["count"])
    assert idx.total_count == int(recs["count"].sum()) and len(idx) == len(s)
    assert idx.scans == 1


@pytest.mark.parametrize("key_type", ["int64", "bytes"])
def test_insert_rows_never_overwrites_an_existing_record(key_type):
    # Another writer may have created a key since the engine saw it missing.
    s = embstore.open("memory://", dim=4, key_type=key_type)
    k = [b"a", b"b"] if key_type == "bytes" else [1, 2]
    s.assign(k[:1], np.full((1, 4), 7.0, np.float32))
    keys = s.normalize_keys(k)
    s.backend.insert_rows(keys, np.zeros((2, 4), np.float32), s.layout.empty(1))
    recs, found = s.backend.get(keys)
    assert found.all()
    np.testing.assert_array_equal(recs["vector"], [[7.0] * 4, [0.0] * 4])


@pytest.mark.parametrize(("itemsize", "rows"), [(8, 2**20), (80, 2**17), (288, 2**15),
                                                (4096, 2**14)])
def test_arena_chunks_span_several_huge_pages_by_default(itemsize, rows):
    # The smallest power of two of rows from 2**14 on that makes a chunk at least 8 MiB (at
    # most 2**20 rows): only a chunk of several 2 MiB pages is mostly backed by them.
    a = RecordArena(itemsize)
    assert a.chunk_rows == rows
    assert RecordArena(itemsize, chunk_shift=4).chunk_rows == 16
    with pytest.raises(ValueError, match="chunk_shift"):
        RecordArena(itemsize, chunk_shift=31)


def _huge_advised_bytes() -> int:
    """Bytes of this process's mappings advised onto transparent huge pages (VmFlags hg)."""
    total = size = 0
    with open("/proc/self/smaps") as f:
        for line in f:
            if line.startswith("Size:"):
                size = int(line.split()[1]) * 1024
            elif line.startswith("VmFlags:") and " hg" in f" {line.split(':', 1)[1]}":
                total += size
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_large_tables_and_arenas_ask_for_huge_pages():
    # Lookups of a large table read buckets and records at random places; on 4 KiB pages
    # nearly every read also misses the TLB. The buckets and the arena's chunks are advised
    # onto transparent huge pages (MADV_HUGEPAGE, visible as the "hg" VmFlag).
    release_pool()          # a pooled chunk would come back already advised
    before = _huge_advised_bytes()
    table = CuckooTable(1 << 20)                # 2**19 buckets of 64 bytes: 32 MiB
    arena = RecordArena(80)
    slots = np.empty(4, np.uint32)
    arena.alloc(slots)
    grown = _huge_advised_bytes() - before
    assert grown >= (32 << 20) + 80 * 2**17, grown
    del table, arena


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_huge_pages_false_keeps_small_pages_and_small_chunks():
    release_pool()
    before = _huge_advised_bytes()
    table = CuckooTable(1 << 20, huge_pages=False)
    arena = RecordArena(80, huge_pages=False)
    slots = np.empty(4, np.uint32)
    arena.alloc(slots)
    assert arena.chunk_rows == 2**14 and not arena.huge_pages
    assert _huge_advised_bytes() - before < (32 << 20), "a table or chunk was advised"
    del table, arena


@pytest.mark.parametrize(("url", "kw"), [("memory://?huge_pages=false", {}),
                                         ("memory://", {"huge_pages": False})])
def test_memory_store_huge_pages_option(url, kw):
    keys, grads = np.arange(1000) * 7, np.full((1000, 4), 0.5, np.float32)
    small = embstore.open(url, dim=4, **kw)
    default = embstore.open("memory://", dim=4)
    assert not small._backend._arena.huge_pages and default._backend._arena.huge_pages
    for s in (small, default):
        s.update(keys, grads)
    np.testing.assert_array_equal(small.lookup(keys, insert=False),
                                  default.lookup(keys, insert=False))
    with pytest.raises(InvalidInputError, match="huge_pages"):
        embstore.open("memory://?huge_pages=maybe", dim=4)
