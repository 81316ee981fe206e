/*
 * The fused CPU optimizer step (optim_fused.h) for AVX2 CPUs (Haswell to Alder Lake,
 * Zen 1-3): 8 lanes, scalar table loads to dequantize 8-bit codes, two permutes and a
 * blend for the 16-entry 4-bit code, and the exact table of code_lut.h as the code
 * search, by gathers or by scalar loads (measured per process: see below).
 */
#include "code_lut_avx2.h"
#include "optim_cpu.h"
#include "optim_search_form.h"

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

#define update_half update_avx2 /* (optim_cpu.h) */
#define store_half store_params_avx2

/* 8-bit codes: the table values by scalar loads (load_code8), not gathers. */
MF_TARGET_AVX2 static inline void dequant64_8(const thread_bufs *b, int k, const float *code,
                                              const uint8_t *q, float absmax, float *out) {
  (void)b, (void)k;
  const __m256 a = _mm256_set1_ps(absmax);
  for (int v = 0; v < 64; v += 8) _mm256_storeu_ps(out + v, _mm256_mul_ps(load_code8(code, q + v), a));
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
 * low nibble of byte i (bits 4). By the threshold tree (4-bit) or the table, its
 * lookups by gather or by scalar loads, as `search` says (quant_ctx.search, measured
 * for this CPU: the same bytes every way). */
MF_TARGET_AVX2 static inline void quantize32(const mf_code_lut *lut, int search, const float *s,
                                             float inv, int bits, uint8_t *out) {
  const __m256 vinv = _mm256_set1_ps(inv);
  __m256i sum[4]; /* byte 2 of each lane: the code index (code_lut.h) */
  const int scalar = search & SEARCH_FAST;
  if (bits == 4 && (search & SEARCH_TREE4)) { /* the threshold tree: no table */
    for (int v = 0; v < 4; v++)
      sum[v] = _mm256_slli_epi32(mf_code_lut_tree4_8(lut, _mm256_mul_ps(_mm256_loadu_ps(s + 8 * v), vinv)), 16);
    _mm_storeu_si128((__m128i *)out, mf_code_lut_nibbles32(sum[0], sum[1], sum[2], sum[3]));
    return;
  }
  for (int v = 0; v < 4; v++) {
    const __m256 x = _mm256_loadu_ps(s + 8 * v);
    sum[v] = scalar ? mf_code_lut_sum8_loads(lut, mf_code_lut_key8(x, vinv)) : mf_code_lut_sum8(lut, x, vinv);
  }
  if (bits == 8) {
    for (int v = 0; v < 4; v++) _mm_storel_epi64((__m128i *)(out + 8 * v), mf_code_lut_bytes8(sum[v]));
    return;
  }
  _mm_storeu_si128((__m128i *)out, mf_code_lut_nibbles32(sum[0], sum[1], sum[2], sum[3]));
}

#include "optim_fused.h"

/* ---- gather or scalar loads: measured ----------------------------------------------
 * CPUID does not say how fast a gather is: an 8-lane vpgatherdd is microcoded on AMD Zen
 * 1/2, where eight scalar loads beat it, and fast on Zen 3/4 and on Intel, where the
 * gather wins (measured and llvm-mca numbers:
 * benchmarks/history/2026-11-24-optim-amd-epyc-search-by-loads.md). So
 * the first AVX2 step of a process times both forms (mf_optim_search_form) and keeps
 * the faster. */

MF_TARGET_AVX2 static void search_run8(const mf_code_lut *lut, int form, const float *x,
                                       int64_t n, uint8_t *q) {
  for (int64_t i = 0; i + 32 <= n; i += 32) quantize32(lut, form ? SEARCH_FAST : 0, x + i, 1.0f, 8, q + i);
}

MF_TARGET_AVX2 static void search_run4(const mf_code_lut *lut, int form, const float *x,
                                       int64_t n, uint8_t *q) {
  const int table = mf_optim_avx2_search(lut, 8); /* the table's own best form */
  for (int64_t i = 0; i + 32 <= n; i += 32)
    quantize32(lut, form ? SEARCH_TREE4 : table, x + i, 1.0f, 4, q + i / 2);
}

static _Atomic int scalar_cached = -1, tree4_cached = -1;

int mf_optim_avx2_search(const mf_code_lut *lut, int bits) {
  const int fast = mf_optim_search_form(&scalar_cached, "avx2-scalar", "avx2-gather", lut, search_run8);
  if (bits == 8) return fast ? SEARCH_FAST : 0;
  return (fast ? SEARCH_FAST : 0) |
         (mf_optim_search_form(&tree4_cached, "avx2-tree4", "avx2-table4", lut, search_run4) ? SEARCH_TREE4 : 0);
}

#endif /* MF_X86_SIMD */
