"""The lock of a ``memory://`` backend, which refuses a child forked after the store was made.

A forked child (a fork-started DataLoader worker) holds only a copy of the table: its updates
would never reach the parent, so every call there raises :class:`ForkedProcessError`.
"""

from __future__ import annotations

import os
import threading
from types import TracebackType

from ..errors import ForkedProcessError

__all__ = ["ProcessLock"]


# Bumped in every forked child: a store remembers the generation it was made in, so telling a
# forked copy apart costs one comparison per call, no getpid() system call.
_fork_generation = 0


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


class ProcessLock:
    """The backend's re-entrant lock, refusing to be taken in a child forked after the store
    was made (the child's copy of the lock may even be held by a thread that does not exist
    there)."""

    __slots__ = ("_lock", "_generation", "_pid")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._generation = _fork_generation
        self._pid = os.getpid()

    def __enter__(self) -> bool:
        if self._generation != _fork_generation:
            raise ForkedProcessError(
                f"a memory:// store made in process {self._pid} is used in forked child "
                f"{os.getpid()}: the child only has a copy, its updates would never reach the "
                "parent. Open the store in the child, use a persistent backend (lmdb://, "
                "rocksdb://, sql, bigtable://) shared by URL, or start workers with 'spawn'")
        return self._lock.__enter__()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._lock.__exit__(exc_type, exc, tb)
