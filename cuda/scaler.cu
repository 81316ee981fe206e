/*
 * GradScaler update on the device: one thread reads every found_inf flag (passed by
 * value as pointers) and applies mf_scaler_update_rule() (memfit/scaler.h, the same
 * function the CPU path calls) to the state block in device memory. One launch, no
 * host sync: update() returns as soon as the kernel is queued.
 */
#include "cuda_util.cuh"
#include "memfit/cuda_launch.h"
#include "memfit/scaler.h"

namespace {

struct FlagPtrs {
  const float *p[MF_SCALER_MAX_FLAGS];
};

__global__ void scaler_update_kernel(uint32_t *state, FlagPtrs flags, int n,
                                     const float *loss_flag, mf_scaler_config cfg) {
  int any = 0;
  for (int i = 0; i < n; i++) any |= *flags.p[i] != 0.0f;
  mf_scaler_update_rule(state, any, loss_flag && *loss_flag != 0.0f, &cfg);
}

}  // namespace

extern "C" mf_status mf_cuda_scaler_update(mf_tensor *state, const mf_tensor *found_infs,
                                           int64_t n, const mf_tensor *loss_flag,
                                           const mf_scaler_config *cfg, void *stream) {
  MfDeviceGuard guard(state->device_id);
  if (guard.err != cudaSuccess) return mf_cuda_status(guard.err, "scaler_update");
  FlagPtrs flags;
  for (int64_t i = 0; i < n; i++) flags.p[i] = (const float *)found_infs[i].data;
  scaler_update_kernel<<<1, 1, 0, (cudaStream_t)stream>>>((uint32_t *)state->data, flags, (int)n,
      loss_flag ? (const float *)loss_flag->data : nullptr, *cfg);
  return mf_cuda_status(cudaGetLastError(), "scaler_update");
}
