# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""A collection's tables in one call each way, spread over native threads: the kernels of
:mod:`fused` for several tables at once (``DynamicEmbeddingBagCollection``'s fused path over
``memory://`` stores, ``embstore.engine.fused``).

One table per thread at a time (a dynamic schedule over tables), each table's loops on its
thread, the GIL released: two threads share the whole embedding part of a step (dedupe, the
probe, pooling, gradient sums, the optimizer's step), not only the loops of tables big enough
to split, and the bits are those of one table at a time (:func:`fused.dedupe`,
:func:`fused.pool`, :func:`fused.grad_sums`, :func:`fused.step_bags` on one thread). The
caller holds every table's store lock across a call: nothing grows, moves or frees a bucket or
a record meanwhile, and tables share no rows.
"""

from cython.parallel cimport prange
from libc.stdint cimport int64_t, uint64_t, uint32_t, uint8_t
from libc.stdlib cimport malloc, free

from .arena cimport RecordArena
from .cuckoo cimport CuckooProbe, probe_of, probe_find
from .fused cimport (KIND_BF16, KIND_F16, KIND_F32, SCRATCH, StepJob, StepSpec, check_bags,
                     dedupe_keys, es_finite, es_gather_bags, es_pool_bag,
                     es_prefetch_span_w, es_scatter_sums, ES_OUT_AHEAD, step_all, step_job,
                     step_spec)


cdef struct PoolJob:
    CuckooProbe probe
    uint8_t** chunks
    uint64_t low_mask
    Py_ssize_t itemsize
    int shift
    const int64_t* keys
    Py_ssize_t n
    int64_t* uniq
    int64_t* inv
    int64_t* counts
    uint32_t* slots
    const int64_t* offsets
    Py_ssize_t n_bags
    const float* w
    int mean, kind
    bint single   # every bag holds one element (es_gather_bags)
    Py_ssize_t vec_offset
    float* out
    Py_ssize_t ostride, d
    Py_ssize_t nu, missing   # results: distinct keys, how many absent (-1: no memory)


ctypedef void (*JobFn)(void* job) noexcept nogil


cdef void* _alloc_jobs(Py_ssize_t n, size_t size, str what) except NULL:
    """An array of ``n`` jobs of ``size`` bytes (one at least), for the call ``what``."""
    cdef void* jobs = malloc((n if n else 1) * size)
    if jobs == NULL:
        raise MemoryError(f"{what}: no memory")
    return jobs


cdef void _run_jobs(char* jobs, size_t size, Py_ssize_t n, int threads,
                    JobFn one) noexcept nogil:
    """``one`` on each of the ``n`` jobs (``size`` bytes apart): on this thread in order,
    or a table at a time over ``threads`` native threads."""
    cdef Py_ssize_t t
    if threads <= 1 or n <= 1:
        for t in range(n):
            one(jobs + t * size)
    else:
        for t in prange(n, num_threads=min(threads, n), schedule="dynamic", chunksize=1):
            one(jobs + t * size)


def probe_pool(list tables, int64_t[:, ::1] found, int threads=1):
    """Each table's :func:`dedupe`, the slots of its distinct keys found in its key table and,
    where every key is there, its bags pooled as :func:`pool` pools them; ``found[t]``
    becomes ``(distinct keys, keys absent)`` of table ``t`` (absent: not pooled, the caller
    inserts and pools them). Tables go over ``threads`` native threads, one table per thread
    at a time, GIL released: the bits are those of one table at a time.

    ``tables[t]`` is ``(key_table, arena, keys, uniq, inv, counts, slots, offsets, weights,
    vec_offset, mean, out, kind)``: an int64 :class:`~embstore._cython.cuckoo.CuckooTable`
    and the arena of its records (the caller holds their store's lock), the table's ids, the
    outputs of :func:`dedupe` and the slots (``len(keys)`` rows each), then :func:`pool`'s
    arguments."""
    cdef Py_ssize_t nt_ = len(tables), t
    cdef PoolJob* jobs
    if found.shape[0] < nt_ or found.shape[1] < 2:
        raise ValueError("probe_pool: found needs a (distinct, absent) row per table")
    jobs = <PoolJob*> _alloc_jobs(nt_, sizeof(PoolJob), "probe_pool")
    try:
        for t in range(nt_):
            _pool_job(&jobs[t], tables[t])
        with nogil:
            _run_jobs(<char*> jobs, sizeof(PoolJob), nt_, threads, _probe_pool_one)
        for t in range(nt_):
            if jobs[t].missing < 0:
                raise MemoryError("probe_pool: no memory")
            found[t, 0], found[t, 1] = jobs[t].nu, jobs[t].missing
    finally:
        free(jobs)


cdef int _pool_job(PoolJob* j, tuple spec) except -1:
    """``j`` from one table of :func:`probe_pool`, checked."""
    cdef RecordArena arena = spec[1]
    cdef const int64_t[::1] keys = spec[2], offsets = spec[7]
    cdef int64_t[::1] uniq = spec[3], inv = spec[4], counts = spec[5]
    cdef uint32_t[::1] slots = spec[6]
    cdef const float[::1] weights = spec[8]
    cdef float[:, :] out = spec[11]
    cdef Py_ssize_t n = keys.shape[0], b, vec_offset = spec[9]
    cdef int kind = spec[12]
    probe_of(spec[0], &j.probe)
    if min(uniq.shape[0], inv.shape[0], counts.shape[0], slots.shape[0]) < n:
        raise ValueError("probe_pool: output arrays are shorter than the keys")
    if kind not in (KIND_F32, KIND_BF16, KIND_F16) or vec_offset < 0 or \
            vec_offset + out.shape[1] * (4 if kind == KIND_F32 else 2) > arena.itemsize:
        raise ValueError("probe_pool: the vector field does not fit the record")
    if out.shape[1] > 1 and out.strides[1] != sizeof(float) or \
            out.strides[0] % sizeof(float) != 0:
        raise ValueError("probe_pool: each output row must be contiguous")
    if offsets.shape[0] != out.shape[0] + 1 or offsets[0] != 0 or offsets[out.shape[0]] != n:
        raise ValueError("probe_pool: offsets must be n_bags + 1 bounds of the keys")
    j.single = True
    for b in range(out.shape[0]):
        if offsets[b + 1] < offsets[b]:
            raise ValueError("probe_pool: offsets must not decrease")
        j.single = j.single and offsets[b + 1] == b + 1
    if weights.shape[0] and weights.shape[0] < n:
        raise ValueError("probe_pool: fewer weights than keys")
    j.chunks, j.low_mask, j.itemsize, j.shift = arena.chunks, arena.low_mask, arena.itemsize, \
        arena.shift
    j.keys, j.n = &keys[0] if n else NULL, n
    j.uniq, j.inv = &uniq[0] if n else NULL, &inv[0] if n else NULL
    j.counts, j.slots = &counts[0] if n else NULL, &slots[0] if n else NULL
    j.offsets, j.n_bags = &offsets[0], out.shape[0]
    j.w = &weights[0] if weights.shape[0] else NULL
    j.mean, j.kind, j.vec_offset = bool(spec[10]), kind, vec_offset
    j.out = &out[0, 0] if out.shape[0] and out.shape[1] else NULL
    j.ostride, j.d = out.strides[0] // sizeof(float), out.shape[1]
    j.nu = j.missing = 0
    return 0


cdef void _probe_pool_one(void* job) noexcept nogil:
    cdef PoolJob* j = <PoolJob*> job
    cdef Py_ssize_t u, b
    cdef uint32_t s
    cdef const void** rows
    j.nu = dedupe_keys(j.keys, j.n, j.uniq, j.inv, j.counts)
    if j.nu < 0:
        j.missing = -1
        return
    j.missing = probe_find(&j.probe, j.uniq, j.nu, j.slots)
    if j.missing or j.out == NULL:
        return
    rows = <const void**> malloc((j.nu if j.nu else 1) * sizeof(void*))
    if rows == NULL:
        j.missing = -1
        return
    for u in range(j.nu):
        s = j.slots[u]
        rows[u] = j.chunks[s >> j.shift] + (s & j.low_mask) * j.itemsize + j.vec_offset
    if j.single:  # (single-hot features: a gather, the same bits)
        es_gather_bags(j.out, j.ostride, j.n_bags, j.d, rows, j.inv, j.w, j.mean, j.kind)
    else:
        for b in range(j.n_bags):
            if b + ES_OUT_AHEAD < j.n_bags:
                es_prefetch_span_w(<const char*> (j.out + (b + ES_OUT_AHEAD) * j.ostride),
                                   j.d * sizeof(float))
            es_pool_bag(j.out + b * j.ostride, j.d, rows, j.inv, j.offsets[b],
                        j.offsets[b + 1], j.w, j.mean, j.kind, j.offsets[j.n_bags])
    free(rows)


cdef struct SumJob:
    float* sums
    Py_ssize_t nu, d, n_bags, gstride
    const char* grad
    const int64_t* inv
    const int64_t* offsets
    const float* w
    int mean
    int state   # result: 1 finite, 0 not, -1 no memory


def sum_tables(list tables, uint8_t[::1] finite, int threads=1):
    """Each table's :func:`grad_sums` (the same bits), tables over ``threads`` native threads;
    ``finite[t]`` becomes 1 where every sum of table ``t`` is finite. ``tables[t]`` is
    ``(inv, offsets, weights, mean, grad, sums)`` as :func:`grad_sums` takes them."""
    cdef Py_ssize_t nt_ = len(tables), t
    cdef SumJob* jobs
    if finite.shape[0] < nt_:
        raise ValueError("sum_tables: finite needs a row per table")
    jobs = <SumJob*> _alloc_jobs(nt_, sizeof(SumJob), "sum_tables")
    try:
        for t in range(nt_):
            _sum_job(&jobs[t], tables[t])
        with nogil:
            _run_jobs(<char*> jobs, sizeof(SumJob), nt_, threads, _sum_one)
        for t in range(nt_):
            if jobs[t].state < 0:
                raise MemoryError("sum_tables: no memory")
            finite[t] = jobs[t].state
    finally:
        free(jobs)


cdef int _sum_job(SumJob* j, tuple spec) except -1:
    cdef const int64_t[::1] inv = spec[0], offsets = spec[1]
    cdef const float[::1] weights = spec[2]
    cdef const float[:, :] grad = spec[4]
    cdef float[:, ::1] sums = spec[5]
    if sums.shape[1] != grad.shape[1] or (grad.shape[1] > 1 and grad.strides[1] != sizeof(float)):
        raise ValueError("sum_tables: the sums must have the gradient's width, and gradient "
                         "rows must be contiguous")
    check_bags(inv, offsets, weights, grad.shape[0], sums.shape[0], "sum_tables")
    j.sums = &sums[0, 0] if sums.shape[0] and sums.shape[1] else NULL
    j.nu, j.d, j.n_bags, j.gstride = sums.shape[0], grad.shape[1], grad.shape[0], grad.strides[0]
    j.grad = <const char*> &grad[0, 0] if grad.shape[0] and grad.shape[1] else NULL
    j.inv = &inv[0] if inv.shape[0] else NULL
    j.offsets, j.w = &offsets[0], &weights[0] if weights.shape[0] else NULL
    j.mean, j.state = bool(spec[3]), 0
    return 0


cdef void _sum_one(void* job) noexcept nogil:
    cdef SumJob* j = <SumJob*> job
    cdef float* scaled
    if j.sums == NULL:  # nothing to sum (no keys, or rows of width 0)
        j.state = 1
        return
    scaled = <float*> malloc((j.d if j.d else 1) * sizeof(float))
    if scaled == NULL:
        j.state = -1
        return
    es_scatter_sums(j.sums, j.nu, j.d, j.grad, j.gstride, j.n_bags, j.inv, j.offsets, j.w,
                    j.mean, scaled)
    free(scaled)
    j.state = es_finite(j.sums, j.nu * j.d)


def step_tables(list tables, int threads=1):
    """Each table's optimizer step from sums :func:`sum_tables` made, as :func:`step_bags`
    steps (the same bits), tables over ``threads`` native threads. ``tables[t]`` is ``(sums,
    args)``: ``args`` the arguments of a :func:`step_bags` call of that table (its gradient,
    bags and threads are not used: ``sums`` holds the per-key sums, all finite)."""
    cdef Py_ssize_t nt_ = len(tables), t
    cdef StepJob* jobs
    jobs = <StepJob*> _alloc_jobs(nt_, sizeof(StepJob), "step_tables")
    try:
        for t in range(nt_):
            _table_step(&jobs[t], tables[t][0], tables[t][1])
        with nogil:
            _run_jobs(<char*> jobs, sizeof(StepJob), nt_, threads, _step_one)
    finally:
        free(jobs)


cdef int _table_step(StepJob* j, object sums_, tuple args) except -1:
    """``j``: the step of one table of :func:`step_tables`, checked as :func:`step_bags`
    checks it (``args``: its 24 arguments by position)."""
    cdef const float[:, ::1] sums = sums_
    cdef RecordArena arena = args[0]
    cdef const uint32_t[::1] slots = args[1]
    cdef const Py_ssize_t[::1] add_offsets = args[13], set_offsets = args[15]
    cdef const int64_t[:, ::1] add_values = args[14]
    cdef const uint64_t[::1] set_bits = args[16]
    cdef StepSpec sp
    cdef Py_ssize_t nu = slots.shape[0]
    if len(args) != 24:
        raise ValueError("step_tables: a table's step takes step_bags' 24 arguments")
    step_spec(&sp, arena.itemsize, sums.shape[1], args[7], args[8], args[9], args[10],
               args[22], args[11], args[12], args[23], args[18], args[19], args[20], args[21])
    if sums.shape[0] != nu:
        raise ValueError("step_tables: one row of sums per key")
    arena._check_metadata(nu, add_offsets, add_values, set_offsets, set_bits, "step_tables")
    arena._check_slots(slots, "step_tables")
    step_job(j, arena, slots, &sums[0, 0] if nu and sums.shape[1] else NULL, &sp, add_offsets,
              add_values, set_offsets, set_bits)
    return 0


cdef void _step_one(void* job) noexcept nogil:
    cdef const StepJob* j = <const StepJob*> job
    cdef float* scratch
    if j.sums == NULL:
        return
    scratch = <float*> malloc(SCRATCH(j.sp.d) * sizeof(float))
    if scratch == NULL:  # pragma: no cover - a few floats
        return
    step_all(j, scratch)
    free(scratch)
