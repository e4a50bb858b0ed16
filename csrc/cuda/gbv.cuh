// Greedy multi-path block verification, GBV (Thomas & Pal, arXiv 2602.16961; docs/design/specs/verification.md section 3),
// as plain CUDA kernels with no torch dependency. The caller (csrc/cuda/gbv.cu with CUB, or the CuPy JIT path)
// runs them in this order, all on one stream, with no host synchronisation:
//
//   1. gbv_walk_kernel                 once: the reached path (the walk needs the keys of <= K children only)
//   2. for d = 0 .. L-1:
//        gbv_fill_keys_kernel(d)       key (p/q, token id) of every token at the depth-d node of the path
//        segmented stable sort         per request, keys ascending, token ids as values (ties -> lower id)
//        gbv_depth_kernel(d)           c_u(x) for every x (scan in key order, scattered by token id), then
//                                      q_G at the drafted token, the weight w_{d+1}, Z_d (d >= 1) and r
//   3. gbv_accept_kernel               tau = the last i whose coin passes (block verification with q_G)
//   4. gbv_fill_keys_kernel(tau)       the node of the residual (skipped per request when tau = L)
//      segmented stable sort
//      gbv_sample_kernel               c_u at that node, inverse-CDF sample of max(w_tau p - q_G, 0) (or of p)
//
// One thread block per request; vocabulary reductions, scans and the inverse CDF are block-wide, in double, as
// in the CPU kernel (csrc/cpu/gbv_cpu.cpp), so the same coins give the same tokens up to summation order.
// Every kernel takes flat arguments (pointers and int64 sizes) so NVRTC / CuPy can launch them as well.
#pragma once

#include "verify.cuh"

