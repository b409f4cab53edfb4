"""A serving replica that follows training: a local store kept current from the workers'
change logs.

For each worker the follower remembers the position in its change log it has applied (the
log's id and a sequence number). It subscribes to every worker (:meth:`Follower.follow`,
``embstore.service.push``): the worker pushes the rows of the keys changed since then (records
of the live ones, the deleted ones) as its log grows, and the follower applies each message
to the local store. A follower that starts, that fell behind what a worker's log still holds,
or whose worker restarted (a new log) takes that worker's whole snapshot instead, drops the
local keys of that shard the snapshot lacks, and subscribes again from the snapshot's
position; a broken subscription is retried with a growing pause. :meth:`Follower.run` polls
instead (``--poll``). Each shard's changes are applied under the serving lock, so readers see
a shard either before or after one message, never part of one, and never a mix of two
snapshots.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from .._keys import key_hash64, keys_in
from ..errors import SchemaMismatchError
from .client import DesStore

log = logging.getLogger("embstore.service")


def replica_options(upstream: DesStore) -> dict[str, Any]:
    """Engine options that give a local store the upstream table's layout."""
    layout, meta = upstream.layout, upstream.meta
    # the same initializer and seed: a key the replica lacks reads as it does upstream
    return {"dim": upstream.dim, "key_type": upstream.key_type,
            "optimizer": upstream.optimizer.config(), "value_dtype": layout.value_dtype,
            "metadata": "compact" if layout.is_compact else "full",
            "initializer": meta["initializer"], "seed": meta["seed"]}


