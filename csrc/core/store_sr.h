/*
 * Private to the core: the stochastic-rounding store of bfloat16 and float16 parameters
 * in the CPU optimizer step (store_params, optim_cpu.h), written by hand for AVX2 and
 * for baseline x86-64 (SSE2). The same bits as the scalar loops they replace there:
 *     out[i] = mf_f32_to_bf16_sr(v[i], (uint32_t)mf_hash64_mix(z0 + i * MF_HASH64_STEP))
 *     out[i] = mf_f32_to_f16_sr(v[i], mf_hash64_mix(z0 + i * MF_HASH64_STEP))
 *
 * Why by hand. mf_hash64_mix (numeric.h, shared with the GPU, so its definition cannot
 * change) is two 64-bit multiplies. AVX2 and SSE2 have no 64-bit multiply: GCC's vector
 * form of the loop spent three vpmuludq, shifts and adds on each, and more again
 * packing 64-bit lanes into 16-bit outputs, so the stochastic-rounding step cost
 * 1.7-1.9x the nearest-even one on AVX2 and 1.4-2.0x on the generic kernel (AVX-512 has
 * vpmullq and GCC's loop meets issue 40's 1.3x there; benchmarks/RESULTS.md,
 * "Stochastic-rounding store per kernel variant"). What the hand-written form uses:
 *  - bf16 compares only bits 0..15 of the hash (mf_f32_to_bf16_sr), and those are
 *    bits 0..15 and 31..46 of the second product z2 = y * C2 (the last step is
 *    z2 ^ (z2 >> 31)). Bits 0..46 of a product need lo32(y) * lo32(C2) in full (one
 *    vpmuludq) plus the two cross products only modulo 2^16 at bit 32:
 *    (y.w2 * c.w0 + y.w0 * c.w2) mod 2^16 (w: 16-bit words), which one vpmaddwd gives
 *    (its signed products agree with the unsigned ones modulo 2^16) once a byte shuffle
 *    has put y.w2 and y.w0 side by side. Bits 48..63 of z2 come out wrong and are never
 *    read.
 *  - The first product is needed in full (z1's bits 27..63 reach y's low bits): AVX2
 *    takes both cross products in one vpmulld (their low 32 bits are all that count),
 *    SSE2 (no vpmulld) three pmuludq.
 *  - Elements 0, 1 (4, 5) and 2, 3 (6, 7) go to two hash vectors, so that one shufps
 *    puts the low 32 bits of their lanes in element order: no packing of 64-bit lanes.
 *  - The rounding is an add and a shift (sr_round8_avx2). NaN, infinities and values
 *    near them (bf16 magnitude 0x7f7f and up: |x| >= 0x1.fep127) are noted as the loop
 *    goes (no branch) and, if any was seen, the call's elements are all stored again
 *    by the scalar form: rare (a diverged model), and exact either way.
 *  - float16 (sr_round8_f16_avx2) uses the hash's bits 0..12 in its normal range; its
 *    subnormals draw up to 63 bits and take the scalar form, per group.
 * tests/c/test_store_sr.c compares these loops with the scalar definition bit for bit
 * (lengths, tails, special values); the ISA-variant tests of tests/test_optim.py compare
 * whole steps; benchmarks/c/mca_optim.c models the loops.
 */
#ifndef MEMFIT_STORE_SR_H
#define MEMFIT_STORE_SR_H

#include <stdint.h>

#include "cpu_isa.h"
#include "mca_mark.h"
#include "memfit/cast.h"
#include "memfit/numeric.h"

#define SR_C1 0xbf58476d1ce4e5b9ull /* mf_hash64_mix's two multipliers */
#define SR_C2 0x94d049bb133111ebull

/* The scalar form over [i, n): the reference, the tails and the special values. */
static inline MF_HOST_INLINE void sr_store_bf16_scalar(const float *restrict v, int64_t i, int64_t n,
                                                       uint64_t z0, uint16_t *restrict out) {
  uint64_t z = z0 + MF_HASH64_STEP * (uint64_t)i;
  for (; i < n; i++, z += MF_HASH64_STEP) out[i] = mf_f32_to_bf16_sr(v[i], (uint32_t)mf_hash64_mix(z));
}

