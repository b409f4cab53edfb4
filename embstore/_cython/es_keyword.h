/* Up to 8 bytes of a key as one zero-padded 64-bit word, the value memcpy into a zeroed
   uint64_t gives. The bytes table compares and stores short keys as two such words. A
   variable-length memcpy into a stack word costs a store-forwarding stall (several narrow
   stores, then one wide load) on every key; fixed-size loads combined in registers do not. */
#ifndef ES_KEYWORD_H
#define ES_KEYWORD_H
#include <stdint.h>
#include <stddef.h>
#include <string.h>

static inline uint64_t es_key_word(const char* p, ptrdiff_t n) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t x;
    uint32_t a, b;
    if (n >= 8) { memcpy(&x, p, 8); return x; }
    if (n >= 4) {
        /* Two overlapping 4-byte loads: the bytes they share land on the same positions. */
        memcpy(&a, p, 4);
        memcpy(&b, p + n - 4, 4);
        return (uint64_t)a | ((uint64_t)b << (8 * (n - 4)));
    }
    if (n > 0)
        return (uint64_t)(uint8_t)p[0] | ((uint64_t)(uint8_t)p[n >> 1] << (8 * (n >> 1)))
               | ((uint64_t)(uint8_t)p[n - 1] << (8 * (n - 1)));
    return 0;
#else
    uint64_t x = 0;
    if (n > 0) memcpy(&x, p, (size_t)(n < 8 ? n : 8));
    return x;
#endif
}
#endif
