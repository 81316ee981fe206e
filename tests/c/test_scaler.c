/*
 * C tests of the scaler core (no Python): the update rule against torch's rule written
 * out here, hysteresis and bounds, the stage machine, and the CPU unscale/norm entry
 * points with their argument checks (including mixed devices, which the Python tests
 * cannot build without a GPU).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "memfit/scaler.h"

#include "check.h"

static float scale_of(const uint32_t *w) { return mf_f32_from_bits(w[MF_SW_SCALE]); }

/* torch's _amp_update_scale_ (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp) */
static void torch_rule(float *scale, int32_t *tracker, int found, float g, float b, int32_t gi) {
  if (found) {
    *scale *= b;
    *tracker = 0;
  } else {
    int32_t s = *tracker + 1;
    if (s == gi) {
      float n = *scale * g;
      if (isfinite(n)) *scale = n;
      *tracker = 0;
    } else {
      *tracker = s;
    }
  }
}

static void test_rule_matches_torch(void) {
  const mf_scaler_config cfg = {2.0f, 0.5f, 3, 1, 0.0f, 0.0f, 0};
  uint32_t w[MF_SCALER_WORDS];
  CHECK(mf_scaler_state_init(w, MF_SCALER_WORDS, 1e37f, 0) == MF_OK);
  float scale = 1e37f;
  int32_t tracker = 0;
  uint64_t x = 12345;
  for (int i = 0; i < 2000; i++) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    int found = (x >> 60) == 0; /* ~1 in 16 */
    mf_scaler_update_rule(w, found, 0, &cfg);
    torch_rule(&scale, &tracker, found, 2.0f, 0.5f, 3);
    CHECK(w[MF_SW_SCALE] == mf_f32_bits(scale));
    CHECK(w[MF_SW_GROWTH_TRACKER] == (uint32_t)tracker);
  }
  CHECK(w[MF_SW_UPDATES] == 2000u);
  CHECK(isfinite(scale_of(w)));
}

static void test_hysteresis_and_bounds(void) {
  mf_scaler_config cfg = {2.0f, 0.5f, 1, 2, 4.0f, 32.0f, 0};
  uint32_t w[MF_SCALER_WORDS];
  mf_scaler_state_init(w, MF_SCALER_WORDS, 16.0f, 0);
  mf_scaler_update_rule(w, 1, 0, &cfg);
  CHECK(scale_of(w) == 16.0f); /* first non-finite: held */
  mf_scaler_update_rule(w, 1, 0, &cfg);
  CHECK(scale_of(w) == 8.0f);
  mf_scaler_update_rule(w, 1, 0, &cfg);
  CHECK(scale_of(w) == 4.0f);
  mf_scaler_update_rule(w, 1, 0, &cfg);
  CHECK(scale_of(w) == 4.0f && w[MF_SW_MIN_CLAMPS] == 1u);
  mf_scaler_update_rule(w, 0, 0, &cfg);
  CHECK(scale_of(w) == 8.0f && w[MF_SW_CONSEC_INF] == 0u && w[MF_SW_MAX_CONSEC_INF] == 4u);
  for (int i = 0; i < 3; i++) mf_scaler_update_rule(w, 0, 0, &cfg);
  CHECK(scale_of(w) == 32.0f && w[MF_SW_MAX_CLAMPS] >= 1u);
  /* loss skip: nothing but the counters moves */
  cfg.loss_skip = 1;
  uint32_t tracker = w[MF_SW_GROWTH_TRACKER];
  mf_scaler_update_rule(w, 1, 1, &cfg);
  CHECK(scale_of(w) == 32.0f && w[MF_SW_GROWTH_TRACKER] == tracker && w[MF_SW_LOSS_NONFINITE] == 1u);
  /* history: the scale each step used, negative when skipped */
  CHECK(mf_f32_from_bits(w[MF_SW_HISTORY + 0]) == -16.0f);
  CHECK(mf_f32_from_bits(w[MF_SW_HISTORY + 4]) == 4.0f);
}

