"""The ANN index's fresh segment, kept between queries and re-read only where written: with
every key fresh (so no answer depends on the graph search), approximate answers equal exact
ones through writes, deletes, keys written again and exclusions, for int64 and bytes keys."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import embstore

pytest.importorskip("usearch")
pytest.importorskip("pyarrow")

from embstore.service.ann import AnnIndex  # noqa: E402


@pytest.mark.parametrize("key_type", ["int64", "bytes"])
def test_answers_equal_exact_top_k_while_the_fresh_segment_is_kept(key_type):
    rng = np.random.default_rng(11)
    n, dim, k = 400, 8, 5

    def keys(ids):
        ids = np.asarray(ids)
        return ids if key_type == "int64" else np.array([b"k%05d" % i for i in ids], object)

    store = embstore.open("memory://", dim=dim, key_type=key_type)
    store.assign(keys(np.arange(n)), rng.standard_normal((n, dim), dtype=np.float32))
    guard = threading.RLock()
    ann = AnnIndex(store, guard, rebuild_at=1.0)   # no rebuild: the segment carries all
    with guard:
        ann.top_k(rng.standard_normal((1, dim), dtype=np.float32), k)
    store.assign(keys(np.arange(n)), rng.standard_normal((n, dim), dtype=np.float32))
    for step in range(8):
        touched = rng.choice(n, 30, replace=False)   # rewrites; deleted keys come back
        store.assign(keys(touched), rng.standard_normal((30, dim), dtype=np.float32))
        store.delete(keys(rng.choice(n, 5, replace=False)))
        q = rng.standard_normal((6, dim), dtype=np.float32)
        exclude = None if step % 2 else [keys(rng.choice(n, 3, replace=False))
                                         for _ in range(6)]
        for _ in range(2):      # the second query reads nothing again
            with guard:
                got = ann.top_k(q, k, exclude)
                want = store.top_k(q, k, exclude)
            assert got.keys.tolist() == want.keys.tolist()
            np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5, atol=1e-5)
    assert ann.builds == 1
