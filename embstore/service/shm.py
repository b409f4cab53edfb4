"""Same-host payloads: the rows of a call travel through shared memory, not through gRPC.

A client on the worker's host, as the worker's user, asks its worker for a segment on a kept
Flight stream (after the token and role checks every call gets); the worker creates a file
in ``/dev/shm`` (mode 0600, a random name) and names it, with a random nonce written in the
file, on that stream. The client maps it and checks the nonce (proof it mapped the worker's
file: a client on another host, in another ``/dev/shm`` or as another user cannot open it,
and uses the Flight path instead), says so, and the worker unlinks the file at once: from
then on it is memory the two processes share and nothing can leak, whoever crashes.

A call is then its rows written into the segment (one copy) and a small JSON message
naming where they lie, ``{"op": "update", "rows": 4096, "dim": 64, "key": 64, "vec":
32832}``; the worker copies them out (what it checks stays what it uses), calls the store,
writes a lookup's vectors into the segment (``"out"``) and answers a small message. On
loopback, a 4096 x 64 lookup or update costs about 0.5 ms of CPU less per call than
sending its 1 MB through gRPC (``docs/service.md``, Transport). The worker checks every
descriptor as it checks a frame (offsets, sizes, the dim, the row count) and refuses a bad
one with a one-line error; ``--no-shm`` (worker) or ``shm=False`` (client) keeps the
Flight path.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import InvalidInputError
from . import wire
from .delta_slot import Slot

#: where segments live (a tmpfs on Linux)
SHM_DIR = "/dev/shm"
#: bytes before the first row: a magic, the nonce, the size
HEADER = 64
_MAGIC = b"embstore-shm-v1\0"
_NAME = re.compile(r"embstore-\d+-[0-9a-f]{32}\Z")
#: a segment holds at most one request's rows and its answer
MAX_SEGMENT = HEADER + 2 * wire.MAX_BYTES
#: regions start on this boundary (int64 keys and float32 rows read aligned)
ALIGN = 64

_live: set[Segment] = set()
_live_lock = threading.Lock()


def host_id() -> str | None:
    """This host's boot id and this process's user: a worker offers segments to a client
    that names the same (None where there is no boot id: no segments)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        return None
    return f"{boot}:{os.geteuid()}" if os.path.isdir(SHM_DIR) else None


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Segment:
    """One shared-memory file mapped into this process."""

    def __init__(self, path: str, mm: mmap.mmap, size: int, nonce: str) -> None:
        self.path: str | None = path
        self.size, self.nonce = size, nonce
        self._mm = mm
        self._buf = np.frombuffer(mm, np.uint8)

    @classmethod
    def create(cls, size: int) -> Segment:
        """A new file of ``size`` bytes (mode 0600, a random name), its header written."""
        path = os.path.join(SHM_DIR, f"embstore-{os.getpid()}-{secrets.token_hex(16)}")
        nonce = secrets.token_hex(16)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        mm[:HEADER] = _MAGIC + bytes.fromhex(nonce) + size.to_bytes(8, "little") + bytes(24)
        seg = cls(path, mm, size, nonce)
        with _live_lock:
            _live.add(seg)
        return seg

    @classmethod
    def attach(cls, name: Any, nonce: Any, size: Any) -> Segment | None:
        """The worker's segment ``name``, or None when this process cannot map it as the one
        the worker made (another host, ``/dev/shm`` or user; a name or nonce that does not
        match: a client writes into nothing but a segment its worker made for it)."""
        if not (isinstance(name, str) and _NAME.match(name) and isinstance(nonce, str)
                and isinstance(size, int) and HEADER < size <= MAX_SEGMENT):
            return None
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                    or st.st_mode & 0o077 or st.st_size != size):
                return None
            mm = mmap.mmap(fd, size)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        if mm[:16] != _MAGIC or mm[16:32].hex() != nonce:
            mm.close()
            return None
        return cls(path, mm, size, nonce)

    @classmethod
    def adopt(cls, named: Any) -> Segment | None:
        """The segment a worker named (``{"name", "nonce", "bytes"}``) mapped with
        :meth:`attach`, its file unlinked at once (nothing left behind, whoever crashes);
        None where it cannot be mapped here."""
        if not isinstance(named, dict):
            return None
        seg = cls.attach(named.get("name"), named.get("nonce"), named.get("bytes"))
        if seg is not None:
            seg.unlink()
        return seg

    def array(self, offset: int, count: int, dtype: Any) -> np.ndarray:
        """A view of ``count`` items of ``dtype`` at ``offset`` (checked by the caller)."""
        dt = np.dtype(dtype)
        return self._buf[offset:offset + count * dt.itemsize].view(dt)

    def unlink(self) -> None:
        """Remove the file (the mappings stay until closed); safe to call twice."""
        path, self.path = self.path, None
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        with _live_lock:
            _live.discard(self)

    def close(self) -> None:
        self.unlink()
        self._buf = np.zeros(0, np.uint8)
        try:
            self._mm.close()
        except BufferError:
            pass  # a view of it is still alive: unmapped when that goes


