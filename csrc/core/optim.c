/*
 * The CPU optimizer step (mf_optim_step_cpu), called by mf_optim_step (optim_api.c)
 * once it has checked the arguments.
 *
 * One parallel region covers every tensor of the call (OpenMP's, or the passive thread
 * pool of memfit/thread_pool.h when the calling thread has one attached: the host
 * queue's thread; both run the one item function, step_item): the work items of all
 * tensors (2048 elements, 16384 for the fused kernel, or one quantization block if
 * larger) are numbered across tensors and handed out dynamically, so a call with many
 * small tensors pays one fork/join, and a slower core takes fewer items. A tensor
 * whose rows are not whole quantization blocks (mf_optim_row, mf_optim_split_rows) is
 * cut row by row, and each item sees its row as a tensor of its own (row_view), so no
 * kernel knows about rows. An item goes through short loops over per-thread buffers
 * (L1/L2 resident):
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
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "optim_cpu.h"
#include "memfit/multi_tensor.h"
#include "memfit/thread_pool.h"

/* ---- the CPU block kernel ------------------------------------------------------- */

MF_INLINE void dequant8(const uint8_t *restrict q, const float *restrict code, float absmax,
                     int64_t n, float *restrict out) {
  for (int64_t i = 0; i < n; i++) out[i] = code[q[i]] * absmax;
}

MF_INLINE void dequant4(const uint8_t *restrict q, const float *restrict code, float absmax,
                     int64_t n, float *restrict out) {
  for (int64_t i = 0; i < n; i++) out[i] = code[(q[i >> 1] >> ((i & 1) * 4)) & 15] * absmax;
}

/* q[i] = code index of state k's s[i] * inv (mf_optim_quantize), through the table
 * when there is one. */
MF_INLINE void quantize_run(const float *restrict s, float inv, int64_t n, const quant_ctx *qc,
                            int k, uint8_t *restrict q) {
  if (qc->lut[k]) {
    mf_code_lut_quantize_n(qc->lut[k], s, inv, n, q);
  } else {
    for (int64_t i = 0; i < n; i++)
      q[i] = mf_optim_quantize(qc->code[k], qc->code_size, s[i] * inv, qc->keep_positive[k]);
  }
}

