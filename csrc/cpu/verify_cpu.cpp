// Fused CPU kernels of the single-path verification rules (docs/design/specs/verification.md sections 1-2):
//   specadapt::chain_verify  token-level rejection sampling (Leviathan et al. 2023)
//   specadapt::block_verify  block verification (Sun et al., arXiv 2403.10444)
// One pass over p and q per verified position, requests in parallel (at::parallel_for), no [B, L, V] temporary.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "../common/verify_checks.h"
#include "verify_common.h"

namespace specadapt {
namespace cpu {
namespace {

struct Views {
  at::Tensor cand, p, q, u, uf, n;
  int64_t B, L, V;
};

// Host-side validation of ids (slot 0 and the live drafts; padding past num_draft_tokens is never read) and coins
// (cheap: B * L values), and contiguous float64 copies of the coins.
Views prepare(const at::Tensor& candidates, const at::Tensor& target_probs, const at::Tensor& draft_probs,
              const at::Tensor& uniforms, const at::Tensor& uniforms_final,
              const c10::optional<at::Tensor>& num_draft_tokens) {
  check_verify_args(candidates, target_probs, draft_probs, uniforms, uniforms_final, num_draft_tokens);
  Views v;
  v.B = candidates.size(0);
  v.L = candidates.size(1) - 1;
  v.V = target_probs.size(2);
  v.cand = candidates.to(at::kLong).contiguous();
  v.p = target_probs.contiguous();
  v.q = draft_probs.contiguous();
  v.u = uniforms.to(at::kDouble).contiguous();
  v.uf = uniforms_final.to(at::kDouble).contiguous();
  v.n = num_draft_tokens.has_value() ? num_draft_tokens->to(at::kLong).contiguous()
                                     : at::full({v.B}, v.L, candidates.options().dtype(at::kLong));
  const int64_t* n = v.n.data_ptr<int64_t>();
  const int64_t* c = v.cand.data_ptr<int64_t>();
  const double* u = v.u.data_ptr<double>();
  const double* uf = v.uf.data_ptr<double>();
  for (int64_t b = 0; b < v.B; ++b) {
    TORCH_CHECK(n[b] >= 0 && n[b] <= v.L, "num_draft_tokens must lie in [0, L] = [0, ", v.L, "]");
    TORCH_CHECK(uf[b] >= 0.0 && uf[b] < 1.0, "uniforms_final must lie in [0, 1)");
    const int64_t last = c[b * (v.L + 1)];
    TORCH_CHECK(last >= 0 && last < v.V, "candidates holds token ids outside [0, V) = [0, ", v.V,
                ") in slot 0 (the last committed token)");
    for (int64_t i = 0; i < v.L; ++i) {
      TORCH_CHECK(u[b * v.L + i] >= 0.0 && u[b * v.L + i] < 1.0, "uniforms must lie in [0, 1)");
      if (i < n[b]) {
        const int64_t x = c[b * (v.L + 1) + i + 1];
        TORCH_CHECK(x >= 0 && x < v.V, "candidates holds token ids outside [0, V) = [0, ", v.V, ") among the drafts");
      }
    }
  }
  return v;
}

std::tuple<at::Tensor, at::Tensor> make_outputs(const Views& v) {
  auto opts = v.cand.options().dtype(at::kInt);
  return {at::zeros({v.B}, opts), at::full({v.B, v.L + 1}, -1, opts)};
}

template <typename scalar_t>
void chain_request(const Views& v, int64_t b, int32_t* accept_out, int32_t* tokens_out) {
  const int64_t L = v.L, V = v.V, n = v.n.data_ptr<int64_t>()[b];
  const int64_t* cand = v.cand.data_ptr<int64_t>() + b * (L + 1);
  const scalar_t* p = v.p.data_ptr<scalar_t>() + b * (L + 1) * V;
  const scalar_t* q = v.q.data_ptr<scalar_t>() + b * L * V;
  const double* u = v.u.data_ptr<double>() + b * L;
  // rows the output can depend on: p rows 0..n, q rows 0..n-1 (chain reads only p(x), q(x) of accepted rows, so
  // this is a pass of its own; rows past n are padding and never read)
  for (int64_t i = 0; i <= n; ++i) {
    check_row_sum<scalar_t>(row_mass(p + i * V, V), "target_probs", b, i);
    if (i < n) check_row_sum<scalar_t>(row_mass(q + i * V, V), "draft_probs", b, i);
  }
  int64_t tau = 0;
  while (tau < n) {
    const int64_t x = cand[tau + 1];
    const double px = clean(p[tau * V + x]), qx = clean(q[tau * V + x]);
    if (!(u[tau] * qx < px)) break;  // accept iff u * q < p (q = 0 accepts iff p > 0)
    ++tau;
  }
  int64_t extra;
  if (tau < n) {
    extra = sample_residual(p + tau * V, q + tau * V, 1.0, v.uf.data_ptr<double>()[b], V);
  } else {
    extra = sample_residual<scalar_t, scalar_t>(p + tau * V, nullptr, 1.0, v.uf.data_ptr<double>()[b], V);
  }
  TORCH_CHECK(extra >= 0, "target_probs has a row with zero total mass: nothing can be sampled");
  accept_out[b] = static_cast<int32_t>(tau);
  for (int64_t i = 0; i < tau; ++i) tokens_out[b * (L + 1) + i] = static_cast<int32_t>(cand[i + 1]);
  tokens_out[b * (L + 1) + tau] = static_cast<int32_t>(extra);
}

template <typename scalar_t>
void block_request(const Views& v, int64_t b, int32_t* accept_out, int32_t* tokens_out) {
  const int64_t L = v.L, V = v.V, n = v.n.data_ptr<int64_t>()[b];
  const int64_t* cand = v.cand.data_ptr<int64_t>() + b * (L + 1);
  const scalar_t* p = v.p.data_ptr<scalar_t>() + b * (L + 1) * V;
  const scalar_t* q = v.q.data_ptr<scalar_t>() + b * L * V;
  // row sums: p and q rows 1..n-1 come from the Z_i pass of block_on_path; rows p_0, q_0 and p_n read here
  std::vector<double> sums(static_cast<size_t>(2 * n + 1), 1.0);
  sums[0] = row_mass(p, V);
  sums[n] = row_mass(p + n * V, V);
  if (n > 0) sums[n + 1] = row_mass(q, V);
  int64_t tau = 0;
  const int64_t extra = block_on_path(cand + 1, p, q, v.u.data_ptr<double>() + b * L, v.uf.data_ptr<double>()[b], n,
                                      V, &tau, sums.data());
  for (int64_t i = 0; i <= n; ++i) check_row_sum<scalar_t>(sums[i], "target_probs", b, i);
  for (int64_t i = 0; i < n; ++i) check_row_sum<scalar_t>(sums[n + 1 + i], "draft_probs", b, i);
  TORCH_CHECK(extra >= 0, "target_probs has a row with zero total mass: nothing can be sampled");
  accept_out[b] = static_cast<int32_t>(tau);
  for (int64_t i = 0; i < tau; ++i) tokens_out[b * (L + 1) + i] = static_cast<int32_t>(cand[i + 1]);
  tokens_out[b * (L + 1) + tau] = static_cast<int32_t>(extra);
}

template <bool kBlock>
std::tuple<at::Tensor, at::Tensor> verify_cpu(const at::Tensor& candidates, const at::Tensor& target_probs,
                                              const at::Tensor& draft_probs, const at::Tensor& uniforms,
                                              const at::Tensor& uniforms_final,
                                              const c10::optional<at::Tensor>& num_draft_tokens,
                                              const c10::optional<at::Tensor>& /*error: the CPU path raises*/) {
  const Views v = prepare(candidates, target_probs, draft_probs, uniforms, uniforms_final, num_draft_tokens);
  auto [accept_len, output_tokens] = make_outputs(v);
  int32_t* acc = accept_len.data_ptr<int32_t>();
  int32_t* tok = output_tokens.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, v.p.scalar_type(), "specadapt_verify_cpu", [&] {
    at::parallel_for(0, v.B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        if constexpr (kBlock) {
          block_request<scalar_t>(v, b, acc, tok);
        } else {
          chain_request<scalar_t>(v, b, acc, tok);
        }
      }
    });
  });
  return {accept_len, output_tokens};
}

}  // namespace

TORCH_LIBRARY_IMPL(specadapt, CPU, m) {
  m.impl("chain_verify", &verify_cpu<false>);
  m.impl("block_verify", &verify_cpu<true>);
}

}  // namespace cpu
}  // namespace specadapt
