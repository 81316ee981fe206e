/*
 * The part of cuBLASLt's C API that memfit uses, declared by hand.
 *
 * memfit loads libcublasLt at run time (dlopen, cuda/gemm_cublaslt.cu), so it builds
 * where NVIDIA's cuBLAS headers and libraries are absent (CI, CPU machines). NVIDIA's
 * header is not vendored: these are our own minimal declarations of the values and
 * layouts, read from
 *   cublasLt.h, cublas_api.h of nvidia-cublas 13.10.0.20      (PyPI, nvidia/cu13/include)
 *   cublasLt.h, cublas_api.h of nvidia-cublas-cu12 12.9.3.13  (PyPI, nvidia/cublas/include)
 *   library_types.h of the CUDA 13.0 toolkit                   (cudaDataType values)
 * which agree on every item below (cuBLASLt keeps this ABI stable across 11.x-13.x).
 *
 * How they are checked: tests/cublaslt_abi_check.cpp includes a real cublasLt.h next
 * to this file and static_asserts every enum value, both struct layouts and the
 * parameter count, sizes and kinds of every function pointer type below;
 * tests/test_gemm_cublaslt.py compiles it whenever a cublasLt.h can be found
 * (MEMFIT_CUBLASLT_INCLUDE, the CUDA toolkit, or a pip nvidia wheel). Attribute
 * value sizes (int32_t, uint32_t, int64_t, ...) are documented only in comments of
 * the header; mf_gemm_cublaslt_selfcheck() has a loaded library accept each of them
 * (it rejects a wrong size with CUBLAS_STATUS_INVALID_VALUE), which needs no GPU.
 *
 * Plain C; every name is prefixed mflt_/MFLT_ so it can sit beside the real header.
 */
#ifndef MEMFIT_CUBLASLT_ABI_H
#define MEMFIT_CUBLASLT_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int mflt_status; /* cublasStatus_t */
/* Its values, listed once: X(name, value) gives MFLT_STATUS_<name> = value here, and
 * the names gemm_cublaslt.cu prints when the library has no cublasLtGetStatusName. */
#define MFLT_STATUS_LIST(X)                                                            \
  X(SUCCESS, 0) X(NOT_INITIALIZED, 1) X(ALLOC_FAILED, 3) X(INVALID_VALUE, 7)          \
  X(ARCH_MISMATCH, 8) X(MAPPING_ERROR, 11) X(EXECUTION_FAILED, 13) X(INTERNAL_ERROR, 14) \
  X(NOT_SUPPORTED, 15) X(LICENSE_ERROR, 16)
#define MFLT_STATUS_ENUM(name, value) MFLT_STATUS_##name = value,
enum { MFLT_STATUS_LIST(MFLT_STATUS_ENUM) };
#undef MFLT_STATUS_ENUM

/* cudaDataType_t (library_types.h) */
enum { MFLT_R_32F = 0, MFLT_R_16F = 2, MFLT_R_16BF = 14 };

/* cublasComputeType_t: float accumulation; never the TF32/FAST variants */
enum { MFLT_COMPUTE_32F = 68 };

/* cublasOperation_t */
enum { MFLT_OP_N = 0, MFLT_OP_T = 1 };

/* cublasLtMatmulDescAttributes_t, with the value type each one takes */
enum {
  MFLT_DESC_TRANSA = 3,               /* int32_t (cublasOperation_t) */
  MFLT_DESC_TRANSB = 4,               /* int32_t */
  MFLT_DESC_EPILOGUE = 7,             /* uint32_t (cublasLtEpilogue_t) */
  MFLT_DESC_BIAS_POINTER = 8,         /* const void * */
  MFLT_DESC_EPILOGUE_AUX_POINTER = 11,/* void * */
  MFLT_DESC_EPILOGUE_AUX_LD = 12      /* int64_t, a multiple of 8 for GELU_AUX */
};

