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

/* The arithmetic search of code_lut.h (t->arith) on 16 floats x (already times inv):
 * the code indices as dwords, exactly mf_code_lut_arith_index's, and in *amb the lanes
 * where that is not to be used. No memory but the piece tables (permutes). */
MF_TARGET_AVX512 static inline __m512i mf_code_lut_arith16(const mf_code_lut *t, __m512 x,
                                                           __mmask16 *amb) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i au = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512 ax = _mm512_castsi512_ps(au);
  /* the segment: exponent clamped to [EXP0, EXP0 + 31]; the permute uses its low 5 bits */
  const __m512i seg = _mm512_min_epi32(_mm512_max_epi32(_mm512_srli_epi32(au, 23),
                                                        _mm512_set1_epi32(MF_CODE_LUT_EXP0)),
                                       _mm512_set1_epi32(MF_CODE_LUT_EXP0 + 31));
  __m512i p = _mm512_permutex2var_epi32(_mm512_load_si512(t->piece_lo), seg,
                                        _mm512_load_si512(t->piece_lo + 16));
  const __m512 split = _mm512_permutexvar_ps(p, _mm512_load_ps(t->split));
  const __mmask16 up = _mm512_cmp_ps_mask(ax, split, _CMP_GT_OQ);
  const __mmask16 at_split = _mm512_cmpeq_epi32_mask(au, _mm512_castps_si512(split));
  p = _mm512_mask_add_epi32(p, up, p, _mm512_set1_epi32(1));
  const __m512 v = _mm512_fmadd_ps(ax, _mm512_permutexvar_ps(p, _mm512_load_ps(t->pa)),
                                   _mm512_permutexvar_ps(p, _mm512_load_ps(t->pc)));
  /* (v < phi ? v : phi, as the scalar form) */
  const __m512i ti = _mm512_cvt_roundps_epi32(_mm512_min_ps(v, _mm512_permutexvar_ps(p, _mm512_load_ps(t->phi))),
                                              _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  *amb = _mm512_testn_epi32_mask(_mm512_add_epi32(ti, _mm512_set1_epi32(1)),
                                 _mm512_set1_epi32(MF_CODE_LUT_FRAC - 2)) | at_split;
  __m512i q = _mm512_srai_epi32(ti, MF_CODE_LUT_FRAC_BITS);
  q = _mm512_mask_sub_epi32(q, _mm512_movepi32_mask(u), _mm512_set1_epi32(t->mirror), q);
  return _mm512_max_epi32(q, _mm512_setzero_si512());
}

/* The 16-entry code search by its threshold tree (mf_code_lut.tree4): 16 floats x
 * (already times inv) -> their code indices as dwords, exact, four compares each. */
MF_TARGET_AVX512 static inline __m512i mf_code_lut_tree4_16(const mf_code_lut *t, __m512 x) {
  const __m512 tree = _mm512_load_ps(t->tree4);
  const __m512i one = _mm512_set1_epi32(1);
  __m512i n = one;
  for (int d = 0; d < 4; d++) {
    const __mmask16 up = _mm512_cmp_ps_mask(x, _mm512_permutexvar_ps(n, tree), _CMP_GE_OQ);
    n = _mm512_add_epi32(n, n);
    n = _mm512_mask_add_epi32(n, up, n, one);
  }
  return _mm512_sub_epi32(n, _mm512_set1_epi32(16));
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
