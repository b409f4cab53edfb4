"""A ``des://`` client's end of the same-host payload path (:mod:`embstore.service.shm`):
per thread and worker, one kept Flight stream of small messages and one segment for the
rows; the Flight streams (:class:`~embstore.service.streams.Streams`) carry the calls a
worker does not take this way (another host or user, ``--no-shm``, bytes keys, a request
over the segment limit) and every call of a client opened with ``shm=False``.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from ..errors import BackendError
from . import shm_sock, wire
from .shm import HEADER, MAX_SEGMENT, Segment, aligned, host_id
from .streams import Streams, Watchdog

_ERRORS = (flight.FlightError, pa.ArrowException, StopIteration, OSError)
#: a first segment's bytes (a 4096 x 64 lookup or update needs about 1.1 MB)
FIRST_SEGMENT = 4 << 20


class _Refused(Exception):
    """The worker offers no segment to this client."""


class _Channel:
    """One thread's stream and segment to one worker (its messages over a socket once the
    worker offered one: :mod:`embstore.service.shm_sock`)."""

    def __init__(self, writer: Any, reader: Any, watchdog: Watchdog, timeout: float) -> None:
        self.writer, self.reader = writer, reader
        self._watchdog, self._timeout = watchdog, timeout
        self.seg: Segment | None = None
        self.sock: socket.socket | None = None

    def ask(self, msg: dict[str, Any], where: str) -> dict[str, Any]:
        """Send one message; its answer (a refusal raises its typed error)."""
        data = json.dumps(msg).encode()
        if self.sock is not None:
            try:
                self.sock.send(data, socket.MSG_NOSIGNAL)
                raw = self.sock.recv(shm_sock.MAX_MESSAGE)
            except TimeoutError:
                raise BackendError(f"{where}: no answer within the deadline") from None
            except OSError as e:
                raise BackendError(f"{where}: the worker closed the stream ({e!r})") from None
            if not raw:
                raise BackendError(f"{where}: the worker closed the stream")
        else:
            raw = self._flight(data, where)
        if raw.startswith(b"[embstore:"):   # a refusal: one typed line, the stream stays
            wire.raise_remote(flight.FlightServerError(raw.decode("utf-8", "replace")), where)
        return {} if raw == b"{}" else wire.parse_body(raw)

    def _flight(self, data: bytes, where: str) -> bytes:
        token = self._watchdog.arm(self.reader, self._timeout)
        try:
            self.writer.write_metadata(pa.py_buffer(data))
            chunk = self.reader.read_chunk()
        except _ERRORS as e:
            if self._watchdog.disarm(token):
                raise BackendError(f"{where}: no answer within the deadline") from None
            if isinstance(e, flight.FlightError):
                wire.raise_remote(e, where)
            raise BackendError(f"{where}: the worker closed the stream ({e!r})") from None
        if self._watchdog.disarm(token):
            raise BackendError(f"{where}: no answer within the deadline")
        return chunk.app_metadata.to_pybytes() if chunk.app_metadata is not None else b""

    def open(self, size: int, host: str, where: str) -> None:
        """Map a new segment of ``size`` bytes from the worker (``_Refused``: none); the
        stream's messages go over a socket from then on where the worker offers one."""
        want_sock = self.sock is None and shm_sock.available()
        reply = self.ask({"op": "open", "bytes": size, "host": host,
                          **({"sock": True} if want_sock else {})}, where)
        if "refused" in reply:
            raise _Refused(str(reply["refused"]))
        seg = Segment.adopt(reply)
        if seg is None:
            raise _Refused("the worker's segment cannot be mapped here")
        old, self.seg = self.seg, seg
        if old is not None:
            old.close()
        self.ask({"op": "attached"}, where)
        if want_sock and "sock" in reply:
            sock = shm_sock.connect(reply["sock"], seg.nonce, self._timeout)
            if sock is not None:
                # the worker takes the connection on switch; refused, this stream stays
                if "refused" in self.ask({"op": "switch"}, where):
                    sock.close()
                else:
                    self.sock = sock

    def close(self, broken: bool = False) -> None:
        """End the stream; ``broken``: after a transport failure, cancelled first (a worker
        that does not answer would hold a graceful end as it held the call). A graceful end
        the worker does not take within the deadline (a paused or partitioned worker) is
        cancelled then: closing never waits longer than a call."""
        if self.sock is not None:
            self.sock.close()
        self._watchdog.end_stream(self.writer, self.reader, self._timeout, cancel=broken,
                                  errors=_ERRORS)
        if self.seg is not None:
            self.seg.close()


