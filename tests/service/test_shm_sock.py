"""A same-host stream's messages over a Unix socket (``embstore.service.shm_sock``): a
client that mapped its segment sends its calls over the worker's socket, with the answers,
refusals, deadlines and clean-up of the Flight stream; a connection that does not prove it
mapped the segment is refused and the stream stays on Flight.

Whether a worker holds such a socket is read from the outside: ``/proc/net/unix`` names
its abstract sockets (``@embstore-PID-...``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

import embstore
from embstore.errors import BackendError

pytest.importorskip("pyarrow.flight")

from embstore.service import shm_sock  # noqa: E402
from embstore.service.shm import HEADER, Segment, host_id  # noqa: E402
from embstore.testing.service import start_worker  # noqa: E402
from tests.service.stream_calls import TRAIN_TOKEN, token_worker  # noqa: E402
from tests.service.test_shm import open_shm, wait_until  # noqa: E402

pytestmark = pytest.mark.skipif(host_id() is None or not shm_sock.available(),
                                reason="no /dev/shm, boot id or sequenced-packet sockets here")

DIM = 8


def sockets(pid: int) -> int:
    """How many abstract sockets worker ``pid`` named (listening or connected ends)."""
    with open("/proc/net/unix") as f:
        return sum(f"@embstore-{pid}-" in line for line in f)


def stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (SIGSTOP reaches them in turn)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] != "T":
                return False
    return True


def _open_with_sock(say) -> tuple[Segment, str]:
    got = json.loads(say({"op": "open", "bytes": 1 << 16, "host": host_id(), "sock": True}))
    seg = Segment.attach(got["name"], got["nonce"], got["bytes"])
    assert seg is not None and "sock" in got
    assert json.loads(say({"op": "attached"})) == {}
    return seg, got["sock"]


def test_calls_go_over_the_socket_and_answer_as_flight_does():
    opts = dict(dim=DIM, optimizer="adagrad", initializer="zeros")
    a, b = start_worker("memory://", **opts), start_worker("memory://", **opts)
    try:
        with embstore.open(f"des://{a.address}") as des, \
                embstore.open(f"des://{b.address}", shm=False) as plain:
            keys = np.random.default_rng(0).integers(0, 300, 500)
            for store in (des, plain):
                store.lookup(keys)
                store.update(keys, np.ones((500, DIM), np.float32),
                             counts=np.ones(500, np.int64))
                store.assign([7, 8], np.full((2, DIM), 3.0, np.float32))
            keys = np.arange(-3, 310)
            np.testing.assert_array_equal(des.lookup(keys, insert=False),
                                          plain.lookup(keys, insert=False))
            np.testing.assert_array_equal(des.contains(keys), plain.contains(keys))
            assert sockets(a.pid) and not sockets(b.pid)    # connected through a socket
        assert wait_until(lambda: not sockets(a.pid))     # closed with the client
    finally:
        a.stop()
        b.stop()


def test_a_connection_that_does_not_prove_the_segment_is_refused(tmp_path):
    w = token_worker(tmp_path, DIM)
    try:
        client, say = open_shm(w.address, TRAIN_TOKEN)
        # no socket offered yet: a switch is refused with one line
        assert say({"op": "switch"}).startswith("[embstore:InvalidInputError]")
        seg, name = _open_with_sock(say)
        seg.array(HEADER, 2, np.int64)[:] = [1, 2]
        lookup = {"op": "lookup", "rows": 2, "dim": DIM, "key": HEADER, "out": 1024}
        wrong = shm_sock.connect(name, "0" * 32, 5.0)       # not the segment's nonce
        assert wrong is not None
        assert "refused" in json.loads(say({"op": "switch"}))
        assert wrong.recv(64) == b""                         # closed by the worker
        wrong.close()
        assert json.loads(say(lookup)) == {}                 # still on the Flight stream
        # the proof: the next segment's socket, its nonce
        seg.close()
        seg, name = _open_with_sock(say)
        seg.array(HEADER, 2, np.int64)[:] = [1, 2]
        sock = shm_sock.connect(name, seg.nonce, 5.0)
        assert sock is not None and json.loads(say({"op": "switch"})) == {}
        seg.array(1024, 2 * DIM, np.float32)[:] = 1.0
        sock.send(json.dumps({"op": "update", "rows": 2, "dim": DIM, "key": HEADER,
                              "vec": 1024}).encode())
        assert "step" in json.loads(sock.recv(1024))
        for bad in (b"not json", json.dumps({**lookup, "key": 0}).encode()):
            sock.send(bad)
            answer = sock.recv(1024).decode()
            assert answer.startswith("[embstore:") and "\n" not in answer
        sock.send(json.dumps(lookup).encode())          # the socket still carries a call
        assert sock.recv(1024) == b"{}"
        sock.close()
        seg.close()
        client.close()
        assert wait_until(lambda: not sockets(w.pid))
    finally:
        w.stop()


def test_a_stopped_worker_fails_socket_calls_within_the_deadline_and_a_stop_ends_them():
    w = start_worker("memory://", dim=DIM, initializer="zeros")
    try:
        with embstore.open(f"des://{w.address}", timeout=2) as des:
            des.assign([1], np.ones((1, DIM), np.float32))
            assert sockets(w.pid)
            os.kill(w.pid, signal.SIGSTOP)
            try:
                assert wait_until(lambda: stopped(w.pid))     # every thread, not just sent
                t = time.monotonic()
                with pytest.raises(BackendError, match="deadline"):
                    des.lookup([1], insert=False)
                assert time.monotonic() - t < 30
            finally:
                os.kill(w.pid, signal.SIGCONT)
            # a new stream (and socket) the next call
            np.testing.assert_array_equal(des.lookup([1], insert=False), np.ones((1, DIM)))
            assert w.stop() == 0                # a socket waiting for a call holds no stop
            with pytest.raises(BackendError):
                des.lookup([1], insert=False)
    finally:
        w.stop()


def test_a_socket_is_taken_only_from_this_user_with_the_nonce():
    """The worker checks the peer's user (``SO_PEERCRED``: anyone may connect to an abstract
    name) and then the nonce, and closes a connection that fails either."""
    listener, name = shm_sock.listen() or (None, "")
    assert listener is not None
    nonce = "ab" * 16
    try:
        good = shm_sock.connect(name, nonce, 5.0)
        conn = shm_sock.accept(listener, nonce, timeout=5.0)
        assert good is not None and conn is not None
        conn.send(b"x")
        assert good.recv(8) == b"x"
        for sock in (good, conn):
            sock.close()
        assert shm_sock.accept(listener, nonce, timeout=0.1) is None   # none waiting
        bad = shm_sock.connect(name, nonce[:-1], 5.0)                  # not the nonce
        assert bad is not None and shm_sock.accept(listener, nonce, timeout=1.0) is None
        bad.close()
        if os.geteuid() == 0:   # another user, with the nonce: refused too
            pid = os.fork()
            if pid == 0:
                try:
                    os.setuid(65534)
                    other = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                    other.connect("\0" + name)     # queued: taken (and closed) by accept
                    try:
                        other.send(nonce.encode())
                        other.recv(8)
                    except OSError:
                        pass    # closed before the nonce went, or after
                    os._exit(0)
                finally:
                    os._exit(2)
            assert shm_sock.accept(listener, nonce, timeout=1.0) is None
            assert os.waitpid(pid, 0)[1] == 0
    finally:
        listener.close()


@pytest.mark.parametrize("n", [1, 2])
def test_a_lookups_rows_stay_the_callers_with_threads_sharing_a_client(n):
    """With one worker a lookup's rows are read from the calling thread's segment (no copy
    between); with several, pool threads serve every caller and copy them out first: either
    way rows returned are not written over by a later call of any thread."""
    from embstore.testing.service import start_workers

    with start_workers(["memory://"] * n, dim=DIM, initializer="zeros") as workers, \
            embstore.open(workers.url) as des:
        des.assign(np.arange(2000), np.repeat(np.arange(2000, dtype=np.float32)[:, None],
                                              DIM, axis=1))
        errors: list[str] = []

        def run(seed: int) -> None:
            rng = np.random.default_rng(seed)
            held = []
            for _ in range(40):
                keys = rng.integers(0, 2000, int(rng.integers(1, 700)))
                held.append((keys, des.lookup(keys, insert=False)))
            for keys, rows in held:
                if not np.array_equal(rows, np.repeat(keys[:, None], DIM, 1)):
                    errors.append(f"thread {seed}: rows changed after they were returned")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
