/* Private to the core: markers around hot loops for benchmarks/mca_model.py, which
 * compiles the core's sources with -DMEMFIT_MCA and models the marked loops with
 * llvm-mca per microarchitecture. In the library they expand to nothing. The spec is
 * "name elems=N isa=generic|avx2|avx512|avx512vbmi": N elements per loop iteration,
 * and the ISA a modelled CPU must have. */
#ifndef MEMFIT_MCA_MARK_H
#define MEMFIT_MCA_MARK_H

#ifdef MEMFIT_MCA
#define MF_MCA_BEGIN(spec) __asm__ volatile("# LLVM-MCA-BEGIN " spec ::: "memory")
#define MF_MCA_END() __asm__ volatile("# LLVM-MCA-END" ::: "memory")
#else
#define MF_MCA_BEGIN(spec)
#define MF_MCA_END()
#endif

#endif /* MEMFIT_MCA_MARK_H */
