/* C tests of the optimizer core: the CPU's table-driven code search must return exactly
 * what mf_optim_quantize (the binary search the CUDA kernels use) returns, for every
 * code the optimizers use; and the element update must skip non-finite values. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "memfit/optim.h"

static int failures = 0;
#define CHECK(cond, ...)                 \
  do {                                   \
    if (!(cond)) {                       \
      failures++;                        \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);      \
      fprintf(stderr, "\n");             \
    }                                    \
  } while (0)

#define BATCH 4096

static void compare(const float *code, int size, const float *x, int64_t n, const char *what) {
  uint8_t fast[BATCH];
  for (int64_t off = 0; off < n; off += BATCH) {
    int64_t m = n - off < BATCH ? n - off : BATCH;
    mf_status st = mf_optim_quantize_fast(code, size, x + off, m, fast);
    CHECK(st == MF_OK, "%s: %s", what, mf_last_error());
    for (int64_t i = 0; i < m; i++) {
      uint8_t want = mf_optim_quantize(code, size, x[off + i]);
      if (fast[i] != want) {
        uint32_t u;
        memcpy(&u, &x[off + i], 4);
        CHECK(0, "%s: x=%.9g (0x%08x): table %d, search %d", what, (double)x[off + i], u, fast[i], want);
        return;
      }
    }
  }
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
  /* 3. specials */
  float sp[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 1e-45f, -1e-45f, 1.0f, -1.0f,
                1.0000001f, -1.0000001f, 3e38f, -3e38f};
  compare(code, size, sp, (int64_t)(sizeof sp / sizeof sp[0]), what);
}

static void test_skip_nonfinite(void) {
  mf_optim_hparams h = {MF_OPT_ADAMW, 1e-3, 0.9, 0.999, 1e-8, 1e-2, 0, 0, 0, 0, 0};
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
  test_skip_nonfinite();
  if (failures) {
    fprintf(stderr, "%d failure(s)\n", failures);
    return 1;
  }
  printf("test_optim: ok\n");
  return 0;
}
