"""Opt-in conformance tests: scans and exports that overlap a restore (``import_(...,
replace=True)``) read the old or the new table or fail with
:class:`~embstore.errors.ConcurrentRestoreError` -- never a mix of both (the harness is
:mod:`embstore.testing.restore_concurrent`).

Subclass :class:`RestoreConformance` with a ``url_factory`` fixture (a callable returning a
fresh, empty store URL per call). ``restore_in_process`` and ``restore_across_processes`` say
which of the two scenarios the backend runs.
"""

from __future__ import annotations

import pytest

import embstore
from embstore.errors import ConcurrentRestoreError

from .restore_concurrent import run, snapshot, tables


class RestoreConformance:
    """Reads overlapping restores; see the module docstring."""

    #: another process restores while this one reads (persistent backends)
    restore_across_processes: bool = True
    #: a scan paused across a whole restore by the same handle fails instead of mixing
    restore_in_process: bool = True
    #: rows of the tables and restores per run across processes (a slow backend runs fewer)
    restore_rows: int = 3000
    restore_rounds: int = 16

    @pytest.fixture
    def url_factory(self):  # pragma: no cover - subclasses provide it
        raise NotImplementedError("subclasses define a url_factory fixture")

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
