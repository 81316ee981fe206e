/*
 * Blockwise quantization: argument checks, dispatch, and the CPU loops.
 *
 * The CPU path runs one OpenMP iteration per block. Half-precision input is widened
 * into a per-thread float buffer first so the absmax pass and the code search run on
 * plain floats. Element math: quant.h (shared with cuda/quant.cu). Nearest rounding
 * of large arrays goes through the exact lookup table of code_lut.h (same codes as
 * the binary search, several times faster; code_lut.c has its vector forms). Where the
 * CPU has AVX2, the absmax pass and the dequantize loop run in the AVX2 forms below;
 * every form gives the same bytes.
 */
#include <stdlib.h>

#include "memfit/quant.h"
#include "code_lut.h"
#include "cpu_isa.h"
#include "mca_mark.h"
#ifdef MEMFIT_WITH_CUDA
#include "memfit/cuda_launch.h"
#endif

int mf_quant_block_size_ok(int64_t bs) {
  return bs >= MF_QUANT_MIN_BLOCK && bs <= MF_QUANT_MAX_BLOCK && (bs & (bs - 1)) == 0;
}

int64_t mf_quant_num_blocks(int64_t numel, int64_t bs) { return (numel + bs - 1) / bs; }

/* Checks shared by both directions; names the arguments as the Python API does. */
static mf_status check_common(const mf_tensor *values, const char *values_name,
                              const mf_tensor *code, const mf_tensor *codes,
                              const mf_tensor *absmax, int64_t bs) {
  mf_status st;
  if (!mf_quant_block_size_ok(bs))
    return mf_error(MF_ERR_VALUE,
                    "block_size: must be one of 64, 128, 256, 512, 1024, 2048, 4096, got %lld",
                    (long long)bs);
  if ((st = mf_check_float(values, values_name))) return st;
  if (values->numel <= 0)
    return mf_error(MF_ERR_VALUE, "%s: empty arrays cannot be quantized (numel must be > 0)", values_name);
  if ((st = mf_check_dtype(code, "code", MF_FLOAT32))) return st;
  if ((st = mf_check_numel(code, "code", MF_CODE_SIZE))) return st;
  if ((st = mf_check_dtype(codes, "codes", MF_UINT8))) return st;
  if ((st = mf_check_numel(codes, "codes", values->numel))) return st;
  if ((st = mf_check_dtype(absmax, "absmax", MF_FLOAT32))) return st;
  if ((st = mf_check_numel(absmax, "absmax", mf_quant_num_blocks(values->numel, bs)))) return st;
  if ((st = mf_check_same_device(values, values_name, code, "code"))) return st;
  if ((st = mf_check_same_device(values, values_name, codes, "codes"))) return st;
  if ((st = mf_check_same_device(values, values_name, absmax, "absmax"))) return st;
  return MF_OK;
}

static mf_status check_code_sorted(const float *code) {
  for (int i = 0; i < MF_CODE_SIZE; i++) {
    if (!(code[i] >= -1.0f && code[i] <= 1.0f))
      return mf_error(MF_ERR_VALUE, "code: values must lie in [-1, 1], code[%d] = %g", i,
                      (double)code[i]);
    if (i > 0 && code[i] < code[i - 1])
      return mf_error(MF_ERR_VALUE, "code: must be sorted ascending (code[%d] < code[%d])", i,
                      i - 1);
  }
  return MF_OK;
}

/* Same value as folding mf_absmax_step over the block (NaN when any element is
 * non-finite), written so the compiler can vectorise it. */
static float block_absmax_cpu(const float *x, int64_t n) {
  float m = 0.0f;
  int bad = 0;
  for (int64_t i = 0; i < n; i++) {
    float a = fabsf(x[i]);
    bad |= !(a <= 3.402823466e38f);
    m = a > m ? a : m;
  }
  return bad ? mf_quiet_nan() : m;
}

#ifdef MF_X86_SIMD
#include <immintrin.h>

/* The AVX2 loops avoid gathers: an 8-lane vpgatherdd or vgatherdps is microcoded on
 * Zen 1/2 and costs several times eight scalar loads there (benchmarks/mca_model.py
 * models both forms on each CPU; benchmarks/history/2026-11-23-quant-amd-epyc-avx2.md
 * has the table). Table lookups are plain
 * loads with the indices in general registers, and the arithmetic around them is
 * vectorised. */

/* block_absmax_cpu 16 lanes at a time (two chains of vmaxps to hide its latency): the
 * same value, as max is exact in any order and a non-finite element makes it NaN. */
