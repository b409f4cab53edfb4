"""Bounds every import checks before anything is written (hostile and damaged files).

Kept in one small module of pure checks, called from the transfer pipelines, so that a file
is judged the same way whichever path reads it (``embstore import``, ``store.import_``,
``import_file``). Each check raises :class:`~embstore.errors.CorruptFileError` (or
:class:`~embstore.errors.InvalidInputError` for a key the target cannot hold) with a
message naming the file.

The bounds (see ``docs/cli.md``, "Import limits"):

* optimizer slots are finite, and those the target's optimizer accumulates squares in
  (Adagrad ``accum``, Adam ``v``, FTRL ``n``) are ``>= 0``: a NaN or negative slot would make
  the next ``update`` write NaN vectors.
* record stamps (``count``, ``last_step``, ``version``) and the header's ``step``/``version``
  are integers in ``[0, 2**62]``; ``last_seen`` is finite and in ``[0, 2**62]``. Stamps only
  grow (``version`` by one per write, ``step`` by one per update), so 2**62 leaves 2**62
  writes before an int64 could overflow.
* decoded data: a chunk holds at most ``CHUNK_BYTES`` of decoded rows (rows are counted in
  bytes, not rows: a 2**20-dim vector is 4 MiB); a compressed part of a file (an ``.npz``
  member, a Parquet row group) may decode to at most ``MAX_INFLATION`` times its stored size
  once it decodes to more than ``INFLATION_FLOOR`` (real embeddings compress less than 2:1;
  zip-bomb style ratios of 1000:1 and more are refused before they are decoded).
* policy state saved in a header (compressed) decodes to at most the policy's own size, or
  ``MAX_POLICY_STATE`` for policies of no fixed size.
* keys must fit the target backend (``max_key_bytes``: LMDB 510, PostgreSQL 2680, Bigtable
  4095 bytes; memory://, RocksDB and SQLite have no limit).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from ..errors import CorruptFileError, InvalidInputError
from ..valuetypes import to_float32

#: largest stamp, step or count accepted on import
MAX_STAMP = 1 << 62
#: decoded bytes per chunk a reader yields (and a pipeline keeps per step)
CHUNK_BYTES = 32 << 20
#: largest ratio of decoded to stored bytes of a compressed part of a file ...
MAX_INFLATION = 100
#: ... once it decodes to more than this many bytes
INFLATION_FLOOR = 64 << 20
#: decoded policy state of a policy whose size is not fixed by its configuration
MAX_POLICY_STATE = 256 << 20

_INT_STAMPS = ("count", "last_step", "version")


def chunk_rows(row_bytes: int, batch_size: int) -> int:
    """Rows per chunk: ``batch_size``, lowered so a chunk decodes to at most CHUNK_BYTES."""
    return max(1, min(int(batch_size), CHUNK_BYTES // max(1, int(row_bytes))))


def check_inflation(name: str, what: str, stored: int, decoded: int) -> None:
    """Refuse a compressed part of a file that would decode to absurdly more than it stores."""
    if decoded > INFLATION_FLOOR and decoded > MAX_INFLATION * max(1, stored):
        raise CorruptFileError(
            f"{name}: {what} stores {stored} bytes but decodes to {decoded} bytes (more than "
            f"{MAX_INFLATION}x; a compression bomb?); refused")


def _int_in_range(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) and 0 <= v <= MAX_STAMP


def check_header(name: str, header: dict[str, Any] | None) -> None:
    """Refuse store metadata (native header, Parquet ``embstore`` metadata) whose counters
    could not be carried on: ``step``/``version`` outside ``[0, 2**62]``, a bad ``seed``."""
    if not header:
        return
    for field in ("step", "version"):
        if field in header and not _int_in_range(header[field]):
            raise CorruptFileError(
                f"{name}: header {field} {header[field]!r} is not an integer in [0, 2**62]; "
                "nothing imported")
    seed = header.get("seed", 0)
    if not (isinstance(seed, int) and not isinstance(seed, bool)) or not (
            -(1 << 63) <= seed < (1 << 64)):
        raise CorruptFileError(f"{name}: header seed {seed!r} is not a 64-bit integer")
    since = header.get("since")
    if since is not None and not _int_in_range(since):
        raise CorruptFileError(f"{name}: header since {since!r} is not an integer in [0, 2**62]")
    extra = header.get("extra", {})
    if extra is not None and not isinstance(extra, dict):
        raise CorruptFileError(f"{name}: header extra is not an object")


def check_stamps(name: str, records: np.ndarray | None, rows: np.ndarray | None = None,
                 row_word: str = "row", row_offset: int = 1) -> None:
    """Refuse records whose stamps are out of range (see the module docstring)."""
    if records is None or len(records) == 0 or records.dtype.names is None:
        return
    bad: np.ndarray | None = None
    field = ""
    for f in _INT_STAMPS:
        if f in records.dtype.names:
            col = records[f]
            wrong = (col < 0) | (col > MAX_STAMP)
            if wrong.any():
                bad, field = wrong, f
                break
    if bad is None and "last_seen" in records.dtype.names:
        col = records["last_seen"]
        with np.errstate(invalid="ignore"):
            wrong = ~((col >= 0) & (col <= float(MAX_STAMP)))  # NaN fails both
        if wrong.any():
            bad, field = wrong, "last_seen"
    if bad is None:
        return
    i = int(np.flatnonzero(bad)[0])
    row = int(rows[i]) if rows is not None else i
    value = records[field][i].item()
    more = int(bad.sum()) - 1
    raise CorruptFileError(
        f"{name}: {row_word} {row + row_offset}: {field} {value!r} is out of range "
        f"[0, 2**62]{f' (and {more} more rows)' if more else ''}; nothing imported")


def check_slots(name: str, records: np.ndarray | None, slots: Sequence[str], slot_dtype: str,
                nonnegative: Collection[str], rows: np.ndarray | None = None,
                row_word: str = "row", row_offset: int = 1) -> None:
    """Refuse records whose optimizer slots the optimizer could not step on: a NaN or
    infinite value in any slot, a negative one in a slot of ``nonnegative`` (stored in
    ``slot_dtype``; the module docstring lists them)."""
    if records is None or len(records) == 0 or records.dtype.names is None:
        return
    for field in slots:
        if field not in records.dtype.names:
            continue
        vals = to_float32(records[field], slot_dtype).reshape(len(records), -1)
        with np.errstate(invalid="ignore"):
            ok = np.isfinite(vals) & ((vals >= 0) if field in nonnegative else True)
        bad = ~ok.all(axis=1)
        if not bad.any():
            continue
        i = int(np.flatnonzero(bad)[0])
        value = vals[i][~ok[i]][0].item()
        row = int(rows[i]) if rows is not None else i
        more = int(bad.sum()) - 1
        rule = "finite and >= 0" if field in nonnegative else "finite"
        raise CorruptFileError(
            f"{name}: {row_word} {row + row_offset}: optimizer slot {field} holds {value!r} "
            f"(it must be {rule}){f' (and {more} more rows)' if more else ''}; nothing "
            "imported")


def check_count(name: str, what: str, value: Any) -> int:
    """A row or item count read from a file: a non-negative integer within MAX_STAMP."""
    if not _int_in_range(value):
        raise CorruptFileError(f"{name}: {what} {value!r} is not a count in [0, 2**62]")
    return int(value)


def max_key_bytes(backend: Any) -> int | None:
    """The longest bytes key ``backend`` can store (its declared ``max_key_bytes``; a layer
    declares the shortest of the backends it wraps); None: no limit."""
    limit = backend.max_key_bytes
    return limit if isinstance(limit, int) else None


def check_key_lengths(name: str, keys: np.ndarray, limit: int | None, where: str,
                      rows: np.ndarray | None = None, row_word: str = "row",
                      row_offset: int = 1) -> None:
    """Refuse the file when a bytes key is longer than the target can store."""
    if limit is None or keys.dtype != object or len(keys) == 0:
        return
    lens = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    over = lens > limit
    if over.any():
        i = int(np.flatnonzero(over)[0])
        row = int(rows[i]) if rows is not None else i
        raise InvalidInputError(
            f"{name}: {row_word} {row + row_offset}: key of {int(lens[i])} bytes is longer than "
            f"{where} can store ({limit} bytes); nothing imported")


def check_input_path(path: str) -> None:
    """Refuse inputs that are neither regular files nor directories (a FIFO would block the
    reader forever, a device would be read without end)."""
    try:
        st = os.stat(path)
    except OSError:
        return  # the reader reports a missing file with its own message
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise CorruptFileError(f"{path}: not a regular file ({_kind(st.st_mode)}); refused")


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return what
    return "a special file"


def finite_float32(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float values as float32 and a per-row mask of rows whose finite values overflow float32
    (they would silently become inf; the caller reports them as bad rows)."""
    if values.dtype == np.float32:
        return values, np.zeros(len(values), dtype=bool)
    with np.errstate(over="ignore", invalid="ignore"):
        out = values.astype(np.float32)
    if values.ndim != 2 or not len(values):
        return out, np.zeros(len(values), dtype=bool)
    lost = ~np.isfinite(out) & np.isfinite(values)
    return out, lost.any(axis=1)


