/* The inner loops of the fused bag kernels (fused.pyx): one bag pooled (sum, mean or max),
   the gradient sums (per element, or by the max's rows),
   one record's optimizer step, a finiteness test (es_fused_body.h).

   On x86-64 with GCC each loop is built twice, for the baseline and for CPUs with AVX2 and
   FMA, and each call takes the one this CPU runs (one predictable branch; GCC's
   target_clones would pick its "arch=" clones by CPU model, not by the instructions a CPU
   has). The arithmetic is the same in both, operation by operation (the extension is built
   with -ffp-contract=off, fmaf is a correctly rounded fused multiply-add either way, sqrtf
   correctly rounded), so the bits do not depend on the CPU; only the width of the vector
   registers does. */
#ifndef ES_FUSED_H
#define ES_FUSED_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "es_bf16.h"
#include "es_f16.h"
#include "es_prefetch.h"
#include "es_rowsq.h"

enum { ES_RULE_AXPY = 0, ES_RULE_ADAGRAD = 1, ES_RULE_ADAGRAD_ROWWISE = 2, ES_RULE_MOMENTUM = 3,
       ES_RULE_NESTEROV = 4, ES_RULE_ADAM = 5, ES_RULE_FTRL = 6, ES_RULE_SGD_DECAY = 7 };

/* The most rows es_rowwise_bf16_rows steps in one call */
enum { ES_ROWS = 8 };

/* How a field is stored: float32, bfloat16 (its upper 16 bits) or IEEE float16 */
enum { ES_F32 = 0, ES_BF16 = 1, ES_F16 = 2 };

/* One optimizer step's constants, each the float32 (or, thresh, float64) value the numpy
   step of the optimizer computes with:
   axpy:            alpha
   sgd_decay:       lr, h[0] weight decay
   adagrad(_rowwise): lr, eps
   momentum/nesterov: lr, h[0] momentum
   adam:            eps, h[0] 1 - b1, h[1] 1 - b2, h[2] the bias-corrected step size
   ftrl:            h[0] alpha, h[1] beta, h[2] 2 * l2, h[3] l1, thresh l21 * sqrt(d) (0: none) */
typedef struct {
    int rule;
    float alpha, lr, eps;
    float h[4];
    double thresh;
} es_rule_t;

/* The float slots a rule keeps per key: how many, and the width of each (d or 1) */
static inline int es_rule_slots(int rule) {
    return rule == ES_RULE_AXPY || rule == ES_RULE_SGD_DECAY ? 0
         : (rule == ES_RULE_ADAM || rule == ES_RULE_FTRL ? 2 : 1);
}
static inline ptrdiff_t es_slot_width(int rule, ptrdiff_t d) {
    return rule == ES_RULE_ADAGRAD_ROWWISE ? 1 : d;
}

#define ES_ATTR
#define ES_NAME(n) n##_base
#include "es_fused_body.h"
#undef ES_ATTR
#undef ES_NAME

#if defined(__GNUC__) && defined(__x86_64__)
#define ES_WIDE 1
#define ES_ATTR __attribute__((target("avx2,fma")))
#define ES_NAME(n) n##_avx2
#include "es_fused_body.h"
#undef ES_ATTR
#undef ES_NAME

static int es_wide_cpu = -1;  /* benign race: every thread computes the same answer */

/* EMBSTORE_BASELINE_KERNELS=1 in the environment keeps the baseline build (a check that
   both give the same bits, or a CPU that misreports its features) */
static inline int es_wide(void) {
    if (es_wide_cpu < 0) {
        const char* off = getenv("EMBSTORE_BASELINE_KERNELS");
        es_wide_cpu = !(off && off[0] && off[0] != '0')
                      && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return es_wide_cpu;
}
#define ES_PICK(n) (es_wide() ? n##_avx2 : n##_base)
#else
#define ES_PICK(n) n##_base
#endif

#define es_pool_bag ES_PICK(es_pool_bag)
#define es_gather_bags ES_PICK(es_gather_bags)
#define es_max_bag ES_PICK(es_max_bag)
#define es_max_sums ES_PICK(es_max_sums)
#define es_scatter_sums ES_PICK(es_scatter_sums)
#define es_sum_key ES_PICK(es_sum_key)
#define es_step_row ES_PICK(es_step_row)
#define es_finite ES_PICK(es_finite)
#define es_step_narrow ES_PICK(es_step_narrow)
#define es_rowwise_bf16_rows ES_PICK(es_rowwise_bf16_rows)
#endif
