"""The lifecycle area of the conformance suite: persistence (reopen, read-only,
pickling), deterministic initialization, export / import, statistics and eviction.

Subclass it beside :class:`~embstore.testing.conformance.StoreConformance` (the tuple
:data:`~embstore.testing.conformance.FULL_CONFORMANCE` names every area); it uses the same
``url_factory`` fixture.
"""

from __future__ import annotations

import io
import math
import pickle

import numpy as np
import pytest

import embstore
from embstore.errors import (
    CorruptFileError,
    ReadOnlyError,
    SchemaMismatchError,
)
from embstore.policies import Eviction

from .conformance_harness import DIM, ConformanceHarness, rows_equal, table_of


class StoreLifecycleConformance(ConformanceHarness):
    """Tests of a store's life beyond one batch; see the module docstring."""

    # -- persistence -------------------------------------------------------------------------------
    def test_reopen_returns_exact_records(self):
        s = self.open(optimizer=embstore.optim.SGD(lr=0.1))
        self.require_persistent(s)
        s.lookup(np.arange(100))
        s.update(np.arange(0, 100, 2), np.ones((50, DIM)))
        before = table_of(s)
        step = s.step
        s2 = self.reopen(s)
        assert s2.step == step
        after = table_of(s2)
        assert after.keys() == before.keys()
        for k in before:
            assert rows_equal(after[k], before[k])

    def test_reopen_with_other_dim_or_key_type_is_refused(self):
        s = self.open()
        self.require_persistent(s)
        s.lookup([1, 2])
        url = s.url
        s.close()
        with pytest.raises(SchemaMismatchError):
            self.open(url, dim=DIM + 1)
        with pytest.raises(SchemaMismatchError):
            self.open(url, key_type="bytes")
        with pytest.raises(SchemaMismatchError):
            self.open(url, optimizer=embstore.optim.SGD(lr=0.123))
        s2 = self.open(url)
        assert len(s2) == 2 and s2.dim == DIM

    def test_read_only_refuses_writes(self):
        s = self.open()
        self.require_persistent(s)
        s.lookup([1, 2])
        url = s.url
        s.close()
        ro = self.open(url, read_only=True)
        v = ro.lookup([1, 2, 3])
        assert len(ro) == 2, "a read-only lookup must not insert"
        np.testing.assert_array_equal(v[2], ro.initial_vectors([3])[0])
        for call in (lambda: ro.update([1], np.ones((1, DIM))),
                     lambda: ro.assign([1], np.ones((1, DIM))),
                     lambda: ro.delete([1]),
                     lambda: ro.import_(b"")):
            with pytest.raises(ReadOnlyError):
                call()

    def test_pickle_by_url(self):
        s = self.open()
        if not s.backend.persistent:
            with pytest.raises(pickle.PicklingError):
                pickle.dumps(s)
            return
        s.assign([1, 2], np.full((2, DIM), 3.0))
        s.flush()
        clone = pickle.loads(pickle.dumps(s))
        self._opened.append(clone)
        assert clone.url == s.url
        np.testing.assert_array_equal(clone.lookup([1, 2], insert=False),
                                      np.full((2, DIM), 3.0, np.float32))

    # -- init determinism --------------------------------------------------------------------------
    def test_initial_vectors_depend_only_on_seed_and_key(self):
        a = self.open(seed=7)
        b = self.open(seed=7)
        c = self.open(seed=8)
        keys = np.array([3, 1, 4, 1, 5, 9, 2, 6], dtype=np.int64)
        va = a.lookup(keys)
        vb = b.lookup(keys[::-1])[::-1]
        np.testing.assert_array_equal(va, vb)
        assert not np.array_equal(va, c.lookup(keys))

    # -- export / import ---------------------------------------------------------------------------
    def test_export_import_reproduces_records(self, tmp_path):
        s = self.open(optimizer=embstore.optim.SGD(lr=0.2))
        s.lookup(np.arange(300))
        s.update(np.arange(0, 300, 3), np.ones((100, DIM)))
        path = tmp_path / "t.emb"
        assert s.export(path) == 300
        t = self.open(optimizer=embstore.optim.SGD(lr=0.2))
        assert t.import_(path) == 300
        a, b = table_of(s), table_of(t)
        assert a.keys() == b.keys()
        for k in a:
            assert rows_equal(a[k], b[k])

    def test_export_import_bytes_keys(self):
        s = self.open(key_type="bytes")
        s.lookup(["alpha", "beta", "", "\u00fc"])
        buf = io.BytesIO()
        s.export(buf)
        t = self.open(key_type="bytes")
        t.import_(buf.getvalue())
        a, b = table_of(s), table_of(t)
        assert a.keys() == b.keys()
        for k in a:
            assert rows_equal(a[k], b[k])

    def test_corrupt_or_truncated_import_imports_nothing(self, tmp_path):
        s = self.open()
        s.lookup(np.arange(5000))
        buf = io.BytesIO()
        s.export(buf, batch_size=1000)
        data = buf.getvalue()
        t = self.open()
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0xFF
        for bad in (data[: len(data) - 10], data[: len(data) // 2], bytes(flipped),
                    b"garbage", data[:20]):
            with pytest.raises(CorruptFileError):
                t.import_(bad)
            assert len(t) == 0

    def test_import_with_other_layout_is_refused(self):
        s = self.open()
        s.lookup([1])
        buf = io.BytesIO()
        s.export(buf)
        t = self.open(dim=DIM * 2)
        with pytest.raises(SchemaMismatchError):
            t.import_(buf.getvalue())
        assert len(t) == 0

    # -- stats -------------------------------------------------------------------------------------
    def test_stats_count_operations(self):
        s = self.open()
        s.lookup([1, 2, 3])
        s.lookup([1, 4])
        s.update([1, 1], np.ones((2, DIM)))
        s.delete([2])
        st = s.stats()
        assert st["lookups"] == 5 and st["hits"] == 1 and st["misses"] == 4
        assert st["inserts"] == 4 and st["updates"] == 2 and st["deletes"] == 1
        assert math.isclose(st["hit_rate"], 0.2)
        # rows: only without a scan by default; always when asked
        assert st.get("rows", 3) == 3 and s.stats(count_rows=True)["rows"] == 3
        assert "rows" not in s.stats(count_rows=False)

    # -- policies ----------------------------------------------------------------------------------
    def test_capacity_eviction_on_the_training_path(self):
        """Each batch looked up (inserting) and then updated, as the adapters train: LFU keeps
        the older, twice-seen rows over the previous batch's once-seen one, LRU the newest."""
        for policy, keep in {"lfu": [0, 1, 3], "lru": [1, 2, 3]}.items():
            s = self.open(eviction=Eviction(3, policy, slack=0))
            for batch in ([0, 1], [0, 1], [2], [3]):
                s.lookup(batch)
                s.update(batch, np.ones((len(batch), DIM), np.float32))
            assert sorted(table_of(s)) == keep, policy
