"""Kept exchange streams between a des:// client and its workers
(``embstore.service.streams``): refusals leave a stream usable, hostile stream messages get
one-line errors and change nothing, deadlines hold on a kept stream, and a worker stops
(flushing) while clients still hold streams open."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

import embstore
from embstore.errors import AuthenticationError, BackendError, InvalidInputError

pytest.importorskip("pyarrow.flight")

import pyarrow as pa  # noqa: E402
import pyarrow.flight as flight  # noqa: E402

from embstore.service import wire  # noqa: E402
from embstore.testing.service import start_worker  # noqa: E402
from tests.service.stream_calls import (  # noqa: E402
    SERVE_TOKEN,
    TRAIN_TOKEN,
    ask,
    open_stream,
    token_worker,
)

DIM = 4
SGD1 = json.dumps({"name": "sgd", "lr": 1.0})


def test_a_stream_answers_refusals_with_one_line_and_stays_usable(tmp_path):
    w = token_worker(tmp_path, DIM)
    try:
        keys = wire.batch(key=wire.keys_column(np.arange(3, dtype=np.int64)))
        client, writer, reader = open_stream(w.address, {"shard": 0, "shards": 1}, keys.schema,
                                             token=SERVE_TOKEN)
        for meta in (b"not json", b"[1]", b'{"op": "delete"}', b'{"op": "no-such-op"}',
                     b'{"op": "lookup"}'):               # lookup inserts: the serve role may not
            answer = ask(writer, reader, meta, keys)
            assert isinstance(answer, str) and "\n" not in answer.strip(), answer
        got = ask(writer, reader, b'{"op": "lookup", "insert": false}', keys)
        assert isinstance(got, pa.RecordBatch) and got.num_rows == 3
        writer.close()
        client.close()
        with embstore.open(f"des://{w.address}", token=TRAIN_TOKEN) as des:
            assert len(des) == 0                          # nothing the refusals changed
            des.update([1], np.ones((1, DIM), np.float32))
            with pytest.raises(InvalidInputError):        # refused on the kept stream ...
                des.update([1], np.full((1, DIM), np.inf, np.float32))
            des.update([1], np.ones((1, DIM), np.float32))  # ... which still carries calls
            np.testing.assert_array_equal(des.lookup([1], insert=False), [[-2.0] * DIM])
        with embstore.open(f"des://{w.address}", token=SERVE_TOKEN) as reader_store:
            reader_store.lookup([1], insert=False)
            with pytest.raises(AuthenticationError):
                reader_store.update([1], np.ones((1, DIM), np.float32))
            np.testing.assert_array_equal(reader_store.lookup([1], insert=False),
                                          [[-2.0] * DIM])
    finally:
        w.kill()


def test_a_call_on_a_kept_stream_keeps_its_deadline_and_the_next_finds_the_worker():
    w = start_worker("memory://", dim=DIM, optimizer=SGD1, initializer="zeros")
    try:
        with embstore.open(f"des://{w.address}", timeout=1.0) as des:
            des.update([1], np.ones((1, DIM), np.float32))   # the stream is open now
            w.pause()
            t = time.monotonic()
            with pytest.raises(BackendError, match="deadline"):
                des.lookup([1], insert=False)
            assert time.monotonic() - t < 5
            w.resume()
            np.testing.assert_array_equal(des.lookup([1], insert=False), [[-1.0] * DIM])
    finally:
        w.resume()
        w.kill()


def test_a_worker_stops_and_flushes_while_clients_hold_streams_open(tmp_path):
    url = f"lmdb://{tmp_path}/held"
    w = start_worker(url, dim=DIM, optimizer=SGD1, initializer="zeros", durable=False)
    des = embstore.open(f"des://{w.address}")
    try:
        des.update([7], np.ones((1, DIM), np.float32))      # acknowledged, stream kept open
        t = time.monotonic()
        assert w.stop(timeout=20) == 0
        assert time.monotonic() - t < 15
        with pytest.raises(BackendError):
            des.lookup([7], insert=False)
    finally:
        des.close()
        w.kill()
    with embstore.open(url, read_only=True) as s:
        np.testing.assert_array_equal(s.lookup([7], insert=False), [[-1.0] * DIM])


def test_a_serve_token_cannot_insert_by_leaving_out_the_insert_flag(tmp_path):
    """A lookup inserts unless ``insert`` is false; a header that leaves the flag out is a
    write, refused to a ``serve`` token on a call of its own as on a stream."""
    tokens = tmp_path / "tokens"
    tokens.write_text("serve " + "s" * 20 + "\n")
    w = start_worker("memory://", dim=DIM, extra=["--token-file", str(tokens)])
    try:
        client = flight.FlightClient(f"grpc+tcp://{w.address}")
        opts = flight.FlightCallOptions(headers=[(b"authorization", b"Bearer " + b"s" * 20)],
                                        timeout=20)
        keys = wire.batch(key=wire.keys_column(np.arange(3, dtype=np.int64)))
        writer, reader = client.do_exchange(wire.command("lookup", shard=0, shards=1), opts)
        with pytest.raises(flight.FlightError, match="may not call 'lookup'"):
            with writer:
                writer.begin(keys.schema)
                writer.write_batch(keys)
                writer.done_writing()
                reader.read_all()
        client.close()
        with embstore.open(f"des://{w.address}", token="s" * 20) as des:
            assert len(des) == 0
    finally:
        w.kill()


@pytest.mark.parametrize("shm", ["", "?shm=0"])
def test_closing_a_client_whose_worker_is_paused_takes_at_most_the_deadline(shm):
    # a graceful end of a kept stream waits for the worker's answer: bounded by the
    # client's deadline, then cancelled (it used to wait as long as the worker was paused)
    w = start_worker("memory://", dim=DIM, optimizer=SGD1, initializer="zeros")
    try:
        des = embstore.open(f"des://{w.address}{shm}", timeout=1.0)
        des.update([1], np.ones((1, DIM), np.float32))   # the stream is open now
        w.pause()
        closing = threading.Thread(target=des.close, daemon=True)
        t = time.monotonic()
        closing.start()
        closing.join(20)
        assert not closing.is_alive(), "close waited for the paused worker"
        assert time.monotonic() - t < 10
        w.resume()
        with embstore.open(f"des://{w.address}{shm}", timeout=5.0) as again:
            np.testing.assert_array_equal(again.lookup([1], insert=False), [[-1.0] * DIM])
    finally:
        w.resume()
        w.kill()
