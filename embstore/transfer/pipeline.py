"""Moving rows between stores and files: import, export, copy (verification: ``verify.py``).

Import is all or nothing by default: a first streaming pass reads and checks the whole file
(structure, checksums, every key and value), and only a clean file is written in a second
pass. With ``skip_bad=True`` rows that fail the row-level checks (bad key, wrong number of
values, NaN/inf) are skipped and counted instead; structural damage (truncation, checksum
mismatch, a lying header) always refuses the file.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from .. import optim
from .._cython.rowops import all_finite
from ..engine import services
from ..engine.protocols import StoreInfo
from ..errors import CorruptFileError, InvalidInputError, SchemaMismatchError
from ..io.base import CHUNK_ROWS, Chunk, FormatReader, describe_row, parse_int_keys, prefetch
from ..io.formats import detect_format, open_reader, open_writer
from ..io.limits import chunk_rows
from ..layout import Layout
from ..progress import progress_bar
from .own_storage import refuse_own_storage, refuse_same_storage
from .parts import Part, part_records
from .validate import ImportChecks, local_store_paths, remove_created

if TYPE_CHECKING:
    from ..store import EmbeddingStore

PROJECTIONS = ("random", "truncate")
#: decoded rows kept between the checking and the writing pass (see ``import_file``)
DEFAULT_CACHE_BYTES = 512 << 20


@dataclass
class ImportReport:
    """What an import did: rows written, bad rows skipped, whether whole records or only
    vectors were loaded."""

    rows: int = 0
    skipped: int = 0
    mode: str = "vectors"
    format: str = ""
    bad: list[str] = field(default_factory=list)
    url: str = ""
    store: Any = None
    #: keys the file asked to delete (a delta's deletions, or a full export's with
    #: ``apply_deletes``) and how many of them were in the store
    deleted: int = 0
    #: the file's stored value type (``"int8"`` for a quantized serving export), where known
    value_dtype: str = ""


def _projection(kind: str, src_dim: int, dst_dim: int, seed: int) -> np.ndarray | None:
    if kind == "truncate":
        return None
    rng = np.random.default_rng(seed)
    # Gaussian random projection (Johnson-Lindenstrauss): dot products are kept in expectation.
    return (rng.standard_normal((src_dim, dst_dim)) / np.sqrt(dst_dim)).astype(np.float32)


def _project(vectors: np.ndarray, kind: str | None, dst_dim: int,
             mat: np.ndarray | None) -> np.ndarray:
    if mat is not None:
        return np.ascontiguousarray(vectors @ mat, dtype=np.float32)
    out = np.zeros((len(vectors), dst_dim), dtype=np.float32)
    w = min(dst_dim, vectors.shape[1])
    out[:, :w] = vectors[:, :w]
    return out


def finite_rows(vectors: np.ndarray) -> np.ndarray:
    """Rows without NaN/inf. A chunk is first checked whole; otherwise a row sum is non-finite
    whenever a value is (and, rarely, on overflow), so only rows with a non-finite sum are
    checked value by value."""
    if (vectors.dtype == np.float32 and vectors.ndim == 2 and vectors.strides[1] == 4
            and all_finite(vectors)):
        return np.ones(len(vectors), dtype=bool)  # the common case, in one pass
    with np.errstate(all="ignore"):
        good = np.isfinite(vectors.sum(axis=1, dtype=np.float32))
    if not good.all():
        idx = np.flatnonzero(~good)
        good[idx] = np.isfinite(vectors[idx]).all(axis=1)
    return good


def clean_chunk(chunk: Chunk, reader: FormatReader, key_type: str) -> tuple[Chunk, list[str]]:
    """Apply the row-level checks that depend on the target store; drop and describe bad rows."""
    bad = [describe_row(reader, r, why) for r, why in chunk.bad]
    n = len(chunk.keys)
    good = finite_rows(chunk.vectors) if n else np.ones(0, dtype=bool)
    reasons = {}
    for i in np.flatnonzero(~good).tolist():
        reasons[i] = "NaN or infinite value"
    keys = chunk.keys
    if reader.key_kind == "text" and key_type == "int64":
        keys, ok = parse_int_keys(chunk.keys)
        for i in np.flatnonzero(~ok & good).tolist():
            reasons[i] = (f"key {chunk.keys[i][:40]!r} is not an integer "
                          "(the store has int64 keys; a new store from a file whose first "
                          "keys are integers gets int64 keys: --key-type bytes keeps text)")
        good &= ok
    if not good.all():
        bad += [describe_row(reader, int(chunk.rows[i]), reasons[i]) for i in sorted(reasons)]
        chunk = Chunk(keys[good], chunk.vectors[good], chunk.rows[good],
                      None if chunk.records is None else chunk.records[good])
    else:
        chunk = Chunk(keys, chunk.vectors, chunk.rows, chunk.records)
    return chunk, bad


def check_compatible(reader: FormatReader, store: StoreInfo, project: str | None) -> None:
    """Refuse files whose keys or dimension do not fit the store."""
    if {reader.key_kind, store.key_type} == {"int64", "bytes"}:
        raise SchemaMismatchError(
            f"{reader.name} holds {reader.key_kind} keys, the store has {store.key_type} keys; "
            "nothing imported")
    reader.assume_dim(store.dim)  # no rows, so no dimension to disagree with
    if reader.dim != store.dim and project is None:
        raise SchemaMismatchError(
            f"{reader.name} holds vectors of dim {reader.dim}, the store has dim {store.dim}; "
            "nothing imported (an explicit --project random|truncate maps them)")
    if project is not None and project not in PROJECTIONS:
        raise InvalidInputError(f"project must be one of {PROJECTIONS}, got {project!r}")


@dataclass
class NewStore:
    """A store to create only once the file has passed validation (so a refused import
    leaves no empty store behind). ``options`` go to :func:`embstore.open`."""

    url: str
    options: dict[str, Any]

    def __post_init__(self) -> None:
        opt = optim.resolve(self.options.get("optimizer")) or optim.SGD(lr=0.01)
        self.dim = int(self.options["dim"])
        self.key_type = self.options.get("key_type", "int64")
        self.layout = Layout(self.dim, tuple(opt.slots(self.dim)))
        self.optimizer = opt

    def check_writable(self) -> None:
        """A store still to be created accepts writes."""

    def open(self) -> EmbeddingStore:
        """Create the store (through :func:`embstore.open`)."""
        # what does not exist yet is removed again when the import fails after this
        self.created = [p for p in local_store_paths(self.url) if not os.path.lexists(p)]
        store: EmbeddingStore = services.opener()(self.url, **self.options)
        return store

    def discard(self, store: Any) -> None:
        """Close and remove a store this import created and then failed to fill."""
        try:
            store.close()
        finally:
            remove_created(getattr(self, "created", []))


def infer_text_key_type(reader: FormatReader) -> str:
    """``"int64"`` when the first chunk's text keys are all integers written as an int64
    store's export writes them (canonical decimals, so a key reads back to the same text),
    else ``"bytes"``. TSV and word2vec files cannot record a key type; this keeps an int64
    store's round trip through them an int64 store."""
    if reader.key_kind != "text":
        return "int64" if reader.key_kind == "int64" else "bytes"
    chunk = next(iter(reader.chunks(CHUNK_ROWS)), None)
    if chunk is None or len(chunk.keys) == 0:
        return "bytes"
    ints, ok = parse_int_keys(chunk.keys)
    if not ok.all():
        return "bytes"
    canonical = np.array([str(v).encode() for v in ints.tolist()], dtype=object)
    return "int64" if bool((canonical == chunk.keys).all()) else "bytes"


