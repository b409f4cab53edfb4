"""A kept stream checks each distinct request header once (``Worker._serve_stream``): the
same header answers alike every time it comes, a refused header stays refused, a header
accepted once does not let another through (a serve token's inserting lookup after its
non-inserting one), and a body-less message of an accepted header is still refused. Only
the store call of a stream's request holds the worker's store lock: a malformed request is
refused while another call holds it, and a request still arriving holds up no other
caller. The request histogram counts each request in every
bucket at or above its latency."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import embstore

pytest.importorskip("pyarrow.flight")

import pyarrow as pa  # noqa: E402
import pyarrow.flight as flight  # noqa: E402

from embstore.service import wire  # noqa: E402
from embstore.service.metrics import BUCKETS, RequestMetrics  # noqa: E402
from embstore.service.server import Worker  # noqa: E402
from embstore.testing.service import start_worker  # noqa: E402
from tests.service.stream_calls import SERVE_TOKEN, ask, open_stream, token_worker  # noqa: E402

DIM = 4
SGD1 = json.dumps({"name": "sgd", "lr": 1.0})


def test_a_stream_checks_every_header_it_has_not_accepted(tmp_path):
    w = token_worker(tmp_path, DIM)
    try:
        keys = wire.batch(key=wire.keys_column(np.arange(3, dtype=np.int64)))
        client, writer, reader = open_stream(w.address, {"shard": 0, "shards": 1},
                                             keys.schema, token=SERVE_TOKEN)
        reads = b'{"op": "lookup", "insert": false}'
        inserts = b'{"op": "lookup", "insert": true}'
        for _ in range(3):   # accepted, then answered from the checked header, alike
            got = ask(writer, reader, reads, keys)
            assert isinstance(got, pa.RecordBatch) and got.num_rows == 3
            refused = ask(writer, reader, inserts, keys)   # never accepted: refused each time
            assert isinstance(refused, str) and "AuthenticationError" in refused, refused
            assert "may not call 'lookup'" in refused
            bare = ask(writer, reader, reads, None)       # a checked header without rows
            assert isinstance(bare, str) and "InvalidInputError" in bare, bare
        writer.done_writing()
        writer.close()
        with client:
            pass
        assert w.proc.poll() is None
    finally:
        w.stop()


def test_the_request_histogram_is_cumulative():
    m = RequestMetrics()
    for seconds in (BUCKETS[0] / 2, BUCKETS[0], BUCKETS[1] * 0.9, BUCKETS[-1] * 2):
        m.observe("lookup", seconds, False)
    lines = {line.split(" ")[0]: int(line.split(" ")[1]) for line in m.text()
             if line.startswith("embstore_request_seconds_bucket")}
    le = {float(k.split('le="')[1].rstrip('"}')): v for k, v in lines.items()}
    assert le[BUCKETS[0]] == 2              # a latency equal to a bound counts in it
    assert le[BUCKETS[1]] == 3
    assert all(le[b] == 3 for b in BUCKETS[1:])
    assert le[float("inf")] == 4


def test_a_stream_request_is_checked_without_the_store_lock():
    # a worker in this process, to hold its store lock as a long call of another client
    # would; a refusal needs no store, so it comes while the lock is held
    store = embstore.open("memory://", dim=DIM, optimizer={"name": "sgd", "lr": 1.0},
                          initializer="zeros")
    w = Worker("grpc+tcp://127.0.0.1:0", store)
    threading.Thread(target=w.serve, daemon=True).start()
    try:
        client = flight.FlightClient(f"grpc+tcp://127.0.0.1:{w.port}")
        bad = pa.RecordBatch.from_pydict({"key": pa.array([1.5, 2.5])})   # float keys
        # (a generous deadline: a worker that wanted the lock would wait it out and fail
        # the test; one that does not answers at once, however loaded the machine)
        writer, reader = client.do_exchange(wire.command("stream", shard=0, shards=1),
                                            flight.FlightCallOptions(timeout=30))
        writer.begin(bad.schema)
        with w.lock:
            refused = ask(writer, reader, b'{"op": "lookup", "insert": true}', bad)
        assert isinstance(refused, str) and "KeyTypeError" in refused, refused
        writer.done_writing()
        writer.close()
        with embstore.open(f"des://127.0.0.1:{w.port}") as des:   # and the worker serves on
            des.update(np.arange(3), np.ones((3, DIM), np.float32))
            assert np.allclose(des.lookup(np.arange(3)), -1.0)
            assert w.requests >= 2
        client.close()
    finally:
        w.shutdown()
        store.close()


def test_a_request_still_arriving_holds_up_no_other_caller():
    # a caller that opened a delete and has not sent its keys yet: the worker reads them
    # before it takes the store lock, so another client's calls go through meanwhile
    w = start_worker("memory://", dim=DIM, optimizer=SGD1, initializer="zeros")
    try:
        client = flight.FlightClient(f"grpc+tcp://{w.address}")
        keys = wire.batch(key=wire.keys_column(np.arange(2, dtype=np.int64)))
        writer, reader = client.do_exchange(wire.command("delete", shard=0, shards=1),
                                            flight.FlightCallOptions(timeout=30))
        writer.begin(keys.schema)                 # ... and nothing more, yet
        with embstore.open(f"des://{w.address}", timeout=5) as des:
            des.update(np.arange(3), np.ones((3, DIM), np.float32))
            assert np.allclose(des.lookup(np.arange(3)), -1.0)
            writer.write_batch(keys)
            writer.done_writing()
            assert reader.read_all().column("deleted")[0].as_py() == 2
            assert des.contains(np.arange(3)).tolist() == [False, False, True]
        writer.close()
        client.close()
    finally:
        w.stop()


def test_a_poll_is_answered_only_after_its_request_arrived():
    """A follower's ``changes`` call: the worker reads the request whole before it answers,
    so a caller still writing it never finds the call over (it failed with "server
    disconnect" once the worker answered first)."""
    w = start_worker("memory://", dim=DIM, optimizer=SGD1, initializer="zeros")
    try:
        client = flight.FlightClient(f"grpc+tcp://{w.address}")
        opts = flight.FlightCallOptions(timeout=20)
        empty = wire.batch(key=wire.keys_column(np.zeros(0, dtype=np.int64)))
        for _ in range(3):
            writer, reader = client.do_exchange(
                wire.command("changes", shard=0, shards=1, since=0), opts)
            writer.begin(empty.schema)
            threading.Event().wait(0.3)  # the answer, if sent now, would close the call
            writer.write_batch(empty)
            writer.done_writing()
            t = reader.read_all()
            assert t.schema.metadata[b"resync"] == b"0" and t.num_rows == 0
            writer.close()
    finally:
        w.kill()
