// The decoder stack of the native forward on CPU (python/specadapt/engine/native/): Llama-family layers (Llama,
// Mistral without a sliding window, Qwen2's q/k/v biases, Qwen3's per-head q/k norms) over a slot-based static
// KV cache, in one op so a forward costs a handful of dispatches instead of ~15 per layer.
//
// Tokens are packed: row t of `hidden` [N, h] is one token of some request, with
//   slot[t]      the cache slot (request) it belongs to,
//   index[t]     the cache index its keys / values are written at (physical),
//   position[t]  its RoPE position (logical: a token-tree node's depth, not its index),
//   visible[t]   it attends to indices [0, visible[t]) of its slot, and, when tree_mask[t] != 0, to the indices
//                tree_base[t] + j for every bit j of tree_mask[t] (a token tree: its ancestors and itself).
// Every token's keys / values are written before any attention of the layer runs, so a chunk attends to itself.
// Per layer (HF Llama semantics): x += o(attn(rope(qkv(rms(x))))); x += down(silu(gate) * up)(rms(x)).
// Each (token, head) attention and each linear output is computed by the same instructions whatever else is in
// the call, so a request's values do not depend on the other tokens of the forward.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "native_attention.h"
#include "native_linear.h"
#include "native_rowops.h"


namespace specadapt {
namespace cpu {
namespace native {
namespace {

// Per layer: 7 weights as (data, scales, mins) triples: q, k, v, o, gate, up, down (k / v and up may be absent
// when q / gate hold the fused q/k/v / gate/up matrix), then norm1, norm2, q_norm, k_norm, qkv_bias.
constexpr int64_t kWeightsPerLayer = 7;
constexpr int64_t kTensorsPerLayer = 3 * kWeightsPerLayer + 5;

// Optional per-phase wall-clock totals (native_phase_times), off unless native_set_profiling(true).
enum Phase { kNorms = 0, kQkv, kAttention, kOut, kGateUp, kActivation, kDown, kPhases };
std::atomic<bool> g_profiling{false};
double g_phase_seconds[kPhases] = {0};

struct PhaseTimer {
  std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
  void lap(Phase p) {
    if (!g_profiling.load(std::memory_order_relaxed)) return;
    const auto now = std::chrono::steady_clock::now();
    g_phase_seconds[p] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

// One linear layer: one weight, or several (a fused q/k/v or gate/up whose parts are stored in different formats)
// whose outputs are concatenated.
struct Linear {
  std::vector<WeightView> parts;
  int64_t rows = 0, cols = 0;
  bool int8_activations = false;
  void operator()(const float* x, int64_t M, float* y) const {
    if (int8_activations) {
      linear_q8_activations_parts(x, M, cols, parts.data(), static_cast<int64_t>(parts.size()), y, rows);
    } else {
      linear(x, M, cols, parts[0], y, rows);
    }
  }
};

struct Layer {
  Linear qkv, o, gate_up, down;
  const float* norm1 = nullptr;
  const float* norm2 = nullptr;
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  const float* qkv_bias = nullptr;
};

const float* float_ptr(const c10::optional<at::Tensor>& t, int64_t numel, const char* what) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == numel, what,
              " must be a contiguous float32 tensor of ", numel, " elements, got ", t->sizes(), " ", t->scalar_type());
  return t->data_ptr<float>();
}

WeightView make_weight(const std::vector<c10::optional<at::Tensor>>& w, int64_t base, int64_t format, int64_t rows,
                       int64_t cols, const char* what) {
  TORCH_CHECK(w[base].has_value() && w[base]->defined(), what, " weight data is missing");
  const at::Tensor& data = w[base].value();
  TORCH_CHECK(data.is_contiguous() && data.dim() == 2, what, " data must be a contiguous 2-D tensor");
  WeightView v;
  v.format = format;
  v.rows = rows;
  v.cols = cols;
  v.data = data.data_ptr();
  if (format == kF32 || format == kBF16) {
    TORCH_CHECK(data.size(0) == rows && data.size(1) == cols &&
                    data.scalar_type() == (format == kF32 ? at::kFloat : at::kBFloat16),
                what, " must be [", rows, ", ", cols, "] ", format == kF32 ? "float32" : "bfloat16", ", got ",
                data.sizes(), " ", data.scalar_type());
    return v;
  }
  if (is_k_format(format)) {
    v = kquant_view(data, w[base + 1], w[base + 2], format, rows);
    TORCH_CHECK(v.cols == cols, what, ": a ", format == kQ4_K ? "Q4_K" : "Q6_K", " weight of K = ", v.cols,
                " where ", cols, " is needed");
    return v;
  }
  TORCH_CHECK(format == kQ8_0 || format == kQ4_1, what, ": unknown format ", format);
  const int64_t groups = (rows + 15) / 16, nb = cols / kBlock;
  TORCH_CHECK(cols % kBlock == 0 && data.size(0) == groups && data.size(1) == nb * (format == kQ8_0 ? 512 : 256) &&
                  data.scalar_type() == (format == kQ8_0 ? at::kChar : at::kByte),
              what, ": block data must be [", groups, ", ", nb * (format == kQ8_0 ? 512 : 256), "] for a ", rows, " x ",
              cols, " matrix, got ", data.sizes(), " ", data.scalar_type());
  for (int64_t part = 1; part <= (format == kQ4_1 ? 2 : 1); ++part) {
    TORCH_CHECK(w[base + part].has_value() && w[base + part]->defined(), what, " scales / mins are missing");
    const at::Tensor& t = w[base + part].value();
    TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous() && t.numel() == groups * nb * 16, what,
                " scales / mins must be contiguous float16 [G, nb * 16]");
    (part == 1 ? v.scales : v.mins) = reinterpret_cast<const uint16_t*>(t.data_ptr());
  }
  return v;
}

bool present(const std::vector<c10::optional<at::Tensor>>& w, int64_t base) {
  return w[base].has_value() && w[base]->defined();
}

// A linear layer of `rows` outputs from the weight triples at `first`, `first + 3`, ... (`count` parts of
// `part_rows` rows each), or from the first alone when the others are absent (a fused matrix of all rows).
Linear make_linear(const std::vector<c10::optional<at::Tensor>>& w, int64_t first, const int64_t* formats,
                   const std::vector<int64_t>& part_rows, int64_t cols, const char* what) {
  Linear lin;
  lin.cols = cols;
  for (int64_t r : part_rows) lin.rows += r;
  bool fused = true;
  for (size_t p = 1; p < part_rows.size(); ++p) fused = fused && !present(w, first + 3 * static_cast<int64_t>(p));
  if (fused) {
    lin.parts.push_back(make_weight(w, first, formats[0], lin.rows, cols, what));
  } else {
    for (size_t p = 0; p < part_rows.size(); ++p)
      lin.parts.push_back(make_weight(w, first + 3 * static_cast<int64_t>(p), formats[p], part_rows[p], cols, what));
  }
  const bool block = is_block_format(lin.parts[0].format);
  for (const WeightView& v : lin.parts)
    TORCH_CHECK(is_block_format(v.format) == block, what, ": parts mix float and block formats");
  TORCH_CHECK(block || lin.parts.size() == 1, what, ": float formats must be fused into one matrix");
  lin.int8_activations = block;
  return lin;
}

std::vector<at::Tensor> native_llama_forward_cpu(
    const at::Tensor& hidden, const std::vector<c10::optional<at::Tensor>>& weights, at::IntArrayRef formats,
    const c10::optional<at::Tensor>& final_norm, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& slot, const at::Tensor& index, const at::Tensor& position, const at::Tensor& visible,
    const at::Tensor& tree_base, const at::Tensor& tree_mask, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
    at::IntArrayRef capture, double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t intermediate, double attn_scale, const c10::optional<at::Tensor>& out_rows) {
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2, "hidden must be [N, h] float32, got ",
              hidden.sizes(), " ", hidden.scalar_type());
  const int64_t N = hidden.size(0), hid = hidden.size(1);
  const int64_t L = static_cast<int64_t>(formats.size()) / kWeightsPerLayer;
  TORCH_CHECK(static_cast<int64_t>(formats.size()) == kWeightsPerLayer * L &&
                  static_cast<int64_t>(weights.size()) == kTensorsPerLayer * L,
              "weights must hold ", kTensorsPerLayer, " entries per layer and formats ", kWeightsPerLayer, ", got ",
              weights.size(), " and ", formats.size());
  const int64_t H = num_heads, Hkv = num_kv_heads, D = head_dim, I = intermediate;
  TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0 && D % 2 == 0, "bad head layout: heads ", H, ", kv heads ", Hkv,
              ", head_dim ", D);
  const bool half_cache = v_cache.scalar_type() == at::kHalf;
  TORCH_CHECK((v_cache.scalar_type() == at::kFloat || half_cache) && v_cache.dim() == 5 && v_cache.is_contiguous() &&
                  v_cache.size(0) >= L && v_cache.size(2) == Hkv && v_cache.size(4) == D &&
                  v_cache.size(3) % kKeyTile == 0,
              "v_cache must be contiguous float32 / float16 [layers, slots, kv_heads, capacity, head_dim] with capacity a multiple "
              "of 16 (", L, " layers, ", Hkv, " kv heads, head_dim ", D, "), got ", v_cache.sizes());
  const int64_t S = v_cache.size(1), C = v_cache.size(3);
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() &&
                  k_cache.sizes() == at::IntArrayRef({v_cache.size(0), S, Hkv, C / kKeyTile, D, kKeyTile}),
              "k_cache must be contiguous, of v_cache's dtype, [layers, slots, kv_heads, capacity/16, head_dim, 16], got ",
              k_cache.sizes());
  for (const at::Tensor* t : {&slot, &index, &position, &visible, &tree_base, &tree_mask})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == N && t->is_contiguous(),
                "token metadata must be contiguous int64 [N] tensors");
  TORCH_CHECK(rope_cos.scalar_type() == at::kFloat && rope_cos.dim() == 2 && rope_cos.size(1) == D &&
                  rope_sin.sizes() == rope_cos.sizes() && rope_cos.is_contiguous() && rope_sin.is_contiguous(),
              "rope_cos / rope_sin must be contiguous float32 [P, head_dim]");
  const int64_t* positions = position.data_ptr<int64_t>();
  AttentionMeta meta{slot.data_ptr<int64_t>(), index.data_ptr<int64_t>(), visible.data_ptr<int64_t>(),
                     tree_base.data_ptr<int64_t>(), tree_mask.data_ptr<int64_t>()};
  const int64_t P = rope_cos.size(0);
  for (int64_t t = 0; t < N; ++t) {
    TORCH_CHECK(meta.slot[t] >= 0 && meta.slot[t] < S, "slot ", meta.slot[t], " outside [0, ", S, ")");
    TORCH_CHECK(meta.index[t] >= 0 && meta.index[t] < C, "cache index ", meta.index[t], " outside the capacity ", C);
    TORCH_CHECK(positions[t] >= 0 && positions[t] < P, "position ", positions[t], " outside the RoPE table (",
                P, ")");
    TORCH_CHECK(meta.visible[t] >= 0 && meta.visible[t] <= C, "visible length ", meta.visible[t], " outside [0, ", C, "]");
    if (meta.tree_mask[t] != 0) {
      TORCH_CHECK(meta.tree_base[t] >= 0, "tree_base must be >= 0, got ", meta.tree_base[t]);
      const uint64_t bits = static_cast<uint64_t>(meta.tree_mask[t]);
      const int top = 63 - __builtin_clzll(bits);
      TORCH_CHECK(meta.tree_base[t] + top < C, "tree_mask reaches past the cache capacity");
    }
  }
  std::vector<Layer> layers(L);
  const int64_t qkv_rows = (H + 2 * Hkv) * D;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t b = l * kTensorsPerLayer;
    Layer& ly = layers[l];
    const int64_t* f = formats.data() + kWeightsPerLayer * l;
    ly.qkv = make_linear(weights, b + 0, f + 0, {H * D, Hkv * D, Hkv * D}, hid, "qkv");
    ly.o = make_linear(weights, b + 9, f + 3, {hid}, H * D, "o_proj");
    ly.gate_up = make_linear(weights, b + 12, f + 4, {I, I}, hid, "gate_up");
    ly.down = make_linear(weights, b + 18, f + 6, {hid}, I, "down_proj");
    const int64_t n = b + 3 * kWeightsPerLayer;
    ly.norm1 = float_ptr(weights[n + 0], hid, "input_layernorm");
    ly.norm2 = float_ptr(weights[n + 1], hid, "post_attention_layernorm");
    TORCH_CHECK(ly.norm1 && ly.norm2, "every layer needs its two norm weights");
    ly.q_norm = float_ptr(weights[n + 2], D, "q_norm");
    ly.k_norm = float_ptr(weights[n + 3], D, "k_norm");
    ly.qkv_bias = float_ptr(weights[n + 4], qkv_rows, "qkv_bias");
  }
  const float* fnorm = float_ptr(final_norm, hid, "final_norm");
  for (int64_t c : capture) TORCH_CHECK(c >= 0 && c < L, "capture layer ", c, " outside [0, ", L, ")");
  // out_rows: the tokens whose outputs are read. Every token's keys / values are still written in every layer,
  // but the last layer's attention, o_proj and MLP run for these rows only (the others' outputs would be
  // dropped), and x / normed come back as [M, h] in out_rows order.
  std::vector<int64_t> outs;
  if (out_rows.has_value()) {
    const at::Tensor& r = *out_rows;
    TORCH_CHECK(r.scalar_type() == at::kLong && r.dim() == 1 && r.is_contiguous(), "out_rows must be int64 [M]");
    TORCH_CHECK(L > 0, "out_rows needs at least one layer");
    const int64_t* rp = r.data_ptr<int64_t>();
    for (int64_t i = 0; i < r.size(0); ++i) {
      TORCH_CHECK(rp[i] >= 0 && rp[i] < N, "out_rows entry ", rp[i], " outside [0, ", N, ")");
      TORCH_CHECK(i == 0 || rp[i] > rp[i - 1], "out_rows must be strictly increasing");
      outs.push_back(rp[i]);
    }
  }
  const bool compact = out_rows.has_value();
  const int64_t M = compact ? static_cast<int64_t>(outs.size()) : N;
  const int64_t m_meta = compact ? M : 0;
  std::vector<int64_t> c_slot(m_meta), c_index(m_meta), c_visible(m_meta), c_base(m_meta), c_mask(m_meta);
  for (int64_t i = 0; compact && i < M; ++i) {
    const int64_t t = outs[i];
    c_slot[i] = meta.slot[t], c_index[i] = meta.index[t], c_visible[i] = meta.visible[t];
    c_base[i] = meta.tree_base[t], c_mask[i] = meta.tree_mask[t];
  }
  const AttentionMeta meta_out{c_slot.data(), c_index.data(), c_visible.data(), c_base.data(), c_mask.data()};

  at::Tensor x = hidden.contiguous().clone();
  float* xp = x.data_ptr<float>();
  std::vector<float> h(N * hid), qkv(N * qkv_rows), attn(N * H * D), gu(N * 2 * I), act(N * I), proj(N * hid);
  std::vector<at::Tensor> captured;
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t entry = half_cache ? 2 : 4;
  const float* cosp = rope_cos.data_ptr<float>();
  const float* sinp = rope_sin.data_ptr<float>();
  const float scale = static_cast<float>(attn_scale);
  PhaseTimer timer;
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t c : capture)
      if (c == l) captured.push_back(x.clone());
    const Layer& ly = layers[l];
    timer.lap(kNorms);
    rms_norm_rows(xp, ly.norm1, N, hid, hid, hid, eps, h.data());
    timer.lap(kNorms);
    ly.qkv(h.data(), N, qkv.data());
    timer.lap(kQkv);
    char* kc_l = kc + l * S * Hkv * C * D * entry;
    char* vc_l = vc + l * S * Hkv * C * D * entry;
    for (int64_t t = 0; t < N; ++t) {
      float* row = qkv.data() + t * qkv_rows;
      if (ly.qkv_bias) add_inplace(row, ly.qkv_bias, qkv_rows);
      if (ly.q_norm) rms_norm_rows(row, ly.q_norm, H, D, D, D, eps, row);
      if (ly.k_norm) rms_norm_rows(row + H * D, ly.k_norm, Hkv, D, D, D, eps, row + H * D);
      const float* cr = cosp + positions[t] * D;
      const float* sr = sinp + positions[t] * D;
      rope_heads(row, H + Hkv, cr, sr, D);
      write_kv(row + H * D, row + (H + Hkv) * D, meta, t, Hkv, C, D, kc_l, vc_l, half_cache);
    }
    timer.lap(kNorms);
    int64_t n = N;
    const AttentionMeta* lm = &meta;
    if (compact && l == L - 1) {  // the last layer past the cache writes: the read rows only, packed in order
      at::Tensor xc = at::empty({M, hid}, x.options());
      float* xcp = xc.data_ptr<float>();
      for (int64_t i = 0; i < M; ++i) {
        const int64_t t = outs[i];
        std::copy(qkv.data() + t * qkv_rows, qkv.data() + (t + 1) * qkv_rows, qkv.data() + i * qkv_rows);
        std::copy(xp + t * hid, xp + (t + 1) * hid, xcp + i * hid);
      }
      x = xc;
      xp = xcp;
      n = M;
      lm = &meta_out;
    }
    attention(qkv.data(), qkv_rows, kc_l, vc_l, *lm, n, H, Hkv, C, D, scale, attn.data(), half_cache);
    timer.lap(kAttention);
    ly.o(attn.data(), n, proj.data());
    timer.lap(kOut);
    add_inplace(xp, proj.data(), n * hid);
    rms_norm_rows(xp, ly.norm2, n, hid, hid, hid, eps, h.data());
    timer.lap(kNorms);
    ly.gate_up(h.data(), n, gu.data());
    timer.lap(kGateUp);
    silu_mul_rows(gu.data(), n, I, act.data());
    timer.lap(kActivation);
    ly.down(act.data(), n, proj.data());
    timer.lap(kDown);
    add_inplace(xp, proj.data(), n * hid);
  }
  std::vector<at::Tensor> outputs{x};
  if (fnorm) {
    at::Tensor normed = at::empty_like(x);
    rms_norm_rows(xp, fnorm, x.size(0), hid, hid, hid, eps, normed.data_ptr<float>());
    outputs.push_back(normed);
  }
  for (auto& c : captured) outputs.push_back(c);
  return outputs;
}

}  // namespace

