"""Scans and exports that overlap another process's restore read one table or fail with
``ConcurrentRestoreError`` -- never a mix of both (issue 34, item 8; the harness is
``tests/restore_concurrent.py``).

They used to mix: SQLite and PostgreSQL scans page by page outside one transaction, LMDB reads
each batch in its own read transaction, Bigtable reads while a restore copies rows over the live
table. Every restore now writes a fresh generation id with its table, and a scan checks it
around every page (Bigtable also the restore's commit marker); RocksDB readers read one
snapshot (a read-only handle) by construction.
"""

from __future__ import annotations

import pytest

from tests.restore_concurrent import run


@pytest.mark.parametrize("kind", ["lmdb", "rocksdb", "sqlite", "postgres", "bigtable"])
def test_reads_overlapping_a_restore_see_the_old_or_the_new_table_or_fail(new_store_url, kind):
    url = new_store_url(kind)
    small = kind == "bigtable"  # the emulator writes ~35k rows/s: a smaller table, fewer swaps
    seen = run(url, n=1000 if small else 3000, rounds=6 if small else 16)
    assert seen["mix"] == 0, dict(seen)
    assert seen["restores"] > 0 and seen["A"] + seen["B"] + seen["error"] > 0, dict(seen)


def test_bigtable_reads_of_a_reader_opened_before_the_restores_never_mix(new_store_url):
    # a fresh read-only open refuses a table carrying the restore's marker; a reader opened
    # earlier scans on, across the rows the restore copies over the live table
    seen = run(new_store_url("bigtable"), n=1000, rounds=6, fresh_opens=False)
    assert seen["mix"] == 0, dict(seen)
    assert seen["restores"] > 0, dict(seen)


@pytest.mark.parametrize("kind", ["memory", "lmdb", "sqlite"])
def test_a_scan_paused_across_a_restore_fails_instead_of_mixing(new_store_url, kind):
    # deterministic: one page read, a whole restore, then the next page. memory:// used to
    # read the new table's records at the old table's slots.
    import embstore
    from embstore.errors import ConcurrentRestoreError
    from tests.restore_concurrent import snapshot, tables

    want = tables(600)
    url = new_store_url(kind)
    with embstore.open(url, dim=4) as s:
        s.import_(snapshot(*want["A"]), replace=True)
        pages = s.items(batch_size=100)
        next(pages)
        s.import_(snapshot(*want["B"]), replace=True)
        with pytest.raises(ConcurrentRestoreError, match="replaced by a restore"):
            list(pages)
        assert sum(len(k) for k, _ in s.items(batch_size=100)) == len(want["B"][0])
