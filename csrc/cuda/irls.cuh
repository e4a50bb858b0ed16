// CUDA kernel of specadapt::irls_accumulate (docs/design/specs/adaptive_verification.md section 4), torch-free so NVRTC can
// compile it too. One thread block per draft position k reduces over the batch: for every request b with
// k < verified[b] and k <= accepted[b] (labels up to and including the first rejection) and finite inputs,
//   w = p (1 - p), r = y - p:  a += w f^2, b += w f, c += w, g0 += r f, g1 += r, n += 1.
// Output [K, 6] double. Same arithmetic as the CPU kernel (double throughout); only the summation order of the
// block reduction differs.
#pragma once

namespace specadapt {
namespace cuda {

template <int kThreads>
__global__ void irls_accumulate_kernel(const double* __restrict__ features, const double* __restrict__ predictions,
                                       const long long* __restrict__ accepted, const long long* __restrict__ verified,
                                       double* __restrict__ out, long long B, long long K) {
  const long long k = blockIdx.x;
  double acc[6] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
  for (long long b = threadIdx.x; b < B; b += kThreads) {
    const long long last = min(verified[b] - 1, accepted[b]);
    if (k > last) continue;
    const double f = features[b * K + k], p = predictions[b * K + k];
    if (!isfinite(f) || !isfinite(p)) continue;
    const double y = k < accepted[b] ? 1.0 : 0.0;
    const double r = y - p, w = p * (1.0 - p);
    acc[0] += w * f * f;
    acc[1] += w * f;
    acc[2] += w;
    acc[3] += r * f;
    acc[4] += r;
    acc[5] += 1.0;
  }
  __shared__ double partial[6][kThreads];
  for (int j = 0; j < 6; ++j) partial[j][threadIdx.x] = acc[j];
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      for (int j = 0; j < 6; ++j) partial[j][threadIdx.x] += partial[j][threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x < 6) out[k * 6 + threadIdx.x] = partial[threadIdx.x][0];
}

}  // namespace cuda
}  // namespace specadapt
