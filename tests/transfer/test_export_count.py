"""An export or copy counts the source's rows only for a progress bar: on Bigtable a count
is a scan of every row key, which a quiet export (and every worker of one) never needs."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.transfer import copy_store, export_file


@pytest.mark.parametrize("fmt", ["parquet", "native"])
def test_a_quiet_bigtable_export_reads_every_row_once(fmt, new_store_url, tmp_path):
    with embstore.open(new_store_url("bigtable"), dim=8) as store:
        store.assign(np.arange(3000, dtype=np.int64), np.ones((3000, 8), np.float32))
        before = store.backend.counters["rows_read"]
        assert export_file(store, tmp_path / f"out.{fmt}", fmt=fmt) == 3000
        assert store.backend.counters["rows_read"] - before == 3000  # no count scan first
        before = store.backend.counters["rows_read"]
        with embstore.open(f"lmdb://{tmp_path}/copy", dim=8) as dst:
            assert copy_store(store, dst) == 3000
        assert store.backend.counters["rows_read"] - before == 3000
