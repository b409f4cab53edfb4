"""The public seams that replaced private reaches (issue #31): a staging memory:// table hands
its storage over, a tombstone log takes its entries when made, a fixed sampler tells its
expected counts."""

from __future__ import annotations

import numpy as np
import pytest

from embstore.backends.memory import MemoryBackend
from embstore.errors import StoreClosedError
from embstore.layout import Layout
from embstore.policies.tombstones import TombstoneLog
from embstore.sampling.samplers import FixedCandidatesSampler


def test_a_memory_table_handed_over_is_closed_and_the_receiver_holds_its_rows():
    layout = Layout(4)
    giver = MemoryBackend()
    giver.bind(layout, "int64")
    recs = layout.empty(3)
    recs["vector"] = np.arange(12, dtype=np.float32).reshape(3, 4)
    giver.put(np.array([1, 2, 3]), recs)
    table, arena = giver.hand_over()
    with pytest.raises(StoreClosedError):
        giver.get(np.array([1]))
    assert len(table) == 3 and arena.live == 3


def test_a_tombstone_log_made_with_entries_holds_them():
    log = TombstoneLog("int64", floor=5, entries=(np.array([7, 8]), np.array([6, 9])))
    keys, versions = log.entries()
    assert keys.tolist() == [7, 8] and versions.tolist() == [6, 9] and len(log) == 2
    assert len(TombstoneLog("int64", entries=(np.zeros(0, np.int64), np.zeros(0)))) == 0
    again = TombstoneLog.from_json("int64", log.to_json(), 0)
    assert again.entries()[0].tolist() == [7, 8]


def test_a_fixed_sampler_tells_its_expected_counts():
    s = FixedCandidatesSampler([4, 5, 6], prob=0.5)
    assert s.expected_counts.tolist() == [0.5, 0.5, 0.5]


def test_a_read_only_lmdb_store_refuses_a_restore_and_keeps_its_table(tmp_path):
    from embstore.backends.lmdb import LmdbBackend
    from embstore.errors import BackendError

    layout = Layout(4)
    url = f"lmdb://{tmp_path}/s"
    w = LmdbBackend(url)
    w.bind(layout, "int64")
    w.write_meta({"v": 1})
    w.put(np.array([1, 2]), layout.empty(2))
    w.close()
    ro = LmdbBackend(url, read_only=True)
    ro.bind(layout, "int64")
    with pytest.raises(BackendError):
        ro.replace_rows(iter([(np.array([9]), layout.empty(1))]), {"v": 2}, rows=1)
    assert sorted(ro.scan().__next__()[0].tolist()) == [1, 2] and ro.read_meta() == {"v": 1}
    ro.close()
    missing = LmdbBackend(f"lmdb://{tmp_path}/none", read_only=True)
    with pytest.raises(BackendError):
        missing.replace_rows(iter([]), {"v": 2})
    assert not (tmp_path / "none").exists()
