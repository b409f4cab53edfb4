"""The native interchange format: whole records (vectors, slots, metadata), streamed in chunks.

File layout (all integers little-endian)::

    magic        8 bytes   b"EMBSTNAT"
    version      u32       FORMAT_VERSION
    header_len   u32       length of the JSON header (<= MAX_HEADER)
    header       bytes     UTF-8 JSON: store metadata (dim, key_type, layout, optimizer, ...)
    header_crc   u32       CRC-32 of the header bytes
    chunk*       b"CHNK" | rows u32 | payload_len u64 | payload_crc u32 | payload
                 payload = keys | records
                   int64 keys: rows * 8 bytes
                   bytes keys: rows * u32 lengths, then the concatenated key bytes
    trailer      b"END." | total_rows u64 | crc u32 of every chunk crc

Readers and writers hold one chunk at a time, so memory stays constant in the table size.
Every size read from the file is checked against the bytes that remain before anything is
allocated, so a hostile header cannot make a reader allocate absurd amounts. Writing to a
path goes through a temporary file renamed on success: a failed export leaves no torn file.
"""

from __future__ import annotations

import io
import json
import os
import struct
import tempfile
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, BinaryIO, Literal, overload

import numpy as np

from ..errors import CorruptFileError
from ..layout import Layout
from .base import MAX_DIM
from .limits import check_input_path, deliver, output_mode

MAGIC = b"EMBSTNAT"
FORMAT_VERSION = 1
MAX_HEADER = 16 << 20
MAX_CHUNK_ROWS = 1 << 22
#: bytes of records per chunk a writer produces (readers accept any chunk the file can hold)
MAX_CHUNK_BYTES = 64 << 20
_CHUNK = struct.Struct("<4sIQI")
_TRAILER = struct.Struct("<4sQI")

#: below this many bytes of chunks a file is read and checked on the caller's thread alone
_READ_AHEAD_MIN_BYTES = 4 << 20


def _open_out(dest: str | os.PathLike | BinaryIO) -> tuple[BinaryIO, str | None, str | None]:
    if isinstance(dest, (str, os.PathLike)):
        final = os.fspath(dest)
        # a FIFO/device gets the finished file written into it; symlinks etc. are refused
        d = (tempfile.gettempdir() if output_mode(final) == "stream"
             else os.path.dirname(os.path.abspath(final)))
        fd, tmp = tempfile.mkstemp(prefix=".embstore-", suffix=".tmp", dir=d)
        mask = os.umask(0o022)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)  # mkstemp's 0600 is for the temporary file only
        return os.fdopen(fd, "wb"), tmp, final
    return dest, None, None


def _crc_of(parts: list) -> int:
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    return crc


