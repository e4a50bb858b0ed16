// Thin torch binding of the CUDA residual reduction in block_residual.cuh.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include "../common/checks.h"
#include "block_residual.cuh"

namespace specadapt {
namespace {

constexpr int kThreads = 256;

at::Tensor block_residual_mass_cuda(const at::Tensor& target_probs, const at::Tensor& draft_probs,
                                    const at::Tensor& weights) {
  check_residual_mass_args(target_probs, draft_probs, weights);
  const c10::cuda::CUDAGuard guard(target_probs.device());
  const auto p = target_probs.contiguous();
  const auto q = draft_probs.contiguous();
  const auto w = weights.contiguous();
  auto out = at::empty({p.size(0)}, p.options().dtype(at::kFloat));
  if (p.size(0) == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  if (p.scalar_type() == at::kFloat) {
    cuda::block_residual_mass_kernel<kThreads, float><<<p.size(0), kThreads, 0, stream>>>(
        p.data_ptr<float>(), q.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), p.size(1));
  } else {
    cuda::block_residual_mass_kernel<kThreads, __nv_bfloat16><<<p.size(0), kThreads, 0, stream>>>(
        reinterpret_cast<const __nv_bfloat16*>(p.data_ptr<at::BFloat16>()),
        reinterpret_cast<const __nv_bfloat16*>(q.data_ptr<at::BFloat16>()), w.data_ptr<float>(),
        out.data_ptr<float>(), p.size(1));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(specadapt, CUDA, m) { m.impl("block_residual_mass", &block_residual_mass_cuda); }

}  // namespace specadapt
