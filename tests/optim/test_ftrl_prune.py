"""FTRL ``prune=True`` frees the rows the optimizer has zeroed, and only those, on every
backend: in the update that zeroes them (``prune_idle_steps=0``) or in the periodic sweep once
they are idle. The non-zero rows come out bit-identical to a store that never prunes."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.optim import FTRL
from tests.builtin_backends import NAMES

DIM = 8
BACKENDS = [*NAMES, "lmdb+cache"]  # every built-in backend, and a cache layer
STRONG, WEAK, IDLE = np.arange(0, 6), np.arange(100, 106), np.arange(200, 206)


def _open(new_store_url, kind: str, opt: FTRL) -> embstore.EmbeddingStore:
    if kind == "lmdb+cache":
        return embstore.open(new_store_url("lmdb"), dim=DIM, optimizer=opt,
                             initializer="zeros", cache="memory://")
    return embstore.open(new_store_url(kind), dim=DIM, optimizer=opt, initializer="zeros")


def _train(store: embstore.EmbeddingStore, steps: int) -> None:
    """IDLE keys get one weak step, then none; STRONG keys a steady push (non-zero rows);
    WEAK keys noise below the group threshold every step (zero rows still being trained)."""
    rng = np.random.default_rng(5)
    store.update(IDLE, rng.normal(0, 0.01, (len(IDLE), DIM)).astype(np.float32))
    for _ in range(steps):
        g_strong = (rng.normal(0, 0.1, (len(STRONG), DIM)) + 2.0).astype(np.float32)
        g_weak = rng.normal(0, 0.01, (len(WEAK), DIM)).astype(np.float32)
        store.update(np.concatenate([STRONG, WEAK]), np.concatenate([g_strong, g_weak]))


def _reference(steps: int) -> dict[int, np.ndarray]:
    with embstore.open("memory://", dim=DIM, initializer="zeros",
                       optimizer=FTRL(alpha=0.1, l21=0.2)) as ref:
        _train(ref, steps)
        return {int(k): r.copy() for keys, recs in ref.records() for k, r in zip(keys, recs)}


@pytest.mark.parametrize("kind", BACKENDS)
def test_prune_on_update_frees_exactly_the_zeroed_rows(new_store_url, kind):
    ref = _reference(12)
    zero = sorted(k for k, r in ref.items() if not r["vector"].any())
    assert set(zero) == set(WEAK.tolist()) | set(IDLE.tolist())  # the scenario holds
    with _open(new_store_url, kind, FTRL(alpha=0.1, l21=0.2, prune=True,
                                         prune_idle_steps=0)) as s:
        _train(s, 12)
        assert not s.contains(IDLE).any() and not s.contains(WEAK).any()
        assert s.contains(STRONG).all() and len(s) == len(STRONG)
        # every update counted each weak row it freed again; the idle rows once
        assert s.stats()["pruned"] == len(IDLE) + 12 * len(WEAK)
        recs, found = s.get_records(STRONG)
        assert found.all()
        for k, r in zip(STRONG.tolist(), recs):  # the kept rows: untouched by the pruning
            assert r["vector"].tobytes() == ref[k]["vector"].tobytes()
            assert r["z"].tobytes() == ref[k]["z"].tobytes()


@pytest.mark.parametrize("kind", BACKENDS)
def test_idle_prune_frees_idle_zero_rows_only(new_store_url, kind):
    ref = _reference(12)
    with _open(new_store_url, kind, FTRL(alpha=0.1, l21=0.2, prune=True,
                                         prune_idle_steps=3)) as s:
        _train(s, 12)
        assert not s.contains(IDLE).any()  # zero and idle: freed by a sweep
        assert s.contains(WEAK).all()      # zero but still trained: z/n kept
        assert s.contains(STRONG).all()
        assert s.stats()["pruned"] == len(IDLE) and len(s) == len(STRONG) + len(WEAK)
        keys = np.concatenate([STRONG, WEAK])
        recs, _ = s.get_records(keys)
        for k, r in zip(keys.tolist(), recs):
            assert r["vector"].tobytes() == ref[k]["vector"].tobytes()
            assert r["z"].tobytes() == ref[k]["z"].tobytes()
