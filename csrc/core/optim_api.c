/*
 * The optimizer step's public entry points: the argument checks, the state layout
 * (mf_optim_state_layout), and the choice between the CPU step (optim.c) and the CUDA
 * one (cuda/optim.cu). Every check runs here once per call, before either step reads
 * anything, so a bad argument leaves every tensor as it was.
 */
#include <math.h>
#include <stdio.h>

#include "optim_cpu.h"
#ifdef MEMFIT_WITH_CUDA
#include "memfit/cuda_launch.h"
#endif

/* The layout without the argument checks (check_call has made them once per call). */
static mf_optim_layout layout_of(const mf_optim_hparams *h, mf_state_format fmt, int64_t bs,
                                 int64_t n, int64_t rows) {
  mf_optim_layout l;
  const int64_t row_len = rows > 0 ? n / rows : 0;
  l.num_states = mf_optim_num_states(h);
  l.is_signed[0] = mf_optim_state_signed(h->kind, 1);
  l.is_signed[1] = mf_optim_state_signed(h->kind, 2);
  l.is_signed[2] = mf_optim_state_signed(h->kind, 3);
  l.state_dtype = fmt == MF_STATE_FP32 ? MF_FLOAT32 : MF_UINT8;
  l.rows = rows;
  l.state_row_numel = fmt == MF_STATE_4BIT ? (row_len + 1) / 2 : row_len;
  l.blocks_per_row = fmt == MF_STATE_FP32 ? 0 : mf_quant_num_blocks(row_len, bs);
  l.state_numel = rows * l.state_row_numel;
  l.absmax_numel = rows * l.blocks_per_row;
  return l;
}

/* A tensor's rows (mf_optim_row): 0 is taken as 1, the whole tensor. */
static int64_t rows_of(const mf_optim_tensor *t) { return t->rows ? t->rows : 1; }

static mf_status check_format(mf_state_format fmt, int64_t bs) {
  if (fmt != MF_STATE_FP32 && fmt != MF_STATE_8BIT && fmt != MF_STATE_4BIT)
    return mf_error(MF_ERR_VALUE, "bits: state format must be 32, 8 or 4, got %d", (int)fmt);
  if (fmt != MF_STATE_FP32 && !mf_quant_block_size_ok(bs))
    return mf_error(MF_ERR_VALUE,
                    "block_size: must be one of 64, 128, 256, 512, 1024, 2048, 4096, got %lld",
                    (long long)bs);
  return MF_OK;
}

/* The kind's name, or NULL for a number that is no kind. */
static const char *kind_name(mf_optim_kind k) {
  switch (k) {
    case MF_OPT_ADAMW: return "AdamW";
    case MF_OPT_ADAM: return "Adam";
    case MF_OPT_LION: return "Lion";
    case MF_OPT_SGD: return "SGD";
    case MF_OPT_RMSPROP: return "RMSprop";
    case MF_OPT_MUON: return "Muon";
    case MF_OPT_ADAGRAD: return "Adagrad";
    case MF_OPT_ADEMAMIX: return "AdEMAMix";
  }
  return NULL;
}

mf_status mf_optim_state_layout(const mf_optim_hparams *h, mf_state_format fmt,
                                int64_t block_size, int64_t n, int64_t rows,
                                mf_optim_layout *out) {
  mf_status st;
  if (!kind_name(h->kind))
    return mf_error(MF_ERR_VALUE, "kind: unknown optimizer %d", (int)h->kind);
  if ((st = check_format(fmt, block_size))) return st;
  if (n < 0) return mf_error(MF_ERR_VALUE, "numel: must be >= 0, got %lld", (long long)n);
  if (rows == 0) rows = 1;
  if (rows < 1 || n % rows != 0)
    return mf_error(MF_ERR_VALUE, "rows: %lld rows do not split %lld elements evenly",
                    (long long)rows, (long long)n);
  *out = layout_of(h, fmt, block_size, n, rows);
  return MF_OK;
}

static int bad_num(double x) { return !(x == x) || x > 1e300 || x < -1e300; }

