/*
 * memfit core: checkpoint planner (model in memfit/plan.h).
 *
 * Why a dynamic program over memory, and why it is exact only up to a unit:
 * with input_bytes = 0 the problem "which stages to store so that the stored bytes
 * fit and the stored forward cost is largest" is 0/1 knapsack, so no algorithm is
 * polynomial in n alone. Like the rotor/revolve planners we discretize memory
 * into slots of `unit` bytes. When every size is a multiple of the unit (we take
 * the gcd of all sizes, which for a chain of identical transformer blocks is
 * large) the answer is exact; otherwise sizes are rounded to a coarser unit (up,
 * which always fits, and to nearest, checked in bytes and retried), the plan's
 * memory is recomputed in bytes, and info->exact = 0.
 *
 * The "max over checkpointed segments" term couples segments, so we iterate over
 * a cap M on that max: for a fixed M every checkpointed segment must satisfy
 * saved(segment) <= M and the rest of the memory must fit in B - M slots. For a
 * fixed cap the DP is over (boundary i, rest memory m):
 *   D[i][m] = least cost of planning stages [0, i) with rest memory <= m
 *           = min( D[i-1][m - saved[i-1]],                          (store i-1)
 *                  min_{k in window(i)} D[k][m - in[k]] + P[i] - P[k] ) (ckpt [k,i))
 * where window(i) = {k : saved(k..i) <= M} is an interval whose ends only move
 * right as i grows, so the inner min is a sliding-window minimum: one monotone
 * deque per m, O(1) amortized per cell.
 * Time: O(n * B * K), K = number of distinct segment sums <= B tried (<= B + 1),
 * cut short by a lower bound from the uncapped DP; memory O(n * B).
 * Exact when budget / gcd(sizes) slots keep that affordable (chains of identical
 * blocks have K <= n + 1); otherwise B = auto_slots(n) (~550 for n = 1000) and
 * rounding: 1000 heterogeneous stages plan in 0.1-0.3 s on one core.
 *
 * The smallest feasible budget is computed exactly in bytes (no slots): for a cap
 * x, f(x) = least rest memory is an O(n) sliding-window DP, f is non-increasing
 * and piecewise constant, and min_x x + f(x) is found by divide and conquer over
 * x with the lower bound lo + f(hi) on an interval [lo, hi].
 */
#include "memfit/plan.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MF_PLAN_MAX_STAGES ((int64_t)1 << 24)
#define MF_COST_INF HUGE_VAL

/* ---------------------------------------------------------------- checks -- */

static mf_status check_chain(int64_t n, const int64_t *in, const int64_t *saved,
                             const double *cost, int need_cost) {
  if (n < 1) return mf_error(MF_ERR_VALUE, "n: the chain needs at least one stage, got %lld", (long long)n);
  if (n > MF_PLAN_MAX_STAGES)
    return mf_error(MF_ERR_VALUE, "n: at most %lld stages, got %lld",
                    (long long)MF_PLAN_MAX_STAGES, (long long)n);
  if (!in) return mf_error(MF_ERR_VALUE, "input_bytes: NULL");
  if (!saved) return mf_error(MF_ERR_VALUE, "saved_bytes: NULL");
  if (need_cost && !cost) return mf_error(MF_ERR_VALUE, "forward_cost: NULL");
  /* Sums of all sizes must fit in int64 with room to add a max term; 2^61 bytes
   * is far beyond any machine. */
  const int64_t limit = (int64_t)1 << 61;
  int64_t total = 0;
  for (int64_t i = 0; i < n; i++) {
    if (in[i] < 0)
      return mf_error(MF_ERR_VALUE, "input_bytes[%lld]: must be >= 0, got %lld",
                      (long long)i, (long long)in[i]);
    if (saved[i] < 0)
      return mf_error(MF_ERR_VALUE, "saved_bytes[%lld]: must be >= 0, got %lld",
                      (long long)i, (long long)saved[i]);
    if (in[i] > limit || saved[i] > limit || total > limit - in[i] - saved[i])
      return mf_error(MF_ERR_VALUE, "input_bytes/saved_bytes: total over 2^61 bytes");
    total += in[i] + saved[i];
    if (cost && !(cost[i] >= 0.0 && cost[i] < MF_COST_INF))
      return mf_error(MF_ERR_VALUE,
                      "forward_cost[%lld]: must be finite and >= 0, got %g",
                      (long long)i, cost[i]);
  }
  return MF_OK;
}

