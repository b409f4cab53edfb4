"""Lookups of bytes keys with new keys in the batch: exact counts, and cost linear in the batch
(the table counts the misses during its one probe; no second pass over the keys)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embstore
from embstore._cython.arena import RecordArena
from embstore._cython.bytestable import BytesTable, find_or_insert
from embstore._keys import count_matching


def as_bytes(ids) -> np.ndarray:
    out = np.empty(len(ids), dtype=object)
    out[:] = [b"k%d" % i for i in ids]
    return out


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=30), st.lists(st.integers(0, 40), max_size=80),
       st.integers(1, 64))
def test_find_or_insert_counts_new_keys_and_their_repeats(held, batch, bits):
    # few fingerprint bits: colliding hashes must not pass for repeats
    table = BytesTable(16, seed=1, fingerprint_bits=bits)
    arena = RecordArena(8, prefault=False, huge_pages=False)
    first = np.empty(len(held), np.uint32)
    find_or_insert(table, arena, as_bytes(held), first)
    missed = np.full(1, -1, dtype=np.int64)
    new = np.zeros(len(batch), dtype=np.uint8)
    slots = np.empty(len(batch), np.uint32)
    n_new = find_or_insert(table, arena, as_bytes(batch), slots, new, None, missed)
    before = set(held)
    assert n_new == len(set(batch) - before)
    assert missed[0] == sum(k not in before for k in batch)
    seen: set = set()
    for i, k in enumerate(batch):  # the first occurrence of each new key is marked
        assert new[i] == (k not in before and k not in seen)
        seen.add(k)


def test_find_or_insert_leaves_missed_alone_only_when_not_asked():
    table = BytesTable(16)
    arena = RecordArena(8, prefault=False, huge_pages=False)
    keys = as_bytes([1, 2, 1, 3])
    assert find_or_insert(table, arena, keys, np.empty(4, np.uint32)) == 3
    missed = np.full(1, -1, dtype=np.int64)
    assert find_or_insert(table, arena, keys, np.empty(4, np.uint32), None, None, missed) == 0
    assert missed[0] == 0
    with pytest.raises(ValueError, match="one element"):
        find_or_insert(table, arena, keys, np.empty(4, np.uint32), None, None,
                       np.empty(0, np.int64))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=60), st.data())
def test_count_matching_equals_isin_over_the_ids(ids, data):
    marked = np.array(data.draw(st.lists(st.booleans(), min_size=len(ids),
                                         max_size=len(ids))), dtype=bool)
    ints = np.array(ids, dtype=np.int64)
    expected = int(np.isin(ints, ints[marked]).sum())
    assert count_matching(as_bytes(ids), marked) == expected
    words = [f"k{i}" if i % 2 else b"k%d" % i for i in ids]  # str is its UTF-8 bytes
    assert count_matching(words, marked) == expected


def half_new_batch(n_old: int, size: int, rng: np.random.Generator,
                   new_from: int | None = None) -> np.ndarray:
    """``size`` ids: old ones (below ``n_old``) with repeats, new ones (from ``new_from``,
    default ``n_old``) each about twice."""
    old = rng.integers(0, n_old, size // 2)
    new = (n_old if new_from is None else new_from) + rng.integers(0, size // 4,
                                                                   size - size // 2)
    return rng.permutation(np.concatenate((old, new)))


@pytest.mark.parametrize("url", ["memory://", "lmdb"])
def test_large_half_new_lookup_counts_like_int64_keys(url, tmp_path):
    rng = np.random.default_rng(5)
    n_old, size = 20_000, 48_000
    ids = half_new_batch(n_old, size, rng)
    got = {}
    for key_type in ("int64", "bytes"):
        u = url if url == "memory://" else f"lmdb://{tmp_path / key_type}"
        kw = {} if url == "memory://" else {"durable": False}
        with embstore.open(u, dim=4, key_type=key_type, initializer="zeros", **kw) as s:
            keys = (np.arange(n_old) if key_type == "int64" else as_bytes(range(n_old)))
            s.lookup(keys)
            before = s.stats()
            batch = ids if key_type == "int64" else as_bytes(ids.tolist())
            vectors = s.lookup(batch)
            after = s.stats()
            got[key_type] = ({k: after[k] - before[k] for k in ("hits", "misses", "inserts")},
                             len(s))
            np.testing.assert_array_equal(vectors, s.lookup(batch, insert=False))
    new = ids >= n_old
    expected = ({"hits": int((~new).sum()), "misses": int(new.sum()),
                 "inserts": len(np.unique(ids[new]))}, n_old + len(np.unique(ids[new])))
    assert got["bytes"] == got["int64"] == expected


def python_calls(fn) -> tuple[int, set]:
    """How many Python-level and builtin calls ``fn()`` makes, and the Python functions'
    names."""
    calls = [0]
    names: set = set()

    def prof(frame, event, arg):
        if event in ("call", "c_call"):
            calls[0] += 1
            if event == "call":
                names.add(frame.f_code.co_name)

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[0], names


def test_half_new_bytes_lookup_makes_one_pass_and_no_per_key_python_work():
    rng = np.random.default_rng(7)
    n_old = 5_000
    with embstore.open("memory://", dim=4, key_type="bytes") as s:
        s.lookup(as_bytes(range(n_old)))
        counts = []
        for size in (1_200, 48_000):
            batch = as_bytes(half_new_batch(n_old, size, rng, new_from=10 * size).tolist())
            s.lookup(batch[:8])  # settles one-off work (plans, caches) before counting
            calls, names = python_calls(lambda b=batch: s.lookup(b))
            counts.append(calls)
            # the misses (new keys and their repeats) were counted by the table's probe:
            # no second dedupe pass over the keys
            assert not names & {"count_repeats_of", "count_matching", "factorize_keys",
                                "unique_first", "distinct"}
        assert counts[0] == counts[1]  # constant Python work: the per-key work is compiled
