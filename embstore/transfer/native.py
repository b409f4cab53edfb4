"""Native export and import of a store.

Kept apart from the store (``embstore.store``) because none of it is on a training hot
path; the engine's ``export``/``import_`` methods validate state and delegate here. Imports of
every format, the native one included, run through one pipeline,
:func:`embstore.transfer.import_file` (check the whole file, then write).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from ..errors import InvalidInputError, SchemaMismatchError
from ..io.formats import NativeFormatReader
from ..io.native import NativeWriter
from ..policies.tombstones import encode_keys
from ..progress import progress_bar
from . import pipeline

if TYPE_CHECKING:
    from ..layout import Layout
    from ..store import EmbeddingStore

_MAX_HEADER_DELETIONS = 1 << 20  # keeps the JSON header within the native format's limit


def quantize_records(layout: Layout, records: np.ndarray) -> np.ndarray:
    """``records`` of ``layout`` in its int8 serving layout (:meth:`Layout.quantized`): each
    vector quantized row-wise, slots dropped, metadata kept."""
    q = layout.quantized()
    out = q.empty(len(records))
    out["vector"] = q.encode_vectors(layout.vectors(records))
    for name in q.meta_names:
        out[name] = records[name]
    return out


def export_native(store: EmbeddingStore, dest: str | os.PathLike | BinaryIO, *,
                  since: int | None, batch_size: int, progress: bool,
                  quantize: str | None = None) -> int:
    src: Iterable[tuple[np.ndarray, np.ndarray]] = (
        store.records(batch_size) if since is None else store.changes_since(since, batch_size))
    header = store.meta
    header["since"] = since
    if quantize is not None:
        if quantize != "int8":
            raise InvalidInputError(f"quantize must be 'int8', got {quantize!r}")
        layout = store.layout
        header["layout"] = layout.quantized().to_json()
        header["record_size"] = layout.quantized().itemsize
        src = ((keys, quantize_records(layout, recs)) for keys, recs in src)
    if since is not None:
        gone, complete = store.deletions_since(since)
        if len(gone) > _MAX_HEADER_DELETIONS:
            gone, complete = gone[:0], False
        header["deleted"] = encode_keys(gone, store.key_type)
        header["deletions_complete"] = complete
    # background: scans yield fresh arrays, so checksum+write can overlap the next scan
    with NativeWriter(dest, header, background=True) as w, progress_bar(
        total=len(store) if since is None and progress else None, enabled=progress,
        desc="export"
    ) as bar:
        for keys, recs in src:
            w.write(keys, recs)
            bar.update(len(keys))
    return w.rows


def import_native(store: EmbeddingStore, src: str | os.PathLike | BinaryIO | bytes, *,
                  partial: bool, progress: bool, apply_deletes: bool = False) -> int:
    """``store.import_``: the native file must hold exactly this store's records; it then
    goes through the one import pipeline (:func:`embstore.transfer.import_file`)."""
    with NativeFormatReader(src) as reader:
        if reader.key_kind != store.key_type:
            raise SchemaMismatchError(
                f"file has {reader.key_kind} keys, the store has {store.key_type} keys"
            )
        if reader.layout != store.layout:
            raise SchemaMismatchError(
                f"file layout {reader.layout} differs from the store's {store.layout}"
            )
        # read at call time: the cache size is a module setting (tests shrink it)
        report = pipeline.import_file(store, reader, partial=partial, progress=progress,
                                      cache_bytes=pipeline.DEFAULT_CACHE_BYTES,
                                      apply_deletes=apply_deletes)
        return report.rows