/* The same for float16 parameters (mf_f32_to_f16_sr takes up to 64 bits of the hash). */
static inline MF_HOST_INLINE void sr_store_f16_scalar(const float *restrict v, int64_t i, int64_t n,
                                                      uint64_t z0, uint16_t *restrict out) {
  uint64_t z = z0 + MF_HASH64_STEP * (uint64_t)i;
  for (; i < n; i++, z += MF_HASH64_STEP) out[i] = mf_f32_to_f16_sr(v[i], mf_hash64_mix(z));
}

#ifdef MF_X86_SIMD
#include <immintrin.h>

/* ---- AVX2: 16 elements per iteration, four hash vectors of 4 lanes ---------------- */

/* Bits 0..15 of mf_hash64_mix(z) in bits 0..15 of each 64-bit lane (bits 16..63: other
 * values, never read). */
MF_TARGET_AVX2 static inline MF_HOST_INLINE __m256i sr_mix16_avx2(__m256i z) {
  const __m256i c1 = _mm256_set1_epi64x((long long)SR_C1);
  /* C1 with its 32-bit halves swapped: lane (lo, hi) of x times it = (lo(x) * hi(C1),
   * hi(x) * lo(C1)) modulo 2^32, the two cross products */
  const __m256i c1x = _mm256_set1_epi64x((long long)((SR_C1 << 32) | (SR_C1 >> 32)));
  const __m256i hi32 = _mm256_set1_epi64x((long long)0xffffffff00000000ull);
  const __m256i c2 = _mm256_set1_epi64x((long long)SR_C2);
  /* words 2 and 3 of each lane: C2's words 0 and 2 (multiplying y's words 2 and 0) */
  const __m256i c2w = _mm256_set1_epi64x((long long)((SR_C2 & 0xffffull) << 32 |
                                                     ((SR_C2 >> 32) & 0xffffull) << 48));
  /* y's words (0, 1, 2, 0) per lane: word 3 <- word 0 */
  const __m256i w20 = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 0, 1, 8, 9, 10, 11, 12, 13, 8, 9,
                                       0, 1, 2, 3, 4, 5, 0, 1, 8, 9, 10, 11, 12, 13, 8, 9);
  const __m256i x = _mm256_xor_si256(z, _mm256_srli_epi64(z, 30));
  const __m256i cross = _mm256_mullo_epi32(x, c1x);
  const __m256i z1 = _mm256_add_epi64(
      _mm256_mul_epu32(x, c1),
      _mm256_and_si256(_mm256_add_epi64(cross, _mm256_slli_epi64(cross, 32)), hi32));
  const __m256i y = _mm256_xor_si256(z1, _mm256_srli_epi64(z1, 27));
  const __m256i z2 = _mm256_add_epi64(_mm256_mul_epu32(y, c2),
                                      _mm256_madd_epi16(_mm256_shuffle_epi8(y, w20), c2w));
  return _mm256_xor_si256(z2, _mm256_srli_epi64(z2, 31));
}

/* 8 floats (their bits u) and their 8 random numbers (bits 0..15 of r) -> the 8 bf16
 * values, sign-extended to 32-bit lanes, as mf_f32_to_bf16_sr gives them for
 * |x| < 0x1.fe8p127 (bf16 magnitudes below 0x7f7f: the largest finite one); `big` keeps
 * the running max of 2|u| as bits, to find the rest afterwards. In mf_f32_to_bf16_sr,
 * up = (a & 0xffff) > (r & 0xffff) and the result is sign | (a >> 16) + up: that is
 * (u + (~r & 0xffff)) >> 16, the carry out of the low 16 bits being up (and below the
 * threshold it never reaches the sign, nor 0x7f80: no clamp to the largest finite value
 * is needed). */
