"""word2vec text and binary formats, as gensim's ``KeyedVectors`` reads and writes them.

Both start with a header line ``"<count> <dim>\\n"``. Text rows are ``"<key> v1 ... vdim\\n"``;
binary rows are ``"<key> "`` followed by ``dim`` little-endian float32 values (gensim writes no
newline after a binary row; the original C tool does, and both are read). Keys are UTF-8 text
without spaces or newlines. Writers produce exactly what ``save_word2vec_format`` produces,
except that text values use ``%.9g`` (which reads back bit-identically) instead of numpy's
shortest repr.

Readers are strict where gensim is lenient, because silently dropping rows is worse than
refusing: a file with fewer rows than its header declares is truncated, one with more is
damaged. The header is checked against the file size before anything is read, so a header
declaring absurd sizes is refused at once.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import CorruptFileError
from .base import (
    CHUNK_ROWS,
    MAX_KEY_BYTES,
    Chunk,
    FormatReader,
    FormatWriter,
    check_dim,
    commit,
    discard,
    file_size,
    format_vector_rows,
    parse_text_rows,
    temp_beside,
    text_keys,
)

_BLOCK = 1 << 20


def _read_header(f, name: str, size: int) -> tuple[int, int, int]:
    line = f.readline(256)
    if not line.endswith(b"\n"):
        raise CorruptFileError(f"{name}: not a word2vec file (no '<count> <dim>' header line)")
    try:
        count, dim = (int(x) for x in line.split())
    except ValueError:
        raise CorruptFileError(
            f"{name}: not a word2vec file (header {line[:60]!r} is not '<count> <dim>')"
        ) from None
    if count < 0:
        raise CorruptFileError(f"{name}: header declares a negative row count")
    check_dim(dim, name)
    return count, dim, len(line)


class Word2VecReader(FormatReader):
    """Read a word2vec file (``binary`` selects the variant); keys are of the text kind."""

    key_kind = "text"
    row_word = "row"
    declared_rows: int  # always known: the header declares it

    def __init__(self, path: str | os.PathLike, binary: bool = False) -> None:
        super().__init__(path)
        self.binary = binary
        self.format = "word2vec-binary" if binary else "word2vec"
        size = file_size(self.path)
        with open(self.path, "rb") as f:
            count, dim, hlen = _read_header(f, self.name, size)
        # Smallest possible row: a 1-byte key, its separator and the values (text: "0 " each).
        min_row = 2 + 4 * dim if binary else 1 + 2 * dim
        if count * min_row > size - hlen + (1 if not binary and count else 0):
            raise CorruptFileError(
                f"{self.name}: header declares {count} rows of dim {dim}, more than the "
                f"{size} bytes of the file can hold (truncated or hostile file)"
            )
        self.dim, self.declared_rows, self._hlen = dim, count, hlen

    def chunks(self, batch_size: int = CHUNK_ROWS, *, validate: bool = False
               ) -> Iterator[Chunk]:
        with open(self.path, "rb") as f:
            f.seek(self._hlen)
            if self.binary:
                yield from self._binary_chunks(f, batch_size)
            else:
                yield from self._text_chunks(f, batch_size)

    # -- text -------------------------------------------------------------------------------------
    def _text_chunks(self, f, batch_size: int) -> Iterator[Chunk]:
        limit = MAX_KEY_BYTES + 64 * self.dim + 2
        row = 0
        while row < self.declared_rows:
            n = min(batch_size, self.declared_rows - row)
            keys: list[bytes] = []
            values: list[bytes] = []
            for _ in range(n):
                line = f.readline(limit)
                if not line:
                    raise CorruptFileError(
                        f"{self.name}: truncated: the header declares {self.declared_rows} "
                        f"rows, the file ends after {row + len(keys)}"
                    )
                if len(line) == limit and not line.endswith(b"\n"):
                    raise CorruptFileError(
                        f"{self.name}: row {row + len(keys) + 1} is absurdly long")
                k, _, v = line.rstrip().partition(b" ")
                keys.append(k)
                values.append(v)
            yield parse_text_rows(keys, values, row, self.dim)
            row += n
        while rest := f.read(_BLOCK):
            if rest.strip():
                raise CorruptFileError(
                    f"{self.name}: more rows than the {self.declared_rows} the header declares")

    # -- binary -----------------------------------------------------------------------------------
    def _binary_chunks(self, f, batch_size: int) -> Iterator[Chunk]:
        vbytes = 4 * self.dim
        buf = b""
        pos = 0
        eof = False
        row = 0

        def fill(need: int) -> bool:
            nonlocal buf, pos, eof
            while len(buf) - pos < need and not eof:
                more = f.read(max(_BLOCK, need))
                if not more:
                    eof = True
                buf = buf[pos:] + more
                pos = 0
            return len(buf) - pos >= need

        while row < self.declared_rows:
            n = min(batch_size, self.declared_rows - row)
            keys: list[bytes] = []
            vecs: list[bytes] = []
            for i in range(n):
                fill(MAX_KEY_BYTES + vbytes + 2)
                # gensim strips newlines before a key: the C tool ends every row with one.
                while pos < len(buf) and buf[pos] == 0x0A:
                    pos += 1
                    fill(MAX_KEY_BYTES + vbytes + 2)
                sp = buf.find(b" ", pos, pos + MAX_KEY_BYTES + 1)
                if sp < 0:
                    if eof and len(buf) - pos <= MAX_KEY_BYTES:
                        raise CorruptFileError(
                            f"{self.name}: truncated: the header declares "
                            f"{self.declared_rows} rows, the file ends in row {row + i + 1}")
                    raise CorruptFileError(
                        f"{self.name}: row {row + i + 1} has no key separator (damaged file)")
                if sp + 1 + vbytes > len(buf):
                    raise CorruptFileError(
                        f"{self.name}: truncated: the file ends inside row {row + i + 1} "
                        f"of {self.declared_rows}")
                keys.append(buf[pos:sp])
                vecs.append(buf[sp + 1:sp + 1 + vbytes])
                pos = sp + 1 + vbytes
            vectors = np.frombuffer(b"".join(vecs), dtype="<f4").reshape(n, self.dim)
            chunk = parse_text_rows(keys, [], row, self.dim, vectors=vectors)
            yield chunk
            row += n
        rest = buf[pos:] + f.read(_BLOCK)
        if rest.strip(b"\n"):
            raise CorruptFileError(
                f"{self.name}: more data than the {self.declared_rows} rows the header declares")


class Word2VecWriter(FormatWriter):
    """Write store rows as a word2vec text (or ``binary``) file, gensim-compatible."""

    def __init__(self, dest: str | os.PathLike, meta: dict[str, Any],
                 binary: bool = False) -> None:
        super().__init__(dest, meta)
        self.binary = binary
        self.format = "word2vec-binary" if binary else "word2vec"
        # The header needs the row count first: rows go to a body file, assembled on close.
        self._body, self._body_tmp = temp_beside(self.dest, ".body")

    def write(self, keys: np.ndarray, records: np.ndarray) -> None:
        if len(keys) == 0:
            return
        names = text_keys(keys, self.key_type, self.format, b" \n")
        vectors = np.ascontiguousarray(self.layout.vectors(records), dtype="<f4")
        if self.binary:
            raw = vectors.tobytes()
            vb = 4 * self.layout.dim
            self._body.write(b"".join(
                name.encode("utf-8") + b" " + raw[i * vb:(i + 1) * vb]
                for i, name in enumerate(names)
            ))
        else:
            rows = format_vector_rows(vectors)
            self._body.write("".join(
                f"{name} {r}\n" for name, r in zip(names, rows)).encode("utf-8"))
        self.rows += len(keys)

    def _finish(self) -> None:
        out, tmp = temp_beside(self.dest)
        try:
            out.write(f"{self.rows} {self.layout.dim}\n".encode())
            self._body.flush()
            with open(self._body_tmp, "rb") as body:
                shutil.copyfileobj(body, out, _BLOCK)
            commit(out, tmp, self.dest)
        except BaseException:
            discard(out, tmp)
            raise
        finally:
            discard(self._body, self._body_tmp)

    def _discard(self) -> None:
        discard(self._body, self._body_tmp)
