/* The bodies of es_fused.h's inner loops, included once per CPU class with ES_NAME (the
   function names' suffix) and ES_ATTR (their target attribute) set; no include guard. */
/* o += h (float16, widened), or o = fmaf(we, h, o) when weighted: its own function, whose
   restrict parameters let GCC keep the loop in vector registers */
ES_ATTR static void ES_NAME(es_add_f16)(float* restrict o, const uint16_t* restrict h,
                                        ptrdiff_t d, int weighted, float we) {
    ptrdiff_t k;
    if (weighted) { for (k = 0; k < d; k++) o[k] = fmaf(we, es_f16_to_f32(h[k]), o[k]); }
    else { for (k = 0; k < d; k++) o[k] = o[k] + es_f16_to_f32(h[k]); }
}

/* Bag [start, stop) into o: the rows (float32, or bfloat16 / float16 widened exactly as
   read: kind ES_*) summed in element order from zero (w[e] times each, one fused
   multiply-add, when w is not NULL), divided by the length with mean. float32 and bfloat16
   columns go ES_BLOCK at a time with the sums in registers (each element a row slice loaded
   and added, no store and reload of o between elements), the rest one loop; each column's
   additions are the same either way. The rows of the elements ES_AHEAD on (up to
   ahead_stop) are requested first, every line of them. The compiler unswitches the
   loop-invariant tests: each case is its own vector loop. */
#ifndef ES_BLOCK
#define ES_BLOCK 32
#define ES_AHEAD 32
#define ES_GRAD_AHEAD 8
#define ES_OUT_AHEAD 8
static inline void es_prefetch_span(const char* p, ptrdiff_t n) {
    ptrdiff_t off;
    for (off = 0; off < n; off += 64) ES_PREFETCH(p + off);
    ES_PREFETCH(p + n - 1);
}
/* the same for writing: an output row written ES_OUT_AHEAD bags on (a collection's table
   writes its columns of each wide row, a strided walk the hardware prefetcher misses) */
static inline void es_prefetch_span_w(const char* p, ptrdiff_t n) {
    ptrdiff_t off;
    for (off = 0; off < n; off += 64) ES_PREFETCH_W(p + off);
    ES_PREFETCH_W(p + n - 1);
}
#endif
ES_ATTR static void ES_NAME(es_pool_bag)(float* restrict o, ptrdiff_t d, const void* const* rows,
                                         const int64_t* inv, ptrdiff_t start, ptrdiff_t stop,
                                         const float* w, int mean, int kind,
                                         ptrdiff_t ahead_stop) {
    ptrdiff_t e, k, k0 = 0;
    ptrdiff_t row_bytes = d * (kind == ES_F32 ? 4 : 2);
    float fl = (float) (stop - start);
    int bf16 = kind == ES_BF16;
    for (e = start; e < stop && e + ES_AHEAD < ahead_stop; e++)
        es_prefetch_span((const char*) rows[inv[e + ES_AHEAD]], row_bytes);
    if (stop == start) {
        memset(o, 0, (size_t) d * sizeof(float));
        return;
    }
    for (; kind != ES_F16 && k0 + ES_BLOCK <= d; k0 += ES_BLOCK) {
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
        if (kind == ES_F16) {  /* (k0 is 0: float16 rows take this loop whole) */
            ES_NAME(es_add_f16)(o, h, d, w != NULL, we);
            continue;
        }
        for (k = k0; k < d; k++) {
            float x = bf16 ? es_bf16_to_f32(h[k]) : r[k];
            o[k] = w ? fmaf(we, x, o[k]) : o[k] + x;
        }
    }
    if (mean) for (k = k0; k < d; k++) o[k] = o[k] / fl;
}

/* Bags of one element each, bag b the element b: row b of out (ostride floats apart) gets
   es_pool_bag's result for such a bag, the same bits (0.0f + x, or fmaf(w[b], x, 0.0f)
   weighted, divided by 1.0f with mean), in one loop without a call and a bounds read per
   bag; the rows of the bags ES_AHEAD on and the output rows ES_OUT_AHEAD on are requested
   first. */
