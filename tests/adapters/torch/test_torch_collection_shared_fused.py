"""A ``DynamicEmbeddingBagCollection`` whose features all share one table (the
recommendation shape) pools every feature's bags in one fused call (a ``FusedBag`` node, as a
``DynamicEmbeddingBag`` over all of them) and trains the bits of its general path: outputs,
every record field and the store's counters; inputs the fused call does not cover keep the
general path."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import embstore
from embstore.optim import SGD, Adagrad

torch = pytest.importorskip("torch")
from embstore_torch import DynamicEmbeddingBagCollection, KeyedJagged  # noqa: E402

from .same_tables import assert_same_tables, train_collection  # noqa: E402
from .test_torch_collection_fused import OPTIMIZERS  # noqa: E402  (the same four rules)

FIELDS = ["user", "movie", "genre"]
DIM = 8


def _batches(single: bool, weighted: bool = False, steps: int = 5, seed: int = 0,
             fields: list[str] = FIELDS) -> list[KeyedJagged]:
    """Feature-major batches of 12 samples: one id per bag (``single``) or bags of 0-4 ids,
    Zipf ids over a growing range (new keys every step, repeats within and across features)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(steps):
        lengths = np.ones(len(fields) * 12, np.int64) if single else rng.integers(
            0, 5, len(fields) * 12)
        ids = torch.from_numpy(rng.zipf(1.3, int(lengths.sum())) % (25 * (i + 1)))
        w = torch.from_numpy(rng.random(len(ids), dtype=np.float32)) if weighted else None
        out.append(KeyedJagged(fields, ids, torch.from_numpy(lengths), weights=w))
    return out


def _graph(out: torch.Tensor) -> set[str]:
    """The names of the autograd nodes behind ``out``."""
    nodes, todo = set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and type(fn).__name__ not in nodes:
            nodes.add(type(fn).__name__)
            todo.extend(f for f, _ in fn.next_functions)
    return nodes


def _train(fused: bool, opt: str, pooling: str, batches: list, url: str = "memory://",
           **opts: object):
    """``(tables, outputs, node names)`` of training a shared-table collection on
    ``batches`` against a fixed head (``train_collection``'s loss)."""
    store = embstore.open(url, dim=DIM, seed=5, optimizer=OPTIMIZERS[opt](), **opts)
    coll = DynamicEmbeddingBagCollection({"t": store}, dict.fromkeys(FIELDS, "t"),
                                         pooling=pooling)
    coll.use_fused_path = fused
    outs, nodes = [], set()
    head = torch.linspace(-1, 1, len(FIELDS) * DIM)
    for kj in batches:
        values = coll(kj).values()
        nodes |= _graph(values)
        outs.append(values.detach().clone())
        (values * head).square().sum().backward()
    return {"t": store}, outs, nodes


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("single,pooling,weighted", [
    (True, "sum", False), (False, "sum", False), (False, "mean", False), (False, "sum", True)])
def test_a_shared_table_pools_every_feature_in_one_fused_call_with_the_general_bits(
        opt, single, pooling, weighted):
    batches = _batches(single, weighted)
    a, a_outs, a_nodes = _train(True, opt, pooling, batches)
    b, b_outs, b_nodes = _train(False, opt, pooling, batches)
    # one fused node (then torch's transpose into the output) against the general bridges
    assert "FusedBagBackward" in a_nodes and not a_nodes & {"StoreGatherBackward",
                                                             "StoreBagBackward"}
    assert "FusedBagBackward" not in b_nodes
    for x, y in zip(a_outs, b_outs, strict=True):
        assert torch.equal(x, y)
    assert_same_tables(a, b)


def test_the_fused_call_is_one_store_pooling_per_step(monkeypatch):
    store = embstore.open("memory://", dim=DIM, optimizer=SGD(lr=0.1))
    coll = DynamicEmbeddingBagCollection({"t": store}, dict.fromkeys(FIELDS, "t"))
    calls = {"pool": 0, "update": 0}
    for name, key in (("pool_bags", "pool"), ("update_bags", "update")):
        real = getattr(type(store), name)

        def spy(self, *a, _real=real, _key=key, **k):
            calls[_key] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(type(store), name, spy)
    outs, _ = train_collection(coll, _batches(False))
    assert calls == {"pool": 5, "update": 5}
    assert outs[0].shape == (12, len(FIELDS) * DIM)


def test_a_shared_table_on_a_cached_lmdb_store_trains_fused_with_the_general_bits(tmp_path):
    urls = (f"lmdb://{tmp_path}/a", f"lmdb://{tmp_path}/b")
    batches = _batches(False)
    a, a_outs, _ = _train(True, "adagrad", "sum", batches, urls[0], cache="memory://",
                          cache_capacity=40)
    b, b_outs, _ = _train(False, "adagrad", "sum", batches, urls[1], cache="memory://",
                          cache_capacity=40)
    assert a["t"].fused_bags()
    for x, y in zip(a_outs, b_outs, strict=True):
        assert torch.equal(x, y)
    keys = np.arange(200, dtype=np.int64)
    (ra, fa), (rb, fb) = a["t"].get_records(keys), b["t"].get_records(keys)
    assert np.array_equal(fa, fb) and fa.sum() > 40  # more rows than the cache holds
    for name in ra.dtype.names:
        if name not in ("version", "last_seen"):
            assert np.array_equal(ra[fa][name], rb[fb][name]), name
    for s in (a["t"], b["t"]):
        s.close()


