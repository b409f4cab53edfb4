"""A memory:// delta read by one compiled call (``backends.memory.gather_into``, the push's
path into a follower's slot): the rows and presence ``backend.get`` reads, the backend's
lock taken per chunk to probe and let go before the rows are copied, a clear waiting for a
copy under way, and one state of the shard while a trainer writes."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import embstore
from embstore._cython import deltaops
from embstore._cython.arena import release_pool
from embstore.backends.memory import gather_into
from embstore.errors import StoreClosedError
from embstore.service.changelog import ChangeLog

from .interleave import Training, table_of

DIM = 4


def _gathered(store, keys: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    w = store.layout.itemsize
    out = np.full((len(keys), w), 0xAB, np.uint8)   # absent rows must be zeroed
    found = np.full(len(keys), 7, np.uint8)
    gather_into(store.backend, keys, out, found, chunk)
    return out, found


@pytest.mark.parametrize("value_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_the_rows_are_those_get_reads(value_dtype, chunk):
    """Present, deleted and never-written keys, in any order and with repeats, for 32- and
    16-bit rows: the bytes and presence of ``backend.get``."""
    with embstore.open("memory://", dim=DIM, optimizer="sgd", value_dtype=value_dtype) as s:
        rng = np.random.default_rng(0)
        s.assign(np.arange(500), rng.standard_normal((500, DIM)).astype(np.float32))
        s.delete(np.arange(0, 500, 3))          # deleted: absent, their slots reused below
        s.assign(np.arange(1000, 1100), np.ones((100, DIM), np.float32))
        keys = rng.permutation(np.concatenate([np.arange(1200), [5, 5, 1050]]))
        recs, found = s.backend.get(keys)
        out, got = _gathered(s, keys, chunk)
        assert np.array_equal(got, np.asarray(found, np.uint8))
        assert np.array_equal(out, np.ascontiguousarray(recs).view(np.uint8)
                              .reshape(len(keys), -1))
        assert not out[got == 0].any()


def test_the_lock_and_tables_are_taken_per_chunk():
    with embstore.open("memory://", dim=DIM) as s:
        s.assign(np.arange(100), np.ones((100, DIM), np.float32))
        lock, table, arena, _ = s.backend.fused_table()
        entered, named = [], []

        class Counting:
            def __enter__(self):
                entered.append(lock.__enter__())

            def __exit__(self, *exc):
                lock.__exit__(*exc)

        def tables():
            named.append(1)
            return table, arena

        out = np.zeros((100, s.layout.itemsize), np.uint8)
        deltaops.gather_keys(Counting(), tables, np.arange(100), out, np.zeros(100, np.uint8),
                             30)
        assert len(entered) == len(named) == 4      # 30 + 30 + 30 + 10


def test_the_rows_are_copied_after_the_lock_is_let_go():
    """A trainer's call waits for a chunk's probe, not for its copy: when the lock is let go
    the chunk's rows are not written yet (the copy follows), and they are by the next
    chunk's lock."""
    with embstore.open("memory://", dim=DIM) as s:
        s.assign(np.arange(100), np.ones((100, DIM), np.float32))
        lock, table, arena, _ = s.backend.fused_table()
        out = np.full((100, s.layout.itemsize), 0xAB, np.uint8)
        at_exit, at_enter = [], []

        class Watching:
            def __enter__(self):
                at_enter.append(out.copy())
                lock.__enter__()

            def __exit__(self, *exc):
                at_exit.append(out.copy())
                lock.__exit__(*exc)

        deltaops.gather_keys(Watching(), lambda: (table, arena), np.arange(100), out,
                             np.zeros(100, np.uint8), 40)
        for i, (lo, hi) in enumerate([(0, 40), (40, 80), (80, 100)]):
            assert (at_exit[i][lo:hi] == 0xAB).all()     # not copied under the lock
            assert (at_exit[i][:lo] != 0xAB).any(axis=1).all()
        assert (at_enter[1][:40] != 0xAB).any(axis=1).all()
        assert (out != 0xAB).any(axis=1).all()


def test_bad_arguments_are_refused():
    with embstore.open("memory://", dim=DIM) as s:
        s.assign(np.arange(10), np.ones((10, DIM), np.float32))
        w, keys = s.layout.itemsize, np.arange(10)
        with pytest.raises(ValueError, match="width"):
            gather_into(s.backend, keys, np.zeros((10, w + 8), np.uint8), np.zeros(10, np.uint8),
                                  4)
        with pytest.raises(ValueError, match="fewer rows"):
            gather_into(s.backend, keys, np.zeros((9, w), np.uint8), np.zeros(10, np.uint8), 4)
        with pytest.raises(ValueError, match="chunk"):
            gather_into(s.backend, keys, np.zeros((10, w), np.uint8), np.zeros(10, np.uint8), 0)
    with pytest.raises(StoreClosedError):
        gather_into(s.backend, keys, np.zeros((10, w), np.uint8), np.zeros(10, np.uint8), 4)
    with embstore.open("memory://", dim=DIM, key_type="bytes") as s:
        with pytest.raises(TypeError):
            lock, table, arena, _ = s.backend.fused_table()
            deltaops.gather_keys(lock, lambda: (table, arena), keys,
                                 np.zeros((10, s.layout.itemsize), np.uint8),
                                 np.zeros(10, np.uint8), 4)