mf_status mf_optim_check_hparams(const mf_optim_hparams *h) {
  if (!kind_name(h->kind))
    return mf_error(MF_ERR_VALUE, "kind: unknown optimizer %d", (int)h->kind);
  const char *k = kind_name(h->kind);
  if (bad_num(h->lr) || h->lr < 0.0)
    return mf_error(MF_ERR_VALUE, "lr: invalid learning rate %g for %s (must be >= 0)", h->lr, k);
  if (bad_num(h->weight_decay) || h->weight_decay < 0.0)
    return mf_error(MF_ERR_VALUE, "weight_decay: invalid value %g for %s (must be >= 0)",
                    h->weight_decay, k);
  if (bad_num(h->max_unorm) || h->max_unorm < 0.0)
    return mf_error(MF_ERR_VALUE, "max_unorm: invalid value %g for %s (must be >= 0)",
                    h->max_unorm, k);
  if (h->max_unorm > 0.0 && h->kind != MF_OPT_ADAMW && h->kind != MF_OPT_ADAM &&
      h->kind != MF_OPT_SGD)
    return mf_error(MF_ERR_VALUE, "max_unorm: the trust ratio (LAMB, LARS) is for AdamW, Adam "
                    "and SGD, not %s; pass 0", k);
  switch (h->kind) {
    case MF_OPT_ADAMW:
    case MF_OPT_ADAM:
    case MF_OPT_LION:
      if (bad_num(h->beta1) || h->beta1 < 0.0 || h->beta1 >= 1.0)
        return mf_error(MF_ERR_VALUE, "betas: invalid beta parameter at index 0: %g (must be in [0, 1))",
                        h->beta1);
      if (bad_num(h->beta2) || h->beta2 < 0.0 || h->beta2 >= 1.0)
        return mf_error(MF_ERR_VALUE, "betas: invalid beta parameter at index 1: %g (must be in [0, 1))",
                        h->beta2);
      if (h->kind != MF_OPT_LION && (bad_num(h->eps) || h->eps < 0.0))
        return mf_error(MF_ERR_VALUE, "eps: invalid epsilon value %g (must be >= 0)", h->eps);
      break;
    case MF_OPT_SGD:
      if (bad_num(h->momentum) || h->momentum < 0.0)
        return mf_error(MF_ERR_VALUE, "momentum: invalid value %g (must be >= 0)", h->momentum);
      if (bad_num(h->dampening))
        return mf_error(MF_ERR_VALUE, "dampening: invalid value %g", h->dampening);
      if (h->nesterov && (h->momentum <= 0.0 || h->dampening != 0.0))
        return mf_error(MF_ERR_VALUE, "nesterov: requires a momentum and zero dampening");
      break;
    case MF_OPT_RMSPROP:
      if (bad_num(h->alpha) || h->alpha < 0.0)
        return mf_error(MF_ERR_VALUE, "alpha: invalid value %g (must be >= 0)", h->alpha);
      if (bad_num(h->eps) || h->eps < 0.0)
        return mf_error(MF_ERR_VALUE, "eps: invalid epsilon value %g (must be >= 0)", h->eps);
      if (bad_num(h->momentum) || h->momentum < 0.0)
        return mf_error(MF_ERR_VALUE, "momentum: invalid value %g (must be >= 0)", h->momentum);
      break;
    case MF_OPT_ADEMAMIX: {
      const double b[3] = {h->beta1, h->beta2, h->beta3};
      for (int i = 0; i < 3; i++)
        if (bad_num(b[i]) || b[i] < 0.0 || b[i] >= 1.0)
          return mf_error(MF_ERR_VALUE, "betas: invalid beta parameter at index %d: %g (must be "
                          "in [0, 1))", i, b[i]);
      if (bad_num(h->eps) || h->eps < 0.0)
        return mf_error(MF_ERR_VALUE, "eps: invalid epsilon value %g (must be >= 0)", h->eps);
      if (bad_num(h->alpha) || h->alpha < 0.0)
        return mf_error(MF_ERR_VALUE, "alpha: invalid value %g for AdEMAMix (must be >= 0)",
                        h->alpha);
      if (bad_num(h->t_alpha) || h->t_alpha < 0.0)
        return mf_error(MF_ERR_VALUE, "t_alpha: invalid value %g (must be > 0, or 0 for no "
                        "scheduler)", h->t_alpha);
      if (bad_num(h->t_beta3) || h->t_beta3 < 0.0)
        return mf_error(MF_ERR_VALUE, "t_beta3: invalid value %g (must be > 0, or 0 for no "
                        "scheduler)", h->t_beta3);
      /* the beta3 scheduler takes their logarithms */
      if (h->t_beta3 > 0.0 && (h->beta1 <= 0.0 || h->beta3 <= 0.0))
        return mf_error(MF_ERR_VALUE, "betas: the beta3 scheduler (t_beta3) needs beta1 > 0 and "
                        "beta3 > 0, got %g and %g", h->beta1, h->beta3);
      break;
    }
    case MF_OPT_MUON: /* torch.optim.Muon's check */
      if (bad_num(h->momentum) || h->momentum < 0.0)
        return mf_error(MF_ERR_VALUE, "momentum: invalid value %g for Muon (must be >= 0)",
                        h->momentum);
      if (h->stochastic_round)
        return mf_error(MF_ERR_VALUE, "sr_seed: Muon's pass writes the update rounded to "
                        "nearest (torch's .bfloat16() of it), not a parameter; pass sr_seed=0");
      break;
    case MF_OPT_ADAGRAD: /* torch.optim.Adagrad's checks */
      if (bad_num(h->lr_decay) || h->lr_decay < 0.0)
        return mf_error(MF_ERR_VALUE, "lr_decay: invalid lr_decay value %g (must be >= 0)",
                        h->lr_decay);
      if (bad_num(h->eps) || h->eps < 0.0)
        return mf_error(MF_ERR_VALUE, "eps: invalid epsilon value %g (must be >= 0)", h->eps);
      break;
  }
  return MF_OK;
}

