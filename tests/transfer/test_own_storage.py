"""Exports and copies never write into the source's own storage (they used to destroy it)."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.cli import main
from embstore.errors import InvalidInputError
from embstore.transfer import copy_store, export_file

KEYS = np.arange(200, dtype=np.int64)


def _fill(url: str) -> np.ndarray:
    with embstore.open(url, dim=4) as s:
        s.assign(KEYS, np.arange(800, dtype=np.float32).reshape(200, 4))
        return s.lookup(KEYS, insert=False)


def _intact(url: str, want: np.ndarray) -> None:
    with embstore.open(url, read_only=True) as s:
        assert len(s) == len(KEYS)
        np.testing.assert_array_equal(s.lookup(KEYS, insert=False), want)


@pytest.fixture(params=["lmdb", "rocksdb", "sqlite"])
def local(request, tmp_path):
    """(url, paths inside its storage) for each local backend."""
    if request.param == "sqlite":
        db = tmp_path / "t.db"
        return f"sqlite:///{db}", [db, tmp_path / "t.db-wal"]
    d = tmp_path / "d"
    inner = d / ("data.mdb" if request.param == "lmdb" else "CURRENT")
    return f"{request.param}://{d}", [inner, d / "new.emb", d]


@pytest.mark.parametrize("fmt", ["native", "npz", "tsv"])
def test_export_into_own_storage_is_refused(local, fmt):
    url, inside = local
    want = _fill(url)
    with embstore.open(url) as s:
        for dest in inside:
            with pytest.raises(InvalidInputError, match="inside the storage"):
                s.export(dest, format=fmt)
            with pytest.raises(InvalidInputError, match="inside the storage"):
                export_file(s, dest, fmt=fmt)
    _intact(url, want)


def test_cli_export_onto_data_file_is_refused_and_store_kept(tmp_path, capsys):
    d = tmp_path / "d"
    want = _fill(f"lmdb://{d}")
    assert main(["export", f"lmdb://{d}", str(d / "data.mdb"), "--format", "native", "-q"]) == 1
    assert "inside the storage" in capsys.readouterr().err
    _intact(f"lmdb://{d}", want)
    # a path outside the store is fine, also through a symlink to a directory elsewhere
    (tmp_path / "out").mkdir()
    assert main(["export", f"lmdb://{d}", str(tmp_path / "out" / "t.emb"), "-q"]) == 0
    (tmp_path / "alias").symlink_to(d)
    assert main(["export", f"lmdb://{d}", str(tmp_path / "alias" / "x.emb"), "-q"]) == 1
    _intact(f"lmdb://{d}", want)


def test_export_into_a_shard_or_cache_storage_is_refused(tmp_path):
    shards = [f"lmdb://{tmp_path}/s{i}" for i in range(2)]
    with embstore.open("sharded://", shards=shards, dim=4) as s:
        s.assign(KEYS, np.ones((200, 4), np.float32))
        with pytest.raises(InvalidInputError, match="inside the storage"):
            s.export(tmp_path / "s1" / "data.mdb")
    with embstore.open(f"lmdb://{tmp_path}/remote", dim=4, cache="memory://") as s:
        s.assign(KEYS, np.ones((200, 4), np.float32))
        with pytest.raises(InvalidInputError, match="inside the storage"):
            s.export(tmp_path / "remote" / "data.mdb")


def test_cli_copy_to_memory_is_refused(tmp_path, capsys):
    url = f"lmdb://{tmp_path}/d"
    _fill(url)
    assert main(["copy", url, "memory://", "-q"]) == 1
    assert "thrown away" in capsys.readouterr().err
    assert main(["copy", url, "memory://", "--shards", "2", "-q"]) == 1


def test_copy_onto_itself_is_refused(local, capsys):
    url, _ = local
    want = _fill(url)
    assert main(["copy", url, url, "-q"]) == 1
    assert "onto itself" in capsys.readouterr().err
    with embstore.open(url) as s:
        with pytest.raises(InvalidInputError, match="onto itself"):
            copy_store(s, s)
    _intact(url, want)


def test_copy_onto_same_storage_through_another_url_is_refused(tmp_path, capsys):
    d = tmp_path / "d"
    want = _fill(f"lmdb://{d}")
    (tmp_path / "alias").symlink_to(d)
    assert main(["copy", f"lmdb://{d}", f"lmdb://{tmp_path}/alias", "-q"]) == 1
    assert "onto itself" in capsys.readouterr().err
    _intact(f"lmdb://{d}", want)
    # a real second store is still a copy
    assert main(["copy", f"lmdb://{d}", f"lmdb://{tmp_path}/e", "-q"]) == 0
    _intact(f"lmdb://{tmp_path}/e", want)


@pytest.mark.parametrize("inline", [True, False])
def test_torch_checkpoint_save_onto_the_stores_own_files_is_refused(local, inline):
    # The .pt file is installed by rename: onto <lmdb>/data.mdb, <rocksdb>/CURRENT or the
    # SQLite file it replaced the store with the checkpoint (issue 34, item 4).
    pytest.importorskip("torch")
    import embstore_torch.checkpoint as ckpt
    from embstore_torch import DynamicEmbedding

    url, inside = local
    want = _fill(url)
    with embstore.open(url) as s:
        model = DynamicEmbedding(s)
        if not inline:
            model.checkpoint_rows = False  # a reference: the rows go to <path>.rows/
        for dest in inside:
            with pytest.raises(InvalidInputError, match="inside the storage"):
                ckpt.save(model, dest)
    _intact(url, want)
