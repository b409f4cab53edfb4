"""Optimistic concurrency for the Bigtable backend: ``CheckAndMutateRow`` per row, retried.

Bigtable has no multi-row transactions; what it offers atomically is one row's
``CheckAndMutateRow``: a predicate filter evaluated on the row and mutations applied only if it
matched (or only if it did not). A read-modify-write of a batch of keys is therefore made of
one compare-and-set per row:

- a row that existed: *if the latest record cell still holds exactly the bytes we read*
  (a closed value range ``[old, old]``), delete the cell's versions and set the new record (or
  delete the row, when ``fn`` drops it);
- a row that did not: *unless the row has a record cell by now*, set the new record.

Rows whose predicate failed were changed by another writer since the read: they are read
again, ``fn`` runs again on the batch, and only those rows are written, until every row has
landed. Rows that already landed are handed to ``fn`` with the same input as when they landed
(so ``fn``'s view of the batch stays one consistent step) and their stored result is put back
into the records array afterwards. Nothing is lost: a write only lands on the exact state ``fn``
saw. The record bytes carry the engine's version stamp (a hybrid clock) and wall time, so two
different writes never produce equal bytes; an attempt whose answer was lost (a timeout after
the server applied it) is recognized on the re-read because the row then holds exactly the
bytes that attempt wrote.

Deleting the old cell versions in the same mutation keeps the record cell the only one, so no
timestamp race between writers' clocks can hide a write under the latest-cell filter (and the
emulator, which never garbage-collects, does not accumulate versions of updated rows).

:class:`CasWriter` holds this, the write timestamps and the control rows' JSON documents
(metadata, writer leases, restore generation): read, blind write and compare-and-set.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import BackendError
from .._txn import records_from_values, write_plan
from ..base import ModifyFn
from . import wire
from .connection import BigtableConnection

_WINDOW = 64  # CheckAndMutateRow calls in flight per sender thread
Requests = list[tuple[int, bytes, bool]]


def meta_update(fn: Callable[[Any], Any]) -> Callable[[dict | None], dict]:
    """The document update of ``modify_meta(fn)``: ``fn`` replaces the document's ``"meta"``;
    its other fields (a pending restore's marker, see :mod:`.restore`) are kept."""
    def on_doc(doc: dict | None) -> dict:
        stored = doc.get("meta", doc) if isinstance(doc, dict) else doc
        meta = fn(stored)
        new = {k: v for k, v in doc.items() if k not in ("meta", "ts_high")} if (
            isinstance(doc, dict) and "meta" in doc) else {}
        new["meta"] = meta
        return new

    return on_doc


class CasWriter:
    """Check-and-mutate writes, write timestamps and the control rows of one table.

    Parameters
    ----------
    conn : BigtableConnection
        The table's connection (requests, retries, the sharded runner, counters).
    read_batch : int
        Rows per ReadRows request.
    """

    def __init__(self, conn: BigtableConnection, read_batch: int) -> None:
        self.conn, self.read_batch = conn, read_batch
        self.url = conn.url
        h = conn.heads
        self._fam, self._fam_b, self._filter = h.family, h.family_b, h.filter
        self._cam_head, self._read_head, self._write_head = h.cam, h.read, h.write
        self._ts_lock = threading.Lock()
        self._last_ts = 0

    # -- timestamps -------------------------------------------------------------------------------
    def next_ts(self) -> int:
        """A write timestamp: millisecond granularity (Bigtable's default), strictly increasing
        within the process so that a later put always shadows an earlier one under the
        latest-cell filter."""
        with self._ts_lock:
            ts = max(time.time_ns() // 1_000_000 * 1000, self._last_ts + 1000)
            self._last_ts = ts
            return ts

    def observe_ts(self, ts: int) -> None:
        """Never write below ``ts``, a timestamp already used (read back from the table)."""
        with self._ts_lock:
            self._last_ts = max(self._last_ts, ts)

    # -- control rows -----------------------------------------------------------------------------
    def read_raw_doc(self, row: bytes) -> bytes | None:
        """The latest cell of control row ``row`` (None: no row)."""
        req = wire.read_rows_keys(self._read_head, [row], self._filter)
        _, vals = self.conn.read(req, "read_meta", self.conn.deadline())
        return vals[0] if vals else None

    def read_doc(self, row: bytes = wire.META_ROW) -> Any:
        """The JSON document of control row ``row`` (None: no row)."""
        raw = self.read_raw_doc(row)
        if not raw:
            return None
        try:
            return json.loads(raw.decode())
        except (UnicodeDecodeError, ValueError) as e:
            raise BackendError(f"{self.url}: the metadata row is not embstore JSON") from e

    def write_doc(self, row: bytes, doc: Any, stamp: bool = True) -> None:
        """Write ``doc`` as JSON into the control row ``row`` (blind); a dict gets ``ts_high``,
        the stamp of the write, unless ``stamp`` is false (a document put back as it was)."""
        ts = self.next_ts()
        if stamp and isinstance(doc, dict):
            doc = {**doc, "ts_high": ts}
        value = np.frombuffer(json.dumps(doc).encode(), np.uint8).reshape(1, -1)
        self.conn.mutate("write_meta", lambda sel: wire.mutate_rows_generic(
            self._write_head, self._fam_b, ts, [row], value), 1, self.conn.deadline())

    def modify_doc(self, fn: Callable[[Any], Any], row: bytes = wire.META_ROW) -> dict:
        """Replace the JSON document ``doc`` of control row ``row`` by ``fn(doc)`` (``None``
        when the row is missing) by compare-and-set, retried on conflict; ``ts_high`` is
        added. Return the document written."""
        deadline = self.conn.deadline()
        delay = 0.002
        fam, fam_b = self._fam, self._fam_b
        written: tuple[bytes, dict] | None = None
        while True:
            old = self.read_raw_doc(row) or b""
            if written is not None and old == written[0]:  # landed, though its answer was lost
                return written[1]
            new = dict(fn(json.loads(old.decode()) if old else None))
            ts = self.next_ts()
            new["ts_high"] = ts
            doc = json.dumps(new).encode()
            if old:
                req = wire.check_and_mutate(
                    self._cam_head, row, wire.value_equals_filter(fam, old),
                    [wire.delete_column(fam_b), wire.set_cell(fam_b, ts, doc)], [])
            else:
                req = wire.check_and_mutate(self._cam_head, row, self._filter, [],
                                            [wire.set_cell(fam_b, ts, doc)])
            if len(self.send([(0, req, bool(old))])):
                return new
            written = (doc, new)
            if time.monotonic() > deadline:
                raise BackendError(f"{self.url}: Bigtable metadata update kept conflicting "
                                   f"with other writers for {self.conn.retry_deadline:g} s")
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 0.2)

    # -- data rows --------------------------------------------------------------------------------
    def send(self, requests: Requests) -> np.ndarray:
        """Send ``(row, request, success_when_matched)`` CheckAndMutateRow calls,
        ``inflight`` at a time; return the rows whose mutation applied."""
        if not requests:
            return np.zeros(0, dtype=np.intp)
        conn = self.conn
        call = conn.stubs.check_and_mutate
        per = -(-len(requests) // max(conn.inflight, 1))
        chunks = [requests[i:i + per] for i in range(0, len(requests), per)]

        def send(chunk: list, deadline: float) -> list[int]:
            # Up to _WINDOW calls in flight per sender (gRPC futures): the emulator answers
            # each in ~0.2 ms, so waiting for one at a time would leave it idle.
            landed = []
            for w in range(0, len(chunk), _WINDOW):
                part = chunk[w:w + _WINDOW]
                timeout = max(min(conn.rpc_timeout, deadline - time.monotonic()), 0.001)
                futures = [call.future(req, timeout=timeout) for _, req, _ in part]
                conn.counters["remote_writes"] += len(part)
                for (row, req, want), fut in zip(part, futures):
                    try:
                        matched = bool(fut.result().predicate_matched)
                    except Exception:  # noqa: BLE001 - classified and retried by retry()
                        def attempt(timeout: float, req=req) -> bool:
                            conn.counters["remote_writes"] += 1
                            return bool(call(req, timeout=timeout).predicate_matched)

                        matched = conn.retry("check_and_mutate", attempt, deadline)
                    if matched == want:
                        landed.append(row)
            return landed

        results = conn.run_sharded("check_and_mutate", chunks, send)
        return np.array([r for part in results for r in part], dtype=np.intp)

    def _requests(self, rows: np.ndarray, rk: list[bytes], old: list[bytes],
                  new: dict[int, bytes], write: np.ndarray, drop: np.ndarray,
                  ts: int) -> Requests:
        fam, fam_b, head = self._fam, self._fam_b, self._cam_head
        out = []
        for i in rows.tolist():
            if old[i]:
                if write[i]:
                    muts = [wire.delete_column(fam_b), wire.set_cell(fam_b, ts, new[i])]
                elif drop[i]:
                    muts = [wire.DELETE_ROW]
                else:
                    continue
                out.append((i, wire.check_and_mutate(head, rk[i], wire.value_equals_filter(
                    fam, old[i]), muts, []), True))
            elif write[i]:
                out.append((i, wire.check_and_mutate(head, rk[i], self._filter, [],
                                                     [wire.set_cell(fam_b, ts, new[i])]), False))
        return out

    def read_raw(self, rk: list[bytes]) -> list[bytes]:
        """The stored bytes of rows ``rk`` (unique) in request order, ``b""`` where missing."""
        got, vals = self.conn.read_keys(self.conn.heads.read, sorted(rk), self._filter,
                                        self.read_batch)
        stored = dict(zip(got, vals))
        return [stored.get(k, b"") for k in rk]

    def modify(self, rk: list[bytes], fn: ModifyFn, landed_recs: np.ndarray) -> np.ndarray:
        """``Backend.modify`` by compare-and-set per row (see the module docstring).

        ``rk``: the rows' keys (unique); ``landed_recs``: an empty record per row (the
        layout's dtype), filled with what ``fn`` made of each."""
        n = len(rk)
        if n == 0:
            return np.zeros(0, dtype=bool)
        dtype, itemsize = landed_recs.dtype, landed_recs.dtype.itemsize
        pending = np.ones(n, dtype=bool)
        landed_input: list[bytes] = [b""] * n  # what fn saw for a row when its write landed
        tried: dict[int, tuple[bytes, bytes, np.ndarray]] = {}  # row -> (input, written, rec)
        deadline = self.conn.deadline()
        delay = 0.002
        while True:
            rows = np.flatnonzero(pending)
            fresh = self.read_raw([rk[i] for i in rows.tolist()]) if len(rows) else []
            inputs = list(landed_input)
            for i, v in zip(rows.tolist(), fresh):
                t = tried.get(i)
                if t is not None and v == t[1]:
                    # the previous attempt landed though its answer was lost
                    pending[i] = False
                    landed_input[i], landed_recs[i] = t[0], t[2]
                    inputs[i] = t[0]
                else:
                    inputs[i] = v
            before = ~pending
            recs, found = records_from_values(inputs, dtype, itemsize, self.url)
            write, drop = write_plan(fn(recs, found.copy()), found)
            rows = np.flatnonzero(pending)
            if len(rows):
                new = np.ascontiguousarray(recs).view(np.uint8).reshape(n, itemsize)
                new_bytes = {i: new[i].tobytes() for i in rows.tolist() if write[i]}
                reqs = self._requests(rows, rk, inputs, new_bytes, write, drop, self.next_ts())
                sent = {r for r, _, _ in reqs}
                ok = set(self.send(reqs).tolist())
                for i in rows.tolist():
                    if i not in sent or i in ok:
                        pending[i] = False
                        landed_input[i], landed_recs[i] = inputs[i], recs[i]
                    else:
                        tried[i] = (inputs[i], new_bytes.get(i, b""), recs[i].copy())
                counters = self.conn.counters
                counters["cas_conflicts"] = counters.get("cas_conflicts", 0) + len(sent - ok)
            if not pending.any():
                # fn's last view: rows that landed in an earlier round hold what was stored
                if before.any():
                    recs[before] = landed_recs[before]
                return np.fromiter((len(v) > 0 for v in landed_input), dtype=bool, count=n)
            if time.monotonic() > deadline:
                raise BackendError(
                    f"{self.url}: Bigtable read-modify-write of {int(pending.sum())} rows kept "
                    f"conflicting with other writers for {self.conn.retry_deadline:g} s")
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 0.2)

    def insert(self, rk: list[bytes], records: np.ndarray) -> np.ndarray:
        """Write ``records`` only for rows without a record (insert-if-absent); return
        which."""
        n = len(rk)
        if n == 0:
            return np.zeros(0, dtype=bool)
        raw = np.ascontiguousarray(records).view(np.uint8).reshape(n, -1)
        ts = self.next_ts()
        reqs = [(i, wire.check_and_mutate(self._cam_head, rk[i], self._filter, [],
                                          [wire.set_cell(self._fam_b, ts, raw[i].tobytes())]),
                 False) for i in range(n)]
        done = np.zeros(n, dtype=bool)
        done[self.send(reqs)] = True
        return done