static mf_status check_segments(int64_t n, int64_t n_segments, const int64_t *seg_end,
                                const uint8_t *seg_ckpt) {
  if (n_segments < 1 || n_segments > n)
    return mf_error(MF_ERR_VALUE, "n_segments: must be in [1, %lld], got %lld",
                    (long long)n, (long long)n_segments);
  if (!seg_end) return mf_error(MF_ERR_VALUE, "seg_end: NULL");
  if (!seg_ckpt) return mf_error(MF_ERR_VALUE, "seg_ckpt: NULL");
  int64_t prev = 0;
  for (int64_t j = 0; j < n_segments; j++) {
    if (seg_end[j] <= prev || seg_end[j] > n)
      return mf_error(MF_ERR_VALUE,
                      "seg_end[%lld]: segments must be non-empty, in order and end "
                      "by %lld (got end %lld after %lld)",
                      (long long)j, (long long)n, (long long)seg_end[j], (long long)prev);
    prev = seg_end[j];
  }
  if (prev != n)
    return mf_error(MF_ERR_VALUE, "seg_end: the last segment must end at n=%lld, got %lld",
                    (long long)n, (long long)prev);
  return MF_OK;
}

/* -------------------------------------------------------------- evaluate -- */

static void evaluate(int64_t n, const int64_t *in, const int64_t *saved,
                     const double *cost, int64_t n_segments, const int64_t *seg_end,
                     const uint8_t *seg_ckpt, int64_t *memory, double *rcost) {
  int64_t mem = 0, mx = 0;
  double c = 0.0;
  int64_t start = 0;
  (void)n;
  for (int64_t j = 0; j < n_segments; j++) {
    int64_t end = seg_end[j];
    int64_t s = 0;
    for (int64_t i = start; i < end; i++) {
      s += saved[i];
      if (seg_ckpt[j] && cost) c += cost[i];
    }
    if (seg_ckpt[j]) {
      mem += in[start];
      if (s > mx) mx = s;
    } else {
      mem += s;
    }
    start = end;
  }
  *memory = mem + mx;
  *rcost = c;
}

mf_status mf_plan_evaluate(int64_t n, const int64_t *input_bytes,
                           const int64_t *saved_bytes, const double *forward_cost,
                           int64_t n_segments, const int64_t *seg_end,
                           const uint8_t *seg_ckpt, int64_t *memory_bytes,
                           double *recompute_cost) {
  mf_status st = check_chain(n, input_bytes, saved_bytes, forward_cost, 0);
  if (st) return st;
  st = check_segments(n, n_segments, seg_end, seg_ckpt);
  if (st) return st;
  if (!memory_bytes || !recompute_cost)
    return mf_error(MF_ERR_VALUE, "memory_bytes/recompute_cost: NULL output");
  evaluate(n, input_bytes, saved_bytes, forward_cost, n_segments, seg_end, seg_ckpt,
           memory_bytes, recompute_cost);
  return MF_OK;
}

/* ------------------------------------------------------------------ sqrt -- */

static int64_t sqrt_plan(int64_t n, int64_t *seg_end, uint8_t *seg_ckpt) {
  int64_t k = (int64_t)floor(sqrt((double)n) + 0.5);
  if (k < 1) k = 1;
  if (k > n) k = n;
  /* Near-equal lengths: the first n % k segments get one extra stage. */
  int64_t base = n / k, extra = n % k, end = 0;
  for (int64_t j = 0; j < k; j++) {
    end += base + (j < extra ? 1 : 0);
    seg_end[j] = end;
    seg_ckpt[j] = (uint8_t)(j + 1 < k);
  }
  return k;
}

