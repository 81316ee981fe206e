// Checks memfit's hand-written cuBLASLt declarations (cuda/cublaslt_abi.h) against a
// real cublasLt.h at compile time: compiling this file is the test
// (tests/test_gemm_cublaslt.py::test_cublaslt_declarations_match_header), e.g.
//   g++ -std=c++17 -fsyntax-only -I<dir of cublasLt.h> -I<CUDA include> -Icuda tests/cublaslt_abi_check.cpp
// It includes NVIDIA's header only here, in a test that runs where one is installed.
#include <cublasLt.h>

#include <cstddef>
#include <type_traits>

#include "cublaslt_abi.h"

#define SAME(ours, theirs) static_assert((long)(ours) == (long)(theirs), #ours " != " #theirs)

SAME(MFLT_STATUS_SUCCESS, CUBLAS_STATUS_SUCCESS);
SAME(MFLT_STATUS_NOT_INITIALIZED, CUBLAS_STATUS_NOT_INITIALIZED);
SAME(MFLT_STATUS_ALLOC_FAILED, CUBLAS_STATUS_ALLOC_FAILED);
SAME(MFLT_STATUS_INVALID_VALUE, CUBLAS_STATUS_INVALID_VALUE);
SAME(MFLT_STATUS_ARCH_MISMATCH, CUBLAS_STATUS_ARCH_MISMATCH);
SAME(MFLT_STATUS_MAPPING_ERROR, CUBLAS_STATUS_MAPPING_ERROR);
SAME(MFLT_STATUS_EXECUTION_FAILED, CUBLAS_STATUS_EXECUTION_FAILED);
SAME(MFLT_STATUS_INTERNAL_ERROR, CUBLAS_STATUS_INTERNAL_ERROR);
SAME(MFLT_STATUS_NOT_SUPPORTED, CUBLAS_STATUS_NOT_SUPPORTED);
SAME(MFLT_STATUS_LICENSE_ERROR, CUBLAS_STATUS_LICENSE_ERROR);
SAME(MFLT_R_32F, CUDA_R_32F);
SAME(MFLT_R_16F, CUDA_R_16F);
SAME(MFLT_R_16BF, CUDA_R_16BF);
SAME(MFLT_COMPUTE_32F, CUBLAS_COMPUTE_32F);
SAME(MFLT_OP_N, CUBLAS_OP_N);
SAME(MFLT_OP_T, CUBLAS_OP_T);
SAME(MFLT_DESC_TRANSA, CUBLASLT_MATMUL_DESC_TRANSA);
SAME(MFLT_DESC_TRANSB, CUBLASLT_MATMUL_DESC_TRANSB);
SAME(MFLT_DESC_EPILOGUE, CUBLASLT_MATMUL_DESC_EPILOGUE);
SAME(MFLT_DESC_BIAS_POINTER, CUBLASLT_MATMUL_DESC_BIAS_POINTER);
SAME(MFLT_DESC_EPILOGUE_AUX_POINTER, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER);
SAME(MFLT_DESC_EPILOGUE_AUX_LD, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD);
SAME(MFLT_PREF_MAX_WORKSPACE_BYTES, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES);
SAME(MFLT_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES);
SAME(MFLT_PREF_MIN_ALIGNMENT_B_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES);
SAME(MFLT_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES);
SAME(MFLT_PREF_MIN_ALIGNMENT_D_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES);
SAME(MFLT_EPILOGUE_DEFAULT, CUBLASLT_EPILOGUE_DEFAULT);
SAME(MFLT_EPILOGUE_RELU, CUBLASLT_EPILOGUE_RELU);
SAME(MFLT_EPILOGUE_BIAS, CUBLASLT_EPILOGUE_BIAS);
SAME(MFLT_EPILOGUE_RELU_BIAS, CUBLASLT_EPILOGUE_RELU_BIAS);
SAME(MFLT_EPILOGUE_GELU, CUBLASLT_EPILOGUE_GELU);
SAME(MFLT_EPILOGUE_GELU_BIAS, CUBLASLT_EPILOGUE_GELU_BIAS);
SAME(MFLT_EPILOGUE_GELU_AUX, CUBLASLT_EPILOGUE_GELU_AUX);
SAME(MFLT_EPILOGUE_GELU_AUX_BIAS, CUBLASLT_EPILOGUE_GELU_AUX_BIAS);

