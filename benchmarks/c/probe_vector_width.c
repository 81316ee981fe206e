/*
 * What kind of x86 core this is, where the CPU model name does not say (a VM's generic
 * "AMD EPYC" model, for one): the throughput of independent 256-bit and 128-bit float
 * adds, the latency of a dependent add, and the throughput of 256-bit sqrt and divide.
 * A core with 128-bit vector units (AMD Zen 1) runs 256-bit adds at half the rate of
 * 128-bit ones; Zen 2 and later, and Intel since Haswell, at the same rate.
 *
 *   gcc -O2 -mavx2 benchmarks/c/probe_vector_width.c -o /tmp/probe && taskset -c 0 /tmp/probe
 *
 * Benchmark-only (benchmarks/history/2026-11-24-optim-amd-epyc-adam-skip-branch.md).
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

#define N 50000000L
/* eight independent chains of OP (the asm keeps the compiler from folding them) */
#define EIGHT(OP, b)                                                                       \
  a0 = OP(a0, b), a1 = OP(a1, b), a2 = OP(a2, b), a3 = OP(a3, b);                           \
  a4 = OP(a4, b), a5 = OP(a5, b), a6 = OP(a6, b), a7 = OP(a7, b);                           \
  __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7))
/* operands away from powers of two, where a divider may take a shortcut: a alternates
 * between 1.3 and 3 / 1.3; sqrt(a + 3) settles near 2.30 */
#define DIV8(a, b) _mm256_div_ps(b, a)
#define SQRT8(a, b) _mm256_sqrt_ps(_mm256_add_ps(a, b))

int main(void) {
  double t, add256, add128, lat, div256, sqrt256;
  {
    __m256 a0 = _mm256_set1_ps(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const __m256 b = _mm256_set1_ps(1e-3f), three = _mm256_set1_ps(3.0f);
    t = now();
    for (long i = 0; i < N; i++) { EIGHT(_mm256_add_ps, b); }
    add256 = (now() - t) / (8.0 * N);
    t = now();
    for (long i = 0; i < N; i++) {
      a0 = _mm256_add_ps(a0, b);
      __asm__ volatile("" : "+x"(a0));
    }
    lat = (now() - t) / N;
    t = now();
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = _mm256_set1_ps(1.3f);
    for (long i = 0; i < N / 10; i++) { EIGHT(DIV8, three); }
    div256 = (now() - t) / (8.0 * (N / 10));
    t = now();
    for (long i = 0; i < N / 10; i++) { EIGHT(SQRT8, three); }
    sqrt256 = (now() - t) / (8.0 * (N / 10));
  }
  {
    __m128 a0 = _mm_set1_ps(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const __m128 b = _mm_set1_ps(1e-3f);
    t = now();
    for (long i = 0; i < N; i++) { EIGHT(_mm_add_ps, b); }
    add128 = (now() - t) / (8.0 * N);
  }
  printf("ns per instruction: 256-bit add %.3f, 128-bit add %.3f (ratio %.2f: ~2 means 128-bit "
         "vector units), dependent add %.3f (latency), 256-bit div %.3f, 256-bit add+sqrt %.3f\n",
         add256 * 1e9, add128 * 1e9, add256 / add128, lat * 1e9, div256 * 1e9, sqrt256 * 1e9);
  return 0;
}
