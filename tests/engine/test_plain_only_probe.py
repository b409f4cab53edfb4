"""A memory:// bytes-key lookup hands its object array to the table's probe unread
(``PlainOnlyProbes``): the probe is the check that every key is exactly ``bytes``, and a batch
holding anything else is refused with nothing changed, normalized and looked up again. So a
lookup reads each scattered key object once; what it returns, counts and tells observers is
what a lookup of the normalized keys gives. Reads that no update follows stop keeping a copy of
their keys (``ReadCopies``), which changes no result."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore._cython import bytestable
from embstore._cython.arena import RecordArena
from embstore._cython.bytestable import BytesTable
from embstore._cython.strkeys import KeySnapshot, NotPlainBytes
from embstore.backends.memory_rows import ReadCopies
from embstore.errors import KeyTypeError

DIM = 4


def obj(items: list) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


def words(n: int, start: int = 0) -> list[bytes]:
    return [b"w%06d" % i for i in range(start, start + n)]


def filled(n: int) -> tuple[BytesTable, RecordArena]:
    table, arena = BytesTable(64, 7), RecordArena(8)
    slots = np.empty(n, dtype=np.uint32)
    bytestable.find_or_insert(table, arena, obj(words(n)), slots)
    return table, arena


@pytest.mark.parametrize("odd", ["w000007", np.bytes_(b"w000007"), 7, None])
@pytest.mark.parametrize("at", [0, 40, 99])  # before, at and past the probe's look-ahead
def test_find_plain_only_refuses_a_key_that_is_not_exactly_bytes(odd, at):
    table, _ = filled(100)
    keys = obj(words(100))
    keys[at] = odd
    out = np.full(100, 5, dtype=np.uint32)
    with pytest.raises(NotPlainBytes):
        table.find(keys, out, KeySnapshot(), True)
    if isinstance(odd, (str, bytes)):  # without plain_only: the general views, as before
        assert table.find(keys, out) == 100
        plain, same = np.empty(100, dtype=np.uint32), obj(words(100))
        same[at] = b"w000007"
        table.find(same, plain)
        np.testing.assert_array_equal(out, plain)


def test_find_plain_only_takes_plain_bytes_as_find_does():
    table, _ = filled(300)
    keys = obj(words(200, 150))  # half stored, half absent
    a, b = np.empty(200, dtype=np.uint32), np.empty(200, dtype=np.uint32)
    snap = KeySnapshot()
    assert table.find(keys, a, snap, True) == table.find(keys, b) == 150
    np.testing.assert_array_equal(a, b)
    assert snap.same(keys)


def test_find_or_insert_plain_only_refuses_with_nothing_inserted():
    table, arena = filled(50)
    keys = obj(words(100, 25))  # 75 new keys, then a str among them
    keys[90] = "w999999"
    slots = np.empty(100, dtype=np.uint32)
    live = arena.live
    with pytest.raises(NotPlainBytes):
        bytestable.find_or_insert(table, arena, keys, slots, None, KeySnapshot(), None, True)
    assert table.size == 50 and arena.live == live
    got = np.empty(100, dtype=np.uint32)
    assert table.find(obj(words(100, 25)), got) == 25  # the refused call's keys are not there
    # without plain_only the str is its UTF-8 key, as ever
    assert bytestable.find_or_insert(table, arena, keys, slots) == 75
    assert table.size == 125


@pytest.mark.parametrize("insert", [True, False])
def test_a_lookup_of_mixed_items_equals_the_lookup_of_their_bytes(insert):
    plain = embstore.open("memory://", dim=DIM, key_type="bytes", seed=3)
    mixed = embstore.open("memory://", dim=DIM, key_type="bytes", seed=3)
    base = words(300)
    for s in (plain, mixed):
        s.lookup(obj(base[:200]))
    told: list[list] = []

    class Seen:
        def on_insert(self, keys, vectors, template):
            told.append(list(keys))

        def on_write(self, keys, records): ...
        def on_row_update(self, keys, update, found): ...
        def on_delete(self, keys): ...
        def on_bulk_load(self): ...
        def stats(self): return {}

    mixed.add_observer(Seen())
    batch = base[150:250] + base[150:160]  # stored, new and repeated keys
    items = [k.decode() if i % 3 == 0 else np.bytes_(k) if i % 3 == 1 else k
             for i, k in enumerate(batch)]
    want = plain.lookup(obj(batch), insert=insert)
    before = mixed.stats()["lookups"]
    np.testing.assert_array_equal(mixed.lookup(obj(items), insert=insert), want)
    assert mixed.stats()["lookups"] - before == len(batch)  # the refused probe counted nothing
    assert len(mixed) == len(plain) == (250 if insert else 200)
    if insert:
        assert [type(k) for k in told[0]] == [bytes] * 50 and told[0] == base[200:250]
    assert mixed.stats()["hits"] == plain.stats()["hits"]


@pytest.mark.parametrize("insert", [True, False])
def test_a_wrong_key_type_is_refused_with_the_table_unchanged(insert):
    s = embstore.open("memory://", dim=DIM, key_type="bytes")
    s.lookup(obj(words(10)))
    keys = obj(words(60, 5))
    keys[55] = 12
    with pytest.raises(KeyTypeError, match="int"):
        s.lookup(keys, insert=insert)
    assert len(s) == 10
    assert s.stats()["lookups"] == 10


def test_read_copies_stop_after_two_unrecalled_reads_and_look_again_every_16th():
    c = ReadCopies()
    taken = [c.take() for _ in range(40)]
    assert taken[:2] == [True, True] and not any(taken[2:15])
    assert [i + 1 for i, t in enumerate(taken) if t] == [1, 2, 16, 32]
    c.settled(False)  # an update with no copy to recall: still not keeping one
    assert not c.take()
    while not c.take():
        pass
    c.settled(True)  # that read's copy was recalled: every read keeps one again
    for _ in range(3):
        assert c.take()
        c.settled(True)


@pytest.mark.parametrize("key_type", ["bytes", "int64"])
def test_rows_do_not_depend_on_which_reads_kept_a_copy(key_type):
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 500, (60, 64))
    as_keys = ((lambda b: obj([b"k%d" % i for i in b])) if key_type == "bytes"
               else (lambda b: b.astype(np.int64)))
    grads = rng.standard_normal((60, 64, DIM)).astype(np.float32)
    stores = [embstore.open("memory://", dim=DIM, key_type=key_type, seed=1,
                            optimizer=embstore.optim.Adagrad(lr=0.1)) for _ in range(2)]
    for i in range(60):
        k = as_keys(ids[i])
        # the first store: steps, then runs of lookups alone; the second: every step
        # preceded by reads of other batches (no copy of them recalled)
        stores[0].lookup(k)
        if i % 20 < 10:
            stores[0].update(k, grads[i])
        stores[1].lookup(as_keys(ids[(i + 7) % 60]))
        stores[1].lookup(k)
        stores[1].lookup(as_keys(ids[(i + 3) % 60]), insert=False)
        if i % 20 < 10:
            stores[1].update(k, grads[i])
    keys = as_keys(np.arange(500))
    a, b = (s.lookup(keys, insert=False) for s in stores)
    np.testing.assert_array_equal(a, b)
