"""Shared pieces of the interchange formats: chunks, reader/writer roles, atomic output.

Every reader yields :class:`Chunk` objects of a bounded number of rows, so memory stays
constant in the size of the file, and can be iterated more than once (import validates the
whole file in a first pass before it writes anything). Every writer receives whole records
(``keys``, ``records`` of the store's layout) and writes what its format can carry; a path is
written through a temporary file that is renamed only on success.
"""

from __future__ import annotations

import abc
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from ..errors import CorruptFileError, InvalidInputError
from ..layout import Layout
from .limits import deliver, output_mode

#: rows per chunk yielded by readers
CHUNK_ROWS = 65536
#: largest dimension a file may declare; larger headers are treated as hostile
MAX_DIM = 1 << 20
#: longest key a text/binary format may hold before the file is treated as damaged
MAX_KEY_BYTES = 1 << 16

#: kinds of keys a file can carry: int64 and bytes map to the store key types of the same
#: name; "text" keys (word2vec, TSV) are UTF-8 strings, stored as bytes in a bytes store or
#: parsed as decimal integers for an int64 store.
KEY_KINDS = ("int64", "bytes", "text")


@dataclass
class Chunk:
    """A batch of rows read from a file.

    Attributes
    ----------
    keys : np.ndarray
        ``int64`` array, or object array of ``bytes`` (for ``bytes`` and ``text`` kinds).
    vectors : np.ndarray
        ``(n, dim)`` float32.
    records : np.ndarray or None
        Whole records of the file's layout, when the format carries them.
    rows : np.ndarray
        0-based row number in the file of each row (for error messages).
    bad : list of (row, reason)
        Rows the parser could not decode; they are not in ``keys``/``vectors``.
    """

    keys: np.ndarray
    vectors: np.ndarray
    rows: np.ndarray
    records: np.ndarray | None = None
    bad: list[tuple[int, str]] = field(default_factory=list)


