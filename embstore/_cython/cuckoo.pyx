# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Bucketized cuckoo hash table (int64 key -> uint32 slot).

Two hash functions pick two buckets of four slots each; a bucket (four keys, four values,
padding) fills exactly one 64-byte cache line, so a lookup touches at most two lines and the
worst case is O(1). An insert that finds both buckets full evicts an occupant to its other
bucket (breadth-limited random walk, MAX_KICKS); when the walk fails or the load factor
passes MAX_LOAD the table doubles, each bucket splitting in place. No key is ever dropped: the
key being displaced when a walk fails is carried into the grown table.

The slots index the record arena (``arena.pyx``); ``find_or_insert`` allocates them there.

Beyond the arena this module imports nothing from embstore; callers pass clean, contiguous
arrays.
"""

cimport cython
from libc.stdint cimport int64_t, uint64_t, uint32_t, uint8_t
from libc.stdlib cimport malloc, free, realloc
from libc.string cimport memcpy, memset

from .arena cimport RecordArena

cdef extern from "es_prefetch.h":
    void ES_PREFETCH(const void* p) nogil

cdef enum:
    BUCKET = 4
    MAX_KICKS = 500
    PREFETCH_AHEAD = 16
cdef uint32_t EMPTY = 0xFFFFFFFFu
cdef double MAX_LOAD = 0.85

ctypedef struct Bucket:
    int64_t keys[4]
    uint32_t vals[4]
    uint8_t pad[16]


cdef inline uint64_t mix64(uint64_t z) noexcept nogil:
    z += 0x9E3779B97F4A7C15ULL
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
    return z ^ (z >> 31)


@cython.final
cdef class CuckooTable:
    """int64 -> uint32 map with cuckoo hashing. Values are arena slot numbers."""

    cdef Bucket* buckets
    cdef uint64_t nbuckets      # power of two
    cdef uint64_t mask
    cdef public uint64_t size
    cdef public uint64_t rehashes
    cdef uint64_t rng

    def __cinit__(self, uint64_t capacity=1024):
        cdef uint64_t nb = 16
        while nb * BUCKET * MAX_LOAD < capacity:
            nb *= 2
        self._alloc(nb)
        self.size = 0
        self.rehashes = 0
        self.rng = 0x2545F4914F6CDD1DULL

    cdef int _alloc(self, uint64_t nb, bint clear=True) except -1:
        cdef Bucket* b = <Bucket*> malloc(nb * sizeof(Bucket))
        if b == NULL:
            raise MemoryError("cuckoo table: cannot allocate %d buckets" % nb)
        if clear:
            memset(b, 0xFF, nb * sizeof(Bucket))
        self.buckets = b
        self.nbuckets = nb
        self.mask = nb - 1
        return 0

    def __dealloc__(self):
        if self.buckets != NULL:
            free(self.buckets)
            self.buckets = NULL

    def __len__(self):
        return self.size

    @property
    def capacity(self):
        return self.nbuckets * BUCKET

    @property
    def nbytes(self):
        return self.nbuckets * sizeof(Bucket)

    cdef inline uint64_t _b1(self, uint64_t h) noexcept nogil:
        return h & self.mask

    cdef inline uint64_t _b2(self, uint64_t h) noexcept nogil:
        cdef uint64_t b = (h >> 32) & self.mask
        if b == (h & self.mask):
            b = b ^ 1
        return b

    cdef inline uint32_t _find(self, int64_t key, uint64_t h) noexcept nogil:
        cdef Bucket* b = &self.buckets[self._b1(h)]
        cdef int i
        for i in range(BUCKET):
            if b.vals[i] != EMPTY and b.keys[i] == key:
                return b.vals[i]
        b = &self.buckets[self._b2(h)]
        for i in range(BUCKET):
            if b.vals[i] != EMPTY and b.keys[i] == key:
                return b.vals[i]
        return EMPTY

    cdef inline int _try_place(self, uint64_t bi, int64_t key, uint32_t val) noexcept nogil:
        cdef Bucket* b = &self.buckets[bi]
        cdef int i
        for i in range(BUCKET):
            if b.vals[i] == EMPTY:
                b.keys[i] = key
                b.vals[i] = val
                return 1
        return 0

    cdef int _insert_new(self, int64_t key, uint32_t val, int64_t* lost_key,
                         uint32_t* lost_val) noexcept nogil:
        """Place a key known to be absent. Returns 1 on success; 0 means the walk failed and
        (lost_key, lost_val) holds the entry left homeless, to be placed after a grow."""
        cdef uint64_t h = mix64(<uint64_t> key)
        cdef uint64_t bi = self._b1(h)
        cdef int kick, i
        cdef int64_t k2
        cdef uint32_t v2
        if self._try_place(bi, key, val) or self._try_place(self._b2(h), key, val):
            return 1
        for kick in range(MAX_KICKS):
            # xorshift to pick the victim slot; avoids cycles a fixed choice would fall into
            self.rng ^= self.rng << 13
            self.rng ^= self.rng >> 7
            self.rng ^= self.rng << 17
            i = <int> (self.rng & (BUCKET - 1))
            k2 = self.buckets[bi].keys[i]
            v2 = self.buckets[bi].vals[i]
            self.buckets[bi].keys[i] = key
            self.buckets[bi].vals[i] = val
            key = k2
            val = v2
            h = mix64(<uint64_t> key)
            bi = self._b2(h) if self._b1(h) == bi else self._b1(h)
            if self._try_place(bi, key, val):
                return 1
        lost_key[0] = key
        lost_val[0] = val
        return 0

    cdef int _natural_bucket(self, int64_t key, uint64_t j, uint64_t old_mask,
                             uint64_t* target) noexcept nogil:
        """Where an entry found in old bucket j lands after doubling, if that follows from the
        hash bit alone (0 when it was placed by the b1^1 tie rule and needs a real insert)."""
        cdef uint64_t h = mix64(<uint64_t> key)
        cdef uint64_t a = h & old_mask, b = (h >> 32) & old_mask
        if a == j:
            target[0] = h & self.mask
            return 1
        if b == j and b != a:
            target[0] = (h >> 32) & self.mask
            return 1
        return 0

    cdef int _split_double(self) except -1:
        """Double the table in place by splitting each bucket j into buckets j and j + old_nb.

        ``realloc`` extends the array (for a large table glibc moves the pages with mremap,
        no copy), so only the new upper half is fresh memory. Every entry placed by its own
        hash bits goes to one of the two halves of its old bucket, so the pass is sequential
        and never overflows a bucket; the rare entries placed by the tie rule are set aside and
        reinserted afterwards, growing again if a walk fails. Never drops a key; returns 1."""
        cdef uint64_t old_nb = self.nbuckets, old_mask = self.mask, j, t, nstash = 0, s
        cdef int i, nlo, nhi
        cdef int64_t lk
        cdef uint32_t lv
        cdef Bucket lo, hi
        cdef Bucket* grown = <Bucket*> realloc(self.buckets, 2 * old_nb * sizeof(Bucket))
        if grown == NULL:
            raise MemoryError("cuckoo table: cannot grow to %d buckets" % (2 * old_nb))
        # Tie-rule entries, at most all of them (in practice a handful): int64 key + slot.
        cdef int64_t* stash_k = <int64_t*> malloc(self.size * sizeof(int64_t) + 8)
        cdef uint32_t* stash_v = <uint32_t*> malloc(self.size * sizeof(uint32_t) + 4)
        if stash_k == NULL or stash_v == NULL:
            free(stash_k)
            free(stash_v)
            self.buckets = grown  # still the old contents, in a bigger block
            raise MemoryError("cuckoo table: cannot allocate the split's side list")
        self.buckets = grown
        self.nbuckets = 2 * old_nb
        self.mask = 2 * old_nb - 1
        with nogil:
            for j in range(old_nb):
                memset(&lo, 0xFF, sizeof(Bucket))
                memset(&hi, 0xFF, sizeof(Bucket))
                nlo = 0
                nhi = 0
                for i in range(BUCKET):
                    if grown[j].vals[i] == EMPTY:
                        continue
                    if self._natural_bucket(grown[j].keys[i], j, old_mask, &t):
                        if t == j:
                            lo.keys[nlo] = grown[j].keys[i]
                            lo.vals[nlo] = grown[j].vals[i]
                            nlo += 1
                        else:
                            hi.keys[nhi] = grown[j].keys[i]
                            hi.vals[nhi] = grown[j].vals[i]
                            nhi += 1
                    else:
                        stash_k[nstash] = grown[j].keys[i]
                        stash_v[nstash] = grown[j].vals[i]
                        nstash += 1
                grown[j] = lo               # bucket j was read in full above
                grown[j + old_nb] = hi
        try:
            for s in range(nstash):
                if not self._insert_new(stash_k[s], stash_v[s], &lk, &lv):
                    self._grow_with_pending(self.nbuckets * 2, lk, lv)
        finally:
            free(stash_k)
            free(stash_v)
        self.rehashes += 1
        return 1

    cdef int _grow(self, uint64_t new_nb) except -1:
        # Rehash from the old table into a bigger one; if a walk fails there, discard the
        # attempt and retry bigger, so the old table (which holds every key) stays intact.
        cdef Bucket* old = self.buckets
        cdef uint64_t old_nb = self.nbuckets
        cdef uint64_t j
        cdef int i, ok
        cdef int64_t lk
        cdef uint32_t lv
        if new_nb == old_nb * 2 and self._split_double():
            return 0
        while True:
            self._alloc(new_nb)
            ok = 1
            for j in range(old_nb):
                for i in range(BUCKET):
                    if old[j].vals[i] != EMPTY:
                        if not self._insert_new(old[j].keys[i], old[j].vals[i], &lk, &lv):
                            ok = 0
                            break
                if not ok:
                    break
            if ok:
                free(old)
                self.rehashes += 1
                return 0
            free(self.buckets)
            new_nb *= 2

    cdef int _grow_with_pending(self, uint64_t new_nb, int64_t pk, uint32_t pv) except -1:
        self._grow(new_nb)
        cdef int64_t lk
        cdef uint32_t lv
        while not self._insert_new(pk, pv, &lk, &lv):
            self._grow(self.nbuckets * 2)
            pk = lk
            pv = lv
        return 0

    cdef int _insert(self, int64_t key, uint32_t val) except -1:
        cdef int64_t lk
        cdef uint32_t lv
        if (self.size + 1) > self.nbuckets * BUCKET * MAX_LOAD:
            self._grow(self.nbuckets * 2)
        if not self._insert_new(key, val, &lk, &lv):
            self._grow_with_pending(self.nbuckets * 2, lk, lv)
        self.size += 1
        return 0

    def find(self, const int64_t[::1] keys, uint32_t[::1] out):
        """Write the slot of each key into ``out`` (0xFFFFFFFF when absent); return hits."""
        cdef Py_ssize_t n = keys.shape[0], j
        cdef uint64_t hits = 0
        cdef uint64_t h
        cdef uint32_t v
        with nogil:
            for j in range(n):
                if j + PREFETCH_AHEAD < n:
                    h = mix64(<uint64_t> keys[j + PREFETCH_AHEAD])
                    ES_PREFETCH(&self.buckets[self._b1(h)])
                    ES_PREFETCH(&self.buckets[self._b2(h)])
                v = self._find(keys[j], mix64(<uint64_t> keys[j]))
                out[j] = v
                if v != EMPTY:
                    hits += 1
        return hits

    def insert_new(self, const int64_t[::1] keys, const uint32_t[::1] vals):
        """Insert keys the caller knows are absent and unique, with their slots."""
        cdef Py_ssize_t n = keys.shape[0], j
        if (self.size + n) > self.nbuckets * BUCKET * MAX_LOAD:
            while (self.size + n) > self.nbuckets * BUCKET * MAX_LOAD:
                self._grow(self.nbuckets * 2)
        cdef uint64_t h
        for j in range(n):
            if j + PREFETCH_AHEAD < n:
                h = mix64(<uint64_t> keys[j + PREFETCH_AHEAD])
                ES_PREFETCH(&self.buckets[self._b1(h)])
                ES_PREFETCH(&self.buckets[self._b2(h)])
            self._insert(keys[j], vals[j])

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
                h = mix64(<uint64_t> keys[j])
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
    ``inserted_out`` (optional) gets 1 where the key was inserted. Returns how many were."""
    cdef Py_ssize_t n = keys.shape[0], j
    cdef uint64_t h, inserted = 0
    cdef uint32_t v
    cdef bint mark = inserted_out is not None
    if out.shape[0] < n or (mark and inserted_out.shape[0] < n):
        raise ValueError("find_or_insert: output has too few rows")
    for j in range(n):
        if j + PREFETCH_AHEAD < n:
            h = mix64(<uint64_t> keys[j + PREFETCH_AHEAD])
            ES_PREFETCH(&table.buckets[table._b1(h)])
            ES_PREFETCH(&table.buckets[table._b2(h)])
        v = table._find(keys[j], mix64(<uint64_t> keys[j]))
        if v == EMPTY:
            v = arena._alloc_one()
            table._insert(keys[j], v)
            inserted += 1
            if mark:
                inserted_out[j] = 1
        elif mark:
            inserted_out[j] = 0
        out[j] = v
    return inserted