static void test_config_and_state_checks(void) {
  mf_scaler_config ok = {2.0f, 0.5f, 10, 1, 0.0f, 0.0f, 0}, c;
  CHECK(mf_scaler_config_check(&ok) == MF_OK);
  c = ok; c.growth_factor = 1.0f;
  CHECK(mf_scaler_config_check(&c) == MF_ERR_VALUE && strstr(mf_last_error(), "growth_factor"));
  c = ok; c.backoff_factor = 1.0f;
  CHECK(mf_scaler_config_check(&c) == MF_ERR_VALUE && strstr(mf_last_error(), "backoff_factor"));
  c = ok; c.backoff_factor = NAN;
  CHECK(mf_scaler_config_check(&c) == MF_ERR_VALUE);
  c = ok; c.hysteresis = 0;
  CHECK(mf_scaler_config_check(&c) == MF_ERR_VALUE && strstr(mf_last_error(), "hysteresis"));
  c = ok; c.min_scale = 8.0f; c.max_scale = 4.0f;
  CHECK(mf_scaler_config_check(&c) == MF_ERR_VALUE && strstr(mf_last_error(), "min_scale"));
  uint32_t w[MF_SCALER_WORDS];
  CHECK(mf_scaler_state_init(w, 3, 1.0f, 0) == MF_ERR_VALUE);
  CHECK(mf_scaler_state_init(w, MF_SCALER_WORDS, INFINITY, 0) == MF_ERR_VALUE);
  CHECK(mf_scaler_state_init(w, MF_SCALER_WORDS, 1.0f, -1) == MF_ERR_VALUE);

  mf_scaler_state_init(w, MF_SCALER_WORDS, 8.0f, 0);
  mf_tensor state = {w, MF_SCALER_WORDS, MF_FLOAT32, MF_CPU, 0};
  float f0 = 0.0f, f1 = 1.0f;
  mf_tensor flags[2] = {{&f0, 1, MF_FLOAT32, MF_CPU, 0}, {&f1, 1, MF_FLOAT32, MF_CPU, 0}};
  CHECK(mf_scaler_update(&state, flags, 2, NULL, &ok, NULL) == MF_OK);
  CHECK(scale_of(w) == 4.0f);
  CHECK(mf_scaler_update(&state, flags, 0, NULL, &ok, NULL) == MF_ERR_VALUE);
  mf_tensor gpu_flag = {(void *)0x10, 1, MF_FLOAT32, MF_CUDA, 0};
  CHECK(mf_scaler_update(&state, &gpu_flag, 1, NULL, &ok, NULL) == MF_ERR_VALUE);
  mf_tensor short_state = state;
  short_state.numel = 10;
  CHECK(mf_scaler_update(&short_state, flags, 1, NULL, &ok, NULL) == MF_ERR_VALUE);
}

