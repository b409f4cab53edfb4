"""In-store optimizers: torch parity (SGD, Adagrad, SparseAdam), FTRL sparsity, bad input."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.errors import InvalidInputError, SchemaMismatchError
from embstore.optim import FTRL, SGD, Adagrad, Adam, Momentum, from_config

DIM = 16
VOCAB = 300
STEPS = 200


def _batches(seed: int = 0, steps: int = STEPS, batch: int = 64):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        # A small vocabulary forces many duplicates within and across batches.
        keys = rng.integers(0, VOCAB, batch).astype(np.int64)
        grads = rng.normal(0.0, 1.0, (batch, DIM)).astype(np.float32)
        yield keys, grads


def _torch_run(make_opt, init: np.ndarray):
    torch = pytest.importorskip("torch")
    emb = torch.nn.Embedding(VOCAB, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(init))
    opt = make_opt(emb.parameters())
    for keys, grads in _batches():
        opt.zero_grad()
        out = emb(torch.from_numpy(keys))
        # d(sum(out * G))/d(out) = G, so each occurrence contributes its own gradient row.
        (out * torch.from_numpy(grads)).sum().backward()
        opt.step()
    return emb.weight.detach().numpy().copy()


def _store_run(optimizer, init: np.ndarray) -> np.ndarray:
    store = embstore.open("memory://", dim=DIM, optimizer=optimizer)
    store.assign(np.arange(VOCAB), init)
    for keys, grads in _batches():
        store.update(keys, grads)
    return store.lookup(np.arange(VOCAB), insert=False)


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (SGD(lr=0.1), lambda p: __import__("torch").optim.SGD(p, lr=0.1)),
        (Adagrad(lr=0.1, initial_accumulator_value=0.1, eps=1e-10),
         lambda p: __import__("torch").optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1,
                                                     eps=1e-10)),
        (Adagrad(lr=0.05),
         lambda p: __import__("torch").optim.Adagrad(p, lr=0.05)),
        (Adam(lr=0.01, betas=(0.9, 0.999), eps=1e-8),
         lambda p: __import__("torch").optim.SparseAdam(p, lr=0.01, betas=(0.9, 0.999),
                                                        eps=1e-8)),
        (Adam(lr=0.003, betas=(0.8, 0.99), eps=1e-6),
         lambda p: __import__("torch").optim.SparseAdam(p, lr=0.003, betas=(0.8, 0.99),
                                                        eps=1e-6)),
    ],
    ids=["sgd", "adagrad-init", "adagrad", "sparseadam", "sparseadam-betas"],
)
def test_matches_torch_sparse_embedding_step_for_step(ours, theirs):
    pytest.importorskip("torch")
    init = np.random.default_rng(42).uniform(-0.5, 0.5, (VOCAB, DIM)).astype(np.float32)
    expected = _torch_run(theirs, init)
    got = _store_run(ours, init)
    assert np.abs(got - expected).max() <= 1e-5


def test_momentum_is_lazy_and_matches_reference():
    opt = Momentum(lr=0.1, momentum=0.9)
    nes = Momentum(lr=0.1, momentum=0.9, nesterov=True)
    s = embstore.open("memory://", dim=2, optimizer=opt, initializer="zeros")
    t = embstore.open("memory://", dim=2, optimizer=nes, initializer="zeros")
    g = np.array([[1.0, -2.0]], dtype=np.float32)
    w = np.zeros(2, np.float32)
    acc = np.zeros(2, np.float32)
    wn = np.zeros(2, np.float32)
    for _ in range(3):
        s.update([7], g)
        t.update([7], g)
        acc = 0.9 * acc + g[0]
        w -= 0.1 * acc
        wn -= 0.1 * g[0] + 0.1 * 0.9 * acc
    s.update([8], g)  # another key: key 7 must not move (lazy)
    np.testing.assert_allclose(s.lookup([7], insert=False)[0], w, rtol=1e-6)
    np.testing.assert_allclose(t.lookup([7], insert=False)[0], wn, rtol=1e-6)
    np.testing.assert_allclose(s.get_records([7])[0]["momentum"][0], acc, rtol=1e-6)


def _ftrl_reference(grads_seq, alpha, beta, l1, l2):
    """McMahan's per-coordinate FTRL-Proximal, in float64 Python, for one coordinate."""
    z = n = w = 0.0
    for g in grads_seq:
        n_new = n + g * g
        z += g - (n_new ** 0.5 - n ** 0.5) / alpha * w
        n = n_new
        w = 0.0 if abs(z) <= l1 else -(z - np.sign(z) * l1) / ((beta + n ** 0.5) / alpha + 2 * l2)
    return w


def test_ftrl_l1_produces_exact_zeros_and_matches_reference():
    dim = 32
    opt = FTRL(alpha=0.1, beta=1.0, l1=1.0, l2=0.5)
    s = embstore.open("memory://", dim=dim, optimizer=opt, initializer="zeros")
    rng = np.random.default_rng(1)
    # Coordinates with a consistent push survive L1; pure-noise ones end at exactly 0.
    seq = rng.normal(0.0, 0.3, (40, 4, dim)).astype(np.float32)
    seq[:, :, :8] += 1.0
    for step in seq:
        s.update(np.arange(4), step)
    vec = s.lookup(np.arange(4), insert=False)
    assert (vec == 0.0).sum() > 0 and (vec != 0.0).sum() > 0
    assert (vec[:, :8] != 0).all()
    for r in range(4):
        for c in (0, 20):
            ref = _ftrl_reference(seq[:, r, c].astype(np.float64), 0.1, 1.0, 1.0, 0.5)
            assert abs(vec[r, c] - ref) < 1e-5
    assert len(s) == 4  # prune is off without l21: zero coordinates, rows kept


