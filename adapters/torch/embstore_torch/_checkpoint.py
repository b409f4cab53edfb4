"""The rows of a store inside a module's ``state_dict`` (its ``_extra_state`` entry).

A store-backed module owns no ``nn.Parameter``, so without this a checkpoint would hold no
embeddings at all. The snapshot is the store's own native export (vectors, optimizer slots,
counts, metadata; CRC-checked) as one ``bytes`` value plus the few fields a restore checks. It
is ``bytes`` rather than a tensor on purpose: ``torch.load(weights_only=True)`` accepts it, and
``torch.distributed.checkpoint`` saves non-tensor values as byte blobs that a load *replaces*,
whereas it loads tensors in place into tensors of the same shape, which a table that grew or
shrank since the module was built does not have.

Large persistent tables are not copied into memory: ``torch.save`` pickles its whole object
into memory before writing, so rows carried inline always cost their size in RAM. A persistent
store whose records exceed :data:`INLINE_BYTES` (or any store, with ``checkpoint_rows=False``)
is carried as a *reference*: the store is flushed and the snapshot records its URL, step and
``version``; the rows stay in the store, and :mod:`embstore_torch.checkpoint` streams them to a
file beside the checkpoint when a self-contained copy is wanted.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

from embstore import StoreProtocol
from embstore.errors import (
    CorruptFileError,
    EmbstoreError,
    ReadOnlyError,
    SchemaMismatchError,
)
from embstore.io.base import MAX_DIM
from embstore.io.limits import MAX_STAMP

FORMAT = "embstore.rows/1"


#: records (bytes) of a persistent store carried inline in a ``state_dict``; a larger table is
#: carried as a reference to its flushed version (see the module docstring)
INLINE_BYTES = 64 << 20


def _inline(store: StoreProtocol, rows: bool | int) -> bool:
    """Whether ``store``'s rows go into the snapshot. ``rows``: the module's
    ``checkpoint_rows`` (True: memory stores always, persistent ones up to INLINE_BYTES;
    False: never; an int: up to that many bytes of records)."""
    if rows is False:
        return False
    persistent = bool(getattr(getattr(store, "backend", None), "persistent", False))
    if rows is True and not persistent:
        return True
    limit = INLINE_BYTES if rows is True else int(rows)
    return _rows_at_most(store, limit // int(store.layout.itemsize))


def _rows_at_most(store: StoreProtocol, most: int) -> bool:
    """``len(store) <= most``, reading at most ``most`` rows where counting means a scan
    (RocksDB, Bigtable): a large table is told apart without reading all of it."""
    backend = getattr(store, "backend", None)
    if backend is None or backend.cheap_len:
        return len(store) <= most
    seen = 0
    for keys, _ in store.records(4096):
        seen += len(keys)
        if seen > most:
            return False
    return True


def store_state(store: StoreProtocol, rows: bool | int = True) -> dict[str, Any]:
    """A snapshot of every record of ``store`` and its step, as plain Python values; or a
    reference to the store's flushed version (``"rows"`` None, ``"version"`` set) when the
    rows are not carried (see :func:`_inline`)."""
    state: dict[str, Any] = {"format": FORMAT, "url": store.url, "dim": int(store.dim),
                             "key_type": store.key_type}
    if _inline(store, rows):
        buf = io.BytesIO()
        store.export(buf)
        state.update(step=int(store.step), rows=buf.getvalue())
        return state
    if not store.read_only:
        store.flush()  # the referenced version is on disk
    state.update(step=int(store.step), rows=None, version=int(store.version))
    return state


#: every field a snapshot may carry, with its declared type (anything else is refused)
_FIELDS: dict[str, tuple[type, ...]] = {
    "format": (str,), "url": (str,), "dim": (int,), "key_type": (str,), "step": (int,),
    "rows": (bytes, bytearray, memoryview, type(None)), "version": (int,),
}
_REQUIRED = ("format", "dim", "key_type", "step", "rows")


def check_state(state: Any, what: str) -> dict[str, Any]:
    """The snapshot's fields, each of its declared type and range; ``CorruptFileError``
    (one line, nothing touched) otherwise. Nothing in a snapshot is followed: ``url`` is
    informational, ``rows`` is data (a ``str`` there is refused, never opened as a path)."""
    if not isinstance(state, dict):
        raise CorruptFileError(f"{what}: not an embstore rows snapshot ({FORMAT}): a "
                               f"{type(state).__name__}, not a dict")
    extra = sorted(str(k)[:40] for k in state if k not in _FIELDS)
    if extra:
        raise CorruptFileError(f"{what}: unknown snapshot field(s) {extra[:5]}; refused")
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise CorruptFileError(f"{what}: snapshot field(s) {missing} missing; refused")
    for k, v in state.items():
        if not isinstance(v, _FIELDS[k]) or isinstance(v, bool):
            raise CorruptFileError(f"{what}: snapshot field {k!r} is a {type(v).__name__}, not "
                                   f"{' or '.join(t.__name__ for t in _FIELDS[k])}; refused")
    if state["format"] != FORMAT:
        raise CorruptFileError(f"{what}: not an embstore rows snapshot ({FORMAT}): format "
                               f"{state['format'][:40]!r}")
    if state["key_type"] not in ("int64", "bytes"):
        raise CorruptFileError(f"{what}: snapshot key_type {state['key_type'][:40]!r} is not "
                               "int64 or bytes")
    if not 0 < state["dim"] <= MAX_DIM:
        raise CorruptFileError(f"{what}: snapshot dim {state['dim']} is out of range")
    for f in ("step", "version"):
        if f in state and not 0 <= state[f] <= MAX_STAMP:
            raise CorruptFileError(f"{what}: snapshot {f} {state[f]} is out of range "
                                   "[0, 2**62]")
    return state


def restore_store(store: StoreProtocol, state: Any, where: str = "") -> None:
    """Make ``store`` hold exactly the snapshot ``state``: its rows (vectors, slots, counts)
    and its step, or (on any error) leave it as it was.

    The snapshot's fields are checked (:func:`check_state`), then its rows go through
    ``store.import_(rows, replace=True)``: the whole snapshot is verified before anything is
    written, and the table is swapped in atomically (``embstore/transfer/replace.py``).
    ``version`` keeps moving forward.
    """
    what = f"{where} checkpoint of {store.url}".strip()
    state = check_state(state, what)
    if state["dim"] != store.dim or state["key_type"] != store.key_type:
        raise SchemaMismatchError(
            f"{what}: the snapshot has dim={state['dim']}, key_type={state['key_type']!r}; "
            f"the store has dim={store.dim}, key_type={store.key_type!r}")
    rows = state["rows"]
    if rows is None:  # a reference: the rows are the store's own (nothing to load)
        version = state.get("version")
        if version is not None and version != store.version:
            warnings.warn(
                f"{what}: the checkpoint references version {version} of the store, which has "
                f"moved on to {store.version}; its rows are kept as they are (restore them "
                "from a copy saved with embstore_torch.checkpoint.save)", stacklevel=4)
        return
    if store.read_only:
        raise ReadOnlyError(f"{what}: the store is open read-only; load_state_dict writes it")
    try:
        store.import_(bytes(rows) if not isinstance(rows, bytes) else rows, replace=True)
    except EmbstoreError as e:  # name the module and store, keep the error's type
        raise type(e)(f"{what}: {e}") from e
    store.flush()
