"""A store with an admission policy on the fused bag path: the forward asks the policy about
the batch's absent ids (as ``lookup`` asks, with their occurrences), places only the admitted
ones and pools the others' initial vectors; the backward steps the admitted and known ids in
one pass and drops the others' gradients. Trained side by side with the general path
(``use_fused_path = False``), the outputs, every record field but the wall-clock stamps, the
store's counters, the policy's counters and its state are the same bits."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.optim import SGD, Adagrad
from embstore.policies import BloomAdmission, FrequencyCutoff, ProbabilisticAdmission

torch = pytest.importorskip("torch")
from embstore_torch import (  # noqa: E402
    DynamicEmbedding,
    DynamicEmbeddingBag,
    DynamicEmbeddingBagCollection,
    KeyedJagged,
)

from .compiled_bags import train_bag  # noqa: E402

DIM = 8
KEYS = np.arange(200, dtype=np.int64)
COUNTERS = ("lookups", "hits", "misses", "inserts", "updates", "admission_rejected",
            "gradients_dropped", "rows")
POLICIES = {
    "cutoff2": lambda: FrequencyCutoff(2),
    "cutoff3": lambda: FrequencyCutoff(3, width=1024),
    "bloom": lambda: BloomAdmission(initial_capacity=1000),
    "bloom-grows": lambda: BloomAdmission(initial_capacity=16),  # grows inside batches
    "probabilistic": lambda: ProbabilisticAdmission(0.3, seed=5),
}
OPTIMIZERS = {"sgd": lambda: SGD(lr=0.1), "adagrad": lambda: Adagrad(lr=0.1)}


def _store(policy: str, opt: str = "sgd", value_dtype: str = "float32", seed: int = 1,
           **kw):
    return embstore.open("memory://", dim=DIM, seed=seed, optimizer=OPTIMIZERS[opt](),
                         value_dtype=value_dtype, stochastic_rounding=False,
                         admission=POLICIES[policy](), **kw)


def _spy(store, monkeypatch) -> dict[str, list]:
    """What the backend's fused calls answered, by name (none: the general path)."""
    backend = store.writer.backend
    calls: dict[str, list] = {"lookup_pool": [], "step_bags": []}
    for name, got in calls.items():
        real = getattr(backend, name)

        def spy(*args, _real=real, _got=got, **kwargs):
            _got.append(_real(*args, **kwargs))
            return _got[-1]

        monkeypatch.setattr(backend, name, spy)
    return calls


