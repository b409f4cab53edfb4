# cython: language_level=3, boundscheck=False, wraparound=False
"""XXH3-128 of a file: the checksum of a part in a manifest (``embstore.io.manifest``).

A part's checksum only has to catch a damaged, truncated or swapped file: XXH3-128 does that
at ~25 GB/s where SHA-256 runs at ~2 GB/s, which was a seventh of a part's CPU time
(``bench/bench_parts.py --profile``). (Someone who can replace a part can rewrite its
manifest too, so a cryptographic hash would buy nothing here.) xxHash is the copy vendored in
``vendor/xxhash.h`` that the bytes-key hash uses.
"""

from libc.stdint cimport uint64_t

cdef extern from "es_xxh.h":
    ctypedef struct XXH3_state_t:
        pass
    ctypedef struct XXH128_hash_t:
        uint64_t low64
        uint64_t high64
    XXH3_state_t* XXH3_createState() nogil
    int XXH3_freeState(XXH3_state_t* s) nogil
    int XXH3_128bits_reset(XXH3_state_t* s) nogil
    int XXH3_128bits_update(XXH3_state_t* s, const void* data, size_t n) nogil
    XXH128_hash_t XXH3_128bits_digest(const XXH3_state_t* s) nogil


cdef class Xxh3:
    """A running XXH3-128 (seed 0): ``update`` with bytes-like blocks, ``hexdigest`` the 32
    hex digits of the 128-bit value, high half first (as ``xxhash.xxh3_128().hexdigest()``)."""

    cdef XXH3_state_t* state

    def __cinit__(self):
        self.state = XXH3_createState()
        if self.state == NULL:
            raise MemoryError("xxh3: no memory for its state")
        XXH3_128bits_reset(self.state)

    def __dealloc__(self):
        if self.state != NULL:
            XXH3_freeState(self.state)

    def update(self, const unsigned char[::1] data not None):
        cdef size_t n = data.shape[0]
        if n:
            with nogil:
                XXH3_128bits_update(self.state, &data[0], n)

    def hexdigest(self) -> str:
        cdef XXH128_hash_t h = XXH3_128bits_digest(self.state)
        return f"{h.high64:016x}{h.low64:016x}"


def file_xxh3_128(path) -> str:
    """Hex XXH3-128 of a file, read in 1 MiB blocks (the hash runs without the GIL)."""
    h = Xxh3()
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()
