/*
 * Matrix products on the GPU: the dispatch between cuBLASLt (cuda/gemm_cublaslt.cu)
 * and a portable shared-memory tiled kernel with float32 accumulation and the same
 * fused epilogue as the CPU kernel (bias, saved pre-activation, activation from
 * memfit/gemm.h).
 *
 * The portable kernel is the correctness baseline that works on every architecture
 * memfit builds for, without tensor cores. mf_cuda_gemm tries cuBLASLt first and runs
 * the portable kernel when cuBLASLt declines (it says why: mf_gemm_last_backend).
 *
 * gemm_tiled_kernel: 64 x 64 tile of C per block of 256 threads, each thread a 4 x 4
 * micro tile; 64 x 16 slices of op(A) and 16 x 64 of op(B) staged in shared memory.
 */
#include "cuda_util.cuh"
#include "memfit/cuda_launch.h"
#include "memfit/gemm.h"
#include "memfit/numeric.h"

namespace {

constexpr int BM = 64, BN = 64, BK = 16, TM = 4, TN = 4;

__device__ __forceinline__ float load_a(const void *a, mf_dtype dt, int trans, int64_t m, int64_t k,
                                        int64_t i, int64_t p) {
  if (i >= m || p >= k) return 0.0f;
  return mf_load_f32(a, trans ? p * m + i : i * k + p, dt);
}

__device__ __forceinline__ float load_b(const void *b, mf_dtype dt, int trans, int64_t k, int64_t n,
                                        int64_t p, int64_t j) {
  if (p >= k || j >= n) return 0.0f;
  return mf_load_f32(b, trans ? j * k + p : p * n + j, dt);
}

__global__ void __launch_bounds__(256)
gemm_tiled_kernel(const void *a, int trans_a, const void *b, int trans_b, mf_dtype in_dt, void *c,
                  mf_dtype c_dt, int64_t m, int64_t n, int64_t k, const void *bias,
                  mf_dtype bias_dt, mf_activation act, void *pre, mf_dtype pre_dt) {
  __shared__ float as[BK][BM + 1];
  __shared__ float bs[BK][BN + 1];
  const int tid = threadIdx.x;
  const int tx = tid % (BN / TN), ty = tid / (BN / TN);
  const int64_t row0 = (int64_t)blockIdx.y * BM, col0 = (int64_t)blockIdx.x * BN;
  float acc[TM][TN] = {};
  for (int64_t p0 = 0; p0 < k; p0 += BK) {
    for (int e = tid; e < BM * BK; e += blockDim.x) {
      int r = e / BK, q = e % BK;
      as[q][r] = load_a(a, in_dt, trans_a, m, k, row0 + r, p0 + q);
      int q2 = e / BN, cc = e % BN;
      bs[q2][cc] = load_b(b, in_dt, trans_b, k, n, p0 + q2, col0 + cc);
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < BK; q++) {
      float av[TM], bv[TN];
#pragma unroll
      for (int i = 0; i < TM; i++) av[i] = as[q][ty * TM + i];
#pragma unroll
      for (int j = 0; j < TN; j++) bv[j] = bs[q][tx * TN + j];
#pragma unroll
      for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TN; j++) acc[i][j] += av[i] * bv[j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < TM; i++) {
    const int64_t r = row0 + ty * TM + i;
    if (r >= m) continue;
#pragma unroll
    for (int j = 0; j < TN; j++) {
      const int64_t cidx = col0 + tx * TN + j;
      if (cidx >= n) continue;
      float v = acc[i][j];
      if (bias) v += mf_load_f32(bias, cidx, bias_dt);
      if (pre) mf_store_f32(pre, r * n + cidx, pre_dt, v);
      mf_store_f32(c, r * n + cidx, c_dt, mf_act_forward(v, act));
    }
  }
}

__global__ void act_forward_kernel(const void *x, mf_dtype x_dt, void *y, mf_dtype y_dt, int64_t n,
                                   mf_activation act) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    mf_store_f32(y, i, y_dt, mf_act_forward(mf_load_f32(x, i, x_dt), act));
}

__global__ void act_backward_kernel(const void *dy, mf_dtype dy_dt, const void *pre, mf_dtype pre_dt,
                                    void *dpre, mf_dtype dpre_dt, int64_t n, mf_activation act) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    mf_store_f32(dpre, i, dpre_dt,
                 mf_load_f32(dy, i, dy_dt) * mf_act_grad(mf_load_f32(pre, i, pre_dt), act));
}

}  // namespace

