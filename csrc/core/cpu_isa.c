/* Run-time choice of the CPU kernels' vector extensions (cpu_isa.h). */
#include "cpu_isa.h"

#include "memfit/common.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#ifdef MF_X86_SIMD
/* MEMFIT_CPU_ISA: "avx512" caps at AVX-512 F/BW/DQ/VL (no VBMI); "avx512vbmi" or unset
 * allows everything. */
static const char *cap_env(void) { return getenv("MEMFIT_CPU_ISA"); }

static int detect(void) {
  const char *cap = cap_env();
  int max_isa = ISA_AVX512;
  if (cap && !strcmp(cap, "generic")) max_isa = ISA_GENERIC;
  if (cap && !strcmp(cap, "avx2")) max_isa = ISA_AVX2;
  __builtin_cpu_init();
  if (max_isa >= ISA_AVX512 && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return ISA_AVX512;
  if (max_isa >= ISA_AVX2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return ISA_AVX2;
  return ISA_GENERIC;
}

/* -1: not yet known. Racing first calls compute and store the same value. */
static _Atomic int isa_cached = -1;

int mf_cpu_isa(void) {
  int isa = atomic_load_explicit(&isa_cached, memory_order_relaxed);
  if (isa < 0) {
    isa = detect();
    atomic_store_explicit(&isa_cached, isa, memory_order_relaxed);
  }
  return isa;
}

int mf_cpu_has_vbmi(void) {
  static _Atomic int vbmi_cached = -1;
  int v = atomic_load_explicit(&vbmi_cached, memory_order_relaxed);
  if (v < 0) {
    const char *cap = cap_env();
    v = mf_cpu_isa() == ISA_AVX512 && !(cap && !strcmp(cap, "avx512")) &&
        __builtin_cpu_supports("avx512vbmi");
    atomic_store_explicit(&vbmi_cached, v, memory_order_relaxed);
  }
  return v;
}
#else
int mf_cpu_isa(void) { return ISA_GENERIC; }
int mf_cpu_has_vbmi(void) { return 0; }
#endif

const char *mf_cpu_kernels(void) {
  if (mf_cpu_has_vbmi()) return "avx512-vbmi";
  switch (mf_cpu_isa()) {
    case ISA_AVX512: return "avx512";
    case ISA_AVX2: return "avx2";
    default: return "generic";
  }
}
