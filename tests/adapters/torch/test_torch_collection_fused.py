"""``DynamicEmbeddingBagCollection``'s fused path (``_fused_tables.py``): every table pooled
into its columns of one output under one autograd node, with the bits of the general path."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.errors import ReadOnlyError
from embstore.optim import SGD, Adagrad, Adam

torch = pytest.importorskip("torch")
from embstore_torch import DynamicEmbeddingBagCollection, KeyedJagged, _fused_tables  # noqa: E402

from .same_tables import assert_same_tables, train_collection  # noqa: E402

DIMS = {"user": 8, "item": 4, "tag": 8}
OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1),
    "adagrad": lambda: Adagrad(lr=0.1, initial_accumulator_value=0.1),
    "adagrad-rowwise": lambda: Adagrad(lr=0.1, rowwise=True),
    "adam": lambda: Adam(lr=0.01),  # fused forward, the general update
}


def _batches(steps: int = 4, weighted: bool = False, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(steps):
        bags = {f: [list(rng.zipf(1.3, rng.integers(0, 5)) % (20 * (i + 1)))
                    for _ in range(12)] for f in DIMS}
        kj = KeyedJagged.from_dict(bags)
        w = None
        if weighted:
            w = torch.from_numpy(rng.random(len(kj.values()), dtype=np.float32))
            kj = KeyedJagged(kj.keys(), kj.values(), kj.lengths(), weights=w)
        out.append(kj)
    return out


def _train(fused: bool, opt: str, pooling: str, weighted: bool = False, threads: int = 1):
    tables = {f: embstore.open("memory://", dim=d, seed=len(f), optimizer=OPTIMIZERS[opt]())
              for f, d in DIMS.items()}
    coll = DynamicEmbeddingBagCollection(tables, pooling=pooling)
    coll.use_fused_path = fused
    outs, nodes = train_collection(coll, _batches(weighted=weighted), threads)
    return tables, outs, nodes


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("mean", False), ("sum", True)])
def test_the_fused_collection_trains_the_bits_of_the_general_path(opt, pooling, weighted):
    a_tables, a_outs, a_nodes = _train(True, opt, pooling, weighted, threads=2)
    b_tables, b_outs, b_nodes = _train(False, opt, pooling, weighted)
    assert set(a_nodes) == {"FusedTablesBackward"}  # one node for every table
    assert "FusedTablesBackward" not in b_nodes
    for x, y in zip(a_outs, b_outs, strict=True):
        assert torch.equal(x, y)
    assert_same_tables(a_tables, b_tables)


def test_count_false_leaves_counts_alone():
    tables = {f: embstore.open("memory://", dim=d) for f, d in DIMS.items()}
    coll = DynamicEmbeddingBagCollection(tables, count=False)
    kj = _batches(1)[0]
    coll(kj).values().sum().backward()
    for s in tables.values():
        recs, found = s.get_records(np.arange(200))
        assert found.any() and not recs["count"][found].any()


@pytest.mark.parametrize("case", ["shared-table", "padding", "eval", "no-grad", "bytes-keys"])
def test_what_the_fused_collection_does_not_take_runs_the_general_path(case, monkeypatch):
    called = []
    monkeypatch.setattr(_fused_tables, "pool", lambda *a, **k: called.append(1))
    kw: dict = {}
    stores = {f: embstore.open("memory://", dim=8,
                               key_type="bytes" if case == "bytes-keys" else "int64")
              for f in DIMS}
    features = None
    if case == "shared-table":
        stores = {"shared": embstore.open("memory://", dim=8)}
        features = dict.fromkeys(DIMS, "shared")
    if case == "padding":
        kw["padding_key"] = 0
    coll = DynamicEmbeddingBagCollection(stores, features, **kw)
    if case == "eval":
        coll.eval()
    kj = _batches(1)[0]
    if case == "bytes-keys":
        kj = KeyedJagged.from_dict({f: [["a", "b"], ["c"]] for f in DIMS})
    if case == "no-grad":
        with torch.no_grad():
            coll(kj)
    else:
        coll(kj)
    assert not called


def test_a_batch_without_ids_runs_backward_and_writes_nothing():
    tables = {f: embstore.open("memory://", dim=d) for f, d in DIMS.items()}
    coll = DynamicEmbeddingBagCollection(tables)
    kj = KeyedJagged.from_dict({f: [[] for _ in range(3)] for f in DIMS})
    out = coll(kj).values()
    assert out.shape == (3, sum(DIMS.values())) and not out.any()
    out.sum().backward()
    assert all(s.stats()["updates"] == 0 and len(s) == 0 for s in tables.values())


def test_a_store_made_read_only_before_the_backward_raises_in_it(tmp_path):
    tables = {f: embstore.open("memory://", dim=d) for f, d in DIMS.items()}
    coll = DynamicEmbeddingBagCollection(tables)
    out = coll(_batches(1)[0]).values()
    tables["item"].close()
    with pytest.raises((ReadOnlyError, embstore.errors.StoreClosedError)):
        out.sum().backward()
