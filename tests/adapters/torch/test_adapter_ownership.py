"""The adapters use their own state and the public names of embstore only (issue #31): no
private reach, no function taking its owner, no mixin in ``embstore_torch`` (but for its
``distributed`` folder) and ``embstore_tf``; the entry points the torch custom ops call on a
module are public and behave as the eager path."""

from __future__ import annotations

import numpy as np
import pytest

from embstore.testing import class_shape
from embstore.testing.architecture import private_reaches
from embstore.testing.source import load_modules


def _adapter(name: str) -> bool:
    return ((name.startswith("embstore_torch") and not name.startswith(
        "embstore_torch.distributed")) or name.startswith("embstore_tf"))


def test_the_adapters_reach_into_no_private_state_and_take_no_owner():
    modules = load_modules()
    reaches = [f"{r.module}:{r.lineno} {r.text}" for r in private_reaches(modules)
               if _adapter(r.module)]
    assert reaches == []
    owners = [f"{o.module}.{o.function}({o.parameter})"
              for o in class_shape.owner_passing(modules) if _adapter(o.module)]
    assert owners == []
    table = class_shape.classes(modules)
    assert {k: v for k, v in class_shape.mixins(table).items() if _adapter(k)} == {}
    assert {k: v for k, v in class_shape.borrowed(table).items() if _adapter(k)} == {}
    assert [(n, size) for n, size in class_shape.with_bases(table)
            if _adapter(n) and size > 500] == []


def test_parse_dir_url_is_public_in_embstore_urls():
    from embstore.errors import InvalidURLError
    from embstore.urls import parse_dir_url

    assert parse_dir_url("lmdb:///data/a/../store", "lmdb") == "/data/store"
    with pytest.raises(InvalidURLError, match="three slashes"):
        parse_dir_url("lmdb://host/data", "lmdb")
    with pytest.raises(InvalidURLError, match="not a rocksdb"):
        parse_dir_url("lmdb:///data", "rocksdb")


torch = pytest.importorskip("torch")

import embstore  # noqa: E402
from embstore_torch import DynamicEmbedding, KeyedJagged  # noqa: E402
from embstore_torch._keys import prepare  # noqa: E402


def test_the_custom_ops_entry_points_read_and_update_as_the_eager_path():
    dim = 3
    ids = torch.tensor([[1, 0, 2, 1]])
    eager_store = embstore.open("memory://", dim=dim, optimizer=embstore.optim.SGD(0.5))
    op_store = embstore.open("memory://", dim=dim, optimizer=embstore.optim.SGD(0.5))
    eager, module = (DynamicEmbedding(s, padding_key=0) for s in (eager_store, op_store))
    grad = torch.arange(4 * dim, dtype=torch.float32).reshape(1, 4, dim)

    out = eager(ids)
    (out * grad).sum().backward()

    batch = prepare(ids)
    rows = module.lookup_rows(batch, True)  # the forward of embstore::lookup
    np.testing.assert_array_equal(rows[batch.inv.reshape(-1).numpy()],
                                  out.detach().reshape(-1, dim).numpy())
    module.apply_gradient(batch, grad.reshape(-1, dim))  # its backward
    assert not op_store.contains([0])[0]  # the padding key is never written
    np.testing.assert_array_equal(op_store.lookup([1, 2], insert=False),
                                  eager_store.lookup([1, 2], insert=False))
    assert op_store.step == eager_store.step == 1


def test_keyed_jagged_hands_its_lengths_as_an_array():
    kj = KeyedJagged(["a", "b"], torch.tensor([1, 2, 3]), lengths=[2, 0, 1, 0])
    lengths = kj.lengths_array()
    assert isinstance(lengths, np.ndarray) and lengths.dtype == np.int64
    np.testing.assert_array_equal(lengths, kj.lengths().numpy())
