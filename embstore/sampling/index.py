"""The per-store sampling index: keys + counts in memory, kept current by the engine's observers.

Built once with one scan of the backend (per shard for a sharded backend) the first time a
store samples, then maintained incrementally from every row write and delete the engine makes
(``on_write`` / ``on_delete``), so no call after the first reads the table. It is *not* written
into the store: it is exactly the ``(key, count)`` column of the records, which the store already
persists; rebuilding it after a reopen costs one scan (counted in :attr:`SamplingIndex.scans`).

Drawing uses a *snapshot* per sampler: the weights of every key as a cumulative sum, inverted
by a search over a cached coarse level and then bisection inside a 64-entry block, so a draw
costs a constant number of memory misses whatever the table size (see ``_inverse_cdf``). A
snapshot is reused until more than ``staleness * len`` rows were written since it was taken, or
any row was deleted; ``prob`` is always computed from the snapshot actually drawn
from, so the logQ correction stays exact for the distribution used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidInputError
from .keyindex import KeyIndex
from .samplers import LogUniformSampler, Sampler

_SCAN_BATCH = 65536
_BLOCK_BITS = 6
_BLOCK = 1 << _BLOCK_BITS


@dataclass
class Snapshot:
    """Weights of every key at one moment, per part (shard)."""

    sizes: np.ndarray            # rows per part when taken
    cdfs: list | None            # per-part cumulative weights (float64); None = uniform
    coarse: list | None          # per-part every _BLOCK-th cdf entry (the search's first level)
    last: np.ndarray             # last position with a positive weight, per part
    part_w: np.ndarray           # total weight per part
    total: float                 # total weight
    support: int                 # keys with a positive weight
    deletes: tuple[int, ...]     # per-part delete counters when taken
    changes: int                 # index write counter when taken
    tries_ratio: float = 1.0     # draws per distinct key in the last unique sample (a hint)
    by_rank: np.ndarray | None = None  # log-uniform, one part: positions in frequency order


class SamplingIndex:
    """Keys and counts of one store, per shard, plus cached sampling snapshots.

    Parameters
    ----------
    backend : Backend
        The store's backend. A backend with ``shards`` and ``shard_of`` (the sharded layer) is
        indexed per shard, and draws are split across shards by their share of the weight.
    key_type : {"int64", "bytes"}
    staleness : float
        Fraction of rows that may be written before a count-based snapshot is rebuilt
        (default 5%: a rebuild is O(n), O(n log n) for log-uniform, so it is amortized over
        ``staleness * n`` writes).
    seed : int, optional
        Seed of the generator used when ``sample`` gets no seed.
    """

    def __init__(self, backend: Any, key_type: str, *, staleness: float = 0.05,
                 seed: int | None = None) -> None:
        if not (isinstance(staleness, (int, float)) and 0.0 <= staleness < float("inf")):
            raise InvalidInputError(f"staleness must be a number >= 0, got {staleness!r}")
        self.backend = backend
        sharded = hasattr(backend, "shards") and hasattr(backend, "shard_of")
        self._shards = list(backend.shards) if sharded else [backend]
        self._shard_of = backend.shard_of if sharded else None
        self.key_type = key_type
        self.staleness = float(staleness)
        self.parts = [KeyIndex(key_type, {"count": (np.int64, ())}) for _ in self._shards]
        self.total_count = 0
        #: full scans of the backend made by this index (1 after build)
        self.scans = 0
        #: snapshot (re)builds
        self.rebuilds = 0
        #: rows written through the engine since the index was built
        self.changes = 0
        self.rng = np.random.default_rng(None if seed is None else [int(seed), 0x5A3D1E])
        self._snaps: dict[tuple, Snapshot] = {}
        #: the index missed writes (a bulk load) and must be rebuilt before use
        self.stale = True

    @property
    def num_shards(self) -> int:
        return len(self.parts)

    def __len__(self) -> int:
        return sum(p.n for p in self.parts)

    # -- building and maintenance ----------------------------------------------------------
    def build(self) -> None:
        """(Re)read every key and count with one scan of the backend (per shard)."""
        self.parts = [KeyIndex(self.key_type, {"count": (np.int64, ())}) for _ in self._shards]
        self.total_count = 0
        for part, shard in zip(self.parts, self._shards):
            for keys, recs in shard.scan(_SCAN_BATCH):
                counts = np.ascontiguousarray(recs["count"], dtype=np.int64)
                part.upsert(keys, {"count": counts})
                self.total_count += int(counts.sum())
        self.scans += 1
        self._snaps.clear()
        self.stale = False

    def _route(self, keys: np.ndarray):
        if self._shard_of is None:
            yield 0, None
            return
        sid = np.asarray(self._shard_of(keys), dtype=np.int64)
        for s in np.unique(sid).tolist():
            yield s, sid == s

    def on_write(self, keys: np.ndarray, recs: np.ndarray) -> None:
        counts = np.ascontiguousarray(recs["count"], dtype=np.int64)
        for s, sel in self._route(keys):
            part = self.parts[s]
            k, c = (keys, counts) if sel is None else (keys[sel], counts[sel])
            pos = part.positions(k)
            old = part.cols["count"][pos[pos >= 0]]
            part.upsert(k, {"count": c}, pos=pos)
            self.total_count += int(c.sum()) - int(old.sum())
        self.changes += len(keys)

    def on_bulk_load(self) -> None:
        # Bulk loads (import) bypass the per-batch observers: rescan on next use.
        self.stale = True

    def on_delete(self, keys: np.ndarray) -> None:
        for s, sel in self._route(keys):
            part = self.parts[s]
            k = keys if sel is None else keys[sel]
            pos = part.positions(k)
            self.total_count -= int(part.cols["count"][pos[pos >= 0]].sum())
            part.remove(k)
        self.changes += len(keys)

    # -- reading -----------------------------------------------------------------------------
    def counts_of(self, keys: np.ndarray) -> np.ndarray:
        """Current ``count`` of each key (0 for keys not in the store)."""
        out = np.zeros(len(keys), dtype=np.int64)
        for s, sel in self._route(keys):
            part = self.parts[s]
            k = keys if sel is None else keys[sel]
            pos = part.positions(k)
            c = np.where(pos >= 0, part.cols["count"][np.maximum(pos, 0)], 0)
            if sel is None:
                out = c
            else:
                out[sel] = c
        return out

    def snapshot(self, sampler: Sampler) -> Snapshot:
        """The sampler's weights over the current keys (cached while fresh enough)."""
        if not sampler.uses_counts:
            return self._uniform_snapshot()
        key = sampler.cache_key()
        snap = self._snaps.get(key)
        limit = self.staleness * max(len(self), 1)
        if (snap is None or snap.deletes != tuple(p.deletes for p in self.parts)
                or self.changes - snap.changes > limit):
            snap = self._build_snapshot(sampler)
            self._snaps[key] = snap
        return snap

    def _uniform_snapshot(self) -> Snapshot:
        sizes = np.array([p.n for p in self.parts], dtype=np.int64)
        return Snapshot(sizes=sizes, cdfs=None, coarse=None, last=sizes - 1,
                        part_w=sizes.astype(np.float64), total=float(sizes.sum()),
                        support=int(sizes.sum()),
                        deletes=tuple(p.deletes for p in self.parts), changes=self.changes)

    def _build_snapshot(self, sampler: Sampler) -> Snapshot:
        counts = [p.col("count") for p in self.parts]
        by_rank = None
        if sampler.rank_based:
            w_all, order = self._rank_weights(sampler, counts)
            weights = _split(w_all, [len(c) for c in counts])
            if len(self.parts) == 1 and isinstance(sampler, LogUniformSampler):
                by_rank = order  # lets draws invert the log-uniform cdf analytically
        else:
            weights = [sampler.weights(c) for c in counts]
        cdfs, last, part_w, support = [], [], [], 0
        for w in weights:
            cdf = np.cumsum(w, dtype=np.float64)
            pos = np.flatnonzero(w > 0)
            support += len(pos)
            cdfs.append(cdf)
            last.append(int(pos[-1]) if len(pos) else -1)
            part_w.append(float(cdf[-1]) if len(cdf) else 0.0)
        part_w_arr = np.array(part_w, dtype=np.float64)
        self.rebuilds += 1
        return Snapshot(sizes=np.array([p.n for p in self.parts], dtype=np.int64), cdfs=cdfs,
                        coarse=[_coarse(c) for c in cdfs], by_rank=by_rank,
                        last=np.array(last, dtype=np.int64), part_w=part_w_arr,
                        total=float(part_w_arr.sum()), support=support,
                        deletes=tuple(p.deletes for p in self.parts), changes=self.changes)

    def _rank_weights(self, sampler: Sampler,
                      counts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        # Ranks are global (across shards): most frequent first, ties by key ascending.
        allc = np.concatenate(counts) if counts else np.zeros(0, np.int64)
        allk = np.concatenate([p.live_keys for p in self.parts])
        if allk.dtype == object:
            by_key = np.argsort(allk, kind="stable")
            order = by_key[np.argsort(-allc[by_key], kind="stable")]
        else:
            order = np.lexsort((allk, -allc))
        w = np.empty(len(allc), dtype=np.float64)
        w[order] = sampler.weights(allc[order])
        return w, order

    # -- drawing -----------------------------------------------------------------------------
    def draw(self, snap: Snapshot, rng: np.random.Generator,
             m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``m`` independent draws: ``(keys, ids, p)`` where ``ids`` identify rows across
        shards and ``p`` is each drawn key's probability under the snapshot."""
        if snap.total <= 0:
            raise InvalidInputError("the store has no key with a positive sampling weight")
        nparts = len(self.parts)
        per = ([m] if nparts == 1
               else rng.multinomial(m, snap.part_w / snap.total).tolist())
        offsets = np.concatenate(([0], np.cumsum(snap.sizes)))
        keys, ids, ps = [], [], []
        for s, c in enumerate(per):
            if c == 0:
                continue
            if snap.cdfs is None:
                pos = rng.integers(0, snap.sizes[s], size=c)
                w = np.ones(c, dtype=np.float64)
            elif snap.by_rank is not None:
                # TF's log-uniform inverse: rank = floor(exp(u * log(N + 1))) - 1, O(1) a draw.
                n = int(snap.sizes[s])
                r = np.floor(np.exp(rng.random(c) * np.log(n + 1.0))).astype(np.int64) - 1
                np.clip(r, 0, n - 1, out=r)
                pos = snap.by_rank[r]
                w = np.log1p(1.0 / (r + 1.0)) / np.log(n + 1.0)  # = the rank's weight
            else:
                cdf = snap.cdfs[s]
                # Sorted probes search the coarse level in one forward sweep (cache friendly);
                # a random permutation then restores an i.i.d. draw order.
                u = np.sort(rng.random(c)) * snap.part_w[s]
                pos = _inverse_cdf(cdf, snap.coarse[s], u)[rng.permutation(c)]
                np.minimum(pos, snap.last[s], out=pos)
                w = cdf[pos] - np.where(pos > 0, cdf[np.maximum(pos - 1, 0)], 0.0)
            keys.append(self.parts[s].keys[pos])
            ids.append(pos + offsets[s])
            ps.append(w / snap.total)
        if len(keys) == 1:
            return keys[0], ids[0], ps[0]
        # Draws grouped by shard are not an i.i.d. sequence; shuffling them makes it one again
        # (the order matters for unique sampling, which keeps first occurrences).
        perm = rng.permutation(m)
        return (np.concatenate(keys)[perm], np.concatenate(ids)[perm],
                np.concatenate(ps)[perm])

    def prob_of(self, snap: Snapshot, keys: np.ndarray) -> np.ndarray:
        """Probability of one draw returning each key, under the snapshot (0 if not in it)."""
        out = np.zeros(len(keys), dtype=np.float64)
        if snap.total <= 0:
            return out
        for s, sel in self._route(keys):
            k = keys if sel is None else keys[sel]
            pos = self.parts[s].positions(k)
            ok = (pos >= 0) & (pos < snap.sizes[s])
            w = np.zeros(len(k), dtype=np.float64)
            if snap.cdfs is None:
                w[ok] = 1.0
            else:
                cdf, p = snap.cdfs[s], pos[ok]
                w[ok] = cdf[p] - np.where(p > 0, cdf[np.maximum(p - 1, 0)], 0.0)
            if sel is None:
                out = w / snap.total
            else:
                out[sel] = w / snap.total
        return out

    def stats(self) -> dict[str, Any]:
        return {"sampling_index_rows": len(self), "sampling_index_scans": self.scans,
                "sampling_snapshot_rebuilds": self.rebuilds,
                "sampling_index_bytes": sum(p.nbytes() for p in self.parts)}


def _coarse(cdf: np.ndarray) -> np.ndarray:
    """Every ``_BLOCK``-th entry of a cdf (the last of each block): small enough to stay in
    cache, so the first search level costs no memory misses on any table size."""
    if len(cdf) == 0:
        return cdf
    ends = np.minimum(np.arange(_BLOCK, len(cdf) + _BLOCK, _BLOCK), len(cdf)) - 1
    return cdf[ends]


def _inverse_cdf(cdf: np.ndarray, coarse: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Smallest ``i`` with ``cdf[i] > u``, for each ``u`` in ``[0, cdf[-1])``.

    A binary search over the cached coarse level picks the block, then a fixed number of
    vectorized bisection steps inside its ``_BLOCK`` entries (a few cache lines) finish:
    O(log n) compute but a constant number of memory misses per draw.
    """
    b = np.minimum(np.searchsorted(coarse, u, side="right"), len(coarse) - 1)
    lo = b * _BLOCK
    hi = np.minimum(lo + _BLOCK, len(cdf)) - 1
    for _ in range(_BLOCK_BITS):
        mid = (lo + hi) >> 1
        go = cdf[mid] <= u
        lo = np.where(go, mid + 1, lo)
        hi = np.where(go, hi, mid)
    return lo


def _split(arr: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    return np.split(arr, np.cumsum(sizes)[:-1]) if sizes else []
