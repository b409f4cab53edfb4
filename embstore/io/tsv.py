"""TSV for quick interop: one row per line, ``key<TAB>v1 v2 ... vdim``.

Writers separate the values by single spaces; readers accept any whitespace between values
(so ``key<TAB>v1<TAB>v2`` also reads). There is no header: the dimension is taken from the
first row (or checked against ``dim`` when given), and blank lines are ignored. Keys are UTF-8
text without tabs or newlines.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import CorruptFileError
from .base import (
    CHUNK_ROWS,
    MAX_DIM,
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


class TsvReader(FormatReader):
    """Read a TSV file of text keys; rows are numbered by line."""

    format = "tsv"
    key_kind = "text"
    row_word = "line"

    def __init__(self, path: str | os.PathLike, dim: int | None = None) -> None:
        super().__init__(path)
        file_size(self.path)
        self._limit = MAX_KEY_BYTES + 64 * MAX_DIM
        if dim is None:
            dim = self._first_dim()
        # 0: a file without rows, whose dimension is unknown (it fits any store)
        self.dim = check_dim(int(dim), self.name) if dim else 0
        self._limit = MAX_KEY_BYTES + 64 * max(self.dim, 1) + 2

    def _first_dim(self) -> int:
        with open(self.path, "rb") as f:
            for line in iter(lambda: f.readline(self._limit), b""):
                if line.strip():
                    _, tab, v = line.partition(b"\t")
                    if not tab:
                        raise CorruptFileError(f"{self.name}: not a TSV file (no tab in line 1)")
                    return self._count_values(v)
        return 0

    def _count_values(self, text: bytes) -> int:
        """Whitespace-separated values of the first row, counted a slice at a time: splitting
        a 64 MiB line at once makes millions of objects (hundreds of MB for one line)."""
        step = 1 << 20
        count, inside = 0, False
        for at in range(0, len(text), step):
            piece = text[at:at + step]
            count += len(piece.split())
            if inside and not piece[:1].isspace():
                count -= 1  # a value cut by the slice boundary was counted twice
            inside = not piece[-1:].isspace()
            if count > MAX_DIM:
                raise CorruptFileError(f"{self.name}: line 1 holds more than {MAX_DIM} values "
                                       "(the largest dimension embstore reads)")
        return count

    def chunks(self, batch_size: int = CHUNK_ROWS, *, validate: bool = False
               ) -> Iterator[Chunk]:
        with open(self.path, "rb") as f:
            lineno = 0
            eof = False
            while not eof:
                keys: list[bytes] = []
                values: list[bytes] = []
                lines: list[int] = []
                bad: list[tuple[int, str]] = []
                while len(keys) < batch_size:
                    line = f.readline(self._limit)
                    if not line:
                        eof = True
                        break
                    if len(line) == self._limit and not line.endswith(b"\n"):
                        raise CorruptFileError(f"{self.name}: line {lineno + 1} is absurdly long")
                    lineno += 1
                    line = line.rstrip(b"\r\n")
                    if not line.strip():
                        continue
                    k, tab, v = line.partition(b"\t")
                    if not tab:
                        bad.append((lineno - 1, "no tab between key and values"))
                        continue
                    keys.append(k)
                    values.append(v)
                    lines.append(lineno - 1)
                if not keys and not bad:
                    continue
                chunk = parse_text_rows(keys, values, 0, self.dim)
                # parse_text_rows numbers rows 0..n-1; map them back to line numbers
                where = np.asarray(lines, dtype=np.int64)
                chunk.bad = sorted(bad + [(int(where[r]), why) for r, why in chunk.bad])
                chunk.rows = where[chunk.rows] if len(where) else chunk.rows
                yield chunk


class TsvWriter(FormatWriter):
    """Write ``key<TAB>values`` lines."""

    format = "tsv"

    def __init__(self, dest: str | os.PathLike, meta: dict[str, Any]) -> None:
        super().__init__(dest, meta)
        self._f, self._tmp = temp_beside(self.dest)

    def write(self, keys: np.ndarray, records: np.ndarray) -> None:
        if len(keys) == 0:
            return
        names = text_keys(keys, self.key_type, "tsv", b"\t\n\r")
        rows = format_vector_rows(np.ascontiguousarray(self.layout.vectors(records)))
        self._f.write("".join(f"{k}\t{r}\n" for k, r in zip(names, rows)).encode("utf-8"))
        self.rows += len(keys)

    def _finish(self) -> None:
        commit(self._f, self._tmp, self.dest)

    def _discard(self) -> None:
        discard(self._f, self._tmp)