extern "C" mf_status mf_cuda_gemm(const mf_tensor *a, int trans_a, const mf_tensor *b, int trans_b,
                                  mf_tensor *c, int64_t m, int64_t n, int64_t k,
                                  const mf_tensor *bias, mf_activation act, mf_tensor *pre,
                                  void *stream) {
  if (m == 0 || n == 0) {
    mf_gemm_note_backend("portable", "m == 0 or n == 0 (nothing to compute)");
    return MF_OK;
  }
  MfDeviceGuard guard(a->device_id);
  if (guard.err != cudaSuccess) return mf_cuda_status(guard.err, "gemm");
  char why[512] = "";
  int ran = 0;
  mf_status st = mf_cublaslt_gemm(a, trans_a, b, trans_b, c, m, n, k, bias, act, pre, stream, &ran,
                                  why, sizeof why);
  if (st) return st;
  if (ran) {
    mf_gemm_note_backend("cublaslt", "");
    return MF_OK;
  }
  if (mf_gemm_get_backend() == MF_GEMM_CUBLASLT)
    return mf_error(MF_ERR_CUDA, "gemm: the GEMM backend is set to cublaslt, but cuBLASLt cannot run this product: %s", why);
  mf_gemm_note_backend("portable", why);
  const int64_t gx = (n + BN - 1) / BN, gy = (m + BM - 1) / BM;
  if (gx > 0x7fffffffLL || gy > 65535)
    return mf_error(MF_ERR_VALUE, "gemm: matrix too large for one launch (m=%lld, n=%lld)",
                    (long long)m, (long long)n);
  dim3 grid((unsigned)gx, (unsigned)gy);
  gemm_tiled_kernel<<<grid, 256, 0, (cudaStream_t)stream>>>(
      a->data, trans_a, b->data, trans_b, a->dtype, c->data, c->dtype, m, n, k,
      bias ? bias->data : nullptr, bias ? bias->dtype : MF_FLOAT32, act,
      pre ? pre->data : nullptr, pre ? pre->dtype : MF_FLOAT32);
  return mf_cuda_status(cudaGetLastError(), "gemm");
}

extern "C" mf_status mf_cuda_act_forward(const mf_tensor *x, mf_tensor *y, mf_activation act,
                                         void *stream) {
  if (x->numel == 0) return MF_OK;
  act_forward_kernel<<<mf_grid_for(x->numel, 256), 256, 0, (cudaStream_t)stream>>>(
      x->data, x->dtype, y->data, y->dtype, x->numel, act);
  return mf_cuda_status(cudaGetLastError(), "act_forward");
}

extern "C" mf_status mf_cuda_act_backward(const mf_tensor *dy, const mf_tensor *pre,
                                          mf_tensor *dpre, mf_activation act, void *stream) {
  if (dy->numel == 0) return MF_OK;
  MfDeviceGuard guard(dy->device_id);
  if (guard.err != cudaSuccess) return mf_cuda_status(guard.err, "act_backward");
  act_backward_kernel<<<mf_grid_for(dy->numel, 256), 256, 0, (cudaStream_t)stream>>>(
      dy->data, dy->dtype, pre->data, pre->dtype, dpre->data, dpre->dtype, dy->numel, act);
  return mf_cuda_status(cudaGetLastError(), "act_backward");
}
