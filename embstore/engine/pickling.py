"""How a pickled store comes back: never as a second writer unless someone asked for one.

A persistent store pickles by URL (DataLoader workers, ``torch.save(model)``,
``multiprocessing``). Reopening that URL read-write in the receiving process would make a second
writer nobody asked for: it writes the store's metadata (step, version) from its own stale
copy on close, e.g. a checkpoint loaded next to the training run reset Adam's step from 51 to
0. So a store pickled from a writable handle reopens **read-only**, unless the writer is asked
for explicitly with :func:`writable_unpickling`, around either the pickling (the receiving
process then reopens it writable, e.g. DataLoader workers that must write) or the unpickling
(``torch.load`` of a model that keeps training the same store).
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..urls import redact_url
from .services import reopener

if TYPE_CHECKING:
    from ..backends.base import Backend

__all__ = ["pickle_args", "reduce_store", "reopen_pickled", "writable_unpickling"]

# Process-wide, not per thread: multiprocessing.Pool pickles its tasks in a handler thread.
_lock = threading.Lock()
_depth = 0


def _requested() -> bool:
    return _depth > 0


@contextlib.contextmanager
def writable_unpickling() -> Iterator[None]:
    """Let stores pickled or unpickled inside this block reopen as writers.

    Without it a store pickled from a writable handle reopens read-only, so a copy (a
    ``torch.load``-ed model, a worker) never writes the store behind the original writer's back.
    The request holds for the whole process while the block runs (``multiprocessing.Pool``
    pickles tasks in a thread of its own).

    Examples
    --------
    >>> with embstore.writable_unpickling():          # doctest: +SKIP
    ...     model = torch.load("model.pt", weights_only=False)   # keeps training the store
    """
    global _depth
    with _lock:
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1


def pickle_args(url: str, options: dict[str, Any], read_only: bool) -> tuple:
    """The arguments :func:`reopen_pickled` gets: the writer grant is decided when pickling
    (inside :func:`writable_unpickling`) or again when unpickling."""
    return (url, options, bool(read_only), (not read_only) and _requested())


def reduce_store(backend: Backend, options: dict[str, Any], read_only: bool
                 ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A store's ``__reduce__``: reopen ``backend.url`` (the real URL, password included) with
    these reopen options; a store in this process's memory refuses to be pickled."""
    if not backend.persistent:
        raise pickle.PicklingError(
            f"a {redact_url(backend.url)} store lives in this process's memory and is not "
            "pickled: a copy would silently diverge. Use a persistent backend (lmdb://, "
            "rocksdb://, sql, bigtable://) to share a store with DataLoader workers, or "
            "export/import it.")
    # Reopens read-only unless a writer is asked for (writable_unpickling): a silent second
    # writer would overwrite the stored step/version from its stale copy.
    return reopen_pickled, pickle_args(backend.url, dict(options), read_only)


def reopen_pickled(url: str, options: dict[str, Any], read_only: bool,
                   writer_granted: bool) -> Any:
    """Reopen a pickled store: read-only unless it was a writer and a writer was asked for.

    The store's ``__reduce__`` names this function (a stable path for pickles); the reopening
    itself is :func:`embstore.api.reopen`.
    """
    writable = not read_only and (writer_granted or _requested())
    return reopener()(url, {**options, "read_only": not writable})
