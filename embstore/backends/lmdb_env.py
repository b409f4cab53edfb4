"""Process-wide LMDB environments, shared by every ``lmdb://`` backend on one path.

LMDB forbids opening one environment twice in a process, so backends on the same directory
share one :class:`SharedEnv`, counted by references and closed with the last backend. An
environment inherited through ``fork()`` is never used in the child.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import BackendError, BackendUnavailableError, InvalidInputError, SchemaMismatchError
from ..extras import install_hint
from ..log import event
from ._localdir import make_store_dir

try:
    import lmdb
except ImportError as e:  # pragma: no cover - depends on the environment
    raise BackendUnavailableError(
        f"the lmdb backend needs py-lmdb; install it with: {install_hint('lmdb')}") from e

__all__ = ["LmdbEnv", "SharedEnv", "acquire_env", "grow_map", "release_env"]
# map growth is reported under the backend's own logger name
log = logging.getLogger("embstore.backends.lmdb")

#: key of the store metadata in the metadata database
META_KEY = b"meta"
#: key of the restore generation in the metadata database: a fresh id written by every restore
#: in its own transaction, so a scan tells a table swapped under it (see ``LmdbBackend.scan``)
GEN_KEY = b"generation"
REC_DB = b"records"
META_DB = b"meta"
GROW_LIMIT = 1 << 46  # 64 TiB: beyond that a MapFullError is a real error, not a small map


class SharedEnv:
    """One open environment of this process, shared by every backend on the same path."""

    def __init__(self, env: lmdb.Environment, read_only: bool, flags: tuple) -> None:
        self.env = env
        self.read_only = read_only
        self.flags = flags
        self.pid = os.getpid()  # an environment must not be used across fork()
        self.refs = 0
        self._dbs: dict[bytes, Any] = {}

    def db(self, name: bytes, create: bool = False):
        """The named database, or None if it does not exist and ``create`` is False."""
        if name not in self._dbs:
            try:
                if create:
                    self._dbs[name] = self.env.open_db(name)
                else:
                    # Nothing is created before the metadata has been read and checked (a
                    # write transaction that changes nothing writes nothing on commit).
                    self._dbs[name] = self.env.open_db(name, create=False)
            except lmdb.NotFoundError:
                return None
            except lmdb.Error as e:
                raise BackendError(f"cannot open LMDB database {name!r}: {e}") from e
        return self._dbs[name]


_POOL: dict[str, SharedEnv] = {}


def acquire_env(path: str, read_only: bool, flags: tuple,
                new_env: Callable[[], lmdb.Environment]) -> SharedEnv:
    """This process's environment at ``path`` (opened with ``new_env`` when there is none),
    with one more reference. ``flags`` (durable, writemap, lock) must match a writer's."""
    shared = _POOL.get(path)
    if shared is not None and shared.pid == os.getpid() and shared.refs > 0:
        # LMDB forbids opening one environment twice in a process: share it.
        if shared.read_only and not read_only:
            raise BackendError(f"{path} is already open read-only in this process; "
                               "close that store before opening it for writing")
        if not read_only and shared.flags != flags:
            raise InvalidInputError(
                f"{path} is already open in this process with durable/writemap/lock="
                f"{shared.flags}; open it with the same options"
            )
    else:
        if shared is not None and shared.pid != os.getpid():
            # Inherited through fork(): LMDB forbids using it here, and py-lmdb would
            # refuse a new open while it counts as open. Closing the child's copy is safe:
            # fcntl locks and reader slots belong to the parent's pid.
            try:
                shared.env.close()
            except lmdb.Error:
                pass
        shared = SharedEnv(new_env(), read_only, flags)
        _POOL[path] = shared
    shared.refs += 1
    return shared


def release_env(path: str, shared: SharedEnv) -> None:
    """Drop one reference; the last one closes the environment."""
    shared.refs -= 1
    if shared.refs == 0:
        if _POOL.get(path) is shared:
            del _POOL[path]
        shared.env.close()


def grow_map(env: Any, path: str, row_bytes: int, limit: int) -> bool:
    """Grow ``env``'s map ahead of a bulk write of ``row_bytes`` of rows, so that no large
    transaction is thrown away by a full map (one that still fills it is retried); return
    whether it grew."""
    info = env.info()
    # Leaf pages of randomly placed rows end up about half full: reserve twice the bytes.
    need = (int(info["last_pgno"]) + 1) * int(env.stat()["psize"]) + 2 * row_bytes
    size = int(info["map_size"])
    if size >= need:
        return False
    while size < need:
        size *= 2
    try:
        env.set_mapsize(min(size, limit))
    except lmdb.Error as e:
        raise BackendError(f"{path}: cannot grow the LMDB map: {e}") from e
    event(log, logging.INFO, "lmdb.map_grow", "%s: grew the LMDB map to %d bytes ahead of a "
          "bulk write", path, min(size, limit), map_size=min(size, limit))
    return True


