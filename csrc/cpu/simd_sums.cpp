// The vocabulary sums of the fused CPU verification kernels, compiled three times (GCC target_clones: AVX-512
// "x86-64-v4", AVX2 "x86-64-v3", and the SSE2 baseline) and picked once at load time by the CPU's features.
// The decisions are in double (see verify_common.h); at 2 doubles per SSE2 vector the block kernel was
// compute-bound at about a third of the copy bandwidth, 4 (AVX2) or 8 (AVX-512) doubles per vector make it
// memory-bound. The build passes -ffp-contract=off so no clone fuses w * p - q into an FMA: every clone
// rounds each product and difference as the float64 reference does (only the summation order differs).
#include "simd_sums.h"

#include <cmath>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPECADAPT_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SPECADAPT_CLONES
#endif

namespace specadapt {
namespace cpu {
namespace simd {
namespace {

inline double clean(float x) {
  const double v = static_cast<double>(x);
  return (v > 0.0 && v < HUGE_VAL) ? v : 0.0;
}

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

}  // namespace

SPECADAPT_CLONES double residual_sum_f32(const float* p, const float* q, double w, int64_t n) {
  double acc = 0.0;
#pragma omp simd reduction(+ : acc)
  for (int64_t v = 0; v < n; ++v) {
    const double d = w * clean(p[v]) - clean(q[v]);
    acc += d > 0.0 ? d : 0.0;
  }
  return acc;
}

SPECADAPT_CLONES double residual_sum_bf16(const uint16_t* p, const uint16_t* q, double w, int64_t n) {
  double acc = 0.0;
#pragma omp simd reduction(+ : acc)
  for (int64_t v = 0; v < n; ++v) {
    const double d = w * clean(bf16_to_float(p[v])) - clean(bf16_to_float(q[v]));
    acc += d > 0.0 ? d : 0.0;
  }
  return acc;
}

SPECADAPT_CLONES double mass_f32(const float* p, int64_t n) {
  double acc = 0.0;
#pragma omp simd reduction(+ : acc)
  for (int64_t v = 0; v < n; ++v) acc += clean(p[v]);
  return acc;
}

SPECADAPT_CLONES double mass_bf16(const uint16_t* p, int64_t n) {
  double acc = 0.0;
#pragma omp simd reduction(+ : acc)
  for (int64_t v = 0; v < n; ++v) acc += clean(bf16_to_float(p[v]));
  return acc;
}

SPECADAPT_CLONES double residual_masses_f32(const float* p, const float* q, double w, int64_t n, double* mass_p,
                                            double* mass_q) {
  double acc = 0.0, mp = 0.0, mq = 0.0;
#pragma omp simd reduction(+ : acc, mp, mq)
  for (int64_t v = 0; v < n; ++v) {
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

SPECADAPT_CLONES double residual_masses_bf16(const uint16_t* p, const uint16_t* q, double w, int64_t n,
                                             double* mass_p, double* mass_q) {
  double acc = 0.0, mp = 0.0, mq = 0.0;
#pragma omp simd reduction(+ : acc, mp, mq)
  for (int64_t v = 0; v < n; ++v) {
    const double pv = clean(bf16_to_float(p[v])), qv = clean(bf16_to_float(q[v]));
    const double d = w * pv - qv;
    acc += d > 0.0 ? d : 0.0;
    mp += pv;
    mq += qv;
  }
  *mass_p = mp;
  *mass_q = mq;
  return acc;
}

}  // namespace simd
}  // namespace cpu
}  // namespace specadapt
