/*
 * Private to the core: 8-bit dequantization without gathers on AVX512-VBMI CPUs (Ice
 * Lake, Sapphire Rapids, Zen 4 and later), for the fused step (optim_avx512.c) and the
 * trust ratio's norm pass (optim_trust.c). The values are code[q] * absmax, as
 * mf_dequantize_one computes them.
 */
#ifndef MEMFIT_OPTIM_VBMI_H
#define MEMFIT_OPTIM_VBMI_H

#include "cpu_isa.h"
#include "memfit/numeric.h"

#ifdef MF_X86_SIMD
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* Dequantization without gathers (AVX512-VBMI): the 256-entry code is split into four
 * byte planes (byte j of every code value), 4 registers each; vpermi2b looks up 64
 * indices in 128 bytes, a blend on the index's top bit picks the half, and byte
 * unpacks reassemble the floats. The codes are permuted first so that the unpacks
 * (which work within 128-bit lanes) leave the floats in order. */
typedef struct {
  __m512i plane[4][4];
  __m512i order;
} vbmi_code;

static inline void vbmi_code_init(vbmi_code *v, const float *code) {
  uint8_t bytes[4][256], order[64];
  for (int i = 0; i < 256; i++)
    for (int j = 0; j < 4; j++) bytes[j][i] = (uint8_t)(mf_f32_bits(code[i]) >> (8 * j));
  memcpy(v->plane, bytes, sizeof bytes);
  /* after the unpacks, output register r, lane l, dword w holds input byte
   * 16 l + 8 (r >> 1) + 4 (r & 1) + w; we want element 16 r + 4 l + w there */
  for (int r = 0; r < 4; r++)
    for (int l = 0; l < 4; l++)
      for (int w = 0; w < 4; w++) order[16 * l + 8 * (r >> 1) + 4 * (r & 1) + w] = (uint8_t)(16 * r + 4 * l + w);
  memcpy(&v->order, order, sizeof order);
}

MF_TARGET_VBMI static inline __m512i vbmi_plane(const __m512i *t, __m512i idx, __mmask64 hi) {
  return _mm512_mask_blend_epi8(hi, _mm512_permutex2var_epi8(t[0], idx, t[1]),
                                _mm512_permutex2var_epi8(t[2], idx, t[3]));
}

MF_TARGET_VBMI static inline void dequant64_vbmi(const vbmi_code *v, const uint8_t *q,
                                                 __m512 absmax, float *out) {
  const __m512i idx = _mm512_permutexvar_epi8(v->order, _mm512_loadu_si512(q));
  const __mmask64 hi = _mm512_movepi8_mask(idx);
  const __m512i b0 = vbmi_plane(v->plane[0], idx, hi), b1 = vbmi_plane(v->plane[1], idx, hi);
  const __m512i b2 = vbmi_plane(v->plane[2], idx, hi), b3 = vbmi_plane(v->plane[3], idx, hi);
  const __m512i l01 = _mm512_unpacklo_epi8(b0, b1), h01 = _mm512_unpackhi_epi8(b0, b1);
  const __m512i l23 = _mm512_unpacklo_epi8(b2, b3), h23 = _mm512_unpackhi_epi8(b2, b3);
  _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(l01, l23)), absmax));
  _mm512_storeu_ps(out + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(l01, l23)), absmax));
  _mm512_storeu_ps(out + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(h01, h23)), absmax));
  _mm512_storeu_ps(out + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(h01, h23)), absmax));
}

#endif /* MF_X86_SIMD */
#endif /* MEMFIT_OPTIM_VBMI_H */
