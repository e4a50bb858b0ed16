// The sampling transform (temperature, top-k, top-p) and coin-driven sampling of the engine, fused on CPU.
// The law of python/specadapt/sampling.py:logits_to_probs, which is the reference:
//   x = logits / T; top-k keeps x >= the k-th largest (ties kept); p = softmax(x); top-p keeps the tokens whose
//   mass ranked strictly before them (probability descending, lower id first on ties) is < top_p; renormalise.
// Greedy (T = 0) is one-hot on the argmax (lowest id on ties). The top-p cut does not sort the vocabulary: a
// 2048-bucket histogram of the probabilities' float bits finds the bucket where the ranked mass crosses top_p,
// and only that bucket is sorted. Masses are summed in double. Rows run in parallel; the full-vocabulary passes
// use AVX2 where the CPU has it (native_set_isa picks, as for the other kernels).
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

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SA_SAMP_X86 1
#define SA_SAMP2 __attribute__((target("avx2,fma")))
#else
#define SA_SAMP_X86 0
#endif

namespace specadapt {
namespace cpu {
namespace native {
int active_isa_value();  // native_linear.cpp: 0 scalar, 1 AVX2, 2 AVX-512
}  // namespace native
namespace {

constexpr int kBucketShift = 20;  // float bits >> 20: sign, 8 exponent bits, 3 mantissa bits
constexpr int kBuckets = 1 << (31 - kBucketShift);

inline uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}

// The full-vocabulary passes of transform_row, portable and AVX2 (used on AVX2 and AVX-512 CPUs). Division and
// max are exact in any order; the double sums run in 4 lanes (a different order than one scalar chain, so the
// masses can differ from the portable path's in the last bits of a double).
struct RowPasses {
  // out[v] = logits[v] / t; returns max(out)
  float (*scale_max)(const float* logits, int64_t V, float t, float* out);
  // out[v] = exp(out[v] - top); returns the sum in double
  double (*exp_sum)(float* out, int64_t V, float top);
  // out[v] *= f
  void (*scale)(float* out, int64_t V, float f);
  // zero out[v] unless bits(out[v]) > cut_bits or (== cut_bits and v <= cut_id); returns the kept mass
  double (*cut)(float* out, int64_t V, uint32_t cut_bits, int64_t cut_id);
};

float scale_max_scalar(const float* logits, int64_t V, float t, float* out) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < V; ++v) {
    out[v] = logits[v] / t;
    top = std::max(top, out[v]);
  }
  return top;
}

double exp_sum_scalar(float* out, int64_t V, float top) {
  for (int64_t v = 0; v < V; ++v) out[v] -= top;
  native::exp_inplace(out, V);
  double total = 0.0;
  for (int64_t v = 0; v < V; ++v) total += out[v];
  return total;
}

void scale_scalar(float* out, int64_t V, float f) {
  for (int64_t v = 0; v < V; ++v) out[v] *= f;
}

double cut_scalar(float* out, int64_t V, uint32_t cut_bits, int64_t cut_id) {
  double kept = 0.0;
  for (int64_t v = 0; v < V; ++v) {
    const uint32_t b = bits_of(out[v]);
    if (b > cut_bits || (b == cut_bits && v <= cut_id)) {
      kept += out[v];
    } else {
      out[v] = 0.f;
    }
  }
  return kept;
}

#if SA_SAMP_X86
SA_SAMP2 float scale_max_avx2(const float* logits, int64_t V, float t, float* out) {
  const __m256 vt = _mm256_set1_ps(t);
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 x = _mm256_div_ps(_mm256_loadu_ps(logits + v), vt);
    _mm256_storeu_ps(out + v, x);
    best = _mm256_max_ps(best, x);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  float top = scale_max_scalar(logits + v, V - v, t, out + v);  // the tail (-inf when there is none)
  for (int i = 0; i < 8; ++i) top = std::max(top, lanes[i]);
  return top;
}

SA_SAMP2 inline __m256d widen_sum(__m256d acc, __m256 x) {
  return _mm256_add_pd(_mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_castps256_ps128(x))),
                       _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
}

SA_SAMP2 inline double hsum_pd(__m256d acc) {
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, acc);
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

