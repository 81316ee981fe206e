/*
 * An exact code search for the GPU in one shared-memory load: a slice of the CPU's
 * lookup table (csrc/core/code_lut.h) built in shared memory.
 *
 * q(x) = mf_optim_quantize(code, size, x, keep_positive) is monotone in the float's key
 * (its bits made monotone as an unsigned integer, mf_code_lut_key). As on the CPU, the
 * keys are cut into buckets of 65536 by their top 16 bits (sign, exponent and the top
 * 7 mantissa bits: 1/128 of a binade), and a bucket where q steps at most once is one
 * 32-bit entry:
 *     q(x) = (entry + pos(x)) >> 16,   entry = (base << 16) + 0x10000 - jump,
 * base = q at the bucket's first key, jump = the position (low 16 bits of the key) of
 * the step, 0x10000 for none; a bucket where q steps more than once is SLOW (bit 31 set
 * in every sum) and its values take the binary search. The slice covers the buckets of
 * |x| in [2^-kSliceBinades, 2), both signs for a signed state (nearest) and x >= 0 for a
 * non-negative one (keep_positive): what a state normalised by its block's absmax
 * holds. Three more entries hold q of +-0 and of the tiny values below the slice on
 * each side when q is constant there (else SLOW); anything else (|x| >= 2, NaN, a
 * negative x in a positive-only slice) is SLOW.
 *
 * Exact by construction: every entry is computed from q itself (mf_optim_quantize on
 * the bucket's first and last float, and a binary search over the 16 position bits for
 * a bucket where q steps once), so the lookup gives the binary search's answer for every
 * float, and the binary search is the fallback. The build runs once per resident thread
 * block (all threads, one barrier after); it costs about 2 searches per entry.
 *
 * Sizes: kSliceBinades = 25 (|x| >= 2^-24, below which the codes memfit ships have no
 * step) gives 3200 entries per sign: 25.6 KB for a signed state and 12.8 KB for a
 * non-negative one. The T4 (sm_75: 64 KB of shared memory per SM) gets 12 binades, so
 * that three 256-thread blocks still fit an SM; the values below them take the search.
 */
#ifndef MEMFIT_CODE_SLICE_CUH
#define MEMFIT_CODE_SLICE_CUH

#include <cuda_runtime.h>

#include "memfit/numeric.h"
#include "memfit/optim.h"

#if defined(MF_CODE_SLICE_BINADES) /* tests/emulate/code_slice_check.cpp checks both forms */
constexpr int kSliceBinades = MF_CODE_SLICE_BINADES;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr int kSliceBinades = 12;
#else
constexpr int kSliceBinades = 25;
#endif
constexpr uint32_t kSliceSlow = 0x80000000u;
constexpr uint32_t kSliceRange = (uint32_t)kSliceBinades << 7; /* buckets per sign */
/* top 16 bits of |x| at the slice's first bucket: biased exponent 128 - binades */
constexpr uint32_t kSliceLow = (uint32_t)(128 - kSliceBinades) << 7;
constexpr int kSliceExtra = 3; /* +-0, tiny positive, tiny negative */

/* Entries of a slice for one state: signed states both signs, non-negative ones x >= 0. */
constexpr int kSliceSigned = 2 * (int)kSliceRange + kSliceExtra;
constexpr int kSlicePositive = (int)kSliceRange + kSliceExtra;

/* The float of a bucket (sign neg, top 16 bits of |x| `hi`) at key position pos. */
__device__ __forceinline__ float slice_float(uint32_t neg, uint32_t hi, uint32_t pos) {
  return neg ? mf_f32_from_bits(0x80000000u | (hi << 16) | (0xffffu - pos))
             : mf_f32_from_bits((hi << 16) | pos);
}

/* q of the floats with bits in [lo, hi] (a run of one sign, in key order first..last)
 * as an entry that needs no position: q << 16 when constant, else SLOW. */
template <int CS>
__device__ __forceinline__ uint32_t slice_const(const float *code, int keep, float first, float last) {
  const uint32_t a = mf_optim_quantize(code, CS, first, keep), b = mf_optim_quantize(code, CS, last, keep);
  return a == b ? a << 16 : kSliceSlow;
}

/* Fills slice[0 .. kSlicePositive (keep) or kSliceSigned) for `code` (in shared memory, CS entries) with
 * all threads of the block; the caller's next __syncthreads() publishes it. */
template <int CS>
__device__ void slice_build(uint32_t *slice, const float *code, bool keep) {
  const int signs = keep ? 1 : 2, n = signs * (int)kSliceRange;
  for (int e = threadIdx.x; e < n; e += blockDim.x) {
    const uint32_t neg = e >= (int)kSliceRange, hi = kSliceLow + (uint32_t)e - (neg ? kSliceRange : 0);
    const uint32_t base = mf_optim_quantize(code, CS, slice_float(neg, hi, 0), keep);
    const uint32_t top = mf_optim_quantize(code, CS, slice_float(neg, hi, 0xffff), keep);
    uint32_t entry = kSliceSlow;
    if (top == base) {
      entry = base << 16;
    } else if (top == base + 1) { /* the smallest position with q = top, in (0, 0xffff] */
      uint32_t lo = 0, up = 0xffff;
      while (up - lo > 1) {
        const uint32_t mid = (lo + up) / 2;
        if (mf_optim_quantize(code, CS, slice_float(neg, hi, mid), keep) == top) up = mid;
        else lo = mid;
      }
      entry = (base << 16) + 0x10000u - up;
    }
    slice[e] = entry;
  }
  if (threadIdx.x == 0) {
    const uint32_t below = kSliceLow << 16; /* bits of the slice's smallest |x| */
    slice[n] = mf_optim_quantize(code, CS, 0.0f, keep) << 16;
    slice[n + 1] = slice_const<CS>(code, keep, mf_f32_from_bits(1), mf_f32_from_bits(below - 1));
    slice[n + 2] = keep ? kSliceSlow
                        : slice_const<CS>(code, keep, mf_f32_from_bits(0x80000000u | (below - 1)),
                                          mf_f32_from_bits(0x80000001u));
  }
}

/* mf_optim_quantize(code, CS, x, keep) through the slice (keep: whether it was built
 * positive-only). */
template <int CS>
__device__ __forceinline__ uint8_t slice_quantize(const uint32_t *slice, const float *code, bool keep,
                                                  float x) {
  const uint32_t u = mf_f32_bits(x), a = u & 0x7fffffffu, neg = u >> 31, hi = a >> 16;
  const int n = (keep ? 1 : 2) * (int)kSliceRange;
  uint32_t r;
  if (hi - kSliceLow < kSliceRange) {
    const uint32_t pos = neg ? 0xffffu - (a & 0xffffu) : a & 0xffffu;
    r = keep && neg ? kSliceSlow : slice[hi - kSliceLow + (neg ? kSliceRange : 0)] + pos;
  } else if (hi < kSliceLow) {
    r = slice[n + (a == 0 ? 0 : 1 + (int)neg)];
  } else {
    r = kSliceSlow;
  }
  if (r & kSliceSlow) return mf_optim_quantize(code, CS, x, keep);
  return (uint8_t)(r >> 16);
}

#endif /* MEMFIT_CODE_SLICE_CUH */
