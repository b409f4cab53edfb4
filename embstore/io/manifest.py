"""Manifests: one export written as several part files, read back as one file.

A manifest (``manifest.json``) lists every part of a split export (see
:func:`embstore.transfer.plan_parts`): its file, row count, byte size and checksum
(``xxh3_128``; manifests written before carry ``sha256``, still checked), and the key range it
holds. :class:`ManifestReader` checks the whole list before a row is read — every
part present, each index once, no file listed twice, sizes and checksums as recorded, the
ranges chained — and then reads the parts one after another as a single
:class:`~embstore.io.base.FormatReader`, so import and verify treat a manifest like any file
(an import refused here writes nothing).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from .._cython.digest import file_xxh3_128
from ..errors import CorruptFileError
from .base import CHUNK_ROWS, Chunk, FormatReader, commit, temp_beside

__all__ = ["CHECKSUM", "CHECKSUM_KINDS", "MANIFEST_KEY", "ManifestReader", "file_checksum",
           "file_sha256", "is_manifest", "write_json"]

#: the key that marks a JSON document as an embstore manifest (its value: the version)
MANIFEST_KEY = "embstore_manifest"
_MAX_MANIFEST_BYTES = 64 << 20


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file (read in 1 MiB blocks; hashlib releases the GIL)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


#: the checksum a manifest entry records for its file (the entry's key) and how to compute
#: each kind a manifest may carry: XXH3-128 since it is ~8x faster than SHA-256 (see
#: ``embstore._cython.digest``); SHA-256 in manifests written before
CHECKSUM = "xxh3_128"
_CHECKSUMS: dict[str, Callable[[str], str]] = {"xxh3_128": file_xxh3_128,
                                               "sha256": file_sha256}
CHECKSUM_KINDS = tuple(_CHECKSUMS)


def file_checksum(path: str) -> dict[str, str]:
    """A part file's checksum as its manifest entry records it: ``{CHECKSUM: hex}``."""
    return {CHECKSUM: _CHECKSUMS[CHECKSUM](path)}


def _checksum_matches(path: str, entry: dict[str, Any]) -> bool:
    """Whether the file has the checksum its entry records (an entry with none: no)."""
    for kind, digest in _CHECKSUMS.items():
        if kind in entry:
            return isinstance(entry[kind], str) and digest(path) == entry[kind]
    return False


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Write ``doc`` atomically (temporary file, fsync, rename)."""
    f, tmp = temp_beside(path, ".json")
    try:
        f.write(json.dumps(doc, indent=1, sort_keys=True).encode())
        commit(f, tmp, path)
    except BaseException:
        f.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def is_manifest(path: str) -> bool:
    """Whether ``path`` is a readable JSON file holding an embstore manifest."""
    try:
        if os.path.getsize(path) > _MAX_MANIFEST_BYTES:
            return False
        with open(path, "rb") as f:
            if f.read(1) != b"{":
                return False
            f.seek(0)
            doc = json.loads(f.read())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and MANIFEST_KEY in doc


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(_MAX_MANIFEST_BYTES + 1))
    except OSError as e:
        raise CorruptFileError(f"cannot open {path}: {e.strerror}") from e
    except ValueError as e:
        raise CorruptFileError(f"{path}: not a readable manifest: {e}") from e
    if not isinstance(doc, dict) or doc.get(MANIFEST_KEY) != 1:
        raise CorruptFileError(f"{path}: not an embstore manifest (version 1)")
    return doc


def check_entries(path: str, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifest's part entries in index order, after every check that needs no part
    file read: count, indexes, duplicates, ranges chained. Raises ``CorruptFileError``."""
    n, parts = doc.get("parts"), doc.get("files")
    if not isinstance(n, int) or n < 1 or not isinstance(parts, list):
        raise CorruptFileError(f"{path}: the manifest has no part count or no part list")
    seen: dict[int, dict[str, Any]] = {}
    files: set[str] = set()
    for e in parts:
        i = e.get("index") if isinstance(e, dict) else None
        if not isinstance(i, int) or not 0 <= i < n:
            raise CorruptFileError(f"{path}: a part entry has no valid index (0..{n - 1}): {e!r}")
        if i in seen:
            raise CorruptFileError(f"{path}: part {i} is listed twice (a duplicated part would "
                                   "import its rows twice); nothing imported")
        f = e.get("file")
        if not isinstance(f, str) or not f or os.path.isabs(f) or ".." in f.split("/"):
            raise CorruptFileError(f"{path}: part {i}: the file must be a name beside the "
                                   f"manifest, got {f!r}")
        if f in files:
            raise CorruptFileError(f"{path}: {f} is listed as two parts; nothing imported")
        files.add(f)
        seen[i] = e
    missing = sorted(set(range(n)) - set(seen))
    if missing:
        raise CorruptFileError(f"{path}: parts {missing} of {n} are missing from the manifest; "
                               "nothing imported (run the missing parts, then write it again)")
    ordered = [seen[i] for i in range(n)]
    # Ranges chain from open end to open end, so no row is in two parts or in none (bounds
    # are compared in their JSON form: only the backend that planned them reads them).
    ranges: list[dict[str, Any]] = [r if isinstance(r := e.get("range"), dict) else {}
                                    for e in ordered]
    chained = (ranges[0].get("lo", 0) is None and ranges[-1].get("hi", 0) is None
               and len({r.get("kind") for r in ranges}) == 1
               and all(a.get("hi") == b.get("lo") and a.get("hi") is not None
                       for a, b in zip(ranges, ranges[1:])))
    if not chained:
        raise CorruptFileError(f"{path}: the parts' key ranges do not chain (parts of "
                               "different plans?); nothing imported")
    return ordered