SA_SAMP2 double exp_sum_avx2(float* out, int64_t V, float top) {
  const __m256 vtop = _mm256_set1_ps(top);
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) _mm256_storeu_ps(out + v, _mm256_sub_ps(_mm256_loadu_ps(out + v), vtop));
  for (; v < V; ++v) out[v] -= top;
  native::exp_inplace(out, V);
  __m256d acc = _mm256_setzero_pd();
  for (v = 0; v + 8 <= V; v += 8) acc = widen_sum(acc, _mm256_loadu_ps(out + v));
  double total = hsum_pd(acc);
  for (; v < V; ++v) total += out[v];
  return total;
}

SA_SAMP2 void scale_avx2(float* out, int64_t V, float f) {
  const __m256 vf = _mm256_set1_ps(f);
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) _mm256_storeu_ps(out + v, _mm256_mul_ps(_mm256_loadu_ps(out + v), vf));
  scale_scalar(out + v, V - v, f);
}

SA_SAMP2 double cut_avx2(float* out, int64_t V, uint32_t cut_bits, int64_t cut_id) {
  // probabilities are >= 0, so their float bits order like the values and compare as signed int32
  const __m256i vcut = _mm256_set1_epi32(static_cast<int32_t>(cut_bits));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256d acc = _mm256_setzero_pd();
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 x = _mm256_loadu_ps(out + v);
    const __m256i b = _mm256_castps_si256(x);
    __m256i keep = _mm256_cmpgt_epi32(b, vcut);
    if (v + 7 <= cut_id) {  // ties with the cut token are kept up to its id
      keep = _mm256_or_si256(keep, _mm256_cmpeq_epi32(b, vcut));
    } else if (v <= cut_id) {
      const __m256i ids = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(v)), lane);
      const __m256i upto = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(cut_id + 1)), ids);
      keep = _mm256_or_si256(keep, _mm256_and_si256(_mm256_cmpeq_epi32(b, vcut), upto));
    }
    const __m256 kept = _mm256_and_ps(x, _mm256_castsi256_ps(keep));
    _mm256_storeu_ps(out + v, kept);
    acc = widen_sum(acc, kept);
  }
  return hsum_pd(acc) + cut_scalar(out + v, V - v, cut_bits, cut_id - v);  // the tail, ids shifted by v
}
#endif

RowPasses row_passes() {
#if SA_SAMP_X86
  if (native::active_isa_value() >= 1) return {scale_max_avx2, exp_sum_avx2, scale_avx2, cut_avx2};
#endif
  return {scale_max_scalar, exp_sum_scalar, scale_scalar, cut_scalar};
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
  const RowPasses pass = row_passes();
  const float t = static_cast<float>(temperature);
  float top = pass.scale_max(logits, V, t, out);
  if (top_k > 0 && top_k < V) {
    scratch.assign(out, out + V);
    std::nth_element(scratch.begin(), scratch.begin() + (top_k - 1), scratch.end(), std::greater<float>());
    const float kth = scratch[top_k - 1];
    for (int64_t v = 0; v < V; ++v)
      if (out[v] < kth) out[v] = -std::numeric_limits<float>::infinity();
  }
  const double total = pass.exp_sum(out, V, top);
  pass.scale(out, V, static_cast<float>(1.0 / total));
  if (top_p >= 1.0) return;
  // bucket masses (two interleaved histograms, so consecutive tokens of one bucket do not wait on each other's
  // stores), highest bucket first
  std::vector<double> mass(2 * kBuckets, 0.0);
  int64_t v0 = 0;
  for (; v0 + 2 <= V; v0 += 2) {
    mass[bits_of(out[v0]) >> kBucketShift] += out[v0];
    mass[kBuckets + (bits_of(out[v0 + 1]) >> kBucketShift)] += out[v0 + 1];
  }
  if (v0 < V) mass[bits_of(out[v0]) >> kBucketShift] += out[v0];
  double above = 0.0;
  int boundary = -1;
  for (int b = kBuckets - 1; b >= 0; --b) {
    const double here = mass[b] + mass[kBuckets + b];
    if (above + here >= top_p) {
      boundary = b;
      break;
    }
    above += here;
  }
  if (boundary < 0) return;  // rounding left the whole vocabulary short of top_p: keep every token
  // inside the boundary bucket walk the ranked order; the last kept token defines the cut: tokens ranked at or
  // before it (float bits, then lower id on ties) are kept, every other token is zeroed
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
  const int64_t last = ids[kept - 1];
  const double kept_mass = pass.cut(out, V, bits_of(out[last]), last);
  pass.scale(out, V, static_cast<float>(1.0 / kept_mass));
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
