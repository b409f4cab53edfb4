"""Adagrad steps applied where memory:// records live (``RecordArena.adagrad_rows``) give the
same records, bit for bit, as the general read -> numpy step -> write path."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore._cython.arena import RecordArena
from embstore.backends.base import RowRule
from embstore.backends.memory import MemoryBackend
from embstore.optim.base import Optimizer

FIELDS = ("vector", "accum", "count", "last_step")


def _keys(key_type: str, ids: np.ndarray) -> np.ndarray:
    if key_type == "int64":
        return ids.astype(np.int64)
    return np.array([f"k{i}".encode() for i in ids.tolist()], dtype=object)


def _train_pair(key_type: str, optimizer_factory, dim: int = 16, steps: int = 6):
    """Two stores fed the same batches: [0] in place, [1] through the general path."""
    rng = np.random.default_rng(11)
    stores = [embstore.open("memory://", dim=dim, key_type=key_type,
                            optimizer=optimizer_factory()) for _ in range(2)]
    stores[1].backend.supports_row_update = False  # the general modify path
    ids = rng.choice(5000, 1500, replace=False)
    for st in stores:
        st.lookup(_keys(key_type, ids[:600]))
    touched = [ids[:600]]
    for _ in range(steps):  # batches of known and new keys, with repeats
        b = rng.choice(ids, 800)
        # large and tiny gradients: the rounding of every operation shows
        g = (rng.standard_normal((800, dim)) * rng.choice([1e-3, 1.0, 50.0], (800, 1)))
        g = g.astype(np.float32)
        touched.append(b)
        for st in stores:
            st.lookup(_keys(key_type, b))  # the lookup's slots are reused by the update
            st.update(_keys(key_type, b), g)
    ks = _keys(key_type, np.unique(np.concatenate(touched)))
    return [st.get_records(ks) for st in stores]


@pytest.mark.parametrize("key_type", ["int64", "bytes"])
@pytest.mark.parametrize("kw", [{}, {"initial_accumulator_value": 0.1, "eps": 1e-6}])
def test_in_place_adagrad_matches_the_general_path_bit_for_bit(key_type, kw):
    (a, fa), (b, fb) = _train_pair(key_type, lambda: embstore.optim.Adagrad(lr=0.05, **kw))
    assert fa.all() and fb.all()
    for f in FIELDS:
        np.testing.assert_array_equal(a[f], b[f], err_msg=f)
    assert (a["accum"] > 0).any()  # the steps did run


def test_adagrad_steps_known_keys_through_update_rows_with_its_rule(monkeypatch):
    seen: list = []
    orig = MemoryBackend.update_rows

    def spy(self, keys, update):
        seen.append(update.rule)
        return orig(self, keys, update)

    monkeypatch.setattr(MemoryBackend, "update_rows", spy)
    s = embstore.open("memory://", dim=4, optimizer=embstore.optim.Adagrad(lr=0.5))
    s.lookup([1, 2, 3])
    before = s.lookup([1, 2, 3], insert=False)
    s.update([1, 2, 3], np.ones((3, 4), np.float32))
    assert len(seen) == 1 and seen[0].name == "adagrad" and seen[0].params == (0.5, 1e-10)
    # first step of Adagrad from a zero accumulator: w -= lr * g / (|g| + eps)
    np.testing.assert_allclose(s.lookup([1, 2, 3], insert=False), before - 0.5, rtol=1e-6)
    rec, _ = s.get_records([1, 2, 3])
    np.testing.assert_array_equal(rec["accum"], np.ones((3, 4), np.float32))
    np.testing.assert_array_equal(rec["count"], [1, 1, 1])


class _HalvedSGD(Optimizer):
    """An optimizer with a rule no backend has a native kernel for: the memory backend
    must fall back to reading the rows, running the rule's numpy step and writing them."""

    name = "halved_sgd"

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def apply(self, records, grads, step):
        records["vector"] -= np.float32(self.lr / 2) * grads

    def row_rule(self):
        return RowRule("halved_sgd", (self.lr,), lambda recs, g: self.apply(recs, g, 0))


def test_a_rule_without_a_native_kernel_falls_back_to_the_general_step():
    (a, fa), (b, fb) = _train_pair("int64", lambda: _HalvedSGD(lr=0.1))
    assert fa.all() and fb.all()
    for f in ("vector", "count", "last_step"):
        np.testing.assert_array_equal(a[f], b[f], err_msg=f)


def test_arena_adagrad_rows_refuses_fields_outside_the_record():
    arena = RecordArena(64)
    slots = np.zeros(1, dtype=np.uint32)
    g = np.ones((1, 8), np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        arena.adagrad_rows(slots, 40, 0, g, 0.1, 1e-10)  # 40 + 8 * 4 > 64
    with pytest.raises(ValueError, match="fewer gradient rows"):
        arena.adagrad_rows(np.zeros(2, np.uint32), 0, 32, g, 0.1, 1e-10)


def test_adagrad_on_rows_of_a_write_back_cache_matches_an_uncached_store():
    from embstore.layers.cache.backend import CachedBackend

    rng = np.random.default_rng(2)
    remote = embstore.open("memory://", dim=8, optimizer=embstore.optim.Adagrad(lr=0.2))
    s = embstore.EmbeddingStore(CachedBackend(remote.backend, capacity=40), dim=8,
                                optimizer=embstore.optim.Adagrad(lr=0.2))
    ref = embstore.open("memory://", dim=8, optimizer=embstore.optim.Adagrad(lr=0.2))
    ref.backend.supports_row_update = False  # the general path
    assert s.backend.supports_row_update  # write-back over memory://: steps in place
    for _ in range(40):  # rows move in and out of the cache between steps
        keys = rng.integers(0, 120, size=rng.integers(1, 30))
        g = rng.standard_normal((len(keys), 8)).astype(np.float32)
        np.testing.assert_array_equal(s.lookup(keys), ref.lookup(keys))
        s.update(keys, g)
        ref.update(keys, g)
    assert s.backend.stats()["cache_hits"] > 0
    s.flush()
    ks = np.arange(120)
    (a, fa), (b, fb) = s.get_records(ks), ref.get_records(ks)
    np.testing.assert_array_equal(fa, fb)
    for f in ("vector", "accum", "count"):
        np.testing.assert_array_equal(a[f][fa], b[f][fb], err_msg=f)
