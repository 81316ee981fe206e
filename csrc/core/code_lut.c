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
  int piece;    /* the piece whose line is checked, or -1: the piece the lookup picks */
  uint32_t tie; /* with piece >= 0: its last float (split), or ~0u for the last piece */
} arith_check;

static float check_t(const arith_check *c, uint32_t u, int *at_split) {
  const float ax = mf_f32_from_bits(u);
  if (c->piece < 0) return mf_code_lut_arith_t(c->t, mf_code_lut_piece(c->t, ax, at_split), ax);
  *at_split = u == c->tie;
  return mf_code_lut_arith_t(c->t, c->piece, ax);
}

/* The arithmetic index of x (non-negative bits u) and of -x, or -1 where ambiguous;
 * *tt: t at x, *t_amb: whether t itself is ambiguous (not only a piece's last float). */
static void arith_both(const arith_check *c, uint32_t u, int *pos, int *neg, float *tt, int *t_amb) {
  int at_split;
  *tt = check_t(c, u, &at_split);
  *pos = mf_code_lut_arith_from_t(c->t, u, *tt, t_amb);
  *neg = mf_code_lut_arith_from_t(c->t, u | 0x80000000u, *tt, t_amb);
  if (*t_amb || at_split) *pos = *neg = -1;
}

/* Whether the arithmetic search gives q(x) and q(-x) for every non-ambiguous x with bits
 * in [a, b] (t non-decreasing there: one piece). An interval whose ends lie between the
 * same two steps of t, away from both, has one model index throughout; q and q(-x) are
 * monotone, so equal values at the ends hold between them. Others are halved. */
static int check_range(const arith_check *c, uint32_t a, uint32_t b) {
  const float xa = mf_f32_from_bits(a), xb = mf_f32_from_bits(b), f = (float)MF_CODE_LUT_FRAC;
  int pa, na, pb, nb, amb_a, amb_b;
  float ta, tb;
  arith_both(c, a, &pa, &na, &ta, &amb_a);
  arith_both(c, b, &pb, &nb, &tb, &amb_b);
  if (!(ta >= -f && tb <= (float)(c->size + 1) * f)) return 0;
  if (pa >= 0 && pb >= 0 && floorf(ta / f) == floorf(tb / f)) {
    return pa == mf_optim_quantize(c->code, c->size, xa, c->keep_positive) &&
           pb == mf_optim_quantize(c->code, c->size, xb, c->keep_positive) &&
           na == mf_optim_quantize(c->code, c->size, -xa, c->keep_positive) &&
           nb == mf_optim_quantize(c->code, c->size, -xb, c->keep_positive);
  }
  if (amb_a && amb_b && rintf(ta / f) == rintf(tb / f))
    return 1; /* t within a unit of one step throughout: every float between is ambiguous */
  if (a == b) return 1; /* one ambiguous float */
  if (b - a == 1) return check_range(c, a, a) && check_range(c, b, b);
  const uint32_t mid = a + (b - a) / 2;
  return check_range(c, a, mid) && check_range(c, mid + 1, b);
}

/* Segment s's floats x > 0 (bits): [2^(s-31), 2^(s-30)), all below for s = 0, all
 * above for s = 31. */
static uint32_t segment_lo(int s) { return s == 0 ? 0u : (uint32_t)(MF_CODE_LUT_EXP0 + s) << 23; }
static uint32_t segment_hi(int s) {
  return s == 31 ? 0x7f7fffffu : ((uint32_t)(MF_CODE_LUT_EXP0 + s + 1) << 23) - 1;
}

#define MAX_FLOAT_BITS 0x7f7fffffu

/* Piece p of the arithmetic search: from the float with bits `start` (where q = k0) on,
 * with the n thresholds thr[k0 + 1 .. k0 + n] inside it: the line through the first and
 * the last of them (n >= 2), through the piece's start half a step up and the one
 * threshold (n = 1), or level half a step up (n = 0); capped half a step above step
 * k0 + n. In fixed point (MF_CODE_LUT_FRAC per step). */
static void set_piece(mf_code_lut *t, int p, uint32_t start, int k0, int n, const uint32_t *thr) {
  const double f = MF_CODE_LUT_FRAC;
  double x0 = mf_f32_from_bits(start), y0 = k0 + 0.5, x1 = x0, y1 = y0;
  if (n >= 2) {
    x0 = mf_f32_from_bits(thr[k0 + 1]), y0 = k0 + 1;
    x1 = mf_f32_from_bits(thr[k0 + n]), y1 = k0 + n;
  } else if (n == 1) {
    x1 = mf_f32_from_bits(thr[k0 + 1]), y1 = k0 + 1;
  }
  const float a = x1 > x0 ? (float)(f * (y1 - y0) / (x1 - x0)) : 0.0f;
  t->pa[p] = a;
  t->pc[p] = (float)(f * y0 - (double)a * x0);
  t->phi[p] = (float)(f * (k0 + n + 0.5));
}

