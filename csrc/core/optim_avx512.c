/*
 * The CPU optimizer step for quantized states on AVX-512 (+VBMI): one fused,
 * software-pipelined pass per work item. 8-bit states (every optimizer kind) and
 * 4-bit states (Adam/AdamW, as AdamW4bit ships).
 *
 * Why a separate kernel. The generic block kernel (optim.c) runs four loops per block
 * (dequantize, update, absmax, requantize). Each loop is bound by a different unit:
 * the update by the divider (one sqrt and one division per element), the dequantize
 * and requantize loops by table gathers (load ports). Run one after the other they
 * add up. Here the dequantization uses byte permutes instead of gathers (see
 * vbmi_code), and one loop does, for every group of 64 elements, the dequantize and
 * update of block j and the requantize of block j - 1 (whose absmax is known by then),
 * so the out-of-order core can overlap the divider with the gathers:
 *
 *   for j = 0 .. blocks:                       (one extra round drains the pipeline)
 *     for each group of 64 elements o in a block:
 *       if j < blocks:  ring[j] <- dequant(codes of block j at o); update p, ring[j]
 *                       (mf_optim_update_one, the same math as every other path);
 *                       running absmax of ring[j]
 *       if j > 0:       codes of block j-1 at o <- nearest(ring[j-1] * inv[j-1])
 *
 * The arithmetic is the generic kernel's, operation for operation (the update loop is
 * the same inline function, absmax is the same integer max, the code search is the
 * exact table of code_lut.h), so the bits are the same; tests compare the variants.
 * Compiled with -ffp-contract=off like optim.c.
 *
 * Two builds of this file: this one for CPUs with AVX512-VBMI (Ice Lake, Sapphire
 * Rapids, Zen 4 and later), and optim_avx512_gather.c, which defines MF_FUSED_GATHER
 * and includes it, for AVX-512 CPUs without VBMI (Skylake-SP, Cascade Lake: much of the
 * cloud, Colab included). The only difference is the 8-bit dequantization: byte
 * permutes here, table gathers there (same values). Entry points carry the suffix.
 */
#include "code_lut_avx512.h"
#include "optim_cpu.h"

#ifdef MF_X86_SIMD
#include <string.h>

#ifdef MF_FUSED_GATHER
#define FUSED_TARGET MF_TARGET_AVX512
#define FUSED_ENTRY(name) name##_gather
#else
#define FUSED_TARGET MF_TARGET_VBMI
#define FUSED_ENTRY(name) name##_vbmi
#endif

/* max over the |bit patterns| of 64 floats, folded into m */
MF_TARGET_AVX512 static inline __m512i absmax64(__m512i m, const float *s) {
  const __m512i mask = _mm512_set1_epi32(0x7fffffff);
  for (int k = 0; k < 4; k++)
    m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(s + 16 * k)), mask));
  return m;
}

#define GROUP 64 /* one VBMI dequantization and one absmax64 per state */

/* Software prefetch, PREFETCH elements (1-2 KB of each array) ahead of the group being
 * dequantized. The loop is compute-heavy, so the demand misses of its five streams
 * (param, grad, two code arrays, and the params written back) come late for the
 * hardware prefetchers; on the 2-core reference machine this took the 16M-param
 * 2-thread step from 11.7 to 10.9-11.1 ms (best of 8 runs; 256-4096 all helped, 256-512
 * most). Only within the work item: prefetches never cross into another thread's. */
#define PREFETCH 512

/* (Always inlined, and the builtin rather than _mm_prefetch: GCC 12 otherwise finds a
 * non-inlined helper "pure" and deletes its calls, prefetches and all.) */
MF_INLINE void prefetch_group(const mf_optim_tensor *t, size_t es, int bits, int ns, int64_t i) {
  const char *p = (const char *)t->param.data + i * es, *g = (const char *)t->grad.data + i * es;
  for (size_t off = 0; off < GROUP * es; off += 64) {
    __builtin_prefetch(p + off, 0, 3);
    __builtin_prefetch(g + off, 0, 3);
  }
  const int64_t byte = bits == 8 ? i : i / 2;
  __builtin_prefetch((const char *)t->state1.data + byte, 0, 3);
  if (ns > 1) __builtin_prefetch((const char *)t->state2.data + byte, 0, 3);
}

#ifndef MF_FUSED_GATHER
/* Dequantization without gathers (AVX512-VBMI): the 256-entry code is split into four
 * byte planes (byte j of every code value), 4 registers each; vpermi2b looks up 64
 * indices in 128 bytes, a blend on the index's top bit picks the half, and byte
 * unpacks reassemble the floats. The codes are permuted first so that the unpacks
 * (which work within 128-bit lanes) leave the floats in order. */