class Follower:
    """Keep ``local`` (a writable store) equal to the table behind ``upstream``.

    Parameters
    ----------
    local : EmbeddingStore
        The replica; its layout must equal the upstream table's.
    upstream : DesStore
        A client of the workers (a ``serve`` token is enough).
    guard : context manager, optional
        Held while one shard's changes are applied (the serving worker's lock).
    """

    def __init__(self, local: Any, upstream: DesStore,
                 guard: AbstractContextManager[Any] | None = None) -> None:
        if local.layout != upstream.layout:
            raise SchemaMismatchError(
                f"the replica {local.url} has layout {local.layout}, the followed table "
                f"{upstream.layout}: create the replica with the same options (policies "
                "that keep last_seen/last_step included)")
        self.local = local
        self.up = upstream
        self.guard = guard if guard is not None else threading.Lock()
        self.seqs: list[int | None] = [None] * upstream.shards
        #: the id of the change log each of ``seqs`` counts in
        self.logs: list[str | None] = [None] * upstream.shards
        self.snapshots = 0
        self.applied = 0
        self.last_poll = 0.0       # monotonic time the last complete poll started
        #: monotonic time each worker was last heard from (subscriptions)
        self.heard = [0.0] * upstream.shards
        self.resubscribes = 0
        self._subs: dict[int, Any] = {}

    def _shard_keys(self, s: int) -> np.ndarray:
        """Local keys that worker ``s`` owns."""
        parts = [k for k, _ in self.local.records(65536)]
        if not parts:
            return self.local.normalize_keys([])
        keys = np.concatenate(parts)
        n = self.up.shards
        return keys if n == 1 else keys[key_hash64(keys) % np.uint64(n) == np.uint64(s)]

    def _snapshot(self, s: int) -> None:
        log_id, seq, batches = self.up.shard_state(s)
        with self.guard:
            have = self._shard_keys(s)
            if batches:
                fresh = np.concatenate([k for k, _ in batches])
                gone = have[~keys_in(have, fresh)]
            else:
                gone = have
            if len(gone):
                self.local.delete(gone)
            if batches:
                self.local.load_records(iter(batches))
            self.seqs[s], self.logs[s] = seq, log_id
        self.snapshots += 1

    def _delta(self, s: int, since: int) -> bool:
        seq, rows = self.up.shard_changes(s, since, self.logs[s])
        if rows is None:
            return False
        self._apply(s, seq, [rows])
        return True

    def _apply(self, s: int, seq: int, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
               ordered: bool = False) -> None:
        """Apply one delta (``(keys, records, found)`` parts, no key in two; ``ordered``: a
        key may be in two, the later part's row or deletion wins) as one step."""
        n = sum(len(k) for k, _, _ in parts)
        if not n:
            self.seqs[s] = seq
            return
        with self.guard:
            for group in ([p] for p in parts) if ordered else [parts]:
                gone = [k[~f] for k, _, f in group if not f.all()]
                if gone:
                    self.local.delete(np.concatenate(gone))
                live = [(k, r) if f.all() else (k[f], r[f]) for k, r, f in group if f.any()]
                if live:
                    self.local.load_records(iter(live))
            self.seqs[s] = seq
        self.applied += n

    def poll(self) -> None:
        """One round over every worker."""
        self.last_poll = time.monotonic()
        for s in range(self.up.shards):
            since = self.seqs[s]
            if since is None or not self._delta(s, since):
                self._snapshot(s)

    def run(self, stop: threading.Event, interval: float = 0.1,
            on_error: Callable[[BaseException], None] | None = None) -> None:
        """Poll every ``interval`` seconds until ``stop`` is set; errors are logged (or
        handed to ``on_error``) and the next poll tries again."""
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - a worker restarting: try again
                (on_error or (lambda e: log.warning("follower poll failed: %s", e)))(e)
            stop.wait(max(0.0, interval - (time.monotonic() - started)))

    def follow(self, stop: threading.Event, interval: float = 0.1,
               on_error: Callable[[BaseException], None] | None = None) -> None:
        """Follow every worker by subscription (changes pushed at most every ``interval``
        seconds) until ``stop`` is set; a broken subscription is logged (or handed to
        ``on_error``) and retried after a pause that doubles up to 5 s."""
        threads = [threading.Thread(target=self._follow_shard, args=(s, stop, interval,
                                                                     on_error),
                                    name=f"embstore-follow-{s}", daemon=True)
                   for s in range(self.up.shards)]
        for t in threads:
            t.start()
        stop.wait()
        for s in list(self._subs):
            sub = self._subs.pop(s, None)
            if sub is not None:
                sub.close()   # ends its thread's wait for the next message
        for t in threads:
            t.join()

    def _follow_shard(self, s: int, stop: threading.Event, interval: float,
                      on_error: Callable[[BaseException], None] | None) -> None:
        pause = 0.05
        while not stop.is_set():
            try:
                if self.seqs[s] is None:
                    self._snapshot(s)
                    self.heard[s] = time.monotonic()
                since = self.seqs[s]
                assert since is not None
                with self.up.shard_subscribe(s, since, self.logs[s], interval) as sub:
                    self._subs[s] = sub
                    sub.views = True   # each delta applied before the next is asked for
                    if stop.is_set():
                        return
                    for push in sub:
                        self.heard[s] = time.monotonic()
                        pause = 0.05
                        if push.resync:
                            self.seqs[s] = None   # behind the log, or a restarted worker
                            break
                        if push.rows is not None:
                            self._apply(s, push.seq, push.rows, push.ordered)
                        if stop.is_set():
                            return
            except Exception as e:  # noqa: BLE001 - a worker restarting: subscribe again
                if stop.is_set():
                    return
                (on_error or (lambda e: log.warning("follower of shard %d: %s", s, e)))(e)
                stop.wait(pause)
                pause = min(pause * 2, 5.0)
            finally:
                self._subs.pop(s, None)
            self.resubscribes += 1

    def lag(self) -> float | None:
        """Seconds since the follower last knew it held every worker's changes: since the
        worker heard from least recently (subscriptions), or the last poll started."""
        if all(self.heard):
            return time.monotonic() - min(self.heard)
        return time.monotonic() - self.last_poll if self.last_poll else None

    def stats(self) -> dict[str, Any]:
        return {"follower_snapshots": self.snapshots, "follower_rows_applied": self.applied,
                "follower_resubscribes": self.resubscribes,
                "follower_lag_seconds": self.lag()}
