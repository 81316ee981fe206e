/*
 * Fused gradient passes over many tensors: unscale + non-finite check, global norm,
 * clip. Argument checks and dispatch here; CPU loops below; CUDA in cuda/unscale.cu.
 *
 * CPU layout: the tensors are cut into chunks of MF_MT_CHUNK elements (the same unit
 * as a CUDA thread block) and one OpenMP loop runs over all chunks of all tensors, so
 * 1000 small gradients cost one parallel region, not 1000. The float32 loops are
 * written so GCC/Clang vectorise them: the non-finite test is an integer max over
 * exponent bits (no branch, no float compare), and the norm accumulates 16 float
 * lanes per 256 elements before adding into a double.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memfit/scaler.h"
#ifdef MEMFIT_WITH_CUDA
#include "memfit/cuda_launch.h"
#endif

/* ---- shared checks ------------------------------------------------------------- */

int64_t mf_mt_num_chunks(const mf_tensor *t, int64_t n) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; i++) c += mf_mt_items(t[i].numel, MF_MT_CHUNK);
  return c;
}

/* Every tensor a float dtype, all on one device; names the offending element as
 * grads[i] so the Python message points at the parameter. */
static mf_status check_tensors(const mf_tensor *t, int64_t n, const char *name) {
  if (n < 0) return mf_error(MF_ERR_VALUE, "%s: negative count %lld", name, (long long)n);
  for (int64_t i = 0; i < n; i++) {
    const mf_dtype dt = t[i].dtype;
    const int bad_dtype = dt != MF_FLOAT32 && dt != MF_FLOAT16 && dt != MF_BFLOAT16;
    const int bad_device =
        i > 0 && (t[i].device != t[0].device || t[i].device_id != t[0].device_id);
    if (!bad_dtype && !bad_device && t[i].numel >= 0) continue;
    char item[64]; /* formatted only for the message */
    snprintf(item, sizeof item, "%s[%lld]", name, (long long)i);
    if (bad_dtype) return mf_check_float(&t[i], item);
    if (t[i].numel < 0) return mf_error(MF_ERR_VALUE, "%s: negative numel", item);
    return mf_error(MF_ERR_VALUE,
                    "%s: all tensors must be on one device (%s:%d), got %s:%d; group them "
                    "by device first",
                    item, mf_device_name(t[0].device), t[0].device_id,
                    mf_device_name(t[i].device), t[i].device_id);
  }
  return MF_OK;
}

static mf_status check_scalar(const mf_tensor *s, const char *name, const mf_tensor *grads,
                              int64_t n) {
  mf_status st;
  if ((st = mf_check_dtype(s, name, MF_FLOAT32))) return st;
  if ((st = mf_check_numel(s, name, 1))) return st;
  if (n > 0 && (st = mf_check_same_device(&grads[0], "grads[0]", s, name))) return st;
  return MF_OK;
}

/* `call` (a CUDA launcher) in a CUDA build; in a CPU-only build, where the launchers
 * are not declared, the error that says so instead. */
#ifdef MEMFIT_WITH_CUDA
#define ON_CUDA(what, stream, call) (call)
#else
#define ON_CUDA(what, stream, call) ((void)(stream), mf_error_no_cuda(what))
#endif

/* Threads for a pass over `elems` elements: one below ~64K elements (a parallel
 * region costs more than the work). */
static int threads_for(int64_t elems) { return elems < 65536 ? 1 : mf_get_num_threads(); }

/* The chunks (work items of MF_MT_CHUNK elements, multi_tensor.h) of all tensors:
 * `starts` holds each tensor's first chunk (n + 1 entries); `threads` is the thread
 * count for a pass over all of them (threads_for). */
typedef struct {
  int64_t *starts;
  int64_t total;
  int threads;
} chunk_table;

static mf_status chunk_table_make(const mf_tensor *t, int64_t n, chunk_table *ct) {
  ct->starts = (int64_t *)malloc((size_t)(n + 1) * sizeof(int64_t));
  if (!ct->starts) return mf_error(MF_ERR_NOMEM, "grads: out of host memory");
  ct->total = mf_mt_prefix(n > 0 ? &t[0].numel : NULL, sizeof *t, NULL, n, MF_MT_CHUNK, ct->starts);
  int64_t elems = 0;
  for (int64_t i = 0; i < n; i++) elems += t[i].numel;
  ct->threads = threads_for(elems);
  return MF_OK;
}

