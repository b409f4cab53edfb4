# find_or_insert of bytestable.pyx (included there, one compiled module): each key's slot, an
# absent key placed with a fresh arena slot in the same probe pass; all or nothing.

@cython.final
cdef class _SlotSet:
    """The arena slots handed out by one ``find_or_insert`` call (open addressing over a
    power-of-two array of uint32, EMPTY where free): a later occurrence of a key inserted by
    the same call finds its slot here, which counts it as a miss without a second pass over
    the keys (see :func:`_count_repeats`)."""

    cdef uint32_t* slots
    cdef uint64_t mask

    def __cinit__(self, Py_ssize_t n):
        cdef uint64_t cap = 16
        while cap < 2 * <uint64_t> n:
            cap *= 2
        self.slots = <uint32_t*> malloc(cap * sizeof(uint32_t))
        if self.slots == NULL:
            raise MemoryError("find_or_insert: no memory for the batch")
        memset(self.slots, 0xFF, cap * sizeof(uint32_t))
        self.mask = cap - 1

    def __dealloc__(self):
        free(self.slots)

    cdef inline uint64_t _home(self, uint32_t r) noexcept nogil:
        return ((<uint64_t> r * 0x9E3779B97F4A7C15ULL) >> 32) & self.mask

    cdef inline void add(self, uint32_t r) noexcept nogil:
        cdef uint64_t j = self._home(r)
        while self.slots[j] != EMPTY:
            j = (j + 1) & self.mask
        self.slots[j] = r

    cdef inline bint has(self, uint32_t r) noexcept nogil:
        cdef uint64_t j = self._home(r)
        while self.slots[j] != EMPTY:
            if self.slots[j] == r:
                return True
            j = (j + 1) & self.mask
        return False

    cdef inline void prefetch(self, uint32_t r) noexcept nogil:
        ES_PREFETCH(&self.slots[self._home(r)])


cdef uint64_t _count_repeats(const uint32_t[::1] out, Py_ssize_t n, const Py_ssize_t* new_at,
                             uint64_t inserted) except? 0:
    """How many of the ``n`` positions hold a key that this ``find_or_insert`` call inserted
    at an earlier position (``out``: every position's slot; ``new_at``: the ``inserted``
    positions where keys went in). A set of the new slots, then a look-up of every slot,
    each fetched PREFETCH_AHEAD ahead: done in the probe loop, the set's random reads and
    writes waited on memory for 40% of that loop at 48,000-key batches (the set outgrew
    the caches the probe's keys and entries were passing through)."""
    cdef _SlotSet fresh = _SlotSet(inserted)
    cdef uint64_t i, found = 0
    cdef Py_ssize_t j
    with nogil:
        for i in range(inserted):
            if i + PREFETCH_AHEAD < inserted:
                fresh.prefetch(out[new_at[i + PREFETCH_AHEAD]])
            fresh.add(out[new_at[i]])
        for j in range(n):
            if j + PREFETCH_AHEAD < n:
                fresh.prefetch(out[j + PREFETCH_AHEAD])
            found += fresh.has(out[j])
    return found - inserted     # each inserted position finds itself


cdef void _undo(BytesTable table, RecordArena arena, const KeyView* v, const uint64_t* hs,
                const Py_ssize_t* new_at, uint64_t inserted, list gone) except *:
    """All or nothing: the keys a ``find_or_insert`` call inserted leave again, and their
    slots (and the slots in ``gone``) go back to the arena."""
    cdef uint64_t i
    for i in range(inserted):
        gone.append(table._erase(v[new_at[i]].p, v[new_at[i]].n, hs[new_at[i]]))
    arena.release(np.array(gone, dtype=np.uint32))


cdef enum:
    _PLACED = 0
    _NOT_BYTES = 1      # a key that is not bytes stopped the pass; nothing stays inserted


