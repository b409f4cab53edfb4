"""``ShardedBackend``: ``hash(key) mod n`` routing of rows over n backends.

The hash is embstore's fixed 64-bit key hash (:func:`embstore._keys.key_hash64`: splitmix64 for
int64 keys, XXH3-64 for bytes), never Python's per-process salted ``hash()``, so every process
routes a key to the same shard. Shard metadata records the bytes-key hash; a bytes-key set
written by an embstore that placed keys by blake2b-8 (no ``hash`` recorded) is refused rather
than read with keys looked for on the wrong shards. A batch is partitioned with one stable
argsort, each shard gets one call, and results are stitched back in request order.

The shard list is part of the data: every shard's metadata carries ``{"count": n, "index": i}``
and reopening with another number or order of shards raises ``SchemaMismatchError`` (rows would
be looked for on the wrong shard). Schema metadata must agree on every shard. Shard metadata
records the format ``"embstore-shard"``, so a shard opened alone as a plain store is refused.

The URL ``sharded://?shard=<url>&shard=<url>...`` (each shard URL percent-encoded) names the
whole set, so ``store.url`` reopens it and a store pickles by URL.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit

import numpy as np

from .._keys import BYTES_KEY_HASH, key_hash64, normalize_keys
from ..backends.base import Backend
from ..engine.row_count import count_is_cheap
from ..errors import InvalidInputError, InvalidURLError, SchemaMismatchError
from ..layout import Layout
from ..registry import backend_class
from ..urls import query_string

SCHEME = "sharded"
#: the ``format`` recorded in each shard's metadata (the engine's is ``"embstore"``)
SHARD_FORMAT = "embstore-shard"
_T = TypeVar("_T")
_R = TypeVar("_R")
_VOLATILE = ("step", "version", "extra", "sharding")


def sharded_url(urls: Sequence[str]) -> str:
    """The ``sharded://`` URL naming an ordered list of shard URLs (readable: only the
    characters that would change its meaning are percent-encoded)."""
    return f"{SCHEME}://?" + query_string([("shard", u) for u in urls])


def parse_sharded_url(url: str) -> list[str]:
    """Shard URLs of a ``sharded://?shard=...`` URL, in order."""
    parts = urlsplit(url)
    if parts.scheme.lower() != SCHEME or parts.netloc or parts.path not in ("", "/"):
        raise InvalidURLError(f"not a sharded URL (sharded://?shard=<url>&...): {url!r}")
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    bad = [k for k, _ in pairs if k != "shard"]
    if bad or not pairs:
        raise InvalidURLError(f"{url!r}: expected one or more 'shard=<url>' parameters")
    return [v for _, v in pairs]


