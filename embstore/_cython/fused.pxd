"""What :mod:`fused_tables` (a collection's tables in one call) shares of :mod:`fused`: the
step of one table's keys, its checks, and the dedupe."""

from libc.stdint cimport int64_t, uint64_t, uint32_t, uint8_t

from .arena cimport RecordArena

cdef extern from "es_fused.h":
    ctypedef struct es_rule_t:
        int rule
        float alpha, lr, eps
        float h[4]
        double thresh
    # the inner loops both modules call (built per CPU class, see the header)
    void es_gather_bags(float* out, Py_ssize_t ostride, Py_ssize_t n_bags, Py_ssize_t d,
                        const void* const* rows, const int64_t* inv, const float* w, int mean,
                        int kind) noexcept nogil
    void es_pool_bag(float* o, Py_ssize_t d, const void* const* rows, const int64_t* inv,
                     Py_ssize_t start, Py_ssize_t stop, const float* w, int mean,
                     int kind, Py_ssize_t ahead_stop) noexcept nogil
    void es_scatter_sums(float* sums, Py_ssize_t nu, Py_ssize_t d, const char* grad,
                         Py_ssize_t gstride, Py_ssize_t n_bags, const int64_t* inv,
                         const int64_t* offsets, const float* w, int mean,
                         float* scaled) noexcept nogil
    int es_finite(const float* x, Py_ssize_t n) noexcept nogil
    # every cache line of n bytes at p requested for writing, and how many bags ahead
    void es_prefetch_span_w(const char* p, Py_ssize_t n) noexcept nogil
    enum: ES_OUT_AHEAD

# How a float field is stored: float32, bfloat16 (its upper 16 bits) or IEEE float16 (the
# values of es_fused.h's ES_F32, ES_BF16, ES_F16)
cdef enum:
    KIND_F32 = 0
    KIND_BF16 = 1
    KIND_F16 = 2


cdef inline Py_ssize_t SCRATCH(Py_ssize_t d) noexcept nogil:
    """Floats of one thread's scratch for a table's step (see ``es_step_narrow``)."""
    return 3 * d + 2


cdef struct StepSpec:
    es_rule_t r
    Py_ssize_t d, vec_offset, acc_offset, acc2_offset
    int vec_kind, acc_kind
    uint64_t seed
    bint stochastic


cdef struct StepJob:
    # one table's step (step_bags, step_tables): its records, keys, sums and metadata
    uint8_t** chunks
    uint64_t low_mask
    Py_ssize_t itemsize
    int shift
    const uint32_t* slots
    Py_ssize_t nu
    const float* sums
    StepSpec sp
    const Py_ssize_t* add_offsets
    Py_ssize_t n_add
    const int64_t* add_values     # (n_add, add_stride): key u's at [f * add_stride + u]
    Py_ssize_t add_stride
    const Py_ssize_t* set_offsets
    Py_ssize_t n_set
    const uint64_t* set_bits


cdef Py_ssize_t dedupe_keys(const int64_t* keys, Py_ssize_t n, int64_t* uniq, int64_t* inv,
                            int64_t* counts) noexcept nogil
cdef int check_bags(const int64_t[::1] inv, const int64_t[::1] offsets,
                    const float[::1] weights, Py_ssize_t n_bags, Py_ssize_t n_rows,
                    str what) except -1
cdef int step_spec(StepSpec* sp, Py_ssize_t itemsize, Py_ssize_t d, int rule, float alpha,
                   float lr, float eps, const double[::1] hyper, Py_ssize_t vec_offset,
                   Py_ssize_t acc_offset, Py_ssize_t acc2_offset, int vec_kind, int acc_kind,
                   uint64_t seed, bint stochastic) except -1
cdef int step_job(StepJob* j, RecordArena arena, const uint32_t[::1] slots, const float* sums,
                  const StepSpec* sp, const Py_ssize_t[::1] add_offsets,
                  const int64_t[:, ::1] add_values, const Py_ssize_t[::1] set_offsets,
                  const uint64_t[::1] set_bits) except -1
cdef void step_all(const StepJob* j, float* scratch) noexcept nogil
