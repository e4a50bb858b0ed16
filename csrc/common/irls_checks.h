// Argument checks of specadapt::irls_accumulate, shared by the CPU and CUDA bindings.
// features [B, K] and predictions [B, K] floating; accepted [B] and verified [B] integer; one device.
#pragma once
#include <ATen/ATen.h>

namespace specadapt {

inline void check_irls_args(const at::Tensor& features, const at::Tensor& predictions, const at::Tensor& accepted,
                            const at::Tensor& verified) {
  TORCH_CHECK(features.dim() == 2, "features must be [B, K], got ", features.sizes());
  TORCH_CHECK(predictions.sizes() == features.sizes(), "predictions must have the shape of features ",
              features.sizes(), ", got ", predictions.sizes());
  const int64_t B = features.size(0);
  TORCH_CHECK(accepted.dim() == 1 && accepted.size(0) == B, "accepted must be [B] = [", B, "], got ", accepted.sizes());
  TORCH_CHECK(verified.dim() == 1 && verified.size(0) == B, "verified must be [B] = [", B, "], got ", verified.sizes());
  TORCH_CHECK(features.is_floating_point() && predictions.is_floating_point(),
              "features and predictions must be floating tensors");
  TORCH_CHECK(!accepted.is_floating_point() && !verified.is_floating_point(),
              "accepted and verified must be integer tensors");
  TORCH_CHECK(predictions.device() == features.device() && accepted.device() == features.device() &&
                  verified.device() == features.device(),
              "irls_accumulate inputs must be on one device");
}

}  // namespace specadapt
