"""Exact top-k by an int8 quantized scan with provable bounds (``--ann-index scan``).

Every row is kept as int8 codes with one scale per row (``r = max|x| / 127``), plus two
norms rounded up: the residual's ``R = ||x - r c||`` and the row's ``N = ||x||``. A query
is quantized the same way (``q' = s c_q``, ``e_q = q - q'``); then for every row the integer
product ``S = c_q . c`` gives ``a = s r S`` and, since ``q.x = q'.x' + q'.e_x + e_q.x``,

    |q.x - a| <= ||q'|| R + ||e_q|| N

(plus a small relative slack for the float32 arithmetic of the exact scorer, proven in
``es_qscan_body.h``). ``L``, the k-th largest lower bound, is a score k rows reach, so only
the rows whose upper bound reaches ``L`` can be among the k best: one native pass over the
codes (12.8 MB at 200k x 64, cache-resident) computes the bounds, keeps the running k-th
lower bound and collects those candidates, a few dozen rows on i.i.d. data. The
candidates' current vectors are then ranked by :func:`embstore.retrieval.top_k` itself
(its ``among`` argument), so the answer is the exact top-k's, ties, NaN and exclusions
included; no recall is lost.

The codes stay current without rebuilds: the index observes the store as
:class:`~embstore.service.ann.AnnIndex` does and re-quantizes only the rows written (from
the records the engine hands over), drops deleted rows, and reads back the rows an
optimizer updated in place at the next query (under the guard). A bulk load re-reads the
table at the next query.
"""

from __future__ import annotations

import logging
import threading
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from .._cython import qscan
from ..errors import InvalidInputError
from ..retrieval import TopKResult
from ..retrieval import top_k as _exact_top_k
from ..sampling.keyindex import KeyIndex
from .ann import AnnIndex

log = logging.getLogger(__name__)

#: ``--ann-index auto`` picks the scan up to this many rows (at start), HNSW beyond: the
#: scan's cost grows with the rows (0.36 ms a query at 200k x 64 here, 1.2 ms at 400k where
#: the codes outgrow the cache, 3.0 ms at 1M), the HNSW search's barely; the two crossed at
#: about 600k rows (docs/service.md).
AUTO_SCAN_ROWS = 400_000
_MAX_DIM = 65536    # int32 sums of 127 * 127 * d stay exact
_PROGRESS_ROWS = 1 << 20


def _quantized(vectors: np.ndarray) -> dict[str, np.ndarray]:
    """The columns of ``vectors``' rows (float32, widened as stored)."""
    x = np.ascontiguousarray(vectors, np.float32)
    n, d = x.shape
    code = np.empty((n, d), np.int8)
    scale, resid, norm = (np.empty(n, np.float32) for _ in range(3))
    qscan.quantize_rows(x, code, scale, resid, norm)
    return {"code": code, "scale": scale, "resid": resid, "norm": norm}


