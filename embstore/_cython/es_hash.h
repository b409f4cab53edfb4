/* The 64-bit key mix shared by the compiled modules: splitmix64's finalizer, the same function
   as embstore._keys.splitmix64 (numpy), so a key hashes alike everywhere. */
#ifndef ES_HASH_H
#define ES_HASH_H
#include <stdint.h>
static inline uint64_t es_mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}
#endif
