"""The PyTorch adapter as a citizen of PyTorch: torch.compile, jit.trace, checkpoints
(state_dict, torch.save, torch.distributed.checkpoint), pickling without a silent second writer,
uint64 keys, padding keys, and the ImportError without torch."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import embstore  # noqa: E402
from embstore.errors import (  # noqa: E402
    CorruptFileError,
    EmbstoreError,
    ReadOnlyError,
    SchemaMismatchError,
)
from embstore.optim import Adam  # noqa: E402
from embstore_torch import (  # noqa: E402
    DynamicEmbedding,
    DynamicEmbeddingBag,
    TracingUnsupportedError,
)

DIM = 8


class _Model(nn.Module):
    def __init__(self, store, bag=False):
        super().__init__()
        torch.manual_seed(0)
        self.bag = bag
        self.emb = DynamicEmbeddingBag(store, "mean") if bag else DynamicEmbedding(store)
        self.hidden = nn.Linear(DIM, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, ids):
        e = self.emb(ids)
        if not self.bag:
            e = e.sum(1)
        return self.out(torch.relu(self.hidden(e))).squeeze(-1)


def _train(model, steps, seed=0, forward=None):
    forward = model if forward is None else forward
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        ids = torch.from_numpy(rng.integers(0, 30, (6, 3)))
        loss = ((forward(ids) - torch.arange(6.0)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _snapshot(store):
    keys, recs = zip(*store.records(), strict=True)
    keys, recs = np.concatenate(keys), np.concatenate(recs)
    order = np.argsort(keys)
    return keys[order], recs[order]


def _assert_same_rows(a, b):
    (ka, ra), (kb, rb) = _snapshot(a), _snapshot(b)
    np.testing.assert_array_equal(ka, kb)
    for field in ra.dtype.names:  # vector, optimizer slots, count, last_step, ...
        if field in ("last_seen", "version"):  # when the row was written (wall clock)
            continue
        np.testing.assert_array_equal(ra[field], rb[field], err_msg=field)


# -- torch.compile / jit.trace ------------------------------------------------------------------

@pytest.mark.parametrize("bag", [False, True])
def test_compiled_training_step_matches_eager_exactly(bag):
    eager_store = embstore.open("memory://", dim=DIM, optimizer="adagrad")
    compiled_store = embstore.open("memory://", dim=DIM, optimizer="adagrad")
    eager, compiled = _Model(eager_store, bag), _Model(compiled_store, bag)
    # aot_eager runs Dynamo and AOTAutograd (the graph break, the compiled forward and
    # backward of the dense part) without inductor's minute-long C++ build on 2 cores.
    fn = torch.compile(compiled, backend="aot_eager", fullgraph=False)
    assert _train(eager, 4) == _train(compiled, 4, forward=fn)
    assert compiled_store.step == eager_store.step == 4
    _assert_same_rows(eager_store, compiled_store)
    for p, q in zip(eager.parameters(), compiled.parameters(), strict=True):
        assert torch.equal(p, q)


def test_embedding_compiles_into_one_graph_with_the_store_as_a_custom_op():
    # fullgraph=True: no graph break at all (the store call is the embstore::lookup op and its
    # backward embstore::update); with a padding key, and the same result as eager
    runs = []
    for compiled in (False, True):
        store = embstore.open("memory://", dim=DIM, optimizer="adagrad")
        model = _Model(store)
        model.emb.padding_key = 0
        fn = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        runs.append((_train(model, 3, forward=fn), _snapshot(store), store.step))
        assert not store.contains([0])[0]
        model.eval()
        with torch.no_grad():  # eval + no_grad compiled: reads, writes nothing
            n = len(store)
            fn(torch.tensor([[1000, 1001, 2]]))
            assert len(store) == n and store.step == 3
    (la, (ka, ra), sa), (lb, (kb, rb), sb) = runs
    assert la == lb and sa == sb
    np.testing.assert_array_equal(ka, kb)
    np.testing.assert_array_equal(ra["vector"], rb["vector"])
    np.testing.assert_array_equal(ra["count"], rb["count"])


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bags_compile_into_one_graph_and_match_eager(mode):
    runs = []
    for compiled in (False, True):
        store = embstore.open("memory://", dim=DIM, optimizer="adagrad")
        bag = DynamicEmbeddingBag(store, mode)
        torch.manual_seed(0)
        head = nn.Linear(DIM, 1)
        weights = torch.ones(7, requires_grad=True)

        def step(ids, offsets, bag=bag, head=head, weights=weights):
            psw = weights * 0.5 if mode == "sum" else None
            return head(bag(ids, offsets, per_sample_weights=psw)).pow(2).sum()

        fn = torch.compile(step, backend="aot_eager", fullgraph=True) if compiled else step
        rng = np.random.default_rng(1)
        losses = []
        for _ in range(3):
            ids = torch.from_numpy(rng.integers(0, 9, 7))
            loss = fn(ids, torch.tensor([0, 2, 2, 5]))  # an empty bag too
            loss.backward()
            losses.append(loss.item())
        runs.append((losses, store.lookup(np.arange(9), insert=False), weights.grad))
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    if mode == "sum":  # the weights' gradient: a dot product per id, summed in another order
        torch.testing.assert_close(runs[0][2], runs[1][2], rtol=1e-6, atol=1e-9)


def test_string_keys_under_compile_run_as_a_graph_break():
    store = embstore.open("memory://", dim=DIM, key_type="bytes", optimizer="sgd")
    emb = DynamicEmbedding(store)
    head = nn.Linear(DIM, 1)
    fn = torch.compile(lambda words: head(emb(words)).sum(), backend="aot_eager")
    before = store.lookup(["a", "b"]).copy()
    fn([["a", "b"]]).backward()
    assert store.step == 1
    assert not np.array_equal(store.lookup(["a", "b"]), before)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning")
def test_jit_trace_refuses_with_what_to_use_instead():
    emb = DynamicEmbedding(embstore.open("memory://", dim=DIM))
    with pytest.raises(TracingUnsupportedError, match="torch.compile"):
        torch.jit.trace(emb, torch.tensor([[1, 2]]), check_trace=False)
    assert issubclass(TracingUnsupportedError, EmbstoreError)


# -- checkpoints ---------------------------------------------------------------------------------

def test_state_dict_restores_rows_slots_counts_and_step_exactly(tmp_path):
    store = embstore.open("memory://", dim=DIM, optimizer=Adam(lr=0.01))
    model = _Model(store)
    _train(model, 3)
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    saved_rows, saved_step = _snapshot(store), store.step
    _train(model, 4, seed=1)  # changes rows, adds keys, moves the step
    assert store.step == 7 and len(store) > len(saved_rows[0])

    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)  # plain types only
    model.load_state_dict(state)
    assert store.step == saved_step == 3
    keys, recs = _snapshot(store)
    np.testing.assert_array_equal(keys, saved_rows[0])
    np.testing.assert_array_equal(recs, saved_rows[1])

    # into a fresh store: same rows, and training continues identically from there
    other = embstore.open("memory://", dim=DIM, optimizer=Adam(lr=0.01))
    twin = _Model(other)
    twin.load_state_dict(state)
    _assert_same_rows(store, other)
    assert _train(model, 2, seed=2) == _train(twin, 2, seed=2)
    _assert_same_rows(store, other)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_state_dict_works_with_torch_distributed_checkpoint(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    store = embstore.open("memory://", dim=DIM, optimizer="adagrad")
    model = _Model(store)
    _train(model, 3)
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "dcp"))

    other = embstore.open("memory://", dim=DIM, optimizer="adagrad")
    twin = _Model(other)
    twin.emb(torch.tensor([100, 101, 102]))  # a table of another size than the checkpoint's
    state = twin.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    twin.load_state_dict(state)
    _assert_same_rows(store, other)
    assert other.step == store.step == 3


def test_checkpoint_rows_off_keeps_a_reference_only():
    store = embstore.open("memory://", dim=DIM)
    emb = DynamicEmbedding(store)
    emb(torch.tensor([1, 2])).sum().backward()
    emb.checkpoint_rows = False
    state = emb.state_dict()["_extra_state"]
    assert state["rows"] is None and state["step"] == 1 and state["url"] == store.url
    emb(torch.tensor([3])).sum().backward()
    emb.load_state_dict({"_extra_state": state})  # nothing to restore: the store is as it is
    assert len(store) == 3 and store.step == 2


def test_bad_checkpoint_leaves_the_store_untouched():
    store = embstore.open("memory://", dim=DIM)
    emb = DynamicEmbedding(store)
    emb(torch.tensor([1, 2, 3])).sum().backward()
    state = emb.state_dict()
    before = _snapshot(store)
    damaged = dict(state["_extra_state"])
    damaged["rows"] = damaged["rows"][:-20]
    with pytest.raises(CorruptFileError):
        emb.load_state_dict({"_extra_state": damaged})
    wrong_dim = DynamicEmbedding(embstore.open("memory://", dim=DIM + 1))
    with pytest.raises(SchemaMismatchError):
        wrong_dim.load_state_dict(state)
    after = _snapshot(store)
    np.testing.assert_array_equal(before[1], after[1])


def _lmdb(tmp_path, **kw):
    try:
        return embstore.open(f"lmdb://{tmp_path}/s", dim=DIM, **kw)
    except ImportError:
        pytest.skip("lmdb backend unavailable")


def test_unpickled_copy_is_never_a_silent_second_writer(tmp_path):
    # The reported scenario: a copy unpickled early (torch.save/torch.load, a worker) used to
    # reopen the store read-write and, on close, wrote its stale step (0) over the trained 51.
    store = _lmdb(tmp_path, optimizer=Adam(lr=0.01))
    model = _Model(store)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copy = torch.load(buf, weights_only=False)
    assert copy.emb.store.read_only and not store.read_only
    _train(model, 51)
    store.close()
    copy.emb.store.close()
    with embstore.open(store.url) as reopened:
        assert reopened.step == 51

    # the copy reads, but cannot write behind the writer's back, and says how to
    store = embstore.open(store.url)
    copy = pickle.loads(pickle.dumps(_Model(store)))
    out = copy(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ReadOnlyError, match="writable_unpickling"):
        out.sum().backward()
    copy.emb.store.close()

    # a writer only when asked for: around the unpickling, or around the pickling
    with embstore.writable_unpickling():
        writer = pickle.loads(pickle.dumps(store))
    assert not writer.read_only
    writer.close()
    with embstore.writable_unpickling():
        blob = pickle.dumps(store)
    writer = pickle.loads(blob)
    assert not writer.read_only
    writer.close()
    read_only = embstore.open(store.url, read_only=True)
    with embstore.writable_unpickling():  # a read-only handle never comes back writable
        assert pickle.loads(pickle.dumps(read_only)).read_only
    store.close()


# -- keys ---------------------------------------------------------------------------------------

def test_uint64_keys_above_2_63_reach_the_store_losslessly():
    store = embstore.open("memory://", dim=DIM)
    emb = DynamicEmbedding(store)
    big = np.array([2**64 - 1, 2**63, 2**63 + 12345, 7], dtype=np.uint64)
    out = emb(big)
    expected = store.lookup(big.view(np.int64), insert=False)
    np.testing.assert_array_equal(out.detach().numpy(), expected)
    np.testing.assert_array_equal(emb(torch.from_numpy(big.view(np.int64))).detach().numpy(),
                                  expected)
    np.testing.assert_array_equal(emb(torch.tensor(big.tolist(), dtype=torch.uint64))
                                  .detach().numpy(), expected)
    np.testing.assert_array_equal(emb([[2**64 - 1, 2**63], [2**63 + 12345, 7]])
                                  .detach().numpy().reshape(4, DIM), expected)
    np.testing.assert_array_equal(emb(2**63).detach().numpy(), expected[1])
    bag = DynamicEmbeddingBag(store, mode="sum")
    np.testing.assert_array_equal(bag([[2**64 - 1, 2**63], [7]]).detach().numpy(),
                                  np.stack([expected[0] + expected[1], expected[3]]))
    assert len(store) == 4


@pytest.mark.parametrize("key_type,pad,keys", [
    ("int64", -1, [[3, -1, 4], [-1, -1, 5]]),
    ("bytes", "<pad>", [["a", "<pad>", "b"], ["<pad>", "<pad>", "c"]]),
])
def test_padding_key_reads_zeros_gets_no_gradient_and_is_never_stored(key_type, pad, keys):
    store = embstore.open("memory://", dim=DIM, key_type=key_type, optimizer="sgd")
    emb = DynamicEmbedding(store, padding_key=pad)
    out = emb(keys)
    assert torch.equal(out[0, 1], torch.zeros(DIM)) and torch.equal(out[1, 0], torch.zeros(DIM))
    real = [k for row in keys for k in row if k != pad]
    before = store.lookup(real).copy()
    (out * 3).sum().backward()
    assert not store.contains([pad])[0] and len(store) == 3
    np.testing.assert_allclose(store.lookup(real), before - 0.01 * 3, rtol=1e-6)
    counts = store.get_records(real)[0]["count"]
    np.testing.assert_array_equal(counts, [1, 1, 1])


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_padding_key_in_bags_pools_like_nn_embedding_bag_padding_idx(mode):
    vocab, pad = 12, 0
    weight = torch.randn(vocab, DIM, generator=torch.Generator().manual_seed(0))
    store = embstore.open("memory://", dim=DIM, optimizer="sgd")
    store.assign(np.arange(1, vocab), weight[1:].numpy())
    bag = DynamicEmbeddingBag(store, mode, padding_idx=pad)
    ref = nn.EmbeddingBag.from_pretrained(weight.clone(), freeze=False, mode=mode,
                                          padding_idx=pad)
    ids = torch.tensor([3, 0, 4, 0, 0, 5, 5, 0, 7])
    offsets = torch.tensor([0, 3, 5, 5])  # bags [3,0,4] [0,0] [] [5,5,0,7]
    got, want = bag(ids, offsets), ref(ids, offsets)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    g = torch.randn_like(want)
    got.backward(g)
    want.backward(g)
    assert not store.contains([pad])[0]
    touched = np.array([3, 4, 5, 7])
    np.testing.assert_allclose(store.lookup(touched),
                               (weight - 0.01 * ref.weight.grad)[touched].numpy(), atol=1e-6)


# -- packaging ----------------------------------------------------------------------------------

def test_import_without_torch_names_the_extra():
    code = textwrap.dedent("""
        import sys
        class Blocker:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, Blocker())
        try:
            import embstore_torch
        except ImportError as e:
            print("ERR", e)
    """)
    import embstore_torch

    # wherever the packages come from here (an install or PYTHONPATH), the child finds them too
    roots = [os.path.dirname(os.path.dirname(m.__file__)) for m in (embstore, embstore_torch)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [*roots, *filter(None, [os.environ.get("PYTHONPATH")])])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert "ERR" in res.stdout, res.stderr
    assert "pip install -e '.[torch]'" in res.stdout
