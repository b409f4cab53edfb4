"""Every store-like is held to the declared store protocol: names and signatures."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import embstore
from embstore import StoreInfo, StoreProtocol
from embstore.engine.protocols import protocol_members
from embstore.engine.unpickled import UnopenedStore
from embstore.errors import StoreNotFoundError
from embstore.testing.protocols import conformance_problems, signature_problems


def test_protocol_lists_what_callers_use():
    members = protocol_members(StoreProtocol)
    for name in ("lookup", "update", "assign", "delete", "contains", "export", "dim",
                 "key_type", "url", "read_only", "step", "optimizer", "layout", "flush",
                 "close", "stats", "check_writable", "__len__"):
        assert name in members
    assert "counts" in inspect.signature(members["update"]).parameters


def test_embedding_store_satisfies_the_protocol():
    assert conformance_problems(StoreProtocol, embstore.EmbeddingStore) == []
    with embstore.open("memory://", dim=4) as store:
        assert conformance_problems(StoreProtocol, store) == []
        assert isinstance(store, StoreProtocol)


def test_unopened_stand_in_satisfies_the_protocol_and_raises_on_use():
    stand_in = UnopenedStore("lmdb:///nowhere", StoreNotFoundError("gone"))
    assert conformance_problems(StoreProtocol, stand_in) == []
    for use in (lambda: stand_in.lookup([1]), lambda: stand_in.dim,
                lambda: stand_in.update([1], np.zeros((1, 4), np.float32), counts=None)):
        with pytest.raises(StoreNotFoundError, match="could not be reopened"):
            use()
    assert inspect.signature(UnopenedStore.update) == inspect.signature(
        protocol_members(StoreProtocol)["update"])


def test_store_to_create_satisfies_the_description():
    from embstore.transfer import NewStore

    target = NewStore("memory://", {"dim": 4})
    assert conformance_problems(StoreInfo, target) == []
    assert conformance_problems(StoreProtocol, target)  # it is no store yet


def test_distributed_store_satisfies_the_protocol():
    pytest.importorskip("torch")
    from embstore_torch.distributed.store import DistributedStore

    assert conformance_problems(StoreProtocol, DistributedStore) == []


def test_a_missing_member_or_a_narrower_signature_is_reported():
    class Partial:
        url = "memory://"
        dim = 4
        key_type = "int64"
        layout = None

        def check_writable(self, strict) -> None: ...

    problems = conformance_problems(StoreProtocol, Partial)
    assert "Partial.lookup: missing" in problems
    assert "Partial.check_writable: extra parameter 'strict' without a default" in problems

    def declared(keys, *, insert=True): ...

    def no_default(keys, *, insert): ...

    def renamed(ids, *, insert=True): ...

    sig = inspect.signature
    assert signature_problems(sig(declared), sig(no_default)) == ["'insert' has no default"]
    assert signature_problems(sig(declared), sig(renamed)) == [
        "positional parameter 0 is 'ids', declared 'keys'", "extra parameter 'ids' without a "
        "default"]


def test_distributed_store_assign_delete_optimizer_in_a_world_of_one(tmp_path):
    pytest.importorskip("torch")
    import torch.distributed as dist

    import embstore_torch.distributed as ed
    from tests.adapters.torch.test_distributed import _free_port

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        with ed.open(f"lmdb://{tmp_path}/d-{{rank}}-of-{{world}}", dim=4, timeout=30,
                     optimizer="adagrad") as store:
            assert conformance_problems(StoreProtocol, store) == []
            assert store.optimizer.name == "adagrad"
            keys = np.array([3, 1, 3, 2])
            values = np.arange(16, dtype=np.float32).reshape(4, 4)
            store.assign(keys, values)
            got = store.lookup(np.array([1, 2, 3]), insert=False)
            np.testing.assert_array_equal(got, values[[1, 3, 2]])  # key 3: the last value
            assert store.delete(np.array([2, 2, 9])) == 1
            assert store.contains(np.array([1, 2, 3])).tolist() == [True, False, True]
    finally:
        dist.destroy_process_group()
