"""The checks an import runs in its first pass, before anything is written.

Both native pipelines (``store.import_`` and ``embstore import``/``import_file``) build one
:class:`ImportChecks` from the file's header and the target store, and run
:meth:`ImportChecks.chunk` on every chunk of the checking pass. A refused file therefore
leaves the store untouched (and a store created for it is never created). See
``embstore/io/limits.py`` for the bounds themselves.
"""

from __future__ import annotations

import os
import shutil
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from ..backends.base import Backend
from ..engine.protocols import StoreInfo
from ..errors import CorruptFileError, EmbstoreError, InvalidInputError
from ..io.limits import (
    check_count,
    check_header,
    check_key_lengths,
    check_slots,
    check_stamps,
    max_key_bytes,
)
from ..policies.admission import decode_state
from ..policies.tombstones import decode_keys
from ..registry import backend_class


class ImportChecks:
    """File-wide checks done once (header, deletions, policy state) plus per-chunk checks
    (record stamps, optimizer slots, key lengths against the target backend). Every import
    of whole records runs them: ``store.import_`` (``replace=True`` too, so the torch and TF
    snapshot restores), ``embstore import``, ``import_file``.

    Parameters
    ----------
    name : str
        The file, for messages.
    header : dict or None
        Store metadata carried by the file.
    store : EmbeddingStore or NewStore
        The target.
    records : bool
        True when whole records (with stamps) are loaded.
    apply_deletes : bool
        Allow a full export (``since`` null) that lists deleted keys to delete them.
    """

    def __init__(self, name: str, header: dict[str, Any] | None, store: Any, *,
                 records: bool, apply_deletes: bool = False, row_word: str = "row",
                 row_offset: int = 1) -> None:
        self.name, self.records = name, records
        self.row_word, self.row_offset = row_word, row_offset
        check_header(name, header)
        self.deleted = _deletions(name, header, store, apply_deletes) if records else None
        if records:
            _check_policy_state(name, header, store)
        self.key_limit, self.target = target_key_limit(store)
        layout, opt = store.layout, getattr(store, "optimizer", None)
        self.slots = (layout.slot_names, layout.slot_dtype,
                      tuple(getattr(opt, "nonnegative_slots", ())))

    def chunk(self, keys: np.ndarray, records: np.ndarray | None,
              rows: np.ndarray | None = None) -> None:
        """Refuse the file when a chunk holds a record or key the target cannot take."""
        if self.records:
            check_stamps(self.name, records, rows, self.row_word, self.row_offset)
            check_slots(self.name, records, *self.slots, rows=rows, row_word=self.row_word,
                        row_offset=self.row_offset)
        check_key_lengths(self.name, keys, self.key_limit, self.target, rows, self.row_word,
                          self.row_offset)


def _deletions(name: str, header: dict[str, Any] | None, store: Any,
               apply_deletes: bool) -> np.ndarray | None:
    """The keys a native file asks to delete, decoded and checked; None when it lists none.

    A delta (``since`` set) carries the deletions since its base version and applies them. A
    full export (``since`` null) has no business deleting anything: such a file is refused
    unless ``apply_deletes`` says the deletions are wanted.
    """
    listed = (header or {}).get("deleted")
    if not listed:
        return None
    try:
        keys = decode_keys(listed, store.key_type)
    except (ValueError, TypeError) as e:
        raise CorruptFileError(f"{name}: the deleted-key list is damaged: {e}") from e
    if (header or {}).get("since") is None and not apply_deletes:
        raise CorruptFileError(
            f"{name}: a full export (since: null) that lists {len(keys)} deleted keys; "
            "nothing imported (pass apply_deletes=True / --apply-deletes to delete them)")
    return keys


def _check_policy_state(name: str, header: dict[str, Any] | None, store: Any) -> None:
    """Decode the admission state the import would take over (bounded by the policy's own
    size), so a damaged or oversized state refuses the file in the first pass."""
    extra = (header or {}).get("extra") or {}
    st = extra.get("policies") if isinstance(extra, dict) else None
    if not st:
        return
    if not isinstance(st, dict):
        raise CorruptFileError(f"{name}: header policy state is not an object")
    if "updates_since_expire" in st:
        check_count(name, "updates_since_expire", st["updates_since_expire"])
    adm = st.get("admission")
    policy = getattr(store, "admission", None)  # None for a store still to be created
    if not adm or policy is None or not isinstance(adm, dict):
        return
    if policy.config() != adm.get("config") or not adm.get("state"):
        return
    try:
        raw = decode_state(adm["state"], policy.max_state_bytes())
    except InvalidInputError as e:
        raise CorruptFileError(f"{name}: {e}") from e
    try:  # the state must also load: try it on a copy of the policy
        type(policy)(**{k: v for k, v in policy.config().items() if k != "name"}
                     ).load_state(raw)
    except EmbstoreError as e:
        raise CorruptFileError(f"{name}: header admission state does not load: {e}") from e
    except (ValueError, TypeError):
        raise CorruptFileError(f"{name}: header admission state does not load") from None


def target_key_limit(store: StoreInfo) -> tuple[int | None, str]:
    """``(max key bytes, what)`` for the target store or a store still to be created."""
    backend = getattr(store, "backend", None)
    if backend is not None:
        return max_key_bytes(backend), store.url
    url = getattr(store, "url", "")
    urls = [url] + [u for u in (getattr(store, "options", {}).get("shards") or ())
                    if isinstance(u, str)]
    limits = []
    for u in urls:
        try:
            cls = backend_class(u)
            # a class attribute here; a property (SQL: per dialect) tells nothing before open
            limit = cls.max_key_bytes if issubclass(cls, Backend) else None
        except EmbstoreError:
            continue
        if isinstance(limit, int):
            limits.append(limit)
    return (min(limits) if limits else None), url


# -- a store created for an import that then failed ------------------------------------------------
def local_store_paths(url: str) -> list[str]:
    """Files or directories a local store URL creates (empty for remote or memory stores)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("lmdb", "rocksdb") and parts.path:
        return [parts.path]
    if scheme.startswith("sqlite") and parts.path.startswith("/"):
        path = parts.path[1:]  # SQLAlchemy: sqlite:///rel.db, sqlite:////abs.db
        return [path, path + "-wal", path + "-shm", path + "-journal"]
    return []


def remove_created(paths: list[str]) -> None:
    """Remove what a failed import created (only paths that did not exist before it)."""
    for p in paths:
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.lexists(p):
            try:
                os.unlink(p)
            except OSError:
                pass