/* cublasLtMatmulPreferenceAttributes_t */
enum {
  MFLT_PREF_MAX_WORKSPACE_BYTES = 1,  /* uint64_t */
  MFLT_PREF_MIN_ALIGNMENT_A_BYTES = 5,/* uint32_t */
  MFLT_PREF_MIN_ALIGNMENT_B_BYTES = 6,
  MFLT_PREF_MIN_ALIGNMENT_C_BYTES = 7,
  MFLT_PREF_MIN_ALIGNMENT_D_BYTES = 8
};

/* cublasLtEpilogue_t. GELU here is the tanh approximation. */
enum {
  MFLT_EPILOGUE_DEFAULT = 1,
  MFLT_EPILOGUE_RELU = 2,
  MFLT_EPILOGUE_BIAS = 4,
  MFLT_EPILOGUE_RELU_BIAS = 6,
  MFLT_EPILOGUE_GELU = 32,
  MFLT_EPILOGUE_GELU_BIAS = 36,
  MFLT_EPILOGUE_GELU_AUX = 160,     /* GELU | 128: also writes the GELU input */
  MFLT_EPILOGUE_GELU_AUX_BIAS = 164 /* GELU_AUX | BIAS */
};

typedef struct mflt_context_s *mflt_handle;          /* cublasLtHandle_t */
typedef struct mflt_matmul_desc_s *mflt_matmul_desc; /* cublasLtMatmulDesc_t */
typedef struct mflt_layout_s *mflt_layout;           /* cublasLtMatrixLayout_t */
typedef struct mflt_preference_s *mflt_preference;   /* cublasLtMatmulPreference_t */

typedef struct {
  uint64_t data[8];
} mflt_algo; /* cublasLtMatmulAlgo_t */

typedef struct {
  mflt_algo algo;
  size_t workspace_size;
  mflt_status state;
  float waves_count;
  int reserved[4];
} mflt_heuristic_result; /* cublasLtMatmulHeuristicResult_t */

/* The functions, as pointer types for dlsym. Enum parameters are int-sized; the
 * stream is a cudaStream_t. */
typedef mflt_status (*mflt_create_fn)(mflt_handle *handle);
typedef mflt_status (*mflt_destroy_fn)(mflt_handle handle);
typedef size_t (*mflt_get_version_fn)(void);
typedef mflt_status (*mflt_desc_create_fn)(mflt_matmul_desc *desc, int compute_type,
                                           int scale_type);
typedef mflt_status (*mflt_desc_destroy_fn)(mflt_matmul_desc desc);
typedef mflt_status (*mflt_desc_set_fn)(mflt_matmul_desc desc, int attr, const void *buf,
                                        size_t size);
typedef mflt_status (*mflt_layout_create_fn)(mflt_layout *layout, int type, uint64_t rows,
                                             uint64_t cols, int64_t ld);
typedef mflt_status (*mflt_layout_destroy_fn)(mflt_layout layout);
typedef mflt_status (*mflt_pref_create_fn)(mflt_preference *pref);
typedef mflt_status (*mflt_pref_destroy_fn)(mflt_preference pref);
typedef mflt_status (*mflt_pref_set_fn)(mflt_preference pref, int attr, const void *buf,
                                        size_t size);
typedef mflt_status (*mflt_heuristic_fn)(mflt_handle handle, mflt_matmul_desc desc,
                                         mflt_layout a, mflt_layout b, mflt_layout c,
                                         mflt_layout d, mflt_preference pref, int requested,
                                         mflt_heuristic_result *results, int *returned);
typedef mflt_status (*mflt_matmul_fn)(mflt_handle handle, mflt_matmul_desc desc,
                                      const void *alpha, const void *a, mflt_layout adesc,
                                      const void *b, mflt_layout bdesc, const void *beta,
                                      const void *c, mflt_layout cdesc, void *d,
                                      mflt_layout ddesc, const mflt_algo *algo, void *workspace,
                                      size_t workspace_size, void *stream);
/* optional (resolved if present): the library's own names for its status codes */
typedef const char *(*mflt_status_string_fn)(mflt_status status);

#ifdef __cplusplus
}
#endif
#endif /* MEMFIT_CUBLASLT_ABI_H */
