/*
 * memfit core: optimizer updates (AdamW/Adam, Lion, SGD with momentum, RMSprop, Adagrad,
 * AdEMAMix and Muon's momentum pass) with fp32 or blockwise-quantized (8-bit, 4-bit) states.
 *
 * The element math is written once here (MF_HD) and used by the CPU loops in
 * csrc/core/optim.c and the CUDA kernels in cuda/optim.cu. All of it is plain IEEE
 * float/double arithmetic (+, -, *, /, sqrt): both sides are compiled without FMA
 * contraction (-ffp-contract=off, nvcc --fmad=false; see CMakeLists.txt), so the CPU
 * and the GPU compute the same bits.
 *
 * States. Each optimizer keeps 0 to 3 states per element ("state1", "state2", "state3"):
 *   kind       state1 (code)              state2 (code)
 *   ADAMW/ADAM exp_avg (signed)           exp_avg_sq (unsigned)
 *   LION       exp_avg (signed)           -
 *   SGD        momentum_buffer (signed)   -                 (none when momentum = 0)
 *   RMSPROP    square_avg (unsigned)      momentum_buffer (signed, only if momentum > 0)
 *   MUON       momentum_buffer (signed)   -
 *   ADAGRAD    sum (unsigned)             -
 *   ADEMAMIX   exp_avg (signed)           exp_avg_sq (unsigned)
 *              and state3: exp_avg_slow (signed; quantized with code1, the code of the
 *              other signed state, as bitsandbytes quantizes both of its EMAs)
 * AdEMAMix is the only kind with a third state; every 2-state path (the element update
 * mf_optim_update_one, the fused CPU kernel, the CUDA kernel instantiations without it)
 * is the same code as before it was added.
 * A state is stored as float32 (MF_STATE_FP32) or blockwise quantized: one code index
 * per element (MF_STATE_8BIT: uint8, 256-entry code; MF_STATE_4BIT: two indices per
 * byte, element 2j in the low nibble and 2j+1 in the high nibble, 16-entry code) plus
 * one float32 absmax per block. The fused update does, per block and in one pass:
 * dequantize the states, update them and the parameter in fp32, write the parameter,
 * take the new absmax from the *new* states and requantize (nearest code value).
 *
 * Step counter. `step` is a float32[1] array on the parameters' device holding the
 * number of steps taken so far (torch stores it the same way). An update uses
 * t = step + 1 for its bias corrections and then stores t, unless the step is skipped.
 *
 * Non-finite values. With `found_inf` (a float32[1] array, as set by a GradScaler)
 * non-zero, the whole call is a no-op: parameters, states and step are unchanged; the
 * flag is read on the device, so nothing syncs. Without a scaler, an element whose
 * (unscaled) gradient is NaN/Inf, or whose update would produce a NaN/Inf state or
 * parameter, is skipped: its parameter keeps its value and its states their old
 * (dequantized) values; the rest of the tensor is updated and the step counts. States
 * therefore never hold NaN or Inf. This covers eps = 0 with a zero gradient and a zero
 * second moment (0/0, where torch writes NaN): the parameter does not move.
 *
 * Muon (MF_OPT_MUON) is the one kind that does not update the parameter: its pass
 * updates the momentum exactly as torch.optim.Muon does (buf.lerp_(grad, 1 - momentum))
 * and writes the update that Newton-Schulz then orthogonalizes (grad.lerp(buf,
 * momentum) with nesterov, else buf) into the tensor in the `param` slot, which is an
 * output here: it is never read, and is rounded to nearest-even when float16/bfloat16
 * (torch's .bfloat16() of the update, the first step of Newton-Schulz). Newton-Schulz
 * needs the whole matrix and torch's matmul, so it, the weight decay and the parameter
 * update are the caller's (memfit.optim.muon). A skipped element (above) keeps its
 * momentum and writes an update of 0. torch's lerp is one fused multiply-add
 * (a + w * (b - a), or b + (w - 1) * (b - a) for |w| >= 0.5: mf_lerp_f32); fmaf is
 * correctly rounded on every CPU and GPU, so this too is the same bits everywhere.
 *
 * Half-precision parameters. float16/bfloat16 parameters are widened to float32, updated
 * in float32 and written back in one of three ways (mf_optim_store_param):
 *   nearest-even      (default without the options below);
 *   stochastic        (hparams.stochastic_round: unbiased random rounding, see below);
 *   Kahan-compensated (the tensor has a `comp` buffer: one value per element in the
 *                      parameter's dtype, 2 bytes for bfloat16; Zamirai et al. 2020,
 *                      "Revisiting BFloat16 Training").
 * The Kahan scheme, exactly as computed on the CPU and the GPU:
 *     x     = float(p) + float(comp)          (float32 add, exact unless comp lies far
 *                                              below p's last bit: the parameter's value)
 *     x_new = the optimizer's update of x     (mf_optim_update_one: every read of the
 *                                              parameter, decoupled weight decay and the
 *                                              L2 terms included, sees x, not p)
 *     p     = nearest_even(x_new)
 *     comp  = nearest_even(x_new - float(p))  (the subtraction is exact in float32;
 *                                              comp = 0 where it is not finite, i.e.
 *                                              where p overflowed to +-Inf or is NaN)
 * so p + comp carries about twice the dtype's precision (16 significant bits for
 * bfloat16) and an update far below half a bfloat16 step accumulates in comp until it
 * moves p, deterministically. A skipped element (non-finite gradient or update) stores
 * x again: p + comp keeps its value (and p and comp their bits, unless comp was exactly
 * half a step, where the tie may renormalise the pair). The two options exclude each
 * other: a compensation buffer with stochastic rounding is an error (the rounding error
 * is what comp keeps; adding noise to it would only lose it). float32 parameters take
 * neither (no buffer is allowed for them; they need none).
 */