def _batches(steps: int = 6, n_bags: int = 20, seed: int = 0):
    """Bags of ids with repeats, new ids every step (empty bags among them)."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        lengths = rng.integers(0, 6, n_bags)
        n = int(lengths.sum())
        ids = np.where(rng.random(n) < 0.5, rng.zipf(1.4, n) % 40,
                       30 * step + rng.integers(0, 30, n))
        out.append((torch.from_numpy(ids.astype(np.int64)),
                    torch.from_numpy(np.concatenate(([0], np.cumsum(lengths)[:-1])))))
    return out


def _state(store) -> dict:
    """The records (but wall-clock stamps), counters and policy state of ``store``."""
    recs, found = store.get_records(KEYS)
    stats = store.stats()
    policy = store.writer.policy.admission
    return {"found": found, "recs": {n: recs[found][n].tobytes() for n in recs.dtype.names
                                     if n not in ("version", "last_seen")},
            "stats": {k: stats[k] for k in COUNTERS}, "policy": policy.state()}


def _assert_same(a: dict, b: dict) -> None:
    assert np.array_equal(a["found"], b["found"])
    for name in a["recs"]:
        assert a["recs"][name] == b["recs"][name], name
    assert a["stats"] == b["stats"]
    assert a["policy"] == b["policy"]


def _train_bag(fused: bool, policy: str, mode: str, opt: str, value_dtype: str, monkeypatch,
               weighted: bool = False, custom_op: bool = False, **store_kw):
    store = _store(policy, opt, value_dtype, **store_kw)
    calls = _spy(store, monkeypatch)
    module = DynamicEmbeddingBag(store, mode=mode)
    module.use_fused_path, module.fused_custom_op = fused, custom_op
    outs = []
    for ids, offsets in _batches():
        w = torch.linspace(0.5, 1.5, len(ids)) if weighted else None
        out = module(ids, offsets, w)
        outs.append(out.detach().numpy().tobytes())
        (out * torch.linspace(-1, 1, DIM)).square().sum().backward()
    return outs, _state(store), calls


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("opt,value_dtype", [("sgd", "float32"), ("adagrad", "float32"),
                                             ("sgd", "bfloat16"), ("adagrad", "bfloat16")])
def test_a_bag_with_admission_trains_fused_with_the_bits_of_the_general_path(
        policy, mode, opt, value_dtype, monkeypatch):
    a_outs, a, a_calls = _train_bag(True, policy, mode, opt, value_dtype, monkeypatch)
    b_outs, b, b_calls = _train_bag(False, policy, mode, opt, value_dtype, monkeypatch)
    assert len(a_calls["lookup_pool"]) == 6 and a_calls["step_bags"] == [True] * 6
    assert b_calls == {"lookup_pool": [], "step_bags": []}
    assert a_outs == b_outs
    _assert_same(a, b)
    # the runs turned ids away and let others in, and dropped the gradients of the former
    stats = a["stats"]
    assert stats["admission_rejected"] > 0 and stats["gradients_dropped"] > 0
    assert 0 < stats["rows"] < len(np.unique(np.concatenate([i for i, _ in _batches()])))


@pytest.mark.parametrize("custom_op", [False, True])
def test_weighted_bags_through_either_form_of_the_fused_op(custom_op, monkeypatch):
    a_outs, a, a_calls = _train_bag(True, "cutoff2", "sum", "adagrad", "float32", monkeypatch,
                                    weighted=True, custom_op=custom_op)
    b_outs, b, _ = _train_bag(False, "cutoff2", "sum", "adagrad", "float32", monkeypatch,
                              weighted=True)
    assert a_calls["step_bags"] == [True] * 6
    assert a_outs == b_outs
    _assert_same(a, b)


def test_a_store_over_capacity_evicts_as_the_general_path_does(monkeypatch):
    """Rows evicted after a forward's inserts: the step finds its slots gone and takes the
    general update, which drops the turned-away ids' gradients all the same."""
    a_outs, a, a_calls = _train_bag(True, "cutoff2", "mean", "adagrad", "float32", monkeypatch,
                                    capacity=30)
    b_outs, b, _ = _train_bag(False, "cutoff2", "mean", "adagrad", "float32", monkeypatch,
                              capacity=30)
    assert len(a_calls["lookup_pool"]) == 6 and None in a_calls["step_bags"]
    assert a_outs == b_outs
    _assert_same(a, b)
    assert a["stats"]["rows"] <= 30


@pytest.mark.parametrize("mode", ["sum", "max"])
def test_a_compiled_bag_with_admission_has_the_general_paths_bits(mode):
    """Under ``torch.compile`` the bag is the fused op (``embstore::fused_bag``, or
    ``fused_bag_max``), admission and all."""
    # (a new module is a new constant of train_bag's step: other files' cases compiled it
    # too, up to dynamo's recompile limit)
    torch._dynamo.reset()
    runs = {}
    for compiled in (True, False):
        store = _store("cutoff2", "adagrad")
        bag = DynamicEmbeddingBag(store, mode)
        bag.use_fused_path = compiled
        losses, ops = train_bag(bag, compiled, 40, steps=5)
        runs[compiled] = losses, _state(store), ops
    assert any("embstore.fused_bag" in op for op in runs[True][2]), runs[True][2]
    assert runs[True][0] == runs[False][0]
    _assert_same(runs[True][1], runs[False][1])
    assert runs[True][1]["stats"]["gradients_dropped"] > 0


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_an_embedding_with_admission_trains_fused_with_the_bits_of_the_general_path(
        policy, monkeypatch):
    def train(fused: bool):
        store = _store(policy, "adagrad")
        calls = _spy(store, monkeypatch)
        module = DynamicEmbedding(store)
        module.use_fused_path = fused
        outs = []
        for ids, _ in _batches():
            out = module(ids.reshape(-1, 1) if len(ids) % 2 else ids.reshape(2, -1))
            outs.append(out.detach().numpy().tobytes())
            (out * torch.arange(DIM)).square().sum().backward()
        return outs, _state(store), calls

    a_outs, a, a_calls = train(True)
    b_outs, b, b_calls = train(False)
    assert a_calls["step_bags"] == [True] * 6 and b_calls["step_bags"] == []
    assert a_outs == b_outs
    _assert_same(a, b)


