/* The sum of squares of a float32 row, in one fixed order on every machine: eight running
   lanes (lane k % 8 takes x[k]^2, each product rounded, then added), then the lanes paired
   ((0+1)+(2+3))+((4+5)+(6+7)). Row-wise Adagrad's mean square comes from here on every
   path (the numpy step, the memory:// kernels, the fused step), so all give the same bits;
   the lanes let the compiler keep the loop in vector registers without reassociating. */
#ifndef ES_ROWSQ_H
#define ES_ROWSQ_H
#include <stddef.h>

static inline float es_sumsq(const float* x, ptrdiff_t d) {
    float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    ptrdiff_t k = 0, l;
    for (; k + 8 <= d; k += 8)
        for (l = 0; l < 8; l++) {
            float p = x[k + l] * x[k + l];
            lane[l] = lane[l] + p;
        }
    for (l = 0; k < d; k++, l++) {
        float p = x[k] * x[k];
        lane[l] = lane[l] + p;
    }
    return ((lane[0] + lane[1]) + (lane[2] + lane[3]))
         + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

/* The same order in float64 (each square exact): FTRL's group-lasso row norm on every path
   (the numpy step through rowops.row_sums_of_squares, the fused step) */
static inline double es_sumsq64(const float* x, ptrdiff_t d) {
    double lane[8] = {0., 0., 0., 0., 0., 0., 0., 0.};
    ptrdiff_t k = 0, l;
    for (; k + 8 <= d; k += 8)
        for (l = 0; l < 8; l++) {
            double p = (double) x[k + l] * (double) x[k + l];
            lane[l] = lane[l] + p;
        }
    for (l = 0; k < d; k++, l++) {
        double p = (double) x[k] * (double) x[k];
        lane[l] = lane[l] + p;
    }
    return ((lane[0] + lane[1]) + (lane[2] + lane[3]))
         + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}
#endif
