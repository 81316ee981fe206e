/*
 * The CPU optimizer's hot loops for benchmarks/mca_model.py to model with llvm-mca:
 *
 *   python benchmarks/mca_model.py --source benchmarks/c/mca_optim.c --per 8
 *
 * Benchmark-only: the product code carries no markers. Each function wraps one loop
 * between LLVM-MCA-BEGIN/END comments and calls the same inline helpers as the
 * kernels in csrc/core (optim_cpu.h, code_lut_avx2.h, code_lut_avx512.h), so the
 * modelled instructions are the shipped ones; the gather forms that the AVX2 kernel
 * does not use (dequantize) or uses where a measurement picks it (code search) are here
 * for comparison.
 */
#include "code_lut_avx2.h"
#include "code_lut_avx512.h"
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

/* AdEMAMix's update (three states: block and fused kernels alike): against AdamW's, two
 * more divisions per element (m1 / bc1, sqrt(nu) / sqrt(bc2)), the third EMA and more
 * finiteness tests. */
#define UPDATE_ADEMAMIX(fn, target, spec)                                                \
  target __attribute__((noinline)) void fn(const mf_optim_consts *c, int64_t n, float *p,  \
                                           const float *g, float *s1, float *s2,          \
                                           float *s3) {                                   \
    MCA_BEGIN(spec);                                                                     \
    update_ademamix(c, n, p, g, s1, s2, s3);                                             \
    MCA_END();                                                                           \
  }
UPDATE_ADEMAMIX(mca_update_ademamix_avx2, MF_TARGET_AVX2, "update_ademamix_avx2 elems=8 isa=avx2")
UPDATE_ADEMAMIX(mca_update_ademamix_avx512, MF_TARGET_AVX512,
                "update_ademamix_avx512 elems=16 isa=avx512")

/* What AVX2 ships for Adam/AdamW instead of the plain loop above (update_adamw_avx2: its
 * selects): update_adam_avx2, one skip branch per 8 elements (modelled as not taken). */
MF_TARGET_AVX2 __attribute__((noinline)) void mca_update_adamw_branch_avx2(
    const mf_optim_consts *c, int64_t n, float *p, const float *g, float *s1, float *s2) {
  MCA_BEGIN("update_adamw_branch_avx2 elems=8 isa=avx2");
  update_adam_avx2(MF_OPT_ADAMW, c, 8 * (n / 8), p, g, s1, s2); /* (no tail loop to model) */
  MCA_END();
}

/* A marked loop over n elements, `step` at a time: `body` reads code (dequantize) or
 * lut (search) and in, writes out at element v. */
#define MCA_LOOP(fn, target, spec, step, Tin, Tout, body)                                 \
  target __attribute__((noinline)) void fn(const float *code, const mf_code_lut *lut,     \
                                           const Tin *in, float k, int64_t n, Tout *out) { \
    (void)code, (void)lut, (void)k;                                                      \
    MCA_BEGIN(spec);                                                                     \
    for (int64_t v = 0; v + step <= n; v += step) { body; }                              \
    MCA_END();                                                                           \
  }

/* 8-bit dequantization, code[q] * absmax (k) */
MCA_LOOP(mca_dequant8_gather_avx2, MF_TARGET_AVX2, "dequant8_gather_avx2 elems=8 isa=avx2", 8,
         uint8_t, float,
         const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(in + v)));
         _mm256_storeu_ps(out + v, _mm256_mul_ps(_mm256_i32gather_ps(code, idx, 4), _mm256_set1_ps(k))))
MCA_LOOP(mca_dequant8_scalar_avx2, MF_TARGET_AVX2, "dequant8_scalar_avx2 elems=8 isa=avx2", 8,
         uint8_t, float,
         _mm256_storeu_ps(out + v, _mm256_mul_ps(load_code8(code, in + v), _mm256_set1_ps(k))))
MCA_LOOP(mca_dequant8_gather_avx512, MF_TARGET_AVX512, "dequant8_gather_avx512 elems=16 isa=avx512",
         16, uint8_t, float, dequant8_16_avx512(in + v, code, _mm512_set1_ps(k), out + v))

