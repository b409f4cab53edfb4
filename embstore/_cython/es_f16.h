/* IEEE float16 <-> float32 for the fused kernels, as embstore.valuetypes converts: widening
   is exact; narrowing rounds to nearest (ties to even, numpy's astype(np.float16): values
   from 65520 up become inf, NaN stays a quiet NaN with its upper payload bits), or
   stochastically between the two float16 neighbours of a value, the upper one taken with
   the probability of the fraction of the gap the value covers (valuetypes._to_float16's
   rule, with bits of a hash instead of numpy's generator). Integer and float selects only:
   the loops that call these stay in vector registers. */
#ifndef ES_F16_H
#define ES_F16_H
#include <stdint.h>
#include <string.h>

static inline float es_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t) (h & 0x8000u) << 16, em = h & 0x7FFFu, bits;
    /* subnormal (and zero): em * 2**-24, exact in float32 */
    float sub = (float) em * 5.9604644775390625e-08f, f;
    uint32_t sub_bits;
    memcpy(&sub_bits, &sub, 4);
    bits = em >= 0x7C00u ? (0x7F800000u | ((em & 0x3FFu) << 13))   /* inf, NaN */
         : em >= 0x0400u ? ((em << 13) + 0x38000000u)             /* rebias 15 -> 127 */
         : sub_bits;
    bits |= sign;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t es_f32_to_f16(float x) {
    uint32_t b, a, m;
    float sub;
    uint16_t r;
    memcpy(&b, &x, 4);
    a = b & 0x7FFFFFFFu;
    m = a - 0x38000000u;                       /* normal half: rebias, round the 13 cut bits */
    m = (m + 0xFFFu + ((m >> 13) & 1u)) >> 13;
    /* below 2**-14: |x| * 2**24 (exact) rounded to an integer, ties to even, in float */
    memcpy(&sub, &a, 4);
    sub = (a < 0x38800000u ? sub : 0.0f) * 16777216.0f;   /* (0 elsewhere: no overflow) */
    sub = (sub + 8388608.0f) - 8388608.0f;
    r = a > 0x7F800000u ? (uint16_t) (0x7E00u | ((a >> 13) & 0x3FFu))
      : a >= 0x477FF000u ? (uint16_t) 0x7C00u                 /* 65520 and up: inf */
      : a >= 0x38800000u ? (uint16_t) m
      : (uint16_t) (int32_t) sub;
    return (uint16_t) (r | ((b >> 16) & 0x8000u));
}

/* x to one of its two float16 neighbours: the one toward x with probability (distance from
   the nearest) / gap, u24 the 24 random bits of a uniform draw in [0, 1) */
static inline uint16_t es_f32_to_f16_sr(float x, uint32_t u24) {
    uint16_t near = es_f32_to_f16(x), other;
    uint32_t up = (uint32_t) near + 1u, down = (uint32_t) near - 1u;
    float back = es_f16_to_f32(near), gap, frac, u;
    int neg = (near & 0x8000u) != 0, zero = (near & 0x7FFFu) == 0;
    if (x > back) other = (uint16_t) (!neg ? up : (zero ? 0x0001u : down));
    else other = (uint16_t) (neg ? up : (zero ? 0x8001u : down));
    gap = es_f16_to_f32(other) - back;
    frac = (x - back) / gap;
    u = (float) u24 * 5.9604644775390625e-08f;
    return (x != back && u < frac) ? other : near;   /* NaN frac (inf, NaN): to nearest */
}
#endif
