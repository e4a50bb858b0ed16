// Chain (token-level rejection sampling) and block verification as plain CUDA kernels, no torch dependency
// (docs/design/specs/verification.md sections 1, 2, 4). One thread block per request; vocabulary reductions and the
// inverse-CDF scan are block-wide; rows are read with 16-byte vector loads when the row is aligned.
// Probabilities are float or __nv_bfloat16; accumulation is in double so that the decisions match the float64
// reference for the same coins (Hopper runs FP64 at half FP32 rate; these kernels are memory-bound).
#pragma once

#include <cuda_bf16.h>
#include "errors.cuh"
#include "stdint.cuh"

namespace specadapt {
namespace cuda {

// Explicit conversions: torch builds with __CUDA_NO_BFLOAT16_CONVERSIONS__, so no implicit bf16 -> float.
__device__ __forceinline__ float as_float(float x) { return x; }
__device__ __forceinline__ float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ double prob(T x) {
  const double v = static_cast<double>(as_float(x));
  return (v > 0.0 && v < 1.0e300) ? v : 0.0;  // NaN, inf and negatives count as 0 (spec section 5)
}

// p/q with the q = 0 rule (ratio 1 if p > 0, else 0); block verification caps the product, not the factor.
__device__ __forceinline__ double draft_ratio(double p, double q) {
  if (q > 0.0) return p / q;
  return p > 0.0 ? 1.0 : 0.0;
}

// Elements per 16-byte load.
template <typename T>
struct Vec {
  static constexpr int kSize = 16 / sizeof(T);
};

// Loads kSize consecutive elements starting at row[i] (vector load if aligned and in range, else scalar).
template <typename T>
__device__ __forceinline__ void load_chunk(const T* row, int64_t i, int64_t vocab, double (&out)[Vec<T>::kSize]) {
  constexpr int N = Vec<T>::kSize;
  if (i + N <= vocab && (reinterpret_cast<uintptr_t>(row + i) & 15u) == 0) {
    const uint4 raw = *reinterpret_cast<const uint4*>(row + i);
    const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = prob(vals[j]);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = (i + j < vocab) ? prob(row[i + j]) : 0.0;
  }
}

// Block-wide sum of one double per thread (blockDim.x a multiple of 32, <= 1024). All threads get the result.
__device__ __forceinline__ double block_sum(double v, double* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? scratch[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) scratch[32] = v;
  }
  __syncthreads();
  return scratch[32];
}

// Block-wide exclusive prefix sum of one double per thread; *total receives the block total.
__device__ __forceinline__ double block_exclusive_scan(double v, double* scratch, double* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  double inclusive = v;
  for (int o = 1; o < 32; o <<= 1) {
    const double n = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += n;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    double w = lane < warps ? scratch[lane] : 0.0;
    for (int o = 1; o < 32; o <<= 1) {
      const double n = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += n;
    }
    if (lane < warps) scratch[lane] = w;  // inclusive warp totals
  }
  __syncthreads();
  const double warp_offset = warp > 0 ? scratch[warp - 1] : 0.0;
  *total = scratch[warps - 1];
  return warp_offset + inclusive - v;
}

// Rows of p and q must be probability distributions: |sum - 1| <= this after prob() (NaN / inf / negatives count
// as 0); 1e-3 for float rows, 1e-2 for bfloat16 (each entry rounded by up to 2^-9 relative). The constants of
// specadapt.verification.common.row_sum_tolerance and csrc/cpu/verify_common.h. The device path cannot raise
// (no host sync): a request with an off row gets -1 as its extra token, as one whose target row has no mass.
__device__ __forceinline__ double row_sum_tolerance(const float*) { return 1.0e-3; }
__device__ __forceinline__ double row_sum_tolerance(const __nv_bfloat16*) { return 1.0e-2; }
__device__ __forceinline__ bool row_sum_ok(double mass, double tol) { return fabs(mass - 1.0) <= tol; }  // NaN: false

// Block-wide sum of prob(row[v]) over one row (16-byte loads when aligned). Every thread gets the result.
template <typename T>
__device__ double block_row_mass(const T* row, int64_t vocab, double* scratch) {
  constexpr int N = Vec<T>::kSize;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * N;
  double local = 0.0;
  for (int64_t i = threadIdx.x * N; i < vocab; i += stride) {
    double x[N];
    load_chunk(row, i, vocab, x);
#pragma unroll
    for (int j = 0; j < N; ++j) local += x[j];
  }
  return block_sum(local, scratch);
}

// Unnormalised residual weight max(w * p - q, 0), or p itself when q is null.
template <typename T>
__device__ __forceinline__ double residual_weight(double p, double q, double w, bool use_p) {
  if (use_p) return p;
  const double d = w * p - q;
  return d > 0.0 ? d : 0.0;
}

// Inverse-CDF sample of the residual of one row (a zero-mass residual falls back to p). Block-wide; every
// thread returns the token id (-1 if p has no mass either).
template <typename T>
__device__ int64_t block_sample_residual(const T* p, const T* q, double w, double u, int64_t vocab, double* scratch,
                                         int64_t* shared_index) {
  constexpr int N = Vec<T>::kSize;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * N;
  double local = 0.0;
  if (q != nullptr) {
    for (int64_t i = threadIdx.x * N; i < vocab; i += stride) {
      double pv[N], qv[N];
      load_chunk(p, i, vocab, pv);
      load_chunk(q, i, vocab, qv);
#pragma unroll
      for (int j = 0; j < N; ++j) local += residual_weight<T>(pv[j], qv[j], w, false);
    }
  }
  double mass = block_sum(local, scratch);
  const bool use_p = q == nullptr || !(mass > 0.0) || !(mass < 1.0e300);
  if (use_p) {
    local = 0.0;
    for (int64_t i = threadIdx.x * N; i < vocab; i += stride) {
      double pv[N];
      load_chunk(p, i, vocab, pv);
#pragma unroll
      for (int j = 0; j < N; ++j) local += pv[j];
    }
    mass = block_sum(local, scratch);
    if (!(mass > 0.0)) return -1;
  }
  const double threshold = u * mass;
  double running = 0.0;
  int64_t last_positive = -1;
  if (threadIdx.x == 0) *shared_index = -1;
  __syncthreads();
  for (int64_t base = 0; base < vocab; base += stride) {
    const int64_t i = base + threadIdx.x * N;
    double x[N];
    double sum = 0.0;
    {
      double pv[N], qv[N];
      load_chunk(p, i, vocab, pv);
      if (!use_p) load_chunk(q, i, vocab, qv);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        x[j] = residual_weight<T>(pv[j], use_p ? 0.0 : qv[j], w, use_p);
        sum += x[j];
        if (x[j] > 0.0) last_positive = i + j;
      }
    }
    double tile_total;
    const double before = running + block_exclusive_scan(sum, scratch, &tile_total);
    if (before <= threshold && before + sum > threshold) {
      double run = before;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        if (x[j] > 0.0) {
          run += x[j];
          if (run > threshold) {
            *shared_index = i + j;
            break;
          }
        }
      }
    }
    __syncthreads();
    if (*shared_index >= 0) return *shared_index;
    running += tile_total;
  }
  // Rounding pushed the threshold past the total: take the last token with positive weight.
  __shared__ unsigned long long last;
  if (threadIdx.x == 0) last = 0ull;
  __syncthreads();
  if (last_positive >= 0) atomicMax(&last, static_cast<unsigned long long>(last_positive + 1));
  __syncthreads();
  return static_cast<int64_t>(last) - 1;
}