cdef int _place(BytesTable table, RecordArena arena, PyObject** items, Py_ssize_t n,
                KeyView* v, uint64_t* hs, bint lazy, uint32_t[::1] out,
                uint8_t[::1] inserted_out, KeySnapshot snapshot, Py_ssize_t* new_at,
                uint64_t* inserted_count) except -1:
    """The probe-and-insert pass of :func:`find_or_insert`; ``inserted_count`` receives how
    many keys went in, ``new_at`` their positions. ``lazy``: ``v``/``hs`` are filled here, key ``j + PREFETCH_AHEAD`` viewed and
    hashed while key ``j`` is probed (one touch of each key object, its bytes still in cache
    for the probe: a separate pass over a 48,000-key batch found them evicted again), and a
    key that is not bytes undoes the pass and returns _NOT_BYTES. Otherwise ``v``/``hs`` hold
    every key already."""
    cdef Py_ssize_t j
    cdef uint64_t inserted = 0
    cdef uint32_t r
    cdef bint mark = inserted_out is not None
    if table._prime(items, n, v, hs, lazy) < n:
        return _NOT_BYTES
    for j in range(n):
        if not table._ahead(items, j, n, v, hs, lazy):
            _undo(table, arena, v, hs, new_at, inserted, [])
            return _NOT_BYTES
        r = table._find(v[j].p, v[j].n, hs[j])
        if r == EMPTY:
            r = arena._alloc_one()
            try:
                table._insert(v[j].p, v[j].n, hs[j], r)
            except BaseException:
                _undo(table, arena, v, hs, new_at, inserted, [r])
                raise
            new_at[inserted] = j
            inserted += 1
            if mark:
                inserted_out[j] = 1
        elif mark:
            inserted_out[j] = 0
        out[j] = r
        if snapshot is not None and not snapshot_add(snapshot, v[j]):
            _undo(table, arena, v, hs, new_at, inserted, [])
            raise MemoryError("cannot allocate a key snapshot")
    inserted_count[0] = inserted
    return _PLACED


def find_or_insert(BytesTable table, RecordArena arena, object keys, uint32_t[::1] out,
                   uint8_t[::1] inserted_out=None, KeySnapshot snapshot=None,
                   int64_t[::1] missed=None, bint plain_only=False):
    """Slot of each key in ``out``; an absent key gets a fresh arena slot and goes into the
    table in the same pass. ``inserted_out`` (optional) gets 1 where the key was inserted.
    Returns how many were. A repeated new key within ``keys`` is inserted once. When the table
    cannot grow (CapacityError) the keys this call inserted are removed again: the table is
    as it was before the call. ``snapshot``, when given, is filled with a copy of ``keys``.
    ``missed`` (optional, one element) receives how many positions held a key absent before
    the call: the inserted ones and the later occurrences of those keys. ``plain_only``: a
    key that is not exactly ``bytes`` raises ``NotPlainBytes`` with nothing inserted (the
    caller had not checked the batch: this pass checks it)."""
    cdef Py_ssize_t n
    cdef PyObject** items = key_items(keys, &n)
    cdef KeyView* v = NULL
    cdef uint64_t* hs = NULL
    cdef uint64_t inserted = 0
    # positions inserted by this call, undone if a later one fails (a C array: a Python list
    # append per new key cost as much as the probe)
    cdef Py_ssize_t* new_at = NULL
    if out.shape[0] < n or (inserted_out is not None and inserted_out.shape[0] < n):
        free(key_views(keys, &n))  # a wrong key type is still told first
        raise ValueError("find_or_insert: output has too few rows")
    if missed is not None and missed.shape[0] < 1:
        free(key_views(keys, &n))
        raise ValueError("find_or_insert: missed needs one element")
    try:
        v = <KeyView*> malloc((n + 1) * sizeof(KeyView))
        hs = <uint64_t*> malloc((n + 1) * sizeof(uint64_t))
        new_at = <Py_ssize_t*> malloc((n + 1) * sizeof(Py_ssize_t))
        if v == NULL or hs == NULL or new_at == NULL:
            raise MemoryError("find_or_insert: no memory for the batch")
        if snapshot is not None:
            snapshot.reserve(n, 16 * n)
        if _place(table, arena, items, n, v, hs, True, out, inserted_out, snapshot, new_at,
                  &inserted) == _NOT_BYTES:
            if plain_only:
                raise NotPlainBytes("a key is not exactly bytes")
            # a str (its UTF-8 form is the key) or a wrong type (TypeError): the general views
            free(v)
            free(hs)
            v = hs = NULL
            v = key_views(keys, &n)
            hs = table._hashes(v, n)
            if snapshot is not None:
                snapshot.reserve(n, 16 * n)
            _place(table, arena, items, n, v, hs, False, out, inserted_out, snapshot, new_at,
                   &inserted)
        if missed is not None:
            missed[0] = <int64_t> (inserted + (_count_repeats(out, n, new_at, inserted)
                                               if inserted else 0))
    finally:
        free(new_at)
        free(hs)
        free(v)
    return inserted
