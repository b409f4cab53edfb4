"""``DynamicEmbeddingBag`` and ``DynamicEmbeddingBagCollection`` over a cache on LMDB take the
fused path (``FusedBag`` / ``FusedTables`` nodes, the cache's in-place step) and train the bits
of the unfused path: outputs, every record field, counters, and the rows LMDB holds after
close."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import embstore
from embstore.layers.cache import CachedBackend
from embstore.optim import SGD, Adagrad

torch = pytest.importorskip("torch")
from embstore_torch import (  # noqa: E402
    DynamicEmbeddingBag,
    DynamicEmbeddingBagCollection,
    KeyedJagged,
)

from .compiled_bags import train_bag  # noqa: E402

DIM = 8
DIMS = {"user": 8, "item": 4}
OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1),
    "adagrad": lambda: Adagrad(lr=0.1, initial_accumulator_value=0.1),
    "adagrad-rowwise": lambda: Adagrad(lr=0.1, rowwise=True),
}
KEYS = np.arange(400, dtype=np.int64)


@pytest.fixture
def lmdb_url(tmp_path):
    counter = itertools.count()
    return lambda: f"lmdb://{tmp_path}/t{next(counter)}"


@pytest.fixture
def general_updates(monkeypatch):
    """How often the cache ran the general update (``update_rows`` / ``modify``)."""
    calls = {"n": 0}
    for name in ("update_rows", "modify"):
        real = getattr(CachedBackend, name)

        def spy(self, *a, _real=real, **k):
            calls["n"] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(CachedBackend, name, spy)
    return calls


def _open(url: str, opt: str, value_dtype: str, dim: int = DIM, seed: int = 3):
    return embstore.open(url, dim=dim, seed=seed, optimizer=OPTIMIZERS[opt](),
                         value_dtype=value_dtype, stochastic_rounding=False,
                         cache="memory://", cache_capacity=48)


def _same(a_recs, b_recs) -> None:
    (ra, fa), (rb, fb) = a_recs, b_recs
    assert np.array_equal(fa, fb)
    for name in ra.dtype.names:
        if name not in ("version", "last_seen"):  # wall-clock stamps
            assert np.array_equal(ra[fa][name], rb[fb][name]), name


def _stats(store) -> dict:
    """Every counter but the wall-clock ``version`` and LMDB's ``size_bytes``: the unfused
    adapter groups ids in sorted order, the fused one in first-seen order, so rows reach the
    cache's slots (and LMDB's pages) in another order, with the same counts."""
    return {k: v for k, v in store.stats().items() if k not in ("version", "size_bytes")}


def _bag_batches(steps: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(steps):
        lengths = rng.integers(0, 6, 24)
        n = int(lengths.sum())
        ids = torch.from_numpy(rng.zipf(1.3, n) % (60 * (i + 1)))
        offs = torch.from_numpy(np.concatenate(([0], np.cumsum(lengths)[:-1])))
        w = torch.from_numpy(rng.random(n, dtype=np.float32)) if i % 3 == 2 else None
        out.append((ids, offs, w))
    return out


def _train_bag(url: str, fused: bool, opt: str, mode: str, value_dtype: str):
    store = _open(url, opt, value_dtype)
    module = DynamicEmbeddingBag(store, mode=mode)
    module.use_fused_path = fused
    head = torch.arange(DIM, dtype=torch.float32) - 3.5
    outs, nodes = [], []
    for ids, offs, w in _bag_batches():
        out = module(ids, offs, per_sample_weights=w if mode == "sum" else None)
        nodes.append(type(out.grad_fn).__name__)
        outs.append(out.detach().clone())
        (out * head).square().sum().backward()
    return store, outs, nodes


@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_a_bag_over_a_cached_lmdb_store_trains_fused_with_the_unfused_bits(
        lmdb_url, general_updates, opt, mode, value_dtype):
    urls = lmdb_url(), lmdb_url()
    b, b_outs, b_nodes = _train_bag(urls[1], False, opt, mode, value_dtype)
    unfused_calls = general_updates["n"]
    a, a_outs, a_nodes = _train_bag(urls[0], True, opt, mode, value_dtype)
    assert a.fused_bags() and set(a_nodes) == {"FusedBagBackward"}
    assert "FusedBagBackward" not in b_nodes and unfused_calls > 0
    assert general_updates["n"] == unfused_calls  # every fused step ran in place
    assert a.stats()["dirty_evictions"] > 0  # rows left the cache and were read back
    for x, y in zip(a_outs, b_outs, strict=True):
        assert torch.equal(x, y)
    _same(a.get_records(KEYS), b.get_records(KEYS))
    assert _stats(a) == _stats(b)
    a.close()
    b.close()
    plain = [embstore.open(u) for u in urls]  # what LMDB holds, no cache
    _same(plain[0].get_records(KEYS), plain[1].get_records(KEYS))
    for s in plain:
        s.close()


def _train_collection(urls: dict, fused: bool, opt: str, pooling: str, value_dtype: str):
    tables = {f: _open(urls[f], opt, value_dtype, dim=d, seed=len(f))
              for f, d in DIMS.items()}
    coll = DynamicEmbeddingBagCollection(tables, pooling=pooling)
    coll.use_fused_path = fused
    rng = np.random.default_rng(1)
    head = None
    outs, nodes = [], []
    for i in range(5):
        bags = {f: [list(rng.zipf(1.3, rng.integers(0, 5)) % (30 * (i + 1)))
                    for _ in range(12)] for f in DIMS}
        values = coll(KeyedJagged.from_dict(bags)).values()
        nodes.append(type(values.grad_fn).__name__)
        head = torch.linspace(-1, 1, values.shape[1]) if head is None else head
        outs.append(values.detach().clone())
        (values * head).square().sum().backward()
    return tables, outs, nodes


@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_a_collection_over_cached_lmdb_stores_trains_fused_with_the_unfused_bits(
        lmdb_url, opt, value_dtype):
    urls = [{f: lmdb_url() for f in DIMS} for _ in range(2)]
    a, a_outs, a_nodes = _train_collection(urls[0], True, opt, "sum", value_dtype)
    b, b_outs, b_nodes = _train_collection(urls[1], False, opt, "sum", value_dtype)
    assert set(a_nodes) == {"FusedTablesBackward"}  # every table pooled in place
    assert "FusedTablesBackward" not in b_nodes
    for x, y in zip(a_outs, b_outs, strict=True):
        assert torch.equal(x, y)
    for f in DIMS:
        _same(a[f].get_records(KEYS), b[f].get_records(KEYS))
        assert _stats(a[f]) == _stats(b[f]), f
        a[f].close()
        b[f].close()
    for f in DIMS:
        with embstore.open(urls[0][f]) as x, embstore.open(urls[1][f]) as y:
            _same(x.get_records(KEYS), y.get_records(KEYS))


def _compiled_run(url: str, compiled: bool, steps: int = 4):
    store = _open(url, "adagrad-rowwise", "float32")
    losses, ops = train_bag(DynamicEmbeddingBag(store, "sum"), compiled, 80, steps)
    return losses, store.get_records(KEYS), ops


def test_a_compiled_bag_over_a_cached_store_is_one_fused_op_with_the_eager_bits(lmdb_url):
    eager_losses, eager_recs, _ = _compiled_run(lmdb_url(), False)
    losses, recs, ops = _compiled_run(lmdb_url(), True)
    assert any("embstore.fused_bag" in op for op in ops), ops
    assert losses == eager_losses
    _same(recs, eager_recs)
