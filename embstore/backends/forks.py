"""Which fork of the process this is: handles made before a fork() must not be used after it.

An in-process table (``memory://``) or a RocksDB handle copied into a forked child would take
the child's writes and never show them to anyone. Each forked child bumps a generation; a
backend remembers the generation it was made in, so telling a forked copy apart costs one
comparison per call, no getpid() system call.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

__all__ = ["ForkSafePool", "ProcessLock", "current_generation", "on_fork_in_child",
           "serialized"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class _Locked(Protocol):
    """A backend with the lock :func:`serialized` takes."""

    @property
    def _lock(self) -> AbstractContextManager[Any]: ...


_L = TypeVar("_L", bound=_Locked)


def serialized(method: Callable[Concatenate[_L, _P], _R]) -> Callable[Concatenate[_L, _P], _R]:
    """Run a backend method under the backend's ``self._lock`` (an ``RLock`` or this module's
    fork-aware lock, so serialized methods may call each other): for backends whose calls
    must not interleave across threads."""
    @functools.wraps(method)
    def wrapper(self: _L, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper

_generation = 0
_hooks: list[Callable[[], None]] = []


def current_generation() -> int:
    """How many times this process is a forked child of the one that imported embstore."""
    return _generation


def on_fork_in_child(fn: Callable[[], None]) -> None:
    """Run ``fn`` in every child forked from now on (after the generation was bumped)."""
    _hooks.append(fn)


def _after_fork_in_child() -> None:
    global _generation
    _generation += 1
    for fn in _hooks:
        fn()


os.register_at_fork(after_in_child=_after_fork_in_child)


class ProcessLock:
    """A re-entrant lock that refuses to be taken in a child forked after it was made (the
    child's copy of the lock may even be held by a thread that does not exist there);
    ``refusal(made_in_pid)`` builds the error to raise."""

    __slots__ = ("_lock", "_generation", "_pid", "_refusal")

    def __init__(self, refusal: Callable[[int], BaseException]) -> None:
        self._lock = threading.RLock()
        self._generation = _generation
        self._pid = os.getpid()
        self._refusal = refusal

    def __enter__(self) -> bool:
        if self._generation != _generation:
            raise self._refusal(self._pid)
        return self._lock.__enter__()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._lock.__exit__(exc_type, exc, tb)


class ForkSafePool:
    """A thread pool that a forked child replaces with one of its own: the parent's worker
    threads do not exist there, and a lock one of them held at the fork (the work queue's)
    would never be released, so a submit in the child would hang."""

    def __init__(self, workers: int, prefix: str) -> None:
        self._workers, self._prefix = workers, prefix
        self._generation = _generation
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=prefix)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        if self._generation != _generation:
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix=self._prefix)
            self._generation = _generation
        return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True) -> None:
        if self._generation == _generation:  # a child never waits for its parent's threads
            self._pool.shutdown(wait=wait)
