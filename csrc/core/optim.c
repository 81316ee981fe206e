/*
 * Optimizer steps: argument checks, dispatch, and the CPU loops.
 *
 * CPU path. One OpenMP parallel region covers every tensor of the call: the work items
 * of all tensors (2048 elements, 16384 for the fused kernel, or one quantization block
 * if larger) are numbered across tensors and handed out dynamically (see step_cpu), so
 * a call with many small tensors pays one fork/join, and a slower core takes fewer
 * items. A tensor whose rows are not whole quantization blocks (mf_optim_row,
 * mf_optim_split_rows) is cut row by row, and each item sees its row as a tensor of its
 * own (row_view), so no kernel knows about rows. An item goes through short loops over per-thread buffers (L1/L2 resident):
 *   1. load:     widen f16/bf16 params and grads to float; dequantize the states
 *                (code[index] * absmax, per quantization block)
 *   2. update:   mf_optim_update_one() for every element (optim.h, shared with CUDA);
 *                on AVX2, Adam's 8 at a time with one skip test (update_adam_avx2)
 *   3. absmax:   per block, of the new states, as the max of the float bit patterns
 *                with the sign cleared (same order as the values for non-negative floats)
 *   4. store:    narrow params; requantize the states with the code search below.
 * The loops are auto-vectorised; the item function is compiled three times (plain
 * x86-64, AVX2, AVX-512) and picked at run time. All of it is compiled with
 * -ffp-contract=off, so no variant fuses a multiply-add: every variant, and the CUDA
 * kernel, computes the same bits (tested).
 *
 * Code search: the exact lookup table of code_lut.h (bit-identical to the binary
 * search the CUDA kernels use), built once per code and cached.
 *
 * On x86 CPUs with AVX2 or AVX-512, work items made of whole quantization blocks (8-bit
 * states, and 4-bit states of Adam/AdamW) go to the fused, software-pipelined kernel of
 * optim_fused.h instead (built per instruction set in optim_avx512.c,
 * optim_avx512_gather.c and optim_avx2.c; same bits, tested): one pass per block that
 * overlaps the divider-bound update with the lookup-bound requantization. Codes whose
 * search table has slow buckets (pick_fused) stay on the block kernel. On AVX2 the
 * fused kernel's code search uses gathers or scalar loads, whichever a short
 * measurement at the first step finds faster (optim_avx2.c; mf_optim_cpu_kernel).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "optim_cpu.h"
#include "memfit/multi_tensor.h"
#ifdef MEMFIT_WITH_CUDA
#include "memfit/cuda_launch.h"
#endif

/* ---- argument checks ------------------------------------------------------------ */

