"""``.npz`` archives and ``.npy`` pairs of (keys, vectors), without pickle.

Layout (the same members in an ``.npz`` archive or as files in an ``.npy`` directory)::

    keys.npy                  int64 keys, shape (n,)            -- int64 stores
    key_offsets.npy key_blob.npy                                -- bytes stores:
                              int64 offsets, shape (n + 1,), and the uint8 concatenation of
                              every key; key i is blob[offsets[i]:offsets[i + 1]]
    vectors.npy               float32, shape (n, dim)

On reading, ``keys.npy`` may also be a fixed-width ``S`` array (bytes keys; numpy drops
trailing NUL bytes of such keys) or ``U`` array (text keys), and ``arr_0``/``arr_1`` (what
``np.savez(path, keys, vectors)`` writes) stand for keys/vectors. Object arrays are refused:
they would need pickle.

Memory: ``np.load`` of an ``.npz`` is lazy per array but loads a whole array on access. These
readers instead parse each member's ``.npy`` header and stream rows from the (possibly
compressed) member, so memory stays at one chunk whichever form is used. Every header is
checked against the member's real size before anything is allocated.
"""

from __future__ import annotations

import ast
import contextlib
import os
import shutil
import zipfile
import zlib
from collections.abc import Callable, Iterator
from typing import IO, Any

import numpy as np

from ..errors import CorruptFileError
from .base import (
    CHUNK_ROWS,
    Chunk,
    FormatReader,
    FormatWriter,
    check_dim,
    commit,
    discard,
    temp_beside,
)
from .limits import check_inflation, check_input_path, chunk_rows, deliver, finite_float32

_MAGIC = b"\x93NUMPY"
#: what the zip module raises on damaged, encrypted or unsupported members
_ZIP_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, RuntimeError, NotImplementedError,
               OSError)
_ZIP_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA)


@contextlib.contextmanager
def _member_errors(name: str):
    """Report zip-level damage of a member (bad CRC, bad deflate data, ...) as a corrupt file."""
    try:
        yield
    except CorruptFileError:
        raise
    except _ZIP_ERRORS as e:
        raise CorruptFileError(f"{name}: damaged member: {e}") from e
_HEADER_BYTES = 128  # fixed, so the header can be rewritten once the row count is known


class _NpyMember:
    """One ``.npy`` stream: header parsed at once, rows read in order on demand."""

    def __init__(self, opener: Callable[[], IO[bytes]], size: int, name: str) -> None:
        self._opener = opener
        self.name = name
        with _member_errors(name), opener() as f:
            try:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
                else:
                    shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
                self.offset = f.tell() if f.seekable() else None
            except (ValueError, SyntaxError, OSError) as e:
                raise CorruptFileError(f"{name}: not a valid .npy member: {e}") from e
        if dtype.hasobject:
            raise CorruptFileError(f"{name}: holds Python objects (would need pickle); refused")
        if fortran and len(shape) > 1:
            raise CorruptFileError(f"{name}: Fortran-ordered arrays cannot be streamed")
        self.shape, self.dtype = tuple(int(s) for s in shape), dtype
        nbytes = int(np.prod(self.shape, dtype=object)) * dtype.itemsize
        if self.offset is not None and self.offset + nbytes != size:
            raise CorruptFileError(
                f"{name}: header declares shape {self.shape} of {dtype} "
                f"({nbytes} bytes), the data holds {size - self.offset} (truncated or hostile)"
            )
        self.row_bytes = dtype.itemsize * int(np.prod(self.shape[1:], dtype=np.int64))

    def open(self) -> IO[bytes]:
        """A fresh stream of the member, from its start."""
        return self._opener()

    def reader(self) -> _RowStream:
        return _RowStream(self)


class _RowStream:
    def __init__(self, m: _NpyMember) -> None:
        self.m = m
        with _member_errors(m.name):
            self.f = m.open()
            np.lib.format.read_magic(self.f)
            assert m.offset is not None  # members open seekable (a file, a zip member of one)
            self.f.seek(m.offset)

    def read(self, n: int) -> np.ndarray:
        want = n * self.m.row_bytes
        with _member_errors(self.m.name):
            b = self.f.read(want)
        if len(b) != want:
            raise CorruptFileError(f"{self.m.name}: truncated data")
        arr = np.frombuffer(b, dtype=self.m.dtype).reshape((n,) + self.m.shape[1:])
        return arr

    def read_bytes(self, n: int) -> bytes:
        with _member_errors(self.m.name):
            b = self.f.read(n)
        if len(b) != n:
            raise CorruptFileError(f"{self.m.name}: truncated data")
        return b

    def close(self) -> None:
        self.f.close()


