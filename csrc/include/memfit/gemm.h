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
 * The activation math is written once (MF_HD) for the CPU kernel and the GPU kernels.
 * MF_ACT_GELU is the exact erf form, torch's default (approximate="none");
 * MF_ACT_GELU_TANH is the tanh approximation (torch's approximate="tanh", GPT-2's), the
 * one cuBLASLt's GELU epilogues compute.
 *
 * On CUDA, mf_gemm runs in cuBLASLt when it can (loaded at run time with dlopen, see
 * cuda/gemm_cublaslt.cu) and otherwise in memfit's portable tiled kernel
 * (cuda/gemm.cu); mf_gemm_backend_* below say which, and why.
 */
#ifndef MEMFIT_GEMM_H
#define MEMFIT_GEMM_H

#include <math.h>

#include "memfit/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  MF_ACT_NONE = 0,
  MF_ACT_RELU = 1,
  MF_ACT_GELU = 2,      /* 0.5 x (1 + erf(x / sqrt 2)) */
  MF_ACT_GELU_TANH = 3  /* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
} mf_activation;

static inline MF_HD int mf_act_valid(int act) { return act >= MF_ACT_NONE && act <= MF_ACT_GELU_TANH; }

/* The tanh approximation's inner term and constants, as torch writes them
 * (aten/src/ATen/native/cpu/Activation.cpp: kBeta = sqrt(2) * 2/sqrt(pi) * 0.5). */
#define MF_GELU_TANH_BETA 0.7978845608028654f
#define MF_GELU_TANH_KAPPA 0.044715f

static inline MF_HD float mf_act_forward(float x, mf_activation act) {
  switch (act) {
    case MF_ACT_RELU: return x > 0.0f ? x : 0.0f;
    case MF_ACT_GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case MF_ACT_GELU_TANH:
      return 0.5f * x * (1.0f + tanhf(MF_GELU_TANH_BETA * (x + MF_GELU_TANH_KAPPA * x * x * x)));
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
    case MF_ACT_GELU_TANH: {
      /* d/dx 0.5 x (1 + t), t = tanh(u), u = beta (x + kappa x^3):
       * 0.5 (1 + t) + 0.5 x (1 - t^2) beta (1 + 3 kappa x^2), in torch's order */
      float x2 = x * x;
      float t = tanhf(MF_GELU_TANH_BETA * (x + MF_GELU_TANH_KAPPA * x2 * x));
      return 0.5f * (1.0f + t) +
             0.5f * x * (1.0f - t * t) * MF_GELU_TANH_BETA * (1.0f + 3.0f * MF_GELU_TANH_KAPPA * x2);
    }
    default: return 1.0f;
  }
}

/* bias and pre may be NULL. pre (same shape as C) receives the value before the
 * activation, which the backward pass needs.
 *
 * Rounding. The CPU and portable CUDA kernels, and cuBLASLt's fused epilogues (bias,
 * relu, gelu_tanh), apply the activation to the float32 value s = acc + bias and round
 * once: C = round_C(act(s)). cuBLASLt's two-pass form (exact gelu; relu or gelu_tanh
 * with a pre the fused GELU_AUX epilogue cannot take: see cuda/gemm_cublaslt.cu) first
 * stores D = round_D(s), D being pre (or C when none is saved), then C = round_C(act(D)),
 * which is what torch computes for F.gelu(F.linear(...)) in half precision. The two
 * agree exactly when D is float32, and for relu in every dtype (rounding is monotone
 * and keeps zero and the sign). For gelu and gelu_tanh with a float16/bfloat16 D they
 * can differ by |act'(s)| (at most 1.13) times half a unit in the last place of D's
 * dtype at |s|, plus C's own rounding: about one unit in the last place of C where
 * |act(s)| is close to |s| (s > 0), relatively more where gelu is small (s < -2).
 * A float32 pre gives the single rounding on every backend. */
mf_status mf_gemm(const mf_tensor *a, int trans_a, const mf_tensor *b, int trans_b, mf_tensor *c,
                  int64_t m, int64_t n, int64_t k, const mf_tensor *bias, mf_activation act,
                  mf_tensor *pre, void *stream);

/* dpre = dy * act'(pre), elementwise (all the same numel; any float dtypes). */
mf_status mf_act_backward(const mf_tensor *dy, const mf_tensor *pre, mf_tensor *dpre,
                          mf_activation act, void *stream);

/* ---- which GEMM implementation runs on CUDA --------------------------------------
 *
 * MF_GEMM_AUTO (default): cuBLASLt when it loads and takes the case, else the
 * portable kernel. MF_GEMM_PORTABLE: always the portable kernel. MF_GEMM_CUBLASLT:
 * cuBLASLt or an error that says why not (for tests and benchmarks). The first
 * CUDA GEMM (or query) reads MEMFIT_GEMM_BACKEND=auto|portable|cublaslt once;
 * mf_gemm_set_backend overrides it. CPU arrays always use the CPU kernel. */
typedef enum { MF_GEMM_AUTO = 0, MF_GEMM_PORTABLE = 1, MF_GEMM_CUBLASLT = 2 } mf_gemm_backend;

mf_status mf_gemm_set_backend(mf_gemm_backend backend);
mf_gemm_backend mf_gemm_get_backend(void);

/* What ran the last mf_gemm call of this thread: "cpu", "cublaslt", "portable", or
 * "" before any call; *reason says why the portable kernel ran instead of cuBLASLt
 * ("" when cuBLASLt ran or on the CPU). Both strings are thread-local. */
void mf_gemm_last_backend(const char **backend, const char **reason);
/* (internal) Records what ran, for mf_gemm_last_backend; called by the dispatch. */
void mf_gemm_note_backend(const char *backend, const char *reason);

/* State of the run-time loaded cuBLASLt (nothing here needs a GPU). */
typedef struct {
  int attempted;   /* a load was tried */
  int loaded;      /* the library loaded and every function we use resolved */
  int version;     /* cublasLtGetVersion(), e.g. 130100 for 13.1.0; 0 if not loaded */
  char path[512];  /* the file it was loaded from */
  char reason[512];/* why it did not load, or "" */
} mf_cublaslt_info;

/* Fills *info; with load != 0, first tries to load the library if no load was tried
 * yet. Built without CUDA: loaded = 0 and the reason says so. */
mf_status mf_gemm_cublaslt_info(mf_cublaslt_info *info, int load);

/* Adds a file to try before the library's names (libcublasLt.so.13, .so.12, .so)
 * are searched, e.g. a pip wheel's nvidia/cu13/lib/libcublasLt.so.13. Only before
 * the first load; MEMFIT_CUBLASLT=<path> (read at load) is tried before these. */
mf_status mf_gemm_cublaslt_add_path(const char *path);

/* Whether cuBLASLt runs GEMMs on CUDA device `device`: loads the library and
 * creates that device's handle if needed. *usable = 1, or 0 with *reason. */
mf_status mf_gemm_cublaslt_device(int device, int *usable, const char **reason);

/* Builds (without running) every cuBLASLt descriptor memfit uses, so a library can
 * be checked against our declarations on a machine without a GPU: every attribute
 * size we pass is accepted. MF_OK, or the first failure. Needs a loaded library. */
mf_status mf_gemm_cublaslt_selfcheck(void);

#ifdef __cplusplus
}
#endif
#endif /* MEMFIT_GEMM_H */
