# The read-only probe of a CuckooTable (cuckoo.pyx includes this file): the view fused_tables
# probes a collection's tables through, and the bucket match CuckooTable._find shares.

cdef int probe_of(object table, CuckooProbe* p) except -1:
    """``p``: a view of ``table``'s buckets (a :class:`CuckooTable`), valid until the table
    next grows or is cleared: the caller holds the store's lock across its use."""
    cdef CuckooTable t
    if not isinstance(table, CuckooTable):
        raise TypeError(f"probe_of: not an int64 cuckoo table: {type(table).__name__}")
    t = <CuckooTable> table
    p.buckets, p.mask, p.seed = <const void*> t.buckets, t.mask, t.seed
    return 0


cdef Py_ssize_t probe_find(const CuckooProbe* p, const int64_t* keys, Py_ssize_t n,
                           uint32_t* out) noexcept nogil:
    """:meth:`CuckooTable.find` through a view (the same hash and buckets, read only): the
    slot of each key into ``out`` (``EMPTY`` when absent); returns how many were absent."""
    cdef const Bucket* buckets = <const Bucket*> p.buckets
    # the buckets of the keys requested ahead, kept until their key's turn (each key's hash
    # made once: PREFETCH_AHEAD is a power of two)
    cdef const Bucket* first[PREFETCH_AHEAD]
    cdef const Bucket* second[PREFETCH_AHEAD]
    cdef const Bucket* b
    cdef const Bucket* c
    cdef Py_ssize_t j, r, missing = 0
    cdef uint32_t v
    for j in range(min(n, PREFETCH_AHEAD)):
        _request(buckets, p, keys[j], &first[j], &second[j])
    for j in range(n):
        r = j & (PREFETCH_AHEAD - 1)
        b, c = first[r], second[r]
        if j + PREFETCH_AHEAD < n:
            _request(buckets, p, keys[j + PREFETCH_AHEAD], &first[r], &second[r])
        v = _match(b, c, keys[j])
        out[j] = v
        missing += v == EMPTY
    return missing


cdef inline void _request(const Bucket* buckets, const CuckooProbe* p, int64_t key,
                          const Bucket** b, const Bucket** c) noexcept nogil:
    """``key``'s two buckets into ``b`` and ``c``, requested from memory."""
    cdef uint64_t h = mix64(<uint64_t> key ^ p.seed)
    b[0], c[0] = &buckets[h & p.mask], &buckets[_other(h, p.mask)]
    ES_PREFETCH(b[0])
    ES_PREFETCH(c[0])


cdef inline uint32_t _match(const Bucket* b, const Bucket* c, int64_t key) noexcept nogil:
    """The value of ``key`` in bucket ``b`` or ``c`` (``EMPTY``: in neither). Every slot of
    both is compared and the match taken by a mask: which slot holds a key is random, so a
    scan that stops at it mispredicts about once a key (8% of a bags-of-8 forward's native
    call), and GCC turns a conditional select back into those branches. A key is in one
    slot at most; an empty slot's stale key is passed over by its value."""
    cdef uint32_t v = EMPTY, m
    cdef int i
    for i in range(BUCKET):
        m = 0u - <uint32_t> ((b.keys[i] == key) & (b.vals[i] != EMPTY))
        v = (b.vals[i] & m) | (v & ~m)
    for i in range(BUCKET):
        m = 0u - <uint32_t> ((c.keys[i] == key) & (c.vals[i] != EMPTY))
        v = (c.vals[i] & m) | (v & ~m)
    return v


cdef inline uint64_t _other(uint64_t h, uint64_t mask) noexcept nogil:
    # a key's second bucket (CuckooTable._b2), never its first
    cdef uint64_t b = (h >> 32) & mask
    return b ^ 1 if b == (h & mask) else b