mf_status mf_plan_sqrt(int64_t n, int64_t *seg_end, uint8_t *seg_ckpt,
                       int64_t *n_segments) {
  if (n < 1 || n > MF_PLAN_MAX_STAGES)
    return mf_error(MF_ERR_VALUE, "n: must be in [1, %lld], got %lld",
                    (long long)MF_PLAN_MAX_STAGES, (long long)n);
  if (!seg_end || !seg_ckpt || !n_segments)
    return mf_error(MF_ERR_VALUE, "seg_end/seg_ckpt/n_segments: NULL output");
  *n_segments = sqrt_plan(n, seg_end, seg_ckpt);
  return MF_OK;
}

/* ------------------------------------------------- least memory (exact) -- */

/* Scratch for the O(n) least-rest-memory DP. */
typedef struct {
  int64_t n;
  const int64_t *in, *saved;
  int64_t *pre;   /* prefix sums of saved, n + 1 */
  int64_t *g;     /* g[i] least rest memory of [0, i), n + 1 */
  int64_t *from;  /* -1: stage i-1 stored; else start k of checkpointed [k, i) */
  int64_t *dq;    /* deque of candidate starts k, n */
} minmem_ws;

/* f(cap): least rest memory (checkpoint inputs + stored saved bytes) over plans
 * whose checkpointed segments each hold <= cap saved bytes. Also returns the
 * largest checkpointed segment of the plan found (<= cap). */
static int64_t least_rest(minmem_ws *w, int64_t cap, int64_t *plan_max) {
  const int64_t n = w->n;
  int64_t head = 0, tail = 0, lo = 0;
  w->g[0] = 0;
  for (int64_t i = 1; i <= n; i++) {
    int64_t k = i - 1;
    /* push start k with key g[k] + in[k] */
    int64_t key = w->g[k] + w->in[k];
    while (tail > head && w->g[w->dq[tail - 1]] + w->in[w->dq[tail - 1]] >= key) tail--;
    w->dq[tail++] = k;
    while (w->pre[i] - w->pre[lo] > cap) lo++;
    while (head < tail && w->dq[head] < lo) head++;
    int64_t best = w->g[k] + w->saved[k];
    int64_t from = -1;
    if (head < tail) {
      int64_t kk = w->dq[head];
      int64_t v = w->g[kk] + w->in[kk];
      if (v < best) { best = v; from = kk; }
    }
    w->g[i] = best;
    w->from[i] = from;
  }
  int64_t mx = 0;
  for (int64_t i = n; i > 0;) {
    int64_t k = w->from[i];
    if (k < 0) { i--; continue; }
    if (w->pre[i] - w->pre[k] > mx) mx = w->pre[i] - w->pre[k];
    i = k;
  }
  *plan_max = mx;
  return w->g[n];
}

typedef struct {
  int64_t best;      /* least memory found so far */
  int64_t best_cap;  /* the cap that found it */
  int evals;
} minmem_search;

/* On caps in [lo, hi] with f(lo) = flo, f(hi) = fhi known (f non-increasing):
 * any cap x there has x + f(x) >= lo + fhi. */
static void search_caps(minmem_ws *w, minmem_search *s, int64_t lo, int64_t flo,
                        int64_t hi, int64_t fhi, int depth) {
  if (hi - lo <= 1 || flo == fhi) return;   /* nothing new strictly inside   */
  if (lo + fhi >= s->best) return;          /* cannot beat what we have       */
  if (depth > 200) return;                  /* unreachable: hi - lo halves    */
  int64_t mid = lo + (hi - lo) / 2, mx;
  int64_t fm = least_rest(w, mid, &mx);
  s->evals++;
  /* The plan found for cap mid is valid for cap mx <= mid, so f is constant
   * (= fm) on [mx, mid], and mx + fm is the best memory on that stretch. */
  if (mx + fm < s->best) { s->best = mx + fm; s->best_cap = mx; }
  search_caps(w, s, lo, flo, mx, fm, depth + 1);
  search_caps(w, s, mid, fm, hi, fhi, depth + 1);
}

static mf_status minmem_alloc(minmem_ws *w, int64_t n, const int64_t *in,
                              const int64_t *saved) {
  memset(w, 0, sizeof *w);
  w->n = n;
  w->in = in;
  w->saved = saved;
  w->pre = malloc(sizeof(int64_t) * (size_t)(n + 1));
  w->g = malloc(sizeof(int64_t) * (size_t)(n + 1));
  w->from = malloc(sizeof(int64_t) * (size_t)(n + 1));
  w->dq = malloc(sizeof(int64_t) * (size_t)(n + 1));
  if (!w->pre || !w->g || !w->from || !w->dq)
    return mf_error(MF_ERR_NOMEM, "checkpoint planner: out of host memory (n=%lld)",
                    (long long)n);
  w->pre[0] = 0;
  for (int64_t i = 0; i < n; i++) w->pre[i + 1] = w->pre[i] + saved[i];
  return MF_OK;
}

