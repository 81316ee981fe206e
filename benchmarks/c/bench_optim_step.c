/*
 * The CPU optimizer step alone: mf_optim_step on one tensor of fp32 parameters with
 * 8-bit (or 4-bit, or fp32) AdamW states, no Python in the way. benchmarks/bench_optim_core.py
 * builds and drives it; by hand:
 *
 *   bench_optim_step NUMEL THREADS [STEPS_PER_REP [REPS [BITS [KIND]]]]
 *
 * KIND: adamw (default), ademamix (AdEMAMix: a third state, signed, with code1), sgd
 * (momentum 0.9), sgd-nesterov, rmsprop (momentum 0.9: two states) or muon (Muon's
 * momentum pass, nesterov).
 *
 * prints one JSON line: the best and the median per-step time (ms) over REPS
 * repetitions of STEPS_PER_REP back-to-back steps, after 3 warm-up steps.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "memfit/optim.h"
#include "memfit/quant.h"

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* xorshift64 uniforms summed to an approximately normal variate (sum of 12 - 6) */
static uint64_t rng_state = 88172645463325252ull;
static float normal(void) {
  float u = 0.0f;
  for (int i = 0; i < 12; i++) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    u += (float)(rng_state >> 40) / 16777216.0f;
  }
  return u - 6.0f;
}

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Its own, not common.h's mf_cpu_tensor: bench_optim_core.py --against builds this file
 * against older cores too, which lack it. */
static mf_tensor cpu_tensor(void *data, mf_dtype dt, int64_t numel) {
  mf_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = dt;
  t.numel = numel;
  t.device = MF_CPU;
  return t;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s NUMEL THREADS [STEPS_PER_REP [REPS [BITS [KIND]]]]\n", argv[0]);
    return 2;
  }
  const int64_t n = atoll(argv[1]);
  const int threads = atoi(argv[2]);
  const int steps = argc > 3 ? atoi(argv[3]) : 3;
  const int reps = argc > 4 ? atoi(argv[4]) : 15;
  const int bits = argc > 5 ? atoi(argv[5]) : 8;
  static const char *const kinds[] = {"adamw", "ademamix", "sgd", "sgd-nesterov", "rmsprop", "muon"};
  const char *kind = argc > 6 ? argv[6] : "adamw";
  int known = 0;
  for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) known |= !strcmp(kind, kinds[k]);
  const int ademamix = !strcmp(kind, "ademamix");
  if (n <= 0 || threads <= 0 || steps <= 0 || reps <= 0 || (bits != 32 && bits != 8 && bits != 4) ||
      !known) {
    fprintf(stderr, "NUMEL, THREADS, STEPS_PER_REP and REPS must be > 0, BITS 32, 8 or 4, "
                    "KIND adamw, ademamix, sgd, sgd-nesterov, rmsprop or muon\n");
    return 2;
  }
  mf_set_num_threads(threads);
  const int64_t bs = bits == 8 ? 256 : 128, nb = (n + bs - 1) / bs;
  const int64_t sn = bits == 4 ? (n + 1) / 2 : n, codes = bits == 4 ? 16 : 256;
  const size_t es = bits == 32 ? 4 : 1; /* bytes per state element */
  float *p = malloc((size_t)n * 4), *g = malloc((size_t)n * 4);
  uint8_t *s1 = calloc((size_t)sn, es), *s2 = calloc((size_t)sn, es), *s3 = calloc((size_t)sn, es);
  float *a1 = calloc((size_t)nb, 4), *a2 = calloc((size_t)nb, 4), *a3 = calloc((size_t)nb, 4);
  float step = 0.0f;
  float *c1 = malloc((size_t)codes * 4), *c2 = malloc((size_t)codes * 4);
  double *times = malloc((size_t)reps * sizeof(double));
  if (!p || !g || !s1 || !s2 || !s3 || !a1 || !a2 || !a3 || !c1 || !c2 || !times) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  for (int64_t i = 0; i < n; i++) {
    p[i] = normal() * 0.1f;
    g[i] = normal() * 0.01f;
  }
  /* the codes memfit.optim uses (python/memfit/optim/_core.py: code_table) */
  if (bits != 4) {
    mf_dynamic_map(c1, 256, 1, 8, 7);
    mf_dynamic_map(c2, 256, 0, 8, 7);
  } else {
    mf_dynamic_map(c1, 16, 1, 4, 3);
    for (int k = 0; k < 16; k++) c2[k] = (float)(k + 1) / 16.0f;
  }
  mf_tensor code1 = cpu_tensor(c1, MF_FLOAT32, codes), code2 = cpu_tensor(c2, MF_FLOAT32, codes);
  mf_optim_tensor t;
  memset(&t, 0, sizeof t);
  t.param = cpu_tensor(p, MF_FLOAT32, n);
  t.grad = cpu_tensor(g, MF_FLOAT32, n);
  t.state1 = cpu_tensor(s1, bits == 32 ? MF_FLOAT32 : MF_UINT8, sn);
  t.state2 = cpu_tensor(s2, bits == 32 ? MF_FLOAT32 : MF_UINT8, sn);
  t.absmax1 = cpu_tensor(a1, MF_FLOAT32, nb);
  t.absmax2 = cpu_tensor(a2, MF_FLOAT32, nb);
