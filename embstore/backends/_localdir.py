"""Shared URL and directory checks of the local, directory-based backends (LMDB, RocksDB).

Everything here runs before a single byte is written, so a bad URL or a directory that belongs
to something else is refused with nothing created or touched.
"""

from __future__ import annotations

import abc
import os

import numpy as np

from ..errors import BackendError, SchemaMismatchError

# its home is embstore.urls (public: the TF adapter checks file-named URLs with it)
from ..urls import parse_dir_url as parse_dir_url
from .base import Backend


def check_store_dir(path: str, marker: str, engine: str) -> bool:
    """Validate a store directory before anything is written; return whether it holds data.

    ``marker`` is the file that shows the directory is an ``engine`` store. A non-empty
    directory without it belongs to something else and is refused, untouched.
    """
    if os.path.lexists(path) and not os.path.isdir(path):
        raise BackendError(f"{path} exists and is not a directory")
    if not os.path.isdir(path):
        return False
    if os.path.exists(os.path.join(path, marker)):
        return True
    try:
        entries = os.listdir(path)
    except OSError as e:
        raise BackendError(f"cannot read directory {path}: {e}") from e
    if entries:
        raise BackendError(
            f"{path} is not empty and holds no {engine} store ({marker} missing); refusing to "
            "write into it"
        )
    return False


def make_store_dir(path: str) -> str | None:
    """Create ``path`` (and parents); return the topmost directory created, for cleanup."""
    top = None
    p = path
    while not os.path.isdir(p):
        top = p
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise BackendError(f"cannot create store directory {path}: {e}") from e
    return top


def sorted_last_wins(pending: list[tuple[np.ndarray, np.ndarray]],
                     dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate bulk-load batches, sort by key, keep the last row of each duplicate key.

    Returns keys and the records as a 1-D array of opaque ``void`` items (gathering those is a
    plain memory copy, several times faster than gathering a structured dtype). int64 keys
    sort numerically, which is the order of their big-endian sign-flipped encoding; bytes
    keys sort bytewise.
    """
    void = np.dtype((np.void, dtype.itemsize))
    keys = np.concatenate([k for k, _ in pending])
    recs = np.concatenate([np.ascontiguousarray(r, dtype=dtype).view(void) for _, r in pending])
    if keys.dtype == np.int64:
        if len(keys) < 2 or bool((keys[1:] > keys[:-1]).all()):
            return keys, recs  # already sorted and unique (e.g. an export of a sorted store)
        # The default sort is several times faster than a stable one (SIMD); it is enough
        # when no key repeats, which is the common case. Duplicates need the stable sort
        # so that the last occurrence wins.
        order = np.argsort(keys)
        sk = keys[order]
        if not bool((sk[1:] != sk[:-1]).all()):
            order = np.argsort(keys, kind="stable")
            sk = keys[order]
            order = order[np.append(sk[1:] != sk[:-1], True)]
        idx = order
    else:
        by_key = sorted(range(len(keys)), key=keys.__getitem__)
        last = {keys[i]: i for i in by_key}
        idx = np.fromiter(last.values(), dtype=np.intp, count=len(last))
    return keys[idx], np.take(recs, idx)


def as_void(records: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Records (structured, or already ``void`` items) as a contiguous 1-D ``void`` array."""
    void = np.dtype((np.void, dtype.itemsize))
    if records.dtype == void:
        return np.ascontiguousarray(records)
    return np.ascontiguousarray(records, dtype=dtype).view(void)


def found_mask(vals: list, buf: bytes | bytearray, itemsize: int, what: str) -> np.ndarray:
    """Which of a multi-get's values (``b""`` for a missing key) were found; ``buf`` is their
    concatenation. Raises ``SchemaMismatchError`` where records are not ``itemsize`` long."""
    # Every stored record has the layout's size, so a full-length result means all hits
    # and the per-value lengths are only needed when some keys missed.
    if len(buf) == len(vals) * itemsize:
        return np.ones(len(vals), dtype=bool)
    found = np.fromiter(map(len, vals), dtype=np.intp, count=len(vals)) != 0
    if len(buf) != int(found.sum()) * itemsize:
        raise SchemaMismatchError(f"{what}: stored records are not {itemsize} bytes long; the "
                                  "data was written with another layout")
    return found


def unpack_records(buf: bytes | bytearray, found: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Records in request order from the concatenated bytes of the found ones (zero rows
    where not found)."""
    got = np.frombuffer(buf, dtype=dtype)
    if len(got) == len(found):
        return got
    recs = np.zeros(len(found), dtype=dtype)
    recs[found] = got
    return recs


def unpack_field(buf: bytes | bytearray, found: np.ndarray, dtype: np.dtype,
                 field: str) -> np.ndarray:
    """One field of :func:`unpack_records`, as a contiguous array."""
    got = np.frombuffer(buf, dtype=dtype)[field]
    if len(got) == len(found):
        return np.ascontiguousarray(got)
    fdt = dtype[field]
    out = np.zeros((len(found),) + fdt.shape, dtype=fdt.base)
    out[found] = got
    return out


class FetchedRows(Backend):
    """Base of the local key-value backends (LMDB, RocksDB): every read of rows comes from
    one :meth:`_fetch`, the found records' bytes concatenated in request order plus the found
    mask, and is answered the same way."""

    @abc.abstractmethod
    def _fetch(self, keys: np.ndarray) -> tuple[bytes | bytearray, np.ndarray]:
        """Raw bytes of the found records (concatenated, request order) and the found mask."""

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        buf, found = self._fetch(keys)
        return unpack_records(buf, found, self.layout.dtype), found

    def get_field(self, keys: np.ndarray, field: str) -> tuple[np.ndarray, np.ndarray]:
        buf, found = self._fetch(keys)
        return unpack_field(buf, found, self.layout.dtype, field), found

    def contains(self, keys: np.ndarray) -> np.ndarray:
        return self._fetch(keys)[1]
