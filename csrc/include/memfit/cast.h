/*
 * memfit core: casts between float32, float16 and bfloat16, with round-to-nearest-even
 * (bit-identical to torch's .to()) or stochastic rounding (unbiased: the expected
 * result equals the input). The rounding math is written once, MF_HD, for the CPU
 * loop (csrc/core/cast.c) and the CUDA kernel (cuda/cast.cu), integer-only so both
 * give the same bits.
 *
 * Stochastic rounding picks one of the two representable neighbours of x, the upper
 * one (in magnitude) with probability (|x| - lo) / (hi - lo), using `r`, uniform
 * random bits. Range rules, the same for both target types:
 *  - NaN stays NaN (canonical quiet NaN), +-Inf stays +-Inf;
 *  - a finite x that round-to-nearest would send to +-Inf (|x| >= 65520 for float16,
 *    |x| >= 0x1.fffp127 for bfloat16) becomes +-Inf too;
 *  - below that, a value above the largest finite number rounds down to it (the only
 *    place where stochastic rounding is biased: it never invents an infinity);
 *  - float16 subnormals are rounded stochastically too (values below 2^-24 round up
 *    to 2^-24 with probability |x| / 2^-24).
 */
#ifndef MEMFIT_CAST_H
#define MEMFIT_CAST_H

#include "memfit/common.h"
#include "memfit/numeric.h"

#ifdef __cplusplus
extern "C" {
#endif

static inline MF_HD MF_HOST_INLINE uint16_t mf_f32_to_bf16_sr(float f, uint32_t r) {
  uint32_t u = mf_f32_bits(f);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fc0u;                  /* NaN */
  if (a >= 0x7f7f8000u) return (uint16_t)((u >> 16 & 0x8000u) | 0x7f80u); /* inf */
  uint32_t up = (a & 0xffffu) > (r & 0xffffu) ? 1u : 0u; /* P = low16 / 2^16 */
  uint32_t h = (a >> 16) + up;
  if (h == 0x7f80u) h = 0x7f7fu; /* never round a finite value up to inf */
  return (uint16_t)((u >> 16 & 0x8000u) | h);
}

static inline MF_HD MF_HOST_INLINE uint16_t mf_f32_to_f16_sr(float f, uint64_t r) {
  uint32_t u = mf_f32_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
  if (a >= 0x38800000u) { /* normal float16: 13 mantissa bits dropped */
    uint32_t rebased = a - 0x38000000u;
    uint32_t h = (rebased >> 13) + (((rebased & 0x1fffu) > (uint32_t)(r & 0x1fffu)) ? 1u : 0u);
    if (h == 0x7c00u) h = 0x7bffu;
    return (uint16_t)(sign | h);
  }
  /* float16 subnormal (or zero): value / 2^-24 = m * 2^-shift */
  uint32_t e = a >> 23;
  uint64_t m = e ? ((a & 0x7fffffu) | 0x800000u) : (a & 0x7fffffu);
  uint32_t shift = e ? 126u - e : 125u; /* >= 14 */
  if (shift >= 64u) return sign;         /* |x| < 2^-64 * 2^24: P(up) < 2^-40, taken as 0 */
  uint64_t q = m >> shift;
  uint64_t rem = m & ((1ull << shift) - 1ull);
  uint64_t draw = r & ((1ull << shift) - 1ull); /* uniform in [0, 2^shift) */
  return (uint16_t)(sign | (uint32_t)(q + (rem > draw ? 1u : 0u)));
}

/* x (float32, float16 or bfloat16) -> out (same numel, any of those dtypes).
 * Narrowing uses `rounding`; widening and same-dtype casts are exact. Stochastic
 * rounding of element i uses mf_hash64(seed, i), so results are reproducible and
 * identical on CPU and GPU. */
mf_status mf_cast(const mf_tensor *x, mf_tensor *out, mf_rounding rounding, uint64_t seed,
                  void *stream);

/* The element function shared by the CPU loop and the CUDA kernel. */
static inline MF_HD void mf_cast_one(const void *x, mf_dtype xt, void *out, mf_dtype ot,
                                     int64_t i, int stochastic, uint64_t seed) {
  float v = mf_load_f32(x, i, xt);
  if (stochastic && ot == MF_BFLOAT16) {
    ((uint16_t *)out)[i] = mf_f32_to_bf16_sr(v, (uint32_t)mf_hash64(seed, (uint64_t)i));
  } else if (stochastic && ot == MF_FLOAT16) {
    ((uint16_t *)out)[i] = mf_f32_to_f16_sr(v, mf_hash64(seed, (uint64_t)i));
  } else {
    mf_store_f32(out, i, ot, v);
  }
}

#ifdef __cplusplus
}
#endif
#endif /* MEMFIT_CAST_H */
