// Weight-only quantised linear layers of the native forward (python/specadapt/engine/native/): one weight
// matrix W [N, K] in one of four formats, activations always float32.
//
//   F32   data [N, K] float32
//   BF16  data [N, K] bfloat16 (raw 16-bit patterns)
//   Q8_0  w = d * q,      q int8, d float16 per block of 32 along K        (GGUF / llama.cpp Q8_0 blocks)
//   Q4_1  w = d * q + m,  q in [0, 15], d and m float16 per block of 32    (GGUF Q4_1 blocks)
//
// Block formats are stored in a 16-row interleaved layout (G = ceil(N / 16) groups of 16 rows, nb = K / 32):
//   Q8_0  data [G, nb * 512] int8: in (group, block) chunk c (0..7) of 64 bytes, bytes 4r..4r+3 are codes
//         4c..4c+3 of the group's row r;
//   Q4_1  data [G, nb * 256] uint8: in (group, block) vector i (0..3) of 64 bytes, byte 4r + j holds code 4i + j of
//         row r in its low nibble and code 16 + 4i + j in its high nibble;
//   scales (and mins) [G, nb * 16] float16, row r of the group at (block * 16 + r).
// Rows past N in the last group are padding (zero codes and scales). F32 / BF16 are plain row-major.
//
// y[m, n] = sum_k x[m, k] * w[n, k]. F32 / BF16 accumulate each output in the same order whatever M is (4 partial
// sums over 16-float chunks, a fixed reduction); the block formats quantise the activations to 8 bits
// (native_qdot.cpp). Either way a row's result does not depend on the other rows of the call: a verify chunk gives
// the bits single-token decoding gives, and a request's logits do not depend on the batch it runs in.
#pragma once
#include <cstdint>

namespace specadapt {
namespace cpu {
namespace native {

enum WeightFormat : int64_t { kF32 = 0, kBF16 = 1, kQ8_0 = 2, kQ4_1 = 3 };
constexpr int64_t kBlock = 32;

struct WeightView {
  int64_t format = kF32;
  int64_t rows = 0;  // N
  int64_t cols = 0;  // K
  const void* data = nullptr;
  const uint16_t* scales = nullptr;  // float16 bits, [N, K/32]
  const uint16_t* mins = nullptr;    // float16 bits, [N, K/32] (Q4_1 only)
};

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T for F32 / BF16 weights, rows of W split over the
// intra-op threads.
void linear(const float* x, int64_t M, int64_t ldx, const WeightView& w, float* y, int64_t ldy);

// The same for Q8_0 / Q4_1 weights, each activation row quantised to 8 bits per block of 32 and integer dot
// products (native_qdot.cpp): the only rounding that differs from the float32 model is that of the activations.
void linear_q8_activations(const float* x, int64_t M, int64_t ldx, const WeightView& w, float* y, int64_t ldy);

// Code q of entry (n, k) of a block-format weight (interleaved layout).
int32_t block_code(const WeightView& w, int64_t n, int64_t k);

// Row n of W, dequantised into out[K].
void dequantize_row(const WeightView& w, int64_t n, float* out);

}  // namespace native
}  // namespace cpu
}  // namespace specadapt
