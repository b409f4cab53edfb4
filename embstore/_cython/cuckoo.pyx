# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Bucketized cuckoo hash table (int64 key -> uint32 slot).

Two hash functions pick two buckets of four slots each; a bucket (four keys, four values,
padding) fills exactly one 64-byte cache line, so a lookup touches at most two lines and the
worst case is O(1). A new key goes to the emptier of its two buckets; when both are full, one
occupant is moved to its other bucket (first a one-step search, then a random walk of at most
MAX_KICKS). When the walk fails or the load factor passes MAX_LOAD the table doubles, each
bucket splitting in place. A failed walk is undone step by step before the table grows, so a
doubling that runs out of memory (``MemoryError``) leaves the table exactly as it was; so does
``find_or_insert``, which takes back the keys it inserted earlier in the same call.

The hash is splitmix64 of ``key ^ seed`` with a per-table seed (random unless given): keys
crafted to collide under one seed do not collide under another. As a second guard, a walk that
fails while the table is less than 1/8 full (at 4096 buckets or more) raises ``MemoryError``
instead of doubling again: only colliding keys do that.

The buckets live in a reserved address range (``es_memory.h``), advised onto transparent huge
pages unless ``huge_pages=False`` (see ``arena.pyx`` for why and what it costs), so a doubling
keeps the table where it is and the half it grows into is faulted in on a background thread before
it is needed.

The slots index the record arena (``arena.pyx``); ``find_or_insert`` allocates them there.

