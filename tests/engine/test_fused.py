"""The fused bag path (``store.pool_bags`` / ``update_bags``, ``embstore::fused_bag``) gives
the rows, outputs and counters of the unfused path, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.errors import InvalidInputError
from embstore.optim import SGD, Adagrad, Adam
from embstore.policies import EventClock

torch = pytest.importorskip("torch")
from embstore_torch import DynamicEmbeddingBag  # noqa: E402

DIM = 8
KEYS = np.arange(300, dtype=np.int64)
OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1),
    "adagrad": lambda: Adagrad(lr=0.1, initial_accumulator_value=0.1),
    "adagrad-rowwise": lambda: Adagrad(lr=0.1, rowwise=True),
    "adam": lambda: Adam(lr=0.01),  # no in-place kernel: the general update, fused forward
}
STAT_NAMES = ("lookups", "hits", "misses", "inserts", "updates")


def _batches(kind: str, steps: int = 6, seed: int = 0):
    """(ids, offsets, weights) per step: Zipf-like ids (repeats, new keys every step)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(steps):
        if kind == "2d":
            ids = rng.zipf(1.3, (32, 4)) % (50 * (i + 1))
            out.append((torch.from_numpy(ids), None, None))
        else:  # ragged bags, some empty, with weights for "weighted"
            lengths = rng.integers(0, 6, 24)
            n = int(lengths.sum())
            ids = torch.from_numpy(rng.zipf(1.3, n) % (50 * (i + 1)))
            offs = torch.from_numpy(np.concatenate(([0], np.cumsum(lengths)[:-1])))
            w = torch.from_numpy(rng.random(n, dtype=np.float32)) if kind == "weighted" else None
            out.append((ids, offs, w))
    return out


def _train(fused: bool, opt: str, mode: str, kind: str, count: bool = True,
           custom_op: bool = False, **store_kw):
    store = embstore.open("memory://", dim=DIM, seed=3, optimizer=OPTIMIZERS[opt](),
                          **store_kw)
    module = DynamicEmbeddingBag(store, mode=mode, count=count)
    module.use_fused_path, module.fused_custom_op = fused, custom_op
    head = torch.arange(DIM, dtype=torch.float32) - 3.5
    outs = []
    for ids, offs, w in _batches(kind):
        out = module(ids, offs, per_sample_weights=w)
        outs.append(out.detach().clone())
        (out * head).square().sum().backward()
    recs, found = store.get_records(KEYS)
    return store, outs, recs[found], KEYS[found]


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mode,kind", [("sum", "2d"), ("mean", "2d"), ("sum", "ragged"),
                                       ("mean", "ragged"), ("sum", "weighted")])
@pytest.mark.parametrize("custom_op", [False, True])
def test_fused_bags_train_the_same_bits_as_the_unfused_path(opt, mode, kind, custom_op):
    a_store, a_out, a_recs, a_keys = _train(True, opt, mode, kind, custom_op=custom_op)
    b_store, b_out, b_recs, b_keys = _train(False, opt, mode, kind)
    assert a_store.fused_bags()
    for x, y in zip(a_out, b_out, strict=True):
        assert torch.equal(x, y)
    assert np.array_equal(a_keys, b_keys)
    for name in a_recs.dtype.names:
        if name not in ("version", "last_seen"):  # wall-clock stamps
            assert np.array_equal(a_recs[name], b_recs[name]), name
    a_stats, b_stats = a_store.stats(), b_store.stats()
    assert {k: a_stats[k] for k in STAT_NAMES} == {k: b_stats[k] for k in STAT_NAMES}
    assert a_store.step == b_store.step


def test_count_false_and_stamps_are_written_as_unfused():
    clock = EventClock(1000.0)
    a = _train(True, "adagrad-rowwise", "sum", "2d", count=False, clock=clock)
    b = _train(False, "adagrad-rowwise", "sum", "2d", count=False, clock=clock)
    assert (a[2]["count"] == 0).all()
    for name in ("count", "last_step", "last_seen", "vector", "accum"):
        assert np.array_equal(a[2][name], b[2][name]), name
    assert (a[2]["version"] > 0).all()


