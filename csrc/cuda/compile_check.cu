// Compile-only check of the torch-free CUDA headers (make cuda-compile-check, tests/test_kernels.py):
// instantiates every kernel template for the dtypes the bindings use, with no torch include, as NVRTC would.
#include <cuda_bf16.h>

#include "block_residual.cuh"
#include "irls.cuh"
#include "verify.cuh"

template __global__ void specadapt::cuda::block_residual_mass_kernel<256, float>(const float*, const float*,
                                                                                  const float*, float*, long long);
template __global__ void specadapt::cuda::block_residual_mass_kernel<256, __nv_bfloat16>(
    const __nv_bfloat16*, const __nv_bfloat16*, const float*, float*, long long);
template __global__ void specadapt::cuda::chain_verify_kernel<float>(const float*, const float*,
                                                                      specadapt::cuda::VerifyArgs);
template __global__ void specadapt::cuda::chain_verify_kernel<__nv_bfloat16>(const __nv_bfloat16*,
                                                                              const __nv_bfloat16*,
                                                                              specadapt::cuda::VerifyArgs);
template __global__ void specadapt::cuda::block_verify_kernel<float, 64>(const float*, const float*,
                                                                          specadapt::cuda::VerifyArgs);
template __global__ void specadapt::cuda::block_verify_kernel<__nv_bfloat16, 64>(const __nv_bfloat16*,
                                                                                  const __nv_bfloat16*,
                                                                                  specadapt::cuda::VerifyArgs);
template __global__ void specadapt::cuda::irls_accumulate_kernel<128>(const double*, const double*, const long long*,
                                                                     const long long*, double*, long long, long long);