// Shared layout of both kernels (flat kernel arguments, so NVRTC / CuPy launch them as nvcc's binding does):
// candidates [B, L+1] int64, target_probs [B, L+1, V], draft_probs [B, L, V],
// uniforms [B, L] double, uniforms_final [B] double, num_draft_tokens [B] int64 or null;
// outputs accept_len [B] int32, output_tokens [B, L+1] int32 (pre-filled with -1 by the caller),
// error [1] int32 (or null): kErrorRowSum (errors.cuh) when a row does not sum to 1, else kErrorNoTargetMass when
// the target row of the extra token has no mass (extra token -1 in both cases).
struct VerifyArgs {
  const int64_t* candidates;
  const double* uniforms;
  const double* uniforms_final;
  const int64_t* num_draft_tokens;
  int32_t* accept_len;
  int32_t* output_tokens;
  int32_t* error;
  int64_t num_drafts;  // L
  int64_t vocab;       // V
};

// Drafts of request b to verify. Counts are not range-checked on the device (that needs a host sync): clamped to
// [0, L] so a bad one cannot read out of bounds.
__device__ __forceinline__ int64_t live_drafts(const VerifyArgs& a, int64_t b) {
  const int64_t n = a.num_draft_tokens ? a.num_draft_tokens[b] : a.num_drafts;
  return n < 0 ? 0 : (n > a.num_drafts ? a.num_drafts : n);
}

