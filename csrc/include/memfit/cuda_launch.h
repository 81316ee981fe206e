/*
 * memfit core -> CUDA: launchers implemented in the cuda/ folder, called by the core's
 * dispatch code only after it has validated every argument. They run on the given
 * stream (a cudaStream_t; NULL is the default stream) on the device of their views,
 * never synchronize, and return MF_ERR_CUDA with the CUDA error string on failure.
 * Only declared when the library is built with CUDA (MEMFIT_WITH_CUDA).
 */
#ifndef MEMFIT_CUDA_LAUNCH_H
#define MEMFIT_CUDA_LAUNCH_H

#include "memfit/common.h"
#include "memfit/gemm.h"
#include "memfit/optim.h"
#include "memfit/quant.h"
#include "memfit/scaler.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Runtime queries (cuda/device.cu). A machine without a GPU or driver gives count 0. */
mf_status mf_cuda_device_count(int *count);
mf_status mf_cuda_device_info(int device, char *name, size_t name_len, int *major,
                              int *minor, int64_t *total_memory);
mf_status mf_cuda_versions(int *driver, int *runtime);
/* Why no CUDA device can be used (no driver, a driver older than this build's CUDA,
 * no visible device, ...) into `why`; empty when one can. */
mf_status mf_cuda_unavailable(char *why, size_t why_len);
/* The hint of memfit/cuda_hint.h when the driver is older than this build's CUDA major
 * version, else ""; reads the driver's version only (CUDA is not initialized). */
mf_status mf_cuda_driver_hint(char *buf, size_t len);

/* cuda/quant.cu */
mf_status mf_cuda_quantize_blockwise(const mf_tensor *x, const mf_tensor *code,
                                     mf_tensor *codes, mf_tensor *absmax,
                                     int64_t block_size, mf_rounding rounding,
                                     uint64_t seed, void *stream);
mf_status mf_cuda_dequantize_blockwise(const mf_tensor *codes, const mf_tensor *absmax,
                                       const mf_tensor *code, mf_tensor *out,
                                       int64_t block_size, void *stream);

/* cuda/cast.cu */
mf_status mf_cuda_cast(const mf_tensor *x, mf_tensor *out, int stochastic, uint64_t seed,
                       void *stream);

/* cuda/gemm.cu: cuBLASLt when it takes the product, else the portable kernel */
mf_status mf_cuda_gemm(const mf_tensor *a, int trans_a, const mf_tensor *b, int trans_b,
                       mf_tensor *c, int64_t m, int64_t n, int64_t k, const mf_tensor *bias,
                       mf_activation act, mf_tensor *pre, void *stream);
mf_status mf_cuda_act_backward(const mf_tensor *dy, const mf_tensor *pre, mf_tensor *dpre,
                               mf_activation act, void *stream);
/* y = act(x) elementwise on x's device (the caller's device is current); y may be x */
mf_status mf_cuda_act_forward(const mf_tensor *x, mf_tensor *y, mf_activation act, void *stream);
/* cuda/gemm_cublaslt.cu: runs the product in cuBLASLt and sets *ran = 1, or leaves it
 * (*ran = 0) and writes the reason into why; an error only when cuBLASLt failed while
 * running. The caller has made a's device current; m, n > 0. */
mf_status mf_cublaslt_gemm(const mf_tensor *a, int trans_a, const mf_tensor *b, int trans_b,
                           mf_tensor *c, int64_t m, int64_t n, int64_t k, const mf_tensor *bias,
                           mf_activation act, mf_tensor *pre, void *stream, int *ran, char *why,
                           size_t why_len);
/* cuda/optim.cu: multi-tensor optimizer step (arguments checked by mf_optim_step). */
mf_status mf_cuda_optim_step(const mf_optim_hparams *h, mf_state_format fmt, int64_t block_size,
                             const mf_tensor *code1, const mf_tensor *code2,
                             const mf_optim_tensor *tensors, int64_t n,
                             const mf_tensor *grad_scale, const mf_tensor *found_inf,
                             void *stream);

/* cuda/scaler.cu */
mf_status mf_cuda_scaler_update(mf_tensor *state, const mf_tensor *found_infs, int64_t n,
                                const mf_tensor *loss_flag, const mf_scaler_config *cfg,
                                void *stream);

/* cuda/unscale.cu: multi-tensor kernels (one launch covers up to MF_MT_MAX_TENSORS
 * tensors, one thread block per chunk of MF_MT_CHUNK elements; multi_tensor.h) */
mf_status mf_cuda_unscale_grads(mf_tensor *grads, int64_t n, const mf_tensor *scale,
                                mf_tensor *found_inf, void *stream);
mf_status mf_cuda_grad_norm(const mf_tensor *grads, int64_t n, double norm_type,
                            mf_tensor *workspace, mf_tensor *out, void *stream);
mf_status mf_cuda_clip_grads(mf_tensor *grads, int64_t n, const mf_tensor *norm,
                             float max_norm, void *stream);

/* cuda/host_queue.cu: the host queue's device jobs (host_queue.c), run on its thread.
 * cudaMemcpyAsync of n bytes on `stream` (NULL: the default stream) with `device`
 * current, then cudaEventRecord(event, stream) when event is not NULL. */
mf_status mf_cuda_copy_async(void *dst, const void *src, size_t n, int device, void *stream,
                             void *event);
/* cudaEventSynchronize(event). */
mf_status mf_cuda_event_wait(void *event);

#ifdef __cplusplus
}
#endif
#endif /* MEMFIT_CUDA_LAUNCH_H */
