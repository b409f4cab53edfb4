"""Type stub of the compiled int64 cuckoo hash table (``cuckoo.pyx``)."""

from __future__ import annotations

from typing import final

import numpy as np
import numpy.typing as npt

from .arena import RecordArena

@final  # a final cdef class: not subclassable at runtime
class CuckooTable:
    """int64 -> uint32 map with cuckoo hashing. Values are arena slot numbers."""

    size: int
    rehashes: int
    @property
    def seed(self) -> int:
        """The table's 64-bit hash seed (random unless given); read-only."""
    def __init__(self, capacity: int = 1024, prefault: bool = True,
                 seed: int | None = None, huge_pages: bool = True) -> None: ...
    def __len__(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def find(self, keys: npt.NDArray[np.int64], out: npt.NDArray[np.uint32]) -> int: ...
    def insert_new(self, keys: npt.NDArray[np.int64], vals: npt.NDArray[np.uint32]) -> None: ...
    def erase(self, keys: npt.NDArray[np.int64], out: npt.NDArray[np.uint32]) -> int: ...
    def items(self, keys_out: npt.NDArray[np.int64], vals_out: npt.NDArray[np.uint32]) -> int: ...
    def clear(self) -> None: ...

def find_or_insert(table: CuckooTable, arena: RecordArena, keys: npt.NDArray[np.int64],
                   out: npt.NDArray[np.uint32],
                   inserted_out: npt.NDArray[np.uint8] | None = None) -> int: ...

def _fail_next_grows(n: int) -> None: ...
