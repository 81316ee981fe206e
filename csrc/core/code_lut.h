/*
 * Private to the core: an exact lookup table for nearest-code search on the CPU.
 *
 * q(x) = mf_optim_quantize(code, size, x, keep_positive) (nearest, or nearest with
 * positive values kept off the code values <= 0: optim.h) is monotone in x (x not
 * NaN), so it is a
 * step function with at most size - 1 jumps. We order all floats by their key, the bit
 * pattern made monotone as an unsigned integer (u ^ 0x80000000 for x >= +0, ~u for
 * negative x), and cut the keys into 65536 buckets by their top 16 bits (sign,
 * exponent and the top 7 mantissa bits: 1/128 of a binade). Per bucket b we know q at
 * the bucket's first key (`base`) and the position `jump` inside the bucket where q
 * steps up by one, if it does (jump = 0x10000 when it does not). With pos(x) the low 16
 * bits of the key,
 *     q(x) = base + (pos(x) >= jump) = (entry[b] + key(x)) >> 16,
 *     entry[b] = (base << 16) + 0x10000 - jump - (b << 16)   (mod 2^32),
 * since entry[b] + key = (base << 16) + 0x10000 - jump + pos: the carry out of the low
 * 16 bits is the step. That sum is below 2^24, so q is byte 2 of it and the byte above
 * is zero; a vector kernel picks byte 2 with one byte permute and needs no shift. This
 * is exact: the table only skips the search, it never approximates. A bucket where q
 * jumps more than once (codes closer together than 1/128 of a binade; none of the
 * codes memfit ships) gets entry[b] = MF_CODE_LUT_SLOW - (b << 16), so its sums have
 * bit 31 set, and its elements take the binary search.
 *
 * Every float has a bucket (256 KB per table): no clamping on the way in. Only the
 * buckets that the data touches are read, and an optimizer's states normalised by
 * their block absmax lie in [-1, 1], a few KB of the table. NaN is ordered past +-Inf
 * by its key; its buckets hold q(+-Inf), and callers that can see NaN map it to 0 (the
 * binary search's answer) themselves.
 *
 * Tables are built once per distinct code and cached for the life of the process
 * (pointers stay valid while other threads insert).
 */
#ifndef MEMFIT_CODE_LUT_H
#define MEMFIT_CODE_LUT_H

#include <math.h>
#include <stdint.h>

#include "memfit/numeric.h"
#include "memfit/optim.h"

#define MF_CODE_LUT_BUCKETS 65536
#define MF_CODE_LUT_SLOW 0x80000000u  /* set in entry + key: this bucket needs the search */

/* The search without a table lookup (a gather or a load per element costs more than this
 * arithmetic on AMD Zen 5, where a 16-lane gather takes ~20 cycles; the kernels time both
 * and keep the faster: mf_optim_search_form). q(x) is a staircase whose steps, the
 * thresholds T_k (the smallest float with q >= k), follow the code's structure: for the
 * dynamic map, evenly spaced within a decade, so the piecewise-linear curve through the
 * points (T_k, k) is concave for x > 0. Cut |x| into 32 segments by its binary exponent
 * (segment 0: |x| < 2^-30; segment 31: |x| >= 1); in each, that curve is the minimum of
 * MF_CODE_LUT_LINES lines a x + c, and for x >= 0
 *     t = min_l fmaf(|x|, a[l][s], c[l][s]),   g = floor(t),
 * is q(x) wherever t is not within MF_CODE_LUT_EPS of an integer; for x < 0, q(x) =
 * max(mirror - g, 0), q(+-0) = at_zero, and q(x) = top_q from x = top on. An element
 * whose t is that close to an integer is "ambiguous": kernels take the table for it
 * (about 3 elements in 10000 of Adam-like states, so one 16-lane vector in 200). The
 * build (build_arith in code_lut.c) fits the lines to the code and checks the claim for
 * every float x, exactly; a code it does not hold for gets arith = 0 and the table
 * alone. The operations are IEEE ones (fmaf, compares, floor: correctly rounded on
 * every CPU), so the scalar form below and the vector forms compute the same t. */
#define MF_CODE_LUT_LINES 3 /* the kernels' lines per segment */
#define MF_CODE_LUT_FIT 4   /* the fit's, one of which must then go */
#define MF_CODE_LUT_SEGMENTS 32
#define MF_CODE_LUT_EPS (1.0f / 4096.0f)
#define MF_CODE_LUT_EXP0 96 /* biased exponent of segment 0's top binade, 2^-31 */