ES_ATTR static void ES_NAME(es_gather_bags)(float* restrict out, ptrdiff_t ostride,
                                            ptrdiff_t n_bags, ptrdiff_t d,
                                            const void* const* rows, const int64_t* inv,
                                            const float* w, int mean, int kind) {
    ptrdiff_t b, k;
    ptrdiff_t row_bytes = d * (kind == ES_F32 ? 4 : 2);
    for (b = 0; b < n_bags; b++) {
        float* restrict o = out + b * ostride;
        const float* restrict r = (const float*) rows[inv[b]];
        const uint16_t* restrict h = (const uint16_t*) rows[inv[b]];
        float we = w ? w[b] : 1.0f;
        if (b + ES_AHEAD < n_bags)
            es_prefetch_span((const char*) rows[inv[b + ES_AHEAD]], row_bytes);
        if (b + ES_OUT_AHEAD < n_bags)
            es_prefetch_span_w((const char*) (out + (b + ES_OUT_AHEAD) * ostride),
                               d * (ptrdiff_t) sizeof(float));
        if (kind == ES_F32) {
            if (w) { for (k = 0; k < d; k++) o[k] = fmaf(we, r[k], 0.0f); }
            else { for (k = 0; k < d; k++) o[k] = 0.0f + r[k]; }
        } else if (kind == ES_BF16) {
            if (w) { for (k = 0; k < d; k++) o[k] = fmaf(we, es_bf16_to_f32(h[k]), 0.0f); }
            else { for (k = 0; k < d; k++) o[k] = 0.0f + es_bf16_to_f32(h[k]); }
        } else {
            if (w) { for (k = 0; k < d; k++) o[k] = fmaf(we, es_f16_to_f32(h[k]), 0.0f); }
            else { for (k = 0; k < d; k++) o[k] = 0.0f + es_f16_to_f32(h[k]); }
        }
        if (mean) for (k = 0; k < d; k++) o[k] = o[k] / 1.0f;
    }
}

/* *o = x and *am = u where x > *o (torch's strict >: NaN never takes), as a bit select:
   GCC makes "o[k] = take ? x : o[k]" a masked store, slow on some CPUs */
ES_ATTR static inline void ES_NAME(es_take)(float* o, int32_t* am, float x, int32_t u) {
    uint32_t take = 0u - (uint32_t) (x > *o), xb, ob;
    memcpy(&xb, &x, 4);
    memcpy(&ob, o, 4);
    ob = (xb & take) | (ob & ~take);
    memcpy(o, &ob, 4);
    *am = (int32_t) (((uint32_t) u & take) | ((uint32_t) *am & ~take));
}

/* es_take of each value k of a row read as kind (first: o and am set from it); one loop per
   kind and case, so that each is a compare-and-select vector loop */
ES_ATTR static void ES_NAME(es_max_row)(float* restrict o, int32_t* restrict am, ptrdiff_t d,
                                        const void* row, int kind, int32_t u, int first) {
    const float* restrict r = (const float*) row;
    const uint16_t* restrict h = (const uint16_t*) row;
    ptrdiff_t k;
    if (first) {
        if (kind == ES_F32) memcpy(o, r, (size_t) d * sizeof(float));
        else if (kind == ES_BF16) for (k = 0; k < d; k++) o[k] = es_bf16_to_f32(h[k]);
        else for (k = 0; k < d; k++) o[k] = es_f16_to_f32(h[k]);
        for (k = 0; k < d; k++) am[k] = u;
    } else if (kind == ES_F32) {
        for (k = 0; k < d; k++) ES_NAME(es_take)(o + k, am + k, r[k], u);
    } else if (kind == ES_BF16) {
        for (k = 0; k < d; k++) ES_NAME(es_take)(o + k, am + k, es_bf16_to_f32(h[k]), u);
    } else {
        for (k = 0; k < d; k++) ES_NAME(es_take)(o + k, am + k, es_f16_to_f32(h[k]), u);
    }
}

