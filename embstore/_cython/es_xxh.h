/* XXH3-64, the fixed 64-bit hash of bytes keys, compiled inline into the module that includes
   this header. vendor/xxhash.h is xxHash 0.8 (BSD-2-Clause, Yann Collet), copied verbatim. */
#ifndef ES_XXH_H
#define ES_XXH_H
#define XXH_INLINE_ALL
#include "vendor/xxhash.h"
#endif
