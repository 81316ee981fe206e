/*
 * Private to the core: the CPU optimizer step's entry point, and the pieces of it
 * shared by the block kernel (optim.c) and the fused kernels for quantized states
 * (optim_fused.h, built in optim_avx512.c and optim_avx2.c).
 */
#ifndef MEMFIT_OPTIM_CPU_H
#define MEMFIT_OPTIM_CPU_H

#include "code_lut.h"
#include "cpu_isa.h" /* kernel variants per ISA, picked at run time */
#include "memfit/optim.h"
#include "store_sr.h" /* the bf16 stochastic-rounding store by hand (AVX2, SSE2) */

#if defined(__GNUC__)
#define MF_INLINE static inline __attribute__((always_inline))
#else
#define MF_INLINE static inline
#endif

/* mf_optim_step on CPU arrays, after optim_api.c has checked every argument. */
mf_status mf_optim_step_cpu(const mf_optim_hparams *h, mf_state_format fmt, int64_t block_size,
                            const mf_tensor *code1, const mf_tensor *code2,
                            const mf_optim_tensor *tensors, int64_t n,
                            const mf_tensor *grad_scale, const mf_tensor *found_inf);

/* The trust ratio's norm pass (optim_trust.c; memfit/optim.h): fills every tensor's
 * scratch. */
mf_status mf_optim_trust_cpu(const mf_optim_hparams *h, mf_state_format fmt, int64_t block_size,
                             const mf_tensor *code1, const mf_tensor *code2,
                             const mf_optim_tensor *tensors, int64_t n, float inv_scale);

typedef struct {
  const float *code[3];        /* code tables of state1, state2, state3 */
  const mf_code_lut *lut[3];   /* their search tables (NULL: binary search) */
  int keep_positive[3];        /* the state is non-negative (mf_optim_quantize) */
  int code_size;               /* 256 or 16 */
  int search;                  /* the fused kernels' code search on this CPU: flags below */
} quant_ctx;

/* quant_ctx.search, as measured on this CPU (mf_optim_search_form, optim_search_form.c:
 * the ISA files call it, optim.c does not); every form gives the
 * same bytes. SEARCH_FAST: 8-bit codes by scalar loads (AVX2) or by the arithmetic of
 * code_lut.h (AVX-512), not by gathers. SEARCH_TREE4: 4-bit codes by the threshold
 * tree of code_lut.h, not by the table. */
#define SEARCH_FAST 1
#define SEARCH_TREE4 2

/* Per-thread scratch, `chunk` floats each (ring: 2 * max(ns, 2) quantization blocks;
 * s[2] only for three-state kinds), and the fused kernel's byte-plane code tables, one
 * per code (FUSED_TABLE; built on its first item of a step call; fused_ready = 0
 * before). */
typedef struct {
  float *p, *g, *s[3], *zero, *ring;
  uint8_t *q;
  int fused_ready;
  _Alignas(64) unsigned char fused_tables[2][1088];
} thread_bufs;

/* The fused kernel's table of state k (0-based): AdEMAMix's state3 is quantized with
 * code1, so it shares state1's. */
#define FUSED_TABLE(k) ((k) == 2 ? 0 : (k))

