/*
 * Blockwise quantization kernels. The element math (absmax step, nearest and
 * stochastic code search, dequantize) comes from memfit/quant.h, shared with the CPU
 * loop in csrc/core/quant.c, so both produce the same codes and absmax.
 *
 * quantize_blockwise_kernel: one thread block per quantization block. Pass 1 reduces
 * absmax (warp shuffles, then one value per warp in shared memory); pass 2 reads the
 * block again (from L1/L2: at most 16 KB) and writes the codes. The 256-entry code
 * sits in shared memory for the binary search.
 * dequantize_blockwise_kernel: grid-stride loop, one element per thread per step; the
 * block of element i is i >> log2(block_size) (block sizes are powers of two, checked
 * by the core), not a 64-bit division per element.
 */
#include "cuda_util.cuh"
#include "memfit/cuda_launch.h"
#include "memfit/numeric.h"
#include "memfit/quant.h"

namespace {

constexpr int kMaxThreads = 256;

__device__ float block_absmax(float m) {
  for (int off = 16; off > 0; off >>= 1)
    m = mf_absmax_combine(m, __shfl_xor_sync(0xffffffffu, m, off));
  __shared__ float warp_max[kMaxThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  const int nwarps = (blockDim.x + 31) / 32;
  float r = 0.0f;
  for (int w = 0; w < nwarps; w++) r = mf_absmax_combine(r, warp_max[w]);
  return r;
}

__global__ void quantize_blockwise_kernel(const void *__restrict__ x, mf_dtype dtype,
                                          int64_t numel, const float *__restrict__ code,
                                          uint8_t *__restrict__ codes,
                                          float *__restrict__ absmax, int64_t block_size,
                                          int stochastic, uint64_t seed) {
  __shared__ float code_s[MF_CODE_SIZE];
  for (int i = threadIdx.x; i < MF_CODE_SIZE; i += blockDim.x) code_s[i] = code[i];

  const int64_t first = (int64_t)blockIdx.x * block_size;
  const int64_t end = first + block_size < numel ? first + block_size : numel;

  float m = 0.0f;
  for (int64_t i = first + threadIdx.x; i < end; i += blockDim.x)
    m = mf_absmax_step(m, mf_load_f32(x, i, dtype));
  m = block_absmax(m); /* contains __syncthreads: code_s is ready too */
  if (threadIdx.x == 0) absmax[blockIdx.x] = m;
  const mf_block_scale s = mf_absmax_scale(m);

  for (int64_t i = first + threadIdx.x; i < end; i += blockDim.x) {
    const float xn = mf_block_normalize(mf_load_f32(x, i, dtype), s);
    codes[i] = stochastic ? mf_quantize_stochastic(code_s, xn, mf_uniform(seed, (uint64_t)i))
                          : mf_quantize_nearest(code_s, xn);
  }
}

__global__ void dequantize_blockwise_kernel(const uint8_t *__restrict__ codes,
                                            const float *__restrict__ absmax,
                                            const float *__restrict__ code, void *out,
                                            mf_dtype dtype, int64_t numel, int block_shift) {
  __shared__ float code_s[MF_CODE_SIZE];
  for (int i = threadIdx.x; i < MF_CODE_SIZE; i += blockDim.x) code_s[i] = code[i];
  __syncthreads();
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += stride)
    mf_store_f32(out, i, dtype, mf_dequantize_one(code_s, codes[i], absmax[i >> block_shift]));
}

}  // namespace

extern "C" mf_status mf_cuda_quantize_blockwise(const mf_tensor *x, const mf_tensor *code,
                                                mf_tensor *codes, mf_tensor *absmax,
                                                int64_t block_size, mf_rounding rounding,
                                                uint64_t seed, void *stream) {
  MfDeviceGuard guard(x->device_id);
  if (guard.err != cudaSuccess) return mf_cuda_status(guard.err, "quantize_blockwise");
  const int64_t nblocks = mf_quant_num_blocks(x->numel, block_size);
  if (nblocks > 0x7fffffffLL)
    return mf_error(MF_ERR_VALUE, "x: too many blocks (%lld) for one launch", (long long)nblocks);
  const int threads = block_size < kMaxThreads ? (int)block_size : kMaxThreads;
  quantize_blockwise_kernel<<<(unsigned)nblocks, threads, 0, (cudaStream_t)stream>>>(
      x->data, x->dtype, x->numel, (const float *)code->data, (uint8_t *)codes->data,
      (float *)absmax->data, block_size, rounding == MF_ROUND_STOCHASTIC, seed);
  return mf_cuda_status(cudaGetLastError(), "quantize_blockwise");
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
  const int threads = 256;
  dequantize_blockwise_kernel<<<mf_grid_for(out->numel, threads), threads, 0,
                                (cudaStream_t)stream>>>(
      (const uint8_t *)codes->data, (const float *)absmax->data, (const float *)code->data,
      out->data, out->dtype, out->numel, shift);
  return mf_cuda_status(cudaGetLastError(), "dequantize_blockwise");
}