static void minmem_free(minmem_ws *w) {
  free(w->pre);
  free(w->g);
  free(w->from);
  free(w->dq);
}

/* Least memory over all plans; leaves the DP of the best cap in w (so the caller
 * can read the plan off w->from). */
static int64_t least_memory(minmem_ws *w) {
  const int64_t n = w->n;
  int64_t mx0, mxh;
  int64_t f0 = least_rest(w, 0, &mx0);
  int64_t hi = w->pre[n];
  int64_t fh = least_rest(w, hi, &mxh);
  minmem_search s = {mx0 + f0, 0, 2};
  if (mxh + fh < s.best) { s.best = mxh + fh; s.best_cap = mxh; }
  search_caps(w, &s, 0, f0, hi, fh, 0);
  int64_t mx;
  least_rest(w, s.best_cap, &mx); /* leave the best plan in w->from */
  return s.best;
}

/* Reads a plan off a least_rest() table; adjacent stored stages are merged. */
static int64_t plan_from_minmem(const minmem_ws *w, int64_t *seg_end, uint8_t *seg_ckpt) {
  /* Walk backward, write segments in reverse, then flip. */
  int64_t ns = 0;
  for (int64_t i = w->n; i > 0;) {
    int64_t k = w->from[i];
    if (k < 0) {
      if (ns > 0 && !seg_ckpt[ns - 1]) {
        /* extend the stored run: its end stays, start moves left (implicit) */
      } else {
        seg_end[ns] = i;
        seg_ckpt[ns] = 0;
        ns++;
      }
      i--;
    } else {
      seg_end[ns] = i;
      seg_ckpt[ns] = 1;
      ns++;
      i = k;
    }
  }
  for (int64_t a = 0, b = ns - 1; a < b; a++, b--) {
    int64_t te = seg_end[a]; seg_end[a] = seg_end[b]; seg_end[b] = te;
    uint8_t tc = seg_ckpt[a]; seg_ckpt[a] = seg_ckpt[b]; seg_ckpt[b] = tc;
  }
  /* seg_end now holds ends in order. */
  return ns;
}

mf_status mf_plan_min_budget(int64_t n, const int64_t *input_bytes,
                             const int64_t *saved_bytes, int64_t *min_budget_bytes) {
  mf_status st = check_chain(n, input_bytes, saved_bytes, NULL, 0);
  if (st) return st;
  if (!min_budget_bytes) return mf_error(MF_ERR_VALUE, "min_budget_bytes: NULL output");
  minmem_ws w;
  st = minmem_alloc(&w, n, input_bytes, saved_bytes);
  if (st == MF_OK) *min_budget_bytes = least_memory(&w);
  minmem_free(&w);
  return st;
}

/* ------------------------------------------------- least cost (slot DP) -- */

static int64_t gcd64(int64_t a, int64_t b) {
  while (b) { int64_t t = a % b; a = b; b = t; }
  return a;
}

static int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

/* Non-exact mode: a slot count that keeps the worst case n * B * B / 2 cell
 * updates near 1.5e8 per DP run (about 0.05 s; up to four runs). */
static int64_t auto_slots(int64_t n) {
  double b = sqrt(3e8 / (double)n);
  if (b < 64) b = 64;
  if (b > 4096) b = 4096;
  return (int64_t)b;
}

static int cmp_i64(const void *x, const void *y) {
  int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
  return (a > b) - (a < b);
}

/* Number of distinct sums saved[k..i) that are <= limit (the caps the exact DP
 * would try), or -1 when there are more than max_count segment sums to look at. */