/* Bag [start, stop) max-pooled into o as torch's CPU embedding_bag (mode="max") pools it,
   column by column: the first element's value, then each later element's where it is
   greater (a strict >: on a tie, a NaN or -0.0 against +0.0 the earlier element stays; a NaN
   that came first stays). am[k] receives the row of the keys (inv[e]) that gave o[k].
   Rows are float32, or bfloat16 / float16 widened exactly (the order of widened values is
   the order of the stored ones). An empty bag gives zeros and rows -1 (no gradient). */
ES_ATTR static void ES_NAME(es_max_bag)(float* restrict o, int32_t* restrict am, ptrdiff_t d,
                                        const void* const* rows, const int64_t* inv,
                                        ptrdiff_t start, ptrdiff_t stop, int kind,
                                        ptrdiff_t ahead_stop) {
    ptrdiff_t e, k, k0 = 0;
    ptrdiff_t row_bytes = d * (kind == ES_F32 ? 4 : 2);
    for (e = start; e < stop && e + ES_AHEAD < ahead_stop; e++)
        es_prefetch_span((const char*) rows[inv[e + ES_AHEAD]], row_bytes);
    if (stop == start) {
        memset(o, 0, (size_t) d * sizeof(float));
        for (k = 0; k < d; k++) am[k] = -1;
        return;
    }
    /* float32 and bfloat16 columns ES_BLOCK at a time with the maxima and their rows in
       registers (a select, not a masked store back to o per element), the rest one loop */
    for (; kind != ES_F16 && k0 + ES_BLOCK <= d; k0 += ES_BLOCK) {
        float acc[ES_BLOCK];
        int32_t arg[ES_BLOCK];
        int32_t u = (int32_t) inv[start];
        const float* restrict r = (const float*) rows[inv[start]] + k0;
        const uint16_t* restrict h = (const uint16_t*) rows[inv[start]] + k0;
        for (k = 0; k < ES_BLOCK; k++) {
            acc[k] = kind == ES_BF16 ? es_bf16_to_f32(h[k]) : r[k];
            arg[k] = u;
        }
        for (e = start + 1; e < stop; e++) {
            u = (int32_t) inv[e];
            r = (const float*) rows[inv[e]] + k0;
            h = (const uint16_t*) rows[inv[e]] + k0;
            for (k = 0; k < ES_BLOCK; k++)
                ES_NAME(es_take)(acc + k, arg + k,
                                 kind == ES_BF16 ? es_bf16_to_f32(h[k]) : r[k], u);
        }
        memcpy(o + k0, acc, sizeof acc);
        memcpy(am + k0, arg, sizeof arg);
    }
    for (e = start; k0 < d && e < stop; e++)
        ES_NAME(es_max_row)(o + k0, am + k0, d - k0, (const char*) rows[inv[e]]
                            + k0 * (kind == ES_F32 ? 4 : 2), kind, (int32_t) inv[e], e == start);
}

/* The backward of es_max_bag: row am[b*d+k] of sums (nu rows of d) gets column k of bag b's
   gradient row (grad + b * gstride bytes), added from zero in bag order as torch's max
   backward adds them (an index_add per column over the non-empty bags). Bag by bag, each
   distinct key u of the bag adds to the columns it gave, a whole row at a time: the sum
   computed in every column and kept by a bit select where am is u (a vector loop, where a
   scatter of single columns would not be one); a column's additions are the same. */
