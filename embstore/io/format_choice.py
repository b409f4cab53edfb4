"""Which format ``EmbeddingStore.export`` / ``import_`` use: the CLI's rules, for the API.

Kept apart from :mod:`embstore.io.formats` (the registry) so the engine's two methods stay a
small dispatch: ``format=`` wins; otherwise a path's suffix (writing) or content and suffix
(reading, as ``embstore import`` does) decides; a suffix that names no format is refused
rather than written as the native format under a misleading name.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import InvalidInputError
from .formats import _EXTENSIONS, FORMATS, detect_format, format_name


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
            f"suffixes: {', '.join(sorted(_EXTENSIONS))}; or pass format= "
            f"({', '.join(FORMATS)})") from None


def storage_of(store: Any) -> tuple[str, ...]:
    """The real paths of the local files and directories that hold ``store``'s data."""
    backend = getattr(store, "backend", None)
    paths = backend.storage_paths() if backend is not None else ()
    return tuple(os.path.realpath(p) for p in paths)


def _inside(path: str, owned: str) -> bool:
    return path == owned or path.startswith(owned.rstrip(os.sep) + os.sep)


def refuse_own_storage(store: Any, dest: Any) -> None:
    """Raise ``InvalidInputError`` when the file ``dest`` lies inside ``store``'s own storage:
    writing there (atomically, by rename) would replace the store's data with the export."""
    if not isinstance(dest, (str, os.PathLike)):
        return
    path = os.path.realpath(os.fspath(dest))
    for owned in storage_of(store):
        if _inside(path, owned):
            raise InvalidInputError(
                f"refusing to write {os.fspath(dest)!r}: it is inside the storage of {store.url} "
                f"({owned}), which the export would destroy; choose a path outside it")


def refuse_same_storage(src: Any, dst: Any) -> None:
    """Raise ``InvalidInputError`` when a copy would read and write the same data."""
    same = src is dst or src.url == dst.url
    if not same:
        mine = storage_of(src)
        same = any(_inside(a, b) or _inside(b, a) for a in mine for b in storage_of(dst))
    if same:
        raise InvalidInputError(f"refusing to copy {src.url} onto itself ({dst.url}): the "
                                "copy would read and overwrite the same rows")


def export_to(store: Any, dest: Any, fmt: str | None, *, since: int | None, batch_size: int,
              progress: bool) -> int:
    """``store.export``: the native writer, or the format writer the name asks for."""
    refuse_own_storage(store, dest)
    name = file_format(dest, fmt, for_write=True)
    if name == "native":
        from ..engine.transfer import export_native

        return export_native(store, dest, since=since, batch_size=batch_size,
                             progress=progress)
    from .transfer import export_file

    return export_file(store, dest, fmt=name, since=since, batch_size=batch_size,
                       progress=progress)


def import_from(store: Any, src: Any, fmt: str | None, *, partial: bool, progress: bool,
                apply_deletes: bool = False) -> int:
    """``store.import_``: the native reader (whole records, ``partial``, ``apply_deletes``),
    or :func:`embstore.io.transfer.import_file` for the other formats."""
    name = file_format(src, fmt, for_write=False)
    if name == "native":
        from ..engine.transfer import import_native

        return import_native(store, src, partial=partial, progress=progress,
                             apply_deletes=apply_deletes)
    from .transfer import import_file

    return import_file(store, src, fmt=name, progress=progress).rows
