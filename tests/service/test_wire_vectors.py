"""Vectors read from a request without a copy (``wire.vectors_from``): the right rows of a
sliced column, a typed error for nulls and wrong widths, never a silent zero."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from embstore.errors import InvalidInputError
from embstore.service import wire


def test_vectors_of_a_sliced_column_are_its_own_rows():
    v = np.arange(40, dtype=np.float32).reshape(10, 4)
    col = wire.vectors_column(v)
    np.testing.assert_array_equal(wire.vectors_from(col, 4, 10), v)
    np.testing.assert_array_equal(wire.vectors_from(col.slice(3, 5), 4, 5), v[3:8])
    chunked = pa.chunked_array([col.slice(0, 4), col.slice(4, 6)])
    np.testing.assert_array_equal(wire.vectors_from(chunked, 4, 10), v)
    out = wire.vectors_from(col, 4, 10)
    assert out.dtype == np.float32 and not out.flags.writeable  # a view: callers copy


def test_null_elements_and_wrong_shapes_are_refused():
    vals = pa.array([1.0, None, 3.0, 4.0], pa.float32())
    col = pa.FixedSizeListArray.from_arrays(vals, 2)
    with pytest.raises(InvalidInputError, match="null"):
        wire.vectors_from(col, 2, 2)
    with pytest.raises(InvalidInputError, match="expected 3 vectors"):
        wire.vectors_from(wire.vectors_column(np.ones((2, 4), np.float32)), 4, 3)
    with pytest.raises(InvalidInputError, match="fixed-size lists of 8"):
        wire.vectors_from(wire.vectors_column(np.ones((2, 4), np.float32)), 8, 2)


def test_records_of_a_sliced_batch_copied_or_viewed_are_its_own_rows():
    import embstore

    with embstore.open("memory://", dim=4, optimizer="adagrad") as store:
        store.update(np.arange(10), np.arange(40, dtype=np.float32).reshape(10, 4))
        recs, _ = store.get_records(np.arange(10))
    col = pa.Array.from_buffers(pa.binary(recs.dtype.itemsize), 10,
                                [None, pa.py_buffer(recs.view(np.uint8))])
    batch = pa.RecordBatch.from_pydict({"key": pa.array(np.arange(10)), "rec": col})
    for copy in (True, False):
        keys, got = wire.records_from(batch.slice(3, 4), "int64", recs.dtype, copy=copy)
        assert keys.tolist() == [3, 4, 5, 6] and got.dtype == recs.dtype
        assert got.tobytes() == recs[3:7].tobytes()
    keys, got = wire.records_from(batch, "int64", recs.dtype)
    got["version"] = 0                                  # a copy: the batch is untouched
    assert wire.records_from(batch, "int64", recs.dtype)[1].tobytes() == recs.tobytes()
