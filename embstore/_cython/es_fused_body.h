/* The bodies of es_fused.h's inner loops, included once per CPU class with ES_NAME (the
   function names' suffix) and ES_ATTR (their target attribute) set; no include guard. */
/* Bag [start, stop) into o: the rows (float32, or bfloat16 widened exactly as read) summed
   in element order from zero (w[e] times each, one fused multiply-add, when w is not NULL),
   divided by the length with mean. The columns go ES_BLOCK at a time with the sums in
   registers (each element a row slice loaded and added, no store and reload of o between
   elements), the rest one loop; each column's additions are the same either way. The
   compiler unswitches the loop-invariant tests: each case is its own vector loop. */
#ifndef ES_BLOCK
#define ES_BLOCK 32
#define ES_AHEAD 16
static inline void es_prefetch_span(const char* p, ptrdiff_t n) {
    ptrdiff_t off;
    for (off = 0; off < n; off += 64) ES_PREFETCH(p + off);
    ES_PREFETCH(p + n - 1);
}
#endif
ES_ATTR static void ES_NAME(es_pool_bag)(float* restrict o, ptrdiff_t d, const void* const* rows,
                                         const int64_t* inv, ptrdiff_t start, ptrdiff_t stop,
                                         const float* w, int mean, int bf16, ptrdiff_t ahead_stop) {
    ptrdiff_t e, k, k0;
    ptrdiff_t row_bytes = d * (bf16 ? 2 : 4);
    /* the rows of the elements ES_AHEAD on, every line of them, requested now */
    for (e = start; e < stop && e + ES_AHEAD < ahead_stop; e++)
        es_prefetch_span((const char*) rows[inv[e + ES_AHEAD]], row_bytes);
    float fl = (float) (stop - start);
    if (stop == start) {
        memset(o, 0, (size_t) d * sizeof(float));
        return;
    }
    for (k0 = 0; k0 + ES_BLOCK <= d; k0 += ES_BLOCK) {
        /* the first element's term added to 0 as the others are, with no zeroing pass (a
           zeroed array would live on the stack, not in registers) */
        float acc[ES_BLOCK];
        {
            const float* restrict r = (const float*) rows[inv[start]] + k0;
            const uint16_t* restrict h = (const uint16_t*) rows[inv[start]] + k0;
            float we = w ? w[start] : 1.0f;
            for (k = 0; k < ES_BLOCK; k++) {
                float x = bf16 ? es_bf16_to_f32(h[k]) : r[k];
                acc[k] = w ? fmaf(we, x, 0.0f) : 0.0f + x;
            }
        }
        for (e = start + 1; e < stop; e++) {
            const float* restrict r = (const float*) rows[inv[e]] + k0;
            const uint16_t* restrict h = (const uint16_t*) rows[inv[e]] + k0;
            float we = w ? w[e] : 1.0f;
            for (k = 0; k < ES_BLOCK; k++) {
                float x = bf16 ? es_bf16_to_f32(h[k]) : r[k];
                acc[k] = w ? fmaf(we, x, acc[k]) : acc[k] + x;
            }
        }
        if (mean) for (k = 0; k < ES_BLOCK; k++) acc[k] = acc[k] / fl;
        memcpy(o + k0, acc, sizeof acc);
    }
    if (k0 == d) return;
    memset(o + k0, 0, (size_t) (d - k0) * sizeof(float));
    for (e = start; e < stop; e++) {
        const float* restrict r = (const float*) rows[inv[e]];
        const uint16_t* restrict h = (const uint16_t*) rows[inv[e]];
        float we = w ? w[e] : 1.0f;
        for (k = k0; k < d; k++) {
            float x = bf16 ? es_bf16_to_f32(h[k]) : r[k];
            o[k] = w ? fmaf(we, x, o[k]) : o[k] + x;
        }
    }
    if (mean) for (k = k0; k < d; k++) o[k] = o[k] / fl;
}

