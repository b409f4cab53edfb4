"""Same-host payloads (``embstore.service.shm``): real workers on loopback answer calls
through shared memory as they answer them through Arrow Flight, fall back when either side
turns it off, refuse hostile descriptors with one line and change nothing, and leave no
segment behind a client that closes or crashes, or a worker that stops.

Whether a call went through shared memory is read from the outside: a worker maps its
segments (``/proc/PID/maps`` names them, unlinked once mapped)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import embstore
from embstore.errors import AuthenticationError, InvalidInputError

pytest.importorskip("pyarrow.flight")

import pyarrow as pa  # noqa: E402
import pyarrow.flight as flight  # noqa: E402

from embstore.service import wire  # noqa: E402
from embstore.service.client import DesStore  # noqa: E402
from embstore.service.follower import Follower, replica_options  # noqa: E402
from embstore.service.shm import HEADER, PUSH_SEGMENT, Segment, host_id, read_push  # noqa: E402
from embstore.testing.service import WorkerProcess, start_worker, start_workers  # noqa: E402
from tests.paths import REPO_ROOT  # noqa: E402
from tests.service.stream_calls import SERVE_TOKEN, TRAIN_TOKEN, token_worker  # noqa: E402

pytestmark = pytest.mark.skipif(host_id() is None, reason="no /dev/shm and boot id here")

DIM = 8


def mapped(pid: int) -> list[str]:
    """The shared-memory segments process ``pid`` maps."""
    with open(f"/proc/{pid}/maps") as f:
        return [line for line in f if "/dev/shm/embstore-" in line]


def files(pid: int) -> list[str]:
    """The segment files worker ``pid`` made and has not unlinked."""
    return glob.glob(f"/dev/shm/embstore-{pid}-*")


def wait_until(cond, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _calls(des, seed: int):
    """The same calls on a table; what each answered."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 500, 300)
    out = [des.lookup(keys)]                                     # inserts, duplicates too
    des.update(keys, rng.standard_normal((300, DIM)).astype(np.float32),
               counts=np.ones(300, np.int64))
    des.assign([1000, 1001], np.full((2, DIM), 2.0, np.float32))
    out += [des.lookup(np.arange(-5, 600), insert=False), des.contains(np.arange(990, 1010)),
            des.lookup(np.arange(20).reshape(4, 5)),
            des.lookup(np.arange(300_000), insert=False)]    # over a first segment: grown
    res = des.top_k(out[1][:3], k=7)
    out += [res.keys, res.scores]
    # which keys a worker draws depends on its process (its table's order): the rest not
    s = des.sample([3, 4], 16, "uniform", seed=0, unique=False, remove_accidental_hits=False)
    assert des.contains(s.keys).all()
    out += [s.keys[:2], s.prob, s.is_positive, np.array([len(des)])]
    return out


def test_shared_memory_answers_as_flight_does():
    opts = dict(dim=DIM, optimizer="adagrad")
    with start_workers(["memory://", "memory://"], **opts) as a, \
            start_workers(["memory://", "memory://"], **opts) as b:
        with embstore.open(a.url) as shm, embstore.open(b.url, shm=False) as plain:
            got, want = _calls(shm, 1), _calls(plain, 1)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w)
            # the shared-memory calls went through segments, the others did not
            assert all(mapped(w.pid) for w in a.workers)
            assert not any(mapped(w.pid) for w in b.workers)
            assert not any(files(w.pid) for w in a.workers)   # unlinked once mapped


def mapped_from(pid: int, maker: int) -> bool:
    """Whether process ``pid`` maps a segment process ``maker`` made."""
    return any(f"/dev/shm/embstore-{maker}-" in line for line in mapped(pid))


@pytest.mark.parametrize("shm", [True, False])
def test_a_follower_equals_a_table_trained_through_shared_memory(tmp_path, shm):
    """Trained through segments; the workers push their deltas to the follower through
    segments too, or (``--no-shm``) as Arrow batches."""
    with start_workers(["memory://", "memory://"], dim=DIM, optimizer="adagrad",
                       initializer="zeros", extra=[] if shm else ["--no-shm"]) as workers, \
            embstore.open(workers.url) as des:
        des.update(np.arange(300), np.ones((300, DIM), np.float32))
        replica = WorkerProcess([f"lmdb://{tmp_path}/replica", "--listen", "127.0.0.1:0",
                                 "--follow", workers.url, "--push-interval", "0.02"])
        try:
            with embstore.open(f"des://{replica.address}") as served:
                for i in range(5):
                    des.update(np.arange(250, 350), np.full((100, DIM), i, np.float32))
                    des.assign(np.arange(400, 410), np.full((10, DIM), i, np.float32))
                des.flush()
                keys = np.arange(-10, 500)
                want = des.lookup(keys, insert=False), des.contains(keys)
                assert wait_until(lambda: np.array_equal(
                    served.lookup(keys, insert=False), want[0]))
                np.testing.assert_array_equal(served.contains(keys), want[1])
                assert all(bool(mapped(w.pid)) == shm for w in workers.workers)
                assert all(mapped_from(replica.pid, w.pid) == shm for w in workers.workers)
                assert served.stats()["follower_resubscribes"] == 0
        finally:
            replica.stop()