class ShmStreams:
    """The kept streams of one client: through shared memory where a worker offers it
    (``enabled`` and a same-host worker), else :class:`Streams` (``flight``)."""

    def __init__(self, clients: list[Any], headers: list[tuple[bytes, bytes]],
                 timeout: float, enabled: bool = True) -> None:
        self.flight = Streams(clients, headers, timeout)
        self._clients = clients
        self._options = flight.FlightCallOptions(headers=headers)
        self._timeout = float(timeout)
        self._host = host_id() if enabled else None
        #: workers that offered no segment: this client sends them everything on Flight
        self.refused: set[int] = set()
        #: the table's dim (set once the client read it): the size of a lookup's answer
        self.dim = 0
        self._local = threading.local()
        self._open: dict[int, _Channel] = {}
        self._lock = threading.Lock()
        self._watchdog = Watchdog()

    def exchange(self, s: int, head: dict[str, Any], op: str, batch: pa.RecordBatch,
                 fields: dict[str, Any], where: str) -> pa.RecordBatch:
        """``Streams.exchange``, through shared memory where it can. With one worker a
        lookup's answer is a view of this thread's segment, valid until its next call: the
        ``des://`` client calls a single worker on the caller's thread and copies the rows
        out at once (one copy, not two); with several, pool threads call the workers for
        any caller, and the rows are copied out of the segment first."""
        if (self._host is None or s in self.refused or not self.dim
                or batch.schema.field("key").type != pa.int64()):
            return self.flight.exchange(s, head, op, batch, fields, where)
        mine: dict[int, _Channel] = self._local.__dict__.setdefault("channels", {})
        ch = mine.get(s)
        try:
            if ch is None:
                ch = mine[s] = self._start(s, head, where)
            out = self._call(ch, op, batch, fields, where, len(self._clients) == 1)
        except _Refused:
            self.refused.add(s)
            self._drop(mine, s)
            return self.flight.exchange(s, head, op, batch, fields, where)
        except BackendError as e:
            if type(e) is BackendError:  # the transport: a new stream next call
                self._drop(mine, s, broken=True)
            raise
        return self.flight.exchange(s, head, op, batch, fields, where) if out is None else out

    def ready(self, dim: int, infos: list[dict[str, Any]]) -> None:
        """The table's ``dim`` and the workers' ``info``: a worker that does not say it
        offers segments (``--no-shm``, or older than them) gets every call on Flight."""
        self.dim = int(dim)
        self.refused.update(s for s, i in enumerate(infos) if i.get("shm") is not True)

    def push_fields(self, s: int) -> dict[str, Any]:
        """What a subscription to worker ``s`` asks for: deltas through shared memory
        where it may (``service/push.py``)."""
        return {"host": self._host} if self._host is not None and s not in self.refused else {}

    def refuse(self, s: int) -> None:
        """Worker ``s``'s segments cannot be mapped here: Flight from now on."""
        self.refused.add(s)

    def _start(self, s: int, head: dict[str, Any], where: str) -> _Channel:
        try:
            writer, reader = self._clients[s].do_exchange(wire.command("shm", **head),
                                                          self._options)
            writer.begin(pa.schema([]))
        except flight.FlightError as e:
            wire.raise_remote(e, where)
        ch = _Channel(writer, reader, self._watchdog, self._timeout)
        with self._lock:
            self._open[id(ch)] = ch
        return ch

    def _call(self, ch: _Channel, op: str, batch: pa.RecordBatch, fields: dict[str, Any],
              where: str, view: bool) -> pa.RecordBatch | None:
        """One call through ``ch``'s segment; None when it is over a segment's limit."""
        names = batch.schema.names
        keys = batch.column("key").to_numpy()
        n, dim = len(keys), self.dim
        parts: list[tuple[str, np.ndarray]] = [("key", keys)]
        if "count" in names:
            parts.append(("count", batch.column("count").to_numpy()))
        if "vec" in names:
            parts.append(("vec", wire.vectors_from(batch.column("vec"), dim, n)))
        msg: dict[str, Any] = {"op": op, **fields, "rows": n, "dim": dim}
        end = HEADER
        for name, arr in parts:
            msg[name], end = end, end + aligned(arr.nbytes)
        out_bytes = n * dim * 4 if op == "lookup" else n if op == "contains" else 0
        if out_bytes:
            msg["out"], end = end, end + aligned(out_bytes)
        if end > MAX_SEGMENT:
            return None
        if ch.seg is None or end > ch.seg.size:
            grown = max(end, FIRST_SEGMENT, 2 * ch.seg.size if ch.seg else 0)
            ch.open(min(grown, MAX_SEGMENT), str(self._host), where)
        seg = ch.seg
        assert seg is not None
        for name, arr in parts:
            seg.array(msg[name], arr.size, arr.dtype)[:] = arr.reshape(-1)
        reply = ch.ask(msg, where)
        if op == "lookup":
            vec = seg.array(msg["out"], n * dim, np.float32).reshape(n, dim)
            return wire.batch(vec=wire.vectors_column(vec if view else vec.copy()))
        if op == "contains":
            return wire.batch(found=pa.array(seg.array(msg["out"], n, np.bool_).copy()))
        step = reply.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise BackendError(f"{where}: a write answered without its step")
        return wire.batch(step=pa.array([step], pa.int64()))

    def _drop(self, mine: dict[int, _Channel], s: int, broken: bool = False) -> None:
        ch = mine.pop(s, None)
        if ch is not None:
            with self._lock:
                self._open.pop(id(ch), None)
            ch.close(broken)

    def close(self) -> None:
        """End every thread's streams and unmap their segments (the watchdog bounds each
        stream's end, then stops)."""
        with self._lock:
            chans, self._open = list(self._open.values()), {}
        try:
            for ch in chans:
                ch.close()
        finally:
            self._watchdog.close()
        self.flight.close()
