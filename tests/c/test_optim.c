/* C tests of the optimizer core: the CPU's table-driven code search must return exactly
 * what mf_optim_quantize (the binary search the CUDA kernels use) returns, for every
 * code the optimizers use and both rules (nearest; keep_positive, where a positive
 * value never takes a code value <= 0); the element update must skip non-finite values (Adam's
 * shortcut test against the contract, on every combination of special values); and the
 * Kahan-compensated store of half-precision parameters. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memfit/optim.h"

#include "check.h"

#define BATCH 4096

static void compare_rule(const float *code, int size, int keep, const float *x, int64_t n,
                         const char *what) {
  uint8_t fast[BATCH];
  for (int64_t off = 0; off < n; off += BATCH) {
    int64_t m = n - off < BATCH ? n - off : BATCH;
    mf_status st = mf_optim_quantize_fast(code, size, keep, x + off, m, fast);
    CHECK(st == MF_OK, "%s: %s", what, mf_last_error());
    for (int64_t i = 0; i < m; i++) {
      const float v = x[off + i];
      uint8_t want = mf_optim_quantize(code, size, v, keep);
      /* the rule itself: keep_positive differs from nearest only where nearest gives a
       * positive value a code value <= 0, and then gives the smallest positive one */
      const uint8_t near = mf_quantize_nearest_n(code, size, v);
      const int moved = keep && v > 0.0f && !(code[near] > 0.0f) && code[size - 1] > 0.0f;
      CHECK(moved ? (code[want] > 0.0f && (want == 0 || !(code[want - 1] > 0.0f))) : want == near,
            "%s (keep_positive %d): x=%.9g: rule gives %d, nearest %d", what, keep, (double)v, want, near);
      if (fast[i] != want) {
        uint32_t u;
        memcpy(&u, &x[off + i], 4);
        CHECK(0, "%s (keep_positive %d): x=%.9g (0x%08x): table %d, search %d", what, keep,
              (double)v, u, fast[i], want);
        return;
      }
    }
  }
}

static void compare(const float *code, int size, const float *x, int64_t n, const char *what) {
  compare_rule(code, size, 0, x, n, what);
  compare_rule(code, size, 1, x, n, what);
}

static float xs[BATCH];

static void test_code(const float *code, int size, const char *what) {
  /* 1. a stride through all 2^32 bit patterns (every sign, exponent, NaN, Inf) */
  int64_t k = 0;
  for (uint64_t u = 0; u < (1ull << 32); u += 509) {
    uint32_t b = (uint32_t)u;
    memcpy(&xs[k++], &b, 4);
    if (k == BATCH) { compare(code, size, xs, k, what); k = 0; }
  }
  if (k) compare(code, size, xs, k, what);
  /* 2. every float within 300 ulps of each code value and of each midpoint */
  for (int i = 0; i < size; i++) {
    float centers[2] = {code[i], i + 1 < size ? 0.5f * (code[i] + code[i + 1]) : code[i]};
    for (int c = 0; c < 2; c++) {
      k = 0;
      float lo = centers[c], hi = centers[c];
      for (int j = 0; j < 300; j++) {
        lo = nextafterf(lo, -INFINITY);
        hi = nextafterf(hi, INFINITY);
        xs[k++] = lo;
        xs[k++] = hi;
      }
      xs[k++] = centers[c];
      compare(code, size, xs, k, what);
    }
  }
  /* 3. specials, and the smallest positive values (keep_positive's step at 0+) */
  float sp[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 1e-45f, -1e-45f, 1.0f, -1.0f,
                1.0000001f, -1.0000001f, 3e38f, -3e38f, 2.8e-45f, 1.1754942e-38f, 1.1754944e-38f,
                1e-30f, 1e-10f, 1e-7f};
  compare(code, size, sp, (int64_t)(sizeof sp / sizeof sp[0]), what);
}

