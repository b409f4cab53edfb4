"""Process-wide LMDB environments, shared by every ``lmdb://`` backend on one path.

LMDB forbids opening one environment twice in a process, so backends on the same directory
share one :class:`SharedEnv`, counted by references and closed with the last backend. An
environment inherited through ``fork()`` is never used in the child.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from ..errors import BackendError, BackendUnavailableError, InvalidInputError
from ..extras import install_hint
from ..log import event

try:
    import lmdb
except ImportError as e:  # pragma: no cover - depends on the environment
    raise BackendUnavailableError(
        f"the lmdb backend needs py-lmdb; install it with: {install_hint('lmdb')}") from e

__all__ = ["SharedEnv", "acquire_env", "grow_map", "release_env"]
# map growth is reported under the backend's own logger name
log = logging.getLogger("embstore.backends.lmdb")

#: key of the store metadata in the metadata database
META_KEY = b"meta"
#: key of the restore generation in the metadata database: a fresh id written by every restore
#: in its own transaction, so a scan tells a table swapped under it (see ``LmdbBackend.scan``)
GEN_KEY = b"generation"


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
