"""The parts of :class:`embstore.layers.sharded.ShardedBackend`: :class:`ShardFanOut` routes a
batch's keys to the shards and calls them (in a thread pool when they do I/O), and
:func:`merge_shard_metas` / :func:`shard_meta` keep the shard placement in each shard's
metadata (see :mod:`embstore.layers.sharded` for the rules)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from .._keys import BYTES_KEY_HASH, key_hash64, normalize_keys
from ..backends.base import Backend
from ..errors import SchemaMismatchError

#: the ``format`` recorded in each shard's metadata (the engine's is ``"embstore"``)
SHARD_FORMAT = "embstore-shard"
_T = TypeVar("_T")
_R = TypeVar("_R")
_VOLATILE = ("step", "version", "extra", "sharding")


class ShardFanOut:
    """Routing by ``key_hash64(key) % n`` and the calls to the shards.

    Parameters
    ----------
    shards : list of Backend
        The shards, in routing order.
    parallel : bool
        Call the shards from a thread pool (one thread per shard).
    """

    def __init__(self, shards: list[Backend], parallel: bool) -> None:
        self.shards = shards
        self.n = len(shards)
        self.pool = ThreadPoolExecutor(self.n, "embstore-shard") if parallel and self.n > 1 \
            else None

    def shard_of(self, keys: Any, key_type: str) -> np.ndarray:
        """Shard index (int64) of each key (normalized, or anything
        :func:`embstore._keys.normalize_keys` accepts for ``key_type``)."""
        if not (isinstance(keys, np.ndarray) and keys.ndim == 1
                and (keys.dtype == np.int64 or keys.dtype == object)):
            keys = normalize_keys(keys, key_type)
        return (key_hash64(keys) % np.uint64(self.n)).astype(np.int64)

    def partition(self, keys: np.ndarray, key_type: str) -> list[tuple[int, np.ndarray]]:
        """``(shard, positions)`` for every shard that receives keys, positions ascending
        (one stable argsort)."""
        sid = self.shard_of(keys, key_type)
        order = np.argsort(sid, kind="stable")
        bounds = np.searchsorted(sid[order], np.arange(self.n + 1))
        return [(i, order[bounds[i]:bounds[i + 1]]) for i in range(self.n)
                if bounds[i + 1] > bounds[i]]

    def map(self, fn: Callable[[_T], _R], which: Sequence[_T]) -> list[_R]:
        """``fn`` over ``which``, in the pool when there is one and more than one call."""
        if self.pool is None or len(which) < 2:
            return [fn(i) for i in which]
        return list(self.pool.map(fn, which))

    def each(self, fn: Callable[[Backend], _R]) -> list[_R]:
        """``fn(shard)`` for every shard, in shard order."""
        return self.map(lambda i: fn(self.shards[i]), range(self.n))

    def scatter(self, keys: np.ndarray, key_type: str,
                fn: Callable[[Backend, np.ndarray], _R]
                ) -> tuple[list[tuple[int, np.ndarray]], list[_R]]:
        """``fn(shard, positions)`` for each shard receiving some of ``keys``; the partition
        and the answers, in the same order."""
        parts = self.partition(keys, key_type)
        return parts, self.map(lambda p: fn(self.shards[p[0]], p[1]), parts)

    def gather_mask(self, n: int, parts: list[tuple[int, np.ndarray]],
                    masks: Sequence[np.ndarray]) -> np.ndarray:
        """Per-shard bool answers stitched back in request order."""
        out = np.zeros(n, dtype=bool)
        for (_, pos), m in zip(parts, masks):
            out[pos] = m
        return out

    def gather_rows(self, out: np.ndarray, parts: list[tuple[int, np.ndarray]],
                    got: Sequence[tuple[np.ndarray, np.ndarray]]
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Per-shard ``(rows, found)`` answers stitched into ``out`` in request order."""
        found = np.empty(len(out), dtype=bool)
        for (_, pos), (r, f) in zip(parts, got):
            out[pos] = r
            found[pos] = f
        return out, found

    def close(self) -> None:
        """Close every shard (all of them, then raise the first error) and the pool."""
        errors = []
        for b in self.shards:
            try:
                b.close()
            except Exception as e:  # noqa: BLE001 - close every shard, then report
                errors.append(e)
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        if errors:
            raise errors[0]


def shard_meta(meta: dict, index: int, count: int) -> dict:
    """The metadata shard ``index`` of ``count`` stores: a distinct format name (opening one
    shard alone as a plain store is refused) and its placement."""
    placed: dict[str, Any] = {"count": count, "index": index}
    if meta.get("key_type") == "bytes":
        placed["hash"] = BYTES_KEY_HASH
    return {**meta, "format": SHARD_FORMAT, "sharding": placed}


def merge_shard_metas(url: str, shard_urls: Sequence[str],
                      metas: Sequence[dict | None]) -> dict | None:
    """The store metadata of a sharded set from its shards' (None: no store), checked: every
    shard holds a shard of this set, at its place, with the same schema."""
    n = len(metas)
    if all(m is None for m in metas):
        return None
    first = next(m for m in metas if m is not None)
    schema = {k: v for k, v in first.items() if k not in _VOLATILE}
    checked: list[dict[str, Any]] = []
    for i, m in enumerate(metas):
        where = f"{url}: shard {i} ({shard_urls[i]})"
        if m is None:
            raise SchemaMismatchError(f"{where} holds no store while other shards do")
        if m.get("format") != SHARD_FORMAT:
            raise SchemaMismatchError(
                f"{where} holds a store that is not a shard of a sharded store")
        placed = {k: v for k, v in (m.get("sharding") or {}).items() if k != "hash"}
        if placed != {"count": n, "index": i}:
            raise SchemaMismatchError(
                f"{where} was written as shard {m.get('sharding')} but is opened as shard {i} "
                f"of {n}; open the shards in their original number and order")
        if m.get("key_type") == "bytes" and \
                (m.get("sharding") or {}).get("hash") != BYTES_KEY_HASH:
            raise SchemaMismatchError(
                f"{where} placed its bytes keys by blake2b-8 (an older embstore); this version "
                f"places them by {BYTES_KEY_HASH}, so keys would be looked for on the wrong "
                "shards. Export it with the embstore that wrote it and import the file into a "
                "new set")
        if {k: v for k, v in m.items() if k not in _VOLATILE} != schema:
            raise SchemaMismatchError(
                f"{where} has other store metadata (dim, key type, optimizer...) than shard 0")
        checked.append(m)
    # step/version may lag on a shard if a crash hit between shard writes: take the newest.
    out = {k: v for k, v in first.items() if k != "sharding"}
    out["format"] = "embstore"
    out["step"] = max(int(m.get("step", 0)) for m in checked)
    out["version"] = max(int(m.get("version", 0)) for m in checked)
    return out