/* Chunk c of the concatenation -> (tensor, first element, length). */
static void chunk_locate(const chunk_table *ct, int64_t n, int64_t c, const mf_tensor *t,
                         int64_t *tensor, int64_t *first, int64_t *len) {
  const int64_t i = mf_mt_tensor_of(ct->starts, n, c);
  *tensor = i;
  *first = (c - ct->starts[i]) * MF_MT_CHUNK;
  int64_t rest = t[i].numel - *first;
  *len = rest < MF_MT_CHUNK ? rest : MF_MT_CHUNK;
}

/* ---- unscale + non-finite check --------------------------------------------------- */

/* x86-64 with GCC: also compile the hot loops for AVX2 and AVX-512 and pick at load
 * time (ifunc), so a portable build still uses the machine's vector width. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__)
#define MF_VEC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MF_VEC_CLONES
#endif

/* The non-finite test is exponent == all ones, accumulated with OR of compare masks:
 * SSE2 has 32-bit compare-equal but no unsigned max, so this is the form every x86-64
 * vectorises. Returns nonzero if any element is NaN or +-Inf. */
MF_VEC_CLONES static uint32_t unscale_f32(float *restrict p, int64_t n, float inv, int write) {
  uint32_t bad = 0;
  if (write) {
    for (int64_t i = 0; i < n; i++) {
      uint32_t b;
      memcpy(&b, &p[i], sizeof b);
      bad |= -(uint32_t)((b & 0x7f800000u) == 0x7f800000u);
      p[i] = p[i] * inv;
    }
  } else {
    for (int64_t i = 0; i < n; i++) {
      uint32_t b;
      memcpy(&b, &p[i], sizeof b);
      bad |= -(uint32_t)((b & 0x7f800000u) == 0x7f800000u);
    }
  }
  return bad;
}

MF_VEC_CLONES static uint32_t unscale_bf16(uint16_t *restrict p, int64_t n, float inv, int write) {
  uint16_t bad = 0;
  for (int64_t i = 0; i < n; i++) bad |= (uint16_t)-(uint16_t)((p[i] & 0x7f80u) == 0x7f80u);
  if (write)
    for (int64_t i = 0; i < n; i++) p[i] = mf_f32_to_bf16(mf_bf16_to_f32(p[i]) * inv);
  return bad;
}

static uint32_t unscale_f16(uint16_t *restrict p, int64_t n, float inv, int write) {
  uint16_t bad = 0;
  for (int64_t i = 0; i < n; i++) bad |= (uint16_t)-(uint16_t)((p[i] & 0x7c00u) == 0x7c00u);
  if (write)
    for (int64_t i = 0; i < n; i++) p[i] = mf_f32_to_f16(mf_f16_to_f32(p[i]) * inv);
  return bad;
}

static mf_status unscale_cpu(mf_tensor *g, int64_t n, float inv, int write, int *bad_out) {
  chunk_table ct;
  mf_status st = chunk_table_make(g, n, &ct);
  if (st) return st;
  uint32_t bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad) num_threads(ct.threads)
  for (int64_t c = 0; c < ct.total; c++) {
    int64_t ti, first, len;
    chunk_locate(&ct, n, c, g, &ti, &first, &len);
    switch (g[ti].dtype) {
      case MF_FLOAT32: bad |= unscale_f32((float *)g[ti].data + first, len, inv, write); break;
      case MF_BFLOAT16: bad |= unscale_bf16((uint16_t *)g[ti].data + first, len, inv, write); break;
      case MF_FLOAT16: bad |= unscale_f16((uint16_t *)g[ti].data + first, len, inv, write); break;
      default: break; /* rejected by check_tensors */
    }
  }
  free(ct.starts);
  *bad_out = bad != 0;
  return MF_OK;
}

mf_status mf_unscale_grads(mf_tensor *grads, int64_t n, const mf_tensor *scale,
                           mf_tensor *found_inf, void *stream) {
  mf_status st;
  if ((st = check_tensors(grads, n, "grads"))) return st;
  if ((st = check_scalar(found_inf, "found_inf", grads, n))) return st;
  if (scale && (st = check_scalar(scale, "scale", grads, n))) return st;
  if (scale && (st = mf_check_same_device(found_inf, "found_inf", scale, "scale"))) return st;
  if (found_inf->device == MF_CUDA)
    return ON_CUDA("unscale_grads", stream, mf_cuda_unscale_grads(grads, n, scale, found_inf, stream));
  /* torch multiplies by inv only when it is not 1 (x * 1.0f is x anyway, except that
   * it would rewrite NaN payloads), so a scale of 1 is a check-only pass */
  float inv = 1.0f;
  if (scale) inv = (float)(1.0 / (double)*(const float *)scale->data);
  int bad = 0;
  if ((st = unscale_cpu(grads, n, inv, scale != NULL && inv != 1.0f, &bad))) return st;
  if (bad) *(float *)found_inf->data = 1.0f;
  return MF_OK;
}

