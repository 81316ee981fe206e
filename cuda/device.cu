/* Runtime queries used by memfit.doctor() and the bindings. A machine with no GPU or
 * no usable driver reports zero devices instead of failing; mf_cuda_unavailable says
 * why, so `memfit doctor` can show the cause (a driver too old for this build's CUDA is
 * the common one: a CUDA 13 build needs driver >= 580), in the words of memfit/cuda_hint.h.
 * Only CUDA 12.0+ runtime API here, so CUDA 12.x toolkits build it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_util.cuh"
#include "memfit/cuda_hint.h"
#include "memfit/cuda_launch.h"

extern "C" int mf_cuda_error_hint(int err, char *buf, size_t len) {
  if (err != MF_CUDA_ERR_INSUFFICIENT_DRIVER && err != MF_CUDA_ERR_NO_KERNEL_IMAGE &&
      err != MF_CUDA_ERR_UNSUPPORTED_PTX) {
    if (len) buf[0] = '\0';
    return 0;
  }
  int driver = 0, device = 0, major = 0, minor = 0;
  cudaDriverGetVersion(&driver); /* 0 when no driver is installed */
  if (err != MF_CUDA_ERR_INSUFFICIENT_DRIVER && cudaGetDevice(&device) == cudaSuccess &&
      (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
       cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess))
    major = minor = 0;
  cudaGetLastError(); /* the queries above leave no error behind */
  return mf_cuda_hint(err, driver, CUDART_VERSION, mf_cuda_archs(), major, minor, buf, len);
}

/* Without initializing CUDA (cudaDriverGetVersion only: a process that forks workers
 * after `import memfit` must not have), whether the driver is older than this build's CUDA
 * major version; the hint, or "". */
extern "C" mf_status mf_cuda_driver_hint(char *buf, size_t len) {
  if (len) buf[0] = '\0';
  int driver = 0;
  cudaDriverGetVersion(&driver);
  if (driver > 0 && driver / 1000 < CUDART_VERSION / 1000)
    mf_cuda_hint(MF_CUDA_ERR_INSUFFICIENT_DRIVER, driver, CUDART_VERSION, mf_cuda_archs(), 0, 0,
                 buf, len);
  return MF_OK;
}

extern "C" mf_status mf_cuda_device_count(int *count) {
  *count = 0;
  cudaError_t err = cudaGetDeviceCount(count);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver ||
      err == cudaErrorInitializationError || err == cudaErrorNotSupported) {
    cudaGetLastError(); /* clear the sticky "no device" error */
    *count = 0;
    return MF_OK;
  }
  return mf_cuda_status(err, "cudaGetDeviceCount");
}

extern "C" mf_status mf_cuda_device_info(int device, char *name, size_t name_len, int *major,
                                         int *minor, int64_t *total_memory) {
  cudaDeviceProp prop;
  mf_status st = mf_cuda_status(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  if (st) return st;
  if (name_len > 0) {
    strncpy(name, prop.name, name_len - 1);
    name[name_len - 1] = '\0';
  }
  *major = prop.major;
  *minor = prop.minor;
  *total_memory = (int64_t)prop.totalGlobalMem;
  return MF_OK;
}

extern "C" mf_status mf_cuda_versions(int *driver, int *runtime) {
  *driver = 0;
  *runtime = 0;
  cudaDriverGetVersion(driver); /* 0 when no driver is installed */
  return mf_cuda_status(cudaRuntimeGetVersion(runtime), "cudaRuntimeGetVersion");
}

extern "C" mf_status mf_cuda_unavailable(char *why, size_t why_len) {
  if (why_len == 0) return MF_OK;
  why[0] = '\0';
  int count = 0, driver = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaSuccess && count > 0) return MF_OK;
  cudaGetLastError();
  cudaDriverGetVersion(&driver); /* 0 when no driver is installed */
  const int rt = CUDART_VERSION;
  if (err == cudaErrorInsufficientDriver) {
    mf_cuda_hint((int)err, driver, rt, mf_cuda_archs(), 0, 0, why, why_len);
  } else if (err == cudaSuccess || err == cudaErrorNoDevice) {
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    snprintf(why, why_len, "no CUDA device is visible%s%s%s", vis ? " (CUDA_VISIBLE_DEVICES=" : "",
             vis ? vis : "", vis ? ")" : "");
  } else {
    snprintf(why, why_len, "cudaGetDeviceCount failed: %s (%s)", cudaGetErrorName(err),
             cudaGetErrorString(err));
  }
  return MF_OK;
}