#ifndef MEMFIT_OPTIM_H
#define MEMFIT_OPTIM_H

#include <math.h>

#include "memfit/cast.h"
#include "memfit/common.h"
#include "memfit/numeric.h"
#include "memfit/quant.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  MF_OPT_ADAMW = 0,   /* Adam with decoupled weight decay (torch.optim.AdamW) */
  MF_OPT_ADAM = 1,    /* Adam with L2 weight decay added to the gradient (torch.optim.Adam) */
  MF_OPT_LION = 2,    /* Lion (Chen et al. 2023), decoupled weight decay */
  MF_OPT_SGD = 3,     /* SGD with (Nesterov) momentum, L2 weight decay (torch.optim.SGD) */
  MF_OPT_RMSPROP = 4, /* RMSprop, not centered, optional momentum (torch.optim.RMSprop) */
  MF_OPT_MUON = 5,    /* Muon's momentum pass: writes the update, not the parameter (above) */
  MF_OPT_ADAGRAD = 6, /* Adagrad, L2 weight decay, lr decay (torch.optim.Adagrad) */
  MF_OPT_ADEMAMIX = 7 /* AdEMAMix (Pagliardini et al. 2024), decoupled weight decay */
} mf_optim_kind;

/* The last kind: every kind lies in [MF_OPT_ADAMW, MF_OPT_LAST]. */
#define MF_OPT_LAST MF_OPT_ADEMAMIX

/* Defined where mf_optim_tensor has a third state (state3, absmax3): for sources built
 * against older cores too (benchmarks/c/bench_optim_step.c, bench_optim_core.py --against). */
#define MF_OPTIM_STATE3 1

typedef enum { MF_STATE_FP32 = 32, MF_STATE_8BIT = 8, MF_STATE_4BIT = 4 } mf_state_format;

/* Hyperparameters, in double as Python passes them. Which fields are used:
 *   ADAMW/ADAM: lr, beta1, beta2, eps, weight_decay
 *   LION:       lr, beta1, beta2, weight_decay
 *   SGD:        lr, momentum, dampening, nesterov, weight_decay
 *   RMSPROP:    lr, alpha, eps, momentum, weight_decay
 *   MUON:       momentum, nesterov (lr and weight_decay are checked, and applied by
 *               the caller after Newton-Schulz)
 *   ADAGRAD:    lr, lr_decay, eps, weight_decay (torch's initial_accumulator_value is
 *               the caller's: the value its `sum` state starts at)
 *   ADEMAMIX:   lr, beta1, beta2, beta3, alpha, t_alpha, t_beta3, eps, weight_decay
 * and maximize for all; ADAMW/ADAM also no_bias_correction, and ADAMW/ADAM and SGD
 * max_unorm (the trust ratio below: LAMB and LARS).
 * AdEMAMix at step t (bitsandbytes' AdEMAMix, which is the paper's):
 *   m1 = b1*m1 + (1-b1)*g;  m2 = b3_t*m2 + (1-b3_t)*g;  nu = b2*nu + (1-b2)*g*g
 *   p  = p*(1 - lr*wd) - lr * (m1/(1-b1^t) + alpha_t*m2) / (sqrt(nu)/sqrt(1-b2^t) + eps)
 *   alpha_t = min(t*alpha/t_alpha, alpha)                    (alpha when t_alpha = 0)
 *   b3_t    = min(exp(ln(b1)*ln(b3) / ((1 - t/t_beta3)*ln(b3) + (t/t_beta3)*ln(b1))), b3)
 *                                                            (b3 when t_beta3 = 0)
 * t lives on the device (the step counter), so both schedulers are computed in
 * mf_optim_prepare, with mf_exp_f64 (numeric.h) and the logarithms ln_beta1, ln_beta3
 * that mf_optim_step fills in once on the host (callers leave them 0). */
typedef struct {
  mf_optim_kind kind;
  double lr, beta1, beta2, eps, weight_decay;
  double momentum, dampening, alpha;
  double lr_decay; /* Adagrad: step t uses lr / (1 + (t - 1) * lr_decay) */
  int nesterov;
  int maximize;
  /* Half-precision parameters: 1 writes the updated value with stochastic rounding
   * (unbiased, so updates smaller than half a bfloat16 step are kept on average;
   * no float32 master copy needed), 0 with nearest-even (or Kahan-compensated, for
   * tensors with a comp buffer; see the header comment). The random bits of element i
   * of tensor k come from mf_hash64(sr_seed, k, i): reproducible, the same on CPU
   * and GPU. */
  int stochastic_round;
  uint64_t sr_seed;
  /* ADAMW/ADAM: 1 drops both bias corrections (step_size = lr, no 1 / sqrt(1 - beta2^t)),
   * as LAMB's bias_correction=False. */
  int no_bias_correction;
  /* > 0: scale each tensor's update by its trust ratio (LAMB, LARS; see "Trust ratio"
   * below); 0: off (the update's bits are those without this field). */
  double max_unorm;
  /* AdEMAMix (above); t_alpha, t_beta3: steps, 0 for no scheduler */
  double beta3, t_alpha, t_beta3;
  double ln_beta1, ln_beta3; /* filled by mf_optim_step: log(beta1), log(beta3) */
} mf_optim_hparams;

