"""``DynamicEmbeddingBagCollection`` under ``torch.compile``: one ``embstore::fused_tables``
node for every table (its backward ``embstore::fused_tables_update``), the bits of the eager
fused path (sum, mean and max tables, mixed); inputs the op does not take still compile around
a graph break."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.optim import SGD, Adagrad

torch = pytest.importorskip("torch")
from embstore_torch import DynamicEmbeddingBagCollection, KeyedJagged  # noqa: E402

DIMS = {"user": 4, "item": 8, "tag": 4}


@pytest.fixture(autouse=True)
def _fresh_compiler():
    # each case's modules are new constants of the same step code: without a reset the cases
    # together would pass dynamo's recompile limit
    torch._dynamo.reset()


def _collection(value_dtype: str, pooling: dict[str, str]) -> DynamicEmbeddingBagCollection:
    stores = {name: embstore.open("memory://", dim=dim, seed=i, value_dtype=value_dtype,
                                  optimizer=Adagrad(lr=0.1, rowwise=True) if i else SGD(lr=0.2))
              for i, (name, dim) in enumerate(DIMS.items())}
    return DynamicEmbeddingBagCollection(stores, pooling=pooling)


def _batches(steps: int, weighted: bool):
    rng = np.random.default_rng(4)
    out = []
    for _ in range(steps):
        lengths = rng.integers(0, 4, 3 * 5)  # 5 samples, some bags empty
        values = torch.from_numpy(rng.integers(0, 30, int(lengths.sum())))
        w = torch.from_numpy(rng.random(len(values), dtype=np.float32)) if weighted else None
        # the features in another order than the collection's: the op maps them
        out.append(KeyedJagged(["tag", "user", "item"], values, torch.from_numpy(lengths),
                               weights=w))
    return out


MIXED = {"user": "max", "item": "sum", "tag": "max"}


def _run(compiled: bool, value_dtype: str = "float32", mode: str | dict[str, str] = "sum",
         weighted: bool = False, steps: int = 4):
    coll = _collection(value_dtype, mode if isinstance(mode, dict) else dict.fromkeys(DIMS, mode))
    torch.manual_seed(0)
    head = torch.nn.Linear(sum(DIMS.values()), 1)
    graphs: list[list[str]] = []

    def step(kj):
        return head(coll(kj).values()).pow(2).sum()

    def backend(gm, example_inputs):  # records each graph's ops, then runs it as it is
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    fn = torch.compile(step, backend=backend, fullgraph=True) if compiled else step
    losses = []
    for kj in _batches(steps, weighted):
        loss = fn(kj)
        loss.backward()
        losses.append(loss.item())
    recs = {}
    for name in DIMS:
        store = coll.embedding_bags[name].store
        r, found = store.get_records(np.arange(30))
        recs[name] = r[found]
    return losses, recs, graphs


@pytest.mark.parametrize("value_dtype,mode,weighted", [
    ("float32", "sum", False), ("float32", "mean", False), ("float32", "sum", True),
    ("bfloat16", "sum", False), ("float32", "max", False), ("float32", MIXED, False),
    ("bfloat16", MIXED, False)])
def test_a_compiled_collection_is_one_fused_op_with_the_eager_bits(value_dtype, mode, weighted):
    eager_losses, eager_recs, _ = _run(False, value_dtype, mode, weighted)
    losses, recs, graphs = _run(True, value_dtype, mode, weighted)
    for ops in graphs:  # (a graph per input shape the compiler saw)
        assert sum("embstore.fused_tables" in op for op in ops) == 1, ops
        assert not any("embstore.fused_bag" in op or "embstore.lookup" in op for op in ops)
    assert losses == eager_losses
    for name in DIMS:
        for field in eager_recs[name].dtype.names:
            if field not in ("version", "last_seen"):  # wall-clock stamps
                assert np.array_equal(recs[name][field], eager_recs[name][field]), (name, field)


def test_a_collection_the_op_does_not_take_still_compiles_around_a_graph_break():
    # two features sharing a table are not fused: the collection runs eagerly inside the
    # compiled step, and trains as the eager step does
    rows = []
    for compiled in (False, True):
        stores = {"user": embstore.open("memory://", dim=4, seed=1, optimizer=SGD(lr=0.2)),
                  "item": embstore.open("memory://", dim=8, seed=2, optimizer=SGD(lr=0.2))}
        coll = DynamicEmbeddingBagCollection(
            stores, features={"user": "user", "item": "item", "tag": "user"},
            pooling={"user": "max", "item": "sum", "tag": "sum"})
        torch.manual_seed(0)
        head = torch.nn.Linear(sum(DIMS.values()), 1)

        def step(kj, coll=coll, head=head):
            return head(coll(kj).values()).pow(2).sum()

        fn = torch.compile(step, backend="eager") if compiled else step
        for kj in _batches(2, False):
            fn(kj).backward()
        r, found = coll.embedding_bags["user"].store.get_records(np.arange(30))
        rows.append(r[found]["vector"])
    assert len(rows[0]) and np.array_equal(rows[0], rows[1])


@pytest.mark.parametrize("pooling", [dict.fromkeys(DIMS, "sum"), MIXED])
def test_a_forward_whose_batch_was_dropped_still_steps_every_table(pooling):
    # the op's backward finds each forward's batches by its ids; one it no longer holds is
    # grouped again from the ids (a max table's argmax from the op's second output), with the
    # same result
    from embstore_torch import _fused_tables

    kept = _run(True, mode=pooling, steps=2)[1]
    coll = _collection("float32", pooling)
    torch.manual_seed(0)
    head = torch.nn.Linear(sum(DIMS.values()), 1)
    fn = torch.compile(lambda kj: head(coll(kj).values()).pow(2).sum(), fullgraph=True,
                       backend="aot_eager")
    for kj in _batches(2, False):
        loss = fn(kj)
        _fused_tables._PARTS.clear()
        loss.backward()
    for name in DIMS:
        r, found = coll.embedding_bags[name].store.get_records(np.arange(30))
        assert np.array_equal(r[found]["vector"], kept[name]["vector"]), name
