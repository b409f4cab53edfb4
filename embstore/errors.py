"""Exceptions raised by embstore.

Every error is a subclass of :class:`EmbstoreError` *and* of the builtin exception a caller
would naturally catch (``ValueError`` for bad input, ``PermissionError`` for writes to a
read-only store, ...), so code that does not know embstore still handles them sensibly.
Misses are data, never errors.
"""

from __future__ import annotations

__all__ = [
    "EmbstoreError",
    "InvalidInputError",
    "KeyTypeError",
    "SchemaMismatchError",
    "ReadOnlyError",
    "StoreClosedError",
    "CapacityError",
    "UnknownSchemeError",
    "BackendUnavailableError",
    "BackendError",
    "CorruptFileError",
    "InvalidURLError",
    "StoreNotFoundError",
    "ForkedProcessError",
    "AuthenticationError",
    "ShardMismatchError",
    "PartFailedError",
    "LeaseConflictError",
    "LeaseLostError",
    "LeaseFormatError",
    "ConcurrentRestoreError",
]


class EmbstoreError(Exception):
    """Base class of every error embstore raises on purpose."""


class InvalidInputError(EmbstoreError, ValueError):
    """An argument has the wrong shape, dtype, dimension or value (e.g. NaN gradients)."""


class KeyTypeError(EmbstoreError, TypeError):
    """Keys of a type the store was not created for (e.g. strings for an int64 store)."""


class SchemaMismatchError(EmbstoreError, ValueError):
    """A store was reopened with a dim, key type, layout or optimizer other than its own."""


class ReadOnlyError(EmbstoreError, PermissionError):
    """A write was attempted on a store opened with ``read_only=True``."""


class StoreClosedError(EmbstoreError, ValueError):
    """An operation was attempted on a closed store (like I/O on a closed file)."""


class CapacityError(EmbstoreError, MemoryError):
    """A capacity-bounded store is full and its policy is to refuse, not to evict."""


class UnknownSchemeError(EmbstoreError, ValueError):
    """No backend is registered for the URL's scheme."""


class InvalidURLError(EmbstoreError, ValueError):
    """A store URL is malformed (missing path, relative path, bad identifier...)."""


class BackendUnavailableError(EmbstoreError, ImportError):
    """A backend's optional dependency is not installed; the message names the extra."""


class BackendError(EmbstoreError, OSError):
    """The storage engine or remote service failed (I/O error, retries exhausted...)."""


class ConcurrentRestoreError(BackendError):
    """A scan or export overlapped a restore (``import_(..., replace=True)``) of the same store
    by another process or thread: what it read would mix the old table and the new one, so it
    fails instead. Retry it; it then reads one table."""


class CorruptFileError(EmbstoreError, ValueError):
    """An import file is truncated, fails its checksum, or is not in the declared format."""


class StoreNotFoundError(EmbstoreError, FileNotFoundError):
    """A store was opened read-only (or without ``dim``) but holds no data yet."""


class CapabilityError(EmbstoreError, NotImplementedError):
    """The backend does not declare the capability an operation needs (e.g. ``supports_scan``
    for a whole-table scan)."""


class ForkedProcessError(EmbstoreError, RuntimeError):
    """An in-process store (``memory://``) was used in a child forked from its process: the
    child holds a private copy, so its writes would silently never reach the parent."""


class AuthenticationError(EmbstoreError, PermissionError):
    """A DynamicEmbedding Worker refused the caller: no token, a wrong token, or a role that
    may not do what was asked (a ``serve`` token writing)."""


class ShardMismatchError(EmbstoreError, ValueError):
    """A request reached a DynamicEmbedding Worker that does not own it: another shard index
    or shard count than the worker's ``--shard I/N``, or keys another shard owns."""


class PartFailedError(EmbstoreError, RuntimeError):
    """A part of a split job (:func:`embstore.transfer.run_part`) still failed after its
    retries; the parts that succeeded are kept, and a rerun does only the rest."""


class LeaseConflictError(BackendError):
    """Another cache holds a live writer lease on keys this one would write (see
    ``docs/concurrency.md``)."""


class LeaseLostError(LeaseConflictError):
    """This cache's writer lease was taken over by another writer: its writes are refused (the
    lease's fencing token no longer matches) instead of overwriting the new holder's updates."""


class LeaseFormatError(BackendError):
    """The stored writer-lease record is malformed (not written by embstore, or damaged)."""