def test_ftrl_group_lasso_keeps_accumulating_below_the_threshold():
    """A key whose per-step gradient is below the group threshold must still accumulate z
    until it crosses it: the zero row keeps its z/n (deleting it each step kept w at 0)."""
    dim = 4
    s = embstore.open("memory://", dim=dim, initializer="zeros",
                      optimizer=FTRL(alpha=0.1, beta=1.0, l21=0.1))
    g = np.full((1, dim), -0.05, np.float32)
    first = None
    for step in range(10):
        s.update([7], g)
        if step == 0:
            first = s.get_records([7])[0][0].copy()
    assert first is not None and not first["vector"].any() and first["z"].any()
    rec = s.get_records([7])[0][0]
    # the same recursion in float64, one coordinate (all four are equal)
    z = n = w_ref = 0.0
    thresh = 0.1 * np.sqrt(dim)
    for _ in range(10):
        n_new = n + 0.05 ** 2
        z += -0.05 - (np.sqrt(n_new) - np.sqrt(n)) / 0.1 * w_ref
        n = n_new
        norm = abs(z) * np.sqrt(dim)
        scale = 1 - thresh / norm if norm > thresh else 0.0
        w_ref = -z * scale / ((1.0 + np.sqrt(n)) / 0.1)
    assert w_ref > 0.03
    np.testing.assert_allclose(rec["vector"], w_ref, rtol=1e-4)
    assert s.stats()["pruned"] == 0 and len(s) == 1


def test_ftrl_prune_removes_only_idle_zero_rows():
    dim = 16
    s = embstore.open("memory://", dim=dim, initializer="zeros",
                      optimizer=FTRL(alpha=0.1, beta=1.0, l21=0.2, prune=True,
                                     prune_idle_steps=5))
    rng = np.random.default_rng(2)
    strong, weak, idle = np.arange(0, 10), np.arange(100, 110), np.arange(200, 210)
    s.update(idle, rng.normal(0, 0.01, (10, dim)).astype(np.float32))  # zero, then idle
    for _ in range(30):
        g_strong = (rng.normal(0, 0.1, (10, dim)) + 2.0).astype(np.float32)
        g_weak = rng.normal(0, 0.01, (10, dim)).astype(np.float32)
        s.update(np.concatenate([strong, weak]), np.concatenate([g_strong, g_weak]))
    assert s.contains(strong).all()
    assert s.contains(weak).all()       # zero but still trained: state kept
    assert not s.contains(idle).any()   # zero and idle for 5+ steps: pruned
    assert s.stats()["pruned"] == 10 and len(s) == 20
    assert (s.lookup(strong, insert=False) != 0).all()
    assert not s.lookup(weak, insert=False).any()
    from embstore.optim.ftrl import nonzero_rows
    nz = sum(int(nonzero_rows(r).sum()) for _, r in s.records())
    assert nz == 10  # what a serving copy needs


@pytest.mark.parametrize("make", [
    lambda: SGD(lr=-0.1), lambda: SGD(lr=0), lambda: Adagrad(lr=-1),
    lambda: Adagrad(eps=-1), lambda: Adam(lr=-0.001), lambda: Adam(betas=(1.0, 0.9)),
    lambda: Adam(betas=(0.9,)), lambda: Momentum(lr=-1), lambda: Momentum(momentum=1.5),
    lambda: FTRL(alpha=-1), lambda: FTRL(l1=-0.1), lambda: FTRL(l21=float("nan")),
    lambda: SGD(lr="fast"),
])
def test_bad_hyperparameters_raise(make):
    with pytest.raises(InvalidInputError):
        make()


def test_config_round_trip_for_every_optimizer():
    for opt in (SGD(0.2, 0.01), Momentum(0.1, 0.5, True), Adagrad(0.3, 0.1, 1e-8),
                Adam(0.01, (0.8, 0.9), 1e-7), FTRL(0.1, 0.5, 0.1, 0.2, 0.3, 0.1)):
        assert from_config(opt.config()) == opt
    with pytest.raises(InvalidInputError):
        from_config({"name": "adam", "momentum": 3})


def test_reopen_with_other_optimizer_is_refused(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    try:
        s = embstore.open(url, dim=4, optimizer=Adam(lr=0.01))
    except Exception:  # noqa: BLE001 - the SQL backend may not exist yet in this checkout
        pytest.skip("sqlite backend unavailable")
    s.update([1], np.ones((1, 4), np.float32))
    s.close()
    with pytest.raises(SchemaMismatchError):
        embstore.open(url, optimizer=Adagrad(lr=0.01))
    with pytest.raises(SchemaMismatchError):
        embstore.open(url, optimizer=Adam(lr=0.02))
    s = embstore.open(url)  # no optimizer given: the stored one is used
    assert s.optimizer == Adam(lr=0.01)
    s.close()


def test_optimizer_by_name_and_slots_in_layout():
    for name, slots in [("momentum", ("momentum",)), ("adagrad", ("accum",)),
                        ("adam", ("m", "v")), ("ftrl", ("z", "n"))]:
        s = embstore.open("memory://", dim=4, optimizer=name)
        assert s.layout.slot_names == slots
