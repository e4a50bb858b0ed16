// Fused CPU kernel of greedy multi-path block verification, GBV (Thomas & Pal, arXiv 2602.16961;
// docs/design/specs/verification.md section 3). Per request: the walk down the tree of K i.i.d. paths ranks the vocabulary
// by the key (p/q, token id) ascending (a sort of q's support per node; ratios in double order float32/bfloat16
// inputs exactly), builds q_G along the reached path, then runs block verification with q_G in place of q.
// Requests run in parallel; each thread holds O(L * V) doubles of scratch, never a [B, L, V] tensor.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

#include "../common/verify_checks.h"
#include "verify_common.h"

namespace specadapt {
namespace cpu {
namespace {

// S_K(a, b) = sum_{i=0}^{K-1} a^i b^(K-1-i)
inline double power_sum(double a, double b, int64_t K) {
  double total = 0.0;
  for (int64_t i = 0; i < K; ++i) total += std::pow(a, static_cast<double>(i)) * std::pow(b, static_cast<double>(K - 1 - i));
  return total;
}

template <typename scalar_t>
void gbv_request(int64_t b, int64_t K, int64_t L, int64_t V, const int64_t* cand_all, const scalar_t* p_all,
                 const scalar_t* q_all, const double* u_all, const double* uf_all, int32_t* acc, int32_t* tok,
                 int32_t* chosen_out) {
  const int64_t* cand = cand_all + b * K * (L + 1);
  const scalar_t* p = p_all + b * K * (L + 1) * V;
  const scalar_t* q = q_all + b * K * L * V;
  std::vector<double> q_g(static_cast<size_t>(L * V));
  std::vector<double> ratio(V), cum(V);
  std::vector<int64_t> order, rank(V);
  order.reserve(V);
  std::vector<char> consistent(K, 1);
  double r = 0.0;
  for (int64_t d = 0; d < L; ++d) {
    int64_t k0 = 0;
    while (!consistent[k0]) ++k0;
    const scalar_t* prow = p + (k0 * (L + 1) + d) * V;
    const scalar_t* qrow = q + (k0 * L + d) * V;
    // Only the support of q needs ranking: a token with q = 0 adds no mass to any c_u and gets q_G = 0, and every
    // drafted child has q > 0 (checked below). Under top-k / top-p drafting the support is a small part of V.
    order.clear();
    for (int64_t v = 0; v < V; ++v) {
      const double qv = clean(qrow[v]);
      if (qv > 0.0) {
        ratio[v] = clean(prow[v]) / qv;
        order.push_back(v);
      }
    }
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t c) {
      return ratio[a] < ratio[c] || (ratio[a] == ratio[c] && a < c);
    });
    double run = 0.0;
    for (size_t j = 0; j < order.size(); ++j) {
      run += clean(qrow[order[j]]);
      cum[order[j]] = run;
      rank[order[j]] = static_cast<int64_t>(j);
    }
    check_row_sum<scalar_t>(run, "draft_probs", b, k0, d);  // the walked node's q mass, from the ranking pass
    const double denom = power_sum(r + 1.0, r, K);
    double* g = q_g.data() + d * V;
    for (int64_t v = 0; v < V; ++v) {
      const double qv = clean(qrow[v]);
      g[v] = qv > 0.0 ? qv * power_sum(r + cum[v], r + cum[v] - qv, K) / denom : 0.0;
    }
    int64_t child = -1;
    for (int64_t k = 0; k < K; ++k) {
      if (!consistent[k]) continue;
      const int64_t x = cand[k * (L + 1) + d + 1];
      // q = 0 ranks above every q > 0 token (ratio +inf), so such a child would be the one walked: an error.
      TORCH_CHECK(clean(qrow[x]) > 0.0, "draft_probs gives zero probability to drafted token ", x, " at depth ", d,
                  ": GBV paths must be sampled from q");
      if (child < 0 || rank[x] > rank[child]) child = x;
    }
    const double qt = clean(qrow[child]);
    r = (r + cum[child] - qt) / qt;
    for (int64_t k = 0; k < K; ++k) consistent[k] = consistent[k] && cand[k * (L + 1) + d + 1] == child;
  }
  int64_t chosen = 0;
  while (!consistent[chosen]) ++chosen;
  int64_t tau = 0;
  const int64_t* drafts = cand + chosen * (L + 1) + 1;
  const scalar_t* p_path = p + chosen * (L + 1) * V;
  // the chosen path's p rows: 1..L-1 from the Z_i pass of block_on_path, rows 0 and L read here (q_G's masses,
  // written to the second half, are not inputs and go unchecked)
  std::vector<double> sums(static_cast<size_t>(2 * L + 1), 1.0);
  sums[0] = row_mass(p_path, V);
  sums[L] = row_mass(p_path + L * V, V);
  const int64_t extra = block_on_path(drafts, p_path, q_g.data(), u_all + b * L, uf_all[b], L, V, &tau, sums.data());
  for (int64_t i = 0; i <= L; ++i) check_row_sum<scalar_t>(sums[i], "target_probs", b, chosen, i);
  TORCH_CHECK(extra >= 0, "target_probs has a row with zero total mass: nothing can be sampled");
  acc[b] = static_cast<int32_t>(tau);
  chosen_out[b] = static_cast<int32_t>(chosen);
  for (int64_t i = 0; i < tau; ++i) tok[b * (L + 1) + i] = static_cast<int32_t>(drafts[i]);
  tok[b * (L + 1) + tau] = static_cast<int32_t>(extra);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gbv_verify_cpu(const at::Tensor& candidates,
                                                              const at::Tensor& target_probs,
                                                              const at::Tensor& draft_probs,
                                                              const at::Tensor& uniforms,
                                                              const at::Tensor& uniforms_final,
                                                              const c10::optional<at::Tensor>& /*error: raises*/) {
  check_gbv_args(candidates, target_probs, draft_probs, uniforms, uniforms_final);
  const int64_t B = candidates.size(0), K = candidates.size(1), L = candidates.size(2) - 1, V = target_probs.size(3);
  const auto cand = candidates.to(at::kLong).contiguous();
  const auto p = target_probs.contiguous();
  const auto q = draft_probs.contiguous();
  const auto u = uniforms.to(at::kDouble).contiguous();
  const auto uf = uniforms_final.to(at::kDouble).contiguous();
  const int64_t* c = cand.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * K * (L + 1); ++i) {  // slot 0 (the last committed token) and every draft
    TORCH_CHECK(c[i] >= 0 && c[i] < V, "candidates holds token ids outside [0, V) = [0, ", V, ")",
                i % (L + 1) == 0 ? " in slot 0 (the last committed token)" : " among the drafts");
  }
  TORCH_CHECK(((u >= 0) & (u < 1)).all().item<bool>(), "uniforms must lie in [0, 1)");
  TORCH_CHECK(((uf >= 0) & (uf < 1)).all().item<bool>(), "uniforms_final must lie in [0, 1)");
  auto opts = candidates.options().dtype(at::kInt);
  auto accept_len = at::zeros({B}, opts);
  auto output_tokens = at::full({B, L + 1}, -1, opts);
  auto chosen_path = at::zeros({B}, opts);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, p.scalar_type(), "gbv_verify_cpu", [&] {
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        gbv_request<scalar_t>(b, K, L, V, c, p.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), u.data_ptr<double>(),
                              uf.data_ptr<double>(), accept_len.data_ptr<int32_t>(), output_tokens.data_ptr<int32_t>(),
                              chosen_path.data_ptr<int32_t>());
      }
    });
  });
  return {accept_len, output_tokens, chosen_path};
}

}  // namespace

TORCH_LIBRARY_IMPL(specadapt, CPU, m) { m.impl("gbv_verify", &gbv_verify_cpu); }

}  // namespace cpu
}  // namespace specadapt
