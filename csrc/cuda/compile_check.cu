// Compile-only check of the torch-free CUDA headers (make cuda-compile-check, tests/test_kernels.py):
// instantiates every kernel template for the dtypes the bindings use, with no torch include, as NVRTC would.
#include <cuda_bf16.h>

#include "block_residual.cuh"
#include "gbv.cuh"
#include "irls.cuh"
#include "verify.cuh"

template __global__ void specadapt::cuda::block_residual_mass_kernel<256, float>(const float*, const float*,
                                                                                  const float*, float*, long long);
template __global__ void specadapt::cuda::block_residual_mass_kernel<256, __nv_bfloat16>(
    const __nv_bfloat16*, const __nv_bfloat16*, const float*, float*, long long);
#define SPECADAPT_VERIFY_INSTANTIATE(T)                                                                       \
  template __global__ void specadapt::cuda::chain_verify_kernel<T>(const T*, const T*, const int64_t*, const double*, \
                                                                   const double*, const int64_t*, int32_t*, int32_t*, \
                                                                   int32_t*, int64_t, int64_t);                      \
  template __global__ void specadapt::cuda::block_verify_kernel<T, 64>(const T*, const T*, const int64_t*,           \
                                                                       const double*, const double*, const int64_t*, \
                                                                       int32_t*, int32_t*, int32_t*, int64_t, int64_t);
SPECADAPT_VERIFY_INSTANTIATE(float)
SPECADAPT_VERIFY_INSTANTIATE(__nv_bfloat16)
template __global__ void specadapt::cuda::irls_accumulate_kernel<128>(const double*, const double*, const long long*,
                                                                     const long long*, double*, long long, long long);
#define SPECADAPT_GBV_INSTANTIATE(T)                                                                          \
  template __global__ void specadapt::cuda::gbv_walk_kernel<T, 32>(const T*, const T*, const int64_t*, int32_t*,    \
                                                                   int32_t*, int32_t*, int64_t, int64_t, int64_t);\
  template __global__ void specadapt::cuda::gbv_fill_keys_kernel<T>(const T*, const T*, const int32_t*,            \
                                                                    const int32_t*, int64_t, double*, int32_t*,  \
                                                                    int64_t, int64_t, int64_t);                  \
  template __global__ void specadapt::cuda::gbv_depth_kernel<T>(const T*, const T*, const int64_t*, const int32_t*, \
                                                                const int32_t*, const int32_t*, double*, double*, \
                                                                double*,                                         \
                                                                double*, int64_t, int64_t, int64_t, int64_t);    \
  template __global__ void specadapt::cuda::gbv_sample_kernel<T>(const T*, const T*, const int32_t*,               \
                                                                 const int32_t*, const int32_t*, const int32_t*, \
                                                                 double*,                                        \
                                                                 const double*, const double*, const double*,    \
                                                                 int32_t*, int32_t*, int64_t, int64_t, int64_t);
SPECADAPT_GBV_INSTANTIATE(float)
SPECADAPT_GBV_INSTANTIATE(__nv_bfloat16)