static void test_skip_nonfinite(void) {
  mf_optim_hparams h = {.kind = MF_OPT_ADAMW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                        .weight_decay = 1e-2};
  mf_optim_consts c = mf_optim_prepare(&h, 3.0f, 1.0f);
  float p = 0.5f, s1 = 0.1f, s2 = 0.01f;
  int ok = mf_optim_update_one(MF_OPT_ADAMW, &c, 2, &p, NAN, &s1, &s2);
  CHECK(!ok && p == 0.5f && s1 == 0.1f && s2 == 0.01f, "NaN gradient must leave the element");
  ok = mf_optim_update_one(MF_OPT_ADAMW, &c, 2, &p, 1e30f, &s1, &s2); /* g*g overflows */
  CHECK(!ok && p == 0.5f && s2 == 0.01f, "overflowing state must leave the element");
  ok = mf_optim_update_one(MF_OPT_ADAMW, &c, 2, &p, 0.01f, &s1, &s2);
  CHECK(ok && p != 0.5f, "a finite gradient updates");
  /* bias corrections: exact binary powers agree with pow() to double rounding */
  CHECK(fabs(mf_powi(0.999, 1000) - pow(0.999, 1000)) < 1e-13, "mf_powi");
}

/* The tensor of one CPU step: parameter and gradient (dtype dt) and two states
 * (state_dt), n elements each, with its step counter; the rest unset. */

static mf_optim_tensor step_tensor(void *param, void *grad, mf_dtype dt, void *s1, void *s2,
                                   mf_dtype state_dt, int64_t n, float *step) {
  mf_optim_tensor t;
  memset(&t, 0, sizeof t);
  t.param = mf_cpu_tensor(param, n, dt);
  t.grad = mf_cpu_tensor(grad, n, dt);
  t.state1 = mf_cpu_tensor(s1, n, state_dt);
  t.state2 = mf_cpu_tensor(s2, n, state_dt);
  t.step = mf_cpu_tensor(step, 1, MF_FLOAT32);
  return t;
}

/* Adam/AdamW decide whether to skip an element from pn and bn alone
 * (mf_both_finite_f32); the contract is the four-value test (g, pn, an, bn finite).
 * Every combination of special and extreme values of g, p, the two states, the step
 * and the hyperparameters (lr 0, eps 0, beta1 0 or 0.9, beta2 0 or 0.999, a decay factor
 * below zero, 1/grad_scale infinite, maximize) must give the same decision, and the
 * same bits, as the contract computed here the long way: by mf_optim_update_one, and by
 * a whole CPU step over all the combinations side by side (the step kernel of the ISA
 * variant this test runs as: the AVX2 one tests and skips 8 elements at a time). */
static const float skip_vals[] = {0.0f, -0.0f, 1e-3f, -2.5f, 1e-40f, 1.8e19f, -2e19f, 3e38f, -3.4e38f,
                                  INFINITY, -INFINITY, NAN};
#define NV ((int)(sizeof skip_vals / sizeof skip_vals[0]))
#define NCOMB (NV * NV * NV * NV)

/* the contract, the long way: the new values if the element is updated, else the old */
static int adam_contract(int kind, const mf_optim_consts *c, float g0, float p0, float a,
                         float b, float *p, float *s1, float *s2) {
  float g = g0 * c->gmul;
  if (kind == MF_OPT_ADAM) g = g + c->wd * p0;
  const float an = c->b1 * a + c->omb1 * g, bn = c->b2 * b + c->omb2 * (g * g);
  const float pn = p0 * c->decay - c->step_size * (an / (sqrtf(bn) * c->inv_sqrt_bc2 + c->eps));
  const int want = isfinite(g) && isfinite(pn) && isfinite(an) && isfinite(bn);
  *p = want ? pn : p0, *s1 = want ? an : a, *s2 = want ? bn : b;
  return want;
}

static int same_bits3(float x, float y, float z, float wx, float wy, float wz) {
  return mf_f32_bits(x) == mf_f32_bits(wx) && mf_f32_bits(y) == mf_f32_bits(wy) &&
         mf_f32_bits(z) == mf_f32_bits(wz);
}

