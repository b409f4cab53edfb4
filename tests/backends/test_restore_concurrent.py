"""Scans and exports that overlap another process's restore read one table or fail with
``ConcurrentRestoreError`` -- never a mix of both (issue 34, item 8; the harness is
``embstore/testing/restore_concurrent.py``). The scenarios are
:class:`~embstore.testing.conformance_restore.RestoreConformance`, run here once per built-in
backend (``tests/builtin_backends.py``).

They used to mix: SQLite and PostgreSQL scans page by page outside one transaction, LMDB reads
each batch in its own read transaction, Bigtable reads while a restore copies rows over the live
table. Every restore now writes a fresh generation id with its table, and a scan checks it
around every page (Bigtable also the restore's commit marker); RocksDB readers read one
snapshot (a read-only handle) by construction.
"""

from __future__ import annotations

from embstore.testing.conformance_restore import RestoreConformance
from embstore.testing.restore_concurrent import run
from tests.builtin_backends import conformance_tests

globals().update(conformance_tests(RestoreConformance))


def test_bigtable_reads_of_a_reader_opened_before_the_restores_never_mix(new_store_url):
    # a fresh read-only open refuses a table carrying the restore's marker; a reader opened
    # earlier scans on, across the rows the restore copies over the live table
    seen = run(new_store_url("bigtable"), n=1000, rounds=6, fresh_opens=False)
    assert seen["mix"] == 0, dict(seen)
    assert seen["restores"] > 0, dict(seen)
