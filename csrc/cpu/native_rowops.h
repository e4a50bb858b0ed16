// Per-token row operations of the native decoder stack (native_llama.cpp): RMS norm, the SiLU-gated product of
// the MLP, rotary embeddings, bias and residual adds. Vectorised for the active instruction set (AVX-512, AVX2,
// portable C++; native_set_isa). Every element goes through the same float operations as the portable loop in
// the same order (no fused multiply-adds, ffp-contract=off), except the RMS norm's mean square (a double sum
// whose order depends on the vector width) and the SiLU's exp (exp_inplace: a polynomial on vector lanes,
// std::exp on the portable path and in the AVX2 tail); a row's result never depends on the other rows of a call.
#pragma once
#include <cstdint>

namespace specadapt {
namespace cpu {
namespace native {

// out[r, i] = weight[i] * (x[r, i] * rsqrt(mean_i x[r, i]^2 + eps)) for `rows` rows of `dim` (strides ld_in /
// ld_out; out may alias x). The mean square is summed and kept in double; 1 / sqrt(mean + eps) is cast to float
// once.
void rms_norm_rows(const float* x, const float* weight, int64_t rows, int64_t dim, int64_t ld_in, int64_t ld_out,
                   double eps, float* out);

// act[r, i] = silu(gu[r, i]) * gu[r, I + i] = (g / (1 + exp(-g))) * u for `rows` rows of [gate | up] (2I floats)
// into rows of I floats; exp is the attention softmax's vectorised exp (exp_inplace).
void silu_mul_rows(const float* gu, int64_t rows, int64_t I, float* act);

// HF rotate_half RoPE of `heads` consecutive head vectors of D floats in place; cos / sin rows of D floats.
void rope_heads(float* v, int64_t heads, const float* cos, const float* sin, int64_t D);

// x[i] += y[i] for i < n.
void add_inplace(float* x, const float* y, int64_t n);

}  // namespace native
}  // namespace cpu
}  // namespace specadapt