static int64_t count_caps(int64_t n, const int64_t *pre, int64_t limit, int64_t max_count) {
  const double all = 0.5 * (double)n * (double)(n + 1); /* every segment */
  if (all < (double)max_count) max_count = (int64_t)all;
  int64_t *sums = malloc(sizeof(int64_t) * (size_t)(max_count + 2));
  if (!sums) return -1;
  int64_t c = 0;
  sums[c++] = 0;
  for (int64_t k = 0; k < n; k++)
    for (int64_t i = k + 1; i <= n && pre[i] - pre[k] <= limit; i++) {
      if (c > max_count) {
        free(sums);
        return -1;
      }
      sums[c++] = pre[i] - pre[k];
    }
  qsort(sums, (size_t)c, sizeof(int64_t), cmp_i64);
  int64_t distinct = 0;
  for (int64_t j = 0; j < c; j++)
    if (j == 0 || sums[j] != sums[j - 1]) distinct++;
  free(sums);
  return distinct;
}

typedef struct {
  int64_t n, B;           /* stages; budget in slots                          */
  const int64_t *a, *b;   /* input / saved sizes in slots                     */
  const double *P;        /* prefix sums of forward_cost, n + 1               */
  const int64_t *pre;     /* prefix sums of b, n + 1                          */
  double *D;              /* (n + 1) x (B + 1)                                */
  int32_t *par;           /* (n + 1) x (B + 1): -1 stored, else start k       */
  int32_t *qi;            /* (B + 1) x n deque indices                        */
  double *qv;             /* (B + 1) x n deque values                         */
  int64_t *qh, *qt;       /* (B + 1) heads / tails                            */
} cost_ws;

/* Fills D for a cap (slots) and rest budget R <= B; records parents if asked. */
static void least_cost(cost_ws *w, int64_t cap, int64_t R, int with_par) {
  const int64_t n = w->n, W = w->B + 1;
  double *D = w->D;
  for (int64_t m = 0; m <= R; m++) {
    D[m] = 0.0;
    w->qh[m] = w->qt[m] = 0;
  }
  int64_t lo = 0;
  for (int64_t i = 1; i <= n; i++) {
    const int64_t k = i - 1, ak = w->a[k], bk = w->b[k];
    const double *Dk = D + k * W;
    double *Di = D + i * W;
    int32_t *pi = with_par ? w->par + i * W : NULL;
    while (w->pre[i] - w->pre[lo] > cap) lo++;
    const double Pk = w->P[k], Pi = w->P[i];
    for (int64_t m = 0; m <= R; m++) {
      int32_t *qi = w->qi + m * n;
      double *qv = w->qv + m * n;
      int64_t h = w->qh[m], t = w->qt[m];
      if (m >= ak && Dk[m - ak] < MF_COST_INF) {
        double e = Dk[m - ak] - Pk;
        while (t > h && qv[t - 1] >= e) t--;
        qi[t] = (int32_t)k;
        qv[t] = e;
        t++;
      }
      while (h < t && qi[h] < lo) h++;
      w->qh[m] = h;
      w->qt[m] = t;
      double best = m >= bk ? Dk[m - bk] : MF_COST_INF;
      int32_t from = -1;
      if (h < t && qv[h] + Pi < best) {
        best = qv[h] + Pi;
        from = qi[h];
      }
      Di[m] = best;
      if (pi) pi[m] = from;
    }
  }
}

static int64_t plan_from_cost(const cost_ws *w, int64_t m, int64_t *seg_end,
                              uint8_t *seg_ckpt) {
  const int64_t W = w->B + 1;
  int64_t ns = 0;
  for (int64_t i = w->n; i > 0;) {
    int32_t k = w->par[i * W + m];
    if (k < 0) {
      if (!(ns > 0 && !seg_ckpt[ns - 1])) {
        seg_end[ns] = i;
        seg_ckpt[ns] = 0;
        ns++;
      }
      m -= w->b[i - 1];
      i--;
    } else {
      seg_end[ns] = i;
      seg_ckpt[ns] = 1;
      ns++;
      m -= w->a[k];
      i = k;
    }
  }
  for (int64_t x = 0, y = ns - 1; x < y; x++, y--) {
    int64_t te = seg_end[x]; seg_end[x] = seg_end[y]; seg_end[y] = te;
    uint8_t tc = seg_ckpt[x]; seg_ckpt[x] = seg_ckpt[y]; seg_ckpt[y] = tc;
  }
  return ns;
}