namespace specadapt {
namespace cuda {

// Ranking key at a node: p/q ascending, ties broken by the token id; q = 0 ranks last (its mass is 0 anyway).
__device__ __forceinline__ double gbv_ratio(double p, double q) { return q > 0.0 ? p / q : __longlong_as_double(0x7ff0000000000000LL); }

__device__ __forceinline__ bool gbv_key_less(double ra, int64_t a, double rb, int64_t b) {
  return ra < rb || (ra == rb && a < b);
}

// S_K(a, b) = sum_{i=0}^{K-1} a^i b^(K-1-i), by the recurrence S_{k+1} = a S_k + b^k (no pow, no cancellation).
__device__ __forceinline__ double gbv_power_sum(double a, double b, int64_t K) {
  double s = 1.0, bk = 1.0;
  for (int64_t k = 1; k < K; ++k) {
    bk *= b;
    s = a * s + bk;
  }
  return s;
}

// q_G(x | u) from q(x | u), the inclusive cumulative mass c_u(x), r of the node and denom = S_K(r + 1, r).
__device__ __forceinline__ double gbv_q(double q, double c, double r, double denom, int64_t K) {
  if (!(q > 0.0)) return 0.0;
  return q * gbv_power_sum(r + c, r + c - q, K) / denom;
}

// Row offsets of path k at depth d inside [B, K, L+1, V] (target) and [B, K, L, V] (draft).
__device__ __forceinline__ int64_t gbv_p_row(int64_t b, int64_t k, int64_t d, int64_t K, int64_t L, int64_t V) {
  return ((b * K + k) * (L + 1) + d) * V;
}
__device__ __forceinline__ int64_t gbv_q_row(int64_t b, int64_t k, int64_t d, int64_t K, int64_t L, int64_t V) {
  return ((b * K + k) * L + d) * V;
}

// 1. The walk. Thread 0 follows the children with the largest key among the paths still consistent with the
// walked prefix; the path it reaches is the lowest-index consistent path. node_path[b, d] records the path whose
// rows stand for the depth-d node (the lowest consistent index, as in the reference: rows of merged prefixes
// repeat, but a draft need not reproduce them bit for bit). Writes chosen_path[b] and node_path [B, L]; sets
// kErrorZeroDraftProb (errors.cuh) when a walked child has q = 0 (not a sample from q; the device path does not raise).
// kMaxPaths bounds K (consistency flags in registers of thread 0).
template <typename T, int kMaxPaths = 32>
__global__ void gbv_walk_kernel(const T* __restrict__ target_probs, const T* __restrict__ draft_probs,
                                const int64_t* __restrict__ candidates, int32_t* __restrict__ chosen_path,
                                int32_t* __restrict__ node_path, int32_t* __restrict__ error, int64_t K, int64_t L,
                                int64_t V) {
  if (threadIdx.x != 0) return;
  const int64_t b = blockIdx.x;
  const int64_t* cand = candidates + b * K * (L + 1);
  bool consistent[kMaxPaths];
  for (int64_t k = 0; k < K; ++k) consistent[k] = true;
  for (int64_t d = 0; d < L; ++d) {
    int64_t k0 = 0;
    while (!consistent[k0]) ++k0;
    node_path[b * L + d] = static_cast<int32_t>(k0);
    const T* p = target_probs + gbv_p_row(b, k0, d, K, L, V);
    const T* q = draft_probs + gbv_q_row(b, k0, d, K, L, V);
    int64_t child = -1;
    double child_ratio = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      if (!consistent[k]) continue;
      const int64_t x = cand[k * (L + 1) + d + 1];
      const double rx = gbv_ratio(prob(p[x]), prob(q[x]));
      if (child < 0 || gbv_key_less(child_ratio, child, rx, x)) {
        child = x;
        child_ratio = rx;
      }
    }
    if (!(prob(q[child]) > 0.0)) report_error(error, kErrorZeroDraftProb);
    for (int64_t k = 0; k < K; ++k) consistent[k] = consistent[k] && cand[k * (L + 1) + d + 1] == child;
  }
  int64_t chosen = 0;
  while (!consistent[chosen]) ++chosen;
  chosen_path[b] = static_cast<int32_t>(chosen);
}

// 2a / 4a. keys[b, v] = p/q of token v at the node of depth depth(b) on the walked path (rows of node_path),
// ids[b, v] = v. depth(b) = depth when depth_per_request is null, else depth_per_request[b] (rows with
// depth >= L get key 0: they need no ranking). Grid: (B, any) blocks; any block size.
template <typename T>
__global__ void gbv_fill_keys_kernel(const T* __restrict__ target_probs, const T* __restrict__ draft_probs,
                                     const int32_t* __restrict__ node_path, const int32_t* __restrict__ depth_per_request,
                                     int64_t depth, double* __restrict__ keys, int32_t* __restrict__ ids, int64_t K,
                                     int64_t L, int64_t V) {
  const int64_t b = blockIdx.x;
  const int64_t d = depth_per_request ? depth_per_request[b] : depth;
  const int64_t k = d < L ? node_path[b * L + d] : 0;
  const T* p = target_probs + gbv_p_row(b, k, d < L ? d : 0, K, L, V);
  const T* q = draft_probs + gbv_q_row(b, k, d < L ? d : 0, K, L, V);
  for (int64_t v = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; v < V;
       v += static_cast<int64_t>(gridDim.y) * blockDim.x) {
    keys[b * V + v] = d < L ? gbv_ratio(prob(p[v]), prob(q[v])) : 0.0;
    ids[b * V + v] = static_cast<int32_t>(v);
  }
}

// c_u(x) for every x of row q: block-wide inclusive scan of q in key order (sorted_ids), scattered by token id.
// Ends with __syncthreads so the whole block sees cum.
template <typename T>
__device__ void gbv_cumulative(const T* q, const int32_t* sorted_ids, double* cum, int64_t V, double* scratch) {
  double running = 0.0;
  for (int64_t base = 0; base < V; base += blockDim.x) {
    const int64_t j = base + threadIdx.x;
    int32_t x = -1;
    double qx = 0.0;
    if (j < V) {
      x = sorted_ids[j];
      qx = prob(q[x]);
    }
    double tile_total;
    const double before = running + block_exclusive_scan(qx, scratch, &tile_total);
    if (x >= 0) cum[x] = before + qx;
    running += tile_total;
  }
  __syncthreads();
}

// 2b. Depth d of the chosen path, one block per request: c_u for every token, then (thread 0) q_G of the drafted
// token, w_{d+1} = min(1, w_d p/q_G) and r of the next node; Z_d = sum_v max(w_d p - q_G, 0) for d >= 1.
// q (hence c_u and q_G) comes from the node's rows (node_path), p from the chosen path, as in the CPU kernel.
// State per request: r [B, L+1] (r before depth d; r[b, 0] = 0 is written here at d = 0), weights [B, L+1]
// (weights[b, 0] = 1 written at d = 0), residual_mass [B, L] (Z_d, column 0 unused).
template <typename T>
__global__ void gbv_depth_kernel(const T* __restrict__ target_probs, const T* __restrict__ draft_probs,
                                 const int64_t* __restrict__ candidates, const int32_t* __restrict__ chosen_path,
                                 const int32_t* __restrict__ node_path, const int32_t* __restrict__ sorted_ids,
                                 double* __restrict__ cum, double* __restrict__ r, double* __restrict__ weights,
                                 double* __restrict__ residual_mass, int64_t depth, int64_t K, int64_t L, int64_t V) {
  __shared__ double scratch[33];
  const int64_t b = blockIdx.x, d = depth, k = chosen_path[b];
  const T* p = target_probs + gbv_p_row(b, k, d, K, L, V);
  const T* q = draft_probs + gbv_q_row(b, node_path[b * L + d], d, K, L, V);
  double* c = cum + b * V;
  gbv_cumulative(q, sorted_ids + b * V, c, V, scratch);
  if (d == 0 && threadIdx.x == 0) {
    r[b * (L + 1)] = 0.0;
    weights[b * (L + 1)] = 1.0;
  }
  __syncthreads();
  const double r_d = r[b * (L + 1) + d];
  const double w_d = weights[b * (L + 1) + d];
  const double denom = gbv_power_sum(r_d + 1.0, r_d, K);
  if (d >= 1) {
    double local = 0.0;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
      const double diff = w_d * prob(p[v]) - gbv_q(prob(q[v]), c[v], r_d, denom, K);
      local += diff > 0.0 ? diff : 0.0;
    }
    const double z = block_sum(local, scratch);
    if (threadIdx.x == 0) residual_mass[b * L + d] = z;
  }
  if (threadIdx.x == 0) {
    const int64_t t = candidates[(b * K + k) * (L + 1) + d + 1];
    const double qt = prob(q[t]);
    const double ratio = draft_ratio(prob(p[t]), gbv_q(qt, c[t], r_d, denom, K));
    const double w = w_d * ratio;
    weights[b * (L + 1) + d + 1] = w < 1.0 ? w : 1.0;
    r[b * (L + 1) + d + 1] = qt > 0.0 ? (r_d + c[t] - qt) / qt : 0.0;
  }
}

