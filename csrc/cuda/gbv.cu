// Thin torch binding of the CUDA GBV kernels in gbv.cuh: the per-depth ranking of the vocabulary is a CUB
// segmented radix sort (stable, one segment per request), everything else is in the header. No host
// synchronisation (token ids and coins are not range-checked on the device, as for chain / block; a walked row of
// p or q that does not sum to 1 gives -1 as the extra token, see gbv_sample_kernel; the error bits go to the
// caller's flag, csrc/cuda/errors.cuh).
// Workspace: O(B * V) doubles and ints per call, reused across the L + 1 depth passes.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cub/device/device_segmented_radix_sort.cuh>
#include <cuda_bf16.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <tuple>

#include "../common/verify_checks.h"
#include "gbv.cuh"

namespace specadapt {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxPaths = 32;

struct Workspace {
  at::Tensor keys_in, keys_out, ids_in, ids_out, offsets, cum, r, weights, residual_mass, node_path, sort_temp;
  size_t sort_temp_bytes = 0;
};

void segmented_sort(Workspace& w, int64_t B, int64_t V, cudaStream_t stream) {
  const auto num_items = B * V;
  C10_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairs(
      w.sort_temp.data_ptr(), w.sort_temp_bytes, w.keys_in.data_ptr<double>(), w.keys_out.data_ptr<double>(),
      w.ids_in.data_ptr<int32_t>(), w.ids_out.data_ptr<int32_t>(), num_items, B, w.offsets.data_ptr<int64_t>(),
      w.offsets.data_ptr<int64_t>() + 1, 0, static_cast<int>(sizeof(double) * 8), stream));
}

