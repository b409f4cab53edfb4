"""Which format ``EmbeddingStore.export`` / ``import_`` use: the CLI's rules, for the API.

Kept apart from :mod:`embstore.io.formats` (the codecs' registry, which knows no store):
``format=`` wins; otherwise a path's suffix (writing) or content and suffix (reading, as
``embstore import`` does) decides; a suffix that names no format is refused
rather than written as the native format under a misleading name.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError
from ..io.formats import EXTENSIONS, FORMATS, detect_format, format_name
from .native import export_native, import_native
from .own_storage import refuse_own_storage
from .pipeline import export_file, import_file

if TYPE_CHECKING:
    from ..store import EmbeddingStore


def file_format(target: Any, fmt: str | None, *, for_write: bool) -> str:
    """The canonical format name for exporting to / importing from ``target``.

    Parameters
    ----------
    target : path, file object or bytes
        File objects and bytes are native only (the other formats need a path).
    fmt : str, optional
        An explicit format name (``"native"``, ``"parquet"``, ``"npz"``, ...).
    for_write : bool
        Export (decide from the name) or import (from the content, then the name).
    """
    if not isinstance(target, (str, os.PathLike)):
        if fmt is not None and format_name(fmt) != "native":
            raise InvalidInputError(
                f"format={fmt!r} needs a path; file objects and bytes carry the native format")
        return "native"
    if fmt is not None:
        return format_name(fmt)
    path = os.fspath(target)
    is_dir_name = path.endswith(("/", os.sep))
    suffix = os.path.splitext(path.rstrip("/\\"))[1]
    if not for_write:
        if not os.path.exists(path):
            return "native"  # import_native raises the missing-file error
        try:
            return detect_format(path)
        except InvalidInputError:
            raise InvalidInputError(
                f"cannot tell the format of {path!r} from its content or name; pass format= "
                f"({', '.join(FORMATS)})") from None
    if not suffix and not is_dir_name:
        return "native"  # a bare name (a temp file, a checkpoint) keeps the native format
    try:
        return detect_format(path, for_write=True)
    except InvalidInputError:
        raise InvalidInputError(
            f"cannot tell the export format of {path!r} from its suffix {suffix!r}; known "
            f"suffixes: {', '.join(sorted(EXTENSIONS))}; or pass format= "
            f"({', '.join(FORMATS)})") from None


def export_to(store: EmbeddingStore, dest: Any, fmt: str | None, *, since: int | None,
              batch_size: int, progress: bool, quantize: str | None = None) -> int:
    """``store.export``: the native writer, or the format writer the name asks for."""
    refuse_own_storage(store, dest)
    name = file_format(dest, fmt, for_write=True)
    if name == "native":
        return export_native(store, dest, since=since, batch_size=batch_size,
                             progress=progress, quantize=quantize)
    if quantize is not None:
        raise InvalidInputError(f"quantize={quantize!r} writes the native format (a serving "
                                f"table a store imports), not {name}")
    return export_file(store, dest, fmt=name, since=since, batch_size=batch_size,
                       progress=progress)


def import_from(store: EmbeddingStore, src: Any, fmt: str | None, *, partial: bool,
                progress: bool, apply_deletes: bool = False) -> int:
    """``store.import_``: the native reader (whole records, ``partial``, ``apply_deletes``),
    or :func:`embstore.transfer.import_file` for the other formats."""
    name = file_format(src, fmt, for_write=False)
    if name == "native":
        return import_native(store, src, partial=partial, progress=progress,
                             apply_deletes=apply_deletes)
    return import_file(store, src, fmt=name, progress=progress).rows
