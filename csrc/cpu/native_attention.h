// Attention of packed tokens over the slot KV cache of the native forward (native_attention.cpp).
//
// Cache layout per layer: keys [slots, kv_heads, capacity/16, head_dim, 16] (tiles of 16 positions stored
// transposed, so 16 scores are one vector FMA chain over head_dim), values [slots, kv_heads, capacity, head_dim].
// Entries are float32, or float16 (`half_cache`: half the bytes to read; values rounded to 11 significant bits,
// computed in float32 after loading).
#pragma once
#include <cstdint>

namespace specadapt {
namespace cpu {
namespace native {

constexpr int64_t kKeyTile = 16;

struct AttentionMeta {
  const int64_t* slot;       // [N] cache slot of each token
  const int64_t* index;      // [N] cache index its key / value is written at
  const int64_t* visible;    // [N] it sees indices [0, visible) ...
  const int64_t* tree_base;  // [N] ... and tree_base + j for each bit j of tree_mask
  const int64_t* tree_mask;  // [N]
};

// x[i] = exp(x[i]) with the vectorised exp of the attention softmax (relative error ~1e-7).
void exp_inplace(float* x, int64_t n);

// Write token t's key [Hkv, D] and value [Hkv, D] into the layer's caches at (slot[t], index[t]).
void write_kv(const float* key, const float* value, const AttentionMeta& meta, int64_t t, int64_t Hkv, int64_t C,
              int64_t D, void* k_layer, void* v_layer, bool half_cache);

// out [N, H, D] = softmax(scale * q k^T) v over each token's visible keys; q rows have stride ldq.
void attention(const float* q, int64_t ldq, const void* k_layer, const void* v_layer, const AttentionMeta& meta,
               int64_t N, int64_t H, int64_t Hkv, int64_t C, int64_t D, float scale, float* out, bool half_cache);

}  // namespace native
}  // namespace cpu
}  // namespace specadapt
