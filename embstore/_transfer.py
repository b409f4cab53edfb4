"""Whole-table transfer for the engine: native export, native import, bulk record loads.

Kept apart from ``store.py`` because none of it is on a training hot path; the engine's
``export``/``import_``/``load_records`` methods validate state and delegate here.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from ._batch import distinct, unique_last
from ._cython.rowops import all_finite
from .errors import CorruptFileError, SchemaMismatchError
from .io.native import NativeReader, NativeWriter
from .io.validate import ImportChecks
from .policies.tombstones import encode_keys
from .progress import progress_bar

if TYPE_CHECKING:
    from .store import EmbeddingStore

_MAX_HEADER_DELETIONS = 1 << 20  # keeps the JSON header within the native format's limit
# Checked chunks kept in memory during a native import (as the CLI's --cache-mb): a file that
# fits is read once; a bigger one is read twice in constant memory.
_CACHE_BYTES = 512 << 20


def export_native(store: EmbeddingStore, dest: str | os.PathLike | BinaryIO, *,
                  since: int | None, batch_size: int, progress: bool) -> int:
    src = (store.records(batch_size) if since is None
           else store.changes_since(since, batch_size))
    header = store.meta
    header["since"] = since
    if since is not None:
        gone, complete = store.deletions_since(since)
        if len(gone) > _MAX_HEADER_DELETIONS:
            gone, complete = gone[:0], False
        header["deleted"] = encode_keys(gone, store.key_type)
        header["deletions_complete"] = complete
    # background: scans yield fresh arrays, so checksum+write can overlap the next scan
    with NativeWriter(dest, header, background=True) as w, progress_bar(
        total=len(store) if since is None else None, enabled=progress, desc="export"
    ) as bar:
        for keys, recs in src:
            w.write(keys, recs)
            bar.update(len(keys))
    return w.rows


def import_native(store: EmbeddingStore, src: str | os.PathLike | BinaryIO | bytes, *,
                  partial: bool, progress: bool, apply_deletes: bool = False) -> int:
    with NativeReader(src) as reader:
        if reader.key_type != store.key_type:
            raise SchemaMismatchError(
                f"file has {reader.key_type} keys, the store has {store.key_type} keys"
            )
        if reader.layout != store.layout:
            raise SchemaMismatchError(
                f"file layout {reader.layout} differs from the store's {store.layout}"
            )
        # header, deletions, policy state now; stamps and key lengths on every chunk below
        checks = ImportChecks(reader.name, reader.header, store, records=True,
                              apply_deletes=apply_deletes)
        total: int | None = None
        cache: list[tuple[np.ndarray, np.ndarray]] | None = None
        if not partial:
            # Pass 1 checks the whole file before anything is written (a damaged file imports
            # nothing); the checked chunks are kept when they fit, so pass 2 need not read it.
            size = _source_size(src)
            cap = _CACHE_BYTES if size is None or size <= _CACHE_BYTES else 0
            total, cache = _check_all(reader, cap, checks)
        header = reader.header
        if header.get("deletions_complete") is False:
            warnings.warn(f"{reader.name}: this delta does not carry every deletion since "
                          "its base version; rows deleted at the source may remain here "
                          "(sync from a full export)", stacklevel=3)
        if checks.deleted is not None:
            # A delta carries the keys deleted since its base version: apply them first,
            # so rows re-created after the delete (in the delta's rows) survive.
            gone = checks.deleted
            for i in range(0, len(gone), 65536):
                store._delete(gone[i:i + 65536])

        def cached(bar: Any, chunks: list) -> Iterator[tuple[np.ndarray, np.ndarray]]:
            chunks.reverse()
            while chunks:
                keys, recs = chunks.pop()  # dropped once handed on: memory shrinks as we go
                bar.update(len(keys))
                yield keys, recs

        def checked(bar: Any) -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for keys, recs in reader:
                if partial:  # otherwise pass 1 has checked every vector
                    _check_finite(reader, recs)
                    checks.chunk(keys, recs)
                bar.update(len(keys))
                yield keys, recs

        with progress_bar(total=total, enabled=progress, desc="import") as bar:
            return load_records(store, cached(bar, cache) if cache is not None else checked(bar),
                                header=header)


def _source_size(src: Any) -> int | None:
    if isinstance(src, (bytes, bytearray)):
        return len(src)
    if isinstance(src, (str, os.PathLike)):
        try:
            return os.path.getsize(src)
        except OSError:
            return None  # the reader reports it
    return None


def _check_finite(reader: NativeReader, recs: np.ndarray) -> None:
    if not all_finite(recs["vector"]):
        raise CorruptFileError(f"{reader.name}: NaN/inf in stored vectors")


def _check_all(reader: NativeReader, cap: int, checks: ImportChecks
               ) -> tuple[int, list[tuple[np.ndarray, np.ndarray]] | None]:
    """Check every checksum, the trailer and every vector; return the row count and the
    decoded chunks if they total at most ``cap`` bytes (else None: read the file again)."""
    cache: list[tuple[np.ndarray, np.ndarray]] | None = [] if cap > 0 else None
    kept = total = 0
    # a file known not to fit is checked through one reused buffer (constant memory)
    for keys, recs in (reader if cache is not None else reader.iter_transient()):
        _check_finite(reader, recs)
        checks.chunk(keys, recs, np.arange(total, total + len(keys)))
        total += len(keys)
        if cache is not None:
            kept += recs.nbytes + (keys.nbytes if keys.dtype != object
                                   else sum(map(len, keys.tolist())) + 8 * len(keys))
            if kept > cap:
                cache = None  # too big after all (size was unknown): pass 2 reads again
            else:
                cache.append((keys, recs))
    return total, cache


def load_records(store: EmbeddingStore, batches: Iterable[tuple[Any, np.ndarray]], *,
                 header: dict[str, Any] | None = None) -> int:
    top = [store._version]

    def clean() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for keys, recs in batches:
            keys = store._keys(keys)
            if len(keys) == 0:
                continue
            if getattr(recs, "dtype", None) != store.layout.dtype or len(recs) != len(keys):
                raise SchemaMismatchError(
                    f"records do not match the store layout {store.layout}")
            top[0] = max(top[0], int(recs["version"].max()))
            if not distinct(keys):
                uniq, last = unique_last(keys)
                keys, recs = uniq, recs[last]
            yield keys, recs

    n = store._backend.bulk_load(clean())
    for obs in store._observers:  # bulk loads bypass _put: let indexes resync
        if hasattr(obs, "on_bulk_load"):
            obs.on_bulk_load()
    store._version = max(store._version, top[0])
    policy = store._policy
    if header:
        store.step = max(store.step, int(header.get("step", 0)))
        policy.load_from_header(header.get("extra") or {})
    if policy.eviction is not None:
        policy.resync_rows(store)
        policy.maybe_evict(store)
    return n
