"""The torch adapter with the model on a GPU: ``module.to("cuda")``, ids and weights given on
the device, the dense part, DDP over NCCL and ``torch.compile`` there. The rows stay on the
host with the store, so every case is held to the same model on the CPU: outputs and the rows
after the backward equal the CPU run's bit for bit (the store's own arithmetic, on the same
float32 gradients), trained models within float32 tolerance (the GPU's matrix products round
differently).

Skipped without a CUDA device (CI has none). ``EMBSTORE_TEST_DEVICE=cpu`` runs the same cases
with the "device" model on the CPU, which checks the cases themselves.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import embstore
from embstore.optim import SGD, Adagrad

torch = pytest.importorskip("torch")
from embstore_torch import (  # noqa: E402
    DynamicEmbedding,
    DynamicEmbeddingBag,
    DynamicEmbeddingBagCollection,
    KeyedJagged,
    SampledSoftmaxLoss,
)

DEVICE = os.environ.get("EMBSTORE_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA device")
DIM = 8
KEYS = np.arange(64, dtype=np.int64)


def _store(optimizer=None, **opts):
    return embstore.open("memory://", dim=DIM, seed=3,
                         optimizer=optimizer or SGD(lr=0.1), **opts)


def _pair(make, fused: bool = True):
    """The same module over two equal stores: one on the CPU, one moved to the device."""
    mods = []
    for dev in ("cpu", DEVICE):
        m = make(_store())
        m.use_fused_path = fused
        mods.append(m.to(dev))
    return mods


def _rows(module) -> np.ndarray:
    return module.store.lookup(KEYS, insert=False)


def _head(shape, device) -> torch.Tensor:
    """A fixed cotangent: ``(out * head).sum()``'s gradient is ``head`` exactly."""
    return torch.linspace(-1, 1, int(np.prod(shape))).reshape(shape).to(device)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_an_embedding_on_the_device_reads_and_trains_as_on_the_cpu(fused, dtype):
    cpu, dev = _pair(DynamicEmbedding, fused)
    ids = torch.tensor([[1, 5, 9], [9, 2, 1]], dtype=dtype)
    outs = []
    for m, d in ((cpu, "cpu"), (dev, DEVICE)):
        out = m(ids.to(d))
        assert out.device.type == torch.device(d).type and out.dtype == torch.float32
        (out * _head(out.shape, d)).sum().backward()
        outs.append(out.detach().cpu())
    assert torch.equal(outs[0], outs[1])
    np.testing.assert_array_equal(_rows(cpu), _rows(dev))
    assert not np.array_equal(_rows(dev)[1], _store().lookup([1])[0])  # it did train


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("mean", False), ("max", False),
                                           ("sum", True)])
def test_a_bag_on_the_device_pools_and_trains_as_on_the_cpu(fused, mode, weighted):
    cpu, dev = _pair(lambda s: DynamicEmbeddingBag(s, mode=mode), fused)
    ids = torch.tensor([4, 7, 4, 11, 2, 7, 30])
    offsets = torch.tensor([0, 3, 3, 5])  # an empty bag too
    w = torch.linspace(0.5, 2.0, len(ids))
    outs = []
    for m, d in ((cpu, "cpu"), (dev, DEVICE)):
        out = m(ids.to(d), offsets.to(d), w.to(d) if weighted else None)
        assert out.device.type == torch.device(d).type
        (out * _head(out.shape, d)).sum().backward()
        outs.append(out.detach().cpu())
    assert torch.equal(outs[0], outs[1])
    np.testing.assert_array_equal(_rows(cpu), _rows(dev))


def test_two_d_bags_on_the_device():
    cpu, dev = _pair(lambda s: DynamicEmbeddingBag(s, mode="sum"))
    ids = torch.tensor([[3, 3, 8], [1, 2, 8]])
    a, b = cpu(ids), dev(ids.to(DEVICE))
    assert torch.equal(a.detach(), b.detach().cpu())
    (a * _head(a.shape, "cpu")).sum().backward()
    (b * _head(b.shape, DEVICE)).sum().backward()
    np.testing.assert_array_equal(_rows(cpu), _rows(dev))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("sum", True), ("mean", False),
                                              ("max", False)])
def test_a_collection_on_the_device_pools_and_trains_as_on_the_cpu(fused, pooling, weighted):
    def collection():
        c = DynamicEmbeddingBagCollection({"user": _store(), "item": _store()}, pooling=pooling)
        c.use_fused_path = fused
        return c

    cpu, dev = collection(), collection().to(DEVICE)
    values = torch.tensor([1, 2, 2, 9, 4, 4, 4, 6])
    lengths = torch.tensor([2, 0, 2, 1, 3, 0])  # 3 samples x 2 features
    w = torch.linspace(0.25, 1.0, len(values))
    outs = []
    for m, d in ((cpu, "cpu"), (dev, DEVICE)):
        kj = KeyedJagged(["user", "item"], values.to(d), lengths.to(d),
                         weights=w.to(d) if weighted else None)
        out = m(kj).values()
        assert out.device.type == torch.device(d).type and out.shape == (3, 2 * DIM)
        (out * _head(out.shape, d)).sum().backward()
        outs.append(out.detach().cpu())
    assert torch.equal(outs[0], outs[1])
    for name in ("user", "item"):
        np.testing.assert_array_equal(cpu.embedding_bags[name].store.lookup(KEYS, insert=False),
                                      dev.embedding_bags[name].store.lookup(KEYS, insert=False))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_outputs_follow_the_modules_device_and_dtype(dtype):
    cpu, dev = _pair(lambda s: DynamicEmbeddingBag(s, mode="mean"))
    dev.to(dtype)
    ids = torch.tensor([[1, 2], [3, 1]])
    out = dev(ids.to(DEVICE))
    assert out.dtype == dtype and out.device.type == torch.device(DEVICE).type
    out.float().sum().backward()  # the gradient is cast back and reaches the store
    cpu.to(dtype)
    cpu(ids).float().sum().backward()
    np.testing.assert_array_equal(_rows(cpu), _rows(dev))


