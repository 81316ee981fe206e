/*
 * memfit core: scalar conversions and a counter-based RNG, written once for the
 * CPU (C11) and the GPU (nvcc). Integer-only bit manipulation on purpose: it cannot
 * be changed by FMA contraction, flush-to-zero or fast-math flags, so the CPU loop
 * and the CUDA kernel produce the same bits.
 *
 * Rounding: float -> bfloat16 and float -> float16 round to nearest, ties to even,
 * bit-identical to torch's scalar conversions (c10::BFloat16 / c10::Half). NaN maps
 * to the canonical quiet NaN torch's scalar path uses (bf16 0x7FC0, fp16 0x7E00 with
 * the sign kept); float16 overflow (|x| >= 65520) gives +-inf.
 */
#ifndef MEMFIT_NUMERIC_H
#define MEMFIT_NUMERIC_H

#include <stdint.h>
#include <string.h>

#include "memfit/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Always inlined by GCC/Clang on the host. The CPU kernels that call these conversions
 * per element are compiled with target attributes (AVX2, AVX-512: csrc/core/optim_*.c),
 * and GCC does not inline a plain `static inline` function into a caller with other
 * target options by its own size estimate: it left mf_hash64 and mf_f32_to_bf16_sr as a
 * call per element in the fused optimizer kernels, the stores then cost 5x the whole
 * rest of the step (benchmarks/RESULTS.md, "Stochastic-rounding store per kernel
 * variant"). Inlined, the store loops vectorise (tests/test_optim_store_inline.py checks
 * the built library). Nothing changes for nvcc (the device code is inlined anyway). */
#if defined(__GNUC__) && !defined(__CUDACC__)
#define MF_HOST_INLINE __attribute__((always_inline))
#else
#define MF_HOST_INLINE
#endif

/* A float's bits as a uint32 and back: nvcc's intrinsics on the device, memcpy (the
 * portable bit cast, compiled to a register move) on the host. */
#ifdef __CUDA_ARCH__
static inline MF_HD uint32_t mf_f32_bits(float f) { return __float_as_uint(f); }
static inline MF_HD float mf_f32_from_bits(uint32_t u) { return __uint_as_float(u); }
#else
static inline MF_HD uint32_t mf_f32_bits(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }
static inline MF_HD float mf_f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }
#endif

/* Finite (not NaN, not +-Inf), by the exponent bits: exact and vectorisable. */
static inline MF_HD int mf_isfinite_f32(float x) {
  return (mf_f32_bits(x) & 0x7f800000u) != 0x7f800000u;
}

/* Both finite: x - x is +0 for a finite x and NaN for +-Inf or NaN, and NaN equals
 * nothing; two subtractions and a compare where two mf_isfinite_f32 take four
 * operations. (Exact unless compiled with -ffinite-math-only, which would fold x - x
 * to 0; memfit never is.) */
static inline MF_HD int mf_both_finite_f32(float x, float y) {
  return (x - x) == (y - y);
}

/* keep ? old : new, as a bitwise select. The same value as the conditional, written
 * so that a compiler cannot turn `*p = ok ? new : *p` into a conditional store: GCC
 * vectorises that as a masked store (vmaskmovps), which is microcoded on AMD Zen and
 * made the AVX2 optimizer loop run at half its speed there; a blend is one cheap
 * instruction on every x86 CPU. */
static inline MF_HD float mf_select_f32(int keep, float old_value, float new_value) {
  const uint32_t m = 0u - (uint32_t)(keep != 0);
  return mf_f32_from_bits((mf_f32_bits(old_value) & m) | (mf_f32_bits(new_value) & ~m));
}

/* ---- bfloat16 ---------------------------------------------------------- */

static inline MF_HD MF_HOST_INLINE float mf_bf16_to_f32(uint16_t h) {
  return mf_f32_from_bits((uint32_t)h << 16);
}

static inline MF_HD MF_HOST_INLINE uint16_t mf_f32_to_bf16(float f) {
  uint32_t u = mf_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  /* add 0x7fff plus the lowest kept bit: ties go to the even neighbour */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* ---- float16 ----------------------------------------------------------- */

static inline MF_HD MF_HOST_INLINE float mf_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu;
  uint32_t m = h & 0x3ffu;
  if (e == 0x1f) return mf_f32_from_bits(sign | 0x7f800000u | (m << 13));
  if (e == 0) {
    if (m == 0) return mf_f32_from_bits(sign);
    /* subnormal: shift the mantissa up until its leading one is the implicit bit */
    int32_t ee = 1;
    while (!(m & 0x400u)) {
      m <<= 1;
      ee--;
    }
    m &= 0x3ffu;
    return mf_f32_from_bits(sign | ((uint32_t)(ee + 112) << 23) | (m << 13));
  }
  return mf_f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
}

static inline MF_HD MF_HOST_INLINE uint16_t mf_f32_to_f16(float f) {
  uint32_t u = mf_f32_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);  /* NaN */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520: inf */
  if (a >= 0x38800000u) {                                 /* normal half */
    /* rebias the exponent (127 -> 15) and round the 13 dropped bits, ties to even */
    a += 0xc8000fffu + ((a >> 13) & 1u);
    return (uint16_t)(sign | (a >> 13));
  }
  if (a < 0x33000000u) return sign; /* below half the smallest subnormal: zero */
  /* subnormal half: value / 2^-24 = m * 2^(e-126), rounded to nearest even */
  uint32_t e = a >> 23;
  uint32_t m = (a & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126u - e; /* 14..24 */
  uint32_t r = m >> shift;
  uint32_t rem = m & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (r & 1u))) r++;
  return (uint16_t)(sign | r);
}

