"""Storage dtypes of vectors and optimizer slots: float32, float16 and bfloat16.

numpy has no bfloat16, so a bfloat16 value is stored as its 16-bit pattern in a ``uint16``
(the upper half of the float32 with the same sign and exponent). Everything computes in
float32: :func:`to_float32` widens stored values, :func:`from_float32` narrows results back,
rounding to nearest (ties to even) or stochastically.

Stochastic rounding rounds ``x`` up to the next representable value with probability equal to
the fraction of the gap it covers, so the expected stored value is ``x`` itself. Without it an
SGD step smaller than half a bfloat16 gap (about 0.4% of the weight) is lost every time: the
weight never moves. With it the weight moves by the step on average, as FBGEMM does for its
fp16 embedding weights.

``int8`` is for serving only (a store of it refuses ``update``): each row is quantized on its
own, as FBGEMM's fused 8-bit row-wise tables and Monolith's serving export do, into ``dim``
uint8 codes followed by a float32 ``scale`` and ``bias`` (``value = code * scale + bias``,
``bias`` the row's minimum, ``scale`` its range / 255): ``dim + 8`` bytes per vector, an error
of at most half a step (``scale / 2``) per value.
"""

from __future__ import annotations

import numpy as np

from .errors import InvalidInputError

#: storage dtype name -> numpy dtype of the stored field
STORAGE = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"),
           "bfloat16": np.dtype("<u2"), "int8": np.dtype("u1")}
#: bytes after the codes of an int8 row: float32 scale and bias
INT8_TAIL = 8
#: the dtypes a store can train in (``int8`` is a serving format)
TRAINABLE = ("float32", "float16", "bfloat16")


def check_value_dtype(name: object, what: str = "value_dtype", *,
                      serving: bool = False) -> str:
    """``name`` if it is a known storage dtype (``int8`` too with ``serving``), else
    ``InvalidInputError`` listing them."""
    if isinstance(name, np.dtype):
        name = name.name
    known = (*TRAINABLE, "int8") if serving else TRAINABLE
    if not isinstance(name, str) or name not in known:
        raise InvalidInputError(f"{what} must be one of {sorted(known)}, got {name!r}")
    return name


def field_shape(kind: str, width: int) -> tuple[int]:
    """Shape of a stored field of ``width`` values of dtype ``kind``."""
    return (width + INT8_TAIL,) if kind == "int8" else (width,)


def to_float32(stored: np.ndarray, kind: str) -> np.ndarray:
    """Stored values of dtype ``kind`` as float32 (the same array when already float32)."""
    if kind == "float32":
        return stored
    if kind == "float16":
        return stored.astype(np.float32)
    if kind == "int8":
        return _from_int8(stored)
    # bfloat16: the pattern is the upper 16 bits of the float32
    wide = np.empty(stored.shape, dtype=np.uint32)
    np.left_shift(stored, 16, out=wide, dtype=np.uint32)
    return wide.view(np.float32)


def from_float32(values: np.ndarray, kind: str,
                 rng: np.random.Generator | None = None) -> np.ndarray:
    """float32 ``values`` narrowed to dtype ``kind``: to nearest (ties to even) when ``rng``
    is None, stochastically with the random bits of ``rng`` otherwise. NaN stays NaN."""
    if kind == "float32":
        return np.asarray(values, dtype=np.float32)
    values = np.ascontiguousarray(values, dtype=np.float32)
    if kind == "float16":
        return _to_float16(values, rng)
    if kind == "int8":
        return _to_int8(values)
    bits = values.view(np.uint32)
    nan = np.isnan(values)
    if rng is None:
        # round to nearest even: add 0x7FFF plus the lowest kept bit, then truncate
        wide = bits >> 16
        wide &= np.uint32(1)
        wide += np.uint32(0x7FFF)
    else:
        # a uniform 16-bit amount: the kept part goes up with probability (dropped / 2**16);
        # raw 64-bit draws cut in four are much cheaper than bounded integers
        size = bits.size
        raw = rng.bit_generator.random_raw((size + 3) // 4).view(np.uint16)[:size]
        wide = raw.reshape(bits.shape).astype(np.uint32)
    # Values within one rounding of the largest finite bfloat16 may carry into the exponent
    # and become inf: the same saturation as a float32 -> float16 cast.
    wide += bits
    wide >>= 16
    out = wide.astype(np.uint16)
    if nan.any():
        out[nan] = (bits[nan] >> 16).astype(np.uint16) | np.uint16(0x40)  # stay a quiet NaN
    return out


def _to_float16(values: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
    near = values.astype(np.float16)
    if rng is None:
        return near
    # The two float16 neighbours of each value: ``near`` and the next one towards the value.
    back = near.astype(np.float32)
    toward = np.where(back < values, np.float16(np.inf), np.float16(-np.inf)).astype(np.float16)
    other = np.nextafter(near, toward)
    gap = other.astype(np.float32) - back
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = (values - back) / gap  # in [0, 0.5]: how far towards ``other`` the value is
    u = rng.random(size=values.shape, dtype=np.float32)
    take = (u < frac) & np.isfinite(frac)
    return np.where(take, other, near)


def _to_int8(values: np.ndarray) -> np.ndarray:
    lead, dim = values.shape[:-1], values.shape[-1]
    lo = values.min(axis=-1, keepdims=True) if dim else np.zeros(lead + (1,), np.float32)
    hi = values.max(axis=-1, keepdims=True) if dim else lo
    scale = (hi - lo) / np.float32(255.0)
    out = np.empty(lead + (dim + INT8_TAIL,), dtype=np.uint8)
    with np.errstate(invalid="ignore", divide="ignore"):
        codes = np.where(scale > 0, np.rint((values - lo) / scale), 0.0)
    out[..., :dim] = np.clip(codes, 0, 255).astype(np.uint8)
    tail = np.concatenate([scale, lo], axis=-1).astype("<f4")
    out[..., dim:] = tail.view(np.uint8).reshape(lead + (INT8_TAIL,))
    return out


def _from_int8(stored: np.ndarray) -> np.ndarray:
    dim = stored.shape[-1] - INT8_TAIL
    tail = np.ascontiguousarray(stored[..., dim:]).view("<f4")  # (..., 2): scale, bias
    out = stored[..., :dim].astype(np.float32)
    out *= tail[..., :1]
    out += tail[..., 1:]
    return out


def round_trip(values: np.ndarray, kind: str) -> np.ndarray:
    """``values`` as they read back after being stored to nearest (float32 unchanged)."""
    if kind == "float32":
        return values
    return to_float32(from_float32(values, kind), kind)
