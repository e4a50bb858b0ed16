// Compile-only check of the torch-free CUDA headers (make cuda-compile-check): instantiates every kernel
// template for the dtypes the bindings use, with no torch include, as NVRTC would see them.
#include <cuda_bf16.h>

#include "block_residual.cuh"

template __global__ void specadapt::cuda::block_residual_mass_kernel<256, float>(const float*, const float*,
                                                                                  const float*, float*, long long);
template __global__ void specadapt::cuda::block_residual_mass_kernel<256, __nv_bfloat16>(
    const __nv_bfloat16*, const __nv_bfloat16*, const float*, float*, long long);