// 3. tau = the last i in 1..L with uniforms[b, i-1] < h_i, h_i = Z_i / (Z_i + 1 - w_i) (i < L) or w_L; writes
// accept_len, the accepted drafts of the chosen path and the tau of each request (int32, also the depth of the
// residual). One thread per request.
__global__ void gbv_accept_kernel(const int64_t* __restrict__ candidates, const int32_t* __restrict__ chosen_path,
                                  const double* __restrict__ uniforms, const double* __restrict__ weights,
                                  const double* __restrict__ residual_mass, int32_t* __restrict__ accept_len,
                                  int32_t* __restrict__ output_tokens, int64_t B, int64_t K, int64_t L) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= B) return;
  int64_t tau = 0;
  for (int64_t i = 1; i <= L; ++i) {
    const double w = weights[b * (L + 1) + i];
    double h;
    if (i < L) {
      const double z = residual_mass[b * L + i];
      const double denom = z + 1.0 - w;
      h = denom > 0.0 ? z / denom : 1.0;
    } else {
      h = w;
    }
    h = h < 0.0 ? 0.0 : (h > 1.0 ? 1.0 : h);
    if (uniforms[b * L + i - 1] < h) tau = i;
  }
  accept_len[b] = static_cast<int32_t>(tau);
  const int64_t* drafts = candidates + (b * K + chosen_path[b]) * (L + 1) + 1;
  for (int64_t i = 0; i < tau; ++i) output_tokens[b * (L + 1) + i] = static_cast<int32_t>(drafts[i]);
}

// Block-wide inverse CDF over weights given by a functor weight(v) >= 0 with total `mass` > 0: the smallest v
// whose running sum exceeds u * mass (the last v with positive weight if rounding pushes the threshold past the
// total). Every thread returns the index.
// (Scan rounding can let two neighbours both claim the crossing: the smaller index wins, deterministically.)
template <typename F>
__device__ int64_t block_inverse_cdf(F weight, double mass, double u, int64_t V, double* scratch,
                                     unsigned long long* shared_index, unsigned long long* shared_last) {
  constexpr unsigned long long kNone = ~0ull;
  const double threshold = u * mass;
  double running = 0.0;
  int64_t last_positive = -1;
  if (threadIdx.x == 0) {
    *shared_index = kNone;
    *shared_last = 0ull;
  }
  __syncthreads();
  for (int64_t base = 0; base < V; base += blockDim.x) {
    const int64_t v = base + threadIdx.x;
    const double x = v < V ? weight(v) : 0.0;
    if (x > 0.0) last_positive = v;
    double tile_total;
    const double before = running + block_exclusive_scan(x, scratch, &tile_total);
    if (x > 0.0 && before <= threshold && before + x > threshold) {
      atomicMin(shared_index, static_cast<unsigned long long>(v));
    }
    __syncthreads();
    if (*shared_index != kNone) return static_cast<int64_t>(*shared_index);
    running += tile_total;
  }
  if (last_positive >= 0) atomicMax(shared_last, static_cast<unsigned long long>(last_positive + 1));
  __syncthreads();
  return static_cast<int64_t>(*shared_last) - 1;
}