def _train(device: str, steps: int = 12, compiled: bool = False):
    """A small CTR model (a bag per feature -> Linear -> BCE) on ``device`` with row-wise
    Adagrad in the store and SGD on the dense part; losses and the final rows."""
    torch.manual_seed(0)
    stores = [_store(Adagrad(lr=0.1, rowwise=True)) for _ in range(2)]
    bags = torch.nn.ModuleList(DynamicEmbeddingBag(s, mode="sum") for s in stores).to(device)
    head = torch.nn.Linear(2 * DIM, 1).to(device)
    opt = torch.optim.SGD(head.parameters(), lr=0.05)
    rng = np.random.default_rng(5)

    def step(ids, labels):
        pooled = torch.cat([bags[f](ids[f]) for f in range(2)], dim=1)
        return torch.nn.functional.binary_cross_entropy_with_logits(head(pooled), labels)

    fn = torch.compile(step) if compiled else step
    losses = []
    for _ in range(steps):
        ids = torch.from_numpy(rng.integers(0, 40, (2, 32, 3))).to(device)
        labels = torch.from_numpy((rng.random((32, 1)) < 0.5).astype(np.float32)).to(device)
        loss = fn(ids, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [s.lookup(KEYS[:40], insert=False) for s in stores]


def test_a_model_trained_on_the_device_matches_the_cpu_run():
    cpu_losses, cpu_rows = _train("cpu")
    dev_losses, dev_rows = _train(DEVICE)
    np.testing.assert_allclose(dev_losses, cpu_losses, rtol=1e-4, atol=1e-5)
    for a, b in zip(cpu_rows, dev_rows, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


def test_a_compiled_model_on_the_device_matches_its_eager_run():
    eager_losses, eager_rows = _train(DEVICE, steps=6)
    comp_losses, comp_rows = _train(DEVICE, steps=6, compiled=True)
    np.testing.assert_allclose(comp_losses, eager_losses, rtol=1e-4, atol=1e-5)
    for a, b in zip(eager_rows, comp_rows, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pooling", ["sum", "max"])
def test_a_compiled_collection_on_the_device_is_one_graph(pooling):
    def collection():
        return DynamicEmbeddingBagCollection({"user": _store(), "item": _store()},
                                             pooling=pooling).to(DEVICE)

    coll, eager = collection(), collection()
    head = _head((3, 2 * DIM), DEVICE)

    def step(module, kj):
        return (module(kj).values() * head).sum()

    compiled = torch.compile(step, fullgraph=True)
    kj = KeyedJagged(["user", "item"], torch.tensor([1, 2, 2, 9, 4, 4, 4, 6], device=DEVICE),
                     torch.tensor([2, 0, 2, 1, 3, 0]))
    for _ in range(3):
        a, b = compiled(coll, kj), step(eager, kj)
        a.backward()
        b.backward()
        torch.testing.assert_close(a.detach().cpu(), b.detach().cpu())
    for name in ("user", "item"):
        np.testing.assert_array_equal(coll.embedding_bags[name].store.lookup(KEYS, insert=False),
                                      eager.embedding_bags[name].store.lookup(KEYS, insert=False))


def test_sampled_softmax_with_hidden_states_on_the_device():
    store = _store()
    store.assign(KEYS, np.random.default_rng(0).normal(size=(len(KEYS), DIM)).astype(np.float32))
    loss_fn = SampledSoftmaxLoss(store, num_sampled=16, sampler="uniform")
    hidden = torch.randn(5, DIM, device=DEVICE, requires_grad=True)
    loss = loss_fn(hidden, torch.tensor([1, 2, 3, 4, 5], device=DEVICE))
    assert loss.device.type == torch.device(DEVICE).type and torch.isfinite(loss)
    before = store.lookup([1, 2, 3], insert=False).copy()
    loss.backward()
    assert hidden.grad is not None and hidden.grad.device == hidden.device
    assert not np.array_equal(before, store.lookup([1, 2, 3], insert=False))


def test_state_dict_of_a_device_model_loads_into_a_cpu_model(tmp_path):
    dev = DynamicEmbeddingBag(_store(), mode="sum").to(DEVICE)
    dev(torch.tensor([[1, 2], [3, 4]], device=DEVICE)).sum().backward()
    torch.save(dev.state_dict(), tmp_path / "m.pt")
    cpu = DynamicEmbeddingBag(embstore.open("memory://", dim=DIM), mode="sum")
    cpu.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=False))
    np.testing.assert_array_equal(cpu.store.lookup([1, 2, 3, 4], insert=False),
                                  dev.store.lookup([1, 2, 3, 4], insert=False))


@pytest.mark.skipif(DEVICE != "cuda", reason="NCCL needs CUDA")
def test_ddp_over_nccl_trains_the_dense_part_while_the_store_updates(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rdzv'}", rank=0,
                            world_size=1)
    try:
        bag = DynamicEmbeddingBag(_store(), mode="sum")
        model = torch.nn.Sequential(bag, torch.nn.Linear(DIM, 1)).to(DEVICE)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        before = bag.store.lookup([1, 2, 3], insert=True).copy()
        for _ in range(3):
            loss = ddp(torch.tensor([[1, 2], [3, 1]], device=DEVICE)).square().sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert not np.array_equal(before, bag.store.lookup([1, 2, 3], insert=False))
        assert model[1].weight.device.type == "cuda"
    finally:
        dist.destroy_process_group()