def creation_options(reader: FormatReader, *, dim: int | None = None,
                     key_type: str | None = None) -> dict[str, Any]:
    """Options to create a store fitting ``reader``'s file: its own configuration when the
    file carries store metadata, else its dim and key kind (text keys that are all integers
    -> int64, see :func:`infer_text_key_type`; other text keys -> bytes)."""
    opts: dict[str, Any] = {}
    h = reader.header or {}
    for k in ("optimizer", "initializer", "seed"):
        if k in h:
            opts[k] = h[k]
    layout = getattr(reader, "layout", None)
    if isinstance(layout, Layout) and reader.header is not None:
        # the storage the file's records were written in (16-bit, int8 serving, compact)
        if layout.value_dtype != "float32":
            opts["value_dtype"] = layout.value_dtype
        if layout.is_compact:
            opts["metadata"] = "compact"
    opts["dim"] = int(dim) if dim is not None else reader.dim
    opts["key_type"] = key_type or infer_text_key_type(reader)
    return opts


def import_file(store: EmbeddingStore | NewStore,
                src: str | os.PathLike | BinaryIO | bytes | FormatReader, *,
                fmt: str | None = None, skip_bad: bool = False, project: str | None = None,
                seed: int = 0, batch_size: int = CHUNK_ROWS, progress: bool = False,
                cache_bytes: int = DEFAULT_CACHE_BYTES, partial: bool = False,
                apply_deletes: bool = False) -> ImportReport:
    """Import a file of any supported format into ``store``.

    Parameters
    ----------
    store : EmbeddingStore or NewStore
        The target; must be writable. A :class:`NewStore` is created after validation.
    src : path, binary stream, bytes or FormatReader
        Streams and bytes are read as the native format (``store.import_``).
    fmt : str, optional
        Format name (see :data:`embstore.io.formats.FORMATS`); detected when None.
    skip_bad : bool
        Skip rows that fail row checks (and count them) instead of refusing the file.
    project : {"random", "truncate"}, optional
        Map vectors of another dimension: a seeded Gaussian random projection, or
        truncation/zero padding. Without it a dimension mismatch is refused.
    seed : int
        Seed of the random projection.
    cache_bytes : int
        Memory for keeping the first pass's decoded rows: a file whose rows fit is read
        once; a bigger one is read (and checked) again in the second pass. 0 disables.
    partial : bool
        One pass, writing each chunk once it is checked: on damage the rows before it stay
        imported (and the error is raised). Default: nothing is written unless the whole
        file is sound.
    apply_deletes : bool
        Let a native full export that lists deleted keys delete them (such a file is refused
        otherwise; a delta's deletions always apply). ``ImportReport.deleted`` counts them.

    Returns
    -------
    ImportReport
    """
    store.check_writable()
    with open_reader(src, fmt) as reader:
        check_compatible(reader, store, project)
        report = ImportReport(format=reader.format)
        records_mode = (reader.layout is not None and reader.layout == store.layout
                        and reader.key_kind == store.key_type and reader.dim == store.dim)
        report.mode = "records" if records_mode else "vectors"
        if reader.layout is not None:
            report.value_dtype = str(reader.layout.value_dtype)
        mat = (_projection(project, reader.dim, store.dim, seed)
               if reader.dim != store.dim and project is not None else None)
        # header, deletions and policy state now; stamps and key lengths per chunk in pass 1
        checks = ImportChecks(reader.name, reader.header, store, records=records_mode,
                              apply_deletes=apply_deletes, row_word=reader.row_word,
                              row_offset=reader.row_offset)
        # chunks are bounded in bytes: a 2**20-dim vector is 4 MiB
        batch_size = chunk_rows(4 * reader.dim + 64, batch_size)

        # Pass 1: read everything, write nothing. Clean chunks are kept (up to cache_bytes)
        # so that a file that fits is not read and parsed a second time.
        total = 0
        cache: list[Chunk] | None = [] if cache_bytes > 0 and not partial else None
        cached = 0
        with progress_bar(total=reader.declared_rows, enabled=progress and not partial,
                          desc="validate") as bar:
            for chunk in ([] if partial else reader.chunks(batch_size,
                                                           validate=cache is None)):
                clean = _checked(chunk, reader, store.key_type, skip_bad, report)
                checks.chunk(clean.keys, clean.records, clean.rows)
                total += len(clean.keys)
                bar.update(len(chunk.keys) + len(chunk.bad))
                if cache is not None:
                    cached += _nbytes(clean)
                    if cached > cache_bytes:
                        cache = None  # too big: pass 2 reads the file again
                    else:
                        cache.append(clean)

        # Pass 2: write. Re-read chunks need no second check unless keys must be converted.
        recheck = partial or report.skipped > 0 or (reader.key_kind == "text"
                                                    and store.key_type == "int64")
        new = store if isinstance(store, NewStore) else None
        if new is not None:
            store = new.open()
            report.url = store.url
            report.store = store

        def cleaned() -> Iterator[Chunk]:
            if cache is not None:
                cache.reverse()
                while cache:
                    clean = cache.pop()  # dropped once written: memory shrinks as we go
                    bar.update(len(clean.keys))
                    yield clean
                return
            for chunk in reader.chunks(batch_size):
                if partial:  # no pass 1: every check before the chunk is written
                    clean = _checked(chunk, reader, store.key_type, skip_bad, report, True)
                    checks.chunk(clean.keys, clean.records, clean.rows)
                else:
                    clean = clean_chunk(chunk, reader, store.key_type)[0] if recheck else chunk
                bar.update(len(clean.keys))
                yield clean

        try:
            # partial: no pass 1 (pass 2 checks each chunk before writing it), no total
            with progress_bar(total=None if partial else total, enabled=progress,
                              desc="import") as bar:
                _write(store, reader, report, cleaned(), checks.deleted, project, mat,
                       partial=partial)
        except BaseException:
            if new is not None:  # a store created for this import goes again
                report.store = None
                new.discard(store)
            raise
    return report


