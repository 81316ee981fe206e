/*
 * The fused CPU optimizer step (optim_fused.h) for AVX2 CPUs (Haswell to Alder Lake,
 * Zen 1-3): 8 lanes, table gathers to dequantize 8-bit codes, two permutes and a blend
 * for the 16-entry 4-bit code, and mf_code_lut_sum8 as the code search.
 */
#include "code_lut_avx2.h"
#include "optim_cpu.h"

#ifdef MF_X86_SIMD
#include <string.h>

#define FUSED_TARGET MF_TARGET_AVX2
#define FUSED8_ENTRY mf_optim_fused8_avx2
#define FUSED4_ENTRY mf_optim_fused4_avx2

typedef __m256i fused_acc;

MF_TARGET_AVX2 static inline fused_acc acc_zero(void) { return _mm256_setzero_si256(); }

/* max over the |bit patterns| of 64 floats, folded into m */
MF_TARGET_AVX2 static inline fused_acc acc_absmax64(fused_acc m, const float *s) {
  const __m256i mask = _mm256_set1_epi32(0x7fffffff);
  for (int k = 0; k < 8; k++)
    m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(s + 8 * k)), mask));
  return m;
}

MF_TARGET_AVX2 static inline uint32_t acc_max(fused_acc m) {
  __m128i x = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  x = _mm_max_epu32(x, _mm_shuffle_epi32(x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = _mm_max_epu32(x, _mm_shuffle_epi32(x, _MM_SHUFFLE(2, 3, 0, 1)));
  return (uint32_t)_mm_cvtsi128_si32(x);
}

static inline void tables_init(thread_bufs *b, const quant_ctx *qc, int ns) {
  (void)b, (void)qc, (void)ns;
}

MF_TARGET_AVX2 static inline void dequant64_8(const thread_bufs *b, int k, const float *code,
                                              const uint8_t *q, float absmax, float *out) {
  (void)b, (void)k;
  const __m256 a = _mm256_set1_ps(absmax);
  for (int v = 0; v < 64; v += 8) {
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + v)));
    _mm256_storeu_ps(out + v, _mm256_mul_ps(_mm256_i32gather_ps(code, idx, 4), a));
  }
}

/* 4-bit states: 64 elements are 32 bytes, element 2i in the low nibble of byte i. The
 * 16-entry code is two registers: a permute in each, and the index's bit 3 picks. */
MF_TARGET_AVX2 static inline void dequant64_4(const float *code, const uint8_t *q, float absmax,
                                              float *out) {
  const __m256 lo = _mm256_loadu_ps(code), hi = _mm256_loadu_ps(code + 8), a = _mm256_set1_ps(absmax);
  const __m128i low4 = _mm_set1_epi8(15);
  for (int v = 0; v < 64; v += 16) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + v / 2));
    const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(bytes, low4),
                                          _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
    for (int h = 0; h < 2; h++) {
      const __m256i idx = _mm256_cvtepu8_epi32(h ? _mm_srli_si128(nib, 8) : nib);
      const __m256 pick_hi = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)); /* bit 3 -> sign */
      const __m256 x = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx),
                                        _mm256_permutevar8x32_ps(hi, idx), pick_hi);
      _mm256_storeu_ps(out + v + 8 * h, _mm256_mul_ps(x, a));
    }
  }
}

/* 32 floats s * inv -> 32 code indices: bytes (bits 8), or nibbles, element 2i in the
 * low nibble of byte i (bits 4) */
MF_TARGET_AVX2 static inline void quantize32(const mf_code_lut *lut, const float *s, float inv,
                                             int bits, uint8_t *out) {
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int v = 0; v < 32; v += 8) {
    const __m128i q = mf_code_lut_bytes8(mf_code_lut_sum8(lut, _mm256_loadu_ps(s + v), vinv));
    if (bits == 8) {
      _mm_storel_epi64((__m128i *)(out + v), q);
    } else {
      const __m128i pairs = _mm_maddubs_epi16(q, _mm_set1_epi16(0x1001)); /* q[2i] + 16 q[2i+1] */
      const int packed = _mm_cvtsi128_si32(_mm_packus_epi16(pairs, pairs));
      memcpy(out + v / 2, &packed, 4);
    }
  }
}

#include "optim_fused.h"

#endif /* MF_X86_SIMD */
