/*
 * The CPU optimizer's hot loops for benchmarks/mca_model.py to model with llvm-mca:
 *
 *   python benchmarks/mca_model.py --source benchmarks/c/mca_optim.c --per 8
 *
 * Benchmark-only: the product code carries no markers. Each function wraps one loop
 * between LLVM-MCA-BEGIN/END comments and calls the same inline helpers as the
 * kernels in csrc/core (optim_cpu.h), so the modelled instructions are the shipped ones.
 */
#include "optim_cpu.h"

#define MCA_BEGIN(spec) __asm__ volatile("# LLVM-MCA-BEGIN " spec ::: "memory")
#define MCA_END() __asm__ volatile("# LLVM-MCA-END" ::: "memory")

/* The fp32-state AdamW update (block kernel, and the update half of the fused one). */
#define UPDATE_ADAMW(fn, target, spec)                                                   \
  target __attribute__((noinline)) void fn(const mf_optim_consts *c, int64_t n, float *p,  \
                                           const float *g, float *s1, float *s2) {        \
    MCA_BEGIN(spec);                                                                     \
    update_loop(MF_OPT_ADAMW, c, 2, n, p, g, s1, s2);                                    \
    MCA_END();                                                                           \
  }
UPDATE_ADAMW(mca_update_adamw_generic, , "update_adamw_generic elems=4 isa=generic")
UPDATE_ADAMW(mca_update_adamw_avx2, MF_TARGET_AVX2, "update_adamw_avx2 elems=8 isa=avx2")
UPDATE_ADAMW(mca_update_adamw_avx512, MF_TARGET_AVX512, "update_adamw_avx512 elems=16 isa=avx512")

/* 8-bit dequantization of 8 (16) codes: code[q] * absmax. */
#include "code_lut_avx2.h"
#include "code_lut_avx512.h"
#include <string.h>

MF_TARGET_AVX2 __attribute__((noinline)) void mca_dequant8_gather_avx2(const float *code,
                                                                      const uint8_t *q, float a,
                                                                      int64_t n, float *out) {
  const __m256 va = _mm256_set1_ps(a);
  MCA_BEGIN("dequant8_gather_avx2 elems=8 isa=avx2");
  for (int64_t v = 0; v + 8 <= n; v += 8) {
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + v)));
    _mm256_storeu_ps(out + v, _mm256_mul_ps(_mm256_i32gather_ps(code, idx, 4), va));
  }
  MCA_END();
}

/* as optim_avx2.c's dequant64_8 */
MF_TARGET_AVX2 __attribute__((noinline)) void mca_dequant8_scalar_avx2(const float *code,
                                                                      const uint8_t *q, float a,
                                                                      int64_t n, float *out) {
  const __m256 va = _mm256_set1_ps(a);
  MCA_BEGIN("dequant8_scalar_avx2 elems=8 isa=avx2");
  for (int64_t v = 0; v + 8 <= n; v += 8) {
    uint64_t w;
    memcpy(&w, q + v, 8);
    const __m128 lo = _mm_setr_ps(code[w & 255], code[(w >> 8) & 255], code[(w >> 16) & 255],
                                  code[(w >> 24) & 255]);
    const __m128 hi = _mm_setr_ps(code[(w >> 32) & 255], code[(w >> 40) & 255],
                                  code[(w >> 48) & 255], code[w >> 56]);
    _mm256_storeu_ps(out + v, _mm256_mul_ps(_mm256_set_m128(hi, lo), va));
  }
  MCA_END();
}

/* as optim_avx512.c's dequant8_16_avx512 (AVX-512 without VBMI) */
MF_TARGET_AVX512 __attribute__((noinline)) void mca_dequant8_gather_avx512(const float *code,
                                                                          const uint8_t *q,
                                                                          float a, int64_t n,
                                                                          float *out) {
  const __m512 va = _mm512_set1_ps(a);
  MCA_BEGIN("dequant8_gather_avx512 elems=16 isa=avx512");
  for (int64_t v = 0; v + 16 <= n; v += 16) dequant8_16_avx512(q + v, code, va, out + v);
  MCA_END();
}

/* The code search of 8 (16) floats into bytes: the fused kernels' requantization. */
MF_TARGET_AVX2 __attribute__((noinline)) void mca_search_gather_avx2(const mf_code_lut *t,
                                                                    const float *x, float inv,
                                                                    int64_t n, uint8_t *q) {
  const __m256 vinv = _mm256_set1_ps(inv);
  MCA_BEGIN("search_gather_avx2 elems=8 isa=avx2");
  for (int64_t v = 0; v + 8 <= n; v += 8)
    _mm_storel_epi64((__m128i *)(q + v), mf_code_lut_bytes8(mf_code_lut_sum8(t, _mm256_loadu_ps(x + v), vinv)));
  MCA_END();
}

MF_TARGET_AVX2 __attribute__((noinline)) void mca_search_scalar_avx2(const mf_code_lut *t,
                                                                    const float *x, float inv,
                                                                    int64_t n, uint8_t *q) {
  const __m256 vinv = _mm256_set1_ps(inv);
  MCA_BEGIN("search_scalar_avx2 elems=8 isa=avx2");
  for (int64_t v = 0; v + 8 <= n; v += 8)
    mf_code_lut_bytes8_scalar(t, _mm256_loadu_ps(x + v), vinv, q + v);
  MCA_END();
}

MF_TARGET_AVX512 __attribute__((noinline)) void mca_search_gather_avx512(const mf_code_lut *t,
                                                                        const float *x,
                                                                        float inv, int64_t n,
                                                                        uint8_t *q) {
  const __m512 vinv = _mm512_set1_ps(inv);
  MCA_BEGIN("search_gather_avx512 elems=16 isa=avx512");
  for (int64_t v = 0; v + 16 <= n; v += 16)
    _mm_storeu_si128((__m128i *)(q + v),
                     _mm512_cvtepi32_epi8(_mm512_srli_epi32(mf_code_lut_sum16(t, _mm512_loadu_ps(x + v), vinv), 16)));
  MCA_END();
}
