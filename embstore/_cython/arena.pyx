# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""A chunked arena of fixed-width records, indexed by uint32 slot.

Records live in chunks of ``chunk_rows`` rows, so growth never copies records and never leaves
more than one partly used chunk; freed slots are reused. The ``memory://`` backend keeps the
slot of each key in the cuckoo table (``cuckoo.pyx``) and its record here.

This module imports nothing from embstore; callers pass clean, contiguous arrays.
"""

from libc.stdint cimport int64_t, uint64_t, uint32_t, uint8_t
from libc.stdlib cimport malloc, free, realloc
from posix.unistd cimport usleep
from libc.string cimport memcpy, memset
from libc.math cimport sqrtf

cdef extern from "es_prefetch.h":
    void ES_PREFETCH(const void* p) nogil
    void ES_PREFETCH_W(const void* p) nogil

cdef extern from *:
    """
    #include "es_memory.h"
    /* Chunk memory comes straight from mmap so that it can be populated ahead of use.
       Chunks of closed or cleared arenas wait in a small process-wide pool (at most
       ES_POOL_MAX bytes) for the next arena: their pages are already faulted in, which is
       what makes opening store after store in one process (imports, tests) cheap. All
       calls happen with the GIL held, so the pool needs no lock of its own. */
    #define ES_POOL_SLOTS 1024
    #define ES_POOL_MAX ((size_t)512 << 20)
    static void* es_pool_p[ES_POOL_SLOTS];
    static size_t es_pool_n[ES_POOL_SLOTS];
    static int es_pool_h[ES_POOL_SLOTS];
    static int es_pool_len = 0;
    static size_t es_pool_bytes = 0;
    /* `n` bytes for a chunk, advised onto huge pages when `huge` (a pooled chunk is reused
       only by an arena that asks for the same size and the same advice). */
    static void* es_map(size_t n, int huge) {
        for (int i = es_pool_len - 1; i >= 0; i--) {
            if (es_pool_n[i] == n && es_pool_h[i] == huge) {
                void* p = es_pool_p[i];
                es_pool_len--;
                es_pool_p[i] = es_pool_p[es_pool_len];
                es_pool_n[i] = es_pool_n[es_pool_len];
                es_pool_h[i] = es_pool_h[es_pool_len];
                es_pool_bytes -= n;
                return p;
            }
        }
        void* p = huge ? es_map_aligned(n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS)
                       : mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return NULL;
        if (huge) es_advise_huge(p, n);
        return p;
    }
    static void es_unmap(void* p, size_t n, int huge) {
        if (!p) return;
        if (es_pool_len < ES_POOL_SLOTS && es_pool_bytes + n <= ES_POOL_MAX) {
            es_pool_p[es_pool_len] = p;
            es_pool_n[es_pool_len] = n;
            es_pool_h[es_pool_len] = huge;
            es_pool_len++;
            es_pool_bytes += n;
            return;
        }
        munmap(p, n);
    }
    static size_t es_pool_release(void) {
        size_t freed = es_pool_bytes;
        for (int i = 0; i < es_pool_len; i++) munmap(es_pool_p[i], es_pool_n[i]);
        es_pool_len = 0;
        es_pool_bytes = 0;
        return freed;
    }
    """
    void* es_map(size_t n, int huge) nogil
    void es_unmap(void* p, size_t n, int huge) nogil
    int es_populate_async(void* p, size_t n) nogil
    size_t es_pool_release()

cdef enum:
    PREFETCH_AHEAD = 16
    SPARE_CHUNKS = 4
    MIN_CHUNK_SHIFT = 14
    MAX_CHUNK_SHIFT = 20
    CHUNK_BYTES = 8 << 20
    SPARE_BYTES = 16 << 20
cdef uint32_t EMPTY = 0xFFFFFFFFu


cdef class RecordArena:
    """Fixed-width records in chunks; slots are uint32 indices, freed slots are reused.

    Chunks are mapped straight from the kernel. Writing a fresh row costs a page fault per
    4 KiB, which on a VM is most of the cost of inserting a new key (measured ~1.5 us per
    page here, 0.1 s per million 288-byte rows). Once the arena has grown to four chunks it
    therefore keeps up to SPARE_CHUNKS chunks mapped ahead of use and has a short-lived
    background thread fault them in (``MADV_POPULATE_WRITE``) while the caller fills the
    current one; ``prefault=False`` turns that off.

    With ``huge_pages`` (the default) chunks start on a 2 MiB boundary and are advised onto
    transparent huge pages. Records of a large table are read at random places, and on 4 KiB
    pages nearly each read also missed the TLB: at 30M keys of 80-byte records that doubled
    the cost of a lookup. The price is at first touch where the kernel must find free 2 MiB
    blocks: on a VM whose balloon returns free memory to its host, filling fresh memory ran
    2.5-4.5x slower than on 4 KiB pages. ``huge_pages=False`` keeps 4 KiB pages.

    A chunk holds ``2**chunk_shift`` records. By default (``chunk_shift=-1``) that is 2**14,
    and with ``huge_pages`` the smallest shift from 14 on that makes a chunk at least 8 MiB
    (at most 2**20 records): only a chunk of several huge pages is mostly backed by them.
    """


    def __cinit__(self, Py_ssize_t itemsize, int chunk_shift=-1, bint prefault=True,
                  bint huge_pages=True):
        if itemsize <= 0:
            raise ValueError("itemsize must be positive")
        if chunk_shift < 0:
            chunk_shift = MIN_CHUNK_SHIFT
            while (huge_pages and chunk_shift < MAX_CHUNK_SHIFT
                   and (itemsize << chunk_shift) < CHUNK_BYTES):
                chunk_shift += 1
        elif chunk_shift > 30:
            raise ValueError("chunk_shift must be at most 30")
        self.itemsize = itemsize
        self.shift = chunk_shift
        self.chunk_rows = 1 << chunk_shift
        self.chunk_bytes = <size_t> self.chunk_rows * <size_t> itemsize
        self.low_mask = self.chunk_rows - 1
        self.prefault = prefault
        self.huge_pages = huge_pages
        self.chunks = NULL
        self.nchunks = 0
        self.nspare = 0
        self.chunk_cap = 0
        self.next_slot = 0
        self.free_list = NULL
        self.nfree = 0
        self.free_cap = 0
        self.pins = 0

    cdef void _unmap_all(self) noexcept:
        cdef Py_ssize_t i
        for i in range(self.nchunks + self.nspare):
            es_unmap(self.chunks[i], self.chunk_bytes, self.huge_pages)
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
        cdef uint8_t* c = <uint8_t*> es_map(self.chunk_bytes, self.huge_pages)
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
            # Spares grow with the arena (one per four chunks in use, at most SPARE_CHUNKS
            # and SPARE_BYTES unless one chunk is more), so the memory held ahead stays a
            # small fraction of what the store uses.
            want = min(<Py_ssize_t> SPARE_CHUNKS, self.nchunks // 4,
                       max(<Py_ssize_t> 1, <Py_ssize_t> (SPARE_BYTES // self.chunk_bytes)))
            while self.nspare < want:
                i = self._map_chunk()
                self.nspare += 1
                es_populate_async(self.chunks[i], self.chunk_bytes)
        return 0

    cdef uint32_t _alloc_one(self) except? 0xFFFFFFFF:
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

    cdef uint8_t* _row(self, uint32_t slot) noexcept nogil:
        return self.chunks[slot >> self.shift] + (slot & self.low_mask) * self.itemsize

    cdef void pin(self) noexcept:
        """A reader is about to copy rows through addresses it took under the owner's lock,
        after releasing it (the push's read, ``deltaops``): the chunks stay mapped until
        :meth:`unpin`. Chunks never move while mapped (growth maps new ones, a freed slot's
        row stays where it is), so such addresses hold a row of this arena until then.
        Called with the GIL held, as is :meth:`clear`, which waits for the pins."""
        self.pins += 1

    cdef void unpin(self) noexcept:
        self.pins -= 1

    cdef void _wait_unpinned(self):
        # (the GIL is let go while waiting: the reader takes it back to unpin)
        while self.pins > 0:
            with nogil:
                usleep(50)

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
        cdef uint8_t* ahead
        with nogil:
            for j in range(n):
                if j + PREFETCH_AHEAD < n and slots[j + PREFETCH_AHEAD] != EMPTY:
                    # for writing, first and last line (as gather): a follower's deltas
                    # scatter ~100k rows spread over the table, each a cache miss otherwise
                    ahead = self._row(slots[j + PREFETCH_AHEAD])
                    ES_PREFETCH_W(ahead)
                    ES_PREFETCH_W(ahead + self.itemsize - 1)
                memcpy(self._row(slots[j]), &src[j, 0], self.itemsize)

    cdef int _check_slots(self, const uint32_t[::1] slots, str what) except -1:
        # Writes in place trust the slots: refuse any that was never handed out.
        cdef Py_ssize_t j
        for j in range(slots.shape[0]):
            if slots[j] == EMPTY or slots[j] >= self.next_slot:
                raise ValueError(f"{what}: a slot is not in the arena")
        return 0

    cdef int _check_metadata(self, Py_ssize_t n, const Py_ssize_t[::1] add_offsets,
                             const int64_t[:, ::1] add_values, const Py_ssize_t[::1] set_offsets,
                             const uint64_t[::1] set_bits, str what) except -1:
        # The counts added (int64 fields, one value per row of n) and the stamps set (8 bytes
        # each) of an in-place update: every field inside the record, every value there.
        cdef Py_ssize_t na = add_offsets.shape[0], ns = set_offsets.shape[0], f
        if (na and add_values.shape[1] < n) or add_values.shape[0] < na \
                or set_bits.shape[0] < ns:
            raise ValueError(f"{what}: value arrays are shorter than the rows")
        for f in range(na):
            if add_offsets[f] < 0 or add_offsets[f] + 8 > self.itemsize:
                raise ValueError(f"{what}: an int field does not fit the record")
        for f in range(ns):
            if set_offsets[f] < 0 or set_offsets[f] + 8 > self.itemsize:
                raise ValueError(f"{what}: a set field does not fit the record")
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
        if x.shape[0] < n:
            raise ValueError("update_rows: value arrays are shorter than the rows")
        if axpy_offset < 0 or axpy_offset + d * 4 > self.itemsize:
            raise ValueError("update_rows: the float field does not fit the record")
        self._check_metadata(n, add_offsets, add_values, set_offsets, set_bits, "update_rows")
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

    def adagrad_rows(self, const uint32_t[::1] slots, Py_ssize_t vec_offset,
                     Py_ssize_t acc_offset, const float[:, ::1] g, float lr, float eps):
        """In place, per slot j and coordinate k (float32 fields of ``g.shape[1]`` values)::

            acc[k] += g[j, k] * g[j, k]
            vec[k] -= lr * (g[j, k] / (sqrt(acc[k]) + eps))

        Each float32 operation rounds as the numpy step of ``embstore.optim.Adagrad`` does
        (no fused multiply-add: the extension is built with ``-ffp-contract=off``; and
        ``-fno-math-errno`` lets ``sqrtf`` be the vector instruction, the same rounding)."""
        cdef Py_ssize_t n = slots.shape[0], d = g.shape[1], j, k
        cdef uint8_t* row
        cdef float* v
        cdef float* a
        cdef const float* gr
        cdef float gk, ak
        if g.shape[0] < n:
            raise ValueError("adagrad_rows: fewer gradient rows than slots")
        if vec_offset < 0 or vec_offset + d * 4 > self.itemsize or acc_offset < 0 \
                or acc_offset + d * 4 > self.itemsize:
            raise ValueError("adagrad_rows: the float fields do not fit the record")
        self._check_slots(slots, "adagrad_rows")
        with nogil:
            for j in range(n):
                if j + PREFETCH_AHEAD < n:
                    row = self._row(slots[j + PREFETCH_AHEAD])
                    ES_PREFETCH_W(row)
                    ES_PREFETCH_W(row + self.itemsize - 1)
                row = self._row(slots[j])
                v = <float*> (row + vec_offset)
                a = <float*> (row + acc_offset)
                gr = &g[j, 0]                   # plain pointers: the loop vectorizes
                for k in range(d):
                    gk = gr[k]
                    ak = a[k] + gk * gk
                    a[k] = ak
                    v[k] = v[k] - lr * (gk / (sqrtf(ak) + eps))

    def adagrad_rowwise_rows(self, const uint32_t[::1] slots, Py_ssize_t vec_offset,
                             Py_ssize_t acc_offset, const float[:, ::1] g,
                             const float[::1] mean_sq, float lr, float eps):
        """Row-wise Adagrad in place, per slot j (one float32 accumulator per record)::

            acc += mean_sq[j]                  # the row's mean squared gradient
            vec[k] -= g[j, k] * (lr / (sqrt(acc) + eps))

        Each float32 operation rounds as ``embstore.optim.Adagrad(rowwise=True)``'s numpy step
        does (the caller computes ``mean_sq`` with the same numpy reduction)."""
        cdef Py_ssize_t n = slots.shape[0], d = g.shape[1], j, k
        cdef uint8_t* row
        cdef float* v
        cdef float* a
        cdef const float* gr
        cdef float s
        if g.shape[0] < n or mean_sq.shape[0] < n:
            raise ValueError("adagrad_rowwise_rows: fewer gradient rows than slots")
        if vec_offset < 0 or vec_offset + d * 4 > self.itemsize or acc_offset < 0 \
                or acc_offset + 4 > self.itemsize:
            raise ValueError("adagrad_rowwise_rows: the float fields do not fit the record")
        self._check_slots(slots, "adagrad_rowwise_rows")
        with nogil:
            for j in range(n):
                if j + PREFETCH_AHEAD < n:
                    row = self._row(slots[j + PREFETCH_AHEAD])
                    ES_PREFETCH_W(row)
                    ES_PREFETCH_W(row + self.itemsize - 1)
                row = self._row(slots[j])
                v = <float*> (row + vec_offset)
                a = <float*> (row + acc_offset)
                a[0] = a[0] + mean_sq[j]
                s = lr / (sqrtf(a[0]) + eps)
                gr = &g[j, 0]
                for k in range(d):
                    v[k] = v[k] - gr[k] * s

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
        self._wait_unpinned()
        self._unmap_all()
        self.next_slot = 0
        self.nfree = 0


def release_pool():
    """Return the pooled chunks of closed arenas to the operating system; returns the bytes
    freed. (They are otherwise kept, up to 512 MiB, for the next store of this process.)"""
    return es_pool_release()
