/* The hand-written stochastic-rounding stores (csrc/core/store_sr.h: bf16 and fp16, AVX2
 * and SSE2) give the bits of the scalar definition, out[i] = mf_f32_to_bf16_sr(v[i],
 * (uint32_t)mf_hash64(seed, first + i)) (mf_f32_to_f16_sr(v[i], mf_hash64(...)) for
 * fp16), written here from numeric.h / cast.h's functions per element: for every length
 * 0..100 (vector part and tail), at odd offsets, for many seeds (the hash state wraps
 * modulo 2^64), on values of every binade, both signs, zeros, subnormals, halfway and
 * all-ones dropped bits, and with NaN, infinities and values at and around the
 * thresholds of the vector forms (which send a call or a group to the scalar form) at
 * every position. A variant the CPU lacks is skipped (and said so). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "store_sr.h"

#define N 256

static uint64_t rng = 0x243f6a8885a308d3ull;
static uint32_t next32(void) {
  rng = rng * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(rng >> 32);
}

static float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* a value of any kind the store meets in practice (and a few it should never) */
static float any_value(void) {
  const uint32_t r = next32(), sign = r & 0x80000000u;
  switch (next32() % 8) {
    case 0: return from_bits(sign | ((next32() % 254u + 1u) << 23) | (r & 0x7fffffu)); /* any normal */
    case 1: return from_bits(sign | (r & 0x7fffffu));                                  /* subnormal, zero */
    case 2: return from_bits(sign | 0x3c000000u | (r & 0x00ff0000u) | 0x8000u);      /* halfway */
    case 3: return from_bits(sign | 0x3c000000u | (r & 0x00ff0000u) | 0xffffu);      /* all-ones low half */
    case 4: return from_bits(sign | 0x3c000000u | (r & 0x00ff0000u));                /* exact bf16 */
    default: return from_bits(sign | (0x3a000000u + (r & 0x03ffffffu)));             /* weight-like */
  }
}

/* float16's: mostly its normal range, and its subnormals, the values that round to
 * zero or the smallest subnormal, and magnitudes around its overflow threshold */
static float any_value_f16(void) {
  const uint32_t r = next32(), sign = r & 0x80000000u;
  switch (next32() % 16) {
    case 0: return from_bits(sign | (0x1f000000u + (r & 0x00ffffffu)));        /* 2^-65 .. 2^-63 */
    case 1: return from_bits(sign | (0x33000000u + (r & 0x05ffffffu)));        /* fp16 subnormals */
    case 2: return from_bits(sign | (0x477f0000u + (r & 0x0001ffffu)));        /* near 65504 */
    case 3: return from_bits(sign | (r & 0x7fffffu));                           /* float32 subnormal */
    case 4: return from_bits(sign | 0x3c000000u | (r & 0x007fe000u) | 0x1fffu); /* all-ones dropped bits */
    default: return from_bits(sign | (0x38800000u + r % 0x0effe000u));         /* fp16 normal */
  }
}

/* the special values of bf16: NaN, infinities, overflow, the largest finite magnitude,
 * and the values around the vector form's threshold */
static const uint32_t SPECIAL[] = {0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7f800000u, 0xff800000u,
                                   0x7f7fffffu, 0xff7f8000u, 0x7f7f7fffu, 0x7f7f0000u, 0xff7f0001u,
                                   0x7f7effffu, 0xff7effffu, 0x7f7e8000u};
/* and of fp16: the same first five, the bounds of its normal range and of the values
 * that keep only their sign, overflow and zero */
static const uint32_t SPECIAL16[] = {0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7f800000u, 0xff800000u,
                                     0x477ff000u, 0xc77fefffu, 0x477fe000u, 0x477fdfffu, 0x38800000u,
                                     0xb87fffffu, 0x1f800000u, 0x9f7fffffu, 0x00000000u, 0x80000000u,
                                     0x7f7fffffu};