static void test_unscale_and_norm_cpu(void) {
  enum { N = 70000 };
  static float a[N];
  uint16_t h[5];
  for (int i = 0; i < N; i++) a[i] = (float)(i % 7) - 3.0f;
  for (int i = 0; i < 5; i++) h[i] = mf_f32_to_f16(4.0f);
  float s = 2.0f, found = 0.0f, out = 0.0f;
  mf_tensor g[3] = {{a, N, MF_FLOAT32, MF_CPU, 0}, {h, 5, MF_FLOAT16, MF_CPU, 0},
                    {a, 0, MF_FLOAT32, MF_CPU, 0}};
  mf_tensor st = {&s, 1, MF_FLOAT32, MF_CPU, 0}, fi = {&found, 1, MF_FLOAT32, MF_CPU, 0};
  CHECK(mf_unscale_grads(g, 3, &st, &fi, NULL) == MF_OK && found == 0.0f);
  CHECK(a[0] == -1.5f && a[N - 1] == ((float)((N - 1) % 7) - 3.0f) / 2.0f);
  CHECK(mf_f16_to_f32(h[4]) == 2.0f);
  a[N - 2] = NAN;
  CHECK(mf_unscale_grads(g, 3, NULL, &fi, NULL) == MF_OK && found == 1.0f);
  a[N - 2] = 0.0f;
  mf_tensor o = {&out, 1, MF_FLOAT32, MF_CPU, 0};
  CHECK(mf_grad_norm(g, 2, INFINITY, NULL, &o, NULL) == MF_OK && out == 2.0f);
  /* mixed devices and bad dtypes name the argument */
  mf_tensor mixed[2] = {{a, 4, MF_FLOAT32, MF_CPU, 0}, {(void *)0x10, 4, MF_FLOAT32, MF_CUDA, 0}};
  CHECK(mf_unscale_grads(mixed, 2, &st, &fi, NULL) == MF_ERR_VALUE);
  CHECK(strstr(mf_last_error(), "grads[1]") && strstr(mf_last_error(), "one device"));
  mf_tensor bytes = {a, 4, MF_UINT8, MF_CPU, 0};
  CHECK(mf_unscale_grads(&bytes, 1, &st, &fi, NULL) == MF_ERR_TYPE);
  CHECK(mf_grad_norm(g, 2, 0.0, NULL, &o, NULL) == MF_ERR_VALUE);
  CHECK(mf_mt_num_chunks(g, 3) == 3); /* 70000 -> 2 chunks, 5 -> 1, 0 -> 0 */
#ifndef MEMFIT_WITH_CUDA
  /* a CPU-only build refuses CUDA arrays with MF_ERR_NO_CUDA (nothing is dereferenced) */
  mf_tensor dg = {(void *)0x10, 4, MF_FLOAT32, MF_CUDA, 0};
  mf_tensor ds = {(void *)0x20, 1, MF_FLOAT32, MF_CUDA, 0}, df = {(void *)0x30, 1, MF_FLOAT32, MF_CUDA, 0};
  CHECK(mf_unscale_grads(&dg, 1, &ds, &df, NULL) == MF_ERR_NO_CUDA);
  CHECK(mf_clip_grads(&dg, 1, &ds, 1.0f, NULL) == MF_ERR_NO_CUDA);
  CHECK(mf_grad_norm(&dg, 1, 2.0, &ds, &df, NULL) == MF_ERR_NO_CUDA);
  const mf_scaler_config cfg = {2.0f, 0.5f, 10, 1, 0.0f, 0.0f, 0};
  mf_tensor dstate = {(void *)0x40, MF_SCALER_WORDS, MF_FLOAT32, MF_CUDA, 0};
  CHECK(mf_scaler_update(&dstate, &df, 1, NULL, &cfg, NULL) == MF_ERR_NO_CUDA);
  CHECK(strstr(mf_last_error(), "scaler_update: got CUDA arrays") != NULL);
  CHECK(strstr(mf_last_error(), "MEMFIT_CUDA=ON") != NULL); /* how to get a CUDA build */
#endif
}

/* The packing every multi-tensor loop uses (multi_tensor.h): each item of each tensor
 * exactly once, in order; block b of a launch is global item base + b and belongs to
 * tensor mf_mt_tensor_of(start, count, b); the limits hold; the CPU's prefix sum
 * numbers the items the same way. Checked for the gradient passes' item size and
 * limits, and for small limits that split the same tensors into many launches. */
