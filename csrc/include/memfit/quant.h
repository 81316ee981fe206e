/*
 * memfit core: blockwise quantization with a 256-entry code.
 *
 * A float array is cut into blocks of `block_size` elements (the last one may be
 * partial). Each block stores absmax = max |x| as float32, and each element stores
 * the uint8 index of the code value nearest to x / absmax. The code is any sorted
 * table of 256 floats in [-1, 1]: the dynamic (tree) map of Dettmers et al. 2022 for
 * optimizer states, or a linear map.
 *
 * Non-finite input: a block containing NaN or +-Inf gets absmax = NaN, so every
 * element of that block dequantizes to NaN (its codes are deterministic but
 * meaningless); other blocks are unaffected. Nothing is hidden and nothing syncs.
 *
 * The element math below is shared by the CPU loop (csrc/core/quant.c) and the CUDA
 * kernels (cuda/quant.cu): same inputs, same codes, same absmax, bit for bit.
 */
#ifndef MEMFIT_QUANT_H
#define MEMFIT_QUANT_H

#include <math.h>

#include "memfit/common.h"
#include "memfit/numeric.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MF_CODE_SIZE 256
#define MF_QUANT_MIN_BLOCK 64
#define MF_QUANT_MAX_BLOCK 4096

/* ---- element math (host and device) -------------------------------------- */

static inline MF_HD float mf_quiet_nan(void) { return mf_f32_from_bits(0x7fc00000u); }

/* One step of the per-block absmax reduction. NaN is sticky, and a non-finite value
 * turns the block's absmax into NaN (see the header comment). */
static inline MF_HD float mf_absmax_step(float m, float v) {
  float a = fabsf(v);
  if (m != m || !(a <= 3.402823466e38f)) return mf_quiet_nan();
  return a > m ? a : m;
}

/* Combine two partial absmax values (both already NaN-or-finite). */
static inline MF_HD float mf_absmax_combine(float a, float b) {
  if (a != a || b != b) return mf_quiet_nan();
  return a > b ? a : b;
}

/* 1/absmax, or 0 for an all-zero block (every value then maps to the code nearest 0)
 * and for a NaN block. */
static inline MF_HD float mf_absmax_inverse(float absmax) {
  return absmax > 0.0f ? 1.0f / absmax : 0.0f;
}

/* Largest index i with code[i] <= x in a sorted code of `size` entries (a power of
 * two, at most 256); 0 if x is below code[0] or NaN. log2(size) branch-free steps. */
static inline MF_HD int mf_code_floor_n(const float *code, int size, float x) {
  int lo = 0;
  for (int step = size / 2; step > 0; step >>= 1)
    lo += (code[lo + step] <= x) ? step : 0;
  return lo;
}

/* Index of the code value nearest to x; a tie goes to the lower index. */
static inline MF_HD uint8_t mf_quantize_nearest_n(const float *code, int size, float x) {
  int lo = mf_code_floor_n(code, size, x);
  if (lo + 1 < size && (code[lo + 1] - x) < (x - code[lo])) lo++;
  return (uint8_t)lo;
}

/* The same for the 256-entry codes of 8-bit quantization. */
static inline MF_HD int mf_code_floor(const float *code, float x) {
  return mf_code_floor_n(code, MF_CODE_SIZE, x);
}

static inline MF_HD uint8_t mf_quantize_nearest(const float *code, float x) {
  return mf_quantize_nearest_n(code, MF_CODE_SIZE, x);
}

/* Stochastic rounding between the two code values around x: rounds up with
 * probability (x - lo) / (hi - lo), so the expected dequantized value is x.
 * `u` is uniform in [0, 1). */
static inline MF_HD uint8_t mf_quantize_stochastic(const float *code, float x, float u) {
  int lo = mf_code_floor(code, x);
  if (lo + 1 >= MF_CODE_SIZE || !(x > code[lo])) return (uint8_t)lo;
  float p = (x - code[lo]) / (code[lo + 1] - code[lo]);
  return (uint8_t)(u < p ? lo + 1 : lo);
}

static inline MF_HD float mf_dequantize_one(const float *code, uint8_t c, float absmax) {
  return code[c] * absmax;
}

/* ---- entry points ---------------------------------------------------------- */

/* Block sizes the kernels accept: 64, 128, ..., 4096. */
int mf_quant_block_size_ok(int64_t block_size);
int64_t mf_quant_num_blocks(int64_t numel, int64_t block_size);

/* x: float32/float16/bfloat16; code: float32[256], sorted ascending;
 * codes: uint8[numel(x)]; absmax: float32[num_blocks]. All on one device.
 * `stream` is a cudaStream_t for CUDA views (NULL: the default stream). */
mf_status mf_quantize_blockwise(const mf_tensor *x, const mf_tensor *code, mf_tensor *codes,
                                mf_tensor *absmax, int64_t block_size, mf_rounding rounding,
                                uint64_t seed, void *stream);

/* out: float32/float16/bfloat16 with numel(codes) elements, rounded to nearest even. */
mf_status mf_dequantize_blockwise(const mf_tensor *codes, const mf_tensor *absmax,
                                  const mf_tensor *code, mf_tensor *out, int64_t block_size,
                                  void *stream);

/* The dynamic (tree) map, 2^total_bits sorted values (see quant_map.c). */
mf_status mf_dynamic_map(float *out, int64_t out_len, int is_signed, int total_bits,
                         int max_exponent_bits);
/* Evenly spaced values in [-1, 1] (signed, with an exact 0) or [0, 1]. */
mf_status mf_linear_map(float *out, int64_t out_len, int is_signed, int total_bits);

#ifdef __cplusplus
}
#endif
#endif /* MEMFIT_QUANT_H */