def test_a_delta_read_while_a_trainer_writes_is_one_state():
    """The compiled read takes no worker lock: a trainer's writes (new keys, rewrites,
    deletions) land while its chunks are read, and the keys they changed are read again
    under the worker's lock at the end; the parts applied make the replica the table then."""
    from embstore.service.delta_slot import Slot, delta_into
    from embstore.service.shm import ALIGN, HEADER, Segment

    def write(rng: np.random.Generator) -> None:
        k = rng.integers(0, 300_000, 64)
        store.assign(k, rng.standard_normal((64, DIM)).astype(np.float32))
        store.delete(rng.integers(0, 300_000, 4))

    with embstore.open("memory://", dim=DIM, optimizer="sgd") as store, \
            embstore.open("memory://", dim=DIM, optimizer="sgd") as replica:
        log = ChangeLog(version=lambda: store.version)
        store.add_observer(log)
        store.assign(np.arange(200_000), np.ones((200_000, DIM), np.float32))
        seg = Segment.create(HEADER + 3 * ALIGN + 400_000 * (9 + store.layout.itemsize))
        try:
            with Training(store, write) as training:
                slot = Slot(seg, HEADER, ALIGN, store.layout.itemsize)
                with training.lock:
                    before = training.writes
                steps = list(delta_into(store, log, training.last, 0, slot, chunk=2048))
            assert len(steps) == 1 and steps[0][2]
            n = steps[0][1]
            keys, found = slot.keys[:n].copy(), slot.flags[:n].copy()
            recs = slot.recs[:n].copy().reshape(-1).view(store.layout.dtype)
        finally:
            seg.close()
        assert len(training.states) == 1 and len(set(keys.tolist())) == n
        # the trainer wrote while the chunks were read
        assert training.writes_at_last[0] > before
        replica.load_records(iter([(keys[found], recs[found])]))
        assert table_of(replica) == training.states[0]


def test_a_clear_waits_for_the_rows_being_copied():
    """The rows are copied after the backend's lock is released, through addresses taken
    under it: the arena is pinned meanwhile, so a ``clear`` (which unmaps its chunks) waits
    for the copy instead of pulling the memory out from under it; every row read is the
    row its key had when it was probed."""
    dim, n = 64, 100_000
    with embstore.open("memory://", dim=dim, optimizer="sgd") as s:
        keys = np.arange(n)
        vectors = np.repeat(keys.astype(np.float32)[:, None], dim, axis=1)
        s.assign(keys, vectors)
        stop, clears = threading.Event(), [0]

        def clear_and_refill() -> None:
            rng = np.random.default_rng(0)
            while not stop.is_set():
                s.backend.clear()
                release_pool()      # the chunks unmapped, not kept for the next arena
                order = rng.permutation(n)      # each key's row lands in another slot
                s.assign(keys[order], vectors[order])
                clears[0] += 1

        t = threading.Thread(target=clear_and_refill, daemon=True)
        t.start()
        try:
            for _ in range(30):
                out, found = _gathered(s, keys, 8192)
                got = out.view(s.layout.dtype).reshape(-1)["vector"]
                hit = found == 1
                assert np.array_equal(got[hit], vectors[hit])
                assert not out[~hit].any()
        finally:
            stop.set()
            t.join(30)
        assert clears[0] > 0


@pytest.mark.parametrize("rows", [400_000, 70_000])
def test_keys_written_during_the_read_are_read_again_outside_the_lock(monkeypatch, rows):
    """The catch-up rounds (every round here: ``CATCH_UP_MIN`` 0) read the keys written
    during the read without the worker's lock, placed over their rows in the part or after
    them, across several parts where the slot is small; the worker's lock is taken once, at
    the end, and the parts applied in order make the replica the table then."""
    from embstore.service import delta
    from embstore.service.delta_slot import Slot, delta_into
    from embstore.service.shm import ALIGN, HEADER, Segment

    def write(rng: np.random.Generator) -> None:
        k = rng.integers(0, 300_000, 256)
        store.update(k, rng.standard_normal((256, DIM)).astype(np.float32))
        store.delete(rng.integers(0, 300_000, 8))

    monkeypatch.setattr(delta, "CATCH_UP_MIN", 0)
    with embstore.open("memory://", dim=DIM, optimizer="sgd") as store:
        log = ChangeLog(version=lambda: store.version)
        store.add_observer(log)
        store.assign(np.arange(200_000), np.ones((200_000, DIM), np.float32))
        seg = Segment.create(HEADER + 3 * ALIGN + rows * (9 + store.layout.itemsize))
        table: dict[int, bytes] = {}
        try:
            with Training(store, write, seed=2) as training:
                training.watch(log, monkeypatch)
                slot = Slot(seg, HEADER, ALIGN, store.layout.itemsize)
                parts = 0
                for _, n, _last in delta_into(store, log, training.last, 0, slot, chunk=2048):
                    parts += 1
                    recs = slot.recs[:n].reshape(-1).view(store.layout.dtype)
                    for k, f, r in zip(slot.keys[:n].tolist(), slot.flags[:n].tolist(), recs):
                        if f:
                            table[k] = r.tobytes()
                        else:
                            table.pop(k, None)
        finally:
            seg.close()
        assert len(training.states) == 1 and table == training.states[0]
        calls = training.calls     # the first since, each round's, the last under the lock
        assert 1 <= len(calls) - 2 <= delta.CATCH_UP_ROUNDS
        assert calls[-1] and not any(calls[:-1])
        assert parts == 1 if rows > 300_000 else parts >= 3