class NpzReader(FormatReader):
    """Read keys and vectors from an ``.npz`` archive or an ``.npy`` directory."""

    declared_rows: int  # always known: the vectors' shape says it

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._zip: zipfile.ZipFile | None = None
        if os.path.isdir(self.path):
            self.format = "npy"
            names = {n: os.path.join(self.path, n) for n in os.listdir(self.path)
                     if n.endswith(".npy")}

            def member(n: str) -> _NpyMember:
                check_input_path(n)  # a FIFO member would block the reader forever
                return _NpyMember(lambda: open(n, "rb"), os.path.getsize(n), n)
        else:
            self.format = "npz"
            try:
                self._zip = archive = zipfile.ZipFile(self.path)
            except (zipfile.BadZipFile, OSError) as e:
                raise CorruptFileError(f"{self.name}: not an .npz archive: {e}") from e
            infos = {i.filename: i for i in self._zip.infolist()}
            names = {n: n for n in infos if n.endswith(".npy")}

            def member(n: str) -> _NpyMember:
                info = infos[n]
                where = f"{self.name}:{n}"
                if info.flag_bits & 0x1:
                    raise CorruptFileError(f"{where}: encrypted members are not supported")
                if info.compress_type not in _ZIP_METHODS:
                    raise CorruptFileError(
                        f"{where}: unsupported compression method {info.compress_type}")
                check_inflation(where, "the member", info.compress_size, info.file_size)
                return _NpyMember(lambda: archive.open(info), info.file_size, where)
        try:
            self._setup(names, lambda n: member(names[n]))
        except BaseException:
            self.close()
            raise

    def _setup(self, names: dict[str, str], member: Callable[[str], _NpyMember]) -> None:
        alias = {"keys.npy": "arr_0.npy", "vectors.npy": "arr_1.npy"}
        for want, alt in alias.items():
            if want not in names and alt in names and "key_offsets.npy" not in names:
                names[want] = names[alt]
        if "vectors.npy" not in names:
            raise CorruptFileError(f"{self.name}: no vectors.npy member")
        self._vec = member("vectors.npy")
        if len(self._vec.shape) != 2 or self._vec.dtype.kind != "f":
            raise CorruptFileError(
                f"{self.name}: vectors must be a 2-D float array, got {self._vec.dtype} "
                f"of shape {self._vec.shape}")
        n, dim = self._vec.shape
        self.dim = check_dim(dim, self.name)
        self.declared_rows = n
        self._offsets = self._blob = self._keys = None
        if "key_offsets.npy" in names and "key_blob.npy" in names:
            self._offsets, self._blob = member("key_offsets.npy"), member("key_blob.npy")
            if (self._offsets.shape != (n + 1,) or self._offsets.dtype.kind not in "iu"
                    or self._blob.dtype != np.uint8 or len(self._blob.shape) != 1):
                raise CorruptFileError(f"{self.name}: key_offsets/key_blob do not fit {n} keys")
            self.key_kind = "bytes"
        elif "keys.npy" in names:
            self._keys = member("keys.npy")
            k = self._keys.dtype.kind
            if self._keys.shape != (n,) or k not in "iuSU":
                raise CorruptFileError(
                    f"{self.name}: keys must be a 1-D array of {n} integers or strings, got "
                    f"{self._keys.dtype} of shape {self._keys.shape}")
            self.key_kind = {"S": "bytes", "U": "text"}.get(k, "int64")
        else:
            raise CorruptFileError(f"{self.name}: no keys.npy (or key_offsets/key_blob) member")

    def chunks(self, batch_size: int = CHUNK_ROWS, *, validate: bool = False
               ) -> Iterator[Chunk]:
        key_bytes = self._keys.row_bytes if self._keys is not None else 16
        batch_size = chunk_rows(self._vec.row_bytes + key_bytes, batch_size)
        streams = [self._vec.reader()]
        try:
            if self._keys is not None:
                streams.append(self._keys.reader())
            else:
                assert self._offsets is not None and self._blob is not None  # the other layout
                streams += [self._offsets.reader(), self._blob.reader()]
            yield from self._chunks(streams, batch_size)
        finally:
            for s in streams:
                s.close()

    def _chunks(self, streams: list[_RowStream], batch_size: int) -> Iterator[Chunk]:
        n = self.declared_rows
        blob_bytes = self._blob.shape[0] if self._blob is not None else 0
        vec_s = streams[0]
        prev_end = 0
        if self._offsets is not None:
            first = int(streams[1].read(1)[0])
            if first != 0:
                raise CorruptFileError(f"{self.name}: key_offsets must start at 0")
        for start in range(0, n, batch_size):
            m = min(batch_size, n - start)
            # float64 values beyond float32's range would silently become inf: bad rows
            vectors, lost = finite_float32(vec_s.read(m))
            if self._keys is not None:
                raw = streams[1].read(m)
                if raw.dtype.kind in "iu":
                    if raw.dtype == np.uint64 and m and int(raw.max()) > np.iinfo(np.int64).max:
                        raise CorruptFileError(f"{self.name}: uint64 keys beyond int64 range")
                    keys = raw.astype(np.int64)
                else:
                    keys = np.empty(m, dtype=object)
                    keys[:] = ([s.encode("utf-8") for s in raw.tolist()]
                               if raw.dtype.kind == "U" else raw.tolist())
            else:
                ends = streams[1].read(m).astype(np.int64)
                bounds = np.concatenate(([prev_end], ends))
                if m and (np.diff(bounds) < 0).any() or (
                        m and ends[-1] > blob_bytes):
                    raise CorruptFileError(f"{self.name}: key_offsets are not increasing "
                                           "within the blob")
                blob = streams[2].read_bytes(int(bounds[-1] - bounds[0]))
                rel = (bounds - bounds[0]).tolist()
                keys = np.empty(m, dtype=object)
                keys[:] = [blob[rel[i]:rel[i + 1]] for i in range(m)]
                prev_end = int(bounds[-1])
            rows = np.arange(start, start + m, dtype=np.int64)
            bad: list[tuple[int, str]] = []
            if lost.any():
                bad = [(int(r), "a value is beyond the float32 range") for r in rows[lost]]
                keys, vectors, rows = keys[~lost], vectors[~lost], rows[~lost]
            yield Chunk(keys, np.ascontiguousarray(vectors), rows, None, bad)
        if self._offsets is not None and prev_end != blob_bytes:
            raise CorruptFileError(f"{self.name}: key_blob has bytes no key refers to")

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()
            self._zip = None


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    d = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
         "shape": shape}
    text = repr(d).encode("latin1")
    body = _HEADER_BYTES - len(_MAGIC) - 4
    assert len(text) < body
    header = _MAGIC + b"\x01\x00" + body.to_bytes(2, "little") + text.ljust(body - 1) + b"\n"
    assert ast.literal_eval(text.decode()) == d
    return header


