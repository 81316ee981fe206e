/*
 * Private to the core: which of two forms of a code search is faster on this CPU.
 *
 * The fused optimizer kernels (optim_avx2.c, optim_avx512.c) can search the code table
 * in two ways that give the same bytes (gathers or scalar loads; the arithmetic or the
 * table; the 4-bit threshold tree or the table), and CPUID does not say which is faster.
 * They ask this file, a leaf that knows nothing of them or of optim.c: the ISA files
 * call it, optim.c dispatches to the ISA files, and nothing here calls back up.
 */
#ifndef MEMFIT_OPTIM_SEARCH_FORM_H
#define MEMFIT_OPTIM_SEARCH_FORM_H

#include <stdatomic.h>
#include <stdint.h>

#include "code_lut.h"

/* Quantize x[0..n) to code indices q with form 1 or 0 of a search over lut's code. */
typedef void search_run(const mf_code_lut *lut, int form, const float *x, int64_t n, uint8_t *q);

/* Which of two forms of a code search is faster on this CPU, 1 or 0, once per process
 * (*cache: -1 before): MEMFIT_OPTIM_KERNEL (a comma-separated list) naming force1 or
 * force0 says, else the faster of 9 alternating timings of run(lut, form, ...) over the
 * same 2048 synthetic states (a few hundred microseconds). Racing first calls may both
 * measure; either answer is right, as both forms give the same bytes. */
int mf_optim_search_form(_Atomic int *cache, const char *force1, const char *force0,
                         const mf_code_lut *lut, search_run *run);

#endif /* MEMFIT_OPTIM_SEARCH_FORM_H */
