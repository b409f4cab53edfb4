"""What the engine needs from the layers above it, handed down instead of imported.

The dependency rule is that modules import downwards only: ``embstore.transfer`` (import,
export, copy) and ``embstore.api`` (opening, reopening) sit above the store and use it. Three
things still run the other way: ``EmbeddingStore.export`` / ``import_`` go
through the transfer pipeline, a pickled store reopens through ``embstore.api``, and an import
that creates its target store opens it through ``embstore.api``. Those layers install
themselves here when imported (``import embstore`` imports both), so the engine and the
transfers depend on the declared protocols below, never on the modules that implement them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, BinaryIO, Protocol

from ..errors import EmbstoreError

__all__ = ["Transfers", "install", "opener", "reopener", "transfers"]


class Transfers(Protocol):
    """The whole-table moves of a store (implemented by :mod:`embstore.transfer`).

    ``store`` is an :class:`embstore.EmbeddingStore`; it is typed ``Any`` here because this
    module sits below the store, which calls it (naming the class would be an import cycle).
    """

    def export(self, store: Any, dest: str | os.PathLike[str] | BinaryIO,
               fmt: str | None, *, since: int | None, batch_size: int,
               progress: bool, quantize: str | None = None) -> int:
        """``store.export``: write the store's records in the format ``fmt`` or the name asks."""
        ...

    def import_(self, store: Any, src: str | os.PathLike[str] | BinaryIO | bytes,
                fmt: str | None, *, partial: bool, progress: bool,
                apply_deletes: bool) -> int:
        """``store.import_``: check the whole file, then write it; return rows imported."""
        ...

    def replace(self, store: Any, src: str | os.PathLike[str] | BinaryIO | bytes
                ) -> tuple[int, int, int, dict]:
        """``store.import_(replace=True)``: check the native snapshot whole, swap it in;
        return ``(rows, step, version, header)``."""
        ...


class _Installed:
    transfers: Transfers | None = None
    opener: Callable[..., Any] | None = None
    reopener: Callable[..., Any] | None = None


def install(*, transfers: Transfers | None = None, opener: Callable[..., Any] | None = None,
            reopener: Callable[..., Any] | None = None) -> None:
    """Hand the engine its services (called by :mod:`embstore.transfer` and
    :mod:`embstore.api` when they are imported)."""
    if transfers is not None:
        _Installed.transfers = transfers
    if opener is not None:
        _Installed.opener = opener
    if reopener is not None:
        _Installed.reopener = reopener


class _NotInstalledError(EmbstoreError, RuntimeError):
    """A service of an upper layer was used before that layer was imported."""


def _missing(what: str, module: str) -> _NotInstalledError:
    return _NotInstalledError(f"{what} needs {module}, which is installed by `import embstore`")


def transfers() -> Transfers:
    """The installed transfer pipeline."""
    if _Installed.transfers is None:
        raise _missing("export and import", "embstore.transfer")
    return _Installed.transfers


def opener() -> Callable[..., Any]:
    """``embstore.open``: how a transfer opens a store it creates."""
    if _Installed.opener is None:
        raise _missing("opening a store", "embstore.api")
    return _Installed.opener


def reopener() -> Callable[..., Any]:
    """How a pickled store comes back (:func:`embstore.api.reopen`)."""
    if _Installed.reopener is None:
        raise _missing("pickling a store", "embstore.api")
    return _Installed.reopener
