"""Interleaving for the delta readers' tests: a worker lock whose every release lets the
trainer write once (deterministic), and a trainer thread writing while a delta is read."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np


class WriteBetween:
    """A worker lock whose every release lets the trainer write once (as a trainer's call
    waiting on the lock would): deterministic interleaving, no threads."""

    def __init__(self, write: Callable[[], object]) -> None:
        self.write = write

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.write()


def table_of(store: Any) -> dict[int, bytes]:
    """Every row of ``store`` by key, as bytes."""
    return {k: r.tobytes() for keys, recs in store.records(65536)
            for k, r in zip(keys.tolist(), recs)}


class Training:
    """A trainer thread calling ``write(rng)`` under ``lock`` (the worker's) from the start of
    the ``with`` block (which waits for its first write) to its end, and that lock as a
    delta's last read takes it (:meth:`last`): the table it saw there goes to ``states``,
    the trainer's write count then to ``writes_at_last``. :meth:`watch` records, at each
    ``log.since`` call, whether the read held the lock (``calls``)."""

    def __init__(self, store: Any, write: Callable[[np.random.Generator], object],
                 seed: int = 1) -> None:
        self.store, self.write, self.seed = store, write, seed
        self.lock, self.stop, self.started = threading.Lock(), threading.Event(), threading.Event()
        self.writes, self.writes_at_last = 0, []
        self.states: list[dict[int, bytes]] = []
        self.calls: list[bool] = []
        self.held = False
        self.thread = threading.Thread(target=self._train, daemon=True)

    def _train(self) -> None:
        rng = np.random.default_rng(self.seed)
        while not self.stop.is_set():
            with self.lock:
                self.write(rng)
                self.writes += 1
            self.started.set()

    def __enter__(self) -> Training:
        self.thread.start()
        assert self.started.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)

    def watch(self, log: Any, monkeypatch: Any) -> None:
        since = log.since

        def counted(seq: int) -> Any:
            self.calls.append(self.held)
            return since(seq)

        monkeypatch.setattr(log, "since", counted)

    def last(self) -> _Last:
        return _Last(self)


class _Last:
    def __init__(self, training: Training) -> None:
        self.t = training

    def __enter__(self) -> None:
        self.t.lock.acquire()
        self.t.held = True
        self.t.writes_at_last.append(self.t.writes)
        self.t.states.append(table_of(self.t.store))

    def __exit__(self, *exc: object) -> None:
        self.t.held = False
        self.t.lock.release()
