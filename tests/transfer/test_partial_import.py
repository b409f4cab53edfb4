"""``import_(..., partial=True)`` keeps the rows before the damage on every backend.

Before: memory:// and SQLite kept the chunks read before a damaged one, LMDB and RocksDB kept
nothing (their bulk load writes only at the end of the whole stream).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import embstore
from embstore.errors import CorruptFileError
from embstore.io.native import NativeWriter

DIM = 4
CHUNK = 1000
ROWS = 5 * CHUNK


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """A native file of 5 chunks whose last chunk is cut short."""
    d = tmp_path_factory.mktemp("partial")
    src = embstore.open("memory://", dim=DIM, optimizer="adagrad")
    keys = np.arange(ROWS, dtype=np.int64)
    src.assign(keys, np.ones((ROWS, DIM), np.float32))
    path = d / "t.emb"
    with NativeWriter(path, src.meta) as w:
        for batch_keys, batch_recs in src.records(CHUNK):
            w.write(batch_keys, batch_recs)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - size // 10)   # inside the last chunk
    return path


@pytest.mark.parametrize("scheme", ["memory", "sqlite", "lmdb", "rocksdb"])
def test_partial_import_keeps_the_chunks_before_the_damage(tmp_path, damaged, scheme):
    url = {"memory": "memory://", "sqlite": f"sqlite:///{tmp_path}/x.db",
           "lmdb": f"lmdb://{tmp_path}/l", "rocksdb": f"rocksdb://{tmp_path}/r"}[scheme]
    with embstore.open(url, dim=DIM, optimizer="adagrad") as s:
        with pytest.raises(CorruptFileError):
            s.import_(damaged, partial=True)
        kept = len(s)
        assert kept >= 4 * CHUNK - CHUNK and kept < ROWS, kept   # everything before the cut
        keys = np.concatenate([k for k, _ in s.items()])
        np.testing.assert_array_equal(s.lookup(keys, insert=False), np.ones((kept, DIM)))
    with embstore.open("memory://", dim=DIM, optimizer="adagrad") as ref:
        with pytest.raises(CorruptFileError):
            ref.import_(damaged, partial=True)
        assert kept == len(ref)      # the same rows as the in-memory store keeps


@pytest.mark.parametrize("scheme", ["lmdb", "rocksdb"])
def test_without_partial_nothing_is_imported(tmp_path, damaged, scheme):
    with embstore.open(f"{scheme}://{tmp_path}/s", dim=DIM, optimizer="adagrad") as s:
        with pytest.raises(CorruptFileError):
            s.import_(damaged)
        assert len(s) == 0