@pytest.mark.parametrize("side", ["worker", "client"])
def test_either_side_turned_off_keeps_the_flight_path(side):
    w = start_worker("memory://", dim=DIM, initializer="zeros",
                     extra=["--no-shm"] if side == "worker" else [])
    try:
        url = f"des://{w.address}" + ("?shm=0" if side == "client" else "")
        with embstore.open(url) as des:
            des.assign([1, 2], np.ones((2, DIM), np.float32))
            np.testing.assert_array_equal(des.lookup([2, 3], insert=False),
                                          [[1.0] * DIM, [0.0] * DIM])
            assert des.contains([1, 3]).tolist() == [True, False]
            assert not mapped(w.pid) and not files(w.pid)
    finally:
        w.stop()


def open_shm(address: str, token: str | None = None):
    """``(client, say)``: a hand-made shared-memory stream; ``say(message)`` sends one
    message (a dict as JSON, or bytes as they are) and returns the answer's text."""
    client = flight.FlightClient(f"grpc+tcp://{address}")
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    writer, reader = client.do_exchange(wire.command("shm", shard=0, shards=1),
                                        flight.FlightCallOptions(headers=headers, timeout=20))
    writer.begin(pa.schema([]))

    def say(msg) -> str:
        raw = msg if isinstance(msg, bytes) else json.dumps(msg).encode()
        writer.write_metadata(pa.py_buffer(raw))
        return reader.read_chunk().app_metadata.to_pybytes().decode()

    return client, say


def _attach(say, size: int = 1 << 16) -> Segment:
    got = json.loads(say({"op": "open", "bytes": size, "host": host_id()}))
    seg = Segment.attach(got["name"], got["nonce"], got["bytes"])
    assert seg is not None
    assert json.loads(say({"op": "attached"})) == {}
    return seg


def test_hostile_descriptors_get_one_line_and_change_nothing(tmp_path):
    w = token_worker(tmp_path, DIM)
    try:
        client, say = open_shm(w.address, TRAIN_TOKEN)
        lookup = {"op": "lookup", "rows": 4, "dim": DIM, "key": HEADER, "out": 1024}
        before = [b"not json", b"[1]", {"op": "no-such-op"}, lookup,   # nothing mapped yet
                  {"op": "open", "bytes": -5, "host": host_id()},
                  {"op": "open", "bytes": 1 << 40, "host": host_id()}, {"op": "attached"}]
        for msg in before:
            answer = say(msg)
            assert answer.startswith("[embstore:") and "\n" not in answer, (msg, answer)
        assert "refused" in json.loads(say({"op": "open", "bytes": 1 << 16, "host": "x:1"}))
        seg = _attach(say)
        assert not files(w.pid) and mapped(w.pid)
        seg.array(HEADER, 4, np.int64)[:] = [1, 2, 3, 4]
        seg.array(1024, 4 * DIM, np.float32)[:] = np.nan
        update = {"op": "update", "rows": 4, "dim": DIM, "key": HEADER, "vec": 1024}
        hostile = [
            {**lookup, "key": seg.size - 8},        # keys past the end
            {**lookup, "key": 0},                   # over the header
            {**lookup, "key": -64}, {**lookup, "key": 65}, {**lookup, "key": "64"},
            {**lookup, "out": seg.size - 64},       # the answer past the end
            {**lookup, "rows": 1 << 30}, {**lookup, "rows": -1}, {**lookup, "rows": True},
            {**lookup, "dim": DIM + 1}, {k: v for k, v in lookup.items() if k != "out"},
            {**update, "dim": 3}, {k: v for k, v in update.items() if k != "vec"},
            update,                                 # NaN gradients
            {**update, "op": "delete"}, {**update, "count": seg.size},
        ]
        for msg in hostile:
            answer = say(msg)
            assert answer.startswith("[embstore:") and "\n" not in answer, (msg, answer)
        # the stream still carries a good call
        assert json.loads(say({**lookup, "insert": False})) == {}
        seg.close()
        client.close()
        with embstore.open(f"des://{w.address}", token=TRAIN_TOKEN) as des:
            assert len(des) == 0                    # nothing the refusals changed
        client, say = open_shm(w.address, SERVE_TOKEN)
        seg = _attach(say)
        seg.array(HEADER, 4, np.int64)[:] = [1, 2, 3, 4]
        seg.array(1024, 4 * DIM, np.float32)[:] = 1.0
        for msg in (update, lookup):                # a serve token may not write
            assert say(msg).startswith("[embstore:AuthenticationError]")
        seg.close()
        client.close()
        with embstore.open(f"des://{w.address}", token=SERVE_TOKEN) as des:
            assert len(des) == 0
            with pytest.raises(AuthenticationError):
                des.update([1], np.ones((1, DIM), np.float32))
    finally:
        w.stop()


