// Vocabulary sums of the fused CPU verification kernels, built for several x86-64 levels (simd_sums.cpp).
// Semantics are those of verify_common.h: entries that are NaN, inf or <= 0 count as 0 (clean), sums in double.
#pragma once
#include <cstdint>

namespace specadapt {
namespace cpu {
namespace simd {

// sum_v max(w * clean(p[v]) - clean(q[v]), 0)
double residual_sum_f32(const float* p, const float* q, double w, int64_t n);
double residual_sum_bf16(const uint16_t* p, const uint16_t* q, double w, int64_t n);
// sum_v clean(p[v])
double mass_f32(const float* p, int64_t n);
double mass_bf16(const uint16_t* p, int64_t n);
// sum_v max(w * clean(p[v]) - clean(q[v]), 0) with, in the same pass, *mass_p = sum_v clean(p[v]) and
// *mass_q = sum_v clean(q[v]) (the row-sum check of block verification, no second read of the rows)
double residual_masses_f32(const float* p, const float* q, double w, int64_t n, double* mass_p, double* mass_q);
double residual_masses_bf16(const uint16_t* p, const uint16_t* q, double w, int64_t n, double* mass_p,
                            double* mass_q);

}  // namespace simd
}  // namespace cpu
}  // namespace specadapt
