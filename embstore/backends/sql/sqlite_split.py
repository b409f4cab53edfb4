"""Split points of a SQLite rowid table read from the upper levels of its B-tree.

A plan of ``n`` parts needs ``n - 1`` keys that cut the table into runs of about equal
length. SQL finds the ``len/n``-th key with ``count(*)`` and ``ORDER BY k LIMIT 1 OFFSET m``,
which step through every row before it: ~60 ms of the planner's CPU for 2 parts of 1M rows of
dim 64 (the pages of half the table are read), ~2.6 s for 64 parts, before any part starts. An
int64 store keeps its key as the rowid (``INTEGER PRIMARY KEY``), and the rowid B-tree holds
such keys already: its interior pages cut it into subtrees whose leaves all lie at one depth,
each between about half full and full. So :func:`rowid_bounds` reads the interior pages level
by level (~300 for 1M rows; ~2 ms) until a level has at least ``_SUBTREES_PER_PART * n``
pages or the next one is the leaves, counts the children of that level's pages (from their
headers) and cuts between the children nearest to every ``k/n``-th share of them: the parts
come out equal within a leaf where the level is the one above the leaves.

The pages are read from the database file, overlaid with the committed frames of its
write-ahead log (``-wal``): what a reader sees, except that a writer may change it meanwhile.
The cut points are only the bounds of ranges that chain from open end to open end: whatever
they are, every row is in exactly one part. A page read while a writer moved it could only
unbalance the parts, never lose or repeat a row. Anything unexpected (a page of another kind
where an interior page should be, keys out of order, a small table) returns None and the
caller counts and walks the keys instead.

The format: https://www.sqlite.org/fileformat2.html (B-tree pages, the WAL).
"""

from __future__ import annotations

import bisect
import os
import struct

#: at least this many subtrees per part before cutting, where the levels allow
_SUBTREES_PER_PART = 64
#: at most this many pages read
_MAX_READ_PAGES = 4096
#: a longer write-ahead log is not indexed (one read per frame header): the plan counts
_MAX_WAL_FRAMES = 1 << 16
_MAGIC = b"SQLite format 3\x00"
_TABLE_INTERIOR, _TABLE_LEAF = 0x05, 0x0D
_WAL_MAGIC = (0x377F0682, 0x377F0683)
_WAL_HEADER = struct.Struct(">IIIIII")  # magic, version, page size, checkpoint, salt-1, salt-2
_FRAME = struct.Struct(">IIII")  # page, database size after a commit (else 0), salt-1, salt-2
_FRAME_BYTES = 24
_INTERIOR = struct.Struct(">BHHHBI")  # type, freeblock, cells, content, fragmented, rightmost


def _varint(data: bytes, pos: int) -> int:
    """A SQLite varint at ``pos`` as a signed 64-bit integer."""
    v = 0
    for i in range(8):
        b = data[pos + i]
        v = (v << 7) | (b & 0x7F)
        if b < 0x80:
            break
    else:
        v = (v << 8) | data[pos + 8]
    return v - (1 << 64) if v >= 1 << 63 else v


class _Pages:
    """Pages of a database file as of its last commit: the main file, overlaid with the
    committed frames of its WAL."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        try:
            head = os.pread(self.fd, 100, 0)
            if len(head) < 100 or head[:16] != _MAGIC:
                raise ValueError("not a SQLite database file")
            psize = struct.unpack_from(">H", head, 16)[0]
            self.psize = 65536 if psize == 1 else psize
            if self.psize < 512 or self.psize & (self.psize - 1):
                raise ValueError("bad page size")
            self.count = os.fstat(self.fd).st_size // self.psize
            self.wal = self._wal_frames(path + "-wal")
            self.reads = 0
        except BaseException:
            os.close(self.fd)
            raise

    def _wal_frames(self, path: str) -> tuple[int, dict[int, int]]:
        """The WAL's descriptor and, per page, the offset of its last committed frame."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return -1, {}
        try:
            return fd, self._committed(fd)
        except BaseException:
            os.close(fd)
            raise

    def _committed(self, fd: int) -> dict[int, int]:
        head = os.pread(fd, _WAL_HEADER.size, 0)
        if len(head) < _WAL_HEADER.size:
            return {}
        magic, _, psize, _, salt1, salt2 = _WAL_HEADER.unpack(head)
        if magic not in _WAL_MAGIC or psize != self.psize:
            return {}
        size = os.fstat(fd).st_size
        if (size - 32) // (_FRAME_BYTES + self.psize) > _MAX_WAL_FRAMES:
            raise ValueError("a write-ahead log too long to index")  # count instead
        committed: dict[int, int] = {}
        pending: dict[int, int] = {}
        # (frames of an older generation have other salts; checksums are not checked: a torn
        # frame could only unbalance the plan)
        off = 32
        while off + _FRAME_BYTES + self.psize <= size:
            page, commit, s1, s2 = _FRAME.unpack(os.pread(fd, _FRAME.size, off))
            if (s1, s2) != (salt1, salt2):
                break
            pending[page] = off + _FRAME_BYTES
            if commit:
                committed.update(pending)
                pending.clear()
                self.count = max(self.count, commit)
            off += _FRAME_BYTES + self.psize
        return committed

    def read(self, pgno: int) -> bytes:
        if not 0 < pgno <= self.count:
            raise ValueError("page out of range")
        self.reads += 1
        if self.reads > _MAX_READ_PAGES:
            raise ValueError("too many pages")
        fd, frames = self.wal
        at = frames.get(pgno)
        data = (os.pread(self.fd, self.psize, (pgno - 1) * self.psize) if at is None
                else os.pread(fd, self.psize, at))
        if len(data) != self.psize:
            raise ValueError("short page")
        return data

    def close(self) -> None:
        os.close(self.fd)
        if self.wal[0] >= 0:
            os.close(self.wal[0])