/* Number of states kept per element for these hyperparameters (0 to 3). */
static inline MF_HD int mf_optim_num_states(const mf_optim_hparams *h) {
  switch (h->kind) {
    case MF_OPT_ADAMW:
    case MF_OPT_ADAM: return 2;
    case MF_OPT_LION: return 1;
    case MF_OPT_SGD: return h->momentum != 0.0 ? 1 : 0;
    case MF_OPT_RMSPROP: return h->momentum != 0.0 ? 2 : 1;
    case MF_OPT_MUON: return 1;
    case MF_OPT_ADAGRAD: return 1;
    case MF_OPT_ADEMAMIX: return 3;
  }
  return 0;
}

/* Whether state k (1 to 3) of this kind is signed (signed code) or non-negative. */
static inline MF_HD int mf_optim_state_signed(mf_optim_kind kind, int k) {
  if (kind == MF_OPT_RMSPROP || kind == MF_OPT_ADAGRAD) return k == 2;
  if (kind == MF_OPT_ADEMAMIX) return k != 2;
  return k == 1;
}

/* ---- per-step constants ----------------------------------------------------- */

/* Everything the element update needs, in float, for one tensor at one step. */
typedef struct {
  float lr, b1, omb1, b2, omb2, eps, wd; /* lr: Adagrad's decayed one at step t */
  float decay;       /* 1 - lr * weight_decay (decoupled decay), 1 when unused */
  float step_size;   /* Adam: lr / (1 - beta1^t) */
  float inv_sqrt_bc2;/* Adam: 1 / sqrt(1 - beta2^t) */
  float gmul;        /* 1/grad_scale, negated under maximize */
  int first;         /* t == 1 (SGD initialises its momentum buffer with the gradient) */
  int nesterov;
  /* AdEMAMix: b3_t and 1 - b3_t, alpha_t, 1 - beta1^t, sqrt(1 - beta2^t) */
  float b3, omb3, alpha, bc1, sqrt_bc2;
} mf_optim_consts;

/* beta^n by binary exponentiation in double: only IEEE multiplications, so host and
 * device agree exactly (pow() differs between libm and CUDA). */
static inline MF_HD double mf_powi(double beta, int64_t n) {
  double r = 1.0, b = beta;
  while (n > 0) {
    if (n & 1) r *= b;
    b *= b;
    n >>= 1;
  }
  return r;
}

/* t: the step number of this update (1 for the first one); inv_scale: 1/grad_scale
 * (1 without a scaler). */
static inline MF_HD mf_optim_consts mf_optim_prepare(const mf_optim_hparams *h, float t,
                                                     float inv_scale) {
  mf_optim_consts c;
  int64_t n = (int64_t)t;
  c.lr = (float)h->lr;
  c.eps = (float)h->eps;
  c.wd = (float)h->weight_decay;
  c.decay = 1.0f;
  c.step_size = (float)h->lr;
  c.inv_sqrt_bc2 = 1.0f;
  c.first = n <= 1;
  c.nesterov = h->nesterov;
  c.gmul = h->maximize ? -inv_scale : inv_scale;
  c.b3 = c.omb3 = c.alpha = 0.0f;
  c.bc1 = c.sqrt_bc2 = 1.0f;
  switch (h->kind) {
    case MF_OPT_ADAMW:
    case MF_OPT_ADAM: {
      const int bc = !h->no_bias_correction;
      double bc1 = bc ? 1.0 - mf_powi(h->beta1, n) : 1.0;
      double bc2 = bc ? 1.0 - mf_powi(h->beta2, n) : 1.0;
      c.b1 = (float)h->beta1;
      c.omb1 = (float)(1.0 - h->beta1);
      c.b2 = (float)h->beta2;
      c.omb2 = (float)(1.0 - h->beta2);
      c.step_size = (float)(h->lr / bc1);
      c.inv_sqrt_bc2 = (float)(1.0 / sqrt(bc2));
      if (h->kind == MF_OPT_ADAMW) c.decay = (float)(1.0 - h->lr * h->weight_decay);
      break;
    }
    case MF_OPT_LION:
      c.b1 = (float)h->beta1;
      c.omb1 = (float)(1.0 - h->beta1);
      c.b2 = (float)h->beta2;
      c.omb2 = (float)(1.0 - h->beta2);
      c.decay = (float)(1.0 - h->lr * h->weight_decay);
      break;
    case MF_OPT_SGD:
      c.b1 = (float)h->momentum;
      c.omb1 = (float)(1.0 - h->dampening);
      c.b2 = 0.0f;
      c.omb2 = 0.0f;
      break;
    case MF_OPT_RMSPROP:
      c.b1 = (float)h->momentum;
      c.omb1 = 0.0f;
      c.b2 = (float)h->alpha;
      c.omb2 = (float)(1.0 - h->alpha);
      break;
    case MF_OPT_MUON: /* torch's lerp weights, rounded to float as torch rounds them */
      c.b1 = (float)h->momentum;
      c.omb1 = (float)(1.0 - h->momentum);
      c.b2 = 0.0f;
      c.omb2 = 0.0f;
      break;
    case MF_OPT_ADAGRAD: /* torch's clr, in double as Python computes it, then float */
      c.lr = (float)(h->lr / (1.0 + (double)(n - 1) * h->lr_decay));
      c.step_size = c.lr;
      c.b1 = c.omb1 = c.b2 = c.omb2 = 0.0f;
      break;
    case MF_OPT_ADEMAMIX: { /* the order of bitsandbytes' 32-bit update */
      const double td = (double)n;
      double b3 = h->beta3, alpha = h->alpha;
      if (h->t_alpha > 0.0) {
        const double a = td * h->alpha / h->t_alpha;
        alpha = a < alpha ? a : alpha;
      }
      if (h->t_beta3 > 0.0) {
        const double x = td / h->t_beta3;
        const double e = mf_exp_f64((h->ln_beta1 * h->ln_beta3) /
                                    ((1.0 - x) * h->ln_beta3 + x * h->ln_beta1));
        b3 = e < b3 ? e : b3;
      }
      c.b1 = (float)h->beta1;
      c.omb1 = (float)(1.0 - h->beta1);
      c.b2 = (float)h->beta2;
      c.omb2 = (float)(1.0 - h->beta2);
      c.b3 = (float)b3;
      c.omb3 = (float)(1.0 - b3);
      c.alpha = (float)alpha;
      c.bc1 = (float)(1.0 - mf_powi(h->beta1, n));
      c.sqrt_bc2 = (float)sqrt(1.0 - mf_powi(h->beta2, n));
      c.decay = (float)(1.0 - h->lr * h->weight_decay);
      break;
    }
  }
  return c;
}

