# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Counter-based random initial vectors: value j of a key is a pure function of
(seed, key hash, j), so any store or shard with the same seed gives a key the same vector,
whatever order keys arrive in. The stream is splitmix64 over a per-key base counter."""

from libc.stdint cimport uint64_t
from libc.math cimport sqrt, log, cos, M_PI


cdef inline uint64_t mix64(uint64_t z) noexcept nogil:
    z += 0x9E3779B97F4A7C15ULL
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef inline double unit(uint64_t base, uint64_t counter) noexcept nogil:
    # 53 random bits -> [0, 1)
    return (mix64(base + counter * 0xD1B54A32D192ED03ULL) >> 11) * (1.0 / 9007199254740992.0)


def fill_uniform(const uint64_t[::1] hashes, uint64_t seed, float[:, ::1] out,
                 double low, double high):
    cdef Py_ssize_t n = hashes.shape[0], d = out.shape[1], i, j
    cdef uint64_t base, s = mix64(seed)
    cdef double span = high - low
    with nogil:
        for i in range(n):
            base = mix64(hashes[i] ^ s)
            for j in range(d):
                out[i, j] = <float> (low + span * unit(base, j))


def fill_normal(const uint64_t[::1] hashes, uint64_t seed, float[:, ::1] out,
                double mean, double std, double truncate):
    """Box-Muller normals; with ``truncate`` > 0, values beyond truncate*std are redrawn
    from later counters (deterministically) as ``tf.truncated_normal`` does."""
    cdef Py_ssize_t n = hashes.shape[0], d = out.shape[1], i, j
    cdef uint64_t base, s = mix64(seed), c
    cdef double u1, u2, z
    with nogil:
        for i in range(n):
            base = mix64(hashes[i] ^ s)
            for j in range(d):
                c = <uint64_t> j * 2
                while True:
                    u1 = unit(base, c)
                    u2 = unit(base, c + 1)
                    z = sqrt(-2.0 * log(1.0 - u1)) * cos(2.0 * M_PI * u2)
                    if truncate <= 0 or (z <= truncate and z >= -truncate):
                        break
                    c += <uint64_t> d * 2
                out[i, j] = <float> (mean + std * z)