/* ---- global norm ------------------------------------------------------------------- */

enum { NORM_L2 = 0, NORM_L1 = 1, NORM_INF = 2, NORM_P = 3 };

/* Sums of x^2 and of |x|: 16 float lanes over blocks of 1024 elements (vectorised, and
 * short enough that float accumulation loses nothing that matters), each block's sum
 * added into a double. */
#define MF_NORM_BLOCK 1024
/* The one loop of both sums; `square` is a constant at each call, so after inlining
 * each caller (and each of its target clones) is the loop of its own operation. */
static inline __attribute__((always_inline)) double sum_f32(const float *restrict x, int64_t n,
                                                            int square) {
  double total = 0.0;
  int64_t i = 0;
  for (; i + MF_NORM_BLOCK <= n; i += MF_NORM_BLOCK) {
    float lane[16] = {0};
    for (int64_t j = 0; j < MF_NORM_BLOCK; j += 16)
      for (int k = 0; k < 16; k++) {
        const float v = x[i + j + k];
        lane[k] += square ? v * v : fabsf(v);
      }
    float s = 0.0f;
    for (int k = 0; k < 16; k++) s += lane[k];
    total += s;
  }
  for (; i < n; i++) total += square ? (double)x[i] * x[i] : fabs((double)x[i]);
  return total;
}

MF_VEC_CLONES static double sum_sq_f32(const float *restrict x, int64_t n) { return sum_f32(x, n, 1); }

MF_VEC_CLONES static double sum_abs_f32(const float *restrict x, int64_t n) { return sum_f32(x, n, 0); }

/* max |x| as a double: the integer max of the magnitude bits orders like the floats,
 * and NaN sorts above inf, so NaN propagates. */
MF_VEC_CLONES static double max_abs_f32(const float *restrict x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; i++) {
    uint32_t b;
    memcpy(&b, &x[i], sizeof b);
    b &= 0x7fffffffu;
    m = b > m ? b : m;
  }
  return (double)mf_f32_from_bits(m);
}

/* Partial of one run of floats for the norm kind (NaN propagates in every kind). */
static double partial_f32(const float *restrict x, int64_t n, int kind, double p) {
  switch (kind) {
    case NORM_L2: return sum_sq_f32(x, n);
    case NORM_L1: return sum_abs_f32(x, n);
    case NORM_INF: return max_abs_f32(x, n);
    default: {
      double s = 0.0;
      for (int64_t i = 0; i < n; i++) s += pow(fabs((double)x[i]), p);
      return s;
    }
  }
}

static double partial_any(const mf_tensor *t, int64_t first, int64_t len, int kind, double p) {
  if (t->dtype == MF_FLOAT32) return partial_f32((const float *)t->data + first, len, kind, p);
  float buf[MF_NORM_BLOCK];
  double acc = 0.0;
  for (int64_t i = 0; i < len; i += MF_NORM_BLOCK) {
    int64_t m = len - i < MF_NORM_BLOCK ? len - i : MF_NORM_BLOCK;
    for (int64_t j = 0; j < m; j++) buf[j] = mf_load_f32(t->data, first + i + j, t->dtype);
    double part = partial_f32(buf, m, kind, p);
    if (kind == NORM_INF) acc = (part > acc || part != part) ? part : acc;
    else acc += part;
  }
  return acc;
}

static int norm_kind(double norm_type) {
  if (isinf(norm_type) && norm_type > 0) return NORM_INF;
  if (norm_type == 2.0) return NORM_L2;
  if (norm_type == 1.0) return NORM_L1;
  return NORM_P;
}

