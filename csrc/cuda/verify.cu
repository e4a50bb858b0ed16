// Thin torch binding of the CUDA chain / block verification kernels in verify.cuh.
// No host synchronisation: token ids and coins are not range-checked on the device path (the CPU path and
// the Python reference do check them); a target row without mass, or a row of p or q that does not sum to 1
// (row_sum_tolerance in verify.cuh), yields -1 as the extra token and sets a bit of the caller's error flag
// (csrc/cuda/errors.cuh; specadapt.kernel_errors reads it on demand, never on this path).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include <tuple>

#include "../common/verify_checks.h"
#include "verify.cuh"

namespace specadapt {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxDrafts = 64;

template <bool kBlock>
std::tuple<at::Tensor, at::Tensor> verify_cuda(const at::Tensor& candidates, const at::Tensor& target_probs,
                                               const at::Tensor& draft_probs, const at::Tensor& uniforms,
                                               const at::Tensor& uniforms_final,
                                               const c10::optional<at::Tensor>& num_draft_tokens,
                                               const c10::optional<at::Tensor>& error_flag) {
  check_verify_args(candidates, target_probs, draft_probs, uniforms, uniforms_final, num_draft_tokens);
  const int64_t B = candidates.size(0), L = candidates.size(1) - 1, V = target_probs.size(2);
  TORCH_CHECK(L <= kMaxDrafts, "the CUDA kernels support at most ", kMaxDrafts, " draft tokens, got L = ", L);
  const c10::cuda::CUDAGuard guard(candidates.device());
  const auto cand = candidates.to(at::kLong).contiguous();
  const auto p = target_probs.contiguous();
  const auto q = draft_probs.contiguous();
  const auto u = uniforms.to(at::kDouble).contiguous();
  const auto uf = uniforms_final.to(at::kDouble).contiguous();
  at::Tensor n;
  if (num_draft_tokens.has_value()) n = num_draft_tokens->to(at::kLong).contiguous();
  auto opts = candidates.options().dtype(at::kInt);
  auto accept_len = at::zeros({B}, opts);
  auto output_tokens = at::full({B, L + 1}, -1, opts);
  auto error = error_flag_or_scratch(error_flag, candidates);  // read by specadapt.kernel_errors, not here
  if (B == 0) return {accept_len, output_tokens};
  const int64_t* cp = cand.data_ptr<int64_t>();
  const double* up = u.data_ptr<double>();
  const double* ufp = uf.data_ptr<double>();
  const int64_t* np = n.defined() ? n.data_ptr<int64_t>() : nullptr;
  int32_t* ap = accept_len.data_ptr<int32_t>();
  int32_t* tp = output_tokens.data_ptr<int32_t>();
  int32_t* ep = error.data_ptr<int32_t>();
#define SPECADAPT_VERIFY_ARGS cp, up, ufp, np, ap, tp, ep, L, V
  auto stream = at::cuda::getCurrentCUDAStream();
  if (p.scalar_type() == at::kFloat) {
    const float* pp = p.data_ptr<float>();
    const float* qp = q.data_ptr<float>();
    if (kBlock) {
      cuda::block_verify_kernel<float, kMaxDrafts><<<B, kThreads, 0, stream>>>(pp, qp, SPECADAPT_VERIFY_ARGS);
    } else {
      cuda::chain_verify_kernel<float><<<B, kThreads, 0, stream>>>(pp, qp, SPECADAPT_VERIFY_ARGS);
    }
  } else {
    const auto* pp = reinterpret_cast<const __nv_bfloat16*>(p.data_ptr<at::BFloat16>());
    const auto* qp = reinterpret_cast<const __nv_bfloat16*>(q.data_ptr<at::BFloat16>());
    if (kBlock) {
      cuda::block_verify_kernel<__nv_bfloat16, kMaxDrafts><<<B, kThreads, 0, stream>>>(pp, qp, SPECADAPT_VERIFY_ARGS);
    } else {
      cuda::chain_verify_kernel<__nv_bfloat16><<<B, kThreads, 0, stream>>>(pp, qp, SPECADAPT_VERIFY_ARGS);
    }
  }
#undef SPECADAPT_VERIFY_ARGS
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {accept_len, output_tokens};
}

}  // namespace

TORCH_LIBRARY_IMPL(specadapt, CUDA, m) {
  m.impl("chain_verify", &verify_cuda<false>);
  m.impl("block_verify", &verify_cuda<true>);
}

}  // namespace specadapt