static void test_adam_skip_test_is_the_contract(void) {
  const struct { double lr, b1, b2, eps, wd, grad_scale, t; int maximize; } hs[] = {
      {1e-3, 0.9, 0.999, 1e-8, 1e-2, 1.0, 1, 0}, {1e-3, 0.9, 0.999, 1e-8, 1e-2, 1.0, 1000, 1},
      {0.0, 0.9, 0.999, 1e-8, 0.0, 1.0, 3, 0},   {1e-3, 0.0, 0.0, 0.0, 0.0, 1.0, 2, 0},
      {10.0, 0.5, 0.9, 1e-8, 5.0, 1.0, 2, 0},    {1e-3, 0.9, 0.999, 1e-8, 1e-2, 0.0, 5, 0},
      {1e30, 0.9, 0.999, 0.0, 0.0, 1e20, 1, 1}};
  /* the step's arrays: every combination, then 5 ordinary elements (a partial vector) */
  const int n = NCOMB + 5;
  float *buf = malloc(4 * (size_t)n * sizeof(float));
  CHECK(buf != NULL, "memory");
  if (!buf) return;
  float *sp = buf, *sg = buf + n, *s1v = buf + 2 * n, *s2v = buf + 3 * n;
  long checked = 0, bad = 0, bad_step = 0;
  for (int kind = MF_OPT_ADAMW; kind <= MF_OPT_ADAM; kind++) {
    for (size_t hi = 0; hi < sizeof hs / sizeof hs[0]; hi++) {
      mf_optim_hparams h = {.kind = (mf_optim_kind)kind, .lr = hs[hi].lr, .beta1 = hs[hi].b1,
                            .beta2 = hs[hi].b2, .eps = hs[hi].eps, .weight_decay = hs[hi].wd,
                            .maximize = hs[hi].maximize};
      float gs = (float)hs[hi].grad_scale, step = (float)hs[hi].t - 1.0f;
      /* 1/grad_scale as the CPU step computes it (infinite for a scale of 0) */
      const mf_optim_consts c = mf_optim_prepare(&h, (float)hs[hi].t, 1.0f / gs);
      for (int i = 0; i < n; i++) {
        const int in = i < NCOMB;
        sg[i] = in ? skip_vals[i % NV] : 1e-3f, sp[i] = in ? skip_vals[i / NV % NV] : 1.0f;
        s1v[i] = in ? skip_vals[i / (NV * NV) % NV] : 0.0f, s2v[i] = in ? skip_vals[i / (NV * NV * NV)] : 0.0f;
      }
      for (int i = 0; i < NCOMB; i++) {
        float wp, w1, w2, p = sp[i], s1 = s1v[i], s2 = s2v[i];
        const int want = adam_contract(kind, &c, sg[i], sp[i], s1v[i], s2v[i], &wp, &w1, &w2);
        const int ok = mf_optim_update_one((mf_optim_kind)kind, &c, 2, &p, sg[i], &s1, &s2);
        checked++;
        if (ok != want || !same_bits3(p, s1, s2, wp, w1, w2)) {
          if (bad++ < 5)
            CHECK(0, "kind %d hparams %zu: g=%g p=%g a=%g b=%g: ok %d, contract %d", kind, hi,
                  (double)sg[i], (double)sp[i], (double)s1v[i], (double)s2v[i], ok, want);
        }
      }
      /* the same through a CPU step (its copies: the contract needs the inputs) */
      float *p_in = malloc(4 * (size_t)n * sizeof(float));
      CHECK(p_in != NULL, "memory");
      if (!p_in) break;
      memcpy(p_in, buf, 4 * (size_t)n * sizeof(float));
      mf_optim_tensor t = step_tensor(sp, sg, MF_FLOAT32, s1v, s2v, MF_FLOAT32, n, &step);
      mf_tensor scale = mf_cpu_tensor(&gs, 1, MF_FLOAT32);
      CHECK(mf_optim_step(&h, MF_STATE_FP32, 0, NULL, NULL, &t, 1, &scale, NULL, NULL) == MF_OK,
            "%s", mf_last_error());
      for (int i = 0; i < n; i++) {
        float wp, w1, w2;
        adam_contract(kind, &c, p_in[n + i], p_in[i], p_in[2 * n + i], p_in[3 * n + i], &wp, &w1, &w2);
        if (!same_bits3(sp[i], s1v[i], s2v[i], wp, w1, w2) && bad_step++ < 5)
          CHECK(0, "step, kind %d hparams %zu, element %d: g=%g p=%g a=%g b=%g", kind, hi, i,
                (double)p_in[n + i], (double)p_in[i], (double)p_in[2 * n + i], (double)p_in[3 * n + i]);
      }
      free(p_in);
    }
  }
  free(buf);
  CHECK(bad == 0, "%ld of %ld combinations differ from the contract", bad, checked);
  CHECK(bad_step == 0, "%ld elements of the CPU steps differ from the contract", bad_step);
  CHECK(checked == 2L * 7 * NCOMB, "all combinations ran");
}

