"""What other compiled modules may use of :mod:`cuckoo`: a read-only view of an int64 table's
buckets, to look keys up without the GIL (the table-parallel fused forward of
``fused.pyx`` probes several tables at once, one per thread)."""

from libc.stdint cimport int64_t, uint32_t, uint64_t


ctypedef struct CuckooProbe:
    const void* buckets
    uint64_t mask
    uint64_t seed


cdef int probe_of(object table, CuckooProbe* p) except -1
cdef Py_ssize_t probe_find(const CuckooProbe* p, const int64_t* keys, Py_ssize_t n,
                           uint32_t* out) noexcept nogil
