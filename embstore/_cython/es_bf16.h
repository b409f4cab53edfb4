/* bfloat16 -> float32 (exact) for the fused kernels, and the mixer of their random bits; the
   rounding back (es_round_bf16 in es_fused_body.h) follows embstore.valuetypes: to nearest
   (ties to even) or stochastically (a uniform 16-bit amount added before the cut), NaN kept a
   quiet NaN, values within one rounding of the largest finite bfloat16 carried into inf. */
#ifndef ES_BF16_H
#define ES_BF16_H
#include <stdint.h>
#include <string.h>

static inline float es_bf16_to_f32(uint16_t h) {
    uint32_t b = (uint32_t) h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* splitmix64's finalizer: seeds each row's stream of stochastic-rounding bits from (seed,
   row, field), so the bits do not depend on how the work is split over threads */
static inline uint64_t es_mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    return x;
}
#endif