template <typename T>
void launch(const at::Tensor& cand, const at::Tensor& p, const at::Tensor& q, const at::Tensor& u,
            const at::Tensor& uf, at::Tensor& accept_len, at::Tensor& output_tokens, at::Tensor& chosen,
            at::Tensor& error, int64_t B, int64_t K, int64_t L, int64_t V) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto dopts = p.options().dtype(at::kDouble);
  const auto iopts = p.options().dtype(at::kInt);
  Workspace w;
  w.keys_in = at::empty({B, V}, dopts);
  w.keys_out = at::empty({B, V}, dopts);
  w.ids_in = at::empty({B, V}, iopts);
  w.ids_out = at::empty({B, V}, iopts);
  w.offsets = at::arange(0, (B + 1) * V, V, p.options().dtype(at::kLong));
  w.cum = at::empty({B, V}, dopts);
  w.r = at::empty({B, L + 1}, dopts);
  w.weights = at::empty({B, L + 1}, dopts);
  w.residual_mass = at::zeros({B, L}, dopts);
  w.node_path = at::zeros({B, std::max<int64_t>(L, 1)}, iopts);
  C10_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairs(
      nullptr, w.sort_temp_bytes, w.keys_in.data_ptr<double>(), w.keys_out.data_ptr<double>(),
      w.ids_in.data_ptr<int32_t>(), w.ids_out.data_ptr<int32_t>(), B * V, B, w.offsets.data_ptr<int64_t>(),
      w.offsets.data_ptr<int64_t>() + 1, 0, static_cast<int>(sizeof(double) * 8), stream));
  w.sort_temp = at::empty({static_cast<int64_t>(w.sort_temp_bytes) + 1}, p.options().dtype(at::kByte));

  const T* pp = reinterpret_cast<const T*>(p.data_ptr());
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const int64_t* c = cand.data_ptr<int64_t>();
  int32_t* chosen_ptr = chosen.data_ptr<int32_t>();
  int32_t* node_ptr = w.node_path.data_ptr<int32_t>();
  const dim3 fill_grid(static_cast<unsigned>(B), static_cast<unsigned>(std::min<int64_t>((V + kThreads - 1) / kThreads, 64)));

  cuda::gbv_walk_kernel<T, kMaxPaths><<<B, 32, 0, stream>>>(pp, qp, c, chosen_ptr, node_ptr, error.data_ptr<int32_t>(), K, L, V);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  for (int64_t d = 0; d < L; ++d) {
    cuda::gbv_fill_keys_kernel<T><<<fill_grid, kThreads, 0, stream>>>(
        pp, qp, node_ptr, nullptr, d, w.keys_in.data_ptr<double>(), w.ids_in.data_ptr<int32_t>(), K, L, V);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    segmented_sort(w, B, V, stream);
    cuda::gbv_depth_kernel<T><<<B, kThreads, 0, stream>>>(
        pp, qp, c, chosen_ptr, node_ptr, w.ids_out.data_ptr<int32_t>(), w.cum.data_ptr<double>(), w.r.data_ptr<double>(),
        w.weights.data_ptr<double>(), w.residual_mass.data_ptr<double>(), d, K, L, V);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (L == 0) {  // no depth pass ran: w_0 = 1, r_0 = 0
    w.weights.fill_(1.0);
    w.r.fill_(0.0);
  }
  cuda::gbv_accept_kernel<<<(B + 127) / 128, 128, 0, stream>>>(
      c, chosen_ptr, u.data_ptr<double>(), w.weights.data_ptr<double>(), w.residual_mass.data_ptr<double>(),
      accept_len.data_ptr<int32_t>(), output_tokens.data_ptr<int32_t>(), B, K, L);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (L > 0) {
    cuda::gbv_fill_keys_kernel<T><<<fill_grid, kThreads, 0, stream>>>(
        pp, qp, node_ptr, accept_len.data_ptr<int32_t>(), 0, w.keys_in.data_ptr<double>(),
        w.ids_in.data_ptr<int32_t>(), K, L, V);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    segmented_sort(w, B, V, stream);
  }
  cuda::gbv_sample_kernel<T><<<B, kThreads, 0, stream>>>(
      pp, qp, chosen_ptr, node_ptr, accept_len.data_ptr<int32_t>(), w.ids_out.data_ptr<int32_t>(), w.cum.data_ptr<double>(),
      w.r.data_ptr<double>(), w.weights.data_ptr<double>(), uf.data_ptr<double>(), output_tokens.data_ptr<int32_t>(),
      error.data_ptr<int32_t>(), K, L, V);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gbv_verify_cuda(const at::Tensor& candidates,
                                                               const at::Tensor& target_probs,
                                                               const at::Tensor& draft_probs,
                                                               const at::Tensor& uniforms,
                                                               const at::Tensor& uniforms_final,
                                                               const c10::optional<at::Tensor>& error_flag) {
  check_gbv_args(candidates, target_probs, draft_probs, uniforms, uniforms_final);
  const int64_t B = candidates.size(0), K = candidates.size(1), L = candidates.size(2) - 1, V = target_probs.size(3);
  TORCH_CHECK(K <= kMaxPaths, "the CUDA GBV kernel supports at most ", kMaxPaths, " paths, got K = ", K);
  // CUB's segmented radix sort counts items and segment offsets in int.
  TORCH_CHECK(B * V <= std::numeric_limits<int>::max(), "the CUDA GBV kernel ranks B x V <= 2^31 - 1 keys per call, "
              "got B = ", B, ", V = ", V, ": split the batch");
  const c10::cuda::CUDAGuard guard(candidates.device());
  const auto cand = candidates.to(at::kLong).contiguous();
  const auto p = target_probs.contiguous();
  const auto q = draft_probs.contiguous();
  const auto u = uniforms.to(at::kDouble).contiguous();
  const auto uf = uniforms_final.to(at::kDouble).contiguous();
  auto opts = candidates.options().dtype(at::kInt);
  auto accept_len = at::zeros({B}, opts);
  auto output_tokens = at::full({B, L + 1}, -1, opts);
  auto chosen = at::zeros({B}, opts);
  auto error = error_flag_or_scratch(error_flag, candidates);  // read by specadapt.kernel_errors, not here
  if (B == 0) return {accept_len, output_tokens, chosen};
  if (p.scalar_type() == at::kFloat) {
    launch<float>(cand, p, q, u, uf, accept_len, output_tokens, chosen, error, B, K, L, V);
  } else {
    launch<__nv_bfloat16>(cand, p, q, u, uf, accept_len, output_tokens, chosen, error, B, K, L, V);
  }
  return {accept_len, output_tokens, chosen};
}

}  // namespace

TORCH_LIBRARY_IMPL(specadapt, CUDA, m) { m.impl("gbv_verify", &gbv_verify_cuda); }

}  // namespace specadapt
