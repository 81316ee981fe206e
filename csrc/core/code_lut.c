/* Building and caching the exact code-search tables of code_lut.h. */
#include "code_lut.h"
#include "code_lut_avx2.h"
#include "code_lut_avx512.h"
#include "mca_mark.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define CACHE_SLOTS 16

typedef struct {
  float code[MF_CODE_SIZE];
  mf_code_lut lut;
} cache_slot;

static cache_slot cache[CACHE_SLOTS];
static int cache_used = 0;
static atomic_flag cache_lock = ATOMIC_FLAG_INIT;

static void lock(void) {
  while (atomic_flag_test_and_set_explicit(&cache_lock, memory_order_acquire)) {
  }
}
static void unlock(void) { atomic_flag_clear_explicit(&cache_lock, memory_order_release); }

/* q at the float whose key is `key`; NaN keys are ordered past +-Inf and take q(+-Inf),
 * which keeps q monotone over all keys (callers map NaN to 0 themselves). */
static uint8_t search(const float *code, int size, int keep_positive, uint32_t key) {
  uint32_t u = key & 0x80000000u ? key ^ 0x80000000u : ~key;
  if ((u & 0x7fffffffu) > 0x7f800000u) u = (u & 0x80000000u) | 0x7f800000u;
  return mf_optim_quantize(code, size, mf_f32_from_bits(u), keep_positive);
}

/* The entry of bucket b: keys [b << 16, (b << 16) + 0xffff]. */
static uint32_t bucket_entry(const float *code, int size, int keep_positive, uint32_t b) {
  const uint32_t lo = b << 16;
  const uint32_t q0 = search(code, size, keep_positive, lo);
  const uint32_t q1 = search(code, size, keep_positive, lo + 0xffffu);
  uint32_t jump = 0x10000u; /* never */
  if (q1 != q0) {
    if (q1 != q0 + 1) return MF_CODE_LUT_SLOW - lo;
    uint32_t below = 0, at = 0xffffu; /* q(lo + below) == q0, q(lo + at) == q1 */
    while (at - below > 1) {
      const uint32_t mid = (below + at) / 2;
      if (search(code, size, keep_positive, lo + mid) == q0) below = mid;
      else at = mid;
    }
    jump = at;
  }
  return (q0 << 16) + 0x10000u - jump - lo;
}

static int build(const float *code, int size, int keep_positive, mf_code_lut *t) {
  uint32_t *entry = (uint32_t *)malloc(MF_CODE_LUT_BUCKETS * sizeof(uint32_t));
  if (!entry) return 0;
  t->has_slow = 0;
  for (uint32_t b = 0; b < MF_CODE_LUT_BUCKETS; b++) {
    entry[b] = bucket_entry(code, size, keep_positive, b);
    t->has_slow |= ((entry[b] + (b << 16)) & MF_CODE_LUT_SLOW) != 0;
  }
  t->entry = entry;
  t->size = size;
  t->keep_positive = keep_positive;
  return 1;
}

static const mf_code_lut *find(const float *code, int size, int keep_positive) {
  for (int i = 0; i < cache_used; i++)
    if (cache[i].lut.size == size && cache[i].lut.keep_positive == keep_positive &&
        !memcmp(cache[i].code, code, (size_t)size * sizeof(float)))
      return &cache[i].lut;
  return NULL;
}

const mf_code_lut *mf_code_lut_get(const float *code, int size, int keep_positive) {
  keep_positive = keep_positive != 0;
  lock();
  const mf_code_lut *found = find(code, size, keep_positive);
  unlock();
  if (found) return found;
  cache_slot fresh;
  memcpy(fresh.code, code, (size_t)size * sizeof(float));
  if (!build(fresh.code, size, keep_positive, &fresh.lut)) return NULL; /* outside the lock: ~1 ms */
  lock();
  found = find(code, size, keep_positive); /* another thread may have won */
  if (!found && cache_used < CACHE_SLOTS) {
    cache_slot *s = &cache[cache_used];
    *s = fresh;
    s->lut.code = s->code;
    found = &s->lut;
    fresh.lut.entry = NULL;
    cache_used++;
  }
  unlock();
  free((void *)fresh.lut.entry); /* NULL when it went into the cache */
  return found; /* NULL when the cache is full: callers use the binary search */
}

static void quantize_scalar(const mf_code_lut *t, const float *x, float inv, int64_t n, uint8_t *q) {
  for (int64_t i = 0; i < n; i++) q[i] = mf_code_lut_quantize(t, x[i] * inv);
}

#ifdef MF_X86_SIMD
/* After a vector loop over [0, i): the scalar tail, and the whole run once more by
 * mf_code_lut_quantize when some bucket was slow (bit 31 of a sum; rare, never with
 * memfit's own codes). */
static void finish(const mf_code_lut *t, const float *x, float inv, int64_t n, uint8_t *q,
                   int64_t i, int slow) {
  quantize_scalar(t, x + i, inv, n - i, q + i);
  if (slow) quantize_scalar(t, x, inv, n, q);
}

MF_TARGET_AVX512 static void quantize_avx512(const mf_code_lut *t, const float *x, float inv,
                                             int64_t n, uint8_t *q) {
  const __m512 vinv = _mm512_set1_ps(inv);
  __m512i slow = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm_storeu_si128((__m128i *)(q + i), mf_code_lut_quantize16(t, _mm512_loadu_ps(x + i), vinv, &slow));
  finish(t, x, inv, n, q, i, ((uint32_t)_mm512_reduce_or_epi32(slow) & MF_CODE_LUT_SLOW) != 0);
}

MF_TARGET_AVX2 static void quantize_avx2(const mf_code_lut *t, const float *x, float inv,
                                         int64_t n, uint8_t *q) {
  const __m256 vinv = _mm256_set1_ps(inv);
  __m256i slow = _mm256_setzero_si256();
  int64_t i = 0;
  MF_MCA_BEGIN("quant_lut_loads_avx2 elems=8 isa=avx2");
  for (; i + 8 <= n; i += 8)
    _mm_storel_epi64((__m128i *)(q + i), mf_code_lut_quantize8(t, _mm256_loadu_ps(x + i), vinv, &slow));
  MF_MCA_END();
  finish(t, x, inv, n, q, i, _mm256_movemask_ps(_mm256_castsi256_ps(slow)) != 0);
}
#endif

void mf_code_lut_quantize_n(const mf_code_lut *t, const float *x, float inv, int64_t n, uint8_t *q) {
#ifdef MF_X86_SIMD
  if (mf_cpu_isa() == ISA_AVX512) {
    quantize_avx512(t, x, inv, n, q);
    return;
  }
  if (mf_cpu_isa() == ISA_AVX2) {
    quantize_avx2(t, x, inv, n, q);
    return;
  }
#endif
  quantize_scalar(t, x, inv, n, q);
}
