/*
 * Gradient scaler: state block, configuration checks and the
 * update dispatch (host rule for CPU state, one kernel for CUDA state). The update
 * rule itself is mf_scaler_update_rule() in scaler.h, shared with cuda/scaler.cu.
 */
#include <math.h>
#include <string.h>

#include "memfit/scaler.h"
#ifdef MEMFIT_WITH_CUDA
#include "memfit/cuda_launch.h"
#endif

mf_status mf_scaler_state_init(uint32_t *words, int64_t nwords, float init_scale,
                               int64_t growth_tracker) {
  if (nwords != MF_SCALER_WORDS)
    return mf_error(MF_ERR_VALUE, "state: expected %d words, got %lld", MF_SCALER_WORDS,
                    (long long)nwords);
  if (!(init_scale > 0.0f) || !mf_isfinite_f32(init_scale))
    return mf_error(MF_ERR_VALUE, "init_scale: must be a finite number > 0, got %g",
                    (double)init_scale);
  if (growth_tracker < 0 || growth_tracker > 0x7fffffffLL)
    return mf_error(MF_ERR_VALUE, "_growth_tracker: must be a non-negative int32, got %lld",
                    (long long)growth_tracker);
  memset(words, 0, (size_t)nwords * sizeof *words);
  words[MF_SW_SCALE] = mf_f32_bits(init_scale);
  words[MF_SW_GROWTH_TRACKER] = (uint32_t)growth_tracker;
  return MF_OK;
}

mf_status mf_scaler_config_check(const mf_scaler_config *c) {
  /* The wording of the first two follows torch ("must be > 1.0" / "< 1.0"). */
  if (!(c->growth_factor > 1.0f) || !mf_isfinite_f32(c->growth_factor))
    return mf_error(MF_ERR_VALUE, "growth_factor: the growth factor must be > 1.0, got %g",
                    (double)c->growth_factor);
  if (!(c->backoff_factor < 1.0f) || !(c->backoff_factor > 0.0f))
    return mf_error(MF_ERR_VALUE,
                    "backoff_factor: the backoff factor must be < 1.0 (and > 0), got %g",
                    (double)c->backoff_factor);
  if (c->growth_interval < 1)
    return mf_error(MF_ERR_VALUE, "growth_interval: must be >= 1, got %d",
                    (int)c->growth_interval);
  if (c->hysteresis < 1)
    return mf_error(MF_ERR_VALUE, "hysteresis: must be >= 1 (1 backs off at every "
                    "non-finite step), got %d", (int)c->hysteresis);
  if (c->min_scale < 0.0f || !mf_isfinite_f32(c->min_scale))
    return mf_error(MF_ERR_VALUE, "min_scale: must be a finite number >= 0, got %g",
                    (double)c->min_scale);
  if (c->max_scale < 0.0f || !mf_isfinite_f32(c->max_scale))
    return mf_error(MF_ERR_VALUE, "max_scale: must be a finite number >= 0, got %g",
                    (double)c->max_scale);
  if (c->max_scale > 0.0f && c->min_scale > c->max_scale)
    return mf_error(MF_ERR_VALUE, "min_scale: %g is larger than max_scale %g",
                    (double)c->min_scale, (double)c->max_scale);
  return MF_OK;
}

static mf_status check_state(const mf_tensor *state) {
  mf_status st;
  if ((st = mf_check_dtype(state, "state", MF_FLOAT32))) return st;
  return mf_check_numel(state, "state", MF_SCALER_WORDS);
}

mf_status mf_scaler_update(mf_tensor *state, const mf_tensor *found_infs, int64_t n,
                           const mf_tensor *loss_flag, const mf_scaler_config *cfg,
                           void *stream) {
  mf_status st;
  if ((st = check_state(state))) return st;
  if ((st = mf_scaler_config_check(cfg))) return st;
  if (n < 1)
    return mf_error(MF_ERR_VALUE, "found_inf: no inf checks were recorded prior to update.");
  if (n > MF_SCALER_MAX_FLAGS)
    return mf_error(MF_ERR_VALUE, "found_inf: at most %d flags per update, got %lld",
                    MF_SCALER_MAX_FLAGS, (long long)n);
  for (int64_t i = 0; i < n; i++) {
    if ((st = mf_check_dtype(&found_infs[i], "found_inf", MF_FLOAT32))) return st;
    if ((st = mf_check_numel(&found_infs[i], "found_inf", 1))) return st;
    if ((st = mf_check_same_device(state, "state", &found_infs[i], "found_inf"))) return st;
  }
  if (loss_flag) {
    if ((st = mf_check_dtype(loss_flag, "loss_flag", MF_FLOAT32))) return st;
    if ((st = mf_check_numel(loss_flag, "loss_flag", 1))) return st;
    if ((st = mf_check_same_device(state, "state", loss_flag, "loss_flag"))) return st;
  }
  if (cfg->loss_skip != 0 && cfg->loss_skip != 1)
    return mf_error(MF_ERR_VALUE, "loss_skip: must be 0 or 1, got %d", (int)cfg->loss_skip);
  if (state->device == MF_CUDA) {
#ifdef MEMFIT_WITH_CUDA
    return mf_cuda_scaler_update(state, found_infs, n, loss_flag, cfg, stream);
#else
    (void)stream;
    return mf_error_no_cuda("scaler_update");
#endif
  }
  int any = 0;
  for (int64_t i = 0; i < n; i++) any |= *(const float *)found_infs[i].data != 0.0f;
  const int loss_bad = loss_flag && *(const float *)loss_flag->data != 0.0f;
  mf_scaler_update_rule((uint32_t *)state->data, any, loss_bad, cfg);
  return MF_OK;
}