def test_an_id_evicted_between_forward_and_backward_is_written_back_as_unfused():
    outs = []
    for fused in (True, False):
        store = embstore.open("memory://", dim=DIM, seed=1, optimizer=SGD(lr=0.5))
        module = DynamicEmbeddingBag(store, mode="sum")
        module.use_fused_path = fused
        ids = torch.tensor([[1, 2], [2, 3]])
        out = module(ids)
        store.delete([2])  # gone before the backward: the update recreates it
        out.sum().backward()
        recs, found = store.get_records([1, 2, 3])
        outs.append((recs["vector"], recs["count"], found, store.stats()["inserts"]))
    a, b = outs
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert a[2].all() and a[3] == b[3]


def test_pool_bags_equals_lookup_and_embedding_bag_and_counts_the_same():
    a = embstore.open("memory://", dim=DIM, seed=5)
    b = embstore.open("memory://", dim=DIM, seed=5)
    a.lookup([7, 8])
    b.lookup([7, 8])
    ids = np.array([7, 9, 9, 8, 10, 7], dtype=np.int64)
    offs = np.array([0, 2, 2, 5])
    pooled, batch = a.pool_bags(ids, offs, mean=True)
    assert list(batch.uniq) == [7, 9, 8, 10] and list(batch.counts) == [2, 2, 1, 1]
    uniq, inv = np.unique(ids, return_inverse=True)
    vecs = torch.from_numpy(b.lookup(uniq))
    ref = torch.nn.functional.embedding_bag(torch.from_numpy(inv), vecs, torch.from_numpy(offs),
                                            mode="mean")
    assert torch.equal(torch.from_numpy(pooled), ref)
    assert (pooled[1] == 0).all()  # an empty bag
    sa, sb = a.stats(), b.stats()
    assert {k: sa[k] for k in STAT_NAMES} == {k: sb[k] for k in STAT_NAMES}


def test_pool_bags_checks_its_input():
    store = embstore.open("memory://", dim=DIM)
    with pytest.raises(InvalidInputError):
        store.pool_bags(np.array([1.5, 2.0]), np.array([0]))
    with pytest.raises(InvalidInputError):
        store.pool_bags(np.array([1, 2]), np.array([1]))  # must start at 0
    with pytest.raises(InvalidInputError):
        store.pool_bags(np.array([1, 2]), np.array([0, 3]))  # beyond the input
    with pytest.raises(InvalidInputError):
        store.pool_bags(np.array([[1, 2]]), np.array([0]))  # 2-D takes no offsets
    with pytest.raises(InvalidInputError):
        store.pool_bags(np.array([1, 2]), np.array([0]), weights=np.ones(2), mean=True)
    pooled, batch = store.pool_bags(np.array([[1, 2]]))
    with pytest.raises(InvalidInputError):
        store.update_bags(batch, np.ones((2, DIM), dtype=np.float32))  # one bag, two rows
    with pytest.raises(InvalidInputError):
        store.update_bags(batch, np.full((1, DIM), np.nan, dtype=np.float32))
    assert store.stats()["updates"] == 0


@pytest.mark.parametrize("kw", [{"admission": embstore.policies.FrequencyCutoff(2),
                                 "cache": "memory://"},  # (memory:// alone keeps admission)
                                {"key_type": "bytes"}])
def test_stores_the_fused_path_does_not_cover_fall_back(kw, tmp_path):
    url = f"lmdb://{tmp_path}/t" if "cache" in kw else "memory://"
    store = embstore.open(url, dim=DIM, **kw)
    assert not store.fused_bags()
    if kw.get("key_type"):
        return
    assert store.pool_bags(np.array([[1, 2]])) is None
    module = DynamicEmbeddingBag(store, mode="sum")
    module(torch.tensor([[1, 2], [2, 2]])).sum().backward()  # the unfused path
    assert store.stats()["updates"] > 0


def test_a_store_with_an_observer_falls_back(tmp_path):
    store = embstore.open("memory://", dim=DIM)
    assert store.fused_bags()
    store.lookup(np.arange(10))
    store.sample(np.array([1]), 3)  # builds the sampling index: an observer of writes
    if store.fused_bags():
        pytest.skip("sampling registers no observer on this store")
    assert store.pool_bags(np.array([[1, 2]])) is None