/* Kahan split (optim.h): x = float(hi) + float(lo) is within the precision of two
 * half-precision numbers of v, and splitting x again keeps its value (a skipped element
 * stores x again). Over a stride through all finite float32 bit patterns. */
static void test_kahan_split(void) {
  const mf_dtype dts[2] = {MF_BFLOAT16, MF_FLOAT16};
  for (int d = 0; d < 2; d++) {
    const mf_dtype dt = dts[d];
    for (uint64_t u = 0; u < (1ull << 32); u += 4093) {
      uint32_t b = (uint32_t)u;
      float v;
      memcpy(&v, &b, 4);
      if (!isfinite(v)) continue;
      uint16_t hi, lo, hi2, lo2;
      mf_optim_kahan_split(v, dt, &hi, &lo);
      if (!isfinite(mf_load_f32(&hi, 0, dt))) { /* overflow, as with nearest rounding */
        CHECK(lo == 0, "overflow: comp must be 0");
        continue;
      }
      const float x = mf_optim_load_param(&hi, &lo, 0, dt);
      mf_optim_kahan_split(x, dt, &hi2, &lo2);
      const float x2 = mf_optim_load_param(&hi2, &lo2, 0, dt);
      const double tol = dt == MF_BFLOAT16 ? ldexp(fabs((double)v), -16) + ldexp(1.0, -133)
                                           : ldexp(fabs((double)v), -21) + ldexp(1.0, -25);
      const int ok = hi == (dt == MF_BFLOAT16 ? mf_f32_to_bf16(v) : mf_f32_to_f16(v)) &&
                     fabs((double)x - (double)v) <= tol && x2 == x;
      if (!ok) {
        CHECK(0, "kahan split (%s): v=%.9g hi+lo=%.9g split again=%.9g", mf_dtype_name(dt),
              (double)v, (double)x, (double)x2);
        break;
      }
    }
  }
  /* non-finite residuals give comp = 0: float16 overflow, NaN */
  uint16_t hi, lo;
  mf_optim_kahan_split(70000.0f, MF_FLOAT16, &hi, &lo);
  CHECK(hi == 0x7c00u && lo == 0, "float16 overflow: p = inf, comp = 0");
  mf_optim_kahan_split(NAN, MF_BFLOAT16, &hi, &lo);
  CHECK(isnan(mf_bf16_to_f32(hi)) && lo == 0, "NaN: comp = 0");
}

