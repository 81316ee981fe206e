/*
 * The fused optimizer kernels for AVX-512 CPUs without AVX512-VBMI (Skylake-SP,
 * Cascade Lake: much of the cloud, Colab included): optim_avx512.c built once more,
 * with table gathers instead of VBMI byte permutes for the 8-bit dequantization.
 * Entry points: mf_optim_fused{8,4}_avx512_gather (optim_cpu.h).
 */
#define MF_FUSED_GATHER 1
#include "optim_avx512.c"
