/* The int8 scan of embstore.service.ann_scan: rows quantized to int8 codes with a per-row
   scale, and for one query a bound [l_i, u_i] on the float32 score of every row, the running
   k-th largest l_i and the rows whose u_i reaches it, in one pass. The proof that the bound
   holds is in es_qscan_body.h, at the scan. */
#ifndef ES_QSCAN_H
#define ES_QSCAN_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

/* v (>= 0, computed in double) as a float no smaller than it: a relative 2^-40 up for the
   double sums' own rounding (d terms, each at most 2^-53 relative), then the float above
   when the nearest one is below. */
static inline float es_up(double v) {
    float f;
    v = v * (1.0 + 0x1p-40);
    f = (float) v;
    if ((double) f < v) f = nextafterf(f, INFINITY);
    return f;
}

/* Quantize one row: scale r = max|x|/127, codes round(x/r) in [-127, 127] (never -128:
   the AVX2 product negates codes), resid = ||x - r c|| and norm = ||x||, both rounded up.
   A row with NaN or inf gets norm = resid = inf (its bounds are then unbounded: always a
   candidate); a zero row, or one too small for r to be a normal float, codes 0 and
   resid = norm (the bound then rests on the norm alone). */
static void es_quantize_row(const float* x, ptrdiff_t d, int8_t* c, float* scale,
                            float* resid, float* norm) {
    ptrdiff_t j;
    float m = 0.0f, r;
    double nn = 0.0, ee = 0.0;
    int finite = 1;
    for (j = 0; j < d; j++) {
        float a = fabsf(x[j]);
        if (!(a <= 3.4028234663852886e38f)) finite = 0;
        else if (a > m) m = a;
        nn += (double) x[j] * (double) x[j];
    }
    r = m / 127.0f;
    if (!finite || !(r >= 1.17549435e-38f)) {
        for (j = 0; j < d; j++) c[j] = 0;
        *scale = 0.0f;
        *norm = finite ? es_up(sqrt(nn)) : INFINITY;
        *resid = *norm;
        return;
    }
    for (j = 0; j < d; j++) {
        float t = nearbyintf(x[j] / r);
        if (t > 127.0f) t = 127.0f;
        if (t < -127.0f) t = -127.0f;
        c[j] = (int8_t) t;
        /* r * c is exact in double (24 + 7 bits); the difference with x nearly so */
        double e = (double) x[j] - (double) r * (double) c[j];
        ee += e * e;
    }
    *scale = r;
    *resid = es_up(sqrt(ee));
    *norm = es_up(sqrt(nn));
}

static void es_quantize_rows(const float* x, ptrdiff_t n, ptrdiff_t d, int8_t* codes,
                             float* scale, float* resid, float* norm) {
    ptrdiff_t i;
    for (i = 0; i < n; i++)
        es_quantize_row(x + i * d, d, codes + i * d, scale + i, resid + i, norm + i);
}

/* A query, quantized as a row is: codes cq, scale sq; qp = ||q'|| with q' = sq cq,
   qe = ||q - q'||, qn = ||q|| (all rounded up; q is finite: the caller checked). */
typedef struct {
    float sq, qp, qe, qn;
} es_query_t;

static void es_quantize_query(const float* q, ptrdiff_t d, int8_t* cq, es_query_t* out) {
    ptrdiff_t j;
    float m = 0.0f, s;
    double pp = 0.0, ee = 0.0, nn = 0.0;
    for (j = 0; j < d; j++) if (fabsf(q[j]) > m) m = fabsf(q[j]);
    s = m / 127.0f;
    if (!(s >= 1.17549435e-38f)) s = 0.0f;
    for (j = 0; j < d; j++) {
        double qq = (double) q[j], p;
        float t = s ? nearbyintf(q[j] / s) : 0.0f;
        if (t > 127.0f) t = 127.0f;
        if (t < -127.0f) t = -127.0f;
        cq[j] = (int8_t) t;
        p = (double) s * (double) cq[j];
        pp += p * p;
        ee += (qq - p) * (qq - p);
        nn += qq * qq;
    }
    out->sq = s;
    out->qp = es_up(sqrt(pp));
    out->qe = es_up(sqrt(ee));
    out->qn = es_up(sqrt(nn));
}

/* A min-heap of the K largest lower bounds seen so far: h[0] is the K-th largest once
   full. */
static inline void es_heap_add(float* h, ptrdiff_t* count, ptrdiff_t K, float v) {
    ptrdiff_t i, c;
    if (*count < K) {
        i = (*count)++;
        while (i > 0 && h[(i - 1) / 2] > v) { h[i] = h[(i - 1) / 2]; i = (i - 1) / 2; }
        h[i] = v;
        return;
    }
    i = 0;
    for (;;) {
        c = 2 * i + 1;
        if (c >= K) break;
        if (c + 1 < K && h[c + 1] < h[c]) c++;
        if (!(h[c] < v)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = v;
}

#define ES_QS_BLOCK 8

#define ES_ATTR
#define ES_NAME(n) n##_base
#include "es_qscan_body.h"
#undef ES_ATTR
#undef ES_NAME

#if defined(__GNUC__) && defined(__x86_64__)
#define ES_QS_AVX2 1
#define ES_ATTR __attribute__((target("avx2,fma")))
#define ES_NAME(n) n##_avx2
#include "es_qscan_body.h"
#undef ES_ATTR
#undef ES_NAME
#undef ES_QS_AVX2

static int es_qs_wide_cpu = -1;  /* benign race: every thread computes the same answer */

/* EMBSTORE_BASELINE_KERNELS=1 keeps the baseline build, as for the fused kernels */
static inline int es_qs_wide(void) {
    if (es_qs_wide_cpu < 0) {
        const char* off = getenv("EMBSTORE_BASELINE_KERNELS");
        es_qs_wide_cpu = !(off && off[0] && off[0] != '0') && __builtin_cpu_supports("avx2");
    }
    return es_qs_wide_cpu;
}
#define ES_QS_PICK(n) (es_qs_wide() ? n##_avx2 : n##_base)
#else
static inline int es_qs_wide(void) { return 0; }
#define ES_QS_PICK(n) n##_base
#endif

#define es_qscan ES_QS_PICK(es_qscan)
#endif