mf_status mf_optim_quantize_fast(const float *code, int size, int keep_positive, const float *x,
                                 int64_t n, uint8_t *out) {
  if (size != MF_CODE_SIZE && size != MF_CODE4_SIZE)
    return mf_error(MF_ERR_VALUE, "size: must be 16 or 256, got %d", size);
  const mf_code_lut *lut = mf_code_lut_get(code, size, keep_positive);
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
  float *p, *g, *s[3];
  if (dt == MF_FLOAT32) {
    p = (float *)t->param.data + first;
    g = (float *)t->grad.data + first;
  } else {
    p = b->p;
    g = b->g;
    load_params(t, first, n, p);
    widen(t->grad.data, dt, first, n, g);
  }
  const mf_tensor *st[3] = {&t->state1, &t->state2, &t->state3};
  const mf_tensor *am[3] = {&t->absmax1, &t->absmax2, &t->absmax3};
  /* the chunk [first, first + n) holds whole quantization blocks (but the last) */
  const int64_t blk0 = fmt == MF_STATE_FP32 ? 0 : first / bs;
  const int64_t nsub = fmt == MF_STATE_FP32 ? 0 : (n + bs - 1) / bs;
  for (int k = 0; k < 3; k++) {
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
  if (h->kind == MF_OPT_ADEMAMIX) {
    update_ademamix(c, n, p, g, s[0], s[1], s[2]);
  } else {
#ifdef MF_X86_SIMD
    if (isa == ISA_AVX2) update_avx2(h->kind, c, ns, n, p, g, s[0], s[1]);
    else
#endif
      update_any(h->kind, c, ns, n, p, g, s[0], s[1]);
  }
  /* (the AVX2 and AVX-512 kernels store after this: block_step_avx2, _avx512) */
  if (dt != MF_FLOAT32 && isa == ISA_GENERIC) store_params(h, t, p, first, n, isa);
  for (int k = 0; k < ns && fmt != MF_STATE_FP32; k++) {
    float *absmax = (float *)am[k]->data + blk0;
    for (int64_t j = 0; j < nsub; j++) {
      const int64_t off = j * bs, len = n - off < bs ? n - off : bs;
      const float *v = s[k] + off;
      const float a = block_absmax(v, len);
      absmax[j] = a;
      const mf_block_scale sc = mf_absmax_scale(a);
      prescale_block(s[k] + off, len, sc.pre);
      uint8_t *dst = fmt == MF_STATE_8BIT ? (uint8_t *)st[k]->data + first + off : b->q;
      quantize_run(v, sc.inv, len, qc, k, dst);
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
  /* the updated parameters are still in b->p; store_params_avx2 cannot be called from
   * block_step_impl, which has no AVX2 target (GCC would not inline it) */
  if (t->param.dtype != MF_FLOAT32) store_params_avx2(h, t, b->p, first, n);
}

MF_TARGET_AVX512 static void block_step_avx512(const mf_optim_hparams *h,
                                               const mf_optim_consts *c, int ns,
                                               mf_state_format fmt, int64_t bs,
                                               const quant_ctx *qc, const mf_optim_tensor *t,
                                               int64_t first, int64_t n, thread_bufs *b) {
  block_step_impl(h, c, ns, fmt, bs, qc, t, first, n, b, ISA_AVX512);
  if (t->param.dtype != MF_FLOAT32) store_params_avx512(h, t, b->p, first, n);
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
 * most of the gain of dynamic sharing when they do not
 * (benchmarks/history/2026-11-21-optim-intel-xeon-4-late-afternoon-work-sharing.md). */
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
  if (!kind_ok || ns < 1 || bs % 64 != 0) return NULL;
  for (int k = 0; k < ns; k++)
    if (!qc->lut[k] || qc->lut[k]->has_slow) return NULL;
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
                                 ? mf_code_lut_get(code, MF_CODE_SIZE, 0) : NULL;
    if (!lut) return "avx2";
    return mf_optim_avx2_search(lut, 8) & SEARCH_FAST ? "avx2-scalar" : "avx2-gather";
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
  if (t->state3.data) v.state3.data = (uint8_t *)t->state3.data + code;
  if (t->absmax1.data) v.absmax1.data = (float *)t->absmax1.data + at.block;
  if (t->absmax2.data) v.absmax2.data = (float *)t->absmax2.data + at.block;
  if (t->absmax3.data) v.absmax3.data = (float *)t->absmax3.data + at.block;
  v.param.numel = v.grad.numel = row_len;
  v.rows = 1;
  v.index_base = t->index_base + at.elem;
  return v;
}

/* What every thread of one step reads: the call's arguments and the work list. */
typedef struct {
  const mf_optim_hparams *h;
  mf_state_format fmt;
  int64_t bs;
  int ns;
  float inv_scale;
  const quant_ctx *qc;
  block_fn block_step;
#ifdef MF_X86_SIMD
  fused_fn fused;
#else
  const void *fused;
#endif
  int64_t chunk;
  const mf_optim_tensor *ts;
  int64_t n;
  const int64_t *start, *split;
  int64_t total_items;
  int grab;
  atomic_int failed;      /* a thread could not allocate its buffers */
  atomic_llong next_item; /* the pool's shared work counter (step_on_pool) */
} step_ctx;

/* A thread's buffers (L1/L2 resident), or 0 when they could not be allocated (then
 * x->failed is set and the thread steps nothing). */
static int bufs_init(step_ctx *x, thread_bufs *b) {
  const int64_t chunk = x->chunk, ns = x->ns, bs = x->bs;
  /* Every region is written before it is read, but for `zero` (the missing second
   * state of one-state kinds, which the update rewrites with its own zeros): zero only
   * that, not the whole ~330 KB a calloc would clear on every call. */
  const int64_t ring = 2 * (ns > 2 ? ns : 2) * bs; /* the fused kernel's (thread_bufs) */
  float *mem = (float *)malloc((size_t)((ns > 2 ? 6 : 5) * chunk + ring) * sizeof(float));
  if (mem) memset(mem + 4 * chunk, 0, (size_t)chunk * sizeof(float));
  uint8_t *qmem = (uint8_t *)malloc((size_t)chunk);
  if (!mem || !qmem) {
    free(mem);
    free(qmem);
    atomic_store(&x->failed, 1);
    memset(b, 0, sizeof *b);
    return 0;
  }
  b->p = mem;
  b->g = mem + chunk;
  b->s[0] = mem + 2 * chunk;
  b->s[1] = mem + 3 * chunk;
  b->zero = mem + 4 * chunk;
  b->ring = mem + 5 * chunk;
  b->s[2] = ns > 2 ? mem + 5 * chunk + ring : NULL;
  b->q = qmem;
  b->fused_ready = 0;
  return 1;
}

static void bufs_free(thread_bufs *b) {
  free(b->p); /* the base of the float buffers */
  free(b->q);
}

/* The constants of the tensor a thread is on (recomputed when its items move on). */
typedef struct {
  int64_t cur; /* the tensor whose constants c holds, or -1 */
  mf_optim_consts c;
} item_consts;

/* Work item w of the step: the one definition of an item's work, whichever threads
 * (OpenMP's or the pool's) run it. Items are independent: any order, same bits. */
static void step_item(const step_ctx *x, thread_bufs *b, item_consts *ic, int64_t w) {
  const mf_optim_hparams *h = x->h;
  const int64_t chunk = x->chunk, bs = x->bs;
  const int64_t i = mf_mt_tensor_of(x->start, x->n, w);
  const mf_optim_tensor *t = &x->ts[i];
  if (i != ic->cur) {
    const float step = *(const float *)t->step.data + 1.0f;
    ic->c = mf_optim_prepare(h, step, x->inv_scale);
    if (h->max_unorm > 0.0) {
      const double *tot = mf_optim_trust_totals(t->trust.data, t->param.numel);
      mf_optim_trust_apply(h, &ic->c, mf_optim_trust_scale(h, step, tot[0], tot[1]));
    }
    ic->cur = i;
  }
  /* item k of a tensor stepped row by row is item k % per_row of row k / per_row */
  int64_t k = w - x->start[i];
  mf_optim_tensor row;
  if (x->split[i] > 1) {
    const int64_t per_row = mf_mt_items(t->param.numel / x->split[i], chunk);
    row = row_view(t, x->fmt, bs, x->split[i], k / per_row);
    t = &row;
    k %= per_row;
  }
  const int64_t numel = t->param.numel, first = k * chunk;
  const int64_t len = numel - first < chunk ? numel - first : chunk;
  /* the whole blocks to the fused kernel, a partial last one to the block kernel */
  const int64_t whole = x->fused ? len - len % bs : 0;
#ifdef MF_X86_SIMD
  if (whole > 0) x->fused(h, &ic->c, x->ns, bs, x->qc, t, first, whole, b);
#endif
  if (whole < len)
    x->block_step(h, &ic->c, x->ns, x->fmt, bs, x->qc, t, first + whole, len - whole, b);
}

/* One thread of the pool's step: takes `grab` items at a time from the shared counter,
 * as OpenMP's schedule(dynamic, grab) does. */
static void step_on_pool(void *ctx, int tid, int nthreads) {
  (void)tid;
  (void)nthreads;
  step_ctx *x = (step_ctx *)ctx;
  thread_bufs b;
  item_consts ic = {.cur = -1};
  if (!bufs_init(x, &b)) return;
  for (;;) {
    const int64_t w0 = (int64_t)atomic_fetch_add(&x->next_item, (long long)x->grab);
    if (w0 >= x->total_items) break;
    const int64_t w1 = w0 + x->grab < x->total_items ? w0 + x->grab : x->total_items;
    for (int64_t w = w0; w < w1; w++) step_item(x, &b, &ic, w);
  }
  bufs_free(&b);
}

mf_status mf_optim_step_cpu(const mf_optim_hparams *h, mf_state_format fmt, int64_t bs,
                            const mf_tensor *code1, const mf_tensor *code2,
                            const mf_optim_tensor *ts, int64_t n, const mf_tensor *grad_scale,
                            const mf_tensor *found_inf) {
  if (found_inf && *(const float *)found_inf->data != 0.0f) return MF_OK; /* skipped step */
  const float inv_scale = grad_scale ? 1.0f / *(const float *)grad_scale->data : 1.0f;
  const int ns = mf_optim_num_states(h);
  quant_ctx qc = {{NULL, NULL, NULL}, {NULL, NULL, NULL}, {0, 0, 0},
                  fmt == MF_STATE_4BIT ? MF_CODE4_SIZE : MF_CODE_SIZE, 0};
  if (fmt != MF_STATE_FP32) {
    const mf_tensor *codes[3] = {code1, code2, code1}; /* state3 is signed: code1 */
    for (int k = 0; k < ns; k++) {
      qc.code[k] = (const float *)codes[k]->data;
      qc.keep_positive[k] = !mf_optim_state_signed(h->kind, k + 1);
      qc.lut[k] = mf_code_lut_get(qc.code[k], qc.code_size, qc.keep_positive[k]);
    }
  }
  if (h->max_unorm > 0.0) { /* pass 1 of the trust ratio (optim_trust.c) */
    const mf_status st = mf_optim_trust_cpu(h, fmt, bs, code1, code2, ts, n, inv_scale);
    if (st) return st;
  }
  const block_fn block_step = pick_block_fn();
#ifdef MF_X86_SIMD
  const fused_fn fused = pick_fused(h, fmt, ns, bs, &qc);
  const int bits = fmt == MF_STATE_8BIT ? 8 : 4;
  if (fused == mf_optim_fused8_avx2 || fused == mf_optim_fused4_avx2)
    qc.search = mf_optim_avx2_search(qc.lut[0], bits);
  else if (fused)
    qc.search = mf_optim_avx512_search(qc.lut[0], bits);
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
    split[i] = mf_optim_split_rows(fmt, bs, ts[i].param.numel, ts[i].rows ? ts[i].rows : 1);
  const int64_t total_items = mf_mt_prefix(&ts[0].param.numel, sizeof *ts, split, n, chunk, start);
  const int grab = chunk >= GRAB_ELEMS ? 1 : (int)(GRAB_ELEMS / chunk);

  step_ctx x = {h, fmt, bs, ns, inv_scale, &qc, block_step, fused, chunk, ts, n, start, split,
                total_items, grab, 0, 0};
  mf_thread_pool *pool = mf_thread_pool_current();
  if (pool) {
    /* The host queue's thread (host_queue.c): its pool's threads wait passively between
     * steps, where OpenMP's would spin against the training thread. */
    if (total_items > 8) mf_thread_pool_run(pool, step_on_pool, &x);
    else step_on_pool(&x, 0, 1);
  } else {
#pragma omp parallel num_threads(mf_get_num_threads()) if (total_items > 8)
    {
      thread_bufs b;
      item_consts ic = {.cur = -1};
      const int ok = bufs_init(&x, &b);
#pragma omp for schedule(dynamic, grab)
      for (int64_t w = 0; w < total_items; w++)
        if (ok) step_item(&x, &b, &ic, w);
      if (ok) bufs_free(&b);
    }
  }
  free(start);
  if (atomic_load(&x.failed)) return mf_error(MF_ERR_NOMEM, "optimizer step: out of host memory");
  for (int64_t i = 0; i < n; i++) *(float *)ts[i].step.data += 1.0f;
  return MF_OK;
}