static void reference(int f16, const float *v, int64_t n, uint64_t seed, uint64_t first, uint16_t *out) {
  for (int64_t i = 0; i < n; i++) {
    const uint64_t r = mf_hash64(seed, first + (uint64_t)i);
    out[i] = f16 ? mf_f32_to_f16_sr(v[i], r) : mf_f32_to_bf16_sr(v[i], (uint32_t)r);
  }
}

typedef void store_fn(const float *v, int64_t n, uint64_t z0, uint16_t *out);

#ifdef MF_X86_SIMD
MF_TARGET_AVX2 static void store_avx2(const float *v, int64_t n, uint64_t z0, uint16_t *out) {
  sr_store_bf16_avx2(v, n, z0, out);
}
static void store_sse2(const float *v, int64_t n, uint64_t z0, uint16_t *out) {
  sr_store_bf16_sse2(v, n, z0, out);
}
MF_TARGET_AVX2 static void store_f16_avx2(const float *v, int64_t n, uint64_t z0, uint16_t *out) {
  sr_store_f16_avx2(v, n, z0, out);
}
static void store_f16_sse2(const float *v, int64_t n, uint64_t z0, uint16_t *out) {
  sr_store_f16_sse2(v, n, z0, out);
}
#endif

static void check_variant(const char *name, store_fn *store, int f16) {
  float v[N + 8];
  uint16_t want[N + 8], got[N + 8];
  int bad = 0;
  for (int round = 0; round < 40 && !bad; round++) {
    for (int i = 0; i < N + 8; i++) v[i] = f16 ? any_value_f16() : any_value();
    const uint64_t seed = round == 0 ? 0 : round == 1 ? ~0ull : ((uint64_t)next32() << 32 | next32());
    for (int64_t n = 0; n <= 100 && !bad; n++) {
      const int off = (int)(n % 3); /* unaligned starts */
      const uint64_t first = (uint64_t)next32() * (round & 1 ? 0x100000001ull : 1u);
      /* special values at one position (or none), so both the vector result and the
       * scalar redo are compared */
      const int64_t at = n ? (int64_t)(next32() % (uint32_t)(2 * n)) : 0;
      const uint32_t sp = f16 ? SPECIAL16[next32() % (sizeof SPECIAL16 / sizeof SPECIAL16[0])]
                              : SPECIAL[next32() % (sizeof SPECIAL / sizeof SPECIAL[0])];
      float w[N];
      memcpy(w, v + off, sizeof w);
      if (at < n) w[at] = from_bits(sp);
      reference(f16, w, n, seed, first, want);
      memset(got, 0xa5, sizeof got);
      store(w, n, seed + MF_HASH64_STEP * (first + 1u), got);
      for (int64_t i = 0; i < n && !bad; i++)
        if (got[i] != want[i]) {
          uint32_t x;
          memcpy(&x, &w[i], sizeof x);
          bad = 1;
          CHECK(got[i] == want[i], "%s: n %lld, element %lld (special at %lld: 0x%08x): x 0x%08x -> 0x%04x, want 0x%04x",
                name, (long long)n, (long long)i, (long long)at, sp, x, got[i], want[i]);
        }
      CHECK(got[n] == 0xa5a5, "%s: n %lld: wrote past the end", name, (long long)n);
    }
  }
}

int main(void) {
#ifdef MF_X86_SIMD
  __builtin_cpu_init();
  check_variant("bf16 sse2", store_sse2, 0);
  check_variant("fp16 sse2", store_f16_sse2, 1);
  if (__builtin_cpu_supports("avx2")) {
    check_variant("bf16 avx2", store_avx2, 0);
    check_variant("fp16 avx2", store_f16_avx2, 1);
  } else printf("test_store_sr: no AVX2 on this CPU: the AVX2 store is not checked\n");
#else
  printf("test_store_sr: not x86-64: no hand-written store to check\n");
#endif
  return check_exit("test_store_sr");
}
