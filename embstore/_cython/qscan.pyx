# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The int8 scan behind ``embstore.service.ann_scan`` (es_qscan.h): rows quantized to int8
with a per-row scale, and per query the rows whose score bound can reach its top k, found
in one native pass."""

from libc.stdint cimport int8_t, int64_t
from libc.stdlib cimport free, malloc


cdef extern from "es_qscan.h" nogil:
    ctypedef struct es_query_t:
        float sq, qp, qe, qn
    void es_quantize_rows(const float* x, Py_ssize_t n, Py_ssize_t d, int8_t* codes,
                          float* scale, float* resid, float* norm)
    void es_quantize_query(const float* q, Py_ssize_t d, int8_t* cq, es_query_t* out)
    Py_ssize_t es_qscan(const int8_t* codes, const float* scale, const float* resid,
                        const float* norm, Py_ssize_t n, Py_ssize_t d, const int8_t* cq,
                        const es_query_t* qs, float kappa, Py_ssize_t K, float* heap,
                        int64_t* cand, float* ub)
    int es_qs_wide()


def kernel() -> str:
    """The scan's build in use: ``"avx2"`` or ``"base"``."""
    return "avx2" if es_qs_wide() else "base"


def quantize_rows(const float[:, ::1] x, int8_t[:, ::1] codes, float[::1] scale,
                  float[::1] resid, float[::1] norm):
    """Quantize the rows of ``x`` into ``codes`` (int8), ``scale``, ``resid`` (the residual
    norm) and ``norm``, the norms rounded up."""
    cdef Py_ssize_t n = x.shape[0], d = x.shape[1]
    if (codes.shape[0] != n or codes.shape[1] != d or scale.shape[0] != n
            or resid.shape[0] != n or norm.shape[0] != n):
        raise ValueError("quantize_rows: shapes do not match")
    if n == 0 or d == 0:
        return
    with nogil:
        es_quantize_rows(&x[0, 0], n, d, &codes[0, 0], &scale[0], &resid[0], &norm[0])


def query_terms(const float[::1] q, int8_t[::1] cq):
    """Quantize one query into ``cq``; return ``(sq, ||q'||, ||q - q'||, ||q||)``."""
    cdef es_query_t qs
    if cq.shape[0] != q.shape[0] or q.shape[0] == 0:
        raise ValueError("query_terms: shapes do not match")
    es_quantize_query(&q[0], q.shape[0], &cq[0], &qs)
    return qs.sq, qs.qp, qs.qe, qs.qn


def scan(const int8_t[:, ::1] codes, const float[::1] scale, const float[::1] resid,
         const float[::1] norm, const float[::1] q, Py_ssize_t k, float kappa,
         int64_t[::1] cand, float[::1] ub):
    """Positions of the rows of ``codes`` that can be among ``q``'s ``k`` best by score
    (written to the front of ``cand``; ``ub`` is scratch; both hold ``len(codes)``);
    returns how many."""
    cdef Py_ssize_t n = codes.shape[0], d = codes.shape[1], got
    cdef es_query_t qs
    cdef int8_t* cq
    cdef float* heap
    if (scale.shape[0] < n or resid.shape[0] < n or norm.shape[0] < n or q.shape[0] != d
            or cand.shape[0] < n or ub.shape[0] < n):
        raise ValueError("scan: shapes do not match")
    if n == 0 or k <= 0:
        return 0
    if d == 0:
        raise ValueError("scan: zero-width rows")
    cq = <int8_t*> malloc(d)
    heap = <float*> malloc(min(k, n) * sizeof(float))
    if cq == NULL or heap == NULL:
        free(cq)
        free(heap)
        raise MemoryError()
    with nogil:
        es_quantize_query(&q[0], d, cq, &qs)
        got = es_qscan(&codes[0, 0], &scale[0], &resid[0], &norm[0], n, d, cq, &qs, kappa,
                       min(k, n), heap, &cand[0], &ub[0])
    free(cq)
    free(heap)
    return got
