"""Declarations shared by the bytes-key modules: borrowed (pointer, length) views of keys."""

from cpython.ref cimport PyObject
from libc.stdint cimport uint64_t


ctypedef struct KeyView:
    const char* p
    Py_ssize_t n


cdef KeyView* key_views(object keys, Py_ssize_t* n_out) except NULL
cdef PyObject** key_items(object keys, Py_ssize_t* n) except NULL


cdef extern from "Python.h":
    # On a borrowed pointer: going through an ``object`` variable would write each scattered
    # key object's reference count, twice.
    bint _is_bytes "PyBytes_Check"(PyObject* o) nogil
    char* _bytes_data "PyBytes_AS_STRING"(PyObject* o) nogil
    Py_ssize_t _bytes_size "PyBytes_GET_SIZE"(PyObject* o) nogil


cdef inline bint bytes_view(PyObject* o, KeyView* v) noexcept nogil:
    """Set ``v`` to the key of ``o`` when it is bytes (or a bytes subclass, as
    :c:func:`key_views` takes); False, ``v`` untouched, for anything else (str included)."""
    if not _is_bytes(o):
        return False
    v.p = _bytes_data(o)
    v.n = _bytes_size(o)
    return True


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
