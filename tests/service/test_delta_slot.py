"""A delta read straight into a same-host follower's push slot
(``embstore.service.delta_slot``): the same one state of the shard ``delta_parts`` reads,
keys written during the read included, and the follower applies it from the segment."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np
import pytest

pytest.importorskip("pyarrow.flight")

import embstore  # noqa: E402
from embstore.service import delta_slot  # noqa: E402
from embstore.service.changelog import ChangeLog  # noqa: E402
from embstore.service.delta_slot import NO_FIT, Slot, delta_into  # noqa: E402
from embstore.service.shm import ALIGN, HEADER, Segment, host_id  # noqa: E402

from .interleave import WriteBetween  # noqa: E402

pytestmark = pytest.mark.skipif(host_id() is None, reason="no /dev/shm and boot id here")

DIM = 4


def _table(store) -> dict[int, bytes]:
    return {k: r.tobytes() for keys, recs in store.records(4096)
            for k, r in zip(keys.tolist(), recs)}


def _parts(slot: Slot, steps, dtype: np.dtype):
    """Each part ``delta_into`` yields, copied out as a subscriber does; the last seq."""
    parts, step = [], None
    for step in steps:
        n = step[1]
        assert n is not None and n != NO_FIT and n <= slot.rows
        parts.append((slot.keys[:n].copy(), slot.recs[:n].copy().reshape(-1).view(dtype),
                      slot.flags[:n].copy()))
    assert step is not None and step[2]      # the last part says so
    return parts, step[0]


def _apply_in_order(replica, parts) -> None:
    for keys, recs, found in parts:
        replica.delete(keys[~found])
        replica.load_records(iter([(keys[found], recs[found])]))


@contextmanager
def _following(follower):
    """The follower subscribed in a thread; stopped on the way out, whatever happened (a
    worker shutting down waits for its subscriptions to end)."""
    stop = threading.Event()
    t = threading.Thread(target=follower.follow, args=(stop, 0.001), daemon=True)
    t.start()
    try:
        yield stop
    finally:
        stop.set()
        t.join(60)


@contextmanager
def _served(store):
    """``store`` served by a worker in this process: ``(a trainer's client, a read-only
    client for a follower)``; the worker shut down and the store closed on the way out."""
    from embstore.service.client import DesStore
    from embstore.service.server import Worker

    w = Worker("grpc+tcp://127.0.0.1:0", store)
    threading.Thread(target=w.serve, daemon=True).start()
    try:
        with embstore.open(f"des://127.0.0.1:{w.port}") as des, \
                DesStore(f"des://127.0.0.1:{w.port}", read_only=True) as up:
            yield des, up
    finally:
        w.shutdown()
        store.close()


def _subscribed(des, local, stop) -> None:
    """Wait until the follower of ``local`` holds a marker key written now: it took the
    worker's snapshot (which may hold what was written before it subscribed), so what is
    written from here on comes as pushed deltas."""
    marker = np.array([-1])
    des.assign(marker, np.zeros((1, DIM), np.float32))
    for _ in range(3000):
        if local.contains(marker).all():
            return
        stop.wait(0.02)
    raise AssertionError("the follower never caught up with the worker")


def _segment(rows: int, itemsize: int) -> Segment:
    return Segment.create(HEADER + 3 * ALIGN + rows * (9 + itemsize))


@pytest.mark.parametrize("backend", ["memory", "lmdb"])
@pytest.mark.parametrize("rows", [100_000, 600])
def test_a_delta_read_into_the_slot_is_one_state_while_the_trainer_writes(
        backend, rows, tmp_path):
    """memory:// gathers into the slot from its arena, other backends are copied in; either
    way, in one part or in slot-sized parts, a key rewritten, deleted or new while the
    chunks were read comes with its last row, and the parts applied in order make the
    replica the table of the last read."""
    url = "memory://" if backend == "memory" else f"lmdb://{tmp_path}/t"
    with embstore.open(url, dim=DIM, optimizer="sgd") as store, \
            embstore.open("memory://", dim=DIM, optimizer="sgd") as replica:
        log = ChangeLog(version=lambda: store.version)
        store.add_observer(log)
        store.assign(np.arange(0, 3000, 2), np.ones((1500, DIM), np.float32))
        states = []

        def write() -> None:   # between chunks: rewrite, delete, and write new keys
            states.append(_table(store))
            n = len(states)
            store.assign([2 * n, 1000 + 2 * n, 2 * n + 1], np.full((3, DIM), 10 + n, np.float32))
            store.delete([2000 + 2 * n])

        seg = _segment(rows, store.layout.itemsize)
        try:
            slot = Slot(seg, HEADER, ALIGN, store.layout.itemsize)
            assert slot.rows == rows
            between = lambda: WriteBetween(write)    # noqa: E731
            parts, seq = _parts(slot, delta_into(store, log, between, 0, slot, chunk=200,
                                                 read_hold=between), store.layout.dtype)
        finally:
            seg.close()
        keys = np.concatenate([k for k, _, _ in parts])
        assert len(parts) == (1 if rows > 3000 else 3)
        assert len(states) == 9                               # 8 chunks and the last hold
        if len(parts) == 1:
            assert len(set(keys.tolist())) == len(keys) == 1500 + 8   # every key once
        assert set(keys.tolist()) == set(range(0, 3000, 2)) | {2 * n + 1 for n in range(1, 9)}
        _apply_in_order(replica, parts)
        assert _table(replica) == states[-1]    # the last hold's write came after its read
        assert seq == log.seq - 2


@pytest.mark.parametrize("backend", ["memory", "lmdb"])
def test_memory_chunks_are_read_without_the_workers_lock(backend, tmp_path):
    """memory:// serializes its own calls: only the last read (of the keys written during
    the others) takes the worker's lock; other backends' chunks each take it."""
    url = "memory://" if backend == "memory" else f"lmdb://{tmp_path}/t"
    with embstore.open(url, dim=DIM, optimizer="sgd") as store:
        log = ChangeLog(version=lambda: store.version)
        store.add_observer(log)
        store.assign(np.arange(20_000), np.ones((20_000, DIM), np.float32))
        held = []

        def hold() -> threading.Lock:
            held.append(1)
            return threading.Lock()

        seg = _segment(30_000, store.layout.itemsize)
        try:
            slot = Slot(seg, HEADER, ALIGN, store.layout.itemsize)
            parts, _ = _parts(slot, delta_into(store, log, hold, 0, slot), store.layout.dtype)
        finally:
            seg.close()
        assert len(held) == (1 if backend == "memory" else 3)    # 16k-key chunks: 2, + 1
        assert len(parts) == 1 and len(parts[0][0]) == 20_000


def test_a_delta_the_slot_cannot_carry_is_left_to_delta_parts():
    with embstore.open("memory://", dim=DIM, key_type="bytes") as store:
        log = ChangeLog(version=lambda: store.version)
        store.add_observer(log)
        store.assign([b"a", b"b"], np.ones((2, DIM), np.float32))
        assert list(delta_into(store, log, threading.Lock, 0, None)) == [(0, NO_FIT, True)]
        seg = _segment(100, store.layout.itemsize)
        try:
            slot = Slot(seg, HEADER, ALIGN, store.layout.itemsize)
            assert list(delta_into(store, log, threading.Lock, 0, slot)) == [(0, NO_FIT, True)]
        finally:
            seg.close()


def test_a_position_the_log_no_longer_holds_is_a_resync():
    with embstore.open("memory://", dim=DIM, optimizer="sgd") as store:
        log = ChangeLog(max_keys=10, version=lambda: store.version)
        store.add_observer(log)
        for i in range(3):
            store.assign(np.arange(10 * i, 10 * i + 10), np.ones((10, DIM), np.float32))
        seg = _segment(100, store.layout.itemsize)
        try:
            slot = Slot(seg, HEADER, ALIGN, store.layout.itemsize)
            assert list(delta_into(store, log, threading.Lock, 0, slot)) == [
                (log.seq, None, True)]
        finally:
            seg.close()


@pytest.fixture
def counted_steps(monkeypatch) -> list:
    """What each ``delta_into`` of the worker yields (its parts), in order."""
    steps: list = []
    real = delta_slot.delta_into

    def counted(*args, **kwargs):
        for step in real(*args, **kwargs):
            steps.append(step)
            yield step

    monkeypatch.setattr(delta_slot, "delta_into", counted)
    return steps


@pytest.mark.parametrize("slot_rows", [None, 700])
def test_a_same_host_follower_applies_deltas_read_into_the_slot(monkeypatch, slot_rows,
                                                                   counted_steps):
    """A worker in this process (to count its reads, and to shrink its slot so that deltas
    come in several parts): the deltas pushed while a trainer writes are read into the slot,
    and once it stopped the follower's replica equals the table, whole records."""
    from embstore.service import shm
    from embstore.service.follower import Follower, replica_options

    steps = counted_steps
    store = embstore.open("memory://", dim=DIM, optimizer="adagrad", initializer="zeros")
    if slot_rows:
        small = HEADER + 3 * ALIGN + slot_rows * (9 + store.layout.itemsize)
        monkeypatch.setattr(shm, "PUSH_SEGMENT", small)
        monkeypatch.setattr(shm, "MAX_PUSH_SEGMENT", small)   # no growing out of parts
    with _served(store) as (des, up):
        local = embstore.open("memory://", **replica_options(up))
        with _following(Follower(local, up)) as stop:
            _subscribed(des, local, stop)
            del steps[:]
            rng = np.random.default_rng(0)
            for i in range(40):
                k = rng.integers(0, 3000, 1000)
                des.update(k, np.full((1000, DIM), i % 3, np.float32))
                if i % 10 == 9:
                    des.delete(rng.integers(0, 3000, 50))
            des.flush()
            want = _table(store)
            for _ in range(3000):
                if _table(local) == want:
                    break
                stop.wait(0.02)
        assert _table(local) == want      # whole records: the optimizer's slots too
        keys = np.arange(-5, 3005)
        np.testing.assert_array_equal(local.lookup(keys, insert=False),
                                      des.lookup(keys, insert=False))
        assert steps and all(n is not None and n != NO_FIT for _, n, _ in steps)
        if slot_rows:
            assert any(not last for _, _, last in steps)   # several parts
        local.close()