/* The layout without the argument checks (check_call has made them once per call). */
static mf_optim_layout layout_of(const mf_optim_hparams *h, mf_state_format fmt, int64_t bs,
                                 int64_t n, int64_t rows) {
  mf_optim_layout l;
  const int64_t row_len = rows > 0 ? n / rows : 0;
  l.num_states = mf_optim_num_states(h);
  l.is_signed[0] = mf_optim_state_signed(h->kind, 1);
  l.is_signed[1] = mf_optim_state_signed(h->kind, 2);
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

mf_status mf_optim_state_layout(const mf_optim_hparams *h, mf_state_format fmt,
                                int64_t block_size, int64_t n, int64_t rows,
                                mf_optim_layout *out) {
  mf_status st;
  if (h->kind < MF_OPT_ADAMW || h->kind > MF_OPT_RMSPROP)
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

static const char *kind_name(mf_optim_kind k) {
  switch (k) {
    case MF_OPT_ADAMW: return "AdamW";
    case MF_OPT_ADAM: return "Adam";
    case MF_OPT_LION: return "Lion";
    case MF_OPT_SGD: return "SGD";
    case MF_OPT_RMSPROP: return "RMSprop";
  }
  return "unknown";
}

static int bad_num(double x) { return !(x == x) || x > 1e300 || x < -1e300; }

mf_status mf_optim_check_hparams(const mf_optim_hparams *h) {
  if (h->kind < MF_OPT_ADAMW || h->kind > MF_OPT_RMSPROP)
    return mf_error(MF_ERR_VALUE, "kind: unknown optimizer %d", (int)h->kind);
  const char *k = kind_name(h->kind);
  if (bad_num(h->lr) || h->lr < 0.0)
    return mf_error(MF_ERR_VALUE, "lr: invalid learning rate %g for %s (must be >= 0)", h->lr, k);
  if (bad_num(h->weight_decay) || h->weight_decay < 0.0)
    return mf_error(MF_ERR_VALUE, "weight_decay: invalid value %g for %s (must be >= 0)",
                    h->weight_decay, k);
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
    const mf_optim_layout L = layout_of(h, fmt, bs, pn, rows);
    const mf_tensor *states[2][2] = {{&t->state1, &t->absmax1}, {&t->state2, &t->absmax2}};
    static const char *const names[2][2] = {{"state1", "absmax1"}, {"state2", "absmax2"}};
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

/* ---- the CPU block kernel ------------------------------------------------------- */

MF_INLINE void dequant8(const uint8_t *restrict q, const float *restrict code, float absmax,
                     int64_t n, float *restrict out) {
  for (int64_t i = 0; i < n; i++) out[i] = code[q[i]] * absmax;
}

MF_INLINE void dequant4(const uint8_t *restrict q, const float *restrict code, float absmax,
                     int64_t n, float *restrict out) {
  for (int64_t i = 0; i < n; i++) out[i] = code[(q[i >> 1] >> ((i & 1) * 4)) & 15] * absmax;
}

/* q[i] = nearest code index of s[i] * inv, through the table when there is one. */
MF_INLINE void quantize_run(const float *restrict s, float inv, int64_t n, const float *code,
                            int size, const mf_code_lut *lut, uint8_t *restrict q) {
  if (lut) {
    mf_code_lut_quantize_n(lut, s, inv, n, q);
  } else {
    for (int64_t i = 0; i < n; i++) q[i] = mf_optim_quantize(code, size, s[i] * inv);
  }
}

mf_status mf_optim_quantize_fast(const float *code, int size, const float *x, int64_t n,
                                 uint8_t *out) {
  if (size != MF_CODE_SIZE && size != MF_CODE4_SIZE)
    return mf_error(MF_ERR_VALUE, "size: must be 16 or 256, got %d", size);
  const mf_code_lut *lut = mf_code_lut_get(code, size);
  if (!lut) return mf_error(MF_ERR_NOMEM, "quantize: no table");
  mf_code_lut_quantize_n(lut, x, 1.0f, n, out);
  return MF_OK;
}


/* One block [first, first + n) of one tensor. Compiled once per instruction set (the
 * variants below), the plain loops vectorise for each; `isa` keeps them apart. */
MF_INLINE void block_step_impl(const mf_optim_hparams *h, const mf_optim_consts *c, int ns,
                               mf_state_format fmt, int64_t bs, const quant_ctx *qc,
                               const mf_optim_tensor *t, int64_t first, int64_t n,
                               thread_bufs *b, const int isa) {
  const mf_dtype dt = t->param.dtype;
  float *p, *g, *s[2];
  if (dt == MF_FLOAT32) {
    p = (float *)t->param.data + first;
    g = (float *)t->grad.data + first;
  } else {
    p = b->p;
    g = b->g;
    load_params(t, first, n, p);
    widen(t->grad.data, dt, first, n, g);
  }
  const mf_tensor *st[2] = {&t->state1, &t->state2};
  const mf_tensor *am[2] = {&t->absmax1, &t->absmax2};
  /* the chunk [first, first + n) holds whole quantization blocks (but the last) */
  const int64_t blk0 = fmt == MF_STATE_FP32 ? 0 : first / bs;
  const int64_t nsub = fmt == MF_STATE_FP32 ? 0 : (n + bs - 1) / bs;
  for (int k = 0; k < 2; k++) {
    if (k >= ns) {
      s[k] = b->zero;
      continue;
    }
    if (fmt == MF_STATE_FP32) {
      s[k] = (float *)st[k]->data + first;
      continue;
    }
    s[k] = b->s[k];
    const float *absmax = (const float *)am[k]->data + blk0;
    for (int64_t j = 0; j < nsub; j++) {
      const int64_t off = j * bs, len = n - off < bs ? n - off : bs;
      if (fmt == MF_STATE_8BIT) {
        const uint8_t *q = (const uint8_t *)st[k]->data + first + off;
        dequant8(q, qc->code[k], absmax[j], len, s[k] + off);
      } else {
        const uint8_t *q = (const uint8_t *)st[k]->data + (first + off) / 2;
        dequant4(q, qc->code[k], absmax[j], len, s[k] + off);
      }
    }
  }
#ifdef MF_X86_SIMD
  if (isa == ISA_AVX2 && (h->kind == MF_OPT_ADAMW || h->kind == MF_OPT_ADAM))
    update_adam_avx2(h->kind, c, n, p, g, s[0], s[1]);
  else
#endif
    update_any(h->kind, c, ns, n, p, g, s[0], s[1]);
  if (dt != MF_FLOAT32) store_params(h, t, p, first, n);
  for (int k = 0; k < ns && fmt != MF_STATE_FP32; k++) {
    float *absmax = (float *)am[k]->data + blk0;
    for (int64_t j = 0; j < nsub; j++) {
      const int64_t off = j * bs, len = n - off < bs ? n - off : bs;
      const float *v = s[k] + off;
      const float a = block_absmax(v, len);
      absmax[j] = a;
      const float inv = mf_absmax_inverse(a);
      uint8_t *dst = fmt == MF_STATE_8BIT ? (uint8_t *)st[k]->data + first + off : b->q;
      quantize_run(v, inv, len, qc->code[k], qc->code_size, qc->lut[k], dst);
      if (fmt == MF_STATE_4BIT) pack4(b->q, len, (uint8_t *)st[k]->data + (first + off) / 2);
    }
  }
}

typedef void (*block_fn)(const mf_optim_hparams *, const mf_optim_consts *, int,
                         mf_state_format, int64_t, const quant_ctx *, const mf_optim_tensor *,
                         int64_t, int64_t, thread_bufs *);

static void block_step_generic(const mf_optim_hparams *h, const mf_optim_consts *c, int ns,
                               mf_state_format fmt, int64_t bs, const quant_ctx *qc,
                               const mf_optim_tensor *t, int64_t first, int64_t n,
                               thread_bufs *b) {
  block_step_impl(h, c, ns, fmt, bs, qc, t, first, n, b, ISA_GENERIC);
}

#ifdef MF_X86_SIMD
MF_TARGET_AVX2 static void block_step_avx2(const mf_optim_hparams *h, const mf_optim_consts *c,
                                           int ns, mf_state_format fmt, int64_t bs,
                                           const quant_ctx *qc, const mf_optim_tensor *t,
                                           int64_t first, int64_t n, thread_bufs *b) {
  block_step_impl(h, c, ns, fmt, bs, qc, t, first, n, b, ISA_AVX2);
}

MF_TARGET_AVX512 static void block_step_avx512(const mf_optim_hparams *h,
                                               const mf_optim_consts *c, int ns,
                                               mf_state_format fmt, int64_t bs,
                                               const quant_ctx *qc, const mf_optim_tensor *t,
                                               int64_t first, int64_t n, thread_bufs *b) {
  block_step_impl(h, c, ns, fmt, bs, qc, t, first, n, b, ISA_AVX512);
}
#endif

static block_fn pick_block_fn(void) {
#ifdef MF_X86_SIMD
  switch (mf_cpu_isa()) {
    case ISA_AVX512: return block_step_avx512;
    case ISA_AVX2: return block_step_avx2;
  }
#endif
  return block_step_generic;
}

/* Elements per work item: a long update loop and long runs through each array (the
 * hardware prefetchers follow runs within a 4 KB page); whole quantization blocks. */
#define CPU_CHUNK 2048
#define FUSED_CHUNK 16384
/* Elements a thread takes from the shared work list at a time (whole items): taken one
 * item at a time, the threads interleave at a fine grain and the step is slower when
 * both cores run at the same speed; 65536 elements (4 fused items) keep that speed and
 * most of the gain of dynamic sharing when they do not (benchmarks/RESULTS.md). */
#define GRAB_ELEMS 65536

/* The fused kernel that work items with whole quantization blocks go to (optim_fused.h;
 * the partial last block of a tensor, if any, takes the block kernel), or NULL: 8-bit
 * states of every kind, 4-bit states of Adam/AdamW, on AVX-512 (with or without VBMI)
 * and AVX2 CPUs. */
#ifdef MF_X86_SIMD
static fused_fn pick_fused(const mf_optim_hparams *h, mf_state_format fmt, int ns, int64_t bs,
                           const quant_ctx *qc) {
  const int kind_ok = fmt == MF_STATE_8BIT ||
                      (fmt == MF_STATE_4BIT && (h->kind == MF_OPT_ADAMW || h->kind == MF_OPT_ADAM));
  /* the fused search has no binary-search fallback: tables with slow buckets (codes
   * closer than 1/128 of a binade; none of memfit's own) take the block kernel */
  if (!kind_ok || ns < 1 || bs % 64 != 0 || !qc->lut[0] || qc->lut[0]->has_slow ||
      (ns > 1 && (!qc->lut[1] || qc->lut[1]->has_slow)))
    return NULL;
  const int eight = fmt == MF_STATE_8BIT;
  if (mf_cpu_has_vbmi()) return eight ? mf_optim_fused8_avx512_vbmi : mf_optim_fused4_avx512_vbmi;
  if (mf_cpu_isa() == ISA_AVX512)
    return eight ? mf_optim_fused8_avx512_gather : mf_optim_fused4_avx512_gather;
  if (mf_cpu_isa() == ISA_AVX2) return eight ? mf_optim_fused8_avx2 : mf_optim_fused4_avx2;
  return NULL;
}
#endif

const char *mf_optim_cpu_kernel(void) {
#ifdef MF_X86_SIMD
  if (mf_cpu_has_vbmi()) return "avx512-vbmi";
  if (mf_cpu_isa() == ISA_AVX512) return "avx512-gather";
  if (mf_cpu_isa() == ISA_AVX2) {
    /* the measurement needs a search table: the one of AdamW8bit's first state */
    float code[MF_CODE_SIZE];
    const mf_code_lut *lut = mf_dynamic_map(code, MF_CODE_SIZE, 1, 8, 7) == MF_OK
                                 ? mf_code_lut_get(code, MF_CODE_SIZE) : NULL;
    if (!lut) return "avx2";
    return mf_optim_avx2_scalar_search(lut) ? "avx2-scalar" : "avx2-gather";
  }
#endif
  return "generic";
}

/* Row r of tensor t (the rows of the block layout, mf_optim_row) as a tensor of its own,
 * for tensors whose rows the kernels step one by one (mf_optim_split_rows). */
static mf_optim_tensor row_view(const mf_optim_tensor *t, mf_state_format fmt, int64_t bs,
                                int64_t rows, int64_t r) {
  mf_optim_tensor v = *t;
  const int64_t row_len = t->param.numel / rows;
  const mf_optim_row_start at = mf_optim_row(row_len, bs, r);
  const int64_t esize = mf_dtype_size(t->param.dtype);
  const int64_t code = fmt == MF_STATE_4BIT ? at.code4 : at.elem;
  v.param.data = (char *)t->param.data + at.elem * esize;
  v.grad.data = (char *)t->grad.data + at.elem * esize;
  if (t->comp.data) v.comp.data = (char *)t->comp.data + at.elem * esize;
  if (t->state1.data) v.state1.data = (uint8_t *)t->state1.data + code;
  if (t->state2.data) v.state2.data = (uint8_t *)t->state2.data + code;
  if (t->absmax1.data) v.absmax1.data = (float *)t->absmax1.data + at.block;
  if (t->absmax2.data) v.absmax2.data = (float *)t->absmax2.data + at.block;
  v.param.numel = v.grad.numel = row_len;
  v.rows = 1;
  v.index_base = t->index_base + at.elem;
  return v;
}

static mf_status step_cpu(const mf_optim_hparams *h, mf_state_format fmt, int64_t bs,
                          const mf_tensor *code1, const mf_tensor *code2,
                          const mf_optim_tensor *ts, int64_t n, const mf_tensor *grad_scale,
                          const mf_tensor *found_inf) {
  if (found_inf && *(const float *)found_inf->data != 0.0f) return MF_OK; /* skipped step */
  const float inv_scale = grad_scale ? 1.0f / *(const float *)grad_scale->data : 1.0f;
  const int ns = mf_optim_num_states(h);
  quant_ctx qc = {{NULL, NULL}, {NULL, NULL}, fmt == MF_STATE_4BIT ? MF_CODE4_SIZE : MF_CODE_SIZE, 0};
  if (fmt != MF_STATE_FP32) {
    const mf_tensor *codes[2] = {code1, code2};
    for (int k = 0; k < ns; k++) {
      qc.code[k] = (const float *)codes[k]->data;
      qc.lut[k] = mf_code_lut_get(qc.code[k], qc.code_size);
    }
  }
  const block_fn block_step = pick_block_fn();
#ifdef MF_X86_SIMD
  const fused_fn fused = pick_fused(h, fmt, ns, bs, &qc);
  if (fused == mf_optim_fused8_avx2 || fused == mf_optim_fused4_avx2)
    qc.scalar_search = mf_optim_avx2_scalar_search(qc.lut[0]);
#else
  const void *fused = NULL;
#endif
  /* the fused kernel drains its pipeline once per item: give it longer ones */
  const int64_t item = fused ? FUSED_CHUNK : CPU_CHUNK;
  const int64_t chunk = fmt == MF_STATE_FP32 || bs < item ? item : bs;
  /* Work items numbered across tensors: tensor i has items [start[i], start[i + 1]).
   * They are handed out GRAB_ELEMS elements' worth at a time (schedule(dynamic)) rather
   * than split evenly up front: the kernels are compute-bound, and on shared machines
   * the cores do not run at the same speed (bench_optim_core.py's per-core line), so an
   * even split waits for the slow one. */
  int64_t *start = (int64_t *)malloc((size_t)(2 * n + 1) * sizeof *start);
  if (!start) return mf_error(MF_ERR_NOMEM, "optimizer step: out of host memory");
  int64_t *split = start + n + 1; /* rows stepped one by one, per tensor */
  for (int64_t i = 0; i < n; i++)
    split[i] = mf_optim_split_rows(fmt, bs, ts[i].param.numel, rows_of(&ts[i]));
  const int64_t total_items = mf_mt_prefix(&ts[0].param.numel, sizeof *ts, split, n, chunk, start);
  const int grab = chunk >= GRAB_ELEMS ? 1 : (int)(GRAB_ELEMS / chunk);

  int failed = 0;
#pragma omp parallel num_threads(mf_get_num_threads()) if (total_items > 8)
  {
    thread_bufs b;
    /* Every region is written before it is read, but for `zero` (the missing second
     * state of one-state kinds, which the update rewrites with its own zeros): zero only
     * that, not the whole ~330 KB a calloc would clear on every call. */
    float *mem = (float *)malloc((size_t)(5 * chunk + 4 * bs) * sizeof(float));
    if (mem) memset(mem + 4 * chunk, 0, (size_t)chunk * sizeof(float));
    uint8_t *qmem = (uint8_t *)malloc((size_t)chunk);
    if (!mem || !qmem) {
#pragma omp atomic write
      failed = 1;
    }
    b.p = mem;
    b.g = mem ? mem + chunk : NULL;
    b.s[0] = mem ? mem + 2 * chunk : NULL;
    b.s[1] = mem ? mem + 3 * chunk : NULL;
    b.zero = mem ? mem + 4 * chunk : NULL;
    b.ring = mem ? mem + 5 * chunk : NULL;
    b.q = qmem;
    b.fused_ready = 0;
    int64_t cur = -1; /* the tensor whose constants c holds */
    mf_optim_consts c;
#pragma omp for schedule(dynamic, grab)
    for (int64_t w = 0; w < total_items; w++) {
      if (!mem || !qmem) continue;
      const int64_t i = mf_mt_tensor_of(start, n, w);
      const mf_optim_tensor *t = &ts[i];
      if (i != cur) {
        c = mf_optim_prepare(h, *(const float *)t->step.data + 1.0f, inv_scale);
        cur = i;
      }
      /* item k of a tensor stepped row by row is item k % per_row of row k / per_row */
      int64_t k = w - start[i];
      mf_optim_tensor row;
      if (split[i] > 1) {
        const int64_t per_row = mf_mt_items(t->param.numel / split[i], chunk);
        row = row_view(t, fmt, bs, split[i], k / per_row);
        t = &row;
        k %= per_row;
      }
      const int64_t numel = t->param.numel, first = k * chunk;
      const int64_t len = numel - first < chunk ? numel - first : chunk;
      /* the whole blocks to the fused kernel, a partial last one to the block kernel */
      const int64_t whole = fused ? len - len % bs : 0;
#ifdef MF_X86_SIMD
      if (whole > 0) fused(h, &c, ns, bs, &qc, t, first, whole, &b);
#endif
      if (whole < len) block_step(h, &c, ns, fmt, bs, &qc, t, first + whole, len - whole, &b);
    }
    free(mem);
    free(qmem);
  }
  free(start);
  if (failed) return mf_error(MF_ERR_NOMEM, "optimizer step: out of host memory");
  for (int64_t i = 0; i < n; i++) *(float *)ts[i].step.data += 1.0f;
  return MF_OK;
}

mf_status mf_optim_step(const mf_optim_hparams *h, mf_state_format fmt, int64_t block_size,
                        const mf_tensor *code1, const mf_tensor *code2,
                        const mf_optim_tensor *tensors, int64_t n, const mf_tensor *grad_scale,
                        const mf_tensor *found_inf, void *stream) {
  mf_status st = check_call(h, fmt, block_size, code1, code2, tensors, n, grad_scale, found_inf);
  if (st || n == 0) return st;
  if (tensors[0].param.device == MF_CUDA) {
#ifdef MEMFIT_WITH_CUDA
    return mf_cuda_optim_step(h, fmt, block_size, code1, code2, tensors, n, grad_scale,
                              found_inf, stream);
#else
    (void)stream;
    return mf_error(MF_ERR_NO_CUDA,
                    "optimizer step: got CUDA arrays, but this memfit was built without CUDA "
                    "support (rebuild where nvcc is installed, or with -C cmake.define.MEMFIT_CUDA=ON)");
#endif
  }
  return step_cpu(h, fmt, block_size, code1, code2, tensors, n, grad_scale, found_inf);
}
