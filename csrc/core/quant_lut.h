/* Private to the core: the CPU's exact lookup table for nearest-code quantization. */
#ifndef MEMFIT_QUANT_LUT_H
#define MEMFIT_QUANT_LUT_H

#include <stdint.h>

#include "memfit/numeric.h"
#include "memfit/quant.h"

/* Buckets: sign x (one bucket for |x| < 2^-32, then 32 binades 2^-32 .. 1) x 1024
 * mantissa slices. Values of 2 or more, Inf and NaN have no bucket. */
#define MF_LUT_MANT_BITS 10
#define MF_LUT_EXP_LO 95 /* biased exponent of 2^-32 */
#define MF_LUT_EXP_HI 127 /* biased exponent of 1.0 */
#define MF_LUT_BINADES (MF_LUT_EXP_HI - MF_LUT_EXP_LO + 2)
#define MF_LUT_PER_SIGN (MF_LUT_BINADES << MF_LUT_MANT_BITS)
#define MF_LUT_SIZE (2 * MF_LUT_PER_SIGN)
#define MF_LUT_FALLBACK 0xffffu

/* The table for `code` (built once per distinct code, then cached for the life of the
 * process; at most a handful of codes are cached), or NULL when none is available, in
 * which case callers use the binary search. Thread-safe. */
const uint16_t *mf_quant_lut_get(const float *code);

/* Bucket of x, or -1 when x has none (|x| >= 2, Inf, NaN). */
static inline int32_t mf_lut_bucket(float x) {
  uint32_t u = mf_f32_bits(x);
  uint32_t sign = u >> 31, e = (u >> 23) & 0xffu;
  if (e > MF_LUT_EXP_HI) return -1;
  uint32_t slot = e < MF_LUT_EXP_LO ? 0u
                                    : (((e - MF_LUT_EXP_LO + 1u) << MF_LUT_MANT_BITS) |
                                       ((u >> (23 - MF_LUT_MANT_BITS)) & ((1u << MF_LUT_MANT_BITS) - 1u)));
  return (int32_t)(sign * MF_LUT_PER_SIGN + slot);
}

/* Exactly mf_quantize_nearest(code, x), through the table where the whole bucket of x
 * maps to one code. */
static inline uint8_t mf_quantize_nearest_lut(const uint16_t *lut, const float *code, float x) {
  int32_t b = mf_lut_bucket(x);
  if (b >= 0) {
    uint16_t v = lut[b];
    if (v != MF_LUT_FALLBACK) return (uint8_t)v;
  }
  return mf_quantize_nearest(code, x);
}

#endif /* MEMFIT_QUANT_LUT_H */
