"""The TF adapter's own state behind public calls (issue #31): a layer rebuilt over a
persistent store refuses a file's rows through its own guard, and one
:class:`~embstore_tf._checkpoint.RowsReplacement` replaces a store's rows and step, or puts
them back."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")

import embstore  # noqa: E402
from embstore.errors import CorruptFileError  # noqa: E402
from embstore_tf import DynamicEmbedding  # noqa: E402
from embstore_tf._checkpoint import RowsReplacement  # noqa: E402

DIM = 4


def _snapshot(store) -> bytes:
    buf = io.BytesIO()
    store.export(buf)
    return buf.getvalue()


def test_a_layer_that_refuses_rows_from_a_file_raises_and_keeps_its_rows():
    store = embstore.open("memory://", dim=DIM)
    store.assign([1, 2], np.ones((2, DIM), np.float32))
    other = embstore.open("memory://", dim=DIM)
    other.assign([7], np.full((1, DIM), 3.0, np.float32))
    layer = DynamicEmbedding(store)
    weights = {"0": np.zeros(1, np.float32),
               "embstore_native": np.frombuffer(_snapshot(other), np.uint8)}
    layer.refuse_rows_from_file()
    with pytest.raises(CorruptFileError, match="never overwrites"):
        layer.load_own_variables(weights)
    assert len(store) == 2
    np.testing.assert_array_equal(store.lookup([1, 2], insert=False), 1.0)


def test_rows_replacement_takes_the_snapshot_rows_and_step():
    source = embstore.open("memory://", dim=DIM, optimizer="adagrad")
    source.update([5, 6], np.ones((2, DIM), np.float32))
    source.update([5], np.ones((1, DIM), np.float32))
    target = embstore.open("memory://", dim=DIM, optimizer="adagrad")
    target.assign([1, 5], np.zeros((2, DIM), np.float32))
    RowsReplacement(target, "test restore").run(_snapshot(source), step=9)
    assert len(target) == 2 and not target.contains([1])[0]
    np.testing.assert_array_equal(target.lookup([5, 6], insert=False),
                                  source.lookup([5, 6], insert=False))
    assert target.step == 9
    RowsReplacement(target, "test restore").run(_snapshot(source))  # the snapshot's own step
    assert target.step == source.step == 2
