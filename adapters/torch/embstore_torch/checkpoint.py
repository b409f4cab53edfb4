"""Self-contained checkpoints of models whose tables are too large for a ``state_dict``.

``model.state_dict()`` carries a persistent store's rows inline only up to
``embstore_torch._checkpoint.INLINE_BYTES`` (64 MiB of records); a larger table is carried as
a reference to its flushed version, because ``torch.save`` builds its whole pickle in memory.
:func:`save` adds what a reference lacks: every referenced table streamed (bounded memory) to
a native export beside the checkpoint, and :func:`load` restores those rows atomically
(``store.import_(..., replace=True)``) before loading the state dict::

    import embstore_torch.checkpoint as ckpt

    ckpt.save(model, "/ckpt/step-1000.pt")   # the .pt file and /ckpt/step-1000.pt.rows/
    ckpt.load(model, "/ckpt/step-1000.pt")   # rows, step, dense weights: all as saved

The export files are named after the module (its name in ``model``) and the referenced version,
never after anything read from the checkpoint, and are read only from the ``.rows`` directory
beside the path the caller gives.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from embstore.errors import InvalidInputError
from embstore.transfer.own_storage import refuse_own_storage

from .modules import StoreModule, store_is_collective

__all__ = ["EXPORT_CHUNK_BYTES", "load", "rows_dir", "save"]

#: records read from a store per step of a streamed export (the memory a save adds is a small
#: multiple of this, whatever the table's size)
EXPORT_CHUNK_BYTES = 4 << 20


def rows_dir(path: str | os.PathLike[str]) -> str:
    """The directory beside ``path`` that holds the streamed tables."""
    return os.fspath(path) + ".rows"


def _store_modules(model: torch.nn.Module) -> list[tuple[str, Any]]:
    out = []
    for name, m in model.named_modules():
        if isinstance(m, StoreModule):
            if store_is_collective(m.store):
                raise InvalidInputError(
                    f"{name or 'the model'} is over a distributed store: save each rank's "
                    "state_dict (torch.save per rank, or torch.distributed.checkpoint)")
            out.append((name, m))
    return out


def _key(name: str) -> str:
    return f"{name}._extra_state" if name else "_extra_state"


def _file(path: str | os.PathLike[str], name: str, version: int) -> str:
    return os.path.join(rows_dir(path), f"{name or 'root'}.v{int(version)}.emb")


def save(model: torch.nn.Module, path: str | os.PathLike[str]) -> dict[str, Any]:
    """``torch.save(model.state_dict(), path)`` plus every table the state dict references
    (rather than carries) streamed to ``path + ".rows/"``; returns the state dict saved.

    The ``.pt`` file is written last and atomically (it names the versions it needs); export
    files of versions it no longer names are removed afterwards.

    Raises
    ------
    InvalidInputError
        ``path`` (or its ``.rows`` directory) lies inside the storage of one of the model's
        stores (``<lmdb dir>/data.mdb``, ``<rocksdb dir>/CURRENT``, a SQLite file...): the
        rename that installs the checkpoint would replace the store's own files. Nothing is
        written.
    """
    modules = _store_modules(model)
    for _, m in modules:  # before anything is written: the rename would destroy the store
        refuse_own_storage(m.store, path)
        refuse_own_storage(m.store, rows_dir(path))
    sd = model.state_dict()
    wanted = set()
    for name, m in modules:
        state = sd[_key(name)]
        if state.get("rows") is None and isinstance(state.get("version"), int):
            os.makedirs(rows_dir(path), exist_ok=True)
            f = _file(path, name, state["version"])
            rows = max(256, EXPORT_CHUNK_BYTES // int(m.store.layout.itemsize))
            m.store.export(f, batch_size=rows)  # streamed; written beside, renamed (atomic)
            wanted.add(os.path.basename(f))
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    try:
        torch.save(sd, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if os.path.isdir(rows_dir(path)):
        for f in os.listdir(rows_dir(path)):
            if f.endswith(".emb") and f not in wanted:
                os.unlink(os.path.join(rows_dir(path), f))
    return sd


def load(model: torch.nn.Module, path: str | os.PathLike[str], *, strict: bool = True) -> Any:
    """Restore a checkpoint written by :func:`save`: each referenced table from its export
    (checked whole, swapped in atomically), then ``model.load_state_dict``. Returns what
    ``load_state_dict`` returns."""
    sd = torch.load(path, weights_only=True)
    for name, m in _store_modules(model):
        state = sd.get(_key(name))
        if not (isinstance(state, dict) and state.get("rows") is None):
            continue
        version = state.get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            continue  # load_state_dict names what is wrong with the entry
        f = _file(path, name, version)
        if os.path.isfile(f):
            m.store.import_(f, replace=True)
            # the store now holds the referenced rows again (at a new version)
            sd[_key(name)] = {**state, "version": int(m.store.version)}
    return model.load_state_dict(sd, strict=strict)