// Thread 0 of request b: accept_len, the accepted drafts, then the extra token (-1 flags an off or massless row,
// reported in the error flag).
__device__ __forceinline__ void write_outputs(const VerifyArgs& a, int64_t b, const int64_t* cand, int64_t tau,
                                              int64_t extra, bool rows_ok) {
  const int64_t L = a.num_drafts;
  if (!rows_ok) {
    report_error(a.error, kErrorRowSum);
  } else if (extra < 0) {
    report_error(a.error, kErrorNoTargetMass);
  }
  a.accept_len[b] = static_cast<int32_t>(tau);
  for (int64_t i = 0; i < tau; ++i) a.output_tokens[b * (L + 1) + i] = static_cast<int32_t>(cand[i + 1]);
  a.output_tokens[b * (L + 1) + tau] = static_cast<int32_t>(extra);
}

template <typename T>
__global__ void chain_verify_kernel(const T* __restrict__ target_probs, const T* __restrict__ draft_probs,
                                    const int64_t* __restrict__ candidates,
                                    const double* __restrict__ uniforms, const double* __restrict__ uniforms_final,
                                    const int64_t* __restrict__ num_draft_tokens, int32_t* __restrict__ accept_len,
                                    int32_t* __restrict__ output_tokens, int32_t* __restrict__ error,
                                    int64_t num_drafts, int64_t vocab) {
  const VerifyArgs a{candidates, uniforms, uniforms_final, num_draft_tokens, accept_len, output_tokens, error,
                     num_drafts, vocab};
  __shared__ double scratch[33];
  __shared__ int64_t shared_index;
  __shared__ int64_t shared_tau;
  const int64_t b = blockIdx.x, L = a.num_drafts, V = a.vocab;
  const int64_t n = live_drafts(a, b);
  const int64_t* cand = a.candidates + b * (L + 1);
  const T* p = target_probs + b * (L + 1) * V;
  const T* q = draft_probs + b * L * V;
  if (threadIdx.x == 0) {
    int64_t tau = 0;
    while (tau < n) {
      const int64_t x = cand[tau + 1];
      if (!(a.uniforms[b * L + tau] * prob(q[tau * V + x]) < prob(p[tau * V + x]))) break;
      ++tau;
    }
    shared_tau = tau;
  }
  __syncthreads();
  const int64_t tau = shared_tau;
  // rows the output can depend on (p rows 0..n, q rows 0..n-1) must sum to 1: a pass of its own (chain reads
  // only p(x), q(x) of the accepted rows); n is the same for the whole block, so every thread reduces every row
  const double tol = row_sum_tolerance(p);
  bool rows_ok = true;
  for (int64_t i = 0; i <= n; ++i) {
    const bool p_ok = row_sum_ok(block_row_mass(p + i * V, V, scratch), tol);
    const bool q_ok = i < n ? row_sum_ok(block_row_mass(q + i * V, V, scratch), tol) : true;
    rows_ok = rows_ok && p_ok && q_ok;
  }
  const int64_t extra = rows_ok ? block_sample_residual<T>(p + tau * V, tau < n ? q + tau * V : nullptr, 1.0,
                                                           a.uniforms_final[b], V, scratch, &shared_index)
                                : -1;
  if (threadIdx.x == 0) write_outputs(a, b, cand, tau, extra, rows_ok);
}

