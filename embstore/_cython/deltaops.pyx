# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""A follower's delta read out of a ``memory://`` table in one call (the worker's push).

The push read a delta in Python, a chunk of keys per call of the backend: each chunk took
the backend's lock, a key table probe and a gather, each a trip through the interpreter
that had to win the GIL back from the thread serving the trainer (whose own calls then
waited for it in turn). Here the whole part is read by one call that, per chunk, probes the
keys under the lock and copies their rows after releasing it, without the GIL.

The copy is most of a chunk's time (each 288-byte row a cache miss, the probe's entries
mostly not) and a trainer's call that wants the lock meanwhile waited for all of it: in one
process, a trainer thread ran at 0.76x its rate while another read 155k keys every 0.1 s
with the copy under the lock, 0.86-0.93x with it outside. Outside it, a row can be torn by
a write under way, or be another key's after a delete freed its slot; either way the key
was written after the delta's first sequence number, and the delta reads every such key
again at the end (``delta_slot.delta_into``: in catch-up rounds, and last under the
worker's lock). The rows' addresses are taken under the lock and the arena pinned until the
copy ends (``RecordArena.pin``): its chunks never move, and ``clear`` waits for the pins.
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


cdef void _row_addresses(RecordArena arena, const uint32_t* slots, Py_ssize_t n,
                         const uint8_t** rows) noexcept nogil:
    """The address of the record at each of ``slots`` (NULL for ``EMPTY``)."""
    cdef Py_ssize_t j
    for j in range(n):
        rows[j] = NULL if slots[j] == EMPTY else arena._row(slots[j])


cdef void _copy_rows(const uint8_t** rows, Py_ssize_t n, uint8_t* out, Py_ssize_t width,
                     uint8_t* found) noexcept nogil:
    """The record at each of ``rows`` into ``out``'s rows (zeros for NULL), its presence
    into ``found``."""
    cdef Py_ssize_t j
    cdef const uint8_t* ahead
    for j in range(n):
        if j + AHEAD < n and rows[j + AHEAD] != NULL:
            # the record's first and last line: the hardware streams the ones between
            ahead = rows[j + AHEAD]
            ES_PREFETCH(ahead)
            ES_PREFETCH(ahead + width - 1)
        if rows[j] == NULL:
            memset(out + j * width, 0, width)
            found[j] = 0
        else:
            memcpy(out + j * width, rows[j], width)
            found[j] = 1


def gather_keys(object lock, object tables, const int64_t[::1] keys, uint8_t[:, ::1] out,
                uint8_t[::1] found, Py_ssize_t chunk):
    """The records of ``keys`` into the rows of ``out`` (zeros for an absent key) and their
    presence into ``found`` (1/0), ``chunk`` keys at a time: each chunk's keys probed under
    ``lock`` (the backend's), their rows copied after it is released (the arena pinned),
    both without the GIL. A row written during the copy may be read torn: the caller reads
    the keys written meanwhile again (see the module's docstring). ``tables()``, called
    under the lock for each chunk, names the int64 key table and the arena to read (a
    restore may have replaced them between chunks)."""
    cdef Py_ssize_t n = keys.shape[0], i = 0, m
    cdef CuckooProbe p
    cdef RecordArena arena
    cdef uint32_t* slots
    cdef const uint8_t** rows
    if out.shape[0] < n or found.shape[0] < n:
        raise ValueError("gather_keys: out or found has fewer rows than keys")
    if chunk < 1:
        raise ValueError("gather_keys: chunk must be positive")
    if n == 0:
        return
    slots = <uint32_t*> malloc(min(chunk, n) * sizeof(uint32_t))
    rows = <const uint8_t**> malloc(min(chunk, n) * sizeof(uint8_t*))
    if slots == NULL or rows == NULL:
        free(slots)
        free(rows)
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
                    _row_addresses(arena, slots, m, rows)
                arena.pin()
            try:
                with nogil:
                    _copy_rows(rows, m, &out[i, 0], out.shape[1], &found[i])
            finally:
                arena.unpin()
            i += m
    finally:
        free(slots)
        free(rows)
