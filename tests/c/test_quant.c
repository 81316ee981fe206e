/*
 * C-level test of the quantization core, no Python: round trips against a float64
 * reference, partial blocks, every dtype and block size, non-finite input, and the
 * error paths (each must return a status with a message, never abort). Built by CMake
 * (MEMFIT_BUILD_TESTS=ON) and run under AddressSanitizer + UBSan in CI.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memfit/numeric.h"
#include "memfit/quant.h"
#include "code_lut.h" /* private to the core: the CPU lookup table */
#include "code_lut_avx512.h" /* and its AVX-512 search */
#include "cpu_isa.h"

#include "check.h"

static uint64_t rng_state = 0x1234567887654321ull;
static double uniform01(void) { /* xorshift64*, enough for test data */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (double)((rng_state * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0);
}
static double normal01(void) {
  double u1 = uniform01(), u2 = uniform01();
  if (u1 < 1e-300) u1 = 1e-300;
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* Nearest code by exhaustive search in float64: the reference for the binary search. */
static int nearest_ref(const float *code, float x) {
  int best = 0;
  double bd = fabs((double)x - code[0]);
  for (int i = 1; i < MF_CODE_SIZE; i++) {
    double d = fabs((double)x - code[i]);
    if (d < bd) { bd = d; best = i; }
  }
  return best;
}

static void test_maps(void) {
  float code[256];
  CHECK(mf_dynamic_map(code, 256, 1, 8, 7) == MF_OK, "dynamic signed: %s", mf_last_error());
  int pos = 0, neg = 0;
  for (int i = 0; i < 256; i++) {
    if (i) CHECK(code[i] >= code[i - 1], "dynamic map not sorted at %d", i);
    pos += code[i] > 0;
    neg += code[i] < 0;
  }
  CHECK(pos == 128 && neg == 127, "signed map: %d positive (127 + 1.0), %d negative", pos, neg);
  CHECK(code[255] == 1.0f, "signed map must end at 1.0");
  CHECK(mf_dynamic_map(code, 256, 0, 8, 7) == MF_OK, "dynamic unsigned");
  CHECK(code[0] == 0.0f && code[1] > 0.0f && code[255] == 1.0f, "unsigned map range");
  CHECK(mf_dynamic_map(code, 256, 1, 9, 7) == MF_ERR_VALUE, "total_bits 9 must fail");
  CHECK(strstr(mf_last_error(), "total_bits") != NULL, "message names total_bits: %s", mf_last_error());
  CHECK(mf_dynamic_map(code, 256, 1, 8, 8) == MF_ERR_VALUE, "max_exponent_bits 8 must fail");
  CHECK(mf_dynamic_map(code, 100, 1, 8, 7) == MF_ERR_VALUE, "short out must fail");
  CHECK(mf_linear_map(code, 256, 1, 8) == MF_OK, "linear map");
  CHECK(code[0] == -1.0f && code[255] == 1.0f, "linear map ends");
}

static void test_search_matches_exhaustive(void) {
  float code[256];
  mf_dynamic_map(code, 256, 1, 8, 7);
  for (int k = 0; k < 200000; k++) {
    float x = (float)(2.0 * uniform01() - 1.0);
    if (k % 4 == 0) x *= 1e-3f;
    int got = mf_quantize_nearest(code, x), want = nearest_ref(code, x);
    /* equal, or an exact tie in float64 distance */
    if (got != want)
      CHECK(fabs((double)x - code[got]) == fabs((double)x - code[want]),
            "x=%.9g: search %d (%.9g), exhaustive %d (%.9g)", (double)x, got, (double)code[got],
            want, (double)code[want]);
  }
}

/* The lookup table must give exactly the binary search's answer: around every
 * decision boundary (+-64 ulps of each code midpoint), at random, and at the
 * special values. */
static void test_lut_is_exact(int is_signed) {
  float code[256];
  mf_dynamic_map(code, 256, is_signed, 8, 7);
  const mf_code_lut *lut = mf_code_lut_get(code, 256, 0);
  CHECK(lut != NULL, "lookup table");
  if (!lut) return;
  CHECK(mf_code_lut_get(code, 256, 0) == lut, "the table is cached");
  CHECK(mf_code_lut_get(code, 256, 1) != lut, "keep_positive has a table of its own");
  CHECK(!lut->has_slow, "the dynamic map needs no binary-search buckets");
  for (int k = 0; k + 1 < 256; k++) {
    float mid = 0.5f * (code[k] + code[k + 1]);
    uint32_t u = mf_f32_bits(mid);
    for (int d = -64; d <= 64; d++) {
      float x = mf_f32_from_bits(u + (uint32_t)d);
      CHECK(mf_code_lut_quantize(lut, x) == mf_quantize_nearest(code, x),
            "lut differs at %.9g", (double)x);
    }
  }
  for (int k = 0; k < 1000000; k++) {
    uint32_t u = (uint32_t)(uniform01() * 4294967296.0);
    float x = mf_f32_from_bits(u); /* any float: every one has a bucket */
    CHECK(mf_code_lut_quantize(lut, x) == mf_quantize_nearest(code, x),
          "lut differs at %.9g", (double)x);
    x = (float)(2.0 * uniform01() - 1.0);
    CHECK(mf_code_lut_quantize(lut, x) == mf_quantize_nearest(code, x),
          "lut differs at %.9g", (double)x);
  }
  float specials[] = {0.0f, -0.0f, 1.0f, -1.0f, 1.0000001f, -1.0000001f, 2.0f, INFINITY, -INFINITY,
                      NAN, 1e-40f, -1e-40f, 2.3283064e-10f};
  for (size_t k = 0; k < sizeof specials / sizeof specials[0]; k++)
    CHECK(mf_code_lut_quantize(lut, specials[k]) == mf_quantize_nearest(code, specials[k]),
          "lut differs at special %g", (double)specials[k]);
}

/* The arithmetic search (code_lut.h) of every code the optimizers ship, signed and
 * unsigned (nearest, and nearest keeping positive values off the zero code, as the
 * optimizers store them): for the 8-bit codes (the kernels use it for them) the build
 * finds it exact, and it is: around every threshold (where it must flag or be right),
 * at random over [-1, 1] and over all floats, and at the special values. Ambiguous
 * elements are few (the kernels take the table for them), and zero is never one
 * (all-zero states are common). The 4-bit codes use the threshold tree, checked here
 * too; an arithmetic search the build finds for them must be exact as well. */
static void test_arith_search_is_exact(int bits, int is_signed) {
  float code[256];
  const int size = 1 << bits;
  mf_dynamic_map(code, size, is_signed, bits, bits == 8 ? 7 : 3);
  const mf_code_lut *lut = mf_code_lut_get(code, size, !is_signed);
  CHECK(lut != NULL, "%d-bit lookup table", bits);
  if (!lut) return;
  if (bits == 8)
    CHECK(lut->arith, "8-bit %s code: the arithmetic search holds", is_signed ? "signed" : "unsigned");
  long ambiguous = 0, total = 0;
#define ARITH_AGREES(x)                                                                    \
  do {                                                                                     \
    if (!lut->arith) break;                                                                \
    int amb_;                                                                              \
    const int q_ = mf_code_lut_arith_index(lut, (x), &amb_);                               \
    const int want_ = mf_optim_quantize(code, size, (x), !is_signed);                      \
    CHECK(amb_ || q_ == want_, "%d-bit: arithmetic %d, search %d at %.9g", bits, q_, want_, \
          (double)(x));                                                                    \
    ambiguous += amb_, total++;                                                            \
  } while (0)
  for (int k = 0; k + 1 < size; k++) {
    const uint32_t u = mf_f32_bits(0.5f * (code[k] + code[k + 1]));
    for (int d = -200; d <= 200; d++) {
      ARITH_AGREES(mf_f32_from_bits(u + (uint32_t)d));
      ARITH_AGREES(-mf_f32_from_bits(u + (uint32_t)d));
    }
  }
  ambiguous = total = 0;
  for (int k = 0; k < 200000; k++) {
    float x = (float)(2.0 * uniform01() - 1.0);
    if (k % 3 == 0) x *= (float)pow(10.0, -7.0 * uniform01());
    ARITH_AGREES(x);
    const uint32_t u = (uint32_t)(uniform01() * 4294967296.0);
    if ((u & 0x7f800000u) != 0x7f800000u) ARITH_AGREES(mf_f32_from_bits(u));
  }
  CHECK(ambiguous <= total / 500, "%ld of %ld ambiguous", ambiguous, total);
  if (lut->arith) {
    int amb;
    mf_code_lut_arith_index(lut, 0.0f, &amb);
    CHECK(!amb, "%d-bit: zero is not ambiguous", bits);
    mf_code_lut_arith_index(lut, -0.0f, &amb);
    CHECK(!amb, "%d-bit: -0 is not ambiguous", bits);
  }
  if (size == 16) { /* and the threshold tree, around every step and at random */
    for (int k = 0; k + 1 < size; k++)
      for (int d = -300; d <= 300; d++) {
        const float x = mf_f32_from_bits(mf_f32_bits(0.5f * (code[k] + code[k + 1])) + (uint32_t)d);
        CHECK(mf_code_lut_tree4_index(lut, x) == mf_optim_quantize(code, size, x, !is_signed) &&
                  mf_code_lut_tree4_index(lut, -x) == mf_optim_quantize(code, size, -x, !is_signed),
              "4-bit tree at +-%.9g", (double)x);
      }
    for (int k = 0; k < 200000; k++) {
      const uint32_t u = (uint32_t)(uniform01() * 4294967296.0);
      const float x = (u & 0x7f800000u) == 0x7f800000u ? 0.0f : mf_f32_from_bits(u);
      CHECK(mf_code_lut_tree4_index(lut, x) == mf_optim_quantize(code, size, x, !is_signed),
            "4-bit tree at %.9g", (double)x);
    }
  }
  const float specials[] = {0.0f, -0.0f, 1.0f, -1.0f, 1.0000001f, -1.0000001f, 2.0f, 1e-40f,
                            -1e-40f, 1.4e-45f, -1.4e-45f, 2.3283064e-10f, 3.4e38f, -3.4e38f};
  for (size_t k = 0; k < sizeof specials / sizeof specials[0]; k++) ARITH_AGREES(specials[k]);
#undef ARITH_AGREES
}

/* A code with no such structure (uneven random values) either gets no arithmetic
 * search or an exact one. */
static void test_arith_search_other_codes(void) {
  float code[256];
  for (int i = 0; i < 256; i++) code[i] = (float)(2.0 * uniform01() - 1.0);
  for (int i = 1; i < 256; i++) /* insertion sort */
    for (int j = i; j > 0 && code[j - 1] > code[j]; j--) {
      const float t = code[j];
      code[j] = code[j - 1], code[j - 1] = t;
    }
  const mf_code_lut *lut = mf_code_lut_get(code, 256, 0);
  CHECK(lut != NULL, "lookup table");
  if (!lut || !lut->arith) return;
  for (int k = 0; k < 200000; k++) {
    const float x = (float)(2.0 * uniform01() - 1.0);
    int amb;
    const int q = mf_code_lut_arith_index(lut, x, &amb);
    CHECK(amb || q == mf_optim_quantize(code, 256, x, 0), "random code at %.9g", (double)x);
  }
}

#ifdef MF_X86_SIMD
/* mf_code_lut_arith16 on 16 floats against the scalar form, lane by lane: the same
 * index and the same ambiguity, so the kernels' vector search is exactly the one the
 * build checked. */
MF_TARGET_AVX512 static void arith16_agrees(const mf_code_lut *lut, const float *x, int bits) {
  __mmask16 amb;
  int32_t q[16];
  _mm512_storeu_si512((void *)q, mf_code_lut_arith16(lut, _mm512_loadu_ps(x), &amb));
  for (int l = 0; l < 16; l++) {
    int amb1;
    const int q1 = mf_code_lut_arith_index(lut, x[l], &amb1);
    CHECK(((amb >> l) & 1) == amb1 && (amb1 || q[l] == q1),
          "%d-bit vector search at %.9g: %d (ambiguous %d), scalar %d (%d)", bits, (double)x[l], q[l],
          (amb >> l) & 1, q1, amb1);
  }
}
#endif

/* The AVX-512 form of the arithmetic search (the one the fused kernels run) equals the
 * scalar form for every 8-bit code the optimizers ship: around every threshold, at
 * every piece boundary (where ties are flagged), at +-0, +-1, denormals and at random,
 * with both signs in one vector. Skipped (and said) on a CPU without AVX-512. */
static void test_arith_vector_matches_scalar(int is_signed) {
#ifdef MF_X86_SIMD
  if (mf_cpu_isa() != ISA_AVX512) {
    printf("test_quant: no AVX-512 here, the vector search is not checked\n");
    return;
  }
  float code[256], x[16];
  mf_dynamic_map(code, 256, is_signed, 8, 7);
  const mf_code_lut *lut = mf_code_lut_get(code, 256, !is_signed);
  CHECK(lut != NULL && lut->arith, "8-bit arithmetic search");
  if (!lut || !lut->arith) return;
  int n = 0;
#define PUSH(v)                                      \
  do {                                               \
    x[n++] = (v);                                    \
    if (n == 16) arith16_agrees(lut, x, 8), n = 0;   \
  } while (0)
  for (int k = 0; k + 1 < 256; k++) {
    const uint32_t u = mf_f32_bits(0.5f * (code[k] + code[k + 1]));
    for (int d = -40; d <= 40; d++) {
      PUSH(mf_f32_from_bits(u + (uint32_t)d));
      PUSH(-mf_f32_from_bits(u + (uint32_t)d));
    }
  }
  for (int p = 0; p < MF_CODE_LUT_PIECES; p++) {
    if (isinf(lut->split[p])) continue;
    const uint32_t u = mf_f32_bits(lut->split[p]) & 0x7fffffffu;
    for (int d = -3; d <= 3; d++) {
      PUSH(mf_f32_from_bits(u + (uint32_t)d));
      PUSH(-mf_f32_from_bits(u + (uint32_t)d));
    }
  }
  const float specials[] = {0.0f, -0.0f, 1.0f, -1.0f, 1.0000001f, -1.0000001f, 0.99999994f, 1e-40f,
                            -1e-40f, 1.4e-45f, -1.4e-45f, 2.3283064e-10f, 1.5f, -1.9999999f};
  for (size_t k = 0; k < sizeof specials / sizeof specials[0]; k++) PUSH(specials[k]);
  for (int k = 0; k < 100000; k++) {
    float v = (float)(2.0 * uniform01() - 1.0);
    if (k % 3 == 0) v *= (float)pow(10.0, -9.0 * uniform01());
    PUSH(v);
  }
  while (n) PUSH(0.0f);
#undef PUSH
#else
  (void)is_signed;
#endif
}

static void test_round_trip(mf_dtype dt, int64_t bs, int64_t numel) {
  float code[256];
  mf_dynamic_map(code, 256, 1, 8, 7);
  size_t es = mf_dtype_size(dt);
  void *x = malloc((size_t)numel * es), *y = malloc((size_t)numel * es);
  uint8_t *codes = malloc((size_t)numel);
  int64_t nb = mf_quant_num_blocks(numel, bs);
  float *absmax = malloc((size_t)nb * sizeof(float));
  for (int64_t i = 0; i < numel; i++) mf_store_f32(x, i, dt, (float)normal01());
  mf_tensor tx = mf_cpu_tensor(x, numel, dt), tc = mf_cpu_tensor(code, 256, MF_FLOAT32),
            tq = mf_cpu_tensor(codes, numel, MF_UINT8), ta = mf_cpu_tensor(absmax, nb, MF_FLOAT32),
            ty = mf_cpu_tensor(y, numel, dt);
  mf_status st = mf_quantize_blockwise(&tx, &tc, &tq, &ta, bs, MF_ROUND_NEAREST, 0, NULL);
  CHECK(st == MF_OK, "quantize dt=%s bs=%lld: %s", mf_dtype_name(dt), (long long)bs, mf_last_error());
  st = mf_dequantize_blockwise(&tq, &ta, &tc, &ty, bs, NULL);
  CHECK(st == MF_OK, "dequantize: %s", mf_last_error());
  double err = 0.0;
  for (int64_t b = 0; b < nb; b++) {
    double m = 0.0;
    for (int64_t i = b * bs; i < numel && i < (b + 1) * bs; i++)
      m = fmax(m, fabs(mf_load_f32(x, i, dt)));
    CHECK((float)m == absmax[b], "absmax of block %lld: %g vs %g", (long long)b, m, (double)absmax[b]);
  }
  for (int64_t i = 0; i < numel; i++) {
    double xv = mf_load_f32(x, i, dt), yv = mf_load_f32(y, i, dt);
    err += fabs(xv - yv);
    int64_t b = i / bs;
    float xn = mf_block_normalize((float)mf_load_f32(x, i, dt), mf_absmax_scale(absmax[b]));
    CHECK(codes[i] == mf_quantize_nearest(code, xn), "code of element %lld", (long long)i);
  }
  err /= (double)numel;
  CHECK(err < 0.011, "mean abs error %g for dt=%s bs=%lld", err, mf_dtype_name(dt), (long long)bs);
  free(x); free(y); free(codes); free(absmax);
}

static void test_non_finite(void) {
  float code[256], x[300], y[300], absmax[3];
  uint8_t codes[300];
  mf_dynamic_map(code, 256, 1, 8, 7);
  for (int i = 0; i < 300; i++) x[i] = (float)normal01();
  x[5] = NAN;
  x[150] = INFINITY;
  mf_tensor tx = mf_cpu_tensor(x, 300, MF_FLOAT32), tc = mf_cpu_tensor(code, 256, MF_FLOAT32),
            tq = mf_cpu_tensor(codes, 300, MF_UINT8), ta = mf_cpu_tensor(absmax, 3, MF_FLOAT32),
            ty = mf_cpu_tensor(y, 300, MF_FLOAT32);
  CHECK(mf_quantize_blockwise(&tx, &tc, &tq, &ta, 128, MF_ROUND_NEAREST, 0, NULL) == MF_OK, "nan q");
  CHECK(isnan(absmax[0]) && isnan(absmax[1]) && isfinite(absmax[2]), "non-finite blocks get NaN absmax");
  CHECK(mf_dequantize_blockwise(&tq, &ta, &tc, &ty, 128, NULL) == MF_OK, "nan dq");
  for (int i = 0; i < 256; i++) CHECK(isnan(y[i]), "element %d of a bad block must be NaN", i);
  for (int i = 256; i < 300; i++) CHECK(isfinite(y[i]), "element %d of a good block must be finite", i);
}

static void test_errors(void) {
  float code[256], x[256], absmax[4];
  uint8_t codes[256];
  mf_dynamic_map(code, 256, 1, 8, 7);
  for (int i = 0; i < 256; i++) x[i] = (float)normal01();
  mf_tensor tx = mf_cpu_tensor(x, 256, MF_FLOAT32), tc = mf_cpu_tensor(code, 256, MF_FLOAT32),
            tq = mf_cpu_tensor(codes, 256, MF_UINT8), ta = mf_cpu_tensor(absmax, 4, MF_FLOAT32);
  struct { int64_t bs; const char *needle; } cases[] = {{100, "block_size"}, {32, "block_size"}, {8192, "block_size"}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    CHECK(mf_quantize_blockwise(&tx, &tc, &tq, &ta, cases[k].bs, MF_ROUND_NEAREST, 0, NULL) == MF_ERR_VALUE,
          "bs %lld must fail", (long long)cases[k].bs);
    CHECK(strstr(mf_last_error(), cases[k].needle) != NULL, "message: %s", mf_last_error());
  }
  mf_tensor short_code = mf_cpu_tensor(code, 100, MF_FLOAT32);
  CHECK(mf_quantize_blockwise(&tx, &short_code, &tq, &ta, 64, MF_ROUND_NEAREST, 0, NULL) == MF_ERR_VALUE,
        "short code must fail");
  CHECK(strstr(mf_last_error(), "code") != NULL, "message names code: %s", mf_last_error());
  mf_tensor bad_dtype = mf_cpu_tensor(x, 256, MF_UINT8);
  CHECK(mf_quantize_blockwise(&bad_dtype, &tc, &tq, &ta, 64, MF_ROUND_NEAREST, 0, NULL) == MF_ERR_TYPE,
        "uint8 input must be a type error");
  mf_tensor empty = mf_cpu_tensor(x, 0, MF_FLOAT32), no_codes = mf_cpu_tensor(codes, 0, MF_UINT8), no_absmax = mf_cpu_tensor(absmax, 0, MF_FLOAT32);
  CHECK(mf_quantize_blockwise(&empty, &tc, &no_codes, &no_absmax, 64, MF_ROUND_NEAREST, 0, NULL) == MF_ERR_VALUE,
        "empty input must fail");
  mf_tensor wrong_absmax = mf_cpu_tensor(absmax, 3, MF_FLOAT32);
  CHECK(mf_quantize_blockwise(&tx, &tc, &tq, &wrong_absmax, 64, MF_ROUND_NEAREST, 0, NULL) == MF_ERR_VALUE,
        "absmax of the wrong size must fail");
  mf_tensor on_gpu = tc;
  on_gpu.device = MF_CUDA;
  mf_status st = mf_quantize_blockwise(&tx, &on_gpu, &tq, &ta, 64, MF_ROUND_NEAREST, 0, NULL);
  CHECK(st == MF_ERR_VALUE && strstr(mf_last_error(), "same device"), "mixed devices: %s", mf_last_error());
  float unsorted[256];
  memcpy(unsorted, code, sizeof unsorted);
  unsorted[10] = 0.5f;
  mf_tensor tu = mf_cpu_tensor(unsorted, 256, MF_FLOAT32);
  CHECK(mf_quantize_blockwise(&tx, &tu, &tq, &ta, 64, MF_ROUND_NEAREST, 0, NULL) == MF_ERR_VALUE,
        "unsorted code must fail");
}

static void test_stochastic_unbiased(void) {
  float code[256];
  mf_dynamic_map(code, 256, 1, 8, 7);
  enum { N = 4096 };
  static float x[N], y[N];
  static uint8_t codes[N];
  float absmax[1];
  /* one block: absmax pins to 1.0, the rest sit between two code values */
  for (int i = 0; i < N; i++) x[i] = 0.3f;
  x[0] = 1.0f;
  mf_tensor tx = mf_cpu_tensor(x, N, MF_FLOAT32), tc = mf_cpu_tensor(code, 256, MF_FLOAT32),
            tq = mf_cpu_tensor(codes, N, MF_UINT8), ta = mf_cpu_tensor(absmax, 1, MF_FLOAT32),
            ty = mf_cpu_tensor(y, N, MF_FLOAT32);
  CHECK(mf_quantize_blockwise(&tx, &tc, &tq, &ta, 4096, MF_ROUND_STOCHASTIC, 42, NULL) == MF_OK, "sr");
  mf_dequantize_blockwise(&tq, &ta, &tc, &ty, 4096, NULL);
  double mean = 0.0;
  for (int i = 1; i < N; i++) mean += y[i];
  mean /= (N - 1);
  CHECK(fabs(mean - 0.3) < 2e-3, "stochastic rounding mean %g should be close to 0.3", mean);
}

int main(void) {
  test_maps();
  test_search_matches_exhaustive();
  test_lut_is_exact(1);
  test_lut_is_exact(0);
  for (int bits = 4; bits <= 8; bits += 4) {
    test_arith_search_is_exact(bits, 1);
    test_arith_search_is_exact(bits, 0);
  }
  test_arith_search_other_codes();
  test_arith_vector_matches_scalar(1);
  test_arith_vector_matches_scalar(0);
  mf_dtype dts[] = {MF_FLOAT32, MF_FLOAT16, MF_BFLOAT16};
  for (int d = 0; d < 3; d++)
    for (int64_t bs = 64; bs <= 4096; bs *= 2) test_round_trip(dts[d], bs, 3 * bs + 17);
  test_non_finite();
  test_errors();
  test_stochastic_unbiased();
  return check_exit("test_quant");
}
