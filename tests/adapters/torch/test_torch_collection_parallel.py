"""The table-parallel calls of ``DynamicEmbeddingBagCollection``'s fused path
(``_fused_tables.TABLE_PARALLEL``): the ``memory://`` tables of a step deduplicated, probed and
pooled in one native call and stepped in two, tables spread over native threads, with the bits
of one store call per table; stores that cannot take them keep their own calls."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import embstore
from embstore.engine import fused as engine_fused
from embstore.errors import InvalidInputError
from embstore.optim import SGD, Adagrad, Adam

torch = pytest.importorskip("torch")
from embstore_torch import DynamicEmbeddingBagCollection, KeyedJagged, _fused_tables  # noqa: E402

from .same_tables import assert_same_tables  # noqa: E402

DIMS = {"user": 8, "item": 4, "tag": 8, "geo": 16}
OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1),
    "adagrad": lambda: Adagrad(lr=0.1, initial_accumulator_value=0.1),
    "adagrad-rowwise": lambda: Adagrad(lr=0.1, rowwise=True),
    "adam": lambda: Adam(lr=0.01),
}


def _batches(steps: int, vocab_grows: bool, weighted: bool = False, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(steps):
        vocab = 30 * (i + 1) if vocab_grows else 30
        bags = {f: [list(rng.zipf(1.3, rng.integers(0, 6)) % vocab) for _ in range(40)]
                for f in DIMS}
        kj = KeyedJagged.from_dict(bags)
        if weighted:
            w = torch.from_numpy(rng.random(len(kj.values()), dtype=np.float32))
            kj = KeyedJagged(kj.keys(), kj.values(), kj.lengths(), weights=w)
        out.append(kj)
    return out


def _stores(opt: str, value_dtype: str = "float32", **opts):
    return {f: embstore.open("memory://", dim=d, seed=len(f), optimizer=OPTIMIZERS[opt](),
                             value_dtype=value_dtype, **opts.get(f, {}))
            for f, d in DIMS.items()}


def _train(parallel: bool, stores: dict, batches: list, threads: int, pooling: str = "sum",
           monkeypatch=None):
    coll = DynamicEmbeddingBagCollection(stores, pooling=pooling)
    outs = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    head = None
    try:
        if monkeypatch is not None:
            monkeypatch.setattr(_fused_tables, "TABLE_PARALLEL", parallel)
        for kj in batches:
            values = coll(kj).values()
            assert type(values.grad_fn).__name__ == "FusedTablesBackward"
            head = torch.linspace(-1, 1, values.shape[1]) if head is None else head
            outs.append(values.detach().clone())
            (values * head).square().sum().backward()
    finally:
        torch.set_num_threads(before)
    return outs


def _rows(store, keys) -> np.ndarray:
    return store.get_records(np.asarray(keys, dtype=np.int64))[0]["vector"].copy()


def _same_stores(a: dict, b: dict) -> None:
    assert_same_tables(a, b)
    for f in DIMS:
        assert a[f].step == b[f].step


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("pooling,weighted,vocab_grows",
                         [("sum", False, True), ("mean", False, False), ("sum", True, True)])
def test_the_table_parallel_calls_give_the_bits_of_one_call_per_table(
        threads, opt, pooling, weighted, vocab_grows, monkeypatch):
    batches = _batches(5, vocab_grows, weighted)
    a, b = _stores(opt), _stores(opt)
    outs_a = _train(True, a, batches, threads, pooling, monkeypatch)
    outs_b = _train(False, b, batches, 1, pooling, monkeypatch)
    for x, y in zip(outs_a, outs_b, strict=True):
        assert torch.equal(x, y)
    _same_stores(a, b)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_bfloat16_rows_give_the_same_bits_in_parallel(rounding, monkeypatch):
    batches = _batches(4, True)
    a = _stores("adagrad-rowwise", "bfloat16")
    b = _stores("adagrad-rowwise", "bfloat16")
    for s in (*a.values(), *b.values()):
        s.stochastic_rounding = rounding == "stochastic"
    for x, y in zip(_train(True, a, batches, 2, monkeypatch=monkeypatch),
                    _train(False, b, batches, 1, monkeypatch=monkeypatch), strict=True):
        assert torch.equal(x, y)
    _same_stores(a, b)


def test_the_memory_tables_go_through_one_native_call_each_way(monkeypatch):
    calls: list[tuple[str, int]] = []
    for name in ("probe_pool", "sum_tables", "step_tables"):
        real = getattr(engine_fused, name)

        def spy(tables, *args, _real=real, _name=name, **kw):
            calls.append((_name, len(tables)))
            return _real(tables, *args, **kw)
        monkeypatch.setattr(_fused_tables, name, spy)
    stores = _stores("adagrad")
    coll = DynamicEmbeddingBagCollection(stores)
    kj = _batches(1, False)[0]
    coll(kj).values().sum().backward()  # the first forward inserts: pooled one by one after
    coll(kj).values().sum().backward()  # every id known: pooled in the one call
    n = len(DIMS)
    assert calls == [("probe_pool", n), ("sum_tables", n), ("step_tables", n)] * 2


def test_keys_placed_between_a_forward_and_its_backward_leave_the_step_whole(monkeypatch):
    """A table whose keys changed between a forward and its backward (another caller placed
    keys, so the slots kept at the forward may not be used) steps through its own store call,
    the others as one call: the bits of one call per table."""
    from embstore.backends.memory import MemoryBackend

    deferred: list[bool | None] = []
    real = MemoryBackend.defer_bags

    def spy(self, *args, **kw):
        done = real(self, *args, **kw)
        deferred.append(done)
        return done
    monkeypatch.setattr(MemoryBackend, "defer_bags", spy)
    batches = _batches(3, True)
    trained = []
    for parallel in (True, False):
        monkeypatch.setattr(_fused_tables, "TABLE_PARALLEL", parallel)
        stores = _stores("adagrad")
        coll = DynamicEmbeddingBagCollection(stores)
        for i, kj in enumerate(batches):
            values = coll(kj).values()
            stores["item"].lookup(np.arange(1000 + 10 * i, 1010 + 10 * i))  # placed meanwhile
            values.square().sum().backward()
        trained.append(stores)
    _same_stores(*trained)
    assert deferred.count(None) == len(batches)  # the "item" table each step
    assert deferred.count(True) == (len(DIMS) - 1) * len(batches)


def test_stores_that_cannot_take_them_keep_their_own_calls(monkeypatch):
    """A store with an eviction capacity (its policy acts on rows after each update) steps
    on its own; the others together; the bits are the general path's either way."""
    tables: list[int] = []
    real = engine_fused.probe_pool
    monkeypatch.setattr(_fused_tables, "probe_pool",
                        lambda t, *a, **k: tables.append(len(t)) or real(t, *a, **k))
    batches = _batches(4, True)
    opts = {"geo": {"capacity": 50}}
    a, b = _stores("sgd", **opts), _stores("sgd", **opts)
    _train(True, a, batches, 2)
    coll = DynamicEmbeddingBagCollection(b)
    coll.use_fused_path = False
    head = None
    for kj in batches:
        values = coll(kj).values()
        head = torch.linspace(-1, 1, values.shape[1]) if head is None else head
        (values * head).square().sum().backward()
    assert tables and set(tables) == {len(DIMS) - 1}
    _same_stores(a, b)