MF_INLINE void update_loop(mf_optim_kind kind, const mf_optim_consts *c, int ns, int64_t n,
                              float *restrict p, const float *restrict g, float *restrict s1,
                              float *restrict s2) {
  /* The arrays never overlap (restrict), but once this is inlined into the fused
   * kernel GCC loses that and adds run-time overlap checks to every 64-element call. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC ivdep
#endif
  for (int64_t i = 0; i < n; i++) mf_optim_update_one(kind, c, ns, &p[i], g[i], &s1[i], &s2[i]);
}

/* update_loop with SGD's, RMSprop's and Muon's run-time flags (the number of states,
 * SGD's first step, nesterov) as constants, on a local copy of the constants: with the
 * flags read from *c inside the loop, and *c possibly changed by the stores, GCC kept
 * these loops scalar on AVX2 and baseline x86-64 (AVX-512 vectorised them anyway). */
MF_INLINE void update_flags(mf_optim_kind kind, const mf_optim_consts *cp, int ns, int first,
                            int nesterov, int64_t n, float *restrict p, const float *restrict g,
                            float *restrict s1, float *restrict s2) {
  mf_optim_consts c = *cp;
  c.first = first;
  c.nesterov = nesterov;
  update_loop(kind, &c, ns, n, p, g, s1, s2);
}

/* The update loop with the kind a constant in each branch (so each one vectorises), and
 * the flags too for the kinds that have them (update_flags). */
MF_INLINE void update_any(mf_optim_kind kind, const mf_optim_consts *c, int ns, int64_t n,
                             float *restrict p, const float *restrict g, float *restrict s1,
                             float *restrict s2) {
  switch (kind) {
    case MF_OPT_ADAMW: update_loop(MF_OPT_ADAMW, c, ns, n, p, g, s1, s2); break;
    case MF_OPT_ADAM: update_loop(MF_OPT_ADAM, c, ns, n, p, g, s1, s2); break;
    case MF_OPT_LION: update_loop(MF_OPT_LION, c, ns, n, p, g, s1, s2); break;
    case MF_OPT_SGD:
      if (ns == 0) update_flags(MF_OPT_SGD, c, 0, 0, 0, n, p, g, s1, s2);
      else if (c->first) /* (the buffer is the gradient: once per run) */
        update_flags(MF_OPT_SGD, c, 1, 1, c->nesterov != 0, n, p, g, s1, s2);
      else if (c->nesterov) update_flags(MF_OPT_SGD, c, 1, 0, 1, n, p, g, s1, s2);
      else update_flags(MF_OPT_SGD, c, 1, 0, 0, n, p, g, s1, s2);
      break;
    case MF_OPT_RMSPROP:
      if (ns > 1) update_flags(MF_OPT_RMSPROP, c, 2, 0, 0, n, p, g, s1, s2);
      else update_flags(MF_OPT_RMSPROP, c, 1, 0, 0, n, p, g, s1, s2);
      break;
    case MF_OPT_MUON:
      if (c->nesterov) update_flags(MF_OPT_MUON, c, 1, 0, 1, n, p, g, s1, s2);
      else update_flags(MF_OPT_MUON, c, 1, 0, 0, n, p, g, s1, s2);
      break;
    case MF_OPT_ADAGRAD: update_loop(MF_OPT_ADAGRAD, c, ns, n, p, g, s1, s2); break;
    case MF_OPT_ADEMAMIX: break; /* three states: update_ademamix */
  }
}

/* AdEMAMix's update loop (the one three-state kind). */
MF_INLINE void update_ademamix(const mf_optim_consts *c, int64_t n, float *restrict p,
                               const float *restrict g, float *restrict s1,
                               float *restrict s2, float *restrict s3) {
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC ivdep /* (as in update_loop: without it GCC kept this loop scalar) */
#endif
  for (int64_t i = 0; i < n; i++)
    mf_optim_update_ademamix(c, &p[i], g[i], &s1[i], &s2[i], &s3[i]);
}

/* max |s[i]| as the max of the bit patterns with the sign cleared (same order as the
 * values for finite floats; states are finite: see mf_optim_update_one). */
MF_INLINE float block_absmax(const float *restrict s, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; i++) {
    uint32_t u = mf_f32_bits(s[i]) & 0x7fffffffu;
    m = u > m ? u : m;
  }
  return mf_f32_from_bits(m);
}

MF_INLINE void widen(const void *src, mf_dtype dt, int64_t first, int64_t n, float *restrict out) {
  if (dt == MF_BFLOAT16) {
    const uint16_t *s = (const uint16_t *)src + first;
    for (int64_t i = 0; i < n; i++) out[i] = mf_bf16_to_f32(s[i]);
  } else {
    for (int64_t i = 0; i < n; i++) out[i] = mf_load_f32(src, first + i, dt);
  }
}

MF_INLINE void narrow(const float *restrict v, mf_dtype dt, int64_t first, int64_t n, void *dst) {
  if (dt == MF_BFLOAT16) {
    uint16_t *d = (uint16_t *)dst + first;
    for (int64_t i = 0; i < n; i++) d[i] = mf_f32_to_bf16(v[i]);
  } else {
    for (int64_t i = 0; i < n; i++) mf_store_f32(dst, first + i, dt, v[i]);
  }
}