/* ---- element math -------------------------------------------------------------- */

/* torch's lerp(a, b, w) for float (ATen's lerp_vec and its scalar form, as GCC and nvcc
 * contract it): one fused multiply-add from the nearer end. */
static inline MF_HD float mf_lerp_f32(float a, float b, float w) {
  return fabsf(w) < 0.5f ? fmaf(w, b - a, a) : fmaf(w - 1.0f, b - a, b);
}


/* Adam's and AdamW's arithmetic, written once for one element (T = float: the update
 * below, used by every CPU loop and the CUDA kernels) and for a vector of elements (T = a
 * GCC vector of floats with SQRT its square root: update_adam_avx2 in csrc/core/optim_cpu.h,
 * which tests and skips 8 elements at a time). g: the gradient, already times gmul; p0, a, b:
 * parameter and states; writes pn, an, bn. Every operation is a plain IEEE one in this
 * order, so a lane of the vector form computes the bits of the float form. */
#define MF_OPTIM_ADAM_MATH(kind, c, SQRT, p0, g, a, b, pn, an, bn)                        \
  do {                                                                                   \
    if ((kind) == MF_OPT_ADAM) g = g + (c)->wd * (p0);                                    \
    an = (c)->b1 * (a) + (c)->omb1 * g;                                                  \
    bn = (c)->b2 * (b) + (c)->omb2 * (g * g);                                            \
    pn = (p0) * (c)->decay - (c)->step_size * MF_OPTIM_ADAM_DIR(c, SQRT, an, bn);         \
  } while (0)

/* The direction Adam's step_size multiplies: m / (sqrt(v) / sqrt(bc2) + eps) (the trust
 * ratio's norm pass sums its squares). */
#define MF_OPTIM_ADAM_DIR(c, SQRT, an, bn) ((an) / (SQRT(bn) * (c)->inv_sqrt_bc2 + (c)->eps))

/* Always inlined by GCC on the host: the CPU's update loops vectorise only with the
 * element math in the loop body, and in the large fused kernels (csrc/core/optim_fused.h)
 * GCC's size estimate otherwise leaves it a scalar call per element. */
#if defined(__GNUC__) && !defined(__CUDACC__)
#define MF_OPTIM_FORCE_INLINE __attribute__((always_inline))
#else
#define MF_OPTIM_FORCE_INLINE
#endif

/* One element of one update. p: parameter, g: raw gradient (scaled by gmul here), s1,
 * s2: the states (in/out; unused ones are ignored). Writes the new values, or the old
 * ones where the element is skipped (see the header comment). Returns 1 when updated.
 * *dir: the direction the update subtracts, times its coefficient (Adam:
 * MF_OPTIM_ADAM_DIR, times step_size; SGD: d, times lr; 0 for the other kinds and where
 * the element is skipped): what the trust ratio's norm pass sums. */
