/* Private to the core: the AVX-512 form of the code search of code_lut.h, inlined
 * into the kernels that use it (code_lut.c, optim_avx512.c). */
#ifndef MEMFIT_CODE_LUT_AVX512_H
#define MEMFIT_CODE_LUT_AVX512_H

#include "code_lut.h"
#include "cpu_isa.h"

#ifdef MF_X86_SIMD
#include <immintrin.h>

/* 16 floats x * inv -> 16 sums entry[key >> 16] + key: the code index is byte 2 of
 * each (a byte permute can pick it directly); bit 31 is set in the sums of slow
 * buckets. */
MF_TARGET_AVX512 static inline __m512i mf_code_lut_sum16(const mf_code_lut *t, __m512 x, __m512 inv) {
  const __m512i u = _mm512_castps_si512(_mm512_mul_ps(x, inv));
  /* key = u ^ (sign ? 0xffffffff : 0x80000000): A ^ (B | C) */
  const __m512i key = _mm512_ternarylogic_epi32(u, _mm512_srai_epi32(u, 31),
                                                _mm512_set1_epi32((int)0x80000000u), 0x1e);
  const __m512i e = _mm512_i32gather_epi32(_mm512_srli_epi32(key, 16), (const void *)t->entry, 4);
  return _mm512_add_epi32(e, key);
}

/* 16 floats x * inv -> 16 code indices as bytes; the vector form of
 * mf_code_lut_quantize. *slow collects the sums (bit 31: a bucket that needs the
 * binary search). NaN maps to 0, as in the binary search (only the public search sees
 * any: optimizer states are finite, and the optimizer kernels use mf_code_lut_sum16). */
MF_TARGET_AVX512 static inline __m128i mf_code_lut_quantize16(const mf_code_lut *t, __m512 x,
                                                              __m512 inv, __m512i *slow) {
  const __m512i sum = mf_code_lut_sum16(t, x, inv);
  *slow = _mm512_or_si512(*slow, sum);
  const __m512i a = _mm512_and_si512(_mm512_castps_si512(_mm512_mul_ps(x, inv)),
                                     _mm512_set1_epi32(0x7fffffff));
  const __mmask16 not_nan = _mm512_cmple_epu32_mask(a, _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi8(_mm512_maskz_mov_epi32(not_nan, _mm512_srli_epi32(sum, 16)));
}

#endif /* MF_X86_SIMD */
#endif /* MEMFIT_CODE_LUT_AVX512_H */