MF_TARGET_AVX2 static inline MF_HOST_INLINE __m256i sr_round8_avx2(__m256i u, __m256i r, __m256i *big) {
  *big = _mm256_max_epu32(*big, _mm256_slli_epi32(u, 1));
  return _mm256_srai_epi32(_mm256_add_epi32(u, _mm256_andnot_si256(r, _mm256_set1_epi32(0xffff))), 16);
}

/* 2 |x| as bits, at or above it: the element is NaN, an infinity, or rounds near them */
#define SR_BIG2 0xfefe0000u

MF_TARGET_AVX2 static inline MF_HOST_INLINE void sr_store_bf16_avx2(const float *restrict v, int64_t n, uint64_t z0,
                                                     uint16_t *restrict out) {
  const uint64_t s = MF_HASH64_STEP;
  const __m256i step = _mm256_set1_epi64x((long long)(16u * s));
  /* lanes: a = elements 0, 1, 4, 5; b = 2, 3, 6, 7 (one shufps then puts the 8 numbers
   * in element order); c, d: the same + 8 */
  __m256i za = _mm256_add_epi64(_mm256_set1_epi64x((long long)z0),
                                _mm256_setr_epi64x(0, (long long)s, (long long)(4u * s), (long long)(5u * s)));
  __m256i zb = _mm256_add_epi64(za, _mm256_set1_epi64x((long long)(2u * s)));
  __m256i zc = _mm256_add_epi64(za, _mm256_set1_epi64x((long long)(8u * s)));
  __m256i zd = _mm256_add_epi64(za, _mm256_set1_epi64x((long long)(10u * s)));
  __m256i big = _mm256_setzero_si256();
  int64_t i = 0;
  MF_MCA_BEGIN("store_bf16_sr_avx2_hand elems=16 isa=avx2");
  for (; i + 16 <= n; i += 16) {
    /* the low 32 bits of each lane, a's then b's per 128-bit half: elements 0..7 */
    const __m256i r0 = _mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(sr_mix16_avx2(za)),
                                                             _mm256_castsi256_ps(sr_mix16_avx2(zb)),
                                                             _MM_SHUFFLE(2, 0, 2, 0)));
    const __m256i r1 = _mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(sr_mix16_avx2(zc)),
                                                             _mm256_castsi256_ps(sr_mix16_avx2(zd)),
                                                             _MM_SHUFFLE(2, 0, 2, 0)));
    za = _mm256_add_epi64(za, step);
    zb = _mm256_add_epi64(zb, step);
    zc = _mm256_add_epi64(zc, step);
    zd = _mm256_add_epi64(zd, step);
    const __m256i h0 = sr_round8_avx2(_mm256_loadu_si256((const __m256i *)(v + i)), r0, &big);
    const __m256i h1 = sr_round8_avx2(_mm256_loadu_si256((const __m256i *)(v + i + 8)), r1, &big);
    /* 16 x 32 -> 16 x 16 (signed 16-bit values: exact), lanes back in order */
    _mm256_storeu_si256((__m256i *)(out + i),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(h0, h1), 0xd8));
  }
  MF_MCA_END();
  /* a NaN, an infinity or a value near them in the vector part: all of it again, by the
   * scalar form */
  const __m256i thr = _mm256_set1_epi32((int)SR_BIG2);
  const int any_big = !_mm256_testz_si256(_mm256_cmpeq_epi32(_mm256_max_epu32(big, thr), big),
                                          _mm256_set1_epi32(-1));
  sr_store_bf16_scalar(v, any_big ? 0 : i, n, z0, out);
}

/* float16, 8 lanes: mf_f32_to_f16_sr where it needs no more than the hash's bits 0..12:
 * the normal float16 range below the overflow threshold (0x38800000 <= a < 0x477fe000,
 * 13 bits dropped: the add-and-shift of sr_round8_avx2 on a - 0x38000000, never
 * reaching 0x7c00) and |x| < 2^-64 (a < 0x1f800000: the sign alone). `odd` gets the
 * other lanes: float16 subnormals (which draw up to 63 bits), NaN, infinities,
 * overflow. Subnormals are common (|x| < 6.1e-5), so a group with one is stored by the
 * scalar form on its own, not the whole call. */
