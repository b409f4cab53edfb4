"""The stamps a memory:// fused step writes (``memory_rows._metadata``): the 8 bytes of each
assigned field packed by ``struct`` are the bytes numpy's structured array gives, and values
``struct`` refuses take numpy's conversion."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from embstore.backends.memory_rows import _metadata

STAMPS = np.dtype([("last_seen", "<f8"), ("last_step", "<i8"), ("version", "<i8")])


class _Update:
    def __init__(self, assign: dict) -> None:
        self.add = {"count": np.array([1, 2, 3], dtype=np.int64)}
        self.assign = assign


def _numpy_bits(assign: dict, dtype: np.dtype) -> np.ndarray:
    return np.array([tuple(assign.values())], dtype=dtype).view(np.uint64)


@given(st.floats(allow_nan=False), st.integers(-2**63, 2**63 - 1),
       st.integers(0, 2**63 - 1))
def test_stamp_bytes_are_numpys(seen: float, step: int, version: int) -> None:
    assign = {"last_seen": seen, "last_step": step, "version": version}
    counts, bits = _metadata(_Update(assign), 3, np.zeros(3, dtype=np.intp), STAMPS)
    assert bits.tobytes() == _numpy_bits(assign, STAMPS).tobytes()
    assert counts.tolist() == [[1, 2, 3]]


def test_numpy_scalars_and_values_struct_refuses_convert_as_numpy_does() -> None:
    for assign in ({"last_seen": np.float64(2.5), "last_step": np.int64(-3), "version": 5},
                   {"last_seen": 3, "last_step": 2.0, "version": np.uint64(7)}):
        bits = _metadata(_Update(assign), 3, np.zeros(3, dtype=np.intp), STAMPS)[1]
        assert bits.tobytes() == _numpy_bits(assign, STAMPS).tobytes()


def test_a_field_struct_has_no_code_for_takes_numpys_path() -> None:
    odd = np.dtype([("version", ">i8")])  # (big-endian: not the packer's)
    bits = _metadata(_Update({"version": 258}), 3, np.zeros(1, dtype=np.intp), odd)[1]
    assert bits.tobytes() == _numpy_bits({"version": 258}, odd).tobytes()
