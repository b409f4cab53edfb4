"""Approximate top-k kept current while training writes: an HNSW index plus an exact "fresh"
segment.

No HNSW library absorbs a training feed key by key without losing recall (removing and
re-adding a node leaves the graph worse each round), so the index is rebuilt whole in the
background, and in between every key written since the last build's snapshot is a *fresh*
key: scored exactly with its current vector. The fresh keys that exist and their vectors are
one contiguous float32 matrix (a :class:`~embstore.sampling.keyindex.KeyIndex`), kept
between queries: a query first reads the keys written since the previous one into it, then
scores the whole segment with one matrix product. The HNSW candidates (``oversample`` x k of
them) whose keys were written or deleted since the snapshot are dropped (the segment holds
the live ones); the others still hold the snapshot's vector, so they are re-scored exactly
from the snapshot's matrix. A rebuild starts when the fresh keys pass ``rebuild_at`` of the
table and swaps in atomically.

Needs ``usearch`` (the ``ann`` extra).
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from .._keys import factorize_keys
from ..errors import BackendUnavailableError, InvalidInputError
from ..retrieval import TopKResult
from ..sampling.keyindex import KeyIndex


def _distinct(parts: list[np.ndarray]) -> np.ndarray:
    """The distinct keys of a list of key arrays, as one array."""
    keys = np.concatenate(parts) if len(parts) > 1 else parts[0]
    return keys[factorize_keys(keys)[0]] if keys.dtype == object else np.unique(keys)


def _block_rows(dim: int) -> int:
    """Rows of the fresh segment scored per BLAS call: 128 at dim 64 (8192 floats, a power of
    two so that the segment's capacity, 1024 doubled, holds whole blocks)."""
    return min(1024, 1 << max(0, (8192 // dim).bit_length() - 1))


def _segment_scores(seg: KeyIndex, q: np.ndarray) -> np.ndarray:
    """``q @ seg's vectors.T``, (len(q), seg.n), as blocks of :func:`_block_rows` rows in one
    stacked matmul. One product over the whole segment is large enough for OpenBLAS to split
    over threads that spin-wait for each other: on a busy machine (load 7-8 on 2 cores) a
    20k-row query then took 16-28 ms instead of 0.04-0.07, measured; blocks of 64 to 256 rows
    x 64 did not. The blocks run on the calling thread, one BLAS call each, and score as one
    product does, up to float rounding."""
    vecs, n = seg.cols["vector"], seg.n
    block = _block_rows(vecs.shape[1])
    rows = -(-n // block) * block       # rows past n are stale or zero: cut off below
    if rows > len(vecs):
        return (vecs[:n] @ q.T).T
    blocks = vecs[:rows].reshape(rows // block, block, vecs.shape[1])
    if len(q) == 1:     # a matrix-vector product per block (q.T as a matrix took 3x as long)
        return (blocks @ q[0]).reshape(1, rows)[:, :n]
    return (blocks @ q.T).reshape(rows, len(q))[:n].T


class _KeyLog:
    """Key arrays as written, deduplicated once they pass twice the distinct keys of the last
    time (and 1M): a table written for long without a query, or during a long build, holds
    its written keys once, not once per write."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.n = 0
        self._limit = 1 << 20

    def add(self, keys: np.ndarray) -> None:
        self.parts.append(keys)
        self.n += len(keys)
        if self.n > self._limit:
            self.parts = [_distinct(self.parts)]
            self.n = len(self.parts[0])
            self._limit = max(self._limit, 2 * self.n)


class _Built:
    """One build: the graph, the snapshot it was built from (label ``i`` is ``snap``'s row
    ``i``), which labels were written since, and the fresh segment."""

    def __init__(self, index: Any, snap: KeyIndex, seg: KeyIndex) -> None:
        self.index, self.snap, self.seg = index, snap, seg
        self.n = snap.n
        self.dirty = np.zeros(snap.n + 1, bool)   # + a sentinel label for usearch's misses
        self.dirty[snap.n] = True
        self.ndirty = 0

    def fresh(self) -> int:
        """Rows a query scores exactly, or graph entries it wastes: what a rebuild clears."""
        return max(self.seg.n, self.ndirty)


class AnnIndex:
    """Approximate top-k over ``store`` (an :class:`~embstore.EmbeddingStore`, observed).

    Parameters
    ----------
    store : EmbeddingStore
    guard : context manager
        Held while the rebuild reads the table (the serving worker's lock).
    oversample : int
        HNSW candidates per query, as a multiple of ``k``, before exact re-scoring.
    connectivity, expansion_search : int
        HNSW graph degree and search breadth (see docs/service.md for the measured trade-off).
        :attr:`expansion_search` may be set later: the next query searches with it.
    dtype : {"bf16", "f16", "f32"}
        How the graph stores vectors. It only picks candidates, which are re-scored from an
        exact float32 copy, so halving its bytes cost no measured recall, and with bf16 a
        search took 20-30% less CPU and a build a third less (50k x 64, AVX-512 BF16).
    rebuild_at : float
        Rebuild once the fresh keys pass this share of the indexed rows.
    threads : int
        Threads a build inserts with (0: every core). usearch's multi-threaded insertion
        links the graph in whatever order the threads reach it, so only ``threads=1``
        builds the same graph, and answers the same candidates, from the same snapshot.
    """

    def __init__(self, store: Any, guard: AbstractContextManager[Any], *, oversample: int = 8,
                 rebuild_at: float = 0.1, connectivity: int = 32,
                 expansion_search: int = 256, dtype: str = "bf16", threads: int = 0) -> None:
        if not 0 < rebuild_at <= 1 or oversample < 1 or threads < 0:
            raise InvalidInputError("rebuild_at must be in (0, 1], oversample >= 1 and "
                                    "threads >= 0")
        if dtype not in ("bf16", "f16", "f32"):
            raise InvalidInputError(f"dtype must be bf16, f16 or f32, got {dtype!r}")
        try:
            from usearch.index import Index  # an optional extra: imported only when used
        except ImportError as e:
            raise BackendUnavailableError(f"approximate top_k needs usearch ({e}); install it "
                                          "with: pip install -e '.[ann]'") from e
        if expansion_search < 1 or connectivity < 2:
            raise InvalidInputError("expansion_search must be >= 1 and connectivity >= 2")
        conn = int(connectivity)
        self._new_index = lambda: Index(ndim=store.dim, metric="ip", dtype=dtype,
                                        connectivity=conn)
        #: HNSW search breadth of the next queries
        self.expansion_search = int(expansion_search)
        self.store, self.guard = store, guard
        self.oversample, self.rebuild_at = int(oversample), float(rebuild_at)
        self.threads = int(threads)
        self._lock = threading.Lock()
        self._built: _Built | None = None
        self._pending = _KeyLog()                   # keys written since the last query
        self._since_snapshot: _KeyLog | None = None  # collected while a build runs
        self._building: threading.Thread | None = None
        self.builds = 0
        store.add_observer(self)

    # -- StoreObserver: every written or deleted key is fresh until the next build ------------
    def _touch(self, keys: np.ndarray) -> None:
        if not len(keys):
            return
        keys = keys.copy()      # the caller's array may be reused
        with self._lock:
            self._pending.add(keys)
            if self._since_snapshot is not None:
                self._since_snapshot.add(keys)

    def on_write(self, keys: np.ndarray, records: np.ndarray) -> None:
        self._touch(keys)

    def on_insert(self, keys: np.ndarray, vectors: np.ndarray, template: np.ndarray) -> None:
        self._touch(keys)

    def on_row_update(self, keys: np.ndarray, update: Any, found: np.ndarray) -> None:
        self._touch(keys[found])

    def on_delete(self, keys: np.ndarray) -> None:
        self._touch(keys)

    def on_bulk_load(self) -> None:
        with self._lock:
            self._built = None    # rows changed around the engine: rebuild on next query
            self._pending = _KeyLog()

    def stats(self) -> dict[str, Any]:
        b = self._built
        return {"ann_builds": self.builds, "ann_fresh_keys": b.fresh() if b else 0,
                "ann_indexed": b.n if b else 0}

    # -- building ----------------------------------------------------------------------------
    def _read_table(self) -> KeyIndex:
        """Every key and vector (the caller holds the guard); written keys collected anew from
        here on."""
        s = self.store
        snap = KeyIndex(s.key_type, {"vector": (np.float32, (s.dim,))}, max(len(s), 16))
        for keys, recs in s.records(65536):
            snap.upsert(keys, {"vector": s.layout.vectors(recs)})
        with self._lock:
            self._since_snapshot = _KeyLog()
        return snap

    def _build(self, guard_held: bool = False) -> None:
        """A new index from a snapshot, swapped in; the keys written since the snapshot are
        its first fresh keys. ``guard_held``: the caller holds the guard (a query's first
        build)."""
        if guard_held:
            snap = self._read_table()
        else:
            with self.guard:
                snap = self._read_table()
        index = self._new_index()
        if snap.n:
            index.add(np.arange(snap.n, dtype=np.uint64), snap.col("vector"),
                      threads=self.threads)
        seg = KeyIndex(self.store.key_type, {"vector": (np.float32, (self.store.dim,))})
        with self._lock:
            self._built = _Built(index, snap, seg)
            self._pending = self._since_snapshot or _KeyLog()   # read by the next query
            self._since_snapshot = None
            self.builds += 1

    def rebuild(self, wait: bool = True) -> None:
        """Rebuild from a fresh snapshot now (in the background unless ``wait``)."""
        if wait:
            self._build()
            return
        if self._building is None or not self._building.is_alive():
            self._building = threading.Thread(target=self._build, name="embstore-ann",
                                              daemon=True)
            self._building.start()

    # -- querying ----------------------------------------------------------------------------
    def _catch_up(self, b: _Built, pending: list[np.ndarray]) -> None:
        """Read the keys written since the last query into ``b`` (the caller holds the guard,
        so no write runs meanwhile): their labels turn dirty, the live ones' current vectors
        go into the segment, the deleted ones leave it."""
        s = self.store
        keys = _distinct(pending)
        labels = b.snap.positions(keys)
        labels = labels[labels >= 0]
        if len(labels):
            b.ndirty += int(len(labels) - np.count_nonzero(b.dirty[labels]))
            b.dirty[labels] = True
        live = s.contains(keys)
        if not live.all():
            b.seg.remove(keys[~live])
        if live.any():
            keys = keys[live]
            b.seg.upsert(keys, {"vector": s.lookup(keys, insert=False)})

    def top_k(self, q: np.ndarray, k: int, exclude: list[np.ndarray] | None = None
              ) -> TopKResult:
        """Approximate top-``k`` of each query row (the caller holds the guard): the HNSW
        candidates and the fresh segment, all scored exactly with current vectors, ordered
        as the exact top-k orders them (score descending, NaN last, ties by key)."""
        if self._built is None:
            self._build(guard_held=True)
        with self._lock:
            b, pending, self._pending = self._built, self._pending, _KeyLog()
        assert b is not None
        if pending.parts:
            self._catch_up(b, pending.parts)
        if b.fresh() > self.rebuild_at * max(b.n, 1):
            self.rebuild(wait=False)
        q = np.ascontiguousarray(q, np.float32)
        nq, want = len(q), min(b.n, k * self.oversample)
        found = np.full((nq, want), b.n, np.int64)     # misses stay the sentinel label
        if want:
            if b.index.expansion_search != self.expansion_search:
                b.index.expansion_search = self.expansion_search
            m = b.index.search(q, want, threads=1)
            if nq == 1:     # one query's Matches holds only what was found
                found[0, :len(m.keys)] = m.keys
            else:           # a batch's is padded with zeros past each row's count
                got = np.arange(want) < np.asarray(m.counts)[:, None]
                found[got] = np.asarray(m.keys).reshape(nq, want)[got]
        seg_keys = b.seg.live_keys
        with np.errstate(over="ignore", invalid="ignore"):   # inf and NaN scores are ranked
            f_scores = _segment_scores(b.seg, q) if len(seg_keys) else None
            rows = []
            for i in range(nq):
                cand = found[i][~b.dirty[found[i]]]   # clean labels hold the snapshot vector
                c_scores = b.snap.cols["vector"][cand] @ q[i]
                rows.append(self._best(k, b, cand, c_scores, seg_keys,
                                       None if f_scores is None else f_scores[i],
                                       None if exclude is None else exclude[i]))
        key_dtype = np.int64 if self.store.key_type == "int64" else object
        width = min(k, max((len(r[0]) for r in rows), default=0))
        out_k = np.full((nq, width), b"" if key_dtype is object else -1, dtype=key_dtype)
        out_s = np.full((nq, width), -np.inf, np.float32)
        valid = np.zeros((nq, width), bool)
        for i, (keys, sc) in enumerate(rows):
            m = min(width, len(keys))
            out_k[i, :m], out_s[i, :m], valid[i, :m] = keys[:m], sc[:m], True
        return TopKResult(out_k, out_s, valid)

    @staticmethod
    def _best(k: int, b: _Built, cand: np.ndarray, c_scores: np.ndarray,
              seg_keys: np.ndarray, f_scores: np.ndarray | None, exclude: np.ndarray | None
              ) -> tuple[np.ndarray, np.ndarray]:
        """One query's top ``k`` over its clean graph candidates (labels) and the fresh
        segment, by score (NaN last), ties by key, as an exact top-k orders them."""
        ex = exclude if exclude is not None and len(exclude) else None
        if ex is not None:
            drop = b.snap.positions(ex)
            keep = ~np.isin(cand, drop[drop >= 0])
            cand, c_scores = cand[keep], c_scores[keep]
        keys, sc = b.snap.keys[cand], c_scores
        num = c_scores[c_scores == c_scores]     # the candidates' numbers (NaN ranks last)
        if f_scores is not None and len(num) >= k:
            # k candidates score at least the k-th best of them: only the segment rows that
            # reach it can still enter (ties kept for the key order), found in one pass
            # instead of partitioning the whole segment
            pick = np.flatnonzero(f_scores >= np.partition(num, len(num) - k)[len(num) - k])
            if ex is not None and len(pick):
                at = b.seg.positions(ex)
                pick = pick[~np.isin(pick, at[at >= 0])]
            keys = np.concatenate((keys, seg_keys[pick]))
            sc = np.concatenate((sc, f_scores[pick]))
        elif f_scores is not None:
            neg, rows = -f_scores, None
            if ex is not None:      # the excluded rows are left out before picking
                at = b.seg.positions(ex)
                if (at >= 0).any():
                    keep = np.ones(len(neg), bool)
                    keep[at[at >= 0]] = False
                    rows = np.flatnonzero(keep)
                    neg = neg[rows]
            if len(neg) > k:   # the segment's k best, ties at the k-th kept for the key order
                kth = np.partition(neg, k - 1)[k - 1]
                pick = np.flatnonzero(neg <= kth) if kth == kth else np.arange(len(neg))
            else:
                pick = np.arange(len(neg))
            keys = np.concatenate((keys, seg_keys[pick if rows is None else rows[pick]]))
            sc = np.concatenate((sc, -neg[pick]))
        tie = np.unique(keys, return_inverse=True)[1] if keys.dtype == object else keys
        order = np.lexsort((tie, -sc))[:k]
        return keys[order], sc[order].astype(np.float32)
