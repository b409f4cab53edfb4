/* The scan of es_qscan.h, included once per CPU class with ES_NAME (the function names'
   suffix) and ES_ATTR (their target attribute) set; no include guard. */

/* s[r] = cq . codes[r] for the m (<= 8) rows at codes (int32: 127 * 127 * d < 2^31). With
   AVX2 and d a multiple of 32: |cq| (unsigned) times the row's codes with cq's sign
   (maddubs: pairs of products, at most 2 * 127 * 127 < 2^15, so never saturated), widened
   to int32 pairs (madd), eight rows reduced to one vector by a tree of hadd. */
ES_ATTR static inline void ES_NAME(es_dot8)(const int8_t* restrict codes, ptrdiff_t d,
                                            const int8_t* restrict cq, ptrdiff_t m,
                                            int32_t* restrict s) {
    ptrdiff_t r, j;
#ifdef ES_QS_AVX2
    if (m == ES_QS_BLOCK && d % 32 == 0) {
        __m256i acc[8];
        const __m256i ones = _mm256_set1_epi16(1);
        for (r = 0; r < 8; r++) acc[r] = _mm256_setzero_si256();
        for (j = 0; j < d; j += 32) {
            __m256i qv = _mm256_loadu_si256((const __m256i*) (cq + j));
            __m256i qa = _mm256_sign_epi8(qv, qv);
            for (r = 0; r < 8; r++) {
                __m256i cv = _mm256_loadu_si256((const __m256i*) (codes + r * d + j));
                __m256i p = _mm256_maddubs_epi16(qa, _mm256_sign_epi8(cv, qv));
                acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(p, ones));
            }
        }
        {
            __m256i t0 = _mm256_hadd_epi32(acc[0], acc[1]);
            __m256i t1 = _mm256_hadd_epi32(acc[2], acc[3]);
            __m256i t2 = _mm256_hadd_epi32(acc[4], acc[5]);
            __m256i t3 = _mm256_hadd_epi32(acc[6], acc[7]);
            __m256i u0 = _mm256_hadd_epi32(t0, t1);   /* rows 0-3, each half a partial */
            __m256i u1 = _mm256_hadd_epi32(t2, t3);   /* rows 4-7 */
            __m256i sum = _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                                           _mm256_permute2x128_si256(u0, u1, 0x31));
            _mm256_storeu_si256((__m256i*) s, sum);
        }
        return;
    }
#endif
    for (r = 0; r < m; r++) {
        const int8_t* restrict c = codes + r * d;
        int32_t acc = 0;
        for (j = 0; j < d; j++) acc += (int32_t) cq[j] * (int32_t) c[j];
        s[r] = acc;
    }
}

/* One query's candidates among n rows: the rows that can be among the K best by their
   float32 score, i.e. every row whose upper bound reaches the K-th largest lower bound.
   Writes their positions to cand (and upper bounds to ub, scratch), returns how many.

   Why the candidates hold the top K. With q' = sq cq, x' = r c (the row's scale and
   codes), e_q = q - q', e_x = x - x':
       q.x = q'.x' + q'.e_x + e_q.x,  and q'.x' = sq r (cq.c) = sq r S exactly,
   so |q.x - a| <= qp R + qe N with a = sq r S, R = ||e_x||, N = ||x|| (Cauchy-Schwarz;
   qp, qe, R, N were rounded up). The score the exact top-k ranks by is q.x computed in
   float32, in some order: |fl(q.x) - q.x| <= gamma_d sum|q_j x_j| <= gamma_d qn N, with
   gamma_d = d u / (1 - d u), u = 2^-24 (FMA only rounds less). a and the bound are
   computed here in float32, a handful of roundings, each at most u times quantities
   below (|a| <= qp (N + R), the bound <= (qp + qe)(N + R)). So with
       slack = kappa (qn + qp + qe) (N + R),  kappa = (d + 16) u  (the caller's),
   l = a - eps - slack <= fl(q.x) <= a + eps + slack = u_i for every finite row whose
   products stay finite (kappa covers gamma_d plus up to 15 further roundings of u, with
   room for the rounding of slack itself). A row with inf or NaN, or whose bound
   overflows, has l = -inf or NaN (never counted among the K best) and u = inf or NaN
   (always a candidate: "not below" lets NaN through). Then the K rows of largest l all
   score >= L (the K-th largest l), so the K-th best score is >= L, and any row among the
   K best (ties included) scores >= L, so its u >= L: it is a candidate. The running L is
   never above the final one, so testing each row against it as the pass goes keeps a
   superset, cut to u >= final L at the end. Fewer than K usable lower bounds: L = -inf,
   every row is a candidate. */