def sweep() -> int:
    """Remove the segment files of processes that are gone (a worker killed before its
    client mapped a segment): those of this user whose maker's pid is not running. Returns
    how many."""
    gone = 0
    for name in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []:
        if not _NAME.match(name):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if (os.lstat(path).st_uid == os.geteuid()
                    and not os.path.exists(f"/proc/{name.split('-')[1]}")):
                os.unlink(path)
                gone += 1
        except OSError:
            pass    # gone meanwhile, or not ours to remove
    return gone


def unlink_all() -> None:
    """Remove every file this process created and has not unlinked (a worker stopping)."""
    with _live_lock:
        segs = list(_live)
    for seg in segs:
        seg.unlink()


def region(h: dict[str, Any], field: str, size: int, nbytes: int) -> int | None:
    """The offset a request names for ``field`` (None when absent), checked: an int, aligned,
    past the header and with its ``nbytes`` inside a segment of ``size`` bytes."""
    off = h.get(field)
    if off is None:
        return None
    if isinstance(off, bool) or not isinstance(off, int) or off % 8:
        raise InvalidInputError(f"{field} must be an 8-byte aligned offset, got {off!r}")
    if off < HEADER or off + nbytes > size:
        raise InvalidInputError(f"{field} at {off} with {nbytes} bytes is outside the "
                                f"segment ({HEADER}..{size})")
    return off


def row_count(h: dict[str, Any]) -> int:
    n = h.get("rows")
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= wire.MAX_ROWS:
        raise InvalidInputError(f"rows must be an int in 0..{wire.MAX_ROWS}, got {n!r}")
    return n


# -- a subscription's deltas ----------------------------------------------------------------
#: a push segment's bytes: one slot a delta streams through in parts, each copied out by the
#: subscriber before the next is written. The same pages every time: a segment as large as
#: a delta would fault in fresh pages in both processes as deltas grow (up to seconds a
#: delta on this project's VMs), as the Arrow path's 16 MB messages do not
PUSH_SEGMENT = HEADER + (32 << 20)
#: the most bytes a push segment grows to: a delta that took several parts makes the next
#: segment a quarter larger than it (where ``/dev/shm`` has twice that free), so a
#: trainer's steady deltas travel as one part the follower applies from the segment (a
#: trainer at 1.9M rows/s changes 180k rows of 288 bytes, 52 MB, every 0.1 s)
MAX_PUSH_SEGMENT = HEADER + (256 << 20)
#: the most bytes of records a subscriber copies out of a segment at once
PART_BYTES = 8 << 20