/* Per key u = inv[e], the gradient of its elements summed into row u of sums (nu rows of d),
   bag by bag in element order: a bag's gradient row (grad + b * gstride bytes) divided by its
   length first with mean, times w[e] (fmaf) when w is not NULL. scaled: d floats of scratch. */
ES_ATTR static void ES_NAME(es_scatter_sums)(float* restrict sums, ptrdiff_t nu, ptrdiff_t d, const char* grad,
                                      ptrdiff_t gstride, ptrdiff_t n_bags, const int64_t* inv,
                                      const int64_t* offsets, const float* w, int mean,
                                      float* scaled) {
    ptrdiff_t b, e, k;
    memset(sums, 0, (size_t) (nu * d) * sizeof(float));
    for (b = 0; b < n_bags; b++) {
        ptrdiff_t ln = offsets[b + 1] - offsets[b];
        const float* g = (const float*) (grad + b * gstride);
        if (ln == 0) continue;
        if (mean) { /* torch divides the gradient by the length first, then sums */
            float fl = (float) ln;
            for (k = 0; k < d; k++) scaled[k] = g[k] / fl;
            g = scaled;
        }
        for (e = offsets[b]; e < offsets[b + 1]; e++) {
            float* restrict s = sums + inv[e] * d;
            if (w) {
                float we = w[e];
                for (k = 0; k < d; k++) s[k] = fmaf(we, g[k], s[k]);
            } else {
                for (k = 0; k < d; k++) s[k] = s[k] + g[k];
            }
        }
    }
}

/* One key's sum (es_scatter_sums' arithmetic) from its (element, bag) pairs el_bag[2i],
   el_bag[2i+1] for i in [first, stop); returns 1 when the sum is not finite. */
ES_ATTR static int ES_NAME(es_sum_key)(float* restrict s, ptrdiff_t d, const char* grad, ptrdiff_t gstride,
                                const int64_t* el_bag, int64_t first, int64_t stop,
                                const int64_t* offsets, const float* w, int mean) {
    int64_t i;
    ptrdiff_t k;
    uint32_t bad = 0;
    memset(s, 0, (size_t) d * sizeof(float));
    for (i = first; i < stop; i++) {
        int64_t e = el_bag[2 * i], b = el_bag[2 * i + 1];
        const float* g = (const float*) (grad + b * gstride);
        float fl = (float) (offsets[b + 1] - offsets[b]);
        if (w) {
            float we = w[e];
            if (mean) { for (k = 0; k < d; k++) s[k] = fmaf(we, g[k] / fl, s[k]); }
            else { for (k = 0; k < d; k++) s[k] = fmaf(we, g[k], s[k]); }
        } else if (mean) {
            for (k = 0; k < d; k++) s[k] = s[k] + g[k] / fl;
        } else {
            for (k = 0; k < d; k++) s[k] = s[k] + g[k];
        }
    }
    for (k = 0; k < d; k++) {
        uint32_t bits;
        memcpy(&bits, s + k, 4);
        bad |= (bits & 0x7F800000u) == 0x7F800000u;
    }
    return bad != 0;
}

/* One float32 record's optimizer step from its summed gradient s:
   axpy:            vec += alpha * s
   adagrad:         acc += s * s; vec -= lr * (s / (sqrt(acc) + eps))      (per coordinate)
   adagrad_rowwise: acc += sumsq(s) / d; vec -= s * (lr / (sqrt(acc) + eps)) */
ES_ATTR static void ES_NAME(es_step_row)(uint8_t* row, const float* restrict s, ptrdiff_t d, int rule,
                                  float alpha, float lr, float eps, ptrdiff_t vec_offset,
                                  ptrdiff_t acc_offset) {
    float* restrict v = (float*) (row + vec_offset);
    float* a = (float*) (row + acc_offset);
    ptrdiff_t k;
    if (rule == ES_RULE_AXPY) {
        for (k = 0; k < d; k++) v[k] = v[k] + alpha * s[k];
    } else if (rule == ES_RULE_ADAGRAD) {
        for (k = 0; k < d; k++) {
            float gk = s[k], ak = a[k] + gk * gk;
            a[k] = ak;
            v[k] = v[k] - lr * (gk / (sqrtf(ak) + eps));
        }
    } else {
        float sc;
        a[0] = a[0] + (d ? es_sumsq(s, d) / (float) d : 0.0f);
        sc = lr / (sqrtf(a[0]) + eps);
        for (k = 0; k < d; k++) v[k] = v[k] - s[k] * sc;
    }
}

