/* Runtime queries used by memfit.doctor() and the bindings. A machine with no GPU or
 * no driver reports zero devices instead of failing. */
#include <string.h>

#include "cuda_util.cuh"
#include "memfit/cuda_launch.h"

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
