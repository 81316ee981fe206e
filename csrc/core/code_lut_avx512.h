/* Private to the core: the AVX-512 form of the code search of code_lut.h, inlined
 * into the kernels that use it (code_lut.c, optim_avx512.c). */
#ifndef MEMFIT_CODE_LUT_AVX512_H
#define MEMFIT_CODE_LUT_AVX512_H

#include "code_lut.h"
#include "cpu_isa.h"

#ifdef MF_X86_SIMD
#include <immintrin.h>

/* 16 floats x * inv -> 16 code indices; the vector form of mf_code_lut_quantize.
 * *slow collects the entries, to find buckets that need the binary search. NaN input
 * (only the public search sees any: optimizer states are finite) maps to 0 when
 * check_nan is set. */
MF_TARGET_AVX512 static inline __m128i mf_code_lut_quantize16(const mf_code_lut *t, __m512 x,
                                                          __m512 inv, __m512i *slow,
                                                          const int check_nan) {
  const __m512i u = _mm512_castps_si512(_mm512_mul_ps(x, inv));
  const __m512i neg = _mm512_srai_epi32(u, 31); /* all ones for negative x */
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i clamped_abs = _mm512_min_epu32(_mm512_max_epu32(a, _mm512_set1_epi32((int)t->min_abs)),
                                               _mm512_set1_epi32((int)MF_CODE_LUT_MAX_ABS));
  /* sign of u, magnitude of clamped_abs (ternary-logic bit select: C ? A : B) */
  const __m512i clamped = _mm512_ternarylogic_epi32(u, clamped_abs, _mm512_set1_epi32((int)0x80000000u), 0xe4);
  const __m512i bucket = _mm512_sub_epi32(_mm512_srli_epi32(clamped, 16), _mm512_set1_epi32((int)t->bucket0));
  const __m512i e = _mm512_i32gather_epi32(bucket, (const void *)t->entry, 4);
  /* pos = (clamped ^ neg) & 0xffff */
  const __m512i pos = _mm512_ternarylogic_epi32(clamped, neg, _mm512_set1_epi32(0xffff), 0x28);
  if (t->has_slow) *slow = _mm512_or_si512(*slow, e);
  __m512i q = _mm512_srli_epi32(_mm512_add_epi32(e, pos), 17);
  if (check_nan)
    q = _mm512_maskz_mov_epi32(_mm512_cmple_epu32_mask(a, _mm512_set1_epi32(0x7f800000)), q);
  return _mm512_cvtepi32_epi8(q);
}

#endif /* MF_X86_SIMD */
#endif /* MEMFIT_CODE_LUT_AVX512_H */