/* The argument checks of a compensation buffer, and one small CPU step with it. */
static void test_kahan_step(void) {
  enum { N = 300 };
  uint16_t p[N], g[N], c[N], c32[N];
  float p32[N], s1[N], s2[N], step = 0.0f;
  for (int i = 0; i < N; i++) {
    p[i] = mf_f32_to_bf16(1.0f);
    g[i] = mf_f32_to_bf16(-1.0f);
    c[i] = 0;
    c32[i] = 0;
    p32[i] = 1.0f;
    s1[i] = s2[i] = 0.0f;
  }
  mf_optim_hparams h = {.kind = MF_OPT_ADAMW, .lr = 1e-4, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
  mf_optim_tensor t = step_tensor(p, g, MF_BFLOAT16, s1, s2, MF_FLOAT32, N, &step);
  t.comp = mf_cpu_tensor(c, N, MF_BFLOAT16);
  for (int k = 0; k < 10; k++)
    CHECK(mf_optim_step(&h, MF_STATE_FP32, 0, NULL, NULL, &t, 1, NULL, NULL, NULL) == MF_OK, "%s",
          mf_last_error());
  /* ten Adam steps of about lr = 1e-4 each: below half a bfloat16 step at 1.0 (2^-8),
   * so p stays 1.0 and the compensation holds the sum */
  CHECK(mf_bf16_to_f32(p[7]) == 1.0f, "p moved: %g", (double)mf_bf16_to_f32(p[7]));
  float x = mf_optim_load_param(p, c, 7, MF_BFLOAT16);
  CHECK(fabsf(x - 1.001f) < 5e-5f, "p + comp = %.7f, want about 1.001", (double)x);

  h.stochastic_round = 1;
  h.sr_seed = 5;
  CHECK(mf_optim_step(&h, MF_STATE_FP32, 0, NULL, NULL, &t, 1, NULL, NULL, NULL) == MF_ERR_VALUE &&
            strstr(mf_last_error(), "stochastic rounding"),
        "comp with stochastic rounding must be refused");
  h.stochastic_round = 0;
  t.comp.dtype = MF_FLOAT16;
  CHECK(mf_optim_step(&h, MF_STATE_FP32, 0, NULL, NULL, &t, 1, NULL, NULL, NULL) == MF_ERR_TYPE,
        "comp of another dtype must be refused");
  t.param = mf_cpu_tensor(p32, N, MF_FLOAT32);
  t.grad = mf_cpu_tensor(s1, N, MF_FLOAT32);
  t.comp = mf_cpu_tensor(c32, N, MF_FLOAT32);
  CHECK(mf_optim_step(&h, MF_STATE_FP32, 0, NULL, NULL, &t, 1, NULL, NULL, NULL) == MF_ERR_VALUE &&
            strstr(mf_last_error(), "comps[0]"),
        "comp for float32 params must be refused");
}

/* A CPU-only build refuses CUDA arrays once the arguments check out: MF_ERR_NO_CUDA,
 * naming the entry point and how to get a CUDA build, with nothing dereferenced (the
 * pointers are not host memory: a read would crash the test). */
static void test_cuda_arrays_without_cuda(void) {
#ifndef MEMFIT_WITH_CUDA
  mf_optim_hparams h = {.kind = MF_OPT_ADAMW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
  mf_optim_tensor t = step_tensor((void *)0x100, (void *)0x200, MF_FLOAT32, (void *)0x300,
                                  (void *)0x400, MF_FLOAT32, 8, (float *)0x500);
  mf_tensor *arrays[] = {&t.param, &t.grad, &t.state1, &t.state2, &t.step};
  for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) arrays[i]->device = MF_CUDA;
  CHECK(mf_optim_step(&h, MF_STATE_FP32, 0, NULL, NULL, &t, 1, NULL, NULL, NULL) == MF_ERR_NO_CUDA,
        "CUDA arrays in a CPU-only build: %s", mf_last_error());
  CHECK(strstr(mf_last_error(), "optimizer step:") && strstr(mf_last_error(), "MEMFIT_CUDA=ON"),
        "the message names the step and the rebuild: %s", mf_last_error());
#endif
}

/* An 8-bit AdamW step must be the scalar reference's, bit for bit (dequantize,
 * mf_optim_update_one, absmax, binary search per block): with the shipped codes (the
 * fused kernel of this CPU, with the code search MEMFIT_OPTIM_KERNEL picks), and with a
 * first-moment code whose entries are closer than a table bucket (the search's slow
 * buckets; the fused kernels do not take such codes, the block kernel does). */
static void test_step_matches_reference(const float *dense, const float *u8, const char *what) {
  enum { N = 1024, BS = 256, NB = N / BS };
  static float p[N], g[N], ref_p[N];
  static uint8_t q1[N], q2[N], ref_q1[N], ref_q2[N];
  float a1[NB], a2[NB], ref_a1[NB], ref_a2[NB], step = 0.0f;
  uint32_t r = 12345u;
  for (int i = 0; i < N; i++) {
    r = r * 1664525u + 1013904223u;
    p[i] = ref_p[i] = (float)(r >> 8) / 16777216.0f - 0.5f;
    g[i] = ((float)((r >> 4) & 0xfff) / 4096.0f - 0.5f) * 0.01f;
    q1[i] = ref_q1[i] = (uint8_t)(r >> 16);
    q2[i] = ref_q2[i] = (uint8_t)(r >> 24);
  }
  for (int b = 0; b < NB; b++) {
    a1[b] = ref_a1[b] = 0.003f * (float)(b + 1);
    a2[b] = ref_a2[b] = 1e-5f * (float)(b + 1);
  }
  /* block 1: tiny gradients and subnormal states, so both new states have absmax below
   * 2^-64 (mf_absmax_scale's two-factor path; 1/absmax overflows for v) */
  for (int i = BS; i < 2 * BS; i++) g[i] *= 1e-20f;
  a1[1] = ref_a1[1] = 3e-41f;
  a2[1] = ref_a2[1] = 1e-42f;
  mf_optim_hparams h = {.kind = MF_OPT_ADAMW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999,
                        .eps = 1e-8, .weight_decay = 0.01};
  const mf_optim_consts c = mf_optim_prepare(&h, 1.0f, 1.0f);
  for (int b = 0; b < NB; b++) {
    float s1[BS], s2[BS];
    uint32_t m1 = 0, m2 = 0;
    for (int i = 0; i < BS; i++) {
      const int e = b * BS + i;
      s1[i] = dense[ref_q1[e]] * ref_a1[b];
      s2[i] = u8[ref_q2[e]] * ref_a2[b];
      mf_optim_update_one(MF_OPT_ADAMW, &c, 2, &ref_p[e], g[e], &s1[i], &s2[i]);
      const uint32_t b1 = mf_f32_bits(s1[i]) & 0x7fffffffu, b2 = mf_f32_bits(s2[i]) & 0x7fffffffu;
      m1 = b1 > m1 ? b1 : m1;
      m2 = b2 > m2 ? b2 : m2;
    }
    ref_a1[b] = mf_f32_from_bits(m1);
    ref_a2[b] = mf_f32_from_bits(m2);
    const mf_block_scale sc1 = mf_absmax_scale(ref_a1[b]), sc2 = mf_absmax_scale(ref_a2[b]);
    for (int i = 0; i < BS; i++) {
      ref_q1[b * BS + i] = mf_optim_quantize(dense, 256, mf_block_normalize(s1[i], sc1), 0);
      ref_q2[b * BS + i] = mf_optim_quantize(u8, 256, mf_block_normalize(s2[i], sc2), 1);
    }
  }
  mf_optim_tensor t = step_tensor(p, g, MF_FLOAT32, q1, q2, MF_UINT8, N, &step);
  t.absmax1 = mf_cpu_tensor(a1, NB, MF_FLOAT32);
  t.absmax2 = mf_cpu_tensor(a2, NB, MF_FLOAT32);
  mf_tensor c1 = mf_cpu_tensor((void *)dense, 256, MF_FLOAT32);
  mf_tensor c2 = mf_cpu_tensor((void *)u8, 256, MF_FLOAT32);
  CHECK(mf_optim_step(&h, MF_STATE_8BIT, BS, &c1, &c2, &t, 1, NULL, NULL, NULL) == MF_OK, "%s",
        mf_last_error());
  int bad = 0;
  for (int i = 0; i < N; i++)
    bad += mf_f32_bits(p[i]) != mf_f32_bits(ref_p[i]) || q1[i] != ref_q1[i] || q2[i] != ref_q2[i];
  for (int b = 0; b < NB; b++)
    bad += mf_f32_bits(a1[b]) != mf_f32_bits(ref_a1[b]) || mf_f32_bits(a2[b]) != mf_f32_bits(ref_a2[b]);
  CHECK(bad == 0, "%s: %d values differ from the scalar reference", what, bad);
}

/* Muon's momentum pass (MF_OPT_MUON): with 8-bit momentum, the step (the fused kernel of
 * this CPU for whole blocks, the block kernel for the partial last one) must be the
 * scalar reference's bit for bit (dequantize, mf_optim_update_one, absmax, binary
 * search), and the element math torch's: buf = fma(1 - m, g - buf, buf) and the update
 * grad.lerp(buf, m) = fma(m - 1, buf - g, buf) (m >= 0.5), or buf without nesterov,
 * written into the output (float32, or bfloat16 rounded to nearest), never read. A
 * non-finite gradient keeps the element's momentum and writes an update of 0. */
static void test_muon_step(const float *code, int nesterov, mf_dtype out_dt) {
  enum { N = 1000, BS = 256, NB = (N + BS - 1) / BS };
  static float g[N], out[N], ref_out[N];
  static uint16_t out16[N];
  static uint8_t q[N], ref_q[N];
  float a[NB], ref_a[NB], step = 4.0f;
  uint32_t r = 777u;
  for (int i = 0; i < N; i++) {
    r = r * 1664525u + 1013904223u;
    g[i] = (float)(r >> 8) / 16777216.0f - 0.5f;
    q[i] = ref_q[i] = (uint8_t)(r >> 16);
    out[i] = NAN; /* an output is never read */
    out16[i] = 0x7fc0u;
  }
  g[5] = NAN;
  g[300] = INFINITY;
  static uint16_t g16[N]; /* a bfloat16 output takes a bfloat16 gradient: the reference reads it */
  for (int i = 0; out_dt != MF_FLOAT32 && i < N; i++) {
    g16[i] = mf_f32_to_bf16(g[i]);
    g[i] = mf_bf16_to_f32(g16[i]);
  }
  for (int b = 0; b < NB; b++) a[b] = ref_a[b] = 0.02f * (float)(b + 1);
  mf_optim_hparams h = {.kind = MF_OPT_MUON, .lr = 0.02, .weight_decay = 0.1, .momentum = 0.95,
                        .nesterov = nesterov};
  const mf_optim_consts c = mf_optim_prepare(&h, step + 1.0f, 1.0f);
  CHECK(c.omb1 == (float)(1.0 - 0.95) && c.b1 == 0.95f, "Muon's lerp weights");
  for (int b = 0; b < NB; b++) {
    float s[BS], zero = 0.0f;
    uint32_t m = 0;
    const int len = N - b * BS < BS ? N - b * BS : BS;
    for (int i = 0; i < len; i++) {
      const int e = b * BS + i;
      const float buf = code[ref_q[e]] * ref_a[b];
      s[i] = buf;
      ref_out[e] = -1.0f;
      const int ok = mf_optim_update_one(MF_OPT_MUON, &c, 1, &ref_out[e], g[e], &s[i], &zero);
      /* torch's arithmetic, spelled out */
      const float nb = fmaf(c.omb1, g[e] - buf, buf);
      const float upd = nesterov ? fmaf(c.b1 - 1.0f, nb - g[e], nb) : nb;
      if (ok)
        CHECK(mf_f32_bits(s[i]) == mf_f32_bits(nb) && mf_f32_bits(ref_out[e]) == mf_f32_bits(upd),
              "Muon element %d: torch's lerp", e);
      else
        CHECK(e == 5 || e == 300, "Muon element %d skipped", e);
      if (!ok) CHECK(s[i] == buf && ref_out[e] == 0.0f, "a skipped Muon element: old momentum, 0");
      const uint32_t u = mf_f32_bits(s[i]) & 0x7fffffffu;
      m = u > m ? u : m;
    }
    ref_a[b] = mf_f32_from_bits(m);
    const mf_block_scale sc = mf_absmax_scale(ref_a[b]);
    for (int i = 0; i < len; i++)
      ref_q[b * BS + i] = mf_optim_quantize(code, 256, mf_block_normalize(s[i], sc), 0);
  }
  void *o = out_dt == MF_FLOAT32 ? (void *)out : (void *)out16;
  mf_optim_tensor t = step_tensor(o, g, out_dt, q, NULL, MF_UINT8, N, &step);
  t.state2 = mf_cpu_tensor(NULL, 0, MF_UINT8);
  t.absmax1 = mf_cpu_tensor(a, NB, MF_FLOAT32);
  if (out_dt != MF_FLOAT32) t.grad = mf_cpu_tensor(g16, N, MF_BFLOAT16);
  mf_tensor c1 = mf_cpu_tensor((void *)code, 256, MF_FLOAT32);
  CHECK(mf_optim_step(&h, MF_STATE_8BIT, BS, &c1, NULL, &t, 1, NULL, NULL, NULL) == MF_OK, "%s",
        mf_last_error());
  int bad = 0;
  for (int i = 0; i < N; i++) {
    const float v = out_dt == MF_FLOAT32 ? out[i] : mf_bf16_to_f32(out16[i]);
    const float want = out_dt == MF_FLOAT32 ? ref_out[i] : mf_bf16_to_f32(mf_f32_to_bf16(ref_out[i]));
    bad += mf_f32_bits(v) != mf_f32_bits(want) || q[i] != ref_q[i];
  }
  for (int b = 0; b < NB; b++) bad += mf_f32_bits(a[b]) != mf_f32_bits(ref_a[b]);
  CHECK(bad == 0, "Muon 8-bit step (nesterov %d, %s output): %d values differ from the reference",
        nesterov, mf_dtype_name(out_dt), bad);
  CHECK(step == 5.0f, "the step counts");
  /* refused: stochastic rounding and a Kahan buffer (the output is no parameter) */
  h.stochastic_round = 1;
  CHECK(mf_optim_step(&h, MF_STATE_8BIT, BS, &c1, NULL, &t, 1, NULL, NULL, NULL) == MF_ERR_VALUE &&
        strstr(mf_last_error(), "sr_seed"), "Muon refuses stochastic rounding: %s", mf_last_error());
}

/* Adagrad (MF_OPT_ADAGRAD): torch.optim.Adagrad's clr = lr / (1 + (t - 1) * lr_decay),
 * computed in double and rounded once; the element math g += wd * p, sum += g * g,
 * p -= clr * g / (sqrt(sum) + eps) in plain float operations; a non-finite gradient or
 * a sum that overflows keeps the element; lr_decay < 0 is refused, naming it. */
static void test_adagrad(void) {
  mf_optim_hparams h = {.kind = MF_OPT_ADAGRAD, .lr = 0.05, .lr_decay = 0.3, .eps = 1e-10,
                        .weight_decay = 0.02};
  CHECK(mf_optim_num_states(&h) == 1 && !mf_optim_state_signed(MF_OPT_ADAGRAD, 1),
        "Adagrad keeps one non-negative state");
  for (int t = 1; t <= 4; t++) {
    const mf_optim_consts c = mf_optim_prepare(&h, (float)t, 1.0f);
    CHECK(c.lr == (float)(0.05 / (1.0 + (t - 1) * 0.3)), "Adagrad's clr at step %d", t);
    const float p0 = 0.75f, g0 = -0.125f, s0 = 0.5f;
    float p = p0, s = s0, zero = 0.0f;
    CHECK(mf_optim_update_one(MF_OPT_ADAGRAD, &c, 1, &p, g0, &s, &zero), "updated");
    const float g = g0 + c.wd * p0, sn = s0 + g * g;
    CHECK(mf_f32_bits(s) == mf_f32_bits(sn) &&
          mf_f32_bits(p) == mf_f32_bits(p0 - c.lr * g / (sqrtf(sn) + c.eps)),
          "Adagrad element at step %d", t);
    const float bad_g[] = {NAN, INFINITY, 3e19f};
    for (int k = 0; k < 3; k++) {
      p = p0, s = s0;
      CHECK(!mf_optim_update_one(MF_OPT_ADAGRAD, &c, 1, &p, bad_g[k], &s, &zero) && p == p0 &&
            s == s0, "Adagrad skips gradient %g", (double)bad_g[k]);
    }
  }
  h.lr_decay = -0.1;
  CHECK(mf_optim_check_hparams(&h) == MF_ERR_VALUE && strstr(mf_last_error(), "lr_decay"),
        "a negative lr_decay is refused: %s", mf_last_error());
}

int main(void) {
  float s8[256], u8[256], s4[16], u4[16];
  CHECK(mf_dynamic_map(s8, 256, 1, 8, 7) == MF_OK, "map");
  CHECK(mf_dynamic_map(u8, 256, 0, 8, 7) == MF_OK, "map");
  CHECK(mf_dynamic_map(s4, 16, 1, 4, 3) == MF_OK, "map");
  for (int i = 0; i < 16; i++) u4[i] = (float)((i + 1) / 16.0);
  test_code(s8, 256, "signed 8-bit dynamic map");
  test_code(u8, 256, "unsigned 8-bit dynamic map");
  test_code(s4, 16, "signed 4-bit dynamic map");
  test_code(u4, 16, "4-bit linear map without zero");
  /* codes closer together than a table bucket (1/128 of a binade): those buckets take
   * the binary search; the answers must not change */
  float dense[256];
  for (int i = 0; i < 256; i++) dense[i] = i < 128 ? -1.0f + (float)i / 128.0f : 0.5f + (float)(i - 128) * 1e-4f;
  test_code(dense, 256, "a code with entries 1e-4 apart");
  test_step_matches_reference(s8, u8, "8-bit step, dynamic maps");
  test_step_matches_reference(dense, u8, "8-bit step, a dense code");
  test_muon_step(s8, 1, MF_FLOAT32);
  test_muon_step(s8, 0, MF_FLOAT32);
  test_muon_step(s8, 1, MF_BFLOAT16);
  test_skip_nonfinite();
  test_adam_skip_test_is_the_contract();
  test_kahan_split();
  test_kahan_step();
  test_cuda_arrays_without_cuda();
  test_adagrad();
  return check_exit("test_optim");
}
