// CPU implementation of specadapt::block_residual_mass: one pass over p and q per row, rows in parallel,
// float32 accumulation, no temporary [N, V] tensor.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include "../common/checks.h"

namespace specadapt {
namespace {

template <typename scalar_t>
void residual_mass_rows(const scalar_t* p, const scalar_t* q, const float* w, float* out, int64_t begin,
                        int64_t end, int64_t vocab) {
  for (int64_t n = begin; n < end; ++n) {
    const scalar_t* prow = p + n * vocab;
    const scalar_t* qrow = q + n * vocab;
    const float weight = w[n];
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t v = 0; v < vocab; ++v) {
      const float d = weight * static_cast<float>(prow[v]) - static_cast<float>(qrow[v]);
      acc += d > 0.f ? d : 0.f;
    }
    out[n] = acc;
  }
}

at::Tensor block_residual_mass_cpu(const at::Tensor& target_probs, const at::Tensor& draft_probs,
                                   const at::Tensor& weights) {
  check_residual_mass_args(target_probs, draft_probs, weights);
  const auto p = target_probs.contiguous();
  const auto q = draft_probs.contiguous();
  const auto w = weights.contiguous();
  const int64_t rows = p.size(0);
  const int64_t vocab = p.size(1);
  auto out = at::empty({rows}, p.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.scalar_type(), "block_residual_mass_cpu", [&] {
    const scalar_t* pp = p.data_ptr<scalar_t>();
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const float* wp = w.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      residual_mass_rows<scalar_t>(pp, qp, wp, op, begin, end, vocab);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(specadapt, CPU, m) { m.impl("block_residual_mass", &block_residual_mass_cpu); }

}  // namespace specadapt
