"""Replace a store's whole table with a native snapshot: validated first, swapped in atomically.

``store.import_(src, replace=True)`` (and the torch adapter's ``load_state_dict``) runs here.
Two passes over the snapshot:

1. **Check, write nothing.** Structure and checksums (the native reader), key type and layout
   against the store, the header's counters (``step``/``version``/``seed`` within
   ``embstore/io/limits.py``), every record's stamps, every key's length against the backend
   (LMDB holds at most 510 bytes), finite vectors. The step, version and row count of the new
   table are known at the end of this pass.
2. **Swap.** The backend's :meth:`~embstore.backends.base.Backend.replace_rows` writes the rows
   and the new metadata so that a failure or a SIGKILL at any moment leaves the old table or
   the new one: one write transaction (LMDB, SQLite, PostgreSQL), a staging directory
   exchanged with the live one (RocksDB), a staging table installed in one step (memory://)
   or committed by a marker and rolled forward (Bigtable).
   Backends without either (layers over several backends) write the new rows before
   deleting the stale ones: never a lost row, but a crash can leave a mix (``replace_mechanism``
   says which a backend uses).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from ..engine.batch import distinct, unique_last
from ..errors import CorruptFileError, SchemaMismatchError
from ..io.base import FormatReader
from ..io.formats import NativeFormatReader
from ..io.limits import MAX_STAMP
from ..layout import Layout
from .pipeline import finite_rows
from .validate import ImportChecks

if TYPE_CHECKING:
    from ..store import EmbeddingStore


def _brief(layout: Layout | None) -> str:
    """A layout in one short line: what a user compares (dim, slots, dtypes, metadata)."""
    if layout is None:
        return "none recorded"
    slots = ",".join(f"{n}x{w}" for n, w in layout.slots) or "none"
    meta = "compact" if layout.is_compact else "full"
    return (f"dim {layout.dim}, slots {slots}, {layout.value_dtype} vectors, "
            f"{layout.slot_dtype} slots, {meta} metadata")


def check_snapshot(store: EmbeddingStore, reader: FormatReader) -> tuple[int, int]:
    """Pass 1: refuse a snapshot the store cannot take whole; return ``(rows, top version)``.

    Raises
    ------
    SchemaMismatchError
        Another key type or layout than the store's.
    CorruptFileError
        Damage, out-of-range stamps or counters, non-finite vectors, a delta export.
    InvalidInputError
        A key longer than the backend can store.
    """
    name = reader.name
    if reader.key_kind != store.key_type:
        raise SchemaMismatchError(f"{name}: the snapshot has {reader.key_kind} keys, the store "
                                  f"has {store.key_type} keys; nothing restored")
    if reader.layout != store.layout:
        raise SchemaMismatchError(f"{name}: the snapshot's layout ({_brief(reader.layout)}) "
                                  f"differs from the store's ({_brief(store.layout)}); "
                                  "nothing restored")
    header = reader.header or {}
    if header.get("since") is not None:
        raise CorruptFileError(f"{name}: a delta export (since {header.get('since')!r}) is not "
                               "a whole table; replace=True takes a full export; nothing restored")
    checks = ImportChecks(name, header, store, records=True, apply_deletes=True)
    rows, top = 0, int(header.get("version", 0) or 0)
    for chunk in reader.chunks(validate=True):
        if chunk.bad:
            row, why = chunk.bad[0]
            raise CorruptFileError(f"{name}: row {row + 1}: {why}; nothing restored")
        checks.chunk(chunk.keys, chunk.records, chunk.rows)
        n = len(chunk.keys)
        if n == 0:
            continue
        good = finite_rows(chunk.vectors)
        if not good.all():
            i = int(np.flatnonzero(~good)[0])
            raise CorruptFileError(f"{name}: row {int(chunk.rows[i]) + 1}: NaN or infinite "
                                   "value; nothing restored")
        assert chunk.records is not None  # native chunks carry whole records
        top = max(top, int(chunk.records["version"].max()))
        rows += n
    if top > MAX_STAMP:  # the per-record check bounds each stamp; keep the sum of them too
        raise CorruptFileError(f"{name}: version {top} is out of range; nothing restored")
    return rows, top


def _batches(store: EmbeddingStore, reader: FormatReader
             ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Pass 2: the snapshot's rows, a later duplicate of a key winning (as an import does)."""
    for chunk in reader.chunks():
        keys, recs = chunk.keys, chunk.records
        if len(keys) == 0 or recs is None:
            continue
        if store.key_type == "int64":
            keys = np.ascontiguousarray(keys, dtype=np.int64)
        if not distinct(keys):
            uniq, last = unique_last(keys)
            keys, recs = uniq, recs[last]
        yield keys, np.ascontiguousarray(recs)


def replace_table(store: EmbeddingStore, src: str | os.PathLike[str] | BinaryIO | bytes
                  ) -> tuple[int, int, int, dict]:
    """Check the native snapshot ``src`` whole, then swap it in as ``store``'s table (see the
    module docstring for the guarantee). Return ``(rows, step, version, header)``: the store
    takes on the step and version and reloads its policy state from the header."""
    if isinstance(src, (bytearray, memoryview)):
        src = bytes(src)
    with NativeFormatReader(src) as reader:
        rows, top = check_snapshot(store, reader)
        header = reader.header or {}
        step = int(header.get("step", 0) or 0)
        version = max(store.version, top) + 1  # the restore is itself a write
        meta = store.meta
        meta["step"], meta["version"] = step, version
        written = store.backend.replace_rows(_batches(store, reader), meta, rows)
    return written, step, version, header
