/*
 * Helpers shared by memfit's CUDA launchers: error mapping and a device guard.
 * Launchers never abort: every CUDA error becomes MF_ERR_CUDA with its message.
 */
#ifndef MEMFIT_CUDA_UTIL_CUH
#define MEMFIT_CUDA_UTIL_CUH

#include <cuda_runtime.h>

#include "memfit/common.h"

static inline mf_status mf_cuda_status(cudaError_t err, const char *what) {
  if (err == cudaSuccess) return MF_OK;
  return mf_error(MF_ERR_CUDA, "%s: CUDA error %d (%s): %s", what, (int)err,
                  cudaGetErrorName(err), cudaGetErrorString(err));
}

/* Makes `device` current for the lifetime of the guard and restores the caller's
 * device afterwards, so a launcher never changes the caller's CUDA state. */
struct MfDeviceGuard {
  int prev = -1;
  cudaError_t err = cudaSuccess;
  explicit MfDeviceGuard(int device) {
    err = cudaGetDevice(&prev);
    if (err == cudaSuccess && prev != device) err = cudaSetDevice(device);
  }
  ~MfDeviceGuard() {
    int cur = -1;
    if (prev >= 0 && cudaGetDevice(&cur) == cudaSuccess && cur != prev) cudaSetDevice(prev);
  }
};

/* Grid size for a grid-stride loop: enough blocks to fill the GPU, never more than
 * the work needs. */
static inline unsigned mf_grid_for(int64_t work_items, int threads) {
  int64_t blocks = (work_items + threads - 1) / threads;
  const int64_t cap = 65535LL * 16;
  if (blocks > cap) blocks = cap;
  return (unsigned)(blocks > 0 ? blocks : 1);
}

#endif /* MEMFIT_CUDA_UTIL_CUH */