static inline MF_HD MF_OPTIM_FORCE_INLINE int mf_optim_update_dir(
    mf_optim_kind kind, const mf_optim_consts *c, int nstates, float *p, float g, float *s1,
    float *s2, float *dir) {
  /* (Muon's `p` is its output: never read) */
  const float p0 = kind == MF_OPT_MUON ? 0.0f : *p, a = *s1, b = *s2;
  float pn = p0, an = a, bn = b, d = 0.0f;
  g = g * c->gmul;
  switch (kind) {
    case MF_OPT_ADAMW:
    case MF_OPT_ADAM:
      MF_OPTIM_ADAM_MATH(kind, c, sqrtf, p0, g, a, b, pn, an, bn);
      d = MF_OPTIM_ADAM_DIR(c, sqrtf, an, bn);
      break;
    case MF_OPT_LION: {
      float u = c->b1 * a + c->omb1 * g;
      float sgn = u > 0.0f ? 1.0f : (u < 0.0f ? -1.0f : 0.0f);
      pn = p0 * c->decay - c->lr * sgn;
      an = c->b2 * a + c->omb2 * g;
      break;
    }
    case MF_OPT_SGD: {
      g = g + c->wd * p0;
      d = g;
      if (nstates > 0) {
        an = c->first ? g : c->b1 * a + c->omb1 * g;
        d = c->nesterov ? g + c->b1 * an : an;
      }
      pn = p0 - c->lr * d;
      break;
    }
    case MF_OPT_RMSPROP: {
      g = g + c->wd * p0;
      an = c->b2 * a + c->omb2 * (g * g);
      float r = g / (sqrtf(an) + c->eps);
      if (nstates > 1) {
        bn = c->b1 * b + r;
        r = bn;
      }
      pn = p0 - c->lr * r;
      break;
    }
    case MF_OPT_MUON:
      an = mf_lerp_f32(a, g, c->omb1);                 /* buf.lerp_(grad, 1 - momentum) */
      pn = c->nesterov ? mf_lerp_f32(g, an, c->b1) : an; /* grad.lerp(buf, momentum) */
      break;
    case MF_OPT_ADAGRAD: /* torch: sum.addcmul_(g, g); p.addcdiv_(g, sqrt(sum) + eps, -clr) */
      g = g + c->wd * p0;
      an = a + g * g;
      pn = p0 - c->lr * g / (sqrtf(an) + c->eps);
      break;
    case MF_OPT_ADEMAMIX: /* three states: mf_optim_update_one3 (never called with it) */
      break;
  }
  int ok;
  if (kind == MF_OPT_ADAMW || kind == MF_OPT_ADAM) {
    /* The test below, in three vector operations instead of eight (the CPU step's
     * hottest loop). Whatever a and b are: a non-finite g makes g * g, so omb2 * (g * g)
     * (0 * Inf is NaN), so bn non-finite; with bn finite the denominator is finite (or
     * NaN, for a negative bn, which makes pn NaN anyway), so a non-finite an makes
     * an / denom, so pn, non-finite (0 * Inf is NaN again). Hence pn and bn finite <=>
     * g, pn, an and bn finite; tests/c/test_optim.c checks decision and bits on every
     * combination of special values. */
    ok = mf_both_finite_f32(pn, bn);
  } else {
    ok = mf_isfinite_f32(g) & mf_isfinite_f32(pn) & mf_isfinite_f32(an) & mf_isfinite_f32(bn);
  }
  /* (a select, not a conditional store: see mf_select_f32) */
  *p = mf_select_f32(!ok, p0, pn);
  *s1 = mf_select_f32(!ok, a, an);
  *s2 = mf_select_f32(!ok, b, bn);
  *dir = mf_select_f32(!ok, 0.0f, d);
  return ok;
}

/* mf_optim_update_dir without the direction (every update loop). */
static inline MF_HD MF_OPTIM_FORCE_INLINE int mf_optim_update_one(
    mf_optim_kind kind, const mf_optim_consts *c, int nstates, float *p, float g, float *s1,
    float *s2) {
  float dir;
  return mf_optim_update_dir(kind, c, nstates, p, g, s1, s2, &dir);
}

/* One element of an AdEMAMix step (s3: exp_avg_slow). Same contract as
 * mf_optim_update_one: an element with a non-finite gradient, state or parameter update
 * keeps its old values. */
static inline MF_HD MF_OPTIM_FORCE_INLINE int mf_optim_update_ademamix(const mf_optim_consts *c,
                                                                       float *p, float g,
                                                                       float *s1, float *s2,
                                                                       float *s3) {
  const float p0 = *p, a = *s1, b = *s2, m = *s3;
  g = g * c->gmul;
  const float an = c->b1 * a + c->omb1 * g;
  const float mn = c->b3 * m + c->omb3 * g;
  const float bn = c->b2 * b + c->omb2 * (g * g);
  const float mixed = an / c->bc1 + c->alpha * mn;
  const float pn = p0 * c->decay - c->lr * (mixed / (sqrtf(bn) / c->sqrt_bc2 + c->eps));
  const int ok = mf_isfinite_f32(g) & mf_isfinite_f32(pn) & mf_isfinite_f32(an) &
                 mf_isfinite_f32(bn) & mf_isfinite_f32(mn);
  *p = mf_select_f32(!ok, p0, pn);
  *s1 = mf_select_f32(!ok, a, an);
  *s2 = mf_select_f32(!ok, b, bn);
  *s3 = mf_select_f32(!ok, m, mn);
  return ok;
}

/* One element of a step of any kind, with a third state s3 (AdEMAMix's exp_avg_slow;
 * ignored by the other kinds, which go to mf_optim_update_one unchanged). */
static inline MF_HD int mf_optim_update_one3(mf_optim_kind kind, const mf_optim_consts *c,
                                             int nstates, float *p, float g, float *s1,
                                             float *s2, float *s3) {
  if (kind != MF_OPT_ADEMAMIX) return mf_optim_update_one(kind, c, nstates, p, g, s1, s2);
  return mf_optim_update_ademamix(c, p, g, s1, s2, s3);
}

/* ---- code search for 16-entry (4-bit) codes ------------------------------------ */

#define MF_CODE4_SIZE 16

/* Code index of x (already brought to [-1, 1]: mf_block_normalize) for a code of
 * `size` (16 or 256): the nearest code value, but for a non-negative state
 * (keep_positive = !mf_optim_state_signed: Adam's second moment, RMSprop's square_avg,
 * Adagrad's sum)
 * a positive value never goes to a code value <= 0 (mf_quantize_keep_positive_n). Such
 * a state sits under a square root in a denominator: rounded to 0 while the first
 * moment is not, the next step with a zero gradient moves the weight by lr * m / eps
 * (490 for AdamW8bit at lr 1e-2, where torch moves it by 0.007). Rounded up to the
 * smallest positive code value instead, the denominator is too large, never too small:
 * that update is smaller than torch's, and decays with m. First moments and momenta
 * keep nearest rounding: rounding them away from 0 would keep a decaying momentum alive
 * at the smallest code value for ever. */
