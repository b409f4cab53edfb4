"""A DynamicEmbedding Worker (DEW): one store shard behind an Arrow Flight server.

The worker is the ordinary engine (optimizer, admission, expiry, sampling, top-k, any backend,
a cache over a remote) opened with :func:`embstore.open`; clients reach it through
``des://`` (:mod:`embstore.service.client`). Calls on the store are serialized, so per key the
owner applies updates in arrival order and none is lost. A worker started with
``--shard I/N`` refuses keys another shard owns and clients that count another N.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from .._keys import key_hash64
from ..errors import (
    AuthenticationError,
    BackendError,
    EmbstoreError,
    InvalidInputError,
    ShardMismatchError,
)
from ..sampling.candidate import sampling_index
from . import wire
from .auth import READ_OPS, TokenAuth
from .changelog import ChangeLog
from .delta import delta_parts, message_slices
from .delta_slot import into_slot
from .metrics import RequestMetrics, gauges
from .push import check_interval, push_changes
from .shm import host_id
from .shm_serve import ShmSession
from .streams import STREAM_OPS

log = logging.getLogger("embstore.service")

_WRITES = frozenset({"update", "assign", "delete"})
#: distinct headers a kept stream remembers as checked (a client sends a handful)
_CHECKED_HEADERS = 64
_OPS = READ_OPS | _WRITES | {"flush"}


def _peek_header(raw: bytes) -> dict[str, Any]:
    """A request's header, or ``{}`` when it is not a JSON object (refused later)."""
    try:
        head = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return {}
    return head if isinstance(head, dict) else {}


def _peek_op(raw: bytes) -> str:
    """The op a request names, for its metrics (``"other"`` when it names none)."""
    op = _peek_header(raw).get("op")
    return op if isinstance(op, str) and op in _OPS else "other"


