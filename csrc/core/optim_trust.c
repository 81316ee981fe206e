/*
 * The trust ratio's norm pass on the CPU (pass 1 of memfit/optim.h's "trust ratio"):
 * per tensor, the sums of u^2 and p^2 in the fixed order the header describes, into
 * the tensor's scratch. mf_optim_step_cpu (optim.c) calls it before the update, which
 * then reads the totals (mf_optim_trust_totals). Compiled with -ffp-contract=off like
 * optim.c: the direction is the update's own arithmetic.
 */
#include <stdlib.h>
#include <string.h>

#include "optim_cpu.h"
#include "optim_vbmi.h"
#include "memfit/multi_tensor.h"

enum { CHUNK = MF_OPTIM_TRUST_CHUNK, LANES = MF_OPTIM_TRUST_LANES };

/* What every chunk of one call shares. */
typedef struct {
  const mf_optim_hparams *h;
  int ns;
  mf_state_format fmt;
  int64_t bs;
  const float *code[2];
  const void *vbmi; /* 8-bit codes as vbmi_code[2] (optim_vbmi.h) for the VBMI variant */
} norm_ctx;

/* out[e] = code[q[e]] * am for a run of n 8-bit codes: the block kernel's dequant8,
 * and with `vbmi` (the VBMI variant) the fused kernel's byte permutes, 64 at a time. */
#ifdef MF_X86_SIMD
MF_TARGET_VBMI static int64_t dequant8_vbmi(const vbmi_code *v, const uint8_t *q, float am,
                                            int64_t n, float *out) {
  const __m512 a = _mm512_set1_ps(am);
  int64_t e = 0;
  for (; e + 64 <= n; e += 64) dequant64_vbmi(v, q + e, a, out + e);
  return e;
}
#endif

MF_INLINE void dequant8_run(const void *vbmi, const uint8_t *restrict q, const float *restrict code,
                            float am, int64_t n, float *restrict out) {
  int64_t e = 0;
#ifdef MF_X86_SIMD
  if (vbmi) e = dequant8_vbmi((const vbmi_code *)vbmi, q, am, n, out);
#else
  (void)vbmi;
#endif
  for (; e < n; e++) out[e] = mf_dequantize_one(code, q[e], am);
}

/* State k's vbmi_code, or NULL. */
static inline const void *vbmi_of(const norm_ctx *x, int k) {
#ifdef MF_X86_SIMD
  if (x->vbmi) return (const vbmi_code *)x->vbmi + k;
#endif
  (void)k;
  return NULL;
}

/* State k's values of elements [first, first + n) (dequantized as the update does):
 * the rows and blocks of the layout (mf_optim_row) walked incrementally, not divided
 * out per element, one block's run (one absmax) at a time. */
MF_INLINE void load_state(const norm_ctx *x, int k, const void *q, const float *absmax,
                          int64_t row_len, int64_t first, int64_t n, float *restrict out) {
  if (x->fmt == MF_STATE_FP32) {
    memcpy(out, (const float *)q + first, (size_t)n * sizeof(float));
    return;
  }
  const uint8_t *b = (const uint8_t *)q;
  const float *code = x->code[k];
  const int64_t bs = x->bs;
  int64_t r = first / row_len, j = first - r * row_len;
  for (int64_t i = 0; i < n;) {
    const mf_optim_row_start at = mf_optim_row(row_len, bs, r);
    const int64_t end = row_len - j < n - i ? row_len : j + (n - i); /* of this row's run */
    while (j < end) {
      const int64_t blk = j / bs, stop = (blk + 1) * bs < end ? (blk + 1) * bs : end;
      const float am = absmax[at.block + blk];
      if (x->fmt == MF_STATE_8BIT) {
        dequant8_run(vbmi_of(x, k), b + at.elem + j, code, am, stop - j, out + i);
      } else {
        for (int64_t e = j; e < stop; e++)
          out[i + e - j] = mf_dequantize_one(code, (uint8_t)((b[at.code4 + (e >> 1)] >> ((e & 1) * 4)) & 15), am);
      }
      i += stop - j;
      j = stop;
    }
    j = 0;
    r++;
  }
}

/* One row of LANES elements (m <= LANES of them) into the lane sums: lu[l] += u^2,
 * lp[l] += p^2 for element l (mf_optim_trust_element). The kind, the number of states
 * and SGD's two flags are constants in each caller (lane_row_any), so the loop has no
 * branch left and vectorises; and the constants are a local copy, which the stores
 * through the restrict pointers cannot change, so nothing is reloaded per element. */