// enums travel as int in our signatures
static_assert(sizeof(cublasStatus_t) == sizeof(mflt_status), "cublasStatus_t size");
static_assert(sizeof(cudaDataType_t) == sizeof(int) && sizeof(cublasComputeType_t) == sizeof(int),
              "enum sizes");

// struct layouts
static_assert(sizeof(mflt_algo) == sizeof(cublasLtMatmulAlgo_t), "cublasLtMatmulAlgo_t size");
static_assert(alignof(mflt_algo) == alignof(cublasLtMatmulAlgo_t), "cublasLtMatmulAlgo_t align");
static_assert(sizeof(mflt_heuristic_result) == sizeof(cublasLtMatmulHeuristicResult_t),
              "cublasLtMatmulHeuristicResult_t size");
#define FIELD(ours, theirs)                                                                      \
  static_assert(offsetof(mflt_heuristic_result, ours) ==                                         \
                        offsetof(cublasLtMatmulHeuristicResult_t, theirs) &&                     \
                    sizeof(mflt_heuristic_result::ours) ==                                       \
                        sizeof(cublasLtMatmulHeuristicResult_t::theirs),                         \
                "cublasLtMatmulHeuristicResult_t." #theirs)
FIELD(algo, algo);
FIELD(workspace_size, workspaceSize);
FIELD(state, state);
FIELD(waves_count, wavesCount);
FIELD(reserved, reserved);

// function signatures: same return and parameter count, and each parameter of the
// same size and kind (pointer, integer, floating point)
template <class T>
constexpr int kind() {
  return std::is_pointer<T>::value ? 1 : std::is_floating_point<T>::value ? 2 : 3;
}
template <class A, class B>
constexpr bool same_slot() {
  return sizeof(A) == sizeof(B) && kind<A>() == kind<B>();
}
template <class R1, class... A1, class R2, class... A2>
constexpr bool same_abi(R1 (*)(A1...), R2 (*)(A2...)) {
  static_assert(sizeof...(A1) == sizeof...(A2), "parameter count differs");
  return same_slot<R1, R2>() && (true && ... && same_slot<A1, A2>());
}
#define SIG(ours, theirs) static_assert(same_abi((ours) nullptr, &theirs), #theirs " signature")
SIG(mflt_create_fn, cublasLtCreate);
SIG(mflt_destroy_fn, cublasLtDestroy);
SIG(mflt_get_version_fn, cublasLtGetVersion);
SIG(mflt_desc_create_fn, cublasLtMatmulDescCreate);
SIG(mflt_desc_destroy_fn, cublasLtMatmulDescDestroy);
SIG(mflt_desc_set_fn, cublasLtMatmulDescSetAttribute);
SIG(mflt_layout_create_fn, cublasLtMatrixLayoutCreate);
SIG(mflt_layout_destroy_fn, cublasLtMatrixLayoutDestroy);
SIG(mflt_pref_create_fn, cublasLtMatmulPreferenceCreate);
SIG(mflt_pref_destroy_fn, cublasLtMatmulPreferenceDestroy);
SIG(mflt_pref_set_fn, cublasLtMatmulPreferenceSetAttribute);
SIG(mflt_heuristic_fn, cublasLtMatmulAlgoGetHeuristic);
SIG(mflt_matmul_fn, cublasLtMatmul);
SIG(mflt_status_string_fn, cublasLtGetStatusName);
SIG(mflt_status_string_fn, cublasLtGetStatusString);

int main() { return 0; }