MF_TARGET_AVX2 static float block_absmax_avx2(const float *x, int64_t n) {
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 big = _mm256_set1_ps(3.402823466e38f);
  __m256 m0 = _mm256_setzero_ps(), m1 = m0, bad = m0;
  int64_t i = 0;
  MF_MCA_BEGIN("absmax_avx2 elems=16 isa=avx2");
  for (; i + 16 <= n; i += 16) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), abs);
    const __m256 b = _mm256_and_ps(_mm256_loadu_ps(x + i + 8), abs);
    m0 = _mm256_max_ps(a, m0);
    m1 = _mm256_max_ps(b, m1);
    /* (vmaxps drops a NaN operand, so non-finite lanes are flagged on their own) */
    bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_cmp_ps(a, big, _CMP_NLE_UQ),
                                         _mm256_cmp_ps(b, big, _CMP_NLE_UQ)));
  }
  MF_MCA_END();
  float lanes[8], m = 0.0f;
  _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
  for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
  const float rest = block_absmax_cpu(x + i, n - i);
  if (_mm256_movemask_ps(bad) || rest != rest) return mf_quiet_nan();
  return rest > m ? rest : m;
}

/* code[c[0..7]] as a vector, by scalar loads. */
MF_TARGET_AVX2 static inline __m256 code_lookup8(const float *code, const uint8_t *c) {
  const __m128 lo = _mm_setr_ps(code[c[0]], code[c[1]], code[c[2]], code[c[3]]);
  const __m128 hi = _mm_setr_ps(code[c[4]], code[c[5]], code[c[6]], code[c[7]]);
  return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}

/* mf_f32_to_bf16 of 8 floats (round to nearest even, NaN -> 0x7fc0). */
MF_TARGET_AVX2 static inline __m128i f32_to_bf16_8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* out[i] = code[c[i]] * a for one block, as float32 or bfloat16. */
MF_TARGET_AVX2 static void dequantize_block_avx2(const float *code, const uint8_t *c, float a,
                                                 int64_t n, void *out, mf_dtype dt) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  if (dt == MF_FLOAT32) {
    float *o = (float *)out;
    MF_MCA_BEGIN("dequant_f32_scalar_avx2 elems=8 isa=avx2");
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(code_lookup8(code, c + i), va));
    MF_MCA_END();
    for (; i < n; i++) o[i] = mf_dequantize_one(code, c[i], a);
  } else {
    uint16_t *o = (uint16_t *)out;
    MF_MCA_BEGIN("dequant_bf16_scalar_avx2 elems=8 isa=avx2");
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128((__m128i *)(o + i), f32_to_bf16_8(_mm256_mul_ps(code_lookup8(code, c + i), va)));
    MF_MCA_END();
    for (; i < n; i++) o[i] = mf_f32_to_bf16(mf_dequantize_one(code, c[i], a));
  }
}
#endif /* MF_X86_SIMD */

static void quantize_block_cpu(const float *x, int64_t n, int64_t first, const float *code,
                               const mf_code_lut *lut, uint8_t *out, float *absmax,
                               mf_rounding rounding, uint64_t seed) {
#ifdef MF_X86_SIMD
  float m = mf_cpu_isa() >= ISA_AVX2 ? block_absmax_avx2(x, n) : block_absmax_cpu(x, n);
#else
  float m = block_absmax_cpu(x, n);
#endif
  *absmax = m;
  const mf_block_scale s = mf_absmax_scale(m);
  if (rounding == MF_ROUND_STOCHASTIC) {
    for (int64_t i = 0; i < n; i++)
      out[i] = mf_quantize_stochastic(code, mf_block_normalize(x[i], s),
                                      mf_uniform(seed, (uint64_t)(first + i)));
  } else if (lut && s.pre == 1.0f) {
    mf_code_lut_quantize_n(lut, x, s.inv, n, out);
  } else if (lut) { /* a tiny block (x is the caller's: scaled one value at a time) */
    for (int64_t i = 0; i < n; i++) out[i] = mf_code_lut_quantize(lut, mf_block_normalize(x[i], s));
  } else {
    for (int64_t i = 0; i < n; i++) out[i] = mf_quantize_nearest(code, mf_block_normalize(x[i], s));
  }
}

/* Half-precision input widened block by block; one loop per dtype so the compiler can
 * vectorise the bfloat16 case. */
static void widen_to_f32(const void *src, int64_t first, int64_t n, mf_dtype dt, float *dst) {
  const uint16_t *p = (const uint16_t *)src + first;
  if (dt == MF_BFLOAT16) {
    for (int64_t i = 0; i < n; i++) dst[i] = mf_bf16_to_f32(p[i]);
  } else {
    for (int64_t i = 0; i < n; i++) dst[i] = mf_f16_to_f32(p[i]);
  }
}

/* Below this many elements building (or looking up) the table is not worth it. */
#define MF_LUT_MIN_NUMEL 32768

