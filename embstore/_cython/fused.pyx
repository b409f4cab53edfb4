# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The fused per-table kernels of a pooled embedding step over the record arena.

One forward: :func:`dedupe` (distinct keys in first-seen order, the inverse index and the
occurrences, one hash pass) and :func:`pool` (each bag summed straight from the records'
vector fields into the pooled output, or their maximum with the key that gave each value: no
``(distinct, dim)`` copy in between). One backward:
:func:`step_bags` (the pooled gradients summed per distinct key, as :func:`grad_sums` sums
them, and the optimizer's step applied to each record in place, counts and stamps with it).

The arithmetic is the one of today's torch path, operation by operation, so both give the
same bits: bag sums add rows in element order starting from zero; the max keeps the first
element's value unless a later one is greater (torch's strict ``>``, ties and NaN included), and
its gradient goes to the key that gave each value; ``mean`` divides the sum by
the bag's length; weighted sums use one fused multiply-add per element (as torch's
``embedding_bag`` kernel does); per-key gradient sums add in element order. Each optimizer
step repeats the float32 operations of the optimizer's numpy step in their order. The
extension is built with ``-ffp-contract=off``, so nothing else is contracted.

This module imports nothing from embstore; callers pass clean, contiguous arrays.
"""

from cython.parallel cimport prange, threadid
from libc.stdint cimport int32_t, int64_t, uint64_t, uint32_t, uint16_t, uint8_t
from libc.stdlib cimport malloc, free
from libc.math cimport sqrt
from libc.string cimport memcpy, memset

from .arena cimport RecordArena

cdef extern from "es_prefetch.h":
    void ES_PREFETCH(const void* p) nogil
    void ES_PREFETCH_W(const void* p) nogil

cdef extern from "es_rowsq.h":
    float es_sumsq(const float* x, Py_ssize_t d) noexcept nogil

cdef extern from "es_fused.h":  # the inner loops, built per CPU class (see the header)
    int es_rule_slots(int rule) noexcept nogil
    Py_ssize_t es_slot_width(int rule, Py_ssize_t d) noexcept nogil
    int es_sum_key(float* s, Py_ssize_t d, const char* grad, Py_ssize_t gstride,
                   const int64_t* el_bag, int64_t first, int64_t stop, const int64_t* offsets,
                   const float* w, int mean) noexcept nogil
    void es_step_row(uint8_t* row, const float* s, Py_ssize_t d, const es_rule_t* r,
                     Py_ssize_t vec_offset, Py_ssize_t acc_offset,
                     Py_ssize_t acc2_offset) noexcept nogil
    void es_step_narrow(uint8_t* row, const float* s, Py_ssize_t d, const es_rule_t* r,
                        Py_ssize_t vec_offset, Py_ssize_t acc_offset, Py_ssize_t acc2_offset,
                        int vec_kind, int acc_kind, float* tmp, uint64_t seed, int stochastic,
                        uint64_t u) noexcept nogil
    void es_rowwise_bf16_rows(uint8_t* const* rows, const float* s, Py_ssize_t n,
                              Py_ssize_t d, const es_rule_t* r, Py_ssize_t vec_offset,
                              Py_ssize_t acc_offset, uint64_t seed, int stochastic,
                              uint64_t u0) noexcept nogil
    void es_max_bag(float* o, int32_t* am, Py_ssize_t d, const void* const* rows,
                    const int64_t* inv, Py_ssize_t start, Py_ssize_t stop, int kind,
                    Py_ssize_t ahead_stop) noexcept nogil
    void es_max_sums(float* sums, Py_ssize_t nu, Py_ssize_t d, const char* grad,
                     Py_ssize_t gstride, Py_ssize_t n_bags, const int32_t* am,
                     const int64_t* inv, const int64_t* offsets) noexcept nogil

# How a float field is stored (``KINDS[name]``; fused.pxd's KIND_*)
KINDS = {"float32": KIND_F32, "bfloat16": KIND_BF16, "float16": KIND_F16}

cdef enum:
    AHEAD = 16   # rows requested this many keys ahead of the one being stepped
    # Threads take bags or keys CHUNK at a time (dynamic: a thread the OS holds back leaves
    # its share to the others), and only calls of at least MIN_SPLIT floats per thread split
    # at all: below that a fork and join costs more than it saves.
    CHUNK = 64
    MIN_SPLIT = 16384
    ROWS = 8     # keys stepped together (_step_keys; es_fused.h's ES_ROWS)


cdef inline int _split(int threads, Py_ssize_t work) noexcept nogil:
    """How many threads a call of ``work`` floats uses, of the ``threads`` asked for."""
    if threads <= 1 or work < 2 * MIN_SPLIT:
        return 1
    if work < <Py_ssize_t> threads * MIN_SPLIT:
        return <int> (work // MIN_SPLIT)
    return threads

# The optimizer rules :func:`step_bags` applies in place (``RULES[name]``; es_fused.h's
# ES_RULE_*), and the slot fields each keeps, first and second (``RULE_SLOTS[name]``)
cdef enum:
    RULE_AXPY = 0
    RULE_ADAGRAD = 1
    RULE_ADAGRAD_ROWWISE = 2
    RULE_MOMENTUM = 3
    RULE_NESTEROV = 4
    RULE_ADAM = 5
    RULE_FTRL = 6
    RULE_SGD_DECAY = 7
    N_RULES = 8

RULES = {"axpy": RULE_AXPY, "adagrad": RULE_ADAGRAD, "adagrad_rowwise": RULE_ADAGRAD_ROWWISE,
         "momentum": RULE_MOMENTUM, "nesterov": RULE_NESTEROV, "adam": RULE_ADAM,
         "ftrl": RULE_FTRL, "sgd_decay": RULE_SGD_DECAY}
RULE_SLOTS = {"axpy": (), "adagrad": ("accum",), "adagrad_rowwise": ("accum",),
              "momentum": ("momentum",), "nesterov": ("momentum",), "adam": ("m", "v"),
              "ftrl": ("z", "n"), "sgd_decay": ()}

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
    cdef Py_ssize_t n = keys.shape[0], nu
    if uniq.shape[0] < n or inv.shape[0] < n or counts.shape[0] < n:
        raise ValueError("dedupe: output arrays are shorter than the keys")
    with nogil:
        nu = dedupe_keys(&keys[0] if n else NULL, n, &uniq[0] if n else NULL,
                         &inv[0] if n else NULL, &counts[0] if n else NULL)
    if nu < 0:
        raise MemoryError("dedupe: no memory for the hash table")
    return nu


cdef Py_ssize_t dedupe_keys(const int64_t* keys, Py_ssize_t n, int64_t* uniq, int64_t* inv,
                            int64_t* counts) noexcept nogil:
    """:func:`dedupe` of ``n`` keys (one open-addressing pass); -1: no memory."""
    cdef Py_ssize_t i, nu = 0
    cdef uint64_t cap = 16, mask, h
    cdef int64_t k, u
    cdef int64_t* table
    while cap < <uint64_t> (2 * n):
        cap <<= 1
    mask = cap - 1
    table = <int64_t*> malloc(cap * sizeof(int64_t))
    if table == NULL:
        return -1
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


cdef int check_bags(const int64_t[::1] inv, const int64_t[::1] offsets,
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
         bint mean, float[:, :] out, int threads=1, int kind=KIND_F32,
         int32_t[:, ::1] argmax=None):
    """Bag ``b`` of ``out``: the float32 vectors (at ``vec_offset`` in each record) of the
    records ``slots[inv[e]]`` for ``e`` in ``offsets[b]:offsets[b+1]``, summed in element
    order (``weights[e]`` times each when ``weights`` is not empty), divided by the bag's
    length with ``mean``; an empty bag gives zeros. ``out`` may be a column block of a wider
    array (rows apart, each row contiguous); bags are split over ``threads`` native
    threads. ``kind`` (``KINDS``) is how the vectors are stored: bfloat16 or float16 rows
    are widened as they are read (exactly), with no float32 copy of them in between.

    With ``argmax`` (int32, ``(n_bags, dim)``) the bags are max-pooled instead (``mean``
    and ``weights`` unused), as torch's ``embedding_bag(mode="max")`` on CPU: per column the
    first element's value, replaced by a later element's only where that is greater (ties,
    NaN and signed zeros keep the earlier one); ``argmax[b, k]`` receives the row of the keys
    (``inv[e]``) that gave ``out[b, k]``, -1 in an empty bag (whose values are zeros)."""
    cdef Py_ssize_t n_bags = out.shape[0], d = out.shape[1], b
    cdef Py_ssize_t nu = slots.shape[0], u
    cdef const float* w = &weights[0] if weights.shape[0] else NULL
    cdef const float** rows
    cdef uint32_t s
    cdef int nt = _split(threads, n_bags * d)
    if kind not in (KIND_F32, KIND_BF16, KIND_F16):
        raise ValueError(f"pool: unknown field kind {kind}")
    if vec_offset < 0 or vec_offset + d * (4 if kind == KIND_F32 else 2) > arena.itemsize:
        raise ValueError("pool: the vector field does not fit the record")
    if d > 1 and out.strides[1] != sizeof(float):
        raise ValueError("pool: each output row must be contiguous")
    check_bags(inv, offsets, weights, n_bags, nu, "pool")
    if argmax is not None and (argmax.shape[0] != n_bags or argmax.shape[1] != d):
        raise ValueError("pool: argmax must have the output's shape")
    if argmax is not None and nu > 0x7FFFFFFF:
        raise ValueError("pool: too many keys for int32 rows")
    arena._check_slots(slots, "pool")
    rows = <const float**> malloc((nu if nu else 1) * sizeof(float*))
    if rows == NULL:
        raise MemoryError("pool: no memory")
    with nogil:
        # Each distinct key's vector address once (the arena's row arithmetic, inlined); the
        # bag loop requests the rows of the elements a few bags on as it goes.
        for u in range(nu):
            s = slots[u]
            rows[u] = <const float*> (arena.chunks[s >> arena.shift]
                                      + (s & arena.low_mask) * arena.itemsize + vec_offset)
        if argmax is not None:
            for b in prange(n_bags, num_threads=nt, schedule="dynamic", chunksize=CHUNK):
                es_max_bag(&out[b, 0], &argmax[b, 0], d, <const void**> rows, &inv[0],
                           offsets[b], offsets[b + 1], kind, offsets[n_bags])
        else:
            for b in prange(n_bags, num_threads=nt, schedule="dynamic", chunksize=CHUNK):
                es_pool_bag(&out[b, 0], d, <const void**> rows, &inv[0], offsets[b],
                            offsets[b + 1], w, mean, kind, offsets[n_bags])
    free(rows)


def grad_sums(const int64_t[::1] inv, const int64_t[::1] offsets, const float[::1] weights,
              bint mean, const float[:, :] grad, float[:, ::1] sums,
              const int32_t[:, ::1] argmax=None):
    """Row ``u`` of ``sums``: the gradient of every element ``e`` with ``inv[e] == u``,
    added in element order; an element's gradient is its bag's row of ``grad``, divided by
    the bag's length with ``mean``, times ``weights[e]`` when weights are given. ``grad``
    may be a strided view of a wider array (a slice of a concatenated output's gradient),
    its rows contiguous. With ``argmax`` (:func:`pool`'s, max pooling) row ``u`` instead
    sums, per column ``k``, ``grad[b, k]`` of the bags whose ``argmax[b, k] == u``, in bag
    order."""
    cdef Py_ssize_t d = grad.shape[1]
    cdef float* scaled
    if sums.shape[1] != d or (d > 1 and grad.strides[1] != sizeof(float)):
        raise ValueError("grad_sums: the sums must have the gradient's width, and gradient "
                         "rows must be contiguous")
    check_bags(inv, offsets, weights, grad.shape[0], sums.shape[0], "grad_sums")
    if argmax is not None:
        _max_sums(&sums[0, 0] if sums.shape[0] else NULL, sums.shape[0], grad, argmax, inv,
                  offsets)
        return
    scaled = <float*> malloc((d if d else 1) * sizeof(float))
    if scaled == NULL:
        raise MemoryError("grad_sums: no memory")
    with nogil:
        _scatter_sums(&sums[0, 0] if sums.shape[0] else NULL, sums.shape[0], grad, inv,
                      offsets, weights, mean, scaled)
    free(scaled)


cdef inline void _scatter_sums(float* sums, Py_ssize_t nu, const float[:, :] grad,
                               const int64_t[::1] inv, const int64_t[::1] offsets,
                               const float[::1] weights, bint mean,
                               float* scaled) noexcept nogil:
    """:func:`grad_sums` into ``nu`` rows at ``sums``, bag by bag (one thread)."""
    es_scatter_sums(sums, nu, grad.shape[1], <const char*> &grad[0, 0] if grad.shape[0]
                    else NULL, grad.strides[0], grad.shape[0], &inv[0], &offsets[0],
                    &weights[0] if weights.shape[0] else NULL, mean, scaled)


cdef int _max_sums(float* sums, Py_ssize_t nu, const float[:, :] grad,
                   const int32_t[:, ::1] argmax, const int64_t[::1] inv,
                   const int64_t[::1] offsets) except -1:
    """:func:`grad_sums` of max-pooled bags into ``nu`` rows at ``sums`` (``inv`` and
    ``offsets`` checked by the caller; ``argmax`` here: the gradient's shape. Its values are
    only compared with the bags' keys, never used as an address)."""
    cdef Py_ssize_t n_bags = grad.shape[0], d = grad.shape[1]
    if argmax.shape[0] != n_bags or argmax.shape[1] != d:
        raise ValueError("grad_sums: argmax must have the gradient's shape")
    with nogil:
        es_max_sums(sums, nu, d, <const char*> &grad[0, 0] if n_bags else NULL,
                    grad.strides[0], n_bags, &argmax[0, 0] if n_bags and d else NULL,
                    &inv[0] if inv.shape[0] else NULL, &offsets[0])
    return 0


def step_bags(RecordArena arena, const uint32_t[::1] slots, const int64_t[::1] inv,
              const int64_t[::1] offsets, const float[::1] weights, bint mean,
              const float[:, :] grad, int rule, float alpha, float lr, float eps,
              Py_ssize_t vec_offset, Py_ssize_t acc_offset, const Py_ssize_t[::1] add_offsets,
              const int64_t[:, ::1] add_values, const Py_ssize_t[::1] set_offsets,
              const uint64_t[::1] set_bits, int threads=1, int vec_kind=KIND_F32,
              int acc_kind=KIND_F32, uint64_t seed=0, bint stochastic=False,
              const double[::1] hyper=None, Py_ssize_t acc2_offset=-1,
              const int32_t[:, ::1] argmax=None):
    """The backward of :func:`pool` and the optimizer's step, in one call: returns False
    (and writes nothing) when a key's summed gradient is not finite.

    First every distinct key's gradient (``slots[u]``: its record) is summed from the pooled
    gradient ``grad`` (``(n_bags, dim)``, rows may sit apart) exactly as :func:`grad_sums`
    sums it (element order; the bag's length divides first with ``mean``; ``fmaf`` with
    ``weights``), the elements of each key found through a stable counting sort, so keys are
    independent. Then each key's record is stepped in place by ``rule`` (``RULES``): ``axpy``
    ``vec += alpha * sum``; ``adagrad`` as :meth:`RecordArena.adagrad_rows`;
    ``adagrad_rowwise`` as :meth:`RecordArena.adagrad_rowwise_rows` with the mean square of
    ``es_sumsq``; ``momentum``, ``nesterov``, ``adam`` and ``ftrl`` as the numpy steps of
    :mod:`embstore.optim` (operation by operation, in float32). The slot fields are at
    ``acc_offset`` and, for a second slot (``RULE_SLOTS``), ``acc2_offset``; the constants
    beyond ``alpha``, ``lr`` and ``eps`` come in ``hyper`` (float64, each narrowed to
    float32 as the numpy step narrows it): ``momentum``/``nesterov`` ``(momentum,)`` with
    ``lr``; ``sgd_decay`` (SGD with weight decay) ``(weight_decay,)`` with ``lr``; ``adam`` ``(1 - b1, 1 - b2, step_size)`` with ``eps``; ``ftrl`` ``(alpha,
    beta, 2 * l2, l1, l21)`` (``l21 * sqrt(dim)`` kept float64; 0: no group lasso). In the
    same visit of the record the int64 fields at ``add_offsets`` grow by ``add_values[f,
    u]`` and the 8 bytes at each ``set_offsets[s]`` become ``set_bits[s]`` (counts and
    stamps, as :meth:`RecordArena.update_rows` writes them). Keys are split over
    ``threads`` native threads in both passes; the bits do not depend on the split.

    ``vec_kind`` / ``acc_kind`` (``KINDS``) say how the vector and the slots are stored:
    16-bit fields are widened, stepped in float32 (the arithmetic above) and rounded back,
    to nearest, or with ``stochastic`` by random bits that are a function of ``seed``, the
    key's row ``u``, the field and the coordinate only (not of the thread split).

    With ``argmax`` (:func:`pool`'s, max pooling) the sums are :func:`grad_sums`' of max
    pooling (one thread: a pass over the gradient); the step is the same."""
    cdef Py_ssize_t nu = slots.shape[0], n_bags = grad.shape[0], d = grad.shape[1]
    cdef Py_ssize_t u
    cdef int nt = _split(threads, (nu if nu > n_bags else n_bags) * d)
    cdef float* sums
    cdef float* scratch
    cdef int bad = 0
    cdef StepSpec sp
    cdef StepJob job
    step_spec(&sp, arena.itemsize, d, rule, alpha, lr, eps, hyper, vec_offset, acc_offset,
               acc2_offset, vec_kind, acc_kind, seed, stochastic)
    if d > 1 and grad.strides[1] != sizeof(float):
        raise ValueError("step_bags: gradient rows must be contiguous")
    arena._check_metadata(nu, add_offsets, add_values, set_offsets, set_bits, "step_bags")
    check_bags(inv, offsets, weights, n_bags, nu, "step_bags")
    arena._check_slots(slots, "step_bags")
    sums = <float*> malloc((nu * d + d + 1) * sizeof(float))  # the sums, then a scratch row
    if sums == NULL:
        raise MemoryError("step_bags: no memory")
    if argmax is not None:
        try:
            _max_sums(sums, nu, grad, argmax, inv, offsets)
        except ValueError:
            free(sums)
            raise
    elif nt == 1:  # bag by bag, as grad_sums: no grouping pass needed
        with nogil:
            _scatter_sums(sums, nu, grad, inv, offsets, weights, mean, sums + nu * d)
    else:
        bad = _grouped_sums(sums, nu, grad, inv, offsets, weights, mean, nt)
    if bad < 0:
        free(sums)
        raise MemoryError("step_bags: no memory")
    if bad or not es_finite(sums, nu * d):
        free(sums)
        return False
    scratch = <float*> malloc(nt * SCRATCH(d) * sizeof(float))  # a widened row per thread
    if scratch == NULL:
        free(sums)
        raise MemoryError("step_bags: no memory")
    step_job(&job, arena, slots, sums, &sp, add_offsets, add_values, set_offsets, set_bits)
    with nogil:
        if nt == 1:  # (an OpenMP region of one thread still costs its setup)
            step_all(&job, scratch)
        else:
            for u in prange((nu + ROWS - 1) // ROWS, num_threads=nt, schedule="dynamic",
                            chunksize=CHUNK // ROWS):
                _step_keys(&job, u * ROWS, min(<Py_ssize_t> ROWS, nu - u * ROWS),
                           scratch + threadid() * SCRATCH(d))
    free(scratch)
    free(sums)
    return True


cdef int step_spec(StepSpec* sp, Py_ssize_t itemsize, Py_ssize_t d, int rule, float alpha,
                   float lr, float eps, const double[::1] hyper, Py_ssize_t vec_offset,
                   Py_ssize_t acc_offset, Py_ssize_t acc2_offset, int vec_kind, int acc_kind,
                   uint64_t seed, bint stochastic) except -1:
    """``sp``: one table's step as :func:`step_bags` takes it (records of ``itemsize`` bytes,
    gradients of width ``d``), checked: a ``ValueError`` for an unknown rule or field kind,
    missing constants, or float fields outside the record."""
    cdef int n_slots
    cdef Py_ssize_t slot_w
    if vec_kind not in (KIND_F32, KIND_BF16, KIND_F16) or acc_kind not in (KIND_F32, KIND_BF16,
                                                                          KIND_F16):
        raise ValueError("step_bags: unknown field kind")
    if rule < 0 or rule >= N_RULES:
        raise ValueError(f"step_bags: unknown rule {rule}")
    _rule_of(&sp.r, rule, alpha, lr, eps, hyper, d)
    n_slots, slot_w = es_rule_slots(rule), es_slot_width(rule, d)
    if not _fits(vec_offset, d, vec_kind, itemsize) or (
            n_slots >= 1 and not _fits(acc_offset, slot_w, acc_kind, itemsize)) or (
            n_slots >= 2 and not _fits(acc2_offset, slot_w, acc_kind, itemsize)):
        raise ValueError("step_bags: the float fields do not fit the record")
    sp.d, sp.vec_offset, sp.acc_offset, sp.acc2_offset = d, vec_offset, acc_offset, acc2_offset
    sp.vec_kind, sp.acc_kind, sp.seed, sp.stochastic = vec_kind, acc_kind, seed, stochastic
    return 0


cdef inline bint _fits(Py_ssize_t offset, Py_ssize_t width, int kind, Py_ssize_t itemsize):
    return offset >= 0 and offset + width * (4 if kind == KIND_F32 else 2) <= itemsize


cdef int _rule_of(es_rule_t* r, int rule, float alpha, float lr, float eps,
                  const double[::1] hyper, Py_ssize_t d) except -1:
    """``r``: the constants of ``rule`` (see :func:`step_bags`), float32 as numpy rounds
    them; a ``ValueError`` when ``hyper`` is too short for the rule."""
    cdef Py_ssize_t need = (1 if rule in (RULE_MOMENTUM, RULE_NESTEROV, RULE_SGD_DECAY) else
                            3 if rule == RULE_ADAM else 5 if rule == RULE_FTRL else 0)
    cdef Py_ssize_t i
    if need and (hyper is None or hyper.shape[0] < need):
        raise ValueError(f"step_bags: rule {rule} takes {need} constants in hyper")
    r.rule, r.alpha, r.lr, r.eps, r.thresh = rule, alpha, lr, eps, 0.0
    for i in range(4):
        r.h[i] = <float> hyper[i] if i < need else 0.0
    if rule == RULE_FTRL:  # l21 * np.sqrt(dim), in float64 as FTRL.apply has it
        r.thresh = hyper[4] * sqrt(<double> d)
    return 0


cdef int step_job(StepJob* j, RecordArena arena, const uint32_t[::1] slots, const float* sums,
                  const StepSpec* sp, const Py_ssize_t[::1] add_offsets,
                  const int64_t[:, ::1] add_values, const Py_ssize_t[::1] set_offsets,
                  const uint64_t[::1] set_bits) except -1:
    """``j``: the step of the keys at ``slots`` (checked by the caller) with their ``sums``."""
    j.chunks, j.low_mask, j.itemsize, j.shift = arena.chunks, arena.low_mask, arena.itemsize, \
        arena.shift
    j.slots, j.nu, j.sums, j.sp = &slots[0] if slots.shape[0] else NULL, slots.shape[0], sums, sp[0]
    j.n_add, j.n_set = add_offsets.shape[0], set_offsets.shape[0]
    j.add_offsets = &add_offsets[0] if j.n_add else NULL
    j.add_values = &add_values[0, 0] if j.n_add and j.nu else NULL
    j.add_stride = add_values.shape[1]
    j.set_offsets = &set_offsets[0] if j.n_set else NULL
    j.set_bits = &set_bits[0] if j.n_set else NULL
    return 0


cdef inline void _step_key(const StepJob* j, Py_ssize_t u, float* scratch) noexcept nogil:
    """Key ``u``'s record: its optimizer step, counts and stamps, in one visit."""
    cdef uint8_t* row
    cdef Py_ssize_t f, d = j.sp.d
    cdef const StepSpec* sp = &j.sp
    if u + AHEAD < j.nu:  # every line of the record AHEAD keys on
        row = _job_row(j, j.slots[u + AHEAD])
        for f in range(0, j.itemsize, 64):
            ES_PREFETCH_W(row + f)
        ES_PREFETCH_W(row + j.itemsize - 1)
    row = _job_row(j, j.slots[u])
    if sp.vec_kind == KIND_F32 and sp.acc_kind == KIND_F32:
        es_step_row(row, &j.sums[u * d], d, &sp.r, sp.vec_offset, sp.acc_offset,
                    sp.acc2_offset)
    else:
        es_step_narrow(row, &j.sums[u * d], d, &sp.r, sp.vec_offset, sp.acc_offset,
                       sp.acc2_offset, sp.vec_kind, sp.acc_kind, scratch, sp.seed,
                       sp.stochastic, u)
    for f in range(j.n_add):
        (<int64_t*> (row + j.add_offsets[f]))[0] += j.add_values[f * j.add_stride + u]
    for f in range(j.n_set):
        memcpy(row + j.set_offsets[f], &j.set_bits[f], 8)


cdef inline uint8_t* _job_row(const StepJob* j, uint32_t s) noexcept nogil:
    # the arena's row arithmetic, inlined: RecordArena._row is a call into another module
    return j.chunks[s >> j.shift] + (s & j.low_mask) * j.itemsize


cdef int _grouped_sums(float* sums, Py_ssize_t nu, const float[:, :] grad,
                       const int64_t[::1] inv, const int64_t[::1] offsets,
                       const float[::1] weights, bint mean, int nt) noexcept:
    """:func:`grad_sums` with the keys split over ``nt`` threads: each key's elements found
    through a stable counting sort (so each key still adds in element order); -1: no
    memory."""
    cdef Py_ssize_t n_bags = grad.shape[0], d = grad.shape[1], u, b, e, i
    cdef Py_ssize_t n_el = offsets[n_bags]
    cdef int64_t* start = <int64_t*> malloc((nu + 1) * sizeof(int64_t))
    cdef int64_t* cursor = <int64_t*> malloc((nu + 1) * sizeof(int64_t))
    cdef int64_t* el_bag = <int64_t*> malloc((n_el if n_el else 1) * 2 * sizeof(int64_t))
    cdef const char* gbase = <const char*> &grad[0, 0] if n_bags else NULL
    cdef Py_ssize_t gstride = grad.strides[0]
    cdef const float* w = &weights[0] if weights.shape[0] else NULL
    cdef int bad = 0
    if start == NULL or cursor == NULL or el_bag == NULL:
        free(start)
        free(cursor)
        free(el_bag)
        return -1
    with nogil:
        # each key's elements, in element order: (element, its bag) pairs grouped by key
        memset(start, 0, (nu + 1) * sizeof(int64_t))
        for e in range(n_el):
            start[inv[e] + 1] += 1
        for u in range(nu):
            start[u + 1] += start[u]
        memcpy(cursor, start, (nu + 1) * sizeof(int64_t))
        for b in range(n_bags):
            for e in range(offsets[b], offsets[b + 1]):
                i = cursor[inv[e]]
                cursor[inv[e]] = i + 1
                el_bag[2 * i] = e
                el_bag[2 * i + 1] = b
        for u in prange(nu, num_threads=nt, schedule="dynamic", chunksize=CHUNK):
            bad += es_sum_key(&sums[u * d], d, gbase, gstride, el_bag, start[u], start[u + 1],
                              &offsets[0], w, mean)
    free(start)
    free(cursor)
    free(el_bag)
    return 1 if bad else 0


def split_threads(int threads, Py_ssize_t work):
    """How many native threads a kernel call of ``work`` floats uses when ``threads`` are
    asked for (small calls stay on one: a fork and join would cost more)."""
    return _split(threads, work)


cdef void step_all(const StepJob* j, float* scratch) noexcept nogil:
    """Every key of ``j`` stepped in order on this thread (``scratch``: ``SCRATCH(d)``
    floats), ``ROWS`` keys at a time (:func:`_step_keys`)."""
    cdef Py_ssize_t b
    for b in range((j.nu + ROWS - 1) // ROWS):
        _step_keys(j, b * ROWS, min(<Py_ssize_t> ROWS, j.nu - b * ROWS), scratch)


cdef void _step_keys(const StepJob* j, Py_ssize_t u0, Py_ssize_t m,
                     float* scratch) noexcept nogil:
    """Keys ``u0`` to ``u0 + m`` (``m <= ROWS``) stepped, the bits of :func:`_step_key` on
    each in turn. Row-wise Adagrad on bfloat16 vectors takes the ``m`` records together
    (``es_rowwise_bf16_rows``: their step sizes first, then their vectors, so the rows'
    division chains overlap), then their counts and stamps; every record is requested
    ``AHEAD`` keys before its turn either way."""
    cdef Py_ssize_t i, u, f, d = j.sp.d
    cdef uint8_t* rows[ROWS]
    cdef uint8_t* ahead
    if not (j.sp.r.rule == RULE_ADAGRAD_ROWWISE and j.sp.vec_kind == KIND_BF16
            and j.sp.acc_kind == KIND_F32):
        for u in range(u0, u0 + m):
            _step_key(j, u, scratch)
        return
    for i in range(m):
        u = u0 + i
        if u + AHEAD < j.nu:
            ahead = _job_row(j, j.slots[u + AHEAD])
            for f in range(0, j.itemsize, 64):
                ES_PREFETCH_W(ahead + f)
            ES_PREFETCH_W(ahead + j.itemsize - 1)
        rows[i] = _job_row(j, j.slots[u])
    es_rowwise_bf16_rows(rows, &j.sums[u0 * d], m, d, &j.sp.r, j.sp.vec_offset,
                         j.sp.acc_offset, j.sp.seed, j.sp.stochastic, u0)
    for i in range(m):
        for f in range(j.n_add):
            (<int64_t*> (rows[i] + j.add_offsets[f]))[0] += j.add_values[f * j.add_stride + u0 + i]
        for f in range(j.n_set):
            memcpy(rows[i] + j.set_offsets[f], &j.set_bits[f], 8)