/* 1 when no value of x[0:n] is NaN or inf (the exponent bits, an integer test) */
ES_ATTR static int ES_NAME(es_finite)(const float* x, ptrdiff_t n) {
    ptrdiff_t i;
    uint32_t bad = 0;
    for (i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, x + i, 4);
        bad |= (bits & 0x7F800000u) == 0x7F800000u;
    }
    return bad == 0;
}

/* float32 values into a bfloat16 field: to nearest even, or (stochastic) adding 16 random
   bits before the cut, those of value k being murmur3's 32-bit finalizer of base + k times
   the golden ratio (independent lanes: the loop stays in vector registers); NaN stays a
   quiet NaN. */
ES_ATTR static void ES_NAME(es_round_bf16)(const float* restrict wide, uint16_t* restrict out,
                                           ptrdiff_t n, int stochastic, uint32_t base) {
    ptrdiff_t k;
    for (k = 0; k < n; k++) {
        uint32_t b, add, nan, h = base + (uint32_t) k * 0x9E3779B1u;
        memcpy(&b, wide + k, 4);
        h ^= h >> 16;
        h *= 0x85EBCA6Bu;
        h ^= h >> 13;
        h *= 0xC2B2AE35u;
        h ^= h >> 16;
        add = stochastic ? (h >> 16) : 0x7FFFu + ((b >> 16) & 1u);
        nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
        out[k] = (uint16_t) (nan ? ((b >> 16) | 0x40u) : ((b + add) >> 16));
    }
}

/* One record with bfloat16 fields (vec_bf16 / acc_bf16 say which): widened into tmp (the
   vector, then the accumulator), stepped by es_step_row in float32, rounded back. Stochastic
   rounding's bits come from a base of mix64(seed, 2u + field): a function of the key's row u
   and the coordinate, not of the thread that steps it. tmp: 2 d + 1 floats. */
ES_ATTR static void ES_NAME(es_step_narrow)(uint8_t* row, const float* restrict s, ptrdiff_t d,
                                            int rule, float alpha, float lr, float eps,
                                            ptrdiff_t vec_offset, ptrdiff_t acc_offset,
                                            int vec_bf16, int acc_bf16, float* restrict tmp,
                                            uint64_t seed, int stochastic, uint64_t u) {
    ptrdiff_t acc_w = rule == ES_RULE_AXPY ? 0 : (rule == ES_RULE_ADAGRAD ? d : 1), k, f;
    for (f = 0; f < 2; f++) {
        ptrdiff_t n = f ? acc_w : d;
        uint8_t* field = row + (f ? acc_offset : vec_offset);
        float* w = tmp + (f ? d : 0);
        if (f ? acc_bf16 : vec_bf16) {
            for (k = 0; k < n; k++) w[k] = es_bf16_to_f32(((const uint16_t*) field)[k]);
        } else {
            memcpy(w, field, (size_t) n * sizeof(float));
        }
    }
    ES_NAME(es_step_row)((uint8_t*) tmp, s, d, rule, alpha, lr, eps, 0, d * 4);
    for (f = 0; f < 2; f++) {
        ptrdiff_t n = f ? acc_w : d;
        uint8_t* field = row + (f ? acc_offset : vec_offset);
        const float* w = tmp + (f ? d : 0);
        if (!(f ? acc_bf16 : vec_bf16)) {
            memcpy(field, w, (size_t) n * sizeof(float));
            continue;
        }
        ES_NAME(es_round_bf16)(w, (uint16_t*) field, n, stochastic,
                               (uint32_t) es_mix64(seed ^ es_mix64(2 * u + (uint64_t) f)));
    }
}