ES_ATTR static ptrdiff_t ES_NAME(es_qscan)(const int8_t* restrict codes,
                                           const float* restrict scale,
                                           const float* restrict resid,
                                           const float* restrict norm, ptrdiff_t n,
                                           ptrdiff_t d, const int8_t* restrict cq,
                                           const es_query_t* qs, float kappa, ptrdiff_t K,
                                           float* restrict heap, int64_t* restrict cand,
                                           float* restrict ub) {
    ptrdiff_t i, r, count = 0, nc = 0, out = 0;
    float L = -INFINITY;
    const float sq = qs->sq, qp = qs->qp, qe = qs->qe;
    const float sl = kappa * (qs->qn + qs->qp + qs->qe);
    int32_t s[ES_QS_BLOCK];
    float lo[ES_QS_BLOCK], hi[ES_QS_BLOCK];
    if (K <= 0) return 0;
    for (i = 0; i < n; i += ES_QS_BLOCK) {
        ptrdiff_t m = n - i < ES_QS_BLOCK ? n - i : ES_QS_BLOCK;
        int any = 0;
        ES_NAME(es_dot8)(codes + i * d, d, cq, m, s);
#ifdef ES_QS_AVX2
        if (m == ES_QS_BLOCK) {   /* the same float operations, 8 lanes at once, one test */
            __m256 N = _mm256_loadu_ps(norm + i), R = _mm256_loadu_ps(resid + i);
            __m256 a = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(sq),
                                                   _mm256_loadu_ps(scale + i)),
                                     _mm256_cvtepi32_ps(_mm256_loadu_si256((__m256i*) s)));
            __m256 e = _mm256_add_ps(
                _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(qp), R),
                              _mm256_mul_ps(_mm256_set1_ps(qe), N)),
                _mm256_mul_ps(_mm256_set1_ps(sl), _mm256_add_ps(N, R)));
            __m256 lv = _mm256_sub_ps(a, e), hv = _mm256_add_ps(a, e), Lv = _mm256_set1_ps(L);
            if (!_mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(hv, Lv, _CMP_NLT_UQ),
                                                 _mm256_cmp_ps(lv, Lv, _CMP_GT_OQ))))
                continue;
            _mm256_storeu_ps(lo, lv);
            _mm256_storeu_ps(hi, hv);
            goto rows;
        }
#endif
        for (r = 0; r < m; r++) {
            float N = norm[i + r], R = resid[i + r];
            float a = (sq * scale[i + r]) * (float) s[r];
            float e = (qp * R + qe * N) + sl * (N + R);
            lo[r] = a - e;
            hi[r] = a + e;
        }
        for (r = 0; r < m; r++) any |= !(hi[r] < L) | (lo[r] > L);
        if (!any) continue;
#ifdef ES_QS_AVX2
    rows:
#endif
        for (r = 0; r < m; r++) {
            if (!(hi[r] < L)) {
                cand[nc] = i + r;
                ub[nc++] = hi[r];
            }
            if (lo[r] > L) {
                es_heap_add(heap, &count, K, lo[r]);
                if (count == K) L = heap[0];
            }
        }
    }
    for (i = 0; i < nc; i++)
        if (!(ub[i] < L)) cand[out++] = cand[i];
    return out;
}
