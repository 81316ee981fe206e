/*
 * The warp kernel of cuda/optim.cu: 8-bit states in blocks of 256, 4-bit in blocks of 128.
 *
 * optim_warp_kernel<BITS, KIND, PM> is optim_quant_kernel<256, 8, false> (BITS 8) and
 * optim_quant_kernel<128, 4, false> (BITS 4) for the optimizers and parameter forms
 * people run (warp_form() picks it; anything else takes the general kernel), shaped for
 * memory bandwidth, with the same bits:
 * - a warp owns whole quantization blocks: a tile of 256 elements is 8 consecutive
 *   elements per lane, one block of 256 (8-bit) or two of 128 (4-bit, a half-warp
 *   each), so the new absmax is 5 (4) shuffles and no barrier;
 * - every load of a tile (both absmax, the codes as one 8-byte (4-byte) load per lane,
 *   parameters and gradients as 16-byte loads) is issued before the first use; a lane
 *   whose 8 elements are not all there or not aligned takes scalar loads and stores;
 * - the optimizer kind, the number of states and the parameter form are template
 *   parameters: the element math (mf_optim_update_one, the same function as everywhere)
 *   folds to one optimizer's arithmetic;
 * - the grid stays resident (a few blocks per SM) and each warp walks items of kItem
 *   elements (the packer's items, LaunchList): the codes are loaded and the search
 *   slices built once per block, the per-tensor constants computed once per tensor a
 *   warp meets (every lane computes them: no barrier);
 * - the code search is one shared-memory load (code_slice.cuh) in launches large enough
 *   to pay for building the slice (slice_min_elements()), the binary search otherwise
 *   and for what the slice does not cover.
 *
 * This file holds what the kernel is made of below the kernel itself: its parameter forms,
 * the per-lane loads and stores of parameters and codes, the block max and the code
 * search; and the host rules for when it runs (warp_form, slice_min_elements).
 * optim_warp_kernel and its launch stay in optim.cu: the emulated build
 * (cuda/emulate/rewrite_launches.py) rewrites __shared__ declarations and <<<>>> launches
 * in .cu files only. Included by optim.cu alone.
 */
#pragma once

#include "code_slice.cuh"
#include "wide_access.cuh"
#include "memfit/numeric.h"
#include "memfit/optim.h"

#include <stdint.h>
#include <stdlib.h>

