"""Import, export, copy and verify: moving rows between stores and files.

This package sits above both the store (:mod:`embstore.store`) and the file codecs
(:mod:`embstore.io`, which know no store). It creates stores only through the opener
:mod:`embstore.api` hands it (:func:`embstore.engine.services.opener`), and it gives the
store its ``export`` / ``import_`` through
:mod:`embstore.engine.services` when imported (``import embstore`` imports it).

>>> import embstore
>>> from embstore.transfer import export_file, import_file, verify_store
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..engine import services
from .format_choice import export_to, file_format, import_from
from .native import export_native, import_native
from .parts import (
    MANIFEST_NAME,
    Part,
    PartResult,
    finish_manifest,
    part_records,
    pending_parts,
    plan_parts,
    run_part,
)
from .pipeline import (
    DEFAULT_CACHE_BYTES,
    ImportReport,
    NewStore,
    check_compatible,
    copy_store,
    creation_options,
    export_file,
    import_file,
)
from .replace import replace_table
from .verify import VerifyReport, row_digests, verify_file, verify_store

if TYPE_CHECKING:
    import os

    from ..store import EmbeddingStore

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "ImportReport",
    "MANIFEST_NAME",
    "NewStore",
    "Part",
    "PartResult",
    "VerifyReport",
    "check_compatible",
    "copy_store",
    "creation_options",
    "export_file",
    "export_native",
    "file_format",
    "finish_manifest",
    "import_file",
    "import_native",
    "part_records",
    "pending_parts",
    "plan_parts",
    "row_digests",
    "run_part",
    "verify_file",
    "verify_store",
]


class _StoreTransfers:
    """:class:`embstore.engine.services.Transfers`: what a store's own methods delegate to."""

    def export(self, store: EmbeddingStore, dest: str | os.PathLike[str] | Any,
               fmt: str | None, *, since: int | None, batch_size: int,
               progress: bool, quantize: str | None = None) -> int:
        return export_to(store, dest, fmt, since=since, batch_size=batch_size,
                         progress=progress, quantize=quantize)

    def import_(self, store: EmbeddingStore, src: Any, fmt: str | None, *, partial: bool,
                progress: bool, apply_deletes: bool) -> int:
        return import_from(store, src, fmt, partial=partial, progress=progress,
                           apply_deletes=apply_deletes)

    def replace(self, store: EmbeddingStore, src: Any) -> tuple[int, int, int, dict]:
        return replace_table(store, src)


services.install(transfers=_StoreTransfers())
