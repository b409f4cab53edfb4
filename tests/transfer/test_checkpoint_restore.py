"""Restores that never lose a row: the torch modules' ``load_state_dict`` on every backend
(``store.import_(..., replace=True)`` itself is
:class:`~embstore.testing.conformance_restore.RestoreConformance`, run per backend by
``tests/backends/test_restore_concurrent.py``), and a hostile-snapshot corpus (generated
here) that must be refused in one line with the store untouched and memory bounded."""

from __future__ import annotations

import io
import os
import struct
import tracemalloc

import numpy as np
import pytest

import embstore
from embstore.errors import (
    CorruptFileError,
    EmbstoreError,
    InvalidInputError,
    SchemaMismatchError,
)
from embstore.io.native import NativeWriter
from embstore.testing.conformance import table_of
from tests import hostile as h


def _keys(kind: str, lo: int, hi: int):
    return (np.arange(lo, hi, dtype=np.int64) if kind == "int64"
            else [f"key-{i}".encode() for i in range(lo, hi)])


def _table(store) -> dict:
    """Every record of ``store`` as {key: record bytes}."""
    return {k: r.tobytes() for k, r in table_of(store).items()}


def _filled(url: str, key_type: str = "int64", n: int = 60, **opts):
    s = embstore.open(url, dim=4, key_type=key_type, optimizer="adagrad", **opts)
    keys = _keys(key_type, 0, n)
    s.lookup(keys)
    s.update(keys, np.ones((n, 4), np.float32))
    return s


def _snapshot(store) -> bytes:
    buf = io.BytesIO()
    store.export(buf)
    return buf.getvalue()


def test_a_key_the_backend_cannot_hold_refuses_the_snapshot_and_keeps_every_row(tmp_path):
    from embstore_torch import DynamicEmbedding

    with embstore.open("memory://", dim=4, key_type="bytes") as src:
        src.lookup([b"x" * 600, b"short"])
        sd = DynamicEmbedding(src).state_dict()
    dst = embstore.open(f"lmdb://{tmp_path}/l", dim=4, key_type="bytes")
    dst.lookup(_keys("bytes", 0, 1000))
    want = _table(dst)
    with pytest.raises(InvalidInputError, match="600 bytes.*510"):
        DynamicEmbedding(dst).load_state_dict(sd)
    assert _table(dst) == want and len(dst) == 1000
    dst.close()


# -- a hostile-snapshot corpus ---------------------------------------------------------------------
def _with_header(src, **header) -> bytes:
    keys, recs = zip(*src.records(1 << 16))
    buf = io.BytesIO()
    with NativeWriter(buf, {**src.meta, "since": None, **header}) as w:
        w.write(np.concatenate(keys), np.concatenate(recs))
    return buf.getvalue()


def _with_field(src, field: str, value) -> bytes:
    keys, recs = zip(*src.records(1 << 16))
    recs = np.concatenate(recs).copy()
    recs[field][3] = value
    buf = io.BytesIO()
    with NativeWriter(buf, {**src.meta, "since": None}) as w:
        w.write(np.concatenate(keys), recs)
    return buf.getvalue()


def _huge_chunk(blob: bytes) -> bytes:
    at = blob.index(b"CHNK")
    return blob[:at] + struct.pack("<4sIQI", b"CHNK", 2**32 - 1, 2**62, 0) + blob[at + 20:]