static int has(const mf_tensor *t) { return t && t->data != NULL; }

/* The checks below run for every array of every call (thousands per step of a large
 * model), so the common, valid case returns before an argument name is formatted. */
static int same_device(const mf_tensor *a, const mf_tensor *b) {
  return a->device == b->device && a->device_id == b->device_id;
}

static mf_status check_one(const mf_tensor *t, const char *what, int64_t i, mf_dtype dt,
                           int64_t numel, const mf_tensor *dev) {
  if (has(t) && t->dtype == dt && t->numel == numel && same_device(t, dev)) return MF_OK;
  if (!has(t) && numel == 0) return MF_OK; /* empty parameter: nothing to point at */
  char name[64];
  snprintf(name, sizeof name, "%s[%lld]", what, (long long)i);
  mf_status st;
  if (!has(t))
    return mf_error(MF_ERR_VALUE, "%s: missing (this optimizer keeps this state)", name);
  if ((st = mf_check_dtype(t, name, dt))) return st;
  if ((st = mf_check_numel(t, name, numel))) return st;
  if ((st = mf_check_same_device(t, name, dev, "params[0]"))) return st;
  return MF_OK;
}

static mf_status check_code(const mf_tensor *code, const char *name, int size,
                            const mf_tensor *dev) {
  mf_status st;
  if (!has(code)) return mf_error(MF_ERR_VALUE, "%s: a code table is needed for quantized states", name);
  if ((st = mf_check_dtype(code, name, MF_FLOAT32))) return st;
  if ((st = mf_check_numel(code, name, size))) return st;
  if ((st = mf_check_same_device(code, name, dev, "params[0]"))) return st;
  if (code->device == MF_CPU) {
    const float *c = (const float *)code->data;
    for (int i = 0; i < size; i++) {
      if (!(c[i] >= -1.0f && c[i] <= 1.0f))
        return mf_error(MF_ERR_VALUE, "%s: values must lie in [-1, 1], %s[%d] = %g", name, name,
                        i, (double)c[i]);
      if (i > 0 && c[i] < c[i - 1])
        return mf_error(MF_ERR_VALUE, "%s: must be sorted ascending (%s[%d] < %s[%d])", name,
                        name, i, name, i - 1);
    }
  }
  return MF_OK;
}