class LmdbEnv:
    """The LMDB environment one ``lmdb://`` backend reads and writes through.

    It opens the process's :class:`SharedEnv` on first need (``open``, or ``create`` for a new
    store), reopens it in a forked child, and runs write transactions that grow a full map and
    retry. ``records`` / ``meta`` are the two named databases (None until they exist);
    ``counters`` counts commits and map growths.
    """

    def __init__(self, path: str, url: str, *, read_only: bool, map_size: int, durable: bool,
                 writemap: bool, lock: bool, max_readers: int) -> None:
        self.path, self.url, self.read_only = path, url, read_only
        self.durable, self.writemap, self.lock = durable, writemap, lock
        self._map_size = map_size
        self._max_readers = max_readers
        self.env: lmdb.Environment | None = None
        self.records: Any = None
        self.meta: Any = None
        self._shared: SharedEnv | None = None
        self.counters = {"commits": 0, "map_grows": 0}

    def open(self) -> None:
        """Take this process's environment at the path (existing databases only)."""
        self._shared = shared = acquire_env(self.path, self.read_only,
                                            (self.durable, self.writemap, self.lock),
                                            self._new_env)
        self.env = shared.env
        self.records = shared.db(REC_DB)
        self.meta = shared.db(META_DB)

    def _new_env(self) -> lmdb.Environment:
        try:
            return lmdb.open(
                self.path, map_size=self._map_size, subdir=True, max_dbs=4,
                readonly=self.read_only, lock=self.lock, sync=self.durable,
                metasync=self.durable, writemap=self.writemap and not self.read_only,
                max_readers=self._max_readers, create=not self.read_only, readahead=False,
            )
        except lmdb.Error as e:
            raise BackendError(f"cannot open LMDB environment {self.path}: {e}") from e

    def create(self) -> None:
        """Make the directory, environment and databases of a new store where missing."""
        if self.read_only:  # nothing is created beside a read-only store
            raise BackendError(f"{self.path}: the LMDB store is open read-only")
        if self.env is None:
            top = make_store_dir(self.path)
            try:
                self.open()
            except Exception:
                if top is not None:
                    shutil.rmtree(top, ignore_errors=True)
                raise
        if self.meta is None or self.records is None:
            assert self._shared is not None  # invariant: set with env
            self.records = self._shared.db(REC_DB, create=True)
            self.meta = self._shared.db(META_DB, create=True)

    @property
    def shared_by(self) -> int:
        """How many backends of this process use the environment (0: not open)."""
        return 0 if self._shared is None else self._shared.refs

    def require(self) -> lmdb.Environment:
        """The open environment, this process's own (raises when closed)."""
        if self._shared is not None and self._shared.pid != os.getpid():
            # Used in a child forked after it opened: LMDB forbids using the parent's
            # environment there; the child opens its own on the same files (multi-process
            # safe), and its writes land for every process to see.
            self._shared = self.env = None
            self.open()
        if self.env is None:
            raise BackendError(f"{self.path}: LMDB environment is not open")
        return self.env

    def begin(self, write: bool = False) -> Any:
        """A transaction on the records database."""
        # buffers=False: values come back as bytes objects, which measured faster than py-lmdb's
        # buffer objects both for get loops (~10%) and cursor walks (~2x), and nothing then
        # depends on the transaction staying open.
        env = self.require()
        try:
            return env.begin(db=self.records, write=write, buffers=False)
        except lmdb.MapResizedError:
            # Another process grew the map: adopt its size, then start again.
            env.set_mapsize(0)
            return env.begin(db=self.records, write=write, buffers=False)

    def write(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(txn)`` in one write transaction; grow the map and retry when full."""
        env = self.require()
        while True:
            try:
                with self.begin(write=True) as txn:
                    out = fn(txn)
                self.counters["commits"] += 1
                return out
            except lmdb.MapFullError as e:
                size = env.info()["map_size"]
                if size >= GROW_LIMIT:
                    raise BackendError(f"{self.path}: LMDB map full at {size} bytes") from e
                env.set_mapsize(size * 2)
                self.counters["map_grows"] += 1
                event(log, logging.INFO, "lmdb.map_grow", "%s: LMDB map full; grew it to %d "
                      "bytes", self.path, size * 2, map_size=size * 2)
            except lmdb.Error as e:
                raise BackendError(f"{self.path}: LMDB write failed: {e}") from e

    def reserve(self, row_bytes: int) -> None:
        """Grow the map ahead of a bulk write of ``row_bytes`` (see :func:`grow_map`)."""
        if grow_map(self.require(), self.path, row_bytes, GROW_LIMIT):
            self.counters["map_grows"] += 1

    def read_meta(self) -> dict | None:
        """The stored metadata; None for a new store; refuses an environment of other data."""
        if self.env is None:
            return None
        if self.meta is None or self.records is None:
            try:
                with self.env.begin() as txn:
                    empty = txn.stat()["entries"] == 0
            except lmdb.Error as e:
                raise BackendError(f"{self.path}: cannot read LMDB environment: {e}") from e
            if empty:
                return None
            raise SchemaMismatchError(f"{self.url}: the LMDB environment holds data that is "
                                      "not an embstore store; refusing to touch it")
        try:
            with self.env.begin(db=self.meta) as txn:
                raw = txn.get(META_KEY)
                empty = txn.stat(self.records)["entries"] == 0
        except lmdb.Error as e:
            raise BackendError(f"{self.path}: cannot read metadata: {e}") from e
        if raw is None:
            if empty:
                return None
            raise SchemaMismatchError(f"{self.url}: records without metadata; not a store")
        try:
            return json.loads(raw)
        except ValueError as e:
            raise SchemaMismatchError(f"{self.url}: unreadable metadata: {e}") from e

    def modify_meta(self, fn: Callable[[dict | None], dict]) -> dict:
        """Read, ``fn`` and write the metadata in one write transaction (writers merge)."""
        def merge(txn: Any) -> dict:
            raw = txn.get(META_KEY, db=self.meta)
            meta = fn(json.loads(raw) if raw is not None else None)
            txn.put(META_KEY, json.dumps(meta, sort_keys=True).encode(), db=self.meta)
            return meta

        return self.write(merge)

    def entries(self) -> int:
        """Number of stored records."""
        if self.records is None:
            return 0
        try:
            with self.begin() as txn:
                return int(txn.stat(self.records)["entries"])
        except lmdb.Error as e:
            raise BackendError(f"{self.path}: LMDB stat failed: {e}") from e

    def sync(self) -> None:
        if self.env is not None and not self.read_only:
            try:
                self.env.sync(True)
            except lmdb.Error as e:
                raise BackendError(f"{self.path}: sync failed: {e}") from e

    def close(self) -> None:
        if self.env is not None:
            self.env = self.records = self.meta = None
            shared, self._shared = self._shared, None
            assert shared is not None  # invariant: set with env
            release_env(self.path, shared)

    def size_bytes(self) -> int:
        if self.env is None:
            return 0
        return int(self.env.stat()["psize"]) * int(self.env.info()["last_pgno"] + 1)

    def map_size(self) -> int | None:
        return None if self.env is None else int(self.env.info()["map_size"])

    def replace_table(self, pairs: Iterator[tuple[list, list]], meta: dict,
                      row_bytes: int | None) -> int:
        """Drop every record, write ``pairs`` (batches of encoded keys and record bytes) and
        ``meta`` in one write transaction; return the rows now stored. It also writes a fresh
        generation id (:data:`GEN_KEY`) that scans check. An aborted or killed transaction is
        never visible: the old table stays (``embstore/backends/_replace.py``)."""
        raw = json.dumps(meta, sort_keys=True).encode()
        gen = uuid.uuid4().hex.encode()
        self.create()
        if row_bytes:
            self.reserve(row_bytes)

        def write(txn: Any) -> int:
            txn.drop(self.records, delete=False)
            cur = txn.cursor()
            for enc, vals in pairs:
                cur.putmulti(zip(enc, vals))
            for key, value in ((META_KEY, raw), (GEN_KEY, gen)):
                txn.put(key, value, db=self.meta)
            return int(txn.stat(self.records)["entries"])

        # Not ``self.write``: its retry on a full map would run ``write`` again on a consumed
        # iterator. The map was grown for ``row_bytes`` above; if it is still too small, the
        # transaction aborts and the old table stays.
        try:
            with self.begin(write=True) as txn:
                n = write(txn)
        except lmdb.MapFullError as e:
            raise BackendError(f"{self.path}: LMDB map full while restoring; the old table is "
                               "kept (open the store with a larger map_size)") from e
        except lmdb.Error as e:
            raise BackendError(f"{self.path}: LMDB restore failed ({e}); the old table is "
                               "kept") from e
        self.counters["commits"] += 1
        return n
