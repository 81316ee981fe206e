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

/* How a block's values are brought to [-1, 1] before the code search:
 *     x_n = (x * pre) * inv,   pre = 1, inv = 1/absmax        (absmax >= 2^-64)
 *                              pre = 2^64, inv = 1/(absmax * 2^64)   (absmax < 2^-64)
 *     pre = 1, inv = 0 for an all-zero block (every value maps to the code nearest 0)
 *     and for a NaN block.
 * Why two factors: 1/absmax overflows to +Inf for absmax below about 2.9e-39 (2^-128;
 * subnormal blocks), which turned every element into +-Inf (and zeros into NaN). A
 * product by a power of two is exact unless it overflows or underflows, which cannot
 * happen here (|x| <= absmax < 2^-64), so x_n is the value x * (1/absmax) would have
 * had with an unbounded exponent: where 1/absmax is finite both forms round the same
 * real number the same way, so the bits are those of the plain x * (1/absmax) at every
 * absmax where that did not overflow (x * 1 is exact). Kernels multiply by pre only in
 * blocks where it is not 1 (a branch per block, never taken by ordinary data). */
typedef struct {
  float pre, inv;
} mf_block_scale;

static inline MF_HD mf_block_scale mf_absmax_scale(float absmax) {
  mf_block_scale s;
  s.pre = absmax < 5.42101086242752217e-20f ? 18446744073709551616.0f : 1.0f; /* 2^-64, 2^64 */
  s.inv = absmax > 0.0f ? 1.0f / (absmax * s.pre) : 0.0f;
  return s;
}

static inline MF_HD float mf_block_normalize(float x, mf_block_scale s) {
  return (x * s.pre) * s.inv;
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

/* Nearest, except that a positive x never gets a code value <= 0: where the nearest
 * one is, x takes the smallest positive code value instead (if the code has one).
 * The optimizers store their non-negative states (second moments) this way: a second
 * moment rounded to 0 under a non-zero first moment makes an update of lr * m / eps
 * (docs/optim.md, "Second moments never round to zero"). Still monotone in x, with one
 * step more at 0+ than nearest (the lookup tables of csrc/core/code_lut.h rely on
 * that). */
static inline MF_HD uint8_t mf_quantize_keep_positive_n(const float *code, int size, float x) {
  int q = mf_quantize_nearest_n(code, size, x);
  if (x > 0.0f && !(code[q] > 0.0f)) {
    const int first_positive = mf_code_floor_n(code, size, 0.0f) + 1;
    if (first_positive < size) q = first_positive;
  }
  return (uint8_t)q;
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