def test_a_table_whose_gradient_is_not_finite_stops_the_step_there(monkeypatch):
    """As with one call per table: the tables before it are stepped, it raises, and it and
    the tables after it are unchanged; every store's lock is free again."""
    for parallel in (True, False):
        monkeypatch.setattr(_fused_tables, "TABLE_PARALLEL", parallel)
        stores = _stores("sgd")
        coll = DynamicEmbeddingBagCollection(stores)
        kj = _batches(1, False)[0]
        keys = np.unique(np.asarray(kj.values(), dtype=np.int64))
        values = coll(kj).values()
        before = {f: _rows(s, keys) for f, s in stores.items()}
        scale = torch.ones(values.shape[1])
        scale[DIMS["user"]:DIMS["user"] + DIMS["item"]] = float("inf")  # the item table
        with pytest.raises(InvalidInputError, match="NaN or inf"):
            (values * scale).sum().backward()
        changed = {f: not np.array_equal(_rows(s, keys), before[f]) for f, s in stores.items()}
        assert changed == {"user": True, "item": False, "tag": False, "geo": False}, parallel
        assert [s.step for s in stores.values()] == [1, 0, 0, 0]
        _read_from_another_thread(stores, keys)  # every store's lock is free


def _read_from_another_thread(stores: dict, keys: np.ndarray) -> None:
    done = threading.Event()
    threading.Thread(target=lambda: [_rows(s, keys) for s in stores.values()]
                     and done.set()).start()
    assert done.wait(30)


def test_other_threads_using_the_stores_meanwhile_see_whole_steps():
    """The native calls hold each store's lock: another thread's updates of the same stores
    interleave between steps, never inside one (the final rows are the sum of both)."""
    stores = {f: embstore.open("memory://", dim=d, optimizer=SGD(lr=1.0))
              for f, d in DIMS.items()}
    coll = DynamicEmbeddingBagCollection(stores)
    kj = KeyedJagged.from_dict({f: [[1], [2], [3]] for f in DIMS})
    for s in stores.values():
        s.assign([1, 2, 3], np.zeros((3, s.dim), dtype=np.float32))
    stop = threading.Event()
    rounds = [0]

    def other():
        while not stop.is_set():
            for s in stores.values():
                s.update([1, 2, 3], np.full((3, s.dim), 1.0, dtype=np.float32))
            rounds[0] += 1

    t = threading.Thread(target=other)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    t.start()
    try:
        for _ in range(30):
            coll(kj).values().sum().backward()  # each row: -1.0 per step
    finally:
        stop.set()
        t.join()
        torch.set_num_threads(before)
    for s in stores.values():
        rows = _rows(s, [1, 2, 3])
        assert np.array_equal(rows, np.full_like(rows, -30.0 - rounds[0]))


def test_two_threads_stepping_collections_that_share_stores_in_other_orders():
    """Each step holds every store's lock: taken in one global order, so two collections over
    the same stores listed in opposite orders, trained from two threads, do not deadlock."""
    stores = {f: embstore.open("memory://", dim=d) for f, d in DIMS.items()}
    names = list(DIMS)
    colls = [DynamicEmbeddingBagCollection({f: stores[f] for f in order})
             for order in (names, names[::-1])]
    errors: list[BaseException] = []

    def train(coll, order):
        try:
            for _ in range(40):
                kj = KeyedJagged.from_dict({f: [[1, 2], [3]] for f in order})
                coll(kj).values().sum().backward()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=train, args=(c, o), daemon=True)
               for c, o in zip(colls, (names, names[::-1]), strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors
    assert all(s.step == 80 for s in stores.values())