/* the code search of x * inv (k) into bytes: the fused kernels' requantization */
MCA_LOOP(mca_search_gather_avx2, MF_TARGET_AVX2, "search_gather_avx2 elems=8 isa=avx2", 8, float,
         uint8_t,
         _mm_storel_epi64((__m128i *)(out + v),
                          mf_code_lut_bytes8(mf_code_lut_sum8(lut, _mm256_loadu_ps(in + v), _mm256_set1_ps(k)))))
MCA_LOOP(mca_search_loads_avx2, MF_TARGET_AVX2, "search_loads_avx2 elems=8 isa=avx2", 8, float,
         uint8_t,
         _mm_storel_epi64((__m128i *)(out + v),
                          mf_code_lut_bytes8(mf_code_lut_sum8_loads(
                              lut, mf_code_lut_key8(_mm256_loadu_ps(in + v), _mm256_set1_ps(k))))))
MCA_LOOP(mca_search_gather_avx512, MF_TARGET_AVX512, "search_gather_avx512 elems=16 isa=avx512", 16,
         float, uint8_t,
         _mm_storeu_si128((__m128i *)(out + v),
                          _mm512_cvtepi32_epi8(_mm512_srli_epi32(
                              mf_code_lut_sum16(lut, _mm512_loadu_ps(in + v), _mm512_set1_ps(k)), 16))))

/* 4-bit: 32 elements to 16 bytes of nibbles, the fused AVX2 kernel's requantization:
 * the table search by gather or by scalar loads, then the packing. */
#define SUM8(x) mf_code_lut_sum8(lut, _mm256_loadu_ps(x), _mm256_set1_ps(k))
#define SUM8_LOADS(x) mf_code_lut_sum8_loads(lut, mf_code_lut_key8(_mm256_loadu_ps(x), _mm256_set1_ps(k)))
MCA_LOOP(mca_search4_loads_avx2, MF_TARGET_AVX2, "search4_loads_avx2 elems=32 isa=avx2", 32, float,
         uint8_t,
         _mm_storeu_si128((__m128i *)(out + v / 2),
                          mf_code_lut_nibbles32(SUM8_LOADS(in + v), SUM8_LOADS(in + v + 8),
                                                SUM8_LOADS(in + v + 16), SUM8_LOADS(in + v + 24))))
MCA_LOOP(mca_search4_gather_avx2, MF_TARGET_AVX2, "search4_gather_avx2 elems=32 isa=avx2", 32, float,
         uint8_t,
         _mm_storeu_si128((__m128i *)(out + v / 2),
                          mf_code_lut_nibbles32(SUM8(in + v), SUM8(in + v + 8), SUM8(in + v + 16),
                                                SUM8(in + v + 24))))

/* The searches without a table (code_lut.h): the arithmetic one (8-bit codes; signed
 * code lines, the ambiguity mask folded into the output so the loop keeps it) and the
 * 4-bit threshold tree, 16 (AVX-512) or 8 (AVX2) lanes. */
MCA_LOOP(mca_search_arith_avx512, MF_TARGET_AVX512, "search_arith_avx512 elems=16 isa=avx512", 16,
         float, uint8_t, {
           __mmask16 amb;
           const __m512i q = mf_code_lut_arith16(lut, _mm512_mul_ps(_mm512_loadu_ps(in + v), _mm512_set1_ps(k)), &amb);
           _mm_storeu_si128((__m128i *)(out + v), _mm512_cvtepi32_epi8(_mm512_mask_mov_epi32(q, amb, q)));
         })
MCA_LOOP(mca_search_tree4_avx512, MF_TARGET_AVX512, "search_tree4_avx512 elems=16 isa=avx512", 16,
         float, uint8_t,
         _mm_storeu_si128((__m128i *)(out + v),
                          _mm512_cvtepi32_epi8(mf_code_lut_tree4_16(lut, _mm512_mul_ps(_mm512_loadu_ps(in + v),
                                                                                      _mm512_set1_ps(k))))))
