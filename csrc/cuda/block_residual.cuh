// Block-verification residual reduction as a plain CUDA kernel (no torch dependency), so the same header
// builds with nvcc through setup.py and with NVRTC (CuPy) at run time.
//   out[n] = sum_v max(weights[n] * target_probs[n, v] - draft_probs[n, v], 0)
// One thread block per row; float32 accumulation; block-wide reduction through shared memory.
#pragma once

#include <cuda_bf16.h>

namespace specadapt {
namespace cuda {

// Explicit conversions: torch builds with __CUDA_NO_BFLOAT16_CONVERSIONS__, so no implicit bf16 -> float.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <int kBlockThreads, typename T>
__global__ void block_residual_mass_kernel(const T* __restrict__ target_probs, const T* __restrict__ draft_probs,
                                           const float* __restrict__ weights, float* __restrict__ out,
                                           long long vocab) {
  const long long row = blockIdx.x;
  const T* p = target_probs + row * vocab;
  const T* q = draft_probs + row * vocab;
  const float w = weights[row];
  float acc = 0.f;
  for (long long v = threadIdx.x; v < vocab; v += kBlockThreads) {
    const float d = w * to_float(p[v]) - to_float(q[v]);
    acc += d > 0.f ? d : 0.f;
  }
  // Warp reduction, then one value per warp through shared memory.
  for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  __shared__ float warp_sums[kBlockThreads / 32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < kBlockThreads / 32 ? warp_sums[lane] : 0.f;
    for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, offset);
    if (lane == 0) out[row] = acc;
  }
}

}  // namespace cuda
}  // namespace specadapt
