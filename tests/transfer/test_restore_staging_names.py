"""A restore cleans up only what it provably made (issue 34, item 2).

A user's store that carries a restore's staging name (Bigtable ``X__restore``, RocksDB
``.rk.restore``) used to be deleted by the next writer open of ``X`` / ``rk``. The staging
table or directory of a restore is now marked with the store it belongs to and the restore's
id before any row is written, and only marked ones are removed.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

import embstore
from embstore.errors import BackendError

KEYS = np.arange(100, dtype=np.int64)


def _fill(url: str, value: float, keys: np.ndarray = KEYS) -> None:
    with embstore.open(url, dim=4) as s:
        s.assign(keys, np.full((len(keys), 4), value, np.float32))


def _check(url: str, value: float, keys: np.ndarray = KEYS) -> None:
    with embstore.open(url, read_only=True) as s:
        assert len(s) == len(keys)
        np.testing.assert_array_equal(s.lookup(keys, insert=False),
                                      np.full((len(keys), 4), value, np.float32))


def _snapshot(n: int = 30) -> bytes:
    with embstore.open("memory://", dim=4) as m:
        m.assign(np.arange(n), np.full((n, 4), 9.0, np.float32))
        buf = io.BytesIO()
        m.export(buf)
        return buf.getvalue()


@pytest.mark.parametrize("name", [".rk.restore", ".rk.restore-old", ".rk.restore-0123abcd"])
def test_rocksdb_writer_open_and_restore_keep_a_users_store_with_a_staging_name(tmp_path, name):
    pytest.importorskip("rocksdict")
    user = f"rocksdb://{tmp_path}/{name}"
    _fill(user, 1.0)
    live = f"rocksdb://{tmp_path}/rk"
    _fill(live, 2.0, KEYS[:10])
    with embstore.open(live) as s:  # a writer open runs the staging cleanup
        assert s.import_(_snapshot(), replace=True) == 30
    with embstore.open(live) as s:
        assert len(s) == 30
    _check(user, 1.0)
    # the restore's own staging directory went; the user's directory stayed
    assert sorted(n for n in os.listdir(tmp_path) if "restore" in n) == [name]


def test_bigtable_writer_open_keeps_a_users_table_with_the_staging_name(bigtable_url_factory):
    pytest.importorskip("google.cloud.bigtable")
    live = bigtable_url_factory()
    user = live + "__restore"
    _fill(user, 1.0)  # 100 user rows in X__restore
    _fill(live, 2.0, KEYS[:10])
    with embstore.open(live) as s:  # the writer open: recovery must not drop X__restore
        assert len(s) == 10
        # a restore needs that name for its staging table: it refuses rather than drop it
        with pytest.raises(BackendError, match="not made by a restore"):
            s.import_(_snapshot(), replace=True)
        assert len(s) == 10
    _check(user, 1.0)
    _check(live, 2.0, KEYS[:10])


def test_bigtable_restore_drops_its_own_leftover_staging_table(bigtable_url_factory,
                                                               monkeypatch):
    pytest.importorskip("google.cloud.bigtable")
    from embstore.backends.bigtable import guard
    from embstore.backends.bigtable.restore import StagedRestore

    live = bigtable_url_factory()
    _fill(live, 2.0, KEYS[:10])

    def crash(self):
        raise RuntimeError("killed before the marker")

    with embstore.open(live) as s:
        monkeypatch.setattr(StagedRestore, "set_marker", crash)
        with pytest.raises(RuntimeError):
            s.import_(_snapshot(), replace=True)
        monkeypatch.undo()
        assert guard.staging_of(s.backend)  # marked with the restore's id
        assert s.import_(_snapshot(), replace=True) == 30  # the leftover is its own: dropped
        assert not s.backend.restore.staging_exists()
    with embstore.open(live) as s:
        assert len(s) == 30


@pytest.mark.parametrize("marker", [b"", b'{"restore_of": "rk", "rest'])
def test_a_staging_directory_killed_while_writing_its_marker_is_removed(tmp_path, marker):
    # a restore killed between creating its marker file and writing it leaves a directory
    # holding only that file, cut short: the next writer open removes it; a directory with
    # anything else beside such a file is left alone
    pytest.importorskip("rocksdict")
    from embstore.backends._replace import MARKER_FILE

    live = f"rocksdb://{tmp_path}/rk"
    _fill(live, 2.0, KEYS[:10])
    half = tmp_path / ".rk.restore-half1234"
    half.mkdir()
    (half / MARKER_FILE).write_bytes(marker)
    kept = tmp_path / ".rk.restore-kept5678"
    kept.mkdir()
    (kept / MARKER_FILE).write_bytes(marker)
    (kept / "data").write_bytes(b"a user's file")
    with embstore.open(live) as s:  # a writer open runs the staging cleanup
        assert len(s) == 10
    assert not half.exists()
    assert (kept / "data").read_bytes() == b"a user's file"