class FormatReader(abc.ABC):
    """A file opened for reading. Subclasses set the attributes below in ``__init__``."""

    format: str = ""
    #: one of KEY_KINDS
    key_kind: str = "text"
    dim: int = 0
    #: store metadata carried by the file (native, Parquet written by embstore), else None
    header: dict | None = None
    #: layout of ``Chunk.records`` when the format carries whole records, else None
    layout: Layout | None = None
    #: number of rows the file declares, when it does
    declared_rows: int | None = None
    #: how error messages name a row: ``f"{row_word} {row + row_offset}"``
    row_word: str = "row"
    row_offset: int = 1

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.name = self.path

    @abc.abstractmethod
    def chunks(self, batch_size: int = CHUNK_ROWS, *, validate: bool = False
               ) -> Iterator[Chunk]:
        """Yield every row once, in file order. Raises ``CorruptFileError`` on structural
        damage (truncation, bad checksum, bad header) — damage no row-skipping can repair.
        ``validate=True`` (a checking pass) allows leaving ``records`` out."""

    def assume_dim(self, dim: int) -> None:
        """A file without rows (``dim == 0``) has no dimension of its own: take ``dim`` (the
        store's), so that it imports into that store as an empty file."""
        if self.dim == 0:
            self.dim = dim

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release file handles."""

    def __enter__(self) -> FormatReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class FormatWriter(abc.ABC):
    """A file being written from store records; use as a context manager."""

    format: str = ""

    def __init__(self, dest: str | os.PathLike, meta: dict[str, Any]) -> None:
        self.dest = os.fspath(dest)
        self.meta = meta
        self.layout = Layout.from_json(meta["layout"])
        self.key_type = meta["key_type"]
        self.rows = 0
        self._done = False

    @abc.abstractmethod
    def write(self, keys: np.ndarray, records: np.ndarray) -> None:
        """Append rows (keys normalized to the store's key type, records of its layout)."""

    @abc.abstractmethod
    def _finish(self) -> None:
        """Complete the file and move it into place."""

    @abc.abstractmethod
    def _discard(self) -> None:
        """Remove every temporary file."""

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._finish()

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._discard()

    def __enter__(self) -> FormatWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


# -- helpers ---------------------------------------------------------------------------------------
def temp_beside(final: str, suffix: str = ".tmp") -> tuple[BinaryIO, str]:
    """A temporary file in the directory of ``final`` (so ``os.replace`` is atomic), or in
    the system's temporary directory when ``final`` is a FIFO or device (see
    :func:`~embstore.io.limits.output_mode`, which also refuses symlinks and the like)."""
    if output_mode(final) == "stream":
        d = tempfile.gettempdir()
    else:
        d = os.path.dirname(os.path.abspath(final))
    fd, tmp = tempfile.mkstemp(prefix=".embstore-", suffix=suffix, dir=d)
    # mkstemp makes the file private (0600); the finished file gets the usual permissions.
    os.fchmod(fd, 0o666 & ~current_umask())
    return os.fdopen(fd, "wb"), tmp


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def commit(f: BinaryIO, tmp: str, final: str) -> None:
    """Flush, fsync and rename a temporary file into place (or stream it into a FIFO or
    character device destination)."""
    f.flush()
    os.fsync(f.fileno())
    f.close()
    deliver(tmp, final)


def discard(f: BinaryIO | None, tmp: str | None) -> None:
    if f is not None and not f.closed:
        f.close()
    if tmp is not None and os.path.exists(tmp):
        os.unlink(tmp)


def file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError as e:
        raise CorruptFileError(f"cannot open {path}: {e.strerror}") from e


def check_dim(dim: int, name: str) -> int:
    if not 0 < dim <= MAX_DIM:
        raise CorruptFileError(f"{name}: declares an absurd dimension ({dim})")
    return dim


def text_keys(keys: np.ndarray, key_type: str, fmt: str, forbidden: bytes) -> list[str]:
    """Render store keys as text for word2vec/TSV, refusing keys the format cannot hold.

    int64 keys become decimal strings. bytes keys must be non-empty UTF-8 without any of the
    ``forbidden`` separator bytes; anything else would be read back as another key.
    """
    if key_type == "int64":
        return [str(k) for k in keys.tolist()]
    out = []
    for k in keys:
        bad = not k or any(c in k for c in forbidden)
        try:
            s = k.decode("utf-8")
        except UnicodeDecodeError:
            bad = True
        if bad:
            raise InvalidInputError(
                f"key {k!r} cannot be written in {fmt} format (empty, not UTF-8, or holds a "
                f"separator); use the native, parquet or npz format for such keys"
            )
        out.append(s)
    return out


_INT_RE = re.compile(rb"[+-]?[0-9]{1,19}")
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


def parse_int_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decimal text keys -> (int64 keys, ok mask). Only ``[+-]digits`` in int64 range count."""
    out = np.zeros(len(keys), dtype=np.int64)
    ok = np.zeros(len(keys), dtype=bool)
    for i, k in enumerate(keys):
        if _INT_RE.fullmatch(k):
            v = int(k)
            if _I64_MIN <= v <= _I64_MAX:
                out[i] = v
                ok[i] = True
    return out, ok


def format_vector_rows(vectors: np.ndarray) -> list[str]:
    """Each float32 row as space-separated decimals that read back bit-identically.

    ``%.9g`` (9 significant digits) round-trips every float32 value, also through a float64
    parse as gensim does.
    """
    fmt = " ".join(["%.9g"] * vectors.shape[1])
    return [fmt % tuple(r) for r in vectors.tolist()]


def parse_text_rows(
    keys: list[bytes], values: list[bytes], first_row: int, dim: int,
    vectors: np.ndarray | None = None,
) -> Chunk:
    """Turn split text lines into a Chunk: UTF-8 keys, float32 vectors, bad rows listed.

    ``values`` holds each row's value text; the fast path parses them all at once with
    numpy's C tokenizer, and only when that fails are they parsed one by one to find the bad
    rows. Binary formats pass decoded ``vectors`` instead (then only keys are checked).
    """
    n = len(keys)
    good = np.ones(n, dtype=bool)
    bad: list[tuple[int, str]] = []
    vecs = vectors
    if vecs is None and n:
        try:
            vecs = np.loadtxt(values, dtype=np.float32, comments=None, ndmin=2)
            if vecs.shape != (n, dim):
                vecs = None
        except ValueError:
            vecs = None
        if vecs is None:
            vecs = np.zeros((n, dim), dtype=np.float32)
            for i, v in enumerate(values):
                toks = v.split()
                if len(toks) != dim:
                    good[i] = False
                    bad.append((first_row + i, f"{len(toks)} values where {dim} are expected"))
                    continue
                try:
                    vecs[i] = np.array([float(t) for t in toks], dtype=np.float32)
                except ValueError:
                    good[i] = False
                    bad.append((first_row + i, "a value is not a number"))
    if vecs is None:
        vecs = np.zeros((0, dim), dtype=np.float32)
    karr = np.empty(n, dtype=object)
    karr[:] = keys
    try:
        # A separator that is no UTF-8 continuation byte: the join decodes iff every key does.
        all_utf8 = all(keys) and (b"\n".join(keys).decode("utf-8") or True)
    except UnicodeDecodeError:
        all_utf8 = False
    for i, k in enumerate(keys):
        if all_utf8 or not good[i]:
            continue
        if not k:
            good[i] = False
            bad.append((first_row + i, "empty key"))
            continue
        try:
            k.decode("utf-8")
        except UnicodeDecodeError:
            good[i] = False
            bad.append((first_row + i, f"key {k[:40]!r} is not valid UTF-8"))
    rows = np.arange(first_row, first_row + n, dtype=np.int64)
    if not good.all():
        karr, vecs, rows = karr[good], vecs[good], rows[good]
        bad.sort()
    return Chunk(karr, np.ascontiguousarray(vecs, dtype=np.float32), rows, None, bad)


def describe_row(reader: FormatReader, row: int, reason: str) -> str:
    return f"{reader.name}: {reader.row_word} {row + reader.row_offset}: {reason}"


class _Raised:
    """An exception raised by a :func:`prefetch` producer, carried to the consumer."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_DONE = object()


def prefetch(items: Iterator[Any] | Any, depth: int = 1, name: str = "embstore-prefetch"
             ) -> Iterator[Any]:
    """Iterate ``items`` in a background thread, ``depth`` items ahead of the consumer.

    For pipelines whose stages release the GIL (file and LMDB reads, Parquet decoding, zlib,
    numpy copies): producing the next batch overlaps consuming this one. At most ``depth + 2``
    items exist at once (queued, being produced, being consumed), so memory stays bounded.
    An exception of the producer is raised in the consumer, after the items produced before
    it; closing the returned generator early stops the producer and closes ``items`` (in the
    producer's thread, which is the only one that ever runs it).
    """
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()

    def offer(item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        it = iter(items)
        try:
            for item in it:
                if not offer(item):
                    break
            else:
                offer(_DONE)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            offer(_Raised(e))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    worker = threading.Thread(target=produce, name=name, daemon=True)
    worker.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, _Raised):
                raise item.exc
            yield item
    finally:
        stop.set()
        # Bounded: an asynchronous exception (Ctrl-C, a signal handler's exception) raised
        # while this thread held the queue's internal lock leaves that lock held, and the
        # producer then waits on it forever; it is a daemon thread, so it is left behind.
        worker.join(timeout=5.0)
