"""A worker's end of the same-host payload path (:mod:`embstore.service.shm`): one kept
Flight stream per client thread carries small JSON messages, the rows lie in a segment the
worker made for that stream.

Messages, each answered with one metadata-only message (a JSON object, or the usual
``[embstore:Class] message`` line for a refusal, after which the stream goes on):

- ``{"op": "open", "bytes": N, "host": ID}``: a segment of N bytes for this stream (the
  one before, if any, is dropped): ``{"name", "nonce", "bytes"}``, or ``{"refused":
  why}`` (``--no-shm``, another host or user) and the client uses the Flight path;
- ``{"op": "attached"}``: the client mapped it; the file is unlinked now;
- ``{"op": "switch"}``: with ``"sock": true`` in its ``open``, the worker named a socket
  (``"sock"``) the client connected to and proved the segment on: ``{}`` and the stream's
  messages go over that socket from then on (:mod:`embstore.service.shm_sock`), or
  ``{"refused": why}`` and they stay on the Flight stream;
- ``{"op": "lookup" | "contains" | "update" | "assign", "rows": n, "dim": d, "key": off,
  "vec": off, "count": off, "out": off, ...}``: the rows at those offsets, checked as a
  frame is; the answer's rows written at ``out``; ``{"step": s}`` for a write.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from ..errors import InvalidInputError
from . import shm_sock, wire
from .shm import HEADER, MAX_SEGMENT, Segment, host_id, region, row_count
from .streams import STREAM_OPS

#: distinct request messages a session remembers as parsed and checked: a client's repeat
#: call after call (the same op, rows and offsets for a trainer's fixed batch size)
_KNOWN = 64

#: ``rows(header, keys, rows, counts)``: the store call of a lookup, contains or write
RowsCall = Callable[[dict[str, Any], np.ndarray, Any, Any], np.ndarray]


class ShmSession:
    """One client stream's segment and calls.

    Parameters
    ----------
    check : callable
        ``check(header)`` raises unless the caller's role may call the header's op on this
        shard (the checks of a frame).
    guard : callable
        ``guard(fn, op)`` runs ``fn``, turning errors into one-line Flight errors.
    rows : callable
        The store call (``RowsCall``); it holds the store lock itself.
    dim : int
        The store's dim; ``int_keys``: whether its keys are int64 (bytes keys use Flight).
    enabled : bool
        False with ``--no-shm``: every ``open`` is refused.
    """

    def __init__(self, check: Callable[[dict[str, Any]], None],
                 guard: Callable[[Callable[[], Any], str], Any], rows: RowsCall, dim: int,
                 int_keys: bool, enabled: bool) -> None:
        self._check, self._guard, self._rows = check, guard, rows
        self._dim, self._int_keys, self._enabled = int(dim), int_keys, enabled
        self.seg: Segment | None = None
        self._known: dict[bytes, dict[str, Any]] = {}
        self._listener: Any = None      # a socket offered in answer to open, until switch
        self._conn: Any = None          # the socket switched to

    def serve(self, reader: Any, writer: Any, stopping: Callable[[], bool]) -> None:
        """Answer the stream's messages until it ends or ``stopping()`` (after a ``switch``,
        the socket's until the client closes it); the segment goes with it."""
        try:
            while not stopping():
                try:
                    chunk = reader.read_chunk()
                except StopIteration:
                    return
                raw = chunk.app_metadata.to_pybytes() if chunk.app_metadata is not None else b""
                writer.write_metadata(pa.py_buffer(self.answer(raw)))
                if self._conn is not None:
                    shm_sock.serve(self._conn, self.answer, stopping)
                    return
        finally:
            for sock in (self._listener, self._conn):
                if sock is not None:
                    sock.close()
            self._listener = self._conn = None
            if self.seg is not None:
                self.seg.close()
                self.seg = None

    def answer(self, raw: bytes) -> bytes:
        """The answer to one message: a JSON object, or a refusal's one line."""
        known = self._known.get(raw)
        try:
            reply = self._guard(partial(self._one, raw, known),
                                _op_of(raw) if known is None else known["op"])
        except flight.FlightServerError as e:
            return str(e).encode()
        return json.dumps(reply).encode() if reply else b"{}"

    def _one(self, raw: bytes, known: dict[str, Any] | None) -> dict[str, Any]:
        h = known
        if h is None:
            h = wire.parse_header(raw)
            op = h["op"]
            if op == "open":
                return self._open(h)
            if op == "attached":
                if self.seg is None:
                    raise InvalidInputError("no segment to attach: open one first")
                self.seg.unlink()
                return {}
            if op == "switch":
                return self._switch()
            if op not in STREAM_OPS:
                raise InvalidInputError(f"{op!r} is not a request shared memory carries")
            self._check(h)
            if len(self._known) < _KNOWN:   # parsed and checked once (the stream's role)
                self._known[raw] = h
        seg = self.seg
        if seg is None or seg.path is not None:
            raise InvalidInputError("no attached segment: open one first")
        if not self._int_keys:
            raise InvalidInputError("shared memory carries int64 keys only")
        return self._call(seg, h, h["op"])

    def _switch(self) -> dict[str, Any]:
        listener, self._listener = self._listener, None
        seg = self.seg
        if listener is None or seg is None or seg.path is not None or self._conn is not None:
            raise InvalidInputError("no socket to switch to: open a segment with sock and "
                                    "attach it first")
        try:
            conn = shm_sock.accept(listener, seg.nonce, timeout=1.0)
        finally:
            listener.close()
        if conn is None:
            return {"refused": "no connection proved it mapped the segment"}
        self._conn = conn
        return {}

    def _open(self, h: dict[str, Any]) -> dict[str, Any]:
        self._check({"op": "info"})     # the stream's shard and N; every role may read
        if not self._enabled:
            return {"refused": "this worker serves without shared memory (--no-shm)"}
        here = host_id()
        if here is None or h.get("host") != here:
            return {"refused": "the client is on another host or runs as another user"}
        size = h.get("bytes")
        if isinstance(size, bool) or not isinstance(size, int) or not (
                HEADER < size <= MAX_SEGMENT):
            raise InvalidInputError(f"bytes must be an int in {HEADER + 1}..{MAX_SEGMENT}")
        if self.seg is not None:
            self.seg.close()
            self.seg = None
        try:
            self.seg = Segment.create(size)
        except OSError as e:    # /dev/shm full or read-only: this client uses Flight
            return {"refused": f"no shared memory: {e}"}
        assert self.seg.path is not None
        named = {"name": self.seg.path.rsplit("/", 1)[1], "nonce": self.seg.nonce,
                 "bytes": size}
        if h.get("sock") is True and self._conn is None:
            if self._listener is not None:
                self._listener.close()
            got = shm_sock.listen()
            if got is not None:
                self._listener, named["sock"] = got
        return named

    def _call(self, seg: Segment, h: dict[str, Any], op: str) -> dict[str, Any]:
        n, dim, size = row_count(h), self._dim, seg.size
        if op != "contains" and h.get("dim") != dim:
            raise InvalidInputError(f"vectors must be {dim} float32 wide, got dim "
                                    f"{h.get('dim')!r}")
        koff = region(h, "key", size, n * 8)
        if koff is None:
            raise InvalidInputError("the request names no key offset")
        # copied out: what is checked is what is used, whatever the client writes meanwhile
        keys = seg.array(koff, n, np.int64).copy()
        counts = None
        if op in ("lookup", "update"):
            coff = region(h, "count", size, n * 8)
            counts = None if coff is None else seg.array(coff, n, np.int64).copy()
        rows = None
        if op in ("update", "assign"):
            voff = region(h, "vec", size, n * dim * 4)
            if voff is None:
                raise InvalidInputError("the request names no vec offset")
            rows = seg.array(voff, n * dim, np.float32).reshape(n, dim).copy()
        out = 0
        if op in ("lookup", "contains"):
            at = region(h, "out", size, n * (dim * 4 if op == "lookup" else 1))
            if at is None:
                raise InvalidInputError("the request names no out offset")
            out = at
        got = self._rows(h, keys, rows, counts)
        if op == "lookup":
            seg.array(out, n * dim, np.float32)[:] = got.reshape(-1)
        elif op == "contains":
            seg.array(out, n, np.uint8)[:] = got
        else:
            return {"step": int(got[0])}
        return {}


def _op_of(raw: bytes) -> str:
    """The op a message names, for the metrics."""
    try:
        op = json.loads(raw).get("op")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return "other"
    return op if isinstance(op, str) and op in STREAM_OPS else "other"
