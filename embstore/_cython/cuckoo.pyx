# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Bucketized cuckoo hash table (int64 key -> uint32 slot) and a chunked record arena.

Two hash functions pick two buckets of four slots each; a bucket (four keys, four values,
padding) fills exactly one 64-byte cache line, so a lookup touches at most two lines and the
worst case is O(1). An insert that finds both buckets full evicts an occupant to its other
bucket (breadth-limited random walk, MAX_KICKS); when the walk fails or the load factor
passes MAX_LOAD the table doubles and every key is reinserted. No key is ever dropped: the
key being displaced when a walk fails is carried into the grown table.

The arena stores fixed-width records in chunks of CHUNK_ROWS rows, so growth never copies
records and never leaves more than one partly used chunk; freed slots are reused.

This module imports nothing from embstore; callers pass clean, contiguous arrays.
"""

cimport cython
from libc.stdint cimport int64_t, uint64_t, uint32_t, uint8_t
from libc.stdlib cimport malloc, calloc, free, realloc
from libc.string cimport memcpy, memset

cdef extern from *:
    """
    #if defined(__GNUC__)
    #define ES_PREFETCH(p) __builtin_prefetch((const void*)(p), 0, 1)
    #define ES_PREFETCH_W(p) __builtin_prefetch((const void*)(p), 1, 1)
    #else
    #define ES_PREFETCH(p) ((void)0)
    #define ES_PREFETCH_W(p) ((void)0)
    #endif
    #include <stdlib.h>
    #include <sys/mman.h>
    #include <pthread.h>
    #ifndef MADV_POPULATE_WRITE
    #define MADV_POPULATE_WRITE 23
    #endif
    /* Chunk memory comes straight from mmap so that it can be populated ahead of use. */
    static void* es_map(size_t n) {
        void* p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        return p == MAP_FAILED ? NULL : p;
    }
    static void es_unmap(void* p, size_t n) { if (p) munmap(p, n); }
    typedef struct { void* p; size_t n; } es_span;
    static void* es_populate_worker(void* arg) {
        es_span s = *(es_span*)arg;
        free(arg);
        /* Faults the pages in without changing their contents, so it is harmless even if
           the owner already writes into them (or has unmapped them: then it just fails). */
        /* In 256 KiB steps: each call holds the address-space lock, and the owner's own
           mmap calls (a new chunk, a bigger hash table) must not wait for a whole chunk. */
        for (size_t off = 0; off < s.n; off += (size_t)1 << 18) {
            size_t len = s.n - off < ((size_t)1 << 18) ? s.n - off : ((size_t)1 << 18);
            if (madvise((char*)s.p + off, len, MADV_POPULATE_WRITE) != 0) break;
        }
        return NULL;
    }
    /* Populate [p, p+n) on a detached thread; 0 when the thread started. */
    static int es_populate_async(void* p, size_t n) {
        pthread_t t;
        pthread_attr_t a;
        es_span* s = (es_span*)malloc(sizeof(es_span));
        if (!s) return -1;
        s->p = p; s->n = n;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&a, 64 * 1024);
        int rc = pthread_create(&t, &a, es_populate_worker, s);
        pthread_attr_destroy(&a);
        if (rc != 0) { free(s); return -1; }
        return 0;
    }
    """
    void ES_PREFETCH(const void* p) nogil
    void ES_PREFETCH_W(const void* p) nogil
    void* es_map(size_t n) nogil
    void es_unmap(void* p, size_t n) nogil
    int es_populate_async(void* p, size_t n) nogil

cdef enum:
    BUCKET = 4
    MAX_KICKS = 500
    PREFETCH_AHEAD = 16
    SPARE_CHUNKS = 4
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


@cython.final
cdef class RecordArena:
    """Fixed-width records in chunks; slots are uint32 indices, freed slots are reused.

    Chunks are mapped straight from the kernel. Writing a fresh row costs a page fault per
    4 KiB, which on a VM is most of the cost of inserting a new key (measured ~1.5 us per
    page here, 0.1 s per million 288-byte rows). Once the arena has grown to four chunks it
    therefore keeps up to SPARE_CHUNKS chunks mapped ahead of use and has a short-lived
    background thread fault them in (``MADV_POPULATE_WRITE``) while the caller fills the
    current one; ``prefault=False`` turns that off.
    """

    cdef uint8_t** chunks        # nchunks chunks in use, then nspare mapped ahead of use
    cdef Py_ssize_t nchunks
    cdef Py_ssize_t nspare
    cdef Py_ssize_t chunk_cap
    cdef public Py_ssize_t itemsize
    cdef public Py_ssize_t chunk_rows
    cdef public bint prefault
    cdef size_t chunk_bytes
    cdef uint64_t next_slot      # slots below this were handed out at least once
    cdef uint32_t* free_list
    cdef Py_ssize_t nfree
    cdef Py_ssize_t free_cap
    cdef int shift
    cdef uint64_t low_mask

    def __cinit__(self, Py_ssize_t itemsize, int chunk_shift=14, bint prefault=True):
        if itemsize <= 0:
            raise ValueError("itemsize must be positive")
        self.itemsize = itemsize
        self.shift = chunk_shift
        self.chunk_rows = 1 << chunk_shift
        self.chunk_bytes = <size_t> self.chunk_rows * <size_t> itemsize
        self.low_mask = self.chunk_rows - 1
        self.prefault = prefault
        self.chunks = NULL
        self.nchunks = 0
        self.nspare = 0
        self.chunk_cap = 0
        self.next_slot = 0
        self.free_list = NULL
        self.nfree = 0
        self.free_cap = 0

    cdef void _unmap_all(self) noexcept:
        cdef Py_ssize_t i
        for i in range(self.nchunks + self.nspare):
            es_unmap(self.chunks[i], self.chunk_bytes)
        self.nchunks = 0
        self.nspare = 0

    def __dealloc__(self):
        if self.chunks != NULL:
            self._unmap_all()
            free(self.chunks)
            self.chunks = NULL
        if self.free_list != NULL:
            free(self.free_list)
            self.free_list = NULL

    @property
    def nbytes(self):
        return (self.nchunks + self.nspare) * self.chunk_bytes + self.free_cap * 4

    @property
    def live(self):
        return self.next_slot - self.nfree

    cdef int _map_chunk(self) except -1:
        """Map one more chunk after those in use and the spares; return its index."""
        cdef uint8_t** nc
        cdef Py_ssize_t n = self.nchunks + self.nspare
        if n == self.chunk_cap:
            self.chunk_cap = self.chunk_cap * 2 + 8
            nc = <uint8_t**> realloc(self.chunks, self.chunk_cap * sizeof(uint8_t*))
            if nc == NULL:
                raise MemoryError("record arena: cannot grow chunk index")
            self.chunks = nc
        cdef uint8_t* c = <uint8_t*> es_map(self.chunk_bytes)
        if c == NULL:
            raise MemoryError("record arena: cannot allocate a chunk")
        self.chunks[n] = c
        return n

    cdef int _add_chunk(self) except -1:
        cdef Py_ssize_t want, i
        if self.nspare > 0:
            self.nspare -= 1        # the first spare becomes the chunk in use
        else:
            self._map_chunk()
        self.nchunks += 1
        if self.prefault:
            # Spares grow with the arena (one per four chunks in use, at most SPARE_CHUNKS),
            # so the memory held ahead stays a small fraction of what the store uses.
            want = min(<Py_ssize_t> SPARE_CHUNKS, self.nchunks // 4)
            while self.nspare < want:
                i = self._map_chunk()
                self.nspare += 1
                es_populate_async(self.chunks[i], self.chunk_bytes)
        return 0

    cdef inline uint32_t _alloc_one(self) except? 0xFFFFFFFF:
        if self.nfree > 0:
            self.nfree -= 1
            return self.free_list[self.nfree]
        if self.next_slot >= 0xFFFFFFFEu:
            raise MemoryError("record arena: more than 2**32-2 records")
        if (self.next_slot >> self.shift) >= <uint64_t> self.nchunks:
            self._add_chunk()
        self.next_slot += 1
        return <uint32_t> (self.next_slot - 1)

    def alloc(self, uint32_t[::1] out):
        """Hand out len(out) slots (reusing freed ones first)."""
        cdef Py_ssize_t n = out.shape[0], j
        for j in range(n):
            out[j] = self._alloc_one()

    def release(self, const uint32_t[::1] slots):
        """Return slots to the free list (0xFFFFFFFF entries are ignored)."""
        cdef Py_ssize_t n = slots.shape[0], j
        cdef uint32_t* nf
        if self.nfree + n > self.free_cap:
            self.free_cap = max(self.free_cap * 2, self.nfree + n, 1024)
            nf = <uint32_t*> realloc(self.free_list, self.free_cap * sizeof(uint32_t))
            if nf == NULL:
                raise MemoryError("record arena: cannot grow free list")
            self.free_list = nf
        for j in range(n):
            if slots[j] != EMPTY:
                self.free_list[self.nfree] = slots[j]
                self.nfree += 1

    cdef inline uint8_t* _row(self, uint32_t slot) noexcept nogil:
        return self.chunks[slot >> self.shift] + (slot & self.low_mask) * self.itemsize

    def gather(self, const uint32_t[::1] slots, uint8_t[:, ::1] out,
               Py_ssize_t offset=0, Py_ssize_t nbytes=-1):
        """Copy bytes [offset, offset+nbytes) of each slot's record into the rows of ``out``;
        rows for 0xFFFFFFFF slots are zeroed."""
        cdef Py_ssize_t n = slots.shape[0], j
        if nbytes < 0:
            nbytes = self.itemsize - offset
        if offset < 0 or offset + nbytes > self.itemsize or out.shape[1] != nbytes:
            raise ValueError("gather: field range does not fit the record")
        if out.shape[0] < n:
            raise ValueError("gather: output has too few rows")
        cdef uint8_t* ahead
        with nogil:
            for j in range(n):
                if j + PREFETCH_AHEAD < n and slots[j + PREFETCH_AHEAD] != EMPTY:
                    # the field's first and last line: the hardware streams the lines in
                    # between, and issuing all five of a 288-byte record measured slower at
                    # 10M keys (more misses in flight than the core can track)
                    ahead = self._row(slots[j + PREFETCH_AHEAD]) + offset
                    ES_PREFETCH(ahead)
                    ES_PREFETCH(ahead + nbytes - 1)
                if slots[j] == EMPTY:
                    memset(&out[j, 0], 0, nbytes)
                else:
                    memcpy(&out[j, 0], self._row(slots[j]) + offset, nbytes)

    def scatter(self, const uint32_t[::1] slots, const uint8_t[:, ::1] src):
        """Write whole records from the rows of ``src`` into the slots."""
        cdef Py_ssize_t n = slots.shape[0], j
        if src.shape[1] != self.itemsize or src.shape[0] < n:
            raise ValueError("scatter: source rows do not match the record size")
        with nogil:
            for j in range(n):
                memcpy(self._row(slots[j]), &src[j, 0], self.itemsize)

    cdef int _check_slots(self, const uint32_t[::1] slots, str what) except -1:
        # Writes in place trust the slots: refuse any that was never handed out.
        cdef Py_ssize_t j
        for j in range(slots.shape[0]):
            if slots[j] == EMPTY or slots[j] >= self.next_slot:
                raise ValueError(f"{what}: a slot is not in the arena")
        return 0

    def update_rows(self, const uint32_t[::1] slots, Py_ssize_t axpy_offset,
                    const float[:, ::1] x, float alpha, const Py_ssize_t[::1] add_offsets,
                    const int64_t[:, ::1] add_values, const Py_ssize_t[::1] set_offsets,
                    const uint64_t[::1] set_bits):
        """In place, per slot j: ``float32 field at axpy_offset += alpha * x[j]``; for each
        f, ``int64 at add_offsets[f] += add_values[f, j]``; for each s, the 8 bytes at
        ``set_offsets[s]`` = ``set_bits[s]``. One pass, each record touched once."""
        cdef Py_ssize_t n = slots.shape[0], d = x.shape[1], j, k, f
        cdef Py_ssize_t na = add_offsets.shape[0], ns = set_offsets.shape[0]
        cdef uint8_t* row
        cdef float* v
        cdef int64_t* c
        if x.shape[0] < n or (na and add_values.shape[1] < n) or add_values.shape[0] < na \
                or set_bits.shape[0] < ns:
            raise ValueError("update_rows: value arrays are shorter than the slots")
        if axpy_offset < 0 or axpy_offset + d * 4 > self.itemsize:
            raise ValueError("update_rows: the float field does not fit the record")
        for f in range(na):
            if add_offsets[f] < 0 or add_offsets[f] + 8 > self.itemsize:
                raise ValueError("update_rows: an int field does not fit the record")
        for f in range(ns):
            if set_offsets[f] < 0 or set_offsets[f] + 8 > self.itemsize:
                raise ValueError("update_rows: a set field does not fit the record")
        self._check_slots(slots, "update_rows")
        with nogil:
            for j in range(n):
                if j + PREFETCH_AHEAD < n:
                    row = self._row(slots[j + PREFETCH_AHEAD])
                    ES_PREFETCH_W(row)          # for writing: the record changes in place
                    ES_PREFETCH_W(row + self.itemsize - 1)
                row = self._row(slots[j])
                v = <float*> (row + axpy_offset)
                for k in range(d):
                    v[k] = v[k] + alpha * x[j, k]
                for f in range(na):
                    c = <int64_t*> (row + add_offsets[f])
                    c[0] += add_values[f, j]
                for f in range(ns):
                    memcpy(row + set_offsets[f], &set_bits[f], 8)

    def write_rows(self, const uint32_t[::1] slots, const uint8_t[::1] template,
                   Py_ssize_t vec_offset, const float[:, ::1] vectors):
        """Write each slot's record as ``template`` with row j of ``vectors`` (float32) at
        ``vec_offset``: new records without building them in a separate buffer first."""
        cdef Py_ssize_t n = slots.shape[0], j
        cdef Py_ssize_t vbytes = vectors.shape[1] * 4, vec_end = vec_offset + vbytes
        cdef uint8_t* row
        if template.shape[0] != self.itemsize or vectors.shape[0] < n or vec_offset < 0 \
                or vec_end > self.itemsize:
            raise ValueError("write_rows: template or vectors do not fit the record")
        self._check_slots(slots, "write_rows")
        with nogil:
            for j in range(n):
                row = self._row(slots[j])
                memcpy(row, &template[0], vec_offset)
                memcpy(row + vec_offset, &vectors[j, 0], vbytes)
                memcpy(row + vec_end, &template[vec_end], self.itemsize - vec_end)

    def clear(self):
        self._unmap_all()
        self.next_slot = 0
        self.nfree = 0


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
