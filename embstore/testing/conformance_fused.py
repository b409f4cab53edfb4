"""An opt-in area of the conformance suite: the fused bag path (``pool_bags`` /
``update_bags``) of a store that offers it (``store.fused_bags()``) against the general path
(``lookup`` of the distinct ids, pooled, then ``update`` of the per-id gradient sums).

Subclass :class:`FusedBagConformance` beside the other areas with the same ``url_factory``
and ``open_options`` (``memory://``, or a cache layer over a persistent store)::

    class TestCachedLmdbFused(FusedBagConformance):
        open_options = {"cache": "memory://", "cache_capacity": 64}
        offers_fused = True

A store that does not pool in place skips, or fails where the subclass says it must
(``offers_fused = True``). Both paths must give the same pooled bags, every
record field (but the wall-clock ``version`` / ``last_seen`` stamps), every counter of
``stats()`` and the same rows once flushed and reopened, bit for bit; ids stored before the
store was (re)opened pool their stored vectors; a gradient that is not finite changes no row,
counter or dirty mark.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import embstore
from embstore.errors import InvalidInputError
from embstore.optim import FTRL, SGD, Adagrad, Adam, Momentum

from .conformance_harness import ConformanceHarness

__all__ = ["FUSED_OPTIMIZERS", "FusedBagConformance", "pooled_reference"]

#: the optimizers the fused step covers, by test-id name
FUSED_OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1),
    "adagrad": lambda: Adagrad(lr=0.1, initial_accumulator_value=0.1),
    "adagrad-rowwise": lambda: Adagrad(lr=0.1, rowwise=True),
    "adam": lambda: Adam(lr=0.01),
    "momentum-nesterov": lambda: Momentum(lr=0.05, nesterov=True),
    "ftrl": lambda: FTRL(alpha=0.1, l1=0.01, l2=0.01),
}
#: ``stats()`` entries that are wall-clock stamps, not counters
_CLOCKED = ("version",)
#: ``stats()`` entries that count rows written (a flush also commits the metadata)
_ROW_WRITES = ("dirty_rows", "remote_writes", "remote_write_calls", "updates", "flushes")
_DIM = 8
_STORED = 40       # ids 0..39 hold rows before the training run opens its store
_KEYS = np.arange(400, dtype=np.int64)


def pooled_reference(vectors: np.ndarray, inv: np.ndarray, offsets: np.ndarray,
                     mean: bool) -> np.ndarray:
    """Unweighted bags of ``vectors`` (float32, one row per distinct id) pooled as the fused
    kernels pool them: added in element order from zero, ``mean`` divided by the length."""
    n_bags = len(offsets) - 1
    out = np.zeros((n_bags, vectors.shape[1]), dtype=np.float32)
    for b in range(n_bags):
        acc = np.zeros(vectors.shape[1], dtype=np.float32)
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        for e in range(lo, hi):
            acc = acc + vectors[inv[e]]
        out[b] = acc / np.float32(hi - lo) if mean and hi > lo else acc
    return out


def _batches(steps: int = 6, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray, bool]]:
    """(ids, offsets, mean) per step: ragged bags (some empty) of Zipf ids over a growing
    vocabulary; the first step's ids are all stored ones."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(steps):
        lengths = rng.integers(0, 7, 24)
        ids = rng.zipf(1.3, int(lengths.sum())) % (_STORED if i == 0 else 60 * (i + 1))
        offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        out.append((ids.astype(np.int64), offsets.astype(np.int64), i % 2 == 1))
    return out


def _same_records(a: embstore.EmbeddingStore, b: embstore.EmbeddingStore) -> None:
    ra, fa = a.get_records(_KEYS)
    rb, fb = b.get_records(_KEYS)
    assert np.array_equal(fa, fb)
    for name in ra.dtype.names or ():
        if name not in ("version", "last_seen"):  # wall-clock stamps
            assert np.array_equal(ra[fa][name], rb[fb][name]), name


def _rows_written(store: embstore.EmbeddingStore) -> dict[str, Any]:
    stats = store.stats()
    return {k: stats.get(k) for k in _ROW_WRITES}


