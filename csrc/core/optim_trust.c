/*
 * The trust ratio's norm pass on the CPU (pass 1 of memfit/optim.h's "trust ratio"):
 * per tensor, the sums of u^2 and p^2 in the fixed order the header describes, into
 * the tensor's scratch. mf_optim_step_cpu (optim.c) calls it before the update, which
 * then reads the totals (mf_optim_trust_totals). Compiled with -ffp-contract=off like
 * optim.c: the direction is the update's own arithmetic.
 */
#include <stdlib.h>

#include "optim_cpu.h"
#include "memfit/multi_tensor.h"

/* The sums of chunk `k` of tensor t into its scratch. */
static void trust_chunk(const mf_optim_hparams *h, const mf_optim_consts *c, int ns,
                        mf_state_format fmt, int64_t bs, const float *code1,
                        const float *code2, const mf_optim_tensor *t, int64_t k) {
  const mf_dtype dt = t->param.dtype;
  const int64_t n = t->param.numel, rows = t->rows ? t->rows : 1, row_len = n / rows;
  const int64_t first = k * MF_OPTIM_TRUST_CHUNK;
  const int64_t last = first + MF_OPTIM_TRUST_CHUNK < n ? first + MF_OPTIM_TRUST_CHUNK : n;
  double lu[MF_OPTIM_TRUST_LANES], lp[MF_OPTIM_TRUST_LANES];
  for (int l = 0; l < MF_OPTIM_TRUST_LANES; l++) {
    double su = 0.0, sp = 0.0;
    for (int64_t i = first + l; i < last; i += MF_OPTIM_TRUST_LANES) {
      const float s1 = ns >= 1 ? mf_optim_state_at(fmt, t->state1.data, (const float *)t->absmax1.data,
                                                   code1, bs, row_len, i) : 0.0f;
      const float s2 = ns >= 2 ? mf_optim_state_at(fmt, t->state2.data, (const float *)t->absmax2.data,
                                                   code2, bs, row_len, i) : 0.0f;
      double u2, p2;
      mf_optim_trust_element(h->kind, c, ns, mf_optim_load_param(t->param.data, t->comp.data, i, dt),
                             mf_load_f32(t->grad.data, i, dt), s1, s2, &u2, &p2);
      su = su + u2;
      sp = sp + p2;
    }
    lu[l] = su;
    lp[l] = sp;
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
