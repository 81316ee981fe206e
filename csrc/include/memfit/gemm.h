/*
 * memfit core: matrix products with float32 accumulation, fused bias + activation.
 *
 *   C[m, n] = act(op(A)[m, k] . op(B)[k, n] + bias[n])
 *
 * op(A) is A stored [m, k] row-major, or its transpose stored [k, m] (trans_a); op(B)
 * is B stored [k, n], or stored [n, k] (trans_b: the layout of a Linear weight). A and
 * B share one dtype (float32, float16 or bfloat16); C, bias and the saved
 * pre-activation may be any of those. Products accumulate in float32.
 *
 * The activation math is written once (MF_HD) for the CPU kernel and the GPU path.
 * GELU is the exact erf form, torch's default (approximate="none").
 */
#ifndef MEMFIT_GEMM_H
#define MEMFIT_GEMM_H

#include <math.h>

#include "memfit/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { MF_ACT_NONE = 0, MF_ACT_RELU = 1, MF_ACT_GELU = 2 } mf_activation;

static inline MF_HD float mf_act_forward(float x, mf_activation act) {
  switch (act) {
    case MF_ACT_RELU: return x > 0.0f ? x : 0.0f;
    case MF_ACT_GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    default: return x;
  }
}

/* d act(x) / dx */
static inline MF_HD float mf_act_grad(float x, mf_activation act) {
  switch (act) {
    case MF_ACT_RELU: return x > 0.0f ? 1.0f : 0.0f;
    case MF_ACT_GELU: {
      float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
      float pdf = 0.39894228040143268f * expf(-0.5f * x * x);
      return cdf + x * pdf;
    }
    default: return 1.0f;
  }
}

/* bias and pre may be NULL. pre (same shape as C) receives the value before the
 * activation, which the backward pass needs. */
mf_status mf_gemm(const mf_tensor *a, int trans_a, const mf_tensor *b, int trans_b, mf_tensor *c,
                  int64_t m, int64_t n, int64_t k, const mf_tensor *bias, mf_activation act,
                  mf_tensor *pre, void *stream);

/* dpre = dy * act'(pre), elementwise (all the same numel; any float dtypes). */
mf_status mf_act_backward(const mf_tensor *dy, const mf_tensor *pre, mf_tensor *dpre,
                          mf_activation act, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* MEMFIT_GEMM_H */
