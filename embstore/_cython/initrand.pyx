# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Counter-based random initial vectors.

A key's vector is a pure function of (seed, key hash): the per-key stream starts from
``splitmix64(hash ^ splitmix64(seed))`` and advances with wyrand (one 64x64->128 multiply per
64 random bits, two float32 values per step), so any store or shard with the same seed gives a
key the same vector whatever order keys arrive in, at ~1 ns per value.
"""

from libc.stdint cimport int64_t, uint64_t
from libc.math cimport sqrt, log, cos, M_PI

cdef extern from "es_hash.h":
    uint64_t es_mix64(uint64_t z) nogil

cdef extern from *:
    """
    #include "es_hash.h"
    static inline uint64_t es_wyrand(uint64_t *state) {
        *state += 0xa0761d6478bd642fULL;
        __uint128_t t = (__uint128_t)(*state) * (*state ^ 0xe7037ed1a0b428dbULL);
        return (uint64_t)(t >> 64) ^ (uint64_t)t;
    }
    /* The two 24-bit values of one draw, as exact doubles in [0, 1). The casts to int32 let
       the compiler use the signed conversion; the values are the same. */
    #define ES_U24_HI(r) ((double)(int32_t)((r) >> 40) * (1.0 / 16777216.0))
    #define ES_U24_LO(r) ((double)(int32_t)(((r) >> 8) & 0xFFFFFF) * (1.0 / 16777216.0))
    /* Two rows at a time: their streams are independent, so the multiplies of one overlap
       those of the other (about 20% faster than one row at a time, same values). */
    static void es_fill_uniform(const uint64_t* hashes, uint64_t s, float* out, Py_ssize_t n,
                                Py_ssize_t d, double low, double span) {
        Py_ssize_t i = 0, j;
        for (; i + 1 < n; i += 2) {
            uint64_t a = es_mix64(hashes[i] ^ s), b = es_mix64(hashes[i + 1] ^ s), ra, rb;
            float* oa = out + i * d;
            float* ob = oa + d;
            for (j = 0; j + 1 < d; j += 2) {
                ra = es_wyrand(&a);
                rb = es_wyrand(&b);
                oa[j] = (float)(low + span * ES_U24_HI(ra));
                oa[j + 1] = (float)(low + span * ES_U24_LO(ra));
                ob[j] = (float)(low + span * ES_U24_HI(rb));
                ob[j + 1] = (float)(low + span * ES_U24_LO(rb));
            }
            if (j < d) {
                oa[j] = (float)(low + span * ES_U24_HI(es_wyrand(&a)));
                ob[j] = (float)(low + span * ES_U24_HI(es_wyrand(&b)));
            }
        }
        for (; i < n; i++) {
            uint64_t a = es_mix64(hashes[i] ^ s), ra;
            float* oa = out + i * d;
            for (j = 0; j + 1 < d; j += 2) {
                ra = es_wyrand(&a);
                oa[j] = (float)(low + span * ES_U24_HI(ra));
                oa[j + 1] = (float)(low + span * ES_U24_LO(ra));
            }
            if (j < d) oa[j] = (float)(low + span * ES_U24_HI(es_wyrand(&a)));
        }
    }
    """
    uint64_t es_wyrand(uint64_t* state) nogil
    void es_fill_uniform(const uint64_t* hashes, uint64_t s, float* out, Py_ssize_t n,
                         Py_ssize_t d, double low, double span) nogil


cdef double INV53 = 1.0 / 9007199254740992.0


def fill_uniform(const uint64_t[::1] hashes, uint64_t seed, float[:, ::1] out,
                 double low, double high):
    """Uniform [low, high) values, 24 random bits each."""
    if out.shape[0] < hashes.shape[0]:
        raise ValueError("fill_uniform: output has too few rows")
    if hashes.shape[0] == 0 or out.shape[1] == 0:
        return
    with nogil:
        es_fill_uniform(&hashes[0], es_mix64(seed), &out[0, 0], hashes.shape[0], out.shape[1],
                        low, high - low)


def fill_normal(const uint64_t[::1] hashes, uint64_t seed, float[:, ::1] out,
                double mean, double std, double truncate):
    """Box-Muller normals from the per-key stream; with ``truncate`` > 0, values beyond
    truncate*std are redrawn from the same stream, as ``tf.random.truncated_normal`` does."""
    cdef Py_ssize_t n = hashes.shape[0], d = out.shape[1], i, j
    cdef uint64_t state, s = es_mix64(seed)
    cdef double u1, u2, z
    with nogil:
        for i in range(n):
            state = es_mix64(hashes[i] ^ s)
            for j in range(d):
                while True:
                    u1 = <double> <int64_t> (es_wyrand(&state) >> 11) * INV53
                    u2 = <double> <int64_t> (es_wyrand(&state) >> 11) * INV53
                    z = sqrt(-2.0 * log(1.0 - u1)) * cos(2.0 * M_PI * u2)
                    if truncate <= 0 or (z <= truncate and z >= -truncate):
                        break
                out[i, j] = <float> (mean + std * z)
