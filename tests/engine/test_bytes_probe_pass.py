"""The bytes table's one-pass probes: each key object is viewed and hashed in the probe loop
itself (some 32 keys ahead of its probe) and copied into the key snapshot as it is probed. A
batch that holds a str or a wrong type takes the general key views instead (str as its UTF-8
form, TypeError for the rest), after the insert pass undid what it had placed. These tests hold
the one-pass results to those of the general path and of a dict."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embstore._cython.arena import RecordArena
from embstore._cython.bytestable import BytesTable, find_or_insert
from embstore._cython.strkeys import KeySnapshot, hash64

_EMPTY = 0xFFFFFFFF
# longer than the probe loops look ahead (32 keys for the hash, 32 more for the objects), so a
# key that stops the one-pass loop lies past keys already probed or placed
LONG_BATCH = 200


def objects(keys: list) -> np.ndarray:
    out = np.empty(len(keys), dtype=object)
    out[:] = keys
    return out


def table_dict(table: BytesTable) -> dict:
    keys, slots = table.items()
    return dict(zip(keys.tolist(), slots.tolist(), strict=True))


# short keys (in the table's entries), the 15/16/17-byte edges of the inline compare and of
# the short-key hash, and long ones (out of line, XXH3's longer branches)
key_bytes = st.one_of(st.binary(max_size=18), st.binary(min_size=100, max_size=300))


@settings(max_examples=60, deadline=None)
@given(st.lists(key_bytes, max_size=120), st.lists(key_bytes, max_size=120),
       st.sampled_from([64, 2]))
def test_one_pass_probes_match_a_dict_and_the_general_path(stored, batch, bits):
    stored_keys, batch_keys = objects(stored), objects(batch + stored[:5] + batch[:5])
    table, arena = BytesTable(16, seed=7, fingerprint_bits=bits), RecordArena(8)
    slots = np.empty(len(stored_keys), np.uint32)
    snap = KeySnapshot()
    find_or_insert(table, arena, stored_keys, slots, None, snap)
    assert snap.same(stored_keys)
    model = table_dict(table)
    assert model == {k: int(s) for k, s in zip(stored, slots.tolist(), strict=True)}
    out = np.empty(len(batch_keys), np.uint32)
    snap = KeySnapshot()
    hits = table.find(batch_keys, out, snap)
    assert out.tolist() == [model.get(k, _EMPTY) for k in batch_keys.tolist()]
    assert hits == sum(k in model for k in batch_keys.tolist()) and snap.same(batch_keys)
    # the general path (a str at the end of the batch): the same slots and snapshot
    general = objects(list(batch_keys) + ["é"])
    got, snap = np.empty(len(general), np.uint32), KeySnapshot()
    table.find(general, got, snap)
    assert got.tolist() == out.tolist() + [model.get("é".encode(), _EMPTY)]
    assert snap.same(objects(list(batch_keys) + ["é".encode()]))
    # hashing: the one loop (XXH3's inline short-key branch) against the reference values
    xxhash = pytest.importorskip("xxhash")
    assert hash64(batch_keys, 5).tolist() == [xxhash.xxh3_64_intdigest(k, 5) for k in
                                              batch_keys.tolist()]


@pytest.mark.parametrize("at", [0, 5, 40, LONG_BATCH - 1])
def test_a_str_key_takes_the_general_path_with_the_same_slots(at):
    keys = [b"key-%05d" % i for i in range(LONG_BATCH)] + [b"k" * 40]
    table, arena = BytesTable(16, seed=3), RecordArena(8)
    stored = np.empty(len(keys), np.uint32)
    find_or_insert(table, arena, objects(keys), stored)
    mixed = list(keys)
    mixed[at] = mixed[at].decode()  # a str is its UTF-8 bytes
    out, snap = np.empty(len(keys), np.uint32), KeySnapshot()
    assert table.find(objects(mixed), out, snap) == len(keys)
    assert out.tolist() == stored.tolist() and snap.same(objects(keys))
    # find_or_insert with new keys before and after the str: the pass that met the str is
    # undone, the general one places every new key once
    fresh = [b"new-%05d" % i for i in range(LONG_BATCH)]
    fresh[at] = fresh[at].decode()
    batch = objects(fresh + keys[:3] + [fresh[1]])
    placed, new, missed = (np.empty(len(batch), np.uint32), np.empty(len(batch), np.uint8),
                           np.zeros(1, np.int64))
    snap = KeySnapshot()
    assert find_or_insert(table, arena, batch, placed, new, snap, missed) == LONG_BATCH
    assert missed[0] == LONG_BATCH + 1 and new.tolist() == [1] * LONG_BATCH + [0] * 4
    assert placed[LONG_BATCH:LONG_BATCH + 3].tolist() == stored[:3].tolist()
    assert placed[-1] == placed[1] and snap.same(batch)
    assert len(table) == len(keys) + LONG_BATCH and arena.live == len(table)
    want = {(k.encode() if isinstance(k, str) else k): int(s)
            for k, s in zip(fresh, placed.tolist(), strict=False)}
    assert {k: v for k, v in table_dict(table).items() if k.startswith(b"new-")} == want


@pytest.mark.parametrize("bad", [3, None, 1.5, ["a"]])
@pytest.mark.parametrize("at", [0, 40, LONG_BATCH - 1])
def test_a_wrong_type_raises_type_error_and_leaves_the_table_as_it_was(bad, at):
    table, arena = BytesTable(16, seed=3), RecordArena(8)
    old = objects([b"old-%d" % i for i in range(50)])
    find_or_insert(table, arena, old, np.empty(len(old), np.uint32))
    before, live = table_dict(table), arena.live
    batch = [b"new-%05d" % i for i in range(LONG_BATCH)]
    batch[at] = bad
    out = np.empty(LONG_BATCH, np.uint32)
    with pytest.raises(TypeError, match=type(bad).__name__):
        find_or_insert(table, arena, objects(batch), out)
    assert table_dict(table) == before and arena.live == live  # every placed key undone
    with pytest.raises(TypeError, match=type(bad).__name__):
        table.find(objects(batch), out)
    with pytest.raises(TypeError, match=type(bad).__name__):
        table.erase(objects(batch), out)
    # the slots handed back are handed out again: nothing leaked
    find_or_insert(table, arena, objects([b"x", b"y"]), np.empty(2, np.uint32))
    assert arena.live == live + 2


def test_bytes_subclasses_empty_and_long_keys_take_the_one_pass():
    keys = [np.bytes_(b"np-%d" % i) for i in range(60)] + [b"", b"\x00" * 16,
                                                          b"z" * 17, b"y" * 5000]
    plain = [bytes(k) for k in keys]
    table, arena = BytesTable(16, seed=9), RecordArena(8)
    slots = np.empty(len(keys), np.uint32)
    assert find_or_insert(table, arena, objects(keys), slots) == len(keys)
    out = np.empty(len(keys), np.uint32)
    assert table.find(objects(plain), out) == len(keys) and out.tolist() == slots.tolist()
    assert table_dict(table) == dict(zip(plain, slots.tolist(), strict=True))
    removed = np.empty(len(keys), np.uint32)
    assert table.erase(objects(plain[::-1]), removed) == len(keys)
    assert removed.tolist() == slots.tolist()[::-1] and len(table) == 0


def test_snapshot_grows_past_its_reservation_for_long_keys():
    # a probe reserves 16 bytes a key and grows the snapshot for longer keys as it copies
    keys = objects([bytes([i % 256]) * (40 + i) for i in range(300)])
    table, arena = BytesTable(16), RecordArena(8)
    snap = KeySnapshot()
    find_or_insert(table, arena, keys, np.empty(len(keys), np.uint32), None, snap)
    assert snap.same(keys) and len(snap) == len(keys)
    snap = KeySnapshot()
    assert table.find(keys, np.empty(len(keys), np.uint32), snap) == len(keys)
    assert snap.same(keys) and not snap.same(keys[::-1].copy())
    other = keys.copy()
    other[-1] = other[-1][:-1] + b"!"
    assert not snap.same(other)
    empty = KeySnapshot()
    assert table.find(objects([]), np.empty(0, np.uint32), empty) == 0 and len(empty) == 0


def test_non_contiguous_and_non_object_arrays_are_refused_as_before():
    table, arena = BytesTable(16), RecordArena(8)
    keys = objects([b"a", b"b", b"c", b"d"])
    out = np.empty(4, np.uint32)
    with pytest.raises(ValueError, match="contiguous"):
        table.find(keys[::2], out)
    with pytest.raises(ValueError, match="contiguous"):
        find_or_insert(table, arena, keys[::2], out)
    with pytest.raises(TypeError, match="object array"):
        table.find(np.array([b"a"]), out)
    with pytest.raises(ValueError, match="too few"):
        table.find(keys, np.empty(2, np.uint32))
    with pytest.raises(TypeError, match="int"):  # a wrong type is told before a short output
        find_or_insert(table, arena, objects([b"a", 1, b"c"]), np.empty(1, np.uint32))
    assert len(table) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=3), max_size=40),
       st.lists(st.binary(max_size=3), min_size=1, max_size=300))
def test_misses_count_every_position_whose_key_was_absent_before_the_call(stored, batch):
    # repeats of the call's new keys are counted after the probe, over the slots it wrote
    table, arena = BytesTable(16, seed=1), RecordArena(8)
    find_or_insert(table, arena, objects(stored), np.empty(len(stored), np.uint32))
    before = set(stored)
    out, new, missed = (np.empty(len(batch), np.uint32), np.empty(len(batch), np.uint8),
                        np.zeros(1, np.int64))
    inserted = find_or_insert(table, arena, objects(batch), out, new, None, missed)
    assert inserted == len(set(batch) - before) == int(new.sum())
    assert missed[0] == sum(k not in before for k in batch)
    first = {}
    for i, k in enumerate(batch):
        first.setdefault(k, i)
    assert new.tolist() == [int(k not in before and first[k] == i)
                            for i, k in enumerate(batch)]
    assert out.tolist() == [table_dict(table)[k] for k in batch]