void native_set_profiling(bool on) {
  g_profiling.store(on);
  for (double& v : g_phase_seconds) v = 0.0;
}

std::vector<double> native_phase_times() { return std::vector<double>(g_phase_seconds, g_phase_seconds + kPhases); }

}  // namespace native
}  // namespace cpu
}  // namespace specadapt

TORCH_LIBRARY_FRAGMENT(specadapt, m) {
  // The Llama-family decoder stack over a slot KV cache (native_llama.cpp): packed tokens hidden [N, h] float32;
  // weights: 26 optional tensors per layer (q, k, v, o, gate, up, down as data / scales / mins, k / v / up absent
  // when q / gate hold the fused matrix; input and post-attention norms; q_norm, k_norm, qkv_bias); formats: 7
  // per layer; k_cache / v_cache
  // [layers, slots, kv_heads, capacity, head_dim] float32 or float16 (written at index[t]); token metadata [N] int64;
  // rope_cos / rope_sin [P, head_dim]; out_rows [M] int64: compute the last layer past its cache writes for these
  // tokens only. Returns [x after the last layer ([N, h], or [M, h] in out_rows order), final_norm(x) when given,
  // the input of each layer in `capture`].
  m.def("native_llama_forward(Tensor hidden, Tensor?[] weights, int[] formats, Tensor? final_norm, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot, Tensor index, Tensor position, Tensor visible, Tensor tree_base, "
        "Tensor tree_mask, Tensor rope_cos, Tensor rope_sin, int[] capture, float eps, int num_heads, "
        "int num_kv_heads, int head_dim, int intermediate, float attn_scale, Tensor? out_rows=None) -> Tensor[]");
  // Per-phase seconds of native_llama_forward since profiling was switched on (and reset):
  // [norms / rope / cache writes, qkv, attention, o_proj, gate_up, activation, down_proj].
  m.def("native_set_profiling(bool on) -> ()", &specadapt::cpu::native::native_set_profiling);
  m.def("native_phase_times() -> float[]", &specadapt::cpu::native::native_phase_times);
}

TORCH_LIBRARY_IMPL(specadapt, CPU, m) {
  m.impl("native_llama_forward", &specadapt::cpu::native::native_llama_forward_cpu);
}