static mf_status check_call(const mf_optim_hparams *h, mf_state_format fmt, int64_t bs,
                            const mf_tensor *code1, const mf_tensor *code2,
                            const mf_optim_tensor *ts, int64_t n, const mf_tensor *grad_scale,
                            const mf_tensor *found_inf) {
  mf_status st;
  if ((st = mf_optim_check_hparams(h))) return st;
  if ((st = check_format(fmt, bs))) return st;
  if (n < 0) return mf_error(MF_ERR_VALUE, "params: negative count");
  if (n == 0) return MF_OK;
  const mf_tensor *dev = &ts[0].param;
  const int ns = mf_optim_num_states(h);
  if (fmt != MF_STATE_FP32) {
    const int size = fmt == MF_STATE_8BIT ? MF_CODE_SIZE : MF_CODE4_SIZE;
    if (ns >= 1 && (st = check_code(code1, "code1", size, dev))) return st;
    if (ns >= 2 && (st = check_code(code2, "code2", size, dev))) return st;
  }
  for (int64_t i = 0; i < n; i++) {
    const mf_optim_tensor *t = &ts[i];
    const mf_dtype pdt = t->param.dtype;
    if ((pdt != MF_FLOAT32 && pdt != MF_FLOAT16 && pdt != MF_BFLOAT16) || !same_device(&t->param, dev)) {
      char name[64];
      snprintf(name, sizeof name, "params[%lld]", (long long)i);
      if ((st = mf_check_float(&t->param, name))) return st;
      if ((st = mf_check_same_device(&t->param, name, dev, "params[0]"))) return st;
    }
    const int64_t pn = t->param.numel;
    if ((st = check_one(&t->grad, "grads", i, t->param.dtype, pn, dev))) {
      if (st == MF_ERR_TYPE)
        return mf_error(MF_ERR_TYPE, "grads[%lld]: expected dtype %s (the dtype of params[%lld]), got %s",
                        (long long)i, mf_dtype_name(t->param.dtype), (long long)i,
                        mf_dtype_name(t->grad.dtype));
      return st;
    }
    if ((st = check_one(&t->step, "steps", i, MF_FLOAT32, 1, dev))) return st;
    if (has(&t->comp)) {
      if (h->kind == MF_OPT_MUON)
        return mf_error(MF_ERR_VALUE, "comps[%lld]: Muon's pass writes an update into "
                        "params[%lld], not a parameter: it takes no Kahan buffer",
                        (long long)i, (long long)i);
      if (t->param.dtype != MF_FLOAT16 && t->param.dtype != MF_BFLOAT16)
        return mf_error(MF_ERR_VALUE,
                        "comps[%lld]: a Kahan compensation buffer is only for float16/bfloat16 "
                        "parameters, but params[%lld] is %s (which needs none)",
                        (long long)i, (long long)i, mf_dtype_name(t->param.dtype));
      if (h->stochastic_round)
        return mf_error(MF_ERR_VALUE,
                        "comps[%lld]: Kahan compensation and stochastic rounding (sr_seed != 0) "
                        "cannot be combined; use one or the other", (long long)i);
      if ((st = check_one(&t->comp, "comps", i, t->param.dtype, pn, dev))) return st;
    }
    const int64_t rows = rows_of(t);
    if (rows < 1 || pn % rows != 0)
      return mf_error(MF_ERR_VALUE, "rows[%lld]: %lld rows do not split the %lld elements of "
                      "params[%lld] evenly", (long long)i, (long long)rows, (long long)pn,
                      (long long)i);
    if (t->index_base < 0)
      return mf_error(MF_ERR_VALUE, "index_base[%lld]: must be >= 0, got %lld", (long long)i,
                      (long long)t->index_base);
    if (h->max_unorm > 0.0 && pn > 0) {
      if ((st = check_one(&t->trust, "trust", i, MF_FLOAT32, mf_optim_trust_numel(pn), dev)))
        return st;
      if ((uintptr_t)t->trust.data % 8 != 0)
        return mf_error(MF_ERR_VALUE, "trust[%lld]: the trust ratio's scratch holds float64 "
                        "values: its data must be 8-byte aligned", (long long)i);
    }
    const mf_optim_layout L = layout_of(h, fmt, bs, pn, rows);
    const mf_tensor *states[3][2] = {
        {&t->state1, &t->absmax1}, {&t->state2, &t->absmax2}, {&t->state3, &t->absmax3}};
    static const char *const names[3][2] = {
        {"state1", "absmax1"}, {"state2", "absmax2"}, {"state3", "absmax3"}};
    for (int k = 0; k < L.num_states; k++) {
      if ((st = check_one(states[k][0], names[k][0], i, L.state_dtype, L.state_numel, dev)))
        return st;
      if (fmt != MF_STATE_FP32 &&
          (st = check_one(states[k][1], names[k][1], i, MF_FLOAT32, L.absmax_numel, dev)))
        return st;
    }
  }
  if (grad_scale && (st = check_one(grad_scale, "grad_scale", 0, MF_FLOAT32, 1, dev))) return st;
  if (found_inf && (st = check_one(found_inf, "found_inf", 0, MF_FLOAT32, 1, dev))) return st;
  return MF_OK;
}

mf_status mf_optim_step(const mf_optim_hparams *h, mf_state_format fmt, int64_t block_size,
                        const mf_tensor *code1, const mf_tensor *code2,
                        const mf_optim_tensor *tensors, int64_t n, const mf_tensor *grad_scale,
                        const mf_tensor *found_inf, void *stream) {
  mf_status st = check_call(h, fmt, block_size, code1, code2, tensors, n, grad_scale, found_inf);
  if (st || n == 0) return st;
  /* AdEMAMix's beta3 scheduler needs ln(beta1), ln(beta3) on the device: computed once
   * here, by the host's libm, for the CPU and the CUDA step alike */
  mf_optim_hparams hl = *h;
  hl.ln_beta1 = h->kind == MF_OPT_ADEMAMIX && h->beta1 > 0.0 ? log(h->beta1) : 0.0;
  hl.ln_beta3 = h->kind == MF_OPT_ADEMAMIX && h->beta3 > 0.0 ? log(h->beta3) : 0.0;
  h = &hl;
  if (tensors[0].param.device == MF_CUDA) {
#ifdef MEMFIT_WITH_CUDA
    return mf_cuda_optim_step(h, fmt, block_size, code1, code2, tensors, n, grad_scale,
                              found_inf, stream);
#else
    (void)stream;
    return mf_error_no_cuda("optimizer step");
#endif
  }
  return mf_optim_step_cpu(h, fmt, block_size, code1, code2, tensors, n, grad_scale, found_inf);
}
