"""``bigtable://project/instance/table`` — records in Cloud Bigtable (or its emulator).

One row per key, one binary cell per row holding the record's raw bytes (the layout dtype), in
column family ``column_family`` (default ``"e"``); store metadata, the writer-lease record and
a restore's generation live in reserved rows no data key can produce (:mod:`.wire`). The hot
paths send hand-encoded gRPC requests (the client library's per-row objects cost several times
the emulator's own work), sharded over ``inflight`` streams; every read carries a latest-cell
filter (the emulator never garbage-collects old versions). The backend owns three parts:
``conn`` (:class:`.connection.BigtableConnection`: channels, administration, retries, the
sharded runner), ``cas`` (:class:`.cas.CasWriter`: compare-and-set writes, timestamps, the
control rows) and ``restore`` (:class:`.restore.StagedRestore`: atomic replace and recovery).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import urlencode

import numpy as np

from ...errors import InvalidInputError, ReadOnlyError
from ...options import accepted_options, unknown_option_error
from ...urls import check_url_text
from .. import ranges as kr
from ..base import Backend, ModifyFn
from . import guard, wire
from .cas import CasWriter
from .connection import BigtableConnection
from .control import ControlRows
from .restore import StagedRestore

_FAMILY = re.compile(r"^[-_.a-zA-Z0-9]{1,64}$")


def _store_url(url: str, emulator_host: str | None
               ) -> tuple[str, str | None, tuple[str, str, str]]:
    """The store's URL and emulator: ``store.url`` must reopen the same table, so with the
    emulator's address in it a reopen in a process without BIGTABLE_EMULATOR_HOST does not go
    to Cloud Bigtable."""
    check_url_text(url)  # a newline would cut the table id short
    project, instance, table_id = wire.parse_url(url)
    host = (emulator_host or wire.url_emulator_host(url)
            or os.environ.get("BIGTABLE_EMULATOR_HOST") or None)
    url = f"bigtable://{project}/{instance}/{table_id}"
    if host:
        url += "?" + urlencode({"emulator_host": host}, safe=":")
    return url, host, (project, instance, table_id)


def _check_settings(column_family: Any, read_batch: Any, write_batch: Any, inflight: Any,
                    retry_deadline: Any, rpc_timeout: Any) -> None:
    if not _FAMILY.match(str(column_family)):
        raise InvalidInputError(f"invalid column family name {column_family!r}")
    for name, val in (("read_batch", read_batch), ("write_batch", write_batch),
                      ("inflight", inflight)):
        if int(val) <= 0:
            raise InvalidInputError(f"{name} must be positive, got {val!r}")
    if float(retry_deadline) <= 0 or float(rpc_timeout) <= 0:
        raise InvalidInputError("retry_deadline and rpc_timeout must be positive")


def _gathered(batches: Iterator[tuple[np.ndarray, np.ndarray]], target: int
              ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``batches`` joined into batches of at least ``target`` rows (the last: the rest); a
    key repeated across the joined batches keeps its last record."""
    keys_acc: list[np.ndarray] = []
    recs_acc: list[np.ndarray] = []
    size = 0
    for keys, recs in batches:
        keys_acc.append(keys)
        recs_acc.append(recs)
        size += len(keys)
        if size >= target:
            yield _joined(keys_acc, recs_acc)
            keys_acc, recs_acc, size = [], [], 0
    if keys_acc:
        yield _joined(keys_acc, recs_acc)


def _joined(keys_acc: list, recs_acc: list) -> tuple[np.ndarray, np.ndarray]:
    keys = np.concatenate(keys_acc)
    recs = np.concatenate(recs_acc)
    if len(keys_acc) > 1:  # a key repeated across batches: the last one wins
        _, last = np.unique(keys[::-1], return_index=True)
        sel = np.sort(len(keys) - 1 - last)
        keys, recs = keys[sel], recs[sel]
    return keys, recs


