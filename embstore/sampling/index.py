"""The per-store sampling index: keys + counts in memory, kept current by the engine's observers.

Built once with one scan of the backend (per shard for a sharded backend) the first time a
store samples, then maintained incrementally from every row write and delete the engine makes
(``on_write`` / ``on_delete``), so no call after the first reads the table. It is *not* written
into the store: it is exactly the ``(key, count)`` column of the records, which the store already
persists; rebuilding it after a reopen costs one scan (counted in :attr:`SamplingIndex.scans`).

Drawing uses a *snapshot* per sampler: the weights of every key as a cumulative sum and an
alias table of them (Walker's method, Vose's construction), so a draw is one uniform, a column
and a comparison: O(1), with no data-dependent branch and a constant number of memory misses
whatever the table size or the weights (see ``_alias``). A snapshot is reused until more
than ``staleness * len`` rows were written or deleted since it was taken (deleted keys stay in
it as tombstones: drawing one draws again, and their weight leaves the normalization);
``prob`` is always computed from the snapshot actually drawn from, so the logQ correction
stays exact for the distribution used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._cython.indexops import alias_table, draw_alias
from ..errors import CapabilityError, InvalidInputError
from .keyindex import KeyIndex
from .samplers import LogUniformSampler, Sampler

_SCAN_BATCH = 65536


@dataclass
class Snapshot:
    """Weights of every key at one moment, per part (shard)."""

    sizes: np.ndarray            # rows (positions) per part when taken, dead ones included
    cdfs: list | None            # per-part cumulative weights (float64); None = uniform
    aliases: list | None         # per-part alias tables ``(prob, alias)`` of the weights
    part_w: np.ndarray           # total weight per part when taken
    support: int                 # keys with a positive weight when taken
    epochs: tuple[int, ...]      # per-part position epochs: positions are valid while equal
    changes: int                 # index write counter when taken
    dead_done: np.ndarray        # per part: entries of the dead log already accounted for
    dead_w: np.ndarray           # per part: weight of keys deleted since taken
    dead_support: int = 0        # keys with a positive weight deleted since taken
    tries_ratio: float = 1.0     # draws per distinct key in the last unique sample (a hint)
    by_rank: np.ndarray | None = None  # log-uniform, one part: positions in frequency order

    @property
    def part_live(self) -> np.ndarray:
        """Weight per part of the keys still alive (draws of dead keys are rejected)."""
        return np.maximum(self.part_w - self.dead_w, 0.0)

    @property
    def total(self) -> float:
        return float(self.part_live.sum())

    def weight_at(self, s: int, pos: np.ndarray) -> np.ndarray:
        """Snapshot weight of positions ``pos`` of part ``s``."""
        if self.cdfs is None:
            return np.ones(len(pos), dtype=np.float64)
        cdf = self.cdfs[s]
        return cdf[pos] - np.where(pos > 0, cdf[np.maximum(pos - 1, 0)], 0.0)


class SamplingIndex:
    """Keys and counts of one store, per shard, plus cached sampling snapshots.

    Parameters
    ----------
    backend : Backend
        The store's backend. A partitioned backend (``partitions()``: the sharded layer, also
        behind a cache) is indexed per part, and draws are split across parts by their share
        of the weight.
    key_type : {"int64", "bytes"}
    staleness : float
        Fraction of rows that may be written before a count-based snapshot is rebuilt
        (default 5%: a rebuild is O(n), O(n log n) for log-uniform, so it is amortized over
        ``staleness * n`` writes).
    """

    def __init__(self, backend: Any, key_type: str, *, staleness: float = 0.05) -> None:
        if not (isinstance(staleness, (int, float)) and 0.0 <= staleness < float("inf")):
            raise InvalidInputError(f"staleness must be a number >= 0, got {staleness!r}")
        self.backend = backend
        self._shards: list[Any] = [backend]
        self._shard_of: Any = None
        self._partition()
        self.key_type = key_type
        self.staleness = float(staleness)
        self.parts = [_part(key_type) for _ in self._shards]
        self.total_count = 0
        #: full scans of the backend made by this index (1 after build)
        self.scans = 0
        #: snapshot (re)builds
        self.rebuilds = 0
        #: rows written through the engine since the index was built
        self.changes = 0
        self._rng = np.random.default_rng()
        self._pid = os.getpid()
        self._snaps: dict[tuple, Snapshot] = {}
        #: the index missed writes (a bulk load) and must be rebuilt before use
        self.stale = True

    @property
    def rng(self) -> np.random.Generator:
        """The generator of unseeded calls: fresh OS entropy, and fresh again in a forked
        child (DataLoader workers must not all draw the same negatives)."""
        if os.getpid() != self._pid:
            self._rng, self._pid = np.random.default_rng(), os.getpid()
        return self._rng

    @property
    def num_shards(self) -> int:
        return len(self.parts)

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    # -- building and maintenance ----------------------------------------------------------
    def _partition(self) -> None:
        # Read at every build: a layer in front of the shards (a cache) makes its buffered
        # writes visible in them when asked.
        parts = self.backend.partitions()
        self._shards = list(parts)
        self._shard_of = self.backend.partition_of if len(parts) > 1 else None

    def build(self) -> None:
        """(Re)read every key and count with one scan of the backend (per shard)."""
        if not self.backend.supports_scan:
            raise CapabilityError(f"{self.backend.url}: sampling needs a backend that can scan "
                                  "its rows (supports_scan)")
        self._partition()
        self.parts = [_part(self.key_type) for _ in self._shards]
        self.total_count = 0
        for part, shard in zip(self.parts, self._shards, strict=True):
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

    # -- the engine's observer protocol (embstore.engine.protocols.StoreObserver) -----------
    def on_write(self, keys: np.ndarray, recs: np.ndarray) -> None:
        self._set_counts(keys, np.ascontiguousarray(recs["count"], dtype=np.int64))

    def on_insert(self, keys: np.ndarray, vectors: np.ndarray, template: np.ndarray) -> None:
        self._set_counts(keys, np.full(len(keys), int(template["count"][0]), dtype=np.int64))

    def on_row_update(self, keys: np.ndarray, update: Any, found: np.ndarray) -> None:
        add = update.add.get("count")
        if add is None:
            return
        if not found.all():
            keys, add = keys[found], add[found]
        add = np.asarray(add, dtype=np.int64)
        if not add.any():  # a step that counts nothing (an adapter with count=False)
            return
        for s, sel in self._route(keys):
            part = self.parts[s]
            k, a = (keys, add) if sel is None else (keys[sel], add[sel])
            pos = part.positions(k)
            hit = pos >= 0
            if not hit.all():
                pos, a = pos[hit], a[hit]
            part.cols["count"][pos] += a
            self.total_count += int(a.sum())
        self.changes += len(keys)

    def _set_counts(self, keys: np.ndarray, counts: np.ndarray) -> None:
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
        if (snap is None or snap.epochs != tuple(p.epoch for p in self.parts)
                or self.changes - snap.changes > limit):
            snap = self._build_snapshot(sampler)
            self._snaps[key] = snap
        else:
            self._account_deletes(snap)
        return snap

    def _account_deletes(self, snap: Snapshot) -> None:
        # Keys deleted since the snapshot stay in it but are rejected when drawn; their
        # weight leaves the normalization, so p stays the exact conditional probability.
        for s, part in enumerate(self.parts):
            log = part.dead_log
            if len(log) > snap.dead_done[s]:
                new = log[snap.dead_done[s]:]
                new = new[new < snap.sizes[s]]
                w = snap.weight_at(s, new)
                snap.dead_w[s] += float(w.sum())
                snap.dead_support += int(np.count_nonzero(w > 0))
                snap.dead_done[s] = len(log)

    def _base(self, **kw: Any) -> Snapshot:
        nparts = len(self.parts)
        return Snapshot(sizes=np.array([p.n for p in self.parts], dtype=np.int64),
                        epochs=tuple(p.epoch for p in self.parts), changes=self.changes,
                        dead_done=np.array([len(p.dead_log) for p in self.parts], np.int64),
                        dead_w=np.zeros(nparts), **kw)

    def _uniform_snapshot(self) -> Snapshot:
        live = np.array([len(p) for p in self.parts], dtype=np.float64)
        return self._base(cdfs=None, aliases=None, part_w=live, support=int(live.sum()))

    def _build_snapshot(self, sampler: Sampler) -> Snapshot:
        counts = [p.col("count") for p in self.parts]
        alive = [p.alive_mask() for p in self.parts]
        by_rank = None
        if sampler.rank_based:
            w_all, order = self._rank_weights(sampler, counts, alive)
            weights = _split(w_all, [len(c) for c in counts])
            if len(self.parts) == 1 and isinstance(sampler, LogUniformSampler):
                by_rank = order  # lets draws invert the log-uniform cdf analytically
        else:
            weights = [np.where(a, sampler.weights(c), 0.0)
                       for c, a in zip(counts, alive, strict=True)]
        cdfs, part_w, support = [], [], 0
        for w in weights:
            cdf = np.cumsum(w, dtype=np.float64)
            support += int(np.count_nonzero(w > 0))
            cdfs.append(cdf)
            part_w.append(float(cdf[-1]) if len(cdf) else 0.0)
        self.rebuilds += 1
        return self._base(cdfs=cdfs, aliases=[_alias(c) for c in cdfs], by_rank=by_rank,
                          part_w=np.array(part_w, dtype=np.float64), support=support)

    def _rank_weights(self, sampler: Sampler, counts: list[np.ndarray],
                      alive: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        # Ranks are global (across shards): most frequent first, ties by key ascending.
        allc = np.concatenate(counts)
        live = np.flatnonzero(np.concatenate(alive))
        c = allc[live]
        k = np.concatenate([p.live_keys for p in self.parts])[live]
        if k.dtype == object:
            by_key = np.argsort(k, kind="stable")
            order = by_key[np.argsort(-c[by_key], kind="stable")]
        else:
            order = np.lexsort((k, -c))
        w = np.zeros(len(allc), dtype=np.float64)
        w[live[order]] = sampler.weights(c[order])
        return w, live[order]

    # -- drawing -----------------------------------------------------------------------------
    def _draw_raw(self, snap: Snapshot, s: int, rng: np.random.Generator,
                  c: int) -> tuple[np.ndarray, np.ndarray]:
        """``c`` positions of part ``s`` from the snapshot (dead ones included) and weights."""
        if snap.cdfs is None:
            pos = rng.integers(0, snap.sizes[s], size=c)
            return pos, np.ones(c, dtype=np.float64)
        if snap.by_rank is not None:
            # TF's log-uniform inverse: rank = floor(exp(u * log(N + 1))) - 1, O(1) a draw.
            n = len(snap.by_rank)
            r = np.floor(np.exp(rng.random(c) * np.log(n + 1.0))).astype(np.int64) - 1
            np.clip(r, 0, n - 1, out=r)
            return snap.by_rank[r], np.log1p(1.0 / (r + 1.0)) / np.log(n + 1.0)
        # One uniform per draw, in draw order (i.i.d. as drawn), read through the alias
        # table, and Snapshot.weight_at's weights in the same pass. (A part is drawn from
        # only where its live weight is positive, so its table exists.)
        assert snap.aliases is not None  # invariant: built together with the cdfs
        prob, alias = snap.aliases[s]
        return draw_alias(snap.cdfs[s], prob, alias, rng.random(c),
                          np.empty(c, dtype=np.int64), np.empty(c, dtype=np.float64))

    def draw(self, snap: Snapshot, rng: np.random.Generator,
             m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``m`` independent draws: ``(keys, ids, p)`` where ``ids`` identify rows across
        shards and ``p`` is each drawn key's probability under the snapshot."""
        live_w = snap.part_live
        total = float(live_w.sum())
        if total <= 0:
            raise InvalidInputError("the store has no key with a positive sampling weight")
        nparts = len(self.parts)
        per = [m] if nparts == 1 else rng.multinomial(m, live_w / total).tolist()
        offsets = np.concatenate(([0], np.cumsum(snap.sizes)))
        keys, ids, ps = [], [], []
        for s, c in enumerate(per):
            if c == 0:
                continue
            alive = self.parts[s].alive
            pos, w = self._draw_raw(snap, s, rng, c)
            redo = np.flatnonzero(~alive[pos])
            while len(redo):  # rejection: a deleted key's slot is drawn again, in place
                p2, w2 = self._draw_raw(snap, s, rng, len(redo))
                pos[redo], w[redo] = p2, w2
                redo = redo[~alive[p2]]
            keys.append(self.parts[s].keys[pos])
            ids.append(pos + offsets[s])
            ps.append(w / total)
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
        total = snap.total
        if total <= 0 or not len(keys):  # (sampling without positives asks for none)
            return out
        for s, sel in self._route(keys):
            k = keys if sel is None else keys[sel]
            pos = self.parts[s].positions(k)  # live keys only
            ok = (pos >= 0) & (pos < snap.sizes[s])
            w = np.zeros(len(k), dtype=np.float64)
            w[ok] = snap.weight_at(s, pos[ok])
            if sel is None:
                out = w / total
            else:
                out[sel] = w / total
        return out

    def stats(self) -> dict[str, Any]:
        return {"sampling_index_rows": len(self), "sampling_index_scans": self.scans,
                "sampling_snapshot_rebuilds": self.rebuilds,
                "sampling_index_bytes": sum(p.nbytes() for p in self.parts)}


def _part(key_type: str) -> KeyIndex:
    return KeyIndex(key_type, {"count": (np.int64, ())}, tombstones=True)


def _alias(cdf: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The alias table ``(prob, alias)`` of a part's weights (``indexops.alias_table``):
    what its draws read. None for a part with no positive weight (nothing is drawn from it)."""
    if len(cdf) == 0 or not cdf[-1] > 0:
        return None
    n = len(cdf)
    return alias_table(cdf, np.empty(n, dtype=np.float64), np.empty(n, dtype=np.int64))


def _split(arr: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    return np.split(arr, np.cumsum(sizes)[:-1]) if sizes else []
