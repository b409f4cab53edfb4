"""Harness for scans and exports that overlap another process's restore (issue 34, item 8;
:class:`~embstore.testing.conformance_restore.RestoreConformance` runs it).

A store holds table ``A``; a restorer process (started with ``spawn``: a fresh interpreter, as
a separate job would be) swaps ``B`` and ``A`` in turn with ``import_(..., replace=True)``
while this process reads it whole, again and again, through ``store.items`` and
``store.export``, with a reader opened before the restores began and with fresh read-only
opens in turn, in small pages (many pages per read, so a restore lands
between two of them). Each read is classified: exactly ``A``, exactly ``B``, a typed
``ConcurrentRestoreError``, or a *mix* -- which must never happen.

``A`` holds keys ``0..n-1`` with vectors of 1.0, ``B`` keys ``n/2..n/2+n+n/4-1`` with 2.0: a
mix shows as another key set or vectors of both values.
"""

from __future__ import annotations

import collections
import io
import multiprocessing
import time
from typing import Any

import numpy as np

import embstore
from embstore.errors import ConcurrentRestoreError

DIM = 4


def tables(n: int) -> dict[str, tuple[np.ndarray, float]]:
    return {"A": (np.arange(n, dtype=np.int64), 1.0),
            "B": (np.arange(n // 2, n // 2 + n + n // 4, dtype=np.int64), 2.0)}


def snapshot(keys: np.ndarray, value: float) -> bytes:
    with embstore.open("memory://", dim=DIM) as m:
        m.assign(keys, np.full((len(keys), DIM), value, np.float32))
        buf = io.BytesIO()
        m.export(buf)
        return buf.getvalue()


def restorer(url: str, snaps: list[bytes], rounds: int, started: Any, done: Any) -> None:
    """The other process: ``rounds`` restores, alternating the snapshots, back to back."""
    with embstore.open(url) as s:
        started.set()
        for i in range(rounds):
            s.import_(snaps[i % len(snaps)], replace=True)
            done.value += 1


def classify(keys: np.ndarray, vectors: np.ndarray, want: dict) -> str:
    order = np.argsort(keys, kind="stable")
    keys, vectors = keys[order], vectors[order]
    for name, (k, v) in want.items():
        if len(keys) == len(k) and (keys == k).all() and (vectors == v).all():
            return name
    return "mix"


def read_items(store: Any, page: int) -> tuple[np.ndarray, np.ndarray]:
    ks, vs = [], []
    for k, v in store.items(batch_size=page):
        ks.append(np.asarray(k))
        vs.append(np.asarray(v))
    return np.concatenate(ks), np.concatenate(vs)


def read_export(store: Any, page: int) -> tuple[np.ndarray, np.ndarray]:
    buf = io.BytesIO()
    store.export(buf, batch_size=page)
    with embstore.open("memory://", dim=DIM) as m:
        m.import_(io.BytesIO(buf.getvalue()))
        return read_items(m, 1 << 16)


def run(url: str, n: int = 3000, rounds: int = 16, page: int = 64, fresh_opens: bool = True,
        min_reads: int = 6, timeout: float = 240.0) -> collections.Counter:
    """Fill ``url`` with ``A``, then read it while a restorer process swaps tables; return how
    often each outcome came (``A``, ``B``, ``error``, ``mix``). ``fresh_opens=False``: every
    read through the reader opened before the restores."""
    want = tables(n)
    with embstore.open(url, dim=DIM) as s:
        s.import_(snapshot(*want["A"]), replace=True)
    snaps = [snapshot(*want["B"]), snapshot(*want["A"])]
    ctx = multiprocessing.get_context("spawn")
    started, done = ctx.Event(), ctx.Value("i", 0)
    child = ctx.Process(target=restorer, args=(url, snaps, rounds, started, done))
    seen: collections.Counter = collections.Counter()
    early = embstore.open(url, read_only=True)  # open before the restores: reads across them
    child.start()
    try:
        if not started.wait(timeout):
            raise TimeoutError("the restorer did not start")
        deadline = time.monotonic() + timeout
        reads = 0
        while (child.is_alive() or reads < min_reads) and time.monotonic() < deadline:
            read = read_items if reads % 2 == 0 else read_export
            fresh = fresh_opens and reads % 4 >= 2
            reads += 1
            try:
                if fresh:
                    with embstore.open(url, read_only=True) as r:
                        seen[classify(*read(r, page), want)] += 1
                else:
                    seen[classify(*read(early, page), want)] += 1
            except ConcurrentRestoreError:
                seen["error"] += 1
        child.join(timeout)
    finally:
        early.close()
        if child.is_alive():
            child.kill()
            child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"the restorer failed (exit code {child.exitcode})")
    seen["restores"] = done.value
    return seen
