"""Followers that subscribe: real `embstore serve` workers push their change logs to a
follower (`--follow`, `embstore.service.push`) and to in-process subscriptions on loopback.

No test depends on timing: each waits (up to a generous deadline) for the follower to equal
the trainers' table, and checks through the follower's counters which path brought it there.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

import embstore

pytest.importorskip("pyarrow.flight")

import pyarrow.flight as flight  # noqa: E402

from embstore.errors import BackendError, InvalidInputError  # noqa: E402
from embstore.service import wire  # noqa: E402
from embstore.service.client import DesStore  # noqa: E402
from embstore.service.follower import Follower, replica_options  # noqa: E402
from embstore.testing.service import WorkerProcess, start_worker, start_workers  # noqa: E402

SGD1 = json.dumps({"name": "sgd", "lr": 1.0})
DIM = 8


def _table(store, keys):
    return store.lookup(keys, insert=False), store.contains(keys)


def _wait_equal(served, des, keys, seconds=60.0):
    """Wait until ``served`` answers ``keys`` as ``des`` does; the last answers of both."""
    want = _table(des, keys)
    deadline = time.monotonic() + seconds
    while True:
        got = _table(served, keys)
        if all(np.array_equal(a, b) for a, b in zip(got, want)) or time.monotonic() > deadline:
            return got, want
        time.sleep(0.02)


def _catch_up(follower, des, keys, mode):
    """One poll, or a subscription followed until the replica holds ``des``'s rows; then
    the replica must equal ``des`` on ``keys``."""
    if mode == "poll":
        follower.poll()
    else:
        stop = threading.Event()
        t = threading.Thread(target=follower.follow, args=(stop, 0.01), daemon=True)
        t.start()
        _wait_equal(follower.local, des, keys)
        stop.set()
        t.join(60)
    _assert_equal(_table(follower.local, keys), _table(des, keys))


def _assert_equal(got, want):
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_a_subscribed_follower_equals_the_trainers_table_after_a_flush(tmp_path):
    with start_workers(["memory://", "memory://"], dim=DIM, optimizer="adagrad",
                       initializer="zeros") as workers, embstore.open(workers.url) as des:
        des.update(np.arange(300), np.ones((300, DIM), np.float32))
        # no --poll: the follower subscribes to both workers
        replica = WorkerProcess([f"lmdb://{tmp_path}/replica", "--listen", "127.0.0.1:0",
                                 "--follow", workers.url, "--push-interval", "0.02"])
        try:
            with embstore.open(f"des://{replica.address}") as served:
                keys = np.arange(-10, 1100)
                _assert_equal(_table(served, keys), _table(des, keys))  # whole at start
                for i in range(5):   # updates, new keys and deletions, pushed as they come
                    des.update(np.arange(250, 350), np.full((100, DIM), i, np.float32))
                    des.delete(np.arange(20 * i, 20 * i + 20))
                    des.lookup(np.arange(1000 + 10 * i, 1010 + 10 * i))
                des.flush()
                _assert_equal(*_wait_equal(served, des, keys))
                assert len(served) == len(des)
                st = served.stats()
                # the first snapshot of each worker, then only pushed deltas
                assert st["follower_snapshots"] == 2 and st["follower_rows_applied"] > 0
                assert st["follower_resubscribes"] == 0
        finally:
            replica.stop()


def test_a_follower_resubscribes_and_catches_up_after_its_worker_restarts(tmp_path):
    url = f"lmdb://{tmp_path}/w0"
    w = start_worker(url, dim=DIM, optimizer=SGD1, initializer="zeros")
    replica = None
    try:
        with embstore.open(f"des://{w.address}") as des:
            des.update(np.arange(100), np.ones((100, DIM), np.float32))
            des.flush()
        replica = WorkerProcess(["memory://", "--listen", "127.0.0.1:0", "--follow",
                                 f"des://{w.address}", "--push-interval", "0.02"])
        w.kill()
        w = start_worker(url, port=w.port, dim=DIM, optimizer=SGD1)
        keys = np.arange(-5, 300)
        with embstore.open(f"des://{w.address}") as des, \
                embstore.open(f"des://{replica.address}") as served:
            # the restarted worker's log counts from the start again: more batches than the
            # follower had seen, which only the log's id tells apart from the old ones
            for i in range(20):
                des.update([100 + i], np.ones((1, DIM), np.float32))
            des.delete(np.arange(0, 10))
            des.flush()
            _assert_equal(*_wait_equal(served, des, keys))
            st = served.stats()
            assert st["follower_resubscribes"] >= 1 and st["follower_snapshots"] >= 2
    finally:
        w.kill()
        if replica is not None:
            replica.stop()


def _follower(upstream: DesStore) -> Follower:
    return Follower(embstore.open("memory://", **replica_options(upstream)), upstream)


@pytest.mark.parametrize("mode", ["poll", "push"])
def test_a_restarted_workers_log_is_not_read_as_the_old_one(tmp_path, mode):
    """A follower at sequence number n of a worker that restarts must not take the new log's
    changes after n as what it missed: it takes a snapshot (the log ids differ)."""
    url = f"lmdb://{tmp_path}/r0"
    w = start_worker(url, dim=DIM, optimizer=SGD1, initializer="zeros")
    try:
        with embstore.open(f"des://{w.address}") as des:
            for i in range(5):
                des.update([i], np.ones((1, DIM), np.float32))
            des.flush()
        up = embstore.open(f"des://{w.address}", read_only=True)
        follower = _follower(up)
        follower.poll()
        assert follower.seqs == [5]
        w.kill()
        w = start_worker(url, port=w.port, dim=DIM, optimizer=SGD1)
        with embstore.open(f"des://{w.address}") as des:
            for i in range(10):   # the new log's batches 1..10: keys 10..19
                des.update([10 + i], np.ones((1, DIM), np.float32))
            des.delete([0])       # batch 11
            keys = np.arange(25)
            _catch_up(follower, des, keys, mode)
            assert follower.snapshots == 2
        up.close()
    finally:
        w.kill()


def test_a_subscriber_behind_the_retained_log_is_told_to_resync():
    w = start_worker("memory://", dim=DIM, optimizer=SGD1, extra=["--log-keys", "15"])
    try:
        with embstore.open(f"des://{w.address}") as des:
            log_id, seq, _ = des.shard_state(0)
            for i in range(4):
                des.update(np.arange(10 * i, 10 * i + 10), np.ones((10, DIM), np.float32))
            with des.shard_subscribe(0, seq, log_id, interval=0.01) as sub:
                first = next(iter(sub))
            assert first.resync and first.rows is None
            # a position the log never reached (another worker's, a hostile client's): resync
            with des.shard_subscribe(0, 1000, log_id, interval=0.01) as sub:
                assert next(iter(sub)).resync
            # from the newest batch the log holds, the rows come: keys 30..39, deleted too
            with des.shard_subscribe(0, 3, log_id, interval=0.01) as sub:
                des.delete([31])
                pushed = []
                for push in sub:
                    assert not push.resync
                    if push.rows:
                        pushed.append(push)
                    if push.seq == 5:
                        break
            keys = np.concatenate([k for p in pushed for k, _, _ in p.rows])
            found = np.concatenate([f for p in pushed for _, _, f in p.rows])
            assert set(keys.tolist()) >= set(range(30, 40))
            assert not found[keys == 31][-1]
    finally:
        w.stop()


def test_a_subscription_to_a_stopped_worker_raises_a_backend_error():
    w = start_worker("memory://", dim=DIM)
    des = embstore.open(f"des://{w.address}")
    try:
        sub = des.shard_subscribe(0, 0, None, interval=0.01)
        w.kill()
        with pytest.raises(BackendError, match=w.address):
            for _ in sub:
                pass
        sub.close()
    finally:
        des.close()
        w.kill()


def test_subscribe_checks_its_interval_and_since():
    w = start_worker("memory://", dim=DIM)
    try:
        with embstore.open(f"des://{w.address}") as des:
            for bad in (0.0, 1e9, "x"):
                with pytest.raises(InvalidInputError, match="interval"):
                    for _ in des.shard_subscribe(0, 0, None, interval=bad):
                        pass
            # a hostile client's since: one typed line, the worker serves on
            client = flight.FlightClient(f"grpc+tcp://{w.address}")
            for bad in ("x", True, None):
                writer, reader = client.do_exchange(wire.command("subscribe", shard=0,
                                                                 shards=1, since=bad))
                with pytest.raises(flight.FlightServerError, match="since must be an int"):
                    reader.read_chunk()
                with pytest.raises(flight.FlightServerError):  # the call's status again
                    writer.close()
            client.close()
            assert des.lookup([1]).shape == (1, DIM)
    finally:
        w.stop()


def test_a_worker_sends_the_next_delta_once_the_last_one_was_applied():
    """A follower slower than the trainer gets one coalesced delta of what changed while it
    applied the last one, not a queue of the deltas in between."""
    w = start_worker("memory://", dim=DIM, optimizer=SGD1, initializer="zeros")
    try:
        with embstore.open(f"des://{w.address}") as des:
            log_id, seq, _ = des.shard_state(0)
            with des.shard_subscribe(0, seq, log_id, interval=0.001) as sub:
                pushes = iter(sub)
                des.update([1], np.ones((1, DIM), np.float32))
                first = next(pushes)
                while not first.rows:        # heartbeats until the first delta
                    first = next(pushes)
                # still "applying" the first: the trainer writes five times meanwhile
                for i in range(5):
                    des.update([1, 2 + i], np.ones((2, DIM), np.float32))
                now = des.stats()["changelog_seq"]
                second = next(pushes)        # asks for it: the first is acknowledged
                while not second.rows:
                    second = next(pushes)
            assert second.seq == now
            keys = np.concatenate([k for k, _, _ in second.rows])
            recs = np.concatenate([r for _, r, _ in second.rows])
            assert sorted(keys.tolist()) == [1, 2, 3, 4, 5, 6]
            np.testing.assert_array_equal(recs[keys == 1][0]["vector"], np.full(DIM, -6.0))
    finally:
        w.stop()


@pytest.mark.parametrize("mode", ["poll", "push"])
def test_a_delta_of_many_chunks_arrives_whole(mode):
    """40k changed keys: read and sent as three parts of at most 16k keys, applied as one."""
    w = start_worker("memory://", dim=DIM, optimizer=SGD1, initializer="zeros")
    try:
        with embstore.open(f"des://{w.address}") as des:
            des.update(np.arange(1000), np.ones((1000, DIM), np.float32))
            up = embstore.open(f"des://{w.address}", read_only=True)
            follower = _follower(up)
            follower.poll()
            keys = np.arange(-5, 40_005)
            des.update(np.arange(40_000), np.full((40_000, DIM), 2.0, np.float32))
            des.delete(np.arange(0, 40_000, 7))
            _catch_up(follower, des, keys, mode)
            assert follower.snapshots == 1
            up.close()
    finally:
        w.stop()


def test_a_subscription_to_a_paused_worker_is_dropped(monkeypatch):
    """A SIGSTOPped worker sends no heartbeat: the subscription raises, so the follower
    subscribes again (to the worker, or its replacement) instead of waiting forever."""
    from embstore.service import push

    monkeypatch.setattr(push, "SILENT_HEARTBEATS", 2)
    w = start_worker("memory://", dim=DIM)
    des = embstore.open(f"des://{w.address}", timeout=5)
    try:
        with des.shard_subscribe(0, 0, None, interval=0.01) as sub:
            pushes = iter(sub)
            next(pushes)      # a heartbeat: the stream is up
            w.pause()
            with pytest.raises(BackendError, match="no message for"):
                for _ in pushes:
                    pass
    finally:
        w.resume()
        des.close()
        w.kill()
