/* Software prefetch hints shared by the compiled modules (no-ops off GCC/Clang). */
#ifndef ES_PREFETCH_H
#define ES_PREFETCH_H
#if defined(__GNUC__)
#define ES_PREFETCH(p) __builtin_prefetch((const void*)(p), 0, 1)
#define ES_PREFETCH_W(p) __builtin_prefetch((const void*)(p), 1, 1)
#else
#define ES_PREFETCH(p) ((void)0)
#define ES_PREFETCH_W(p) ((void)0)
#endif
#endif