/* Whether piece c->piece, from the float `from` (q = k0) with n thresholds inside,
 * checks (set_piece, then check_range over its floats). x = 0 must not be ambiguous:
 * all-zero states are common. */
static int piece_checks(arith_check *c, const uint32_t *thr, int qmax, uint32_t from, int k0, int n) {
  mf_code_lut *t = (mf_code_lut *)c->t;
  const uint32_t to = k0 + n == qmax ? MAX_FLOAT_BITS : thr[k0 + n + 1] - 1;
  if (k0 + n < qmax && thr[k0 + n + 1] <= from) return 0; /* two steps at one float */
  c->tie = k0 + n == qmax || to == 0 ? 0xffffffffu : to;
  set_piece(t, c->piece, from, k0, n, thr);
  int amb0 = 0;
  if (from == 0) mf_code_lut_arith_from_t(t, 0u, mf_code_lut_arith_t(t, c->piece, 0.0f), &amb0);
  return !amb0 && check_range(c, from, to);
}

/* Builds and checks the arithmetic search; t->arith = 1 when it holds for every x.
 * Pieces are taken greedily from x = 0 up, each as long as its check passes (so the
 * check sees every float of every piece), then the segments are mapped to them and the
 * whole search checked once more as the kernels run it. */
static void build_arith(const float *code, int size, int keep_positive, mf_code_lut *t) {
  t->arith = 0;
  const int q0 = mf_optim_quantize(code, size, 0.0f, keep_positive);
  const int qmax = mf_optim_quantize(code, size, mf_f32_from_bits(MAX_FLOAT_BITS), keep_positive);
  if (mf_optim_quantize(code, size, -0.0f, keep_positive) != q0) return;
  /* x < 0: q(-x) + q(x) is constant where q(-x) > 0 (a code symmetric about its zero);
   * 0 where every x < 0 has q = 0 (the unsigned codes) */
  t->mirror = 0;
  if (mf_optim_quantize(code, size, -mf_f32_from_bits(1u), keep_positive) != 0)
    t->mirror = mf_optim_quantize(code, size, -1e-3f, keep_positive) +
                mf_optim_quantize(code, size, 1e-3f, keep_positive);
  uint32_t thr[MF_CODE_SIZE + 1]; /* thr[k]: the smallest float x >= 0 with q >= k */
  for (int k = q0 + 1; k <= qmax; k++) thr[k] = first_at_least(code, size, keep_positive, k, 0u, MAX_FLOAT_BITS);
  uint32_t start[MF_CODE_LUT_PIECES + 1];
  int pieces = 0;
  arith_check c = {code, size, keep_positive, t, 0, 0xffffffffu};
  for (int k0 = q0; k0 <= qmax;) {
    if (pieces == MF_CODE_LUT_PIECES) return;
    const uint32_t from = k0 == q0 ? 0u : thr[k0];
    c.piece = pieces;
    /* the longest piece from k0 that checks: n = 0, 1, 2 each (a short piece's line is
     * a different shape), then doubling and halving (a run that checks for n
     * thresholds checks for fewer) */
    int best = -1;
    for (int n = 0; n <= 2 && k0 + n <= qmax; n++)
      if (piece_checks(&c, thr, qmax, from, k0, n)) best = n;
    if (best == 2) {
      int bad = qmax - k0 + 1; /* the smallest n known not to check */
      while (bad - best > 1) {
        const int n = 2 * best < bad ? 2 * best : best + (bad - best) / 2;
        if (piece_checks(&c, thr, qmax, from, k0, n)) best = n;
        else bad = n;
      }
    }
    if (best < 0) return;
    set_piece(t, pieces, from, k0, best, thr);
    start[pieces++] = from;
    k0 += best + 1;
  }
  for (int p = 0; p < MF_CODE_LUT_PIECES; p++) {
    const int last = p >= pieces - 1;
    t->split[p] = last ? INFINITY : start[p + 1] == 1u ? -0.0f : mf_f32_from_bits(start[p + 1] - 1);
    if (p >= pieces) t->pa[p] = t->pa[pieces - 1], t->pc[p] = t->pc[pieces - 1], t->phi[p] = t->phi[pieces - 1];
  }
  start[pieces] = 0xffffffffu;
  for (int s = 0, p = 0; s < MF_CODE_LUT_SEGMENTS; s++) {
    while (start[p + 1] <= segment_lo(s)) p++;
    if (start[p + 2 <= pieces ? p + 2 : pieces] <= segment_hi(s)) return; /* two boundaries */
    t->piece_lo[s] = p;
  }
  c.piece = -1;
  for (int s = 0; s < MF_CODE_LUT_SEGMENTS; s++) {
    const uint32_t lo = segment_lo(s), hi = segment_hi(s);
    const uint32_t cut = start[t->piece_lo[s] + 1]; /* the next piece, inside or past hi */
    if (cut > hi) {
      if (!check_range(&c, lo, hi)) return;
    } else if (!check_range(&c, lo, cut - 1) || !check_range(&c, cut, hi)) {
      return;
    }
  }
  t->arith = 1;
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
