"""The backend half of the conformance suite: the row primitives the engine is built on
(``update_rows``, ``insert_rows``, ``modify``), called on ``store.backend`` directly.

Every backend and layer runs them as one area of
:data:`~embstore.testing.conformance.FULL_CONFORMANCE`; they use the harness's ``open`` helper.
"""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.backends.base import RowUpdate

from .conformance_harness import DIM, ConformanceHarness


class BackendPrimitiveConformance(ConformanceHarness):
    """Tests of ``Backend.update_rows`` / ``insert_rows`` / ``modify`` (an area of
    :data:`~embstore.testing.conformance.FULL_CONFORMANCE`)."""

    def test_backend_row_update_changes_found_rows_only(self):
        s = self.open()
        if not s.layout.is_wide:
            pytest.skip("16-bit rows are stepped through modify (no float32 field to add to)")
        s.lookup([4, 5, 6])
        backend = s.backend
        keys = np.array([4, 6, 8], dtype=np.int64)
        before, _ = backend.get(keys)
        x = np.arange(3 * DIM, dtype=np.float32).reshape(3, DIM)
        names = s.layout.meta_names
        stamps = {f: v for f, v in {"last_step": 9, "last_seen": 1.5, "version": 77}.items()
                  if f in names}
        found = backend.update_rows(keys, RowUpdate(
            ("vector", -0.5, x), {"count": np.array([2, 3, 4])}, stamps))
        assert found.tolist() == [True, True, False]
        after, present = backend.get(keys)
        assert present.tolist() == [True, True, False]  # nothing created for key 8
        np.testing.assert_array_equal(after["vector"][:2],
                                      before["vector"][:2] + np.float32(-0.5) * x[:2])
        assert after["count"][:2].tolist() == [2, 3]
        for f, v in stamps.items():
            assert after[f][:2].tolist() == [v, v]
        untouched, _ = backend.get(np.array([5], dtype=np.int64))
        assert untouched["count"][0] == 0 and untouched["version"][0] != 77

    def test_backend_reads_of_no_keys_are_empty(self):
        s = self.open()
        s.lookup([1])
        none = s.normalize_keys([])
        recs, found = s.backend.get(none)
        assert len(recs) == 0 and recs.dtype == s.layout.dtype and len(found) == 0
        assert len(s.backend.contains(none)) == 0
        s.backend.put(none, s.layout.empty(0))
        assert len(s) == 1

    def test_backend_insert_rows_fills_records_from_a_template(self):
        s = self.open(optimizer=embstore.optim.Adagrad(initial_accumulator_value=0.5))
        s.lookup([1])  # binds the layout; key 1 exists already
        template = s.layout.empty(1)
        template["accum"], template["count"], template["version"] = 0.5, 3, 99
        keys = np.array([20, -7, 2**40], dtype=np.int64)
        # vectors reach a backend in the stored dtype
        vecs = s.layout.encode_vectors(np.arange(3 * DIM, dtype=np.float32).reshape(3, DIM))
        s.backend.insert_rows(keys, vecs, template)
        recs, found = s.backend.get(keys)
        assert found.all()
        np.testing.assert_array_equal(recs["vector"], vecs)
        assert (recs["accum"] == 0.5).all() and recs["count"].tolist() == [3, 3, 3]
        assert recs["version"].tolist() == [99] * 3
        assert s.backend.get(np.array([1], dtype=np.int64))[1].all()

    def test_backend_modify_keeps_deletes_and_inserts(self):
        s = self.open()
        s.lookup([1, 2, 3])
        backend = s.backend
        keys = np.array([3, 1, 10, 2, 11], dtype=np.int64)
        before, _ = backend.get(keys[[0, 1, 3]])
        calls = []

        def fn(recs: np.ndarray, found: np.ndarray) -> np.ndarray:
            calls.append(found.copy())
            assert recs.dtype == s.layout.dtype and len(recs) == len(keys)
            # rows of missing keys arrive zeroed
            assert not recs[~found].tobytes().strip(b"\0")
            recs["count"] = [5, 6, 7, 8, 9]
            recs["vector"][2] = s.layout.encode_vectors(np.full((1, DIM), 1.5, np.float32))[0]
            return np.array([True, False, True, False, False])

        found = backend.modify(keys, fn)
        assert calls and found.tolist() == [True, True, False, True, False]
        assert all(c.tolist() == found.tolist() for c in calls)
        recs, present = backend.get(keys)
        # kept rows written (key 10 inserted), found rows not kept deleted, missing stay absent
        assert present.tolist() == [True, False, True, False, False]
        assert recs["count"][[0, 2]].tolist() == [5, 7]
        np.testing.assert_array_equal(recs["vector"][0], before["vector"][0])
        assert (s.layout.vectors(recs)[2] == 1.5).all()
        assert len(backend) == 2

    def test_backend_modify_without_keep_writes_every_row(self):
        s = self.open()
        s.lookup([4, 5])
        backend = s.backend

        def fn(recs: np.ndarray, found: np.ndarray) -> None:
            recs["count"] += np.arange(1, len(recs) + 1, dtype=recs["count"].dtype)

        found = backend.modify(np.array([5, 6, 4], dtype=np.int64), fn)
        assert found.tolist() == [True, False, True]
        recs, present = backend.get(np.array([4, 5, 6], dtype=np.int64))
        assert present.all() and recs["count"].tolist() == [3, 1, 2]
        # every row cached/found: a partial keep deletes the others
        found = backend.modify(np.array([4, 5, 6], dtype=np.int64),
                               lambda recs, found: np.array([False, True, True]))
        assert found.all()
        assert backend.contains(np.array([4, 5, 6], dtype=np.int64)).tolist() == [False, True,
                                                                                   True]

    def test_backend_modify_bytes_keys(self):
        s = self.open(key_type="bytes")
        s.lookup([b"a", b"b"])
        keys = np.array([b"b", b"c", b"a"], dtype=object)

        def fn(recs: np.ndarray, found: np.ndarray) -> np.ndarray:
            recs["count"] = 4
            return np.array([True, True, False])

        assert s.backend.modify(keys, fn).tolist() == [True, False, True]
        recs, present = s.backend.get(keys)
        assert present.tolist() == [True, True, False]
        assert recs["count"][:2].tolist() == [4, 4]

    @pytest.mark.parametrize("key_type", ["int64", "bytes"])
    def test_backend_key_ranges_hold_every_row_exactly_once(self, key_type):
        s = self.open(key_type=key_type)
        if not s.backend.supports_ranges:
            pytest.skip("the backend reads no key ranges (supports_ranges is False)")
        if key_type == "int64":
            keys: list = [-2**63, -1, 0, 1, 2**63 - 1, *range(100, 400, 3)]
        else:
            keys = [b"", b"\x00", b"\xff\xff", *(f"k{i}".encode() for i in range(100))]
        s.lookup(keys)
        s.flush()
        for n in (1, 2, 5, 200):
            ranges = s.backend.plan_ranges(n)
            assert len(ranges) == n
            seen = [k for r in ranges for ks, recs in s.backend.scan_range(r, 7)
                    for k in ks.tolist()]
            assert sorted(seen) == sorted(keys), n
