/* Building and caching the exact code-search tables of code_lut.h. */
#include "code_lut.h"
#include "code_lut_avx2.h"
#include "code_lut_avx512.h"
#include "mca_mark.h"

#include <stdatomic.h>
#include <math.h>
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

/* ---- the arithmetic search (code_lut.h) ----------------------------------------- */

/* The smallest non-negative float (as bits) with q >= k, searched among [lo, hi] (bits
 * of non-negative floats, q(hi) >= k assumed). */
static uint32_t first_at_least(const float *code, int size, int keep_positive, int k,
                               uint32_t lo, uint32_t hi) {
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (mf_optim_quantize(code, size, mf_f32_from_bits(mid), keep_positive) >= k) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

typedef struct {
  const float *code;
  int size, keep_positive;
  const mf_code_lut *t;
} arith_check;

/* The arithmetic index of x (non-negative bits u) and of -x, or -1 where ambiguous. */
static void arith_both(const arith_check *c, uint32_t u, int *pos, int *neg) {
  int amb;
  *pos = mf_code_lut_arith_index(c->t, mf_f32_from_bits(u), &amb);
  *neg = mf_code_lut_arith_index(c->t, mf_f32_from_bits(u | 0x80000000u), &amb);
  if (amb && u != 0) *pos = *neg = -1;
}

/* Whether the arithmetic search gives q(x) and q(-x) for every non-ambiguous x with bits
 * in [a, b] (one segment: t is non-decreasing there). An interval whose ends lie between
 * the same two integers of t, away from both, has one model index throughout; q and
 * q(-x) are monotone, so equal values at the ends hold between them. Others are halved. */
static int check_range(const arith_check *c, uint32_t a, uint32_t b) {
  const float xa = mf_f32_from_bits(a), xb = mf_f32_from_bits(b);
  const float ta = mf_code_lut_arith_t(c->t, xa), tb = mf_code_lut_arith_t(c->t, xb);
  if (!(ta >= -1.0f && tb <= (float)c->size + 1.0f)) return 0;
  int pa, na, pb, nb;
  arith_both(c, a, &pa, &na);
  arith_both(c, b, &pb, &nb);
  if (pa >= 0 && floorf(ta) == floorf(tb) && pb >= 0) {
    return pa == mf_optim_quantize(c->code, c->size, xa, c->keep_positive) &&
           pb == mf_optim_quantize(c->code, c->size, xb, c->keep_positive) &&
           na == mf_optim_quantize(c->code, c->size, -xa, c->keep_positive) &&
           nb == mf_optim_quantize(c->code, c->size, -xb, c->keep_positive);
  }
  if (pa < 0 && pb < 0 && rintf(ta) == rintf(tb)) return 1; /* t within EPS of one integer throughout */
  if (a == b) return 1; /* one ambiguous float */
  if (b - a == 1) return check_range(c, a, a) && check_range(c, b, b);
  const uint32_t mid = a + (b - a) / 2;
  return check_range(c, a, mid) && check_range(c, mid + 1, b);
}

/* Segment s's floats x > 0 (bits): [2^(s-31), 2^(s-30)), all below for s = 0, all
 * above for s = 31. */
static uint32_t segment_lo(int s) { return s == 0 ? 1u : (uint32_t)(MF_CODE_LUT_EXP0 + s) << 23; }
static uint32_t segment_hi(int s) {
  return s == 31 ? 0x7f7fffffu : ((uint32_t)(MF_CODE_LUT_EXP0 + s + 1) << 23) - 1;
}

/* q below the last step (mf_code_lut.top) */
static int q_below_top(const float *code, int size, int keep_positive, const mf_code_lut *t,
                       float x) {
  const int q = mf_optim_quantize(code, size, x, keep_positive);
  return q < t->top_q ? q : t->top_q - 1;
}

/* Fits the lines of segment s: the chords of the staircase's points (T_k, k) in the
 * segment and one either side (or, where there is none, a point half a step into the
 * flat part at the segment's end), consecutive chords of nearly one slope merged into
 * the line through the group's ends. Returns 0 when it needs more than
 * MF_CODE_LUT_LINES lines that pass the check (c) on the segment. */
static int fit_segment(const float *code, int size, int keep_positive, int s, mf_code_lut *t,
                       const arith_check *c) {
  const uint32_t lo = segment_lo(s), hi = segment_hi(s);
  const uint32_t top = 0x7f7fffffu;
  const float xlo = mf_f32_from_bits(lo), xhi = mf_f32_from_bits(hi);
  const int qlo = q_below_top(code, size, keep_positive, t, xlo);
  const int qhi = q_below_top(code, size, keep_positive, t, xhi);
  const int qtop = t->top_q - 1;
  double px[260], py[260];
  int np = 0;
  /* the step before the segment (a threshold above 0), else half a step into it */
  if (qlo > q_below_top(code, size, keep_positive, t, mf_f32_from_bits(1u))) {
    const uint32_t b = first_at_least(code, size, keep_positive, qlo, 1u, lo);
    px[np] = mf_f32_from_bits(b), py[np++] = qlo;
  } else {
    px[np] = xlo, py[np++] = qlo + 0.5;
  }
  for (int k = qlo + 1; k <= qhi; k++) {
    const uint32_t b = first_at_least(code, size, keep_positive, k, lo, hi);
    px[np] = mf_f32_from_bits(b), py[np++] = k;
  }
  if (qhi < qtop) {
    const uint32_t b = first_at_least(code, size, keep_positive, qhi + 1, hi, top);
    px[np] = mf_f32_from_bits(b), py[np++] = qhi + 1;
  } else {
    px[np] = xhi, py[np++] = qhi + 0.5;
  }
  int nl = 0;
  double la[MF_CODE_LUT_FIT], lc[MF_CODE_LUT_FIT];
  if (qlo == qhi && qhi == qtop) { /* flat to the end: one level */
    la[0] = 0.0, lc[0] = qlo + 0.5, nl = 1;
  } else {
    int g0 = 0; /* first point of the current group */
    for (int i = 1; i < np; i++) {
      const double slope0 = (py[g0 + 1] - py[g0]) / (px[g0 + 1] - px[g0]);
      const int last = i + 1 == np;
      const double next = last ? 0.0 : (py[i + 1] - py[i]) / (px[i + 1] - px[i]);
      if (last || fabs(next - slope0) > 1e-3 * fabs(slope0)) {
        if (nl == MF_CODE_LUT_FIT) return 0;
        const double a = (py[i] - py[g0]) / (px[i] - px[g0]);
        la[nl] = a, lc[nl] = py[g0] - (double)(float)a * px[g0], nl++;
        g0 = i;
      }
    }
  }
  /* More lines than the kernels take: leave one out where the check still passes (the
   * dynamic map's decade corners have four chords, of which the corner chord itself is
   * not needed: the floor of the other three's minimum is the same step). */
  if (nl <= MF_CODE_LUT_LINES) {
    for (int l = 0; l < MF_CODE_LUT_LINES; l++) {
      const int i = l < nl ? l : nl - 1; /* (unused lines repeat the last) */
      t->a[l][s] = (float)la[i], t->c[l][s] = (float)lc[i];
    }
    return 1;
  }
  for (int drop = 1; drop + 1 < nl; drop++) { /* nl == MF_CODE_LUT_FIT */
    for (int i = 0, l = 0; i < nl; i++)
      if (i != drop) t->a[l][s] = (float)la[i], t->c[l][s] = (float)lc[i], l++;
    if (check_range(c, segment_lo(s), segment_hi(s))) return 1;
  }
  return 0;
}

/* The tree of thresholds of a 16-entry code (mf_code_lut.tree4): the smallest finite
 * float with q >= k (searched over keys, as bucket_entry does), -Inf where q(-FLT_MAX)
 * is already k or more, +Inf where no finite float reaches k. */
static void build_tree4(const float *code, int keep_positive, mf_code_lut *t) {
  float thr[16];
  for (int k = 1; k < 16; k++) {
    uint32_t lo = mf_code_lut_key(0xff7fffffu), hi = mf_code_lut_key(0x7f7fffffu);
    if (search(code, 16, keep_positive, lo) >= k) {
      thr[k] = -INFINITY;
    } else if (search(code, 16, keep_positive, hi) < k) {
      thr[k] = INFINITY;
    } else {
      while (hi - lo > 1) { /* q(lo) < k <= q(hi) */
        const uint32_t mid = lo + (hi - lo) / 2;
        if (search(code, 16, keep_positive, mid) >= k) hi = mid;
        else lo = mid;
      }
      thr[k] = mf_f32_from_bits(hi & 0x80000000u ? hi ^ 0x80000000u : ~hi);
    }
  }
  /* node n at depth d (n in [2^d, 2^(d+1))) splits the 2^(4-d) indices it covers,
   * [(n - 2^d) 2^(4-d), ...), in the middle */
  t->tree4[0] = 0.0f;
  for (int d = 0; d < 4; d++)
    for (int j = 0; j < (1 << d); j++) t->tree4[(1 << d) + j] = thr[(2 * j + 1) << (3 - d)];
}

/* Builds and checks the arithmetic search; t->arith = 1 when it holds for every x. */
static void build_arith(const float *code, int size, int keep_positive, mf_code_lut *t) {
  t->arith = 0;
  t->top_q = mf_optim_quantize(code, size, mf_f32_from_bits(0x7f7fffffu), keep_positive);
  t->top = mf_f32_from_bits(first_at_least(code, size, keep_positive, t->top_q, 1u, 0x7f7fffffu));
  t->at_zero = mf_optim_quantize(code, size, 0.0f, keep_positive);
  if (mf_optim_quantize(code, size, -0.0f, keep_positive) != t->at_zero) return;
  /* x < 0: q(-x) + q(x) is constant where q(-x) > 0 (a code symmetric about its zero);
   * 0 where every x < 0 has q = 0 (the unsigned codes) */
  t->mirror = 0;
  if (mf_optim_quantize(code, size, -mf_f32_from_bits(1u), keep_positive) != 0)
    t->mirror = mf_optim_quantize(code, size, -1e-3f, keep_positive) +
                mf_optim_quantize(code, size, 1e-3f, keep_positive);
  const arith_check c = {code, size, keep_positive, t};
  for (int s = 0; s < MF_CODE_LUT_SEGMENTS; s++)
    if (!fit_segment(code, size, keep_positive, s, t, &c)) return;
  for (int s = 0; s < MF_CODE_LUT_SEGMENTS; s++)
    if (!check_range(&c, segment_lo(s), segment_hi(s))) return;
  t->arith = 1;
}

static int build(const float *code, int size, int keep_positive, mf_code_lut *t) {
  build_arith(code, size, keep_positive, t);
  if (size == 16) build_tree4(code, keep_positive, t);
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
