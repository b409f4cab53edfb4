"""Split points of an LMDB table read from the upper levels of its B-tree, not from a key walk.

A plan of ``n`` parts needs ``n - 1`` keys that cut the table into runs of about equal length.
Walking the keys to every ``len/n``-th costs ~0.2 us a key in Python (~0.1 s per 1M rows for
two parts), time the planner spends before any part starts. The B-tree holds such keys
already: the separators of its branch pages cut it into subtrees that LMDB keeps balanced (all
leaves at one depth, every page between half full and full). So :func:`btree_bounds` reads a
few branch pages of the top levels -- from the data file, under a read transaction, whose
snapshot keeps those pages from being reused -- until it has at least
``_SUBTREES_PER_PART * n`` subtrees, and cuts at the subtree boundaries nearest to every
``k/n``-th share of them (counted as equal: the parts come out equal within a few per cent).

The cut points are only the bounds of ranges that chain from open end to open end: whatever
they are, every row is in exactly one part. Misreading the pages could only unbalance the
parts, never lose or repeat a row. Anything unexpected (another LMDB data format, a page that
is not a branch page where one should be, separators out of order) returns None and the
caller walks the keys instead.
"""

from __future__ import annotations

import os
import struct
from typing import Any

#: at least this many subtrees per part before cutting (the share of each cut is then within
#: ~1/64 of a part of the ideal, plus the spread of subtree sizes)
_SUBTREES_PER_PART = 64
#: tables with fewer rows are cut by walking their keys (exact, and cheap at that size)
WALK_ROWS = 1 << 16

# LMDB 0.9 on a 64-bit build: the named database's record in the main database (MDB_db),
# the page header (MDB_page) and a branch node (MDB_node) -- see lmdb.h / mdb.c
_DB = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow, entries, root
_PAGE = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper
_NODE = struct.Struct("<HHHH")  # lo, hi, flags (the child's pgno in 48 bits), key size
_P_BRANCH, _P_OTHER = 0x01, 0x02 | 0x04 | 0x08 | 0x20  # leaf, overflow, meta, leaf2
_MAX_READ_PAGES = 4096


def _branch_children(data: bytes, pgno: int, psize: int) -> list[tuple[int, bytes | None]]:
    """``(child page, separator key)`` of a branch page; the first child's key is None (the
    page's own lower bound). Raises ValueError on anything but a sane branch page."""
    if len(data) != psize:
        raise ValueError("short page")
    page_no, _, flags, lower, upper = _PAGE.unpack_from(data)
    if page_no != pgno or not flags & _P_BRANCH or flags & _P_OTHER:
        raise ValueError("not the branch page expected")
    if not _PAGE.size <= lower <= upper <= psize:
        raise ValueError("bad page bounds")
    count = (lower - _PAGE.size) >> 1
    out: list[tuple[int, bytes | None]] = []
    for off in struct.unpack_from(f"<{count}H", data, _PAGE.size):
        if not upper <= off <= psize - _NODE.size:
            raise ValueError("node outside the page")
        lo, hi, top, ksize = _NODE.unpack_from(data, off)
        start = off + _NODE.size
        if start + ksize > psize:
            raise ValueError("key outside the page")
        out.append((lo | hi << 16 | top << 32, bytes(data[start:start + ksize]) if out else None))
    if not out:
        raise ValueError("empty branch page")
    return out


def btree_bounds(txn: Any, main_db: Any, name: bytes, stat: dict[str, int], path: str,
                 n: int) -> list[bytes] | None:
    """``n - 1`` cut keys of the named database ``name`` from its B-tree's upper levels, or
    None where the walk has to do (a small table, an unexpected layout).

    ``txn`` is a read transaction (it pins the snapshot whose pages are read), ``main_db``
    the main database's handle, ``stat`` the ``txn.stat()`` of the named database and
    ``path`` the environment's data file.
    """
    raw = txn.get(name, db=main_db)
    if raw is None or len(raw) != _DB.size:
        return None
    _, _, depth, _, _, _, entries, root = _DB.unpack(raw)
    psize = int(stat["psize"])
    if (depth != stat["depth"] or entries != stat["entries"] or depth < 2
            or entries < max(WALK_ROWS, n) or psize < 512):
        return None
    try:
        with open(path, "rb") as f:
            pages = os.fstat(f.fileno()).st_size // psize
            level: list[tuple[int, bytes | None]] = [(root, None)]
            reads = 0
            # expand whole levels while they hold too few subtrees and are branch pages
            # (a tree of depth d has branch pages on its top d - 1 levels)
            for _ in range(depth - 1):
                if len(level) >= _SUBTREES_PER_PART * n:
                    break
                reads += len(level)
                if reads > _MAX_READ_PAGES:
                    return None
                nxt: list[tuple[int, bytes | None]] = []
                for pgno, key in level:
                    if not 0 < pgno < pages:
                        return None
                    children = _branch_children(os.pread(f.fileno(), psize, pgno * psize),
                                                pgno, psize)
                    nxt.append((children[0][0], key))
                    nxt.extend(children[1:])
                level = nxt
    except (OSError, ValueError, struct.error):
        return None
    keys = [k for _, k in level]
    if len(keys) < n or any(k is None or not k for k in keys[1:]):
        return None
    if any(a >= b for a, b in zip(keys[1:], keys[2:])):  # type: ignore[operator]
        return None
    m = len(keys)
    return [keys[max(1, min(m - 1, round(m * i / n)))] for i in range(1, n)]  # type: ignore[misc]
