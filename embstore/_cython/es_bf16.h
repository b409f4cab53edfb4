/* bfloat16 <-> float32 for the fused kernels, with the rounding of embstore.valuetypes:
   to nearest (ties to even) or stochastically (a uniform 16-bit amount added before the
   cut), NaN kept a quiet NaN, values within one rounding of the largest finite bfloat16
   carried into inf as a float32 -> float16 cast saturates. */
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

/* ``amount``: the 16 bits added before the cut (stochastic), or ~0u for to-nearest-even */
static inline uint16_t es_f32_to_bf16(float f, uint32_t amount) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t) ((b >> 16) | 0x40u);
    if (amount == ~0u)
        amount = 0x7FFFu + ((b >> 16) & 1u);
    return (uint16_t) ((b + amount) >> 16);
}

/* splitmix64's finalizer: the random bits of stochastic rounding, a pure function of
   (seed, index), so the bits do not depend on how the work is split over threads */
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
