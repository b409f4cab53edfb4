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
from typing import Any

import numpy as np

from ..errors import InvalidInputError
from . import wire

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
