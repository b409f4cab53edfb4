"""The conformance suite every backend and layer runs, in areas.

Subclass every area (:data:`FULL_CONFORMANCE`) in a test module and provide a ``url_factory``
fixture that returns a callable producing a *fresh, empty* store URL on each call::

    class TestLmdb(*FULL_CONFORMANCE):
        @pytest.fixture
        def url_factory(self, tmp_path):
            names = iter(range(10**6))
            return lambda: f"lmdb://{tmp_path}/s{next(names)}"

The areas are :class:`StoreConformance` (lookups, updates, assign / delete, scans, bad input,
a Hypothesis model check),
:class:`~embstore.testing.conformance_lifecycle.StoreLifecycleConformance` (persistence,
initialization, export / import, stats, eviction) and
:class:`~embstore.testing.conformance_backend.BackendPrimitiveConformance` (the backend's row
primitives); each derives from :class:`~embstore.testing.conformance_harness.ConformanceHarness`.

``open_options`` (a class attribute) is passed to every ``embstore.open`` call, so layers reuse
the suite: ``open_options = {"cache": "memory://"}``. ``layout_options`` does the same for the
record layout (``{"value_dtype": "bfloat16"}``): the suite then expects values as that layout
stores them (:meth:`ConformanceHarness.stored`, :attr:`ConformanceHarness.rtol`), and
:data:`LAYOUT_MATRIX` lists the layouts a backend's test module runs the suite over
(:class:`LayoutMatrix`). Tests that need a capability the store lacks (persistence, scans) are
skipped, never silently passed.

Behaviour across processes is in opt-in areas of its own: several writers
(:mod:`~embstore.testing.conformance_writers`), SIGKILL
(:mod:`~embstore.testing.conformance_crash`), ``fork()``
(:mod:`~embstore.testing.conformance_fork`) and restores overlapping reads
(:mod:`~embstore.testing.conformance_restore`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import embstore
from embstore.errors import (
    InvalidInputError,
    KeyTypeError,
    StoreClosedError,
)
from embstore.sampling import sampling_index

from .conformance_backend import BackendPrimitiveConformance
from .conformance_harness import DIM, ConformanceHarness, rows_equal, table_of
from .conformance_lifecycle import StoreLifecycleConformance
from .state_machine import make_state_machine

__all__ = ["DIM", "FULL_CONFORMANCE", "LAYOUT_MATRIX", "BackendPrimitiveConformance",
           "ConformanceHarness", "LayoutMatrix", "StoreConformance", "StoreLifecycleConformance",
           "rows_equal", "table_of"]

#: layouts the suite runs over (``layout_options`` of a subclass), by a short test-id name
LAYOUT_MATRIX: dict[str, dict[str, Any]] = {
    "f16": {"value_dtype": "float16"},
    "bf16": {"value_dtype": "bfloat16"},
    "compact": {"metadata": "compact"},
    "bf16-compact": {"value_dtype": "bfloat16", "metadata": "compact"},
}


class StoreConformance(ConformanceHarness):
    """The store API area: lookups, updates, assign / delete, scans, bad input, and a
    Hypothesis model check; see the module docstring."""

    # -- round trips -------------------------------------------------------------------------------
    def test_lookup_inserts_and_returns_same_vectors(self):
        s = self.open()
        keys = np.array([5, -3, 2**62, 0, -(2**63)], dtype=np.int64)
        v1 = s.lookup(keys)
        assert v1.shape == (5, DIM) and v1.dtype == np.float32
        assert len(s) == 5
        np.testing.assert_array_equal(s.lookup(keys[::-1]), v1[::-1])
        np.testing.assert_array_equal(v1, s.initial_vectors(keys))
        assert s.contains(keys).all()
        assert not s.contains([7, 8]).any()

    def test_lookup_without_insert_writes_nothing(self):
        s = self.open()
        v = s.lookup([1, 2, 3], insert=False)
        np.testing.assert_array_equal(v, s.initial_vectors([1, 2, 3]))
        assert len(s) == 0
        assert not s.contains([1, 2, 3]).any()

    def test_duplicate_keys_in_lookup(self):
        s = self.open()
        v = s.lookup([4, 4, 9, 4])
        assert len(s) == 2
        np.testing.assert_array_equal(v[0], v[1])
        np.testing.assert_array_equal(v[0], v[3])

    def test_bytes_and_str_keys(self):
        s = self.open(key_type="bytes")
        keys = [b"a", b"a\x00", b"", "caf\u00e9", b"\xff\xfe", b"x" * 300]
        v = s.lookup(keys)
        assert len(s) == 6, "distinct bytes keys must not share a record"
        np.testing.assert_array_equal(s.lookup(["caf\u00e9".encode()]), v[3:4])
        assert s.contains([b"a", b"b"]).tolist() == [True, False]
        got = dict(zip(*[np.concatenate(x) for x in zip(*s.items(batch_size=2))]))
        assert set(got) == {b"a", b"a\x00", b"", "caf\u00e9".encode(), b"\xff\xfe", b"x" * 300}

    def test_empty_batches(self):
        s = self.open()
        assert s.lookup([]).shape == (0, DIM)
        s.update([], np.zeros((0, DIM), np.float32))
        s.assign(np.array([], dtype=np.int64), np.zeros((0, DIM)))
        assert s.delete([]) == 0
        assert s.contains([]).shape == (0,)

    def test_growth_keeps_every_key(self):
        s = self.open()
        keys = np.random.default_rng(1).choice(2**40, 20000, replace=False).astype(np.int64)
        vals = np.random.default_rng(2).standard_normal((len(keys), DIM)).astype(np.float32)
        for i in range(0, len(keys), 4096):
            s.assign(keys[i:i + 4096], vals[i:i + 4096])
        assert len(s) == len(keys)
        np.testing.assert_array_equal(s.lookup(keys, insert=False), self.stored(vals))

    # -- update ------------------------------------------------------------------------------------
    def test_update_sums_duplicates_then_steps(self):
        s = self.open(optimizer=embstore.optim.SGD(lr=0.5))
        keys = [1, 2, 1, 3]
        before = s.lookup([1, 2, 3])
        g = np.arange(4 * DIM, dtype=np.float32).reshape(4, DIM) / 100
        s.update(keys, g)
        after = s.lookup([1, 2, 3])
        tol = {"rtol": self.rtol, "atol": 1e-6}
        np.testing.assert_allclose(after[0], before[0] - 0.5 * (g[0] + g[2]), **tol)
        np.testing.assert_allclose(after[1], before[1] - 0.5 * g[1], **tol)
        np.testing.assert_allclose(after[2], before[2] - 0.5 * g[3], **tol)
        recs, found = s.get_records([1, 2, 3])
        assert found.all()
        assert recs["count"].tolist() == [2, 1, 1] and s.step == 1
        if "last_step" in s.layout.meta_names:  # a compact layout without expiry has none
            assert (recs["last_step"] == s.step).all()

    def test_update_creates_unknown_keys(self):
        s = self.open(optimizer="sgd")
        g = np.ones((2, DIM), np.float32)
        s.update([10, 11], g)
        lr = s.optimizer.lr
        np.testing.assert_allclose(s.lookup([10, 11]), s.initial_vectors([10, 11]) - lr * g,
                                   rtol=self.rtol, atol=1e-6)

    def test_update_of_known_and_new_keys_in_one_batch(self):
        # Known keys may be stepped where they are stored (Backend.update_rows), new ones go
        # through the general path: both must end as one SGD step with exact counts.
        s = self.open(optimizer=embstore.optim.SGD(lr=0.25))
        before = s.lookup([1, 2, 3])
        g = np.arange(5 * DIM, dtype=np.float32).reshape(5, DIM) / 64
        s.update([3, 7, 1, 7, 9], g, counts=[1, 2, 3, 4, 5])
        lr = np.float32(0.25)
        expect = {3: before[2] - lr * g[0], 1: before[0] - lr * g[2],
                  7: s.initial_vectors([7])[0] - lr * (g[1] + g[3]),
                  9: s.initial_vectors([9])[0] - lr * g[4], 2: before[1]}
        keys = sorted(expect)
        np.testing.assert_allclose(s.lookup(keys, insert=False),
                                   np.stack([expect[k] for k in keys]), rtol=self.rtol,
                                   atol=1e-6)
        recs, found = s.get_records(keys)
        assert found.all()
        assert dict(zip(keys, recs["count"].tolist())) == {1: 3, 2: 0, 3: 1, 7: 6, 9: 5}
        stepped = np.isin(keys, [1, 3, 7, 9])
        if "last_step" in s.layout.meta_names:
            assert (recs["last_step"][stepped] == 1).all()
            assert recs["last_step"][~stepped][0] == 0
        assert s.stats()["updates"] == 5 and s.stats()["inserts"] == 5

    def test_update_and_assign_side_effects_follow_modify(self):
        s = self.open()
        s.lookup([1, 2])
        s.sample([1], 1, "uniform", seed=0)  # an observer (the sampling index) is listening
        s.update([2, 3], np.ones((2, DIM), dtype=np.float32))
        s.assign([4, 1], np.full((2, DIM), 0.5, dtype=np.float32))
        st = s.stats(count_rows=True)
        assert st["inserts"] == 4 and st["assigns"] == 2 and st["rows"] == 4

        idx = sampling_index(s)
        counts = idx.counts_of(np.array([1, 2, 3, 4], dtype=np.int64))
        recs, _ = s.get_records([1, 2, 3, 4])
        assert counts.tolist() == recs["count"].tolist() == [0, 1, 1, 0]
        np.testing.assert_array_equal(s.layout.vectors(recs)[[0, 3]], 0.5)

    def test_versions_increase_with_writes(self):
        s = self.open()
        s.lookup([1])
        v1 = s.version
        s.update([2], np.ones((1, DIM)))
        assert s.version > v1
        changed = {k for keys, _ in s.changes_since(v1) for k in keys.tolist()}
        assert changed == {2}

    # -- assign / delete ---------------------------------------------------------------------------
    def test_assign_sets_vectors_last_wins(self):
        s = self.open()
        vals = np.arange(3 * DIM, dtype=np.float32).reshape(3, DIM)
        s.assign([7, 8, 7], vals)
        np.testing.assert_array_equal(s.lookup([7, 8]), vals[[2, 1]])

    def test_delete(self):
        s = self.open()
        s.lookup([1, 2, 3])
        assert s.delete([2, 2, 99]) == 1
        assert len(s) == 2
        assert s.contains([1, 2, 3]).tolist() == [True, False, True]
        s.assign([2], np.ones((1, DIM)))
        np.testing.assert_array_equal(s.lookup([2]), np.ones((1, DIM), np.float32))

    def test_nd_key_arrays(self):
        s = self.open()
        keys = np.arange(12, dtype=np.int64).reshape(2, 3, 2)
        vals = np.arange(12 * DIM, dtype=np.float32).reshape(2, 3, 2, DIM)
        s.assign(keys, vals)
        np.testing.assert_array_equal(s.lookup(keys), vals)
        np.testing.assert_array_equal(s.lookup(keys[:, :1], insert=False), vals[:, :1])
        assert s.contains(keys[0]).shape == (3, 2) and s.contains(keys).all()
        assert s.delete(keys[1]) == 6
        assert s.contains(keys).tolist() == [[[True] * 2] * 3, [[False] * 2] * 3]

    def test_clear(self):
        s = self.open()
        s.assign(np.arange(300), np.ones((300, DIM)))
        v0 = s.version
        assert s.clear() == 300
        assert len(s) == 0 and not s.contains([0, 299]).any()
        assert s.version > v0 and s.clear() == 0
        s.lookup([5])  # the store stays usable
        assert len(s) == 1

    def test_items_cover_table_once(self):
        s = self.open()
        keys = np.arange(-500, 500, 3, dtype=np.int64)
        vals = np.random.default_rng(0).standard_normal((len(keys), DIM)).astype(np.float32)
        s.assign(keys, vals)
        seen: dict[int, np.ndarray] = {}
        for k, v in s.items(batch_size=64):
            assert v.shape == (len(k), DIM)
            for kk, vv in zip(k.tolist(), v):
                assert kk not in seen
                seen[kk] = vv
        assert set(seen) == set(keys.tolist())
        for kk, vv in zip(keys.tolist(), self.stored(vals)):
            np.testing.assert_array_equal(seen[kk], vv)

    # -- bad input ---------------------------------------------------------------------------------
    def test_bad_input_raises_and_leaves_data_unchanged(self):
        s = self.open()
        s.assign([1, 2], np.ones((2, DIM)))
        snapshot = table_of(s)
        bad_calls = [
            (InvalidInputError, lambda: s.update([1, 2], np.ones((2, DIM + 1)))),
            (InvalidInputError, lambda: s.update([1, 2], np.ones((3, DIM)))),
            (InvalidInputError, lambda: s.update([1, 2], np.full((2, DIM), np.nan))),
            (InvalidInputError, lambda: s.update([1, 2], np.array([[np.inf] * DIM, [0] * DIM]))),
            (InvalidInputError, lambda: s.assign([1], np.full((1, DIM), -np.inf))),
            (InvalidInputError, lambda: s.assign([1], np.array([["a"] * DIM]))),
            (KeyTypeError, lambda: s.lookup([b"x"])),
            (KeyTypeError, lambda: s.lookup(["x", "y"])),
            (KeyTypeError, lambda: s.update([1.5], np.ones((1, DIM)))),
            (InvalidInputError, lambda: s.assign(np.ones((2, 2), dtype=np.int64),
                                                 np.ones((4, DIM)))),
        ]
        for err, call in bad_calls:
            with pytest.raises(err):
                call()
        after = table_of(s)
        assert after.keys() == snapshot.keys()
        for k in snapshot:
            assert rows_equal(after[k], snapshot[k])

    def test_bytes_store_rejects_int_keys(self):
        s = self.open(key_type="bytes")
        with pytest.raises(KeyTypeError):
            s.lookup(np.array([1, 2]))

    def test_unknown_key_type_and_bad_dim(self):
        with pytest.raises(InvalidInputError):
            self.open(key_type="float")
        with pytest.raises(InvalidInputError):
            self.open(dim=0)

    def test_closed_store_raises(self):
        s = self.open()
        s.close()
        s.close()  # idempotent
        for call in (lambda: s.lookup([1]), lambda: s.update([1], np.ones((1, DIM))),
                     lambda: len(s), lambda: s.stats(), lambda: list(s.items())):
            with pytest.raises(StoreClosedError):
                call()


    # -- model-based -------------------------------------------------------------------------------
    def test_state_machine_against_dict_model(self):
        from hypothesis import HealthCheck, settings
        from hypothesis.stateful import run_state_machine_as_test

        run_state_machine_as_test(
            make_state_machine(self.open, self.value_dtype),
            settings=settings(max_examples=12, stateful_step_count=15, deadline=None,
                              suppress_health_check=list(HealthCheck)),
        )



#: every area of the suite: ``class TestMine(*FULL_CONFORMANCE)`` runs all of them
FULL_CONFORMANCE: tuple[type, ...] = (StoreConformance, StoreLifecycleConformance,
                                      BackendPrimitiveConformance)


class LayoutMatrix:
    """Mix in before a :class:`StoreConformance` subclass to run its suite once per layout of
    :data:`LAYOUT_MATRIX` (``class TestLmdbLayouts(LayoutMatrix, TestLmdbConformance)``)."""

    layout_options: dict[str, Any]

    @pytest.fixture(autouse=True, params=sorted(LAYOUT_MATRIX))
    def _layout(self, request: Any) -> None:
        self.layout_options = LAYOUT_MATRIX[request.param]
