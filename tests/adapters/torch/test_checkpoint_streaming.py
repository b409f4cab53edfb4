"""Large persistent tables are not copied into memory by a checkpoint: ``state_dict`` carries a
reference to the flushed version beyond the inline limit, and ``embstore_torch.checkpoint``
streams the rows beside the checkpoint (memory measured with tracemalloc)."""

from __future__ import annotations

import io
import os
import tracemalloc
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import embstore  # noqa: E402
import embstore_torch.checkpoint as ckpt  # noqa: E402
from embstore_torch import DynamicEmbedding  # noqa: E402
from tests.restore_crash import table_digest  # noqa: E402

ROWS, DIM = 80_000, 64


def _model(url: str):
    store = embstore.open(url, dim=DIM, optimizer="adagrad")
    if len(store) == 0:
        for lo in range(0, ROWS, 8192):
            keys = np.arange(lo, min(ROWS, lo + 8192), dtype=np.int64)
            store.assign(keys, np.full((len(keys), DIM), lo / ROWS, np.float32))
    model = torch.nn.Sequential(DynamicEmbedding(store), torch.nn.Linear(DIM, 2))
    return store, model


def _train(model, seed: int) -> None:
    keys = torch.from_numpy(np.random.default_rng(seed).integers(0, ROWS, 256))
    model(keys).sum().backward()


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_state_dict_of_a_large_persistent_table_is_a_reference_with_bounded_memory(tmp_path):
    store, model = _model(f"lmdb://{tmp_path}/big")
    table = len(store) * store.layout.itemsize
    model[0].checkpoint_rows = 1 << 20  # inline up to 1 MiB of records; this table is ~42 MiB
    buf = io.BytesIO()
    peak = _peak(lambda: torch.save(model.state_dict(), buf))
    assert peak < table // 10, f"torch.save(state_dict) took {peak >> 20} MiB"
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)["0._extra_state"]
    assert state["rows"] is None and state["version"] == store.version
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the store is at the referenced version: no warning
        model.load_state_dict(state_dict := torch.load(io.BytesIO(buf.getvalue()),
                                                      weights_only=True))
    _train(model, 1)
    with pytest.warns(UserWarning, match="moved on"):
        model.load_state_dict(state_dict)
    store.close()


def test_default_inline_limit_keeps_small_persistent_tables_self_contained(tmp_path):
    with embstore.open(f"lmdb://{tmp_path}/small", dim=4) as s:
        s.lookup(np.arange(100))
        state = DynamicEmbedding(s).state_dict()["_extra_state"]
        assert isinstance(state["rows"], bytes) and "version" not in state


def test_streamed_checkpoint_restores_the_table_with_bounded_memory(tmp_path):
    store, model = _model(f"lmdb://{tmp_path}/big")
    model[0].checkpoint_rows = 1 << 20
    table = len(store) * store.layout.itemsize
    _train(model, 1)
    path = str(tmp_path / "ckpt.pt")
    peak = _peak(lambda: ckpt.save(model, path))
    assert peak < min(table // 2, 4 * ckpt.EXPORT_CHUNK_BYTES), (
        f"checkpoint.save took {peak >> 20} MiB for {table >> 20} MiB")
    want = (table_digest(store), store.step, model[1].weight.detach().clone())
    assert sorted(os.listdir(ckpt.rows_dir(path))) == [f"0.v{store.version}.emb"]
    _train(model, 2)
    store.lookup(np.arange(ROWS, ROWS + 500))
    with torch.no_grad():
        model[1].weight.add_(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.load(model, path)
    assert (table_digest(store), store.step) == want[:2]
    assert torch.equal(model[1].weight, want[2])
    # a second save keeps only the export its checkpoint names
    _train(model, 3)
    ckpt.save(model, path)
    assert sorted(os.listdir(ckpt.rows_dir(path))) == [f"0.v{store.version}.emb"]
    store.close()
