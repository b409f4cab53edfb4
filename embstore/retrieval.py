"""Exact top-k retrieval by dot product: ``store.top_k(queries, k)``.

Items stream through in blocks: one matrix product per block, then only the scores that can
still enter a query's top k (``>=`` its current k-th best) are merged. The first block is cut to
its k best per row with ``np.partition``; after that the running threshold usually lets very few
scores through, so the cost is dominated by the matrix products. Ties are broken by key
ascending, so the result is a pure function of the data (equal to a brute-force sort).

Sources: a persistent or remote backend is streamed with ``scan`` in constant memory; a sharded
backend is streamed per shard and the per-shard top-k lists are merged (n x k -> k); a
``memory://`` store keeps a dense copy of its vectors (built by one scan, then kept current by
the engine's write/delete observers) and multiplies against it directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from .errors import InvalidInputError
from .sampling.keyindex import KeyIndex

_ATTR = "_dense_vectors"
_SCORE_BUDGET = 1 << 23  # scores per block (32 MB of float32)


class TopK:
    """Running top-k of every query row, merged block by block.

    Parameters
    ----------
    nq, k : int
        Number of queries and results per query.
    key_dtype : numpy dtype
        int64 or object (bytes keys).
    """

    def __init__(self, nq: int, k: int, key_dtype: Any) -> None:
        self.nq, self.k = nq, k
        self.scores = np.full((nq, k), -np.inf, dtype=np.float32)
        self.keys = np.zeros((nq, k), dtype=key_dtype)
        if key_dtype == object:
            self.keys[:] = b""
        self.filled = 0  # valid columns, the same for every row

    def add(self, scores: np.ndarray, keys: np.ndarray) -> None:
        """Merge a ``(nq, b)`` block of scores of items ``keys``."""
        b = scores.shape[1]
        if b == 0:
            return
        k = self.k
        if self.filled < k:
            thr = np.full(self.nq, -np.inf, dtype=np.float32)
        else:
            thr = self.scores[:, k - 1]
        flat = np.flatnonzero(scores >= thr[:, None])
        if b > k and len(flat) > 2 * self.nq * k:
            kth = np.partition(scores, b - k, axis=1)[:, b - k]
            flat = np.flatnonzero(scores >= np.maximum(thr, kth)[:, None])  # >= keeps ties
        rows, cols = np.divmod(flat, b)
        cand_s, cand_k = scores.ravel()[flat], keys[cols]
        if self.filled == k and len(flat):
            # A score equal to a row's k-th best only enters with a smaller key: this keeps
            # massive ties (e.g. a zero query) from flooding every merge.
            tie = cand_s == thr[rows]
            if tie.any():
                ok = ~tie
                ok[tie] = cand_k[tie] < self.keys[rows[tie], k - 1]
                rows, cand_s, cand_k = rows[ok], cand_s[ok], cand_k[ok]
        self._merge(rows, cand_s, cand_k, min(k, self.filled + b))

    def merge(self, other: TopK) -> None:
        """Merge another partial result over disjoint items (e.g. another shard's)."""
        f = other.filled
        rows = np.repeat(np.arange(self.nq), f)
        self._merge(rows, other.scores[:, :f].ravel(), other.keys[:, :f].ravel(),
                    min(self.k, self.filled + f))

    def _merge(self, rows: np.ndarray, s: np.ndarray, keys: np.ndarray, newfill: int) -> None:
        f = self.filled
        rows = np.concatenate((np.repeat(np.arange(self.nq), f), rows))
        s = np.concatenate((self.scores[:, :f].ravel(), s))
        keys = np.concatenate((self.keys[:, :f].ravel(), keys))
        if keys.dtype == object:  # lexsort needs numbers: rank bytes keys among candidates
            _, tie = np.unique(keys, return_inverse=True)
        else:
            tie = keys
        order = np.lexsort((tie, -s, rows))
        rs = rows[order]
        starts = np.searchsorted(rs, np.arange(self.nq))
        rank = np.arange(len(rs)) - starts[rs]
        keep = rank < newfill
        self.scores[rs[keep], rank[keep]] = s[order][keep]
        self.keys[rs[keep], rank[keep]] = keys[order][keep]
        self.filled = newfill


def _queries(store: Any, queries: Any) -> np.ndarray:
    if hasattr(queries, "detach") and hasattr(queries, "cpu"):
        queries = queries.detach().cpu().numpy()
    elif hasattr(queries, "numpy") and not isinstance(queries, np.ndarray):
        queries = queries.numpy()
    q = np.asarray(queries)
    if q.ndim == 1:
        q = q[None, :]
    if q.ndim != 2 or q.shape[1] != store.dim:
        raise InvalidInputError(f"queries must have shape (n, {store.dim}), got {q.shape}")
    if q.dtype.kind not in "fiu" or q.dtype == np.bool_:
        raise InvalidInputError(f"queries must be numeric, got dtype {q.dtype}")
    q = np.ascontiguousarray(q, dtype=np.float32)
    if not np.isfinite(q).all():
        raise InvalidInputError("queries contain NaN or inf")
    return q


def _exclusions(store: Any, exclude: Any, nq: int) -> tuple[np.ndarray | None, list | None]:
    """``(global, per_query)``: one key array applied to all queries, or one per query."""
    if exclude is None:
        return None, None
    if isinstance(exclude, (list, tuple)) and len(exclude) == nq and nq and all(
        isinstance(e, (list, tuple, np.ndarray)) for e in exclude
    ):
        return None, [store._keys(e) for e in exclude]
    return store._keys(exclude), None


def _dense(store: Any) -> KeyIndex:
    """The memory store's dense (keys, vectors) copy, kept current by observers."""
    idx = store.__dict__.get(_ATTR)
    if idx is None or idx.stale:
        if idx is not None:
            store._observers.remove(idx)
        idx = _DenseVectors(store.key_type, store.dim, len(store.backend))
        for keys, recs in store.backend.scan(65536):
            idx.upsert(keys, {"vector": recs["vector"]})
        store._observers.append(idx)
        setattr(store, _ATTR, idx)
    return idx


class _DenseVectors(KeyIndex):
    def __init__(self, key_type: str, dim: int, capacity: int) -> None:
        super().__init__(key_type, {"vector": (np.float32, (dim,))}, capacity)
        self.stale = False

    def on_write(self, keys: np.ndarray, recs: np.ndarray) -> None:
        self.upsert(keys, {"vector": recs["vector"]})

    def on_delete(self, keys: np.ndarray) -> None:
        self.remove(keys)

    def on_bulk_load(self) -> None:
        self.stale = True


def _blocks(source: Iterable[tuple[np.ndarray, np.ndarray]], rows: int,
            k: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Re-cut ``(keys, vectors)`` batches into blocks of geometrically growing size, capped at
    ``rows``: each block is about as large as everything seen before it, so only ~k scores per
    query beat the running threshold and the merge stays small."""
    size = min(rows, max(1024, 4 * k))
    for keys, vecs in source:
        i = 0
        while i < len(keys):
            yield keys[i:i + size], vecs[i:i + size]
            i += size
            size = min(rows, size * 2)


def _scan_vectors(backend: Any, batch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for keys, recs in backend.scan(batch):
        yield keys, recs["vector"]


def _run(q: np.ndarray, k: int, key_dtype: Any, source: Iterable, rows: int,
         exclude: np.ndarray | None) -> TopK:
    acc = TopK(len(q), k, key_dtype)
    for keys, vecs in _blocks(source, rows, k):
        if exclude is not None and len(exclude):
            keep = ~np.isin(keys, exclude)
            if not keep.all():
                keys, vecs = keys[keep], vecs[keep]
        acc.add(q @ vecs.T, keys)
    return acc


def top_k(store: Any, queries: Any, k: int, exclude: Any = None, *,
          batch_size: int | None = None, dense: bool | None = None,
          ) -> tuple[np.ndarray, np.ndarray]:
    """See :meth:`embstore.EmbeddingStore.top_k`."""
    store._check_open()
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k <= 0:
        raise InvalidInputError(f"k must be a positive int, got {k!r}")
    q = _queries(store, queries)
    nq = len(q)
    glob, per = _exclusions(store, exclude, nq)
    k_eff = int(k) + (max((len(e) for e in per), default=0) if per else 0)
    key_dtype = np.int64 if store.key_type == "int64" else object
    rows = max(1024, _SCORE_BUDGET // max(nq, 1))
    if batch_size is not None:
        if batch_size <= 0:
            raise InvalidInputError(f"batch_size must be positive, got {batch_size}")
        rows = int(batch_size)
    backend = store.backend
    if dense is None:
        dense = not backend.persistent and not hasattr(backend, "shards")
    if nq == 0:
        acc = TopK(0, k_eff, key_dtype)
    elif dense:
        idx = _dense(store)
        acc = _run(q, k_eff, key_dtype, [(idx.live_keys, idx.col("vector"))], rows, glob)
    elif hasattr(backend, "shards") and hasattr(backend, "shard_of"):
        # Per-shard top-k (what each shard server would compute), merged by the caller.
        acc = TopK(nq, k_eff, key_dtype)
        for shard in backend.shards:
            acc.merge(_run(q, k_eff, key_dtype, _scan_vectors(shard, min(rows, 65536)), rows,
                           glob))
    else:
        acc = _run(q, k_eff, key_dtype, _scan_vectors(backend, min(rows, 65536)), rows, glob)
    keys, scores = acc.keys[:, :acc.filled], acc.scores[:, :acc.filled]
    if per is None:
        return keys.copy(), scores.copy()
    return _drop_per_query(keys, scores, per, int(k))


def _drop_per_query(keys: np.ndarray, scores: np.ndarray, per: list[np.ndarray],
                    k: int) -> tuple[np.ndarray, np.ndarray]:
    # A loop over queries (not keys): each row drops its own excluded keys, then pads.
    width = min(k, keys.shape[1])
    out_k = np.zeros((len(keys), width), dtype=keys.dtype)
    if keys.dtype == object:
        out_k[:] = b""
    out_s = np.full((len(keys), width), -np.inf, dtype=np.float32)
    for i, ex in enumerate(per):
        keep = ~np.isin(keys[i], ex) if len(ex) else np.ones(keys.shape[1], dtype=bool)
        kk, ss = keys[i][keep][:width], scores[i][keep][:width]
        out_k[i, :len(kk)] = kk
        out_s[i, :len(ss)] = ss
    return out_k, out_s