ES_ATTR static void ES_NAME(es_max_sums)(float* restrict sums, ptrdiff_t nu, ptrdiff_t d,
                                         const char* grad, ptrdiff_t gstride, ptrdiff_t n_bags,
                                         const int32_t* restrict am, const int64_t* inv,
                                         const int64_t* offsets) {
    ptrdiff_t b, e, e2, k;
    memset(sums, 0, (size_t) (nu * d) * sizeof(float));
    for (b = 0; b < n_bags; b++) {
        const float* restrict g = (const float*) (grad + b * gstride);
        const int32_t* restrict a = am + b * d;
        for (e = offsets[b]; e < offsets[b + 1]; e++) {
            int32_t u = (int32_t) inv[e];
            float* restrict s = sums + (ptrdiff_t) u * d;
            for (e2 = offsets[b]; e2 < e && inv[e2] != u; e2++) {}
            if (e2 < e) continue;  /* a repeat in the bag: its columns are added already */
            for (k = 0; k < d; k++) {
                float t = s[k] + g[k];
                uint32_t keep = 0u - (uint32_t) (a[k] == u), tb, sb;
                memcpy(&tb, &t, 4);
                memcpy(&sb, s + k, 4);
                sb = (tb & keep) | (sb & ~keep);
                memcpy(s + k, &sb, 4);
            }
        }
    }
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
        if (b + ES_GRAD_AHEAD < n_bags)
            es_prefetch_span(grad + (b + ES_GRAD_AHEAD) * gstride, d * (ptrdiff_t) sizeof(float));
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

/* FTRL's weight of a shrunk z: -sh / quad, and +0.0 where sh is zero; the zero chosen by a
   mask (a select GCC would turn into a branch around the division, leaving vector code) */
ES_ATTR static inline float ES_NAME(es_weight)(float sh, float quad) {
    float wk = -sh / quad;
    uint32_t bits, keep = 0u - (uint32_t) (sh != 0.0f);
    memcpy(&bits, &wk, 4);
    bits &= keep;
    memcpy(&wk, &bits, 4);
    return wk;
}

/* One float32 record's optimizer step from its summed gradient s, each operation the one of
   the optimizer's numpy step in the same order (r: es_fused.h's constants; a, b: the first
   and second slot):
   axpy:            vec += alpha * s
   sgd_decay:       vec += -lr * (s + wd * vec)
   adagrad:         a += s * s; vec -= lr * (s / (sqrt(a) + eps))      (per coordinate)
   adagrad_rowwise: a += sumsq(s) / d; vec -= s * (lr / (sqrt(a) + eps))
   momentum:        a = a * mu + s; vec -= lr * a         (nesterov: vec -= lr * (s + mu * a))
   adam (a = m, b = v): m += (s - m) * (1 - b1); v += (s * s - v) * (1 - b2);
                    vec -= (m / (sqrt(v) + eps)) * step_size
   ftrl (a = z, b = n): Optimizer FTRL.apply, the group lasso's norm from es_sumsq64 */
ES_ATTR static void ES_NAME(es_step_row)(uint8_t* row, const float* restrict s, ptrdiff_t d,
                                         const es_rule_t* r, ptrdiff_t vec_offset,
                                         ptrdiff_t acc_offset, ptrdiff_t acc2_offset) {
    float* restrict v = (float*) (row + vec_offset);
    float* restrict a = (float*) (row + acc_offset);
    float* restrict b = (float*) (row + acc2_offset);
    ptrdiff_t k;
    int rule = r->rule;
    if (rule == ES_RULE_AXPY) {
        float alpha = r->alpha;
        for (k = 0; k < d; k++) v[k] = v[k] + alpha * s[k];
    } else if (rule == ES_RULE_SGD_DECAY) {
        float a_ = -r->lr, wd = r->h[0];
        for (k = 0; k < d; k++) v[k] = v[k] + a_ * (s[k] + wd * v[k]);
    } else if (rule == ES_RULE_ADAGRAD) {
        float lr = r->lr, eps = r->eps;
        for (k = 0; k < d; k++) {
            float gk = s[k], ak = a[k] + gk * gk;
            a[k] = ak;
            v[k] = v[k] - lr * (gk / (sqrtf(ak) + eps));
        }
    } else if (rule == ES_RULE_ADAGRAD_ROWWISE) {
        float sc;
        a[0] = a[0] + (d ? es_sumsq(s, d) / (float) d : 0.0f);
        sc = r->lr / (sqrtf(a[0]) + r->eps);
        for (k = 0; k < d; k++) v[k] = v[k] - s[k] * sc;
    } else if (rule == ES_RULE_MOMENTUM) {
        float lr = r->lr, mu = r->h[0];
        for (k = 0; k < d; k++) {
            float ak = a[k] * mu;
            ak = ak + s[k];
            a[k] = ak;
            v[k] = v[k] - lr * ak;
        }
    } else if (rule == ES_RULE_NESTEROV) {
        float lr = r->lr, mu = r->h[0];
        for (k = 0; k < d; k++) {
            float ak = a[k] * mu;
            ak = ak + s[k];
            a[k] = ak;
            v[k] = v[k] - lr * (s[k] + mu * ak);
        }
    } else if (rule == ES_RULE_ADAM) {
        float c1 = r->h[0], c2 = r->h[1], step = r->h[2], eps = r->eps;
        for (k = 0; k < d; k++) {
            float gk = s[k], mk = a[k] + (gk - a[k]) * c1, vk = b[k] + (gk * gk - b[k]) * c2;
            a[k] = mk;
            b[k] = vk;
            v[k] = v[k] - (mk / (sqrtf(vk) + eps)) * step;
        }
    } else {  /* ES_RULE_FTRL */
        float alpha = r->h[0], beta = r->h[1], l2x2 = r->h[2], l1 = r->h[3];
        int group = r->thresh > 0.0;
        for (k = 0; k < d; k++) {
            float gk = s[k], nk = b[k], nn = nk + gk * gk, sq = sqrtf(nn);
            float sigma = (sq - sqrtf(nk)) / alpha;
            float zk = a[k] + (gk - sigma * v[k]);
            float m = fabsf(zk) - l1;
            /* np.sign(z) * np.maximum(|z| - l1, 0) (NaN stays NaN; a zero's sign may differ,
               and every zero is stored as +0.0 below), as selects: vector registers */
            float sh = copysignf(m <= 0.0f ? 0.0f : m, zk);
            a[k] = zk;
            b[k] = nn;
            /* the group lasso's rows keep the shrunk z in v until the row's norm is known */
            v[k] = group ? sh : ES_NAME(es_weight)(sh, (beta + sq) / alpha + l2x2);
        }
        if (group) {  /* the row's shrunk z scaled as a group, then the weights */
            double norm = sqrt(es_sumsq64(v, d));
            float scale = (float) (norm > r->thresh ? 1.0 - r->thresh / norm : 0.0);
            for (k = 0; k < d; k++)
                v[k] = ES_NAME(es_weight)(v[k] * scale, (beta + sqrtf(b[k])) / alpha + l2x2);
        }
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

/* The 32 random bits of value k of a field whose stream starts at base: murmur3's 32-bit
   finalizer of base + k times the golden ratio (independent lanes: the loops stay in vector
   registers) */
ES_ATTR static inline uint32_t ES_NAME(es_bits)(uint32_t base, ptrdiff_t k) {
    uint32_t h = base + (uint32_t) k * 0x9E3779B1u;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

/* One float32 value to bfloat16: to nearest even, or (stochastic) by adding the upper 16 of
   the random bits before the cut; NaN stays a quiet NaN */
ES_ATTR static inline uint16_t ES_NAME(es_round_bf16)(float x, uint32_t bits, int stochastic) {
    uint32_t b, add, nan;
    memcpy(&b, &x, 4);
    add = stochastic ? (bits >> 16) : 0x7FFFu + ((b >> 16) & 1u);
    nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
    return (uint16_t) (nan ? ((b >> 16) | 0x40u) : ((b + add) >> 16));
}

/* float32 values into a 16-bit field (kind ES_BF16 or ES_F16): to nearest even, or
   stochastically from the bits of es_bits. bfloat16 adds 16 random bits before the cut;
   float16 takes es_f32_to_f16_sr's upper neighbour below a uniform draw of 24 bits. NaN
   stays a quiet NaN. */
ES_ATTR static void ES_NAME(es_round_field)(const float* restrict wide, uint16_t* restrict out,
                                            ptrdiff_t n, int kind, int stochastic,
                                            uint32_t base) {
    ptrdiff_t k;
    if (kind == ES_F16) {
        if (stochastic) {
            for (k = 0; k < n; k++)
                out[k] = es_f32_to_f16_sr(wide[k], ES_NAME(es_bits)(base, k) >> 8);
        } else {
            for (k = 0; k < n; k++) out[k] = es_f32_to_f16(wide[k]);
        }
        return;
    }
    for (k = 0; k < n; k++)
        out[k] = ES_NAME(es_round_bf16)(wide[k], ES_NAME(es_bits)(base, k), stochastic);
}

#ifndef ES_FIELD_BASE
#define ES_FIELD_BASE
/* The stream base of field f of key u (see es_step_narrow) */
static inline uint32_t es_field_base(uint64_t seed, uint64_t u, ptrdiff_t f) {
    uint64_t salt = (uint64_t) (f >> 1) * 0xD6E8FEB86659FD93ull;
    return (uint32_t) es_mix64(seed ^ es_mix64(2 * u + (uint64_t) (f & 1)) ^ salt);
}
#endif

/* Row-wise Adagrad on a bfloat16 vector with a float32 accumulator, in one pass: each
   coordinate widened, stepped (es_step_row's arithmetic) and rounded back (es_round_field's)
   in registers, with no float32 copy of the row: the bits of es_step_narrow's three passes. */
/* Its first half: the accumulator moved on by the row's mean squared gradient, and the step
   size it gives (a chain of two divisions and a square root: es_rowwise_bf16_rows runs it for
   a few rows before their vector halves, so the chains of those rows overlap) */
ES_ATTR static inline float ES_NAME(es_rowwise_scale)(uint8_t* row, const float* restrict s,
                                                     ptrdiff_t d, const es_rule_t* r,
                                                     ptrdiff_t acc_offset) {
    float acc;
    memcpy(&acc, row + acc_offset, 4);
    acc = acc + (d ? es_sumsq(s, d) / (float) d : 0.0f);
    memcpy(row + acc_offset, &acc, 4);
    return r->lr / (sqrtf(acc) + r->eps);
}

/* Its second half: the vector stepped by sc and rounded back */
ES_ATTR static inline void ES_NAME(es_rowwise_bf16_apply)(uint8_t* row, const float* restrict s,
                                                         ptrdiff_t d, float sc,
                                                         ptrdiff_t vec_offset, uint64_t seed,
                                                         int stochastic, uint64_t u) {
    uint16_t* restrict h = (uint16_t*) (row + vec_offset);
    uint32_t base = es_field_base(seed, u, 0);
    ptrdiff_t k;
    if (stochastic) {
        for (k = 0; k < d; k++)
            h[k] = ES_NAME(es_round_bf16)(es_bf16_to_f32(h[k]) - s[k] * sc,
                                          ES_NAME(es_bits)(base, k), 1);
    } else {
        for (k = 0; k < d; k++)
            h[k] = ES_NAME(es_round_bf16)(es_bf16_to_f32(h[k]) - s[k] * sc, 0u, 0);
    }
}

ES_ATTR static void ES_NAME(es_step_rowwise_bf16)(uint8_t* row, const float* restrict s,
                                                  ptrdiff_t d, const es_rule_t* r,
                                                  ptrdiff_t vec_offset, ptrdiff_t acc_offset,
                                                  uint64_t seed, int stochastic, uint64_t u) {
    float sc = ES_NAME(es_rowwise_scale)(row, s, d, r, acc_offset);
    ES_NAME(es_rowwise_bf16_apply)(row, s, d, sc, vec_offset, seed, stochastic, u);
}

/* es_step_rowwise_bf16 of n rows (n <= ES_ROWS; key u0 + i's row at rows[i], its sums at
   s + i * d): every row's step size first, then every row's vector, the bits of one row at a
   time. Row by row, the vector loop of one row (tens of instructions per coordinate with the
   rounding bits) left no room for the next row's division chain to start early. */
ES_ATTR static void ES_NAME(es_rowwise_bf16_rows)(uint8_t* const* rows, const float* restrict s,
                                                  ptrdiff_t n, ptrdiff_t d, const es_rule_t* r,
                                                  ptrdiff_t vec_offset, ptrdiff_t acc_offset,
                                                  uint64_t seed, int stochastic, uint64_t u0) {
    float sc[ES_ROWS];
    ptrdiff_t i;
    for (i = 0; i < n; i++)
        sc[i] = ES_NAME(es_rowwise_scale)(rows[i], s + i * d, d, r, acc_offset);
    for (i = 0; i < n; i++)
        ES_NAME(es_rowwise_bf16_apply)(rows[i], s + i * d, d, sc[i], vec_offset, seed,
                                       stochastic, u0 + (uint64_t) i);
}

/* One record with 16-bit fields (vec_kind / acc_kind say which: ES_*): the vector and the
   slots widened into tmp (the vector, then each slot), stepped by es_step_row in float32,
   rounded back. Stochastic rounding's bits of field f come from a base of mix64(seed ^
   mix64(2u + f % 2) ^ (f / 2) * c): a function of the key's row u and the coordinate, not
   of the thread that steps it. tmp: 3 d + 2 floats. */
ES_ATTR static void ES_NAME(es_step_narrow)(uint8_t* row, const float* restrict s, ptrdiff_t d,
                                            const es_rule_t* r, ptrdiff_t vec_offset,
                                            ptrdiff_t acc_offset, ptrdiff_t acc2_offset,
                                            int vec_kind, int acc_kind, float* restrict tmp,
                                            uint64_t seed, int stochastic, uint64_t u) {
    ptrdiff_t sw = es_slot_width(r->rule, d), k, f, nf = 1 + es_rule_slots(r->rule);
    if (r->rule == ES_RULE_ADAGRAD_ROWWISE && vec_kind == ES_BF16 && acc_kind == ES_F32) {
        ES_NAME(es_step_rowwise_bf16)(row, s, d, r, vec_offset, acc_offset, seed, stochastic, u);
        return;
    }
    for (f = 0; f < nf; f++) {
        ptrdiff_t n = f ? sw : d;
        const uint16_t* field = (const uint16_t*) (row + (f == 0 ? vec_offset
                                                          : f == 1 ? acc_offset : acc2_offset));
        float* w = tmp + (f ? d + (f - 1) * sw : 0);
        int kind = f ? acc_kind : vec_kind;
        if (kind == ES_BF16) {
            for (k = 0; k < n; k++) w[k] = es_bf16_to_f32(field[k]);
        } else if (kind == ES_F16) {
            for (k = 0; k < n; k++) w[k] = es_f16_to_f32(field[k]);
        } else {
            memcpy(w, field, (size_t) n * sizeof(float));
        }
    }
    ES_NAME(es_step_row)((uint8_t*) tmp, s, d, r, 0, d * 4, (d + sw) * 4);
    for (f = 0; f < nf; f++) {
        ptrdiff_t n = f ? sw : d;
        uint8_t* field = row + (f == 0 ? vec_offset : f == 1 ? acc_offset : acc2_offset);
        const float* w = tmp + (f ? d + (f - 1) * sw : 0);
        int kind = f ? acc_kind : vec_kind;
        if (kind == ES_F32) {
            memcpy(field, w, (size_t) n * sizeof(float));
            continue;
        }
        ES_NAME(es_round_field)(w, (uint16_t*) field, n, kind, stochastic,
                                es_field_base(seed, u, f));
    }
}
