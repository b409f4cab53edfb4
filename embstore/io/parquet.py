"""Parquet via pyarrow: one row per key, streamed one row group at a time.

Columns written by embstore::

    key          int64 | binary
    vector       fixed_size_list<float32>[dim]
    slot.<name>  fixed_size_list<float32>[width]     one per optimizer slot
    count int64, last_seen float64, last_step int64, version int64

and the store metadata as JSON under the schema metadata key ``embstore``, so a Parquet export
carries whole records and re-imports like the native format. Files from other tools are read
too: the key column may be named ``key``/``keys``/``id``/``word`` (integers, binary or strings),
the vector column ``vector``/``vectors``/``embedding`` (fixed-size or variable lists of floats,
every row of the same length); other columns are ignored. Null keys or vectors are bad rows.

Memory: reading holds up to three row groups at a time (the next ones are decoded ahead in a
thread; embstore writes one row group per export batch of 65536 rows; files from other tools
may use larger groups, up to pyarrow's default of 1M rows).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import BackendUnavailableError, CorruptFileError
from ..extras import install_hint
from ..layout import META_FIELDS, Layout
from .base import (
    CHUNK_ROWS,
    Chunk,
    FormatReader,
    FormatWriter,
    check_dim,
    commit,
    discard,
    prefetch,
    temp_beside,
)
from .limits import CHUNK_BYTES, check_inflation, chunk_rows

try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError as e:  # pragma: no cover - depends on the environment
    raise BackendUnavailableError(
        f"the Parquet format needs pyarrow; install it with: {install_hint('parquet')}") from e

META_KEY = b"embstore"
_KEY_NAMES = ("key", "keys", "id", "word")
_VEC_NAMES = ("vector", "vectors", "embedding")
_ARROW_META = {"<i8": pa.int64(), "<f8": pa.float64(), "<u4": pa.uint32()}
#: decoded bytes per value of the fixed-width Parquet physical types
_PHYSICAL_BYTES = {"BOOLEAN": 1, "INT32": 4, "INT64": 8, "INT96": 12, "FLOAT": 4, "DOUBLE": 8}
#: row groups decoding to more than this are read in batches, not whole
_WHOLE_GROUP_BYTES = 4 * CHUNK_BYTES


def _schema(layout: Layout, key_type: str, meta: dict[str, Any]) -> pa.Schema:
    fields = [pa.field("key", pa.int64() if key_type == "int64" else pa.binary(), False),
              pa.field("vector", pa.list_(pa.float32(), layout.dim), False)]
    fields += [pa.field(f"slot.{n}", pa.list_(pa.float32(), w), False) for n, w in layout.slots]
    fields += [pa.field(n, _ARROW_META[t], False) for n, t in layout.meta]
    return pa.schema(fields, metadata={META_KEY: json.dumps(meta, sort_keys=True).encode()})


def _fixed(values: np.ndarray, width: int) -> pa.Array:
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat), width)


class ParquetWriter(FormatWriter):
    """Write records as Parquet, one row group per written batch."""

    format = "parquet"

    def __init__(self, dest: str | os.PathLike, meta: dict[str, Any],
                 compression: str = "snappy") -> None:
        super().__init__(dest, meta)
        self.schema = _schema(self.layout, self.key_type, meta)
        f, self._tmp = temp_beside(self.dest)
        f.close()
        try:
            # Dictionary encoding only where values repeat (the per-row metadata: counts,
            # stamps). Keys are unique and trained float vectors almost never repeat, so
            # pyarrow would build a dictionary for each page only to throw it away: about
            # two thirds of the write's CPU for a dim-64 table, for a larger file.
            # Statistics (min/max per page and column chunk) only for the key and metadata:
            # the min/max of all floats of a vector column prunes nothing, and computing it
            # is ~a tenth of the write's CPU.
            meta_names = [n for n, _ in self.layout.meta]
            self._w = pq.ParquetWriter(
                self._tmp, self.schema, compression=compression, use_dictionary=meta_names,
                write_statistics=["key", *meta_names])
        except BaseException:
            discard(None, self._tmp)
            raise

    def write(self, keys: np.ndarray, records: np.ndarray) -> None:
        if len(keys) == 0:
            return
        # 16-bit stores write their values widened to float32 (exact, and narrowed back to the
        # same bits on import); the header's layout records the storage dtype
        records = records if self.layout.is_wide else self.layout.widen(records)
        cols = [pa.array(keys, type=self.schema.field("key").type),
                _fixed(records["vector"], self.layout.dim)]
        cols += [_fixed(records[n], w) for n, w in self.layout.slots]
        cols += [pa.array(np.ascontiguousarray(records[n])) for n, _ in self.layout.meta]
        self._w.write_table(pa.Table.from_arrays(cols, schema=self.schema))
        self.rows += len(keys)

    def _finish(self) -> None:
        self._w.close()
        commit(open(self._tmp, "rb+"), self._tmp, self.dest)  # noqa: SIM115 - commit closes

    def _discard(self) -> None:
        try:
            self._w.close()
        finally:
            discard(None, self._tmp)


def _pick(names: list[str], wanted: tuple[str, ...], what: str, file: str) -> str:
    for w in wanted:
        if w in names:
            return w
    raise CorruptFileError(f"{file}: no {what} column (looked for {', '.join(wanted)})")


class ParquetReader(FormatReader):
    """Read (key, vector) rows — whole records when the file was written by embstore."""

    format = "parquet"

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        try:
            self._pf = pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as e:
            raise CorruptFileError(f"{self.name}: not a readable Parquet file: {e}") from e
        schema = self._pf.schema_arrow
        names = schema.names
        self._kcol = _pick(names, _KEY_NAMES, "key", self.name)
        self._vcol = _pick(names, _VEC_NAMES, "vector", self.name)
        ktype, vtype = schema.field(self._kcol).type, schema.field(self._vcol).type
        if pa.types.is_integer(ktype):
            self.key_kind = "int64"
        elif pa.types.is_binary(ktype) or pa.types.is_large_binary(ktype):
            self.key_kind = "bytes"
        elif pa.types.is_string(ktype) or pa.types.is_large_string(ktype):
            self.key_kind = "text"
        else:
            raise CorruptFileError(f"{self.name}: key column has unsupported type {ktype}")
        if not (pa.types.is_list(vtype) or pa.types.is_large_list(vtype)
                or pa.types.is_fixed_size_list(vtype)) or not pa.types.is_floating(
                    vtype.value_type):
            raise CorruptFileError(f"{self.name}: vector column must hold lists of floats, "
                                   f"not {vtype}")
        self.declared_rows = self._pf.metadata.num_rows
        raw = (schema.metadata or {}).get(META_KEY)
        if raw is not None:
            try:
                self.header = json.loads(raw)
                self.layout = Layout.from_json(self.header["layout"])
            except (ValueError, KeyError, TypeError) as e:
                raise CorruptFileError(f"{self.name}: unreadable embstore metadata: {e}") from e
            except RecursionError:
                raise CorruptFileError(
                    f"{self.name}: embstore metadata JSON is nested absurdly deep") from None
        # Before any data is decoded: no row group may decode to absurdly more than it stores.
        self._group_bytes = self._decoded_group_bytes()
        if pa.types.is_fixed_size_list(vtype):
            self.dim = vtype.list_size
        elif self.layout is not None:
            self.dim = self.layout.dim
        else:
            self.dim = self._first_length()
        check_dim(self.dim, self.name)
        record_cols = ["vector"] + [f"slot.{n}" for n in (self.layout.slot_names
                                                         if self.layout else ())]
        record_cols += [n for n, _ in (self.layout.meta if self.layout else META_FIELDS)]
        self._records = (self.layout is not None and self.layout.dim == self.dim
                         and self._vcol == "vector" and all(c in names for c in record_cols))
        if not self._records:
            self.layout = None
        self._cols = [self._kcol] + (record_cols if self._records else [self._vcol])
        layout = self.layout if self._records else None  # (not None when _records)
        widths = self.dim + (sum(w for _, w in layout.slots) if layout is not None else 0)
        self._row_bytes = 8 + 4 * widths + (8 * len(layout.meta) if layout is not None else 0)

    def _decoded_group_bytes(self) -> list[int]:
        """Decoded size of each row group, from the value counts of its column chunks (a
        count the decoder stops at, unlike the declared byte sizes, which run-length and
        dictionary encodings make arbitrarily small); refuses compression bombs."""
        md = self._pf.metadata
        sizes = []
        for i in range(md.num_row_groups):
            rg = md.row_group(i)
            stored = decoded = 0
            for j in range(rg.num_columns):
                col = rg.column(j)
                stored += col.total_compressed_size
                width = _PHYSICAL_BYTES.get(col.physical_type)
                decoded += (col.num_values * width if width is not None
                            else max(col.total_uncompressed_size, col.num_values))
            check_inflation(self.name, f"row group {i}", stored, decoded)
            sizes.append(decoded)
        return sizes
    def _first_length(self) -> int:
        import pyarrow.compute as pc  # deferred: see _chunks

        for batch in self._iter(1024, [self._vcol]):
            lens = pc.list_value_length(batch.column(0)).drop_null()
            if len(lens):
                return int(lens[0].as_py())
        return 1

    def _iter(self, batch_size: int, columns: list[str]):
        # One row group at a time (memory: one row group; embstore writes one per export
        # batch). Measured 2-3x faster than ParquetFile.iter_batches, which decodes serially.
        # The next group is decoded in a thread (pyarrow releases the GIL) while the caller
        # converts and checks this one: at most three groups in memory.
        def groups() -> Iterator[pa.Table]:
            for i in range(self._pf.metadata.num_row_groups):
                if self._group_bytes[i] <= _WHOLE_GROUP_BYTES:
                    yield self._pf.read_row_group(i, columns=columns)
                    continue
                # a big row group (other tools write up to 1M rows) streams in bounded batches
                for b in self._pf.iter_batches(batch_size, row_groups=[i], columns=columns):
                    yield pa.Table.from_batches([b])

        try:
            for table in prefetch(groups(), depth=1, name="embstore-parquet"):
                yield from table.to_batches(max_chunksize=batch_size)
        except (pa.ArrowException, OSError) as e:
            raise CorruptFileError(f"{self.name}: damaged Parquet data: {e}") from e

    def chunks(self, batch_size: int = CHUNK_ROWS, *, validate: bool = False
               ) -> Iterator[Chunk]:
        batch_size = chunk_rows(self._row_bytes, batch_size)
        try:
            yield from self._chunks(batch_size, validate)
        except pa.ArrowException as e:
            raise CorruptFileError(f"{self.name}: unreadable Parquet data: {e}") from e

    def _chunks(self, batch_size: int, validate: bool) -> Iterator[Chunk]:
        # deferred: importing pyarrow.compute costs ~0.1-0.2 s of CPU, which an export (a
        # writer, or each worker of an export in parts) never needs
        import pyarrow.compute as pc

        start = 0
        # records also in a checking pass: their stamps are range-checked before any write
        layout = self.layout if self._records else None  # (not None when _records)
        with_records = layout is not None
        for batch in self._iter(batch_size, self._cols if with_records else self._cols[:2]):
            n = batch.num_rows
            rows = np.arange(start, start + n, dtype=np.int64)
            start += n
            kcol, vcol = batch.column(0), batch.column(1)
            good = np.ones(n, dtype=bool)
            bad: list[tuple[int, str]] = []
            if kcol.null_count:
                nulls = kcol.is_null().to_numpy(zero_copy_only=False)
                good &= ~nulls
                bad += [(int(r), "null key") for r in rows[nulls]]
            lens = pc.list_value_length(vcol).fill_null(-1).to_numpy(zero_copy_only=False)
            wrong = good & (lens != self.dim)
            if wrong.any():
                good &= ~wrong
                bad += [(int(r), "null vector" if lens[i] < 0 else
                         f"{lens[i]} values where {self.dim} are expected")
                        for i, r in zip(np.flatnonzero(wrong), rows[wrong])]
            if not good.all():
                mask = pa.array(good)
                batch = batch.filter(mask)
                kcol, vcol, rows = batch.column(0), batch.column(1), rows[good]
                bad.sort()
            m = batch.num_rows
            vectors = _floats(vcol, m, self.dim)
            keys = _keys(kcol, self.key_kind)
            records = None
            if layout is not None:
                wide = layout.wide.empty(m)
                wide["vector"] = vectors
                for j, (name, w) in enumerate(layout.slots):
                    wide[name] = _floats(batch.column(2 + j), m, w)
                for j, (name, _) in enumerate(layout.meta):
                    col = batch.column(2 + len(layout.slots) + j)
                    wide[name] = col.to_numpy(zero_copy_only=False)
                if layout.is_wide:
                    records = wide
                else:
                    records = layout.empty(m)
                    layout.narrow_into(wide, records)
            yield Chunk(keys, vectors, rows, records, bad)


def _floats(col: pa.Array, n: int, width: int) -> np.ndarray:
    # Null inner values come out as NaN and are rejected like NaN values.
    flat = col.flatten().to_numpy(zero_copy_only=False)
    with np.errstate(over="ignore"):  # float64 beyond float32 range -> inf -> a bad row
        return np.ascontiguousarray(flat, dtype=np.float32).reshape(n, width)


def _keys(col: pa.Array, kind: str) -> np.ndarray:
    if kind == "int64":
        return col.cast(pa.int64()).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    out = np.empty(len(col), dtype=object)
    if kind == "text":
        out[:] = [s.encode("utf-8") for s in col.to_pylist()]
    else:
        out[:] = col.to_pylist()
    return out