// 4b. The extra token: at depth tau < L, the residual max(w_tau p - q_G, 0) of the chosen path's node (c_u from
// sorted_ids, r[b, tau]); a zero-mass residual, or tau = L, samples p itself. Writes output_tokens[b, tau] and
// sets kErrorNoTargetMass when p has no mass. First checks the rows the output depends on -- the chosen path's p rows
// 0..L and the walked nodes' q rows 0..L-1 -- sum to 1 (row_sum_tolerance, verify.cuh); an off row gives -1 as
// the extra token (the device path cannot raise) and sets kErrorRowSum.
template <typename T>
__global__ void gbv_sample_kernel(const T* __restrict__ target_probs, const T* __restrict__ draft_probs,
                                  const int32_t* __restrict__ chosen_path, const int32_t* __restrict__ node_path,
                                  const int32_t* __restrict__ accept_len,
                                  const int32_t* __restrict__ sorted_ids, double* __restrict__ cum,
                                  const double* __restrict__ r, const double* __restrict__ weights,
                                  const double* __restrict__ uniforms_final, int32_t* __restrict__ output_tokens,
                                  int32_t* __restrict__ error, int64_t K, int64_t L, int64_t V) {
  __shared__ double scratch[33];
  __shared__ unsigned long long shared_index;
  __shared__ unsigned long long shared_last;
  const int64_t b = blockIdx.x, k = chosen_path[b], tau = accept_len[b];
  const T* p = target_probs + gbv_p_row(b, k, tau, K, L, V);
  const double u = uniforms_final[b];
  double mass = 0.0;
  double* c = cum + b * V;
  const double w = weights[b * (L + 1) + tau];
  const double r_tau = r[b * (L + 1) + (tau < L ? tau : 0)];
  const double denom = gbv_power_sum(r_tau + 1.0, r_tau, K);
  const T* q = draft_probs + (tau < L ? gbv_q_row(b, node_path[b * L + tau], tau, K, L, V) : 0);
  auto residual = [&](int64_t v) {
    const double diff = w * prob(p[v]) - gbv_q(prob(q[v]), c[v], r_tau, denom, K);
    return diff > 0.0 ? diff : 0.0;
  };
  auto target = [&](int64_t v) { return prob(p[v]); };
  const double tol = row_sum_tolerance(target_probs);
  bool rows_ok = true;
  for (int64_t d = 0; d <= L; ++d) {  // the same d for the whole block: every thread reduces every row
    const bool p_ok = row_sum_ok(block_row_mass(target_probs + gbv_p_row(b, k, d, K, L, V), V, scratch), tol);
    const bool q_ok = d < L ? row_sum_ok(block_row_mass(draft_probs + gbv_q_row(b, node_path[b * L + d], d, K, L, V),
                                                        V, scratch), tol)
                            : true;
    rows_ok = rows_ok && p_ok && q_ok;
  }
  int64_t extra = -1;
  if (rows_ok) {
    if (tau < L) {
      gbv_cumulative(q, sorted_ids + b * V, c, V, scratch);
      double local = 0.0;
      for (int64_t v = threadIdx.x; v < V; v += blockDim.x) local += residual(v);
      mass = block_sum(local, scratch);
    }
    if (tau < L && mass > 0.0 && mass < 1.0e300) {
      extra = block_inverse_cdf(residual, mass, u, V, scratch, &shared_index, &shared_last);
    } else {
      double local = 0.0;
      for (int64_t v = threadIdx.x; v < V; v += blockDim.x) local += target(v);
      mass = block_sum(local, scratch);
      extra = mass > 0.0 ? block_inverse_cdf(target, mass, u, V, scratch, &shared_index, &shared_last) : -1;
    }
  }
  if (threadIdx.x == 0) {
    if (!rows_ok) report_error(error, kErrorRowSum);
    if (extra < 0 && rows_ok) report_error(error, kErrorNoTargetMass);
    output_tokens[b * (L + 1) + tau] = static_cast<int32_t>(extra);
  }
}

}  // namespace cuda
}  // namespace specadapt
