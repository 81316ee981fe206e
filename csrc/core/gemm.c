/*
 * Matrix products on the CPU: a blocked float32-accumulating GEMM.
 *
 * Each thread owns tiles of C (MC x NC) and keeps a float32 accumulator for its tile,
 * so half-precision outputs are rounded once, at the end. For each KC slice of the
 * inner dimension it widens the A block and the B panel into float32 buffers laid
 * out for the micro-kernel (MR rows / NR columns interleaved), then runs an MR x NR
 * micro-kernel whose inner loop the compiler vectorises; on x86-64 it is compiled
 * for AVX-512, AVX2+FMA and baseline, chosen at run time. The epilogue adds the bias,
 * stores the pre-activation if asked, applies the activation and narrows to C's dtype.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memfit/gemm.h"
#include "memfit/numeric.h"
#ifdef MEMFIT_WITH_CUDA
#include "memfit/cuda_launch.h"
#endif

#define MR 8
#define NR 32
#define MC 64
#define NC 256
#define KC 256

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MF_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MF_MULTIVERSION
#endif

/* acc[MR][NR] (row stride ldacc) += ap[kc][MR]^T . bp[kc][NR] */
MF_MULTIVERSION
static void micro_kernel(int64_t kc, const float *restrict ap, const float *restrict bp,
                         float *restrict acc, int64_t ldacc) {
  float c[MR][NR];
  memset(c, 0, sizeof c);
  for (int64_t p = 0; p < kc; p++) {
    const float *a = ap + p * MR, *b = bp + p * NR;
    for (int i = 0; i < MR; i++) {
      const float ai = a[i];
      for (int j = 0; j < NR; j++) c[i][j] += ai * b[j];
    }
  }
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NR; j++) acc[i * ldacc + j] += c[i][j];
}

/* Element (i, p) of op(A), widened to float. */
static inline float load_op(const mf_tensor *t, int trans, int64_t rows, int64_t cols, int64_t i,
                            int64_t p) {
  return mf_load_f32(t->data, trans ? p * rows + i : i * cols + p, t->dtype);
}

/* A block rows [i0, i0+mc) x cols [p0, p0+kc) -> MR-row micro panels, zero padded. */
static void pack_a(const mf_tensor *a, int trans_a, int64_t m, int64_t k, int64_t i0, int64_t mc,
                   int64_t p0, int64_t kc, float *dst) {
  for (int64_t ir = 0; ir < mc; ir += MR)
    for (int64_t p = 0; p < kc; p++)
      for (int i = 0; i < MR; i++, dst++)
        *dst = ir + i < mc ? load_op(a, trans_a, m, k, i0 + ir + i, p0 + p) : 0.0f;
}

/* B panel rows [p0, p0+kc) x cols [j0, j0+nc) -> NR-column micro panels, zero padded. */
static void pack_b(const mf_tensor *b, int trans_b, int64_t k, int64_t n, int64_t p0, int64_t kc,
                   int64_t j0, int64_t nc, float *dst) {
  for (int64_t jr = 0; jr < nc; jr += NR)
    for (int64_t p = 0; p < kc; p++)
      for (int j = 0; j < NR; j++, dst++) {
        int64_t col = j0 + jr + j;
        /* op(B)(p, col) = trans_b ? B[col][p] : B[p][col] */
        *dst = jr + j < nc ? mf_load_f32(b->data, trans_b ? col * k + (p0 + p) : (p0 + p) * n + col,
                                         b->dtype)
                           : 0.0f;
      }
}

