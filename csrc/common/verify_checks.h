// Argument checks of the verification ops (chain / block / GBV), shared by CPU and CUDA bindings.
// Every message names the argument, as the Python reference's do.
#pragma once
#include <ATen/ATen.h>

namespace specadapt {

// Single-path contract: candidates [B, L+1] int64/int32, target_probs [B, L+1, V], draft_probs [B, L, V]
// (float32 or bfloat16, same dtype), uniforms [B, L] and uniforms_final [B] (float32 or float64),
// optional num_draft_tokens [B] int.
inline void check_verify_args(const at::Tensor& candidates, const at::Tensor& target_probs,
                              const at::Tensor& draft_probs, const at::Tensor& uniforms,
                              const at::Tensor& uniforms_final, const c10::optional<at::Tensor>& num_draft_tokens) {
  TORCH_CHECK(candidates.dim() == 2, "candidates must be [B, L+1], got ", candidates.sizes());
  TORCH_CHECK(candidates.scalar_type() == at::kLong || candidates.scalar_type() == at::kInt,
              "candidates must be int64 or int32, got ", candidates.scalar_type());
  const int64_t B = candidates.size(0), slots = candidates.size(1), L = slots - 1;
  TORCH_CHECK(slots >= 1, "candidates must have at least one slot");
  TORCH_CHECK(target_probs.dim() == 3 && target_probs.size(0) == B && target_probs.size(1) == slots,
              "target_probs must be [B, L+1, V] = [", B, ", ", slots, ", V] (B, L+1 from candidates), got ",
              target_probs.sizes());
  const int64_t V = target_probs.size(2);
  TORCH_CHECK(V >= 1, "target_probs must have a vocabulary of V >= 1 entries, got ", target_probs.sizes());
  TORCH_CHECK(draft_probs.dim() == 3 && draft_probs.size(0) == B && draft_probs.size(1) == L && draft_probs.size(2) == V,
              "draft_probs must be [B, L, V] = [", B, ", ", L, ", ", V, "], got ", draft_probs.sizes());
  TORCH_CHECK(target_probs.scalar_type() == at::kFloat || target_probs.scalar_type() == at::kBFloat16,
              "target_probs must be float32 or bfloat16, got ", target_probs.scalar_type());
  TORCH_CHECK(draft_probs.scalar_type() == target_probs.scalar_type(), "draft_probs dtype must match target_probs (",
              target_probs.scalar_type(), "), got ", draft_probs.scalar_type());
  TORCH_CHECK(uniforms.dim() == 2 && uniforms.size(0) == B && uniforms.size(1) == L, "uniforms must be [B, L] = [", B,
              ", ", L, "], got ", uniforms.sizes());
  TORCH_CHECK(uniforms_final.dim() == 1 && uniforms_final.size(0) == B, "uniforms_final must be [B] = [", B, "], got ",
              uniforms_final.sizes());
  for (const auto* t : {&uniforms, &uniforms_final}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kDouble,
                (t == &uniforms ? "uniforms" : "uniforms_final"), " must be float32 or float64, got ", t->scalar_type());
  }
  if (num_draft_tokens.has_value()) {
    TORCH_CHECK(num_draft_tokens->dim() == 1 && num_draft_tokens->size(0) == B, "num_draft_tokens must be [B] = [", B,
                "], got ", num_draft_tokens->sizes());
    TORCH_CHECK(!at::isFloatingType(num_draft_tokens->scalar_type()), "num_draft_tokens must be an integer tensor");
    TORCH_CHECK(num_draft_tokens->device() == candidates.device(), "num_draft_tokens must be on the device of candidates");
  }
  const auto dev = candidates.device();
  TORCH_CHECK(target_probs.device() == dev && draft_probs.device() == dev && uniforms.device() == dev &&
                  uniforms_final.device() == dev,
              "candidates, target_probs, draft_probs, uniforms and uniforms_final must be on one device");
}