typedef struct {
  const uint32_t *entry;   /* MF_CODE_LUT_BUCKETS entries, as above */
  const float *code;       /* the code (a private copy, sorted ascending in [-1, 1]) */
  int size;                /* 16 or 256 entries */
  int keep_positive;       /* the search it reproduces (mf_optim_quantize) */
  int has_slow;            /* some bucket is slow */
  int arith;               /* the arithmetic search below holds for this code */
  int32_t mirror, at_zero; /* q(x < 0) = max(mirror - g(|x|), 0); q(+-0) = at_zero */
  int32_t top_q;           /* q(x) = top_q for x >= top: the last step, left out of */
  float top;               /* the lines (1.0 is closer to the code below it than the
                            * dynamic map's spacing, a convex corner) */
  /* 16-entry codes: the thresholds T_1 .. T_15 (the smallest float with q >= k) as a
   * search tree, node n (1 .. 15) at tree4[n]: the root T_8, then n's children 2n and
   * 2n + 1; q(x) is the leaf 16 + q reached from the root by going to 2n + (x >= T)
   * four times. Exact for every x but NaN (the compares are IEEE ones; +-0 compare
   * equal, as q treats them). */
  _Alignas(64) float tree4[16];
  _Alignas(64) float a[MF_CODE_LUT_LINES][MF_CODE_LUT_SEGMENTS];
  _Alignas(64) float c[MF_CODE_LUT_LINES][MF_CODE_LUT_SEGMENTS];
} mf_code_lut;

/* The segment of a float with bits u (sign ignored): its biased exponent clamped to
 * [EXP0, EXP0 + 31], less EXP0. */
static inline int mf_code_lut_segment(uint32_t u) {
  int e = (int)((u & 0x7fffffffu) >> 23);
  e = e < MF_CODE_LUT_EXP0 ? MF_CODE_LUT_EXP0 : e;
  e = e > MF_CODE_LUT_EXP0 + 31 ? MF_CODE_LUT_EXP0 + 31 : e;
  return e - MF_CODE_LUT_EXP0;
}

/* t of the arithmetic search for |x| (the bits of a non-negative float). */
static inline float mf_code_lut_arith_t(const mf_code_lut *t, float ax) {
  const int s = mf_code_lut_segment(mf_f32_bits(ax));
  float m = fmaf(ax, t->a[0][s], t->c[0][s]);
  for (int l = 1; l < MF_CODE_LUT_LINES; l++) {
    const float v = fmaf(ax, t->a[l][s], t->c[l][s]);
    m = v < m ? v : m;
  }
  return m;
}

/* The arithmetic search's index for x (finite), and whether x is ambiguous (*amb = 1:
 * the index is not to be used). */
static inline int mf_code_lut_arith_index(const mf_code_lut *t, float x, int *amb) {
  const uint32_t u = mf_f32_bits(x);
  const float ax = mf_f32_from_bits(u & 0x7fffffffu);
  const float tt = mf_code_lut_arith_t(t, ax);
  const float r = tt - rintf(tt);
  *amb = fabsf(r) < MF_CODE_LUT_EPS && ax != 0.0f;
  int q = (int)floorf(tt);
  if (u >> 31) q = t->mirror - q;
  q = q < 0 ? 0 : q;
  q = x >= t->top ? t->top_q : q;
  return ax == 0.0f ? t->at_zero : q;
}

/* q(x) of a 16-entry code by its threshold tree (t->tree4), for x not NaN. */
static inline int mf_code_lut_tree4_index(const mf_code_lut *t, float x) {
  int n = 1;
  for (int d = 0; d < 4; d++) n = 2 * n + (x >= t->tree4[n]);
  return n - 16;
}

/* The table for this code (size 16 or 256, validated by the caller) and search
 * (keep_positive: see mf_optim_quantize), or NULL when out of memory or when the cache
 * is full (callers then use the binary search, which gives the same answers).
 * Thread-safe. */
const mf_code_lut *mf_code_lut_get(const float *code, int size, int keep_positive);

/* The float's bits as an unsigned integer in the order of the values (-0 just below
 * +0; negative NaNs below -Inf, positive ones above +Inf). */
static inline uint32_t mf_code_lut_key(uint32_t u) {
  return u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u);
}

/* Exactly mf_optim_quantize(t->code, t->size, x, t->keep_positive). */
static inline uint8_t mf_code_lut_quantize(const mf_code_lut *t, float x) {
  const uint32_t u = mf_f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0; /* NaN */
  const uint32_t key = mf_code_lut_key(u);
  const uint32_t sum = t->entry[key >> 16] + key;
  if (sum & MF_CODE_LUT_SLOW) return mf_optim_quantize(t->code, t->size, x, t->keep_positive);
  return (uint8_t)(sum >> 16);
}

/* q[i] = mf_code_lut_quantize(t, x[i] * inv) for i < n, 16 (8) at a time with AVX-512
 * (AVX2) gathers where the CPU has them. */
void mf_code_lut_quantize_n(const mf_code_lut *t, const float *x, float inv, int64_t n, uint8_t *q);

#endif /* MEMFIT_CODE_LUT_H */