static inline MF_HD uint8_t mf_optim_quantize(const float *code, int size, float x,
                                              int keep_positive) {
  return keep_positive ? mf_quantize_keep_positive_n(code, size, x)
                       : mf_quantize_nearest_n(code, size, x);
}

/* ---- entry points ------------------------------------------------------------- */

/* Quantization blocks and rows. A tensor of n elements is `rows` rows of L = n / rows
 * elements in storage order (the torch optimizers pass p.shape[0] for parameters of two
 * or more dimensions: dim 0 is the outermost one in memory, so a row is a dim-0 slice).
 * Blocks never cross a row: row r holds blocks (r, 0 .. bpr - 1), bpr = ceil(L / bs),
 * block (r, j) being elements [r*L + j*bs, r*L + min((j+1)*bs, L)). The layout per row:
 *   8BIT codes: uint8, one per element (row r starts at element r*L);
 *   4BIT codes: uint8[ceil(L/2)] per row (row r starts at byte r*ceil(L/2)); element
 *               2j of a row in the low nibble of its byte j, 2j+1 in the high one (the
 *               high nibble of an odd row's last byte is 0);
 *   absmax:     bpr float32 per row (row r starts at r*bpr).
 * Sharding a tensor along dim 0 (FSDP2's Shard(0)) therefore cuts every state between
 * rows: a rank's rows of the states are exactly the states of its rows of the
 * parameter, and the bits do not depend on how many ranks there are. rows = 1 is the
 * flat layout of blocks over the whole storage; so is any rows when bs divides L. */
typedef struct {
  int64_t elem;   /* first element of the row (param, grad, comp, 8-bit codes) */
  int64_t code4;  /* first byte of the row's 4-bit codes */
  int64_t block;  /* first absmax of the row */
} mf_optim_row_start;

static inline MF_HD mf_optim_row_start mf_optim_row(int64_t row_len, int64_t bs, int64_t r) {
  mf_optim_row_start s;
  s.elem = r * row_len;
  s.code4 = r * ((row_len + 1) / 2);
  s.block = r * ((row_len + bs - 1) / bs);
  return s;
}

/* The rows a kernel must step one by one: `rows`, unless the flat layout's blocks are
 * already the row blocks (FP32 states; bs dividing L), where the whole tensor is one. */
static inline MF_HD int64_t mf_optim_split_rows(mf_state_format fmt, int64_t bs, int64_t n,
                                               int64_t rows) {
  if (fmt == MF_STATE_FP32 || rows <= 1) return 1;
  return (n / rows) % bs == 0 ? 1 : rows;
}

/* One parameter tensor and its states. Unused states: data NULL, numel 0. With R rows
 * of L elements (n = R*L; see mf_optim_row):
 *   param, grad: float32/float16/bfloat16, same dtype, same numel n
 *   state1/2/3:  FP32: float32[n];  8BIT: uint8[n];  4BIT: uint8[R * ceil(L/2)]
 *   absmax1/2/3: float32[R * ceil(L / block_size)] (quantized formats only)
 *   step:        float32[1]
 *   comp:        optional, dtype of param, numel n (Kahan compensation) */
typedef struct {
  mf_tensor param, grad, state1, state2, absmax1, absmax2, step;
  int32_t sr_stream; /* distinct per tensor of one step call (stochastic rounding) */
  /* Kahan compensation (see the header comment): float16/bfloat16 like param, numel n;
   * data NULL for none. Not allowed with float32 params or stochastic rounding. */
  mf_tensor comp;
  int64_t rows;       /* rows of the block layout (>= 1; must divide n; 0 is taken as 1) */
  /* The number of this tensor's element 0 in the whole tensor it is a part of: the
   * stochastic rounding of element i draws from index_base + i, so a shard (FSDP2)
   * rounds each element as the unsharded tensor does. 0 for a whole tensor. */
  int64_t index_base;
  /* Scratch of the trust ratio (hparams.max_unorm > 0; ignored otherwise): float64
   * values passed as a float32 array of mf_optim_trust_numel(n) elements (two float32
   * words per float64; data 8-byte aligned), on the parameter's device. Written by the
   * step; after it, its last two float64 are the sums of u^2 and p^2 (below). */
  mf_tensor trust;
  mf_tensor state3, absmax3; /* AdEMAMix's third state (see the header comment) */
} mf_optim_tensor;

/* Kahan split of an updated value v into a half-precision pair (dt: float16 or
 * bfloat16): *hi = nearest_even(v), *lo = nearest_even(v - float(*hi)), and *lo = 0
 * where v - float(*hi) is not finite. */
static inline MF_HD MF_OPTIM_FORCE_INLINE void mf_optim_kahan_split(float v, mf_dtype dt, uint16_t *hi, uint16_t *lo) {
  const int bf = dt == MF_BFLOAT16;
  const uint16_t h = bf ? mf_f32_to_bf16(v) : mf_f32_to_f16(v);
  const float r = v - (bf ? mf_bf16_to_f32(h) : mf_f16_to_f32(h));
  *hi = h;
  *lo = mf_isfinite_f32(r) ? (bf ? mf_f32_to_bf16(r) : mf_f32_to_f16(r)) : (uint16_t)0;
}

/* The float32 value element i of a parameter starts its update from: the parameter,
 * plus its Kahan compensation when there is one (comp != NULL). */