MF_INLINE void lane_row(mf_optim_kind kind, const mf_optim_consts *cp, int ns, int first,
                        int nesterov, int64_t m, const float *restrict p,
                        const float *restrict g, const float *restrict s1,
                        const float *restrict s2, double *restrict lu, double *restrict lp) {
  mf_optim_consts c = *cp;
  c.first = first;
  c.nesterov = nesterov;
  for (int64_t l = 0; l < m; l++) {
    double u2, p2;
    mf_optim_trust_element(kind, &c, ns, p[l], g[l], s1[l], s2[l], &u2, &p2);
    lu[l] = lu[l] + u2;
    lp[l] = lp[l] + p2;
  }
}

/* lane_row for the kinds with a trust ratio (ADAMW, ADAM, SGD), one instance per case. */
MF_INLINE void lane_row_any(mf_optim_kind kind, const mf_optim_consts *c, int ns, int64_t m,
                            const float *restrict p, const float *restrict g,
                            const float *restrict s1, const float *restrict s2,
                            double *restrict lu, double *restrict lp) {
  if (kind == MF_OPT_ADAMW) lane_row(MF_OPT_ADAMW, c, 2, 0, 0, m, p, g, s1, s2, lu, lp);
  else if (kind == MF_OPT_ADAM) lane_row(MF_OPT_ADAM, c, 2, 0, 0, m, p, g, s1, s2, lu, lp);
  else if (ns == 0) lane_row(MF_OPT_SGD, c, 0, 0, 0, m, p, g, s1, s2, lu, lp);
  else if (c->first) /* (momentum's first step: the buffer is the gradient) */
    lane_row(MF_OPT_SGD, c, 1, 1, c->nesterov != 0, m, p, g, s1, s2, lu, lp);
  else if (c->nesterov) lane_row(MF_OPT_SGD, c, 1, 0, 1, m, p, g, s1, s2, lu, lp);
  else lane_row(MF_OPT_SGD, c, 1, 0, 0, m, p, g, s1, s2, lu, lp);
}

/* The sums of chunk `k` of tensor t into its scratch: lane l adds the squares of the
 * chunk's elements l, l + LANES, ... in turn (the order of memfit/optim.h, which the
 * CUDA kernel follows thread by thread), a row of LANES elements at a time: its
 * parameters, gradients and states (float32 ones read in place, the others widened or
 * dequantized into L1-sized buffers), then lane_row. Compiled once per instruction set
 * (the variants below). */
MF_INLINE void trust_chunk_impl(const norm_ctx *x, const mf_optim_consts *c,
                                const mf_optim_tensor *t, int64_t k) {
  float pb[LANES], gb[LANES], s1[LANES], s2[LANES];
  double lu[LANES] = {0}, lp[LANES] = {0};
  const int ns = x->ns;
  const mf_dtype dt = t->param.dtype;
  const int64_t numel = t->param.numel, rows = t->rows ? t->rows : 1, row_len = numel / rows;
  const int64_t first = k * CHUNK, n = numel - first < CHUNK ? numel - first : CHUNK;
  if (ns < 1) memset(s1, 0, sizeof s1);
  if (ns < 2) memset(s2, 0, sizeof s2);
  for (int64_t base = 0; base < n; base += LANES) {
    const int64_t at = first + base, m = n - base < LANES ? n - base : LANES;
    const float *p = pb, *g = gb;
    if (dt == MF_FLOAT32) { /* (no comp: float32 parameters take none) */
      p = (const float *)t->param.data + at;
      g = (const float *)t->grad.data + at;
    } else {
      load_params(t, at, m, pb);
      widen(t->grad.data, dt, at, m, gb);
    }
    if (ns >= 1) load_state(x, 0, t->state1.data, (const float *)t->absmax1.data, row_len, at, m, s1);
    if (ns >= 2) load_state(x, 1, t->state2.data, (const float *)t->absmax2.data, row_len, at, m, s2);
    lane_row_any(x->h->kind, c, ns, m, p, g, s1, s2, lu, lp);
  }
  double *ws = (double *)t->trust.data;
  ws[2 * k] = mf_optim_trust_tree(lu);
  ws[2 * k + 1] = mf_optim_trust_tree(lp);
}