# -- export destinations ---------------------------------------------------------------------------
def output_mode(path: str) -> str:
    """How an export reaches ``path``: ``"replace"`` (a regular file or nothing there yet:
    written beside it and renamed over it, atomically) or ``"stream"`` (a FIFO or character
    device such as ``/dev/null``: the finished file is written into it).

    Symbolic links are not followed to files: renaming over one would replace the link, and
    writing through it would overwrite whatever it points at (in a shared directory, another
    user's file), so an export to a symlink is refused unless it points at a FIFO or character
    device (``/dev/stdout``). Block devices, sockets and directories are refused.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "replace"
    except OSError as e:
        raise InvalidInputError(f"{path}: cannot export here: {e.strerror}") from e
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        try:
            target: int | None = os.stat(path).st_mode
        except OSError:
            target = None
        if target is None or not (stat.S_ISFIFO(target) or stat.S_ISCHR(target)):
            raise InvalidInputError(
                f"{path}: is a symbolic link; export does not replace or write through links "
                "to files (export to the file it points at instead)")
        return "stream"
    if stat.S_ISREG(mode):
        return "replace"
    if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode):
        return "stream"
    raise InvalidInputError(f"{path}: is {_kind(mode)}; export writes regular files, FIFOs "
                            "and character devices only")


def stream_into(tmp: str, final: str) -> None:
    """Copy a finished temporary file into a FIFO/character device, then remove it."""
    import shutil

    try:
        with open(tmp, "rb") as src, open(final, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    finally:
        os.unlink(tmp)


def deliver(tmp: str, final: str) -> None:
    """Move a finished temporary file to ``final`` as :func:`output_mode` says."""
    if output_mode(final) == "stream":
        stream_into(tmp, final)
    else:
        os.replace(tmp, final)