def test_a_follower_applies_the_parts_of_an_ordered_delta_in_order():
    """A key in two parts of a shared-memory delta (written while the first was sent): the
    later part's row, or its deletion, is what the replica keeps."""
    from embstore.service.client import DesStore
    from embstore.service.follower import Follower, replica_options
    from embstore.service.server import Worker

    store = embstore.open("memory://", dim=DIM, optimizer="sgd")
    w = Worker("grpc+tcp://127.0.0.1:0", store)
    threading.Thread(target=w.serve, daemon=True).start()
    try:
        with DesStore(f"des://127.0.0.1:{w.port}", read_only=True) as up:
            local = embstore.open("memory://", **replica_options(up))
            dtype = local.layout.dtype

            def part(keys, value, found):
                recs = np.zeros(len(keys), dtype)
                recs["vector"] = value
                return np.asarray(keys), recs, np.asarray(found)

            first = part([1, 2, 3], 1.0, [True, True, True])
            later = part([1, 2, 4], 2.0, [False, True, True])   # 1 deleted, 2 rewritten
            Follower(local, up)._apply(0, 7, [first, later], ordered=True)
            assert local.contains([1, 2, 3, 4]).tolist() == [False, True, True, True]
            np.testing.assert_array_equal(local.lookup([2, 3, 4], insert=False)[:, 0],
                                          [2.0, 1.0, 2.0])
            local.close()
    finally:
        w.shutdown()
        store.close()


