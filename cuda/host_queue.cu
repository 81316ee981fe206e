/*
 * The host queue's device jobs (csrc/core/host_queue.c; memfit/cuda_launch.h): an
 * asynchronous copy with its completion event, and a wait for an event. Called on the
 * queue's own thread, which holds no Python lock, so a wait here blocks nothing else.
 */
#include <cuda_runtime.h>

#include "cuda_util.cuh"
#include "memfit/cuda_launch.h"

extern "C" mf_status mf_cuda_copy_async(void *dst, const void *src, size_t n, int device,
                                        void *stream, void *event) {
  MfDeviceGuard guard(device);
  if (guard.err != cudaSuccess) return mf_cuda_status(guard.err, "host queue copy: set device");
  cudaStream_t s = (cudaStream_t)stream;
  mf_status st = mf_cuda_status(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s),
                                "host queue copy");
  if (st == MF_OK && event)
    st = mf_cuda_status(cudaEventRecord((cudaEvent_t)event, s), "host queue copy: event record");
  return st;
}

extern "C" mf_status mf_cuda_event_wait(void *event) {
  return mf_cuda_status(cudaEventSynchronize((cudaEvent_t)event), "host queue event wait");
}