MF_TARGET_AVX2 static inline MF_HOST_INLINE __m256i sr_round8_f16_avx2(__m256i u, __m256i r, __m256i *odd) {
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i rebased = _mm256_sub_epi32(a, _mm256_set1_epi32(0x38000000));
  const __m256i h = _mm256_srli_epi32(_mm256_add_epi32(rebased, _mm256_andnot_si256(r, _mm256_set1_epi32(0x1fff))), 13);
  const __m256i tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x1f800000), a);
  const __m256i normal = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x00800000), rebased),
                                             _mm256_cmpgt_epi32(_mm256_set1_epi32(0x0f7fe000), rebased));
  *odd = _mm256_or_si256(*odd, _mm256_andnot_si256(_mm256_or_si256(tiny, normal), _mm256_set1_epi32(-1)));
  return _mm256_or_si256(_mm256_andnot_si256(tiny, h), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)));
}

MF_TARGET_AVX2 static inline MF_HOST_INLINE void sr_store_f16_avx2(const float *restrict v, int64_t n, uint64_t z0,
                                                                   uint16_t *restrict out) {
  const uint64_t s = MF_HASH64_STEP;
  const __m256i step = _mm256_set1_epi64x((long long)(16u * s));
  __m256i za = _mm256_add_epi64(_mm256_set1_epi64x((long long)z0),
                                _mm256_setr_epi64x(0, (long long)s, (long long)(4u * s), (long long)(5u * s)));
  __m256i zb = _mm256_add_epi64(za, _mm256_set1_epi64x((long long)(2u * s)));
  __m256i zc = _mm256_add_epi64(za, _mm256_set1_epi64x((long long)(8u * s)));
  __m256i zd = _mm256_add_epi64(za, _mm256_set1_epi64x((long long)(10u * s)));
  int64_t i = 0;
  MF_MCA_BEGIN("store_f16_sr_avx2_hand elems=16 isa=avx2");
  for (; i + 16 <= n; i += 16) {
    const __m256i r0 = _mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(sr_mix16_avx2(za)),
                                                             _mm256_castsi256_ps(sr_mix16_avx2(zb)),
                                                             _MM_SHUFFLE(2, 0, 2, 0)));
    const __m256i r1 = _mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(sr_mix16_avx2(zc)),
                                                             _mm256_castsi256_ps(sr_mix16_avx2(zd)),
                                                             _MM_SHUFFLE(2, 0, 2, 0)));
    za = _mm256_add_epi64(za, step);
    zb = _mm256_add_epi64(zb, step);
    zc = _mm256_add_epi64(zc, step);
    zd = _mm256_add_epi64(zd, step);
    __m256i odd = _mm256_setzero_si256();
    const __m256i h0 = sr_round8_f16_avx2(_mm256_loadu_si256((const __m256i *)(v + i)), r0, &odd);
    const __m256i h1 = sr_round8_f16_avx2(_mm256_loadu_si256((const __m256i *)(v + i + 8)), r1, &odd);
    if (__builtin_expect(!_mm256_testz_si256(odd, odd), 0)) sr_store_f16_scalar(v, i, i + 16, z0, out);
    else _mm256_storeu_si256((__m256i *)(out + i), _mm256_permute4x64_epi64(_mm256_packus_epi32(h0, h1), 0xd8));
  }
  MF_MCA_END();
  sr_store_f16_scalar(v, i, n, z0, out);
}

/* ---- SSE2 (baseline x86-64): 8 elements per iteration, four vectors of 2 lanes ---- */

