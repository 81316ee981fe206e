/*
 * Private to the core: an exact lookup table for nearest-code search on the CPU.
 *
 * q(x) = mf_quantize_nearest_n(code, size, x) is monotone in x (x not NaN), so it is a
 * step function with at most size - 1 jumps. We cut floats into buckets by sign,
 * exponent and the top 7 mantissa bits (1/128 of a binade), and store per bucket q at
 * the bucket's low end (`base`) and the position `jump` inside the bucket where q
 * steps up by one, if it does (jump = 0x10000 when it does not). With pos(x) the low
 * 16 bits of |x|'s bit pattern, counted from the bucket's low end (reversed for
 * negative x, whose value falls as those bits grow),
 *     q(x) = base + (pos(x) >= jump) = (entry + pos(x)) >> 17,
 *     entry = (base << 17) + 0x20000 - jump,
 * which is exact: the table only skips the search, it never approximates. The sum
 * form costs two vector instructions. A bucket where q jumps more than once (codes
 * closer together than 1/128 of a binade; none of the codes memfit ships) is flagged,
 * and its elements take the binary search.
 *
 * Only binades that matter get buckets. Codes lie in [-1, 1], so q is constant for
 * |x| >= 1 (the last code, or the first for negative x): magnitudes of 2 and more
 * (and Inf) are clamped to the largest float below 2. Near zero, q is constant below
 * the smallest decision boundary: magnitudes below 2^(exp_lo - 127) are clamped up to
 * it, where exp_lo is the highest biased exponent that keeps q(x) = q(0) for all
 * clamped x. For the 8-bit dynamic map that leaves 24 binades, a 24 KB table that stays
 * in the L1 cache. NaN maps to 0, as the binary search does.
 *
 * Tables are built once per distinct code and cached for the life of the process
 * (pointers stay valid while other threads insert).
 */
#ifndef MEMFIT_CODE_LUT_H
#define MEMFIT_CODE_LUT_H

#include <stdint.h>

#include "memfit/numeric.h"
#include "memfit/quant.h"

#define MF_CODE_LUT_MANT_BITS 7
#define MF_CODE_LUT_SLOW 0x80000000u  /* q jumps more than once in this bucket */
#define MF_CODE_LUT_MAX_ABS 0x3fffffffu /* the largest float below 2, as bits */

/* Buckets are numbered by the top 16 bits of the (clamped) float: positive ones from
 * bucket0 to MF_CODE_LUT_MAX_ABS >> 16, negative ones 0x8000 higher; entry[b - bucket0]
 * (the range between the two signs is allocated but never touched). */
typedef struct {
  const uint32_t *entry;   /* (base << 17) + 0x20000 - jump, or MF_CODE_LUT_SLOW */
  const float *code;       /* the code (a private copy, sorted ascending in [-1, 1]) */
  int size;                /* 16 or 256 entries */
  int has_slow;            /* some bucket is MF_CODE_LUT_SLOW */
  uint32_t min_abs;        /* 2^(exp_lo - 127) as bits: smaller magnitudes clamp up */
  uint32_t bucket0;        /* bucket number of min_abs */
} mf_code_lut;

/* The table for this code (size 16 or 256, validated by the caller), or NULL when out
 * of memory or when the cache is full (callers then use the binary search, which gives
 * the same answers). Thread-safe. */
const mf_code_lut *mf_code_lut_get(const float *code, int size);

/* Exactly mf_quantize_nearest_n(t->code, t->size, x). */
static inline uint8_t mf_code_lut_quantize(const mf_code_lut *t, float x) {
  const uint32_t u = mf_f32_bits(x), neg = (uint32_t)((int32_t)u >> 31);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0; /* NaN */
  a = a < t->min_abs ? t->min_abs : (a > MF_CODE_LUT_MAX_ABS ? MF_CODE_LUT_MAX_ABS : a);
  const uint32_t clamped = a | (u & 0x80000000u);
  const uint32_t e = t->entry[(clamped >> 16) - t->bucket0];
  if (e & MF_CODE_LUT_SLOW) return mf_quantize_nearest_n(t->code, t->size, x);
  return (uint8_t)((e + ((clamped ^ neg) & 0xffffu)) >> 17);
}

/* q[i] = mf_code_lut_quantize(t, x[i] * inv) for i < n, 16 (8) at a time with AVX-512
 * (AVX2) gathers where the CPU has them. */
void mf_code_lut_quantize_n(const mf_code_lut *t, const float *x, float inv, int64_t n, uint8_t *q);

#endif /* MEMFIT_CODE_LUT_H */
