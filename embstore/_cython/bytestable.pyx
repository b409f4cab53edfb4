# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Hash table for bytes keys (bytes key -> uint32 arena slot), the ``memory://`` index of
bytes-key stores.

Open addressing with linear probing over 32-byte entries (two per cache line): the key's 64-bit hash (XXH3-64
seeded per table, so crafted keys cannot be aimed at one store's probe chains), the key's
length and offset in the table's key buffer (keys of up to 16 bytes -- words, most ids -- are
kept in the entry itself, which saves them a second memory access), and the slot. A probe compares the stored hash
first and the full key bytes (``memcmp``) only on a hash match: two keys are one key only
when every byte agrees, so the table is collisionless, and it never drops a key -- it grows
instead. Deletion shifts the following entries back (no tombstones), so probe chains stay as
short as the load allows.

Growth follows the int64 table's rules: the table doubles when an insert would pass
MAX_LOAD (0.75 here: linear probing needs more headroom than 4-way buckets), and a grow that
cannot get memory raises CapacityError with the table unchanged (the new entry array is
built aside and swapped in). The key bytes live in one growing buffer; bytes of erased keys
are reclaimed by compacting it once they are the larger part of it.
"""

cimport cython
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy, memset

import os

import numpy as np

from .strkeys import NotPlainBytes

from .arena cimport RecordArena
from cpython.ref cimport PyObject

from .strkeys cimport (
    KeySnapshot,
    KeyView,
    bytes_view,
    hash_view,
    key_items,
    key_views,
    snapshot_add,
)

cdef extern from "es_memory.h":
    void* es_alloc_probed(size_t n) nogil
cdef extern from "es_keyword.h":
    uint64_t _word "es_key_word"(const char* p, Py_ssize_t n) nogil

cdef extern from "es_prefetch.h":
    void ES_PREFETCH(const void* p) nogil
cdef extern from "es_keyobj.h":
    const char* ES_BYTES_SHORT_END(PyObject* o) nogil

cdef enum:
    # How many keys ahead of its probe a key is hashed and its home entry fetched: 32
    # measured faster than 16 (1M-key lookups, bytes/int64 0.74x -> 0.77x on a busy machine)
    # and than 64, now that the loops hash the keys they fetch for.
    PREFETCH_AHEAD = 32
    # How many key objects ahead of the one being hashed the loops fetch: the objects lie
    # scattered over the heap.
    OBJ_AHEAD = 32
    INLINE = 16         # keys this short are kept in the entry itself, not the key buffer
cdef uint32_t EMPTY = 0xFFFFFFFFu
cdef double MAX_LOAD = 0.75
# Compaction of the key buffer starts once erased bytes are over half of it and this large.
cdef uint64_t COMPACT_MIN = 1 << 20

ctypedef struct Entry:
    uint64_t h
    uint64_t off        # offset in the key buffer; for an inline key, its bytes 0..7
    uint64_t off2       # for an inline key, its bytes 8..15 (zero-padded)
    uint32_t len
    uint32_t val        # arena slot; EMPTY marks a free entry


cdef object _capacity_error(str message):
    from ..errors import CapacityError  # here, not at import: the module stays standalone
    return CapacityError(message)


@cython.final
cdef class BytesTable:
    """bytes -> uint32 map (values are arena slots); see the module docstring."""

    cdef Entry* entries
    cdef uint64_t nentries      # power of two
    cdef uint64_t mask
    cdef uint64_t grow_at
    cdef char* data
    cdef uint64_t data_len
    cdef uint64_t data_cap
    cdef uint64_t data_dead
    cdef readonly uint64_t seed
    cdef uint64_t fp_mask
    cdef public uint64_t size
    cdef public uint64_t rehashes

    def __cinit__(self, uint64_t capacity=1024, seed=None, int fingerprint_bits=64):
        """``fingerprint_bits`` < 64 keeps only that many hash bits: tests use it to force
        fingerprint collisions, which the full-key compare must resolve."""
        cdef uint64_t ne = 16
        while ne * MAX_LOAD < capacity:
            ne *= 2
        self.seed = (int.from_bytes(os.urandom(8), "little") if seed is None
                     else int(seed) & 0xFFFFFFFFFFFFFFFF)
        if not 1 <= fingerprint_bits <= 64:
            raise ValueError("fingerprint_bits must be in 1..64")
        self.fp_mask = 0xFFFFFFFFFFFFFFFF >> (64 - fingerprint_bits)
        self.entries = self._new_entries(ne)
        if self.entries == NULL:
            raise _capacity_error(f"bytes table: cannot allocate {ne} entries")
        self._set_entries(self.entries, ne)
        self.size = 0
        self.rehashes = 0

    def __dealloc__(self):
        free(self.entries)
        free(self.data)

    cdef Entry* _new_entries(self, uint64_t ne) noexcept nogil:
        """A free entry array; NULL without memory. On huge pages when large (see
        es_alloc_probed): lookups of 1M keys ran ~15% faster than with 4 KiB pages."""
        cdef Entry* e = <Entry*> es_alloc_probed(ne * sizeof(Entry))
        cdef uint64_t j
        if e != NULL:
            for j in range(ne):
                e[j].val = EMPTY
        return e

    cdef void _set_entries(self, Entry* e, uint64_t ne) noexcept nogil:
        self.entries = e
        self.nentries = ne
        self.mask = ne - 1
        self.grow_at = <uint64_t> (ne * MAX_LOAD)

    def __len__(self):
        return self.size

    @property
    def capacity(self):
        return <uint64_t> (self.nentries * MAX_LOAD)

    @property
    def nbytes(self):
        """Bytes of memory held: the entry array and the key buffer."""
        return self.nentries * sizeof(Entry) + self.data_cap

    cdef inline bint _same(self, Entry* e, const char* p, Py_ssize_t n) noexcept nogil:
        if e.len != <uint32_t> n:
            return False
        if n <= INLINE:
            return e.off == _word(p, n) and e.off2 == _word(p + 8, n - 8)
        return memcmp(self.data + e.off, p, <size_t> n) == 0

    cdef inline uint32_t _find(self, const char* p, Py_ssize_t n, uint64_t h) noexcept nogil:
        cdef uint64_t j = h & self.mask
        cdef Entry* e
        while True:
            e = &self.entries[j]
            if e.val == EMPTY:
                return EMPTY
            if e.h == h and self._same(e, p, n):
                return e.val
            j = (j + 1) & self.mask

    cdef int _grow(self) except -1:
        """Double the entry array; on failure raise CapacityError and change nothing."""
        cdef uint64_t ne = self.nentries * 2, j, k, nmask = ne - 1
        cdef Entry* e = self._new_entries(ne)
        if e == NULL:
            raise _capacity_error(
                f"bytes table: cannot grow to {ne} entries ({self.size} keys held)")
        with nogil:
            for j in range(self.nentries):
                if self.entries[j].val != EMPTY:
                    k = self.entries[j].h & nmask
                    while e[k].val != EMPTY:
                        k = (k + 1) & nmask
                    e[k] = self.entries[j]
        free(self.entries)
        self._set_entries(e, ne)
        self.rehashes += 1
        return 0

    cdef int _reserve_data(self, uint64_t more) except -1:
        cdef uint64_t cap = self.data_cap
        cdef char* d
        if self.data_len + more <= cap:
            return 0
        cap = max(cap * 2, self.data_len + more, <uint64_t> 4096)
        d = <char*> realloc(self.data, cap)
        if d == NULL:
            raise _capacity_error(f"bytes table: cannot grow its key buffer to {cap} bytes")
        self.data = d
        self.data_cap = cap
        return 0

    cdef int _insert(self, const char* p, Py_ssize_t n, uint64_t h, uint32_t val) except -1:
        """Place a key known to be absent."""
        cdef uint64_t j
        if <uint64_t> n > 0xFFFFFFFFu:
            raise _capacity_error("bytes table: a key longer than 4 GiB")
        if self.size + 1 > self.grow_at:
            self._grow()
        if n > INLINE:
            self._reserve_data(<uint64_t> n)
        j = h & self.mask
        while self.entries[j].val != EMPTY:
            j = (j + 1) & self.mask
        self.entries[j].h = h
        self.entries[j].len = <uint32_t> n
        self.entries[j].val = val
        if n <= INLINE:
            self.entries[j].off = _word(p, n)
            self.entries[j].off2 = _word(p + 8, n - 8)
        else:
            memcpy(self.data + self.data_len, p, <size_t> n)
            self.entries[j].off = self.data_len
            self.data_len += <uint64_t> n
        self.size += 1
        return 0

    cdef uint32_t _erase(self, const char* p, Py_ssize_t n, uint64_t h) noexcept nogil:
        cdef uint64_t i = h & self.mask, j, home
        cdef uint32_t val
        cdef Entry* e
        while True:
            e = &self.entries[i]
            if e.val == EMPTY:
                return EMPTY
            if e.h == h and self._same(e, p, n):
                break
            i = (i + 1) & self.mask
        val = e.val
        if e.len > INLINE:
            self.data_dead += e.len
        # Backward shift: move later entries of the chain into the hole when the hole lies
        # between their home position and where they sit (cyclically).
        j = i
        while True:
            j = (j + 1) & self.mask
            if self.entries[j].val == EMPTY:
                break
            home = self.entries[j].h & self.mask
            if ((j - home) & self.mask) >= ((j - i) & self.mask):
                self.entries[i] = self.entries[j]
                i = j
        self.entries[i].val = EMPTY
        self.size -= 1
        return val

    cdef void _compact(self) noexcept:
        """Rewrite the key buffer without the bytes of erased keys (skipped if no memory)."""
        cdef uint64_t live = self.data_len - self.data_dead, pos = 0, j
        cdef uint64_t cap = max(live * 2, <uint64_t> 4096)
        cdef char* d = <char*> malloc(cap)
        if d == NULL:
            return
        for j in range(self.nentries):
            if self.entries[j].val != EMPTY and self.entries[j].len > INLINE:
                memcpy(d + pos, self.data + self.entries[j].off, self.entries[j].len)
                self.entries[j].off = pos
                pos += self.entries[j].len
        free(self.data)
        self.data = d
        self.data_cap = cap
        self.data_len = pos
        self.data_dead = 0

    cdef inline void _prefetch_home(self, uint64_t h) noexcept nogil:
        """Fetch the cache line of the home entry of hash ``h`` and the two lines after it
        (two entries a line): the probe loops do it PREFETCH_AHEAD keys before the probe. A
        probe that went on past the fetched entries waited on memory, and the stall on the
        entries past home was a third of the time of ``find`` with the home entry and the
        one after it fetched. Measured on 1M-key lookups, bytes/int64 in one run on a busy
        machine: 0.75x with the entry after home, 0.78-0.81x with the next line, 0.84x with
        the next two (0.85x with three: little more for another line per key)."""
        cdef const Entry* e = &self.entries[h & self.mask]
        ES_PREFETCH(e)
        ES_PREFETCH(e + 2)  # past the last entry: a hint only, never a fault
        ES_PREFETCH(e + 4)

    cdef inline void _prefetch_stored(self, uint64_t h, Py_ssize_t n) noexcept nogil:
        """For a key longer than INLINE (length ``n``, hash ``h``): fetch the stored bytes of
        its home entry, which the probe compares and which lie out of line. The probe loops
        call it half as far ahead as they fetch the home entry, which has arrived by then,
        so that such a key does not wait for two memory accesses in a row; short keys skip
        the entry read (only a key longer than INLINE can match an out-of-line one)."""
        cdef const Entry* e
        if n > INLINE:
            e = &self.entries[h & self.mask]
            if e.val != EMPTY and e.len > INLINE:
                ES_PREFETCH(self.data + e.off)

    cdef uint64_t* _hashes(self, KeyView* v, Py_ssize_t n) except NULL:
        cdef uint64_t* hs = <uint64_t*> malloc((n + 1) * sizeof(uint64_t))
        cdef Py_ssize_t j
        if hs == NULL:
            raise MemoryError("bytes table: cannot allocate hashes")
        with nogil:
            for j in range(n):
                hs[j] = hash_view(v[j], self.seed) & self.fp_mask
        return hs

    cdef inline bint _view_hashed(self, PyObject** items, Py_ssize_t k, Py_ssize_t n,
                                  KeyView* v, uint64_t* hs) noexcept nogil:
        """View and hash key ``k`` when it is bytes (False otherwise), fetching the object
        OBJ_AHEAD on: one touch of each scattered key object, with its hashing overlapping
        the fetches in flight, instead of a walk over the objects and one over their views."""
        cdef PyObject* o
        if k + OBJ_AHEAD < n:
            o = items[k + OBJ_AHEAD]
            ES_PREFETCH(o)
            ES_PREFETCH(ES_BYTES_SHORT_END(o))
        if not bytes_view(items[k], &v[k]):
            return False
        if v[k].n > 15:     # a long key: its end lies past the line fetched ahead
            ES_PREFETCH(v[k].p + v[k].n - 1)
        hs[k] = hash_view(v[k], self.seed) & self.fp_mask
        return True

    cdef Py_ssize_t _views_hashed(self, PyObject** items, Py_ssize_t n, KeyView* v,
                                  uint64_t* hs) noexcept nogil:
        """Views and hashes of the keys in one pass; returns at the first key that is not
        bytes (a str, or a wrong type), or ``n``."""
        cdef Py_ssize_t k
        for k in range(n):
            if not self._view_hashed(items, k, n, v, hs):
                return k
        return n

    cdef KeyView* _views(self, object keys, Py_ssize_t* n, uint64_t** hs_out) except NULL:
        """Views and hashes (``hs_out``) of ``keys``; the caller frees both. Bytes keys take
        the fused pass (:meth:`_views_hashed`); a batch holding a str or a wrong type goes
        through ``key_views`` (which encodes str and raises TypeError as always)."""
        cdef PyObject** items = key_items(keys, n)
        cdef KeyView* v = <KeyView*> malloc((n[0] + 1) * sizeof(KeyView))
        cdef uint64_t* hs = <uint64_t*> malloc((n[0] + 1) * sizeof(uint64_t))
        cdef Py_ssize_t done
        if v == NULL or hs == NULL:
            free(v)
            free(hs)
            raise MemoryError("bytes table: cannot allocate key views")
        with nogil:
            done = self._views_hashed(items, n[0], v, hs)
        if done < n[0]:
            free(v)
            free(hs)
            v = key_views(keys, n)
            try:
                hs = self._hashes(v, n[0])
            except BaseException:
                free(v)
                raise
        hs_out[0] = hs
        return v

    cdef inline Py_ssize_t _prime(self, PyObject** items, Py_ssize_t n, KeyView* v,
                                  uint64_t* hs, bint lazy) noexcept nogil:
        """The start of a probe pass: the first PREFETCH_AHEAD keys viewed and hashed (with
        ``lazy``) and their home entries fetched; returns the first key that is not bytes, or
        ``n``."""
        cdef Py_ssize_t k
        for k in range(min(n, <Py_ssize_t> PREFETCH_AHEAD)):
            if lazy and not self._view_hashed(items, k, n, v, hs):
                return k
            self._prefetch_home(hs[k])
        return n

    cdef inline bint _ahead(self, PyObject** items, Py_ssize_t j, Py_ssize_t n, KeyView* v,
                            uint64_t* hs, bint lazy) noexcept nogil:
        """The fetches ahead of probing key ``j``: key ``j + PREFETCH_AHEAD`` viewed and hashed
        (with ``lazy``) and its home entry fetched, the stored bytes of key
        ``j + PREFETCH_AHEAD // 2`` fetched; False when that first key is not bytes."""
        cdef Py_ssize_t k = j + PREFETCH_AHEAD
        if k < n:
            if lazy and not self._view_hashed(items, k, n, v, hs):
                return False
            self._prefetch_home(hs[k])
        k = j + PREFETCH_AHEAD // 2
        if k < n:
            self._prefetch_stored(hs[k], v[k].n)
        return True

    cdef Py_ssize_t _find_all(self, PyObject** items, Py_ssize_t n, KeyView* v, uint64_t* hs,
                              bint lazy, uint32_t* out, uint64_t* hits, KeySnapshot snapshot,
                              bint* no_memory) noexcept nogil:
        """The probe pass of ``find``, each key copied into ``snapshot`` (when given) as it is
        probed. ``lazy``: ``v``/``hs`` are filled here, key ``j + PREFETCH_AHEAD`` viewed and
        hashed while key ``j`` is probed, so the hashing overlaps the entry fetches in
        flight; returns at the first key that is not bytes. Otherwise ``v``/``hs`` hold every
        key already. Returns ``n`` when every key was probed."""
        cdef Py_ssize_t j, k = self._prime(items, n, v, hs, lazy)
        cdef uint32_t r
        if k < n:
            return k
        for j in range(n):
            if not self._ahead(items, j, n, v, hs, lazy):
                return j + PREFETCH_AHEAD
            r = self._find(v[j].p, v[j].n, hs[j])
            out[j] = r
            hits[0] += r != EMPTY
            if snapshot is not None and not snapshot_add(snapshot, v[j]):
                no_memory[0] = True
        return n

    def find(self, object keys, uint32_t[::1] out, KeySnapshot snapshot=None,
             bint plain_only=False):
        """Write the slot of each key into ``out`` (0xFFFFFFFF when absent); return hits.
        ``snapshot``, when given, is filled with a copy of ``keys``. ``plain_only``: a key
        that is not exactly ``bytes`` raises ``NotPlainBytes`` instead of taking the general
        views (the caller had not checked the batch: this pass checks it)."""
        cdef Py_ssize_t n, done
        cdef PyObject** items = key_items(keys, &n)
        cdef uint64_t hits = 0
        cdef KeyView* v = NULL
        cdef uint64_t* hs = NULL
        cdef bint no_memory = False
        if out.shape[0] < n:
            free(key_views(keys, &n))  # a wrong key type is still told first
            raise ValueError("find: output has too few rows")
        if n == 0:
            if snapshot is not None:
                snapshot.fill(NULL, 0)
            return 0
        try:
            v = <KeyView*> malloc((n + 1) * sizeof(KeyView))
            hs = <uint64_t*> malloc((n + 1) * sizeof(uint64_t))
            if v == NULL or hs == NULL:
                raise MemoryError("bytes table: cannot allocate key views")
            if snapshot is not None:
                snapshot.reserve(n, 16 * n)
            with nogil:
                done = self._find_all(items, n, v, hs, True, &out[0], &hits, snapshot,
                                      &no_memory)
            if done < n:
                if plain_only:
                    raise NotPlainBytes("a key is not exactly bytes")
                # a str or a wrong type: the general views (str encoded, TypeError raised)
                free(v)
                free(hs)
                v = hs = NULL
                hits = 0
                v = key_views(keys, &n)
                hs = self._hashes(v, n)
                if snapshot is not None:
                    snapshot.reserve(n, 16 * n)
                with nogil:
                    self._find_all(items, n, v, hs, False, &out[0], &hits, snapshot,
                                   &no_memory)
            if no_memory:
                raise MemoryError("cannot allocate a key snapshot")
        finally:
            free(hs)
            free(v)
        return hits

    def insert_new(self, object keys, const uint32_t[::1] vals):
        """Insert keys the caller knows are absent and unique, with their slots."""
        cdef Py_ssize_t n, j
        cdef uint64_t* hs = NULL
        cdef KeyView* v = self._views(keys, &n, &hs)
        try:
            if vals.shape[0] < n:
                raise ValueError("insert_new: fewer values than keys")
            for j in range(n):
                self._insert(v[j].p, v[j].n, hs[j], vals[j])
        finally:
            free(hs)
            free(v)

    def erase(self, object keys, uint32_t[::1] out):
        """Remove keys; ``out`` receives each removed key's slot or 0xFFFFFFFF."""
        cdef Py_ssize_t n, j
        cdef uint64_t removed = 0
        cdef uint64_t* hs = NULL
        cdef KeyView* v = self._views(keys, &n, &hs)
        if out.shape[0] < n:
            free(hs)
            free(v)
            raise ValueError("erase: output has too few rows")
        with nogil:
            for j in range(n):
                out[j] = self._erase(v[j].p, v[j].n, hs[j])
                removed += out[j] != EMPTY
        free(hs)
        free(v)
        if self.data_dead > COMPACT_MIN and self.data_dead * 2 > self.data_len:
            self._compact()
        return removed

    def items(self):
        """``(keys, slots)``: every key (object array of bytes) and its slot (uint32)."""
        keys = np.empty(self.size, dtype=object)
        vals = np.empty(self.size, dtype=np.uint32)
        cdef uint32_t[::1] vo = vals
        cdef uint64_t j, k = 0
        cdef Entry* e
        for j in range(self.nentries):
            e = &self.entries[j]
            if e.val != EMPTY:
                keys[k] = ((<char*> &e.off)[:e.len] if e.len <= INLINE
                           else self.data[e.off:e.off + e.len])
                vo[k] = e.val
                k += 1
        return keys, vals

    def clear(self):
        cdef uint64_t j
        for j in range(self.nentries):
            self.entries[j].val = EMPTY
        self.size = 0
        self.data_len = 0
        self.data_dead = 0


# find_or_insert, the probe-and-insert pass with its undo and the count of repeated new keys:
# compiled into this module (the table's inline probes stay inline), read on its own
include "bytestable_place.pxi"