typedef struct {
  __m512i plane[4][4];
  __m512i order;
} vbmi_code;
_Static_assert(sizeof(vbmi_code) <= sizeof(((thread_bufs *)0)->fused_tables[0]),
               "thread_bufs.fused_tables holds a vbmi_code");

static void vbmi_code_init(vbmi_code *v, const float *code) {
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

#else

/* Without VBMI: one gather of 16 code values per 16 indices. */
MF_TARGET_AVX512 static inline void dequant64_gather(const float *code, const uint8_t *q,
                                                     __m512 absmax, float *out) {
  for (int v = 0; v < 4; v++) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * v)));
    _mm512_storeu_ps(out + 16 * v, _mm512_mul_ps(_mm512_i32gather_ps(idx, code, 4), absmax));
  }
}
#endif /* MF_FUSED_GATHER */

/* 4-bit states: 64 elements are 32 bytes, element 2i in the low nibble of byte i. The
 * 16-entry code fits one register, so the lookup is a permute (no gather, no VBMI). */
MF_TARGET_AVX512 static inline void dequant64_4bit(const float *code, const uint8_t *q,
                                                   __m512 absmax, float *out) {
  const __m512 table = _mm512_loadu_ps(code);
  const __m128i low4 = _mm_set1_epi8(15);
  for (int v = 0; v < 4; v++) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + 8 * v));
    const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(bytes, low4),
                                          _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
    const __m512 x = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(nib), table);
    _mm512_storeu_ps(out + 16 * v, _mm512_mul_ps(x, absmax));
  }
}

/* 16 code indices (bytes, each < 16) -> 8 bytes, element 2i in the low nibble of byte i */
MF_TARGET_AVX512 static inline void store_nibbles(__m128i q, uint8_t *out) {
  const __m128i pairs = _mm_maddubs_epi16(q, _mm_set1_epi16(0x1001)); /* q[2i] + 16 q[2i+1] */
  _mm_storel_epi64((__m128i *)out, _mm_packus_epi16(pairs, pairs));
}

/* `kind`, `ns` and `bits` (8 or 4) are constants in each instantiation below (no
 * branches on them in the loop). */