class FusedBagConformance(ConformanceHarness):
    """The fused bag path against the general path; see the module docstring."""

    #: the store must offer the path: a refusal fails the test instead of skipping it
    offers_fused = False
    #: ``stats()`` entries that depend on thread timing, left out of the comparison (a cache
    #: with a write-behind thread reads a row from its queue or, once landed, the remote)
    timed_counters: tuple[str, ...] = ()

    def _counters(self, store: embstore.EmbeddingStore) -> dict[str, Any]:
        skip = _CLOCKED + self.timed_counters
        return {k: v for k, v in store.stats().items() if k not in skip}

    def _pair(self, opt: str, value_dtype: str) -> tuple[list, dict[str, np.ndarray]]:
        """Two stores, fresh URLs, each holding the same stored rows and reopened (a cache
        starts empty: the stored rows are in its remote only), and those rows' vectors."""
        kw: dict[str, Any] = {"dim": _DIM, "seed": 5, "optimizer": FUSED_OPTIMIZERS[opt](),
                              "value_dtype": value_dtype, "stochastic_rounding": False}
        values = np.random.default_rng(1).standard_normal((_STORED, _DIM)).astype(np.float32)
        stores = []
        for _ in range(2):
            s = self.open(**kw)
            s.assign(np.arange(_STORED), values)
            if s.backend.persistent:
                s = self.reopen(s, stochastic_rounding=False)
            if not s.fused_bags():
                assert not self.offers_fused, f"{s.url}: fused_bags() is False"
                pytest.skip(f"{s.url}: no fused bag path (fused_bags() is False)")
            stores.append(s)
        return stores, {"stored": stores[0].layout.vectors(stores[0].layout.encode_vectors(
            values))}

    @pytest.mark.parametrize("value_dtype", ["float32", "bfloat16", "float16"])
    @pytest.mark.parametrize("opt", sorted(FUSED_OPTIMIZERS))
    def test_fused_bags_train_the_bits_of_the_general_path(self, opt, value_dtype):
        (a, b), ref = self._pair(opt, value_dtype)
        rng = np.random.default_rng(2)
        for step, (ids, offsets, mean) in enumerate(_batches()):
            got = a.pool_bags(ids, offsets, mean=mean)
            assert got is not None, "the fused path was refused"
            out, batch = got
            vectors = b.lookup(batch.uniq)
            assert np.array_equal(out, pooled_reference(vectors, batch.inv, batch.offsets,
                                                        mean)), step
            if step == 0:  # stored ids only: their stored vectors, read from the backend
                assert np.array_equal(vectors, ref["stored"][batch.uniq])
            grad = rng.standard_normal(out.shape).astype(np.float32)
            a.update_bags(batch, grad)
            b.update(batch.uniq, batch.grad_sums(grad), counts=batch.counts)
            assert a.step == b.step
        _same_records(a, b)
        ca, cb = self._counters(a), self._counters(b)
        assert ca == cb, {k: (ca.get(k), cb.get(k)) for k in ca.keys() | cb.keys()
                          if ca.get(k) != cb.get(k)}
        a.flush()
        b.flush()
        assert self._counters(a) == self._counters(b)
        if a.backend.persistent:  # the rows as the backing store holds them
            a, b = (self.reopen(s, stochastic_rounding=False) for s in (a, b))
            _same_records(a, b)

    @pytest.mark.parametrize("bad", [np.nan, np.inf])
    @pytest.mark.parametrize("opt", sorted(FUSED_OPTIMIZERS))
    def test_a_bad_gradient_changes_nothing(self, opt, bad):
        (a, _), _ = self._pair(opt, "float32")
        ids, offsets, _ = _batches(2)[1]
        out, batch = a.pool_bags(ids, offsets)
        a.update_bags(batch, np.ones_like(out))
        a.flush()
        out, batch = a.pool_bags(ids, offsets)
        before, _ = a.get_records(batch.uniq)
        counters, step, rows_written = self._counters(a), a.step, _rows_written(a)
        grad = np.ones_like(out)
        grad[len(grad) // 2, 1] = bad
        with pytest.raises(InvalidInputError, match="NaN or inf"):
            a.update_bags(batch, grad)
        assert self._counters(a) == counters and a.step == step
        a.flush()  # nothing became dirty: no row to write
        assert _rows_written(a) == rows_written
        after, _ = a.get_records(batch.uniq)
        assert before.tobytes() == after.tobytes()
