"""The small-batch DynamicEmbedding step: raw string keys, one shared table, exact results."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import embstore  # noqa: E402
from embstore_torch import DynamicEmbedding  # noqa: E402
from embstore_torch._keys import prepare  # noqa: E402


@pytest.mark.parametrize("given", [
    ["b", "a", "b", "c"],
    np.array(["b", "a", "b", "c"], dtype=object),
    np.array(["b", "a", "b", "c"]),
])
def test_string_batches_dedupe_into_the_stores_key_form(given):
    """The distinct keys of a str batch are encoded once, into the object array of bytes the
    store takes as it is (its lookup and update then skip the per-key encoding)."""
    batch = prepare(given)
    assert isinstance(batch.uniq, np.ndarray) and batch.uniq.dtype == object
    assert batch.uniq.tolist() == [b"b", b"a", b"c"]
    assert batch.inv.tolist() == [0, 1, 0, 2]


def _train(make_input, steps: int = 6):
    rng = np.random.default_rng(0)
    store = embstore.open("memory://", dim=4, key_type="bytes",
                          optimizer=embstore.optim.Adagrad(lr=0.1))
    emb = DynamicEmbedding(store)
    w = torch.arange(4, dtype=torch.float32)
    for _ in range(steps):
        ids = rng.integers(0, 30, (16, 7))
        out = emb(make_input(ids))
        ((out * w).sum(-1) ** 2).mean().backward()
    keys, rows = zip(*((k, r) for ks, rs in store.records(4096)
                       for k, r in zip(ks.tolist(), rs, strict=True)), strict=True)
    order = np.argsort(np.array(keys, dtype=object).astype(bytes))
    recs = np.stack(rows)[order]
    # everything but the stamps taken from the wall clock (last_seen, version)
    recs = {f: recs[f].copy() for f in ("vector", "accum", "count", "last_step")}
    st = {k: v for k, v in store.stats().items() if isinstance(v, int) and k != "version"}
    store.close()
    return [keys[i] for i in order], recs, st


def test_str_list_bytes_array_and_str_array_inputs_train_identically():
    """Rows, optimizer slots, counts, steps and stats after the same steps are bit-identical
    whatever form the raw keys come in."""
    def as_str_lists(ids):
        return [[f"f{j}={v}" for j, v in enumerate(row)] for row in ids.tolist()]

    def as_bytes(ids):
        return np.array([[f"f{j}={v}".encode() for j, v in enumerate(row)]
                         for row in ids.tolist()], dtype=object)

    def as_str_array(ids):
        return np.array(as_str_lists(ids))

    ref_keys, ref_recs, ref_stats = _train(as_bytes)
    for make in (as_str_lists, as_str_array):
        keys, recs, stats = _train(make)
        assert keys == ref_keys
        for f, col in ref_recs.items():
            assert recs[f].tobytes() == col.tobytes(), f
        assert stats == ref_stats