static inline MF_HOST_INLINE __m128i sr_mix16_sse2(__m128i z) {
  const __m128i c1 = _mm_set1_epi64x((long long)SR_C1), c1hi = _mm_set1_epi64x((long long)(SR_C1 >> 32));
  const __m128i c2 = _mm_set1_epi64x((long long)SR_C2);
  const __m128i c2w = _mm_set1_epi64x((long long)((SR_C2 & 0xffffull) << 32 |
                                                  ((SR_C2 >> 32) & 0xffffull) << 48));
  const __m128i x = _mm_xor_si128(z, _mm_srli_epi64(z, 30));
  /* x * C1 modulo 2^64 from 32 x 32 -> 64-bit products (no pmulld before SSE4.1) */
  const __m128i cross = _mm_add_epi64(_mm_mul_epu32(_mm_srli_epi64(x, 32), c1), _mm_mul_epu32(x, c1hi));
  const __m128i z1 = _mm_add_epi64(_mm_mul_epu32(x, c1), _mm_slli_epi64(cross, 32));
  const __m128i y = _mm_xor_si128(z1, _mm_srli_epi64(z1, 27));
  /* y's words (0, 1, 2, 0) per lane (no pshufb before SSSE3: two word shuffles) */
  const __m128i ys = _mm_shufflehi_epi16(_mm_shufflelo_epi16(y, _MM_SHUFFLE(0, 2, 1, 0)), _MM_SHUFFLE(0, 2, 1, 0));
  const __m128i z2 = _mm_add_epi64(_mm_mul_epu32(y, c2), _mm_madd_epi16(ys, c2w));
  return _mm_xor_si128(z2, _mm_srli_epi64(z2, 31));
}

/* sr_round8_avx2 on 4 lanes; `big` collects the lanes at or above the threshold (no
 * unsigned max before SSE4.1). */
static inline MF_HOST_INLINE __m128i sr_round4_sse2(__m128i u, __m128i r, __m128i *big) {
  *big = _mm_or_si128(*big, _mm_cmpgt_epi32(_mm_and_si128(u, _mm_set1_epi32(0x7fffffff)),
                                            _mm_set1_epi32((int)(SR_BIG2 / 2 - 1))));
  return _mm_srai_epi32(_mm_add_epi32(u, _mm_andnot_si128(r, _mm_set1_epi32(0xffff))), 16);
}

static inline MF_HOST_INLINE void sr_store_bf16_sse2(const float *restrict v, int64_t n, uint64_t z0,
                                                     uint16_t *restrict out) {
  const uint64_t s = MF_HASH64_STEP;
  const __m128i step = _mm_set1_epi64x((long long)(8u * s));
  /* lanes: a = elements 0, 1; b = 2, 3; c, d: the same + 4 */
  __m128i za = _mm_add_epi64(_mm_set1_epi64x((long long)z0), _mm_set_epi64x((long long)s, 0));
  __m128i zb = _mm_add_epi64(za, _mm_set1_epi64x((long long)(2u * s)));
  __m128i zc = _mm_add_epi64(za, _mm_set1_epi64x((long long)(4u * s)));
  __m128i zd = _mm_add_epi64(za, _mm_set1_epi64x((long long)(6u * s)));
  __m128i big = _mm_setzero_si128();
  int64_t i = 0;
  MF_MCA_BEGIN("store_bf16_sr_sse2_hand elems=8 isa=generic");
  for (; i + 8 <= n; i += 8) {
    const __m128i r0 = _mm_castps_si128(_mm_shuffle_ps(_mm_castsi128_ps(sr_mix16_sse2(za)),
                                                       _mm_castsi128_ps(sr_mix16_sse2(zb)),
                                                       _MM_SHUFFLE(2, 0, 2, 0)));
    const __m128i r1 = _mm_castps_si128(_mm_shuffle_ps(_mm_castsi128_ps(sr_mix16_sse2(zc)),
                                                       _mm_castsi128_ps(sr_mix16_sse2(zd)),
                                                       _MM_SHUFFLE(2, 0, 2, 0)));
    za = _mm_add_epi64(za, step);
    zb = _mm_add_epi64(zb, step);
    zc = _mm_add_epi64(zc, step);
    zd = _mm_add_epi64(zd, step);
    const __m128i h0 = sr_round4_sse2(_mm_loadu_si128((const __m128i *)(v + i)), r0, &big);
    const __m128i h1 = sr_round4_sse2(_mm_loadu_si128((const __m128i *)(v + i + 4)), r1, &big);
    _mm_storeu_si128((__m128i *)(out + i), _mm_packs_epi32(h0, h1));
  }
  MF_MCA_END();
  sr_store_bf16_scalar(v, _mm_movemask_epi8(big) ? 0 : i, n, z0, out);
}
/* sr_round8_f16_avx2 on 4 lanes; the result minus 0x8000, for the signed pack */
static inline MF_HOST_INLINE __m128i sr_round4_f16_sse2(__m128i u, __m128i r, __m128i *odd) {
  const __m128i a = _mm_and_si128(u, _mm_set1_epi32(0x7fffffff));
  const __m128i rebased = _mm_sub_epi32(a, _mm_set1_epi32(0x38000000));
  const __m128i h = _mm_srli_epi32(_mm_add_epi32(rebased, _mm_andnot_si128(r, _mm_set1_epi32(0x1fff))), 13);
  const __m128i tiny = _mm_cmpgt_epi32(_mm_set1_epi32(0x1f800000), a);
  const __m128i normal = _mm_andnot_si128(_mm_cmpgt_epi32(_mm_set1_epi32(0x00800000), rebased),
                                          _mm_cmpgt_epi32(_mm_set1_epi32(0x0f7fe000), rebased));
  *odd = _mm_or_si128(*odd, _mm_andnot_si128(_mm_or_si128(tiny, normal), _mm_set1_epi32(-1)));
  const __m128i res = _mm_or_si128(_mm_andnot_si128(tiny, h), _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(0x8000)));
  return _mm_sub_epi32(res, _mm_set1_epi32(0x8000));
}

