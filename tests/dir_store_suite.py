"""Checks every directory-based store (``lmdb://``, ``rocksdb://``) runs against a real
directory. A test module subclasses :class:`DirectoryStoreSuite`, names its scheme, says how to
make a foreign database of its engine and which URLs are malformed for it."""

from __future__ import annotations

import hashlib
import itertools
import os

import numpy as np
import pytest

import embstore
from embstore.errors import BackendError, InvalidURLError, SchemaMismatchError
from embstore.testing.conformance import rows_equal, table_of

DIM = 8


def snapshot(path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Content hashes of every file below ``path`` except those named in ``skip``."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            if f in skip:
                continue
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


class DirectoryStoreSuite:
    scheme: str = ""
    #: files the engine may touch even for a refused open (LMDB registers readers in its lock)
    volatile_files: tuple[str, ...] = ()
    #: the longest bytes key the round-trip test stores
    long_key: int = 400

    @pytest.fixture
    def malformed_url(self):  # pragma: no cover - subclasses provide it
        raise NotImplementedError("subclasses define a parametrized malformed_url fixture")

    def make_foreign(self, path: str) -> None:  # pragma: no cover - subclasses provide it
        """Create a database of the backend's engine at ``path`` that embstore did not write."""
        raise NotImplementedError

    @pytest.fixture
    def dir_url(self, tmp_path):
        counter = itertools.count()
        return lambda: f"{self.scheme}://{tmp_path}/s{next(counter)}"

    def snapshot(self, path) -> dict[str, str]:
        return snapshot(path, self.volatile_files)

    def test_int_keys_scan_in_numeric_order(self, dir_url):
        with embstore.open(dir_url(), dim=DIM) as s:
            keys = np.array([5, -1, 2**63 - 1, -(2**63), 0, 77, -78], dtype=np.int64)
            s.lookup(keys)
            scanned = np.concatenate([k for k, _ in s.items(batch_size=3)])
            assert scanned.tolist() == sorted(keys.tolist())

    def test_reopen_exact_bytes_keys_and_meta(self, dir_url):
        url = dir_url()
        s = embstore.open(url, dim=DIM, key_type="bytes", optimizer="adagrad", seed=3)
        keys = [b"", b"\x00", b"a", "\u00e9t\u00e9", b"z" * self.long_key]
        s.lookup(keys)
        s.update(keys[:3], np.ones((3, DIM)))
        before, step, version = table_of(s), s.step, s.version
        s.close()
        s2 = embstore.open(url)
        assert (s2.key_type, s2.step, s2.version, s2.seed) == ("bytes", step, version, 3)
        assert s2.layout == s.layout
        after = table_of(s2)
        assert after.keys() == before.keys()
        assert all(rows_equal(after[k], before[k]) for k in before)
        s2.close()

    def test_other_layout_directory_is_refused_and_untouched(self, dir_url):
        url = dir_url()
        with embstore.open(url, dim=DIM) as s:
            s.lookup(np.arange(50))
        path = url[len(f"{self.scheme}://"):]
        before = self.snapshot(path)
        for kw in ({"dim": DIM * 2}, {"key_type": "bytes"}, {"optimizer": "adagrad"}):
            with pytest.raises(SchemaMismatchError):
                embstore.open(url, **kw)
        assert self.snapshot(path) == before

    def test_foreign_database_and_foreign_directory_are_refused(self, tmp_path):
        foreign = tmp_path / "foreign"
        self.make_foreign(str(foreign))
        before = self.snapshot(foreign)
        with pytest.raises(SchemaMismatchError, match="not an embstore store"):
            embstore.open(f"{self.scheme}://{foreign}", dim=DIM)
        assert self.snapshot(foreign) == before
        other = tmp_path / "other"
        other.mkdir()
        (other / "notes.txt").write_text("hello")
        with pytest.raises(BackendError, match="not empty"):
            embstore.open(f"{self.scheme}://{other}", dim=DIM)
        assert os.listdir(other) == ["notes.txt"]

    def test_unwritable_directory(self, tmp_path):
        blocker = tmp_path / "file"
        blocker.write_text("x")
        for url in (f"{self.scheme}://{blocker}", f"{self.scheme}://{blocker}/store"):
            with pytest.raises(BackendError):
                embstore.open(url, dim=DIM)
        assert blocker.read_text() == "x" and os.listdir(tmp_path) == ["file"]

    def test_malformed_urls(self, malformed_url, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        with pytest.raises(InvalidURLError):
            embstore.open(malformed_url, dim=DIM)
        assert os.listdir(tmp_path) == []
        assert not os.path.exists("/tmp/x")
