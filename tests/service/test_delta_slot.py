"""A delta read straight into a same-host follower's push slot
(``embstore.service.delta_slot``): the same one state of the shard ``delta_parts`` reads,
keys written during the read included, and the follower applies it from the segment."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("pyarrow.flight")

import embstore  # noqa: E402
from embstore.service import delta_slot  # noqa: E402
from embstore.service.changelog import ChangeLog  # noqa: E402
from embstore.service.delta_slot import NO_FIT, Slot, delta_into  # noqa: E402
from embstore.service.shm import ALIGN, HEADER, Segment, host_id  # noqa: E402

pytestmark = pytest.mark.skipif(host_id() is None, reason="no /dev/shm and boot id here")

DIM = 4


class _WriteBetween:
    """A worker lock whose every release lets the trainer write once (as a trainer's call
    waiting on the lock would): deterministic interleaving, no threads."""

    def __init__(self, write) -> None:
        self.write = write

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        self.write()


def _table(store) -> dict[int, bytes]:
    return {k: r.tobytes() for keys, recs in store.records(4096)
            for k, r in zip(keys.tolist(), recs)}


def _slot_rows(slot: Slot, n: int, dtype: np.dtype):
    return (slot.keys[:n].copy(), slot.recs[:n].copy().reshape(-1).view(dtype),
            slot.flags[:n].copy())


@pytest.fixture
def segment():
    seg = Segment.create(1 << 20)
    yield seg
    seg.close()


@pytest.mark.parametrize("backend", ["memory", "lmdb"])
def test_a_delta_read_into_the_slot_is_one_state_while_the_trainer_writes(
        backend, segment, tmp_path):
    """memory:// gathers into the slot from its arena, other backends are copied in; either
    way a key rewritten, deleted or new while the chunks were read travels once, as read
    last, and the delta applied makes the replica the table of the last read."""
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

        slot = Slot(segment, HEADER, ALIGN, store.layout.itemsize)
        seq, n = delta_into(store, log, lambda: _WriteBetween(write), 0, slot, chunk=200)
        assert n is not None and n != NO_FIT and len(states) == 9  # 8 chunks and the last
        keys, recs, found = _slot_rows(slot, n, store.layout.dtype)
        assert len(set(keys.tolist())) == n == 1500 + 8      # every key once, new ones too
        assert not found[np.isin(keys, [2002, 2004])].any()   # deleted meanwhile
        replica.delete(keys[~found])
        replica.load_records(iter([(keys[found], recs[found])]))
        assert _table(replica) == states[-1]    # the last hold's write came after its read
        assert seq == log.seq - 2


def test_a_delta_that_does_not_fit_the_slot_is_left_to_delta_parts(segment):
    with embstore.open("memory://", dim=DIM, optimizer="sgd") as store:
        log = ChangeLog(version=lambda: store.version)
        store.add_observer(log)
        slot = Slot(segment, HEADER, ALIGN, store.layout.itemsize)
        store.assign(np.arange(slot.rows - 2), np.ones((slot.rows - 2, DIM), np.float32))
        assert delta_into(store, log, threading.Lock, 0, None) == (0, NO_FIT)   # no slot
        assert delta_into(store, log, threading.Lock, 0, slot) == (log.seq, slot.rows - 2)
        # new keys written during the read that overflow it: all of it read the other way
        more = iter([np.arange(slot.rows, slot.rows + 5)])

        def write() -> None:
            k = next(more, None)
            if k is not None:
                store.assign(k, np.ones((5, DIM), np.float32))

        assert delta_into(store, log, lambda: _WriteBetween(write), 0, slot,
                          chunk=slot.rows)[1] == NO_FIT
        store.assign(np.arange(slot.rows + 1), np.ones((slot.rows + 1, DIM), np.float32))
        assert delta_into(store, log, threading.Lock, 0, slot)[1] == NO_FIT


def test_a_position_the_log_no_longer_holds_is_a_resync(segment):
    with embstore.open("memory://", dim=DIM, optimizer="sgd") as store:
        log = ChangeLog(max_keys=10, version=lambda: store.version)
        store.add_observer(log)
        for i in range(3):
            store.assign(np.arange(10 * i, 10 * i + 10), np.ones((10, DIM), np.float32))
        slot = Slot(segment, HEADER, ALIGN, store.layout.itemsize)
        assert delta_into(store, log, threading.Lock, 0, slot) == (log.seq, None)


def test_a_same_host_follower_applies_deltas_read_into_the_slot(monkeypatch):
    """A worker in this process (to count its reads): the pushed deltas are read into the
    slot and the follower's replica equals the table."""
    from embstore.service.client import DesStore
    from embstore.service.follower import Follower, replica_options
    from embstore.service.server import Worker

    calls = []
    real = delta_slot.delta_into

    def counted(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out[1])
        return out

    monkeypatch.setattr(delta_slot, "delta_into", counted)
    store = embstore.open("memory://", dim=DIM, optimizer="adagrad", initializer="zeros")
    w = Worker("grpc+tcp://127.0.0.1:0", store)
    threading.Thread(target=w.serve, daemon=True).start()
    try:
        with embstore.open(f"des://127.0.0.1:{w.port}") as des, \
                DesStore(f"des://127.0.0.1:{w.port}", read_only=True) as up:
            local = embstore.open("memory://", **replica_options(up))
            follower = Follower(local, up)
            stop = threading.Event()
            t = threading.Thread(target=follower.follow, args=(stop, 0.01), daemon=True)
            t.start()
            keys = np.arange(-5, 3000)
            for i in range(5):
                des.update(np.arange(i * 500, i * 500 + 1000), np.full((1000, DIM), i, np.float32))
            des.delete(np.arange(0, 3000, 7))
            want = _table(store)
            deadline = threading.Event()
            for _ in range(3000):
                if _table(local) == want:
                    break
                deadline.wait(0.02)
            stop.set()
            t.join(60)
            assert _table(local) == want      # whole records: the optimizer's slots too
            np.testing.assert_array_equal(local.lookup(keys, insert=False),
                                          des.lookup(keys, insert=False))
            assert any(c is not None and c > 0 for c in calls), calls
            assert NO_FIT not in calls
            local.close()
    finally:
        w.shutdown()
        store.close()
