"""Refusing transfers that would destroy their own source: an export into the store's own
files, a copy of a store onto itself."""

from __future__ import annotations

import os
from typing import Any

from ..errors import InvalidInputError
from .validate import local_store_paths

__all__ = ["refuse_copy_onto_urls", "refuse_own_storage", "refuse_same_storage", "storage_of"]


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


def _overlap(mine: tuple[str, ...], theirs: tuple[str, ...]) -> bool:
    return any(_inside(a, b) or _inside(b, a) for a in mine for b in theirs)


def _refuse_copy(src_url: str, dst_url: str) -> None:
    raise InvalidInputError(f"refusing to copy {src_url} onto itself ({dst_url}): the "
                            "copy would read and overwrite the same rows")


def refuse_same_storage(src: Any, dst: Any) -> None:
    """Raise ``InvalidInputError`` when a copy would read and write the same data."""
    if src is dst or src.url == dst.url or _overlap(storage_of(src), storage_of(dst)):
        _refuse_copy(src.url, dst.url)


def refuse_copy_onto_urls(src: Any, dst_urls: list[str]) -> None:
    """:func:`refuse_same_storage` for destinations not opened yet, named by URL (their local
    paths are worked out from the URL, so nothing is created to check them)."""
    mine = storage_of(src)
    for url in dst_urls:
        theirs = tuple(os.path.realpath(p) for p in local_store_paths(url))
        if url == src.url or _overlap(mine, theirs):
            _refuse_copy(src.url, url)
