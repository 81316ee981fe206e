/*
 * Multi-tensor gradient kernels: unscale + non-finite check, global norm, clip.
 *
 * Many gradients, few launches (apex / PyTorch multi_tensor_apply): mf_mt_pack_next()
 * (memfit/multi_tensor.h, plain C, tested on the CPU by tests/c/test_scaler.c) packs up
 * to 96 tensors, with the prefix sum of their chunks, into an MtArgs passed by value
 * (under the classic 4 KB kernel-parameter limit, so any driver takes it); one thread
 * block handles one chunk of MF_MT_CHUNK elements and finds its tensor in the prefix
 * sum. A model with 500 small gradients costs 6 launches, not 500, and nothing syncs
 * with the host: the scale, found_inf and the norm stay on the device.
 *
 * unscale_grads_kernel: every thread checks and rescales a strided slice of its
 *   block's chunk; __syncthreads_or() folds the non-finite flags, thread 0 sets
 *   found_inf. inv = (float)(1.0 / (double)scale), as torch computes it, by thread 0
 *   once per block (FP64 division runs at 1/32 rate on sm_75).
 * grad_norm_partial_kernel: one float partial per chunk into the workspace (the chunk's
 *   global index), reduced in a fixed order by grad_norm_finish_kernel in float64, so
 *   the result does not depend on scheduling. A general p sums |x|^p in float64, as the
 *   CPU does (in float, 10^40 is already inf: v = 10, p = 40 would clip every gradient
 *   to zero), and stores the chunk's own p-norm, sum^(1/p), which fits a float whenever
 *   the total does; the finish kernel raises it back to the p-th power in float64.
 * clip_grads_kernel: multiplies by torch's clip coefficient read from the norm.
 */
#include "cuda_util.cuh"
#include "memfit/cuda_launch.h"
#include "memfit/multi_tensor.h"
#include "memfit/numeric.h"
#include "memfit/scaler.h"

