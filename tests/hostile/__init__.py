"""A corpus of hostile and damaged import files, each built in code by a small function.

Nothing here is stored as a binary blob: every generator writes its file into a directory the
test gives it and returns the path. Files are small on disk (the bombs are a few KB to 1 MB)
and are built in constant memory (the bombs decode to 1 GiB and more, so a reader that
trusts them needs gigabytes).
"""

from __future__ import annotations

import base64
import json
import os
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np

import embstore
from embstore.io.native import MAGIC, NativeWriter

DIM = 4


# -- native ----------------------------------------------------------------------------------------
def small_store(key_type: str = "int64", n: int = 10, **options) -> embstore.EmbeddingStore:
    s = embstore.open("memory://", dim=DIM, key_type=key_type, optimizer="adagrad", **options)
    keys = np.arange(1, n + 1) if key_type == "int64" else [b"k%d" % i for i in range(n)]
    s.lookup(keys)
    s.update(keys, np.ones((n, DIM), np.float32))
    return s


def _records(store) -> tuple[np.ndarray, np.ndarray]:
    ks, rs = zip(*store.records(1 << 16))
    return np.concatenate(ks), np.concatenate(rs).copy()


def native_file(path: Path, *, header: dict | None = None, field: str | None = None,
                value=None, row: int = 3, key_type: str = "int64") -> Path:
    """A valid native export, with one header entry or one record field overridden."""
    src = small_store(key_type)
    keys, recs = _records(src)
    meta = {**src.meta, "since": None, **(header or {})}
    if field is not None:
        recs[field][row] = value
    with NativeWriter(path, meta) as w:
        w.write(keys, recs)
    src.close()
    return path


def native_raw_header(path: Path, header_bytes: bytes) -> Path:
    """A native file whose header is ``header_bytes`` (CRC made to match), and no chunks."""
    body = MAGIC + struct.pack("<II", 1, len(header_bytes)) + header_bytes
    body += struct.pack("<I", zlib.crc32(header_bytes)) + struct.pack("<4sQI", b"END.", 0, 0)
    path.write_bytes(body)
    return path


def deep_json(depth: int = 200_000) -> bytes:
    return b'{"layout": ' + b"[" * depth + b"]" * depth + b"}"


def native_deep_header(path: Path, depth: int = 200_000) -> Path:
    return native_raw_header(path, deep_json(depth))


def native_zero_dim(path: Path) -> Path:
    src = small_store()
    meta = src.meta
    meta["layout"] = {**meta["layout"], "dim": 0}
    src.close()
    return native_raw_header(path, json.dumps(meta).encode())


def zlib_bomb(decoded: int, level: int = 9) -> bytes:
    """zlib stream of ``decoded`` zero bytes, built in 16 MiB steps."""
    c = zlib.compressobj(level)
    block = bytes(16 << 20)
    out = []
    left = decoded
    while left > 0:
        out.append(c.compress(block[:min(left, len(block))]))
        left -= len(block)
    out.append(c.flush())
    return b"".join(out)


def admission_config() -> dict:
    from embstore.policies import FrequencyCutoff

    return FrequencyCutoff(3, width=1 << 10, depth=2).config()


def native_admission_bomb(path: Path, decoded: int = 1 << 30) -> Path:
    """A native export whose admission state (zlib + base64 in the header) decodes to
    ``decoded`` bytes, for a sketch of 2 KiB."""
    state = base64.b64encode(zlib_bomb(decoded)).decode("ascii")
    extra = {"policies": {"admission": {"config": admission_config(), "state": state}}}
    return native_file(path, header={"extra": extra})


# -- parquet ---------------------------------------------------------------------------------------
def parquet_file(path: Path, *, field: str | None = None, value=None, row: int = 3,
                 header: dict | None = None) -> Path:
    from embstore.io.parquet import ParquetWriter

    src = small_store()
    keys, recs = _records(src)
    if field is not None:
        recs[field][row] = value
    with ParquetWriter(path, {**src.meta, **(header or {})}) as w:
        w.write(keys, recs)
    src.close()
    return path


def parquet_deep_metadata(path: Path, depth: int = 200_000) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([pa.field("key", pa.int64()),
                        pa.field("vector", pa.list_(pa.float32(), DIM))],
                       metadata={b"embstore": deep_json(depth)})
    t = pa.Table.from_arrays([pa.array([1], pa.int64()), pa.FixedSizeListArray.from_arrays(
        pa.array(np.zeros(DIM, np.float32)), DIM)], schema=schema)
    pq.write_table(t, path)
    return path


def parquet_bomb(path: Path, rows: int = 256, dim: int = 1 << 20) -> Path:
    """One row group of ``rows`` zero vectors of ``dim`` floats (1 GiB decoded) in ~60 KB.

    Every row is the same 4 MiB array (a chunked column of one chunk repeated), so building
    it costs 4 MiB, not the 1 GiB it decodes to.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([pa.field("key", pa.int64()),
                        pa.field("vector", pa.list_(pa.float32(), dim))])
    one = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(dim, np.float32)), dim)
    t = pa.Table.from_arrays([pa.array(np.arange(rows), pa.int64()),
                              pa.chunked_array([one] * rows)], schema=schema)
    pq.write_table(t, path, compression="zstd", row_group_size=rows, use_dictionary=False)
    return path


# -- npz / npy -------------------------------------------------------------------------------------
def _npy_header(dtype: str, shape: tuple) -> bytes:
    from embstore.io.npz import _npy_header as h

    return h(np.dtype(dtype), shape)


def npz_file(path: Path, keys: np.ndarray, vectors: np.ndarray,
             compression: int = zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression) as z:
        z.writestr("keys.npy", _npy_header(keys.dtype.str, keys.shape) + keys.tobytes())
        z.writestr("vectors.npy", _npy_header(vectors.dtype.str, vectors.shape)
                   + vectors.tobytes())
    return path


def npz_valid(path: Path, n: int = 8, compression: int = zipfile.ZIP_STORED) -> Path:
    rng = np.random.default_rng(0)
    return npz_file(path, np.arange(n, dtype="<i8"),
                    rng.standard_normal((n, DIM)).astype("<f4"), compression)


def npz_bomb(path: Path, rows: int = 256, dim: int = 1 << 20) -> Path:
    """A deflated .npz whose vectors member decodes to rows * dim * 4 bytes (1 GiB) of zeros;
    about 1 MB on disk, built in 16 MiB steps."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        keys = np.arange(rows, dtype="<i8")
        z.writestr("keys.npy", _npy_header("<i8", (rows,)) + keys.tobytes())
        with z.open("vectors.npy", "w", force_zip64=True) as f:
            f.write(_npy_header("<f4", (rows, dim)))
            block = bytes(16 << 20)
            left = rows * dim * 4
            while left > 0:
                f.write(block[:min(left, len(block))])
                left -= len(block)
    return path


