"""Key normalization at the public edge, and the fixed 64-bit key hash.

Keys enter as numpy arrays, lists, torch/tf tensors (int64) or string containers: lists or
tuples of ``bytes``/``str``, numpy ``S``/``U``/``O``/``StringDType`` arrays, pyarrow string or
binary arrays (chunked, large), tf.string tensors (``str`` is UTF-8 encoded). Everything after
this module sees either a contiguous 1-D ``int64`` array or a 1-D numpy object array of
``bytes``; the per-key work on the latter (encoding, hashing, table probes, batch dedupe) runs
in compiled loops (``embstore._cython.strkeys``).

A numpy ``S`` array cannot hold trailing NUL bytes (numpy strips them on read), so keys that
end in ``b"\\0"`` must be given as bytes objects (a list or an object array).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ._cython import strkeys
from .errors import InvalidInputError, KeyTypeError

KEY_TYPES = ("int64", "bytes")
#: the hash of bytes keys (recorded by ``sharded://``, whose key placement depends on it)
BYTES_KEY_HASH = "xxh3-64"

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def check_key_type(key_type: str) -> str:
    if key_type not in KEY_TYPES:
        raise InvalidInputError(f"key_type must be one of {KEY_TYPES}, got {key_type!r}")
    return key_type


def _to_numpy(keys: Any) -> Any:
    # Framework tensors expose .numpy(); they are converted without importing the framework.
    if hasattr(keys, "detach") and hasattr(keys, "cpu"):
        return keys.detach().cpu().numpy()
    if hasattr(keys, "numpy") and not isinstance(keys, np.ndarray):
        return keys.numpy()
    return keys


class DistinctKeys:
    """A batch of keys in a store's key form (a contiguous 1-D int64 array, or an object
    array of plain ``bytes``) in which no key repeats: what a dedupe found.

    Stores take it wherever they take keys. ``lookup`` and ``update`` then skip the work the
    dedupe did already: normalizing the batch again, and summing the rows of repeated keys
    (``update``) or deduplicating the keys it inserts (``lookup``), which would find none.
    :func:`embstore.keys.factorize` returns one with ``distinct=True`` at no extra cost (the
    PyTorch adapter hands its batches' keys to the store so); ``DistinctKeys(keys, key_type)``
    normalizes any keys and checks them (``InvalidInputError`` where a key repeats).

    Attributes
    ----------
    keys : numpy.ndarray
        The keys (do not modify them: the batch is known distinct as it is).
    """

    __slots__ = ("keys",)

    def __init__(self, keys: Any, key_type: str = "bytes") -> None:
        k = normalize_keys(keys, key_type)
        n_distinct = (len(factorize_keys(k)[0]) if k.dtype == object
                      else len(np.unique(k)))
        if n_distinct != len(k):
            raise InvalidInputError(f"DistinctKeys: {len(k) - n_distinct} of {len(k)} keys "
                                    "repeat an earlier key")
        self.keys = k

    @classmethod
    def found(cls, keys: np.ndarray) -> DistinctKeys:
        """The distinct keys a dedupe returned, as they are: not checked again (trusted)."""
        out = cls.__new__(cls)
        out.keys = keys
        return out

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Any:
        return iter(self.keys)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        # a store that does not know this type reads it as the array it wraps
        if dtype is not None:
            return self.keys.astype(dtype)
        return self.keys.copy() if copy else self.keys

    def __repr__(self) -> str:
        return f"DistinctKeys({self.keys!r})"


def normalize_keys(keys: Any, key_type: str) -> np.ndarray:
    """Return keys as a contiguous 1-D int64 array or 1-D object array of bytes.

    Raises ``KeyTypeError`` when the keys do not fit ``key_type`` and ``InvalidInputError``
    for shapes other than 1-D (a scalar is promoted to one key).
    """
    return normalize_distinct(keys, key_type)[0]


def normalize_distinct(keys: Any, key_type: str) -> tuple[np.ndarray, bool]:
    """:func:`normalize_keys`, and whether the keys are known distinct: a
    :class:`DistinctKeys` of the store's key type, taken as it is (no second walk over it)."""
    if type(keys) is DistinctKeys:
        k = keys.keys
        if k.dtype == (object if key_type == "bytes" else np.int64):
            return k, True
        keys = k  # the other key type's: normalized (and refused) as any array
    keys = _to_numpy(keys)
    if key_type == "int64":
        return _normalize_int_keys(keys), False
    return _normalize_bytes_keys(keys), False


def normalize_unchecked(keys: Any, key_type: str, probe_checks: bool
                        ) -> tuple[np.ndarray, bool, bool]:
    """:func:`normalize_distinct`, and whether the keys were checked. With ``probe_checks``
    (a backend whose probe checks bytes keys itself: ``PlainOnlyProbes``) a 1-D contiguous
    object array of a bytes-key store is taken as it is, its key objects unread (False):
    the probe is then told ``plain_only``, and on ``NotPlainBytes`` the caller normalizes
    the batch (encoding str, refusing a wrong type) and asks again."""
    if probe_checks and key_type == "bytes" and raw_string_array(keys):
        return keys, False, False
    k, distinct = normalize_distinct(keys, key_type)
    return k, distinct, True


_U64_SPAN = 1 << 64


def _python_ints_as_int64(keys: list | tuple) -> np.ndarray | None:
    """Python ints in [-2**63, 2**64) as int64 (uint64 bits reinterpreted), or None when
    ``keys`` are not all ints. numpy reads ``[2**63, 5]`` as float64 (lossy), hence this."""
    if not all(isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_))
               for k in keys):
        return None
    if any(not -(1 << 63) <= int(k) < _U64_SPAN for k in keys):
        raise KeyTypeError("integer keys must lie in [-2**63, 2**64) to fit 64 bits")
    return np.array([int(k) % _U64_SPAN for k in keys], dtype=np.uint64).view(np.int64)