// Block verification. kMaxDrafts bounds L (path weights live in shared memory).
template <typename T, int kMaxDrafts = 64>
__global__ void block_verify_kernel(const T* __restrict__ target_probs, const T* __restrict__ draft_probs,
                                    const int64_t* __restrict__ candidates,
                                    const double* __restrict__ uniforms, const double* __restrict__ uniforms_final,
                                    const int64_t* __restrict__ num_draft_tokens, int32_t* __restrict__ accept_len,
                                    int32_t* __restrict__ output_tokens, int32_t* __restrict__ error,
                                    int64_t num_drafts, int64_t vocab) {
  const VerifyArgs a{candidates, uniforms, uniforms_final, num_draft_tokens, accept_len, output_tokens, error,
                     num_drafts, vocab};
  constexpr int N = Vec<T>::kSize;
  __shared__ double scratch[33];
  __shared__ double weights[kMaxDrafts + 1];
  __shared__ int64_t shared_index;
  __shared__ int64_t shared_tau;
  const int64_t b = blockIdx.x, L = a.num_drafts, V = a.vocab;
  const int64_t n = live_drafts(a, b);
  const int64_t* cand = a.candidates + b * (L + 1);
  const T* p = target_probs + b * (L + 1) * V;
  const T* q = draft_probs + b * L * V;
  if (threadIdx.x == 0) {
    weights[0] = 1.0;
    for (int64_t i = 1; i <= n; ++i) {
      const int64_t x = cand[i];
      const double r = draft_ratio(prob(p[(i - 1) * V + x]), prob(q[(i - 1) * V + x]));
      const double w = weights[i - 1] * r;
      weights[i] = w < 1.0 ? w : 1.0;
    }
    shared_tau = 0;
  }
  __syncthreads();
  const int64_t stride = static_cast<int64_t>(blockDim.x) * N;
  // row sums (p rows 0..n, q rows 0..n-1 must sum to 1): rows 1..n-1 from the Z_i pass below, p_0, q_0, p_n here
  const double tol = row_sum_tolerance(p);
  const bool p0_ok = row_sum_ok(block_row_mass(p, V, scratch), tol);
  const bool pn_ok = row_sum_ok(block_row_mass(p + n * V, V, scratch), tol);
  const bool q0_ok = n > 0 ? row_sum_ok(block_row_mass(q, V, scratch), tol) : true;
  bool rows_ok = p0_ok && pn_ok && q0_ok;
  for (int64_t i = 1; i <= n; ++i) {
    const double w = weights[i];
    double h;
    if (i < n) {
      double local = 0.0, mass_p = 0.0, mass_q = 0.0;
      for (int64_t k = threadIdx.x * N; k < V; k += stride) {
        double pv[N], qv[N];
        load_chunk(p + i * V, k, V, pv);
        load_chunk(q + i * V, k, V, qv);
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const double d = w * pv[j] - qv[j];
          local += d > 0.0 ? d : 0.0;
          mass_p += pv[j];
          mass_q += qv[j];
        }
      }
      const double z = block_sum(local, scratch);
      const bool mp_ok = row_sum_ok(block_sum(mass_p, scratch), tol);
      const bool mq_ok = row_sum_ok(block_sum(mass_q, scratch), tol);
      rows_ok = rows_ok && mp_ok && mq_ok;
      const double denom = z + 1.0 - w;
      h = denom > 0.0 ? z / denom : 1.0;
    } else {
      h = w;
    }
    h = h < 0.0 ? 0.0 : (h > 1.0 ? 1.0 : h);
    if (threadIdx.x == 0 && a.uniforms[b * L + i - 1] < h) shared_tau = i;
  }
  __syncthreads();
  const int64_t tau = shared_tau;
  const int64_t extra = rows_ok ? block_sample_residual<T>(p + tau * V, tau < n ? q + tau * V : nullptr,
                                                           weights[tau], a.uniforms_final[b], V, scratch,
                                                           &shared_index)
                                : -1;
  if (threadIdx.x == 0) write_outputs(a, b, cand, tau, extra, rows_ok);
}

}  // namespace cuda
}  // namespace specadapt
