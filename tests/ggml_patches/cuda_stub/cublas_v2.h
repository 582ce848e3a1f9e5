// Compile checks only (tests/ggml_patches/test_cuda_kernels.py): the few cuBLAS names that ggml-cuda's
// headers mention, for a machine with nvcc but without cuBLAS. Never linked, never run.
#pragma once
#include <cuda_runtime.h>
#include <library_types.h>
typedef struct cublasContext * cublasHandle_t;
typedef enum { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_NOT_INITIALIZED = 1 } cublasStatus_t;
typedef enum { CUBLAS_COMPUTE_16F = 64, CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_FAST_TF32 = 77 } cublasComputeType_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUBLAS_GEMM_DEFAULT = -1, CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99 } cublasGemmAlgo_t;
typedef enum { CUBLAS_DEFAULT_MATH = 0, CUBLAS_TENSOR_OP_MATH = 1, CUBLAS_TF32_TENSOR_OP_MATH = 3 } cublasMath_t;
inline const char * cublasGetStatusString(cublasStatus_t) { return ""; }
inline cublasStatus_t cublasCreate(cublasHandle_t *) { return CUBLAS_STATUS_SUCCESS; }
inline cublasStatus_t cublasSetMathMode(cublasHandle_t, cublasMath_t) { return CUBLAS_STATUS_SUCCESS; }
inline cublasStatus_t cublasSetStream(cublasHandle_t, cudaStream_t) { return CUBLAS_STATUS_SUCCESS; }
// named by ggml-cuda.cu itself (its compile check)
template <typename... A> inline cublasStatus_t cublasDestroy(A...) { return CUBLAS_STATUS_SUCCESS; }
template <typename... A> inline cublasStatus_t cublasSgemm(A...) { return CUBLAS_STATUS_SUCCESS; }
template <typename... A> inline cublasStatus_t cublasGemmBatchedEx(A...) { return CUBLAS_STATUS_SUCCESS; }
template <typename... A> inline cublasStatus_t cublasGemmEx(A...) { return CUBLAS_STATUS_SUCCESS; }
template <typename... A> inline cublasStatus_t cublasGemmStridedBatchedEx(A...) { return CUBLAS_STATUS_SUCCESS; }