def _normalize_int_keys(keys: Any) -> np.ndarray:
    if isinstance(keys, (bytes, str)):
        raise KeyTypeError("this store has int64 keys; got a bytes/str key")
    if isinstance(keys, (int, np.integer)) and not isinstance(keys, (bool, np.bool_)):
        keys = [keys]
    arr = np.asarray(keys) if not isinstance(keys, (list, tuple)) else _list_keys(keys)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise InvalidInputError(f"keys must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype == np.int64:
        return np.ascontiguousarray(arr)
    if arr.dtype == np.uint64:
        # Hashed ids use all 64 bits: reinterpreted, not converted, so every uint64 maps to
        # one distinct int64 (2**63 + x becomes -2**63 + x); ``keys.view(np.uint64)`` undoes it.
        return np.ascontiguousarray(arr).view(np.int64)
    if arr.dtype.kind in "iu":
        return np.ascontiguousarray(arr, dtype=np.int64)
    if arr.dtype.kind in "OUSb":
        raise KeyTypeError(f"this store has int64 keys; got keys of dtype {arr.dtype}")
    raise KeyTypeError(f"int64 keys required; got dtype {arr.dtype} (floats are not keys)")


def _list_keys(keys: list | tuple) -> np.ndarray:
    arr = np.asarray(keys) if keys else np.empty(0, dtype=np.int64)
    if arr.dtype.kind in "fO" and arr.ndim == 1:  # ints beyond int64 became float or object
        ints = _python_ints_as_int64(keys)
        if ints is not None:
            return ints
    return arr


def _from_arrow(keys: Any) -> Any:
    # pyarrow arrays without importing pyarrow: to_numpy gives an object array of str/bytes
    # (None for nulls, refused below), built in C.
    if type(keys).__module__.startswith("pyarrow") and hasattr(keys, "to_numpy"):
        return keys.to_numpy(zero_copy_only=False)
    return keys


def _bad_key_error(keys: Any, e: TypeError) -> Exception:
    """The error for a container that held something other than bytes/str keys."""
    for k in keys:
        if isinstance(k, (list, tuple, np.ndarray)):
            return InvalidInputError(f"keys must be a flat sequence, got a {type(k).__name__} "
                                     "among them")
        if not isinstance(k, (bytes, str, bytearray, memoryview)):
            return KeyTypeError(f"this store has bytes keys; got a key of type "
                                f"{type(k).__name__}")
    return KeyTypeError(f"this store has bytes keys: {e}")


def _normalize_bytes_keys(keys: Any) -> np.ndarray:
    if isinstance(keys, (bytes, str, bytearray, memoryview)):
        keys = [keys]
    keys = _from_arrow(keys)
    if isinstance(keys, np.ndarray):
        if keys.ndim == 0:
            keys = keys.reshape(1)
        if keys.ndim != 1:
            raise InvalidInputError(f"keys must be 1-D, got shape {keys.shape}")
        if keys.dtype.kind in "SUT":  # T: numpy's StringDType
            keys = keys.astype(object)
        elif keys.dtype.kind != "O":
            raise KeyTypeError(f"this store has bytes keys; got keys of dtype {keys.dtype}")
        keys = np.ascontiguousarray(keys)
        if strkeys.all_plain_bytes(keys):
            # Already the store's key form: used as it is, as an int64 array is for int64
            # keys (a copy would cost a write to every scattered key object).
            return keys
    elif not isinstance(keys, (list, tuple)):
        if not isinstance(keys, Iterable):
            raise KeyTypeError(f"this store has bytes keys; got {type(keys).__name__}")
        keys = list(keys)
    try:
        return strkeys.encode_keys(keys)
    except TypeError as e:
        raise _bad_key_error(keys, e) from None


def factorize_keys(keys: Any) -> tuple[np.ndarray, np.ndarray]:
    """Dedupe a batch of string keys in compiled code: ``(first, inverse)`` (int64 arrays).

    ``keys`` is a list, tuple or 1-D object array of ``bytes``/``str`` (a str and its UTF-8
    bytes are one key). ``first`` holds the position of each distinct key's first occurrence,
    in first-seen order, and ``inverse`` the distinct-key number of every element, so
    ``keys[first]`` are the distinct keys and ``keys[first][inverse]`` equals ``keys``.
    """
    try:
        return strkeys.factorize(keys)
    except TypeError as e:
        raise _bad_key_error(keys, e) from None


def raw_string_array(keys: Any) -> bool:
    """Whether ``keys`` is a 1-D contiguous object array: the compiled loops read its
    ``bytes``/``str`` items as they are (str by its UTF-8 form, the key it normalizes to), so
    a dedupe or a hash of it needs no normalizing walk over every key object first."""
    return (type(keys) is np.ndarray and keys.dtype == object and keys.ndim == 1
            and keys.flags.c_contiguous)


def factorize_raw(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`factorize_keys` of a :func:`raw_string_array` as it is, or None where an item
    is neither bytes nor str (the caller normalizes then, and refuses with a typed error)."""
    try:
        return strkeys.factorize(keys)
    except TypeError:
        return None


def hash64_raw(keys: np.ndarray) -> np.ndarray | None:
    """:func:`key_hash64` of a :func:`raw_string_array` as it is (the hashes of its
    normalized keys), or None where an item is neither bytes nor str."""
    try:
        return strkeys.hash64(keys)
    except TypeError:
        return None


def keys_in(keys: np.ndarray, among: np.ndarray) -> np.ndarray:
    """Bool mask (the shape of ``keys``) of the keys found among ``among``: ``np.isin`` for
    int64 keys; for bytes keys a compiled hash set of ``among`` probed once per key, linear
    in both (``np.isin`` over object arrays compares every pair)."""
    if keys.dtype != object:
        return np.isin(keys, among)
    flat = np.ascontiguousarray(keys.reshape(-1))
    if not among.size or not len(flat):
        return np.zeros(keys.shape, bool)
    try:
        return strkeys.isin(flat, np.ascontiguousarray(among.reshape(-1))).reshape(keys.shape)
    except TypeError as e:
        raise _bad_key_error(flat, e) from None


def count_matching(keys: np.ndarray, marked: np.ndarray) -> int:
    """How many bytes ``keys`` equal the key at some ``marked`` position (a bool mask; those
    positions count themselves), in one compiled pass: each key hashed once, a set of the
    marked keys, a probe per other key."""
    return int(strkeys.count_matching(keys, np.ascontiguousarray(marked, dtype=bool)
                                      .view(np.uint8)))


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer over a uint64 array (wrapping arithmetic)."""
    z = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += _GOLDEN
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    return z


def key_hash64(keys: np.ndarray) -> np.ndarray:
    """A fixed, process-independent 64-bit hash of each key (never Python's salted ``hash``).

    int64 keys use splitmix64; bytes keys XXH3-64 with seed 0 (:data:`BYTES_KEY_HASH`), the
    value ``xxhash.xxh3_64_intdigest(key)`` gives, computed in a compiled loop.
    """
    if keys.dtype == np.int64:
        return splitmix64(keys.view(np.uint64))
    return strkeys.hash64(keys)


_SIGN = np.uint64(1 << 63)


def ordered_int64_bytes(keys: np.ndarray) -> np.ndarray:
    """Big-endian uint64 with the sign bit flipped: byte order equals numeric order, which is
    how the ordered key-value backends (LMDB, RocksDB, Bigtable) store int64 keys."""
    return (keys.view(np.uint64) ^ _SIGN).astype(">u8")


def int64_from_ordered(be: np.ndarray) -> np.ndarray:
    """Inverse of :func:`ordered_int64_bytes` over a ``>u8`` array."""
    return (be.astype(np.uint64) ^ _SIGN).view(np.int64)

