"""Connections, table administration and the retry rules of the Bigtable backend.

:class:`BigtableConnection`, owned by :class:`~embstore.backends.bigtable.BigtableBackend`
(``backend.conn``), opens the gRPC channels, checks / creates / recreates the table through
the admin client, and sends every encoded request under one retry policy, ``inflight`` at a
time. What the rows hold (records, keys, control documents) is the backend's and its other
parts' business.

Failures: transient gRPC errors (UNAVAILABLE, DEADLINE_EXCEEDED, ABORTED, RESOURCE_EXHAUSTED,
streams reset mid-way) are retried with exponential backoff until ``retry_deadline`` seconds
after the operation started; then :class:`~embstore.errors.BackendError` names the operation
and the last gRPC error. Retrying is safe: writes set whole records with a timestamp fixed per
call, so a replay writes the same cell again.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from ...errors import BackendError, StoreNotFoundError
from ...log import event
from ..forks import ForkSafePool
from . import wire
from .stubs import data_stubs

# The backend's public logger name: retry / recovery / recreation events are documented (and
# filtered by users) under ``embstore.backends.bigtable``, wherever the code emitting them lives.
log = logging.getLogger("embstore.backends.bigtable")

try:
    import grpc
except ImportError as e:  # pragma: no cover - depends on the environment
    from ...errors import BackendUnavailableError
    from ...extras import install_hint

    raise BackendUnavailableError(
        "the bigtable:// backend needs google-cloud-bigtable; install it with: "
        + install_hint("bigtable")) from e

T = TypeVar("T")


def open_channels(url: str, emulator_host: str | None, credentials: Any,
                  interceptors: Sequence[Any]) -> tuple[Any, Any]:
    """The data channel and the admin channel (None: the admin client makes its own) to the
    emulator at ``emulator_host`` or to Cloud Bigtable; ``url`` names the store in errors."""
    # ReadRows and MutateRows are unary-stream calls, and the emulator answers ReadRows with
    # one message per row. gRPC's default iterator hands every message over from its
    # channel thread (a lock/condition round trip, ~40 us of Python per message); the
    # single-threaded iterator drives the completion queue from the reading thread itself:
    # ~3x less client CPU per row read (measured: 465 random rows 29 ms -> 10 ms).
    single = (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)
    if emulator_host:
        # Reconnect quickly after an emulator restart (gRPC's default backoff reaches 120 s).
        opts = [("grpc.initial_reconnect_backoff_ms", 50),
                ("grpc.min_reconnect_backoff_ms", 50),
                ("grpc.max_reconnect_backoff_ms", 500),
                ("grpc.max_receive_message_length", 256 << 20),
                ("grpc.max_send_message_length", 256 << 20)]
        data = grpc.insecure_channel(emulator_host, options=opts + [single])
        admin = grpc.insecure_channel(emulator_host, options=opts)
    else:
        import google.auth.exceptions
        from google.api_core import grpc_helpers

        scopes = ("https://www.googleapis.com/auth/bigtable.data",
                  "https://www.googleapis.com/auth/cloud-platform")
        opts = [("grpc.max_receive_message_length", 256 << 20),
                ("grpc.max_send_message_length", 256 << 20)]
        try:
            data = grpc_helpers.create_channel("bigtable.googleapis.com:443",
                                               credentials=credentials, scopes=scopes,
                                               options=opts + [single])
        except google.auth.exceptions.GoogleAuthError as e:
            raise BackendError(
                f"{url}: no Google Cloud credentials for Bigtable ({e}); configure "
                "Application Default Credentials, pass credentials=, or set "
                "BIGTABLE_EMULATOR_HOST / emulator_host= to use the emulator") from e
        admin = None  # the admin client builds its own authenticated channel
    if interceptors:
        data = grpc.intercept_channel(data, *interceptors)
    return data, admin


class BigtableConnection:
    """One table's channels, administration, retries and the sharded runner of its requests.

    Owned by ``BigtableBackend`` (``backend.conn``). It knows requests and row pages, not
    records: reads, writes and scans go through :meth:`read`, :meth:`mutate` and :meth:`scan`
    under one retry policy; ``on_recreated`` (set by the owner) puts the control rows back when
    a vanished table was recreated.

    Parameters
    ----------
    url : str
        The store's URL, for messages.
    table_name : str
        ``projects/<p>/instances/<i>/tables/<t>``.
    counters : dict
        The owner's counters (``remote_reads``, ``retries``, ...), incremented here.
    settings
        As the backend's options of the same names.

    Attributes
    ----------
    heads : wire.Heads
        The fixed parts of this table's requests, for every part of the backend.
    """

    def __init__(self, url: str, table_name: str, counters: dict[str, int], *,
                 emulator_host: str | None, create: bool, read_only: bool, column_family: str,
                 app_profile_id: str | None,
                 retry_deadline: float, rpc_timeout: float, inflight: int,
                 interceptors: Sequence[Any] = (), credentials: Any = None) -> None:
        self.url, self.table_name, self.counters = url, table_name, counters
        _, self.project, _, self.instance, _, self.table_id = table_name.split("/")
        self.emulator_host, self.create, self.read_only = emulator_host, create, read_only
        self.column_family = column_family
        self.heads = wire.heads(table_name, app_profile_id, column_family)
        self.retry_deadline, self.rpc_timeout = retry_deadline, rpc_timeout
        self.inflight = inflight
        self.credentials = credentials
        self.on_recreated: Callable[[], None] = lambda: None
        self._admin: Any = None
        self._closed = False
        self._table_lock = threading.RLock()
        self._channel, self._admin_channel = open_channels(url, emulator_host, credentials,
                                                          interceptors)
        self.stubs = data_stubs(self._channel)
        # The calling thread is one of the ``inflight`` senders (see run_sharded).
        self._pool = ForkSafePool(max(self.inflight - 1, 1), "embstore-bigtable")

    def deadline(self) -> float:
        """When an operation starting now stops retrying."""
        return time.monotonic() + self.retry_deadline

    # -- connections ------------------------------------------------------------------------------
    def admin_client(self) -> Any:
        """The table admin client (made on first use)."""
        if self._admin is None:
            from google.cloud.bigtable_admin_v2 import BigtableTableAdminClient
            from google.cloud.bigtable_admin_v2.services.bigtable_table_admin.transports import (
                BigtableTableAdminGrpcTransport,
            )

            if self._admin_channel is not None:
                self._admin = BigtableTableAdminClient(
                    transport=BigtableTableAdminGrpcTransport(channel=self._admin_channel))
            else:
                self._admin = BigtableTableAdminClient(credentials=self.credentials)
        return self._admin

    def ensure_table(self, initial: bool = False, deadline: float | None = None) -> None:
        """Check the table (and family) exist; create them when allowed. Transient failures
        are retried until ``deadline`` (default: ``retry_deadline`` from now)."""
        from google.api_core import exceptions as gexc

        if deadline is None:
            deadline = time.monotonic() + self.retry_deadline
        # One thread at a time: several in-flight requests see a vanished table together.
        with self._table_lock:
            try:
                self._ensure_table_locked(initial, gexc, deadline)
            except (gexc.GoogleAPICallError, gexc.RetryError) as e:
                raise BackendError(
                    f"{self.url}: Bigtable table administration failed: {e}") from e

    def admin_call(self, fn: Callable[..., T], deadline: float, **kwargs: Any) -> T:
        """One admin RPC under this backend's retry rules (transient errors retried until
        ``deadline``, then ``BackendError``). The client library's own retry is off: it keeps
        going for 60 s whatever ``retry_deadline`` says, and raises a ``RetryError`` that is
        not a ``GoogleAPICallError``."""
        from google.api_core import exceptions as gexc

        transient = (gexc.ServiceUnavailable, gexc.DeadlineExceeded, gexc.Aborted,
                     gexc.ResourceExhausted, gexc.RetryError)
        delay = 0.05
        while True:
            remaining = deadline - time.monotonic()
            try:
                return fn(**kwargs, retry=None,
                          timeout=max(min(self.rpc_timeout, remaining), 0.001))
            except transient as e:
                last = e
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BackendError(
                    f"{self.url}: Bigtable table administration gave up after "
                    f"{self.retry_deadline:g} s of retries; last error: {last}") from last
            self.counters["retries"] += 1
            event(log, logging.WARNING if delay == 0.05 else logging.DEBUG, "bigtable.retry",
                  "%s: Bigtable table administration failed (%s); retrying, %.1f s left",
                  self.url, last, remaining, op="admin")
            time.sleep(min(delay * (0.5 + random.random()), remaining))
            delay = min(delay * 2, 1.0)

    def _ensure_table_locked(self, initial: bool, gexc: Any, deadline: float) -> None:
        admin = self.admin_client()
        parent = f"projects/{self.project}/instances/{self.instance}"
        gc = {"gc_rule": {"max_num_versions": 1}}
        try:
            table = self.admin_call(admin.get_table, deadline, name=self.table_name)
        except gexc.NotFound:
            if not self.create or self.read_only:
                raise StoreNotFoundError(
                    f"{self.url}: Bigtable table {self.table_name} does not exist "
                    "(pass create=True to create it)") from None
            try:
                self.admin_call(admin.create_table, deadline, parent=parent,
                                 table_id=self.table_id,
                                 table={"column_families": {self.column_family: gc}})
            except gexc.AlreadyExists:  # another process won the race
                pass
            if not initial:
                self.counters["tables_recreated"] += 1
                event(log, logging.WARNING, "bigtable.table_recreated",
                      "%s: table vanished (emulator restart?); recreated it", self.url)
                self.on_recreated()
            return
        if self.column_family not in table.column_families:
            if not self.create or self.read_only:
                raise StoreNotFoundError(
                    f"{self.url}: table has no column family {self.column_family!r}")
            self.admin_call(admin.modify_column_families, deadline, name=self.table_name,
                             modifications=[{"id": self.column_family, "create": gc}])

    # -- requests ---------------------------------------------------------------------------------
    def read(self, req: bytes, op: str, deadline: float) -> tuple[list, list]:
        """Send one encoded ReadRows request (retried): ``(row keys, cell values)``."""
        def attempt(timeout: float):
            self.counters["remote_reads"] += 1
            return wire.parse_rows(self.stubs.read_rows(req, timeout=timeout),
                                   self.column_family)

        return self.retry(op, attempt, deadline)

    def mutate(self, op: str, build: Callable[[np.ndarray], bytes], n: int,
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
            for resp in self.stubs.mutate_rows(build(pending), timeout=timeout):
                for e in resp.entries:
                    if e.status.code != 0:
                        failed.append(e.index)
                        bad_status = e.status
                        transient &= e.status.code in wire.TRANSIENT_CODES
            if failed:
                pending = pending[np.asarray(sorted(failed))]
                raise wire.PartialWrite(pending, bad_status, transient)
            self.counters["rows_written"] += len(pending)

        self.retry(op, attempt, deadline)

    def read_keys(self, head: bytes, row_keys: np.ndarray | list[bytes], filt: bytes,
                  batch: int) -> tuple[list[bytes], list[bytes]]:
        """Rows ``row_keys`` (sorted), ``batch`` per request, ``inflight`` requests at a time:
        ``(row keys found, their values)``."""
        chunks = [row_keys[i:i + batch] for i in range(0, len(row_keys), batch)]
        results = self.run_sharded("read", chunks, lambda c, dl: self.read(
            wire.read_rows_keys(head, c, filt), "read", dl))
        found = [k for ks, _ in results for k in ks]
        self.counters["rows_read"] += len(found)
        return found, [v for _, vs in results for v in vs]

    def mutate_batches(self, op: str, n: int, step: int,
                       build: Callable[[int, np.ndarray], bytes]) -> None:
        """MutateRows for rows ``0..n-1``, ``step`` per request, ``inflight`` requests at a
        time; ``build(start, sel)`` encodes rows ``start + sel`` (``sel``: indices in the
        request, all of them but on a retry of the entries that failed)."""
        def send(start: int, deadline: float) -> None:
            self.mutate(op, lambda sel: build(start, sel), min(step, n - start), deadline)

        if n:
            self.run_sharded(op, list(range(0, n, step)), send)

    def scan(self, head: bytes, filt: bytes, batch_size: int, start: bytes, end: bytes,
             check: Callable[[], None] | None = None) -> Iterator[tuple[list, list]]:
        """Stream the rows in ``[start, end)`` in key order, resuming after the last row on
        errors; ``check()`` runs after every read request, before its rows are handed out."""
        start_open = False
        page = max(batch_size, 1) * 16
        while True:
            req = wire.read_rows_range(head, start, start_open, end, filt, limit=page)
            self.check_open()
            ks, vs = self.read(req, "scan", self.deadline())
            if check is not None:
                check()
            self.counters["rows_read"] += len(ks)
            for i in range(0, len(ks), batch_size):
                yield ks[i:i + batch_size], vs[i:i + batch_size]
            if len(ks) < page:
                return
            start, start_open = ks[-1], True

    def sample_row_keys(self) -> list[tuple[bytes, int]]:
        """Bigtable's ``(row key, byte offset)`` samples of the table (no rows read)."""
        return self.retry("sample", lambda timeout: [
            (bytes(r.row_key), int(r.offset_bytes))
            for r in self.stubs.sample_row_keys(self.heads.sample, timeout=timeout)],
            self.deadline())

    def drop_rows(self, prefix: bytes) -> None:
        """Drop every row starting with ``prefix`` (an admin call: needs admin rights)."""
        self.admin_call(self.admin_client().drop_row_range, self.deadline(),
                        request={"name": self.table_name, "row_key_prefix": prefix})

    # -- retry machinery --------------------------------------------------------------------------
    def retry(self, op: str, attempt: Callable[[float], T], deadline: float) -> T:
        """Run ``attempt(timeout)`` until it succeeds, a permanent error, or the deadline."""
        delay = 0.01
        recreated = False
        tries = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                out = attempt(max(min(self.rpc_timeout, remaining), 0.001))
                if tries:
                    event(log, logging.INFO, "bigtable.recovered",
                          "%s: Bigtable %s recovered after %d retries", self.url, op, tries,
                          op=op, retries=tries)
                return out
            except grpc.RpcError as e:
                last: BaseException = e
                if (hasattr(e, "code") and e.code() == grpc.StatusCode.NOT_FOUND
                        and self.create and not recreated and not self.read_only):
                    # The table vanished (emulator restarted): recreate it once, then retry.
                    try:
                        self.ensure_table(deadline=deadline)
                        recreated = True
                        continue
                    except BackendError as e2:  # admin not reachable yet: back off, try again
                        last = e2
                elif not wire.is_transient(e):
                    raise BackendError(
                        f"{self.url}: Bigtable {op} failed: {wire.describe(e)}") from e
            except wire.PartialWrite as e:
                last = e
                if not e.transient:
                    raise BackendError(f"{self.url}: Bigtable {op} failed for {len(e.failed)} "
                                       f"rows: {e}") from e
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                event(log, logging.ERROR, "bigtable.gave_up",
                      "%s: Bigtable %s gave up after %d retries: %s", self.url, op, tries,
                      wire.describe(last), op=op, retries=tries)
                raise BackendError(
                    f"{self.url}: Bigtable {op} gave up after {self.retry_deadline:g} s of "
                    f"retries; last error: {wire.describe(last)}") from last
            self.counters["retries"] += 1
            tries += 1
            event(log, logging.WARNING if tries == 1 else logging.DEBUG, "bigtable.retry",
                  "%s: Bigtable %s failed (%s); retry %d, %.1f s left", self.url, op,
                  wire.describe(last), tries, remaining, op=op, retry=tries)
            time.sleep(min(delay * (0.5 + random.random()), remaining))
            delay = min(delay * 2, 1.0)

    def run_sharded(self, op: str, items: list, fn: Callable[[Any, float], T]) -> list[T]:
        """Run ``fn(item, deadline)`` for every item, ``inflight`` at a time, in order."""
        self.check_open()
        deadline = time.monotonic() + self.retry_deadline
        if len(items) == 1 or self.inflight == 1:
            return [fn(it, deadline) for it in items]
        # The calling thread runs the first item itself: one thread hand-off less per call,
        # and it has nothing else to do while it waits.
        futures = [self._pool.submit(fn, it, deadline) for it in items[1:]]
        out, first_err = [], None
        try:
            out.append(fn(items[0], deadline))
        except BaseException as e:  # noqa: BLE001 - re-raised below after all finish
            first_err = e
        for f in futures:
            try:
                out.append(f.result())
            except BaseException as e:  # noqa: BLE001 - re-raised below after all finish
                first_err = first_err or e
        if first_err is not None:
            raise first_err
        return out

    def check_open(self) -> None:
        if self._closed:
            raise BackendError(f"{self.url}: backend is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        for ch in (self._channel, self._admin_channel):
            if ch is not None:
                ch.close()
        if self._admin is not None and self._admin_channel is None:
            self._admin.transport.close()