class Worker(flight.FlightServerBase):
    """Serve ``store`` (an open :class:`~embstore.EmbeddingStore`) as shard ``shard`` of
    ``shards``."""

    def __init__(self, location: str, store: Any, *, shard: int = 0, shards: int = 1,
                 tokens: dict[str, str] | None = None,
                 tls: tuple[bytes, bytes] | None = None, read_only: bool = False,
                 log_keys: int = 4_000_000, shm: bool = True) -> None:
        super().__init__(location, middleware={"auth": TokenAuth(tokens)},
                         tls_certificates=[tls] if tls else None)
        self.store = store
        self.shard, self.shards = int(shard), int(shards)
        #: refuse every write whatever the token (a follower's replica)
        self.read_only = bool(read_only)
        #: offer same-host clients shared-memory payloads (``service/shm.py``; ``--no-shm``)
        self.shm = bool(shm)
        #: keys written since a sequence number, for followers (O(changed keys))
        self.log = ChangeLog(log_keys, version=lambda: store.version)
        store.add_observer(self.log)
        #: set on a replica: its follower's counters join ``stats``
        self.follower: Any = None
        #: counts and latencies per operation (``--metrics``)
        self.metrics = RequestMetrics()
        #: approximate top-k (``--ann``): an AnnIndex over the store, or None
        self.ann: Any = None
        #: held around every call on the store (per key, arrival order; no lost update)
        self.lock = threading.Lock()
        self.requests = 0
        #: set once a stop began: calls are refused from then on (the store is being closed)
        self.stopping = False

    def flush(self) -> None:
        """Flush the store between calls (a timer's flush; errors are logged)."""
        try:
            with self.lock:
                self.store.flush()
        except Exception:  # noqa: BLE001 - the next flush, or shutdown's, tries again
            log.exception("periodic flush failed")

    @contextmanager
    def held(self) -> Iterator[None]:
        """The store lock, refused once a stop began (the store is being closed)."""
        with self.lock:
            if self.stopping:
                raise BackendError("this worker is stopping: it takes no more calls")
            yield

    # -- checks ------------------------------------------------------------------------------
    def _check(self, context: Any, header: dict[str, Any]) -> None:
        role = context.get_middleware("auth").role
        if self.read_only:
            role = "serve"
        op = header["op"]
        # a lookup inserts unless told not to (as _exchange reads it): a write
        inserts = op == "lookup" and header.get("insert", True)
        if role != "train" and (op not in READ_OPS or inserts):
            raise AuthenticationError(f"a {role!r} token may not call {op!r}")
        if header.get("shards") != self.shards or header.get("shard") != self.shard:
            raise ShardMismatchError(
                f"this worker is shard {self.shard}/{self.shards}; the client asked for shard "
                f"{header.get('shard')}/{header.get('shards')} (same address list everywhere)")

    def _own(self, keys: np.ndarray) -> np.ndarray:
        if self.shards > 1 and len(keys):
            owner = key_hash64(keys) % np.uint64(self.shards)
            if (owner != np.uint64(self.shard)).any():
                raise ShardMismatchError(
                    f"{int(np.count_nonzero(owner != self.shard))} keys belong to other "
                    f"shards than {self.shard}/{self.shards}")
        return keys

    @contextmanager
    def _counted(self) -> Iterator[None]:
        """:meth:`held` for one request, counted (a kept stream's store call)."""
        with self.held():
            self.requests += 1
            yield

    def _guard(self, fn: Callable[[], Any], op: str, locked: bool | None = True) -> Any:
        """Run ``fn`` under the store lock (``locked=False``: ``fn`` takes it itself where it
        needs it; None: and counts the request, :meth:`_counted`); every error leaves as one
        typed line."""
        t0 = time.perf_counter()
        failed = True
        try:
            if locked is not None:
                with self.lock:
                    if self.stopping:
                        raise BackendError("this worker is stopping: it takes no more calls")
                    self.requests += 1
                    out = fn() if locked else None
            if not locked:
                out = fn()
            failed = False
            return out
        except flight.FlightError:
            raise
        except EmbstoreError as e:
            raise flight.FlightServerError(wire.remote_error(e)) from None
        except (ValueError, TypeError, KeyError, pa.ArrowException) as e:
            raise flight.FlightServerError(
                wire.remote_error(InvalidInputError(f"bad request: {e}"))) from None
        except Exception as e:  # noqa: BLE001 - the caller gets a line, the log the trace
            log.exception("request failed")
            raise flight.FlightServerError(wire.remote_error(e)) from None
        finally:
            self.metrics.observe(op if op in _OPS else "other", time.perf_counter() - t0,
                                 failed)

    # -- operations endpoint -----------------------------------------------------------------
    def metrics_text(self) -> list[str]:
        """Prometheus lines: requests, the store's counters, the change log, a follower's lag."""
        lines = self.metrics.text()
        lines.append(f'embstore_shard_info{{index="{self.shard}",count="{self.shards}"}} 1')
        if self.lock.acquire(timeout=5):
            try:
                lines += gauges(self.store.stats())
            except Exception:  # noqa: BLE001 - an unreachable remote: no store gauges
                lines.append("embstore_store_up 0")
            finally:
                self.lock.release()
        lines += gauges(self.log.stats(), "embstore_")
        if self.follower is not None:
            lines += gauges(self.follower.stats(), "embstore_")
        return lines

    def ready(self) -> tuple[bool, str]:
        """Whether this worker should get traffic: the store answers within 5 s and, on a
        replica, the follower polled recently."""
        if not self.lock.acquire(timeout=5):
            return False, "busy: a call has held the store for over 5 s"
        try:
            self.store.stats()
        except Exception as e:  # noqa: BLE001 - reported to the probe
            return False, f"store unavailable: {wire.remote_error(e)}"
        finally:
            self.lock.release()
        if self.follower is not None:
            lag = self.follower.lag()
            if lag is None or lag > 30:
                return False, f"follower behind: last heard from its workers {lag} s ago"
        return True, "ready"

    # -- small questions ---------------------------------------------------------------------
    def do_action(self, context: Any, action: Any) -> Iterator[bytes]:
        def run() -> Any:
            header = {**wire.parse_body(action.body.to_pybytes() or b"{}"), "op": action.type}
            self._check(context, header)
            return self._action(header)

        yield json.dumps(self._guard(run, action.type)).encode()

    def _action(self, h: dict[str, Any]) -> Any:
        s = self.store
        op = h["op"]
        if op == "info":
            return {"meta": s.meta, "shard": self.shard, "shards": self.shards, "shm": self.shm,
                    "read_only": s.read_only, "step": s.step, "version": s.version}
        if op == "len":
            return len(s)
        if op == "flush":
            s.flush()
            return {"version": s.version}
        if op == "stats":
            st = {**s.stats(), **self.log.stats(),
                  **(self.follower.stats() if self.follower else {}),
                  **(self.ann.stats() if self.ann else {})}
            return {k: v for k, v in st.items()
                    if isinstance(v, (int, float, str, bool, type(None)))}
        if op == "sample_weight":
            snap = sampling_index(s).snapshot(wire.sampler_from(h.get("sampler")))
            return {"total": float(snap.total), "support": int(snap.support - snap.dead_support)}
        raise InvalidInputError(f"unknown action {op!r}")

    # -- batches -----------------------------------------------------------------------------
    def do_exchange(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        head = _peek_header(descriptor.command)
        if head.get("op") == "stream":
            self._serve_stream(context, head, reader, writer)
            return
        if head.get("op") == "subscribe":
            self._subscribe(context, descriptor.command, reader, writer)
            return
        if head.get("op") == "shm":     # same-host payloads (service/shm_serve.py)
            route = {k: head.get(k) for k in ("shard", "shards")}
            ShmSession(lambda h: self._check(context, {**h, **route}),
                       lambda fn, op: self._guard(fn, op, locked=None),
                       lambda h, k, r, c: self._rows_apply(h, self._own(k), r, c, self._counted),
                       self.store.dim, self.store.key_type == "int64",
                       self.shm).serve(reader, writer, lambda: self.stopping)
            return

        def run() -> pa.RecordBatch | pa.Table:
            header = wire.parse_header(descriptor.command)
            self._check(context, header)
            # read before the store lock: a slow sender holds up no other caller; and read
            # whole before answering, or a caller still writing finds the call over
            t = wire.read_request(reader)
            if header["op"] == "changes":  # takes the lock per chunk (service/delta.py)
                return self._changes(header)
            if header["op"] in STREAM_OPS:
                return self._exchange(header, t, self._counted)
            with self._counted():
                return self._exchange(header, t)

        op = _peek_op(descriptor.command)
        out = self._guard(run, op, locked=False if op == "changes" else None)
        writer.begin(out.schema)
        # a follower's delta can hold a whole table: messages of at most 16 MB each, under
        # gRPC's message limit whatever the delta's size
        for batch in (out.to_batches() if isinstance(out, pa.Table) else [out]):
            for part in message_slices(batch):
                writer.write_batch(part)

    def _serve_stream(self, context: Any, head: dict[str, Any], reader: Any,
                      writer: Any) -> None:
        """A client's kept stream (``embstore.service.streams``): each message is one request
        (its header in the message's metadata; shard and N from the stream's), answered with
        one batch, or with a metadata-only error line that leaves the stream open."""
        route = {k: head.get(k) for k in ("shard", "shards")}
        # a stream's headers repeat call after call ({"op": "lookup", "insert": true}) and
        # its caller's role and shard are the stream's: each distinct header is parsed and
        # checked once, a header that failed is checked again each time it comes
        checked: dict[bytes, dict[str, Any]] = {}
        started = False
        while not self.stopping:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                return
            raw = chunk.app_metadata.to_pybytes() if chunk.app_metadata is not None else b"{}"
            known = checked.get(raw)
            if known is None:
                head = _peek_header(raw)  # parsed once: its op names the metrics, run checks
                op = head.get("op")
                op = op if isinstance(op, str) and op in _OPS else "other"
            else:
                head, op = known, known["op"]

            def run(raw: bytes = raw, head: dict[str, Any] = head, known: Any = known,
                    data: Any = chunk.data) -> pa.RecordBatch:
                h = known
                if h is None:
                    h = {**(head if isinstance(head.get("op"), str)
                            else wire.parse_header(raw)), **route}
                if h["op"] not in STREAM_OPS or data is None:
                    raise InvalidInputError(f"{h['op']!r} is not a request a stream carries")
                if known is None:
                    self._check(context, h)
                    if len(checked) < _CHECKED_HEADERS:
                        checked[raw] = h
                return self._exchange(h, wire.request_table(data), self._counted)

            try:
                out = self._guard(run, op, locked=None)
            except flight.FlightServerError as e:
                writer.write_metadata(pa.py_buffer(str(e).encode()))
                continue
            if not started:
                writer.begin(out.schema)
                started = True
            writer.write_batch(out)

    def _keys(self, table: pa.Table) -> np.ndarray:
        return self._own(wire.keys_from(table.column("key"), self.store.key_type))

    @staticmethod
    def _counts(t: pa.Table) -> np.ndarray | None:
        if "count" not in t.schema.names:  # cheaper than t.column_names
            return None
        col = t.column("count")
        if col.type != pa.int64() or col.null_count:
            raise InvalidInputError(f"counts must be int64, got {col.type}")
        return np.asarray(col.to_numpy(), np.int64)

    def _exchange(self, h: dict[str, Any], t: pa.Table | pa.RecordBatch,
                  hold: Callable[[], AbstractContextManager[Any]] = nullcontext
                  ) -> pa.RecordBatch:
        """Answer a request; ``hold()`` holds the store lock (the default: the caller holds
        it already)."""
        s = self.store
        op = h["op"]
        if op in STREAM_OPS:
            return self._rows_call(h, t, hold)
        if op in _WRITES:
            # a worker that cannot hold its shard's writer lease (a cache over a shared
            # table) acknowledges no write: LeaseLostError after a takeover, BackendError
            # when cut from the table past half a lease
            s.backend.hold_writer_lease()
        if op == "delete":
            return wire.batch(deleted=pa.array([s.delete(self._keys(t))], pa.int64()))
        if op == "top_k":
            return self._top_k(h, t)
        if op == "sample_draw":
            return self._draw(h)
        if op == "sample_prob":
            idx = sampling_index(s)
            snap = idx.snapshot(wire.sampler_from(h.get("sampler")))
            w = idx.prob_of(snap, self._keys(t)) * snap.total
            return wire.batch(weight=pa.array(w, pa.float64()))
        raise InvalidInputError(f"unknown operation {op!r}")

    def _rows_call(self, h: dict[str, Any], t: pa.Table | pa.RecordBatch,
                   hold: Callable[[], AbstractContextManager[Any]]) -> pa.RecordBatch:
        """lookup, contains, update, assign: the request's columns are read and checked
        before ``hold()`` and the answer is built after it, so on kept streams only the
        store call holds the store lock and the rest of several streams' calls overlap."""
        s, op = self.store, h["op"]
        keys = self._keys(t)
        rows = (wire.vectors_from(t.column("vec"), s.dim, len(keys))
                if op in ("update", "assign") else None)
        counts = self._counts(t) if op in ("lookup", "update") else None
        out = self._rows_apply(h, keys, rows, counts, hold)
        if op == "lookup":
            return wire.batch(vec=wire.vectors_column(out))
        if op == "contains":
            return wire.batch(found=pa.array(out))
        return wire.batch(step=pa.array(out))

    def _rows_apply(self, h: dict[str, Any], keys: np.ndarray, rows: Any, counts: Any,
                    hold: Callable[[], AbstractContextManager[Any]]) -> np.ndarray:
        """The store call of :meth:`_rows_call` (checked arrays), under ``hold()``."""
        s, op, insert = self.store, h["op"], bool(h.get("insert", True))
        with hold():
            if op in _WRITES or (op == "lookup" and insert):
                s.backend.hold_writer_lease()   # see _exchange
            if op == "lookup":
                out = s.lookup(keys, insert=insert, counts=counts)
            elif op == "contains":
                out = s.contains(keys)
            else:
                if op == "assign":
                    s.assign(keys, rows)
                else:
                    s.update(keys, rows, counts=counts)
                out = np.array([s.step], np.int64)
        return out

    def _top_k(self, h: dict[str, Any], t: pa.Table) -> pa.RecordBatch:
        s = self.store
        k = h.get("k")
        if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= wire.MAX_TOP_K:
            raise InvalidInputError(f"k must be an int in 1..{wire.MAX_TOP_K}, got {k!r}")
        # a writable copy: an ANN library refuses a read-only view of Arrow memory
        q = np.array(wire.vectors_from(t.column("q"), s.dim, t.num_rows))
        ex = None
        if "ex" in t.column_names:
            col = t.column("ex").combine_chunks()
            flat = wire.keys_from(col.flatten(), s.key_type)
            offs = col.offsets.to_numpy()
            ex = [flat[offs[i]:offs[i + 1]] for i in range(len(q))]
        if h.get("approximate") and self.ann is None:
            raise InvalidInputError("this worker has no ANN index (start it with --ann)")
        if len(q) == 0 or len(s) == 0:
            width = 0
            keys = np.zeros((len(q), 0), np.int64 if s.key_type == "int64" else object)
            scores, valid = np.zeros((len(q), 0), np.float32), np.zeros((len(q), 0), bool)
        else:
            res = self.ann.top_k(q, k, ex) if h.get("approximate") else s.top_k(q, k, ex)
            keys, scores = res
            valid = np.asarray(res.valid)
            width = keys.shape[1]
        return wire.batch(key=wire.keys_column(keys.reshape(-1)),
                          score=pa.array(scores.reshape(-1).astype(np.float32)),
                          valid=pa.array(valid.reshape(-1)),
                          width=pa.array(np.full(len(q) * width, width, np.int64)))

    def _draw(self, h: dict[str, Any]) -> pa.RecordBatch:
        s = self.store
        count, seed = h.get("count"), h.get("seed")
        if (isinstance(count, bool) or not isinstance(count, int)
                or not 0 <= count <= wire.MAX_DRAWS):
            raise InvalidInputError(f"count must be an int in 0..{wire.MAX_DRAWS}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InvalidInputError("seed must be a non-negative int")
        idx = sampling_index(s)
        snap = idx.snapshot(wire.sampler_from(h.get("sampler")))
        if count == 0 or snap.total <= 0:
            keys, w = s.normalize_keys([]), np.zeros(0, np.float64)
        else:
            keys, _, p = idx.draw(snap, np.random.default_rng(seed), count)
            w = p * snap.total
        return wire.batch(key=wire.keys_column(keys), weight=pa.array(w, pa.float64()))

    def _records_batch(self, keys: np.ndarray, recs: np.ndarray,
                       found: np.ndarray | None = None) -> pa.RecordBatch:
        cols = {"key": wire.keys_column(keys), "rec": pa.Array.from_buffers(
            pa.binary(self.store.layout.itemsize), len(keys),
            [None, pa.py_buffer(np.ascontiguousarray(recs).view(np.uint8))])}
        if found is not None:
            cols["found"] = pa.array(found)
        return wire.batch(**cols)

    def _delta(self, since: Any, log_id: Any = None) -> tuple[int, list[pa.RecordBatch] | None]:
        """``(seq, batches)``: the records of the keys changed after ``since`` as one state,
        a batch per chunk read (``delta.delta_parts``); None when the log no longer holds
        ``since`` or is not ``log_id`` (this worker restarted)."""
        if isinstance(since, bool) or not isinstance(since, int):
            raise InvalidInputError("since must be an int")
        if log_id is not None and log_id != self.log.id:
            return self.log.seq, None
        seq, rows = delta_parts(self.store, self.log, self.held, since)
        return seq, None if rows is None else [self._records_batch(*r) for r in rows]

    def _changes(self, h: dict[str, Any]) -> pa.Table:
        """A follower's poll: the delta after ``since`` and its ``seq`` (or ``resync``)."""
        seq, batches = self._delta(h.get("since"), h.get("log"))
        meta = {"seq": str(seq), "resync": "0", "log": self.log.id}
        if batches is None:
            empty = self.store.layout.empty(0)
            batches = [self._records_batch(self.store.normalize_keys([]), empty, np.zeros(0, bool))]
            meta["resync"] = "1"
        return pa.Table.from_batches(batches).replace_schema_metadata(meta)

    def _subscribe(self, context: Any, raw: bytes, reader: Any, writer: Any) -> None:
        """A follower's subscription (``embstore.service.push``): the stream stays open and
        carries each delta as the change log grows, until the follower or this worker goes."""
        def check() -> tuple[int, float, bool]:
            h = wire.parse_header(raw)
            self._check(context, h)
            since, interval = h.get("since"), check_interval(h.get("interval", 0.1))
            if isinstance(since, bool) or not isinstance(since, int):
                raise InvalidInputError("since must be an int")
            # a log of another worker (restarted since), or a position it never reached:
            # whatever since is, a snapshot
            known = h.get("log") in (None, self.log.id) and since <= self.log.seq
            # deltas through shared memory to a follower on this host (service/shm.py)
            return (since if known else -1), interval, self.shm and h.get("host") == host_id()

        since, interval, shm = self._guard(check, "subscribe")
        into = into_slot(self.store, self.log, self.held,   # service/delta_slot.py
                         lambda fn: self._guard(fn, "subscribe", locked=False))
        push_changes(self.log, lambda n: self._guard(lambda: self._delta(n), "subscribe",
                                                      locked=False),
                     reader, writer, since, interval, lambda: self.stopping, shm, into)

    # -- export ------------------------------------------------------------------------------
    def _changed_rows(self, since: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The rows written after the store's version ``since``: read by key from the change
        log where it covers ``since`` (O(changed rows)), else the store's own
        ``changes_since`` (a scan on most backends). The same rows either way."""
        rows = self.log.rows_after_version(self.store, since)
        return self.store.changes_since(since, 65536) if rows is None else rows

    def do_get(self, context: Any, ticket: Any) -> Any:
        def run() -> tuple[pa.Schema, list[pa.RecordBatch]]:
            header = wire.parse_header(ticket.ticket)
            self._check(context, header)
            if header["op"] not in ("records", "snapshot"):
                raise InvalidInputError(f"unknown stream {header['op']!r}")
            since = None if header["op"] == "snapshot" else header.get("since")
            if since is not None and (isinstance(since, bool) or not isinstance(since, int)):
                raise InvalidInputError("since must be an int")
            s = self.store
            src = s.records(65536) if since is None else self._changed_rows(since)
            # read under the lock (a consistent table), sent after it
            out = [self._records_batch(k, r) for k, r in src]
            key_type = pa.int64() if s.key_type == "int64" else pa.binary()
            schema = pa.schema([("key", key_type), ("rec", pa.binary(s.layout.itemsize))],
                               metadata={"seq": str(self.log.seq), "log": self.log.id})
            return schema, [b.replace_schema_metadata(schema.metadata) for b in out]

        schema, batches = self._guard(run, _peek_op(ticket.ticket))
        return flight.GeneratorStream(schema, iter(batches))