MCA_LOOP(mca_search_tree4_avx2, MF_TARGET_AVX2, "search_tree4_avx2 elems=8 isa=avx2", 8, float,
         uint8_t,
         _mm_storel_epi64((__m128i *)(out + v),
                          mf_code_lut_bytes8(_mm256_slli_epi32(
                              mf_code_lut_tree4_8(lut, _mm256_mul_ps(_mm256_loadu_ps(in + v), _mm256_set1_ps(k))), 16))))

/* The parameter store of half-precision parameters (store_params in optim_cpu.h: the
 * same expressions): bf16
 * by stochastic rounding (the hash state stepped by an add, then mf_hash64_mix's two
 * 64-bit multiplies), by nearest-even, and the bf16 Kahan split. What stochastic
 * rounding costs over nearest in the core. */
#define STORE_LOOP(fn, target, spec, body)                                                \
  target __attribute__((noinline)) void fn(const float *restrict v, int64_t n, uint64_t z0, \
                                           uint16_t *restrict out, uint16_t *restrict comp) { \
    (void)comp;                                                                          \
    uint64_t z = z0;                                                                     \
    MCA_BEGIN(spec);                                                                     \
    /* (a multiple of 64 elements: no scalar epilogue, the vector loop is the last) */    \
    for (int64_t i = 0; i < (n & -64); i++, z += MF_HASH64_STEP) { body; }               \
    MCA_END();                                                                           \
  }
#define STORE_SR(i) out[i] = mf_f32_to_bf16_sr(v[i], (uint32_t)mf_hash64_mix(z))
#define STORE_NEAREST(i) out[i] = mf_f32_to_bf16(v[i])
#define STORE_KAHAN(i) mf_optim_kahan_split(v[i], MF_BFLOAT16, &out[i], &comp[i])
/* (elems: gcc's vector loop stores 8 (baseline SSE2), 16 (AVX2) or 32 (AVX-512) bf16) */
#define STORES(isa, target, elems)                                                        \
  STORE_LOOP(mca_store_bf16_sr_##isa, target, "store_bf16_sr_" #isa " elems=" #elems " isa=" #isa, \
             STORE_SR(i))                                                                 \
  STORE_LOOP(mca_store_bf16_nearest_##isa, target,                                        \
             "store_bf16_nearest_" #isa " elems=" #elems " isa=" #isa, STORE_NEAREST(i))  \
  STORE_LOOP(mca_store_bf16_kahan_##isa, target,                                          \
             "store_bf16_kahan_" #isa " elems=" #elems " isa=" #isa, STORE_KAHAN(i))
STORES(generic, , 8)
STORES(avx2, MF_TARGET_AVX2, 16)
STORES(avx512, MF_TARGET_AVX512, 32)

/* The bf16 stochastic-rounding stores that the generic (SSE2) and AVX2 kernels ship
 * (csrc/core/store_sr.h, whose loops carry the markers: regions
 * store_bf16_sr_sse2_hand, store_bf16_sr_avx2_hand); GCC's form of the scalar loop
 * above (store_bf16_sr_*) is what AVX-512 ships and what the other two did before. */
__attribute__((noinline)) void mca_store_bf16_sr_sse2_hand(const float *restrict v, int64_t n, uint64_t z0,
                                                           uint16_t *restrict out) {
  sr_store_bf16_sse2(v, n, z0, out);
}
MF_TARGET_AVX2 __attribute__((noinline)) void mca_store_bf16_sr_avx2_hand(const float *restrict v, int64_t n,
                                                                          uint64_t z0, uint16_t *restrict out) {
  sr_store_bf16_avx2(v, n, z0, out);
}
/* and float16's (regions store_f16_sr_sse2_hand, store_f16_sr_avx2_hand; GCC keeps the
 * scalar loop scalar: its subnormal branch) */
__attribute__((noinline)) void mca_store_f16_sr_sse2_hand(const float *restrict v, int64_t n, uint64_t z0,
                                                          uint16_t *restrict out) {
  sr_store_f16_sse2(v, n, z0, out);
}
MF_TARGET_AVX2 __attribute__((noinline)) void mca_store_f16_sr_avx2_hand(const float *restrict v, int64_t n,
                                                                         uint64_t z0, uint16_t *restrict out) {
  sr_store_f16_avx2(v, n, z0, out);
}
