/*
 * memfit core: the gradient scaler (dynamic loss scaling for float16 training).
 *
 * Three pieces, each written once:
 *
 * 1. The scaler state: a block of MF_SCALER_WORDS 32-bit words that lives where the
 *    scale lives (host memory for CPU training, device memory for CUDA), so that the
 *    update runs where the data is and CUDA's update() needs no host sync. Word 0 is
 *    the float32 scale (a 0-d view of it is what torch's fused optimizers receive as
 *    `grad_scale`); the other words are uint32 counters stored bit for bit, and a
 *    ring of recent scales (negated for skipped steps) that scaler.stats() reads.
 *
 * 2. The update rule, mf_scaler_update_rule() below, MF_HD: the CPU entry and the
 *    CUDA kernel both call it. With hysteresis = 1 and no min/max scale it is exactly
 *    torch's _amp_update_scale_:
 *      non-finite step: scale *= backoff_factor, growth tracker = 0;
 *      finite step:     tracker += 1; when it reaches growth_interval, scale *=
 *                       growth_factor unless that is not finite, and tracker = 0.
 *    Extras: hysteresis = N backs off only from the N-th consecutive non-finite step
 *    on (then at each further one); min_scale clamps a backoff, max_scale a growth.
 *    One deliberate difference: growth happens when the tracker reaches *at least*
 *    growth_interval (torch tests ==), so lowering growth_interval below the current
 *    tracker with set_growth_interval() grows at the next finite step instead of never.
 *
 * The fused kernels that feed the scaler (unscale + non-finite check over many
 * tensors, the global gradient norm and the clip) are declared here too and live in
 * csrc/core/unscale.c and cuda/unscale.cu.
 */
#ifndef MEMFIT_SCALER_H
#define MEMFIT_SCALER_H

#include <math.h>

#include "memfit/common.h"
#include "memfit/multi_tensor.h"
#include "memfit/numeric.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- state layout ---------------------------------------------------------------- */

enum {
  MF_SW_SCALE = 0,          /* float32 bits: the current scale                          */
  MF_SW_GROWTH_TRACKER = 1, /* consecutive finite steps since the last growth/backoff   */
  MF_SW_CONSEC_INF = 2,     /* consecutive non-finite steps (hysteresis and warnings)   */
  MF_SW_UPDATES = 3,        /* update() calls that applied the rule                     */
  MF_SW_SKIPPED = 4,        /* of those, steps with non-finite gradients                */
  MF_SW_BACKOFFS = 5,       /* times the scale was reduced                              */
  MF_SW_GROWTHS = 6,        /* times the scale was increased                            */
  MF_SW_MIN_CLAMPS = 7,     /* backoffs stopped at min_scale (still non-finite there)   */
  MF_SW_MAX_CLAMPS = 8,     /* growths stopped at max_scale                             */
  MF_SW_MAX_CONSEC_INF = 9, /* longest run of consecutive non-finite steps              */
  MF_SW_OVERFLOW_HOLDS = 10,/* growths refused because scale * growth_factor is not finite */
  MF_SW_LOSS_NONFINITE = 11,/* steps whose loss was already NaN/Inf when it was scaled     */
  MF_SW_HISTORY = 16,       /* first word of the ring of recent scales                  */
  MF_SCALER_HISTORY = 240,  /* ring length: entry (u % 240) is update u's scale          */
  MF_SCALER_WORDS = MF_SW_HISTORY + MF_SCALER_HISTORY /* 256 words = 1 KiB             */
};

typedef struct {
  float growth_factor;   /* > 1 */
  float backoff_factor;  /* in (0, 1) */
  int32_t growth_interval; /* >= 1 */
  int32_t hysteresis;    /* >= 1; 1 = back off at every non-finite step (torch) */
  float min_scale;       /* 0 = no lower bound */
  float max_scale;       /* 0 = no upper bound */
  int32_t loss_skip;     /* 1: a step whose loss was non-finite is skipped without
                            touching the scale or the growth tracker (it is not an
                            fp16 overflow, so backing off would only hurt) */
} mf_scaler_config;


/* The update rule on a state block `w` (host or device memory), given whether any
 * gradient of this step was non-finite and whether the loss already was. Writes the
 * new scale, counters and the history entry for this step: the scale the step used,
 * negated if the step was skipped. */