def _write(store: Any, reader: FormatReader, report: ImportReport, chunks: Iterator[Chunk],
           deleted: np.ndarray | None, project: str | None, mat: np.ndarray | None, *,
           partial: bool = False) -> None:
    """Pass 2 of ``import_file``: deletions first (rows re-created after them survive),
    then whole records or vectors. ``partial``: one load per chunk, so that every chunk read
    before a damaged one is stored (a bulk load of the whole stream, as LMDB and RocksDB do
    it, writes only at its end and would keep nothing)."""
    if report.mode == "records":
        if (reader.header or {}).get("deletions_complete") is False:
            warnings.warn(f"{reader.name}: this delta does not carry every deletion "
                          "since its base version; rows deleted at the source may "
                          "remain here (sync from a full export)", stacklevel=4)
        if deleted is not None and len(deleted):
            report.deleted = _apply_deletions(store, deleted)
        if partial:
            for c in chunks:
                report.rows += store.load_records(iter([(c.keys, c.records)]),
                                                  header=reader.header)
            return
        report.rows = store.load_records(((c.keys, c.records) for c in chunks),
                                         header=reader.header)
        return
    for c in chunks:
        vecs = c.vectors
        if reader.dim != store.dim:
            vecs = _project(vecs, project, store.dim, mat)
        if len(c.keys):
            store.assign(c.keys, vecs)
            report.rows += len(c.keys)


