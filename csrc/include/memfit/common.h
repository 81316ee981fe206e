/*
 * memfit core: shared definitions.
 *
 * Everything here is plain C11 and also compiles as CUDA C++ under nvcc, so the
 * element math in the capability headers (quant.h, ...) is written once and used by
 * both the CPU loops in csrc/core and the kernels in cuda/.
 *
 * Error model: every entry point returns an mf_status. On failure the message is
 * stored in a thread-local buffer (mf_last_error()); the CPython bindings turn the
 * status into an exception. The core never aborts and never prints.
 */
#ifndef MEMFIT_COMMON_H
#define MEMFIT_COMMON_H

#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#define MF_HD __host__ __device__
#else
#define MF_HD
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  MF_OK = 0,
  MF_ERR_TYPE = 1,     /* wrong dtype or kind of argument        -> TypeError    */
  MF_ERR_VALUE = 2,    /* bad shape, size, option or device mix  -> ValueError   */
  MF_ERR_CUDA = 3,     /* a CUDA call failed                     -> RuntimeError */
  MF_ERR_NO_CUDA = 4,  /* built without CUDA, or no usable GPU   -> RuntimeError */
  MF_ERR_NOMEM = 5,    /* host allocation failed                 -> MemoryError  */
  MF_ERR_INTERNAL = 6  /* a bug in memfit                        -> RuntimeError */
} mf_status;

typedef enum {
  MF_FLOAT32 = 0,
  MF_FLOAT16 = 1,
  MF_BFLOAT16 = 2,
  MF_UINT8 = 3
} mf_dtype;

typedef enum { MF_CPU = 0, MF_CUDA = 1 } mf_device;

/* How a value that falls between two representable ones is rounded. */
typedef enum { MF_ROUND_NEAREST = 0, MF_ROUND_STOCHASTIC = 1 } mf_rounding;

/* A view of contiguous memory owned by someone else (a torch tensor, a NumPy
 * array, ...). The core never allocates or frees what a view points to. */
typedef struct {
  void *data;
  int64_t numel;
  mf_dtype dtype;
  mf_device device;
  int device_id;
} mf_tensor;

/* A view of host memory: what C callers (tests, benchmarks, embedders) pass to the
 * entry points; the Python bindings build theirs from DLPack. */
static inline mf_tensor mf_cpu_tensor(void *data, int64_t numel, mf_dtype dtype) {
  mf_tensor t = {data, numel, dtype, MF_CPU, 0};
  return t;
}

/* Thread-local error message of the last failing call on this thread. */
const char *mf_last_error(void);
/* Records a message (printf-style) and returns `status`, so callers can write
 * `return mf_error(MF_ERR_VALUE, "x: ...");`. */
mf_status mf_error(mf_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void mf_clear_error(void);
/* MF_ERR_NO_CUDA for an entry point (`what`) given CUDA arrays in a build without CUDA,
 * with how to get a build that has it: the one wording every entry point uses. */
mf_status mf_error_no_cuda(const char *what);

const char *mf_dtype_name(mf_dtype dtype);
size_t mf_dtype_size(mf_dtype dtype);
const char *mf_device_name(mf_device device);

/* Argument checks shared by every entry point; each names the argument. */
mf_status mf_check_dtype(const mf_tensor *t, const char *name, mf_dtype want);
mf_status mf_check_float(const mf_tensor *t, const char *name); /* f32/f16/bf16 */
mf_status mf_check_numel(const mf_tensor *t, const char *name, int64_t want);
mf_status mf_check_same_device(const mf_tensor *a, const char *a_name,
                               const mf_tensor *b, const char *b_name);

/* CPU threads used by the core's parallel loops (OpenMP). 0 means "the OpenMP
 * default" (OMP_NUM_THREADS or the number of cores). */
void mf_set_num_threads(int n);
int mf_get_num_threads(void);
/* The calling thread's count, over mf_set_num_threads's for that thread only (0: none). */
void mf_set_thread_num_threads(int n);

/* Which vector form the CPU kernels run on this machine: "avx512-vbmi", "avx512",
 * "avx2" or "generic" (the widest the CPU has, capped by MEMFIT_CPU_ISA). */
const char *mf_cpu_kernels(void);

/* What the CPU is, for advice (not for picking kernels): the model name ("" where the CPU
 * or OS does not say), the vendor ID ("AuthenticAMD", "GenuineIntel"; "" off x86), and
 * which native bfloat16 compute it has: "amx-bf16", "avx512-bf16", both separated by a
 * space, "bf16" (aarch64 FEAT_BF16), or "" (none: bf16 math would be emulated). */
const char *mf_cpu_model_name(void);
const char *mf_cpu_vendor(void);
const char *mf_cpu_bf16_features(void);

/* What this library was built with. */
int mf_built_with_cuda(void);
int mf_built_with_openmp(void);
const char *mf_version(void);
const char *mf_compiler(void);
const char *mf_cuda_archs(void);

#ifdef __cplusplus
}
#endif
#endif /* MEMFIT_COMMON_H */
