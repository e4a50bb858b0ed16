// The sampling transform (temperature, top-k, top-p) and coin-driven sampling of the engine, fused on CPU.
// The law of python/specadapt/sampling.py:logits_to_probs, which is the reference:
//   x = logits / T; top-k keeps x >= the k-th largest (ties kept); p = softmax(x); top-p keeps the tokens whose
//   mass ranked strictly before them (probability descending, lower id first on ties) is < top_p; renormalise.
// Greedy (T = 0) is one-hot on the argmax (lowest id on ties). The top-p cut does not sort the vocabulary: a
// 2048-bucket histogram of the probabilities' float bits finds the bucket where the ranked mass crosses top_p,
// and only that bucket is sorted. Masses are summed in double. Rows run in parallel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "native_attention.h"  // exp_inplace

namespace specadapt {
namespace cpu {
namespace {

constexpr int kBucketShift = 20;  // float bits >> 20: sign, 8 exponent bits, 3 mantissa bits
constexpr int kBuckets = 1 << (31 - kBucketShift);

inline uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}

void transform_row(const float* logits, int64_t V, double temperature, int64_t top_k, double top_p, float* out,
                   std::vector<float>& scratch, std::vector<int64_t>& ids) {
  if (temperature == 0.0) {
    int64_t best = 0;
    for (int64_t v = 1; v < V; ++v)
      if (logits[v] > logits[best]) best = v;
    std::fill(out, out + V, 0.f);
    out[best] = 1.f;
    return;
  }
  const float t = static_cast<float>(temperature);
  for (int64_t v = 0; v < V; ++v) out[v] = logits[v] / t;
  if (top_k > 0 && top_k < V) {
    scratch.assign(out, out + V);
    std::nth_element(scratch.begin(), scratch.begin() + (top_k - 1), scratch.end(), std::greater<float>());
    const float kth = scratch[top_k - 1];
    for (int64_t v = 0; v < V; ++v)
      if (out[v] < kth) out[v] = -std::numeric_limits<float>::infinity();
  }
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < V; ++v) top = std::max(top, out[v]);
  for (int64_t v = 0; v < V; ++v) out[v] -= top;
  native::exp_inplace(out, V);
  double total = 0.0;
  for (int64_t v = 0; v < V; ++v) total += out[v];
  const float inv = static_cast<float>(1.0 / total);
  for (int64_t v = 0; v < V; ++v) out[v] *= inv;
  if (top_p >= 1.0) return;
  // bucket masses, highest bucket first
  std::vector<double> mass(kBuckets, 0.0);
  for (int64_t v = 0; v < V; ++v) mass[bits_of(out[v]) >> kBucketShift] += out[v];
  double above = 0.0;
  int boundary = -1;
  for (int b = kBuckets - 1; b >= 0; --b) {
    if (above + mass[b] >= top_p) {
      boundary = b;
      break;
    }
    above += mass[b];
  }
  // keep every token in higher buckets; inside the boundary bucket walk the ranked order
  uint32_t cut_bits = 0;  // tokens with bits > cut_bits (in the boundary bucket) are kept, plus ties by id
  int64_t cut_id = -1;
  if (boundary >= 0) {
    ids.clear();
    for (int64_t v = 0; v < V; ++v)
      if (static_cast<int>(bits_of(out[v]) >> kBucketShift) == boundary) ids.push_back(v);
    std::sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) {
      return out[a] != out[b] ? out[a] > out[b] : a < b;
    });
    double before = above;
    size_t kept = 0;
    while (kept < ids.size() && before < top_p) {
      before += out[ids[kept]];
      ++kept;
    }
    // the last kept token defines the cut: (bits, id) ranked at or before it are kept
    const int64_t last = ids[kept - 1];
    cut_bits = bits_of(out[last]);
    cut_id = last;
  }
  double kept_mass = 0.0;
  for (int64_t v = 0; v < V; ++v) {
    const uint32_t b = bits_of(out[v]);
    const int bucket = static_cast<int>(b >> kBucketShift);
    bool keep;
    if (boundary < 0 || bucket > boundary) {
      keep = true;
    } else if (bucket < boundary) {
      keep = false;
    } else {
      keep = b > cut_bits || (b == cut_bits && v <= cut_id);
    }
    if (keep) {
      kept_mass += out[v];
    } else {
      out[v] = 0.f;
    }
  }
  const float renorm = static_cast<float>(1.0 / kept_mass);
  for (int64_t v = 0; v < V; ++v) out[v] *= renorm;
}