class _NpyOut:
    """A ``.npy`` file written row by row; the header is fixed up on ``finish``."""

    def __init__(self, final: str, dtype: Any, tail: tuple[int, ...] = ()) -> None:
        self.final, self.dtype, self.tail = final, np.dtype(dtype), tail
        self.f, self.tmp = temp_beside(final, ".npy")
        self.f.write(b"\0" * _HEADER_BYTES)
        self.n = 0

    def write(self, arr: np.ndarray) -> None:
        self.f.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes())
        self.n += len(arr)

    def finish(self) -> None:
        self.f.seek(0)
        self.f.write(_npy_header(self.dtype, (self.n,) + self.tail))
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()

    def discard(self) -> None:
        discard(self.f, self.tmp)


class NpzWriter(FormatWriter):
    """Write an ``.npz`` archive (``npy=False``) or an ``.npy`` directory."""

    def __init__(self, dest: str | os.PathLike, meta: dict[str, Any], npy: bool = False) -> None:
        super().__init__(dest, meta)
        self.format = "npy" if npy else "npz"
        self._npy = npy
        if npy:
            os.makedirs(self.dest, exist_ok=True)
            where = lambda n: os.path.join(self.dest, n)  # noqa: E731
        else:
            where = lambda n: self.dest  # noqa: E731 - temp files go beside the archive
        self._members: dict[str, _NpyOut] = {}
        try:
            # the stored values: float16 as float16; bfloat16, which no .npy reader knows,
            # as float32 (exact, and read back to the same bits)
            vec_dtype = "<f2" if self.layout.value_dtype == "float16" else "<f4"
            self._members["vectors.npy"] = _NpyOut(where("vectors.npy"), vec_dtype,
                                                   (self.layout.dim,))
            if self.key_type == "int64":
                self._members["keys.npy"] = _NpyOut(where("keys.npy"), "<i8")
            else:
                self._members["key_offsets.npy"] = _NpyOut(where("key_offsets.npy"), "<i8")
                self._members["key_blob.npy"] = _NpyOut(where("key_blob.npy"), "u1")
                self._members["key_offsets.npy"].write(np.zeros(1, dtype=np.int64))
                self._blob_end = 0
        except BaseException:
            self._discard()
            raise

    def write(self, keys: np.ndarray, records: np.ndarray) -> None:
        if len(keys) == 0:
            return
        vectors = records["vector"]
        if self.layout.value_dtype == "bfloat16":
            vectors = self.layout.vectors(vectors)
        self._members["vectors.npy"].write(vectors)
        if self.key_type == "int64":
            self._members["keys.npy"].write(keys)
        else:
            lens = np.fromiter((len(k) for k in keys), dtype=np.int64, count=len(keys))
            self._members["key_offsets.npy"].write(self._blob_end + np.cumsum(lens))
            self._blob_end += int(lens.sum())
            self._members["key_blob.npy"].write(np.frombuffer(b"".join(keys), dtype=np.uint8))
        self.rows += len(keys)

    def _finish(self) -> None:
        try:
            for m in self._members.values():
                m.finish()
            if self._npy:
                for m in self._members.values():
                    deliver(m.tmp, m.final)
                return
            out, tmp = temp_beside(self.dest)
            try:
                with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
                    for name, m in self._members.items():
                        with open(m.tmp, "rb") as src, zf.open(name, "w",
                                                                force_zip64=True) as dst:
                            shutil.copyfileobj(src, dst, 1 << 20)
                commit(out, tmp, self.dest)
            except BaseException:
                discard(out, tmp)
                raise
        finally:
            self._discard()

    def _discard(self) -> None:
        for m in self._members.values():
            m.discard()
