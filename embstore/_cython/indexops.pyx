# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Index kernels of a training step: the sampler's inverse-cdf search and draw weights, a
batch's grouping by its inverse index, and jagged bags' bounds from their lengths.

Each replaces a few numpy calls that each made a temporary and walked it again (a draw of
40k negatives from an 8k-key cdf: ``searchsorted`` ~0.32 ms, the weights' gathers and
``where`` ~0.28 ms; a 49k-element batch's stable ``argsort`` + ``bincount`` + ``cumsum``
~0.18 ms) with one pass each. The results are the numpy calls' own, bit for bit: the same
indices, and the weights the same float64 subtractions.
"""

from libc.stdint cimport int64_t


cdef inline bint _le(double a, double x) noexcept nogil:
    """``a <= x`` in numpy's sort order, where NaN sorts after every number."""
    return x != x or a <= x


def search_sorted_right(const double[::1] cdf, const double[::1] u, object out_arr):
    """``out[i] = np.searchsorted(cdf, u[i], side="right")`` (``cdf`` non-decreasing): the
    number of entries ``<= u[i]``. Runs of ascending ``u`` (sorted probes) gallop forward
    from the previous answer, so a sorted batch costs O(m log(n/m)) with its memory read in
    order; a probe below its predecessor searches the whole cdf again. NaN compares as numpy
    sorts it, after every number."""
    cdef Py_ssize_t n = cdf.shape[0], m = u.shape[0], i, lo = 0, hi, step
    cdef Py_ssize_t mid
    cdef double x, prev = 0.0
    cdef int64_t[::1] out = out_arr
    if out.shape[0] < m:
        raise ValueError("search_sorted_right: out is shorter than the probes")
    with nogil:
        for i in range(m):
            x = u[i]
            if i == 0 or not _le(prev, x):
                lo = 0      # not ascending from the last probe: a full search
            prev = x
            # lo: every entry before it is <= x; gallop to a bound hi with cdf[hi] > x
            step = 1
            hi = lo
            while hi < n and _le(cdf[hi], x):
                lo = hi + 1
                hi = lo + step
                step *= 2
            if hi > n:
                hi = n
            # the first entry > x lies in [lo, hi] (hi == n: none)
            while lo < hi:
                mid = lo + ((hi - lo) >> 1)
                if _le(cdf[mid], x):
                    lo = mid + 1
                else:
                    hi = mid
            out[i] = lo
    return out_arr


def draw_weights(const double[::1] cdf, const int64_t[::1] sorted_pos,
                 const int64_t[::1] perm, int64_t last, object pos_arr, object weight_arr):
    """The draws in ``perm`` order: ``pos[i] = min(sorted_pos[perm[i]], last)`` and
    ``weight[i] = cdf[pos[i]] - cdf[pos[i] - 1]`` (``cdf[pos[i]]`` where ``pos[i]`` is 0),
    as ``pos = sorted_pos[perm]; np.minimum(pos, last, out=pos)`` and the numpy weights of
    ``Snapshot.weight_at`` give them."""
    cdef Py_ssize_t m = perm.shape[0], n = cdf.shape[0], k = sorted_pos.shape[0], i
    cdef int64_t p, q
    cdef bint bad = False
    cdef int64_t[::1] pos = pos_arr
    cdef double[::1] weight = weight_arr
    if pos.shape[0] < m or weight.shape[0] < m:
        raise ValueError("draw_weights: out arrays are shorter than the draws")
    with nogil:
        for i in range(m):
            q = perm[i]
            if q < 0 or q >= k:
                bad = True
                break
            p = min(sorted_pos[q], last)
            if p < 0 or p >= n:
                bad = True
                break
            pos[i] = p
            weight[i] = cdf[p] - cdf[p - 1] if p > 0 else cdf[p] - 0.0
    if bad:
        raise IndexError("draw_weights: a permutation entry or position is out of range")
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
