/* Checkpoint planner: the DP against brute force on random chains, infeasible
 * budgets, argument checks, and the time for 1000 stages (printed, not asserted). */
#define _POSIX_C_SOURCE 199309L
#include "memfit/plan.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"

/* xorshift64*: fixed seeds so a failure reproduces. */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 0x2545F4914F6CDD1Dull;
}
static int64_t rnd_int(int64_t lo, int64_t hi) { return lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1)); }
static double rnd_unit(void) { return (double)(rnd() >> 11) / 9007199254740992.0; }

/* Every plan of a chain: 2^(n-1) ways to cut, 2^segments ways to mark segments;
 * their (memory, cost) pairs, to query for any budget. */
typedef struct {
  int64_t count;
  int64_t mem[400000];
  double cost[400000];
} all_plans;
static all_plans plans;

static void enumerate(int n, const int64_t *in, const int64_t *saved, const double *cost) {
  int64_t seg_end[16];
  uint8_t seg_ckpt[16];
  plans.count = 0;
  for (uint32_t cuts = 0; cuts < (1u << (n - 1)); cuts++) {
    int ns = 0;
    for (int i = 1; i < n; i++)
      if (cuts & (1u << (i - 1))) seg_end[ns++] = i;
    seg_end[ns++] = n;
    for (uint32_t marks = 0; marks < (1u << ns); marks++) {
      for (int j = 0; j < ns; j++) seg_ckpt[j] = (uint8_t)((marks >> j) & 1);
      int64_t k = plans.count++;
      if (mf_plan_evaluate(n, in, saved, cost, ns, seg_end, seg_ckpt, &plans.mem[k],
                           &plans.cost[k]) != MF_OK) {
        fprintf(stderr, "evaluate failed: %s\n", mf_last_error());
        failures++;
        return;
      }
    }
  }
}

static int64_t brute_min_mem(void) {
  int64_t m = INT64_MAX;
  for (int64_t k = 0; k < plans.count; k++)
    if (plans.mem[k] < m) m = plans.mem[k];
  return m;
}

static double brute_cost(int64_t budget) {
  double c = INFINITY;
  for (int64_t k = 0; k < plans.count; k++)
    if (plans.mem[k] <= budget && plans.cost[k] < c) c = plans.cost[k];
  return c;
}

static void test_brute_force(void) {
  int cases = 0, exact_cases = 0;
  for (int trial = 0; trial < 400; trial++) {
    /* every size up to 12, the big ones less often (3^11 plans each) */
    int n = (trial % 20 == 0) ? (int)rnd_int(11, 12) : (int)rnd_int(1, 10);
    int64_t in[12], saved[12];
    double cost[12];
    /* Small integer sizes keep the DP exact (unit = gcd); sometimes scaled by a
     * common factor (as real tensor sizes are), sometimes zero-sized stages. */
    int64_t scale = (trial % 3 == 0) ? 4096 : 1;
    for (int i = 0; i < n; i++) {
      in[i] = rnd_int(trial % 5 == 0 ? 0 : 1, 20) * scale;
      saved[i] = rnd_int(trial % 7 == 0 ? 0 : 1, 60) * scale;
      cost[i] = (trial % 2) ? (double)rnd_int(1, 9) : 0.1 + rnd_unit() * 10.0;
    }
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += saved[i];
    enumerate(n, in, saved, cost);
    int64_t min_mem, want_min = brute_min_mem();
    CHECK(mf_plan_min_budget(n, in, saved, &min_mem) == MF_OK, "min_budget: %s", mf_last_error());
    CHECK(min_mem == want_min, "n=%d min budget %lld, brute force %lld", n,
          (long long)min_mem, (long long)want_min);
    /* budgets from the minimum to a bit over "store everything" */
    int64_t hi = total + total / 4 + 1;
    int64_t budget = min_mem + (int64_t)(rnd_unit() * (double)(hi - min_mem));
    double want = brute_cost(budget);
    int64_t seg_end[12];
    uint8_t seg_ckpt[12];
    mf_plan_info info;
    mf_status st = mf_plan_budget(n, in, saved, cost, budget, 0, seg_end, seg_ckpt, &info);
    CHECK(st == MF_OK, "n=%d budget=%lld: %s", n, (long long)budget, mf_last_error());
    if (st != MF_OK) continue;
    int64_t mem;
    double c;
    CHECK(mf_plan_evaluate(n, in, saved, cost, info.n_segments, seg_end, seg_ckpt, &mem,
                           &c) == MF_OK,
          "plan is malformed: %s", mf_last_error());
    CHECK(mem == info.memory_bytes && fabs(c - info.recompute_cost) <= 1e-9,
          "info disagrees with the plan: %lld vs %lld", (long long)mem,
          (long long)info.memory_bytes);
    CHECK(mem <= budget, "plan uses %lld > budget %lld", (long long)mem, (long long)budget);
    CHECK(info.exact == 1, "small integer chain should be exact (unit %lld)",
          (long long)info.unit_bytes);
    CHECK(fabs(c - want) <= 1e-9 * (1.0 + want),
          "trial %d n=%d budget=%lld: DP cost %.12g, brute force %.12g", trial, n,
          (long long)budget, c, want);
    cases++;
    exact_cases += info.exact;
  }
  printf("brute force: %d random chains (n <= 12) agree, %d exact\n", cases, exact_cases);
}

