/* Memory helpers shared by the compiled modules: faulting pages in on a background thread,
   and a growable region that keeps its address while it doubles. */
#ifndef ES_MEMORY_H
#define ES_MEMORY_H
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <pthread.h>
#include <stdint.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

typedef struct { void* p; size_t n; } es_span;

static inline void* es_populate_worker(void* arg) {
    es_span s = *(es_span*)arg;
    free(arg);
    /* Faults the pages in without changing their contents, so it is harmless even if the
       owner already writes into them (or has unmapped them: then it just fails). In 256 KiB
       steps: each call holds the address-space lock, and the owner's own mmap calls must not
       wait for a whole span. */
    for (size_t off = 0; off < s.n; off += (size_t)1 << 18) {
        size_t len = s.n - off < ((size_t)1 << 18) ? s.n - off : ((size_t)1 << 18);
        if (madvise((char*)s.p + off, len, MADV_POPULATE_WRITE) != 0) break;
    }
    return NULL;
}

/* Populate [p, p+n) on a detached thread; 0 when the thread started. */
static inline int es_populate_async(void* p, size_t n) {
    pthread_t t;
    pthread_attr_t a;
    es_span* s = (es_span*)malloc(sizeof(es_span));
    if (!s) return -1;
    s->p = p; s->n = n;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&a, 64 * 1024);
    int rc = pthread_create(&t, &a, es_populate_worker, s);
    pthread_attr_destroy(&a);
    if (rc != 0) { free(s); return -1; }
    return 0;
}

/* A region is a reservation of address space (PROT_NONE, costs no memory) of which the first
   `committed` bytes are usable. Growing within the reservation keeps the address, so the part
   to grow into can be committed and faulted in ahead of time, while the old part is in use.
   Outgrowing it moves the pages to a bigger reservation (mremap: no copy on Linux). */
typedef struct { char* base; size_t committed; size_t reserved; int huge; } es_region;

#define ES_REGION_MIN_RESERVE ((size_t)1 << 20)
#define ES_REGION_RESERVE_FACTOR 16

#define ES_PAGE ((size_t)4096)
static inline size_t es_page_round(size_t n) { return (n + ES_PAGE - 1) & ~(ES_PAGE - 1); }

static inline size_t es_region_reserve_for(size_t need) {
    size_t r = need * ES_REGION_RESERVE_FACTOR;
    if (r < ES_REGION_MIN_RESERVE) r = ES_REGION_MIN_RESERVE;
    return es_page_round(r);
}

#define ES_HUGE_PAGE ((size_t)2 << 20)

/* Ask for transparent huge pages over [p, p+n) when it spans at least one. Large
   tables are probed at random places: with 4 KiB pages nearly every probe also misses the TLB
   and waits on a page walk (at 30M keys that halved the lookup rate). Only advice: ignored
   where unsupported, and where THP is "never". */
static inline void es_advise_huge(void* p, size_t n) {
#ifdef MADV_HUGEPAGE
    if (n >= ES_HUGE_PAGE) madvise(p, n, MADV_HUGEPAGE);
#else
    (void)p; (void)n;
#endif
}

/* `n` bytes of address space (a multiple of the page size) starting on a 2 MiB boundary when
   `n` is at least a huge page, so that huge pages can back all of it; MAP_FAILED if none. */
static inline void* es_map_aligned(size_t n, int prot, int flags) {
    if (n < ES_HUGE_PAGE) return mmap(NULL, n, prot, flags, -1, 0);
    char* p = (char*)mmap(NULL, n + ES_HUGE_PAGE, prot, flags, -1, 0);
    if (p == MAP_FAILED) return MAP_FAILED;
    char* a = (char*)(((uintptr_t)p + ES_HUGE_PAGE - 1) & ~(uintptr_t)(ES_HUGE_PAGE - 1));
    if (a > p) munmap(p, (size_t)(a - p));
    if (a + n < p + n + ES_HUGE_PAGE) munmap(a + n, (size_t)(p + n + ES_HUGE_PAGE - (a + n)));
    return a;
}

/* A new reservation of `res` bytes with its first `need` usable, advised onto huge pages when
   `huge`; NULL if not available. */
static inline char* es_reserve(size_t res, size_t need, int huge) {
    void* p = es_map_aligned(res, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE);
    if (p == MAP_FAILED) return NULL;
    if (need && mprotect(p, need, PROT_READ | PROT_WRITE) != 0) { munmap(p, res); return NULL; }
    if (huge) es_advise_huge(p, res);
    return (char*)p;
}

/* 0 on success; -1 (errno set) if the address space or the memory is not available. */
static inline int es_region_init(es_region* r, size_t need, int huge) {
    need = es_page_round(need);   /* committed stays page-aligned, as mprotect needs */
    size_t res = es_region_reserve_for(need);
    char* p = es_reserve(res, need, huge);
    if (!p) return -1;
    r->base = p; r->committed = need; r->reserved = res; r->huge = huge;
    return 0;
}

/* Make the first `need` bytes usable, keeping contents; the base may move only when `need`
   exceeds the reservation. 0 on success, -1 with the region unchanged otherwise. */
static inline int es_region_commit(es_region* r, size_t need) {
    need = es_page_round(need);
    if (need <= r->committed) return 0;
    if (need <= r->reserved) {
        if (mprotect(r->base + r->committed, need - r->committed, PROT_READ | PROT_WRITE) != 0)
            return -1;
        r->committed = need;
        return 0;
    }
    size_t res = es_region_reserve_for(need);
    char* p = es_reserve(res, need, r->huge);
    if (!p) return -1;
#ifdef __linux__
    /* Move the committed pages into the new reservation (replacing its first pages). */
    if (mremap(r->base, r->committed, r->committed, MREMAP_MAYMOVE | MREMAP_FIXED, p)
            == MAP_FAILED) {
        munmap(p, res);
        return -1;
    }
    munmap(r->base, r->reserved);  /* the reservation's tail; the moved part is gone already */
    if (r->huge) es_advise_huge(p, res);   /* moved pages keep their old mapping's advice */
#else
    memcpy(p, r->base, r->committed);
    munmap(r->base, r->reserved);
#endif
    r->base = p; r->committed = need; r->reserved = res;
    return 0;
}

static inline void es_region_free(es_region* r) {
    if (r->base) munmap(r->base, r->reserved);
    r->base = NULL; r->committed = 0; r->reserved = 0;
}
/* Memory for an array probed at random places (free() releases it). From 2 MiB on it is
   2 MiB aligned and advised onto huge pages: with 4 KiB pages nearly every probe of a large
   table also misses the TLB. The advice is only advice: ignored where unsupported. */
static inline void* es_alloc_probed(size_t n) {
    void* p = NULL;
    if (n < ES_HUGE_PAGE) return malloc(n);
    if (posix_memalign(&p, ES_HUGE_PAGE, n) != 0) return NULL;
    es_advise_huge(p, n);
    return p;
}

#endif
