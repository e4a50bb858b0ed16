// Thin torch binding of the CUDA IRLS-accumulate kernel in irls.cuh (no host synchronisation).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../common/irls_checks.h"
#include "irls.cuh"

namespace specadapt {
namespace {

constexpr int kThreads = 128;

at::Tensor irls_accumulate_cuda(const at::Tensor& features, const at::Tensor& predictions, const at::Tensor& accepted,
                                const at::Tensor& verified) {
  check_irls_args(features, predictions, accepted, verified);
  const int64_t B = features.size(0), K = features.size(1);
  const c10::cuda::CUDAGuard guard(features.device());
  const auto f = features.to(at::kDouble).contiguous();
  const auto p = predictions.to(at::kDouble).contiguous();
  const auto acc = accepted.to(at::kLong).contiguous();
  const auto ver = verified.to(at::kLong).contiguous();
  auto out = at::zeros({K, 6}, features.options().dtype(at::kDouble));
  if (K == 0 || B == 0) return out;
  cuda::irls_accumulate_kernel<kThreads><<<K, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      f.data_ptr<double>(), p.data_ptr<double>(), reinterpret_cast<const long long*>(acc.data_ptr<int64_t>()),
      reinterpret_cast<const long long*>(ver.data_ptr<int64_t>()), out.data_ptr<double>(), B, K);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(specadapt, CUDA, m) { m.impl("irls_accumulate", &irls_accumulate_cuda); }

}  // namespace specadapt
