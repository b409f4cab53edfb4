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
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import numpy as np

from ..backends.base import Backend
from ..engine.row_count import count_is_cheap
from ..errors import InvalidInputError, InvalidURLError
from ..layout import Layout
from ..registry import backend_class
from ..urls import query_string
from .shard_parts import SHARD_FORMAT as SHARD_FORMAT
from .shard_parts import ShardFanOut, merge_shard_metas, shard_meta

SCHEME = "sharded"


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
    fan_out : ShardFanOut
        Routes keys to the shards and calls them.
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
        self.fan_out = ShardFanOut(opened, parallel)

    # -- routing ----------------------------------------------------------------------------------
    def shard_of(self, keys: np.ndarray) -> np.ndarray:
        """Shard index (int64) of each key: ``key_hash64(key) % n``.

        Takes normalized keys (an int64 array or an object array of bytes) or anything
        :func:`embstore._keys.normalize_keys` accepts for this store's key type.
        """
        return self.fan_out.shard_of(keys, self.key_type)

    def partitions(self) -> list[Backend]:
        return list(self.shards)

    def partition_of(self, keys: np.ndarray) -> np.ndarray:
        return self.shard_of(keys)

    # -- lifecycle --------------------------------------------------------------------------------
    def bind(self, layout: Layout, key_type: str) -> None:
        super().bind(layout, key_type)
        for b in self.shards:
            b.bind(layout, key_type)

    def read_meta(self) -> dict | None:
        metas = self.fan_out.each(lambda b: b.read_meta())
        return merge_shard_metas(self.url, [b.url for b in self.shards], metas)

    def write_meta(self, meta: dict) -> None:
        self.fan_out.map(lambda i: self.shards[i].write_meta(shard_meta(meta, i, self.n)),
                         range(self.n))

    def flush(self) -> None:
        self.fan_out.each(lambda b: b.flush())

    def close(self) -> None:
        self.fan_out.close()

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
        parts, got = self.fan_out.scatter(keys, self.key_type, lambda b, pos: b.get(keys[pos]))
        return self.fan_out.gather_rows(np.empty(len(keys), self.layout.dtype), parts, got)

    def get_field(self, keys: np.ndarray, field: str) -> tuple[np.ndarray, np.ndarray]:
        parts, got = self.fan_out.scatter(keys, self.key_type,
                                          lambda b, pos: b.get_field(keys[pos], field))
        fdt = self.layout.fields[field][0]
        out = np.empty((len(keys),) + fdt.shape, dtype=fdt.base)
        return self.fan_out.gather_rows(out, parts, got)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        parts, got = self.fan_out.scatter(keys, self.key_type,
                                          lambda b, pos: b.contains(keys[pos]))
        return self.fan_out.gather_mask(len(keys), parts, got)

    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        self.fan_out.scatter(keys, self.key_type, lambda b, pos: b.put(keys[pos], records[pos]))

    def delete(self, keys: np.ndarray) -> np.ndarray:
        parts, got = self.fan_out.scatter(keys, self.key_type,
                                          lambda b, pos: b.delete(keys[pos]))
        return self.fan_out.gather_mask(len(keys), parts, got)

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
        return int(sum(self.fan_out.each(len)))

    def scan(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return itertools.chain.from_iterable(b.scan(batch_size) for b in self.shards)

    def changes_since(self, version: int,
                      batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return itertools.chain.from_iterable(b.changes_since(version, batch_size)
                                             for b in self.shards)

    def bulk_load(self, batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> int:
        n = 0
        for keys, recs in batches:

            def load(b: Backend, pos: np.ndarray, k: np.ndarray = keys,
                     r: np.ndarray = recs) -> int:
                return b.bulk_load(iter([(k[pos], r[pos])]))

            self.fan_out.scatter(keys, self.key_type, load)
            n += len(keys)
        return n

    def clear(self) -> None:
        self.fan_out.each(lambda b: b.clear())

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