static mf_status grad_norm_cpu(const mf_tensor *g, int64_t n, double norm_type, float *out) {
  chunk_table ct;
  mf_status st = chunk_table_make(g, n, &ct);
  if (st) return st;
  double *part = (double *)malloc((size_t)(ct.total > 0 ? ct.total : 1) * sizeof(double));
  if (!part) {
    free(ct.starts);
    return mf_error(MF_ERR_NOMEM, "grad_norm: out of host memory");
  }
  const int kind = norm_kind(norm_type);
#pragma omp parallel for schedule(static) num_threads(ct.threads)
  for (int64_t c = 0; c < ct.total; c++) {
    int64_t ti, first, len;
    chunk_locate(&ct, n, c, g, &ti, &first, &len);
    part[c] = partial_any(&g[ti], first, len, kind, norm_type);
  }
  /* combine in chunk order: the same result for any thread count */
  double acc = 0.0;
  int nan = 0;
  for (int64_t c = 0; c < ct.total; c++) {
    if (part[c] != part[c]) nan = 1;
    if (kind == NORM_INF) acc = part[c] > acc ? part[c] : acc;
    else acc += part[c];
  }
  free(part);
  free(ct.starts);
  double norm;
  if (nan) norm = NAN;
  else if (kind == NORM_INF || kind == NORM_L1) norm = acc;
  else if (kind == NORM_L2) norm = sqrt(acc);
  else norm = pow(acc, 1.0 / norm_type);
  *out = (float)norm;
  return MF_OK;
}

mf_status mf_grad_norm(const mf_tensor *grads, int64_t n, double norm_type,
                       mf_tensor *workspace, mf_tensor *out, void *stream) {
  mf_status st;
  if (!(norm_type > 0.0) || (isinf(norm_type) && norm_type < 0))
    return mf_error(MF_ERR_VALUE, "norm_type: must be > 0 or inf, got %g", norm_type);
  if ((st = check_tensors(grads, n, "grads"))) return st;
  if ((st = check_scalar(out, "out", grads, n))) return st;
  if (out->device == MF_CUDA) {
    /* the workspace is checked even in a CPU-only build: the same message either way */
    if ((st = mf_check_dtype(workspace, "workspace", MF_FLOAT32))) return st;
    if ((st = mf_check_same_device(out, "out", workspace, "workspace"))) return st;
    if (workspace->numel < mf_mt_num_chunks(grads, n))
      return mf_error(MF_ERR_VALUE, "workspace: needs %lld float32 elements, got %lld",
                      (long long)mf_mt_num_chunks(grads, n), (long long)workspace->numel);
    return ON_CUDA("grad_norm", stream,
                   mf_cuda_grad_norm(grads, n, norm_type, workspace, out, stream));
  }
  return grad_norm_cpu(grads, n, norm_type, (float *)out->data);
}

/* ---- clip ----------------------------------------------------------------------------- */

/* torch: clip_coef = max_norm / (total_norm + 1e-6), clamped to <= 1, all in float32;
 * `float / tensor` is computed by torch as reciprocal(tensor) * float. */
static inline float clip_coef(float norm, float max_norm) {
  float coef = (1.0f / (norm + 1e-6f)) * max_norm;
  return coef > 1.0f ? 1.0f : coef; /* NaN stays NaN, as torch.clamp keeps it */
}

MF_VEC_CLONES static void scale_f32(float *restrict p, int64_t n, float c) {
  for (int64_t i = 0; i < n; i++) p[i] *= c;
}

mf_status mf_clip_grads(mf_tensor *grads, int64_t n, const mf_tensor *norm, float max_norm,
                        void *stream) {
  mf_status st;
  if ((st = check_tensors(grads, n, "grads"))) return st;
  if ((st = check_scalar(norm, "norm", grads, n))) return st;
  if (norm->device == MF_CUDA)
    return ON_CUDA("clip_grads", stream, mf_cuda_clip_grads(grads, n, norm, max_norm, stream));
  const float coef = clip_coef(*(const float *)norm->data, max_norm);
  if (coef == 1.0f) return MF_OK; /* x * 1 is x: nothing to write */
  chunk_table ct;
  if ((st = chunk_table_make(grads, n, &ct))) return st;
#pragma omp parallel for schedule(static) num_threads(ct.threads)
  for (int64_t c = 0; c < ct.total; c++) {
    int64_t ti, first, len;
    chunk_locate(&ct, n, c, grads, &ti, &first, &len);
    const mf_tensor *t = &grads[ti];
    if (t->dtype == MF_FLOAT32) {
      scale_f32((float *)t->data + first, len, coef);
    } else {
      for (int64_t i = first; i < first + len; i++)
        mf_store_f32(t->data, i, t->dtype, mf_load_f32(t->data, i, t->dtype) * coef);
    }
  }
  free(ct.starts);
  return MF_OK;
}
