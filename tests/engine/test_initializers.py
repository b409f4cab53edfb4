"""The compiled initializers against a plain-Python statement of the same formula, bit for bit.

A key's initial vector is part of what a store promises (two stores or shards with one seed
agree on it), so a faster fill must not change a single value.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from embstore import init
from embstore._keys import key_hash64

M64 = (1 << 64) - 1


def mix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def wyrand(state: int) -> tuple[int, int]:
    state = (state + 0xA0761D6478BD642F) & M64
    t = state * (state ^ 0xE7037ED1A0B428DB)
    return state, ((t >> 64) ^ t) & M64


def uniform_row(h: int, seed: int, dim: int, low: float, high: float) -> np.ndarray:
    state, row = mix64(h ^ mix64(seed)), []
    while len(row) < dim:
        state, r = wyrand(state)
        row.append(low + (high - low) * ((r >> 40) / 2**24))
        row.append(low + (high - low) * (((r >> 8) & 0xFFFFFF) / 2**24))
    return np.array(row[:dim], dtype=np.float32)


def normal_row(h: int, seed: int, dim: int, mean: float, std: float, trunc: float) -> np.ndarray:
    state, row = mix64(h ^ mix64(seed)), []
    while len(row) < dim:
        state, r1 = wyrand(state)
        state, r2 = wyrand(state)
        z = math.sqrt(-2.0 * math.log(1.0 - (r1 >> 11) / 2**53)) * math.cos(
            2.0 * math.pi * ((r2 >> 11) / 2**53))
        if trunc <= 0 or -trunc <= z <= trunc:
            row.append(mean + std * z)
    return np.array(row, dtype=np.float32)


KEYS = np.array([0, 1, -1, 42, 2**62 + 7, -(2**63)], dtype=np.int64)


@pytest.mark.parametrize("dim", [1, 2, 3, 8, 65])
@pytest.mark.parametrize("n", [1, 2, 5, 6])  # odd and even: rows are filled two at a time
def test_uniform_matches_the_formula(dim, n):
    keys, seed = KEYS[:n], 11
    got = init.Uniform(-0.25, 0.5)(keys, dim, seed)
    hashes = key_hash64(keys)
    want = np.stack([uniform_row(int(h), seed, dim, -0.25, 0.5) for h in hashes])
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("cls,trunc", [(init.Normal, 0.0), (init.TruncatedNormal, 2.0)])
def test_normal_matches_the_formula(cls, trunc):
    keys, seed, dim = KEYS, 3, 9
    got = cls(std=0.1, mean=0.5)(keys, dim, seed)
    want = np.stack([normal_row(int(h), seed, dim, 0.5, 0.1, trunc) for h in key_hash64(keys)])
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_uniform_of_no_keys_or_no_columns():
    assert init.Uniform()(KEYS[:0], 4).shape == (0, 4)
    assert init.Uniform()(KEYS, 0).shape == (len(KEYS), 0)