Beyond the arena this module imports nothing from embstore; callers pass clean, contiguous
arrays.
"""

cimport cython
from libc.stdint cimport int64_t, uint64_t, uint32_t, uint8_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset

import array
import os

from .arena cimport RecordArena

cdef extern from "es_prefetch.h":
    void ES_PREFETCH(const void* p) nogil

cdef extern from "es_hash.h":
    uint64_t mix64 "es_mix64"(uint64_t z) nogil

cdef extern from "es_memory.h":
    ctypedef struct es_region:
        char* base
        size_t committed
        size_t reserved
    int es_region_init(es_region* r, size_t need, int huge) nogil
    int es_region_commit(es_region* r, size_t need) nogil
    void es_region_free(es_region* r) nogil
    int es_populate_async(void* p, size_t n) nogil

cdef enum:
    BUCKET = 4
    MAX_KICKS = 500
    PREFETCH_AHEAD = 32
cdef uint32_t EMPTY = 0xFFFFFFFFu

cdef double MAX_LOAD = 0.85
# A failed walk below this load (in tables of at least COLLISION_MIN_BUCKETS) means colliding
# keys, not a full table: refuse to double instead of growing without bound.
cdef double COLLISION_LOAD = 0.125
cdef uint64_t COLLISION_MIN_BUCKETS = 4096
# Test hook (``_fail_next_grows``): the next N doublings fail as if memory ran out.
cdef Py_ssize_t _grow_failures_to_inject = 0


def _fail_next_grows(Py_ssize_t n):
    """Make the next ``n`` table doublings (of any table in this process) raise
    ``MemoryError`` before changing anything, as when memory runs out. For tests."""
    global _grow_failures_to_inject
    _grow_failures_to_inject = n
# The upper half a doubling will write into is committed and faulted in on a background
# thread once the table is this far towards its next doubling, and only for halves of at
# least PREPARE_MIN_BUCKETS (smaller ones fault in faster than a thread starts).
cdef double PREPARE_AT = 0.8
cdef uint64_t PREPARE_MIN_BUCKETS = 16384

ctypedef struct Bucket:
    int64_t keys[4]
    uint32_t vals[4]
    uint8_t pad[16]


@cython.final
cdef class CuckooTable:
    """int64 -> uint32 map with cuckoo hashing. Values are arena slot numbers."""

    cdef Bucket* buckets        # == <Bucket*> region.base
    cdef es_region region
    cdef uint64_t nbuckets      # power of two
    cdef uint64_t mask
    cdef uint64_t grow_at       # size beyond which the table doubles
    cdef uint64_t prepare_at    # size at which the next doubling's memory is made ready
    cdef bint prefault
    cdef public uint64_t size
    cdef public uint64_t rehashes
    cdef uint64_t rng
    cdef readonly uint64_t seed

    def __cinit__(self, uint64_t capacity=1024, bint prefault=True, seed=None,
                  bint huge_pages=True):
        cdef uint64_t nb = 16
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        self.seed = <uint64_t> (int(seed) & 0xFFFFFFFFFFFFFFFF)
        while nb * BUCKET * MAX_LOAD < capacity:
            nb *= 2
        if es_region_init(&self.region, nb * sizeof(Bucket), huge_pages) != 0:
            raise MemoryError("cuckoo table: cannot allocate %d buckets" % nb)
        self.prefault = prefault
        self.size = 0
        self.rehashes = 0
        self.rng = 0x2545F4914F6CDD1DULL
        self._set_buckets(nb)
        memset(self.buckets, 0xFF, nb * sizeof(Bucket))

    cdef void _set_buckets(self, uint64_t nb) noexcept nogil:
        self.buckets = <Bucket*> self.region.base
        self.nbuckets = nb
        self.mask = nb - 1
        self.grow_at = <uint64_t> (nb * BUCKET * MAX_LOAD)
        self.prepare_at = <uint64_t> (self.grow_at * PREPARE_AT)

    cdef void _prepare_next(self) noexcept nogil:
        """Commit the memory the next doubling grows into, and fault it in on a background
        thread while the table keeps filling, so the doubling itself only moves entries."""
        cdef size_t half = self.nbuckets * sizeof(Bucket)
        self.prepare_at = <uint64_t> -1
        if self.region.committed >= 2 * half:
            return
        if es_region_commit(&self.region, 2 * half) != 0:
            return              # not fatal here: the doubling tries again and raises
        self.buckets = <Bucket*> self.region.base   # moved if it outgrew its reservation
        if self.prefault and self.nbuckets >= PREPARE_MIN_BUCKETS:
            es_populate_async(self.region.base + half, half)

    def __dealloc__(self):
        es_region_free(&self.region)
        self.buckets = NULL

    def __len__(self):
        return self.size

    @property
    def capacity(self):
        return self.nbuckets * BUCKET

    @property
    def nbytes(self):
        """Bytes of memory committed (the buckets, and the next doubling's once prepared)."""
        return self.region.committed

    cdef inline uint64_t _hash(self, int64_t key) noexcept nogil:
        return mix64(<uint64_t> key ^ self.seed)

    cdef inline uint64_t _b1(self, uint64_t h) noexcept nogil:
        return h & self.mask

    cdef inline uint64_t _b2(self, uint64_t h) noexcept nogil:
        return _other(h, self.mask)

    cdef inline uint32_t _find(self, int64_t key, uint64_t h) noexcept nogil:
        return _match(&self.buckets[self._b1(h)], &self.buckets[self._b2(h)], key)

    cdef inline int _try_place(self, uint64_t bi, int64_t key, uint32_t val) noexcept nogil:
        cdef Bucket* b = &self.buckets[bi]
        cdef int i
        for i in range(BUCKET):
            if b.vals[i] == EMPTY:
                b.keys[i] = key
                b.vals[i] = val
                return 1
        return 0

    cdef inline int _free_in(self, uint64_t bi) noexcept nogil:
        cdef Bucket* b = &self.buckets[bi]
        return ((b.vals[0] == EMPTY) + (b.vals[1] == EMPTY) + (b.vals[2] == EMPTY)
                + (b.vals[3] == EMPTY))

    cdef int _move_one_out(self, uint64_t bi) noexcept nogil:
        """Move one occupant of the full bucket ``bi`` to its other bucket if that has room;
        returns the freed position or -1. The four other buckets are prefetched together, so
        this costs about one memory latency, not four in a row."""
        cdef uint64_t alt[4]
        cdef uint64_t h
        cdef int i
        cdef Bucket* b = &self.buckets[bi]
        for i in range(BUCKET):
            h = self._hash(b.keys[i])
            alt[i] = self._b2(h) if self._b1(h) == bi else self._b1(h)
            ES_PREFETCH(&self.buckets[alt[i]])
        for i in range(BUCKET):
            if self._try_place(alt[i], b.keys[i], b.vals[i]):
                return i
        return -1

    cdef int _insert_new(self, int64_t key, uint32_t val) noexcept nogil:
        """Place a key known to be absent. Returns 1 on success; 0 means the walk failed, and
        then every move it made has been undone: the table is exactly as before the call.

        The key goes to the emptier of its two buckets, which keeps buckets evenly filled
        and makes full pairs (and the walks they need) rare; a full pair first tries to
        move one occupant out in a single step, and only then starts a random walk."""
        cdef uint64_t h = self._hash(key)
        cdef uint64_t bi = self._b1(h), bj = self._b2(h)
        cdef int kick, i, f1 = self._free_in(bi), f2 = self._free_in(bj)
        cdef int64_t k2
        cdef uint32_t v2
        # the walk's path, to undo it when it fails
        cdef uint64_t path_b[MAX_KICKS]
        cdef int path_i[MAX_KICKS]
        if f1 or f2:
            self._try_place(bi if f1 >= f2 else bj, key, val)
            return 1
        i = self._move_one_out(bi)
        if i < 0:
            i = self._move_one_out(bj)
            if i >= 0:
                bi = bj
        if i >= 0:
            self.buckets[bi].keys[i] = key
            self.buckets[bi].vals[i] = val
            return 1
        for kick in range(MAX_KICKS):
            # xorshift to pick the victim slot; avoids cycles a fixed choice would fall into
            self.rng ^= self.rng << 13
            self.rng ^= self.rng >> 7
            self.rng ^= self.rng << 17
            i = <int> (self.rng & (BUCKET - 1))
            path_b[kick] = bi
            path_i[kick] = i
            k2 = self.buckets[bi].keys[i]
            v2 = self.buckets[bi].vals[i]
            self.buckets[bi].keys[i] = key
            self.buckets[bi].vals[i] = val
            key = k2
            val = v2
            h = self._hash(key)
            bi = self._b2(h) if self._b1(h) == bi else self._b1(h)
            if self._try_place(bi, key, val):
                return 1
        # Undo: put each displaced entry back where it was taken from, newest move first;
        # what comes out last is the key this call was given.
        for kick in range(MAX_KICKS - 1, -1, -1):
            bi = path_b[kick]
            i = path_i[kick]
            k2 = self.buckets[bi].keys[i]
            v2 = self.buckets[bi].vals[i]
            self.buckets[bi].keys[i] = key
            self.buckets[bi].vals[i] = val
            key = k2
            val = v2
        return 0

    cdef int _check_collisions(self) except -1:
        """Called when a walk failed: refuse to double a table that is nearly empty."""
        if (self.nbuckets >= COLLISION_MIN_BUCKETS
                and self.size < self.nbuckets * BUCKET * COLLISION_LOAD):
            raise MemoryError(
                "cuckoo table: keys collide under both hash functions at %.1f%% load in %d "
                "buckets (crafted keys?); refusing to grow further"
                % (100.0 * self.size / (self.nbuckets * BUCKET), self.nbuckets))
        return 0

    cdef int _grow(self) except -1:
        """Double the table in place by splitting each bucket j into buckets j and j + old_nb.

        The region keeps its address, so only the upper half is new memory (already faulted
        in when ``_prepare_next`` ran). An entry placed by its own hash bits goes to one of the
        two halves of its old bucket, chosen by the next bit of that hash, so the pass is
        sequential, branch-free per entry and never overflows a bucket; the rare entries
        placed by the tie rule (b2 == b1, so b1 ^ 1) are set aside and reinserted afterwards,
        growing again if a walk fails. Running out of memory raises ``MemoryError`` before
        anything changed (see the stash loop below for the one exception)."""
        cdef uint64_t old_nb = self.nbuckets, old_mask = self.mask, j, h, a, b, nstash = 0, s
        cdef uint64_t occ, via1, nat, bit
        cdef int i, nlo, nhi, shift = 0
        cdef int64_t k
        cdef uint32_t v
        cdef Bucket src
        cdef Bucket* lo
        cdef Bucket* hi
        cdef Bucket* grown
        global _grow_failures_to_inject
        while (<uint64_t> 1 << shift) < old_nb:
            shift += 1
        if _grow_failures_to_inject > 0:
            _grow_failures_to_inject -= 1
            raise MemoryError("cuckoo table: cannot grow to %d buckets (injected)"
                              % (2 * old_nb))
        if es_region_commit(&self.region, 2 * old_nb * sizeof(Bucket)) != 0:
            raise MemoryError("cuckoo table: cannot grow to %d buckets" % (2 * old_nb))
        # Tie-rule entries, at most all of them (in practice a handful): int64 key + slot.
        cdef int64_t* stash_k = <int64_t*> malloc(self.size * sizeof(int64_t) + 8)
        cdef uint32_t* stash_v = <uint32_t*> malloc(self.size * sizeof(uint32_t) + 4)
        if stash_k == NULL or stash_v == NULL:
            free(stash_k)
            free(stash_v)
            self.buckets = <Bucket*> self.region.base   # old contents, bigger region
            raise MemoryError("cuckoo table: cannot allocate the split's side list")
        self._set_buckets(2 * old_nb)
        grown = self.buckets
        with nogil:
            for j in range(old_nb):
                src = grown[j]      # copied first: bucket j is rewritten as it is read
                lo = &grown[j]
                hi = &grown[j + old_nb]
                nlo = 0
                nhi = 0
                for i in range(BUCKET):
                    k = src.keys[i]
                    v = src.vals[i]
                    h = self._hash(k)
                    a = h & old_mask
                    b = (h >> 32) & old_mask
                    occ = v != EMPTY
                    via1 = a == j
                    nat = via1 | ((b == j) & (b != a))
                    bit = ((h >> shift) if via1 else (h >> (32 + shift))) & 1
                    # Written to both, kept (counted) in one: no branch on the 50/50 bit.
                    lo.keys[nlo] = k
                    lo.vals[nlo] = v
                    hi.keys[nhi] = k
                    hi.vals[nhi] = v
                    nlo += <int> (occ & nat & (bit ^ 1))
                    nhi += <int> (occ & nat & bit)
                    if occ & (nat ^ 1):
                        stash_k[nstash] = k
                        stash_v[nstash] = v
                        nstash += 1
                for i in range(nlo, BUCKET):
                    lo.vals[i] = EMPTY
                for i in range(nhi, BUCKET):
                    hi.vals[i] = EMPTY
        # A walk failing here (at about 43% load: practically never with a seeded hash) needs
        # one more doubling; should that one run out of memory, the entries not yet placed
        # are lost. Everything else in this method fails before changing the table.
        try:
            for s in range(nstash):
                while not self._insert_new(stash_k[s], stash_v[s]):
                    self._grow()
        finally:
            free(stash_k)
            free(stash_v)
        self.rehashes += 1
        return 0

    cdef int _insert(self, int64_t key, uint32_t val) except -1:
        """Insert an absent key; on ``MemoryError`` the table is unchanged."""
        if self.size >= self.prepare_at:
            self._prepare_next()
        if self.size + 1 > self.grow_at:
            self._grow()
        while not self._insert_new(key, val):   # the failed walk was undone
            self._check_collisions()
            self._grow()
        self.size += 1
        return 0

    cdef uint32_t _erase_one(self, int64_t key) noexcept nogil:
        """Remove ``key``; return its slot or EMPTY."""
        cdef uint64_t h = self._hash(key)
        cdef Bucket* b = &self.buckets[self._b1(h)]
        cdef int i
        cdef uint32_t v
        for i in range(BUCKET):
            if b.vals[i] != EMPTY and b.keys[i] == key:
                v = b.vals[i]
                b.vals[i] = EMPTY
                self.size -= 1
                return v
        b = &self.buckets[self._b2(h)]
        for i in range(BUCKET):
            if b.vals[i] != EMPTY and b.keys[i] == key:
                v = b.vals[i]
                b.vals[i] = EMPTY
                self.size -= 1
                return v
        return EMPTY

    def find(self, const int64_t[::1] keys, uint32_t[::1] out):
        """Write the slot of each key into ``out`` (0xFFFFFFFF when absent); return hits."""
        cdef Py_ssize_t n = keys.shape[0], j
        cdef uint64_t hits = 0
        cdef uint64_t h
        cdef uint32_t v
        with nogil:
            for j in range(n):
                if j + PREFETCH_AHEAD < n:
                    h = self._hash(keys[j + PREFETCH_AHEAD])
                    ES_PREFETCH(&self.buckets[self._b1(h)])
                    ES_PREFETCH(&self.buckets[self._b2(h)])
                v = self._find(keys[j], self._hash(keys[j]))
                out[j] = v
                if v != EMPTY:
                    hits += 1
        return hits

    def insert_new(self, const int64_t[::1] keys, const uint32_t[::1] vals):
        """Insert keys the caller knows are absent and unique, with their slots. All or
        nothing: on ``MemoryError`` the keys inserted so far are taken out again."""
        cdef Py_ssize_t n = keys.shape[0], j = 0, t
        while self.size + n > self.grow_at:
            self._grow()
        cdef uint64_t h
        try:
            for j in range(n):
                if j + PREFETCH_AHEAD < n:
                    h = self._hash(keys[j + PREFETCH_AHEAD])
                    ES_PREFETCH(&self.buckets[self._b1(h)])
                    ES_PREFETCH(&self.buckets[self._b2(h)])
                self._insert(keys[j], vals[j])
        except BaseException:
            for t in range(j - 1, -1, -1):
                self._erase_one(keys[t])
            raise

    def erase(self, const int64_t[::1] keys, uint32_t[::1] out):
        """Remove keys; ``out`` receives each removed key's slot or 0xFFFFFFFF."""
        cdef Py_ssize_t n = keys.shape[0], j
        cdef uint64_t h
        cdef Bucket* b
        cdef int i, done
        cdef uint64_t removed = 0
        with nogil:
            for j in range(n):
                out[j] = EMPTY
                h = self._hash(keys[j])
                done = 0
                b = &self.buckets[self._b1(h)]
                for i in range(BUCKET):
                    if b.vals[i] != EMPTY and b.keys[i] == keys[j]:
                        out[j] = b.vals[i]
                        b.vals[i] = EMPTY
                        done = 1
                        break
                if not done:
                    b = &self.buckets[self._b2(h)]
                    for i in range(BUCKET):
                        if b.vals[i] != EMPTY and b.keys[i] == keys[j]:
                            out[j] = b.vals[i]
                            b.vals[i] = EMPTY
                            done = 1
                            break
                removed += done
            self.size -= removed
        return removed

    def items(self, int64_t[::1] keys_out, uint32_t[::1] vals_out):
        """Fill the arrays (length >= len(self)) with every (key, slot); return the count."""
        cdef uint64_t j, k = 0
        cdef int i
        if <uint64_t> keys_out.shape[0] < self.size or <uint64_t> vals_out.shape[0] < self.size:
            raise ValueError("output arrays are shorter than the table")
        with nogil:
            for j in range(self.nbuckets):
                for i in range(BUCKET):
                    if self.buckets[j].vals[i] != EMPTY:
                        keys_out[k] = self.buckets[j].keys[i]
                        vals_out[k] = self.buckets[j].vals[i]
                        k += 1
        return k

    def clear(self):
        memset(self.buckets, 0xFF, self.nbuckets * sizeof(Bucket))
        self.size = 0


def find_or_insert(CuckooTable table, RecordArena arena, const int64_t[::1] keys,
                   uint32_t[::1] out, uint8_t[::1] inserted_out=None):
    """Slot of each key in ``out``; an absent key gets a fresh arena slot and goes into the
    table in the same pass (one probe per key instead of a find and then an insert).
    ``inserted_out`` (optional) gets 1 where the key was inserted. Returns how many were.

    All or nothing: when the table or the arena runs out of memory (``MemoryError``) the
    keys this call inserted are taken out again and their slots returned to the arena."""
    cdef Py_ssize_t n = keys.shape[0], j
    cdef uint64_t h, inserted = 0
    cdef uint32_t v, pending = EMPTY
    cdef bint mark = inserted_out is not None
    cdef Py_ssize_t* new_at
    if out.shape[0] < n or (mark and inserted_out.shape[0] < n):
        raise ValueError("find_or_insert: output has too few rows")
    new_at = <Py_ssize_t*> malloc(n * sizeof(Py_ssize_t) + 8)   # where the new keys are
    if new_at == NULL:
        raise MemoryError("find_or_insert: cannot allocate the undo list")
    try:
        for j in range(n):
            if j + PREFETCH_AHEAD < n:
                h = table._hash(keys[j + PREFETCH_AHEAD])
                ES_PREFETCH(&table.buckets[table._b1(h)])
                ES_PREFETCH(&table.buckets[table._b2(h)])
            v = table._find(keys[j], table._hash(keys[j]))
            if v == EMPTY:
                v = arena._alloc_one()
                pending = v
                table._insert(keys[j], v)       # on MemoryError: not inserted, table as before
                pending = EMPTY
                out[j] = v
                new_at[inserted] = j
                inserted += 1
                if mark:
                    inserted_out[j] = 1
            elif mark:
                inserted_out[j] = 0
            out[j] = v
    except BaseException:
        _undo_inserts(table, arena, keys, out, new_at, inserted, pending)
        raise
    finally:
        free(new_at)
    return inserted


cdef int _undo_inserts(CuckooTable table, RecordArena arena, const int64_t[::1] keys,
                       uint32_t[::1] out, Py_ssize_t* new_at, uint64_t n,
                       uint32_t pending) except -1:
    """Take the ``n`` keys ``keys[new_at[:n]]`` out of the table again and return their slots
    (and ``pending``, a slot handed out for a key that did not make it in) to the arena."""
    cdef uint64_t t
    slots = array.array("I", [pending] if pending != EMPTY else [])
    for t in range(n):
        table._erase_one(keys[new_at[t]])
        slots.append(out[new_at[t]])
    try:
        arena.release(slots)
    except MemoryError:
        pass            # the slots stay unused: memory is leaked, no record is harmed
    return 0


# The read-only probe view of a table and the bucket match it shares with CuckooTable._find
include "cuckoo_probe.pxi"
