"""A Parquet export writes statistics (min/max) for the key and the metadata columns, which
a query engine can prune by, and none for the vector and slot columns, whose min/max over
every float prunes nothing and cost ~a tenth of the write; the file reads back whole."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

import embstore
from embstore.transfer import export_file, verify_file


def test_statistics_for_keys_and_metadata_only(tmp_path):
    out = tmp_path / "s.parquet"
    with embstore.open("memory://", dim=4, optimizer="adagrad") as store:
        store.assign(np.arange(-50, 50), np.arange(400, dtype=np.float32).reshape(100, 4))
        export_file(store, out)
        digest = verify_file(out).digest
    md = pq.ParquetFile(out).metadata.row_group(0)
    stats = {md.column(j).path_in_schema: md.column(j) for j in range(md.num_columns)}
    assert not stats["vector.list.element"].is_stats_set
    assert not stats["slot.accum.list.element"].is_stats_set
    key = stats["key"].statistics
    assert stats["key"].is_stats_set and (key.min, key.max) == (-50, 49)
    assert all(stats[n].is_stats_set for n in ("count", "last_seen", "last_step", "version"))
    with embstore.open(f"lmdb://{tmp_path}/back", dim=4, optimizer="adagrad") as back:
        embstore.transfer.import_file(back, out)
        assert len(back) == 100
        np.testing.assert_array_equal(back.lookup([-50, 49], insert=False),
                                      [[0, 1, 2, 3], [396, 397, 398, 399]])
    assert verify_file(out).digest == digest
