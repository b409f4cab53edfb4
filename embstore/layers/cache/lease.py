"""Writer leases: "one writer per key range" for caches over a shared remote, enforced.

A write-back cache holds the newest copy of the rows it wrote, and a cache never re-reads a
row it holds; two caches writing the same keys of one remote table would each overwrite the
other's updates on flush. So a writable cache over a persistent remote takes a *lease* in the
remote's metadata before its first write: which keys it writes (``writer_keys=(index, count)``:
the keys with ``key_hash64(k) % count == index``, the routing of ``sharded://`` and of
``embstore_torch.distributed.store``; None: every key), who holds it (host, pid) and until when.
A cache whose keys overlap a live lease of another writer is refused with
:class:`~embstore.errors.LeaseConflictError`; writes of keys outside the declared range raise
:class:`~embstore.errors.InvalidInputError`. Leases are taken and renewed with the remote's
``modify_meta`` (a transaction or compare-and-set), renewed while the cache writes, released on
``close``; a lease of a writer that died without closing expires after ``lease_seconds``, and
is taken over at once when its holder is provably dead: same host, same boot, same pid
namespace, and its pid is gone or now belongs to a process that started at another time (a
restart after a crash must not wait for the lease). Live holders and holders on other hosts
keep their lease until it expires.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import Any

import numpy as np

from ..._keys import key_hash64
from ...errors import BackendError, InvalidInputError

LEASES = "writer_leases"  # top-level key of the store metadata

log = logging.getLogger(__name__)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, Linux ``/proc``); None when there
    is no such process (or no ``/proc``). A pid reused later has another start time."""
    stat = _read(f"/proc/{int(pid)}/stat")
    if stat is None:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None


def machine_identity() -> dict[str, str | None]:
    """Host name, boot id and pid namespace: a pid means the same process only where all
    three match (containers may share a host name, a reboot reuses pids)."""
    try:
        pidns: str | None = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {"host": socket.gethostname(), "boot": _read("/proc/sys/kernel/random/boot_id"),
            "pidns": pidns}