class PushSegment:
    """A worker's segment for one subscriber on its host: a delta's keys, records and found
    flags streamed through its slot in parts, each named by a message, or read into it
    directly (:mod:`embstore.service.delta_slot`); a delta it cannot carry (bytes keys, no
    segment to be had) travels as Arrow batches."""

    def __init__(self) -> None:
        self.seg: Segment | None = None
        self._named: dict[str, Any] = {}    # the new segment, for the next message
        self._slot: Slot | None = None
        self._want = 0                      # bytes the next segment should have

    def slot(self, width: int) -> Slot | None:
        """The segment's :class:`~embstore.service.delta_slot.Slot` for records of ``width``
        bytes (the segment made at the first call, and made again larger after
        :meth:`fit`), or None where none can be had."""
        if self.seg is None or self._want > self.seg.size:
            try:
                seg = Segment.create(max(PUSH_SEGMENT, self._want))
            except OSError:     # /dev/shm full: over Flight, or on through the one there is
                if self.seg is None:
                    return None
            else:   # the subscriber acknowledged every part of the old one: it can go
                if self.seg is not None:
                    self.seg.close()
                self.seg, self._slot = seg, None
                self._named = {"segment": {"name": os.path.basename(seg.path or ""),
                                           "nonce": seg.nonce, "bytes": seg.size}}
            self._want = 0
        if self._slot is None or self._slot.width != width:
            self._slot = Slot(self.seg, HEADER, ALIGN, width)
        return self._slot

    def fit(self, rows: int, width: int) -> None:
        """A delta of ``rows`` rows took several parts: the next segment holds a quarter
        more, up to :data:`MAX_PUSH_SEGMENT`, where ``/dev/shm`` has twice that free (a
        tmpfs sized below it would kill the writer with SIGBUS, not refuse a write)."""
        want = min(MAX_PUSH_SEGMENT, HEADER + 3 * ALIGN + (rows + rows // 4) * (9 + width))
        try:
            st = os.statvfs(SHM_DIR)
        except OSError:
            return
        if want > (self.seg.size if self.seg is not None else 0) and (
                2 * want <= st.f_bavail * st.f_frsize):
            self._want = want

    def named(self) -> dict[str, Any]:
        """The fields a message carries besides its own: the segment, once, when new."""
        fields, self._named = self._named, {}
        return fields

    def filled(self, rows: int) -> dict[str, Any]:
        """The fields of the message naming a delta of ``rows`` rows read into the slot."""
        assert self._slot is not None
        return {**self.named(), **self._slot.fields(rows)}

    def parts(self, batches: list[Any]) -> Iterator[tuple[dict[str, Any], bool]] | None:
        """``(message fields, last)`` of each part of ``batches`` (``key``, ``rec``,
        ``found`` columns), the part written into the segment as it is asked for: ask for
        the next once the subscriber copied the last out. None: send them as Arrow."""
        if not batches or batches[0].schema.field("key").type != pa.int64():
            return None
        slot = self.slot(batches[0].schema.field("rec").type.byte_width)
        return None if slot is None else self._parts(batches, slot)

    def _parts(self, batches: list[Any], slot: Slot) -> Iterator[tuple[dict[str, Any], bool]]:
        n = sum(b.num_rows for b in batches)
        width, per = slot.width, slot.rows
        cols = [(b.column("key").to_numpy(), np.frombuffer(
            b.column("rec").buffers()[1], np.uint8, b.num_rows * width,
            b.column("rec").offset * width).reshape(b.num_rows, width),
            b.column("found").to_numpy(zero_copy_only=False)) for b in batches]
        done, fill = 0, 0            # rows sent, rows in the slot
        src, pos = 0, 0              # the source batch and row
        while True:
            while fill < per and src < len(cols):
                k, r, f = cols[src]
                take = min(per - fill, len(k) - pos)
                slot.keys[fill:fill + take] = k[pos:pos + take]
                slot.recs[fill:fill + take] = r[pos:pos + take]
                slot.flags[fill:fill + take] = f[pos:pos + take]
                fill, pos = fill + take, pos + take
                if pos == len(k):
                    src, pos = src + 1, 0
            done += fill
            yield {**self.named(), **slot.fields(fill)}, done >= n
            if done >= n:
                return
            fill = 0

    def acked(self) -> None:
        """The subscriber copied a part out: it mapped the segment, whose file can go."""
        if self.seg is not None:
            self.seg.unlink()

    def close(self) -> None:
        if self.seg is not None:
            self.seg.close()
            self.seg = None
            self._slot = None


def read_push(seg: Segment, meta: dict[str, Any], dtype: np.dtype, view: bool = False
              ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The ``(keys, records, found)`` parts of a delta a message names in ``seg``, checked
    against the segment. With ``view`` one part whose records are a view of the segment
    (keys and flags copied: what a replica's key table is built from cannot change under
    it), valid until the subscriber acknowledges the message; else copies (the worker
    writes the next delta over them) of at most
    :data:`PART_BYTES` each: a copy into memory of tens of megabytes at once is fresh memory
    every time (the allocator maps it and gives it back), whose page faults and zeroing cost
    more than the copy (up to seconds a delta on this project's VMs); parts the size of the
    Arrow path's messages reuse the allocator's memory."""
    n = meta.get("rows")
    width = dtype.itemsize
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= seg.size // (9 + width):
        raise InvalidInputError(f"a pushed delta of {n!r} rows does not fit its segment")
    spans = {"key": n * 8, "rec": n * width, "found": n}
    at = {f: region(meta, f, seg.size, nbytes) for f, nbytes in spans.items()}
    if any(v is None for v in at.values()):
        raise InvalidInputError("a pushed delta without its key, rec and found offsets")
    keys = seg.array(at["key"] or 0, n, np.int64)
    recs = seg.array(at["rec"] or 0, n * width, np.uint8)
    found = seg.array(at["found"] or 0, n, np.uint8)
    if view:    # applied from the segment: the delta's records copied once less
        return [(keys.copy(), recs.view(dtype), found != 0)]
    step = max(1, PART_BYTES // width)
    # records copied as bytes: numpy copies a structured dtype field by field (10x slower)
    # one part at least: an empty delta is acknowledged as any other
    return [(keys[i:i + step].copy(), recs[i * width:(i + step) * width].copy().view(dtype),
             found[i:i + step] != 0) for i in range(0, max(n, 1), step)]
