"""Writer leases: "one writer per key range" for caches over a shared remote, enforced and fenced.

A write-back cache holds the newest copy of the rows it wrote, and a cache never re-reads a
row it holds; two caches writing the same keys of one remote table would each overwrite the
other's updates on flush. So a writable cache over a persistent remote takes a *lease* before
its first write: which keys it writes (``writer_keys=(index, count)``: the keys with
``key_hash64(k) % count == index``, the routing of ``sharded://`` and of
``embstore_torch.distributed.store``; None: every key), who holds it (host, boot, pid) and
until when. A cache whose keys overlap a live lease of another writer is refused with
:class:`~embstore.errors.LeaseConflictError`; writes of keys outside the declared range raise
:class:`~embstore.errors.InvalidInputError`.

Leases live in the remote's lease record (:mod:`embstore.backends.lease_record`; SQL and
Bigtable keep it apart from the metadata, so no metadata write can erase it; other backends
keep it in the metadata under ``writer_leases``, carried over by every metadata write). They
are taken and renewed in one transaction or compare-and-set, renewed while the cache writes,
released on ``close``. A lease whose holder died without closing is taken over after
``lease_seconds``, or at once when its holder is provably dead: same host *and* boot *and* pid
namespace, and its pid is gone or now belongs to a process that started at another time (a
restart after a crash must not wait). A host name alone proves nothing (cloned VMs, fixed
container host names): a lease from another boot is kept until it expires.

Every grant gets a fencing token larger than any before it. Where the remote supports fencing,
each of its row writes checks that the cache still holds its token, so a holder whose lease
was taken over (a taker whose clock runs ahead, a holder stalled past ``lease_seconds``) gets
:class:`~embstore.errors.LeaseLostError` on its next write instead of overwriting the new
holder's updates; a renewal that finds the lease gone raises it too.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from ..._keys import key_hash64
from ...backends import lease_record
from ...errors import (
    BackendError,
    InvalidInputError,
    LeaseConflictError,
    LeaseFormatError,
    LeaseLostError,
)
from ...urls import redact_url

__all__ = ["LEASES", "LeaseConflictError", "LeaseFormatError", "LeaseLostError", "WriterLease",
           "check_writer_keys", "holder_is_dead", "machine_identity", "process_start",
           "read_leases", "modify_leases"]

LEASES = "writer_leases"  # the record's key in the metadata of backends without fencing

log = logging.getLogger(__name__)

Leases = dict[str, dict]


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


def _same_machine(lease: dict, me: dict[str, str | None]) -> bool:
    """Whether ``lease`` was taken in this boot of this machine (and pid namespace)."""
    return bool(me["boot"] and me["pidns"]) and lease.get("host") == me["host"] and \
        lease.get("boot") == me["boot"] and lease.get("pidns") == me["pidns"]


def holder_is_dead(lease: dict) -> bool:
    """Whether the lease's holder provably no longer runs (see the module docstring). Only a
    holder of this boot of this machine can be checked: another boot id may be another
    machine that carries the same host name, whose holder may well be alive."""
    me = machine_identity()
    if not _same_machine(lease, me) or not lease.get("start"):
        return False
    pid = lease.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool):
        return False
    return process_start(pid) != lease["start"]


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
    me = machine_identity()
    if lease.get("host") != me["host"]:
        return "on another host: its liveness cannot be checked from here"
    if lease.get("boot") != me["boot"]:
        return ("on a host of the same name but another boot (another machine, or before a "
                "reboot): its liveness cannot be checked from here")
    pid = lease.get("pid")
    if _same_machine(lease, me) and lease.get("start") and isinstance(pid, int) and \
            process_start(pid) == lease["start"]:
        return "still running on this host"
    return "on this host, in another container or from an older embstore: cannot check it"


def _from_meta(raw: Any) -> Any:
    """The record kept in the metadata; leases an older embstore left there (``{id: entry}``,
    no tokens) read as a record of their own."""
    if isinstance(raw, dict) and raw and not {"epoch", "leases"} & set(raw) and \
            all(isinstance(v, dict) for v in raw.values()):
        return {"epoch": len(raw), "leases": {k: {**v, "token": i + 1}
                                              for i, (k, v) in enumerate(raw.items())}}
    return raw


def modify_leases(remote: Any, fn: Callable[[int, Leases], tuple[int, Leases]]) -> None:
    """Replace ``remote``'s lease record ``(epoch, leases)`` by ``fn(epoch, leases)`` in one
    transaction (``fn`` may run more than once)."""
    where = redact_url(remote.url)
    if remote.supports_fencing:
        remote.modify_leases(lambda raw: lease_record.record(
            *fn(*lease_record.parse(raw, where))))
        return

    def in_meta(stored: dict | None) -> dict:
        if stored is None:
            raise BackendError(f"{where}: no store metadata to take a writer lease in")
        new = fn(*lease_record.parse(_from_meta(stored.get(LEASES)), where))
        return {**stored, LEASES: lease_record.record(*new)}

    remote.modify_meta(in_meta)


def read_leases(remote: Any) -> tuple[int, Leases]:
    """``(epoch, leases)`` of ``remote``'s lease record (no write)."""
    where = redact_url(remote.url)
    if remote.supports_fencing:
        return lease_record.parse(remote.read_leases(), where)
    return lease_record.parse(_from_meta((remote.read_meta() or {}).get(LEASES)), where)


