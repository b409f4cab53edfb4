"""Kept exchange streams from a ``des://`` client to its workers: one Flight ``do_exchange``
stream per (thread, worker, op, request schema), reused call after call.

A call on a stream of its own pays for gRPC's stream set-up on both sides (headers, the auth
middleware, a schema message, the end-of-stream handshake); on a kept stream a call is one
request batch and one answer, about half the transport CPU (0.52 against 1.0 ms for a
4096-key lookup, client and server together, measured on loopback). A worker answers a
request it refuses with a metadata-only message and keeps the stream; a transport failure
drops the stream, and the next call opens a new one (a restarted worker is found again).

A stream outlives any one call, so the call's deadline cannot be the stream's: a watchdog
thread cancels the stream of a call that passed its deadline, and the call raises
``BackendError`` as a call past its deadline on a stream of its own does.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from ..errors import BackendError
from . import wire

#: the ops a client sends on kept streams (the per-step ones); the rest use a call each
STREAM_OPS = frozenset({"lookup", "update", "assign", "contains"})
#: what ending an exchange stream that is already broken raises
STREAM_ERRORS = (flight.FlightError, pa.ArrowException, OSError)


class Watchdog:
    """Cancels a registered reader once its deadline passes (one thread, woken only when a
    deadline earlier than the one it waits for is armed)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, Any]] = {}
        self._fired: set[int] = set()
        self._next = 0
        self._waiting_until: float | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def arm(self, reader: Any, seconds: float) -> int:
        """Watch ``reader`` for ``seconds``; returns the token for :meth:`disarm`."""
        deadline = time.monotonic() + seconds
        with self._cond:
            self._next += 1
            self._armed[self._next] = (deadline, reader)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="embstore-deadlines",
                                                daemon=True)
                self._thread.start()
            elif self._waiting_until is None or deadline < self._waiting_until:
                self._cond.notify()
            return self._next

    def disarm(self, token: int) -> bool:
        """Stop watching; True when the deadline had passed and the reader was cancelled."""
        with self._cond:
            self._armed.pop(token, None)
            if token in self._fired:
                self._fired.discard(token)
                return True
            return False

    def end_stream(self, writer: Any, reader: Any, seconds: float, cancel: bool = False,
                   errors: tuple[type[BaseException], ...] = STREAM_ERRORS) -> None:
        """End an exchange stream gracefully (done writing, closed), the end cancelled if the
        worker does not take it within ``seconds`` (paused, partitioned): closing never waits
        longer than a call. ``cancel``: cancelled first (a stream that failed). A stream
        already broken (``errors``) has nothing to end."""
        token = None if cancel else self.arm(reader, seconds)
        try:
            if cancel:
                reader.cancel()
            writer.done_writing()
            writer.close()
        except errors:
            pass
        finally:
            if token is not None:
                self.disarm(token)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for token, (deadline, reader) in list(self._armed.items()):
                    if deadline <= now:
                        del self._armed[token]
                        self._fired.add(token)
                        reader.cancel()
                self._waiting_until = min((d for d, _ in self._armed.values()), default=None)
                self._cond.wait(None if self._waiting_until is None
                                else max(self._waiting_until - now, 0.0))
            self._waiting_until = None


class Streams:
    """The kept streams of one client (``clients``: one ``FlightClient`` per worker)."""

    def __init__(self, clients: list[Any], headers: list[tuple[bytes, bytes]],
                 timeout: float) -> None:
        self._clients = clients
        self._options = flight.FlightCallOptions(headers=headers)  # no deadline: see above
        self._timeout = float(timeout)
        self._local = threading.local()
        self._open: dict[int, tuple[Any, Any]] = {}   # every thread's, to close them all
        self._lock = threading.Lock()
        self._watchdog = Watchdog()
        self._headers: dict[Any, pa.Buffer] = {}

    def exchange(self, s: int, head: dict[str, Any], op: str, batch: pa.RecordBatch,
                 fields: dict[str, Any], where: str) -> pa.RecordBatch:
        """Send ``op`` with ``batch`` to worker ``s`` on this thread's stream; its answer."""
        mine: dict[Any, tuple[Any, Any]] = self._local.__dict__.setdefault("streams", {})
        # by column names: a client's column of a name always has the same type (hashing
        # the schema itself costs more than the rest of this method's Python)
        key = (s, op, *batch.schema.names)
        stream = mine.get(key)
        if stream is None:
            stream = self._start(s, head, batch.schema, where)
            mine[key] = stream
        writer, reader = stream
        token = self._watchdog.arm(reader, self._timeout)
        try:
            writer.write_with_metadata(batch, self._header(op, fields))
            chunk = reader.read_chunk()
        except (flight.FlightError, pa.ArrowException, StopIteration, OSError) as e:
            fired = self._watchdog.disarm(token)
            self._drop(mine, key)
            if fired:
                raise BackendError(f"{where}: no answer within the deadline") from None
            if isinstance(e, flight.FlightError):
                wire.raise_remote(e, where)
            raise BackendError(f"{where}: the worker closed the stream ({e!r})") from None
        if self._watchdog.disarm(token):  # the answer came as the deadline cancelled it
            self._drop(mine, key)
        if chunk.data is None:            # a refusal: one typed line, the stream stays
            text = chunk.app_metadata.to_pybytes().decode("utf-8", "replace")
            wire.raise_remote(flight.FlightServerError(text), where)
        return chunk.data

    def _header(self, op: str, fields: dict[str, Any]) -> pa.Buffer:
        """A request's header as sent: the same few each call, encoded once each."""
        key = (op, *fields.items())
        try:
            buf = self._headers.get(key)
        except TypeError:  # an unhashable field: encoded each time
            return pa.py_buffer(json.dumps({"op": op, **fields}).encode())
        if buf is None:
            buf = pa.py_buffer(json.dumps({"op": op, **fields}).encode())
            if len(self._headers) < 64:
                self._headers[key] = buf
        return buf

    def _start(self, s: int, head: dict[str, Any], schema: pa.Schema,
               where: str) -> tuple[Any, Any]:
        try:
            writer, reader = self._clients[s].do_exchange(wire.command("stream", **head),
                                                          self._options)
            writer.begin(schema)
        except flight.FlightError as e:
            wire.raise_remote(e, where)
        with self._lock:
            self._open[id(writer)] = (writer, reader)
        return writer, reader

    def _drop(self, mine: dict[Any, tuple[Any, Any]], key: Any) -> None:
        writer, _ = mine.pop(key)
        with self._lock:
            self._open.pop(id(writer), None)
        try:
            writer.close()
        except STREAM_ERRORS:
            pass  # the stream is already broken: nothing to end

    def close(self) -> None:
        """End every thread's streams (the workers' handlers return); a graceful end the
        worker does not take within the deadline (paused, partitioned) is cancelled."""
        with self._lock:
            streams, self._open = list(self._open.values()), {}
        try:
            for writer, reader in streams:
                self._watchdog.end_stream(writer, reader, self._timeout)
        finally:
            self._watchdog.close()