/* (cost, memory) order with a relative tolerance on cost, so that two plans whose
 * costs differ only by rounding in a different summation order count as a tie. */
static int better(double c1, int64_t m1, double c2, int64_t m2, double tol) {
  if (c1 < c2 - tol) return 1;
  if (c1 > c2 + tol) return 0;
  return m1 < m2;
}

/* The best plan so far; its segments live in the caller's output arrays. */
typedef struct {
  int64_t *end;
  uint8_t *ckpt;
  int64_t ns, mem;
  double cost;
} best_plan;

/* Takes the candidate (ns segments in end/ckpt, memory mem, cost c) if it beats the
 * best so far; the caller has checked that it fits the budget. */
static void keep_if_better(best_plan *best, int64_t ns, const int64_t *end, const uint8_t *ckpt,
                           int64_t mem, double c, double tol) {
  if (!better(c, mem, best->cost, best->mem, tol)) return;
  memcpy(best->end, end, sizeof(int64_t) * (size_t)ns);
  memcpy(best->ckpt, ckpt, (size_t)ns);
  best->ns = ns;
  best->mem = mem;
  best->cost = c;
}

/* The cap loop over a filled cost_ws (a, b, pre, B set): writes the least-cost
 * plan for the slot sizes and returns its segment count, or 0 when none fits.
 * is_cap and G are scratch of B + 1 entries. */
static int64_t slot_dp(cost_ws *w, uint8_t *is_cap, double *G, double tol, int64_t *seg_end,
                       uint8_t *seg_ckpt) {
  const int64_t n = w->n, B = w->B;
  const size_t W = (size_t)B + 1;
  /* Every cap worth trying is a segment sum (or 0); a plan with max segment M is
   * found by the run with cap M. */
  memset(is_cap, 0, W);
  is_cap[0] = 1;
  for (int64_t k = 0; k < n; k++)
    for (int64_t i = k + 1; i <= n && w->pre[i] - w->pre[k] <= B; i++)
      is_cap[w->pre[i] - w->pre[k]] = 1;

  /* Lower bound: without the cap, G(r) = D[n][r] is the least cost with rest
   * memory <= r; any cap M then costs at least G(B - M), which grows with M. */
  least_cost(w, INT64_MAX, B, 0);
  memcpy(G, w->D + (size_t)n * W, sizeof(double) * W);

  double dp_cost = MF_COST_INF;
  int64_t dp_slots = INT64_MAX, dp_cap = -1, dp_m = -1;
  for (int64_t M = 0; M <= B; M++) {
    if (!is_cap[M]) continue;
    const int64_t R = B - M;
    if (G[R] == MF_COST_INF) continue;     /* nothing fits with this cap       */
    if (G[R] > dp_cost + tol) break;       /* and so for every larger cap      */
    least_cost(w, M, R, 0);
    const double *Dn = w->D + (size_t)n * W;
    double c = Dn[R];
    if (c == MF_COST_INF) continue;
    int64_t m = 0;
    while (Dn[m] > c + tol) m++;           /* least memory at (about) that cost */
    if (better(c, M + m, dp_cost, dp_slots, tol)) {
      dp_cost = c;
      dp_slots = M + m;
      dp_cap = M;
      dp_m = m;
    }
  }
  if (dp_cap < 0) return 0;
  least_cost(w, dp_cap, B - dp_cap, 1);
  return plan_from_cost(w, dp_m, seg_end, seg_ckpt);
}