/* Half-precision parameters [first, first + n) as float32: the values an update starts
 * from (plus the Kahan compensation when the tensor has one). */
MF_INLINE void load_params(const mf_optim_tensor *t, int64_t first, int64_t n, float *restrict out) {
  if (t->comp.data) {
    for (int64_t i = 0; i < n; i++)
      out[i] = mf_optim_load_param(t->param.data, t->comp.data, first + i, t->param.dtype);
  } else {
    widen(t->param.data, t->param.dtype, first, n, out);
  }
}

/* The seed state z of element `first` of t's stochastic rounding: element first + i
 * rounds with mf_hash64_mix(z + i * MF_HASH64_STEP) = mf_hash64(seed, index_base +
 * first + i). */
MF_INLINE uint64_t sr_state(const mf_optim_hparams *h, const mf_optim_tensor *t, int64_t first) {
  return mf_optim_sr_seed(h, t->sr_stream) + MF_HASH64_STEP * ((uint64_t)(t->index_base + first) + 1u);
}

/* Writes updated half-precision parameters: Kahan-compensated, stochastic or
 * nearest-even rounding (mf_optim_store_param). `isa` (ISA_*, a constant in each
 * kernel): the stochastic-rounding loops of the generic x86-64 kernel are the SSE2 ones
 * of store_sr.h; the AVX2 and AVX-512 kernels call store_params_avx2 / _avx512
 * instead; other CPUs take GCC's form of the scalar loop. */
MF_INLINE void store_params(const mf_optim_hparams *h, const mf_optim_tensor *t,
                            const float *restrict v, int64_t first, int64_t n, const int isa) {
  /* mf_optim_store_param's three cases, each a loop of its own with the dtype a constant:
   * called per element, its branches kept the loop scalar, and stochastic rounding cost
   * several times the rest of the step (benchmarks/RESULTS.md, "bf16 parameters"). */
  const int bf = t->param.dtype == MF_BFLOAT16;
  uint16_t *restrict out = (uint16_t *)t->param.data + first;
  if (t->comp.data) {
    uint16_t *restrict comp = (uint16_t *)t->comp.data + first;
    if (bf)
      for (int64_t i = 0; i < n; i++) mf_optim_kahan_split(v[i], MF_BFLOAT16, &out[i], &comp[i]);
    else
      for (int64_t i = 0; i < n; i++) mf_optim_kahan_split(v[i], MF_FLOAT16, &out[i], &comp[i]);
  } else if (h->stochastic_round) {
    /* element i's bits are mf_hash64(seed, base + i): its state z stepped by an add per
     * element (mf_hash64_mix), a vector induction once vectorised */
    uint64_t z = sr_state(h, t, first);
#ifdef MF_X86_SIMD
    if (bf && isa == ISA_GENERIC) sr_store_bf16_sse2(v, n, z, out);
    else if (isa == ISA_GENERIC) sr_store_f16_sse2(v, n, z, out);
    else
#else
    (void)isa;
#endif
    if (bf)
      for (int64_t i = 0; i < n; i++, z += MF_HASH64_STEP)
        out[i] = mf_f32_to_bf16_sr(v[i], (uint32_t)mf_hash64_mix(z));
    else
      for (int64_t i = 0; i < n; i++, z += MF_HASH64_STEP)
        out[i] = mf_f32_to_f16_sr(v[i], mf_hash64_mix(z));
  } else {
    narrow(v, t->param.dtype, first, n, t->param.data);
  }
}

/* s[i] *= pre for a block whose absmax is so small that it is brought to [-1, 1] in
 * two products (mf_absmax_scale; pre = 1 for every other block, and nothing is done).
 * The block's values are scratch by then: only the code search reads them. */
MF_INLINE void prescale_block(float *restrict s, int64_t n, float pre) {
  if (pre != 1.0f)
    for (int64_t i = 0; i < n; i++) s[i] *= pre;
}

/* 4-bit states: q[2i] in the low nibble of out[i], q[2i+1] in the high one. */
MF_INLINE void pack4(const uint8_t *restrict q, int64_t n, uint8_t *restrict out) {
  int64_t pairs = n / 2;
  for (int64_t j = 0; j < pairs; j++) out[j] = (uint8_t)(q[2 * j] | (q[2 * j + 1] << 4));
  if (n & 1) out[pairs] = q[n - 1];
}