class ManifestReader(FormatReader):
    """The parts listed in a manifest, read as one file (checked whole before any row)."""

    format = "manifest"

    def __init__(self, path: str | os.PathLike,
                 open_reader: Callable[[str, str | None], FormatReader]) -> None:
        super().__init__(path)
        doc = _load(self.path)
        self.doc = doc
        base = os.path.dirname(os.path.abspath(self.path))
        self.entries = check_entries(self.path, doc)
        self.paths = [os.path.join(base, e["file"]) for e in self.entries]
        for e, p in zip(self.entries, self.paths):
            try:
                size = os.path.getsize(p)
            except OSError:
                raise CorruptFileError(f"{self.path}: part {e['index']} ({e['file']}) is "
                                       "missing; nothing imported") from None
            if size != e.get("bytes") or not _checksum_matches(p, e):
                raise CorruptFileError(f"{self.path}: part {e['index']} ({e['file']}) does "
                                       "not match its checksum (damaged or replaced); nothing "
                                       "imported")
        self._open = open_reader
        self.declared_rows = sum(int(e.get("rows", 0)) for e in self.entries)
        first = open_reader(self.paths[0], doc.get("format"))
        try:
            self.key_kind, self.dim = first.key_kind, first.dim
            self.header, self.layout = first.header, first.layout
            self.row_word, self.row_offset = first.row_word, first.row_offset
        finally:
            first.close()

    def chunks(self, batch_size: int = CHUNK_ROWS, *, validate: bool = False
               ) -> Iterator[Chunk]:
        offset = 0
        for e, p in zip(self.entries, self.paths):
            with self._open(p, self.doc.get("format")) as r:
                if (r.key_kind, r.dim, r.layout) != (self.key_kind, self.dim, self.layout):
                    raise CorruptFileError(f"{self.path}: part {e['index']} holds other keys, "
                                           "dimension or layout than part 0")
                rows = 0
                for c in r.chunks(batch_size, validate=validate):
                    rows += len(c.keys) + len(c.bad)
                    yield Chunk(c.keys, c.vectors, c.rows + offset, c.records,
                                [(row + offset, why) for row, why in c.bad])
                if rows != e.get("rows"):
                    raise CorruptFileError(f"{self.path}: part {e['index']} holds {rows} rows, "
                                           f"the manifest says {e.get('rows')}")
                offset += rows
