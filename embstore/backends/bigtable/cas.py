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
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import numpy as np

from ...errors import BackendError
from .._txn import records_from_values, write_plan
from ..base import ModifyFn
from . import wire

_CheckAndMutateRowResponse = None
_WINDOW = 64  # CheckAndMutateRow calls in flight per sender thread


def check_and_mutate_stub(channel) -> Any:
    """The unary CheckAndMutateRow call on ``channel`` (pre-encoded requests)."""
    global _CheckAndMutateRowResponse
    if _CheckAndMutateRowResponse is None:
        from google.cloud.bigtable_v2.types import bigtable as _pb

        _CheckAndMutateRowResponse = _pb.CheckAndMutateRowResponse.pb()
    return channel.unary_unary("/google.bigtable.v2.Bigtable/CheckAndMutateRow",
                               request_serializer=lambda b: b,
                               response_deserializer=_CheckAndMutateRowResponse.FromString)


def _row_key_list(b: Any, keys: np.ndarray) -> list[bytes]:
    rk = b._row_keys(keys)
    return [bytes(r) for r in rk] if isinstance(rk, np.ndarray) else list(rk)


def read_raw(b: Any, keys: np.ndarray) -> list[bytes]:
    """Stored record bytes of ``keys`` (unique) in request order, ``b""`` where missing."""
    out = [b""] * len(keys)
    if len(keys) == 0:
        return out
    order = np.argsort(keys, kind="stable")
    _, idx, vals = b._fetch(keys[order], keys_only=False)
    for i, v in zip(order[idx].tolist(), vals):
        out[i] = v
    return out


def _cas_rows(b: Any, requests: list[tuple[int, bytes, bool]]) -> np.ndarray:
    """Send ``(row, request, success_when_matched)`` CheckAndMutateRow calls, ``inflight`` at
    a time; return the rows whose mutation applied."""
    if not requests:
        return np.zeros(0, dtype=np.intp)
    per = -(-len(requests) // max(b.inflight, 1))
    chunks = [requests[i:i + per] for i in range(0, len(requests), per)]

    def send(chunk: list, deadline: float) -> list[int]:
        # Up to _WINDOW calls in flight per sender (gRPC futures): the emulator answers each
        # in ~0.2 ms, so waiting for one at a time would leave it idle.
        landed = []
        for w in range(0, len(chunk), _WINDOW):
            part = chunk[w:w + _WINDOW]
            timeout = max(min(b.rpc_timeout, deadline - time.monotonic()), 0.001)
            futures = [b._check_and_mutate.future(req, timeout=timeout) for _, req, _ in part]
            b.counters["remote_writes"] += len(part)
            for (row, req, want), fut in zip(part, futures):
                try:
                    matched = bool(fut.result().predicate_matched)
                except Exception:  # noqa: BLE001 - classified and retried by _retry
                    def attempt(timeout: float, req=req) -> bool:
                        b.counters["remote_writes"] += 1
                        return bool(b._check_and_mutate(req, timeout=timeout).predicate_matched)

                    matched = b._retry("check_and_mutate", attempt, deadline)
                if matched == want:
                    landed.append(row)
        return landed

    results = b._run_sharded("check_and_mutate", chunks, send)
    return np.array([r for part in results for r in part], dtype=np.intp)


def _requests(b: Any, rows: np.ndarray, rk: list[bytes], old: list[bytes], new: dict[int, bytes],
              write: np.ndarray, drop: np.ndarray, ts: int) -> list[tuple[int, bytes, bool]]:
    fam, fam_b, head = b.column_family, b._family_b, b._cam_head
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
            out.append((i, wire.check_and_mutate(head, rk[i], b._filter,
                                                 [], [wire.set_cell(fam_b, ts, new[i])]), False))
    return out


def cas_modify(b: Any, keys: np.ndarray, fn: ModifyFn) -> np.ndarray:
    """``Backend.modify`` by compare-and-set per row (see the module docstring)."""
    n = len(keys)
    if n == 0:
        return np.zeros(0, dtype=bool)
    dtype, itemsize = b.layout.dtype, b.layout.itemsize
    rk = _row_key_list(b, keys)
    pending = np.ones(n, dtype=bool)
    landed_input: list[bytes] = [b""] * n  # what fn saw for a row when its write landed
    landed_recs = b._empty_records(n)
    tried: dict[int, tuple[bytes, bytes, np.ndarray]] = {}  # row -> (input, written, record)
    deadline = time.monotonic() + b.retry_deadline
    delay = 0.002
    while True:
        rows = np.flatnonzero(pending)
        fresh = read_raw(b, keys[rows])
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
        recs, found = records_from_values(inputs, dtype, itemsize, b.url)
        write, drop = write_plan(fn(recs, found.copy()), found)
        rows = np.flatnonzero(pending)
        if len(rows):
            new = np.ascontiguousarray(recs).view(np.uint8).reshape(n, itemsize)
            new_bytes = {i: new[i].tobytes() for i in rows.tolist() if write[i]}
            reqs = _requests(b, rows, rk, inputs, new_bytes, write, drop, b._next_ts())
            sent = {r for r, _, _ in reqs}
            ok = set(_cas_rows(b, reqs).tolist())
            for i in rows.tolist():
                if i not in sent or i in ok:
                    pending[i] = False
                    landed_input[i], landed_recs[i] = inputs[i], recs[i]
                else:
                    tried[i] = (inputs[i], new_bytes.get(i, b""), recs[i].copy())
            b.counters["cas_conflicts"] = b.counters.get("cas_conflicts", 0) + len(sent - ok)
        if not pending.any():
            # fn's last view: rows that landed in an earlier round hold what was stored
            if before.any():
                recs[before] = landed_recs[before]
            return np.fromiter((len(v) > 0 for v in landed_input), dtype=bool, count=n)
        if time.monotonic() > deadline:
            raise BackendError(
                f"{b.url}: Bigtable read-modify-write of {int(pending.sum())} rows kept "
                f"conflicting with other writers for {b.retry_deadline:g} s")
        time.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 0.2)