class ShardedBackend(Backend):
    """Rows spread over ``n`` backends by ``key_hash64(key) % n``.

    Parameters
    ----------
    shards : sequence of Backend or str, or a ``sharded://`` URL
        The shards, in routing order (the order is checked on reopen).
    read_only : bool
        Passed to shards given as URLs.
    parallel : bool, optional
        Call the shards from a thread pool (default: when any shard is persistent, i.e. does
        I/O; in-memory shards are faster called in turn).
    **options
        Backend options for shards given as URLs (the same for every shard).

    Attributes
    ----------
    shards : list of Backend
    """

    def __init__(self, shards: Sequence[Backend | str] | str, *, read_only: bool = False,
                 parallel: bool | None = None, **options: Any) -> None:
        if isinstance(shards, str):
            shards = parse_sharded_url(shards)
        shards = list(shards)
        if not shards:
            raise InvalidInputError("ShardedBackend needs at least one shard")
        opened: list[Backend] = []
        try:
            for s in shards:
                if isinstance(s, Backend):
                    opened.append(s)
                elif isinstance(s, str):
                    if s.lower().startswith(f"{SCHEME}://"):
                        raise InvalidURLError("a shard cannot itself be a sharded:// URL")

                    opened.append(backend_class(s)(s, read_only=read_only, **options))
                else:
                    raise InvalidInputError(f"a shard must be a Backend or a URL, got {s!r}")
        except BaseException:
            for b in opened:
                b.close()
            raise
        urls = [b.url for b in opened]
        durable = [b.url for b in opened if b.persistent]
        if len(set(durable)) < len(durable):
            for b in opened:
                b.close()
            raise InvalidInputError(f"shard URLs must be distinct, got {urls}")
        super().__init__(sharded_url(urls), read_only=read_only)
        self.shards: list[Backend] = opened
        self.n = len(opened)
        self.persistent = all(b.persistent for b in opened)
        self.supports_scan = all(b.supports_scan for b in opened)
        self.supports_changes = all(b.supports_changes for b in opened)
        self.scheme = SCHEME
        self.thread_safe = all(b.thread_safe for b in opened)
        if parallel is None:
            parallel = any(b.persistent for b in opened)
        self._pool = ThreadPoolExecutor(self.n, "embstore-shard") if parallel and self.n > 1 \
            else None

    # -- routing ----------------------------------------------------------------------------------
    def shard_of(self, keys: np.ndarray) -> np.ndarray:
        """Shard index (int64) of each key: ``key_hash64(key) % n``.

        Takes normalized keys (an int64 array or an object array of bytes) or anything
        :func:`embstore._keys.normalize_keys` accepts for this store's key type.
        """
        if not (isinstance(keys, np.ndarray) and keys.ndim == 1
                and (keys.dtype == np.int64 or keys.dtype == object)):
            keys = normalize_keys(keys, self.key_type)
        return (key_hash64(keys) % np.uint64(self.n)).astype(np.int64)

    def partitions(self) -> list[Backend]:
        return list(self.shards)

    def partition_of(self, keys: np.ndarray) -> np.ndarray:
        return self.shard_of(keys)

    def _partition(self, keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """``(shard, positions)`` for every shard that receives keys, positions ascending."""
        sid = self.shard_of(keys)
        order = np.argsort(sid, kind="stable")
        bounds = np.searchsorted(sid[order], np.arange(self.n + 1))
        return [(i, order[bounds[i]:bounds[i + 1]]) for i in range(self.n)
                if bounds[i + 1] > bounds[i]]

    def _map(self, fn: Callable[[_T], _R], which: Sequence[_T]) -> list[_R]:
        if self._pool is None or len(which) < 2:
            return [fn(i) for i in which]
        return list(self._pool.map(fn, which))

    # -- lifecycle --------------------------------------------------------------------------------
    def bind(self, layout: Layout, key_type: str) -> None:
        super().bind(layout, key_type)
        for b in self.shards:
            b.bind(layout, key_type)

    def read_meta(self) -> dict | None:
        metas = self._map(lambda i: self.shards[i].read_meta(), range(self.n))
        if all(m is None for m in metas):
            return None
        first = next(m for m in metas if m is not None)
        schema = {k: v for k, v in first.items() if k not in _VOLATILE}
        checked: list[dict[str, Any]] = []
        for i, m in enumerate(metas):
            if m is None:
                raise SchemaMismatchError(f"{self.url}: shard {i} ({self.shards[i].url}) holds "
                                          "no store while other shards do")
            if m.get("format") != SHARD_FORMAT:
                raise SchemaMismatchError(
                    f"{self.url}: shard {i} ({self.shards[i].url}) holds a store that is not "
                    "a shard of a sharded store"
                )
            placed = {k: v for k, v in (m.get("sharding") or {}).items() if k != "hash"}
            if placed != {"count": self.n, "index": i}:
                raise SchemaMismatchError(
                    f"{self.url}: shard {i} ({self.shards[i].url}) was written as shard "
                    f"{m.get('sharding')} but is opened as shard {i} of {self.n}; open the "
                    "shards in their original number and order"
                )
            if m.get("key_type") == "bytes" and \
                    (m.get("sharding") or {}).get("hash") != BYTES_KEY_HASH:
                raise SchemaMismatchError(
                    f"{self.url}: shard {i} ({self.shards[i].url}) placed its bytes keys by "
                    f"blake2b-8 (an older embstore); this version places them by "
                    f"{BYTES_KEY_HASH}, so keys would be looked for on the wrong shards. Export "
                    "it with the embstore that wrote it and import the file into a new set"
                )
            if {k: v for k, v in m.items() if k not in _VOLATILE} != schema:
                raise SchemaMismatchError(
                    f"{self.url}: shard {i} ({self.shards[i].url}) has other store metadata "
                    "(dim, key type, optimizer...) than shard 0"
                )
            checked.append(m)
        # step/version may lag on a shard if a crash hit between shard writes: take the newest.
        out = {k: v for k, v in first.items() if k != "sharding"}
        out["format"] = "embstore"
        out["step"] = max(int(m.get("step", 0)) for m in checked)
        out["version"] = max(int(m.get("version", 0)) for m in checked)
        return out

    def write_meta(self, meta: dict) -> None:
        def one(i: int) -> None:
            # A distinct format name: opening one shard alone as a plain store is refused.
            placed: dict[str, Any] = {"count": self.n, "index": i}
            if meta.get("key_type") == "bytes":
                placed["hash"] = BYTES_KEY_HASH
            self.shards[i].write_meta({**meta, "format": SHARD_FORMAT, "sharding": placed})

        self._map(one, range(self.n))

    def flush(self) -> None:
        self._map(lambda i: self.shards[i].flush(), range(self.n))

    def close(self) -> None:
        errors = []
        for b in self.shards:
            try:
                b.close()
            except Exception as e:  # noqa: BLE001 - close every shard, then report
                errors.append(e)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if errors:
            raise errors[0]

    def storage_paths(self) -> tuple[str, ...]:
        return tuple(p for s in self.shards for p in s.storage_paths())

    def reopen_options(self) -> dict:
        out: dict = {}
        for b in self.shards:
            for k, v in b.reopen_options().items():
                out.setdefault(k, v)
        return out

    # -- rows -------------------------------------------------------------------------------------
    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        parts = self._partition(keys)
        got = self._map(lambda p: self.shards[p[0]].get(keys[p[1]]), parts)
        recs = np.empty(len(keys), dtype=self.layout.dtype)
        found = np.empty(len(keys), dtype=bool)
        for (_, pos), (r, f) in zip(parts, got):
            recs[pos] = r
            found[pos] = f
        return recs, found

    def get_field(self, keys: np.ndarray, field: str) -> tuple[np.ndarray, np.ndarray]:
        parts = self._partition(keys)
        got = self._map(lambda p: self.shards[p[0]].get_field(keys[p[1]], field), parts)
        fdt = self.layout.fields[field][0]
        out = np.empty((len(keys),) + fdt.shape, dtype=fdt.base)
        found = np.empty(len(keys), dtype=bool)
        for (_, pos), (v, f) in zip(parts, got):
            out[pos] = v
            found[pos] = f
        return out, found

    def contains(self, keys: np.ndarray) -> np.ndarray:
        parts = self._partition(keys)
        got = self._map(lambda p: self.shards[p[0]].contains(keys[p[1]]), parts)
        found = np.empty(len(keys), dtype=bool)
        for (_, pos), f in zip(parts, got):
            found[pos] = f
        return found

    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        parts = self._partition(keys)
        self._map(lambda p: self.shards[p[0]].put(keys[p[1]], records[p[1]]), parts)

    def delete(self, keys: np.ndarray) -> np.ndarray:
        parts = self._partition(keys)
        got = self._map(lambda p: self.shards[p[0]].delete(keys[p[1]]), parts)
        present = np.zeros(len(keys), dtype=bool)
        for (_, pos), f in zip(parts, got):
            present[pos] = f
        return present

    # -- capabilities: those of every shard --------------------------------------------------------
    @property
    def cheap_len(self) -> bool:  # type: ignore[override]
        """Every shard counts its rows without reading them."""
        return all(b.cheap_len for b in self.shards)

    @property
    def cheap_size(self) -> bool:  # type: ignore[override]
        """Every shard tells its size without reading rows."""
        return all(b.cheap_size for b in self.shards)

    @property
    def max_key_bytes(self) -> int | None:  # type: ignore[override]
        """The shortest key limit of the shards (None: no limit)."""
        limits = [b.max_key_bytes for b in self.shards if b.max_key_bytes is not None]
        return min(limits) if limits else None

    def __len__(self) -> int:
        return int(sum(self._map(lambda i: len(self.shards[i]), range(self.n))))

    def scan(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return itertools.chain.from_iterable(b.scan(batch_size) for b in self.shards)

    def changes_since(self, version: int,
                      batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return itertools.chain.from_iterable(b.changes_since(version, batch_size)
                                             for b in self.shards)

    def bulk_load(self, batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> int:
        n = 0
        for keys, recs in batches:
            parts = self._partition(keys)

            def load(p: tuple[int, np.ndarray], k: np.ndarray = keys,
                     r: np.ndarray = recs) -> int:
                return self.shards[p[0]].bulk_load(iter([(k[p[1]], r[p[1]])]))

            self._map(load, parts)
            n += len(keys)
        return n

    def clear(self) -> None:
        self._map(lambda i: self.shards[i].clear(), range(self.n))

    def size_bytes(self) -> int | None:
        sizes = [b.size_bytes() for b in self.shards]
        known = [s for s in sizes if s is not None]
        return int(sum(known)) if len(known) == len(sizes) else None

    def stats(self) -> dict[str, Any]:
        """Numeric counters summed over shards, plus ``shard_rows`` (rows per shard) where
        counting is free."""
        out: dict[str, Any] = dict(self.counters)
        for b in self.shards:
            for k, v in b.stats().items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[k] = out.get(k, 0) + v
        out["shards"] = self.n
        if count_is_cheap(self):  # else a scan of every shard per stats() call
            out["shard_rows"] = [len(b) for b in self.shards]
        return out
