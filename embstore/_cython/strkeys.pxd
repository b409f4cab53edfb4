"""Declarations shared by the bytes-key modules: borrowed (pointer, length) views of keys."""

from libc.stdint cimport uint64_t


ctypedef struct KeyView:
    const char* p
    Py_ssize_t n


cdef KeyView* key_views(object keys, Py_ssize_t* n_out) except NULL


cdef class KeySnapshot:
    cdef char* data
    cdef Py_ssize_t* lens
    cdef Py_ssize_t n
    cdef int fill(self, KeyView* v, Py_ssize_t n) except -1
cdef extern from "es_xxh.h":
    uint64_t XXH3_64bits_withSeed(const void* data, size_t length, uint64_t seed) nogil


# Inline here, so each module that probes by hash compiles XXH3 into its own loop: called
# through the cross-module function table it costs a call per key and cannot be inlined.
cdef inline uint64_t hash_view(KeyView k, uint64_t seed) noexcept nogil:
    return XXH3_64bits_withSeed(k.p, <size_t> k.n, seed)
