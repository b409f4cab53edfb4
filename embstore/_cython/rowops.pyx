# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Row kernels for the optimizers: one fused pass over a record field.

A record field such as ``records["vector"]`` is a strided view (one row per record, rows a
record apart); numpy's ``v -= lr * g`` makes a temporary and then walks the view again, which
measured ~33 us for 1,357 rows of 64 floats against ~8 us for this single pass.
"""

from libc.stdint cimport uint32_t


def axpy_rows(float[:, :] y, const float[:, ::1] x, float a):
    """``y += a * x`` in place; ``y`` may be a strided field view (contiguous within a row)."""
    cdef Py_ssize_t n = y.shape[0], d = y.shape[1], i, j
    cdef float* yr
    cdef const float* xr
    if y.strides[1] != sizeof(float) or x.shape[0] != n or x.shape[1] != d:
        raise ValueError("axpy_rows: target rows must be contiguous and shapes must match")
    with nogil:
        for i in range(n):
            yr = &y[i, 0]
            xr = &x[i, 0]
            for j in range(d):
                yr[j] = yr[j] + a * xr[j]


def all_finite(const float[:, :] x):
    """True when no value of ``x`` (rows contiguous, e.g. a record field) is NaN or inf.

    Tests the exponent bits, an integer test the compiler vectorizes: one pass with no
    temporary, where ``np.isfinite(x).all()`` writes a bool array and reads it again.
    """
    cdef Py_ssize_t n = x.shape[0], d = x.shape[1], i, j
    cdef const uint32_t* r
    cdef uint32_t bad = 0
    if n and d and x.strides[1] != sizeof(float):
        raise ValueError("all_finite: the rows must be contiguous")
    with nogil:
        for i in range(n):
            r = <const uint32_t*> &x[i, 0]
            for j in range(d):
                bad |= (r[j] & 0x7F800000u) == 0x7F800000u
            if bad:
                break
    return not bad


cdef extern from "es_rowsq.h":
    float es_sumsq(const float* x, Py_ssize_t d) noexcept nogil
    double es_sumsq64(const float* x, Py_ssize_t d) noexcept nogil


def row_mean_squares(const float[:, ::1] x, float[::1] out):
    """Each row's mean square into ``out``: ``es_sumsq`` (one fixed order of additions on
    every machine, the one the fused step uses) divided by the width, in float32."""
    cdef Py_ssize_t n = x.shape[0], d = x.shape[1], i
    cdef float fd = <float> d
    if out.shape[0] < n:
        raise ValueError("row_mean_squares: out is shorter than the rows")
    with nogil:
        for i in range(n):
            out[i] = es_sumsq(&x[i, 0], d) / fd if d else <float> 0.0 / fd


def row_sums_of_squares(const float[:, ::1] x, double[::1] out):
    """Each row's sum of squares in float64 into ``out``: ``es_sumsq64`` (the order of
    ``es_sumsq`` in float64), the one FTRL's group lasso and the fused step use."""
    cdef Py_ssize_t n = x.shape[0], d = x.shape[1], i
    if out.shape[0] < n:
        raise ValueError("row_sums_of_squares: out is shorter than the rows")
    with nogil:
        for i in range(n):
            out[i] = es_sumsq64(&x[i, 0], d) if d else 0.0
