/* XXH3-64, the fixed 64-bit hash of bytes keys, compiled inline into the module that includes
   this header. vendor/xxhash.h is xxHash 0.8 (BSD-2-Clause, Yann Collet), copied verbatim. */
#ifndef ES_XXH_H
#define ES_XXH_H
#define XXH_INLINE_ALL
#include "vendor/xxhash.h"

/* XXH3_64bits_withSeed with the branch of keys up to 16 bytes (words, most ids) inlined into
   the caller's loop: the full function is too large to inline, and a call per key cost more
   than the hashing. The values are the same (xxHash's own dispatch takes that branch). */
XXH_NO_INLINE uint64_t es_xxh3_seeded_long(const void* p, size_t n, uint64_t seed) {
    return XXH3_64bits_withSeed(p, n, seed);
}

XXH_FORCE_INLINE uint64_t es_xxh3_seeded(const void* p, size_t n, uint64_t seed) {
    if (n <= 16)
        return XXH3_len_0to16_64b((const xxh_u8*)p, n, XXH3_kSecret, seed);
    return es_xxh3_seeded_long(p, n, seed);
}
#endif
