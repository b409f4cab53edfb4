"""``store.pool_bags`` / ``update_bags`` of a ``memory://`` store with an admission policy:
the ids it turns away read their initial vectors and get no row, their gradients are dropped,
and what the store holds and counts is what ``lookup`` (with the ids' occurrences) and
``update`` make of the same batch. The rows the pooling read for turned-away ids never show
as the table's (an ``update`` of the batch, a cleared table)."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest

import embstore
from embstore.errors import InvalidInputError
from embstore.optim import Adagrad
from embstore.policies import FrequencyCutoff

DIM = 4
KEYS = np.arange(100, dtype=np.int64)
COUNTERS = ("lookups", "hits", "misses", "inserts", "updates", "admission_rejected",
            "gradients_dropped", "rows")


def _store() -> embstore.EmbeddingStore:
    return embstore.open("memory://", dim=DIM, seed=2, optimizer=Adagrad(lr=0.1),
                         admission=FrequencyCutoff(2))


def _bags(step: int) -> np.ndarray:
    """Eight bags of three ids: repeats (admitted at once) and ids seen once (turned away)."""
    rng = np.random.default_rng(step)
    return rng.integers(0, 30 + 10 * step, (8, 3))


def _general(store: embstore.EmbeddingStore, ids: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """The sum-pooled bags through ``lookup`` and ``update`` of the distinct ids (sorted, with
    their occurrences), as the adapters' general path calls them."""
    uniq, inv, counts = np.unique(ids, return_inverse=True, return_counts=True)
    rows = store.lookup(uniq, counts=counts)
    pooled = rows[inv.reshape(ids.shape)].sum(axis=1)
    sums = np.zeros((len(uniq), DIM), dtype=np.float32)
    np.add.at(sums, inv.reshape(-1), np.repeat(grad, ids.shape[1], axis=0))
    store.update(uniq, sums, counts=counts)
    return pooled


def _state(store: embstore.EmbeddingStore) -> tuple:
    recs, found = store.get_records(KEYS)
    stats = store.stats()
    return (found.tolist(), recs[found]["vector"].tobytes(), recs[found]["count"].tolist(),
            {k: stats[k] for k in COUNTERS}, store.writer.policy.admission.state())


def test_pool_bags_with_admission_holds_and_counts_what_lookup_and_update_do():
    fused, general = _store(), _store()
    assert fused.fused_bags()
    for step in range(5):
        ids = _bags(step)
        grad = np.random.default_rng(100 + step).standard_normal((8, DIM)).astype(np.float32)
        pooled, batch = fused.pool_bags(ids, mode="sum")
        expected = _general(general, ids, grad)
        np.testing.assert_allclose(pooled, expected, rtol=1e-6)  # (sums in another order)
        fused.update_bags(batch, grad)
        assert _state(fused) == _state(general)
    stats = fused.stats()
    assert stats["admission_rejected"] > 0 and stats["gradients_dropped"] > 0 and len(fused)


def test_an_update_of_the_pooled_ids_drops_the_turned_away_gradients():
    """``update`` of a batch's own ids after its pooling sees the turned-away ids absent, as
    the table holds them (not at the rows the pooling read)."""
    store = _store()
    ids = np.array([[1, 1, 2], [3, 4, 4]])
    _, batch = store.pool_bags(ids, mode="sum")
    assert store.contains([1, 2, 3, 4]).tolist() == [True, False, False, True]
    store.update(batch.uniq, np.ones((len(batch.uniq), DIM), dtype=np.float32))
    assert store.stats()["gradients_dropped"] == 2
    assert store.contains([1, 2, 3, 4]).tolist() == [True, False, False, True]
    assert len(store) == 2


@pytest.mark.parametrize("how", ["store", "backend"])
def test_a_table_cleared_between_forward_and_step_takes_the_general_update(how):
    """``store.clear()`` deletes the rows (the step finds the keys gone: the general update);
    the backend's own ``clear`` (a restore's) empties the arena, scratch rows with it: the
    next forward must not free them again."""
    store = _store()
    backend = store.writer.backend
    arena = backend._arena
    _, batch = store.pool_bags(np.array([[1, 1, 2], [3, 4, 4]]), mode="sum")
    assert arena.live == 4  # two rows, two scratch rows
    store.clear() if how == "store" else backend.clear()
    store.update_bags(batch, np.ones((2, DIM), dtype=np.float32))
    assert store.stats()["gradients_dropped"] == 2  # 2 and 3: turned away at the lookup
    assert store.contains([1, 2, 3, 4]).tolist() == [True, False, False, True]  # asked again
    store.pool_bags(np.array([[5, 6]]), mode="sum")  # the last batch's scratch rows freed
    assert arena.live == len(store) + 2
    store.pool_bags(np.array([[7, 7]]), mode="sum")
    assert arena.live == len(store) == 3


def test_a_gradient_that_is_not_finite_writes_nothing_and_frees_the_scratch_rows():
    store = _store()
    arena = store.writer.backend._arena
    _, batch = store.pool_bags(np.array([[1, 1, 2]]), mode="sum")
    before = store.get_records([1])[0].tobytes()
    with pytest.raises(InvalidInputError):
        store.update_bags(batch, np.full((1, DIM), np.inf, dtype=np.float32))
    assert store.get_records([1])[0].tobytes() == before
    assert arena.live == len(store) == 1


def test_a_clock_that_strays_raises_before_the_policy_counts():
    """As ``lookup``: the clock is read once there are absent ids, before the policy is
    asked (a failing reading leaves the policy and the table as they were); a batch of
    known ids reads no clock."""
    reading = [100.0]
    store = embstore.open("memory://", dim=DIM, seed=2, optimizer=Adagrad(lr=0.1),
                          admission=FrequencyCutoff(2), clock=lambda: reading[0])
    store.pool_bags(np.array([[1, 1]]), mode="sum")
    state = store.writer.policy.admission.state()
    reading[0] = float("nan")
    store.pool_bags(np.array([[1, 1]]), mode="sum")  # known ids only
    with pytest.raises(InvalidInputError):
        store.pool_bags(np.array([[1, 2]]), mode="sum")
    assert store.writer.policy.admission.state() == state
    assert store.stats()["admission_rejected"] == 0 and len(store) == 1


def test_closing_between_forward_and_step_lets_the_arena_go():
    """A store closed while a forward's scratch rows wait for its step keeps no reference to
    its records (close frees the memory now)."""
    store = _store()
    _, batch = store.pool_bags(np.array([[1, 2, 3]]), mode="sum")
    arena = store.writer.backend._arena
    store.close()
    gc.collect()
    assert sys.getrefcount(arena) == 2  # this test's name and the call's argument
