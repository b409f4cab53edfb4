"""Change subscriptions: a worker pushes its change log to a follower over one kept stream.

A follower subscribes to each worker with the change-log position it holds (the log's id and
a sequence number). The worker keeps the Flight ``do_exchange`` stream open and, each time
its log grows, sends the rows of the keys changed since the last message — at most once per
``interval`` seconds, so a trainer's writes coalesce per key between messages while a single
change after a quiet spell goes out at once. The follower acknowledges each delta once it
applied it, and the worker sends the next only then: a follower slower than the trainer
gets fewer, larger deltas (coalesced per key), never a queue of stale ones. A delta is read
as one state of the shard (:func:`embstore.service.delta.delta_parts`) in parts no key is in
two of; each travels as a message of its own, the last one marked, and the follower applies
them together. An idle stream carries a heartbeat every :data:`HEARTBEAT` seconds, so a
follower knows how current it is and a worker notices a follower that went away.

A worker whose log no longer holds the follower's position — it fell behind the retained
log, or it names the log of a worker since restarted — answers ``resync`` and ends the
stream: the follower takes a snapshot and subscribes again from there. Staleness is then the
push interval plus the time to read, send and apply one message, not a poll period.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from ..errors import BackendError
from . import wire
from .changelog import ChangeLog
from .delta import message_slices
from .delta_slot import NO_FIT
from .shm import PushSegment, Segment, read_push
from .streams import Watchdog

#: seconds between the heartbeats of an idle subscription
HEARTBEAT = 1.0
#: a subscription that heard nothing for this many heartbeats is dropped (a paused worker;
#: generous: a worker reading a delta of millions of rows sends nothing meanwhile)
SILENT_HEARTBEATS = 30
#: bounds of a subscriber's push interval in seconds
MIN_INTERVAL, MAX_INTERVAL = 0.001, 60.0

_WRITE_ERRORS = (flight.FlightError, pa.ArrowException, OSError)
_ACK = pa.py_buffer(b"{}")


def _meta(**fields: Any) -> pa.Buffer:
    return pa.py_buffer(json.dumps(fields).encode())


def check_interval(value: Any) -> float:
    """A push interval in seconds, from a request header."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            MIN_INTERVAL <= value <= MAX_INTERVAL):
        raise ValueError(f"interval must be a number of seconds in {MIN_INTERVAL}.."
                         f"{MAX_INTERVAL}, got {value!r}")
    return float(value)


def push_changes(log: ChangeLog,
                 delta: Callable[[int], tuple[int, list[pa.RecordBatch] | None]],
                 reader: Any, writer: Any, since: int, interval: float,
                 stopping: Callable[[], bool], shm: bool = False,
                 into: Callable[[int, PushSegment], Iterator[tuple[int, int | None, bool]]]
                 | None = None) -> None:
    """Write the changes after ``since`` to ``writer`` as ``log`` grows, each delta once the
    subscriber acknowledged the one before on ``reader``, until ``stopping()``, a resync, or
    the subscriber goes away. ``delta(since)`` reads ``(seq, batch)`` of the keys
    changed after ``since`` as one state, in batches no key is in two of (None: the log no
    longer holds ``since``); they travel as one message each, the last one marked, or with
    ``shm`` (a subscriber on this host) through a segment, named by one message.
    ``into(since, segment)`` (with ``shm``) reads such a delta straight into the segment's
    slot a part at a time, as :func:`embstore.service.delta_slot.delta_into` yields them
    (``NO_FIT``: read it with ``delta``)."""
    started = reading = False
    sent = 0.0
    pushed = PushSegment() if shm else None
    try:
        while not stopping():
            if not log.wait_past(since, HEARTBEAT):
                writer.write_metadata(_meta(seq=since, last=True))
                continue
            pause = sent + interval - time.monotonic()
            if pause > 0:      # coalesce: the writes of the rest of the interval join this one
                time.sleep(pause)
            reading = True     # an error reading goes to the subscriber as its one line
            steps = into(since, pushed) if into and pushed else iter([(since, NO_FIT, True)])
            seq, rows, last = next(steps)
            batches: list[pa.RecordBatch] | None = []
            if rows == NO_FIT:
                seq, batches = delta(since)
            reading = False
            sent = time.monotonic()
            if batches is None or rows is None:
                writer.write_metadata(_meta(seq=seq, resync=True, last=True))
                return
            parts = pushed.parts(batches) if pushed is not None and batches else None
            if pushed is not None and rows != NO_FIT:   # read into the slot, part by part
                while True:
                    writer.write_metadata(_meta(seq=seq, last=last, **pushed.filled(rows)))
                    if last:
                        break
                    reader.read_chunk()     # copied out: the next part into the same pages
                    pushed.acked()
                    reading = True
                    seq, rows, last = next(steps)
                    reading = False
                    if rows is None:
                        writer.write_metadata(_meta(seq=seq, resync=True, last=True))
                        return
            elif pushed is not None and parts is not None:
                for fields, last in parts:
                    writer.write_metadata(_meta(seq=seq, last=last, **fields))
                    if not last:    # copied out: the next part goes into the same pages
                        reader.read_chunk()
                        pushed.acked()
            else:
                if not started:
                    writer.begin(batches[0].schema)
                    started = True
                msgs = [m for b in batches for m in message_slices(b)]
                for i, part in enumerate(msgs):
                    writer.write_with_metadata(part, _meta(seq=seq, last=i == len(msgs) - 1))
            since = seq
            # the next delta once the follower applied this one: a follower slower than the
            # trainer gets larger, coalesced deltas instead of a queue of stale ones
            reader.read_chunk()
            if pushed is not None:
                pushed.acked()
    except StopIteration:
        return  # the subscriber ended the stream
    except _WRITE_ERRORS:
        if reading:
            raise
        return  # the subscriber went away (or the stream broke): nothing more to send
    finally:
        if pushed is not None:
            pushed.close()


