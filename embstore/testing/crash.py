"""Crash-consistency harness: kill a writing process with SIGKILL, then check the store.

Works for any persistent store URL. A *child* process (``python -m embstore.testing.crash child
URL ...``) writes batches in a loop; batch ``i`` sets every row of a fixed, deterministic key set
``keys_of(i)`` to the value ``i`` in every dimension — even batches through ``assign``, odd
batches through ``update`` (SGD with ``lr=1`` and gradient ``v - i``, so the result is exactly
``i``: all values are small integers and float32 arithmetic on them is exact). After each call
returns, the child prints and flushes ``ack i``.

The parent kills the child at a random moment (during start-up, mid-batch or between batches),
reopens the store and checks:

- the store opens cleanly and holds every key exactly once (nothing lost, nothing torn);
- every acknowledged batch is present: the table equals the state after the last acknowledged
  batch ``A`` — or after ``A + 1`` when the batch in flight had committed before its ``ack``
  was printed;
- no batch is half-applied: the keys of batch ``A + 1`` hold either all ``A + 1`` or none of it,
  and every record's dimensions agree.

Run it from Python (:func:`run_crash_trials`) or the command line::

    python -m embstore.testing.crash run lmdb:///tmp/crashy --trials 10 \
        --options '{"durable": true}'
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import embstore


def keys_of(i: int, keyspace: int, batch: int) -> np.ndarray:
    """The keys batch ``i`` writes: deterministic, distinct, overlapping other batches."""
    rng = np.random.default_rng(1_000_003 * i + 17)
    return np.sort(rng.choice(keyspace, size=batch, replace=False)).astype(np.int64)


def _open(url: str, dim: int | None, options: dict[str, Any]):
    return embstore.open(url, dim=dim, optimizer=embstore.optim.SGD(lr=1.0), **options)


# -- child -----------------------------------------------------------------------------------------
def child_main(url: str, start: int, dim: int, keyspace: int, batch: int,
               options: dict[str, Any], limit: int) -> None:
    """Write batches ``start, start+1, ...`` and acknowledge each after it returns."""
    store = _open(url, dim, options)
    print("ready", flush=True)
    for i in range(start, start + limit):
        keys = keys_of(i, keyspace, batch)
        if i % 2 == 0:
            store.assign(keys, np.full((batch, dim), float(i), np.float32))
        else:
            current = store.lookup(keys, insert=False)
            store.update(keys, current - np.float32(i))
        print(f"ack {i}", flush=True)
    store.close()


# -- parent ----------------------------------------------------------------------------------------
@dataclass
class CrashReport:
    """What a series of trials did."""

    trials: int = 0
    batches_acked: int = 0
    in_flight_applied: int = 0
    killed_before_ready: int = 0
    details: list[str] = field(default_factory=list)


def _model_after(values: np.ndarray, upto: int, start: int, keyspace: int,
                 batch: int) -> np.ndarray:
    out = values.copy()
    for i in range(start, upto + 1):
        out[keys_of(i, keyspace, batch)] = i
    return out


def _read_lines(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line.strip())
    q.put(None)


def setup_store(url: str, *, dim: int = 4, keyspace: int = 512,
                options: dict[str, Any] | None = None) -> None:
    """Create the store and set every key to 0 (batch values start at 0 too)."""
    with _open(url, dim, dict(options or {})) as s:
        s.assign(np.arange(keyspace, dtype=np.int64), np.zeros((keyspace, dim), np.float32))


def verify_store(url: str, values: np.ndarray, acked: int, start: int, *, dim: int,
                 keyspace: int, batch: int, options: dict[str, Any]) -> bool:
    """Check the store after a kill; return whether batch ``acked + 1`` was applied.

    Raises
    ------
    AssertionError
        With a description of what was lost or half-applied.
    """
    with _open(url, None, options) as s:
        assert s.dim == dim, f"reopened with dim {s.dim}"
        n = len(s)
        recs, found = s.get_records(np.arange(keyspace, dtype=np.int64))
    assert n == keyspace, f"store holds {n} rows after the crash, expected {keyspace}"
    assert found.all(), f"keys lost after the crash: {np.flatnonzero(~found)[:10].tolist()}"
    vec = recs["vector"]
    torn = ~(vec == vec[:, :1]).all(axis=1)
    assert not torn.any(), f"torn records (dims disagree) for keys {np.flatnonzero(torn)[:10]}"
    got = vec[:, 0].astype(np.int64)
    before = _model_after(values, acked, start, keyspace, batch)
    if np.array_equal(got, before):
        return False
    nxt = acked + 1
    after = before.copy()
    nkeys = keys_of(nxt, keyspace, batch)
    after[nkeys] = nxt
    if np.array_equal(got, after):
        return True
    bad = np.flatnonzero(got != before)
    in_next = np.isin(bad, nkeys)
    raise AssertionError(
        f"store state after the kill matches neither batch {acked} (last acknowledged) nor "
        f"batch {nxt} (in flight): {len(bad)} keys differ from the acknowledged state, "
        f"{int(in_next.sum())} of them in the in-flight batch (half-applied) and "
        f"{int((~in_next).sum())} elsewhere (lost acknowledged writes); e.g. keys "
        f"{bad[:5].tolist()} hold {got[bad[:5]].tolist()}, expected {before[bad[:5]].tolist()}"
    )


def run_crash_trials(url: str, *, trials: int = 8, dim: int = 4, keyspace: int = 512,
                     batch: int = 64, options: dict[str, Any] | None = None, seed: int = 0,
                     max_acks: int = 6, timeout: float = 60.0) -> CrashReport:
    """Create a store at ``url`` and run ``trials`` kill-and-verify rounds against it.

    Parameters
    ----------
    url : str
        A fresh, persistent store URL (any backend).
    options : dict, optional
        Extra ``embstore.open`` options for the child and the checks, e.g.
        ``{"durable": True}`` for LMDB/RocksDB.
    max_acks : int
        Each trial waits for a random number of acknowledgements in ``[0, max_acks]`` and then
        a random 0–40 ms before killing, so kills land during start-up, mid-batch or between
        batches.
    """
    options = dict(options or {})
    rng = random.Random(seed)
    setup_store(url, dim=dim, keyspace=keyspace, options=options)
    values = np.zeros(keyspace, dtype=np.int64)
    start = 0
    report = CrashReport()
    for t in range(trials):
        cmd = [sys.executable, "-m", "embstore.testing.crash", "child", url, "--start",
               str(start), "--dim", str(dim), "--keyspace", str(keyspace), "--batch",
               str(batch), "--options", json.dumps(options)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stderr is not None  # both are PIPEs
        q: queue.Queue = queue.Queue()
        reader = threading.Thread(target=_read_lines, args=(proc.stdout, q), daemon=True)
        reader.start()
        want = rng.randint(0, max_acks)
        early = want == 0 and rng.random() < 0.5
        lines: list[str] = []
        deadline = time.monotonic() + timeout
        if early:
            time.sleep(rng.uniform(0.0, 0.3))  # may land during import or open
        else:
            while sum(x.startswith("ack") for x in lines) < want:
                line = q.get(timeout=max(0.1, deadline - time.monotonic()))
                if line is None:
                    break
                lines.append(line)
            time.sleep(rng.uniform(0.0, 0.04))
        if proc.poll() is not None:
            err = proc.stderr.read()
            raise AssertionError(f"child exited on its own (rc={proc.returncode}): {err[-2000:]}")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)
        reader.join(timeout=timeout)
        while True:
            line = q.get_nowait() if not q.empty() else None
            if line is None:
                break
            lines.append(line)
        proc.stderr.close()
        acks = [int(x.split()[1]) for x in lines if x.startswith("ack")]
        assert acks == list(range(start, start + len(acks))), f"acks out of order: {acks}"
        acked = start + len(acks) - 1
        applied = verify_store(url, values, acked, start, dim=dim, keyspace=keyspace,
                               batch=batch, options=options)
        values = _model_after(values, acked + (1 if applied else 0), start, keyspace, batch)
        report.trials += 1
        report.batches_acked += len(acks)
        report.in_flight_applied += int(applied)
        report.killed_before_ready += int("ready" not in lines)
        report.details.append(f"trial {t}: {len(acks)} acked batches from {start}, in-flight "
                              f"batch {'applied' if applied else 'not applied'}")
        start = acked + (2 if applied else 1)
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m embstore.testing.crash",
                                 description="SIGKILL crash-consistency harness")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("child", "run"):
        p = sub.add_parser(name)
        p.add_argument("url")
        p.add_argument("--dim", type=int, default=4)
        p.add_argument("--keyspace", type=int, default=512)
        p.add_argument("--batch", type=int, default=64)
        p.add_argument("--options", default="{}", help="JSON dict of embstore.open options")
        if name == "child":
            p.add_argument("--start", type=int, default=0)
            p.add_argument("--limit", type=int, default=10**9)
        else:
            p.add_argument("--trials", type=int, default=8)
            p.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    options = json.loads(args.options)
    if args.cmd == "child":
        child_main(args.url, args.start, args.dim, args.keyspace, args.batch, options,
                   args.limit)
        return
    rep = run_crash_trials(args.url, trials=args.trials, dim=args.dim, keyspace=args.keyspace,
                           batch=args.batch, options=options, seed=args.seed)
    print("\n".join(rep.details))
    print(f"{rep.trials} trials, {rep.batches_acked} acknowledged batches, "
          f"{rep.in_flight_applied} in-flight batches applied, all consistent")


if __name__ == "__main__":
    main()
