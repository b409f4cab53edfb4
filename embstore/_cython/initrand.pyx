# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Counter-based random initial vectors.

A key's vector is a pure function of (seed, key hash): the per-key stream starts from
``splitmix64(hash ^ splitmix64(seed))`` and advances with wyrand (one 64x64->128 multiply per
64 random bits, two float32 values per step), so any store or shard with the same seed gives a
key the same vector whatever order keys arrive in, at ~1 ns per value.
"""

from libc.stdint cimport uint64_t
from libc.math cimport sqrt, log, cos, M_PI

cdef extern from *:
    """
    static inline unsigned long long es_wyrand(unsigned long long *state) {
        *state += 0xa0761d6478bd642fULL;
        __uint128_t t = (__uint128_t)(*state) * (*state ^ 0xe7037ed1a0b428dbULL);
        return (unsigned long long)(t >> 64) ^ (unsigned long long)t;
    }
    """
    uint64_t es_wyrand(uint64_t* state) nogil


cdef inline uint64_t mix64(uint64_t z) noexcept nogil:
    z += 0x9E3779B97F4A7C15ULL
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef double INV24 = 1.0 / 16777216.0
cdef double INV53 = 1.0 / 9007199254740992.0


def fill_uniform(const uint64_t[::1] hashes, uint64_t seed, float[:, ::1] out,
                 double low, double high):
    """Uniform [low, high) values, 24 random bits each."""
    cdef Py_ssize_t n = hashes.shape[0], d = out.shape[1], i, j
    cdef uint64_t state, r, s = mix64(seed)
    cdef double span = high - low
    with nogil:
        for i in range(n):
            state = mix64(hashes[i] ^ s)
            j = 0
            while j < d:
                r = es_wyrand(&state)
                out[i, j] = <float> (low + span * ((r >> 40) * INV24))
                if j + 1 < d:
                    out[i, j + 1] = <float> (low + span * (((r >> 8) & 0xFFFFFF) * INV24))
                j += 2


def fill_normal(const uint64_t[::1] hashes, uint64_t seed, float[:, ::1] out,
                double mean, double std, double truncate):
    """Box-Muller normals from the per-key stream; with ``truncate`` > 0, values beyond
    truncate*std are redrawn from the same stream, as ``tf.random.truncated_normal`` does."""
    cdef Py_ssize_t n = hashes.shape[0], d = out.shape[1], i, j
    cdef uint64_t state, s = mix64(seed)
    cdef double u1, u2, z
    with nogil:
        for i in range(n):
            state = mix64(hashes[i] ^ s)
            for j in range(d):
                while True:
                    u1 = (es_wyrand(&state) >> 11) * INV53
                    u2 = (es_wyrand(&state) >> 11) * INV53
                    z = sqrt(-2.0 * log(1.0 - u1)) * cos(2.0 * M_PI * u2)
                    if truncate <= 0 or (z <= truncate and z >= -truncate):
                        break
                out[i, j] = <float> (mean + std * z)
