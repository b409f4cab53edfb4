"""The format registry: names, detection from file names and contents, reader/writer factory.

=================  ==========================  =======================================
format             detected from               carries
=================  ==========================  =======================================
native             ``.emb``/``.embstore``,     whole records (vector, slots, metadata),
                   magic ``EMBSTNAT``          store metadata, checksums
parquet            ``.parquet``/``.pq``,       whole records when written by embstore
                   magic ``PAR1``
npz                ``.npz``, zip magic         keys, vectors
npy                a directory with            keys, vectors (files ``keys.npy``,
                   ``vectors.npy``             ``vectors.npy`` ...)
word2vec           ``.txt``/``.vec``/``.w2v``  text keys, vectors
word2vec-binary    ``.bin``                    text keys, vectors
tsv                ``.tsv``                    text keys, vectors
manifest           JSON with                   the parts of a split export (read only)
                   ``embstore_manifest``
=================  ==========================  =======================================
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from ..errors import CorruptFileError, InvalidInputError
from .base import CHUNK_ROWS, Chunk, FormatReader, FormatWriter
from .limits import check_input_path
from .manifest import ManifestReader, is_manifest
from .native import MAGIC, NativeReader, NativeWriter
from .npz import NpzReader, NpzWriter
from .tsv import TsvReader, TsvWriter
from .word2vec import Word2VecReader, Word2VecWriter

FORMATS = ("native", "parquet", "npz", "npy", "word2vec", "word2vec-binary", "tsv", "manifest")
_ALIASES = {"w2v": "word2vec", "word2vec-text": "word2vec", "w2v-binary": "word2vec-binary",
            "word2vec-bin": "word2vec-binary", "emb": "native", "pq": "parquet"}
EXTENSIONS = {
    ".emb": "native", ".embstore": "native", ".parquet": "parquet", ".pq": "parquet",
    ".npz": "npz", ".npy": "npy", ".txt": "word2vec", ".vec": "word2vec", ".w2v": "word2vec",
    ".bin": "word2vec-binary", ".tsv": "tsv",
}


def format_name(fmt: str) -> str:
    """Canonical format name; raises ``InvalidInputError`` for unknown names."""
    name = _ALIASES.get(fmt.lower(), fmt.lower())
    if name not in FORMATS:
        raise InvalidInputError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    return name


def _by_extension(path: str) -> str | None:
    p = path.rstrip("/\\")
    if path.endswith(("/", os.sep)):
        return "npy"
    return EXTENSIONS.get(os.path.splitext(p)[1].lower())


def detect_format(path: str | os.PathLike, fmt: str | None = None, *,
                  for_write: bool = False) -> str:
    """The format of ``path``: ``fmt`` if given, else sniffed from the content (reading) or
    the file name (writing)."""
    if fmt:
        return format_name(fmt)
    path = os.fspath(path)
    if not for_write:
        if os.path.isdir(path):
            return "npy"
        if os.path.basename(path) == "vectors.npy":
            return "npy"
        check_input_path(path)  # opening a FIFO to sniff it would block
        try:
            with open(path, "rb") as f:
                head = f.read(8)
        except OSError as e:
            raise CorruptFileError(f"cannot open {path}: {e.strerror}") from e
        if head == MAGIC:
            return "native"
        if head[:4] == b"PAR1":
            return "parquet"
        if head[:4] == b"PK\x03\x04":
            return "npz"
        if head[:1] == b"{" and is_manifest(path):
            return "manifest"
    found = _by_extension(path)
    if found is None:
        raise InvalidInputError(
            f"cannot tell the format of {path!r} from its name; pass --format "
            f"({', '.join(FORMATS)})")
    return found


class NativeFormatReader(FormatReader):
    """The native format as a :class:`FormatReader` (records, metadata, checksums).

    ``src`` may also be a seekable binary stream or the file's bytes (``store.import_``).
    """

    format = "native"

    def __init__(self, src: str | os.PathLike | BinaryIO | bytes) -> None:
        self._reader = NativeReader(src)
        super().__init__(self._reader.name)
        self.header = self._reader.header
        self.layout = self._reader.layout
        self.key_kind = self._reader.key_type
        self.dim = self.layout.dim

    def chunks(self, batch_size: int = CHUNK_ROWS, *, validate: bool = False
               ) -> Iterator[Chunk]:
        # Chunks are as the writer made them (bounded by its chunk size), not batch_size.
        start = 0
        r = self._reader
        layout = r.layout
        for keys, recs in (r.iter_transient() if validate else r):
            n = len(keys)
            yield Chunk(keys, layout.vectors(recs), _arange(start, n), recs)
            start += n

    def close(self) -> None:
        self._reader.close()


def _arange(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


class NativeFormatWriter(FormatWriter):
    format = "native"

    def __init__(self, dest: str | os.PathLike, meta: dict[str, Any]) -> None:
        super().__init__(dest, meta)
        self._w = NativeWriter(self.dest, meta)

    def write(self, keys, records) -> None:
        self._w.write(keys, records)
        self.rows = self._w.rows

    def _finish(self) -> None:
        self._w.close()

    def _discard(self) -> None:
        self._w.abort()


def open_reader(path: str | os.PathLike | BinaryIO | bytes | FormatReader,
                fmt: str | None = None, *, dim: int | None = None) -> FormatReader:
    """Open ``path`` for reading in ``fmt`` (detected when None). A binary stream or bytes
    are read as the native format; an open reader is returned as it is."""
    if isinstance(path, FormatReader):
        return path
    if not isinstance(path, (str, os.PathLike)):
        if fmt is not None and format_name(fmt) != "native":
            raise InvalidInputError(f"only the native format is read from a stream, not {fmt!r}")
        return NativeFormatReader(path)
    path = os.fspath(path)
    name = detect_format(path, fmt)
    if name == "npy" and os.path.basename(path) == "vectors.npy" and not os.path.isdir(path):
        path = os.path.dirname(path) or "."
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    check_input_path(path)
    if name == "native":
        return NativeFormatReader(path)
    if name == "manifest":
        return ManifestReader(path, lambda p, f: open_reader(p, f))
    if name in ("word2vec", "word2vec-binary"):
        return Word2VecReader(path, binary=name == "word2vec-binary")
    if name in ("npz", "npy"):
        return NpzReader(path)
    if name == "parquet":
        # deferred: pyarrow (heavy, optional) loads only when a Parquet file is read
        from .parquet import ParquetReader

        return ParquetReader(path)
    return TsvReader(path, dim=dim)


def open_writer(dest: str | os.PathLike, meta: dict[str, Any],
                fmt: str | None = None) -> FormatWriter:
    """Open ``dest`` for writing store records in ``fmt`` (from the file name when None)."""
    dest = os.fspath(dest)
    name = detect_format(dest, fmt, for_write=True)
    parent = os.path.dirname(os.path.abspath(dest.rstrip("/\\")))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"{parent}: no such directory")
    if name == "manifest":
        raise InvalidInputError(f"{dest}: a manifest is written by an export in parts "
                                "(--part I/N), not as a file format")
    if name == "native":
        return NativeFormatWriter(dest, meta)
    if name in ("word2vec", "word2vec-binary"):
        return Word2VecWriter(dest, meta, binary=name == "word2vec-binary")
    if name in ("npz", "npy"):
        return NpzWriter(dest, meta, npy=name == "npy")
    if name == "parquet":
        # deferred: pyarrow (heavy, optional) loads only when a Parquet file is written
        from .parquet import ParquetWriter

        return ParquetWriter(dest, meta)
    return TsvWriter(dest, meta)