def test_a_delta_that_took_several_parts_makes_the_next_segment_larger(monkeypatch,
                                                                         counted_steps):
    """The first delta larger than the slot streams through it in parts; the worker then
    names a larger segment, and a delta as large comes as one part."""
    from embstore.service import shm
    from embstore.service.follower import Follower, replica_options

    steps = counted_steps
    store = embstore.open("memory://", dim=DIM, optimizer="sgd", initializer="zeros")
    monkeypatch.setattr(shm, "PUSH_SEGMENT", HEADER + 3 * ALIGN + 700 * (9 + store.layout.itemsize))
    with _served(store) as (des, up):
        local = embstore.open("memory://", **replica_options(up))
        keys = np.arange(2000)
        with _following(Follower(local, up)) as stop:
            _subscribed(des, local, stop)
            for value in (1.0, 2.0):
                del steps[:]
                des.assign(keys, np.full((2000, DIM), value, np.float32))
                for _ in range(3000):
                    if (local.lookup(keys[-1:], insert=False) == value).all():
                        break
                    stop.wait(0.02)
                assert all(n is not None and n != NO_FIT for _, n, _ in steps)
                if value == 1.0:
                    assert len(steps) == 3            # 700 + 700 + 600 rows
                else:
                    assert [n for _, n, _ in steps] == [2000]
        np.testing.assert_array_equal(local.lookup(keys, insert=False), des.lookup(keys))
        local.close()