def _corpus(tmp_path, good: dict) -> list[tuple[str, object, type]]:
    """(name, hostile state, expected error class)."""
    with embstore.open("memory://", dim=4, optimizer="adagrad") as src:
        src.lookup(np.arange(20))
        src.update(np.arange(20), np.ones((20, 4), np.float32))
        rows = _snapshot(src)
        export_path = tmp_path / "elsewhere.emb"
        src.export(str(export_path))
        header_cases = {
            "header step 10**30": _with_header(src, step=10**30),
            "header step -1": _with_header(src, step=-1),
            "header version 2**63": _with_header(src, version=2**63),
            "header seed str": _with_header(src, seed="x"),
            "a delta export": _with_header(src, since=1),
            "record count -1": _with_field(src, "count", -1),
            "record last_step 2**63-1": _with_field(src, "last_step", 2**63 - 1),
            "record version -5": _with_field(src, "version", -5),
            "NaN vector": _with_field(src, "vector", np.nan),
        }
    with embstore.open("memory://", dim=8, optimizer="adagrad") as wide:
        wide.lookup(np.arange(5))
        wide_rows = _snapshot(wide)
    with embstore.open("memory://", dim=4) as plain:
        plain.lookup(np.arange(5))
        sgd_rows = _snapshot(plain)
    with embstore.open("memory://", dim=4, key_type="bytes", optimizer="adagrad") as b:
        b.lookup([b"a", b"b"])
        bytes_rows = _snapshot(b)
    raw = h.native_raw_header
    deep = raw(tmp_path / "deep", h.deep_json()).read_bytes()
    zero_dim = h.native_zero_dim(tmp_path / "zero").read_bytes()
    bomb = h.native_admission_bomb(tmp_path / "bomb", decoded=1 << 28).read_bytes()
    huge_header = rows[:8] + struct.pack("<II", 1, 2**32 - 1) + rows[16:]

    def state(**kw):
        return {**good, **kw}

    C, S = CorruptFileError, SchemaMismatchError
    cases: list[tuple[str, object, type]] = [
        ("a list", [1, 2], C), ("a str", "/etc/passwd", C), ("None", None, C),
        ("unknown field with a path", state(path=str(export_path)), C),
        ("unknown field with a URL", state(store="lmdb:///tmp/elsewhere"), C),
        ("missing rows", {k: v for k, v in good.items() if k != "rows"}, C),
        ("rows as a path", state(rows=str(export_path)), C),
        ("rows as a URL", state(rows="file:///etc/passwd"), C),
        ("rows as an int", state(rows=5), C), ("rows as a dict", state(rows={"a": 1}), C),
        ("rows as a list", state(rows=[rows]), C),
        ("step 10**30", state(step=10**30), C), ("step -1", state(step=-1), C),
        ("step True", state(step=True), C), ("step str", state(step="5"), C),
        ("step float", state(step=1.5), C),
        ("dim 10**12", state(dim=10**12), C), ("dim 0", state(dim=0), C),
        ("dim str", state(dim="4"), C), ("key_type path", state(key_type="../../x"), C),
        ("format other", state(format="pickle"), C), ("format int", state(format=1), C),
        ("url an object", state(url=["lmdb:///x"]), C),
        ("dim of another store", state(dim=8), S),
        ("rows of dim 8", state(rows=wide_rows), S),
        ("rows of another optimizer", state(rows=sgd_rows), S),
        ("rows with bytes keys", state(rows=bytes_rows), S),
        ("empty rows", state(rows=b""), C), ("rows a huge header size", state(rows=huge_header), C),
        ("rows a huge chunk", state(rows=_huge_chunk(rows)), C),
        ("rows a deep JSON header", state(rows=deep), C),
        ("rows of dim 0", state(rows=zero_dim), C),
        ("rows an admission-state bomb", state(rows=bomb), C),
        ("rows garbage", state(rows=bytes(range(256)) * 64), C),
    ]
    cases += [(f"rows {k}", state(rows=v), C) for k, v in header_cases.items()]
    for cut in (1, 8, 16, 40, len(rows) // 2, len(rows) - 20, len(rows) - 1):
        cases.append((f"rows truncated at {cut}", state(rows=rows[:cut]), C))
    flipped = bytearray(rows)
    flipped[len(rows) // 2] ^= 0xFF
    cases.append(("rows with a flipped byte", state(rows=bytes(flipped)), C))
    return cases


@pytest.mark.parametrize("kind", ["memory", "lmdb"])
def test_hostile_snapshots_are_refused_in_one_line_and_change_nothing(new_store_url, tmp_path,
                                                                     kind):
    from embstore.policies import FrequencyCutoff
    from embstore_torch import DynamicEmbedding

    # the admission policy of the bomb's header: its state is decoded (and must be bounded)
    store = _filled(new_store_url(kind), n=40, admission=FrequencyCutoff(3, width=1 << 10,
                                                                         depth=2))
    module = DynamicEmbedding(store)
    good = module.state_dict()["_extra_state"]
    want, step = _table(store), store.step
    cases = _corpus(tmp_path, good)
    assert len(cases) >= 40
    tracemalloc.start()
    try:
        for name, bad, kind_of_error in cases:
            with pytest.raises(EmbstoreError) as err:
                module.load_state_dict({"_extra_state": bad})
            msg = str(err.value)
            assert isinstance(err.value, kind_of_error), (name, type(err.value), msg)
            assert "\n" not in msg and len(msg) < 400, (name, msg)
            assert _table(store) == want and store.step == step, name
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 96 << 20, f"a hostile snapshot took {peak >> 20} MiB"
    # and the good one still loads afterwards
    module.load_state_dict({"_extra_state": good})
    assert _table(store) == want
    store.close()


def test_a_snapshot_step_out_of_range_is_never_saved_and_the_store_keeps_working(tmp_path):
    url = f"lmdb://{tmp_path}/s"
    s = _filled(url)
    with embstore.open("memory://", dim=4, optimizer="adagrad") as src:
        src.lookup(np.arange(3))
        bad = _with_header(src, step=10**30)
    with pytest.raises(CorruptFileError, match="step"):
        s.import_(bad, replace=True)
    s.update(np.arange(3), np.ones((3, 4), np.float32))  # no OverflowError
    s.close()
    with embstore.open(url) as again:
        again.update(np.arange(3), np.ones((3, 4), np.float32))
        assert again.step == 3


def test_replace_refuses_options_it_cannot_honour():
    with embstore.open("memory://", dim=4) as s:
        with pytest.raises(InvalidInputError, match="replace=True"):
            s.import_(b"", replace=True, partial=True)


def test_what_a_killed_rocksdb_restore_leaves_is_recovered_on_open(tmp_path):
    from embstore.backends._replace import make_staging

    path = str(tmp_path / "r")
    url = f"rocksdb://{path}"
    s = _filled(url)
    want = _table(s)
    s.close()
    # killed while building the new table: a half-built staging directory beside the store
    stage, _ = make_staging(path)
    os.makedirs(os.path.join(stage, "new", "junk"))
    with embstore.open(url) as s:
        assert _table(s) == want
    assert not os.path.exists(stage)
    # killed between the renames of the fallback exchange: the live directory is parked
    stage, _ = make_staging(path)
    os.rename(path, os.path.join(stage, "old"))
    with embstore.open(url) as s:
        assert _table(s) == want
    assert not os.path.exists(stage)
    # killed right after mkdtemp, before the marker: an empty directory, nothing to lose
    empty = tmp_path / ".r.restore-xyz"
    empty.mkdir()
    with embstore.open(url) as s:
        assert _table(s) == want
    assert not empty.exists()
