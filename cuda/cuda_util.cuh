/*
 * Helpers shared by memfit's CUDA launchers: error mapping and a device guard.
 * Launchers never abort: every CUDA error becomes MF_ERR_CUDA with its message.
 */
#ifndef MEMFIT_CUDA_UTIL_CUH
#define MEMFIT_CUDA_UTIL_CUH

#include <cuda_runtime.h>

#include "memfit/common.h"

/* The one-line fix for an error a rebuild fixes (a driver older than this build's CUDA, no
 * kernel for this GPU), "" for any other: cuda/device.cu, memfit/cuda_hint.h. */
extern "C" int mf_cuda_error_hint(int err, char *buf, size_t len);

static inline mf_status mf_cuda_status(cudaError_t err, const char *what) {
  if (err == cudaSuccess) return MF_OK;
  char hint[640];
  if (mf_cuda_error_hint((int)err, hint, sizeof hint))
    return mf_error(MF_ERR_CUDA, "%s: CUDA error %d (%s): %s", what, (int)err,
                    cudaGetErrorName(err), hint);
  return mf_error(MF_ERR_CUDA, "%s: CUDA error %d (%s): %s", what, (int)err,
                  cudaGetErrorName(err), cudaGetErrorString(err));
}

/* Whether `device` has an active primary context (the driver's
 * cuDevicePrimaryCtxGetState, reached through the runtime so memfit does not link
 * libcuda). Unknown (no driver entry point) counts as active: the guard then restores
 * the caller's device as it always did. */
static inline bool mf_cuda_has_context(int device) {
  typedef int (*get_state_fn)(int dev, unsigned *flags, int *active); /* CUresult, CUdevice */
  static get_state_fn get_state = []() -> get_state_fn {
    void *fn = nullptr;
    cudaDriverEntryPointQueryResult found;
#if CUDART_VERSION >= 12050
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &fn, 12000,
                                                       cudaEnableDefault, &found);
#else
    cudaError_t err = cudaGetDriverEntryPoint("cuDevicePrimaryCtxGetState", &fn,
                                              cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return (get_state_fn)fn;
  }();
  unsigned flags = 0;
  int active = 1;
  if (get_state && get_state(device, &flags, &active) != 0) return true;
  return active != 0;
}

/* Makes `device` current for the lifetime of the guard and restores the caller's
 * device afterwards, so a launcher does not change the caller's CUDA state. As torch's
 * device guard does, it switches back only when it switched, and only to a device
 * that already has a context: since CUDA 12, cudaSetDevice creates the primary context
 * (300-500 MB) of a device the process never used, typically GPU 0, the default
 * current device of every new thread. In that one case the thread stays on `device`,
 * which is also where torch's guard leaves the CUDA runtime (torch keeps the device
 * it means in a thread-local of its own). */
struct MfDeviceGuard {
  int prev = -1;
  bool switched = false;
  cudaError_t err = cudaSuccess;
  explicit MfDeviceGuard(int device) {
    err = cudaGetDevice(&prev);
    if (err == cudaSuccess && prev != device) {
      err = cudaSetDevice(device);
      switched = err == cudaSuccess;
    }
  }
  ~MfDeviceGuard() {
    if (switched && mf_cuda_has_context(prev)) cudaSetDevice(prev);
  }
  MfDeviceGuard(const MfDeviceGuard &) = delete;
  MfDeviceGuard &operator=(const MfDeviceGuard &) = delete;
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
