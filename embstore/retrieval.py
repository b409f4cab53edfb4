"""Exact top-k retrieval by dot product: ``store.top_k(queries, k)``.

Items stream through in blocks: one matrix product per block, then only the scores that can
still enter a query's top k (``>=`` its current k-th best) are merged. The first block is cut to
its k best per row with ``np.partition``; after that the running threshold usually lets very few
scores through, so the cost is dominated by the matrix products. Ties are broken by key
ascending, so the result is a pure function of the data (equal to a brute-force sort). A NaN
score (a dot product of inf - inf) ranks after every number, ``-inf`` included.

The result is a :class:`TopKResult`: it unpacks as ``keys, scores`` and carries ``valid``, a
mask that is False where a row ran out of items (after per-query exclusion); those places hold
:data:`PAD_KEY` (``b""`` for bytes keys) and score ``-inf``. Any int64 can be a real key, so
``valid``, not the key, tells padding apart.

Sources: a persistent or remote backend is streamed with ``scan`` in constant memory; a sharded
backend is streamed per shard and the per-shard top-k lists are merged (n x k -> k); a
``memory://`` store keeps a dense copy of its vectors (built by one scan, then kept current by
the engine's write/delete observers) and multiplies against it directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from .errors import CapabilityError, InvalidInputError
from .sampling.keyindex import KeyIndex

#: Key in the padded places of a top-k result of an int64 store (see ``TopKResult.valid``).
PAD_KEY = np.iinfo(np.int64).min
_ATTR = "_dense_vectors"
_SCORE_BUDGET = 1 << 23  # scores per block (32 MB of float32)
_MAX_QUERIES = 8192


class TopKResult(tuple):
    """``(keys, scores)`` of :func:`top_k`, plus a ``valid`` mask of the same shape.

    Unpacks as a 2-tuple (``keys, scores = store.top_k(q, k)``). Where ``valid`` is False the
    row ran out of items: the key is :data:`PAD_KEY` (``b""`` for bytes keys) and the score
    ``-inf``.
    """

    valid: np.ndarray

    def __new__(cls, keys: np.ndarray, scores: np.ndarray, valid: np.ndarray) -> TopKResult:
        obj = super().__new__(cls, (keys, scores))
        obj.valid = valid
        return obj

    def __getnewargs__(self):
        return (self[0], self[1], self.valid)

    @property
    def keys(self) -> np.ndarray:
        return self[0]

    @property
    def scores(self) -> np.ndarray:
        return self[1]


def _pad_key(key_dtype: Any) -> Any:
    return b"" if np.dtype(key_dtype).kind == "O" else PAD_KEY


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
        if np.dtype(key_dtype).kind == "O":
            self.keys[:] = b""
        self.filled = 0  # valid columns, the same for every row
        # Candidates that passed the threshold wait here and are merged in bulk: once the
        # top k is full, few pass per block and one sort per many blocks is enough.
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._npending = 0
        self._items_pending = 0

    def add(self, scores: np.ndarray, keys: np.ndarray) -> None:
        """Merge a ``(nq, b)`` block of scores of items ``keys``."""
        b = scores.shape[1]
        if b == 0:
            return
        k = self.k
        thr = self._threshold()
        # "not below" rather than ">=": NaN scores pass while a row is not full (they rank
        # last but still count as items); a NaN threshold lets everything through.
        flat = np.flatnonzero(~(scores < thr[:, None]))
        if b > k and len(flat) > 2 * self.nq * k and self._pending:
            self.flush()  # a fresher threshold may be all it takes
            thr = self._threshold()
            flat = np.flatnonzero(~(scores < thr[:, None]))
        if b > k and len(flat) > 2 * self.nq * k:
            kth = np.partition(scores, b - k, axis=1)[:, b - k]  # NaN sorts last
            flat = np.flatnonzero(~(scores < np.fmax(thr, kth)[:, None]))  # keeps ties
        rows, cols = np.divmod(flat, b)
        cand_s, cand_k = scores.ravel()[flat], keys[cols]
        if self.filled == k and len(flat):
            # NaN ranks below every number: it cannot displace a full row's numeric k-th best
            nan = np.isnan(cand_s)
            if nan.any():
                ok = ~nan | np.isnan(thr[rows])
                rows, cand_s, cand_k = rows[ok], cand_s[ok], cand_k[ok]
            # A score equal to a row's k-th best only enters with a smaller key: this keeps
            # massive ties (e.g. a zero query) from flooding every merge.
            tie = cand_s == thr[rows]
            if tie.any():
                ok = ~tie
                ok[tie] = cand_k[tie] < self.keys[rows[tie], k - 1]
                rows, cand_s, cand_k = rows[ok], cand_s[ok], cand_k[ok]
        self._pending.append((rows, cand_s, cand_k))
        self._npending += len(rows)
        self._items_pending += b
        if self.filled < k or self._npending > 4 * self.nq * k:
            self.flush()

    def _threshold(self) -> np.ndarray:
        if self.filled < self.k:
            return np.full(self.nq, -np.inf, dtype=np.float32)
        return self.scores[:, self.k - 1]

    def flush(self) -> None:
        """Merge the pending candidates into the top k."""
        if not self._pending:
            return
        rows, s, keys = (np.concatenate(parts) for parts in zip(*self._pending, strict=True))
        newfill = min(self.k, self.filled + self._items_pending)
        self._pending, self._npending, self._items_pending = [], 0, 0
        self._merge(rows, s, keys, newfill)

    def merge(self, other: TopK) -> None:
        """Merge another partial result over disjoint items (e.g. another shard's)."""
        other.flush()
        self.flush()
        f = other.filled
        rows = np.repeat(np.arange(self.nq), f)
        self._merge(rows, other.scores[:, :f].ravel(), other.keys[:, :f].ravel(),
                    min(self.k, self.filled + f))

    def _merge(self, rows: np.ndarray, s: np.ndarray, keys: np.ndarray, newfill: int) -> None:
        """Merge candidates ``(rows, s, keys)`` into the top k, keeping ``newfill`` per row.

        Candidates are laid out as a padded ``(nq, filled + most per row)`` matrix next to
        the current top k, and each row is sorted on its own (score desc, key asc): far less
        work than one global sort keyed by row.
        """
        f, nq = self.filled, self.nq
        if len(rows) > 1 and (np.diff(rows) < 0).any():  # several blocks: group by row
            order = np.argsort(rows.astype(np.int16 if nq < 2**15 else np.int64),
                               kind="stable")
            rows, s, keys = rows[order], s[order], keys[order]
        counts = np.bincount(rows, minlength=nq)
        width = f + (int(counts.max()) if len(rows) else 0)
        mat_s = np.full((nq, width), -np.inf, dtype=np.float32)
        mat_k = np.zeros((nq, width), dtype=self.keys.dtype)
        # rank class: 0 a number, 1 NaN (after every number), 2 an empty cell (after all)
        rank = np.full((nq, width), 2, dtype=np.int8)
        mat_s[:, :f] = self.scores[:, :f]
        mat_k[:, :f] = self.keys[:, :f]
        rank[:, :f] = 0
        starts = np.cumsum(counts) - counts
        cols = f + np.arange(len(rows)) - starts[rows]
        mat_s[rows, cols] = s
        mat_k[rows, cols] = keys
        rank[rows, cols] = 0
        neg = -mat_s
        nan = np.isnan(neg)
        if nan.any():
            rank[nan] = 1
            neg[nan] = np.inf
        tie: np.ndarray
        if mat_k.dtype == object:  # lexsort needs numbers: rank bytes keys among candidates
            mat_k[rank == 2] = b""
            tie = np.unique(mat_k, return_inverse=True)[1].reshape(mat_k.shape)
        else:
            tie = mat_k
        order = np.lexsort((tie, rank, neg), axis=-1)[:, :newfill]
        self.scores[:, :newfill] = np.take_along_axis(mat_s, order, axis=1)
        self.keys[:, :newfill] = np.take_along_axis(mat_k, order, axis=1)
        self.filled = newfill


def check_queries(store: Any, queries: Any) -> np.ndarray:
    """``queries`` as a C-contiguous ``(n, dim)`` float32 array of ``store``'s dimension
    (torch and TensorFlow tensors converted); ``InvalidInputError`` otherwise."""
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
        return None, [store.normalize_keys(e) for e in exclude]
    return store.normalize_keys(exclude), None


def _dense(store: Any) -> KeyIndex:
    """The memory store's dense (keys, vectors) copy, kept current as an observer."""
    idx = next((o for o in store.observers if isinstance(o, _DenseVectors)), None)
    if idx is None or idx.stale or idx.backend is not store.backend:
        if idx is not None:
            store.remove_observer(idx)
        idx = _DenseVectors(store.backend, store.key_type, store.dim, len(store.backend))
        for keys, recs in store.backend.scan(65536):
            idx.upsert(keys, {"vector": store.layout.vectors(recs)})
        store.add_observer(idx)
    return idx


class _DenseVectors(KeyIndex):
    """Keys and vectors of a memory store as dense arrays (a ``StoreObserver``)."""

    def __init__(self, backend: Any, key_type: str, dim: int, capacity: int) -> None:
        super().__init__(key_type, {"vector": (np.float32, (dim,))}, capacity)
        self.backend = backend
        self.stale = False

    def on_write(self, keys: np.ndarray, recs: np.ndarray) -> None:
        self.upsert(keys, {"vector": self.backend.layout.vectors(recs)})

    def on_insert(self, keys: np.ndarray, vectors: np.ndarray, template: np.ndarray) -> None:
        self.upsert(keys, {"vector": vectors})

    def on_row_update(self, keys: np.ndarray, update: Any, found: np.ndarray) -> None:
        if update.axpy[0] != "vector":
            return
        k = keys if found.all() else keys[found]
        # read back, not recomputed: the copy must equal the stored bits exactly
        vectors, _ = self.backend.get_field(k, "vector")
        self.upsert(k, {"vector": self.backend.layout.vectors(vectors)})

    def on_delete(self, keys: np.ndarray) -> None:
        self.remove(keys)

    def on_bulk_load(self) -> None:
        self.stale = True

    def stats(self) -> dict[str, Any]:
        return {}


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
        yield keys, backend.layout.vectors(recs)


def _run(q: np.ndarray, k: int, key_dtype: Any, source: Iterable, rows: int,
         exclude: np.ndarray | None) -> TopK:
    acc = TopK(len(q), k, key_dtype)
    buf = np.empty(len(q) * rows, dtype=np.float32)  # one score buffer: no page faults per block
    for keys, vecs in _blocks(source, rows, k):
        if exclude is not None and len(exclude):
            keep = ~np.isin(keys, exclude)
            if not keep.all():
                keys, vecs = keys[keep], vecs[keep]
        scores = buf[:len(q) * len(keys)].reshape(len(q), len(keys))
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN scores are ranked
            np.matmul(q, np.asarray(vecs, dtype=np.float32).T, out=scores)
        acc.add(scores, keys)
    acc.flush()
    return acc


def top_k(store: Any, queries: Any, k: int, exclude: Any = None, *,
          batch_size: int | None = None, dense: bool | None = None,
          among: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]] | None = None,
          ) -> TopKResult:
    """Exact top-``k`` keys of ``store`` by dot product for each query row
    (``store.top_k``; ``dense``: score a dense copy of the vectors, the default for an
    in-process store of one shard; ``among``: rank only the rows it returns, see below).

    Parameters
    ----------
    queries : array-like, shape (n, dim) or (dim,)
    k : int
    exclude : array-like of keys, or a list of n arrays (one per query), optional
        Keys never returned (for all queries, or per query).
    batch_size : int, optional
        Items per block (default: about 8M scores per block).
    among : callable, optional
        ``among(q, m) -> (keys, vectors)``: for the validated queries ``q`` (a chunk of at
        most 8192 rows), distinct rows of the table that hold every query's ``m`` best
        rows (ties at the ``m``-th included; ``m`` counts the excluded keys too). They are
        ranked as the whole table is, so the result equals the whole table's (an index
        that can bound scores, ``embstore.service.ann_scan``).

    Returns
    -------
    keys : np.ndarray, shape (n, min(k, rows))
    scores : np.ndarray of float32, same shape
        Sorted by score descending, ties by key ascending; a NaN score (inf - inf) ranks
        last. Rows that run out of keys after per-query exclusion are padded with key
        ``embstore.retrieval.PAD_KEY`` (``b""`` for bytes keys) and score ``-inf``.
        The result is a :class:`embstore.retrieval.TopKResult`: it unpacks as
        ``(keys, scores)``, and its ``valid`` mask is False at padded places.
    """
    store.check_open()
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k <= 0:
        raise InvalidInputError(f"k must be a positive int, got {k!r}")
    q = check_queries(store, queries)
    nq = len(q)
    glob, per = _exclusions(store, exclude, nq)
    k_eff = int(k) + (max((len(e) for e in per), default=0) if per else 0)
    key_dtype = np.int64 if store.key_type == "int64" else object
    rows = max(1024, _SCORE_BUDGET // max(min(nq, _MAX_QUERIES), 1))
    if batch_size is not None:
        if batch_size <= 0:
            raise InvalidInputError(f"batch_size must be positive, got {batch_size}")
        rows = int(batch_size)
    backend = store.backend
    if not backend.supports_scan:
        raise CapabilityError(f"{backend.url}: top_k needs a backend that can scan its rows "
                              "(supports_scan)")
    shards = backend.partitions()
    if dense is None:
        dense = not backend.persistent and len(shards) == 1
    parts = []
    # Very large query batches go in chunks so a block of scores stays bounded (streaming
    # backends are then scanned once per chunk).
    for qc in [q] if nq <= _MAX_QUERIES else np.array_split(q, -(-nq // _MAX_QUERIES)):
        if len(qc) == 0:
            acc = TopK(0, k_eff, key_dtype)
        elif among is not None:
            few = among(qc, k_eff + (0 if glob is None else len(glob)))
            # one block, and a score buffer of its size (not 32 MB mapped per call)
            acc = _run(qc, k_eff, key_dtype, [few], max(1, min(rows, len(few[0]))), glob)
        elif dense:
            idx = _dense(store)
            acc = _run(qc, k_eff, key_dtype, [(idx.live_keys, idx.col("vector"))], rows, glob)
        elif len(shards) > 1:
            # Per-shard top-k (what each shard server would compute), merged by the caller.
            acc = TopK(len(qc), k_eff, key_dtype)
            for shard in shards:
                acc.merge(_run(qc, k_eff, key_dtype, _scan_vectors(shard, min(rows, 65536)),
                               rows, glob))
        else:
            acc = _run(qc, k_eff, key_dtype, _scan_vectors(backend, min(rows, 65536)), rows,
                       glob)
        parts.append(acc)
    fill = min(a.filled for a in parts)  # every chunk saw the same items
    keys = np.concatenate([a.keys[:, :fill] for a in parts])
    scores = np.concatenate([a.scores[:, :fill] for a in parts])
    if per is None:
        return TopKResult(keys.copy(), scores.copy(), np.ones(keys.shape, dtype=bool))
    return _drop_per_query(keys, scores, per, int(k))


def _drop_per_query(keys: np.ndarray, scores: np.ndarray, per: list[np.ndarray],
                    k: int) -> TopKResult:
    # A loop over queries (not keys): each row drops its own excluded keys, then pads.
    width = min(k, keys.shape[1])
    out_k = np.full((len(keys), width), _pad_key(keys.dtype), dtype=keys.dtype)
    out_s = np.full((len(keys), width), -np.inf, dtype=np.float32)
    valid = np.zeros((len(keys), width), dtype=bool)
    for i, ex in enumerate(per):
        keep = ~np.isin(keys[i], ex) if len(ex) else np.ones(keys.shape[1], dtype=bool)
        kk, ss = keys[i][keep][:width], scores[i][keep][:width]
        out_k[i, :len(kk)] = kk
        out_s[i, :len(ss)] = ss
        valid[i, :len(kk)] = True
    return TopKResult(out_k, out_s, valid)
