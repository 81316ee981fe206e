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
 * dynamic map, evenly spaced within a decade. So for x >= 0 the axis is cut into at most
 * MF_CODE_LUT_PIECES "pieces", each one run of evenly spaced thresholds (a decade), and
 * in piece p
 *     t = min(fmaf(|x|, pa[p], pc[p]), phi[p]),   g = floor(t / MF_CODE_LUT_FRAC),
 * is q(x): t is the line through the piece's thresholds, in fixed point (the step index
 * times MF_CODE_LUT_FRAC), capped at the piece's last step (the decade's last code holds
 * on past the decade's edge, up to the next decade's first threshold). The piece of |x|
 * comes without a search: |x|'s binary exponent picks a segment (32 of them: segment 0
 * |x| < 2^-30, segment 31 |x| >= 1), no segment holds more than one piece boundary, so
 *     p = piece_lo[segment] + (|x| > split[piece_lo[segment]]),
 * split[p] being the last float of piece p.
 * For x < 0, q(x) = max(mirror - g, 0). Where t is within one unit (1/MF_CODE_LUT_FRAC of
 * a step) of a multiple of MF_CODE_LUT_FRAC, x is "ambiguous": the line need not put
 * the step exactly where the code does, and kernels take the table for such x (about 3
 * elements in 10000 of Adam-like states, so one 16-lane vector in 200). So is a piece's
 * last float: the step there is one the line does not pass through, and a tie between
 * two codes (x exactly halfway) is not mirrored for -x (nearest rounds ties to the
 * smaller index on both sides of 0). The build
 * (build_arith in code_lut.c) fits the pieces to the code and checks the claim for every
 * float x, exactly; a code it does not hold for gets arith = 0 and the table alone. The
 * operations are IEEE ones (fmaf, compares, min, floor: correctly rounded on every CPU),
 * so the scalar form below and the vector forms compute the same t. Per 16 elements the
 * vector form is 22 operations, 5 of them permutes (4 from one register). */
#define MF_CODE_LUT_PIECES 16 /* one AVX-512 register of each piece table */
#define MF_CODE_LUT_SEGMENTS 32
#define MF_CODE_LUT_FRAC_BITS 12 /* t in fixed point */
#define MF_CODE_LUT_FRAC (1 << MF_CODE_LUT_FRAC_BITS)
#define MF_CODE_LUT_EXP0 96   /* biased exponent of segment 0's top binade, 2^-31 */

typedef struct {
  const uint32_t *entry;   /* MF_CODE_LUT_BUCKETS entries, as above */
  const float *code;       /* the code (a private copy, sorted ascending in [-1, 1]) */
  int size;                /* 16 or 256 entries */
  int keep_positive;       /* the search it reproduces (mf_optim_quantize) */
  int has_slow;            /* some bucket is slow */
  int arith;               /* the arithmetic search below holds for this code */
  int32_t mirror;          /* q(x < 0) = max(mirror - g(|x|), 0) */
  /* 16-entry codes: the thresholds T_1 .. T_15 (the smallest float with q >= k) as a
   * search tree, node n (1 .. 15) at tree4[n]: the root T_8, then n's children 2n and
   * 2n + 1; q(x) is the leaf 16 + q reached from the root by going to 2n + (x >= T)
   * four times. Exact for every x but NaN (the compares are IEEE ones; +-0 compare
   * equal, as q treats them). */
  _Alignas(64) float tree4[16];
  /* the arithmetic search: the piece of each segment's smallest floats; per piece its
   * last float (+Inf for the last piece; -0 for a piece of +0 alone, whose end is no
   * tie: +-0 have one code, and -0 equals no |x| bit for bit) and the line and cap
   * above (pieces past the last repeat it) */
  _Alignas(64) int32_t piece_lo[MF_CODE_LUT_SEGMENTS];
  _Alignas(64) float split[MF_CODE_LUT_PIECES];
  _Alignas(64) float pa[MF_CODE_LUT_PIECES];
  _Alignas(64) float pc[MF_CODE_LUT_PIECES];
  _Alignas(64) float phi[MF_CODE_LUT_PIECES];
} mf_code_lut;

/* The segment of a float with bits u (sign ignored): its biased exponent clamped to
 * [EXP0, EXP0 + 31], less EXP0. */
static inline int mf_code_lut_segment(uint32_t u) {
  int e = (int)((u & 0x7fffffffu) >> 23);
  e = e < MF_CODE_LUT_EXP0 ? MF_CODE_LUT_EXP0 : e;
  e = e > MF_CODE_LUT_EXP0 + 31 ? MF_CODE_LUT_EXP0 + 31 : e;
  return e - MF_CODE_LUT_EXP0;
}

/* The piece of |x| (ax: a non-negative float), and whether ax is the last float before
 * a piece boundary (*at_split = 1: ambiguous, as below). */
static inline int mf_code_lut_piece(const mf_code_lut *t, float ax, int *at_split) {
  const int p = t->piece_lo[mf_code_lut_segment(mf_f32_bits(ax))];
  *at_split = mf_f32_bits(ax) == mf_f32_bits(t->split[p]); /* (bits: see split) */
  return p + (ax > t->split[p]);
}

/* t of the arithmetic search for ax >= 0 in piece p. */
static inline float mf_code_lut_arith_t(const mf_code_lut *t, int p, float ax) {
  const float v = fmaf(ax, t->pa[p], t->pc[p]);
  return v < t->phi[p] ? v : t->phi[p];
}

/* The index for x (bits u) from its t, and whether x is ambiguous (*amb = 1: the index
 * is not to be used). floor(t) >> FRAC_BITS is floor(t / MF_CODE_LUT_FRAC) (an
 * arithmetic shift, as the vector forms do); t stays within [-2^20, 2^20], so the conversion is
 * exact. */
static inline int mf_code_lut_arith_from_t(const mf_code_lut *t, uint32_t u, float tt, int *amb) {
  const int32_t ti = (int32_t)floorf(tt);
  *amb = ((uint32_t)(ti + 1) & (MF_CODE_LUT_FRAC - 2)) == 0; /* ti mod FRAC in {FRAC - 1, 0} */
  int q = ti >> MF_CODE_LUT_FRAC_BITS;
  if (u >> 31) q = t->mirror - q;
  return q < 0 ? 0 : q;
}

/* The arithmetic search's index for x (finite), and whether x is ambiguous. */
static inline int mf_code_lut_arith_index(const mf_code_lut *t, float x, int *amb) {
  const uint32_t u = mf_f32_bits(x);
  const float ax = mf_f32_from_bits(u & 0x7fffffffu);
  int at_split;
  const int p = mf_code_lut_piece(t, ax, &at_split);
  const int q = mf_code_lut_arith_from_t(t, u, mf_code_lut_arith_t(t, p, ax), amb);
  *amb |= at_split;
  return q;
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