mf_status mf_plan_budget(int64_t n, const int64_t *input_bytes,
                         const int64_t *saved_bytes, const double *forward_cost,
                         int64_t budget_bytes, int64_t max_slots, int64_t *seg_end,
                         uint8_t *seg_ckpt, mf_plan_info *info) {
  mf_status st = check_chain(n, input_bytes, saved_bytes, forward_cost, 1);
  if (st) return st;
  if (budget_bytes < 0)
    return mf_error(MF_ERR_VALUE, "budget_bytes: must be >= 0, got %lld",
                    (long long)budget_bytes);
  if (max_slots < 0)
    return mf_error(MF_ERR_VALUE, "max_slots: must be >= 0 (0: auto), got %lld",
                    (long long)max_slots);
  if (!seg_end || !seg_ckpt || !info)
    return mf_error(MF_ERR_VALUE, "seg_end/seg_ckpt/info: NULL output");

  const size_t N = (size_t)n;
  int64_t *tmp_end = malloc(sizeof(int64_t) * N);
  uint8_t *tmp_ckpt = malloc(N);
  int64_t *a = malloc(sizeof(int64_t) * N);
  int64_t *b = malloc(sizeof(int64_t) * N);
  double *P = malloc(sizeof(double) * (N + 1));
  int64_t *pre = malloc(sizeof(int64_t) * (N + 1));
  uint8_t *is_cap = NULL;
  double *G = NULL;
  cost_ws w;
  memset(&w, 0, sizeof w);
  minmem_ws mw;
  st = minmem_alloc(&mw, n, input_bytes, saved_bytes);
  if (st) goto finish;
  if (!tmp_end || !tmp_ckpt || !a || !b || !P || !pre) {
    st = mf_error(MF_ERR_NOMEM, "checkpoint planner: out of host memory (n=%lld)",
                  (long long)n);
    goto finish;
  }

  /* 1. Feasibility, exactly in bytes. The least-memory plan is also kept as a
   * candidate, so any budget >= the reported minimum gets a plan. */
  int64_t min_mem = least_memory(&mw);
  if (budget_bytes < min_mem) {
    st = mf_error(MF_ERR_VALUE,
                  "budget_bytes: no plan fits in %lld bytes; the smallest feasible "
                  "budget for this chain is %lld bytes",
                  (long long)budget_bytes, (long long)min_mem);
    goto finish;
  }
  best_plan best = {seg_end, seg_ckpt, plan_from_minmem(&mw, seg_end, seg_ckpt), 0, 0.0};
  evaluate(n, input_bytes, saved_bytes, forward_cost, best.ns, seg_end, seg_ckpt, &best.mem,
           &best.cost);

  P[0] = 0.0;
  for (int64_t i = 0; i < n; i++) P[i + 1] = P[i] + forward_cost[i];
  const double tol = 1e-12 * (P[n] > 1.0 ? P[n] : 1.0);

  /* 2. The classic candidates: store everything, checkpoint every stage, the
   * sqrt(n) plan. They make "never worse than these" hold even when the DP below
   * has to round sizes. */
  for (int pass = 0; pass < 3; pass++) {
    int64_t ns, mem;
    double c;
    if (pass == 0) {
      ns = 1;
      tmp_end[0] = n;
      tmp_ckpt[0] = 0;
    } else if (pass == 1) {
      ns = n;
      for (int64_t i = 0; i < n; i++) {
        tmp_end[i] = i + 1;
        tmp_ckpt[i] = 1;
      }
    } else {
      ns = sqrt_plan(n, tmp_end, tmp_ckpt);
    }
    evaluate(n, input_bytes, saved_bytes, forward_cost, ns, tmp_end, tmp_ckpt, &mem, &c);
    if (mem <= budget_bytes) keep_if_better(&best, ns, tmp_end, tmp_ckpt, mem, c, tol);
  }

  /* 3. The slot DP. Budgets above "store everything" change nothing. */
  int64_t total_saved = mw.pre[n];
  int64_t eff_budget = budget_bytes < total_saved ? budget_bytes : total_saved;
  int64_t slots = max_slots > 0 ? max_slots : auto_slots(n);
  int64_t unit = 0;
  for (int64_t i = 0; i < n; i++) unit = gcd64(gcd64(unit, input_bytes[i]), saved_bytes[i]);
  if (unit == 0) unit = 1;
  int exact = eff_budget / unit <= slots;
  if (!exact && max_slots == 0) {
    /* The exact DP costs n * B * K for B = budget / gcd slots and K distinct
     * segment sums. Chains of identical blocks have few sums (K <= n) and can
     * afford many slots: plan them exactly when the table (~24 bytes a cell)
     * stays under ~100 MB and the work under ~4e8 cell updates. */
    const double cells = (double)(n + 1) * (double)(eff_budget / unit + 1);
    if (cells <= 4e6) {
      int64_t k_caps = count_caps(n, mw.pre, eff_budget, 4000000);
      exact = k_caps > 0 && cells * (double)k_caps <= 4e8;
    }
  }
  if (!exact) unit = ceil_div(eff_budget, slots);
  for (int64_t i = 0; i < n; i++) {
    a[i] = ceil_div(input_bytes[i], unit);
    b[i] = ceil_div(saved_bytes[i], unit);
  }
  const int64_t B = eff_budget / unit;
  pre[0] = 0;
  for (int64_t i = 0; i < n; i++) pre[i + 1] = pre[i] + b[i];

  is_cap = malloc((size_t)B + 1);
  w.n = n;
  w.B = B;
  w.a = a;
  w.b = b;
  w.P = P;
  w.pre = pre;
  const size_t W = (size_t)B + 1;
  if (W > ((size_t)1 << 40) / (N + 1)) {
    st = mf_error(MF_ERR_VALUE, "max_slots: %lld slots x %lld stages is too large",
                  (long long)slots, (long long)n);
    goto finish;
  }
  w.D = malloc(sizeof(double) * (N + 1) * W);
  w.par = malloc(sizeof(int32_t) * (N + 1) * W);
  w.qi = malloc(sizeof(int32_t) * N * W);
  w.qv = malloc(sizeof(double) * N * W);
  w.qh = malloc(sizeof(int64_t) * W);
  w.qt = malloc(sizeof(int64_t) * W);
  G = malloc(sizeof(double) * W);
  if (!is_cap || !w.D || !w.par || !w.qi || !w.qv || !w.qh || !w.qt || !G) {
    st = mf_error(MF_ERR_NOMEM,
                  "checkpoint planner: out of host memory (n=%lld, %lld slots); "
                  "lower max_slots",
                  (long long)n, (long long)slots);
    goto finish;
  }
  int64_t ns = slot_dp(&w, is_cap, G, tol, tmp_end, tmp_ckpt);
  if (ns > 0) {
    int64_t mem;
    double c;
    evaluate(n, input_bytes, saved_bytes, forward_cost, ns, tmp_end, tmp_ckpt, &mem, &c);
    if (mem > budget_bytes) {
      st = mf_error(MF_ERR_INTERNAL, "checkpoint planner: DP plan uses %lld > %lld bytes",
                    (long long)mem, (long long)budget_bytes);
      goto finish;
    }
    keep_if_better(&best, ns, tmp_end, tmp_ckpt, mem, c, tol);
  }
  if (!exact) {
    /* Rounding every size up overstates a plan's memory by up to one unit per
     * term, which adds up over many stages; sizes rounded to the nearest unit err
     * both ways and mostly cancel. Such a plan may not fit, so check it in bytes
     * and, if it does not, retry with the slot budget lowered by the excess. */
    for (int64_t i = 0; i < n; i++) {
      a[i] = (input_bytes[i] + unit / 2) / unit;
      b[i] = (saved_bytes[i] + unit / 2) / unit;
      pre[i + 1] = pre[i] + b[i];
    }
    int64_t bt = B;
    for (int attempt = 0; attempt < 3 && bt >= 0; attempt++) {
      w.B = bt;
      ns = slot_dp(&w, is_cap, G, tol, tmp_end, tmp_ckpt);
      if (ns == 0) break;
      int64_t mem;
      double c;
      evaluate(n, input_bytes, saved_bytes, forward_cost, ns, tmp_end, tmp_ckpt, &mem, &c);
      if (mem <= budget_bytes) {
        keep_if_better(&best, ns, tmp_end, tmp_ckpt, mem, c, tol);
        break;
      }
      bt -= ceil_div(mem - budget_bytes, unit);
    }
  }
  info->n_segments = best.ns;
  info->memory_bytes = best.mem;
  info->recompute_cost = best.cost;
  info->unit_bytes = unit;
  info->exact = exact;
  st = MF_OK;

finish:
  minmem_free(&mw);
  free(tmp_end);
  free(tmp_ckpt);
  free(a);
  free(b);
  free(P);
  free(pre);
  free(is_cap);
  free(G);
  free(w.D);
  free(w.par);
  free(w.qi);
  free(w.qv);
  free(w.qh);
  free(w.qt);
  return st;
}
