/*
 * What to do when the CUDA runtime cannot run this build's kernels: one line naming the
 * driver/toolkit pair or the architecture list needed and how to rebuild. Pure C, built
 * with or without CUDA, so the messages are tested on machines without a GPU; cuda/
 * device.cu feeds it the versions and the device it queried (csrc/core/cuda_hint.c).
 */
#ifndef MEMFIT_CUDA_HINT_H
#define MEMFIT_CUDA_HINT_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The CUDA runtime's codes for the three errors a hint explains (stable across CUDA
 * versions: driver_types.h). */
enum {
  MF_CUDA_ERR_INSUFFICIENT_DRIVER = 35,   /* cudaErrorInsufficientDriver */
  MF_CUDA_ERR_NO_KERNEL_IMAGE = 209,      /* cudaErrorNoKernelImageForDevice */
  MF_CUDA_ERR_UNSUPPORTED_PTX = 222,      /* cudaErrorUnsupportedPtxVersion */
};

/* Writes the hint for `cuda_error` into `buf` and returns 1, or writes "" and returns 0
 * for an error no rebuild fixes. `driver` and `runtime` are cudaDriverGetVersion's and
 * CUDART_VERSION's numbers (12040 = 12.4; driver 0: no driver); `archs` is build_info's
 * list ("75-real,90"); `cc_major`.`cc_minor` the device's capability (0.0: unknown). */
int mf_cuda_hint(int cuda_error, int driver, int runtime, const char *archs, int cc_major,
                 int cc_minor, char *buf, size_t len);

/* 1 when the architecture list `archs` ("75-real,80-real,90") has code a GPU of
 * capability major.minor runs: SASS of the same major and a minor no higher (an 'a'/'f'
 * arch-specific one: the same capability only), or PTX of a capability no higher. */
int mf_cuda_archs_run_on(const char *archs, int cc_major, int cc_minor);

/* The NVIDIA driver a CUDA `runtime` major version needs at least (580 for 13, 525 for
 * 12), 0 when unknown. */
int mf_cuda_min_driver(int runtime);

#ifdef __cplusplus
}
#endif

#endif /* MEMFIT_CUDA_HINT_H */