typedef void (*chunk_fn)(const norm_ctx *, const mf_optim_consts *, const mf_optim_tensor *, int64_t);

static void trust_chunk_generic(const norm_ctx *x, const mf_optim_consts *c,
                                const mf_optim_tensor *t, int64_t k) {
  trust_chunk_impl(x, c, t, k);
}

#ifdef MF_X86_SIMD
MF_TARGET_AVX2 static void trust_chunk_avx2(const norm_ctx *x, const mf_optim_consts *c,
                                            const mf_optim_tensor *t, int64_t k) {
  trust_chunk_impl(x, c, t, k);
}

MF_TARGET_AVX512 static void trust_chunk_avx512(const norm_ctx *x, const mf_optim_consts *c,
                                                const mf_optim_tensor *t, int64_t k) {
  trust_chunk_impl(x, c, t, k);
}

/* (x->vbmi set: 8-bit states; otherwise as trust_chunk_avx512) */
MF_TARGET_VBMI static void trust_chunk_vbmi(const norm_ctx *x, const mf_optim_consts *c,
                                            const mf_optim_tensor *t, int64_t k) {
  trust_chunk_impl(x, c, t, k);
}
#endif

static chunk_fn pick_chunk_fn(void) {
#ifdef MF_X86_SIMD
  if (mf_cpu_has_vbmi()) return trust_chunk_vbmi;
  switch (mf_cpu_isa()) {
    case ISA_AVX512: return trust_chunk_avx512;
    case ISA_AVX2: return trust_chunk_avx2;
  }
#endif
  return trust_chunk_generic;
}

/* The totals of tensor t from its chunk sums. */
static void trust_finish(const mf_optim_tensor *t) {
  const int64_t chunks = mf_optim_trust_chunks(t->param.numel);
  double *ws = (double *)t->trust.data;
  double lu[MF_OPTIM_TRUST_LANES], lp[MF_OPTIM_TRUST_LANES];
  for (int l = 0; l < MF_OPTIM_TRUST_LANES; l++) {
    double su = 0.0, sp = 0.0;
    for (int64_t k = l; k < chunks; k += MF_OPTIM_TRUST_LANES) {
      su = su + ws[2 * k];
      sp = sp + ws[2 * k + 1];
    }
    lu[l] = su;
    lp[l] = sp;
  }
  ws[2 * chunks] = mf_optim_trust_tree(lu);
  ws[2 * chunks + 1] = mf_optim_trust_tree(lp);
}

mf_status mf_optim_trust_cpu(const mf_optim_hparams *h, mf_state_format fmt, int64_t bs,
                             const mf_tensor *code1, const mf_tensor *code2,
                             const mf_optim_tensor *ts, int64_t n, float inv_scale) {
  norm_ctx x = {h, mf_optim_num_states(h), fmt, bs, {NULL, NULL}, NULL};
  if (fmt != MF_STATE_FP32) {
    if (x.ns >= 1) x.code[0] = (const float *)code1->data;
    if (x.ns >= 2) x.code[1] = (const float *)code2->data;
  }
  const chunk_fn trust_chunk = pick_chunk_fn();
#ifdef MF_X86_SIMD
  vbmi_code tables[2]; /* read-only, shared by the threads */
  if (trust_chunk == trust_chunk_vbmi && fmt == MF_STATE_8BIT) {
    for (int k = 0; k < x.ns && k < 2; k++) vbmi_code_init(&tables[k], x.code[k]);
    x.vbmi = tables;
  }
#endif
  int64_t *start = (int64_t *)malloc((size_t)(n + 1) * sizeof *start);
  if (!start) return mf_error(MF_ERR_NOMEM, "optimizer step: out of host memory");
  const int64_t total = mf_mt_prefix(&ts[0].param.numel, sizeof *ts, NULL, n, MF_OPTIM_TRUST_CHUNK,
                                     start);
#pragma omp parallel for schedule(dynamic, 4) num_threads(mf_get_num_threads()) if (total > 8)
  for (int64_t w = 0; w < total; w++) {
    const int64_t i = mf_mt_tensor_of(start, n, w);
    const mf_optim_consts c = mf_optim_prepare(h, *(const float *)ts[i].step.data + 1.0f, inv_scale);
    trust_chunk(&x, &c, &ts[i], w - start[i]);
  }
  for (int64_t i = 0; i < n; i++)
    if (ts[i].param.numel > 0) trust_finish(&ts[i]);
  free(start);
  return MF_OK;
}