class NativeWriter:
    """Write a native file chunk by chunk.

    Parameters
    ----------
    dest : path or binary file object
        A path is written atomically (temporary file, renamed by ``close``).
    header : dict
        Store metadata; must contain ``layout`` and ``key_type``.
    """

    def __init__(self, dest: str | os.PathLike | BinaryIO, header: dict[str, Any], *,
                 background: bool = False) -> None:
        self.layout = Layout.from_json(header["layout"])
        self.key_type = header["key_type"]
        self._f, self._tmp, self._final = _open_out(dest)
        self._crcs = 0
        self.rows = 0
        self._closed = False
        # background=True: each chunk is checksummed by one thread and written by another
        # while the caller produces the next one (zlib and file writes release the GIL), so
        # scan, CRC and write of consecutive chunks overlap. The caller must leave the arrays
        # it passed alone until its next write()/close() returns -- true of scans, which
        # yield fresh arrays per batch.
        self._pool = ThreadPoolExecutor(1, "embstore-native") if background else None
        self._crc_pool = ThreadPoolExecutor(1, "embstore-native-crc") if background else None
        self._pending: Future | None = None
        hb = json.dumps(header, sort_keys=True).encode("utf-8")
        self._f.write(MAGIC + struct.pack("<II", FORMAT_VERSION, len(hb)) + hb
                      + struct.pack("<I", zlib.crc32(hb)))

    def write(self, keys: np.ndarray, records: np.ndarray) -> None:
        """Append one chunk of (keys, records)."""
        n = len(keys)
        if n == 0:
            return
        # chunks bounded in bytes too, so a reader of wide records holds little at a time
        step = max(1, min(MAX_CHUNK_ROWS, MAX_CHUNK_BYTES // (self.layout.itemsize + 8)))
        for start in range(0, n, step):
            self._write_chunk(keys[start:start + step], records[start:start + step])

    def _write_chunk(self, keys: np.ndarray, records: np.ndarray) -> None:
        n = len(keys)
        recs = np.ascontiguousarray(records, dtype=self.layout.dtype).view(np.uint8)
        parts: list[np.ndarray | bytes]
        if self.key_type == "int64":
            parts = [np.ascontiguousarray(keys, dtype="<i8").view(np.uint8), recs]
        else:
            lens = np.fromiter((len(k) for k in keys), dtype="<u4", count=n)
            parts = [lens.view(np.uint8), b"".join(keys), recs]
        if self._pool is None:
            self._emit(n, parts)
        else:
            assert self._crc_pool is not None  # invariant: made with _pool
            crc = self._crc_pool.submit(_crc_of, parts)  # overlaps the previous chunk's write
            self._wait()
            self._pending = self._pool.submit(self._emit, n, parts, crc)

    def _wait(self) -> None:
        if self._pending is not None:
            done, self._pending = self._pending, None
            done.result()  # re-raises an error of the background write

    def _emit(self, n: int, parts: list, crc_done: Future | None = None) -> None:
        # The parts are written and checksummed in place: no payload copy is made.
        crc = _crc_of(parts) if crc_done is None else crc_done.result()
        self._f.write(_CHUNK.pack(b"CHNK", n, sum(len(p) for p in parts), crc))
        for p in parts:
            self._f.write(p)
        self._crcs = zlib.crc32(struct.pack("<I", crc), self._crcs)
        self.rows += n

    def close(self) -> None:
        """Write the trailer and, for a path, move the file into place."""
        if self._closed:
            return
        try:
            self._wait()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._shutdown()
        self._f.write(_TRAILER.pack(b"END.", self.rows, self._crcs))
        if self._tmp is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            assert self._final is not None  # invariant: a path destination has both
            deliver(self._tmp, self._final)

    def abort(self) -> None:
        """Drop a partly written file (path destinations only)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wait()
        except Exception:  # noqa: BLE001 - the file is being dropped anyway
            pass
        self._shutdown()
        if self._tmp is not None:
            self._f.close()
            os.unlink(self._tmp)

    def _shutdown(self) -> None:
        if self._pool is not None:
            assert self._crc_pool is not None  # invariant: made with _pool
            self._pool.shutdown(wait=True)
            self._crc_pool.shutdown(wait=True)
            self._pool = self._crc_pool = None

    def __enter__(self) -> NativeWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class NativeReader:
    """Read a native file: ``header`` at once, chunks on iteration.

    ``verify()`` checks every checksum and the trailer without keeping records in memory.
    """

    def __init__(self, src: str | os.PathLike | BinaryIO | bytes) -> None:
        if isinstance(src, (bytes, bytearray)):
            self._f: IO[bytes] = io.BytesIO(src)
            self._owns = True
        elif isinstance(src, (str, os.PathLike)):
            check_input_path(os.fspath(src))
            try:
                self._f = open(src, "rb")  # noqa: SIM115 - closed by close()
            except OSError as e:
                raise CorruptFileError(f"cannot open {src!s}: {e.strerror}") from e
            self._owns = True
        else:
            self._f = src
            self._owns = False
        self.name = str(src) if isinstance(src, (str, os.PathLike)) else "<stream>"
        self._pools: tuple[ThreadPoolExecutor, ...] | None = None
        try:
            self._open_header()
        except BaseException:
            self.close()  # a refused file is not left open
            raise

    def _open_header(self) -> None:
        self._size = self._remaining_size()
        self.header = self._read_header()
        try:
            self.layout = Layout.from_json(self.header.get("layout", {}))
        except (ValueError, TypeError, KeyError) as e:
            raise CorruptFileError(f"{self.name}: header has a bad layout: {e}") from e
        if self.layout.dim > MAX_DIM or self.layout.itemsize > 16 * 4 * MAX_DIM:
            raise CorruptFileError(f"{self.name}: header declares an absurd record layout "
                                   f"(dim {self.layout.dim}, {self.layout.itemsize} bytes)")
        self.key_type: str = self.header.get("key_type", "")  # checked just below
        if self.key_type not in ("int64", "bytes"):
            raise CorruptFileError(f"{self.name}: header has an unknown key_type")
        self._body = self._f.tell()

    def _remaining_size(self) -> int | None:
        try:
            pos = self._f.tell()
            end = self._f.seek(0, io.SEEK_END)
            self._f.seek(pos)
            return end - pos
        except (OSError, AttributeError):
            return None

    def _read_exact(self, n: int, what: str) -> bytes:
        b = self._f.read(n)
        if len(b) != n:
            raise CorruptFileError(f"{self.name}: truncated file (while reading {what})")
        return b

    def _read_header(self) -> dict:
        magic = self._f.read(len(MAGIC))
        if magic != MAGIC:
            raise CorruptFileError(f"{self.name}: not an embstore native file (bad magic)")
        version, hlen = struct.unpack("<II", self._read_exact(8, "header size"))
        if version > FORMAT_VERSION:
            raise CorruptFileError(
                f"{self.name}: format version {version} is newer than this embstore "
                f"({FORMAT_VERSION}); upgrade embstore"
            )
        if hlen <= MAX_HEADER and self._size is not None and hlen > self._size:
            raise CorruptFileError(f"{self.name}: truncated file (the header declares {hlen} "
                                   f"bytes, the file holds {self._size} more)")
        if hlen > MAX_HEADER:
            raise CorruptFileError(f"{self.name}: header declares an absurd size ({hlen} bytes)")
        hb = self._read_exact(hlen, "header")
        (crc,) = struct.unpack("<I", self._read_exact(4, "header checksum"))
        if zlib.crc32(hb) != crc:
            raise CorruptFileError(f"{self.name}: header checksum mismatch")
        try:
            header = json.loads(hb.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptFileError(f"{self.name}: header is not valid JSON: {e}") from e
        except RecursionError:  # e.g. 200k nested brackets: no store header looks like that
            raise CorruptFileError(f"{self.name}: header JSON is nested absurdly deep") from None
        if not isinstance(header, dict) or "layout" not in header:
            raise CorruptFileError(f"{self.name}: header lacks a layout")
        return header

    @overload
    def _chunks(self, decode: Literal[True], reuse: bool = False
                ) -> Iterator[tuple[np.ndarray, np.ndarray]]: ...
    @overload
    def _chunks(self, decode: Literal[False], reuse: bool = False) -> Iterator[int]: ...
    def _chunks(self, decode: bool, reuse: bool = False
                ) -> Iterator[tuple[np.ndarray, np.ndarray] | int]:
        self._stop_read_ahead()  # of an earlier iteration left suspended: it shares the file
        self._f.seek(self._body)
        state = {"total": 0, "crcs": 0, "end": False}
        # reuse: the caller is done with a chunk before asking for the next, so two buffers
        # alternate (one being read ahead while the caller holds the other)
        spares = [np.empty(0, dtype=np.uint8), np.empty(0, dtype=np.uint8)] if reuse else None
        # A stream is read in line (it may not be safe to use elsewhere), and so is a small
        # file: a checking thread per import costs more than it saves below a few chunks.
        if self._size is None or self._size < _READ_AHEAD_MIN_BYTES:
            while (got := self._checked(self._next_chunk(state, spares, 0))) is not None:
                yield self._decode(*got) if decode else got[1]
            return
        # A file: the caller's thread reads chunk i+1 while a thread checks its CRC, and the
        # caller works on chunk i meanwhile (zlib releases the GIL). Reads stay on the caller's
        # thread: buffers allocated there are reused by the allocator from one import to the
        # next, where a reading thread's fresh arena would page-fault every buffer in again.
        # Chunks still come out only once checked, in order, and the error of a damaged chunk
        # is raised only after every chunk before it.
        check = ThreadPoolExecutor(1, "embstore-native-crc")
        self._pools = (check,)
        try:
            checking = check.submit(self._checked, self._next_chunk(state, spares, 0))
            i = 0
            while True:
                i += 1
                ahead: Any = None
                try:
                    ahead = self._next_chunk(state, spares, i % 2)
                except Exception as e:  # noqa: BLE001 - raised after the chunks before it
                    ahead = e
                got = checking.result()
                if got is None:
                    return
                if isinstance(ahead, Exception):
                    yield self._decode(*got) if decode else got[1]
                    raise ahead
                checking = check.submit(self._checked, ahead)
                yield self._decode(*got) if decode else got[1]
        finally:  # the buffers are never touched after the caller is gone
            check.shutdown(wait=True)
            if self._pools == (check,):
                self._pools = None

    def _stop_read_ahead(self) -> None:
        pools, self._pools = self._pools, None
        for pool in pools or ():
            pool.shutdown(wait=True)

    def _checked(self, got: Any) -> tuple[np.ndarray, int] | None:
        """Verify the CRC of a chunk read by ``_next_chunk``."""
        if got is None:
            return None
        payload, n, crc, start = got
        if zlib.crc32(payload) != crc:
            raise CorruptFileError(f"{self.name}: checksum mismatch in chunk at row {start}")
        return payload, n

    def _next_chunk(self, state: dict, spares: list | None, which: int
                    ) -> tuple[np.ndarray, int, int, int] | None:
        """Read the next chunk: ``(payload, rows, declared crc, first row)``, or None after a
        good trailer. The payload's CRC is checked by ``_checked``."""
        if state["end"]:
            return None
        total = state["total"]
        tag = self._read_exact(4, "chunk tag")
        if tag == b"END.":
            state["end"] = True
            rows, crc = struct.unpack("<QI", self._read_exact(12, "trailer"))
            if rows != total or crc != state["crcs"]:
                raise CorruptFileError(
                    f"{self.name}: trailer does not match the chunks "
                    f"({rows} rows declared, {total} read)"
                )
            if self._f.read(1):
                raise CorruptFileError(f"{self.name}: trailing bytes after the trailer")
            return None
        if tag != b"CHNK":
            raise CorruptFileError(f"{self.name}: bad chunk tag {tag!r} after {total} rows")
        n, plen, pcrc = struct.unpack("<IQI", self._read_exact(16, "chunk header"))
        min_len = n * (self.layout.itemsize + (8 if self.key_type == "int64" else 4))
        if n > MAX_CHUNK_ROWS or plen < min_len or plen > (1 << 40) or (
            self._size is not None and plen > self._size
        ):
            left = self._remaining_size()
            if n <= MAX_CHUNK_ROWS and min_len <= plen <= (1 << 40) and left is not None \
                    and plen > left:
                # a sound chunk header whose payload the file does not hold: cut short
                raise CorruptFileError(
                    f"{self.name}: truncated file (a chunk of {n} rows after {total} rows "
                    f"declares {plen} bytes, the file holds {left} more)")
            raise CorruptFileError(f"{self.name}: chunk declares an absurd size ({n} rows)")
        if self.key_type == "int64" and plen != min_len:
            raise CorruptFileError(f"{self.name}: chunk size does not match its row count")
        # readinto a bytearray: decoded arrays are writable views, not second copies
        if self._size is not None and hasattr(self._f, "readinto"):
            # np.empty: uninitialized (no zero fill), writable, readinto fills it
            if spares is not None:
                if len(spares[which]) < plen:
                    spares[which] = np.empty(plen, dtype=np.uint8)
                payload = spares[which][:plen]
            else:
                payload = np.empty(plen, dtype=np.uint8)
            if self._f.readinto(payload) != plen:
                raise CorruptFileError(f"{self.name}: truncated file (while reading "
                                       "chunk payload)")
        else:  # a stream of unknown size: never preallocate what the file claims
            payload = np.frombuffer(bytearray(self._read_exact(plen, "chunk payload")),
                                    dtype=np.uint8)
        state["crcs"] = zlib.crc32(struct.pack("<I", pcrc), state["crcs"])
        state["total"] = total + n
        return payload, n, pcrc, total

    def _decode(self, payload: bytes | bytearray | memoryview | np.ndarray, n: int
                ) -> tuple[np.ndarray, np.ndarray]:
        itemsize = self.layout.itemsize
        if self.key_type == "int64":
            keys = np.frombuffer(payload, dtype="<i8", count=n).astype(np.int64, copy=False)
            recs = np.frombuffer(payload, dtype=self.layout.dtype, count=n, offset=8 * n)
            return keys, recs
        lens = np.frombuffer(payload, dtype="<u4", count=n).astype(np.int64)
        kbytes = int(lens.sum())
        if 4 * n + kbytes + n * itemsize != len(payload):
            raise CorruptFileError(f"{self.name}: chunk key lengths do not add up")
        kb = bytes(payload[4 * n:4 * n + kbytes])
        ends = np.cumsum(lens)
        starts = ends - lens
        keys = np.empty(n, dtype=object)
        keys[:] = [kb[s:e] for s, e in zip(starts.tolist(), ends.tolist())]
        recs = np.frombuffer(payload, dtype=self.layout.dtype, count=n, offset=4 * n + kbytes)
        return keys, recs

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(keys, records)`` chunks; raises ``CorruptFileError`` where damage starts."""
        return self._chunks(decode=True)

    def verify(self) -> int:
        """Check every checksum and the trailer; return the row count."""
        return sum(self._chunks(decode=False, reuse=True))

    def iter_transient(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Like iteration, but each chunk's arrays are only valid until the next one is read
        (one buffer is reused): for checking passes that keep nothing."""
        return self._chunks(decode=True, reuse=True)

    def close(self) -> None:
        self._stop_read_ahead()
        if self._owns:
            self._f.close()

    def __enter__(self) -> NativeReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def is_native(path: str | os.PathLike) -> bool:
    """True when the file starts with the native magic."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


__all__ = ["NativeReader", "NativeWriter", "is_native", "FORMAT_VERSION", "MAGIC", "Path"]
