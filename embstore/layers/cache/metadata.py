"""The cache layer's store metadata: kept in the remote, written through the writer lease.

:class:`CacheMetadata` is owned by :class:`~embstore.layers.cache.backend.CachedBackend`: it
reads and writes the remote's metadata (a ``modify_meta`` keeps the cache's writer lease in
the same transaction), mirrors it into a separate persistent local store, clears such a local
store when it holds rows of an earlier run, and keeps the last copy (re-written after the
table is cleared).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ...backends.base import Backend
from .lease import WriterLease

__all__ = ["CacheMetadata"]


class CacheMetadata:
    """Metadata of a cache over ``remote`` with the local store ``local``.

    Parameters
    ----------
    remote, local : Backend
    lease : WriterLease or None
        The cache's writer lease (a writable persistent cache), checked before writes.
    remote_lock : context manager
        Serializes calls to a remote that is not thread-safe.
    mirror : bool
        Write the metadata into ``local`` too (a local store separate from the slot index).
    """

    def __init__(self, remote: Backend, local: Backend, lease: WriterLease | None,
                 remote_lock: AbstractContextManager[Any], mirror: bool) -> None:
        self.remote, self.local, self.lease = remote, local, lease
        self.remote_lock, self.mirror = remote_lock, mirror
        #: the metadata as last read or written (None: no store yet)
        self.last: dict | None = None

    def read(self) -> dict | None:
        meta = self.remote.read_meta()
        self.last = None if meta is None else dict(meta)
        if self.local.read_meta() is not None:
            self.local.clear()  # a persistent local cache from an earlier run may be stale
        return meta

    def write(self, meta: dict) -> None:
        if self.lease is not None:  # a compare-and-set that keeps the stored writer leases
            meta = self.modify(lambda stored: meta)
        else:
            with self.remote_lock:
                self.remote.write_meta(meta)
        self.last = dict(meta)
        if self.mirror:
            self.local.write_meta(meta)

    def modify(self, fn: Callable[[dict | None], dict]) -> dict:
        lease = self.lease
        with self.remote_lock:
            meta = self.remote.modify_meta(
                fn if lease is None else (lambda stored: lease.keep(stored, fn(stored))))
        self.last = dict(meta)
        return meta