class ScanIndex:
    """Exact top-k over ``store`` by a quantized scan (an observer of ``store``).

    :class:`~embstore.service.ann.AnnIndex`'s interface: ``top_k``, ``stats`` and the
    observer calls; its answers equal ``store.top_k``'s.

    Parameters
    ----------
    store : EmbeddingStore
    guard : context manager
        Held by the callers of :meth:`top_k` and :meth:`build` (the serving worker's lock):
        the index reads rows of the store while no write runs.
    """

    kind = "scan"

    def __init__(self, store: Any, guard: AbstractContextManager[Any]) -> None:
        if not 0 < store.dim <= _MAX_DIM:
            raise InvalidInputError(f"the scan index takes dim 1..{_MAX_DIM}, "
                                    f"got {store.dim}")
        self.store, self.guard = store, guard
        # the slack of es_qscan_body.h: gamma_d of the exact scorer plus 16 roundings
        self._kappa = float((store.dim + 16) * 2.0 ** -24)
        self._lock = threading.Lock()
        self._rows: KeyIndex | None = None        # None: (re)read at the next query
        self._pending: list[np.ndarray] = []      # keys updated in place since the last query
        self._cand = np.empty(0, np.int64)
        self._ub = np.empty(0, np.float32)
        self.builds = 0
        self.queries = 0
        self.candidates = 0
        store.add_observer(self)

    # -- StoreObserver ------------------------------------------------------------------------
    def _put(self, rows: KeyIndex, keys: np.ndarray, vectors: np.ndarray) -> None:
        if len(keys):
            rows.upsert(keys, _quantized(vectors))

    def on_write(self, keys: np.ndarray, records: np.ndarray) -> None:
        with self._lock:
            if self._rows is not None:
                self._put(self._rows, keys, self.store.layout.vectors(records))

    def on_insert(self, keys: np.ndarray, vectors: np.ndarray, template: np.ndarray) -> None:
        with self._lock:
            if self._rows is not None:
                self._put(self._rows, keys, vectors)

    def on_row_update(self, keys: np.ndarray, update: Any, found: np.ndarray) -> None:
        if update.axpy[0] != "vector":
            return
        with self._lock:
            if self._rows is not None:   # read back at the next query, under the guard
                self._pending.append(keys[found].copy())

    def on_delete(self, keys: np.ndarray) -> None:
        with self._lock:
            if self._rows is not None:
                self._rows.remove(keys)

    def on_bulk_load(self) -> None:
        with self._lock:
            self._rows, self._pending = None, []

    def stats(self) -> dict[str, Any]:
        rows = self._rows
        return {"ann_kind": self.kind, "ann_builds": self.builds,
                "ann_indexed": len(rows) if rows is not None else 0,
                # totals (summed over workers by des://): candidates / queries is the mean
                "ann_queries": self.queries, "ann_candidates": self.candidates}

    # -- building and catching up -------------------------------------------------------------
    def build(self) -> None:
        """Quantize the whole table now (the caller holds the guard); logs progress every
        ~1M rows."""
        s = self.store
        rows = KeyIndex(s.key_type, {"code": (np.int8, (s.dim,)), "scale": (np.float32, ()),
                                     "resid": (np.float32, ()), "norm": (np.float32, ())},
                        max(len(s), 16))
        total, told = len(s), 0
        for keys, recs in s.records(65536):
            self._put(rows, keys, s.layout.vectors(recs))
            if rows.n - told >= _PROGRESS_ROWS:
                told = rows.n
                log.info("scan index: %d of %d rows quantized", rows.n, total)
        with self._lock:
            self._rows, self._pending = rows, []
            self.builds += 1

    def _current(self) -> KeyIndex:
        """The rows, built or caught up with the in-place updates (the guard is held)."""
        if self._rows is None:
            self.build()
        with self._lock:
            rows, pending, self._pending = self._rows, self._pending, []
        assert rows is not None
        if pending:
            keys = np.unique(np.concatenate(pending))
            recs, found = self.store.get_records(keys)
            with self._lock:
                rows.remove(keys[~found])
                self._put(rows, keys[found], self.store.layout.vectors(recs[found]))
        return rows

    # -- querying ------------------------------------------------------------------------------
    def _candidates(self, rows: KeyIndex, q: np.ndarray, m: int
                    ) -> tuple[np.ndarray, np.ndarray]:
        """The distinct rows that can be among any query's ``m`` best, with their current
        vectors (``retrieval.top_k``'s ``among``)."""
        n = rows.n
        if len(self._cand) < n:
            self._cand = np.empty(max(n, 2 * len(self._cand)), np.int64)
            self._ub = np.empty(len(self._cand), np.float32)
        code, scale = rows.col("code"), rows.col("scale")
        resid, norm = rows.col("resid"), rows.col("norm")
        parts = []
        for row in q:
            got = qscan.scan(code, scale, resid, norm, row, m, self._kappa, self._cand,
                             self._ub)
            parts.append(self._cand[:got].copy())
            self.candidates += got
        self.queries += len(q)
        pos = np.unique(np.concatenate(parts)) if len(parts) > 1 else np.sort(parts[0])
        keys = rows.keys[pos]
        recs, found = self.store.get_records(keys)
        if not found.all():     # cannot happen while observed: rank only what exists
            keys, recs = keys[found], recs[found]
        return keys, self.store.layout.vectors(recs)

    def top_k(self, queries: Any, k: int, exclude: Any = None) -> TopKResult:
        """Exact top-``k`` of each query row (the caller holds the guard), as
        ``store.top_k(queries, k, exclude)`` answers, errors included."""
        self.store.check_open()
        rows = self._current()
        return _exact_top_k(self.store, queries, k, exclude,
                            among=lambda q, m: self._candidates(rows, q, m))


def ann_index(kind: str, store: Any, guard: AbstractContextManager[Any], **hnsw: Any) -> Any:
    """The top-k index of ``--ann-index``: ``"scan"`` (:class:`ScanIndex`), ``"hnsw"``
    (:class:`~embstore.service.ann.AnnIndex`, options ``hnsw``) or ``"auto"``: the scan up
    to :data:`AUTO_SCAN_ROWS` rows at start, HNSW beyond."""
    if kind not in ("auto", "scan", "hnsw"):
        raise InvalidInputError(f"--ann-index must be auto, scan or hnsw, got {kind!r}")
    if kind == "auto":
        kind = "scan" if len(store) <= AUTO_SCAN_ROWS else "hnsw"
    if kind == "scan":
        return ScanIndex(store, guard)
    return AnnIndex(store, guard, **hnsw)
