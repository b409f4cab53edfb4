"""The distributed store is made of parts it owns, each with its own state.

``DistributedStore`` holds a ``Collectives`` (the comm, this rank's own store, the global step,
the routing of keys to their owners) and the parts that call it: the keyed collectives, top_k
and sample, the export and this rank's checkpoint. No part is a mixin reading the store's
private names or holds the store itself; a rank's snapshot and restore are a part's methods
(the module functions the torch modules call dispatch to it). The collectives themselves are
covered, over two ranks, by the other ``test_distributed*`` files; here a world of one runs
in this process.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import embstore  # noqa: E402
from embstore.errors import InvalidInputError, StoreClosedError  # noqa: E402
from embstore.testing import architecture as arch  # noqa: E402
from embstore.testing import class_shape  # noqa: E402
from embstore.testing.postgres import free_port  # noqa: E402

AREA = "embstore_torch.distributed."
DIM = 4
ADAGRAD = {"name": "adagrad", "lr": 0.1}


def _mine(name: str) -> bool:
    return name.startswith(AREA)


def test_the_distributed_store_is_composed_of_parts_not_mixins():
    mods = arch.load_modules()
    table = class_shape.classes(mods)
    assert {q: n for q, n in class_shape.mixins(table).items() if _mine(q)} == {}
    assert {q: n for q, n in class_shape.borrowed(table).items() if _mine(q)} == {}
    assert [f"{r.module}:{r.lineno} {r.text}" for r in arch.private_reaches(mods)
            if _mine(r.module + ".")] == []
    assert [f"{f.module}.{f.function}" for f in class_shape.owner_passing(mods)
            if _mine(f.module + ".")] == []
    # ShardView is a backend layer: its bases (WrapperBackend, Backend) are sized with the
    # backends; its own body stays small
    big = {q: n for q, n in class_shape.with_bases(table)
           if _mine(q) and n > 500 and not q.endswith(".ShardView")}
    assert big == {}
    assert table[AREA + "shard.ShardView"].lines <= 100


@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _grads(n: int, t: int) -> np.ndarray:
    return np.random.default_rng(t).standard_normal((n, DIM)).astype(np.float32)


def test_parts_share_the_collectives_and_hold_no_store(tmp_path, world_of_one):
    import embstore_torch.distributed as ed

    store = ed.open(f"lmdb://{tmp_path}/s-{{rank}}", dim=DIM, optimizer=ADAGRAD, timeout=30)
    try:
        parts = [store.keyed, store.queries, store.exports, store.checkpoint]
        for part in [store.collectives, *parts]:
            assert all(v is not store for v in vars(part).values()), type(part).__name__
        assert all(part.collectives is store.collectives for part in parts)
        keys = np.array([1, 2, 3], np.int64)
        store.lookup(keys)
        store.update(keys, _grads(3, 0))
        # the global step is the collectives' own, kept in line on this rank's store
        assert store.step == store.collectives.step == store.local.step == 1
        store.step = 5
        assert store.local.step == 5
    finally:
        store.close()
    assert store.local is None


def test_a_rank_restores_its_snapshot_through_its_checkpoint_part(tmp_path, world_of_one):
    import embstore_torch.distributed as ed
    from embstore_torch.distributed.checkpoint import restore_shard, shard_state

    store = ed.open(f"lmdb://{tmp_path}/s-{{rank}}", dim=DIM, optimizer=ADAGRAD, timeout=30)
    keys = np.array([4, 5, 6, 7], np.int64)
    store.lookup(keys)
    store.update(keys, _grads(4, 1))
    snap = shard_state(store)
    saved = store.lookup(keys, insert=False)
    for t in (2, 3):
        store.update(keys, _grads(4, t))
    assert store.step == 3 and not np.array_equal(store.lookup(keys, insert=False), saved)
    restore_shard(store, snap, "test")
    assert store.step == store.local.step == 1
    assert np.array_equal(store.lookup(keys, insert=False), saved)
    with embstore.open("memory://", dim=DIM) as plain:  # not a distributed store
        with pytest.raises(InvalidInputError, match="not a distributed store"):
            shard_state(plain)
        with pytest.raises(InvalidInputError, match="not a distributed store"):
            restore_shard(plain, snap)
    store.close()
    with pytest.raises(StoreClosedError):  # a closed store: the typed error, no AttributeError
        shard_state(store)
    with pytest.raises(StoreClosedError):
        restore_shard(store, snap)
