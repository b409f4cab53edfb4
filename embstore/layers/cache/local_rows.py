"""The cache layer's local rows: the local store and the key -> slot index over it.

A slot-addressed local store (``memory://``, :class:`~embstore.backends.base.SlotAddressed`)
is its own index: one hash probe finds a key's slot and its bytes. Any other local store
(LMDB, ...) gets a ``memory://`` index beside it that holds only the keys.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...backends.base import Backend, SlotAddressed
from ...backends.memory import MemoryBackend
from ...layout import Layout

__all__ = ["EMPTY_SLOT", "LocalRows"]

#: the slot of a key that is not cached
EMPTY_SLOT = np.uint32(0xFFFFFFFF)


class LocalRows:
    """Rows cached in ``local``, addressed by slot.

    Attributes
    ----------
    local : Backend
        The local store.
    index : Backend (SlotAddressed)
        ``local`` itself when it is slot-addressed, else a ``memory://`` index of the keys.
    shared : bool
        ``index is local``: rows are read and written by slot.
    """

    def __init__(self, local: Backend) -> None:
        self.local = local
        self.index: Any = (local if local.supports_slots and isinstance(local, SlotAddressed)
                           else MemoryBackend("memory://"))
        self.shared = self.index is local

    def bind(self, layout: Layout, key_type: str) -> None:
        self.local.bind(layout, key_type)
        if not self.shared:
            self.index.bind(Layout(1), key_type)

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The slot of each key and whether it is cached."""
        slots = self.index.find_slots(keys)
        return slots, slots != EMPTY_SLOT

    def read(self, keys: np.ndarray, slots: np.ndarray, field: str | None = None) -> np.ndarray:
        """Rows of cached keys (zero rows where ``slots`` is empty)."""
        if not self.shared:
            if field is None:
                return self.local.get(keys)[0]
            return self.local.get_field(keys, field)[0]
        return self.index.read_slots(slots, field)

    def write(self, keys: np.ndarray, records: np.ndarray, slots: np.ndarray,
              found: np.ndarray) -> None:
        """Overwrite the cached rows of ``keys[found]`` (their ``slots`` are known)."""
        if not self.shared:
            self.local.put(keys[found], records[found])
            return
        # Same slots, new bytes: the key -> slot map does not change, so writing straight to
        # the slots is what memory:// put would do after a second probe of every key.
        if found.all():
            self.index.write_slots(slots, records)
        else:
            self.index.write_slots(slots[found], records[found])

    def insert(self, keys: np.ndarray, records: np.ndarray) -> np.ndarray:
        """Cache rows of keys not cached yet; return their slots."""
        self.local.put(keys, records)
        if not self.shared:
            self.index.put(keys, self.index.layout.empty(len(keys)))
        return self.index.find_slots(keys)

    def remove(self, keys: np.ndarray) -> None:
        self.local.delete(keys)
        if not self.shared:
            self.index.delete(keys)

    def clear(self) -> None:
        self.local.clear()
        if not self.shared:
            self.index.clear()

    def close(self) -> None:
        try:
            self.local.close()
        finally:
            if not self.shared:
                self.index.close()
