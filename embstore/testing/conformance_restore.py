"""Opt-in conformance tests of restores (``import_(..., replace=True)``): the store then holds
exactly the snapshot, a restore failing part way keeps the old table (where the backend
declares an atomic ``replace_mechanism``), and scans and exports that overlap a restore read the
old or the new table or fail with :class:`~embstore.errors.ConcurrentRestoreError` -- never a
mix of both (the harness is :mod:`embstore.testing.restore_concurrent`).

Subclass :class:`RestoreConformance` with a ``url_factory`` fixture (a callable returning a
fresh, empty store URL per call). ``restore_in_process`` and ``restore_across_processes`` say
which of the two overlap scenarios the backend runs; ``replace_mechanism``, where set, is the
value the backend must declare.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest

import embstore
from embstore.errors import ConcurrentRestoreError

from .conformance_harness import table_of
from .restore_concurrent import run, snapshot, tables


def _keys(key_type: str, lo: int, hi: int) -> Any:
    return (np.arange(lo, hi, dtype=np.int64) if key_type == "int64"
            else [f"key-{i}".encode() for i in range(lo, hi)])


def _table(store: Any) -> dict:
    """Every record of ``store`` as {key: record bytes}."""
    return {k: r.tobytes() for k, r in table_of(store).items()}


def _filled(url: str, key_type: str = "int64", n: int = 60) -> Any:
    s = embstore.open(url, dim=4, key_type=key_type, optimizer="adagrad")
    keys = _keys(key_type, 0, n)
    s.lookup(keys)
    s.update(keys, np.ones((n, 4), np.float32))
    return s


class RestoreConformance:
    """Reads overlapping restores; see the module docstring."""

    #: another process restores while this one reads (persistent backends)
    restore_across_processes: bool = True
    #: a scan paused across a whole restore by the same handle fails instead of mixing
    restore_in_process: bool = True
    #: rows of the tables and restores per run across processes (a slow backend runs fewer)
    restore_rows: int = 3000
    restore_rounds: int = 16
    #: the ``replace_mechanism`` the backend must declare (None: not checked)
    replace_mechanism: str | None = None

    @pytest.fixture
    def url_factory(self):  # pragma: no cover - subclasses provide it
        raise NotImplementedError("subclasses define a url_factory fixture")

    @pytest.mark.parametrize("key_type", ["int64", "bytes"])
    def test_replace_makes_the_store_hold_exactly_the_snapshot(self, url_factory, key_type):
        url = url_factory()
        s = _filled(url, key_type)
        buf = io.BytesIO()
        s.export(buf)
        snap, want, step = buf.getvalue(), _table(s), s.step
        more = _keys(key_type, 60, 90)
        s.lookup(more)
        s.update(_keys(key_type, 0, 90), np.full((90, 4), 2.0, np.float32))
        assert len(s) == 90 and s.step == step + 1
        assert s.import_(snap, replace=True) == 60
        assert _table(s) == want and s.step == step and len(s) == 60
        if self.replace_mechanism is not None:
            assert s.backend.replace_mechanism == self.replace_mechanism
        persistent = s.backend.persistent
        s.close()
        if persistent:
            with embstore.open(url) as again:
                assert _table(again) == want and again.step == step

    def test_a_restore_failing_part_way_keeps_the_old_table(self, url_factory):
        s = _filled(url_factory())
        want, step = _table(s), s.step
        rec = s.get_records(np.arange(5))[0]

        def batches() -> Any:
            yield np.arange(1000, 1005), rec
            raise OSError("the source broke")

        with pytest.raises(OSError, match="the source broke"):
            s.backend.replace_rows(batches(), s.meta)
        got = _table(s)
        if s.backend.replace_mechanism != "write-then-delete":  # old table, exactly
            assert got == want
        else:  # every old row is still there (the new ones may be too)
            assert all(got[k] == v for k, v in want.items())
        assert s.step == step
        s.close()

    def test_reads_overlapping_a_restore_see_the_old_or_the_new_table_or_fail(self,
                                                                              url_factory):
        if not self.restore_across_processes:
            pytest.skip("restore_across_processes is False")
        seen = run(url_factory(), n=self.restore_rows, rounds=self.restore_rounds)
        assert seen["mix"] == 0, dict(seen)
        assert seen["restores"] > 0 and seen["A"] + seen["B"] + seen["error"] > 0, dict(seen)

    def test_a_scan_paused_across_a_restore_fails_instead_of_mixing(self, url_factory):
        # deterministic: one page read, a whole restore, then the next page. memory:// used to
        # read the new table's records at the old table's slots.
        if not self.restore_in_process:
            pytest.skip("restore_in_process is False")
        want = tables(600)
        with embstore.open(url_factory(), dim=4) as s:
            s.import_(snapshot(*want["A"]), replace=True)
            pages = s.items(batch_size=100)
            next(pages)
            s.import_(snapshot(*want["B"]), replace=True)
            with pytest.raises(ConcurrentRestoreError, match="replaced by a restore"):
                list(pages)
            assert sum(len(k) for k, _ in s.items(batch_size=100)) == len(want["B"][0])
