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
    uint32_t sign = (uint32_t) (h & 0x8000u) << 16, em = h & 0x7FFFu, bits, sub_bits;
    /* all-ones masks instead of branches or selects: the loops stay in vector registers */
    uint32_t special = 0u - (uint32_t) (em >= 0x7C00u), normal = 0u - (uint32_t) (em >= 0x0400u);
    /* subnormal (and zero): em * 2**-24, exact in float32 */
    float sub = (float) (int32_t) em * 5.9604644775390625e-08f, f;
    memcpy(&sub_bits, &sub, 4);
    bits = (special & (0x7F800000u | ((em & 0x3FFu) << 13)))          /* inf, NaN */
         | (~special & normal & ((em << 13) + 0x38000000u))          /* rebias 15 -> 127 */
         | (~normal & sub_bits);
    bits |= sign;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t es_f32_to_f16(float x) {
    uint32_t b, a, m, sb, nan, inf, normal;
    float sub;
    memcpy(&b, &x, 4);
    a = b & 0x7FFFFFFFu;
    nan = 0u - (uint32_t) (a > 0x7F800000u);
    inf = 0u - (uint32_t) (a >= 0x477FF000u);                  /* 65520 and up: inf */
    normal = 0u - (uint32_t) (a >= 0x38800000u);
    m = a - 0x38000000u;                       /* normal half: rebias, round the 13 cut bits */
    m = (m + 0xFFFu + ((m >> 13) & 1u)) >> 13;
    /* below 2**-14: |x| * 2**24 (exact) rounded to an integer, ties to even, in float */
    memcpy(&sub, &a, 4);
    sub = sub * 16777216.0f;
    sub = (sub + 8388608.0f) - 8388608.0f;
    sb = (uint32_t) (int32_t) (sub < 2048.0f ? sub : 0.0f);    /* (no overflow elsewhere) */
    m = (nan & (0x7E00u | ((a >> 13) & 0x3FFu)))
      | (~nan & inf & 0x7C00u)
      | (~inf & normal & m)
      | (~normal & sb);
    return (uint16_t) (m | ((b >> 16) & 0x8000u));
}

/* x to one of its two float16 neighbours: the one toward x with probability (distance from
   the nearest) / gap, u24 the 24 random bits of a uniform draw in [0, 1) */
static inline uint16_t es_f32_to_f16_sr(float x, uint32_t u24) {
    uint32_t near = es_f32_to_f16(x), other, neg, zero, up, take;
    float back = es_f16_to_f32((uint16_t) near), gap, frac, u;
    /* the neighbour toward x: one more magnitude away from zero when x lies beyond back,
       one less toward it (across zero: the smallest subnormal of x's sign) */
    neg = 0u - (near >> 15);
    zero = 0u - (uint32_t) ((near & 0x7FFFu) == 0u);
    up = 0u - (uint32_t) (x > back);                 /* x above back */
    other = ((up ^ neg) & (near + 1u))                /* away from zero */
          | (~(up ^ neg) & ~zero & (near - 1u))       /* toward zero */
          | (~(up ^ neg) & zero & ((up & 0x0001u) | (~up & 0x8001u)));
    gap = es_f16_to_f32((uint16_t) other) - back;
    frac = (x - back) / gap;
    u = (float) (int32_t) u24 * 5.9604644775390625e-08f;
    take = 0u - (uint32_t) ((x != back) & (u < frac));  /* NaN frac (inf, NaN): nearest */
    return (uint16_t) ((take & other) | (~take & near));
}
#endif