static mf_status gemm_cpu(const mf_tensor *a, int trans_a, const mf_tensor *b, int trans_b,
                          mf_tensor *c, int64_t m, int64_t n, int64_t k, const mf_tensor *bias,
                          mf_activation act, mf_tensor *pre) {
  const int64_t tiles_m = (m + MC - 1) / MC, tiles_n = (n + NC - 1) / NC;
  int failed = 0;
#pragma omp parallel num_threads(mf_get_num_threads()) if (m * n * k > 32768)
  {
    /* accumulator tile rounded up to whole micro tiles, plus packing buffers */
    float *acc = (float *)malloc(sizeof(float) * MC * NC);
    float *abuf = (float *)malloc(sizeof(float) * MC * KC);
    float *bbuf = (float *)malloc(sizeof(float) * KC * NC);
    if (!acc || !abuf || !bbuf) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t tm = 0; tm < tiles_m; tm++) {
      for (int64_t tn = 0; tn < tiles_n; tn++) {
        if (!acc || !abuf || !bbuf) continue;
        const int64_t i0 = tm * MC, j0 = tn * NC;
        const int64_t mc = m - i0 < MC ? m - i0 : MC, nc = n - j0 < NC ? n - j0 : NC;
        memset(acc, 0, sizeof(float) * MC * NC);
        for (int64_t p0 = 0; p0 < k; p0 += KC) {
          const int64_t kc = k - p0 < KC ? k - p0 : KC;
          pack_a(a, trans_a, m, k, i0, mc, p0, kc, abuf);
          pack_b(b, trans_b, k, n, p0, kc, j0, nc, bbuf);
          for (int64_t ir = 0; ir < mc; ir += MR)
            for (int64_t jr = 0; jr < nc; jr += NR)
              micro_kernel(kc, abuf + ir * kc, bbuf + jr * kc, acc + ir * NC + jr, NC);
        }
        for (int64_t i = 0; i < mc; i++) {
          for (int64_t j = 0; j < nc; j++) {
            float v = acc[i * NC + j];
            if (bias) v += mf_load_f32(bias->data, j0 + j, bias->dtype);
            int64_t idx = (i0 + i) * n + (j0 + j);
            if (pre) mf_store_f32(pre->data, idx, pre->dtype, v);
            mf_store_f32(c->data, idx, c->dtype, mf_act_forward(v, act));
          }
        }
      }
    }
    free(acc);
    free(abuf);
    free(bbuf);
  }
  if (failed) return mf_error(MF_ERR_NOMEM, "gemm: out of host memory for the work buffers");
  return MF_OK;
}

mf_status mf_gemm(const mf_tensor *a, int trans_a, const mf_tensor *b, int trans_b, mf_tensor *c,
                  int64_t m, int64_t n, int64_t k, const mf_tensor *bias, mf_activation act,
                  mf_tensor *pre, void *stream) {
  mf_status st;
  if (m < 0 || n < 0 || k < 0)
    return mf_error(MF_ERR_VALUE, "gemm: negative dimension (m=%lld, n=%lld, k=%lld)",
                    (long long)m, (long long)n, (long long)k);
  if ((st = mf_check_float(a, "a")) || (st = mf_check_float(b, "b")) ||
      (st = mf_check_float(c, "out")))
    return st;
  if (a->dtype != b->dtype)
    return mf_error(MF_ERR_TYPE, "a and b must have the same dtype (got %s and %s)",
                    mf_dtype_name(a->dtype), mf_dtype_name(b->dtype));
  if ((st = mf_check_numel(a, "a", m * k)) || (st = mf_check_numel(b, "b", k * n)) ||
      (st = mf_check_numel(c, "out", m * n)))
    return st;
  if ((st = mf_check_same_device(a, "a", b, "b")) || (st = mf_check_same_device(a, "a", c, "out")))
    return st;
  if (bias && ((st = mf_check_float(bias, "bias")) || (st = mf_check_numel(bias, "bias", n)) ||
               (st = mf_check_same_device(a, "a", bias, "bias"))))
    return st;
  if (pre && ((st = mf_check_float(pre, "pre")) || (st = mf_check_numel(pre, "pre", m * n)) ||
              (st = mf_check_same_device(a, "a", pre, "pre"))))
    return st;
  if (!mf_act_valid(act))
    return mf_error(MF_ERR_VALUE, "activation: unknown activation %d", (int)act);
  if (a->device == MF_CUDA) {
#ifdef MEMFIT_WITH_CUDA
    return mf_cuda_gemm(a, trans_a, b, trans_b, c, m, n, k, bias, act, pre, stream);
#else
    (void)stream;
    return mf_error_no_cuda("gemm");
#endif
  }
  mf_gemm_note_backend("cpu", "");
  if (m == 0 || n == 0) return MF_OK;
  return gemm_cpu(a, trans_a, b, trans_b, c, m, n, k, bias, act, pre);
}

