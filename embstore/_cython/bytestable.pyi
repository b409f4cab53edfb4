"""Type stub of the compiled bytes-key hash table (``bytestable.pyx``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import numpy as np
import numpy.typing as npt

from .arena import RecordArena
from .strkeys import KeySnapshot

_Keys = npt.NDArray[np.object_] | Sequence[bytes | str]

@final  # a final cdef class: not subclassable at runtime
class BytesTable:
    """bytes -> uint32 map (values are arena slots): fingerprint + full-key compare."""

    size: int
    rehashes: int
    @property
    def seed(self) -> int: ...
    def __init__(self, capacity: int = 1024, seed: int | None = None,
                 fingerprint_bits: int = 64) -> None: ...
    def __len__(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def find(self, keys: _Keys, out: npt.NDArray[np.uint32],
             snapshot: KeySnapshot | None = None, plain_only: bool = False) -> int: ...
    def insert_new(self, keys: _Keys, vals: npt.NDArray[np.uint32]) -> None: ...
    def erase(self, keys: _Keys, out: npt.NDArray[np.uint32]) -> int: ...
    def items(self) -> tuple[npt.NDArray[np.object_], npt.NDArray[np.uint32]]: ...
    def clear(self) -> None: ...

@final
class _SlotSet:
    """The arena slots one ``find_or_insert`` call handed out (its repeats count)."""

    def __init__(self, n: int) -> None: ...

def find_or_insert(table: BytesTable, arena: RecordArena, keys: _Keys,
                   out: npt.NDArray[np.uint32],
                   inserted_out: npt.NDArray[np.uint8] | None = None,
                   snapshot: KeySnapshot | None = None,
                   missed: npt.NDArray[np.int64] | None = None,
                   plain_only: bool = False) -> int: ...
