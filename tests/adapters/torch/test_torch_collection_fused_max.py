"""Max-pooled features of a ``DynamicEmbeddingBagCollection`` on the fused path: one
``pool_bags(mode="max")`` call per such table inside the collection's one autograd node (the
sum and mean tables beside them keep the table-parallel calls), with the bits of the general
path: outputs, every record field but the wall-clock stamps, and the counters."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.optim import SGD, Adagrad, Adam

torch = pytest.importorskip("torch")
from embstore_torch import DynamicEmbeddingBagCollection, KeyedJagged  # noqa: E402

from .same_tables import assert_same_tables, train_collection  # noqa: E402

DIMS = {"user": 8, "item": 40, "tag": 8, "genre": 4}
OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1),
    "adagrad-rowwise": lambda: Adagrad(lr=0.1, rowwise=True),
    "adam": lambda: Adam(lr=0.01),
}
POOLINGS = {
    "all max": "max",
    "mixed": {"user": "max", "item": "max", "tag": "sum", "genre": "mean"},
    "one max": {"user": "sum", "item": "max", "tag": "sum", "genre": "sum"},
}


def _batches(steps: int = 4, seed: int = 0) -> list[KeyedJagged]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(steps):
        # bags of 0-5 ids (empty bags included), repeats within a bag (ties of one row)
        bags = {f: [list(rng.zipf(1.3, rng.integers(0, 6)) % (20 * (i + 1)))
                    for _ in range(12)] for f in DIMS}
        out.append(KeyedJagged.from_dict(bags))
    return out


def _train(fused: bool, opt: str, pooling, value_dtype: str = "float32", threads: int = 1):
    # (16-bit rows round to nearest: test_torch_bag_fused_optimizers.py's collection case)
    tables = {f: embstore.open("memory://", dim=d, seed=len(f), optimizer=OPTIMIZERS[opt](),
                               value_dtype=value_dtype, stochastic_rounding=False)
              for f, d in DIMS.items()}
    coll = DynamicEmbeddingBagCollection(tables, pooling=pooling)
    coll.use_fused_path = fused
    outs, nodes = train_collection(coll, _batches(), threads)
    return tables, outs, nodes


def _same(a, b) -> None:
    a_tables, a_outs, a_nodes = a
    b_tables, b_outs, b_nodes = b
    assert set(a_nodes) == {"FusedTablesBackward"}  # one node for every table, max ones too
    assert "FusedTablesBackward" not in b_nodes
    for x, y in zip(a_outs, b_outs, strict=True):
        assert torch.equal(x, y)
    assert_same_tables(a_tables, b_tables)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("pooling", sorted(POOLINGS))
@pytest.mark.parametrize("threads", [1, 2])
def test_max_features_train_fused_with_the_general_paths_bits(opt, pooling, threads):
    _same(_train(True, opt, POOLINGS[pooling], threads=threads),
          _train(False, opt, POOLINGS[pooling]))


def test_bfloat16_max_features_train_fused_with_the_general_paths_bits():
    _same(_train(True, "adagrad-rowwise", POOLINGS["mixed"], "bfloat16"),
          _train(False, "adagrad-rowwise", POOLINGS["mixed"], "bfloat16"))


def test_a_max_feature_takes_one_store_call_the_others_the_table_parallel_ones(monkeypatch):
    tables = {f: embstore.open("memory://", dim=d, optimizer=SGD(lr=0.1))
              for f, d in DIMS.items()}
    calls: list[str] = []
    for name, store in tables.items():
        pool = store.pool_bags

        def spy(*args, _pool=pool, _name=name, **kwargs):
            calls.append(f"{_name}:{kwargs.get('mode')}")
            return _pool(*args, **kwargs)

        monkeypatch.setattr(store, "pool_bags", spy)
    coll = DynamicEmbeddingBagCollection(tables, pooling=POOLINGS["mixed"])
    coll(_batches(1)[0]).values().sum().backward()
    assert sorted(calls) == ["item:max", "user:max"]  # sum and mean: one native call


def test_nan_and_signed_zero_rows_pool_as_torch_does_in_the_collection():
    rows = np.array([[np.nan, -0.0, 1.0, -2.0], [0.5, 0.0, 1.0, np.nan],
                     [-1.0, 0.0, 3.0, -2.0]], dtype=np.float32)
    tables = {f: embstore.open("memory://", dim=4, optimizer=SGD(lr=0.1), initializer="zeros")
              for f in ("a", "b")}
    for s in tables.values():
        s.lookup(np.arange(3))
        recs, _ = s.get_records(np.arange(3))
        recs["vector"] = rows
        s.load_records([(np.arange(3), recs)])  # (assign refuses NaN: whole records)
    coll = DynamicEmbeddingBagCollection(tables, pooling="max")
    bags = [[0, 1, 2], [1, 0], [2, 2, 1], []]
    got = coll(KeyedJagged.from_dict({"a": bags, "b": bags[::-1]})).values().detach()
    ids = torch.tensor([i for b in bags for i in b])
    offsets = torch.tensor([0, 3, 5, 8])
    want = torch.nn.functional.embedding_bag(ids, torch.from_numpy(rows), offsets, mode="max")
    flip = torch.nn.functional.embedding_bag(
        torch.tensor([i for b in bags[::-1] for i in b]), torch.from_numpy(rows),
        torch.tensor([0, 0, 3, 5]), mode="max")
    assert torch.equal(torch.nan_to_num(got[:, :4], nan=7.0), torch.nan_to_num(want, nan=7.0))
    assert torch.equal(torch.signbit(got[:, :4]), torch.signbit(want))
    assert torch.equal(torch.nan_to_num(got[:, 4:], nan=7.0), torch.nan_to_num(flip, nan=7.0))
