/*
 * Blockwise quantization kernels. The element math (absmax step, nearest and
 * stochastic code search, dequantize) comes from memfit/quant.h, shared with the CPU
 * loop in csrc/core/quant.c, so both produce the same codes and absmax.
 *
 * Both kernels are shaped for memory bandwidth: each thread owns runs of 8 consecutive
 * elements (one or two 16-byte loads of x or out, one 8-byte load or store of codes; a
 * run at the tensor's end or at an unaligned address goes element by element), and the
 * grid stays resident (a few blocks per SM, mf_cuda_resident_blocks) and walks the data,
 * so the 256-entry code is loaded into shared memory once per resident block.
 *
 * quantize_kernel<BS>: one pass. A quantization block is owned by T = BS / E threads,
 * E = max(8, BS / 256) elements each, held in registers from the load to the store: a
 * block of 256 is one warp (absmax by 5 shuffles, no barrier), smaller blocks a part of
 * a warp, larger ones several warps (then one barrier per round, the per-warp maxima
 * double-buffered by round parity). Nearest rounding searches through the code slice
 * (code_slice.cuh: one shared-memory load, exact) in launches large enough to pay for
 * building it, the binary search otherwise; stochastic rounding keeps the binary search.
 * dequantize_kernel: 8 elements per thread per step; the block of element i is
 * i >> log2(block_size) (block sizes are powers of two, checked by the core), one absmax
 * per run (block sizes are >= 64).
 */
#include "code_slice.cuh"
#include "cuda_util.cuh"
#include "wide_access.cuh"
#include "memfit/cuda_launch.h"
#include "memfit/numeric.h"
#include "memfit/quant.h"

#include <stdlib.h>

