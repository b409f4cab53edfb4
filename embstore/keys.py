"""Public helpers for batches of keys: normalization, dedupe and the fixed key hash.

String keys run through compiled loops here (UTF-8 encoding, XXH3-64 hashing, hash-table
dedupe), so a pipeline that feeds raw strings needs no per-key Python of its own:

>>> from embstore.keys import factorize
>>> uniq, inverse = factorize(["the", "cat", "the"])
>>> uniq.tolist(), inverse.tolist()
([b'the', b'cat'], [0, 1, 0])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._keys import BYTES_KEY_HASH, factorize_keys, key_hash64, normalize_keys

__all__ = ["BYTES_KEY_HASH", "factorize", "factorize_keys", "hash64", "key_hash64", "normalize",
           "normalize_keys"]


def normalize(keys: Any, key_type: str = "bytes") -> np.ndarray:
    """Keys as the stores take them: a 1-D int64 array, or a 1-D object array of ``bytes``.

    Accepts lists/tuples of ``str``/``bytes``, numpy ``S``/``U``/``O``/``StringDType``
    arrays, pyarrow string/binary arrays (chunked and large too), tf.string tensors, and for
    ``key_type="int64"`` integer arrays and tensors. ``str`` is UTF-8 encoded.
    """
    return normalize_keys(keys, key_type)


def factorize(keys: Any) -> tuple[np.ndarray, np.ndarray]:
    """Distinct string keys in first-seen order and each element's index among them.

    Returns ``(uniq, inverse)``: ``uniq`` an object array of ``bytes``, ``inverse`` int64,
    with ``uniq[inverse]`` equal to the normalized keys. Hashing and comparing run in
    compiled code (no per-key Python).
    """
    k = normalize_keys(keys, "bytes")
    first, inverse = factorize_keys(k)
    return k[first], inverse


def hash64(keys: Any, key_type: str = "bytes") -> np.ndarray:
    """The fixed 64-bit hash embstore routes keys by (``sharded://``), as uint64.

    bytes keys: XXH3-64 with seed 0 (``xxhash.xxh3_64_intdigest``); int64 keys: splitmix64.
    """
    return key_hash64(normalize_keys(keys, key_type))
