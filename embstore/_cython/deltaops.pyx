# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""A follower's delta read out of a ``memory://`` table in one call (the worker's push).

The push read a delta in Python, a chunk of keys per call of the backend: each chunk took
the backend's lock, a key table probe and a gather, each a trip through the interpreter
that had to win the GIL back from the thread serving the trainer (whose own calls then
waited for it in turn). Here the whole part is read by one call that takes the lock per
chunk and probes and copies that chunk's rows without the GIL: the trainer's calls wait
for one chunk at most, and the push no longer competes for the interpreter per chunk.
"""

from libc.stdint cimport int64_t, uint8_t, uint32_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from .arena cimport RecordArena
from .cuckoo cimport CuckooProbe, probe_find, probe_of


cdef extern from "es_prefetch.h":
    void ES_PREFETCH(const void* p) nogil


cdef enum:
    # rows requested ahead of their copy (as RecordArena.gather)
    AHEAD = 16

cdef uint32_t EMPTY = 0xFFFFFFFFu


cdef void _copy_rows(RecordArena arena, const uint32_t* slots, Py_ssize_t n, uint8_t* out,
                     Py_ssize_t width, uint8_t* found) noexcept nogil:
    """The record at each of ``slots`` into ``out``'s rows (zeros for ``EMPTY``), its
    presence into ``found``."""
    cdef Py_ssize_t j
    cdef const uint8_t* ahead
    for j in range(n):
        if j + AHEAD < n and slots[j + AHEAD] != EMPTY:
            # the record's first and last line: the hardware streams the ones between
            ahead = arena._row(slots[j + AHEAD])
            ES_PREFETCH(ahead)
            ES_PREFETCH(ahead + width - 1)
        if slots[j] == EMPTY:
            memset(out + j * width, 0, width)
            found[j] = 0
        else:
            memcpy(out + j * width, arena._row(slots[j]), width)
            found[j] = 1


def gather_keys(object lock, object tables, const int64_t[::1] keys, uint8_t[:, ::1] out,
                uint8_t[::1] found, Py_ssize_t chunk):
    """The records of ``keys`` into the rows of ``out`` (zeros for an absent key) and their
    presence into ``found`` (1/0), ``chunk`` keys at a time, each chunk under ``lock`` (the
    backend's) and read without the GIL. ``tables()``, called under the lock for each
    chunk, names the int64 key table and the arena to read (a restore may have replaced
    them between chunks)."""
    cdef Py_ssize_t n = keys.shape[0], i = 0, m
    cdef CuckooProbe p
    cdef RecordArena arena
    cdef uint32_t* slots
    if out.shape[0] < n or found.shape[0] < n:
        raise ValueError("gather_keys: out or found has fewer rows than keys")
    if chunk < 1:
        raise ValueError("gather_keys: chunk must be positive")
    if n == 0:
        return
    slots = <uint32_t*> malloc(min(chunk, n) * sizeof(uint32_t))
    if slots == NULL:
        raise MemoryError("gather_keys: no memory for a chunk's slots")
    try:
        while i < n:
            m = min(chunk, n - i)
            with lock:
                table, arena_obj = tables()
                probe_of(table, &p)
                arena = <RecordArena?> arena_obj
                if arena.itemsize != out.shape[1]:
                    raise ValueError("gather_keys: out's rows are not the records' width")
                with nogil:
                    probe_find(&p, &keys[i], m, slots)
                    _copy_rows(arena, slots, m, &out[i, 0], out.shape[1], &found[i])
            i += m
    finally:
        free(slots)
