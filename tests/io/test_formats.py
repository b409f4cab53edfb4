"""Interchange formats: exact round trips through every format and backend, gensim interop,
and refusal of corrupt, truncated, wrong-dim and hostile files (nothing imported)."""

from __future__ import annotations

import os
import struct
import zipfile

import numpy as np
import pytest

import embstore
from embstore.errors import (
    CorruptFileError,
    InvalidInputError,
    SchemaMismatchError,
)
from embstore.io.formats import detect_format, open_reader
from embstore.transfer import export_file, import_file, verify_file, verify_store

FORMATS = {  # format -> file name
    "native": "t.emb", "parquet": "t.parquet", "npz": "t.npz", "npy": "tdir",
    "word2vec": "t.txt", "word2vec-binary": "t.bin", "tsv": "t.tsv",
}
RECORD_FORMATS = ("native", "parquet")
BACKENDS = ("memory", "lmdb", "sqlite", "postgres", "bigtable")
DIM = 6


@pytest.fixture
def new_url(new_store_url):
    """new_url(kind) -> a fresh store URL of that backend (skips when it is not available)."""
    return new_store_url


def _keys(key_type: str, n: int, seed: int = 0) -> np.ndarray | list:
    rng = np.random.default_rng(seed)
    if key_type == "int64":
        k = rng.choice(np.arange(-(1 << 62), 1 << 62, (1 << 62) // 5000), n, replace=False)
        k[0], k[1] = np.iinfo(np.int64).min, np.iinfo(np.int64).max
        return k.astype(np.int64)
    base = [f"w{i}" for i in range(n - 3)] + ["été", "日本語", "a\tb"]
    return [s.encode() for s in base]


def _filled(url: str, key_type: str, n: int = 120) -> embstore.EmbeddingStore:
    s = embstore.open(url, dim=DIM, key_type=key_type, optimizer="adagrad")
    keys = _keys(key_type, n)
    s.lookup(keys)
    rng = np.random.default_rng(1)
    s.update(keys[: n // 2], rng.standard_normal((n // 2, DIM)).astype(np.float32))
    # values that stress text formatting: tiny, huge, negative zero, subnormal
    s.assign(keys[:4], np.array([[1e-38, -0.0, 3.4e38, 1.4e-45, 0.1, -1 / 3]] * 4, np.float32))
    return s


def _records_by_key(store) -> dict:
    out = {}
    for keys, recs in store.records(1000):
        for k, r in zip(keys.tolist(), recs):
            out[k] = r.tobytes()
    return out


def _vectors_by_key(store) -> dict:
    out = {}
    for keys, vecs in store.items(1000):
        for k, v in zip(keys.tolist(), vecs):
            out[k] = v.tobytes()
    return out


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_is_exact(backend, fmt, new_url, tmp_path):
    key_type = "bytes" if backend in ("lmdb", "postgres") else "int64"
    if fmt in ("word2vec", "word2vec-binary") or (fmt == "tsv" and key_type == "bytes"):
        key_type = "bytes"
    src = _filled(new_url(backend), key_type)
    if fmt in ("word2vec", "word2vec-binary", "tsv") and key_type == "bytes":
        # a tab is fine in word2vec keys, not in TSV ones; a space in neither
        src.delete([b"a\tb"]) if fmt == "tsv" else None
    path = tmp_path / FORMATS[fmt]
    n = export_file(src, path, fmt=fmt if fmt == "npy" else None)
    assert n == len(src)
    dst = embstore.open(new_url(backend), dim=DIM, key_type=key_type, optimizer="adagrad")
    rep = import_file(dst, path)
    assert rep.rows == n and rep.skipped == 0
    assert _vectors_by_key(dst) == _vectors_by_key(src)
    if fmt in RECORD_FORMATS:
        assert rep.mode == "records"
        assert _records_by_key(dst) == _records_by_key(src)
    else:
        recs, found = dst.get_records(list(_vectors_by_key(src)))
        assert found.all()
        assert (recs["accum"] == 0).all() and (recs["count"] == 0).all()  # fresh slots
    assert verify_file(path).digest == verify_store(src).digest == verify_store(dst).digest
    src.close()
    dst.close()


def test_text_keys_into_int64_store(tmp_path):
    src = _filled("memory://", "int64")
    export_file(src, tmp_path / "v.txt")
    dst = embstore.open("memory://", dim=DIM, key_type="int64")
    import_file(dst, tmp_path / "v.txt")
    assert _vectors_by_key(dst) == _vectors_by_key(src)
    (tmp_path / "bad.tsv").write_text("12\t1 2 3 4 5 6\n0x10\t1 2 3 4 5 6\n1_000\t1 2 3 4 5 6\n")
    with pytest.raises(CorruptFileError, match="line 2.*not an integer"):
        import_file(dst, tmp_path / "bad.tsv")
    rep = import_file(dst, tmp_path / "bad.tsv", skip_bad=True)
    assert rep.rows == 1 and rep.skipped == 2


@pytest.mark.parametrize("binary", [False, True])
def test_gensim_reads_our_exports_exactly(binary, tmp_path):
    from gensim.models import KeyedVectors

    from embstore.cli import main

    src = _filled(f"lmdb://{tmp_path}/db", "bytes")
    vecs = _vectors_by_key(src)
    src.close()
    fmt = "word2vec-binary" if binary else "word2vec"
    path = tmp_path / "v"
    assert main(["export", src.url, str(path), "--format", fmt, "-q"]) == 0
    kv = KeyedVectors.load_word2vec_format(str(path), binary=binary)
    assert len(kv) == len(vecs)
    for k, v in vecs.items():
        assert kv[k.decode()].tobytes() == v
    if binary:  # gensim writing the same vectors back produces the same bytes
        kv.save_word2vec_format(str(tmp_path / "again"), binary=True)
        assert (tmp_path / "again").read_bytes() == path.read_bytes()


@pytest.mark.parametrize("binary", [False, True])
def test_vectors_gensim_saves_import_identically(binary, tmp_path):
    from gensim.models import KeyedVectors

    rng = np.random.default_rng(5)
    words = [f"tok{i}" for i in range(200)] + ["naïve", "東京", "x,y"]
    vecs = (rng.standard_normal((len(words), 10)) * 10.0 ** rng.integers(
        -8, 8, (len(words), 1))).astype(np.float32)
    kv = KeyedVectors(10)
    kv.add_vectors(words, vecs)
    path = tmp_path / ("g.bin" if binary else "g.txt")
    kv.save_word2vec_format(str(path), binary=binary)
    store = embstore.open("memory://", dim=10, key_type="bytes")
    rep = import_file(store, path)
    assert rep.rows == len(words)
    got = store.lookup([w.encode() for w in words], insert=False)
    assert got.tobytes() == np.asarray([kv[w] for w in words]).tobytes()


# -- hostile and damaged input ---------------------------------------------------------------------
def _w2v_text(rows, dim=3, count=None):
    body = "".join(f"{k} {' '.join(map(str, v))}\n" for k, v in rows)
    return f"{len(rows) if count is None else count} {dim}\n{body}".encode()


@pytest.fixture
def store():
    s = embstore.open("memory://", dim=3, key_type="bytes")
    s.assign([b"keep"], [[1, 2, 3]])
    return s


def _untouched(store):
    assert len(store) == 1
    assert store.lookup([b"keep"], insert=False).tolist() == [[1, 2, 3]]


@pytest.mark.parametrize("content,match", [
    (b"99999999999 3\nw 1 2 3\n", "more than the"),
    (b"1 999999999999\nw 1 2 3\n", "absurd dimension"),
    (b"1 -3\nw 1 2 3\n", "absurd dimension"),
    (b"hello world\n", "not a word2vec file"),
    (b"3 3\nw 1 2 3\nv 1 2 3\n", "truncated"),
    (b"1 3\nw 1 2 3\nv 1 2 3\n", "more rows"),
])
def test_bad_word2vec_text_is_refused(store, tmp_path, content, match):
    p = tmp_path / "v.txt"
    p.write_bytes(content)
    with pytest.raises(CorruptFileError, match=match):
        import_file(store, p, skip_bad=True)
    _untouched(store)


@pytest.mark.parametrize("row,match", [
    (b"\xff\xfe 1 2 3", "not valid UTF-8"),
    (b"w nan 2 3", "NaN"),
    (b"w 1 inf 3", "NaN or infinite"),
    (b"w 1 2", "2 values where 3"),
    (b"w 1 2 x", "not a number"),
])
def test_bad_rows_refuse_the_whole_file_unless_skipped(store, tmp_path, row, match):
    good = [(f"k{i}", [i, i, i]) for i in range(50)]
    p = tmp_path / "v.txt"
    p.write_bytes(_w2v_text(good, count=51) + row + b"\n")
    with pytest.raises(CorruptFileError, match=f"row 51: .*{match}.*nothing was imported"):
        import_file(store, p)
    _untouched(store)
    rep = import_file(store, p, skip_bad=True)
    assert (rep.rows, rep.skipped) == (50, 1)
    assert len(store) == 51


def test_truncated_and_lying_binary_word2vec(store, tmp_path):
    rows = b"".join(f"k{i} ".encode() + np.full(3, i, "<f4").tobytes() for i in range(10))
    p = tmp_path / "v.bin"
    p.write_bytes(b"10 3\n" + rows[:-5])
    with pytest.raises(CorruptFileError, match="truncated"):
        import_file(store, p)
    p.write_bytes(b"10 3\n" + rows + b"junk")
    with pytest.raises(CorruptFileError, match="more data"):
        import_file(store, p)
    p.write_bytes(b"1 3\n" + b"x" * 100000)
    with pytest.raises(CorruptFileError):
        import_file(store, p)
    _untouched(store)
    p.write_bytes(b"10 3\n" + rows.replace(b" ", b"\n ", 1))  # C-tool newlines are fine
    assert import_file(store, p).rows == 10


def test_wrong_dim_is_refused_unless_projected(store, tmp_path):
    p = tmp_path / "v.tsv"
    p.write_text("a\t1 2 3 4 5\nb\t5 4 3 2 1\n")
    with pytest.raises(SchemaMismatchError, match="dim 5.*dim 3.*--project"):
        import_file(store, p)
    _untouched(store)
    import_file(store, p, project="truncate")
    assert store.lookup([b"a", b"b"], insert=False).tolist() == [[1, 2, 3], [5, 4, 3]]
    import_file(store, p, project="random")
    assert np.isfinite(store.lookup([b"a"], insert=False)).all()


def test_key_type_mismatch_is_refused(store, tmp_path):
    np.savez(tmp_path / "k.npz", keys=np.arange(3), vectors=np.ones((3, 3), np.float32))
    with pytest.raises(SchemaMismatchError, match="int64 keys.*bytes keys"):
        import_file(store, tmp_path / "k.npz")
    _untouched(store)


def test_npz_refuses_pickle_and_lying_headers(store, tmp_path):
    keys = np.array([b"a", b"b"], dtype=object)
    np.savez(tmp_path / "obj.npz", keys=keys, vectors=np.ones((2, 3), np.float32))
    with pytest.raises(CorruptFileError, match="pickle"):
        import_file(store, tmp_path / "obj.npz")
    # a .npy header declaring 10**12 rows over a few bytes of data
    hdr = "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000, 3), }"
    hdr = hdr.ljust(118) + "\n"
    with zipfile.ZipFile(tmp_path / "big.npz", "w") as z:
        z.writestr("vectors.npy", b"\x93NUMPY\x01\x00" + struct.pack("<H", len(hdr))
                   + hdr.encode() + b"\0" * 24)
        z.writestr("keys.npy", b"")
    with pytest.raises(CorruptFileError, match="truncated or hostile"):
        import_file(store, tmp_path / "big.npz")
    (tmp_path / "not.npz").write_bytes(b"PK\x03\x04garbage")
    with pytest.raises(CorruptFileError):
        import_file(store, tmp_path / "not.npz")
    _untouched(store)


def test_npz_written_by_embstore_has_no_object_arrays(tmp_path):
    src = _filled("memory://", "bytes")
    export_file(src, tmp_path / "o.npz")
    with np.load(tmp_path / "o.npz", allow_pickle=False) as z:
        assert sorted(z.files) == ["key_blob", "key_offsets", "vectors"]
        assert z["vectors"].dtype == np.float32 and z["key_offsets"].dtype == np.int64
    # also keys from plain numpy savez (positional arrays, unicode keys) import
    np.savez(tmp_path / "plain.npz", np.array(["x", "ÿ"]), np.ones((2, DIM), np.float64))
    dst = embstore.open("memory://", dim=DIM, key_type="bytes")
    import_file(dst, tmp_path / "plain.npz")
    assert dst.contains([b"x", "ÿ".encode()]).all()


def test_native_damage_imports_nothing(tmp_path):
    src = _filled("memory://", "int64", n=300)
    p = tmp_path / "t.emb"
    export_file(src, p, batch_size=100)
    dst = _filled("memory://", "int64", n=5)
    before = _records_by_key(dst)
    raw = bytearray(p.read_bytes())
    raw[len(raw) * 2 // 3] ^= 0xFF
    (tmp_path / "bad.emb").write_bytes(bytes(raw))
    with pytest.raises(CorruptFileError, match="checksum"):
        import_file(dst, tmp_path / "bad.emb", skip_bad=True)
    (tmp_path / "cut.emb").write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(CorruptFileError):
        import_file(dst, tmp_path / "cut.emb")
    assert _records_by_key(dst) == before
    rep = verify_file(p)
    assert rep.ok and rep.rows == 300


def test_parquet_nulls_are_bad_rows_and_garbage_is_refused(store, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pa.table({"word": ["a", None, "c", "d"],
                  "embedding": [[1.0, 2, 3], [1.0, 2, 3], None, [1.0, 2, 3, 4]]})
    pq.write_table(t, tmp_path / "x.parquet")
    with pytest.raises(CorruptFileError, match="row 2: null key"):
        import_file(store, tmp_path / "x.parquet")
    rep = import_file(store, tmp_path / "x.parquet", skip_bad=True)
    assert (rep.rows, rep.skipped) == (1, 3)
    (tmp_path / "g.parquet").write_bytes(b"PAR1" + b"\0" * 50)
    with pytest.raises(CorruptFileError, match="Parquet"):
        import_file(store, tmp_path / "g.parquet")


def test_vector_import_keeps_optimizer_state_of_existing_keys(tmp_path):
    src = embstore.open("memory://", dim=DIM, key_type="int64")  # sgd: another layout
    src.assign(np.arange(10), np.ones((10, DIM), np.float32))
    export_file(src, tmp_path / "s.parquet")
    dst = embstore.open("memory://", dim=DIM, optimizer="adagrad")
    dst.update(np.arange(5), np.ones((5, DIM), np.float32))
    before, _ = dst.get_records(np.arange(5))
    rep = import_file(dst, tmp_path / "s.parquet")
    assert rep.mode == "vectors"
    after, found = dst.get_records(np.arange(10))
    assert found.all() and (after["vector"] == 1).all()
    assert (after["accum"][:5] == before["accum"]).all() and (after["accum"][5:] == 0).all()


def test_unwritable_keys_leave_no_file(tmp_path):
    s = embstore.open("memory://", dim=2, key_type="bytes")
    s.assign([b"ok", b"has space"], np.ones((2, 2), np.float32))
    with pytest.raises(InvalidInputError, match="cannot be written in word2vec"):
        export_file(s, tmp_path / "x.txt")
    assert os.listdir(tmp_path) == []


def test_detection_and_chunk_bounds(tmp_path):
    src = _filled("memory://", "int64", n=200)
    for fmt, name in FORMATS.items():
        p = tmp_path / name
        export_file(src, p, fmt=fmt)
        assert detect_format(p) == fmt
        with open_reader(p) as r:
            sizes = [len(c.keys) for c in r.chunks(batch_size=64)]
        assert sum(sizes) == 200
        if fmt != "native":  # native chunks are the writer's
            assert max(sizes) <= 64
    with pytest.raises(InvalidInputError, match="--format"):
        detect_format(tmp_path / "x.unknown", for_write=True)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_large_files_are_read_twice_in_constant_memory(fmt, tmp_path):
    # cache_bytes=0: the writing pass re-reads (and re-checks) the file instead of keeping rows
    src = _filled("memory://", "bytes" if fmt != "tsv" else "int64", n=300)
    path = tmp_path / FORMATS[fmt]
    export_file(src, path, fmt=fmt)
    dst = embstore.open("memory://", dim=DIM, key_type=src.key_type, optimizer="adagrad")
    rep = import_file(dst, path, cache_bytes=0, batch_size=64)
    assert rep.rows == 300 and _vectors_by_key(dst) == _vectors_by_key(src)
    if fmt in RECORD_FORMATS:
        assert _records_by_key(dst) == _records_by_key(src)


def test_skip_bad_without_cache(store, tmp_path):
    p = tmp_path / "v.txt"
    p.write_bytes(_w2v_text([("a", [1, 2, 3]), ("b", ["nan", 2, 3]), ("c", [3, 2, 1])]))
    rep = import_file(store, p, skip_bad=True, cache_bytes=0)
    assert (rep.rows, rep.skipped) == (2, 1)
    assert store.contains([b"a", b"b", b"c"]).tolist() == [True, False, True]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_empty_tables_round_trip(fmt, tmp_path):
    src = embstore.open("memory://", dim=DIM, key_type="bytes")
    path = tmp_path / FORMATS[fmt]
    assert export_file(src, path, fmt=fmt) == 0
    dst = embstore.open("memory://", dim=DIM, key_type="bytes")
    assert import_file(dst, path, fmt=fmt).rows == 0 and len(dst) == 0
    assert verify_file(path, fmt=fmt).ok


@pytest.mark.parametrize("backend", ["sqlite", "postgres", "bigtable"])
def test_cli_copy_into_lmdb_for_serving(backend, new_url, tmp_path):
    from embstore.cli import main

    src = _filled(new_url(backend), "int64")
    want = _records_by_key(src)
    url = src.url
    src.close()
    dst = f"lmdb://{tmp_path}/serve"
    assert main(["copy", url, dst, "-q"]) == 0
    with embstore.open(dst, read_only=True) as s:
        assert s.optimizer.name == "adagrad" and _records_by_key(s) == want


def test_native_nan_rows_are_refused_or_skipped(tmp_path):
    from embstore.io.native import NativeWriter

    s = embstore.open("memory://", dim=3)
    recs = s.layout.empty(4)
    recs["vector"] = [[1, 2, 3], [np.nan, 0, 0], [4, 5, 6], [0, np.inf, 0]]
    with NativeWriter(tmp_path / "n.emb", s.meta) as w:
        w.write(np.arange(4, dtype=np.int64), recs)
    with pytest.raises(CorruptFileError, match="row 2: NaN"):
        import_file(s, tmp_path / "n.emb")
    assert len(s) == 0
    rep = import_file(s, tmp_path / "n.emb", skip_bad=True)
    assert (rep.rows, rep.skipped, rep.mode) == (2, 2, "records")
    assert s.contains(np.arange(4)).tolist() == [True, False, True, False]


def test_background_native_writer_surfaces_write_errors(tmp_path):
    import io

    from embstore.io.native import NativeReader, NativeWriter

    class Full(io.BytesIO):
        def write(self, b):
            if self.tell() > 1000:
                raise OSError(28, "No space left on device")
            return super().write(b)

    s = embstore.open("memory://", dim=4)
    recs = s.layout.empty(100)
    with pytest.raises(OSError, match="No space"):
        with NativeWriter(Full(), s.meta, background=True) as w:
            for i in range(5):
                w.write(np.arange(i * 100, i * 100 + 100, dtype=np.int64), recs)
    # a background export to a path is complete and readable after close
    with NativeWriter(tmp_path / "ok.emb", s.meta, background=True) as w:
        for i in range(5):
            w.write(np.arange(i * 100, i * 100 + 100, dtype=np.int64), recs)
    with NativeReader(tmp_path / "ok.emb") as r:
        assert r.verify() == 500
    assert os.listdir(tmp_path) == ["ok.emb"]


def test_native_reader_reads_ahead_yet_fails_where_damage_starts(tmp_path):
    from embstore.io.native import NativeReader

    src = _filled("memory://", "int64", n=500)
    p = tmp_path / "t.emb"
    export_file(src, p, batch_size=100)  # 5 chunks
    want = _records_by_key(src)
    # every chunk decodes right, also through the two alternating buffers of iter_transient
    for transient in (False, True):
        got = {}
        with NativeReader(p) as r:
            for keys, recs in (r.iter_transient() if transient else r):
                got.update(zip(keys.tolist(), [x.tobytes() for x in recs]))
        assert got.keys() == want.keys()
        assert all(got[k] == want[k] for k in want)
    # damage in chunk 4: chunks 1-3 come out, then the error (the read-ahead hides nothing)
    raw = bytearray(p.read_bytes())
    raw[len(raw) * 7 // 10] ^= 0xFF
    (tmp_path / "bad.emb").write_bytes(bytes(raw))
    seen = 0
    with NativeReader(tmp_path / "bad.emb") as r:
        with pytest.raises(CorruptFileError, match="checksum mismatch in chunk at row"):
            for keys, _ in r:
                seen += len(keys)
    assert seen in (200, 300)
    # leaving early stops the read-ahead; the reader can start over
    with NativeReader(p) as r:
        for _ in r:
            break
        assert r.verify() == 500


def test_prefetch_keeps_order_errors_and_stops_early():
    import threading

    from embstore.io.base import prefetch

    assert list(prefetch(iter(range(100)), depth=2)) == list(range(100))

    def failing():
        yield 1
        yield 2
        raise ValueError("broken source")

    got = []
    with pytest.raises(ValueError, match="broken source"):
        for x in prefetch(failing()):
            got.append(x)
    assert got == [1, 2]

    closed = threading.Event()

    def endless():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()

    it = prefetch(endless(), depth=1)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    it.close()  # stops the producer thread and closes the source in it
    assert closed.is_set()


@pytest.mark.parametrize("key_type", ["int64", "bytes"])
def test_copy_in_several_loads_equals_one(key_type, tmp_path, monkeypatch):
    from embstore.transfer import pipeline as transfer

    src = _filled("memory://", key_type, n=500)
    want = _records_by_key(src)
    # tiny groups: the copy is made of many load_records calls, the source read in a thread
    monkeypatch.setattr(transfer, "COPY_GROUP_BYTES", 1000)
    with embstore.open(f"lmdb://{tmp_path}/dst", dim=DIM, key_type=key_type,
                       optimizer="adagrad") as dst:
        assert transfer.copy_store(src, dst, batch_size=64) == 500
        assert _records_by_key(dst) == want
        assert dst.step == src.step
    # a store that evicts gets the rows in one load (eviction runs once, on the whole copy)
    assert not transfer._regroupable(embstore.open("memory://", dim=DIM, capacity=100))


def test_native_reader_restarted_while_an_iteration_is_suspended(tmp_path):
    from embstore.io.native import NativeReader

    src = _filled("memory://", "int64", n=500)
    p = tmp_path / "t.emb"
    export_file(src, p, batch_size=50)
    with NativeReader(p) as r:
        first = iter(r)
        next(first)  # suspended with a read-ahead in flight
        assert r.verify() == 500  # a new pass is not disturbed by the old one's read-ahead
        assert sum(len(k) for k, _ in r) == 500
