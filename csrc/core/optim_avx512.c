/*
 * The fused CPU optimizer step (optim_fused.h) for AVX-512, built twice: this file as
 * is, for CPUs with AVX512-VBMI (Ice Lake, Sapphire Rapids, Zen 4 and later), and
 * optim_avx512_gather.c, which defines MF_FUSED_GATHER and includes it, for AVX-512
 * CPUs without VBMI (Skylake-SP, Cascade Lake: much of the cloud, Colab included). The
 * only difference is the 8-bit dequantization: byte permutes here, table gathers there
 * (the same values). 16 lanes; the code search is mf_code_lut_sum16.
 */
#include "code_lut_avx512.h"
#include "optim_cpu.h"
#include "optim_search_form.h"
#include "optim_vbmi.h"

#ifdef MF_X86_SIMD
#include <string.h>

#ifdef MF_FUSED_GATHER
#define FUSED_TARGET MF_TARGET_AVX512
#define FUSED8_ENTRY mf_optim_fused8_avx512_gather
#define FUSED4_ENTRY mf_optim_fused4_avx512_gather
#else
#define FUSED_TARGET MF_TARGET_VBMI
#define FUSED8_ENTRY mf_optim_fused8_avx512_vbmi
#define FUSED4_ENTRY mf_optim_fused4_avx512_vbmi
#endif

typedef __m512i fused_acc;

/* The plain update loop: with mask registers its selects cost little. */
#define update_half update_loop
#define store_half store_params_avx512 /* (optim_cpu.h) */

MF_TARGET_AVX512 static inline fused_acc acc_zero(void) { return _mm512_setzero_si512(); }

/* max over the |bit patterns| of 64 floats, folded into m */
MF_TARGET_AVX512 static inline fused_acc acc_absmax64(fused_acc m, const float *s) {
  const __m512i mask = _mm512_set1_epi32(0x7fffffff);
  for (int k = 0; k < 4; k++)
    m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(s + 16 * k)), mask));
  return m;
}

MF_TARGET_AVX512 static inline uint32_t acc_max(fused_acc m) {
  return (uint32_t)_mm512_reduce_max_epu32(m);
}

#ifndef MF_FUSED_GATHER
_Static_assert(sizeof(vbmi_code) <= sizeof(((thread_bufs *)0)->fused_tables[0]),
               "thread_bufs.fused_tables holds a vbmi_code");

MF_TARGET_VBMI static inline void tables_init(thread_bufs *b, const quant_ctx *qc, int ns) {
  if (b->fused_ready) return;
  for (int k = 0; k < ns && k < 2; k++) /* (a third state shares table 0: FUSED_TABLE) */
    vbmi_code_init((vbmi_code *)(void *)b->fused_tables[k], qc->code[k]);
  b->fused_ready = 1;
}

MF_TARGET_VBMI static inline void dequant64_8(const thread_bufs *b, int k, const float *code,
                                              const uint8_t *q, float absmax, float *out) {
  (void)code;
  dequant64_vbmi((const vbmi_code *)(const void *)b->fused_tables[k], q, _mm512_set1_ps(absmax), out);
}

#else

static inline void tables_init(thread_bufs *b, const quant_ctx *qc, int ns) {
  (void)b, (void)qc, (void)ns;
}

/* Without VBMI: the block kernel's gathers (optim_cpu.h). */
MF_TARGET_AVX512 static inline void dequant64_8(const thread_bufs *b, int k, const float *code,
                                                const uint8_t *q, float absmax, float *out) {
  (void)b, (void)k;
  const __m512 a = _mm512_set1_ps(absmax);
  for (int i = 0; i < 64; i += 16) dequant8_16_avx512(q + i, code, a, out + i);
}
#endif /* MF_FUSED_GATHER */

/* 4-bit states: the 16-entry code fits one register, a permute (optim_cpu.h). */
MF_TARGET_AVX512 static inline void dequant64_4(const float *code, const uint8_t *q, float absmax,
                                                float *out) {
  const __m512 a = _mm512_set1_ps(absmax), table = _mm512_loadu_ps(code);
  for (int i = 0; i < 64; i += 16) dequant4_16_avx512(q + i / 2, table, a, out + i);
}

/* 16 floats s * inv -> their code indices as dwords, in the form `search` says
 * (quant_ctx.search): 4-bit by the threshold tree (code_lut.h), 8-bit by the arithmetic
 * search (code_lut.h; no memory access) with the table where a lane is ambiguous (about
 * one call in 100), or by the table. The same indices every way. */