namespace {

enum ParamMode { kParamF32 = 0, kParamBF16 = 1, kParamBF16SR = 2 };
constexpr int kPerLane = 8;           /* elements per lane per tile */
constexpr int kTile = 32 * kPerLane;  /* a warp's tile */

/* Elements i .. i + 7 of a float32 (PM kParamF32) or bfloat16 array as floats: one or
 * two 16-byte loads (vec), else the first `valid` of them one by one (the rest 0). */
template <int PM>
__device__ __forceinline__ void load8(const void *base, int64_t i, bool vec, int valid,
                                      float v[kPerLane]) {
  if (PM == kParamF32) {
    const float *f = (const float *)base + i;
    if (vec) {
      const Vec16 a = ((const Vec16 *)f)[0], b = ((const Vec16 *)f)[1];
#pragma unroll
      for (int k = 0; k < 4; k++) {
        v[k] = mf_f32_from_bits(a.w[k]);
        v[k + 4] = mf_f32_from_bits(b.w[k]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < kPerLane; k++) v[k] = k < valid ? f[k] : 0.0f;
    }
  } else {
    const uint16_t *h = (const uint16_t *)base + i;
    if (vec) {
      const Vec16 a = *(const Vec16 *)h;
#pragma unroll
      for (int k = 0; k < 4; k++) {
        v[2 * k] = mf_bf16_to_f32((uint16_t)a.w[k]);
        v[2 * k + 1] = mf_bf16_to_f32((uint16_t)(a.w[k] >> 16));
      }
    } else {
#pragma unroll
      for (int k = 0; k < kPerLane; k++) v[k] = k < valid ? mf_bf16_to_f32(h[k]) : 0.0f;
    }
  }
}

/* Stores the updated parameters as mf_optim_store_param does for this form (no Kahan
 * buffer here): float32, or bfloat16 rounded to nearest-even or stochastically with the
 * bits mf_hash64(seed, index + k) of element number index + k. */
template <int PM>
__device__ __forceinline__ void store8(void *base, int64_t i, bool vec, int valid,
                                       const float v[kPerLane], uint64_t seed, int64_t index) {
  if (PM == kParamF32) {
    float *f = (float *)base + i;
    if (vec) {
      Vec16 a, b;
#pragma unroll
      for (int k = 0; k < 4; k++) {
        a.w[k] = mf_f32_bits(v[k]);
        b.w[k] = mf_f32_bits(v[k + 4]);
      }
      ((Vec16 *)f)[0] = a;
      ((Vec16 *)f)[1] = b;
    } else {
#pragma unroll
      for (int k = 0; k < kPerLane; k++)
        if (k < valid) f[k] = v[k];
    }
  } else {
    uint16_t *h = (uint16_t *)base + i;
    uint32_t r[kPerLane];
#pragma unroll
    for (int k = 0; k < kPerLane; k++)
      r[k] = PM == kParamBF16SR
                 ? mf_f32_to_bf16_sr(v[k], (uint32_t)mf_hash64(seed, (uint64_t)(index + k)))
                 : mf_f32_to_bf16(v[k]);
    if (vec) {
      Vec16 a;
#pragma unroll
      for (int k = 0; k < 4; k++) a.w[k] = r[2 * k] | (r[2 * k + 1] << 16);
      *(Vec16 *)h = a;
    } else {
#pragma unroll
      for (int k = 0; k < kPerLane; k++)
        if (k < valid) h[k] = (uint16_t)r[k];
    }
  }
}

/* Code indices of elements i .. i + 7 (i a multiple of 8): 8 bytes (8-bit) or 4 bytes
 * (4-bit) in one load (vec), else the first `valid` one by one (the rest 0). */
template <int BITS>
__device__ __forceinline__ void load_codes(const void *s, int64_t i, bool vec, int valid,
                                           uint32_t q[kPerLane]) {
  if (BITS == 8) {
    const uint8_t *b = (const uint8_t *)s + i;
    if (vec) {
      const Vec8 a = *(const Vec8 *)b;
#pragma unroll
      for (int k = 0; k < kPerLane; k++) q[k] = (a.w[k / 4] >> (8 * (k % 4))) & 255u;
    } else {
#pragma unroll
      for (int k = 0; k < kPerLane; k++) q[k] = k < valid ? b[k] : 0u;
    }
  } else {
    const uint8_t *b = (const uint8_t *)s + (i >> 1);
    if (vec) {
      const uint32_t a = *(const uint32_t *)b;
#pragma unroll
      for (int k = 0; k < kPerLane; k++) q[k] = (a >> (4 * k)) & 15u;
    } else {
#pragma unroll
      for (int k = 0; k < kPerLane; k++) q[k] = k < valid ? (b[k >> 1] >> ((k & 1) * 4)) & 15u : 0u;
    }
  }
}

/* Writes the code indices of elements i .. i + 7 (those past `valid` are 0, so the high
 * nibble of a 4-bit row's last byte is 0, as optim_quant_kernel writes it). */
template <int BITS>
__device__ __forceinline__ void store_codes(void *s, int64_t i, bool vec, int valid,
                                            const uint32_t q[kPerLane]) {
  if (BITS == 8) {
    uint8_t *b = (uint8_t *)s + i;
    if (vec) {
      Vec8 a;
#pragma unroll
      for (int j = 0; j < 2; j++)
        a.w[j] = q[4 * j] | (q[4 * j + 1] << 8) | (q[4 * j + 2] << 16) | (q[4 * j + 3] << 24);
      *(Vec8 *)b = a;
    } else {
#pragma unroll
      for (int k = 0; k < kPerLane; k++)
        if (k < valid) b[k] = (uint8_t)q[k];
    }
  } else {
    uint8_t *b = (uint8_t *)s + (i >> 1);
    uint32_t w = 0;
#pragma unroll
    for (int k = 0; k < kPerLane; k++) w |= q[k] << (4 * k);
    if (vec) {
      *(uint32_t *)b = w;
    } else {
#pragma unroll
      for (int j = 0; j < kPerLane / 2; j++)
        if (2 * j < valid) b[j] = (uint8_t)(w >> (8 * j));
    }
  }
}

/* Max of v over the lanes of one quantization block (groups of `lanes` lanes). */
template <int LANES>
__device__ __forceinline__ uint32_t group_max_u32(uint32_t v) {
#pragma unroll
  for (int off = LANES / 2; off > 0; off >>= 1) {
    const uint32_t o = __shfl_xor_sync(0xffffffffu, v, off);
    v = o > v ? o : v;
  }
  return v;
}

/* State k's code index of x (normalised), through the slice or the binary search. */
template <int CS>
__device__ __forceinline__ uint32_t quantize_state(const uint32_t *slice, const float *code, bool keep,
                                                   bool use_slice, float x) {
  return use_slice ? slice_quantize<CS>(slice, code, keep, x) : mf_optim_quantize(code, CS, x, keep);
}

/* The parameter form (ParamMode) optim_warp_kernel takes for this call, or -1 where
 * the general kernel must: 8-bit states in blocks of 256 or 4-bit ones in blocks of
 * 128; AdamW, Adam, Lion, SGD with momentum or Muon (state1 signed, Adam's state2
 * non-negative: the kernel's slices); every parameter float32, or every one bfloat16
 * without a Kahan buffer. */
int warp_form(const mf_optim_hparams *h, mf_state_format fmt, int64_t bs, const mf_optim_tensor *ts,
              int64_t n) {
  if (!((fmt == MF_STATE_8BIT && bs == MF_OPTIM_BLOCK_8BIT) ||
        (fmt == MF_STATE_4BIT && bs == MF_OPTIM_BLOCK_4BIT)) || n == 0)
    return -1;
  switch (h->kind) {
    case MF_OPT_ADAMW:
    case MF_OPT_ADAM:
    case MF_OPT_LION:
    case MF_OPT_MUON: break;
    case MF_OPT_SGD:
      if (h->momentum != 0.0) break;
      return -1;
    default: return -1;
  }
  if (!mf_optim_state_signed(h->kind, 1) ||
      (mf_optim_num_states(h) >= 2 && mf_optim_state_signed(h->kind, 2)))
    return -1;
  const mf_dtype dt = ts[0].param.dtype;
  if (dt != MF_FLOAT32 && dt != MF_BFLOAT16) return -1;
  for (int64_t i = 0; i < n; i++)
    if (ts[i].param.dtype != dt || ts[i].comp.data) return -1;
  return dt == MF_FLOAT32 ? kParamF32 : h->stochastic_round ? kParamBF16SR : kParamBF16;
}

/* Launches of at least this many elements build the code slices (code_slice.cuh):
 * MEMFIT_CUDA_SLICE_MIN, default 2^24. Below it the build (about two binary searches
 * per entry, once per resident block) would cost more than it saves. */
int64_t slice_min_elements() {
  static const int64_t v = [] {
    const char *e = getenv("MEMFIT_CUDA_SLICE_MIN");
    return e && *e ? (int64_t)atoll(e) : ((int64_t)1 << 24);
  }();
  return v;
}

}  // namespace