static inline MF_HD MF_OPTIM_FORCE_INLINE float mf_optim_load_param(const void *p, const void *comp, int64_t i,
                                              mf_dtype dt) {
  const float v = mf_load_f32(p, i, dt);
  return comp ? v + mf_load_f32(comp, i, dt) : v;
}

/* The seed of tensor `stream`'s stochastic rounding: element i of it rounds with the bits
 * mf_hash64(seed, index_base + i). */
static inline MF_HD uint64_t mf_optim_sr_seed(const mf_optim_hparams *h, int32_t stream) {
  return h->sr_seed + 0x9e3779b97f4a7c15ull * (uint64_t)(stream + 1);
}

/* Stores an updated parameter value: Kahan-compensated when comp != NULL, else with
 * stochastic rounding (mf_optim_hparams.stochastic_round) or nearest-even. The random
 * bits of element i come from element number index_base + i of the tensor (see
 * mf_optim_tensor.index_base). */
static inline MF_HD void mf_optim_store_param(void *p, void *comp, int64_t i, mf_dtype dt,
                                              float v, const mf_optim_hparams *h,
                                              int32_t stream, int64_t index_base) {
  if (comp) {
    mf_optim_kahan_split(v, dt, &((uint16_t *)p)[i], &((uint16_t *)comp)[i]);
  } else if (h->stochastic_round && dt != MF_FLOAT32) {
    uint64_t r = mf_hash64(mf_optim_sr_seed(h, stream), (uint64_t)(index_base + i));
    ((uint16_t *)p)[i] = dt == MF_BFLOAT16 ? mf_f32_to_bf16_sr(v, (uint32_t)r) : mf_f32_to_f16_sr(v, r);
  } else {
    mf_store_f32(p, i, dt, v);
  }
}

/* ---- trust ratio (LAMB, LARS) ------------------------------------------------- *
 *
 * With hparams.max_unorm > 0 (ADAMW/ADAM and SGD), each tensor's update is scaled by
 *     scale = max_unorm * ||p|| / ||u||   if ||u|| > max_unorm * ||p||,  else 1
 * where ||p|| is the norm of the parameter before the step (of p + comp with Kahan) and
 * u the update direction of the new states without lr and without decoupled weight
 * decay: Adam's bias-corrected m_hat / (sqrt(v_hat) + eps) (L2 decay included for ADAM),
 * SGD's momentum buffer, or its Nesterov form (bitsandbytes' LAMB and PytorchLARS).
 * ||p|| = 0 gives scale 0 (the tensor does not move) unless u = 0, as in bitsandbytes.
 * The step runs two passes per tensor:
 *  1. norms: every element's direction (mf_optim_trust_element: the update's own math,
 *     mf_optim_update_dir, on the dequantized states; nothing written but the scratch).
 *     An element the update skips (non-finite gradient or result) contributes 0 to
 *     sum(u^2), as it does not move. The products are exact in float64 (float x float);
 *     the sums run in float64 in one fixed order, so the CPU and the GPU get the same
 *     bits for any thread count: chunk k of a tensor is its elements
 *     [k*MF_OPTIM_TRUST_CHUNK, ...); lane l of MF_OPTIM_TRUST_LANES adds the chunk's
 *     elements l, l + LANES, ... in turn; the lanes are then added as a tree
 *     (mf_optim_trust_tree). The chunk sums are added the same way: lane l adds chunks
 *     l, l + LANES, ..., then the tree. Scratch: per chunk (u, p), then the totals.
 *  2. the update, with step_size (Adam) or lr (SGD) multiplied by scale in float64 and
 *     rounded to float (mf_optim_trust_apply); scale = 1 leaves them, so the bits are
 *     those of the update without the trust ratio whenever it does not clip.
 * On CUDA pass 2 reads the totals on the device: no host synchronisation. */
#define MF_OPTIM_TRUST_CHUNK 4096
#define MF_OPTIM_TRUST_LANES 256

static inline MF_HD int64_t mf_optim_trust_chunks(int64_t n) {
  return (n + MF_OPTIM_TRUST_CHUNK - 1) / MF_OPTIM_TRUST_CHUNK;
}

/* float32 elements of the scratch for a tensor of n elements: 2 float64 per chunk and
 * 2 for the totals. */
static inline MF_HD int64_t mf_optim_trust_numel(int64_t n) {
  return 4 * (mf_optim_trust_chunks(n) + 1);
}

/* The fixed reduction of MF_OPTIM_TRUST_LANES values (CPU form; the CUDA kernels do the
 * same additions in shared memory): halve the width, v[l] += v[l + width]. */
static inline MF_HD double mf_optim_trust_tree(double *v) {
  for (int w = MF_OPTIM_TRUST_LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; l++) v[l] = v[l] + v[l + w];
  return v[0];
}

/* State k's value at element i of a tensor of row_len-element rows (mf_optim_row),
 * dequantized as the update dequantizes it. */
static inline MF_HD float mf_optim_state_at(mf_state_format fmt, const void *q, const float *absmax,
                                            const float *code, int64_t bs, int64_t row_len,
                                            int64_t i) {
  if (fmt == MF_STATE_FP32) return ((const float *)q)[i];
  const int64_t r = i / row_len, j = i - r * row_len;
  const mf_optim_row_start at = mf_optim_row(row_len, bs, r);
  const float am = absmax[at.block + j / bs];
  const uint8_t *b = (const uint8_t *)q;
  const uint8_t c = fmt == MF_STATE_8BIT ? b[i] : (uint8_t)((b[at.code4 + j / 2] >> ((j & 1) * 4)) & 15);
  return mf_dequantize_one(code, c, am);
}