def npz_bad_crc(path: Path) -> Path:
    """A stored .npz whose vectors member has one data byte changed (CRC no longer matches)."""
    npz_valid(path)
    raw = bytearray(path.read_bytes())
    at = raw.rfind(b"\x93NUMPY")  # the vectors member (written last)
    raw[at + 128 + 5] ^= 0x40
    path.write_bytes(bytes(raw))
    return path


def _patch_members(path: Path, flag_bits: int = 0, method: int | None = None) -> Path:
    """Set general-purpose flag bits / the compression method of every member, in the local
    headers and the central directory."""
    raw = bytearray(path.read_bytes())
    for sig, flag_at, method_at in ((b"PK\x03\x04", 6, 8), (b"PK\x01\x02", 8, 10)):
        at = raw.find(sig)
        while at >= 0:
            flags = struct.unpack_from("<H", raw, at + flag_at)[0]
            struct.pack_into("<H", raw, at + flag_at, flags | flag_bits)
            if method is not None:
                struct.pack_into("<H", raw, at + method_at, method)
            at = raw.find(sig, at + 4)
    path.write_bytes(bytes(raw))
    return path


def npz_encrypted(path: Path) -> Path:
    return _patch_members(npz_valid(path), flag_bits=0x1)


def npz_unsupported_method(path: Path) -> Path:
    return _patch_members(npz_valid(path), method=99)


def npz_float64_overflow(path: Path) -> Path:
    vec = np.ones((4, DIM), dtype="<f8")
    vec[2, 1] = 1e300
    return npz_file(path, np.arange(4, dtype="<i8"), vec)


def npy_dir_with_fifo(path: Path) -> Path:
    path.mkdir()
    keys = np.arange(4, dtype="<i8")
    (path / "keys.npy").write_bytes(_npy_header("<i8", (4,)) + keys.tobytes())
    os.mkfifo(path / "vectors.npy")
    return path


# -- text ------------------------------------------------------------------------------------------
def word2vec_long_key(path: Path, rows: int = 300, at: int = 250, key_len: int = 600) -> Path:
    """A valid word2vec text file whose row ``at`` (0-based) has a ``key_len``-byte key."""
    lines = [f"{rows} {DIM}\n"]
    for i in range(rows):
        key = ("x" * key_len) if i == at else f"w{i}"
        lines.append(key + " " + " ".join(["0.5"] * DIM) + "\n")
    path.write_text("".join(lines))
    return path


def native_full_with_deletions(path: Path, deleted=(1, 2), since=None) -> Path:
    """A native export of keys 1..10 (since=None: a full export) that lists ``deleted``."""
    from embstore.policies.tombstones import encode_keys

    gone = encode_keys(np.asarray(deleted, dtype=np.int64), "int64")
    return native_file(path, header={"since": since, "deleted": gone,
                                     "deletions_complete": True})


def long_key_file(path: Path, fmt: str, rows: int = 300, at: int = 250,
                  key_len: int = 4200) -> Path:
    """A valid file of ``rows`` bytes/text keys in ``fmt``, one of them (the ``at``-th
    assigned; a scan puts it after the first hundred rows) ``key_len`` bytes long: too long
    for LMDB's 511 and Bigtable's 4096-byte key limits."""
    from embstore.transfer import export_file

    s = embstore.open("memory://", dim=DIM, key_type="bytes", optimizer="adagrad")
    keys = [b"w%d" % i for i in range(rows)]
    keys[at] = b"x" * key_len
    s.assign(keys, np.full((rows, DIM), 0.25, np.float32))
    export_file(s, path, fmt=fmt)
    s.close()
    return path


def word2vec_lying_count(path: Path) -> Path:
    """A word2vec header declaring a billion rows over a one-row file."""
    path.write_text(f"1000000000 {DIM}\n1 " + " ".join(["0.5"] * DIM) + "\n")
    return path


def word2vec_binary_nan(path: Path) -> Path:
    """A word2vec binary file whose second row holds a NaN."""
    vec = np.full((2, DIM), 0.5, dtype="<f4")
    vec[1, 2] = np.nan
    path.write_bytes(f"2 {DIM}\n".encode() + b"1 " + vec[0].tobytes() + b"\n2 "
                     + vec[1].tobytes() + b"\n")
    return path


def tsv_endless_line(path: Path, length: int = 1 << 20) -> Path:
    """A TSV file whose second line never ends (1 MiB of digits, no tab, no newline)."""
    path.write_text("1\t" + " ".join(["0.5"] * DIM) + "\n" + "7" * length)
    return path
