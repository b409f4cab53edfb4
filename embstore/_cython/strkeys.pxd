"""Declarations shared by the bytes-key modules: borrowed (pointer, length) views of keys."""

from cpython.ref cimport PyObject
from libc.stdint cimport uint64_t
from libc.stdlib cimport realloc
from libc.string cimport memcpy


ctypedef struct KeyView:
    const char* p
    Py_ssize_t n


cdef KeyView* key_views(object keys, Py_ssize_t* n_out) except NULL
cdef PyObject** key_items(object keys, Py_ssize_t* n) except NULL


cdef extern from "Python.h":
    # On a borrowed pointer: going through an ``object`` variable would write each scattered
    # key object's reference count, twice.
    bint _is_bytes "PyBytes_Check"(PyObject* o) nogil
    bint _is_exact_bytes "PyBytes_CheckExact"(PyObject* o) nogil
    char* _bytes_data "PyBytes_AS_STRING"(PyObject* o) nogil
    Py_ssize_t _bytes_size "PyBytes_GET_SIZE"(PyObject* o) nogil


cdef inline bint bytes_view(PyObject* o, KeyView* v) noexcept nogil:
    """Set ``v`` to the key of ``o`` when it is exactly ``bytes`` (the store's key form);
    False, ``v`` untouched, for anything else: str, a bytes subclass (which
    :c:func:`key_views` takes), a wrong type. So a fast pass over a batch that took every key
    proved the batch is in the key form as well."""
    if not _is_exact_bytes(o):
        return False
    v.p = _bytes_data(o)
    v.n = _bytes_size(o)
    return True


cdef class KeySnapshot:
    cdef char* data
    cdef Py_ssize_t* lens
    cdef Py_ssize_t n
    cdef Py_ssize_t used    # bytes of data taken by the n keys
    cdef Py_ssize_t cap     # bytes data holds
    cdef int fill(self, KeyView* v, Py_ssize_t n) except -1
    cdef int reserve(self, Py_ssize_t n, Py_ssize_t nbytes) except -1


cdef extern from "es_keyword.h":
    uint64_t key_word "es_key_word"(const char* p, Py_ssize_t n) nogil


cdef inline bint snapshot_add(KeySnapshot s, KeyView k) noexcept nogil:
    """Append key ``k`` to ``s``, which ``KeySnapshot.reserve`` readied for as many keys
    as are added (inline: the probe loops copy each key while it is in cache); False when a
    long key finds no memory. A key of up to 16 bytes goes in as two word stores, zero-padded
    past its end (the next key overwrites the padding; the buffer keeps 16 bytes spare): a
    memcpy call of a variable length per key cost more than the copy."""
    cdef Py_ssize_t need = s.used + (k.n if k.n > 16 else 16)
    cdef uint64_t w
    cdef char* d
    if need > s.cap:
        d = <char*> realloc(s.data, <size_t> (max(2 * s.cap, need) + 16))
        if d == NULL:
            return False
        s.data = d
        s.cap = max(2 * s.cap, need) + 16
    d = s.data + s.used
    if k.n <= 16:
        w = key_word(k.p, k.n)
        memcpy(d, &w, 8)
        w = key_word(k.p + 8, k.n - 8)
        memcpy(d + 8, &w, 8)
    else:
        memcpy(d, k.p, <size_t> k.n)
    s.lens[s.n] = k.n
    s.n += 1
    s.used += k.n
    return True
cdef extern from "es_xxh.h":
    uint64_t XXH3_64bits_withSeed(const void* data, size_t length, uint64_t seed) nogil
    uint64_t es_xxh3_seeded(const void* data, size_t length, uint64_t seed) nogil


# Inline here, so each module that probes by hash compiles XXH3 into its own loop: called
# through the cross-module function table it costs a call per key and cannot be inlined.
cdef inline uint64_t hash_view(KeyView k, uint64_t seed) noexcept nogil:
    return es_xxh3_seeded(k.p, <size_t> k.n, seed)
