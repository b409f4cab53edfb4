"""Crash harness for restores: kill ``load_state_dict`` at random moments, check old-or-new.

Two snapshots ``A`` and ``B`` of different tables (other keys, values, step) are saved with
``torch.save``. A child process opens the store and restores them alternately, back to back,
with ``DynamicEmbedding.load_state_dict``; the parent kills it with SIGKILL at a random moment
(so nearly every kill lands inside a restore), reopens the store and checks that it holds
exactly ``A`` or exactly ``B``: every record byte for byte, no row more or less, and the stored
step of the same snapshot.

Children are forked from a ``multiprocessing`` fork server that has imported torch once, so a
trial costs milliseconds rather than an interpreter start.

A memory:// store dies with its process, so there a SIGKILL proves nothing; instead
:func:`run_interrupt_trials` interrupts the restore inside one process with an exception raised
by a ``SIGALRM`` handler at a random moment (Python runs it between any two bytecodes of the
restore), then checks what that process can observe: its table and the metadata stored with
it are those of ``A`` or of ``B``.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import embstore
from embstore.errors import ConcurrentRestoreError
from embstore_torch import DynamicEmbedding


def table_digest(store: Any) -> str:
    """A digest of every record (sorted by key) of ``store``."""
    parts = []
    for keys, recs in store.records(1 << 16):
        parts.append((keys, recs.copy()))
    if not parts:
        return hashlib.sha256(b"").hexdigest()
    keys = np.concatenate([k for k, _ in parts])
    recs = np.concatenate([r for _, r in parts])
    order = np.argsort(keys, kind="stable") if keys.dtype != object else sorted(
        range(len(keys)), key=lambda i: keys[i])
    h = hashlib.sha256()
    for k, r in zip(keys[order].tolist(), recs[order]):
        h.update(k.to_bytes(8, "little", signed=True) if isinstance(k, int) else k)
        h.update(r.tobytes())
    return h.hexdigest()


def make_snapshots(dim: int = 8, rows: int = 2000) -> tuple[dict, dict, dict[str, tuple]]:
    """Two module state dicts ``A``, ``B`` and what each leaves: {name: (digest, step)}."""

    out: list[dict] = []
    expect: dict[str, tuple] = {}
    for name, lo, value, steps in (("A", 0, 1.0, 3), ("B", rows // 2, 2.0, 5)):
        with embstore.open("memory://", dim=dim, optimizer="adagrad") as s:
            keys = np.arange(lo, lo + rows + (rows // 4 if name == "B" else 0), dtype=np.int64)
            s.assign(keys, np.full((len(keys), dim), value, np.float32))
            for _ in range(steps):
                s.update(keys, np.ones((len(keys), dim), np.float32))
            out.append(DynamicEmbedding(s).state_dict())
            expect[name] = (table_digest(s), int(s.step))
    return out[0], out[1], expect


def _stored(url: str, options: dict[str, Any]) -> tuple[str, int]:
    # The killed restorer's last COMMIT may still land while this reads (the server notices
    # the dead client later): a scan that sees it raises ConcurrentRestoreError, and a read
    # after it finds one table whole.
    for _ in range(50):
        try:
            with embstore.open(url, **options) as s:
                return table_digest(s), int(s.step)
        except ConcurrentRestoreError:
            time.sleep(0.1)
    raise AssertionError(f"{url}: restores kept landing after the restorer was killed")


# -- SIGKILL trials (persistent backends) ---------------------------------------------------------
def _child(url: str, options: dict[str, Any], paths: list[str], conn: Any) -> None:
    import torch

    sds = [torch.load(p, weights_only=True) for p in paths]
    module = DynamicEmbedding(embstore.open(url, **options))
    conn.send("ready")
    i = 0
    while True:
        module.load_state_dict(sds[i % 2])
        conn.send(i)
        i += 1


@dataclass
class RestoreCrashReport:
    trials: int = 0
    found: dict[str, int] = field(default_factory=lambda: {"A": 0, "B": 0})
    restores_done: int = 0


def run_kill_trials(url: str, paths: list[str], expect: dict[str, tuple], *, trials: int = 20,
                    options: dict[str, Any] | None = None, seed: int = 0,
                    timeout: float = 120.0) -> RestoreCrashReport:
    """Kill a child restoring ``paths`` (saved state dicts) into ``url`` ``trials`` times;
    after each kill the store must hold one of ``expect``'s tables (see the module docstring).
    The store at ``url`` must already hold one of them."""
    options = dict(options or {})
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "embstore", "embstore_torch"])
    rng = random.Random(seed)
    report = RestoreCrashReport()
    per_restore = 0.05
    by_state = {v: k for k, v in expect.items()}
    for t in range(trials):
        here, there = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(url, options, paths, there), daemon=True)
        proc.start()
        there.close()
        acks = 0
        try:
            if not here.poll(timeout):
                raise AssertionError(f"trial {t}: the child did not start within {timeout} s")
            assert here.recv() == "ready"
            want = rng.randint(0, 2)
            t0, acks = time.monotonic(), 0
            while acks < want and here.poll(timeout):
                here.recv()
                acks += 1
            if acks:
                per_restore = (time.monotonic() - t0) / acks
            time.sleep(rng.uniform(0.0, 1.5 * per_restore))
        finally:
            proc.kill()
            proc.join(timeout)
            try:
                while here.poll(0):
                    if here.recv() != "ready":
                        acks += 1
            except EOFError:  # the child is gone and everything it sent was read
                pass
            here.close()
        report.restores_done += acks
        state = _stored(url, options)
        name = by_state.get(state)
        assert name is not None, (
            f"trial {t}: after a kill during a restore the store holds neither snapshot "
            f"(step {state[1]}; A: step {expect['A'][1]}, B: step {expect['B'][1]})")
        report.found[name] += 1
        report.trials += 1
    return report


# -- in-process interrupts (memory://) ---------------------------------------------------------
class _Interrupted(BaseException):
    """Raised by the alarm handler inside a restore (a BaseException: nothing swallows it)."""


def run_interrupt_trials(*, trials: int = 20, seed: int = 0) -> RestoreCrashReport:
    """Interrupt restores into a memory:// store at random moments (see the module docstring);
    run it in a process of its own (it installs a ``SIGALRM`` handler)."""

    a, b, expect = make_snapshots()
    by_state = {v: k for k, v in expect.items()}
    rng = random.Random(seed)
    store = embstore.open("memory://", dim=8, optimizer="adagrad")
    module = DynamicEmbedding(store)
    module.load_state_dict(a)
    t0 = time.monotonic()
    module.load_state_dict(b)
    per_restore = time.monotonic() - t0
    report = RestoreCrashReport()

    def interrupt(signum: int, frame: Any) -> None:
        raise _Interrupted

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        i = 0
        while report.trials < trials:
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-4, per_restore))
            try:
                while True:
                    module.load_state_dict((a, b)[i % 2])
                    i += 1
                    report.restores_done += 1
            except _Interrupted:
                pass
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            meta = store.backend.read_meta() or {}
            state = (table_digest(store), int(meta.get("step", -1)))
            name = by_state.get(state)
            assert name is not None, (f"interrupt {report.trials}: the memory:// table is "
                                      f"neither snapshot (stored step {state[1]})")
            report.found[name] += 1
            report.trials += 1
    finally:
        signal.signal(signal.SIGALRM, old)
        store.close()
    return report


if __name__ == "__main__":  # python -m tests.restore_crash [trials]
    import sys

    rep = run_interrupt_trials(trials=int(sys.argv[1]) if len(sys.argv) > 1 else 20)
    print(f"{rep.trials} interrupts, {rep.restores_done} restores completed, "
          f"found {rep.found}, all consistent")
