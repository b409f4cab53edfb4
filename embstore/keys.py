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

from ._keys import (
    BYTES_KEY_HASH,
    DistinctKeys,
    factorize_keys,
    factorize_raw,
    hash64_raw,
    key_hash64,
    normalize_keys,
    raw_string_array,
)

# one public name per operation; the compiled primitives behind them stay in embstore._keys
__all__ = ["BYTES_KEY_HASH", "DistinctKeys", "factorize", "hash64", "normalize"]


def normalize(keys: Any, key_type: str = "bytes") -> np.ndarray:
    """Keys as the stores take them: a 1-D int64 array, or a 1-D object array of ``bytes``.

    Accepts lists/tuples of ``str``/``bytes``, numpy ``S``/``U``/``O``/``StringDType``
    arrays, pyarrow string/binary arrays (chunked and large too), tf.string tensors, and for
    ``key_type="int64"`` integer arrays and tensors. ``str`` is UTF-8 encoded.
    """
    return normalize_keys(keys, key_type)


def factorize(keys: Any, *, return_index: bool = False, distinct: bool = False
              ) -> tuple[Any, np.ndarray] | tuple[Any, np.ndarray, np.ndarray]:
    """Distinct string keys in first-seen order and each element's index among them.

    Returns ``(uniq, inverse)``: ``uniq`` an object array of ``bytes``, ``inverse`` int64,
    with ``uniq[inverse]`` equal to the normalized keys. With ``return_index=True``,
    ``(uniq, first, inverse)``: ``first`` (int64) the position of each distinct key's first
    occurrence, to pick the caller's own values (``str`` kept as ``str``). Hashing and
    comparing run in compiled code (no per-key Python). With ``distinct=True``, ``uniq`` is
    a :class:`DistinctKeys` (the array is its ``keys``): a store's ``lookup`` and ``update``
    take it and skip normalizing and deduplicating it again.
    """
    found = factorize_raw(keys) if raw_string_array(keys) else None
    if found is not None:
        # deduplicated as they are, then only the distinct keys normalized: one walk over
        # every key object instead of two (the same groups: a str is its UTF-8 bytes' key)
        first, inverse = found
        k = normalize_keys(keys[first], "bytes")
        uniq: Any = k
    else:
        k = normalize_keys(keys, "bytes")
        first, inverse = factorize_keys(k)
        uniq = k[first]
    uniq = DistinctKeys.found(uniq) if distinct else uniq
    return (uniq, first, inverse) if return_index else (uniq, inverse)


def hash64(keys: Any, key_type: str | None = None) -> np.ndarray:
    """The fixed 64-bit hash embstore routes keys by (``sharded://``), as uint64.

    bytes keys: XXH3-64 with seed 0 (``xxhash.xxh3_64_intdigest``); int64 keys: splitmix64.
    ``key_type`` defaults to ``"int64"`` for an integer array, else ``"bytes"``.
    """
    if key_type is None:
        integral = isinstance(keys, np.ndarray) and keys.dtype.kind in "iu"
        key_type = "int64" if integral else "bytes"
    if key_type == "bytes" and raw_string_array(keys):
        hashes = hash64_raw(keys)  # one walk over the key objects, none to normalize them
        if hashes is not None:
            return hashes
    return key_hash64(normalize_keys(keys, key_type))
