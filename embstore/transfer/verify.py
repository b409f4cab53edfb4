"""Verification: read a store or a file whole and report what is wrong, writing nothing.

The digests are order-independent sums of per-row hashes, equal for a store and any export
of it, so ``embstore verify`` of both tells whether the rows made it across.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._keys import key_hash64, splitmix64
from ..errors import CorruptFileError
from ..io.base import CHUNK_ROWS
from ..io.formats import open_reader
from ..io.limits import check_header, check_stamps, chunk_rows
from ..progress import progress_bar
from .parts import Part, part_records
from .pipeline import clean_chunk

__all__ = ["VerifyReport", "row_digests", "verify_file", "verify_store"]

_COL_SALT = np.uint64(0x9E3779B97F4A7C15)


def row_digests(keys: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """A 64-bit digest per (key, vector) row; sums of them are order-independent digests.

    Keys are hashed as bytes, int64 keys as their decimal text, so a store and its export
    in any format (text formats write int64 keys as decimals) have the same digest.
    """
    if keys.dtype == np.int64:
        text = np.empty(len(keys), dtype=object)
        text[:] = [str(k).encode() for k in keys.tolist()]
        keys = text
    bits = np.ascontiguousarray(vectors, dtype="<f4").view("<u4").astype(np.uint64)
    cols = np.arange(vectors.shape[1], dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = splitmix64((bits << np.uint64(32)) | cols)
        acc = np.bitwise_xor.reduce(h, axis=1) if vectors.shape[1] else np.zeros(len(keys),
                                                                                 np.uint64)
        return splitmix64(acc ^ key_hash64(keys))


@dataclass
class VerifyReport:
    rows: int = 0
    bad: int = 0
    problems: list[str] = field(default_factory=list)
    digest: int = 0
    dim: int = 0
    kind: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def digest_hex(self) -> str:
        """The digest as ``embstore verify`` prints it (16 hex digits); ``digest`` is the
        same 64-bit value as an int."""
        return f"{self.digest:016x}"

    def add_rows(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Add the rows' digests to ``digest`` (a sum modulo 2**64: order does not matter)."""
        if len(keys):
            with np.errstate(over="ignore"):
                self.digest = int((np.uint64(self.digest) + row_digests(keys, vectors).sum(
                    dtype=np.uint64)) & np.uint64(0xFFFFFFFFFFFFFFFF))


def verify_store(store: Any, *, batch_size: int = CHUNK_ROWS,
                 progress: bool = False, part: Part | None = None) -> VerifyReport:
    """Read every record of ``store``: it must decode, have finite vectors, and the rows read
    must match the store's count. ``part`` (from :func:`embstore.transfer.plan_parts`): only
    its rows (no count to compare; the parts' digests add up to the store's)."""
    rep = VerifyReport(dim=store.dim, kind=store.key_type)
    declared = len(store) if part is None else None
    rows = store.records(batch_size) if part is None else part_records(store, part, batch_size)
    with progress_bar(total=declared, enabled=progress, desc="verify") as bar:
        for keys, recs in rows:
            if len(keys) != len(recs) or recs.dtype != store.layout.dtype:
                rep.problems.append("a batch of records does not match the layout")
                continue
            vec = store.layout.vectors(recs)
            fin = np.isfinite(vec).all(axis=1)
            if not fin.all():
                rep.bad += int(np.count_nonzero(~fin))
                if len(rep.problems) < 20:
                    rep.problems.append(f"key {keys[~fin][0]!r}: NaN or infinite value")
            rep.rows += len(keys)
            rep.add_rows(keys, vec)
            bar.update(len(keys))
    if declared is not None and rep.rows != declared:
        rep.problems.append(f"the store reports {declared} rows, a full scan read {rep.rows}")
    return rep


def _verify_check(rep: VerifyReport, check: Any) -> bool:
    try:
        check()
    except CorruptFileError as e:
        rep.problems.append(str(e).replace("; nothing imported", ""))
        return False
    return True


def verify_file(path: str | os.PathLike, *, fmt: str | None = None,
                batch_size: int = CHUNK_ROWS, progress: bool = False) -> VerifyReport:
    """Read every row of a file: structure and checksums (native), keys, values, counts."""
    with open_reader(path, fmt) as reader:
        rep = VerifyReport(dim=reader.dim, kind=f"{reader.format} ({reader.key_kind} keys)")
        kt = "int64" if reader.key_kind == "int64" else "bytes"
        batch_size = chunk_rows(4 * reader.dim + 64, batch_size)
        stamps_ok = _verify_check(rep, lambda: check_header(reader.name, reader.header))
        with progress_bar(total=reader.declared_rows, enabled=progress, desc="verify") as bar:
            for chunk in reader.chunks(batch_size, validate=True):
                if stamps_ok:  # the first bad stamp is reported, as import would refuse it
                    stamps_ok = _verify_check(rep, lambda c=chunk: check_stamps(
                        reader.name, c.records, c.rows, reader.row_word, reader.row_offset))
                clean, bad = clean_chunk(chunk, reader, kt)
                rep.bad += len(bad)
                rep.problems += bad[:max(0, 20 - len(rep.problems))]
                rep.rows += len(clean.keys)
                rep.add_rows(clean.keys, clean.vectors)
                bar.update(len(chunk.keys) + len(chunk.bad))
        if reader.declared_rows is not None and rep.rows + rep.bad != reader.declared_rows:
            rep.problems.append(f"the file declares {reader.declared_rows} rows, "
                                f"{rep.rows + rep.bad} were read")
    return rep
