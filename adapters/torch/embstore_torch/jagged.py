"""Multi-feature jagged input (TorchRec's ``KeyedJaggedTensor`` layout) and keyed pooled output.

TorchRec lays out a batch of ``B`` samples over features ``f_0 .. f_{F-1}`` feature-major:
``values`` holds every id of ``f_0`` (sample by sample), then of ``f_1``, ...; ``lengths`` has
``F * B`` entries, the number of ids of each (feature, sample) bag in the same order, and
``offsets`` (``F * B + 1`` entries) their cumulative sum. :class:`KeyedJagged` keeps exactly that
layout, so a real ``torchrec.KeyedJaggedTensor`` (anything with ``keys()``, ``values()`` and
``lengths()`` or ``offsets()``) is accepted as is, and :class:`PooledFeatures` answers the parts
of TorchRec's ``KeyedTensor`` a model reads (``values()``, ``keys()``, ``to_dict()``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from embstore.engine.fused import bag_bounds
from embstore.errors import InvalidInputError

__all__ = ["KeyedJagged", "PooledFeatures"]

_STR = (str, bytes)


def _int_array(x: Any, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidInputError(f"{what} must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False).reshape(-1)


class KeyedJagged:
    """Jagged ids of several features for one batch, in TorchRec's ``KeyedJaggedTensor`` layout.

    Parameters
    ----------
    keys : sequence of str
        Feature names, in the order their values appear.
    values : int tensor / array, or list of str/bytes
        Every id, feature-major (all of ``keys[0]``, then ``keys[1]``, ...).
    lengths : int tensor / array of ``len(keys) * batch_size``, optional
        Ids per (feature, sample) bag. Give ``lengths`` or ``offsets``.
    offsets : int tensor / array of ``len(keys) * batch_size + 1``, optional
        Start of each bag in ``values`` (``offsets[0] == 0``, last entry ``len(values)``).
    weights : float tensor of ``len(values)``, optional
        Per-id weights (TorchRec's weighted features): pooled as ``sum(w_i * v_i)``.
    """

    def __init__(self, keys: Sequence[str], values: Any, lengths: Any = None,
                 offsets: Any = None, weights: torch.Tensor | None = None) -> None:
        self._keys = [str(k) for k in keys]
        if len(set(self._keys)) != len(self._keys):
            raise InvalidInputError(f"feature names repeat: {self._keys}")
        self._values = values
        n = len(values)
        if (lengths is None) == (offsets is None):
            raise InvalidInputError("give exactly one of lengths and offsets")
        if lengths is not None:
            lens = _int_array(lengths, "lengths")
            bounds = bag_bounds(lens)  # (sums and sign test in one pass: lengths come cold)
            if bounds is None or int(bounds[-1]) != n:
                raise InvalidInputError(
                    f"lengths must be non-negative and sum to len(values) = {n}, "
                    f"got sum {int(lens.sum())}")
            offs = bounds
        else:
            offs = _int_array(offsets, "offsets").copy()  # (held: not the caller's array)
            if (len(offs) == 0 or offs[0] != 0 or offs[-1] != n
                    or (np.diff(offs) < 0).any()):
                raise InvalidInputError(
                    f"offsets must start at 0, be non-decreasing and end at len(values) = {n}")
            lens = np.diff(offs)
        if self._keys and len(lens) % len(self._keys):
            raise InvalidInputError(
                f"{len(lens)} bags do not split evenly over {len(self._keys)} features")
        self._lengths, self._offsets = lens, offs
        self._stride = len(lens) // len(self._keys) if self._keys else 0
        if weights is not None and len(weights) != n:
            raise InvalidInputError(f"weights must have one entry per value ({n})")
        self._weights = weights

    @classmethod
    def from_dict(cls, features: Mapping[str, Any]) -> KeyedJagged:
        """Build from ``{name: bags}``; ``bags`` is a list of lists of ids (ragged, multi-hot),
        a 2-D tensor/array (one bag per row), a 1-D tensor/array or flat list (one id per
        sample), ``(values, lengths)`` or ``(values, lengths, weights)``.
        Every feature must have the same number of bags (the batch size)."""
        names, vals, lens, wts = [], [], [], []
        for name, bags in features.items():
            weights = None
            if isinstance(bags, tuple):
                if len(bags) not in (2, 3):
                    raise InvalidInputError(f"{name}: give (values, lengths[, weights])")
                v, ln = bags[0], _int_array(bags[1], f"{name} lengths")
                weights = bags[2] if len(bags) == 3 else None
            elif isinstance(bags, (torch.Tensor, np.ndarray)):
                if bags.ndim not in (1, 2):
                    raise InvalidInputError(f"{name}: a tensor of bags must be 1-D (one id per "
                                            f"sample) or 2-D (one bag per row), got "
                                            f"{bags.ndim}-D")
                v = bags.reshape(-1)
                ln = np.full(bags.shape[0], bags.shape[1] if bags.ndim == 2 else 1,
                             dtype=np.int64)
            elif len(bags) and not isinstance(bags[0], Sequence) or (
                    len(bags) and isinstance(bags[0], _STR)):  # one id per sample
                v = list(bags)
                ln = np.ones(len(bags), dtype=np.int64)
            else:
                v = [k for bag in bags for k in bag]
                ln = np.fromiter((len(b) for b in bags), dtype=np.int64, count=len(bags))
            names.append(name)
            vals.append(v)
            lens.append(ln)
            wts.append(weights)
        if any(w is not None for w in wts) and any(w is None for w in wts):
            raise InvalidInputError("give weights for every feature or for none")
        values = _concat_values(vals)
        weights = torch.cat([torch.as_tensor(w, dtype=torch.float32).reshape(-1)
                             for w in wts]) if wts and wts[0] is not None else None
        lengths = np.concatenate(lens) if lens else np.zeros(0, dtype=np.int64)
        sizes = {len(ln) for ln in lens}
        if len(sizes) > 1:
            raise InvalidInputError(f"features have different batch sizes: {sorted(sizes)}")
        return cls(names, values, lengths=lengths, weights=weights)

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self) -> Any:
        return self._values

    def lengths(self) -> torch.Tensor:
        return torch.from_numpy(self._lengths)

    def lengths_array(self) -> np.ndarray:
        """The bag lengths as the int64 array held (no copy: do not modify)."""
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return torch.from_numpy(self._offsets)

    def offsets_array(self) -> np.ndarray:
        """The bags' bounds (``len(lengths) + 1``, int64) as the array held (no copy: do not
        modify)."""
        return self._offsets

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def stride(self) -> int:
        """The batch size (bags per feature)."""
        return self._stride

    def __repr__(self) -> str:
        return f"KeyedJagged(keys={self._keys}, stride={self._stride}, values={len(self._values)})"


def _concat_values(vals: list) -> Any:
    if all(isinstance(v, (torch.Tensor, np.ndarray)) for v in vals) and vals:
        arrs = [v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v for v in vals]
        if all(a.dtype.kind in "iu" for a in arrs):
            return np.concatenate([a.reshape(-1) for a in arrs])
    return [k for v in vals for k in (v.tolist() if hasattr(v, "tolist") else v)]


def as_keyed_jagged(input: Any) -> tuple[list[str], Any, np.ndarray, int, Any]:
    """``(keys, values, lengths, stride, weights)`` of a :class:`KeyedJagged`, a TorchRec
    ``KeyedJaggedTensor`` or a dict accepted by :meth:`KeyedJagged.from_dict`."""
    if isinstance(input, Mapping):
        input = KeyedJagged.from_dict(input)
    if not (hasattr(input, "keys") and hasattr(input, "values")):
        raise InvalidInputError(
            "input must be a KeyedJagged, a KeyedJaggedTensor or a dict of feature -> bags, "
            f"got {type(input).__name__}")
    keys = list(input.keys())
    values = input.values()
    if isinstance(input, KeyedJagged):
        lengths = input.lengths_array()
    elif hasattr(input, "lengths") and input.lengths() is not None:
        lengths = _int_array(input.lengths(), "lengths")
    else:
        lengths = np.diff(_int_array(input.offsets(), "offsets"))
    if keys and len(lengths) % len(keys):
        raise InvalidInputError(f"{len(lengths)} bags do not split evenly over {keys}")
    stride = len(lengths) // len(keys) if keys else 0
    weights = input.weights_or_none() if hasattr(input, "weights_or_none") else None
    return keys, values, lengths, stride, weights


class PooledFeatures:
    """One pooled vector per (sample, feature): TorchRec's ``KeyedTensor`` in the parts a model
    reads. ``values()`` is ``(batch, sum of dims)``, features side by side in ``keys()`` order.
    """

    def __init__(self, keys: list[str], dims: list[int], values: torch.Tensor) -> None:
        self._keys, self._dims, self._values = keys, dims, values

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self) -> torch.Tensor:
        return self._values

    def length_per_key(self) -> list[int]:
        return list(self._dims)

    def offset_per_key(self) -> list[int]:
        return [0, *np.cumsum(self._dims).tolist()]

    def to_dict(self) -> dict[str, torch.Tensor]:
        """``{feature: (batch, dim)}`` views of :meth:`values`."""
        parts = torch.split(self._values, self._dims, dim=1)
        return dict(zip(self._keys, parts, strict=True))

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.to_dict()[key]

    def __repr__(self) -> str:
        return f"PooledFeatures(keys={self._keys}, values={tuple(self._values.shape)})"
