"""A follower's delta read in chunks (``embstore.service.delta``): one state of the shard
however the trainer writes meanwhile, deletions included, and applied to a replica it makes
the replica equal the trainer's table."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import embstore
from embstore.service.changelog import ChangeLog
from embstore.service.delta import read_delta

from .interleave import Training, WriteBetween

DIM = 4
KEYS = np.arange(3000)


def _apply(replica, rows) -> None:
    keys, recs, found = rows
    if (~found).any():
        replica.delete(keys[~found])
    if found.any():
        replica.load_records(iter([(keys[found], recs[found])]))


def _table(store) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    for keys, recs in store.records(4096):
        for k, r in zip(keys.tolist(), recs):
            out[k] = r.tobytes()
    return out


def test_a_chunked_delta_is_one_state_while_the_trainer_writes():
    """Every write sets the whole key range to one generation: a delta mixing two writes
    would hold rows of two generations."""
    with embstore.open("memory://", dim=DIM, optimizer="sgd") as store:
        log = ChangeLog(version=lambda: store.version)
        store.add_observer(log)
        gens = [0]

        def write() -> None:
            gens[0] += 1
            store.assign(KEYS, np.full((len(KEYS), DIM), gens[0], np.float32))

        write()
        seq = 0
        for _ in range(3):
            seq, rows = read_delta(store, log, lambda: WriteBetween(write), seq, chunk=64,
                                   free=False)
            assert rows is not None
            keys, recs, found = rows
            assert found.all() and sorted(keys.tolist()) == KEYS.tolist()
            values = store.layout.vectors(recs)
            assert len(np.unique(values)) == 1, "rows of two writes in one delta"
        assert gens[0] > 3 * len(KEYS) // 64


def test_coalesced_deltas_make_the_replica_equal_the_table_deletions_included():
    rng = np.random.default_rng(5)
    lock = threading.Lock()
    with embstore.open("memory://", dim=DIM, optimizer="adagrad") as store, \
            embstore.open("memory://", dim=DIM, optimizer="adagrad") as replica:
        log = ChangeLog(version=lambda: store.version)
        store.add_observer(log)
        seq = 0
        for round_ in range(6):
            for _ in range(5):   # several writes coalesced into one delta
                keys = rng.integers(0, 500, 200)
                store.update(keys, rng.standard_normal((200, DIM), dtype=np.float32))
                store.lookup(rng.integers(500, 700, 20))        # inserts
                store.delete(rng.integers(0, 700, 30))           # deletions
            seq, rows = read_delta(store, log, lambda: lock, seq, chunk=37 + round_)
            assert rows is not None
            _apply(replica, rows)
            assert _table(replica) == _table(store)
        # a key deleted and written again within one delta arrives as its last state
        store.delete([1])
        store.assign([1], np.ones((1, DIM)))
        store.delete([2])
        seq, rows = read_delta(store, log, lambda: lock, seq, chunk=1)
        _apply(replica, rows)
        assert _table(replica) == _table(store)
        assert read_delta(store, log, lambda: lock, seq)[1][0].tolist() == []


def test_a_delta_older_than_the_log_asks_for_a_snapshot():
    lock = threading.Lock()
    with embstore.open("memory://", dim=DIM) as store:
        log = ChangeLog(max_keys=10, version=lambda: store.version)
        store.add_observer(log)
        store.assign(np.arange(8), np.ones((8, DIM)))
        store.assign(np.arange(100, 108), np.ones((8, DIM)))   # pushes the first batch out
        assert read_delta(store, log, lambda: lock, 0)[1] is None
        seq, rows = read_delta(store, log, lambda: lock, 1)
        assert rows is not None and sorted(rows[0].tolist()) == list(range(100, 108))
        assert seq == log.seq


def test_a_large_answer_travels_in_slices_that_read_back_whole():
    import pyarrow as pa

    from embstore.service import wire
    from embstore.service.delta import message_slices

    with embstore.open("memory://", dim=DIM, optimizer="adagrad") as store:
        store.update(KEYS, np.ones((len(KEYS), DIM), np.float32))
        recs, found = store.get_records(KEYS)
    col = pa.Array.from_buffers(pa.binary(recs.dtype.itemsize), len(KEYS),
                                [None, pa.py_buffer(recs.view(np.uint8))])
    batch = pa.RecordBatch.from_pydict({"key": pa.array(KEYS), "rec": col,
                                        "found": pa.array(found)})
    batch = batch.replace_schema_metadata({"seq": "7"})
    parts = message_slices(batch, max_bytes=batch.nbytes // 10)
    assert 10 <= len(parts) <= 12 and all(p.nbytes <= batch.nbytes // 9 for p in parts)
    assert message_slices(batch) == [batch]
    # through Arrow IPC, as Flight sends them: one table equal to the batch
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        for p in parts:
            w.write_batch(p)
    table = pa.ipc.open_stream(sink.getvalue()).read_all()
    assert table.schema.metadata == {b"seq": b"7"}
    keys, got = wire.records_from(table, "int64", recs.dtype, copy=False)
    assert keys.tolist() == KEYS.tolist() and got.tobytes() == recs.tobytes()


def test_a_delta_read_in_chunks_stays_in_parts_no_key_in_two():
    """Parts of at most ``chunk`` rows (plus the keys written meanwhile), never joined into
    one array: joining made memory the kernel zeroed at every push. Applied together they
    are the one state ``read_delta`` gives."""
    from embstore.service.delta import delta_parts

    with embstore.open("memory://", dim=DIM, optimizer="sgd") as store, \
            embstore.open("memory://", dim=DIM, optimizer="sgd") as replica:
        log = ChangeLog(version=lambda: store.version)
        store.add_observer(log)
        store.assign(KEYS, np.ones((len(KEYS), DIM), np.float32))
        rewrites = iter(range(100))

        def write() -> None:     # the trainer rewrites keys 0..9 between chunks
            store.assign(np.arange(10), np.full((10, DIM), next(rewrites), np.float32))

        seq, parts = delta_parts(store, log, lambda: WriteBetween(write), 0, chunk=500,
                                  free=False)
        # keys 0..9, rewritten meanwhile, are written over in the first part: no part more
        assert parts is not None and len(parts) == 6
        assert all(len(k) <= 500 for k, _, _ in parts)
        keys = np.concatenate([k for k, _, _ in parts])
        assert sorted(keys.tolist()) == KEYS.tolist()          # every key once
        for k, r, f in parts:
            _apply(replica, (k, r, f))
        # the last hold's write came after the final read: one write short of the store
        write_before_last = store.lookup(np.arange(10), insert=False) - 1
        np.testing.assert_array_equal(replica.lookup(np.arange(10), insert=False),
                                      write_before_last)
        assert seq == log.seq - 1




@pytest.mark.parametrize("key_type", ["int64", "bytes"])
def test_keys_written_between_chunks_travel_once_as_read_last(key_type):
    """A key written while the chunks were read is read again at the end: one already in a
    part gets its last row (or its deletion) there, one new to the delta comes in a part of
    its own; either way every key once, all as of the final read."""
    from embstore.service.delta import delta_parts

    def keys(ks):
        return np.asarray(ks) if key_type == "int64" else [b"%05d" % k for k in ks]

    with embstore.open("memory://", dim=DIM, key_type=key_type) as store, \
            embstore.open("memory://", dim=DIM, key_type=key_type) as replica:
        log = ChangeLog(version=lambda: store.version)
        store.add_observer(log)
        store.assign(keys(range(0, 3000, 2)), np.ones((1500, DIM), np.float32))
        states = []

        def write() -> None:   # between chunks: rewrite, delete, and write new keys
            states.append(_table(store))
            n = len(states)
            store.assign(keys([2 * n, 1000 + 2 * n, 2 * n + 1]),
                         np.full((3, DIM), 10 + n, np.float32))
            store.delete(keys([2000 + 2 * n]))

        seq, parts = delta_parts(store, log, lambda: WriteBetween(write), 0, chunk=200,
                                  free=False)
        assert parts is not None and len(states) == 9   # 8 chunks and the last hold
        got = [k for ks, _, _ in parts for k in ks.tolist()]
        assert len(got) == len(set(got)), "a key in two parts"
        for rows in parts:
            _apply(replica, rows)
        # the state of the last hold's read (its write came after it)
        assert _table(replica) == states[-1]
        assert seq == log.seq - 2


def test_a_memory_delta_is_read_outside_the_lock_and_is_one_state(monkeypatch):
    """``memory://`` int64 keys: the chunks and the catch-up rounds (every round here:
    ``CATCH_UP_MIN`` 0) read without the worker's lock while a trainer thread writes
    (updates, deletions, new keys), the lock taken once, at the end; the parts, no key in
    two, make the replica the table as of that last read."""
    from embstore.service import delta
    from embstore.service.delta import delta_parts

    def write(rng: np.random.Generator) -> None:
        k = rng.integers(0, 150_000, 256)
        store.update(k, rng.standard_normal((256, DIM)).astype(np.float32))
        store.delete(rng.integers(0, 150_000, 8))

    monkeypatch.setattr(delta, "CATCH_UP_MIN", 0)
    with embstore.open("memory://", dim=DIM, optimizer="sgd") as store, \
            embstore.open("memory://", dim=DIM, optimizer="sgd") as replica:
        log = ChangeLog(version=lambda: store.version)
        store.add_observer(log)
        store.assign(np.arange(100_000), np.ones((100_000, DIM), np.float32))
        with Training(store, write, seed=3) as training:
            training.watch(log, monkeypatch)
            seq, parts = delta_parts(store, log, training.last, 0, chunk=4096)
        assert parts is not None and len(training.states) == 1
        got = [k for ks, _, _ in parts for k in ks.tolist()]
        assert len(got) == len(set(got)), "a key in two parts"
        for rows in parts:
            _apply(replica, rows)
        assert _table(replica) == training.states[0]
        assert 1 <= len(training.calls) - 2 <= delta.CATCH_UP_ROUNDS
        assert training.calls[-1] and not any(training.calls[:-1])