#ifdef MF_X86_SIMD
#include <immintrin.h>
#include <string.h>

/* AVX-512 dequantization, 16 elements at a time: the arithmetic of dequant8/dequant4 in
 * optim.c (one float multiply), for the fused kernels (optim_avx512.c), four times over
 * a group of 64. */
MF_TARGET_AVX512 static inline void dequant8_16_avx512(const uint8_t *restrict q,
                                                       const float *restrict code, __m512 absmax,
                                                       float *restrict out) {
  const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
  _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_i32gather_ps(idx, code, 4), absmax));
}

/* 4-bit: 16 codes fit one register, so the lookup is a permute (no gather). q: the 8
 * bytes of the 16 elements. */
MF_TARGET_AVX512 static inline void dequant4_16_avx512(const uint8_t *restrict q, __m512 table,
                                                       __m512 absmax, float *restrict out) {
  const __m128i low4 = _mm_set1_epi8(15), bytes = _mm_loadl_epi64((const __m128i *)q);
  const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(bytes, low4),
                                        _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
  const __m512 v = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(nib), table);
  _mm512_storeu_ps(out, _mm512_mul_ps(v, absmax));
}

/* Adam/AdamW over n elements on AVX2 (ns = 2): the arithmetic of MF_OPTIM_ADAM_MATH on 8
 * lanes, and the skip test (mf_both_finite_f32, as mf_optim_update_one applies it to
 * Adam) once per 8 elements as a branch: when all 8 are finite they are stored, else the
 * 8 go through mf_optim_update_one, which keeps the old values where it must. The same
 * bits as update_loop; what it saves is the three selects per element, which cost 10-17%
 * of the step on a core with 128-bit vector units such as Zen 1
 * (benchmarks/history/2026-11-24-optim-amd-epyc-adam-skip-branch.md).
 * GCC does not find this form in the scalar loop. */
MF_TARGET_AVX2 static inline void update_adam_avx2(mf_optim_kind kind, const mf_optim_consts *c,
                                                   int64_t n, float *restrict p,
                                                   const float *restrict g, float *restrict s1,
                                                   float *restrict s2) {
  const mf_optim_consts k = *c; /* (a local copy: the stores below cannot change it) */
  const int64_t whole = n - n % 8;
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256 p0 = _mm256_loadu_ps(p + i), a = _mm256_loadu_ps(s1 + i), b = _mm256_loadu_ps(s2 + i);
    __m256 gs = _mm256_loadu_ps(g + i) * k.gmul, pn, an, bn;
    MF_OPTIM_ADAM_MATH(kind, &k, _mm256_sqrt_ps, p0, gs, a, b, pn, an, bn);
    if (__builtin_expect(_mm256_movemask_ps(_mm256_cmp_ps(pn - pn, bn - bn, _CMP_EQ_OQ)) == 0xff, 1)) {
      _mm256_storeu_ps(p + i, pn);
      _mm256_storeu_ps(s1 + i, an);
      _mm256_storeu_ps(s2 + i, bn);
    } else {
      for (int j = 0; j < 8; j++) mf_optim_update_one(kind, &k, 2, &p[i + j], g[i + j], &s1[i + j], &s2[i + j]);
    }
  }
  for (int64_t i = whole; i < n; i++) mf_optim_update_one(kind, &k, 2, &p[i], g[i], &s1[i], &s2[i]);
}

/* The update on AVX2, for the block and the fused kernel: Adam/AdamW by
 * update_adam_avx2, the other kinds by the plain loop. With FMA (MF_TARGET_AVX2_FMA), so
 * that Muon's loop vectorises (its lerp's fmaf); a call from the AVX2 kernels, as before. */
MF_TARGET_AVX2_FMA static inline void update_avx2(mf_optim_kind kind, const mf_optim_consts *c, int ns,
                                              int64_t n, float *restrict p, const float *restrict g,
                                              float *restrict s1, float *restrict s2) {
  if (kind == MF_OPT_ADAMW || kind == MF_OPT_ADAM) update_adam_avx2(kind, c, n, p, g, s1, s2);
  else update_any(kind, c, ns, n, p, g, s1, s2);
}

