/*
 * Every non-NaN float through the in-register 4-bit code search (mf_code_lut_search4_8,
 * csrc/core/code_lut_avx2.h) against the binary search (mf_quantize_nearest_n): all
 * 2^32 bit patterns for the two codes AdamW4bit ships, |x| < 2 for four more (the
 * signed linear and dynamic maps, sorted codes with repeated entries). Not part of the
 * build (a few minutes on 2 cores); tests/c/test_quant.c checks around every step point.
 *
 *   gcc -O2 -mavx2 -fopenmp -ffp-contract=off -Icsrc/include -Icsrc/core \
 *       benchmarks/c/exhaustive_search4.c csrc/core/code_lut.c csrc/core/quant_map.c \
 *       csrc/core/cpu_isa.c csrc/core/common.c -lm -o /tmp/exhaustive_search4
 *   /tmp/exhaustive_search4     # prints one line per code: "<code>: 0 bad"
 */
#include <stdio.h>
#include <stdlib.h>

#include "code_lut_avx2.h"
#include "memfit/quant.h"

/* Mismatches over the floats whose top 16 bits are hi, for every hi (|x| < 2 unless full). */
static long check(const float *code, int full) {
  const mf_code_lut *t = mf_code_lut_get(code, 16);
  if (!t) return -1;
  long bad = 0;
#pragma omp parallel for reduction(+ : bad) schedule(static)
  for (long hi = 0; hi < 65536; hi++) {
    if (!full && (hi & 0x7fff) >= 0x4000) continue;
    for (uint32_t lo = 0; lo < 65536; lo += 8) {
      const uint32_t w = ((uint32_t)hi << 16) + lo;
      const __m256i u = _mm256_add_epi32(_mm256_set1_epi32((int)w), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      int32_t q[8];
      _mm256_storeu_si256((__m256i *)q, mf_code_lut_search4_8(t, _mm256_castsi256_ps(u), _mm256_set1_ps(1.0f)));
      for (uint32_t i = 0; i < 8; i++) {
        const uint32_t v = w + i;
        if ((v & 0x7fffffffu) > 0x7f800000u) continue; /* NaN: callers never search it */
        const int want = mf_quantize_nearest_n(code, 16, mf_f32_from_bits(v));
        if (q[i] != want) {
          if (bad < 5) printf("  %08x: %d, binary search %d\n", v, q[i], want);
          bad++;
        }
      }
    }
  }
  return bad;
}

int main(void) {
  float c[16];
  mf_dynamic_map(c, 16, 1, 4, 3);
  printf("dynamic signed 4-bit (AdamW4bit state1), every float: %ld bad\n", check(c, 1));
  for (int k = 0; k < 16; k++) c[k] = (float)(k + 1) / 16.0f;
  printf("linear k/16 (AdamW4bit state2), every float: %ld bad\n", check(c, 1));
  mf_linear_map(c, 16, 1, 4);
  printf("linear signed, |x| < 2: %ld bad\n", check(c, 0));
  mf_dynamic_map(c, 16, 0, 4, 3);
  printf("dynamic unsigned 4-bit, |x| < 2: %ld bad\n", check(c, 0));
  srand(7);
  for (int r = 0; r < 3; r++) { /* sorted codes with repeated entries */
    for (int k = 0; k < 16; k++) c[k] = (float)((rand() % 9) - 4) / 4.0f * (r == 2 ? 0.37f : 1.0f);
    for (int i = 1; i < 16; i++)
      for (int j = i; j > 0 && c[j] < c[j - 1]; j--) {
        const float x = c[j];
        c[j] = c[j - 1];
        c[j - 1] = x;
      }
    printf("random sorted code %d, |x| < 2: %ld bad\n", r, check(c, 0));
  }
  return 0;
}
