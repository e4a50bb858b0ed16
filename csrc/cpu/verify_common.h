// Per-request building blocks of the fused CPU verification kernels (chain, block, GBV).
// All arithmetic on probabilities is in double: the float64 PyTorch reference is the oracle, and computing
// the decisions in the same precision makes the kernels return the SAME tokens for the same coins.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include "simd_sums.h"

namespace specadapt {
namespace cpu {

// NaN / inf / negative probabilities count as 0 (docs/design/specs/verification.md section 5). Branch-free (NaN fails both
// comparisons) so the loops below vectorise.
template <typename T>
inline double clean(T x) {
  const double v = static_cast<double>(static_cast<float>(x));
  return (v > 0.0 && v < HUGE_VAL) ? v : 0.0;
}

// Rows computed in double (GBV's q_G) stay in double: no float rounding of the law block verification uses.
inline double clean(double v) { return (v > 0.0 && v < HUGE_VAL) ? v : 0.0; }

// p/q with the q = 0 rule (spec section 5): ratio 1 if p > 0, else 0. Not capped: block verification caps
// the running product w_i = min(1, w_{i-1} * p/q), not each factor.
inline double draft_ratio(double p, double q) {
  if (q > 0.0) return p / q;
  return p > 0.0 ? 1.0 : 0.0;
}

// float32 / bfloat16 rows go to the multi-versioned loops of simd_sums.cpp (AVX-512 / AVX2 / SSE2 picked at load).
template <typename T, typename Q>
constexpr bool kSimdF32 = std::is_same_v<T, float> && std::is_same_v<Q, float>;
template <typename T, typename Q>
constexpr bool kSimdBF16 = std::is_same_v<T, c10::BFloat16> && std::is_same_v<Q, c10::BFloat16>;

template <typename T>
inline const uint16_t* bf16_bits(const T* x) {
  return reinterpret_cast<const uint16_t*>(x);
}

// Unnormalised residual weight at v: max(w * p - q, 0), or p itself when use_p.
template <typename T, typename Q>
inline double residual_weight(const T* p, const Q* q, double w, bool use_p, int64_t v) {
  if (use_p) return clean(p[v]);
  const double d = w * clean(p[v]) - clean(q[v]);
  return d > 0.0 ? d : 0.0;
}

template <typename T, typename Q>
inline double residual_sum(const T* p, const Q* q, double w, bool use_p, int64_t begin, int64_t end) {
  if constexpr (kSimdF32<T, Q>) {
    return use_p ? simd::mass_f32(p + begin, end - begin) : simd::residual_sum_f32(p + begin, q + begin, w, end - begin);
  } else if constexpr (kSimdBF16<T, Q>) {
    return use_p ? simd::mass_bf16(bf16_bits(p + begin), end - begin)
                 : simd::residual_sum_bf16(bf16_bits(p + begin), bf16_bits(q + begin), w, end - begin);
  } else {
    double acc = 0.0;
    if (use_p) {
#pragma omp simd reduction(+ : acc)
      for (int64_t v = begin; v < end; ++v) acc += clean(p[v]);
    } else {
#pragma omp simd reduction(+ : acc)
      for (int64_t v = begin; v < end; ++v) {
        const double d = w * clean(p[v]) - clean(q[v]);
        acc += d > 0.0 ? d : 0.0;
      }
    }
    return acc;
  }
}

// sum_v max(w * p[v] - q[v], 0) over the whole row, q given as a row of T or of double.
template <typename T, typename Q>
inline double residual_mass(const T* p, const Q* q, double w, int64_t vocab) {
  return residual_sum(p, q, w, false, 0, vocab);
}

// The same residual mass and, from the same pass over the rows, the masses of p and q (row-sum check).
template <typename T, typename Q>
inline double residual_mass_and_sums(const T* p, const Q* q, double w, int64_t vocab, double* mass_p,
                                     double* mass_q) {
  if constexpr (kSimdF32<T, Q>) {
    return simd::residual_masses_f32(p, q, w, vocab, mass_p, mass_q);
  } else if constexpr (kSimdBF16<T, Q>) {
    return simd::residual_masses_bf16(bf16_bits(p), bf16_bits(q), w, vocab, mass_p, mass_q);
  } else {
    double acc = 0.0, mp = 0.0, mq = 0.0;
#pragma omp simd reduction(+ : acc, mp, mq)
    for (int64_t v = 0; v < vocab; ++v) {
      const double pv = clean(p[v]), qv = clean(q[v]);
      const double d = w * pv - qv;
      acc += d > 0.0 ? d : 0.0;
      mp += pv;
      mq += qv;
    }
    *mass_p = mp;
    *mass_q = mq;
    return acc;
  }
}

// sum_v clean(row[v]) (NaN / inf / negative entries count as 0).
template <typename T>
inline double row_mass(const T* row, int64_t vocab) {
  return residual_sum<T, T>(row, nullptr, 1.0, true, 0, vocab);
}

// Rows of p and q must be probability distributions: |sum - 1| <= this, after clean(). 1e-2 for 16-bit rows
// (bfloat16 rounds each entry by up to 2^-9 relative), 1e-3 for float32 / float64 -- the constants of
// specadapt.verification.common.row_sum_tolerance and csrc/cuda/verify.cuh. A scaled row would change the
// output law silently (the rules divide p by q entry by entry), so it is refused instead.
template <typename T>
constexpr double row_sum_tolerance() {
  return sizeof(T) <= 2 ? 1e-2 : 1e-3;
}

// Raises (ValueError in Python) naming the argument and the row -- index (b, row) or (b, path, depth) -- when
// its mass is off 1 by more than the tolerance (NaN fails the comparison, so it raises too).
template <typename T, typename... Index>
inline void check_row_sum(double mass, const char* name, Index... index) {
  constexpr double tol = row_sum_tolerance<T>();
  if (std::fabs(mass - 1.0) <= tol) return;
  std::string where;
  ((where += (where.empty() ? "" : ", ") + std::to_string(static_cast<long long>(index))), ...);
  TORCH_CHECK(false, name, " row (", where, ") sums to ", mass, ", not 1 (tolerance ", tol,
              "): rows of p and q must be probability distributions (normalise them; a scaled row changes the "
              "output law)");
}

// Inverse CDF over the unnormalised residual max(w * p - q, 0) (or p itself when q == nullptr). Picks the
// smallest index whose running sum exceeds u * mass; a zero-mass residual falls back to sampling p.
// The running sum advances by vectorised chunk sums and is scanned element by element only inside the chunk
// that crosses the threshold. Returns -1 only if p has no mass either.
template <typename T, typename Q>
inline int64_t sample_residual(const T* p, const Q* q, double w, double u, int64_t vocab) {
  constexpr int64_t kChunk = 512;
  bool use_p = q == nullptr;
  double mass = use_p ? 0.0 : residual_sum(p, q, w, false, 0, vocab);
  if (!use_p && (!(mass > 0.0) || !std::isfinite(mass))) use_p = true;
  if (use_p) {
    mass = residual_sum(p, q, w, true, 0, vocab);
    if (!(mass > 0.0)) return -1;
  }
  const double threshold = u * mass;
  double run = 0.0;
  for (int64_t c = 0; c < vocab; c += kChunk) {
    const int64_t end = std::min(vocab, c + kChunk);
    const double chunk = residual_sum(p, q, w, use_p, c, end);
    if (run + chunk > threshold) {
      for (int64_t v = c; v < end; ++v) {
        const double x = residual_weight(p, q, w, use_p, v);
        if (x > 0.0) {
          run += x;
          if (run > threshold) return v;
        }
      }
      // rounding: the element-wise sum did not cross where the chunk sum did; keep scanning
    } else {
      run += chunk;
    }
  }
  for (int64_t v = vocab - 1; v >= 0; --v) {  // threshold at or past the total: the last token with mass
    if (residual_weight(p, q, w, use_p, v) > 0.0) return v;
  }
  return -1;
}

// Block verification of one path (n live drafts). p: (n+1) rows of V, q: n rows of V (T or double).
// Returns the extra token (-1 if p has no mass) and writes tau. With row_sums (n + 1 doubles for p, then n for q)
// the masses of p rows 1..n-1 and q rows 1..n-1 are written there from the Z_i pass (entries 0 and n untouched).
template <typename T, typename Q>
inline int64_t block_on_path(const int64_t* drafts, const T* p, const Q* q, const double* u, double uf, int64_t n,
                      int64_t V, int64_t* tau_out, double* row_sums = nullptr) {
  std::vector<double> w(n + 1, 1.0);
  int64_t tau = 0;
  for (int64_t i = 1; i <= n; ++i) {
    const int64_t x = drafts[i - 1];
    const double ratio = draft_ratio(clean(p[(i - 1) * V + x]), clean(q[(i - 1) * V + x]));
    const double wi = std::min(1.0, w[i - 1] * ratio);
    w[i] = wi;
    double h;
    if (i < n) {
      const double z = row_sums ? residual_mass_and_sums(p + i * V, q + i * V, wi, V, row_sums + i, row_sums + n + 1 + i)
                                : residual_mass(p + i * V, q + i * V, wi, V);
      const double denom = z + 1.0 - wi;
      h = denom > 0.0 ? z / denom : 1.0;
    } else {
      h = wi;
    }
    h = std::min(1.0, std::max(0.0, h));
    if (u[i - 1] < h) tau = i;  // tau = the LAST index whose coin passes
  }
  *tau_out = tau;
  if (tau < n) return sample_residual(p + tau * V, q + tau * V, w[tau], uf, V);
  return sample_residual<T, T>(p + tau * V, nullptr, 1.0, uf, V);
}

}  // namespace cpu
}  // namespace specadapt