def test_segments_go_with_a_client_that_closes_or_crashes_and_with_the_worker():
    w = start_worker("memory://", dim=DIM)
    try:
        with embstore.open(f"des://{w.address}") as des:
            des.lookup(np.arange(100))
            assert mapped(w.pid) and not files(w.pid)
        assert wait_until(lambda: not mapped(w.pid))          # closed: unmapped
        crash = ("import os, numpy as np, embstore\n"
                 f"d = embstore.open('des://{w.address}')\n"
                 "d.lookup(np.arange(100))\nprint('mapped', flush=True)\nos._exit(0)\n")
        subprocess.run([sys.executable, "-c", crash], check=True, cwd=REPO_ROOT, timeout=120)
        assert wait_until(lambda: not mapped(w.pid))          # crashed: unmapped too
        # a segment never attached: its file goes with its stream ...
        client, say = open_shm(w.address)
        assert "name" in json.loads(say({"op": "open", "bytes": 1 << 16, "host": host_id()}))
        assert files(w.pid)
        client.close()
        assert wait_until(lambda: not files(w.pid))
        # ... and with the worker
        client, say = open_shm(w.address)
        assert "name" in json.loads(say({"op": "open", "bytes": 1 << 16, "host": host_id()}))
        assert files(w.pid)
        pid = w.pid
    finally:
        w.stop()
    assert not files(pid)


def test_a_segment_is_mapped_only_as_the_one_its_worker_named(tmp_path):
    seg = Segment.create(1 << 16)
    try:
        name = seg.path.rsplit("/", 1)[1]
        assert Segment.attach(name, "0" * 32, seg.size) is None        # another nonce
        assert Segment.attach(name, seg.nonce, seg.size + 8) is None   # another size
        assert Segment.attach("../../etc/passwd", seg.nonce, seg.size) is None
        assert Segment.attach(name + "x", seg.nonce, seg.size) is None
        other = Segment.attach(name, seg.nonce, seg.size)
        assert other is not None
        other.close()
    finally:
        seg.close()
    assert not glob.glob(seg.nonce)


def test_a_hostile_pushed_delta_is_refused():
    dtype = np.dtype([("v", np.float32, DIM)])
    seg = Segment.create(1 << 16)
    try:
        good = {"rows": 4, "key": HEADER, "rec": 128, "found": 1024}
        (part,) = read_push(seg, good, dtype)
        assert [len(x) for x in part] == [4, 4, 4]
        for bad in ({**good, "rows": 1 << 40}, {**good, "rows": -1}, {**good, "rec": seg.size},
                    {**good, "key": 3}, {k: v for k, v in good.items() if k != "found"}):
            with pytest.raises(InvalidInputError):
                read_push(seg, bad, dtype)
    finally:
        seg.close()


def test_a_delta_larger_than_the_push_slot_streams_through_it_in_parts():
    w = start_worker("memory://", dim=DIM, optimizer="sgd")
    try:
        with embstore.open(f"des://{w.address}") as des, \
                DesStore(f"des://{w.address}", read_only=True) as up:
            local = embstore.open("memory://", **replica_options(up))
            follower = Follower(local, up)
            follower.poll()                                  # the (empty) snapshot
            per = (PUSH_SEGMENT - HEADER) // (9 + up.layout.itemsize)
            keys = np.arange(per + per // 2)                 # two parts
            values = np.random.default_rng(0).standard_normal((len(keys), DIM))
            des.assign(keys, values.astype(np.float32))
            stop = threading.Event()
            t = threading.Thread(target=follower.follow, args=(stop, 0.01), daemon=True)
            t.start()
            assert wait_until(lambda: follower.applied >= len(keys))
            assert mapped_from(os.getpid(), w.pid)           # it came through the segment
            stop.set()
            t.join(60)
            np.testing.assert_array_equal(local.lookup(keys, insert=False),
                                          des.lookup(keys, insert=False))
            assert follower.snapshots == 1 and follower.applied == len(keys)
            local.close()
    finally:
        w.stop()


def test_a_worker_sweeps_the_segment_files_of_processes_gone():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"/dev/shm/embstore-{dead.pid}-{'ab' * 16}"
    mine = f"/dev/shm/embstore-{os.getpid()}-{'cd' * 16}"     # a live process's: kept
    for path in (stale, mine):
        with open(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600), "wb") as f:
            f.write(b"x")
    try:
        w = start_worker("memory://", dim=DIM)
        w.stop()
        assert not os.path.exists(stale) and os.path.exists(mine)
    finally:
        for path in (stale, mine):
            if os.path.exists(path):
                os.unlink(path)


def test_a_killed_worker_leaves_no_push_segment_file():
    w = start_worker("memory://", dim=DIM)
    try:
        with embstore.open(f"des://{w.address}") as des:
            log_id, seq, _ = des.shard_state(0)
            des.assign(np.arange(10), np.ones((10, DIM), np.float32))
            with des.shard_subscribe(0, seq, log_id, interval=0.01) as sub:
                push = next(iter(sub))                # mapped, not yet acknowledged
                assert len(push.rows[0][0]) == 10 and mapped_from(os.getpid(), w.pid)
                w.kill()
                assert not files(w.pid)
    finally:
        w.stop()