#ifdef MF_OPTIM_STATE3
  if (ademamix) {
    t.state3 = cpu_tensor(s3, bits == 32 ? MF_FLOAT32 : MF_UINT8, sn);
    t.absmax3 = cpu_tensor(a3, MF_FLOAT32, nb);
  }
#endif
  t.step = cpu_tensor(&step, MF_FLOAT32, 1);
  mf_optim_hparams h;
  memset(&h, 0, sizeof h);
  h.kind = MF_OPT_ADAMW;
  h.lr = 1e-3;
  h.beta1 = 0.9;
  h.beta2 = 0.999;
  h.eps = 1e-8;
  h.weight_decay = 0.01;
  if (!strncmp(kind, "sgd", 3)) {
    h.kind = MF_OPT_SGD;
    h.momentum = 0.9;
    h.nesterov = !strcmp(kind, "sgd-nesterov");
  } else if (!strcmp(kind, "rmsprop")) {
    h.kind = MF_OPT_RMSPROP;
    h.momentum = 0.9;
    h.alpha = 0.99;
  } else if (!strcmp(kind, "muon")) {
    h.kind = MF_OPT_MUON;
    h.momentum = 0.95;
    h.nesterov = 1;
    h.weight_decay = 0.0;
  }
#ifdef MF_OPTIM_STATE3
  if (ademamix) { /* bitsandbytes' defaults, no schedulers */
    h.kind = MF_OPT_ADEMAMIX;
    h.beta3 = 0.9999;
    h.alpha = 5.0;
  }
#else
  if (ademamix) {
    fprintf(stderr, "KIND ademamix: this core has no third state\n");
    return 2;
  }
#endif
  const mf_state_format fmt = (mf_state_format)bits;
  const mf_tensor *codes1 = bits == 32 ? NULL : &code1, *codes2 = bits == 32 ? NULL : &code2;
  for (int r = -3; r < reps * steps; r++) {
    const double t0 = now_s();
    if (mf_optim_step(&h, fmt, bs, codes1, codes2, &t, 1, NULL, NULL, NULL)) {
      fprintf(stderr, "mf_optim_step: %s\n", mf_last_error());
      return 1;
    }
    if (r >= 0) {
      if (r % steps == 0) times[r / steps] = 0.0;
      times[r / steps] += (now_s() - t0) / steps;
    }
  }
  qsort(times, (size_t)reps, sizeof *times, cmp_double);
  printf("{\"numel\": %lld, \"threads\": %d, \"bits\": %d, \"kind\": \"%s\", \"best_ms\": %.4f, "
         "\"median_ms\": %.4f}\n", (long long)n, threads, bits, kind,
         times[0] * 1e3, times[reps / 2] * 1e3);
  free(p), free(g), free(s1), free(s2), free(s3), free(a1), free(a2), free(a3), free(c1), free(c2);
  free(times);
  return 0;
}
