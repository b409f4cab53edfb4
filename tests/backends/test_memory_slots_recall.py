"""A ``memory://`` table's ``find_slots`` (the cache layer's probe of its rows) remembers its
last batch: a training step probes its keys for the lookup and again for the update, and the
second call is answered from the first while no key was inserted or removed since. Anything
that moves keys (insert, delete, clear) makes it probe again."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore._cython.strkeys import KeySnapshot
from embstore.backends.memory import MemoryBackend
from embstore.layout import Layout

EMPTY = 0xFFFFFFFF


def table(key_type):
    b = MemoryBackend("memory://?hash_seed=3")
    b.bind(Layout(4), key_type)
    return b


def keys_of(key_type, ids):
    ids = np.asarray(ids, dtype=np.int64)
    if key_type == "int64":
        return ids * 101
    return np.array([b"k%d" % i for i in ids], dtype=object)


@pytest.mark.parametrize("key_type", ["int64", "bytes"])
def test_second_probe_of_a_batch_is_the_first(key_type):
    b = table(key_type)
    k = keys_of(key_type, range(50))
    b.put(k, b.layout.empty(50))
    first = b.find_slots(k)
    again = b.find_slots(k.copy())          # equal keys, another array: recalled
    assert again is first
    other = keys_of(key_type, range(1, 51))
    assert b.find_slots(other)[-1] == EMPTY  # another batch: probed
    assert np.array_equal(b.find_slots(k), first)


@pytest.mark.parametrize("key_type", ["int64", "bytes"])
def test_inserts_and_deletes_make_it_probe_again(key_type):
    b = table(key_type)
    k = keys_of(key_type, range(20))
    b.put(k[:10], b.layout.empty(10))
    before = b.find_slots(k)
    assert (before[10:] == EMPTY).all()
    b.put(k[10:], b.layout.empty(10))       # inserted: the remembered slots are stale
    after = b.find_slots(k)
    assert (after != EMPTY).all() and np.array_equal(after[:10], before[:10])
    b.delete(k[:5])
    assert (b.find_slots(k)[:5] == EMPTY).all()
    b.clear()
    assert (b.find_slots(k) == EMPTY).all()


def test_a_key_array_refilled_in_place_is_probed_again():
    b = table("bytes")
    k = keys_of("bytes", range(8))
    b.put(k, b.layout.empty(8))
    slots = b.find_slots(k).copy()
    k[0] = b"absent"                         # same array object, other keys
    got = b.find_slots(k)
    assert got[0] == EMPTY and np.array_equal(got[1:], slots[1:])


def test_closed_table_refuses_even_a_remembered_batch():
    b = table("bytes")
    k = keys_of("bytes", range(4))
    b.put(k, b.layout.empty(4))
    b.find_slots(k)
    b.close()
    with pytest.raises(embstore.errors.StoreClosedError):
        b.find_slots(k)


def test_snapshot_tells_another_length_without_reading_the_keys():
    snap = KeySnapshot(np.array([b"a", b"b"], dtype=object))
    assert not snap.same([b"a", b"b", 3])    # not a key, but a batch of another length
    assert snap.same(np.array([b"a", b"b"], dtype=object))
    with pytest.raises(TypeError):
        snap.same([b"a", 3])


def test_cached_training_step_gives_the_uncached_records():
    """Lookup then update through a write-back cache (the word2vec demo's store) writes what
    a plain memory:// store writes."""
    rng = np.random.default_rng(0)
    stores = [embstore.open("memory://?hash_seed=5", dim=8, key_type="bytes", seed=2),
              embstore.open("memory://?hash_seed=5", dim=8, key_type="bytes", seed=2,
                            cache="memory://?hash_seed=9", cache_capacity=64)]
    for _ in range(12):
        k = np.unique(keys_of("bytes", rng.integers(0, 100, 40)))
        g = rng.standard_normal((len(k), 8)).astype(np.float32)
        for s in stores:
            s.lookup(k, insert=True)
            s.update(k, g, counts=np.ones(len(k), np.int64))
    every = keys_of("bytes", range(100))
    (ra, fa), (rb, fb) = stores[0].get_records(every), stores[1].get_records(every)
    assert np.array_equal(fa, fb)
    for name in ra.dtype.names:
        if name not in ("version", "last_seen"):
            assert np.array_equal(ra[fa][name], rb[fb][name]), name