MF_INLINE FUSED_TARGET void fused(const mf_optim_kind kind, const int ns, const int bits,
                                     const mf_optim_hparams *h, const mf_optim_consts *c,
                                     int64_t bs, const quant_ctx *qc, const mf_optim_tensor *t,
                                     int64_t first, int64_t n, thread_bufs *b) {
  const mf_dtype dt = t->param.dtype;
  const size_t es = mf_dtype_size(dt);
  const int64_t blocks = n / bs;
  /* state bytes of this item (4-bit: first is a multiple of the block size, so even) */
  const int64_t byte0 = bits == 8 ? first : first / 2;
  uint8_t *codes[2] = {(uint8_t *)t->state1.data + byte0,
                       ns > 1 ? (uint8_t *)t->state2.data + byte0 : NULL};
  float *absmax[2] = {(float *)t->absmax1.data + first / bs,
                      ns > 1 ? (float *)t->absmax2.data + first / bs : NULL};
  float *p = dt == MF_FLOAT32 ? (float *)t->param.data + first : b->p;
  const float *g = dt == MF_FLOAT32 ? (const float *)t->grad.data + first : b->g;
  float inv_prev[2] = {0.0f, 0.0f};
#ifndef MF_FUSED_GATHER
  vbmi_code *vc = (vbmi_code *)(void *)b->fused_tables;
  if (bits == 8 && !b->fused_ready) {
    for (int k = 0; k < ns; k++) vbmi_code_init(&vc[k], qc->code[k]);
    b->fused_ready = 1;
  }
#endif
  __m512i slow = _mm512_setzero_si512();
  for (int64_t j = 0; j <= blocks; j++) {
    float *cur[2] = {b->ring + (j & 1) * 2 * bs, b->ring + (j & 1) * 2 * bs + bs};
    float *prev[2] = {b->ring + ((j + 1) & 1) * 2 * bs, b->ring + ((j + 1) & 1) * 2 * bs + bs};
    const __m512 am[2] = {_mm512_set1_ps(j < blocks ? absmax[0][j] : 0.0f),
                          _mm512_set1_ps(j < blocks && ns > 1 ? absmax[1][j] : 0.0f)};
    const __m512 inv[2] = {_mm512_set1_ps(inv_prev[0]), _mm512_set1_ps(inv_prev[1])};
    __m512i mx[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int64_t o = 0; o < bs; o += GROUP) {
      if (j < blocks) {
        const int64_t at = j * bs + o;
        if (at + PREFETCH < n) prefetch_group(t, es, bits, ns, first + at + PREFETCH);
        for (int k = 0; k < ns; k++) {
#ifndef MF_FUSED_GATHER
          if (bits == 8) dequant64_vbmi(&vc[k], codes[k] + at, am[k], cur[k] + o);
#else
          if (bits == 8) dequant64_gather(qc->code[k], codes[k] + at, am[k], cur[k] + o);
#endif
          else dequant64_4bit(qc->code[k], codes[k] + at / 2, am[k], cur[k] + o);
        }
        if (dt != MF_FLOAT32) {
          load_params(t, first + at, GROUP, p + at);
          widen(t->grad.data, dt, first + at, GROUP, b->g + at);
        }
        update_loop(kind, c, ns, GROUP, p + at, g + at, cur[0] + o, ns > 1 ? cur[1] + o : b->zero);
        if (dt != MF_FLOAT32) store_params(h, t, p + at, first + at, GROUP);
        for (int k = 0; k < ns; k++) mx[k] = absmax64(mx[k], cur[k] + o);
      }
      if (j > 0) {
        const int64_t at = (j - 1) * bs + o;
        for (int k = 0; k < ns; k++)
          for (int v = 0; v < GROUP; v += 16) {
            const __m128i q =
                mf_code_lut_quantize16(qc->lut[k], _mm512_loadu_ps(prev[k] + o + v), inv[k], &slow, 0);
            if (bits == 8) _mm_storeu_si128((__m128i *)(codes[k] + at + v), q);
            else store_nibbles(q, codes[k] + (at + v) / 2);
          }
      }
    }
    if (j > 0 && ((uint32_t)_mm512_reduce_or_epi32(slow) & MF_CODE_LUT_SLOW)) {
      for (int k = 0; k < ns; k++) { /* buckets that need the binary search */
        if (bits == 8) {
          mf_code_lut_quantize_n(qc->lut[k], prev[k], inv_prev[k], bs, codes[k] + (j - 1) * bs);
        } else {
          mf_code_lut_quantize_n(qc->lut[k], prev[k], inv_prev[k], bs, b->q);
          pack4(b->q, bs, codes[k] + (j - 1) * bs / 2);
        }
      }
      slow = _mm512_setzero_si512();
    }
    if (j < blocks) {
      for (int k = 0; k < ns; k++) {
        const float a = mf_f32_from_bits((uint32_t)_mm512_reduce_max_epu32(mx[k]));
        absmax[k][j] = a;
        inv_prev[k] = mf_absmax_inverse(a);
      }
    }
  }
}

/* One instantiation per optimizer kind and state count, for 8-bit states. */
FUSED_TARGET void FUSED_ENTRY(mf_optim_fused8_avx512)(const mf_optim_hparams *h,
                                                    const mf_optim_consts *c, int ns, int64_t bs,
                                                    const quant_ctx *qc, const mf_optim_tensor *t,
                                                    int64_t first, int64_t n, thread_bufs *b) {
#define FUSED(kind, ns) fused(kind, ns, 8, h, c, bs, qc, t, first, n, b)
  switch (h->kind) {
    case MF_OPT_ADAMW: FUSED(MF_OPT_ADAMW, 2); break;
    case MF_OPT_ADAM: FUSED(MF_OPT_ADAM, 2); break;
    case MF_OPT_LION: FUSED(MF_OPT_LION, 1); break;
    case MF_OPT_SGD: FUSED(MF_OPT_SGD, 1); break; /* with momentum: one state */
    case MF_OPT_RMSPROP:
      if (ns == 2) FUSED(MF_OPT_RMSPROP, 2);
      else FUSED(MF_OPT_RMSPROP, 1);
      break;
  }
#undef FUSED
}

/* 4-bit states: the optimizers that ship them (AdamW4bit; the functional API also
 * takes other kinds, which use the block kernel). */
FUSED_TARGET void FUSED_ENTRY(mf_optim_fused4_avx512)(const mf_optim_hparams *h,
                                                    const mf_optim_consts *c, int ns, int64_t bs,
                                                    const quant_ctx *qc, const mf_optim_tensor *t,
                                                    int64_t first, int64_t n, thread_bufs *b) {
  (void)ns;
  if (h->kind == MF_OPT_ADAMW) fused(MF_OPT_ADAMW, 2, 4, h, c, bs, qc, t, first, n, b);
  else fused(MF_OPT_ADAM, 2, 4, h, c, bs, qc, t, first, n, b);
}

#endif /* MF_X86_SIMD */
