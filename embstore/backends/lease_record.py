"""The writer-lease record of a shared store, and the fence its writes check.

A write-back cache over a shared remote holds a *writer lease* (see
:mod:`embstore.layers.cache.lease`). Backends that can fence writes (``supports_fencing``:
SQL, Bigtable) keep the leases in a record of their own, apart from the store metadata, so a
metadata write can never erase them::

    {"epoch": 7, "leases": {"<holder id>": {"token": 7, "keys": null, "host": ..., "pid": ...,
                                            "boot": ..., "pidns": ..., "start": ...,
                                            "expires": 1767000000.0}}}

``epoch`` counts the leases ever granted; each grant gets the next value as its *fencing
token*, so a takeover always hands out a larger token than the one it replaces. A lease holder
sets ``backend.fence = (holder id, token)``; from then on every row write of that backend
checks, in the same transaction (SQL) or just before the batch (Bigtable, see
:class:`.bigtable.control.ControlRows`), that the record still holds that token for that
holder. A holder whose lease was taken over gets :class:`~embstore.errors.LeaseLostError`
instead of overwriting the new holder's updates.

This module knows the record's format: parsing (a malformed record raises
:class:`~embstore.errors.LeaseFormatError`, never a raw ``TypeError``) and the fence check.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from ..errors import LeaseFormatError, LeaseLostError

#: name of the lease record (the SQL ``_meta`` table row; the key in fallback metadata)
RECORD = "leases"
_TEXT_FIELDS = ("host", "boot", "pidns", "start")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_entry(where: str, lid: Any, e: Any) -> dict:
    def bad(why: str) -> LeaseFormatError:
        return LeaseFormatError(
            f"{where}: the writer-lease record is malformed: lease {lid!r} {why} (got "
            f"{e!r:.200}). It was not written by this embstore version, or was damaged; "
            "remove the entry (or the whole record) once no cache writes this table")

    if not isinstance(lid, str) or not isinstance(e, dict):
        raise bad("is not an object keyed by a holder id")
    token = e.get("token")
    if not isinstance(token, int) or isinstance(token, bool) or token < 1:
        raise bad("has no positive integer 'token'")
    expires = e.get("expires")
    if not isinstance(expires, (int, float)) or isinstance(expires, bool) or \
            not math.isfinite(expires) or abs(expires) > 1e12:
        raise bad("has no finite 'expires' time")
    keys = e.get("keys")
    if keys is not None:
        if not (isinstance(keys, list) and len(keys) == 2 and all(_is_int(x) for x in keys)
                and 0 <= keys[0] < keys[1]):
            raise bad("has 'keys' that are not null or [index, count] with 0 <= index < count")
    pid = e.get("pid")
    if pid is not None and (not _is_int(pid) or not 0 <= pid < 2**31):
        raise bad("has a 'pid' that is not a process id")
    for f in _TEXT_FIELDS:
        if e.get(f) is not None and not isinstance(e[f], str):
            raise bad(f"has a '{f}' that is not text")
    return e


def parse(raw: Any, where: str) -> tuple[int, dict[str, dict]]:
    """``(epoch, leases)`` of a stored record (None: no record yet); ``where`` names the
    store in errors (password redacted)."""
    if raw is None or raw == {}:
        return 0, {}
    if not isinstance(raw, dict) or not set(raw) <= {"epoch", "leases", "ts_high"}:
        raise LeaseFormatError(f"{where}: the writer-lease record is malformed (got "
                               f"{raw!r:.200}): expected {{'epoch': int, 'leases': {{...}}}}")
    epoch, leases = raw.get("epoch", 0), raw.get("leases") or {}
    if not _is_int(epoch) or epoch < 0 or not isinstance(leases, dict):
        raise LeaseFormatError(f"{where}: the writer-lease record is malformed: 'epoch' must "
                               f"be a non-negative integer and 'leases' an object (got "
                               f"{raw!r:.200})")
    out = {lid: _check_entry(where, lid, e) for lid, e in leases.items()}
    if any(e["token"] > epoch for e in out.values()):
        raise LeaseFormatError(f"{where}: the writer-lease record is malformed: a lease's "
                               f"token is above the record's epoch {epoch}")
    return epoch, out


def loads(text: str | bytes | None, where: str) -> Any:
    """The stored record from its JSON text (None or empty: no record yet)."""
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError as e:
        raise LeaseFormatError(f"{where}: the writer-lease record is not JSON: {e}") from None


def record(epoch: int, leases: dict[str, dict]) -> dict:
    """The stored form of ``(epoch, leases)``."""
    return {"epoch": int(epoch), "leases": leases}


def describe(lease: dict) -> str:
    """Who holds ``lease``, for messages: host, pid, token and until when."""
    return (f"host {lease.get('host')}, pid {lease.get('pid')}, token {lease.get('token')}, "
            f"lease until {time.ctime(lease['expires'])}")


def lost_error(where: str, holder: str, token: int, leases: dict[str, dict]) -> LeaseLostError:
    """The error of a holder whose lease (``holder``, ``token``) is not in ``leases``."""
    others = [e for lid, e in leases.items() if lid != holder]
    now = "; the table's leases are now: " + "; ".join(describe(e) for e in others) \
        if others else ""
    return LeaseLostError(
        f"{where}: this cache's writer lease (token {token}) was taken over by another writer "
        f"(its lease looked expired to that writer: a clock running ahead, or this writer "
        f"stalled past lease_seconds){now}. Its writes are refused so that they cannot "
        "overwrite the new holder's updates; reopen the store to write again")


def check_fence(raw: Any, fence: tuple[str, int], where: str) -> None:
    """Raise :class:`~embstore.errors.LeaseLostError` unless ``raw`` (the stored record)
    still holds ``fence = (holder id, token)``."""
    holder, token = fence
    _, leases = parse(raw, where)
    mine = leases.get(holder)
    if mine is None or mine["token"] != token:
        raise lost_error(where, holder, token, leases)