def _general_nodes(coll: DynamicEmbeddingBagCollection, kj: KeyedJagged) -> set[str]:
    """The autograd nodes of ``coll``'s output on ``kj``, and its backward run."""
    out = coll(kj).values()
    nodes = _graph(out)
    out.sum().backward()
    return nodes


@pytest.mark.parametrize("case", ["input order", "namespaces", "two poolings", "max"])
def test_inputs_the_fused_call_does_not_cover_keep_the_general_path(case):
    store = embstore.open("memory://", dim=DIM, optimizer=SGD(lr=0.1))
    pooling: object = {"user": "sum", "movie": "mean", "genre": "sum"} if case == "two poolings" \
        else ("max" if case == "max" else "sum")
    coll = DynamicEmbeddingBagCollection(
        {"t": store}, dict.fromkeys(FIELDS, "t"), pooling=pooling,  # type: ignore[arg-type]
        namespaces={"user": 1, "movie": 2} if case == "namespaces" else None)
    fields = FIELDS[::-1] if case == "input order" else FIELDS
    nodes = _general_nodes(coll, _batches(False, fields=fields)[0])
    assert "FusedBagBackward" not in nodes


def test_the_fused_call_is_taken_and_a_bytes_table_keeps_the_general_path():
    ints = embstore.open("memory://", dim=DIM, optimizer=SGD(lr=0.1))
    coll = DynamicEmbeddingBagCollection({"t": ints}, dict.fromkeys(FIELDS, "t"))
    assert "FusedBagBackward" in _general_nodes(coll, _batches(False)[0])
    strs = embstore.open("memory://", dim=DIM, key_type="bytes", optimizer=SGD(lr=0.1))
    coll = DynamicEmbeddingBagCollection({"t": strs}, dict.fromkeys(FIELDS, "t"))
    keys = [f"k{i}".encode() for i in itertools.islice(itertools.cycle(range(7)), 36)]
    kj = KeyedJagged(FIELDS, np.array(keys, dtype=object), lengths=np.ones(36, np.int64))
    assert "FusedBagBackward" not in _general_nodes(coll, kj)
    assert len(strs) == 7


def test_a_no_grad_forward_keeps_the_general_path_and_writes_nothing():
    store = embstore.open("memory://", dim=DIM, optimizer=SGD(lr=0.1))
    coll = DynamicEmbeddingBagCollection({"t": store}, dict.fromkeys(FIELDS, "t"))
    kj = _batches(False, steps=1)[0]
    train_collection(coll, [kj])
    keys = np.unique(kj.values().numpy())
    before = store.get_records(keys)[0]["vector"].copy()
    with torch.no_grad():
        out = coll(kj).values()
    assert out.grad_fn is None
    assert np.array_equal(store.get_records(keys)[0]["vector"], before)
    coll.use_fused_path = False
    with torch.no_grad():
        assert torch.equal(coll(kj).values(), out)


def test_a_double_collection_gets_double_outputs_with_the_general_bits():
    outs, tables = [], []
    for fused in (True, False):
        store = embstore.open("memory://", dim=DIM, seed=5, optimizer=SGD(lr=0.1))
        coll = DynamicEmbeddingBagCollection({"t": store}, dict.fromkeys(FIELDS, "t")).double()
        coll.use_fused_path = fused
        got = []
        for kj in _batches(False, steps=3):
            values = coll(kj).values()
            assert values.dtype == torch.float64
            assert ("FusedBagBackward" in _graph(values)) == fused
            got.append(values.detach().clone())
            values.square().sum().backward()
        outs.append(got)
        tables.append({"t": store})
    for x, y in zip(*outs, strict=True):
        assert torch.equal(x, y)
    assert_same_tables(*tables)


def test_a_feature_without_ids_pools_zeros_as_the_general_path_does():
    lengths = np.array([1, 2, 0, 1] + [0] * 4 + [3, 0, 1, 1], dtype=np.int64)  # movie: no ids
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 2], dtype=torch.int64)
    outs, tables = [], []
    for fused in (True, False):
        store = embstore.open("memory://", dim=DIM, seed=5, optimizer=Adagrad(lr=0.1))
        coll = DynamicEmbeddingBagCollection({"t": store}, dict.fromkeys(FIELDS, "t"))
        coll.use_fused_path = fused
        values = coll(KeyedJagged(FIELDS, ids, torch.from_numpy(lengths))).values()
        assert ("FusedBagBackward" in _graph(values)) == fused
        values.square().sum().backward()
        outs.append(values.detach())
        tables.append({"t": store})
    assert torch.equal(outs[0], outs[1])
    assert not outs[0][:, DIM:2 * DIM].any()
    assert_same_tables(*tables)
