"""SQL row store through SQLAlchemy: ``sqlite:////abs/file.db``, ``postgresql+psycopg://...``.

One table per store holds ``(k, rec, version)``: the key (``INTEGER PRIMARY KEY`` -- the rowid
alias -- on SQLite, ``BIGINT`` elsewhere; a binary column for bytes stores), the record as the
raw bytes of the layout dtype, and the record's write stamp in an indexed ``version`` column so
incremental export reads only what changed. ``<table>_meta`` holds the store metadata as JSON.

SQLAlchemy provides URLs, dialects and the DDL; the hot paths use the connection's raw DBAPI
cursor (:mod:`embstore.backends.sql.ops`), because SQLAlchemy Core costs about 2x on lookups.
Other dialects (MySQL, ...) run through portable SQLAlchemy Core statements.

The table name travels in the URL (``?table=name``) so ``store.url`` reopens the same store.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from ...errors import BackendUnavailableError, InvalidInputError, SchemaMismatchError
from ...extras import install_hint
from ...layout import Layout
from ..base import Backend, ModifyFn
from ..lease_record import check_fence, loads
from ..ranges import KIND_KEY, KeyRange, ranges_from_bounds

try:
    import sqlalchemy  # noqa: F401 - a missing SQLAlchemy is named before the modules below fail
except ImportError as e:  # pragma: no cover - depends on the environment
    raise BackendUnavailableError(
        f"the SQL backend needs SQLAlchemy; install it with: {install_hint('sql')}") from e

from . import ops as _sql_ops
from . import schema as _sql_schema
from .bulk import BulkLoader
from .connection import RestoreGuard, SqlConnection
from .modify import SqlRows
from .url import DEFAULT_TABLE as DEFAULT_TABLE
from .url import parse_store_url as _parse  # tests split URLs through this name
from .url import validate_table_name as validate_table_name

# Seconds to wait for a PostgreSQL server to answer a new connection (libpq drivers); a URL's
# own ``?connect_timeout=`` wins.
DEFAULT_CONNECT_TIMEOUT = 10

_F = TypeVar("_F", bound=Callable[..., Any])


def _wrap_errors(fn: _F) -> _F:
    # One DBAPI connection per backend: the connection runs the call under its lock (a batch's
    # transaction never interleaves with another thread's statements), reconnects after a
    # lost connection and replays the call when that is harmless.
    name = fn.__name__

    @functools.wraps(fn)
    def inner(self, *args, **kwargs):
        return self.sql.call(name, lambda: fn(self, *args, **kwargs))

    return inner  # type: ignore[return-value]


class SQLBackend(Backend):
    """Row store in one SQL table (SQLite, PostgreSQL, or any SQLAlchemy dialect).

    Options
    -------
    table : str
        Table name (default ``"embeddings"``; also accepted as ``?table=`` in the URL). Many
        stores can share one database under different names.
    durable : bool
        ``True`` (default): a batch is on disk when ``update``/``assign`` returns (SQLite
        ``synchronous=FULL``, PostgreSQL ``synchronous_commit=on``). ``False``: SQLite
        ``synchronous=NORMAL`` (WAL; a process crash loses nothing, a power cut may lose the
        last batches), PostgreSQL ``synchronous_commit=off``. ``flush()`` makes every
        acknowledged batch durable in both modes.
    pg_upsert : {"unnest", "copy"}
        PostgreSQL write path for ``put`` (one ``INSERT ... SELECT unnest(...)`` statement, or
        binary COPY into a temp table then ``INSERT ... ON CONFLICT``).
    fast_path : bool
        Use the tuned raw-DBAPI statements on SQLite / PostgreSQL (default). ``False`` uses the
        portable SQLAlchemy Core path every other dialect takes.
    """

    persistent = True
    supports_scan = True
    supports_changes = True
    supports_ranges = True
    supports_fencing = True
    scheme = "sql"

    def __init__(self, url: str, *, read_only: bool = False, table: str | None = None,
                 durable: bool = True, pg_upsert: str = "unnest", fast_path: bool = True,
                 **options: Any) -> None:
        if options:
            raise InvalidInputError(f"unknown SQL backend options: {sorted(options)}")
        if pg_upsert not in ("unnest", "copy"):
            raise InvalidInputError(f"pg_upsert must be 'unnest' or 'copy', got {pg_upsert!r}")
        sa_url, name, public = _parse(url, table)
        super().__init__(public, read_only=read_only)
        self.table_name, self.durable = name, bool(durable)
        self.sql = SqlConnection(sa_url, name, pg_upsert, read_only=read_only,
                                 durable=self.durable, counters=self.counters)
        try:
            self.sql.open(fast_path, DEFAULT_CONNECT_TIMEOUT)
        except BaseException:
            self.close()
            raise

    def storage_paths(self) -> tuple[str, ...]:
        return self.sql.storage_paths()

    @property
    def max_key_bytes(self) -> int | None:  # type: ignore[override]
        """Longest bytes key: PostgreSQL's B-tree index rows hold at most 2704 bytes (2684
        of key after the row overheads), MySQL keys are VARBINARY(767); SQLite has no limit."""
        return {"postgresql": 2680, "mysql": 767}.get(self.sql.dialect_name)

    # -- metadata and schema ----------------------------------------------------------------------
    @_wrap_errors
    def read_meta(self) -> dict | None:
        if self.sql.missing:
            return None
        return _sql_schema.read_store_meta(self.sql.ops, self.sql.safe_url, self.table_name)

    @_wrap_errors
    def write_meta(self, meta: dict) -> None:
        text = json.dumps(meta, sort_keys=True)
        with self.sql.ops.txn():
            self.sql.ops.meta_put(text)
        self.sql.keep_file()  # a store lives here now

    @_wrap_errors
    def bind(self, layout: Layout, key_type: str) -> None:
        super().bind(layout, key_type)
        cols = self.sql.ops.columns(self.table_name)
        if cols is None:
            if self.read_only:
                raise SchemaMismatchError(f"{self.sql.safe_url}: table {self.table_name!r} missing")
            # the portable path runs DDL objects, the fast paths DDL text of this dialect
            dialect = None if isinstance(self.sql.ops, _sql_ops.CoreOps) else self.sql.db.dialect
            self.sql.ops.execute_ddl(
                _sql_schema.create_statements(self.table_name, key_type, dialect))
        else:
            _sql_schema.check_data_columns(self.sql.safe_url, self.table_name, cols, key_type)
        self.sql.configure_ops(key_type, layout.itemsize)
        self.rows = SqlRows(self.sql, layout, key_type)
        self.loader = BulkLoader(self.sql, layout, key_type)

    # -- rows -------------------------------------------------------------------------------------
    @_wrap_errors
    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out, found = self.rows.gather(keys, 0, self.layout.itemsize)
        return out.view(self.layout.dtype).reshape(len(keys)), found

    @_wrap_errors
    def get_field(self, keys: np.ndarray, field: str) -> tuple[np.ndarray, np.ndarray]:
        fdt, offset = self.layout.fields[field]
        out, found = self.rows.gather(keys, offset, fdt.itemsize)
        return out.view(fdt.base).reshape((len(keys),) + fdt.shape), found

    @_wrap_errors
    def contains(self, keys: np.ndarray) -> np.ndarray:
        return self.rows.mask(keys, self.sql.ops.present(keys))

    @_wrap_errors
    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        if len(keys) == 0:
            return
        with self.sql.ops.txn():  # one transaction per batch: all of it or nothing
            self._check_fence()
            self.rows.upsert(keys, records)

    @_wrap_errors
    def insert_rows(self, keys: np.ndarray, vectors: np.ndarray,
                    template: np.ndarray) -> np.ndarray:
        """Insert-if-absent: a row another writer created since the caller's read is kept.
        Returns which keys were written."""
        if len(keys) == 0:
            return np.zeros(0, bool)
        records = np.repeat(template[:1], len(keys))
        records["vector"] = vectors
        return self.rows.insert_absent(keys, records)

    @_wrap_errors
    def modify(self, keys: np.ndarray, fn: ModifyFn) -> np.ndarray:
        """Read, ``fn`` and write in one transaction: SQLite ``BEGIN IMMEDIATE`` (the database
        write lock, across processes); PostgreSQL row locks on every key, existing or not (see
        ``PostgresOps.lock_rows``), retried whole on a deadlock or serialization failure."""
        if len(keys) == 0:
            return np.zeros(0, bool)
        return self.rows.modify(keys, fn)

    @_wrap_errors
    def modify_meta(self, fn) -> dict:
        """Read, ``fn`` and write the metadata in one transaction (the metadata row locked)."""
        if self.read_only or self.sql.missing:
            return super().modify_meta(fn)
        with self.sql.ops.txn():
            get = getattr(self.sql.ops, "meta_get_for_update", self.sql.ops.meta_get)
            text = get()
            meta = fn(json.loads(text) if text is not None else None)
            self.sql.ops.meta_put(json.dumps(meta, sort_keys=True))
        return meta

    @_wrap_errors
    def modify_leases(self, fn) -> dict:
        """The writer-lease record (the ``_meta`` table's ``leases`` row) replaced by
        ``fn(stored)`` in one transaction, the row locked (PostgreSQL ``FOR UPDATE``: fenced
        writes in flight finish first, later ones see the new record)."""
        with self.sql.ops.txn():
            text = self.sql.ops.lease_get("update")
            new = fn(loads(text, self.sql.safe_url))
            self.sql.ops.lease_put(json.dumps(new, sort_keys=True))
        return new

    @_wrap_errors
    def read_leases(self) -> Any:
        if self.sql.missing:
            return None
        return loads(self.sql.ops.lease_get(""), self.sql.safe_url)

    def _check_fence(self) -> None:
        # Inside the write's transaction: PostgreSQL holds the lease row FOR SHARE until the
        # commit, so a takeover (FOR UPDATE) either precedes this write or follows it.
        if self.fence is not None:
            text = self.sql.ops.lease_get("share")
            check_fence(loads(text, self.sql.safe_url), self.fence, self.sql.safe_url)

    @_wrap_errors
    def delete(self, keys: np.ndarray) -> np.ndarray:
        if len(keys) == 0:
            return np.zeros(0, bool)
        with self.sql.ops.txn():
            self._check_fence()
            gone = self.sql.ops.delete(keys)
        return self.rows.mask(keys, gone)

    @_wrap_errors
    def __len__(self) -> int:
        if self.sql.missing or not self.is_bound:
            return 0
        return self.sql.ops.count()

    def scan(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every record, page by page (keyset pagination, one statement each). A restore by
        another connection commits the new table with a new generation id; the id is read
        before the first page and after every page, and a change raises
        ``ConcurrentRestoreError``: the pages read so far came from the old table, the next
        would come from the new one."""
        if self.sql.missing or not self.is_bound:
            return
        guard = RestoreGuard(self.sql)

        def scan_page(after):
            return guard.checked(lambda: self.sql.ops.page(after, batch_size))

        yield from self.sql.read_pages(scan_page, self.layout.dtype, False)

    @_wrap_errors
    def plan_ranges(self, n: int) -> list[KeyRange]:
        """Cut at every ``len/n``-th key, each found by an index walk (``OFFSET``); an int64
        SQLite table whose rowid B-tree is at least three levels deep at the boundaries of
        its subtrees (:mod:`.sqlite_split`: a few hundred pages read, parts equal within a
        leaf page)."""
        if self.sql.missing or not self.is_bound:
            return ranges_from_bounds(KIND_KEY, [0 if self.key_type == "int64" else b""]
                                      * (n - 1))
        with self.sql.lock:
            ops = self.sql.ops
            cuts = ops.btree_cuts(n) if isinstance(ops, _sql_ops.SQLiteOps) else None
            if cuts is None:
                total = ops.count()
                cuts = [ops.key_at(total * i // n) for i in range(1, n)]
        empty = 0 if self.key_type == "int64" else b""
        bounds = [c for c in cuts if c is not None]
        return ranges_from_bounds(KIND_KEY, bounds + [bounds[-1] if bounds else empty]
                                  * (n - 1 - len(bounds)))

    def scan_range(self, rng: KeyRange, batch_size: int = 4096
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        if self.sql.missing or not self.is_bound:
            return

        def range_page(after):
            return self.sql.ops.page_range(after, batch_size, rng.lo, rng.hi)

        yield from self.sql.read_pages(range_page, self.layout.dtype, False)

    def changes_since(self, version: int,
                      batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Records with ``version`` above ``version``, read through the version index."""
        if self.sql.missing or not self.is_bound:
            return

        guard = RestoreGuard(self.sql)

        def changes_page(after):
            return guard.checked(lambda: self.sql.ops.changes(int(version), after, batch_size))

        yield from self.sql.read_pages(changes_page, self.layout.dtype, True)

    @_wrap_errors
    def changes_plan(self, version: int = 0) -> str:
        """The database's query plan for :meth:`changes_since` (shows the index it uses)."""
        return self.sql.ops.changes_plan(version)

    @_wrap_errors
    def bulk_load(self, batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> int:
        """Load many batches in one transaction through the dialect's bulk path.

        PostgreSQL streams binary COPY straight into an empty table (switching to upserts if a
        key repeats across batches); other cases upsert batch by batch. If the *source* fails
        part-way, the rows before the failure are committed and the error is re-raised (as
        ``put`` per batch would have left them).
        """
        return self.loader.load(batches)

    replace_mechanism = "transaction"

    @_wrap_errors
    def replace_rows(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict,
                     rows: int | None = None) -> int:
        """The table and ``meta`` replaced in one transaction (see ``bulk.py``)."""
        return self.loader.replace(batches, meta)

    @_wrap_errors
    def clear(self) -> None:
        with self.sql.ops.txn():
            self._check_fence()
            self.sql.ops.clear()

    @_wrap_errors
    def flush(self) -> None:
        if self.read_only or self.sql.ops is None or self.durable:
            return
        self.sql.ops.sync()

    @property
    def cheap_size(self) -> bool:  # type: ignore[override]
        # SQLite measures a table with dbstat, which reads every page (see embstore/_rowcount.py)
        return self.sql.dialect_name != "sqlite"

    @_wrap_errors
    def size_bytes(self) -> int | None:
        if self.sql.missing or not self.is_bound:
            return 0
        return self.sql.ops.size_bytes()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        out["sql_dialect"] = self.sql.dialect_name
        out["sql_table"] = self.table_name
        return out

    def reopen_options(self) -> dict:
        opts: dict[str, Any] = {}
        if not self.durable:
            opts["durable"] = False
        if self.sql.pg_upsert != "unnest":
            opts["pg_upsert"] = self.sql.pg_upsert
        if self.sql.conn is not None and self.sql.dialect_name in ("sqlite", "postgresql"):
            opts["fast_path"] = False
        return opts

    def close(self) -> None:
        self.sql.close()