def delta_rows(batch: Any, key_type: str, dtype: np.dtype
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(keys, records, found)`` of a delta's batch; the records a view of what arrived (38
    MB for 133k rows of dim 64), not to be written (``found`` False: deleted)."""
    keys, recs = wire.records_from(batch, key_type, dtype, copy=False)
    return keys, recs, np.asarray(batch.column("found").to_numpy(zero_copy_only=False), bool)


class Push(NamedTuple):
    """One delta of a subscription: the rows changed up to ``seq`` in parts no key is in two
    of (none on a heartbeat, None on a resync: take a snapshot and subscribe again), or
    with ``ordered`` parts to apply in order (a shared-memory delta of several parts: a key
    written while an earlier part was sent comes again in a later one, whose row wins)."""

    seq: int
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None
    resync: bool = False
    ordered: bool = False


class Subscription:
    """A follower's stream of one worker's changes (:meth:`DesStore.shard_subscribe`);
    iterate it for :class:`Push` messages, :meth:`close` it to stop."""

    def __init__(self, client: Any, command: Any, headers: list[tuple[bytes, bytes]],
                 key_type: str, dtype: np.dtype, where: str,
                 refuse: Callable[[], None] = lambda: None) -> None:
        self._key_type, self._dtype, self._where = key_type, dtype, where
        #: the worker's segment for this subscription (deltas through shared memory)
        self._seg: Segment | None = None
        self._refuse = refuse   # called when it cannot be mapped: subscribe over Flight
        #: a shared-memory delta's last part as a view of the segment, not a copy: valid
        #: only until the next message is asked for (a follower applies it before that)
        self.views = False
        try:  # no deadline: the stream lasts; a silent one is cancelled by the watchdog
            self._writer, self._reader = client.do_exchange(
                command, flight.FlightCallOptions(headers=headers))
        except flight.FlightError as e:
            wire.raise_remote(e, where)
        self._watchdog = Watchdog()

    def __iter__(self) -> Iterator[Push]:
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        shm_parts = 0
        while True:
            token = self._watchdog.arm(self._reader, HEARTBEAT * SILENT_HEARTBEATS)
            try:
                chunk = self._reader.read_chunk()
            except StopIteration:
                raise BackendError(f"{self._where}: the worker ended the subscription"
                                   ) from None
            except _WRITE_ERRORS as e:
                if self._watchdog.disarm(token):
                    raise BackendError(f"{self._where}: no message for "
                                       f"{HEARTBEAT * SILENT_HEARTBEATS:.0f} s") from None
                if isinstance(e, flight.FlightError):
                    wire.raise_remote(e, self._where)
                raise BackendError(f"{self._where}: subscription broke ({e!r})") from None
            self._watchdog.disarm(token)
            meta = wire.parse_body(chunk.app_metadata.to_pybytes()
                                   if chunk.app_metadata is not None else b"{}")
            seq = meta.get("seq")
            if isinstance(seq, bool) or not isinstance(seq, int):
                raise BackendError(f"{self._where}: a subscription message without a seq")
            if meta.get("resync"):
                yield Push(seq, None, True)
                return
            if "rows" in meta:  # a part through shared memory: copied out, the slot free
                view = self.views and bool(meta.get("last"))
                parts.extend(read_push(self._segment(meta), meta, self._dtype, view))
                shm_parts += 1
                if not meta.get("last"):
                    self._ack()
            elif chunk.data is not None:
                parts.append(delta_rows(chunk.data, self._key_type, self._dtype))
            if not meta.get("last"):
                continue
            yield Push(seq, parts, ordered=shm_parts > 1)
            if parts:   # applied (the caller asks for the next): the worker may send again
                self._ack()
            parts, shm_parts = [], 0

    def _ack(self) -> None:
        try:
            self._writer.write_metadata(_ACK)
        except _WRITE_ERRORS as e:
            raise BackendError(f"{self._where}: subscription broke ({e!r})") from None

    def _segment(self, meta: dict[str, Any]) -> Segment:
        """The segment a shared-memory delta lies in (a new one mapped when named)."""
        new = meta.get("segment")
        if new is not None:
            seg = Segment.adopt(new)
            if seg is None:
                self._refuse()
                raise BackendError(f"{self._where}: the worker's shared memory cannot be "
                                   "mapped here; subscribing again over Flight")
            if self._seg is not None:
                self._seg.close()
            self._seg = seg
        if self._seg is None:
            raise BackendError(f"{self._where}: a shared-memory delta before its segment")
        return self._seg

    def close(self) -> None:
        """Stop the stream (the worker's handler returns at its next write)."""
        self._watchdog.close()
        if self._seg is not None:
            self._seg.close()
            self._seg = None
        try:
            self._reader.cancel()
            self._writer.close()
        except _WRITE_ERRORS:
            pass  # already broken: nothing to end

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