namespace {

constexpr int kThreads = 512;

/* One launch: tensors 0 .. ntensors-1; block b works on chunk b - start[t] of tensor
 * t = mf_mt_tensor_of(start, ntensors, b). */
struct MtArgs {
  void *ptr[MF_MT_MAX_TENSORS];
  int64_t numel[MF_MT_MAX_TENSORS];
  int64_t start[MF_MT_MAX_TENSORS + 1];
  uint8_t dtype[MF_MT_MAX_TENSORS];
  int32_t ntensors;
  uint32_t nblocks; /* start[ntensors] */
  int64_t base;     /* global chunk index of block 0 (grad_norm's workspace slot) */
};
static_assert(sizeof(MtArgs) <= 4000, "multi-tensor arguments must fit the 4 KB parameter limit");

enum { kNormL2 = 0, kNormL1 = 1, kNormInf = 2, kNormP = 3 };

/* The chunk this block works on. */
struct Chunk {
  void *ptr;
  mf_dtype dtype;
  int64_t first, len;
};

__device__ __forceinline__ Chunk my_chunk(const MtArgs &a) {
  const int64_t t = mf_mt_tensor_of(a.start, a.ntensors, blockIdx.x);
  Chunk c;
  c.ptr = a.ptr[t];
  c.dtype = (mf_dtype)a.dtype[t];
  c.first = ((int64_t)blockIdx.x - a.start[t]) * MF_MT_CHUNK;
  const int64_t rest = a.numel[t] - c.first;
  c.len = rest < MF_MT_CHUNK ? rest : MF_MT_CHUNK;
  return c;
}

__global__ void __launch_bounds__(kThreads)
    unscale_grads_kernel(MtArgs a, const float *__restrict__ scale, float *found_inf) {
  __shared__ float inv_s;
  const Chunk c = my_chunk(a);
  if (threadIdx.x == 0) inv_s = scale ? (float)(1.0 / (double)*scale) : 1.0f;
  __syncthreads();
  const float inv = inv_s;
  const bool write = inv != 1.0f;
  int bad = 0;
  for (int64_t i = c.first + threadIdx.x; i < c.first + c.len; i += blockDim.x) {
    const float v = mf_load_f32(c.ptr, i, c.dtype);
    bad |= !mf_isfinite_f32(v);
    if (write) mf_store_f32(c.ptr, i, c.dtype, v * inv);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
}

/* Block-wide reductions over kThreads threads (warp shuffles, then one value per
 * warp in shared memory). Every thread gets the result. */
template <class T>
__device__ T block_sum(T v) {
  __shared__ T s[kThreads / 32];
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = v;
  __syncthreads();
  T r = 0;
  for (int w = 0; w < (int)(blockDim.x + 31) / 32; w++) r += s[w];
  __syncthreads();
  return r;
}

__device__ uint32_t block_max_u32(uint32_t v) {
  __shared__ uint32_t s[kThreads / 32];
  for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
  if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = v;
  __syncthreads();
  uint32_t r = 0;
  for (int w = 0; w < (int)(blockDim.x + 31) / 32; w++) r = max(r, s[w]);
  __syncthreads();
  return r;
}

__global__ void __launch_bounds__(kThreads)
    grad_norm_partial_kernel(MtArgs a, int kind, double p, float *__restrict__ ws, int64_t base) {
  const Chunk c = my_chunk(a);
  if (kind == kNormInf) {
    /* max of |x| bits: same order as the floats, and NaN sorts above inf */
    uint32_t m = 0;
    for (int64_t i = c.first + threadIdx.x; i < c.first + c.len; i += blockDim.x)
      m = max(m, mf_f32_bits(mf_load_f32(c.ptr, i, c.dtype)) & 0x7fffffffu);
    m = block_max_u32(m);
    if (threadIdx.x == 0) ws[base + blockIdx.x] = mf_f32_from_bits(m);
    return;
  }
  if (kind == kNormP) {
    double acc = 0.0;
    for (int64_t i = c.first + threadIdx.x; i < c.first + c.len; i += blockDim.x)
      acc += pow(fabs((double)mf_load_f32(c.ptr, i, c.dtype)), p);
    acc = block_sum(acc);
    if (threadIdx.x == 0) ws[base + blockIdx.x] = (float)pow(acc, 1.0 / p);
    return;
  }
  float acc = 0.0f;
  for (int64_t i = c.first + threadIdx.x; i < c.first + c.len; i += blockDim.x) {
    const float v = fabsf(mf_load_f32(c.ptr, i, c.dtype));
    acc += kind == kNormL2 ? v * v : v;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) ws[base + blockIdx.x] = acc;
}

constexpr int kFinishThreads = 256;

__global__ void __launch_bounds__(kFinishThreads)
    grad_norm_finish_kernel(const float *__restrict__ ws, int64_t nchunks, int kind, double p,
                            float *out) {
  __shared__ double s[kFinishThreads];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < nchunks; i += blockDim.x) {
    const double v = kind == kNormP ? pow((double)ws[i], p) : ws[i]; /* see the top */
    if (kind == kNormInf) acc = (v > acc || v != v) ? v : acc;
    else acc += v;
  }
  s[threadIdx.x] = acc;
  __syncthreads();
  for (int half = kFinishThreads / 2; half > 0; half /= 2) { /* fixed tree order */
    if (threadIdx.x < half) {
      const double x = s[threadIdx.x], y = s[threadIdx.x + half];
      s[threadIdx.x] = kind == kNormInf ? ((y > x || y != y) ? y : x) : x + y;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const double t = s[0];
    double norm = kind == kNormInf || kind == kNormL1 ? t : kind == kNormL2 ? sqrt(t)
                                                                           : pow(t, 1.0 / p);
    *out = (float)norm;
  }
}

__global__ void __launch_bounds__(kThreads)
    clip_grads_kernel(MtArgs a, const float *__restrict__ norm, float max_norm) {
  const Chunk c = my_chunk(a);
  float coef = (1.0f / (*norm + 1e-6f)) * max_norm; /* as torch: reciprocal * max_norm */
  coef = coef > 1.0f ? 1.0f : coef;
  if (coef == 1.0f) return; /* x * 1 is x: skip the write (uniform across the grid) */
  for (int64_t i = c.first + threadIdx.x; i < c.first + c.len; i += blockDim.x)
    mf_store_f32(c.ptr, i, c.dtype, mf_load_f32(c.ptr, i, c.dtype) * coef);
}

/* Calls launch(args) for each launch mf_mt_pack_next() packs. */
template <class Launch>
mf_status for_each_launch(const mf_tensor *t, int64_t n, Launch launch) {
  for (int64_t i = 0; i < n; i++)
    if (mf_mt_items(t[i].numel, MF_MT_CHUNK) > MF_MT_MAX_GRID)
      return mf_error(MF_ERR_VALUE, "grads[%lld]: too large (%lld elements)", (long long)i,
                      (long long)t[i].numel);
  mf_mt_packer pk;
  mf_mt_pack_begin(&pk, n > 0 ? &t[0].numel : nullptr, sizeof *t, nullptr, n, MF_MT_CHUNK);
  MtArgs a;
  for (;;) {
    a.base = pk.base;
    int64_t first;
    const int64_t count = mf_mt_pack_next(&pk, MF_MT_MAX_TENSORS, MF_MT_MAX_GRID, a.start, &first);
    if (count == 0) return MF_OK;
    for (int64_t k = 0; k < count; k++) {
      a.ptr[k] = t[first + k].data;
      a.numel[k] = t[first + k].numel;
      a.dtype[k] = (uint8_t)t[first + k].dtype;
    }
    a.ntensors = (int32_t)count;
    a.nblocks = (uint32_t)a.start[count];
    mf_status st = launch(a);
    if (st) return st;
  }
}

}  // namespace

extern "C" mf_status mf_cuda_unscale_grads(mf_tensor *grads, int64_t n, const mf_tensor *scale,
                                           mf_tensor *found_inf, void *stream) {
  MfDeviceGuard guard(found_inf->device_id);
  if (guard.err != cudaSuccess) return mf_cuda_status(guard.err, "unscale_grads");
  const float *s = scale ? (const float *)scale->data : nullptr;
  float *fi = (float *)found_inf->data;
  return for_each_launch(grads, n, [&](const MtArgs &a) {
    unscale_grads_kernel<<<a.nblocks, kThreads, 0, (cudaStream_t)stream>>>(a, s, fi);
    return mf_cuda_status(cudaGetLastError(), "unscale_grads");
  });
}

static int norm_kind(double p) {
  if (isinf(p)) return kNormInf;
  return p == 2.0 ? kNormL2 : p == 1.0 ? kNormL1 : kNormP;
}

extern "C" mf_status mf_cuda_grad_norm(const mf_tensor *grads, int64_t n, double norm_type,
                                       mf_tensor *workspace, mf_tensor *out, void *stream) {
  MfDeviceGuard guard(out->device_id);
  if (guard.err != cudaSuccess) return mf_cuda_status(guard.err, "grad_norm");
  const int kind = norm_kind(norm_type);
  float *ws = (float *)workspace->data;
  mf_status st = for_each_launch(grads, n, [&](const MtArgs &a) {
    grad_norm_partial_kernel<<<a.nblocks, kThreads, 0, (cudaStream_t)stream>>>(
        a, kind, norm_type, ws, a.base);
    return mf_cuda_status(cudaGetLastError(), "grad_norm");
  });
  if (st) return st;
  /* no chunks (no gradients, or all empty): the finish kernel writes 0 */
  grad_norm_finish_kernel<<<1, kFinishThreads, 0, (cudaStream_t)stream>>>(
      ws, mf_mt_num_chunks(grads, n), kind, norm_type, (float *)out->data);
  return mf_cuda_status(cudaGetLastError(), "grad_norm");
}

extern "C" mf_status mf_cuda_clip_grads(mf_tensor *grads, int64_t n, const mf_tensor *norm,
                                        float max_norm, void *stream) {
  MfDeviceGuard guard(norm->device_id);
  if (guard.err != cudaSuccess) return mf_cuda_status(guard.err, "clip_grads");
  const float *nm = (const float *)norm->data;
  return for_each_launch(grads, n, [&](const MtArgs &a) {
    clip_grads_kernel<<<a.nblocks, kThreads, 0, (cudaStream_t)stream>>>(a, nm, max_norm);
    return mf_cuda_status(cudaGetLastError(), "clip_grads");
  });
}