/* store_params for the AVX2 kernels (the fused one and block_step_avx2): the
 * stochastic-rounding loops by hand (store_sr.h). Functions of their own with the
 * kernel's target, because GCC inlines an AVX2 function only into one with AVX2 too
 * (store_params has none) and, not inlined, the store was a call per 64 elements. */
MF_TARGET_AVX2 MF_INLINE void store_params_avx2(const mf_optim_hparams *h, const mf_optim_tensor *t,
                                                const float *restrict v, int64_t first, int64_t n) {
  uint16_t *out = (uint16_t *)t->param.data + first;
  if (t->comp.data || !h->stochastic_round) store_params(h, t, v, first, n, ISA_AVX2);
  else if (t->param.dtype == MF_BFLOAT16) sr_store_bf16_avx2(v, n, sr_state(h, t, first), out);
  else sr_store_f16_avx2(v, n, sr_state(h, t, first), out);
}

/* The AVX-512 kernels': bf16 by GCC's form of the scalar loop (with vpmullq the hash's
 * multiplies are cheap: within 1.3x of nearest), fp16 by the AVX2 loop (GCC keeps the
 * scalar one scalar: its subnormal branch). */
MF_TARGET_AVX512 MF_INLINE void store_params_avx512(const mf_optim_hparams *h, const mf_optim_tensor *t,
                                                    const float *restrict v, int64_t first, int64_t n) {
  if (!t->comp.data && h->stochastic_round && t->param.dtype == MF_FLOAT16)
    sr_store_f16_avx2(v, n, sr_state(h, t, first), (uint16_t *)t->param.data + first);
  else
    store_params(h, t, v, first, n, ISA_AVX512);
}

/* code[q[0..7]] by eight scalar loads: on AVX2 faster than an 8-lane gather, which is
 * microcoded on AMD Zen (benchmarks/history/2026-11-24-optim-amd-epyc-search-by-loads.md;
 * llvm-mca agrees for Intel). */
MF_TARGET_AVX2 static inline __m256 load_code8(const float *code, const uint8_t *q) {
  uint64_t w;
  memcpy(&w, q, 8);
  const __m128 lo = _mm_setr_ps(code[w & 255], code[(w >> 8) & 255], code[(w >> 16) & 255],
                                code[(w >> 24) & 255]);
  const __m128 hi = _mm_setr_ps(code[(w >> 32) & 255], code[(w >> 40) & 255],
                                code[(w >> 48) & 255], code[w >> 56]);
  return _mm256_set_m128(hi, lo);
}

/* The fused kernels (optim_fused.h): the same bits as the generic block kernel. They
 * need n % bs == 0 and bs % 64 == 0; the 4-bit ones take Adam/AdamW. avx512_vbmi: for
 * CPUs with AVX512-VBMI; avx512_gather: any AVX-512 CPU (F, BW, DQ, VL); avx2. */
typedef void fused_kernel(const mf_optim_hparams *h, const mf_optim_consts *c, int ns,
                          int64_t bs, const quant_ctx *qc, const mf_optim_tensor *t,
                          int64_t first, int64_t n, thread_bufs *b);
typedef fused_kernel *fused_fn;
fused_kernel mf_optim_fused8_avx512_vbmi, mf_optim_fused4_avx512_vbmi;
fused_kernel mf_optim_fused8_avx512_gather, mf_optim_fused4_avx512_gather;
fused_kernel mf_optim_fused8_avx2, mf_optim_fused4_avx2;

/* quant_ctx.search of the AVX2 (optim_avx2.c) and AVX-512 (optim_avx512.c) fused
 * kernels for codes like `lut`'s, 8-bit or 4-bit (bits). The forms (MEMFIT_OPTIM_KERNEL
 * names): 8-bit AVX2 avx2-scalar|avx2-gather, AVX-512 avx512-arith|avx512-table (a
 * 16-lane gather takes ~20 cycles on AMD Zen 5; llvm-mca puts it at 4-10 on Intel, below
 * the arithmetic's 12-14); 4-bit avx2-tree4|avx2-table4, avx512-tree4|avx512-table4. */
int mf_optim_avx2_search(const mf_code_lut *lut, int bits);
int mf_optim_avx512_search(const mf_code_lut *lut, int bits);
#endif

#endif /* MEMFIT_OPTIM_CPU_H */
