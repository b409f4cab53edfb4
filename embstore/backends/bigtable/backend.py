"""``bigtable://project/instance/table`` — records in Cloud Bigtable (or its emulator).

One row per key, one binary cell per row holding the record's raw bytes (the layout dtype), in
column family ``column_family`` (default ``"e"``); store metadata, the writer-lease record and
a restore's generation live in reserved rows no data key can produce (:mod:`.wire`). The hot
paths send hand-encoded gRPC requests (the client library's per-row objects cost several times
the emulator's own work), sharded over ``inflight`` streams; every read carries a latest-cell
filter (the emulator never garbage-collects old versions). Channels, administration and
retries: :mod:`.connection`; compare-and-set: :mod:`.cas`; restores: :mod:`.restore`.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import urlencode

import numpy as np

from ...errors import InvalidInputError
from ...options import accepted_options, unknown_option_error
from ...urls import check_url_text
from .. import ranges as kr
from ..base import Backend, ModifyFn
from ..forks import ForkSafePool
from ..lease_record import check_fence, loads
from . import cas, guard, restore, wire
from .restore import BigtableRestore
from .stubs import data_stubs

_FAMILY = re.compile(r"^[-_.a-zA-Z0-9]{1,64}$")


class BigtableBackend(BigtableRestore, Backend):
    """Row store in a Bigtable table; persistent, scan in key order.

    Options
    -------
    emulator_host : str, optional
        ``host:port`` of an emulator; default ``$BIGTABLE_EMULATOR_HOST``. Carried in
        ``reopen_options`` so a pickled store reaches the same emulator from other processes.
    create : bool, optional
        Create the table / column family when missing (max-1-version GC rule). Default: True
        against an emulator, False against real Bigtable (where tables are usually made by
        infrastructure code). With ``create`` a table that vanishes while in use (an emulator
        restart) is recreated and the metadata re-written.
    column_family : str
        Family holding the records (default ``"e"``).
    app_profile_id : str, optional
        Bigtable app profile for data requests.
    retry_deadline : float
        Seconds an operation keeps retrying transient errors (default 30).
    rpc_timeout : float
        Per-attempt deadline in seconds (default 20; never beyond ``retry_deadline``).
    read_batch, write_batch : int
        Keys per ReadRows / rows per MutateRows request (default 1024 / 1024).
    inflight : int
        Requests in flight at once per operation (default 4).
    interceptors : sequence, optional
        gRPC client interceptors for the data channel (e.g. fault injection in tests).
    check_and_set : bool
        ``True`` (default): ``update``/``assign`` and the creation of new rows write each row
        with ``CheckAndMutateRow`` against the bytes read (retried on conflict), so several
        writers on one table lose nothing (see ``docs/concurrency.md``). ``False``: blind
        batched writes, several times faster, for a table with one writer (e.g. behind a
        write-back cache, or a rank's own table).
    """

    persistent = True
    supports_scan = True
    supports_ranges = True
    supports_fencing = True
    thread_safe = True  # a gRPC channel pool; calls from several threads overlap
    scheme = "bigtable"
    #: longest bytes key: Bigtable's 4 KiB row-key limit minus the one-byte key prefix
    max_key_bytes = wire.MAX_ROW_KEY - 1

    def __init__(self, url: str, *, read_only: bool = False, emulator_host: str | None = None,
                 create: bool | None = None, column_family: str = "e",
                 app_profile_id: str | None = None, retry_deadline: float = 30.0,
                 rpc_timeout: float = 20.0, read_batch: int = 1024, write_batch: int = 1024,
                 inflight: int = 4, interceptors: Sequence[Any] = (),
                 credentials: Any = None, check_and_set: bool = True,
                 **options: Any) -> None:
        check_url_text(url)  # a newline would cut the table id short
        self.project, self.instance, self.table_id = wire.parse_url(url)
        if not _FAMILY.match(str(column_family)):
            raise InvalidInputError(f"invalid column family name {column_family!r}")
        for name, val in (("read_batch", read_batch), ("write_batch", write_batch),
                          ("inflight", inflight)):
            if int(val) <= 0:
                raise InvalidInputError(f"{name} must be positive, got {val!r}")
        if float(retry_deadline) <= 0 or float(rpc_timeout) <= 0:
            raise InvalidInputError("retry_deadline and rpc_timeout must be positive")
        if options:
            raise unknown_option_error("bigtable://", options, accepted_options(type(self)) or ())
        self.emulator_host = (emulator_host or wire.url_emulator_host(url)
                              or os.environ.get("BIGTABLE_EMULATOR_HOST") or None)
        # store.url must reopen the same table: with the emulator's address in it, a reopen
        # in a process without BIGTABLE_EMULATOR_HOST does not go to Cloud Bigtable
        url = f"bigtable://{self.project}/{self.instance}/{self.table_id}"
        if self.emulator_host:
            url += "?" + urlencode({"emulator_host": self.emulator_host}, safe=":")
        super().__init__(url, read_only=read_only)
        self.create = (self.emulator_host is not None) if create is None else bool(create)
        self.column_family = str(column_family)
        self.app_profile_id = app_profile_id
        self.retry_deadline = float(retry_deadline)
        self.rpc_timeout = float(rpc_timeout)
        self.read_batch, self.write_batch = int(read_batch), int(write_batch)
        self.inflight = int(inflight)
        self.table_name = (f"projects/{self.project}/instances/{self.instance}"
                           f"/tables/{self.table_id}")
        self._family_b = self.column_family.encode()
        self._read_head = wire.request_head(self.table_name, app_profile_id, 5)
        self._write_head = wire.request_head(self.table_name, app_profile_id, 3)
        self._cam_head = wire.request_head(self.table_name, app_profile_id, 7)
        self.check_and_set = bool(check_and_set)
        self._filter = wire.latest_cell_filter(self.column_family)
        self._keys_filter = wire.latest_cell_filter(self.column_family, strip_value=True)
        self._meta_cache: dict | None = None
        self._lease_doc: dict | None = None  # the lease record as this backend last wrote it
        self._restore_pending: str | None = None  # staging table of a committed restore
        self._restore_id: str | None = None  # that restore's id, kept with the marker
        self._staging_of: dict | None = None  # set on a restore's own staging table
        self._ts_lock = threading.Lock()
        self._table_lock = threading.RLock()
        self._last_ts = 0
        self._closed = False
        self.counters = dict.fromkeys(
            ("remote_reads", "remote_writes", "rows_read", "rows_written", "retries",
             "tables_recreated"), 0)
        self._credentials = credentials
        self._channel, self._admin_channel = self._make_channels(credentials, interceptors)
        self._read_rows, self._mutate_rows, self._sample_row_keys = data_stubs(self._channel)
        self._check_and_mutate = cas.check_and_mutate_stub(self._channel)
        # The calling thread is one of the ``inflight`` senders (see _run_sharded).
        self._pool = ForkSafePool(max(self.inflight - 1, 1), "embstore-bigtable")
        self._admin = None
        try:
            self._ensure_table(initial=True)
            # A restore interrupted by a crash: finished or undone here (see .restore).
            if read_only:
                guard.refuse_pending(self)
            else:
                guard.recover(self)
        except BaseException:
            self.close()
            raise

    # -- key encoding -----------------------------------------------------------------------------
    def _row_keys(self, keys: np.ndarray) -> np.ndarray | list[bytes]:
        if self.key_type == "int64":
            return wire.encode_int_keys(keys)
        too_long = [k for k in keys if len(k) >= wire.MAX_ROW_KEY]
        if too_long:
            raise InvalidInputError(
                f"bytes keys must be shorter than {wire.MAX_ROW_KEY} bytes for Bigtable; got "
                f"one of {len(too_long[0])} bytes")
        return wire.encode_bytes_keys(keys)

    def _decode_keys(self, row_keys: list[bytes]) -> np.ndarray:
        if self.key_type == "int64":
            return wire.decode_int_keys(row_keys)
        return wire.decode_bytes_keys(row_keys)

    def _next_ts(self) -> int:
        # Millisecond granularity (Bigtable's default), strictly increasing within the process
        # so that a later put always shadows an earlier one under the latest-cell filter.
        with self._ts_lock:
            ts = max(time.time_ns() // 1_000_000 * 1000, self._last_ts + 1000)
            self._last_ts = ts
            return ts

    # -- reads ------------------------------------------------------------------------------------
    def _read_request(self, req: bytes, op: str, deadline: float) -> tuple[list, list]:
        def attempt(timeout: float):
            self.counters["remote_reads"] += 1
            return wire.parse_rows(self._read_rows(req, timeout=timeout), self.column_family)

        return self._retry(op, attempt, deadline)

    def _fetch(self, keys: np.ndarray, keys_only: bool) -> tuple[np.ndarray, np.ndarray,
                                                                  list[bytes]]:
        """Read unique sorted ``keys``: return (keys, index into keys of found rows, values)."""
        rk = self._row_keys(keys)
        filt = self._keys_filter if keys_only else self._filter
        step = self.read_batch
        chunks = [rk[i:i + step] for i in range(0, len(keys), step)]
        results = self._run_sharded(
            "read", chunks,
            lambda c, dl: self._read_request(wire.read_rows_keys(self._read_head, c, filt),
                                             "read", dl))
        got_keys: list[bytes] = []
        vals: list[bytes] = []
        for ks, vs in results:
            got_keys += ks
            vals += vs
        self.counters["rows_read"] += len(got_keys)
        found_keys = self._decode_keys(got_keys)
        idx = np.searchsorted(keys, found_keys) if len(found_keys) else np.zeros(0, np.intp)
        return keys, idx, vals

    def _unique(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.unique(keys, return_inverse=True)

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = len(keys)
        recs = self._empty_records(n)
        found = np.zeros(n, dtype=bool)
        if n == 0:
            return recs, found
        uniq, inv = self._unique(keys)
        _, idx, vals = self._fetch(uniq, keys_only=False)
        urecs = self._empty_records(len(uniq))
        ufound = np.zeros(len(uniq), dtype=bool)
        if len(idx):
            urecs[idx] = self.layout.from_bytes(b"".join(vals), len(vals))
            ufound[idx] = True
        return urecs[inv], ufound[inv]

    def contains(self, keys: np.ndarray) -> np.ndarray:
        if len(keys) == 0:
            return np.zeros(0, dtype=bool)
        uniq, inv = self._unique(keys)
        _, idx, _ = self._fetch(uniq, keys_only=True)
        ufound = np.zeros(len(uniq), dtype=bool)
        ufound[idx] = True
        return ufound[inv]

    # -- writes -----------------------------------------------------------------------------------
    def _mutate(self, op: str, build: Callable[[np.ndarray], bytes], n: int,
                deadline: float) -> None:
        """Send MutateRows for rows ``0..n-1`` (``build(indices)`` encodes a subset), retrying
        only the entries that failed."""
        pending = np.arange(n)

        def attempt(timeout: float) -> None:
            nonlocal pending
            self.counters["remote_writes"] += 1
            failed: list[int] = []
            bad_status = None
            transient = True
            for resp in self._mutate_rows(build(pending), timeout=timeout):
                for e in resp.entries:
                    if e.status.code != 0:
                        failed.append(e.index)
                        bad_status = e.status
                        transient &= e.status.code in wire.TRANSIENT_CODES
            if failed:
                pending = pending[np.asarray(sorted(failed))]
                raise wire.PartialWrite(pending, bad_status, transient)
            self.counters["rows_written"] += len(pending)

        self._retry(op, attempt, deadline)

    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        self._check_writable()
        n = len(keys)
        if n == 0:
            return
        self._check_fence()
        if records.dtype != self.layout.dtype or len(records) != n:
            raise InvalidInputError(
                f"put needs {n} records of the store's layout, got {len(records)} of "
                f"{records.dtype}")
        rk = self._row_keys(keys)
        values = np.ascontiguousarray(records).view(np.uint8).reshape(n, -1)
        ts = self._next_ts()
        encode = wire.mutate_rows_int if self.key_type == "int64" else wire.mutate_rows_generic
        step = self.write_batch

        def send(start: int, deadline: float) -> None:
            ck = rk[start:start + step]
            cv = values[start:start + step]
            if isinstance(ck, list):
                def build(sel):
                    return encode(self._write_head, self._family_b, ts, [ck[i] for i in sel],
                                  cv[sel])
            else:
                def build(sel):
                    if len(sel) == len(cv):  # first attempt: no copies
                        return encode(self._write_head, self._family_b, ts, ck, cv)
                    return encode(self._write_head, self._family_b, ts, ck[sel], cv[sel])
            self._mutate("write", build, len(cv), deadline)

        self._run_sharded("write", list(range(0, n, step)), send)

    def modify(self, keys: np.ndarray, fn: ModifyFn) -> np.ndarray:
        """Read-modify-write by compare-and-set per row, retried on conflict (see
        :mod:`._bigtable_cas`); with ``check_and_set=False`` a plain read then batched write."""
        self._check_writable()
        if not self.check_and_set:
            return super().modify(keys, fn)
        return cas.cas_modify(self, keys, fn)

    def insert_rows(self, keys: np.ndarray, vectors: np.ndarray,
                    template: np.ndarray) -> np.ndarray | None:
        """Insert-if-absent per row (``CheckAndMutateRow``); blind batched writes with
        ``check_and_set=False``. Returns which keys were written (None: all)."""
        self._check_writable()
        if not self.check_and_set:
            return super().insert_rows(keys, vectors, template)
        records = np.repeat(template[:1], len(keys))
        records["vector"] = vectors
        return cas.cas_insert(self, keys, records)

    def delete(self, keys: np.ndarray) -> np.ndarray:
        self._check_writable()
        self._check_fence()
        present = self.contains(keys)
        gone = keys[present]
        if len(gone):
            rk = self._row_keys(gone)
            rk_list = [bytes(r) for r in rk] if isinstance(rk, np.ndarray) else rk
            step = self.write_batch

            def send(start: int, deadline: float) -> None:
                ck = rk_list[start:start + step]
                self._mutate("delete", lambda sel: wire.delete_rows(
                    self._write_head, [ck[i] for i in sel]), len(ck), deadline)

            self._run_sharded("delete", list(range(0, len(gone), step)), send)
        return present

    def bulk_load(self, batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> int:
        # Gather small batches so that every put keeps ``inflight`` requests busy.
        n, keys_acc, recs_acc, size = 0, [], [], 0
        target = self.write_batch * self.inflight * 4
        for keys, recs in batches:
            keys_acc.append(keys)
            recs_acc.append(recs)
            size += len(keys)
            if size >= target:
                n += self._put_concat(keys_acc, recs_acc)
                keys_acc, recs_acc, size = [], [], 0
        if keys_acc:
            n += self._put_concat(keys_acc, recs_acc)
        return n

    def _put_concat(self, keys_acc: list, recs_acc: list) -> int:
        keys = np.concatenate(keys_acc)
        recs = np.concatenate(recs_acc)
        if len(keys_acc) > 1:  # a key repeated across batches: the last one wins
            _, last = np.unique(keys[::-1], return_index=True)
            sel = np.sort(len(keys) - 1 - last)
            keys, recs = keys[sel], recs[sel]
        self.put(keys, recs)
        return len(keys)

    # -- scans ------------------------------------------------------------------------------------
    def _scan_rows(self, keys_only: bool, batch_size: int, start: bytes = wire.DATA_PREFIX,
                   end: bytes = wire.DATA_END, check: Callable[[], None] | None = None
                   ) -> Iterator[tuple[list, list]]:
        """Stream the data rows in ``[start, end)`` in key order, resuming after the last row
        on errors; ``check()`` runs after every read request, before its rows are handed
        out."""
        filt = self._keys_filter if keys_only else self._filter
        start_open = False
        while True:
            deadline = time.monotonic() + self.retry_deadline
            req = wire.read_rows_range(self._read_head, start, start_open, end, filt,
                                       limit=max(batch_size, 1) * 16)

            def attempt(timeout: float, req=req):
                self.counters["remote_reads"] += 1
                return wire.parse_rows(self._read_rows(req, timeout=timeout), self.column_family)

            self._check_open()
            ks, vs = self._retry("scan", attempt, deadline)
            if check is not None:
                check()
            self.counters["rows_read"] += len(ks)
            for i in range(0, len(ks), batch_size):
                yield ks[i:i + batch_size], vs[i:i + batch_size]
            if len(ks) < max(batch_size, 1) * 16:
                return
            start, start_open = ks[-1], True

    def scan(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every record, from one table: a scan that overlaps a restore by another process
        raises ``ConcurrentRestoreError`` (see :mod:`.restore`)."""
        return self.scan_range(kr.KeyRange(kr.KIND_BYTES), batch_size)

    def plan_ranges(self, n: int) -> list[kr.KeyRange]:
        """Row ranges cut at every ``size/n``-th byte offset of Bigtable's own row-key samples
        (``SampleRowKeys``: split points the server keeps, no rows read); a table with too
        few samples (a small one) is cut at every ``rows/n``-th row key of a keys-only read."""
        req = wire.request_head(self.table_name, self.app_profile_id, 2)
        samples = self._retry("sample", lambda timeout: [
            (bytes(r.row_key), int(r.offset_bytes))
            for r in self._sample_row_keys(req, timeout=timeout)],
            time.monotonic() + self.retry_deadline)
        data = [(k, off) for k, off in samples if wire.DATA_PREFIX <= k < wire.DATA_END]
        if n > 1 and len(data) >= 2 * (n - 1):
            return kr.ranges_from_bounds(kr.KIND_BYTES, kr.bounds_from_samples(
                data, max(off for _, off in samples), n))
        walked = [k for ks, _ in self._scan_rows(True, 65536) for k in ks]
        return kr.ranges_from_bounds(kr.KIND_BYTES, kr.bounds_from_walk(walked, len(walked), n,
                                                               wire.DATA_PREFIX))

    def scan_range(self, rng: kr.KeyRange, batch_size: int = 4096
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        # bounds are whole row keys (prefix included), so a range is one Bigtable row range
        start = wire.DATA_PREFIX if rng.lo is None else bytes(rng.lo)
        end = wire.DATA_END if rng.hi is None else bytes(rng.hi)
        if start >= end:
            return
        for ks, vs in self._scan_rows(False, batch_size, start, end,
                                      guard.restore_guard(self)):
            yield self._decode_keys(ks), self.layout.from_bytes(b"".join(vs), len(vs)).copy()

    def __len__(self) -> int:
        # Bigtable keeps no row count: this streams every row key (values stripped), O(rows).
        return sum(len(ks) for ks, _ in self._scan_rows(True, 65536))

    def clear(self) -> None:
        from google.api_core import exceptions as gexc

        self._check_writable()
        self._check_fence()
        try:
            self._admin_call(self._admin_client().drop_row_range,
                             time.monotonic() + self.retry_deadline,
                             request={"name": self.table_name,
                                      "row_key_prefix": wire.DATA_PREFIX})
        except gexc.GoogleAPICallError:  # e.g. no admin rights: delete row by row instead
            super().clear()

    # -- metadata ---------------------------------------------------------------------------------
    def read_meta(self) -> dict | None:
        doc = self.read_meta_doc()
        if doc is None:
            return None
        meta = doc.get("meta", doc) if isinstance(doc, dict) else doc
        if isinstance(doc, dict):
            with self._ts_lock:  # never write below a timestamp already used
                self._last_ts = max(self._last_ts, int(doc.get("ts_high", 0)))
        self._meta_cache = meta
        return meta

    def write_meta(self, meta: dict) -> None:
        self._check_writable()
        self._meta_cache = dict(meta)
        self._write_meta_row(self._meta_cache)

    def modify_meta(self, fn) -> dict:
        self._check_writable()
        return cas.cas_modify_meta(self, fn)

    def modify_leases(self, fn) -> dict:
        """The writer-lease record (row ``wire.LEASE_ROW``) replaced by ``fn(stored)``, by
        compare-and-set, retried on conflict."""
        self._check_writable()
        self._lease_doc = cas.cas_modify_meta_doc(self, fn, row=wire.LEASE_ROW)
        return self._lease_doc

    def _rewrite_leases(self) -> None:
        # The table was recreated empty (an emulator restart): the lease record this writer
        # last wrote goes back with the metadata, so its fenced writes go on.
        if self._lease_doc is not None:
            value = np.frombuffer(json.dumps(self._lease_doc).encode(), np.uint8).reshape(1, -1)
            ts = self._next_ts()
            self._mutate("write_leases", lambda sel: wire.mutate_rows_generic(
                self._write_head, self._family_b, ts, [wire.LEASE_ROW], value), 1,
                time.monotonic() + self.retry_deadline)

    def read_leases(self) -> Any:
        req = wire.read_rows_keys(self._read_head, [wire.LEASE_ROW], self._filter)
        _, vals = self._read_request(req, "read_leases", time.monotonic() + self.retry_deadline)
        return loads(vals[0] if vals else None, self.url)

    def _check_fence(self) -> None:
        # No multi-row transactions: the lease row is read just before the batch is sent, so
        # a takeover between the two lets this one batch land (docs/concurrency.md).
        if self.fence is not None:
            check_fence(self.read_leases(), self.fence, self.url)

    replace_mechanism = "staging-table"

    def replace_rows(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict,
                     rows: int | None = None) -> int:
        """The new rows staged in ``<table>__restore``, committed by a marker in the metadata
        row, then copied over the live table; finished on the next writer open after a crash
        (see :mod:`.restore`)."""
        self._check_writable()
        return self.replace_via_staging(batches, meta)

    def _write_meta_row(self, meta: dict) -> None:
        fields: dict[str, Any] = {"meta": meta}
        if self._restore_pending:
            fields[restore.MARKER] = self._restore_pending
            fields[restore.RESTORE_ID] = self._restore_id
        if self._staging_of:
            fields[restore.STAGING_OF] = self._staging_of
        self.write_row_doc(wire.META_ROW, fields)

    def write_row_doc(self, row: bytes, doc: Any) -> None:
        """Write ``doc`` as JSON into the control row ``row`` (blind); a dict gets ``ts_high``,
        the stamp of the write."""
        ts = self._next_ts()
        if isinstance(doc, dict):
            doc = {**doc, "ts_high": ts}
        value = np.frombuffer(json.dumps(doc).encode(), np.uint8).reshape(1, -1)
        deadline = time.monotonic() + self.retry_deadline
        self._mutate("write_meta", lambda sel: wire.mutate_rows_generic(
            self._write_head, self._family_b, ts, [row], value), 1, deadline)

    # -- lifecycle --------------------------------------------------------------------------------
    def reopen_options(self) -> dict:
        out: dict[str, Any] = {}
        if self.emulator_host:
            out["emulator_host"] = self.emulator_host
        if self.column_family != "e":
            out["column_family"] = self.column_family
        if self.app_profile_id:
            out["app_profile_id"] = self.app_profile_id
        out["retry_deadline"] = self.retry_deadline
        if not self.check_and_set:
            out["check_and_set"] = False
        return out

    def stats(self) -> dict[str, Any]:
        return dict(self.counters)
