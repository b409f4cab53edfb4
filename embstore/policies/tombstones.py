"""The tombstone log: which keys were deleted after a version, for incremental sync.

``changes_since`` can only stream rows that exist. To bring a serving copy to the same state,
a delta must also carry deletions (explicit deletes, expiry, eviction, FTRL pruning). The
engine stamps every delete with a version and keeps ``(key, version)`` here. The log is
bounded: past ``max_entries`` the oldest entries are dropped and ``floor`` rises to the newest
dropped version. A delta ``since=v`` is *complete* only for ``v >= floor``; otherwise the
caller should ship a full export. The most recent ``persist_entries`` tombstones are saved in
the store metadata, so the log survives reopen (deletions made by *other* processes writing
the same store are not seen by this log).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np


class TombstoneLog:
    def __init__(self, key_type: str, floor: int = 0, max_entries: int = 1 << 20,
                 persist_entries: int = 1 << 14, *,
                 entries: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        self.key_type = key_type
        self.floor = int(floor)
        self.max_entries, self.persist_entries = int(max_entries), int(persist_entries)
        self._keys: list[np.ndarray] = []
        self._versions: list[np.ndarray] = []
        self._n = 0
        if entries is not None and len(entries[0]):  # (keys, versions), oldest first
            keys, versions = entries
            self._keys, self._versions = [keys], [versions.astype(np.int64)]
            self._n = len(keys)

    def __len__(self) -> int:
        return self._n

    def add(self, keys: np.ndarray, version: int) -> None:
        if len(keys) == 0:
            return
        self._keys.append(np.asarray(keys).copy())
        self._versions.append(np.full(len(keys), int(version), dtype=np.int64))
        self._n += len(keys)
        if self._n > self.max_entries:
            self._trim(self.max_entries // 2)

    @classmethod
    def from_entries(cls, key_type: str, keys: np.ndarray, versions: np.ndarray,
                     floor: int = 0) -> TombstoneLog:
        """A log holding ``(key, version)`` entries (aligned arrays, oldest first)."""
        return cls(key_type, floor=floor, entries=(keys, versions))

    def entries(self) -> tuple[np.ndarray, np.ndarray]:
        """Every ``(key, version)`` entry as two aligned arrays, oldest first."""
        return self._flat()

    def _flat(self) -> tuple[np.ndarray, np.ndarray]:
        if not self._keys:
            dt = np.int64 if self.key_type == "int64" else object
            return np.zeros(0, dtype=dt), np.zeros(0, dtype=np.int64)
        if len(self._keys) > 1:
            self._keys = [np.concatenate(self._keys)]
            self._versions = [np.concatenate(self._versions)]
        return self._keys[0], self._versions[0]

    def _trim(self, keep: int) -> None:
        keys, vers = self._flat()
        if len(keys) <= keep:
            return
        cut = len(keys) - keep
        self.floor = max(self.floor, int(vers[:cut].max()))
        self._keys, self._versions = [keys[cut:]], [vers[cut:]]
        self._n = keep

    def since(self, version: int) -> tuple[np.ndarray, bool]:
        """Unique keys deleted after ``version`` and whether the log covers ``version``."""
        keys, vers = self._flat()
        sel = keys[vers > version]
        if len(sel):
            sel = np.unique(sel)
        return sel, int(version) >= self.floor

    # -- persistence (JSON-safe) ------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        keys, vers = self._flat()
        floor = self.floor
        if len(keys) > self.persist_entries:
            cut = len(keys) - self.persist_entries
            floor = max(floor, int(vers[:cut].max()))
            keys, vers = keys[cut:], vers[cut:]
        return {"floor": floor, "keys": encode_keys(keys, self.key_type),
                "versions": base64.b64encode(vers.astype("<i8").tobytes()).decode("ascii")}

    @classmethod
    def from_json(cls, key_type: str, obj: dict[str, Any] | None, version: int) -> TombstoneLog:
        if not obj:
            # A store from before the log existed: nothing is known before its current version.
            return cls(key_type, floor=version)
        keys = decode_keys(obj.get("keys"), key_type)
        vers = np.frombuffer(base64.b64decode(obj.get("versions", "")), dtype="<i8")
        return cls(key_type, floor=int(obj.get("floor", version)),
                   entries=(keys, vers) if len(keys) == len(vers) else None)


def encode_keys(keys: np.ndarray, key_type: str) -> Any:
    """Keys as JSON-safe text: int64 as base64 of little-endian bytes, bytes as base64 each."""
    if key_type == "int64":
        return base64.b64encode(np.asarray(keys, dtype="<i8").tobytes()).decode("ascii")
    return [base64.b64encode(k).decode("ascii") for k in keys]


def decode_keys(obj: Any, key_type: str) -> np.ndarray:
    if key_type == "int64":
        raw = base64.b64decode(obj or "")
        return np.frombuffer(raw, dtype="<i8").astype(np.int64)
    out = np.empty(len(obj or ()), dtype=object)
    out[:] = [base64.b64decode(s) for s in (obj or ())]
    return out
