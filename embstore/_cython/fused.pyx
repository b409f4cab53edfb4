# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The fused per-table kernels of a pooled embedding step over the record arena.

One forward: :func:`dedupe` (distinct keys in first-seen order, the inverse index and the
occurrences, one hash pass) and :func:`pool` (each bag summed straight from the records'
vector fields into the pooled output: no ``(distinct, dim)`` copy in between). One backward:
:func:`grad_sums` (the pooled gradients summed per distinct key) feeding the arena's in-place
optimizer kernels.

The arithmetic is the one of today's torch path, operation by operation, so both give the
same bits: bag sums add rows in element order starting from zero; ``mean`` divides the sum by
the bag's length; weighted sums use one fused multiply-add per element (as torch's
``embedding_bag`` kernel does); per-key gradient sums add in element order. The extension is
built with ``-ffp-contract=off``, so nothing else is contracted.

This module imports nothing from embstore; callers pass clean, contiguous arrays.
"""

from libc.stdint cimport int64_t, uint64_t, uint32_t, uint8_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset
from libc.math cimport fmaf

from .arena cimport RecordArena

cdef extern from "es_prefetch.h":
    void ES_PREFETCH(const void* p) nogil

cdef inline uint64_t _mix(uint64_t x) noexcept nogil:
    # splitmix64's finalizer: ids that differ in high bits only still spread
    x ^= x >> 30
    x *= <uint64_t> 0xbf58476d1ce4e5b9
    x ^= x >> 27
    x *= <uint64_t> 0x94d049bb133111eb
    x ^= x >> 31
    return x


def dedupe(const int64_t[::1] keys, int64_t[::1] uniq, int64_t[::1] inv,
           int64_t[::1] counts):
    """Distinct ``keys`` into ``uniq`` (first-seen order), each key's row of ``uniq`` into
    ``inv`` and each distinct key's occurrences into ``counts``; returns how many are
    distinct. Output arrays need ``len(keys)`` rows."""
    cdef Py_ssize_t n = keys.shape[0], i, nu = 0
    cdef uint64_t cap = 16, mask, h
    cdef int64_t k, u
    cdef int64_t* table
    if uniq.shape[0] < n or inv.shape[0] < n or counts.shape[0] < n:
        raise ValueError("dedupe: output arrays are shorter than the keys")
    while cap < <uint64_t> (2 * n):
        cap <<= 1
    mask = cap - 1
    table = <int64_t*> malloc(cap * sizeof(int64_t))
    if table == NULL:
        raise MemoryError("dedupe: no memory for the hash table")
    with nogil:
        memset(table, 0xFF, cap * sizeof(int64_t))   # -1: empty
        for i in range(n):
            k = keys[i]
            h = _mix(<uint64_t> k) & mask
            while True:
                u = table[h]
                if u < 0:
                    table[h] = nu
                    uniq[nu] = k
                    counts[nu] = 1
                    inv[i] = nu
                    nu += 1
                    break
                if uniq[u] == k:
                    counts[u] += 1
                    inv[i] = u
                    break
                h = (h + 1) & mask
    free(table)
    return nu


cdef int _check_bags(const int64_t[::1] inv, const int64_t[::1] offsets,
                     const float[::1] weights, Py_ssize_t n_bags, Py_ssize_t n_rows,
                     str what) except -1:
    cdef Py_ssize_t b, e
    if offsets.shape[0] != n_bags + 1 or offsets[0] != 0 or offsets[n_bags] > inv.shape[0]:
        raise ValueError(f"{what}: offsets must be n_bags + 1 bounds within the input")
    for b in range(n_bags):
        if offsets[b + 1] < offsets[b]:
            raise ValueError(f"{what}: offsets must not decrease")
    if weights.shape[0] and weights.shape[0] < offsets[n_bags]:
        raise ValueError(f"{what}: fewer weights than elements")
    for e in range(offsets[n_bags]):
        if inv[e] < 0 or inv[e] >= n_rows:
            raise ValueError(f"{what}: an element's row is out of range")
    return 0


def pool(RecordArena arena, const uint32_t[::1] slots, const int64_t[::1] inv,
         const int64_t[::1] offsets, const float[::1] weights, Py_ssize_t vec_offset,
         bint mean, float[:, ::1] out):
    """Bag ``b`` of ``out``: the float32 vectors (at ``vec_offset`` in each record) of the
    records ``slots[inv[e]]`` for ``e`` in ``offsets[b]:offsets[b+1]``, summed in element
    order (``weights[e]`` times each when ``weights`` is not empty), divided by the bag's
    length with ``mean``; an empty bag gives zeros."""
    cdef Py_ssize_t n_bags = out.shape[0], d = out.shape[1], b, e, k, end, ln
    cdef Py_ssize_t nu = slots.shape[0], u
    cdef float* o
    cdef const float* r
    cdef float w, fl
    cdef bint weighted = weights.shape[0] != 0
    cdef const float** rows
    cdef uint32_t s
    if vec_offset < 0 or vec_offset + d * 4 > arena.itemsize:
        raise ValueError("pool: the vector field does not fit the record")
    _check_bags(inv, offsets, weights, n_bags, nu, "pool")
    arena._check_slots(slots, "pool")
    end = offsets[n_bags]
    rows = <const float**> malloc((nu if nu else 1) * sizeof(float*))
    if rows == NULL:
        raise MemoryError("pool: no memory")
    with nogil:
        # Each distinct key's vector address once (the arena's row arithmetic, inlined), its
        # first line requested ahead: the bag loop below then reads rows already on their way.
        for u in range(nu):
            s = slots[u]
            rows[u] = <const float*> (arena.chunks[s >> arena.shift]
                                      + (s & arena.low_mask) * arena.itemsize + vec_offset)
            ES_PREFETCH(rows[u])
            ES_PREFETCH(<const char*> rows[u] + d * 4 - 1)
        for b in range(n_bags):
            o = &out[b, 0]
            memset(o, 0, d * sizeof(float))
            for e in range(offsets[b], offsets[b + 1]):
                r = rows[inv[e]]
                if weighted:
                    w = weights[e]
                    for k in range(d):
                        o[k] = fmaf(w, r[k], o[k])
                else:
                    for k in range(d):
                        o[k] = o[k] + r[k]
            ln = offsets[b + 1] - offsets[b]
            if mean and ln > 0:
                fl = <float> ln
                for k in range(d):
                    o[k] = o[k] / fl
    free(rows)


def grad_sums(const int64_t[::1] inv, const int64_t[::1] offsets, const float[::1] weights,
              bint mean, const float[:, :] grad, float[:, ::1] sums):
    """Row ``u`` of ``sums``: the gradient of every element ``e`` with ``inv[e] == u``,
    added in element order; an element's gradient is its bag's row of ``grad``, divided by
    the bag's length with ``mean``, times ``weights[e]`` when weights are given. ``grad``
    may be a strided view of a wider array (a slice of a concatenated output's gradient),
    its rows contiguous."""
    cdef Py_ssize_t n_bags = grad.shape[0], d = grad.shape[1], b, e, k, ln
    cdef float* s
    cdef const float* g
    cdef float w, fl
    cdef float* scaled
    cdef bint weighted = weights.shape[0] != 0
    if sums.shape[1] != d or (d > 1 and grad.strides[1] != sizeof(float)):
        raise ValueError("grad_sums: the sums must have the gradient's width, and gradient "
                         "rows must be contiguous")
    _check_bags(inv, offsets, weights, n_bags, sums.shape[0], "grad_sums")
    scaled = <float*> malloc((d if d else 1) * sizeof(float))
    if scaled == NULL:
        raise MemoryError("grad_sums: no memory")
    with nogil:
        for e in range(sums.shape[0]):
            memset(&sums[e, 0], 0, d * sizeof(float))
        for b in range(n_bags):
            ln = offsets[b + 1] - offsets[b]
            if ln == 0:
                continue
            g = &grad[b, 0]
            if mean:  # torch divides the gradient by the length first, then sums
                fl = <float> ln
                for k in range(d):
                    scaled[k] = g[k] / fl
                g = scaled
            for e in range(offsets[b], offsets[b + 1]):
                s = &sums[inv[e], 0]
                if weighted:
                    w = weights[e]
                    for k in range(d):
                        s[k] = fmaf(w, g[k], s[k])
                else:
                    for k in range(d):
                        s[k] = s[k] + g[k]
    free(scaled)
