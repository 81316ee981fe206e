/*
 * The CPU optimizer's hot loops for benchmarks/mca_model.py to model with llvm-mca:
 *
 *   python benchmarks/mca_model.py --source benchmarks/c/mca_optim.c --per 8
 *
 * Benchmark-only: the product code carries no markers. Each function wraps one loop
 * between LLVM-MCA-BEGIN/END comments and calls the same inline helpers as the
 * kernels in csrc/core (optim_cpu.h), so the modelled instructions are the shipped ones.
 */
#include "optim_cpu.h"

#define MCA_BEGIN(spec) __asm__ volatile("# LLVM-MCA-BEGIN " spec ::: "memory")
#define MCA_END() __asm__ volatile("# LLVM-MCA-END" ::: "memory")

/* The fp32-state AdamW update (block kernel, and the update half of the fused one). */
#define UPDATE_ADAMW(fn, target, spec)                                                   \
  target __attribute__((noinline)) void fn(const mf_optim_consts *c, int64_t n, float *p,  \
                                           const float *g, float *s1, float *s2) {        \
    MCA_BEGIN(spec);                                                                     \
    update_loop(MF_OPT_ADAMW, c, 2, n, p, g, s1, s2);                                    \
    MCA_END();                                                                           \
  }
UPDATE_ADAMW(mca_update_adamw_generic, , "update_adamw_generic elems=4 isa=generic")
UPDATE_ADAMW(mca_update_adamw_avx2, MF_TARGET_AVX2, "update_adamw_avx2 elems=8 isa=avx2")
UPDATE_ADAMW(mca_update_adamw_avx512, MF_TARGET_AVX512, "update_adamw_avx512 elems=16 isa=avx512")
