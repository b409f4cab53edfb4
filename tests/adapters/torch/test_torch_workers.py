"""DataLoader workers over a module's store: the worker's copy is read-only or a clear error.

A worker started by fork inherits the parent's writable handle; one started by spawn unpickles
the module (its store reopens read-only). Either way a worker's training-mode lookup must not
insert rows behind the writer's back, and a backward in a worker raises ``ReadOnlyError``.
"""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import embstore  # noqa: E402
from embstore_torch import DynamicEmbedding  # noqa: E402

DIM = 4
BACKENDS = ["lmdb", "rocksdb", "sqlite"]


def _url(kind: str, tmp_path) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path}/t.db"
    return f"{kind}://{tmp_path}/{kind}"


class _Lookups(torch.utils.data.Dataset):
    """Looks keys up in a training-mode, grad-enabled forward: the case that would write."""

    def __init__(self, emb, backward: bool = False) -> None:
        self.emb, self.backward = emb, backward

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        out = self.emb(torch.tensor([1000 + i, 1]))
        if self.backward:
            out.sum().backward()
        return out.detach()


def _open(kind: str, tmp_path):
    try:
        store = embstore.open(_url(kind, tmp_path), dim=DIM)
    except ImportError:
        pytest.skip(f"{kind} backend unavailable")
    store.assign([1], np.full((1, DIM), 3.0, np.float32))
    store.flush()
    return store


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("kind", BACKENDS)
def test_worker_lookups_read_and_never_insert(kind, method, tmp_path):
    store = _open(kind, tmp_path)
    emb = DynamicEmbedding(store)  # train mode
    loader = torch.utils.data.DataLoader(
        _Lookups(emb), batch_size=2, num_workers=2,
        multiprocessing_context=multiprocessing.get_context(method))
    batches = list(loader)
    assert len(batches) == 2
    init = store.initial_vectors(np.arange(1000, 1004))
    got = torch.cat(batches).numpy()  # (4, 2, DIM): key 1000 + i, then key 1
    np.testing.assert_array_equal(got[:, 1], np.full((4, DIM), 3.0, np.float32))
    np.testing.assert_array_equal(got[:, 0], init)  # unknown keys: their initial vector
    assert not store.contains(np.arange(1000, 1004)).any()  # nothing written by a worker
    assert len(store) == 1
    # the parent's handle still writes and trains
    emb(torch.tensor([7])).sum().backward()
    assert store.contains([7]).all()
    store.close()


def _first_batch_error(loader) -> Exception:
    it = iter(loader)
    try:
        next(it)
    except Exception as e:  # the worker's error, re-raised by the DataLoader
        return e
    finally:
        it._shutdown_workers()
    raise AssertionError("the worker did not fail")


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("kind", ["lmdb", "rocksdb"])
def test_worker_backward_is_a_clear_error(kind, method, tmp_path):
    store = _open(kind, tmp_path)
    emb = DynamicEmbedding(store)
    loader = torch.utils.data.DataLoader(
        _Lookups(emb, backward=True), batch_size=2, num_workers=2,
        multiprocessing_context=multiprocessing.get_context(method))
    assert "ReadOnlyError" in str(_first_batch_error(loader))
    assert len(store) == 1 and not store.contains(np.arange(1000, 1004)).any()
    store.close()


def test_memory_store_in_a_forked_worker_is_a_clear_error():
    store = embstore.open("memory://", dim=DIM)
    emb = DynamicEmbedding(store)
    loader = torch.utils.data.DataLoader(
        _Lookups(emb), batch_size=2, num_workers=2,
        multiprocessing_context=multiprocessing.get_context("fork"))
    assert "ForkedProcessError" in str(_first_batch_error(loader))
    assert len(store) == 0
