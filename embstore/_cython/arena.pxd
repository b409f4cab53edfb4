"""Declarations of :class:`RecordArena`, so that other compiled modules can allocate slots."""

cimport cython
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t


@cython.final
cdef class RecordArena:
    cdef uint8_t** chunks        # nchunks chunks in use, then nspare mapped ahead of use
    cdef Py_ssize_t nchunks
    cdef Py_ssize_t nspare
    cdef Py_ssize_t chunk_cap
    cdef public Py_ssize_t itemsize
    cdef public Py_ssize_t chunk_rows
    cdef public bint prefault
    cdef readonly bint huge_pages
    cdef size_t chunk_bytes
    cdef uint64_t next_slot      # slots below this were handed out at least once
    cdef uint32_t* free_list
    cdef Py_ssize_t nfree
    cdef Py_ssize_t free_cap
    cdef int shift
    cdef uint64_t low_mask
    cdef Py_ssize_t pins         # readers copying rows outside the owner's lock (pin/unpin)

    cdef void _unmap_all(self) noexcept
    cdef int _map_chunk(self) except -1
    cdef int _add_chunk(self) except -1
    cdef uint32_t _alloc_one(self) except? 0xFFFFFFFF
    cdef uint8_t* _row(self, uint32_t slot) noexcept nogil
    cdef void pin(self) noexcept
    cdef void unpin(self) noexcept
    cdef void _wait_unpinned(self)
    cdef int _check_slots(self, const uint32_t[::1] slots, str what) except -1
    cdef int _check_metadata(self, Py_ssize_t n, const Py_ssize_t[::1] add_offsets,
                             const int64_t[:, ::1] add_values, const Py_ssize_t[::1] set_offsets,
                             const uint64_t[::1] set_bits, str what) except -1