def holder_is_dead(lease: dict) -> bool:
    """Whether the lease's holder provably no longer runs (see the module docstring)."""
    me = machine_identity()
    if lease.get("host") != me["host"] or not me["boot"] or not lease.get("boot"):
        return False
    if lease["boot"] != me["boot"]:
        return True  # the host rebooted since the lease was taken
    if not me["pidns"] or lease.get("pidns") != me["pidns"] or not lease.get("start"):
        return False
    try:
        pid = int(lease["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    return process_start(pid) != lease["start"]


class LeaseConflictError(BackendError):
    """Another cache holds a live lease on keys this one would write."""


def _overlap(a: list | None, b: list | None) -> bool:
    if a is None or b is None:
        return True
    (i, n), (j, m) = a, b
    if n == m:
        return i == j
    # different counts: residues i mod n and j mod m meet unless gcd(n, m) separates them
    return (i - j) % np.gcd(n, m) == 0


def check_writer_keys(writer_keys: Any) -> list[int] | None:
    """Validate ``writer_keys`` (None or ``(index, count)``); return it as a JSON list."""
    if writer_keys is None:
        return None
    try:
        i, n = (int(x) for x in writer_keys)
    except (TypeError, ValueError):
        raise InvalidInputError(
            f"writer_keys must be (index, count), got {writer_keys!r}") from None
    if n <= 0 or not 0 <= i < n:
        raise InvalidInputError(f"writer_keys=(index, count) needs 0 <= index < count, got "
                                f"{writer_keys!r}")
    return [i, n]


def _whereabouts(lease: dict) -> str:
    """Why a lease still stands, for the conflict error."""
    if lease.get("host") != machine_identity()["host"]:
        return "on another host: its liveness cannot be checked from here"
    if lease.get("start") and process_start(int(lease.get("pid", -1))) == lease["start"]:
        return "still running on this host"
    return "on this host, in another container or from an older embstore: cannot check it"


class WriterLease:
    """The lease of one cache (see the module docstring)."""

    def __init__(self, remote: Any, writer_keys: Any, lease_seconds: float) -> None:
        if float(lease_seconds) <= 0:
            raise InvalidInputError(f"lease_seconds must be positive, got {lease_seconds!r}")
        self.remote = remote
        self.keys = check_writer_keys(writer_keys)
        self.seconds = float(lease_seconds)
        self.id = uuid.uuid4().hex
        self.held_until = 0.0  # wall time; 0: not held

    def _entry(self, now: float) -> dict:
        pid = os.getpid()
        return {"keys": self.keys, **machine_identity(), "pid": pid,
                "start": process_start(pid), "expires": now + self.seconds}

    def keep(self, stored: dict | None, meta: dict) -> dict:
        """``meta`` with the live leases of ``stored`` carried over (and ours renewed), for a
        metadata write that would otherwise drop them."""
        now = time.time()
        leases = {k: v for k, v in ((stored or {}).get(LEASES) or {}).items()
                  if v.get("expires", 0) > now and k != self.id}
        if self.held_until:
            leases[self.id] = self._entry(now)
        out = dict(meta)
        if leases:
            out[LEASES] = leases
        else:
            out.pop(LEASES, None)
        return out

    def ensure(self) -> None:
        """Hold the lease before a write: take it, or renew it when half of it has run."""
        now = time.time()
        if self.held_until - now > self.seconds / 2:
            return

        def take(stored: dict | None) -> dict:
            if stored is None:
                raise BackendError(f"{self.remote.url}: no store metadata to take a writer "
                                   "lease in")
            t = time.time()
            leases = dict(stored.get(LEASES) or {})
            for lid, lease in list(leases.items()):
                if lid != self.id and lease.get("expires", 0) > t and holder_is_dead(lease):
                    log.warning("%s: taking over the writer lease of pid %s on %s, which is no "
                                "longer running (its lease ran until %s)", self.remote.url,
                                lease.get("pid"), lease.get("host"),
                                time.ctime(lease["expires"]))
                    del leases[lid]
            stored = {**stored, LEASES: leases}
            for lid, lease in leases.items():
                if lid != self.id and lease.get("expires", 0) > t and \
                        _overlap(lease.get("keys"), self.keys):
                    mine = "every key" if self.keys is None else f"writer_keys={self.keys}"
                    theirs = ("every key" if lease.get("keys") is None
                              else f"writer_keys={lease['keys']}")
                    where = _whereabouts(lease)
                    raise LeaseConflictError(
                        f"{self.remote.url}: another cache writes {theirs} of this table "
                        f"(host {lease.get('host')}, pid {lease.get('pid')}, {where}; lease "
                        f"until {time.ctime(lease['expires'])}, "
                        f"{max(0.0, lease['expires'] - t):.0f} s from now); this one would "
                        f"write {mine}. Two "
                        "caches writing the same keys overwrite each other's updates: give "
                        "each writer its own writer_keys=(index, count) and route keys to "
                        "their owner (embstore_torch.distributed.store does), or write without a "
                        "cache (the backends merge concurrent updates)")
            self.held_until = t + self.seconds
            return self.keep(stored, stored)

        try:
            self.remote.modify_meta(take)
        except BaseException:
            self.held_until = 0.0
            raise

    def check_keys(self, keys: np.ndarray) -> None:
        """Refuse writes of keys outside ``writer_keys``."""
        if self.keys is None or len(keys) == 0:
            return
        i, n = self.keys
        if n > 1 and not bool((key_hash64(keys) % np.uint64(n) == np.uint64(i)).all()):
            raise InvalidInputError(
                f"{self.remote.url}: this cache writes only keys with key_hash64(k) % {n} == "
                f"{i} (writer_keys={tuple(self.keys)}); route other keys to their owner")

    def release(self) -> None:
        """Drop the lease (on close); a failure leaves it to expire."""
        if not self.held_until:
            return
        self.held_until = 0.0

        def drop(stored: dict | None) -> dict:
            return self.keep(stored, stored or {})

        try:
            self.remote.modify_meta(drop)
        except Exception:  # noqa: BLE001 - the lease then expires on its own
            pass
