"""Deterministic interleaving for the delta readers' tests: a worker lock whose every release
lets the trainer write once."""

from __future__ import annotations

from collections.abc import Callable


class WriteBetween:
    """A worker lock whose every release lets the trainer write once (as a trainer's call
    waiting on the lock would): deterministic interleaving, no threads."""

    def __init__(self, write: Callable[[], object]) -> None:
        self.write = write

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.write()