/* Element i's contribution to pass 1: *u2 = u^2 (float64, exact; u the direction with
 * its coefficient's lr left out: see mf_optim_trust_scale), *p2 = p^2. */
static inline MF_HD void mf_optim_trust_element(mf_optim_kind kind, const mf_optim_consts *c,
                                                int ns, float p, float g, float s1, float s2,
                                                double *u2, double *p2) {
  float x = p, dir;
  mf_optim_update_dir(kind, c, ns, &x, g, &s1, &s2, &dir);
  *u2 = (double)dir * (double)dir;
  *p2 = (double)p * (double)p;
}

/* The scale of pass 2 from the totals of pass 1 at step t. Adam's direction in pass 1
 * lacks the bias correction of the first moment (step_size = lr / bc1 carries it):
 * ||u|| = sqrt(sum) / bc1. */
static inline MF_HD double mf_optim_trust_scale(const mf_optim_hparams *h, float t, double sum_u2,
                                                double sum_p2) {
  double unorm = sqrt(sum_u2);
  if ((h->kind == MF_OPT_ADAMW || h->kind == MF_OPT_ADAM) && !h->no_bias_correction)
    unorm = unorm / (1.0 - mf_powi(h->beta1, (int64_t)t));
  const double limit = h->max_unorm * sqrt(sum_p2);
  return unorm > limit ? limit / unorm : 1.0;
}

/* Scales the update term of c (pass 2). */
static inline MF_HD void mf_optim_trust_apply(const mf_optim_hparams *h, mf_optim_consts *c,
                                              double scale) {
  if (scale == 1.0) return;
  if (h->kind == MF_OPT_SGD) c->lr = (float)((double)c->lr * scale);
  else c->step_size = (float)((double)c->step_size * scale);
}

/* The totals a step left in a tensor's scratch (pass 1), as (sum u^2, sum p^2). */
static inline MF_HD const double *mf_optim_trust_totals(const void *trust, int64_t n) {
  return (const double *)trust + 2 * mf_optim_trust_chunks(n);
}

/* Default block sizes: 256 for 8-bit states, 128 for 4-bit. */
#define MF_OPTIM_BLOCK_8BIT 256
#define MF_OPTIM_BLOCK_4BIT 128

/* Applies one optimizer step to `n` tensors, all on one device, states in format
 * `fmt`. code1/code2: float32 code tables (256 entries for 8-bit, 16 for 4-bit, sorted
 * ascending, in [-1, 1]) on that device for quantized states; NULL for FP32. A third
 * state (AdEMAMix) is signed and uses code1.
 * grad_scale, found_inf: NULL or float32[1] on that device (see the header comment).
 * CUDA: one launch sequence for all tensors on `stream`, no host synchronisation. */
mf_status mf_optim_step(const mf_optim_hparams *h, mf_state_format fmt, int64_t block_size,
                        const mf_tensor *code1, const mf_tensor *code2,
                        const mf_optim_tensor *tensors, int64_t n, const mf_tensor *grad_scale,
                        const mf_tensor *found_inf, void *stream);

/* Checks hyperparameters (ranges as torch checks them); names the bad one. */
mf_status mf_optim_check_hparams(const mf_optim_hparams *h);

/* The CPU's fast exact code search (table lookup; see optim.c), exported for tests:
 * out[i] = mf_optim_quantize(code, size, x[i], keep_positive) for size 16 or 256. */
mf_status mf_optim_quantize_fast(const float *code, int size, int keep_positive, const float *x,
                                 int64_t n, uint8_t *out);

/* The CPU kernel that 8-bit and 4-bit states take on this machine: "avx512-vbmi",
 * "avx512-gather", "avx2-gather" or "avx2-scalar" (AVX2 code search by gathers or by
 * scalar loads: measured once per process, as CPUID cannot tell which is faster;
 * MEMFIT_OPTIM_KERNEL=avx2-gather|avx2-scalar forces one), "avx2" (out of memory for
 * the measurement's table) or "generic". For `memfit doctor` and benchmark metadata. */
const char *mf_optim_cpu_kernel(void);

/* The states one parameter of n elements in `rows` rows needs (mf_optim_row): the one
 * definition of the layout that mf_optim_step checks and that the Python layer
 * allocates (memfit.optim). States k = 1..num_states each have rows * state_row_numel
 * elements of state_dtype (float32 for FP32, else uint8 codes) and, when quantized,
 * rows * blocks_per_row float32 block maxima. */
typedef struct {
  int num_states;          /* 0 to 3: mf_optim_num_states */
  int is_signed[3];        /* state k + 1 uses the signed code: mf_optim_state_signed */
  mf_dtype state_dtype;
  int64_t rows;            /* as given (n = rows * row_len) */
  int64_t state_row_numel; /* L for FP32/8BIT, ceil(L/2) for 4BIT */
  int64_t blocks_per_row;  /* ceil(L / block_size); 0 for FP32 */
  int64_t state_numel;     /* rows * state_row_numel */
  int64_t absmax_numel;    /* rows * blocks_per_row */
} mf_optim_layout;

/* Fills *out; checks fmt, block_size (quantized formats), n >= 0 and rows (>= 1,
 * dividing n), naming the bad one. */
mf_status mf_optim_state_layout(const mf_optim_hparams *h, mf_state_format fmt,
                                int64_t block_size, int64_t n, int64_t rows,
                                mf_optim_layout *out);

#ifdef __cplusplus
}
#endif
#endif /* MEMFIT_OPTIM_H */