def cas_insert(b: Any, keys: np.ndarray, records: np.ndarray) -> np.ndarray:
    """Write ``records`` only for keys without a record (insert-if-absent); return which."""
    n = len(keys)
    if n == 0:
        return np.zeros(0, dtype=bool)
    rk = _row_key_list(b, keys)
    raw = np.ascontiguousarray(records).view(np.uint8).reshape(n, -1)
    ts = b._next_ts()
    reqs = [(i, wire.check_and_mutate(b._cam_head, rk[i], b._filter, [],
                                      [wire.set_cell(b._family_b, ts, raw[i].tobytes())]),
             False) for i in range(n)]
    done = np.zeros(n, dtype=bool)
    done[_cas_rows(b, reqs)] = True
    return done


def cas_modify_meta(b: Any, fn) -> dict:
    """``Backend.modify_meta``: compare-and-set of the metadata row, retried. Other fields of
    the row's document (a pending restore's marker, see :mod:`.restore`) are kept."""
    def on_doc(doc: dict | None) -> dict:
        stored = doc.get("meta", doc) if isinstance(doc, dict) else doc
        meta = fn(stored)
        new = {k: v for k, v in doc.items() if k not in ("meta", "ts_high")} if (
            isinstance(doc, dict) and "meta" in doc) else {}
        new["meta"] = meta
        return new

    meta = cas_modify_meta_doc(b, on_doc)["meta"]
    b._meta_cache = dict(meta)
    return meta


def cas_modify_meta_doc(b: Any, fn, row: bytes = wire.META_ROW) -> dict:
    """Replace the metadata row's JSON document ``doc`` by ``fn(doc)`` (``None`` when the row
    is missing) by compare-and-set, retried on conflict; ``ts_high`` is added. Return the
    document written. ``row``: another reserved row holding a JSON document (the writer
    leases, ``wire.LEASE_ROW``)."""
    deadline = time.monotonic() + b.retry_deadline
    delay = 0.002
    fam, fam_b = b.column_family, b._family_b
    written: tuple[bytes, dict] | None = None
    while True:
        req = wire.read_rows_keys(b._read_head, [row], b._filter)
        _, vals = b._read_request(req, "read_meta", time.monotonic() + b.retry_deadline)
        old = vals[0] if vals else b""
        if written is not None and old == written[0]:  # landed, though its answer was lost
            return written[1]
        new = dict(fn(json.loads(old.decode()) if old else None))
        ts = b._next_ts()
        new["ts_high"] = ts
        doc = json.dumps(new).encode()
        if old:
            req = wire.check_and_mutate(b._cam_head, row, wire.value_equals_filter(fam, old),
                                        [wire.delete_column(fam_b), wire.set_cell(fam_b, ts, doc)],
                                        [])
        else:
            req = wire.check_and_mutate(b._cam_head, row, b._filter, [],
                                        [wire.set_cell(fam_b, ts, doc)])
        if len(_cas_rows(b, [(0, req, bool(old))])):
            return new
        written = (doc, new)
        if time.monotonic() > deadline:
            raise BackendError(f"{b.url}: Bigtable metadata update kept conflicting with "
                               f"other writers for {b.retry_deadline:g} s")
        time.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 0.2)