class WriterLease:
    """The lease of one cache (see the module docstring).

    ``on_acquire`` runs when a lease is granted (not renewed) after another writer may have
    written these keys since :meth:`observe` (a grant or an overlapping lease in between): the
    cache then drops the clean rows it read before, which may be stale.
    """

    def __init__(self, remote: Any, writer_keys: Any, lease_seconds: float,
                 on_acquire: Callable[[], None] | None = None) -> None:
        if float(lease_seconds) <= 0:
            raise InvalidInputError(f"lease_seconds must be positive, got {lease_seconds!r}")
        self.remote = remote
        self.keys = check_writer_keys(writer_keys)
        self.seconds = float(lease_seconds)
        self.id = uuid.uuid4().hex
        self.held_until = 0.0  # wall time; 0: not held
        self.token: int | None = None  # fencing token of the lease held
        self.lost: LeaseLostError | None = None  # set once another writer took the lease
        self.on_acquire = on_acquire
        self.where = redact_url(remote.url)
        self.seen: int | None = None  # the epoch at open when no overlapping lease stood
        self.observe()

    def observe(self) -> None:
        """Note the lease record before the cache reads rows (on creation): a grant at that
        same epoch proves that no other cache wrote these keys in between."""
        try:
            epoch, leases = read_leases(self.remote)
        except Exception:  # noqa: BLE001 - unknown: the first grant drops clean rows
            return
        if not any(_overlap(v.get("keys"), self.keys) for v in leases.values()):
            self.seen = epoch

    def _entry(self, now: float, token: int) -> dict:
        pid = os.getpid()
        return {"keys": self.keys, **machine_identity(), "pid": pid,
                "start": process_start(pid), "expires": now + self.seconds, "token": token}

    def keep(self, stored: dict | None, meta: dict) -> dict:
        """``meta`` with the lease record of ``stored`` carried over, for a metadata write
        that would otherwise drop it (backends without fencing keep it in the metadata)."""
        if self.remote.supports_fencing:
            return meta
        out = dict(meta)
        if stored and stored.get(LEASES) is not None:
            out[LEASES] = stored[LEASES]
        else:
            out.pop(LEASES, None)
        return out

    def lose(self, err: LeaseLostError) -> None:
        """Remember that the lease was taken over (a fenced write was refused)."""
        self.lost = err
        self.held_until = 0.0

    def ensure(self) -> None:
        """Hold the lease before a write: take it, or renew it when half of it has run."""
        if self.lost is not None:
            raise LeaseLostError(str(self.lost))
        if self.token is not None and self.held_until - time.time() > self.seconds / 2:
            return
        granted: list[tuple[int, float, bool, bool]] = []

        def take(epoch: int, leases: Leases) -> tuple[int, Leases]:
            t = time.time()
            mine = leases.get(self.id)
            if self.token is not None and (mine is None or mine["token"] != self.token):
                self.lose(lease_record.lost_error(self.where, self.id, self.token, leases))
                raise self.lost  # type: ignore[misc]
            leases = dict(leases)
            for lid, lease in list(leases.items()):
                if lid != self.id and _overlap(lease.get("keys"), self.keys):
                    if lease["expires"] <= t:
                        log.warning("%s: taking over the expired writer lease of %s; if that "
                                    "writer still runs, its next write fails (the lease is "
                                    "fenced)", self.where, lease_record.describe(lease))
                        del leases[lid]
                    elif holder_is_dead(lease):
                        log.warning("%s: taking over the writer lease of pid %s on %s, which "
                                    "is no longer running (its lease ran until %s)", self.where,
                                    lease.get("pid"), lease.get("host"),
                                    time.ctime(lease["expires"]))
                        del leases[lid]
            for lease in (v for k, v in leases.items() if k != self.id):
                if _overlap(lease.get("keys"), self.keys):
                    raise self._conflict(lease, t)
            stale = mine is None and epoch != self.seen
            if mine is None:
                epoch += 1
            token = epoch if mine is None else mine["token"]
            leases[self.id] = self._entry(t, token)
            granted[:] = [(token, t + self.seconds, mine is None, stale)]
            return epoch, leases

        try:
            modify_leases(self.remote, take)
        except LeaseConflictError:
            raise
        except BaseException:
            if self.token is None:
                self.held_until = 0.0
            raise
        self.token, self.held_until, new, stale = granted[0]
        if new:
            if self.remote.supports_fencing:
                self.remote.fence = (self.id, self.token)
            if stale and self.on_acquire is not None:
                self.on_acquire()

    def retake(self) -> None:
        """Take the lease afresh, keeping the cached rows (``resync`` after the remote lost its
        data, the lease record with it): refused only by another live holder."""
        self.token, self.lost, self.held_until = None, None, 0.0
        on_acquire, self.on_acquire = self.on_acquire, None
        try:
            self.ensure()
        finally:
            self.on_acquire = on_acquire

    def _conflict(self, lease: dict, t: float) -> LeaseConflictError:
        mine = "every key" if self.keys is None else f"writer_keys={self.keys}"
        theirs = "every key" if lease.get("keys") is None else f"writer_keys={lease['keys']}"
        return LeaseConflictError(
            f"{self.where}: another cache writes {theirs} of this table (host "
            f"{lease.get('host')}, pid {lease.get('pid')}, {_whereabouts(lease)}; lease until "
            f"{time.ctime(lease['expires'])}, {max(0.0, lease['expires'] - t):.0f} s from "
            f"now); this one would write {mine}. Two caches writing the same keys overwrite "
            "each other's updates: give each writer its own writer_keys=(index, count) and "
            "route keys to their owner (embstore_torch.distributed.store does), or write "
            "without a cache (the backends merge concurrent updates)")

    def check_keys(self, keys: np.ndarray) -> None:
        """Refuse writes of keys outside ``writer_keys``."""
        if self.keys is None or len(keys) == 0:
            return
        i, n = self.keys
        if n > 1 and not bool((key_hash64(keys) % np.uint64(n) == np.uint64(i)).all()):
            raise InvalidInputError(
                f"{self.where}: this cache writes only keys with key_hash64(k) % {n} == "
                f"{i} (writer_keys={tuple(self.keys)}); route other keys to their owner")

    def release(self) -> None:
        """Drop the lease (on close); a failure leaves it to expire."""
        token, self.token, self.held_until = self.token, None, 0.0
        if token is None or self.lost is not None:
            return

        def drop(epoch: int, leases: Leases) -> tuple[int, Leases]:
            mine = leases.get(self.id)
            if mine is not None and mine["token"] == token:
                leases = {k: v for k, v in leases.items() if k != self.id}
            return epoch, leases

        try:
            modify_leases(self.remote, drop)
        except Exception:  # noqa: BLE001 - the lease then expires on its own
            pass