// Multi-path (GBV) contract: candidates [B, K, L+1], target_probs [B, K, L+1, V], draft_probs [B, K, L, V],
// uniforms [B, L], uniforms_final [B].
inline void check_gbv_args(const at::Tensor& candidates, const at::Tensor& target_probs, const at::Tensor& draft_probs,
                    const at::Tensor& uniforms, const at::Tensor& uniforms_final) {
  TORCH_CHECK(candidates.dim() == 3, "candidates must be [B, K, L+1] for GBV, got ", candidates.sizes());
  TORCH_CHECK(candidates.scalar_type() == at::kLong || candidates.scalar_type() == at::kInt,
              "candidates must be int64 or int32, got ", candidates.scalar_type());
  const int64_t B = candidates.size(0), K = candidates.size(1), slots = candidates.size(2), L = slots - 1;
  TORCH_CHECK(K >= 1 && slots >= 1, "candidates must hold K >= 1 paths of L+1 >= 1 slots");
  TORCH_CHECK(target_probs.dim() == 4 && target_probs.size(0) == B && target_probs.size(1) == K &&
                  target_probs.size(2) == slots,
              "target_probs must be [B, K, L+1, V] = [", B, ", ", K, ", ", slots, ", V], got ", target_probs.sizes());
  const int64_t V = target_probs.size(3);
  TORCH_CHECK(V >= 1, "target_probs must have a vocabulary of V >= 1 entries, got ", target_probs.sizes());
  TORCH_CHECK(draft_probs.dim() == 4 && draft_probs.size(0) == B && draft_probs.size(1) == K &&
                  draft_probs.size(2) == L && draft_probs.size(3) == V,
              "draft_probs must be [B, K, L, V] = [", B, ", ", K, ", ", L, ", ", V, "], got ", draft_probs.sizes());
  TORCH_CHECK(target_probs.scalar_type() == at::kFloat || target_probs.scalar_type() == at::kBFloat16,
              "target_probs must be float32 or bfloat16, got ", target_probs.scalar_type());
  TORCH_CHECK(draft_probs.scalar_type() == target_probs.scalar_type(), "draft_probs dtype must match target_probs (",
              target_probs.scalar_type(), "), got ", draft_probs.scalar_type());
  TORCH_CHECK(uniforms.dim() == 2 && uniforms.size(0) == B && uniforms.size(1) == L, "uniforms must be [B, L] = [", B,
              ", ", L, "], got ", uniforms.sizes());
  TORCH_CHECK(uniforms_final.dim() == 1 && uniforms_final.size(0) == B, "uniforms_final must be [B] = [", B,
              "], got ", uniforms_final.sizes());
  TORCH_CHECK(uniforms.is_floating_point() && uniforms_final.is_floating_point(),
              "uniforms and uniforms_final must be floating tensors");
  const auto dev = candidates.device();
  TORCH_CHECK(target_probs.device() == dev && draft_probs.device() == dev && uniforms.device() == dev &&
                  uniforms_final.device() == dev,
              "candidates, target_probs, draft_probs, uniforms and uniforms_final must be on one device");
}

// The device error flag of a CUDA launch (csrc/cuda/errors.cuh): the caller's `error` ([>= 1] int32 on the device
// of `like`; the kernels OR bits into its first element) or, without one, a scratch flag nobody reads.
inline at::Tensor error_flag_or_scratch(const c10::optional<at::Tensor>& error, const at::Tensor& like) {
  if (error.has_value() && error->defined()) {
    TORCH_CHECK(error->scalar_type() == at::kInt && error->numel() >= 1,
                "error must be an int32 tensor with at least one element, got ", error->scalar_type(), " ",
                error->sizes());
    TORCH_CHECK(error->device() == like.device(), "error must be on ", like.device(), ", got ", error->device());
    return *error;
  }
  return at::zeros({1}, like.options().dtype(at::kInt));
}

}  // namespace specadapt
