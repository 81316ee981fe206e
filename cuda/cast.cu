/* Float casts on the GPU: a grid-stride loop over mf_cast_one (cast.h), the same
 * element function as the CPU loop, so both produce the same bits. A same-dtype cast
 * without stochastic rounding is a byte copy on both (cudaMemcpyAsync here): a load and
 * store through float would canonicalise NaN payloads, which the CPU keeps. x and out
 * may be the same array (mf_cast allows it when the dtypes match), so neither pointer
 * is __restrict__. */
#include "cuda_util.cuh"
#include "memfit/cast.h"
#include "memfit/cuda_launch.h"

namespace {

__global__ void cast_kernel(const void *x, mf_dtype xt, void *out,
                            mf_dtype ot, int64_t n, int stochastic, uint64_t seed) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    mf_cast_one(x, xt, out, ot, i, stochastic, seed);
}

}  // namespace

extern "C" mf_status mf_cuda_cast(const mf_tensor *x, mf_tensor *out, int stochastic,
                                  uint64_t seed, void *stream) {
  if (x->numel == 0) return MF_OK;
  MfDeviceGuard guard(x->device_id);
  if (guard.err != cudaSuccess) return mf_cuda_status(guard.err, "cast");
  if (x->dtype == out->dtype && !stochastic) {
    if (x->data == out->data) return MF_OK;
    return mf_cuda_status(cudaMemcpyAsync(out->data, x->data,
                                          (size_t)x->numel * mf_dtype_size(x->dtype),
                                          cudaMemcpyDeviceToDevice, (cudaStream_t)stream),
                          "cast");
  }
  const int threads = 256;
  cast_kernel<<<mf_grid_for(x->numel, threads), threads, 0, (cudaStream_t)stream>>>(
      x->data, x->dtype, out->data, out->dtype, x->numel, stochastic, seed);
  return mf_cuda_status(cudaGetLastError(), "cast");
}