at::Tensor sampling_probs_cpu(const at::Tensor& logits, double temperature, int64_t top_k, double top_p) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2, "logits must be [R, V] float32, got ",
              logits.sizes(), " ", logits.scalar_type());
  TORCH_CHECK(logits.size(1) >= 1, "logits has an empty vocabulary dimension");
  TORCH_CHECK(temperature >= 0.0 && std::isfinite(temperature), "temperature must be finite and >= 0, got ",
              temperature);
  TORCH_CHECK(top_k >= 0, "top_k must be >= 0, got ", top_k);
  TORCH_CHECK(top_p > 0.0 && top_p <= 1.0, "top_p must lie in (0, 1], got ", top_p);
  const at::Tensor x = logits.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({R, V}, x.options());
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    std::vector<int64_t> ids;
    for (int64_t r = begin; r < end; ++r) transform_row(in + r * V, V, temperature, top_k, top_p, o + r * V, scratch, ids);
  });
  return out;
}

at::Tensor sample_tokens_cpu(const at::Tensor& probs, const at::Tensor& uniforms) {
  TORCH_CHECK(probs.scalar_type() == at::kFloat && probs.dim() == 2, "probs must be [R, V] float32, got ",
              probs.sizes(), " ", probs.scalar_type());
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == probs.size(0), "uniforms must be [R] = [", probs.size(0),
              "], got ", uniforms.sizes());
  const at::Tensor p = probs.contiguous();
  const at::Tensor u = uniforms.to(at::kDouble).contiguous();
  const int64_t R = p.size(0), V = p.size(1);
  at::Tensor out = at::empty({R}, probs.options().dtype(at::kLong));
  const float* pp = p.data_ptr<float>();
  const double* uu = u.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(uu[r] >= 0.0 && uu[r] < 1.0, "uniforms must lie in [0, 1)");
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = pp + r * V;
      double total = 0.0;
      int64_t last_positive = -1;
      for (int64_t v = 0; v < V; ++v) {
        if (row[v] > 0.f) {
          total += row[v];
          last_positive = v;
        }
      }
      TORCH_CHECK(last_positive >= 0, "probs row ", r, " has no positive entry: nothing can be sampled");
      const double threshold = uu[r] * total;
      double cum = 0.0;
      int64_t pick = last_positive;
      for (int64_t v = 0; v < V; ++v) {
        if (row[v] > 0.f) {
          cum += row[v];
          if (cum > threshold) {
            pick = v;
            break;
          }
        }
      }
      o[r] = pick;
    }
  });
  return out;
}

}  // namespace
}  // namespace cpu
}  // namespace specadapt

TORCH_LIBRARY_FRAGMENT(specadapt, m) {
  // The sampling transform (python/specadapt/sampling.py): logits [R, V] float32 -> probs [R, V] float32.
  m.def("sampling_probs(Tensor logits, float temperature, int top_k, float top_p) -> Tensor");
  // Inverse-CDF sampling with given coins: probs [R, V] float32, uniforms [R] in [0, 1) -> ids [R] int64 (the
  // smallest id whose cumulative mass exceeds u * total; zero-probability ids are never chosen).
  m.def("sample_tokens(Tensor probs, Tensor uniforms) -> Tensor");
}

TORCH_LIBRARY_IMPL(specadapt, CPU, m) {
  m.impl("sampling_probs", &specadapt::cpu::sampling_probs_cpu);
  m.impl("sample_tokens", &specadapt::cpu::sample_tokens_cpu);
}