def test_a_collection_with_admission_tables_trains_fused_with_the_general_paths_bits(
        monkeypatch):
    dims = {"user": 8, "item": 8}
    policies = {"user": "cutoff2", "item": "probabilistic"}

    def train(fused: bool):
        tables = {f: _store(policies[f], "adagrad", seed=len(f)) for f in dims}
        calls = {f: _spy(s, monkeypatch) for f, s in tables.items()}
        coll = DynamicEmbeddingBagCollection(tables, pooling="mean")
        coll.use_fused_path = fused
        rng = np.random.default_rng(3)
        outs = []
        for step in range(5):
            kj = KeyedJagged.from_dict({f: [list(rng.zipf(1.3, rng.integers(0, 5)) % 30
                                                 + 20 * step) for _ in range(12)]
                                        for f in dims})
            values = coll(kj).values()
            outs.append(values.detach().numpy().tobytes())
            (values * torch.linspace(-1, 1, values.shape[1])).square().sum().backward()
        return outs, {f: _state(s) for f, s in tables.items()}, calls

    a_outs, a, a_calls = train(True)
    b_outs, b, b_calls = train(False)
    for f in dims:
        assert a_calls[f]["step_bags"] == [True] * 5 and b_calls[f]["step_bags"] == []
        _assert_same(a[f], b[f])
        assert a[f]["stats"]["gradients_dropped"] > 0
    assert a_outs == b_outs


def test_two_forwards_before_their_backward_drop_the_same_gradients(monkeypatch):
    """Two forwards of one store before one backward (their slots no longer remembered for
    the first): the step of each still drops exactly the turned-away ids' gradients."""
    def train(fused: bool):
        store = _store("cutoff3")
        calls = _spy(store, monkeypatch)
        module = DynamicEmbeddingBag(store, mode="sum")
        module.use_fused_path = fused
        batches = _batches()
        outs = []
        for (ids, offsets), (ids2, offsets2) in zip(batches[::2], batches[1::2], strict=True):
            first, again, second = (module(ids, offsets), module(ids, offsets),
                                    module(ids2, offsets2))
            outs += [t.detach().numpy().tobytes() for t in (first, again, second)]
            (first.sum() + (again * 2).sum() + second.square().sum()).backward()
        return outs, _state(store), calls

    a_outs, a, a_calls = train(True)
    b_outs, b, _ = train(False)
    # backwards in reverse: the last forward's slots are remembered, the others are probed
    # again (turned-away ids still absent: the general update, which drops their gradients;
    # admitted by a later forward: the fused step)
    steps = a_calls["step_bags"]
    assert len(a_calls["lookup_pool"]) == 9 and steps[::3] == [True] * 3 and None in steps
    assert a_outs == b_outs
    _assert_same(a, b)


def test_scratch_rows_of_turned_away_ids_are_freed(monkeypatch):
    """The rows the pooling read for turned-away ids leave the arena with the step, and no
    key of the table ever points to them."""
    store = _store("cutoff3")
    arena = store.writer.backend._arena
    module = DynamicEmbeddingBag(store, mode="sum")
    held = []
    for ids, offsets in _batches():
        out = module(ids, offsets)
        held.append(arena.live - len(store))  # the scratch rows, until the step
        out.sum().backward()
        assert arena.live == len(store)
    assert min(held) > 0