static mf_status quantize_cpu(const mf_tensor *x, const float *code, uint8_t *codes,
                              float *absmax, int64_t bs, mf_rounding rounding, uint64_t seed) {
  const int64_t numel = x->numel, nblocks = mf_quant_num_blocks(numel, bs);
  const mf_code_lut *lut = rounding == MF_ROUND_NEAREST && numel >= MF_LUT_MIN_NUMEL
                               ? mf_code_lut_get(code, MF_CODE_SIZE, 0)
                               : NULL;
  int failed = 0;
#pragma omp parallel num_threads(mf_get_num_threads()) if (nblocks > 4)
  {
    float *buf = NULL;
    if (x->dtype != MF_FLOAT32) {
      buf = (float *)malloc((size_t)bs * sizeof(float));
      if (!buf) {
#pragma omp atomic write
        failed = 1;
      }
    }
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
      if (x->dtype != MF_FLOAT32 && !buf) continue;
      int64_t first = b * bs;
      int64_t n = numel - first < bs ? numel - first : bs;
      const float *src;
      if (x->dtype == MF_FLOAT32) {
        src = (const float *)x->data + first;
      } else {
        widen_to_f32(x->data, first, n, x->dtype, buf);
        src = buf;
      }
      quantize_block_cpu(src, n, first, code, lut, codes + first, absmax + b, rounding, seed);
    }
    free(buf);
  }
  if (failed) return mf_error(MF_ERR_NOMEM, "quantize_blockwise: out of host memory");
  return MF_OK;
}

/* out[first + i] = code[c[i]] * a for one block of n elements, in out's dtype. */
static void dequantize_block_cpu(const float *code, const uint8_t *c, float a, int64_t n,
                                 void *out, int64_t first, mf_dtype dt) {
#ifdef MF_X86_SIMD
  if (dt != MF_FLOAT16 && mf_cpu_isa() >= ISA_AVX2) {
    dequantize_block_avx2(code, c, a, n, (char *)out + first * mf_dtype_size(dt), dt);
    return;
  }
#endif
  if (dt == MF_FLOAT32) {
    float *o = (float *)out + first;
    for (int64_t i = 0; i < n; i++) o[i] = mf_dequantize_one(code, c[i], a);
  } else if (dt == MF_BFLOAT16) {
    uint16_t *o = (uint16_t *)out + first;
    for (int64_t i = 0; i < n; i++) o[i] = mf_f32_to_bf16(mf_dequantize_one(code, c[i], a));
  } else {
    uint16_t *o = (uint16_t *)out + first;
    for (int64_t i = 0; i < n; i++) o[i] = mf_f32_to_f16(mf_dequantize_one(code, c[i], a));
  }
}

mf_status mf_quantize_blockwise(const mf_tensor *x, const mf_tensor *code, mf_tensor *codes,
                                mf_tensor *absmax, int64_t block_size, mf_rounding rounding,
                                uint64_t seed, void *stream) {
  mf_status st = check_common(x, "x", code, codes, absmax, block_size);
  if (st) return st;
  if (rounding != MF_ROUND_NEAREST && rounding != MF_ROUND_STOCHASTIC)
    return mf_error(MF_ERR_VALUE, "rounding: unknown mode %d", (int)rounding);
  if (x->device == MF_CUDA) {
#ifdef MEMFIT_WITH_CUDA
    return mf_cuda_quantize_blockwise(x, code, codes, absmax, block_size, rounding, seed,
                                      stream);
#else
    (void)stream;
    return mf_error_no_cuda("quantize_blockwise");
#endif
  }
  if ((st = check_code_sorted((const float *)code->data))) return st;
  return quantize_cpu(x, (const float *)code->data, (uint8_t *)codes->data,
                      (float *)absmax->data, block_size, rounding, seed);
}

mf_status mf_dequantize_blockwise(const mf_tensor *codes, const mf_tensor *absmax,
                                  const mf_tensor *code, mf_tensor *out, int64_t block_size,
                                  void *stream) {
  mf_status st = check_common(out, "out", code, codes, absmax, block_size);
  if (st) return st;
  if (out->device == MF_CUDA) {
#ifdef MEMFIT_WITH_CUDA
    return mf_cuda_dequantize_blockwise(codes, absmax, code, out, block_size, stream);
#else
    (void)stream;
    return mf_error_no_cuda("dequantize_blockwise");
#endif
  }
  const float *cd = (const float *)code->data, *am = (const float *)absmax->data;
  const uint8_t *c = (const uint8_t *)codes->data;
  const int64_t numel = out->numel, nblocks = mf_quant_num_blocks(numel, block_size);
  const mf_dtype dt = out->dtype;
  void *dst = out->data;
#pragma omp parallel for schedule(static) num_threads(mf_get_num_threads()) if (nblocks > 4)
  for (int64_t b = 0; b < nblocks; b++) {
    int64_t first = b * block_size;
    int64_t end = numel - first < block_size ? numel : first + block_size;
    dequantize_block_cpu(cd, c + first, am[b], end - first, dst, first, dt);
  }
  return MF_OK;
}
