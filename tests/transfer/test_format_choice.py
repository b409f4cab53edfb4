"""store.export / store.import_ pick the format from the file name (and content) like the CLI."""

from __future__ import annotations

import io

import numpy as np
import pytest

import embstore
from embstore.errors import InvalidInputError

DIM = 4


@pytest.fixture
def store():
    s = embstore.open("memory://", dim=DIM, seed=3)
    s.lookup(np.arange(50))
    yield s
    s.close()


def _head(path, n=8):
    with open(path, "rb") as f:
        return f.read(n)


@pytest.mark.parametrize("name,magic", [("x.parquet", b"PAR1"), ("x.pq", b"PAR1"),
                                        ("x.npz", b"PK\x03\x04"), ("x.emb", b"EMBSTNAT"),
                                        ("bare", b"EMBSTNAT")])
def test_export_format_follows_the_file_name(store, tmp_path, name, magic):
    path = tmp_path / name
    assert store.export(path) == 50
    assert _head(path, len(magic)) == magic
    with embstore.open("memory://", dim=DIM) as back:
        assert back.import_(path) == 50
        keys = np.arange(50)
        np.testing.assert_array_equal(back.lookup(keys, insert=False),
                                      store.lookup(keys, insert=False))


def test_npz_export_is_readable_by_numpy(store, tmp_path):
    store.export(tmp_path / "v.npz")
    with np.load(tmp_path / "v.npz") as z:
        order = np.argsort(z["keys"])
        np.testing.assert_array_equal(z["keys"][order], np.arange(50))
        np.testing.assert_array_equal(z["vectors"][order], store.lookup(np.arange(50)))


def test_tsv_export(store, tmp_path):
    assert store.export(tmp_path / "v.tsv") == 50
    rows = (tmp_path / "v.tsv").read_text().splitlines()
    assert sum(1 for r in rows if r.strip()) >= 50


def test_unknown_suffix_is_refused_and_nothing_written(store, tmp_path):
    with pytest.raises(InvalidInputError, match=r"'\.csv'.*format="):
        store.export(tmp_path / "x.csv")
    assert list(tmp_path.iterdir()) == []


def test_explicit_format_overrides_the_name(store, tmp_path):
    path = tmp_path / "looks.parquet"
    store.export(path, format="native")
    assert _head(path) == b"EMBSTNAT"
    with embstore.open("memory://", dim=DIM) as back:
        # content wins when reading, as in the CLI
        assert back.import_(path) == 50
    store.export(tmp_path / "odd.data", format="npz")
    assert _head(tmp_path / "odd.data", 4) == b"PK\x03\x04"
    with embstore.open("memory://", dim=DIM) as back:
        assert back.import_(tmp_path / "odd.data", format="npz") == 50


def test_file_objects_carry_native_only(store):
    buf = io.BytesIO()
    assert store.export(buf) == 50
    with pytest.raises(InvalidInputError, match="needs a path"):
        store.export(io.BytesIO(), format="parquet")
    with embstore.open("memory://", dim=DIM) as back:
        assert back.import_(buf.getvalue()) == 50


def test_parquet_from_embstore_keeps_whole_records(tmp_path):
    with embstore.open("memory://", dim=DIM, optimizer="adagrad") as s:
        s.update(np.arange(10), np.ones((10, DIM), np.float32))
        s.export(tmp_path / "r.parquet")
        want, _ = s.get_records(np.arange(10))
    with embstore.open("memory://", dim=DIM, optimizer="adagrad") as back:
        back.import_(tmp_path / "r.parquet")
        got, _ = back.get_records(np.arange(10))
    np.testing.assert_array_equal(got["vector"], want["vector"])
    for name in want.dtype.names:  # optimizer slots and metadata too
        np.testing.assert_array_equal(got[name], want[name])