def _checked(chunk: Chunk, reader: FormatReader, key_type: str, skip_bad: bool,
             report: ImportReport, partial: bool = False) -> Chunk:
    """The chunk's clean rows; bad rows are counted (``skip_bad``) or refuse the file."""
    clean, bad = clean_chunk(chunk, reader, key_type)
    if bad and not skip_bad:
        more = "" if len(bad) == 1 else f" (and {len(bad) - 1} more in this chunk)"
        done = ("the rows before this chunk were imported" if partial
                else "nothing was imported (--skip-bad skips bad rows)")
        raise CorruptFileError(f"{bad[0]}{more}; {done}")
    report.skipped += len(bad)
    report.bad += bad[:max(0, 20 - len(report.bad))]
    return clean


def _nbytes(chunk: Chunk) -> int:
    n = chunk.records.nbytes if chunk.records is not None else chunk.vectors.nbytes
    if chunk.keys.dtype == object:
        return n + 64 * len(chunk.keys) + sum(len(k) for k in chunk.keys)
    return n + chunk.keys.nbytes


def _apply_deletions(store: Any, gone: np.ndarray) -> int:
    # A native delta export lists the keys deleted since its base version.
    n = 0
    for i in range(0, len(gone), CHUNK_ROWS):
        n += int(store.delete(gone[i:i + CHUNK_ROWS]) or 0)
    return n


