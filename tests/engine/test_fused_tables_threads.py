"""The native threads of the table-parallel calls: every table runs once, whatever the
thread count and the number of tables, with calls from several Python threads at once."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import embstore
from embstore.engine.fused import probe_pool, sum_tables

DIM = 8


def _tables(n_tables: int, seed: int):
    """``(specs, want)``: a probe_pool spec per table and the pooled output one call per
    table gives."""
    rng = np.random.default_rng(seed)
    specs, want, outs = [], [], []
    for t in range(n_tables):
        s, ref = (embstore.open("memory://", dim=DIM, seed=t) for _ in range(2))
        lengths = rng.integers(0, 4, 40)
        ids = (rng.zipf(1.3, int(lengths.sum())) % 50).astype(np.int64)
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        for x in (s, ref):
            x.lookup(ids)
        want.append(ref.pool_bags(ids, offsets[:-1], threads=1)[0])
        _, table, arena, bags = s.backend.fused_table()
        offset, kind = bags.vector_field()
        n = len(ids)
        out = np.full((40, DIM), np.nan, np.float32)
        specs.append((table, arena, ids, np.empty(n, np.int64), np.empty(n, np.int64),
                      np.empty(n, np.int64), np.empty(n, np.uint32), offsets,
                      np.zeros(0, np.float32), offset, False, out, kind, s))
        outs.append(out)
    return specs, want, outs


def _pool(specs, threads):
    found = np.zeros((len(specs), 2), np.int64)
    probe_pool([sp[:13] for sp in specs], found, threads)
    return found


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_every_table_is_pooled_once_on_any_thread_count(threads):
    for n_tables in (2, 5, 17):
        specs, want, outs = _tables(n_tables, n_tables)
        for _ in range(3):  # (threads started once, woken again)
            for out in outs:
                out.fill(np.nan)
            found = _pool(specs, threads)
            assert (found[:, 1] == 0).all()
            for out, w in zip(outs, want, strict=True):
                assert np.array_equal(out, w)


def test_calls_from_several_python_threads_at_once():
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            specs, want, outs = _tables(6, seed)
            for _ in range(30):
                _pool(specs, 2)
                for out, w in zip(outs, want, strict=True):
                    assert np.array_equal(out, w)
                grads = [np.ones((40, DIM), np.float32) for _ in specs]
                sums = [np.empty((int(f), DIM), np.float32) for f in _pool(specs, 2)[:, 0]]
                finite = np.zeros(len(specs), np.uint8)
                sum_tables([(sp[4], sp[7], sp[8], False, g, s)
                            for sp, g, s in zip(specs, grads, sums, strict=True)], finite, 3)
                assert finite.all()
        except BaseException as e:  # (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and not errors, errors
