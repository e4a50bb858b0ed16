// Thin torch binding of the CUDA IRLS-accumulate kernel in irls.cuh (no host synchronisation).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "irls.cuh"

namespace specadapt {
namespace {

constexpr int kThreads = 128;

at::Tensor irls_accumulate_cuda(const at::Tensor& features, const at::Tensor& predictions, const at::Tensor& accepted,
                                const at::Tensor& verified) {
  TORCH_CHECK(features.dim() == 2, "features must be [B, K], got ", features.sizes());
  TORCH_CHECK(predictions.sizes() == features.sizes(), "predictions must have the shape of features ",
              features.sizes(), ", got ", predictions.sizes());
  const int64_t B = features.size(0), K = features.size(1);
  TORCH_CHECK(accepted.dim() == 1 && accepted.size(0) == B, "accepted must be [B] = [", B, "], got ", accepted.sizes());
  TORCH_CHECK(verified.dim() == 1 && verified.size(0) == B, "verified must be [B] = [", B, "], got ", verified.sizes());
  TORCH_CHECK(features.is_floating_point() && predictions.is_floating_point(),
              "features and predictions must be floating tensors");
  TORCH_CHECK(!accepted.is_floating_point() && !verified.is_floating_point(),
              "accepted and verified must be integer tensors");
  TORCH_CHECK(predictions.device() == features.device() && accepted.device() == features.device() &&
                  verified.device() == features.device(),
              "irls_accumulate inputs must be on one device");
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