class BigtableBackend(Backend):
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
        url, self.emulator_host, (self.project, self.instance, self.table_id) = _store_url(
            url, emulator_host)
        _check_settings(column_family, read_batch, write_batch, inflight, retry_deadline,
                        rpc_timeout)
        if options:
            raise unknown_option_error("bigtable://", options, accepted_options(type(self)) or ())
        super().__init__(url, read_only=read_only)
        self.column_family = str(column_family)
        self.app_profile_id = app_profile_id
        self.rpc_timeout = float(rpc_timeout)
        self.read_batch, self.write_batch = int(read_batch), int(write_batch)
        self.inflight = int(inflight)
        self.check_and_set = bool(check_and_set)
        self.table_name = (f"projects/{self.project}/instances/{self.instance}"
                           f"/tables/{self.table_id}")
        self.counters = dict.fromkeys(
            ("remote_reads", "remote_writes", "rows_read", "rows_written", "retries",
             "tables_recreated"), 0)
        self.conn = BigtableConnection(
            self.url, self.table_name, self.counters, emulator_host=self.emulator_host,
            create=(self.emulator_host is not None) if create is None else bool(create),
            read_only=read_only, column_family=self.column_family, app_profile_id=app_profile_id,
            retry_deadline=float(retry_deadline), rpc_timeout=self.rpc_timeout,
            inflight=self.inflight, interceptors=interceptors, credentials=credentials)
        self.cas = CasWriter(self.conn, self.read_batch)
        self.restore = StagedRestore(self.conn, self.cas, self.write_batch, self.open_staging,
                                     self.write_meta)
        self.control = ControlRows(self.cas, self.restore.marker_fields, self.url)
        self.conn.on_recreated = self.control.put_back
        try:
            self.conn.ensure_table(initial=True)
            # A restore interrupted by a crash: finished or undone here (see .restore).
            if read_only:
                guard.refuse_pending(self.restore)
            else:
                guard.recover(self.restore)
        except BaseException:
            self.close()
            raise

    @property
    def retry_deadline(self) -> float:
        """Seconds an operation keeps retrying transient errors (settable)."""
        return self.conn.retry_deadline

    @retry_deadline.setter
    def retry_deadline(self, seconds: float) -> None:
        self.conn.retry_deadline = float(seconds)

    def _check_writable(self) -> None:
        if self.read_only:
            raise ReadOnlyError(f"{self.url} is open read-only")

    # -- reads ------------------------------------------------------------------------------------
    def _fetch(self, keys: np.ndarray, keys_only: bool) -> tuple[np.ndarray, list[bytes]]:
        """Read unique sorted ``keys``: return (index into keys of found rows, values)."""
        h = self.conn.heads
        got, vals = self.conn.read_keys(h.read, wire.row_keys(keys, self.key_type),
                                        h.keys_filter if keys_only else h.filter,
                                        self.read_batch)
        found_keys = wire.decode_keys(got, self.key_type)
        idx = np.searchsorted(keys, found_keys) if len(found_keys) else np.zeros(0, np.intp)
        return idx, vals

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = len(keys)
        if n == 0:
            return self._empty_records(0), np.zeros(0, dtype=bool)
        uniq, inv = np.unique(keys, return_inverse=True)
        idx, vals = self._fetch(uniq, keys_only=False)
        urecs = self._empty_records(len(uniq))
        ufound = np.zeros(len(uniq), dtype=bool)
        if len(idx):
            urecs[idx] = self.layout.from_bytes(b"".join(vals), len(vals))
            ufound[idx] = True
        return urecs[inv], ufound[inv]

    def contains(self, keys: np.ndarray) -> np.ndarray:
        if len(keys) == 0:
            return np.zeros(0, dtype=bool)
        uniq, inv = np.unique(keys, return_inverse=True)
        idx, _ = self._fetch(uniq, keys_only=True)
        ufound = np.zeros(len(uniq), dtype=bool)
        ufound[idx] = True
        return ufound[inv]

    # -- writes -----------------------------------------------------------------------------------
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
        rk = wire.row_keys(keys, self.key_type)
        values = np.ascontiguousarray(records).view(np.uint8).reshape(n, -1)
        ts = self.cas.next_ts()
        encode: Any = wire.mutate_rows_int if self.key_type == "int64" else (
            wire.mutate_rows_generic)
        head, fam, step = self.conn.heads.write, self.conn.heads.family_b, self.write_batch

        def build(start: int, sel: np.ndarray) -> bytes:
            ck, cv = rk[start:start + step], values[start:start + step]
            if isinstance(ck, list):
                return encode(head, fam, ts, [ck[i] for i in sel], cv[sel])
            if len(sel) == len(cv):  # first attempt: no copies
                return encode(head, fam, ts, ck, cv)
            return encode(head, fam, ts, ck[sel], cv[sel])

        self.conn.mutate_batches("write", n, step, build)

    def modify(self, keys: np.ndarray, fn: ModifyFn) -> np.ndarray:
        """Read-modify-write by compare-and-set per row, retried on conflict (see
        :mod:`.cas`); with ``check_and_set=False`` a plain read then batched write."""
        self._check_writable()
        if not self.check_and_set:
            return super().modify(keys, fn)
        return self.cas.modify(wire.row_key_list(keys, self.key_type), fn,
                               self._empty_records(len(keys)))

    def insert_rows(self, keys: np.ndarray, vectors: np.ndarray,
                    template: np.ndarray) -> np.ndarray | None:
        """Insert-if-absent per row (``CheckAndMutateRow``); blind batched writes with
        ``check_and_set=False``. Returns which keys were written (None: all)."""
        self._check_writable()
        if not self.check_and_set:
            return super().insert_rows(keys, vectors, template)
        records = np.repeat(template[:1], len(keys))
        records["vector"] = vectors
        return self.cas.insert(wire.row_key_list(keys, self.key_type), records)

    def delete(self, keys: np.ndarray) -> np.ndarray:
        self._check_writable()
        self._check_fence()
        present = self.contains(keys)
        rk, head = wire.row_key_list(keys[present], self.key_type), self.conn.heads.write
        self.conn.mutate_batches("delete", len(rk), self.write_batch, lambda start, sel:
                                 wire.delete_rows(head, [rk[start + i] for i in sel]))
        return present

    def bulk_load(self, batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> int:
        # Gather small batches so that every put keeps ``inflight`` requests busy.
        n = 0
        for keys, recs in _gathered(batches, self.write_batch * self.inflight * 4):
            self.put(keys, recs)
            n += len(keys)
        return n

    # -- scans ------------------------------------------------------------------------------------
    def _scan_rows(self, keys_only: bool, batch_size: int, start: bytes = wire.DATA_PREFIX,
                   end: bytes = wire.DATA_END, check: Callable[[], None] | None = None
                   ) -> Iterator[tuple[list, list]]:
        h = self.conn.heads
        return self.conn.scan(h.read, h.keys_filter if keys_only else h.filter, batch_size,
                              start, end, check)

    def raw_rows(self, keys_only: bool, batch_size: int) -> Iterator[tuple[list, list]]:
        """Pages of ``(row keys, cell values)`` of every data row, in key order, as stored."""
        return self._scan_rows(keys_only, batch_size)

    def scan(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every record, from one table: a scan that overlaps a restore by another process
        raises ``ConcurrentRestoreError`` (see :mod:`.restore`)."""
        return self.scan_range(kr.KeyRange(kr.KIND_BYTES), batch_size)

    def plan_ranges(self, n: int) -> list[kr.KeyRange]:
        """Row ranges cut at every ``size/n``-th byte offset of Bigtable's own row-key samples
        (``SampleRowKeys``: split points the server keeps, no rows read); a table with too
        few samples (a small one) is cut at every ``rows/n``-th row key of a keys-only read."""
        samples = self.conn.sample_row_keys()
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
                                      guard.restore_guard(self.restore)):
            recs = self.layout.from_bytes(b"".join(vs), len(vs)).copy()
            yield wire.decode_keys(ks, self.key_type), recs

    def __len__(self) -> int:
        # Bigtable keeps no row count: this streams every row key (values stripped), O(rows).
        return sum(len(ks) for ks, _ in self._scan_rows(True, 65536))

    def clear(self) -> None:
        from google.api_core import exceptions as gexc

        self._check_writable()
        self._check_fence()
        try:
            self.conn.drop_rows(wire.DATA_PREFIX)
        except gexc.GoogleAPICallError:  # e.g. no admin rights: delete row by row instead
            super().clear()

    # -- metadata and control rows (see .control) ---------------------------------------------
    def read_meta(self) -> dict | None:
        return self.control.read_meta()

    def write_meta(self, meta: dict) -> None:
        self._check_writable()
        self.control.write_meta(meta)

    def modify_meta(self, fn) -> dict:
        self._check_writable()
        return self.control.modify_meta(fn)

    def modify_leases(self, fn) -> dict:
        self._check_writable()
        return self.control.modify_leases(fn)

    def read_leases(self) -> Any:
        return self.control.read_leases()

    def _check_fence(self) -> None:
        self.control.check_fence(self.fence)

    # -- restores ---------------------------------------------------------------------------------
    replace_mechanism = "staging-table"

    def replace_rows(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict,
                     rows: int | None = None) -> int:
        """The new rows staged in ``<table>__restore``, committed by a marker in the metadata
        row, then copied over the live table; finished on the next writer open after a crash
        (see :mod:`.restore`)."""
        self._check_writable()
        return self.restore.replace(batches, meta)

    def open_staging(self, create: bool) -> BigtableBackend:
        """A backend on this table's staging table with this one's connection settings (and
        layout, once bound). Once open it never recreates a vanished staging table: a
        half-filled one must not pass for whole."""
        table = guard.staging_table_id(self.table_id)
        stage = type(self)(f"bigtable://{self.project}/{self.instance}/{table}", **{
            **self.reopen_options(), "create": create, "rpc_timeout": self.rpc_timeout,
            "read_batch": self.read_batch, "write_batch": self.write_batch,
            "inflight": self.inflight, "credentials": self.conn.credentials,
            "check_and_set": False})
        stage.conn.create = False
        if self.is_bound:
            stage.bind(self.layout, self.key_type)
        return stage

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

    def close(self) -> None:
        self.conn.close()