def _header(data: bytes, pgno: int) -> tuple[int, int, int]:
    """Offset of the B-tree header, number of cells and rightmost child of a table interior
    page; ValueError on any other page."""
    at = 100 if pgno == 1 else 0
    kind, _, cells, _, _, right = _INTERIOR.unpack_from(data, at)
    if kind != _TABLE_INTERIOR or not cells:
        raise ValueError("not a table interior page")
    return at, cells, right


def _interior(data: bytes, pgno: int) -> tuple[list[tuple[int, int]], int]:
    """``(child page, largest rowid in it)`` of a table interior page's cells, and its
    rightmost child (the rowids above the last cell's)."""
    at, cells, right = _header(data, pgno)
    out = []
    for off in struct.unpack_from(f">{cells}H", data, at + _INTERIOR.size):
        if not at + _INTERIOR.size <= off <= len(data) - 5:
            raise ValueError("cell outside the page")
        out.append((struct.unpack_from(">I", data, off)[0], _varint(data, off + 4)))
    return out, right


def rowid_bounds(path: str, root: int, n: int) -> list[int] | None:
    """``n - 1`` cut keys (``k >= cut`` goes right) of the rowid table whose B-tree root is
    page ``root`` of the database file ``path``, or None where counting has to do (a table
    of one interior level, an unexpected layout)."""
    if n < 2:
        return [] if n == 1 else None
    try:
        pages = _Pages(path)
    except (OSError, ValueError, struct.error):
        return None
    try:
        level, data = _level(pages, root, n)
        if len(level) < 2:  # the root's children are leaves: a small table, counted exactly
            return None
        cuts = _cuts(level, data, n)
    except (OSError, ValueError, struct.error, IndexError):
        return None
    finally:
        pages.close()
    if any(not -2**63 < c < 2**63 for c in cuts) or any(a > b for a, b in zip(cuts, cuts[1:])):
        return None
    return cuts


def _cuts(level: list[tuple[int, int | None]], data: list[bytes], n: int) -> list[int]:
    """Cut keys at the children of the level's pages nearest to every ``k/n``-th share of
    all their children (children of one level hold about equal numbers of rows: leaves,
    every one between about half full and full)."""
    cum = [0]
    for d, (p, _) in zip(data, level):
        cum.append(cum[-1] + _header(d, p)[1] + 1)
    out = []
    for k in range(1, n):
        target = cum[-1] * k / n
        j = min(bisect.bisect_right(cum, target) - 1, len(level) - 1)
        cells, _ = _interior(data[j], level[j][0])  # decoded only where a cut falls
        i = round(target - cum[j])  # children of page j left of the cut
        if i <= 0 and j == 0:
            i = 1  # the first page's first child has no lower bound
        if i <= 0:
            lo = level[j][1]
            if lo is None:
                raise ValueError("a subtree without a lower bound")
            out.append(lo)
        elif i > len(cells):
            if j + 1 < len(level):
                lo = level[j + 1][1]
                if lo is None:
                    raise ValueError("a subtree without a lower bound")
                out.append(lo)
            else:
                out.append(cells[-1][1] + 1)
        else:
            out.append(cells[i - 1][1] + 1)  # child i holds the rowids above cell i - 1's
    return out


def _level(pages: _Pages, root: int, n: int) -> tuple[list[tuple[int, int | None]], list[bytes]]:
    """The pages of the deepest interior level read (``(page, smallest rowid it may hold)``,
    None for the first) and their contents. Only that level's pages are read, not their
    children (~300 a page): the cuts fall between children, counted as equal."""
    level: list[tuple[int, int | None]] = [(root, None)]
    while True:
        data = [pages.read(p) for p, _ in level]
        fanout = sum(_header(d, p)[1] + 1 for d, (p, _) in zip(data, level))
        if len(level) >= _SUBTREES_PER_PART * n or pages.reads + fanout > _MAX_READ_PAGES:
            return level, data
        first = _interior(data[0], level[0][0])[0][0][0]
        if pages.read(first)[100 if first == 1 else 0] == _TABLE_LEAF:
            return level, data  # the next level holds the leaves
        nxt: list[tuple[int, int | None]] = []
        for d, (pgno, lo) in zip(data, level):
            cells, right = _interior(d, pgno)
            nxt.append((cells[0][0], lo))
            nxt += [(child, prev + 1) for (child, _), (_, prev) in zip(cells[1:], cells)]
            nxt.append((right, cells[-1][1] + 1))
        level = nxt
