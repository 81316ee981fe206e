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
#include "memfit/multi_tensor.h"

/* State k's values of elements [first, first + n) (dequantized as the update does):
 * the rows and blocks of the layout (mf_optim_row) walked incrementally, not divided
 * out per element. */
static void load_state(mf_state_format fmt, const void *q, const float *absmax, const float *code,
                       int64_t bs, int64_t row_len, int64_t first, int64_t n, float *out) {
  if (fmt == MF_STATE_FP32) {
    memcpy(out, (const float *)q + first, (size_t)n * sizeof(float));
    return;
  }
  const int sh = __builtin_ctzll((unsigned long long)bs); /* block sizes are powers of 2 */
  const uint8_t *b = (const uint8_t *)q;
  int64_t r = first / row_len, j = first - r * row_len;
  for (int64_t i = 0; i < n;) {
    const mf_optim_row_start at = mf_optim_row(row_len, bs, r);
    const int64_t run = row_len - j < n - i ? row_len - j : n - i;
    const float *am = absmax + at.block;
    if (fmt == MF_STATE_8BIT) {
      for (int64_t e = 0; e < run; e++, j++)
        out[i + e] = mf_dequantize_one(code, b[at.elem + j], am[j >> sh]);
    } else {
      for (int64_t e = 0; e < run; e++, j++)
        out[i + e] = mf_dequantize_one(code, (uint8_t)((b[at.code4 + (j >> 1)] >> ((j & 1) * 4)) & 15),
                                       am[j >> sh]);
    }
    i += run;
    j = 0;
    r++;
  }
}

/* The update directions of n elements (mf_optim_update_dir, the kind a constant in each
 * branch so the loop vectorises). */
static void directions(mf_optim_kind kind, const mf_optim_consts *c, int ns, int64_t n,
                       const float *p, const float *g, float *s1, float *s2, float *dir) {
#define DIR_LOOP(K)                                                                   \
  for (int64_t i = 0; i < n; i++) {                                                  \
    float x = p[i];                                                                  \
    mf_optim_update_dir(K, c, ns, &x, g[i], &s1[i], &s2[i], &dir[i]);                \
  }
  switch (kind) {
    case MF_OPT_ADAMW: DIR_LOOP(MF_OPT_ADAMW) break;
    case MF_OPT_ADAM: DIR_LOOP(MF_OPT_ADAM) break;
    default: DIR_LOOP(MF_OPT_SGD) break; /* the only other kind with max_unorm > 0 */
  }
#undef DIR_LOOP
}

/* The sums of chunk `k` of tensor t into its scratch: lane l adds the squares of the
 * chunk's elements l, l + LANES, ... in turn (the order of memfit/optim.h, which the
 * CUDA kernel follows thread by thread), computed a row of LANES elements at a time. */
static void trust_chunk(const mf_optim_hparams *h, const mf_optim_consts *c, int ns,
                        mf_state_format fmt, int64_t bs, const float *code1,
                        const float *code2, const mf_optim_tensor *t, int64_t k) {
  enum { N = MF_OPTIM_TRUST_CHUNK, L = MF_OPTIM_TRUST_LANES };
  float p[N], g[N], s1[N], s2[N], dir[N];
  const mf_dtype dt = t->param.dtype;
  const int64_t numel = t->param.numel, rows = t->rows ? t->rows : 1, row_len = numel / rows;
  const int64_t first = k * N, n = numel - first < N ? numel - first : N;
  if (dt == MF_FLOAT32) { /* (no comp: float32 parameters take none) */
    memcpy(p, (const float *)t->param.data + first, (size_t)n * sizeof(float));
    memcpy(g, (const float *)t->grad.data + first, (size_t)n * sizeof(float));
  } else {
    for (int64_t i = 0; i < n; i++) {
      p[i] = mf_optim_load_param(t->param.data, t->comp.data, first + i, dt);
      g[i] = mf_load_f32(t->grad.data, first + i, dt);
    }
  }
  if (ns >= 1)
    load_state(fmt, t->state1.data, (const float *)t->absmax1.data, code1, bs, row_len, first, n, s1);
  else
    memset(s1, 0, (size_t)n * sizeof(float));
  if (ns >= 2)
    load_state(fmt, t->state2.data, (const float *)t->absmax2.data, code2, bs, row_len, first, n, s2);
  else
    memset(s2, 0, (size_t)n * sizeof(float));
  directions(h->kind, c, ns, n, p, g, s1, s2, dir);
  double lu[L] = {0}, lp[L] = {0};
  for (int64_t base = 0; base < n; base += L) {
    const int64_t m = n - base < L ? n - base : L;
    for (int64_t l = 0; l < m; l++) {
      lu[l] = lu[l] + (double)dir[base + l] * (double)dir[base + l];
      lp[l] = lp[l] + (double)p[base + l] * (double)p[base + l];
    }
  }
  double *ws = (double *)t->trust.data;
  ws[2 * k] = mf_optim_trust_tree(lu);
  ws[2 * k + 1] = mf_optim_trust_tree(lp);
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
  const int ns = mf_optim_num_states(h);
  const float *c1 = code1 && ns >= 1 && fmt != MF_STATE_FP32 ? (const float *)code1->data : NULL;
  const float *c2 = code2 && ns >= 2 && fmt != MF_STATE_FP32 ? (const float *)code2->data : NULL;
  int64_t *start = (int64_t *)malloc((size_t)(n + 1) * sizeof *start);
  if (!start) return mf_error(MF_ERR_NOMEM, "optimizer step: out of host memory");
  const int64_t total = mf_mt_prefix(&ts[0].param.numel, sizeof *ts, NULL, n, MF_OPTIM_TRUST_CHUNK,
                                     start);
#pragma omp parallel for schedule(dynamic, 4) num_threads(mf_get_num_threads()) if (total > 8)
  for (int64_t w = 0; w < total; w++) {
    const int64_t i = mf_mt_tensor_of(start, n, w);
    const mf_optim_consts c = mf_optim_prepare(h, *(const float *)ts[i].step.data + 1.0f, inv_scale);
    trust_chunk(h, &c, ns, fmt, bs, c1, c2, &ts[i], w - start[i]);
  }
  for (int64_t i = 0; i < n; i++)
    if (ts[i].param.numel > 0) trust_finish(&ts[i]);
  free(start);
  return MF_OK;
}
