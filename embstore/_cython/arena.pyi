"""Type stub of the compiled record arena (``arena.pyx``)."""

from __future__ import annotations

from typing import final

import numpy as np
import numpy.typing as npt

@final  # a final cdef class: not subclassable at runtime
class RecordArena:
    """Fixed-width records in chunks; slots are uint32 indices, freed slots are reused."""

    itemsize: int
    chunk_rows: int
    prefault: bool
    @property
    def huge_pages(self) -> bool:
        """Whether the chunks are advised onto transparent huge pages; read-only."""
    def __init__(self, itemsize: int, chunk_shift: int = -1, prefault: bool = True,
                 huge_pages: bool = True) -> None: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def live(self) -> int: ...
    def alloc(self, out: npt.NDArray[np.uint32]) -> None: ...
    def release(self, slots: npt.NDArray[np.uint32]) -> None: ...
    def gather(self, slots: npt.NDArray[np.uint32], out: npt.NDArray[np.uint8],
               offset: int = 0, nbytes: int = -1) -> None: ...
    def scatter(self, slots: npt.NDArray[np.uint32], src: npt.NDArray[np.uint8]) -> None: ...
    def update_rows(self, slots: npt.NDArray[np.uint32], axpy_offset: int,
                    x: npt.NDArray[np.float32], alpha: float,
                    add_offsets: npt.NDArray[np.intp], add_values: npt.NDArray[np.int64],
                    set_offsets: npt.NDArray[np.intp],
                    set_bits: npt.NDArray[np.uint64]) -> None: ...
    def adagrad_rows(self, slots: npt.NDArray[np.uint32], vec_offset: int, acc_offset: int,
                     g: npt.NDArray[np.float32], lr: float, eps: float) -> None: ...
    def adagrad_rowwise_rows(self, slots: npt.NDArray[np.uint32], vec_offset: int,
                             acc_offset: int, g: npt.NDArray[np.float32],
                             mean_sq: npt.NDArray[np.float32], lr: float, eps: float) -> None: ...
    def write_rows(self, slots: npt.NDArray[np.uint32], template: npt.NDArray[np.uint8],
                   vec_offset: int, vectors: npt.NDArray[np.float32]) -> None: ...
    def clear(self) -> None: ...

def release_pool() -> int: ...