namespace {

constexpr int kThreads = 256;
constexpr int kRun = 8; /* consecutive elements a thread loads and stores together */

__device__ __forceinline__ float half_to_f32(uint16_t h, mf_dtype dt) {
  return dt == MF_BFLOAT16 ? mf_bf16_to_f32(h) : mf_f16_to_f32(h);
}

/* Elements i .. i + 7 of x as floats (mf_load_f32): 16-byte loads when all 8 are there
 * and aligned, else the first `valid` one by one (the rest 0). */
__device__ __forceinline__ void load_run(const void *x, mf_dtype dt, int64_t i, int valid, float v[kRun]) {
  const int esize = dt == MF_FLOAT32 ? 4 : 2;
  if (valid == kRun && aligned_to((const char *)x + i * esize, 16)) {
    if (dt == MF_FLOAT32) {
      const Vec16 *p = (const Vec16 *)((const float *)x + i);
      const Vec16 a = p[0], b = p[1];
#pragma unroll
      for (int k = 0; k < 4; k++) {
        v[k] = mf_f32_from_bits(a.w[k]);
        v[k + 4] = mf_f32_from_bits(b.w[k]);
      }
    } else {
      const Vec16 a = *(const Vec16 *)((const uint16_t *)x + i);
#pragma unroll
      for (int k = 0; k < 4; k++) {
        v[2 * k] = half_to_f32((uint16_t)a.w[k], dt);
        v[2 * k + 1] = half_to_f32((uint16_t)(a.w[k] >> 16), dt);
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < kRun; k++) v[k] = k < valid ? mf_load_f32(x, i + k, dt) : 0.0f;
  }
}

/* Stores v[0 .. valid) at elements i .. of out (mf_store_f32), 16 bytes at a time when
 * all 8 are there and aligned. */
__device__ __forceinline__ void store_run(void *out, mf_dtype dt, int64_t i, int valid, const float v[kRun]) {
  const int esize = dt == MF_FLOAT32 ? 4 : 2;
  if (valid == kRun && aligned_to((char *)out + i * esize, 16)) {
    if (dt == MF_FLOAT32) {
      Vec16 a, b;
#pragma unroll
      for (int k = 0; k < 4; k++) {
        a.w[k] = mf_f32_bits(v[k]);
        b.w[k] = mf_f32_bits(v[k + 4]);
      }
      Vec16 *p = (Vec16 *)((float *)out + i);
      p[0] = a;
      p[1] = b;
    } else {
      Vec16 a;
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const uint32_t lo = dt == MF_BFLOAT16 ? mf_f32_to_bf16(v[2 * k]) : mf_f32_to_f16(v[2 * k]);
        const uint32_t hi = dt == MF_BFLOAT16 ? mf_f32_to_bf16(v[2 * k + 1]) : mf_f32_to_f16(v[2 * k + 1]);
        a.w[k] = lo | (hi << 16);
      }
      *(Vec16 *)((uint16_t *)out + i) = a;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kRun; k++)
      if (k < valid) mf_store_f32(out, i + k, dt, v[k]);
  }
}

/* The elements of [i, i + 8) below n (0 to 8). */
__device__ __forceinline__ int run_length(int64_t i, int64_t n) {
  return i >= n ? 0 : (n - i >= kRun ? kRun : (int)(n - i));
}

template <int BS>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const void *__restrict__ x, mf_dtype dtype, int64_t numel, int64_t nblocks,
                    const float *__restrict__ code, uint8_t *__restrict__ codes, float *__restrict__ absmax,
                    int stochastic, uint64_t seed, int use_slice) {
  constexpr int E = BS / kThreads > kRun ? BS / kThreads : kRun; /* elements per thread */
  constexpr int R = E / kRun;                                    /* runs per thread */
  constexpr int T = BS / E;                                      /* threads per block */
  constexpr int GROUPS = kThreads / T;                           /* blocks per round */
  constexpr int WARPS = T > 32 ? T / 32 : 1;                     /* warps per block */
  static_assert(T >= kRun && T <= kThreads && BS % (T * kRun) == 0, "block sizes 64 .. 4096");
  __shared__ float code_s[MF_CODE_SIZE];
  __shared__ uint32_t slice[kSliceSigned];
  __shared__ float red[2][kThreads / 32];

  for (int i = threadIdx.x; i < MF_CODE_SIZE; i += blockDim.x) code_s[i] = code[i];
  __syncthreads();
  const bool sliced = use_slice && !stochastic;
  if (sliced) {
    slice_build<MF_CODE_SIZE>(slice, code_s, false);
    __syncthreads();
  }
  const int r = threadIdx.x % T, warp = threadIdx.x / 32;
  int parity = 0;
  /* every thread of the block runs the same rounds (the barrier below) */
  for (int64_t b0 = (int64_t)blockIdx.x * GROUPS; b0 < nblocks; b0 += (int64_t)gridDim.x * GROUPS, parity ^= 1) {
    const int64_t blk = b0 + threadIdx.x / T, first = blk * BS;
    float v[R][kRun];
    float m = 0.0f;
#pragma unroll
    for (int c = 0; c < R; c++) {
      const int64_t i = first + (int64_t)c * T * kRun + r * kRun;
      const int valid = blk < nblocks ? run_length(i, numel) : 0;
      load_run(x, dtype, i, valid, v[c]);
#pragma unroll
      for (int k = 0; k < kRun; k++)
        if (k < valid) m = mf_absmax_step(m, v[c][k]);
    }
    /* the block's absmax: shuffles within its T (or 32) lanes, then across its warps */
#pragma unroll
    for (int off = (T < 32 ? T : 32) / 2; off > 0; off >>= 1)
      m = mf_absmax_combine(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (WARPS > 1) {
      if (threadIdx.x % 32 == 0) red[parity][warp] = m;
      __syncthreads();
      const int lead = warp & ~(WARPS - 1);
      m = 0.0f;
#pragma unroll
      for (int w = 0; w < WARPS; w++) m = mf_absmax_combine(m, red[parity][lead + w]);
    }
    if (blk >= nblocks) continue;
    if (r == 0) absmax[blk] = m;
    const mf_block_scale s = mf_absmax_scale(m);
#pragma unroll
    for (int c = 0; c < R; c++) {
      const int64_t i = first + (int64_t)c * T * kRun + r * kRun;
      const int valid = run_length(i, numel);
      uint32_t q[kRun];
#pragma unroll
      for (int k = 0; k < kRun; k++) {
        const float xn = mf_block_normalize(v[c][k], s);
        q[k] = k >= valid ? 0u
               : stochastic ? mf_quantize_stochastic(code_s, xn, mf_uniform(seed, (uint64_t)(i + k)))
               : sliced     ? slice_quantize<MF_CODE_SIZE>(slice, code_s, false, xn)
                            : mf_quantize_nearest(code_s, xn);
      }
      if (valid == kRun && aligned_to(codes + i, 8)) {
        Vec8 a;
        a.w[0] = q[0] | (q[1] << 8) | (q[2] << 16) | (q[3] << 24);
        a.w[1] = q[4] | (q[5] << 8) | (q[6] << 16) | (q[7] << 24);
        *(Vec8 *)(codes + i) = a;
      } else {
#pragma unroll
        for (int k = 0; k < kRun; k++)
          if (k < valid) codes[i + k] = (uint8_t)q[k];
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t *__restrict__ codes, const float *__restrict__ absmax,
                      const float *__restrict__ code, void *out, mf_dtype dtype, int64_t numel,
                      int block_shift) {
  __shared__ float code_s[MF_CODE_SIZE];
  for (int i = threadIdx.x; i < MF_CODE_SIZE; i += blockDim.x) code_s[i] = code[i];
  __syncthreads();
  const int64_t stride = (int64_t)gridDim.x * blockDim.x * kRun;
  for (int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * kRun; i < numel; i += stride) {
    const int valid = run_length(i, numel);
    const float am = absmax[i >> block_shift]; /* one block: block sizes are >= 64 */
    uint32_t q[kRun];
    if (valid == kRun && aligned_to(codes + i, 8)) {
      const Vec8 a = *(const Vec8 *)(codes + i);
#pragma unroll
      for (int k = 0; k < kRun; k++) q[k] = (a.w[k / 4] >> (8 * (k % 4))) & 255u;
    } else {
#pragma unroll
      for (int k = 0; k < kRun; k++) q[k] = k < valid ? codes[i + k] : 0u;
    }
    float v[kRun];
#pragma unroll
    for (int k = 0; k < kRun; k++) v[k] = mf_dequantize_one(code_s, (uint8_t)q[k], am);
    store_run(out, dtype, i, valid, v);
  }
}

/* Blocks of `kernel` (256 threads) that all SMs of the current device hold at once: the
 * grid of a kernel that walks its data. */
template <class K>
cudaError_t resident_blocks(K kernel, int64_t *blocks) {
  int dev = 0, sms = 0, per_sm = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
  *blocks = (int64_t)(sms > 0 ? sms : 1) * (per_sm > 0 ? per_sm : 1);
  return err;
}

/* Quantizations of at least this many elements build the code slice:
 * MEMFIT_CUDA_SLICE_MIN, as the optimizer step (cuda/optim.cu). */
int64_t slice_min_elements() {
  static const int64_t v = [] {
    const char *e = getenv("MEMFIT_CUDA_SLICE_MIN");
    return e && *e ? (int64_t)atoll(e) : ((int64_t)1 << 24);
  }();
  return v;
}

template <int BS>
mf_status launch_quantize(const mf_tensor *x, const mf_tensor *code, mf_tensor *codes, mf_tensor *absmax,
                          int64_t nblocks, int stochastic, uint64_t seed, cudaStream_t stream) {
  constexpr int T = BS / (BS / kThreads > kRun ? BS / kThreads : kRun), GROUPS = kThreads / T;
  int64_t resident;
  const cudaError_t err = resident_blocks(quantize_kernel<BS>, &resident);
  if (err != cudaSuccess) return mf_cuda_status(err, "quantize_blockwise");
  const int64_t want = (nblocks + GROUPS - 1) / GROUPS;
  const unsigned grid = (unsigned)(want < resident ? want : resident);
  quantize_kernel<BS><<<grid, kThreads, 0, stream>>>(x->data, x->dtype, x->numel, nblocks,
                                                     (const float *)code->data, (uint8_t *)codes->data,
                                                     (float *)absmax->data, stochastic, seed,
                                                     x->numel >= slice_min_elements());
  return mf_cuda_status(cudaGetLastError(), "quantize_blockwise");
}

}  // namespace

extern "C" mf_status mf_cuda_quantize_blockwise(const mf_tensor *x, const mf_tensor *code,
                                                mf_tensor *codes, mf_tensor *absmax,
                                                int64_t block_size, mf_rounding rounding,
                                                uint64_t seed, void *stream) {
  MfDeviceGuard guard(x->device_id);
  if (guard.err != cudaSuccess) return mf_cuda_status(guard.err, "quantize_blockwise");
  const int64_t nblocks = mf_quant_num_blocks(x->numel, block_size);
  if (nblocks == 0) return MF_OK;
  const int st = rounding == MF_ROUND_STOCHASTIC;
  cudaStream_t s = (cudaStream_t)stream;
  switch (block_size) {
    case 64: return launch_quantize<64>(x, code, codes, absmax, nblocks, st, seed, s);
    case 128: return launch_quantize<128>(x, code, codes, absmax, nblocks, st, seed, s);
    case 256: return launch_quantize<256>(x, code, codes, absmax, nblocks, st, seed, s);
    case 512: return launch_quantize<512>(x, code, codes, absmax, nblocks, st, seed, s);
    case 1024: return launch_quantize<1024>(x, code, codes, absmax, nblocks, st, seed, s);
    case 2048: return launch_quantize<2048>(x, code, codes, absmax, nblocks, st, seed, s);
    case 4096: return launch_quantize<4096>(x, code, codes, absmax, nblocks, st, seed, s);
    default:
      return mf_error(MF_ERR_INTERNAL, "quantize_blockwise: unexpected block size %lld", (long long)block_size);
  }
}

extern "C" mf_status mf_cuda_dequantize_blockwise(const mf_tensor *codes,
                                                  const mf_tensor *absmax,
                                                  const mf_tensor *code, mf_tensor *out,
                                                  int64_t block_size, void *stream) {
  MfDeviceGuard guard(out->device_id);
  if (guard.err != cudaSuccess) return mf_cuda_status(guard.err, "dequantize_blockwise");
  int shift = 0;
  while (((int64_t)1 << shift) < block_size) shift++;
  if (((int64_t)1 << shift) != block_size)
    return mf_error(MF_ERR_INTERNAL, "dequantize_blockwise: block_size %lld is not a power of two",
                    (long long)block_size);
  if (out->numel == 0) return MF_OK;
  int64_t resident;
  const cudaError_t err = resident_blocks(dequantize_kernel, &resident);
  if (err != cudaSuccess) return mf_cuda_status(err, "dequantize_blockwise");
  const int64_t want = (out->numel + (int64_t)kThreads * kRun - 1) / ((int64_t)kThreads * kRun);
  const unsigned grid = (unsigned)(want < resident ? want : resident);
  dequantize_kernel<<<grid, kThreads, 0, (cudaStream_t)stream>>>(
      (const uint8_t *)codes->data, (const float *)absmax->data, (const float *)code->data,
      out->data, out->dtype, out->numel, shift);
  return mf_cuda_status(cudaGetLastError(), "dequantize_blockwise");
}