static inline MF_HOST_INLINE void sr_store_f16_sse2(const float *restrict v, int64_t n, uint64_t z0,
                                                    uint16_t *restrict out) {
  const uint64_t s = MF_HASH64_STEP;
  const __m128i step = _mm_set1_epi64x((long long)(8u * s));
  __m128i za = _mm_add_epi64(_mm_set1_epi64x((long long)z0), _mm_set_epi64x((long long)s, 0));
  __m128i zb = _mm_add_epi64(za, _mm_set1_epi64x((long long)(2u * s)));
  __m128i zc = _mm_add_epi64(za, _mm_set1_epi64x((long long)(4u * s)));
  __m128i zd = _mm_add_epi64(za, _mm_set1_epi64x((long long)(6u * s)));
  int64_t i = 0;
  MF_MCA_BEGIN("store_f16_sr_sse2_hand elems=8 isa=generic");
  for (; i + 8 <= n; i += 8) {
    const __m128i r0 = _mm_castps_si128(_mm_shuffle_ps(_mm_castsi128_ps(sr_mix16_sse2(za)),
                                                       _mm_castsi128_ps(sr_mix16_sse2(zb)),
                                                       _MM_SHUFFLE(2, 0, 2, 0)));
    const __m128i r1 = _mm_castps_si128(_mm_shuffle_ps(_mm_castsi128_ps(sr_mix16_sse2(zc)),
                                                       _mm_castsi128_ps(sr_mix16_sse2(zd)),
                                                       _MM_SHUFFLE(2, 0, 2, 0)));
    za = _mm_add_epi64(za, step);
    zb = _mm_add_epi64(zb, step);
    zc = _mm_add_epi64(zc, step);
    zd = _mm_add_epi64(zd, step);
    __m128i odd = _mm_setzero_si128();
    const __m128i h0 = sr_round4_f16_sse2(_mm_loadu_si128((const __m128i *)(v + i)), r0, &odd);
    const __m128i h1 = sr_round4_f16_sse2(_mm_loadu_si128((const __m128i *)(v + i + 4)), r1, &odd);
    if (__builtin_expect(_mm_movemask_epi8(odd) != 0, 0)) sr_store_f16_scalar(v, i, i + 8, z0, out);
    else _mm_storeu_si128((__m128i *)(out + i), _mm_xor_si128(_mm_packs_epi32(h0, h1), _mm_set1_epi16((short)0x8000)));
  }
  MF_MCA_END();
  sr_store_f16_scalar(v, i, n, z0, out);
}
#endif /* MF_X86_SIMD */

#endif /* MEMFIT_STORE_SR_H */