MF_TARGET_AVX512 static inline __m512i quantize16(const mf_code_lut *lut, const int search,
                                                  const int bits, const float *s, __m512 inv) {
  if (bits == 4 && (search & SEARCH_TREE4))
    return mf_code_lut_tree4_16(lut, _mm512_mul_ps(_mm512_loadu_ps(s), inv));
  if (bits == 8 && (search & SEARCH_FAST) && lut->arith) {
    __mmask16 amb;
    const __m512i q = mf_code_lut_arith16(lut, _mm512_mul_ps(_mm512_loadu_ps(s), inv), &amb);
    if (__builtin_expect(amb == 0, 1)) return q;
  }
  return _mm512_srli_epi32(mf_code_lut_sum16(lut, _mm512_loadu_ps(s), inv), 16);
}

/* 32 floats s * inv -> 32 code indices: bytes (bits 8), or nibbles, element 2i in the
 * low nibble of byte i (bits 4). */
#ifndef MF_FUSED_GATHER
/* With VBMI one byte permute takes the indices (byte 0 of each dword) out of 32 dwords
 * at once: no vpmovdb (two uops each). */
MF_TARGET_VBMI static inline void quantize32(const mf_code_lut *lut, int search, const float *s,
                                             float inv, int bits, uint8_t *out) {
  const __m512 vinv = _mm512_set1_ps(inv);
  /* byte i <- byte 0 of dword i of the 32 dwords of (lo, hi); bytes 32-63 unused */
  const __m512i pick = _mm512_set_epi32(0x7c787470, 0x6c686460, 0x5c585450, 0x4c484440,
                                        0x3c383430, 0x2c282420, 0x1c181410, 0x0c080400,
                                        0x7c787470, 0x6c686460, 0x5c585450, 0x4c484440,
                                        0x3c383430, 0x2c282420, 0x1c181410, 0x0c080400);
  const __m512i lo = quantize16(lut, search, bits, s, vinv), hi = quantize16(lut, search, bits, s + 16, vinv);
  const __m256i q = _mm512_castsi512_si256(_mm512_permutex2var_epi8(lo, pick, hi));
  if (bits == 8) {
    _mm256_storeu_si256((__m256i *)out, q);
  } else {
    const __m256i pairs = _mm256_maddubs_epi16(q, _mm256_set1_epi16(0x1001)); /* q[2i] + 16 q[2i+1] */
    _mm_storeu_si128((__m128i *)out, _mm256_cvtepi16_epi8(pairs));
  }
}
#else
MF_TARGET_AVX512 static inline void quantize32(const mf_code_lut *lut, int search, const float *s,
                                               float inv, int bits, uint8_t *out) {
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int v = 0; v < 32; v += 16) {
    const __m128i q = _mm512_cvtepi32_epi8(quantize16(lut, search, bits, s + v, vinv));
    if (bits == 8) {
      _mm_storeu_si128((__m128i *)(out + v), q);
    } else {
      const __m128i pairs = _mm_maddubs_epi16(q, _mm_set1_epi16(0x1001)); /* q[2i] + 16 q[2i+1] */
      _mm_storel_epi64((__m128i *)(out + v / 2), _mm_packus_epi16(pairs, pairs));
    }
  }
}
#endif

#include "optim_fused.h"

#ifndef MF_FUSED_GATHER
/* ---- arithmetic (tree) or table search: measured (defined once, in this build) -----
 * llvm-mca puts the arithmetic search at 12-14 cycles per 16 elements and the 4-bit
 * tree at 11-12 on every AVX-512 core, a 16-lane gather at 4-10; on AMD Zen 5 the gather
 * measures ~20. So the first AVX-512 step of a process times both forms for its code
 * width. */
MF_TARGET_AVX512 static void search_run_avx512(const mf_code_lut *lut, int form, const float *x,
                                               int64_t n, uint8_t *q) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const int bits = lut->size == 16 ? 4 : 8;
  const int search = form ? (bits == 4 ? SEARCH_TREE4 : SEARCH_FAST) : 0;
  for (int64_t i = 0; i + 16 <= n; i += 16)
    _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(quantize16(lut, search, bits, x + i, one)));
}

static _Atomic int arith_cached = -1, tree4_cached = -1;

int mf_optim_avx512_search(const mf_code_lut *lut, int bits) {
  if (!lut) return 0;
  if (bits == 4)
    return mf_optim_search_form(&tree4_cached, "avx512-tree4", "avx512-table4", lut, search_run_avx512) ? SEARCH_TREE4 : 0;
  if (!lut->arith) return 0;
  return mf_optim_search_form(&arith_cached, "avx512-arith", "avx512-table", lut, search_run_avx512) ? SEARCH_FAST : 0;
}
#endif

#endif /* MF_X86_SIMD */
