/*
 * Private to the core: which x86 vector extensions the CPU kernels may use.
 *
 * Kernels are compiled for plain x86-64 and, through target attributes, for AVX2 and
 * AVX-512; the widest one the CPU runs is picked at run time. Every variant computes
 * the same bits (the tests compare them), so MEMFIT_CPU_ISA=generic|avx2|avx512|avx512vbmi
 * can cap the choice for tests and benchmarks ("avx512": without the VBMI byte permutes,
 * as on Skylake-SP and Cascade Lake).
 */
#ifndef MEMFIT_CPU_ISA_H
#define MEMFIT_CPU_ISA_H

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(MEMFIT_NO_SIMD)
#define MF_X86_SIMD 1
#define MF_TARGET_AVX2 __attribute__((target("avx2")))
/* AVX2 with FMA (every AVX2 CPU has both; ISA_AVX2 requires both): only for code compiled
 * with -ffp-contract=off, where the one fused multiply-add is an explicit fmaf (Muon's
 * mf_lerp_f32), which is then an instruction instead of a libm call per element. */
#define MF_TARGET_AVX2_FMA __attribute__((target("avx2,fma")))
#define MF_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define MF_TARGET_VBMI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi")))
#endif

enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

/* The widest of ISA_* this CPU runs, capped by MEMFIT_CPU_ISA (read once). */
int mf_cpu_isa(void);

/* ISA_AVX512 and the AVX512-VBMI byte permutes (Ice Lake, Zen 4 and later), unless
 * MEMFIT_CPU_ISA=avx512 (read once). */
int mf_cpu_has_vbmi(void);

#endif /* MEMFIT_CPU_ISA_H */