def export_file(store: Any, dest: str | os.PathLike, *, fmt: str | None = None,
                since: int | None = None, batch_size: int = CHUNK_ROWS,
                progress: bool = False, quantize: str | None = None) -> int:
    """Write the store's rows (or those changed after ``since``) to ``dest`` in ``fmt``.

    The native format keeps everything (also deletions for ``since``); other formats keep
    what they can carry (see ``docs/cli.md``). Returns the number of rows written; the file
    appears only when complete.
    """
    refuse_own_storage(store, dest)
    name = detect_format(dest, fmt, for_write=True)
    if name == "native":
        return store.export(dest, since=since, batch_size=batch_size, progress=progress,
                            format="native", quantize=quantize)
    if quantize is not None:
        raise InvalidInputError(f"quantize={quantize!r} writes the native format (a serving "
                                f"table a store imports), not {name}")
    meta = store.meta
    meta["since"] = since
    src = store.records(batch_size) if since is None else store.changes_since(since, batch_size)
    with open_writer(dest, meta, name) as w, progress_bar(
            # the count only for a progress bar: on Bigtable it is a scan of every row key
            total=len(store) if since is None and progress else None, enabled=progress,
            desc="export") as bar:
        for keys, recs in src:
            w.write(keys, recs)
            bar.update(len(keys))
    return w.rows


#: bytes of records per ``load_records`` call of a copy (see ``copy_store``)
COPY_GROUP_BYTES = 32 << 20


def _regroupable(dst: Any) -> bool:
    # Loading in several calls leaves the same table as one call, unless the destination
    # evicts (eviction would run per call) or has observers (each call resyncs them).
    return dst.eviction is None and not dst.observers


def _take_bytes(it: Iterator[tuple[np.ndarray, np.ndarray]], limit: int
                ) -> list[tuple[np.ndarray, np.ndarray]]:
    group, size = [], 0
    for keys, recs in it:
        group.append((keys, recs))
        size += recs.nbytes
        if size >= limit:
            break
    return group


def copy_store(src: Any, dst: Any, *, batch_size: int = CHUNK_ROWS,
               progress: bool = False, part: Part | None = None) -> int:
    """Stream every row of ``src`` into ``dst`` (any two stores; a sharded ``dst``
    re-partitions on the way). Whole records when the layouts agree, else vectors only.
    Copying a store onto itself (same URL or storage) raises ``InvalidInputError``.
    ``part`` (from :func:`embstore.transfer.plan_parts` on ``src``): only its rows."""
    refuse_same_storage(src, dst)
    if src.key_type != dst.key_type:
        raise SchemaMismatchError(
            f"{src.url} has {src.key_type} keys, {dst.url} has {dst.key_type} keys")
    if src.dim != dst.dim:
        raise SchemaMismatchError(f"{src.url} has dim {src.dim}, {dst.url} has dim {dst.dim}")
    with progress_bar(total=len(src) if part is None and progress else None, enabled=progress,
                      desc="copy") as bar:
        def batches():
            # The source is read in a thread while the destination writes: reads and writes
            # (LMDB, files, network) release the GIL, so the two sides overlap. Distinct
            # stores only: one store is never used from two threads at once.
            rows = (src.records(batch_size) if part is None
                    else part_records(src, part, batch_size))
            for keys, recs in (prefetch(rows, depth=2) if src is not dst else rows):
                bar.update(len(keys))
                yield keys, recs

        if src.layout == dst.layout:
            if not _regroupable(dst):
                return dst.load_records(batches(), header=src.meta)
            # Several loads of ~COPY_GROUP_BYTES: the destination writes one group while the
            # source thread reads the next (one bulk_load may buffer hundreds of MB before
            # writing anything, which would leave nothing to overlap).
            it, header, n = batches(), src.meta, 0
            try:
                while group := _take_bytes(it, COPY_GROUP_BYTES):
                    n += dst.load_records(iter(group), header=header)
            finally:
                it.close()
            return n
        n = 0
        for keys, recs in batches():
            dst.assign(keys, np.ascontiguousarray(src.layout.vectors(recs)))
            n += len(keys)
        return n