/* Sizes that are not multiples of a small unit force rounding: the plan must
 * still fit and be no worse than the sqrt(n) plan or the brute-force optimum. */
static void test_rounded_sizes(void) {
  double worst_ratio = 1.0;
  for (int trial = 0; trial < 60; trial++) {
    int n = (int)rnd_int(2, 11);
    int64_t in[12], saved[12];
    double cost[12];
    for (int i = 0; i < n; i++) {
      in[i] = rnd_int(1000000, 20000000);
      saved[i] = rnd_int(10000000, 90000000);
      cost[i] = 0.5 + rnd_unit();
    }
    enumerate(n, in, saved, cost);
    int64_t total = 0, min_mem = brute_min_mem();
    for (int i = 0; i < n; i++) total += saved[i];
    int64_t budget = min_mem + (int64_t)(rnd_unit() * (double)(total - min_mem));
    double want = brute_cost(budget);
    int64_t seg_end[12];
    uint8_t seg_ckpt[12];
    mf_plan_info info;
    /* few slots on purpose, so rounding matters */
    mf_status st = mf_plan_budget(n, in, saved, cost, budget, 40, seg_end, seg_ckpt, &info);
    CHECK(st == MF_OK, "rounded: %s", mf_last_error());
    if (st != MF_OK) continue;
    CHECK(info.memory_bytes <= budget, "rounded plan over budget");
    CHECK(info.recompute_cost >= want - 1e-9, "better than brute force?");
    CHECK(info.exact == 0, "40 slots cannot be exact here");
    if (want > 0 && info.recompute_cost / want > worst_ratio)
      worst_ratio = info.recompute_cost / want;
  }
  printf("rounded sizes (40 slots): worst cost / optimum = %.3f\n", worst_ratio);
}

/* A 12-block transformer with real byte counts (gcd 2 KiB, so a budget is tens of
 * thousands of units): few distinct segment sums make the exact DP affordable. */
static void test_identical_blocks_exact(void) {
  int64_t in[12], saved[12];
  double cost[12];
  for (int i = 0; i < 12; i++) {
    in[i] = 262144;
    saved[i] = 7886848;
    cost[i] = 1.0 + 0.001 * i; /* slightly different timings, as measured */
  }
  enumerate(12, in, saved, cost);
  for (int pct = 20; pct <= 80; pct += 15) {
    int64_t budget = (int64_t)12 * 7886848 * pct / 100;
    int64_t se[12];
    uint8_t sc[12];
    mf_plan_info info;
    mf_status st = mf_plan_budget(12, in, saved, cost, budget, 0, se, sc, &info);
    CHECK(st == MF_OK, "identical blocks %d%%: %s", pct, mf_last_error());
    CHECK(info.exact == 1 && info.unit_bytes == 2048, "identical blocks %d%%: exact=%d unit=%lld",
          pct, info.exact, (long long)info.unit_bytes);
    double want = brute_cost(budget);
    CHECK(fabs(info.recompute_cost - want) <= 1e-9, "identical blocks %d%%: %.4f vs %.4f", pct,
          info.recompute_cost, want);
  }
}

