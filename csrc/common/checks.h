// Argument checks shared by the CPU and CUDA bindings: every message names the argument.
#pragma once
#include <ATen/ATen.h>

namespace specadapt {

inline void check_residual_mass_args(const at::Tensor& target_probs, const at::Tensor& draft_probs,
                                     const at::Tensor& weights) {
  TORCH_CHECK(target_probs.dim() == 2, "target_probs must be [N, V], got ", target_probs.sizes());
  TORCH_CHECK(draft_probs.sizes() == target_probs.sizes(), "draft_probs must have the shape of target_probs ",
              target_probs.sizes(), ", got ", draft_probs.sizes());
  TORCH_CHECK(weights.dim() == 1 && weights.size(0) == target_probs.size(0), "weights must be [N] = [",
              target_probs.size(0), "], got ", weights.sizes());
  TORCH_CHECK(target_probs.scalar_type() == draft_probs.scalar_type(),
              "draft_probs dtype must match target_probs dtype ", target_probs.scalar_type(), ", got ",
              draft_probs.scalar_type());
  TORCH_CHECK(target_probs.scalar_type() == at::kFloat || target_probs.scalar_type() == at::kBFloat16,
              "target_probs must be float32 or bfloat16, got ", target_probs.scalar_type());
  TORCH_CHECK(weights.scalar_type() == at::kFloat, "weights must be float32, got ", weights.scalar_type());
  TORCH_CHECK(draft_probs.device() == target_probs.device() && weights.device() == target_probs.device(),
              "target_probs, draft_probs and weights must be on one device");
}

}  // namespace specadapt