/* ---- load / store any float dtype as float32 ---------------------------- */

static inline MF_HD MF_HOST_INLINE float mf_load_f32(const void *p, int64_t i, mf_dtype dt) {
  switch (dt) {
    case MF_FLOAT16: return mf_f16_to_f32(((const uint16_t *)p)[i]);
    case MF_BFLOAT16: return mf_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
  }
}

static inline MF_HD MF_HOST_INLINE void mf_store_f32(void *p, int64_t i, mf_dtype dt, float v) {
  switch (dt) {
    case MF_FLOAT16: ((uint16_t *)p)[i] = mf_f32_to_f16(v); break;
    case MF_BFLOAT16: ((uint16_t *)p)[i] = mf_f32_to_bf16(v); break;
    default: ((float *)p)[i] = v; break;
  }
}

/* ---- a deterministic exp ----------------------------------------------- */

/* A double's bits as a uint64 and back (as mf_f32_bits). */
#ifdef __CUDA_ARCH__
static inline MF_HD uint64_t mf_f64_bits(double d) { return (uint64_t)__double_as_longlong(d); }
static inline MF_HD double mf_f64_from_bits(uint64_t u) { return __longlong_as_double((long long)u); }
#else
static inline MF_HD uint64_t mf_f64_bits(double d) { uint64_t u; memcpy(&u, &d, sizeof u); return u; }
static inline MF_HD double mf_f64_from_bits(uint64_t u) { double d; memcpy(&d, &u, sizeof d); return d; }
#endif

/* e^x in double from IEEE + - * / only, so the host and the device compute the same
 * bits (glibc's exp and CUDA's differ in the last place): x = k ln2 + r with |r| <=
 * ln2/2 (Cody-Waite: ln2 split into a head with 11 trailing zero bits, so k * head is
 * exact for |k| < 2^11, and a tail), e^r by its Taylor series to degree 13 in Horner
 * form (truncation below 5e-18 relative), then times 2^k through the exponent bits (in
 * two factors where 2^k alone would be subnormal). Within a few ulp of the exact value
 * (tests/test_optim_ademamix.py checks it against math.exp). x > 709.78: +Inf;
 * x < -745.2: 0; NaN: NaN. Used by AdEMAMix's beta3 scheduler (optim.h). */
static inline MF_HD double mf_exp_f64(double x) {
  if (!(x == x)) return x;
  if (x > 709.782712893384) return mf_f64_from_bits(0x7ff0000000000000ull);
  if (x < -745.2) return 0.0;
  const double ln2_hi = 6.93147180369123816490e-01, ln2_lo = 1.90821492927058770002e-10;
  const double inv_ln2 = 1.44269504088896338700e+00;
  const double kd = x * inv_ln2;
  const int64_t k = (int64_t)(kd < 0.0 ? kd - 0.5 : kd + 0.5); /* nearest, ties away */
  const double r = (x - (double)k * ln2_hi) - (double)k * ln2_lo;
  double s = 1.0 / 6227020800.0; /* 1/13! */
  s = s * r + 1.0 / 479001600.0;
  s = s * r + 1.0 / 39916800.0;
  s = s * r + 1.0 / 3628800.0;
  s = s * r + 1.0 / 362880.0;
  s = s * r + 1.0 / 40320.0;
  s = s * r + 1.0 / 5040.0;
  s = s * r + 1.0 / 720.0;
  s = s * r + 1.0 / 120.0;
  s = s * r + 1.0 / 24.0;
  s = s * r + 1.0 / 6.0;
  s = s * r + 0.5;
  s = s * r + 1.0;
  s = s * r + 1.0;
  /* 2^k = 2^k1 * 2^(k - k1), both factors normal: exact but for the last product's
   * rounding into the subnormal range */
  const int64_t k1 = k < -1000 ? -1000 : (k > 1000 ? 1000 : k);
  s = s * mf_f64_from_bits((uint64_t)(k1 + 1023) << 52);
  return s * mf_f64_from_bits((uint64_t)(k - k1 + 1023) << 52);
}

/* ---- counter-based random numbers --------------------------------------- */

/* splitmix64's finaliser over (seed, counter): stateless, so element i gets the same
 * number on the CPU and the GPU whatever the thread layout. In two parts: the state
 * z = seed + MF_HASH64_STEP * (counter + 1) and the mix of it, so that a loop over
 * consecutive counters can step z by MF_HASH64_STEP (an add: the same bits modulo 2^64)
 * instead of multiplying per element, one of the three 64-bit multiplies per element
 * of the CPU's stochastic-rounding store (csrc/core/optim_cpu.h, store_params). */
#define MF_HASH64_STEP 0x9e3779b97f4a7c15ull

static inline MF_HD MF_HOST_INLINE uint64_t mf_hash64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static inline MF_HD MF_HOST_INLINE uint64_t mf_hash64(uint64_t seed, uint64_t counter) {
  return mf_hash64_mix(seed + MF_HASH64_STEP * (counter + 1u));
}

/* Uniform float in [0, 1) with 24 random bits (exactly representable). */
static inline MF_HD float mf_uniform(uint64_t seed, uint64_t counter) {
  return (float)(mf_hash64(seed, counter) >> 40) * (1.0f / 16777216.0f);
}

#ifdef __cplusplus
}
#endif
#endif /* MEMFIT_NUMERIC_H */