static void check_packing(const mf_tensor *t, int64_t n, int64_t item, int64_t cap,
                          int64_t max_items) {
  static int64_t prefix[1001], start[1001];
  const int64_t total = mf_mt_prefix(&t[0].numel, sizeof *t, NULL, n, item, prefix);
  mf_mt_packer pk;
  mf_mt_pack_begin(&pk, &t[0].numel, sizeof *t, NULL, n, item);
  int64_t global = 0, next = 0, first, count;
  int launches = 0, ok = 1;
  for (;;) {
    const int64_t base = pk.base;
    if ((count = mf_mt_pack_next(&pk, cap, max_items, start, &first)) == 0) break;
    launches++;
    ok &= count <= cap && start[0] == 0 && start[count] >= 1 && base == global;
    ok &= count == 1 || start[count] <= max_items;
    while (next < n && t[next].numel == 0) next++; /* skipped before a launch */
    ok &= first == next;
    for (int64_t b = 0; b < start[count]; b++, global++) {
      const int64_t k = mf_mt_tensor_of(start, count, b);
      const int64_t i = first + k, w = global;
      ok &= k < count && t[i].numel > 0;
      ok &= (b - start[k]) * item < t[i].numel; /* a real item of that tensor */
      ok &= mf_mt_tensor_of(prefix, n, w) == i && w - prefix[i] == b - start[k];
    }
    next = first + count;
  }
  CHECK(ok);
  CHECK(global == total);
  while (next < n && t[next].numel == 0) next++;
  CHECK(next == n);
  int64_t nonempty = 0;
  for (int64_t i = 0; i < n; i++) nonempty += t[i].numel > 0;
  CHECK(launches >= (nonempty + cap - 1) / cap);
  CHECK(mf_mt_pack_next(&pk, cap, max_items, start, &first) == 0); /* stays done */
}

/* N tensors: empty, tiny (numel i < N), exactly one `chunk`, multi-chunk, and a few
 * huge ones (700 chunks) */
enum { N_PACKED = 700 };
static void packing_tensors(mf_tensor *t, int64_t chunk) {
  static char dummy[N_PACKED];
  for (int i = 0; i < N_PACKED; i++) {
    int64_t numel = (i % 7 == 0) ? 0 : (i % 5 == 0) ? chunk
                  : (i % 11 == 0) ? 3 * chunk + 1 : (i % 97 == 0) ? 700LL * chunk : i;
    t[i] = (mf_tensor){dummy + i, numel, MF_FLOAT32, MF_CUDA, 0};
  }
}

static void test_multi_tensor_packing(void) {
  enum { N = N_PACKED };
  static mf_tensor t[N];
  packing_tensors(t, MF_MT_CHUNK);
  int64_t expected_chunks = 0;
  for (int i = 0; i < N; i++) expected_chunks += (t[i].numel + MF_MT_CHUNK - 1) / MF_MT_CHUNK;
  CHECK(mf_mt_num_chunks(t, N) == expected_chunks);
  check_packing(t, N, MF_MT_CHUNK, MF_MT_MAX_TENSORS, MF_MT_MAX_GRID);
  check_packing(t, N, 4096, 40, 1000); /* the optimizer's item, a small grid limit */
  /* item 1: huge tensors alone in their launch. The same tensors with a chunk of 1024
   * instead of 65536 and a limit of N = 700 items: every tensor but the tiny ones is
   * still over the limit, alone in its launch, with 1/64 of the items to check. */
  static mf_tensor small[N];
  packing_tensors(small, 1024);
  check_packing(small, N, 1, 3, N);
  /* nothing at all, or only empty tensors: no launch */
  mf_mt_packer pk;
  int64_t start[4], first;
  mf_mt_pack_begin(&pk, &t[0].numel, sizeof *t, NULL, 1, MF_MT_CHUNK);
  CHECK(t[0].numel == 0 && mf_mt_pack_next(&pk, 3, MF_MT_MAX_GRID, start, &first) == 0);
  mf_mt_pack_begin(&pk, &t[0].numel, sizeof *t, NULL, 0, MF_MT_CHUNK);
  CHECK(mf_mt_pack_next(&pk, 3, MF_MT_MAX_GRID, start, &first) == 0);
}

int main(void) {
  test_rule_matches_torch();
  test_hysteresis_and_bounds();
  test_config_and_state_checks();
  test_unscale_and_norm_cpu();
  test_multi_tensor_packing();
  return check_exit("test_scaler");
}