static void test_never_worse_than_sqrt(void) {
  for (int trial = 0; trial < 40; trial++) {
    int n = (int)rnd_int(4, 60);
    int64_t in[60], saved[60];
    double cost[60];
    for (int i = 0; i < n; i++) {
      in[i] = rnd_int(1, 8);
      saved[i] = rnd_int(4, 30);
      cost[i] = (double)rnd_int(1, 5);
    }
    int64_t se[60], pe[60];
    uint8_t sc[60], pc[60];
    int64_t ns, smem;
    double scost;
    CHECK(mf_plan_sqrt(n, se, sc, &ns) == MF_OK, "sqrt: %s", mf_last_error());
    CHECK(mf_plan_evaluate(n, in, saved, cost, ns, se, sc, &smem, &scost) == MF_OK, "eval sqrt");
    mf_plan_info info;
    CHECK(mf_plan_budget(n, in, saved, cost, smem, 0, pe, pc, &info) == MF_OK, "plan: %s",
          mf_last_error());
    CHECK(info.recompute_cost <= scost + 1e-9, "n=%d planner %.3f worse than sqrt %.3f", n,
          info.recompute_cost, scost);
    CHECK(info.memory_bytes <= smem, "planner over the sqrt plan's memory");
  }
}

static void test_sqrt_shape(void) {
  int64_t se[100];
  uint8_t sc[100];
  int64_t ns;
  CHECK(mf_plan_sqrt(12, se, sc, &ns) == MF_OK, "sqrt 12");
  /* round(sqrt(12)) = 3 segments of 4, the last stored */
  CHECK(ns == 3 && se[0] == 4 && se[1] == 8 && se[2] == 12, "sqrt(12) segments");
  CHECK(sc[0] == 1 && sc[1] == 1 && sc[2] == 0, "sqrt(12) marks");
  CHECK(mf_plan_sqrt(1, se, sc, &ns) == MF_OK && ns == 1 && se[0] == 1 && sc[0] == 0,
        "sqrt(1)");
  CHECK(mf_plan_sqrt(10, se, sc, &ns) == MF_OK && ns == 3 && se[0] == 4 && se[1] == 7 &&
            se[2] == 10,
        "sqrt(10) near-equal lengths");
  CHECK(mf_plan_sqrt(0, se, sc, &ns) == MF_ERR_VALUE, "sqrt(0) rejected");
}

