/* Private to the core: the AVX2 form of the code search of code_lut.h, inlined into
 * the kernels that use it (code_lut.c, optim_avx2.c). */
#ifndef MEMFIT_CODE_LUT_AVX2_H
#define MEMFIT_CODE_LUT_AVX2_H

#include "code_lut.h"
#include "cpu_isa.h"

#ifdef MF_X86_SIMD
#include <immintrin.h>

/* The keys of 8 floats x * inv (code_lut.h: the bit patterns in the order of the values). */
MF_TARGET_AVX2 static inline __m256i mf_code_lut_key8(__m256 x, __m256 inv) {
  const __m256i u = _mm256_castps_si256(_mm256_mul_ps(x, inv));
  return _mm256_xor_si256(u, _mm256_or_si256(_mm256_srai_epi32(u, 31),
                                             _mm256_set1_epi32((int)0x80000000u)));
}

/* The AVX2 form of mf_code_lut_sum16 (code_lut_avx512.h): 8 floats x * inv -> 8 sums
 * entry[key >> 16] + key, with an 8-lane gather. */
MF_TARGET_AVX2 static inline __m256i mf_code_lut_sum8(const mf_code_lut *t, __m256 x, __m256 inv) {
  const __m256i key = mf_code_lut_key8(x, inv);
  const __m256i e = _mm256_i32gather_epi32((const int *)t->entry, _mm256_srli_epi32(key, 16), 4);
  return _mm256_add_epi32(e, key);
}

/* The same sums as mf_code_lut_sum8 from the keys, with eight scalar table loads instead
 * of a gather: the keys go through memory as four 64-bit words (one load per two
 * buckets, no vpextrd, which costs 2 uops on Zen) and the entries come back by inserts.
 * On AMD Zen 1/2 an 8-lane gather is microcoded and this is faster (measured: 5.1 vs
 * 9.2 ns per 8, benchmarks/history/2026-11-24-optim-amd-epyc-search-by-loads.md); on Intel and Zen 3/4 the gather is
 * (optim_avx2.c measures which; quant.c always loads). */
MF_TARGET_AVX2 static inline __m256i mf_code_lut_sum8_loads(const mf_code_lut *t, __m256i key) {
  uint64_t k[4];
  _mm256_storeu_si256((__m256i *)k, key);
  const uint32_t *e = t->entry;
  const __m128i lo = _mm_setr_epi32((int)e[(uint32_t)k[0] >> 16], (int)e[k[0] >> 48],
                                    (int)e[(uint32_t)k[1] >> 16], (int)e[k[1] >> 48]);
  const __m128i hi = _mm_setr_epi32((int)e[(uint32_t)k[2] >> 16], (int)e[k[2] >> 48],
                                    (int)e[(uint32_t)k[3] >> 16], (int)e[k[3] >> 48]);
  return _mm256_add_epi32(_mm256_set_m128i(hi, lo), key);
}

/* The AVX2 form of mf_code_lut_tree4_16 (code_lut_avx512.h): 8 floats x (already times
 * inv) -> their code indices (16-entry code) as dwords. Nodes 1-7 of the tree fill one
 * register and nodes 8-15 the other, so each level is one permute. */
MF_TARGET_AVX2 static inline __m256i mf_code_lut_tree4_8(const mf_code_lut *t, __m256 x) {
  const __m256 top = _mm256_load_ps(t->tree4), leaves = _mm256_load_ps(t->tree4 + 8);
  __m256i n = _mm256_set1_epi32(1);
  for (int d = 0; d < 4; d++) {
    const __m256 thr = _mm256_permutevar8x32_ps(d < 3 ? top : leaves, n);
    /* n = 2n + (x >= thr): the compare's all-ones lanes are -1 */
    n = _mm256_sub_epi32(_mm256_add_epi32(n, n), _mm256_castps_si256(_mm256_cmp_ps(x, thr, _CMP_GE_OQ)));
  }
  return _mm256_sub_epi32(n, _mm256_set1_epi32(16));
}

/* The code indices of 8 sums (byte 2 of each) in the low 8 bytes: to bytes 0-3 of each
 * 128-bit lane, then the two lanes together. */
MF_TARGET_AVX2 static inline __m128i mf_code_lut_bytes8(__m256i sum) {
  const __m256i pick = _mm256_setr_epi8(2, 6, 10, 14, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        2, 6, 10, 14, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i b = _mm256_shuffle_epi8(sum, pick);
  return _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
}

/* The code indices of 32 sums (byte 2 of each; 4-bit codes, so below 16) as 16 bytes of
 * nibbles, index 2i in the low nibble of byte i. The packs work within 128-bit lanes:
 * the dwords are put back in order before the pairs are joined. */
MF_TARGET_AVX2 static inline __m128i mf_code_lut_nibbles32(__m256i s0, __m256i s1, __m256i s2,
                                                           __m256i s3) {
  const __m256i lo = _mm256_packs_epi32(_mm256_srli_epi32(s0, 16), _mm256_srli_epi32(s1, 16));
  const __m256i hi = _mm256_packs_epi32(_mm256_srli_epi32(s2, 16), _mm256_srli_epi32(s3, 16));
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(lo, hi),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  const __m256i pairs = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x1001)); /* q[2i] + 16 q[2i+1] */
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi16(pairs, pairs), 0x08));
}

/* The AVX2 form of mf_code_lut_quantize16: 8 floats x * inv -> 8 code indices (in the
 * low 8 bytes), by scalar table loads (the form that is fastest where gathers are slow,
 * and not far behind elsewhere); *slow collects the sums (bit 31: a bucket that needs
 * the binary search), and NaN maps to 0, as in the binary search. */
MF_TARGET_AVX2 static inline __m128i mf_code_lut_quantize8(const mf_code_lut *t, __m256 x,
                                                           __m256 inv, __m256i *slow) {
  const __m256i sum = mf_code_lut_sum8_loads(t, mf_code_lut_key8(x, inv));
  *slow = _mm256_or_si256(*slow, sum);
  /* NaN: |bits| above Inf's */
  const __m256i a = _mm256_andnot_si256(_mm256_set1_epi32((int)0x80000000u),
                                        _mm256_castps_si256(_mm256_mul_ps(x, inv)));
  return mf_code_lut_bytes8(_mm256_and_si256(sum, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f800001), a)));
}

#endif /* MF_X86_SIMD */
#endif /* MEMFIT_CODE_LUT_AVX2_H */