def test_rowwise_adagrad_in_place_matches_the_numpy_step():
    """``update`` of a row-wise Adagrad store now runs in place on memory://: same bits as
    the optimizer's numpy step on the records."""
    opt = Adagrad(lr=0.3, rowwise=True, initial_accumulator_value=0.2)
    store = embstore.open("memory://", dim=DIM, optimizer=opt)
    keys = np.arange(40)
    rng = np.random.default_rng(1)
    store.lookup(keys)
    for _ in range(3):
        recs, _ = store.get_records(keys)
        g = rng.standard_normal((40, DIM)).astype(np.float32)
        opt.apply(recs, g, 0)
        store.update(keys, g)
        got, _ = store.get_records(keys)
        assert np.array_equal(got["vector"], recs["vector"])
        assert np.array_equal(got["accum"], recs["accum"])


def test_gradient_slices_of_a_concatenated_output_give_the_same_bits():
    """Several tables concatenated (the usual model): each table's gradient is a strided
    slice, read in place by the fused backward."""
    results = []
    for fused in (True, False):
        stores = [embstore.open("memory://", dim=DIM, seed=i,
                                optimizer=Adagrad(lr=0.1, rowwise=True)) for i in range(3)]
        mods = [DynamicEmbeddingBag(s, mode="mean") for s in stores]
        for m in mods:
            m.use_fused_path = fused
        head = torch.linspace(-1, 1, 3 * DIM)
        for ids, _, _ in _batches("2d", steps=4):
            out = torch.cat([m(ids + 7 * i) for i, m in enumerate(mods)], dim=1)
            (out * head).square().sum().backward()
        results.append([s.get_records(np.arange(400))[0] for s in stores])
    for a, b in zip(*results, strict=True):
        assert np.array_equal(a["vector"], b["vector"]) and np.array_equal(a["accum"], b["accum"])


@pytest.mark.parametrize("eviction", ["lfu", "lru"])
def test_capacity_eviction_sees_the_same_rows(eviction):
    """Inserts by the fused forward trigger capacity eviction as the lookup does."""
    kw = {"capacity": 60, "eviction": eviction, "clock": EventClock(50.0)}
    a = _train(True, "adagrad-rowwise", "sum", "ragged", **kw)
    b = _train(False, "adagrad-rowwise", "sum", "ragged", **kw)
    assert np.array_equal(a[3], b[3])  # the same keys survived
    assert len(a[3]) < 100
    for name in ("vector", "accum", "count", "last_step"):
        assert np.array_equal(a[2][name], b[2][name]), name
    sa, sb = a[0].stats(), b[0].stats()
    assert {k: sa[k] for k in (*STAT_NAMES, "deletes")} == {k: sb[k] for k in
                                                           (*STAT_NAMES, "deletes")}


@pytest.mark.parametrize("dim", [1, 31, 32, 40, 64, 100])
@pytest.mark.parametrize("mode", ["sum", "mean", "weighted"])
@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16", "float16"])
def test_pooling_every_width_equals_embedding_bag(dim, mode, value_dtype):
    # the kernel sums ES_BLOCK columns at a time in registers and the rest in one loop: both,
    # and widths below one block, give torch's bits
    a = embstore.open("memory://", dim=dim, seed=2, value_dtype=value_dtype)
    rng = np.random.default_rng(dim)
    lengths = rng.integers(0, 9, 200)
    ids = rng.zipf(1.2, int(lengths.sum())).astype(np.int64) % 500
    offs = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    w = rng.standard_normal(len(ids)).astype(np.float32) if mode == "weighted" else None
    pooled, batch = a.pool_bags(ids, offs, weights=w, mean=mode == "mean")
    vecs = torch.from_numpy(a.lookup(batch.uniq).astype(np.float32))
    ref = torch.nn.functional.embedding_bag(
        torch.from_numpy(batch.inv), vecs, torch.from_numpy(offs),
        mode="mean" if mode == "mean" else "sum",
        per_sample_weights=None if w is None else torch.from_numpy(w))
    assert torch.equal(torch.from_numpy(pooled), ref)