static void test_infeasible_and_errors(void) {
  int64_t in[4] = {10, 10, 10, 10}, saved[4] = {100, 100, 100, 100};
  double cost[4] = {1, 1, 1, 1};
  int64_t se[4];
  uint8_t sc[4];
  mf_plan_info info;
  int64_t min_mem;
  CHECK(mf_plan_min_budget(4, in, saved, &min_mem) == MF_OK, "min budget");
  /* best: checkpoint each stage separately: 4 * 10 + 100 = 140, or store the
   * last: 3 * 10 + 100 + 100 = 230 -> 140 */
  CHECK(min_mem == 140, "min budget 140, got %lld", (long long)min_mem);
  mf_status st = mf_plan_budget(4, in, saved, cost, 139, 0, se, sc, &info);
  CHECK(st == MF_ERR_VALUE, "139 bytes must be infeasible");
  CHECK(strstr(mf_last_error(), "budget_bytes") && strstr(mf_last_error(), "140"),
        "message should name the argument and the minimum: %s", mf_last_error());
  CHECK(mf_plan_budget(4, in, saved, cost, 140, 0, se, sc, &info) == MF_OK &&
            info.memory_bytes == 140 && info.recompute_cost == 4.0,
        "140 bytes is feasible");
  CHECK(mf_plan_budget(4, in, saved, cost, 400, 0, se, sc, &info) == MF_OK &&
            info.recompute_cost == 0.0 && info.n_segments == 1 && sc[0] == 0,
        "a budget of everything stores everything");

  int64_t bad_in[2] = {1, -1}, ok_saved[2] = {1, 1};
  double ok_cost[2] = {1, 1}, nan_cost[2] = {1, NAN};
  st = mf_plan_budget(2, bad_in, ok_saved, ok_cost, 10, 0, se, sc, &info);
  CHECK(st == MF_ERR_VALUE && strstr(mf_last_error(), "input_bytes[1]"), "negative input: %s",
        mf_last_error());
  int64_t ok_in[2] = {1, 1};
  st = mf_plan_budget(2, ok_in, ok_saved, nan_cost, 10, 0, se, sc, &info);
  CHECK(st == MF_ERR_VALUE && strstr(mf_last_error(), "forward_cost[1]"), "NaN cost: %s",
        mf_last_error());
  st = mf_plan_budget(2, ok_in, ok_saved, ok_cost, -1, 0, se, sc, &info);
  CHECK(st == MF_ERR_VALUE && strstr(mf_last_error(), "budget_bytes"), "negative budget");
  st = mf_plan_budget(0, ok_in, ok_saved, ok_cost, 10, 0, se, sc, &info);
  CHECK(st == MF_ERR_VALUE && strstr(mf_last_error(), "n:"), "empty chain");
  int64_t mem;
  double c;
  int64_t bad_end[2] = {1, 1};
  uint8_t marks[2] = {0, 1};
  st = mf_plan_evaluate(2, ok_in, ok_saved, ok_cost, 2, bad_end, marks, &mem, &c);
  CHECK(st == MF_ERR_VALUE && strstr(mf_last_error(), "seg_end[1]"), "empty segment: %s",
        mf_last_error());
  int64_t short_end[1] = {1};
  st = mf_plan_evaluate(2, ok_in, ok_saved, ok_cost, 1, short_end, marks, &mem, &c);
  CHECK(st == MF_ERR_VALUE, "plan not covering the chain");
  /* all-zero sizes: everything fits in 0 bytes, nothing needs recomputing */
  int64_t z[3] = {0, 0, 0};
  double zc[3] = {1, 2, 3};
  CHECK(mf_plan_budget(3, z, z, zc, 0, 0, se, sc, &info) == MF_OK &&
            info.recompute_cost == 0.0 && info.memory_bytes == 0,
        "zero-sized chain: %s", mf_last_error());
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void time_chain(const char *label, int n, int64_t *in, int64_t *saved, double *cost,
                       double frac) {
  int64_t *se = malloc(sizeof(int64_t) * (size_t)n);
  uint8_t *sc = malloc((size_t)n);
  int64_t total = 0, min_mem;
  for (int i = 0; i < n; i++) total += saved[i];
  double t0 = now_s();
  mf_status st = mf_plan_min_budget(n, in, saved, &min_mem);
  double t1 = now_s();
  CHECK(st == MF_OK, "min budget: %s", mf_last_error());
  int64_t budget = min_mem + (int64_t)(frac * (double)(total - min_mem));
  mf_plan_info info;
  double t2 = now_s();
  st = mf_plan_budget(n, in, saved, cost, budget, 0, se, sc, &info);
  double t3 = now_s();
  CHECK(st == MF_OK, "%s: %s", label, mf_last_error());
  int64_t sn, smem;
  double scost;
  mf_plan_sqrt(n, se, sc, &sn);
  mf_plan_evaluate(n, in, saved, cost, sn, se, sc, &smem, &scost);
  printf("%-34s n=%d budget=%.0f%%: plan %.3f s (min budget %.3f s), %lld segments, "
         "cost %.1f, exact=%d, unit=%lld B\n",
         label, n, 100 * frac, t3 - t2, t1 - t0, (long long)info.n_segments,
         info.recompute_cost, info.exact, (long long)info.unit_bytes);
  free(se);
  free(sc);
}

static void test_1000_stages(void) {
  enum { N = 1000 };
  static int64_t in[N], saved[N];
  static double cost[N];
  /* identical blocks (a transformer): exact */
  for (int i = 0; i < N; i++) {
    in[i] = 8 << 20;
    saved[i] = 136 << 20;
    cost[i] = 1.0;
  }
  time_chain("1000 identical blocks", N, in, saved, cost, 0.25);
  /* heterogeneous layers with arbitrary byte counts: rounded */
  for (int i = 0; i < N; i++) {
    in[i] = rnd_int(1 << 20, 16 << 20);
    saved[i] = rnd_int(4 << 20, 64 << 20);
    cost[i] = 0.5 + rnd_unit();
  }
  time_chain("1000 random layers", N, in, saved, cost, 0.25);
  /* inputs as large as the saved tensors: checkpointing barely helps, the worst
   * case for the exact minimum-budget search */
  for (int i = 0; i < N; i++) {
    saved[i] = rnd_int(4 << 20, 64 << 20);
    in[i] = saved[i] - rnd_int(0, 1 << 20);
  }
  time_chain("1000 layers, inputs ~ saved", N, in, saved, cost, 0.5);
}

int main(void) {
  test_sqrt_shape();
  test_infeasible_and_errors();
  test_brute_force();
  test_rounded_sizes();
  test_identical_blocks_exact();
  test_never_worse_than_sqrt();
  test_1000_stages();
  return check_exit("test_plan");
}
