// Weight-only quantised linear layers of the native forward (python/specadapt/engine/native/): one weight
// matrix W [N, K] in one of four formats, activations always float32.
//
//   F32   data [N, K] float32
//   BF16  data [N, K] bfloat16 (raw 16-bit patterns)
//   Q8_0  w = d * q,      q int8, d float16 per block of 32 along K        (GGUF / llama.cpp Q8_0 blocks)
//   Q4_1  w = d * q + m,  q in [0, 15], d and m float16 per block of 32    (GGUF Q4_1 blocks)
//   Q4_K  w = (d * sc) * q - (dmin * m), q in [0, 15]; per super-block of 256: d, dmin float16; per sub-block
//         of 32: 6-bit sc, m (GGUF / llama.cpp Q4_K, de-quantised with the products in float32 as ggml does)
//   Q6_K  w = (d * sc) * (q - 32), q in [0, 63]; per super-block of 256: d float16; per 16 values: int8 sc
//         (GGUF Q6_K)
//
// Block formats are stored in a 16-row interleaved layout (G = ceil(N / 16) groups of 16 rows, nb = K / 32):
//   Q8_0  data [G, nb * 512] int8: in (group, block) chunk c (0..7) of 64 bytes, bytes 4r..4r+3 are codes
//         4c..4c+3 of the group's row r;
//   Q4_1  data [G, nb * 256] uint8: in (group, block) vector i (0..3) of 64 bytes, byte 4r + j holds code 4i + j of
//         row r in its low nibble and code 16 + 4i + j in its high nibble;
//   scales (and mins) [G, nb * 16] float16, row r of the group at (block * 16 + r);
//   Q4_K  data as Q4_1 (per block of 32 of a super-block); scales [G, nsb * 32] float16: super-block s holds
//         d of rows 0..15 at s * 32 + r and dmin at s * 32 + 16 + r (nsb = K / 256); sub [G, nb * 32] uint8:
//         block b holds sc of row r at b * 32 + r and m at b * 32 + 16 + r;
//   Q6_K  data [G, nb * 384] uint8: per (group, block) the low 4 bits of the codes in the Q4_1 layout (256
//         bytes), then two 64-byte planes of high bits: byte 4r + j of plane p holds, in bits 2i..2i+1, the high
//         2 bits of code 4 * (4p + i) + j of row r (i = 0..3); scales [G, nsb * 16] float16 (d of row r of
//         super-block s at s * 16 + r); sub [G, nb * 32] int8: block b holds sc of its first 16 values of row r
//         at b * 32 + r and of its last 16 at b * 32 + 16 + r.
// Rows past N in the last group are padding (zero codes and scales). F32 / BF16 are plain row-major.
//
// y[m, n] = sum_k x[m, k] * w[n, k]. F32 / BF16 accumulate each output in the same order whatever M is (4 partial
// sums over 16-float chunks, a fixed reduction); the block formats quantise the activations to 8 bits
// (native_qdot.cpp). Either way a row's result does not depend on the other rows of the call: a verify chunk gives
// the bits single-token decoding gives, and a request's logits do not depend on the batch it runs in.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

namespace specadapt {
namespace cpu {
namespace native {

enum WeightFormat : int64_t { kF32 = 0, kBF16 = 1, kQ8_0 = 2, kQ4_1 = 3, kQ4_K = 4, kQ6_K = 5 };
constexpr int64_t kBlock = 32;
constexpr int64_t kSuperBlock = 256;

inline bool is_block_format(int64_t f) { return f == kQ8_0 || f == kQ4_1 || f == kQ4_K || f == kQ6_K; }
inline bool is_k_format(int64_t f) { return f == kQ4_K || f == kQ6_K; }
// Bytes of codes per (group of 16 rows, block of 32).
inline int64_t block_data_bytes(int64_t f) { return f == kQ8_0 ? 512 : f == kQ6_K ? 384 : 256; }

struct WeightView {
  int64_t format = kF32;
  int64_t rows = 0;  // N
  int64_t cols = 0;  // K
  const void* data = nullptr;
  const uint16_t* scales = nullptr;  // float16 bits, [N, K/32]
  const uint16_t* mins = nullptr;    // float16 bits, [N, K/32] (Q4_1 only)
  const uint8_t* sub = nullptr;      // Q4_K / Q6_K sub-block scales (and Q4_K minimums), see above
};

// One linear layer whose output rows are the concatenation of several weights of the same K (a fused q/k/v or
// gate/up whose parts are stored in different formats): the activations are quantised once for all parts.
void linear_q8_activations_parts(const float* x, int64_t M, int64_t ldx, const WeightView* parts, int64_t nparts,
                                 float* y, int64_t ldy);

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T for F32 / BF16 weights, rows of W split over the
// intra-op threads.
void linear(const float* x, int64_t M, int64_t ldx, const WeightView& w, float* y, int64_t ldy);

// The same for the block formats (Q8_0, Q4_1, Q4_K, Q6_K), each activation row quantised to 8 bits per block of 32 and integer dot
// products (native_qdot.cpp): the only rounding that differs from the float32 model is that of the activations.
void linear_q8_activations(const float* x, int64_t M, int64_t ldx, const WeightView& w, float* y, int64_t ldy);

// The view of a Q4_K / Q6_K weight from its tensors (data, scales, sub-block scales), checked; errors name the
// format and the expected shapes.
WeightView kquant_view(const at::Tensor& data, const c10::optional<at::Tensor>& scales,
                       const c10::optional<at::Tensor>& sub, int64_t format, int64_t rows);

// Code q of entry (n, k) of a block-format weight (interleaved layout).
int32_t block_code(const WeightView& w, int64_t n, int64_t k);

// Row n of W, dequantised into out[K].
void dequantize_row(const WeightView& w, int64_t n, float* out);

}  // namespace native
}  // namespace cpu
}  // namespace specadapt