static inline MF_HD void mf_scaler_update_rule(uint32_t *w, int found_inf, int loss_nonfinite,
                                               const mf_scaler_config *cfg) {
  const float scale = mf_f32_from_bits(w[MF_SW_SCALE]);
  float next = scale;
  const uint32_t u = w[MF_SW_UPDATES];
  const int skipped = found_inf || (loss_nonfinite && cfg->loss_skip);
  w[MF_SW_HISTORY + u % MF_SCALER_HISTORY] = mf_f32_bits(skipped ? -scale : scale);
  w[MF_SW_UPDATES] = u + 1u;
  if (loss_nonfinite) {
    w[MF_SW_LOSS_NONFINITE] += 1u;
    if (cfg->loss_skip) {
      w[MF_SW_SKIPPED] += 1u;
      return; /* scale, tracker and the overflow streak stay as they were */
    }
  }
  if (found_inf) {
    const uint32_t consec = w[MF_SW_CONSEC_INF] + 1u;
    w[MF_SW_CONSEC_INF] = consec;
    if (consec > w[MF_SW_MAX_CONSEC_INF]) w[MF_SW_MAX_CONSEC_INF] = consec;
    w[MF_SW_SKIPPED] += 1u;
    w[MF_SW_GROWTH_TRACKER] = 0u;
    if (consec >= (uint32_t)cfg->hysteresis) {
      next = scale * cfg->backoff_factor;
      if (cfg->min_scale > 0.0f && !(next >= cfg->min_scale)) {
        /* `!(>=)` so a NaN scale is also caught */
        next = cfg->min_scale;
        w[MF_SW_MIN_CLAMPS] += 1u;
      }
      if (next != scale) w[MF_SW_BACKOFFS] += 1u;
    }
  } else {
    w[MF_SW_CONSEC_INF] = 0u;
    const uint32_t tracker = w[MF_SW_GROWTH_TRACKER] + 1u;
    if (tracker >= (uint32_t)cfg->growth_interval) {
      const float grown = scale * cfg->growth_factor;
      if (!mf_isfinite_f32(grown)) {
        w[MF_SW_OVERFLOW_HOLDS] += 1u; /* would overflow float32: keep the scale */
      } else if (cfg->max_scale > 0.0f && grown > cfg->max_scale) {
        if (scale < cfg->max_scale) {
          next = cfg->max_scale;
          w[MF_SW_GROWTHS] += 1u;
        }
        w[MF_SW_MAX_CLAMPS] += 1u;
      } else {
        next = grown;
        w[MF_SW_GROWTHS] += 1u;
      }
      w[MF_SW_GROWTH_TRACKER] = 0u;
    } else {
      w[MF_SW_GROWTH_TRACKER] = tracker;
    }
  }
  w[MF_SW_SCALE] = mf_f32_bits(next);
}

/* ---- entry points (csrc/core/scaler.c) ------------------------------------------- */

/* Fills a host block of MF_SCALER_WORDS words: scale = init_scale, growth tracker =
 * `growth_tracker`, every other word 0. (The caller copies it to the device.) */
mf_status mf_scaler_state_init(uint32_t *words, int64_t nwords, float init_scale,
                               int64_t growth_tracker);

/* Names the first invalid field (growth_factor, backoff_factor, growth_interval,
 * hysteresis, min_scale, max_scale). */
mf_status mf_scaler_config_check(const mf_scaler_config *cfg);

/* Applies the update rule to `state` (float32 view of MF_SCALER_WORDS elements) with
 * found_inf = any of the `n` one-element float32 `found_infs` is non-zero and
 * loss_nonfinite = `loss_flag` (one-element float32, or NULL) is non-zero. On CUDA one
 * single-thread kernel on `stream` reads the flags and writes the state: no host
 * sync. Every flag must be on the state's device. */
mf_status mf_scaler_update(mf_tensor *state, const mf_tensor *found_infs, int64_t n,
                           const mf_tensor *loss_flag, const mf_scaler_config *cfg,
                           void *stream);

/* Most found_inf flags one update() combines (one per optimizer and device). */
#define MF_SCALER_MAX_FLAGS 32

/* ---- fused gradient kernels (csrc/core/unscale.c, cuda/unscale.cu) ----------------- */

/* Number of chunks the tensors are cut into (the workspace size of mf_grad_norm). */
int64_t mf_mt_num_chunks(const mf_tensor *tensors, int64_t n);

/* For every tensor: found_inf = 1 if any element is NaN or +-Inf (found_inf is only
 * ever set, never cleared, so one flag can collect several calls); then, unless
 * `scale` is NULL (check only), every element is multiplied by inv = (float)(1.0 /
 * (double)scale) computed from the one-element float32 `scale` on the device (the
 * value the element had before is what is checked, as torch does). float32, float16
 * and bfloat16 tensors may be mixed in one call; all on one device. */
mf_status mf_unscale_grads(mf_tensor *grads, int64_t n, const mf_tensor *scale,
                           mf_tensor *found_inf, void *stream);

/* Global norm of all tensors together, as if concatenated: norm_type 2, 1, any p > 0,
 * or INFINITY (max |x|). The CPU sums float32 lanes over 1024 elements, then float64;
 * CUDA sums float32 per chunk, then float64 across chunks. A general p sums |x|^p in
 * float64 on both (|x|^p overflows float32 long before the norm does). `workspace` is float32 with at least
 * mf_mt_num_chunks() elements on the tensors' device (unused on the CPU); the result
 * goes to the one-element float32 `out` on that device. NaN anywhere gives NaN. */
mf_status mf_grad_norm(const mf_tensor *grads, int64_t n, double norm_type,
                       mf_tensor *workspace, mf_tensor *out, void *stream);

/* Multiplies every tensor by min(1, max_norm / (norm + 1e-6)) in float32 (torch's
 * clip_grad_norm_ coefficient), reading `norm` (one-element float32) on the device.
 * A coefficient of exactly 1 writes nothing (x * 1 == x). */
mf_status mf_clip_grads(mf_tensor *grads, int64_t n, const mf_tensor *norm, float max_norm,
                        void *stream);

#ifdef __cplusplus
}
#endif
#endif /* MEMFIT_SCALER_H */
