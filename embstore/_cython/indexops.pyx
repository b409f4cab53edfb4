# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Index kernels of a training step: the sampler's draws (an alias table and one O(1) draw
per uniform, with each draw's weight), a batch's grouping by its inverse index, and jagged
bags' bounds from their lengths.

Each replaces a few numpy calls that each made a temporary and walked it again (a
49k-element batch's stable ``argsort`` + ``bincount`` + ``cumsum`` ~0.18 ms) with one pass.
The results are the numpy calls' own, bit for bit: the same indices and counts, and a draw's
position and weight those of the same table read with numpy (``tests/numpy_draw.py``).
"""

from libc.stdint cimport int64_t
from libc.math cimport INFINITY
from libc.stdlib cimport free, malloc


def alias_table(const double[::1] cdf, object prob_arr, object alias_arr):
    """Walker's alias table (Vose's construction) of the weights ``cdf[p] - cdf[p - 1]``
    (``cdf[0]`` at 0): ``prob[p]`` in ``[0, 1]`` and ``alias[p]`` such that drawing ``p``
    uniformly, then keeping it with probability ``prob[p]`` and taking ``alias[p]``
    otherwise, draws each position with probability ``weight / cdf[-1]``. The shares are
    carried in extended precision while columns are filled, so the table's probabilities
    stay within 1e-9 of the weights' (relative; tested at 100k keys of Zipf weights). A
    position of weight 0 has ``prob`` 0 and is nobody's alias: it is never drawn."""
    cdef Py_ssize_t n = cdf.shape[0], i, ns = 0, nl = 0, s, l, heavy = 0
    cdef double[::1] prob = prob_arr
    cdef int64_t[::1] alias = alias_arr
    cdef double total
    cdef long double* share
    cdef int64_t* small         # positions below one column, a stack from the front of...
    cdef int64_t* large         # ...the same block as those of one or more, from its back
    if n == 0 or prob.shape[0] != n or alias.shape[0] != n:
        raise ValueError("alias_table: needs a non-empty cdf and out arrays of its length")
    total = cdf[n - 1]
    if not (total > 0 and total < INFINITY):
        raise ValueError("alias_table: the weights must have a positive finite sum")
    share = <long double*> malloc(n * sizeof(long double))
    small = <int64_t*> malloc(n * sizeof(int64_t))
    if share == NULL or small == NULL:
        free(share)
        free(small)
        raise MemoryError("alias_table: no memory")
    large = small + n - 1           # large[-k]: a position is on one stack at a time
    with nogil:
        for i in range(n):
            # this position's share, in columns of 1/n
            share[i] = <long double> (cdf[i] - cdf[i - 1] if i > 0 else cdf[i] - 0.0) \
                * n / total
            alias[i] = i
            if share[i] > 0.0:
                heavy = i               # (any position that can be drawn: see the end)
            if share[i] < 1.0:
                small[ns] = i
                ns += 1
            else:
                large[-nl] = i
                nl += 1
        while ns > 0 and nl > 0:
            ns -= 1
            s = small[ns]
            l = large[-(nl - 1)]
            prob[s] = <double> share[s]  # s's column: s below prob[s], l above it
            alias[s] = l
            share[l] = (share[l] + share[s]) - 1.0
            if share[l] < 1.0:
                nl -= 1
                small[ns] = l
                ns += 1
        # what is left holds a full column each (1 up to rounding)
        for i in range(nl):
            prob[large[-i]] = 1.0
        for i in range(ns):
            s = small[i]
            if share[s] > 0.0:
                prob[s] = 1.0
            else:
                prob[s] = 0.0
                alias[s] = heavy
    free(share)
    free(small)
    return prob_arr, alias_arr


def draw_alias(const double[::1] cdf, const double[::1] prob, const int64_t[::1] alias,
               const double[::1] u, object pos_arr, object weight_arr):
    """One draw per uniform ``u[i]`` in ``[0, 1)`` from an :func:`alias_table`: column
    ``j = floor(u[i] * n)``, kept where the fraction ``u[i] * n - j`` is below
    ``prob[j]``, else ``alias[j]``; and its weight ``cdf[p] - cdf[p - 1]`` (``cdf[p]`` at 0),
    as :meth:`Snapshot.weight_at` gives it. O(1) a draw with no data-dependent branch: two
    reads of the table and two of the cdf."""
    cdef Py_ssize_t n = cdf.shape[0], k = u.shape[0], i, j
    cdef int64_t p
    cdef double t
    cdef bint bad = False
    cdef int64_t[::1] pos = pos_arr
    cdef double[::1] weight = weight_arr
    if pos.shape[0] < k or weight.shape[0] < k:
        raise ValueError("draw_alias: out arrays are shorter than the draws")
    if n == 0 or prob.shape[0] != n or alias.shape[0] != n:
        raise ValueError("draw_alias: needs a non-empty cdf and its alias table")
    with nogil:
        for i in range(k):
            t = u[i] * n
            j = <Py_ssize_t> t
            if j < 0 or j >= n:
                j = 0 if j < 0 else n - 1
            p = j if t - j < prob[j] else alias[j]
            if p < 0 or p >= n:
                bad = True
                break
            pos[i] = p
            weight[i] = cdf[p] - cdf[p - 1] if p > 0 else cdf[p] - 0.0
    if bad:
        raise IndexError("draw_alias: an alias entry is out of range")
    return pos_arr, weight_arr


def group_by_inverse(const int64_t[::1] inv, Py_ssize_t n_keys, int64_t[::1] order,
                     int64_t[::1] starts, int64_t[::1] counts):
    """A counting sort of an inverse index whose values lie in ``0..n_keys-1``: ``counts``
    (each value's occurrences), ``starts`` (where each value's run begins) and ``order`` (the
    positions, grouped by value, ascending within each group): what
    ``np.argsort(inv, kind="stable")``, ``np.bincount`` and their ``cumsum`` give."""
    cdef Py_ssize_t n = inv.shape[0], i
    cdef int64_t v, total = 0
    cdef bint bad = False
    if order.shape[0] < n or starts.shape[0] < n_keys or counts.shape[0] < n_keys:
        raise ValueError("group_by_inverse: out arrays are too short")
    with nogil:
        for i in range(n_keys):
            counts[i] = 0
        for i in range(n):
            v = inv[i]
            if v < 0 or v >= n_keys:
                bad = True
                break
            counts[v] += 1
    if bad:
        raise IndexError(f"group_by_inverse: a value outside 0..{n_keys - 1}")
    with nogil:
        for i in range(n_keys):
            starts[i] = total
            total += counts[i]
        # starts doubles as each group's fill cursor, then is put back
        for i in range(n):
            v = inv[i]
            order[starts[v]] = i
            starts[v] += 1
        for i in range(n_keys):
            starts[i] -= counts[i]


def bag_bounds(const int64_t[::1] lengths, int64_t[::1] out):
    """``out[0] = 0`` and ``out[i + 1] = out[i] + lengths[i]`` (``len(lengths) + 1``
    entries: ``np.cumsum``'s sums) in one pass that also looks for a negative length; returns
    False where there is one (``out`` then partly written). A batch's lengths come cold from
    the caches, and numpy's ``cumsum`` and a separate ``min`` read them twice."""
    cdef Py_ssize_t i, n = lengths.shape[0]
    cdef int64_t total = 0, bad = 0, x
    if out.shape[0] != n + 1:
        raise ValueError("bag_bounds: out needs len(lengths) + 1 entries")
    with nogil:
        out[0] = 0
        for i in range(n):
            x = lengths[i]
            bad |= x
            total += x
            out[i + 1] = total
    return bad >= 0
