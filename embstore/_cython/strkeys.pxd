"""Declarations shared by the bytes-key modules: borrowed (pointer, length) views of keys."""

from libc.stdint cimport uint64_t


ctypedef struct KeyView:
    const char* p
    Py_ssize_t n


cdef KeyView* key_views(object keys, Py_ssize_t* n_out) except NULL
cdef uint64_t hash_view(KeyView k, uint64_t seed) noexcept nogil