mf_status mf_act_backward(const mf_tensor *dy, const mf_tensor *pre, mf_tensor *dpre,
                          mf_activation act, void *stream) {
  mf_status st;
  if ((st = mf_check_float(dy, "grad_output")) || (st = mf_check_float(pre, "pre")) ||
      (st = mf_check_float(dpre, "out")))
    return st;
  if ((st = mf_check_numel(pre, "pre", dy->numel)) || (st = mf_check_numel(dpre, "out", dy->numel)))
    return st;
  if ((st = mf_check_same_device(dy, "grad_output", pre, "pre")) ||
      (st = mf_check_same_device(dy, "grad_output", dpre, "out")))
    return st;
  if (!mf_act_valid(act))
    return mf_error(MF_ERR_VALUE, "activation: unknown activation %d", (int)act);
  if (dy->device == MF_CUDA) {
#ifdef MEMFIT_WITH_CUDA
    return mf_cuda_act_backward(dy, pre, dpre, act, stream);
#else
    (void)stream;
    return mf_error_no_cuda("act_backward");
#endif
  }
  const int64_t n = dy->numel;
#pragma omp parallel for schedule(static) num_threads(mf_get_num_threads()) if (n > 65536)
  for (int64_t i = 0; i < n; i++) {
    float g = mf_load_f32(dy->data, i, dy->dtype) *
              mf_act_grad(mf_load_f32(pre->data, i, pre->dtype), act);
    mf_store_f32(dpre->data, i, dpre->dtype, g);
  }
  return MF_OK;
}

/* ---- backend choice and reporting (the cuBLASLt side is cuda/gemm_cublaslt.cu) ---- */

/* -1: not decided yet; MEMFIT_GEMM_BACKEND is read on the first use. */
static atomic_int g_backend = -1;

mf_status mf_gemm_set_backend(mf_gemm_backend backend) {
  if (backend != MF_GEMM_AUTO && backend != MF_GEMM_PORTABLE && backend != MF_GEMM_CUBLASLT)
    return mf_error(MF_ERR_VALUE, "backend: unknown GEMM backend %d", (int)backend);
  atomic_store(&g_backend, (int)backend);
  return MF_OK;
}

mf_gemm_backend mf_gemm_get_backend(void) {
  int b = atomic_load(&g_backend);
  if (b >= 0) return (mf_gemm_backend)b;
  const char *env = getenv("MEMFIT_GEMM_BACKEND");
  b = MF_GEMM_AUTO; /* unset, empty or unknown (memfit.amp.gemm_backend() reports an unknown value) */
  if (env && !strcmp(env, "portable")) b = MF_GEMM_PORTABLE;
  if (env && !strcmp(env, "cublaslt")) b = MF_GEMM_CUBLASLT;
  int unset = -1;
  atomic_compare_exchange_strong(&g_backend, &unset, b); /* a concurrent set wins */
  return (mf_gemm_backend)atomic_load(&g_backend);
}

static _Thread_local const char *g_last_backend = "";
static _Thread_local char g_last_reason[512];

void mf_gemm_note_backend(const char *backend, const char *reason) {
  g_last_backend = backend;
  snprintf(g_last_reason, sizeof g_last_reason, "%s", reason ? reason : "");
}

void mf_gemm_last_backend(const char **backend, const char **reason) {
  *backend = g_last_backend;
  *reason = g_last_reason;
}

#ifndef MEMFIT_WITH_CUDA
static const char no_cuda[] = "memfit was built without CUDA support";

mf_status mf_gemm_cublaslt_info(mf_cublaslt_info *info, int load) {
  (void)load;
  memset(info, 0, sizeof *info);
  snprintf(info->reason, sizeof info->reason, "%s", no_cuda);
  return MF_OK;
}

mf_status mf_gemm_cublaslt_add_path(const char *path) {
  (void)path;
  return MF_OK; /* nothing will ever be loaded */
}

mf_status mf_gemm_cublaslt_device(int device, int *usable, const char **reason) {
  (void)device;
  *usable = 0;
  *reason = no_cuda;
  return MF_OK;
}

mf_status mf_gemm_cublaslt_selfcheck(void) {
  return mf_error(MF_ERR_NO_CUDA, "cublaslt: %s", no_cuda);
}
#endif
