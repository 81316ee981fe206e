/* Casts between float dtypes: checks, dispatch, and the CPU loop (OpenMP). The
 * element math is mf_cast_one in cast.h, shared with cuda/cast.cu. */
#include "memfit/cast.h"
#ifdef MEMFIT_WITH_CUDA
#include "memfit/cuda_launch.h"
#endif

mf_status mf_cast(const mf_tensor *x, mf_tensor *out, mf_rounding rounding, uint64_t seed,
                  void *stream) {
  mf_status st;
  if ((st = mf_check_float(x, "x"))) return st;
  if ((st = mf_check_float(out, "out"))) return st;
  if ((st = mf_check_numel(out, "out", x->numel))) return st;
  if ((st = mf_check_same_device(x, "x", out, "out"))) return st;
  if (rounding != MF_ROUND_NEAREST && rounding != MF_ROUND_STOCHASTIC)
    return mf_error(MF_ERR_VALUE, "rounding: unknown mode %d", (int)rounding);
  if (x->data == out->data && x->dtype != out->dtype && x->numel > 0)
    return mf_error(MF_ERR_VALUE, "out: must not alias x when the dtypes differ");
  const int stochastic = rounding == MF_ROUND_STOCHASTIC;
  if (x->device == MF_CUDA) {
#ifdef MEMFIT_WITH_CUDA
    return mf_cuda_cast(x, out, stochastic, seed, stream);
#else
    (void)stream;
    return mf_error_no_cuda("cast");
#endif
  }
  const void *src = x->data;
  void *dst = out->data;
  const mf_dtype xt = x->dtype, ot = out->dtype;
  const int64_t n = x->numel;
  if (xt == ot && !stochastic) {
    if (src != dst)
      for (int64_t i = 0; i < n * (int64_t)mf_dtype_size(xt); i++)
        ((uint8_t *)dst)[i] = ((const uint8_t *)src)[i];
    return MF_OK;
  }
#pragma omp parallel for schedule(static) num_threads(mf_get_num_threads()) if (n > 65536)
  for (int64_t i = 0; i < n; i++) mf_cast_one(src, xt, dst, ot, i, stochastic, seed);
  return MF_OK;
}
