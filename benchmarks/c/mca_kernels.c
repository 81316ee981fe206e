/*
 * Loops for benchmarks/mca_model.py to model with llvm-mca. Benchmark-only: the
 * product code carries no markers. Each function wraps one hot loop of the core
 * between LLVM-MCA-BEGIN/END comments (see mca_model.py for the spec syntax), calling
 * the same inline helpers the core's kernels call, so the modelled instructions are
 * the shipped ones. Only whole vectors are processed (the tails are not hot).
 */
#include "code_lut_avx2.h"
#include "code_lut_avx512.h"
#include "memfit/quant.h"

#define MCA_BEGIN(spec) __asm__ volatile("# LLVM-MCA-BEGIN " spec ::: "memory")
#define MCA_END() __asm__ volatile("# LLVM-MCA-END" ::: "memory")

/* The code-LUT search of code_lut_avx2.h / code_lut_avx512.h (8- and 16-lane gathers),
 * as the AVX-512 quantize_blockwise and the optimizer kernels run it. */
MF_TARGET_AVX2 __attribute__((noinline)) int mca_quant_lut_avx2(const mf_code_lut *t,
                                                                const float *x, float inv,
                                                                int64_t n, uint8_t *q) {
  __m256i slow = _mm256_setzero_si256();
  MCA_BEGIN("quant_lut_avx2 elems=8 isa=avx2");
  for (int64_t i = 0; i + 8 <= n; i += 8)
    _mm_storel_epi64((__m128i *)(q + i), mf_code_lut_quantize8(t, _mm256_loadu_ps(x + i),
                                                               _mm256_set1_ps(inv), &slow));
  MCA_END();
  return _mm256_movemask_ps(_mm256_castsi256_ps(slow));
}

MF_TARGET_AVX512 __attribute__((noinline)) int mca_quant_lut_avx512(const mf_code_lut *t,
                                                                    const float *x, float inv,
                                                                    int64_t n, uint8_t *q) {
  __m512i slow = _mm512_setzero_si512();
  MCA_BEGIN("quant_lut_avx512 elems=16 isa=avx512");
  for (int64_t i = 0; i + 16 <= n; i += 16) {
    const __m128i b = mf_code_lut_quantize16(t, _mm512_loadu_ps(x + i), _mm512_set1_ps(inv), &slow);
    _mm_storeu_si128((__m128i *)(q + i), b);
  }
  MCA_END();
  return _mm512_reduce_or_epi32(slow);
}

/* dequantize_blockwise to float32 as a plain table lookup (the generic loop of
 * quant.c), and with an 8-lane gather for comparison with quant.c's AVX2 loop. */
__attribute__((noinline)) void mca_dequant_table_generic(const float *code, const uint8_t *c,
                                                         float a, int64_t n, float *o) {
  MCA_BEGIN("dequant_table_generic elems=1 isa=generic");
  for (int64_t i = 0; i < n; i++) o[i] = mf_dequantize_one(code, c[i], a);
  MCA_END();
}

__attribute__((noinline)) void mca_dequant_bf16_table_generic(const float *code, const uint8_t *c,
                                                              float a, int64_t n, uint16_t *o) {
  MCA_BEGIN("dequant_bf16_table_generic elems=1 isa=generic");
  for (int64_t i = 0; i < n; i++) o[i] = mf_f32_to_bf16(mf_dequantize_one(code, c[i], a));
  MCA_END();
}

MF_TARGET_AVX2 __attribute__((noinline)) void mca_dequant_gather_avx2(const float *code,
                                                                      const uint8_t *c, float a,
                                                                      int64_t n, float *o) {
  const __m256 va = _mm256_set1_ps(a);
  MCA_BEGIN("dequant_gather_avx2 elems=8 isa=avx2");
  for (int64_t i = 0; i + 8 <= n; i += 8) {
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + i)));
    _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_i32gather_ps(code, idx, 4), va));
  }
  MCA_END();
}
