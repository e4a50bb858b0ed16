// Weight-only quantised linear layers of the native forward (see native_linear.h for the formats).
//
// Per output row n: dequantise row n of W into a float32 buffer (L1-resident), then dot it with every
// activation row, R rows at a time (R = 4 on AVX-512, 2 on AVX2) so the buffer is read once per R rows. Each
// dot product keeps 4 vector partial sums (chunk c of 16 / 8 floats goes to partial c mod 4; the last chunk is
// read with a mask), reduced in a fixed order: the same instructions for a given (m, n) whatever M or the tile
// is, hence row-independent results. The ISA is picked once from the CPU's features (AVX-512, AVX2 + FMA,
// or portable C++), and can be forced for tests (native_set_isa).
#include "native_linear.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define SPECADAPT_X86 1
#define SA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define SA_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define SPECADAPT_X86 0
#endif

namespace specadapt {
namespace cpu {
namespace native {

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

namespace {

int detect_isa() {
#if SPECADAPT_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  int isa = avx512 ? kAvx512 : avx2 ? kAvx2 : kScalar;
  if (const char* env = std::getenv("SPECADAPT_NATIVE_ISA")) {
    const std::string want(env);
    if (want == "scalar") isa = kScalar;
    if (want == "avx2" && avx2) isa = kAvx2;
  }
  return isa;
#else
  return kScalar;
#endif
}

std::atomic<int>& active_isa() {
  static std::atomic<int> isa{detect_isa()};
  return isa;
}

inline float half_bits_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// ---------------------------------------------------------------------------------------------- portable C++
void dequantize_row_scalar(const WeightView& w, int64_t n, float* out) {
  const int64_t K = w.cols, nb = K / kBlock;
  switch (w.format) {
    case kF32:
      std::memcpy(out, static_cast<const float*>(w.data) + n * K, sizeof(float) * K);
      return;
    case kBF16: {
      const uint16_t* p = static_cast<const uint16_t*>(w.data) + n * K;
      for (int64_t k = 0; k < K; ++k) {
        const uint32_t bits = static_cast<uint32_t>(p[k]) << 16;
        std::memcpy(out + k, &bits, sizeof(float));
      }
      return;
    }
    case kQ8_0:
    case kQ4_1: {
      const int64_t group = n / 16, r = n % 16;
      for (int64_t blk = 0; blk < nb; ++blk) {
        const float d = half_bits_to_float(w.scales[(group * nb + blk) * 16 + r]);
        const float m = w.format == kQ4_1 ? half_bits_to_float(w.mins[(group * nb + blk) * 16 + r]) : 0.f;
        for (int64_t j = 0; j < kBlock; ++j) {
          const float q = static_cast<float>(block_code(w, n, blk * kBlock + j));
          out[blk * kBlock + j] = w.format == kQ4_1 ? std::fma(q, d, m) : d * q;
        }
      }
      return;
    }
    case kQ4_K:
    case kQ6_K: {
      // ggml's order: the block scale (and Q4_K's minimum) as a float32 product, then scale * q (- minimum)
      const int64_t group = n / 16, r = n % 16, nsb = K / kSuperBlock;
      const bool q4 = w.format == kQ4_K;
      const int64_t per = q4 ? 32 : 16;
      for (int64_t blk = 0; blk < nb; ++blk) {
        const float d = half_bits_to_float(w.scales[group * nsb * per + (blk / 8) * per + r]);
        const uint8_t* sub = w.sub + group * nb * 32 + blk * 32;
        if (q4) {
          const float dmin = half_bits_to_float(w.scales[group * nsb * per + (blk / 8) * per + 16 + r]);
          const float scale = d * static_cast<float>(sub[r]);
          const float minimum = dmin * static_cast<float>(sub[16 + r]);
          for (int64_t j = 0; j < kBlock; ++j)
            out[blk * kBlock + j] = scale * static_cast<float>(block_code(w, n, blk * kBlock + j)) - minimum;
        } else {
          for (int64_t j = 0; j < kBlock; ++j) {
            const float scale = d * static_cast<float>(static_cast<int8_t>(sub[16 * (j / 16) + r]));
            out[blk * kBlock + j] = scale * static_cast<float>(block_code(w, n, blk * kBlock + j) - 32);
          }
        }
      }
      return;
    }
    default:
      TORCH_CHECK(false, "unknown weight format ", w.format);
  }
}

void dot_rows_scalar(const float* wrow, const float* x, int64_t M, int64_t ldx, int64_t K, float* y, int64_t ldy) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * ldx;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t k = 0; k < K; ++k) acc[k & 3] = std::fma(wrow[k], xm[k], acc[k & 3]);
    y[m * ldy] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  }
}

#if SPECADAPT_X86
// ------------------------------------------------------------------------------------------------- AVX-512
SA_AVX512 void dequantize_row_avx512(const WeightView& w, int64_t n, float* out) {
  const int64_t K = w.cols, nb = K / kBlock;
  switch (w.format) {
    case kBF16: {
      const uint16_t* p = static_cast<const uint16_t*>(w.data) + n * K;
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k)));
        _mm512_storeu_ps(out + k, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
      }
      for (; k < K; ++k) {
        const uint32_t bits = static_cast<uint32_t>(p[k]) << 16;
        std::memcpy(out + k, &bits, sizeof(float));
      }
      return;
    }
    default:
      dequantize_row_scalar(w, n, out);
  }
}

SA_AVX512 inline __mmask16 chunk_mask512(int64_t start, int64_t K) {
  const int64_t left = K - start;
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
}

template <int R>
SA_AVX512 void dot_tile_avx512(const float* w, const float* x, int64_t ldx, int64_t K, float* y, int64_t ldy) {
  __m512 acc[R][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + k + 16);
    const __m512 w2 = _mm512_loadu_ps(w + k + 32), w3 = _mm512_loadu_ps(w + k + 48);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * ldx + k;
      acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xr + 32), acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xr + 48), acc[r][3]);
    }
  }
  if (k < K) {  // the last group of (up to) 4 chunks, masked: chunks past K add +0
    const __mmask16 m0 = chunk_mask512(k, K), m1 = chunk_mask512(k + 16, K);
    const __mmask16 m2 = chunk_mask512(k + 32, K), m3 = chunk_mask512(k + 48, K);
    const __m512 w0 = _mm512_maskz_loadu_ps(m0, w + k), w1 = _mm512_maskz_loadu_ps(m1, w + k + 16);
    const __m512 w2 = _mm512_maskz_loadu_ps(m2, w + k + 32), w3 = _mm512_maskz_loadu_ps(m3, w + k + 48);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * ldx + k;
      acc[r][0] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(m0, xr), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w1, _mm512_maskz_loadu_ps(m1, xr + 16), acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(w2, _mm512_maskz_loadu_ps(m2, xr + 32), acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(w3, _mm512_maskz_loadu_ps(m3, xr + 48), acc[r][3]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m512 s = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
    y[r * ldy] = _mm512_reduce_add_ps(s);
  }
}

SA_AVX512 void dot_rows_avx512(const float* w, const float* x, int64_t M, int64_t ldx, int64_t K, float* y,
                               int64_t ldy) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dot_tile_avx512<4>(w, x + m * ldx, ldx, K, y + m * ldy, ldy);
  for (; m < M; ++m) dot_tile_avx512<1>(w, x + m * ldx, ldx, K, y + m * ldy, ldy);
}

// ---------------------------------------------------------------------------------------------------- AVX2
SA_AVX2 void dequantize_row_avx2(const WeightView& w, int64_t n, float* out) {
  const int64_t K = w.cols, nb = K / kBlock;
  switch (w.format) {
    case kBF16: {
      const uint16_t* p = static_cast<const uint16_t*>(w.data) + n * K;
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k)));
        _mm256_storeu_ps(out + k, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
      }
      for (; k < K; ++k) {
        const uint32_t bits = static_cast<uint32_t>(p[k]) << 16;
        std::memcpy(out + k, &bits, sizeof(float));
      }
      return;
    }
    default:
      dequantize_row_scalar(w, n, out);
  }
}

SA_AVX2 inline __m256i chunk_mask256(int64_t start, int64_t K) {
  const int64_t left = K - start;
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int32_t n = left >= 8 ? 8 : left <= 0 ? 0 : static_cast<int32_t>(left);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes);
}

template <int R>
SA_AVX2 void dot_tile_avx2(const float* w, const float* x, int64_t ldx, int64_t K, float* y, int64_t ldy) {
  __m256 acc[R][4];
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
    const __m256 w2 = _mm256_loadu_ps(w + k + 16), w3 = _mm256_loadu_ps(w + k + 24);
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * ldx + k;
      acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), acc[r][3]);
    }
  }
  if (k < K) {
    const __m256i m0 = chunk_mask256(k, K), m1 = chunk_mask256(k + 8, K);
    const __m256i m2 = chunk_mask256(k + 16, K), m3 = chunk_mask256(k + 24, K);
    const __m256 w0 = _mm256_maskload_ps(w + k, m0), w1 = _mm256_maskload_ps(w + k + 8, m1);
    const __m256 w2 = _mm256_maskload_ps(w + k + 16, m2), w3 = _mm256_maskload_ps(w + k + 24, m3);
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * ldx + k;
      acc[r][0] = _mm256_fmadd_ps(w0, _mm256_maskload_ps(xr, m0), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, _mm256_maskload_ps(xr + 8, m1), acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(w2, _mm256_maskload_ps(xr + 16, m2), acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(w3, _mm256_maskload_ps(xr + 24, m3), acc[r][3]);
    }
  }
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r) {
    const __m256 s = _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3]));
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    y[r * ldy] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
  }
}

SA_AVX2 void dot_rows_avx2(const float* w, const float* x, int64_t M, int64_t ldx, int64_t K, float* y,
                           int64_t ldy) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) dot_tile_avx2<2>(w, x + m * ldx, ldx, K, y + m * ldy, ldy);
  for (; m < M; ++m) dot_tile_avx2<1>(w, x + m * ldx, ldx, K, y + m * ldy, ldy);
}
#endif  // SPECADAPT_X86

}  // namespace

int active_isa_value() { return active_isa().load(); }

void dequantize_row(const WeightView& w, int64_t n, float* out) {
#if SPECADAPT_X86
  const int isa = active_isa().load();
  if (isa == kAvx512) return dequantize_row_avx512(w, n, out);
  if (isa == kAvx2) return dequantize_row_avx2(w, n, out);
#endif
  dequantize_row_scalar(w, n, out);
}

void linear(const float* x, int64_t M, int64_t ldx, const WeightView& w, float* y, int64_t ldy) {
  TORCH_CHECK(w.format == kF32 || w.format == kBF16, "float activations need F32 or BF16 weights (block formats run "
              "with 8-bit activations), got format ", w.format);
  const int64_t N = w.rows, K = w.cols;
  if (M == 0 || N == 0) return;
  const int isa = active_isa().load();
  auto dot = dot_rows_scalar;
#if SPECADAPT_X86
  if (isa == kAvx512) dot = dot_rows_avx512;
  if (isa == kAvx2) dot = dot_rows_avx2;
#endif
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(64, N / (4 * at::get_num_threads() + 1)));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(w.format == kF32 ? 0 : K);
    for (int64_t n = begin; n < end; ++n) {
      const float* row = static_cast<const float*>(w.data) + n * K;
      if (w.format != kF32) {
        dequantize_row(w, n, buffer.data());
        row = buffer.data();
      }
      dot(row, x, M, ldx, K, y + n, ldy);
    }
  });
}

// ---------------------------------------------------------------------------------------------- op bindings
namespace {

WeightView weight_view(const at::Tensor& data, const c10::optional<at::Tensor>& scales,
                       const c10::optional<at::Tensor>& mins, int64_t format, int64_t rows) {
  TORCH_CHECK(data.device().is_cpu(), "weight data must be a CPU tensor");
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous(), "weight data must be a contiguous 2-D tensor, got ",
              data.sizes());
  WeightView w;
  w.format = format;
  w.data = data.data_ptr();
  auto halves = [&](const c10::optional<at::Tensor>& t, const char* name) -> const uint16_t* {
    TORCH_CHECK(t.has_value() && t->defined(), name, " is required for this weight format");
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 2 && t->size(0) == data.size(0) &&
                    t->size(1) == (w.cols / kBlock) * 16,
                name, " must be a contiguous float16 [G, K/32 * 16] = [", data.size(0), ", ", (w.cols / kBlock) * 16,
                "] tensor, got ", t->sizes(), " ", t->scalar_type());
    return reinterpret_cast<const uint16_t*>(t->data_ptr());
  };
  switch (format) {
    case kF32:
    case kBF16:
      TORCH_CHECK(data.scalar_type() == (format == kF32 ? at::kFloat : at::kBFloat16),
                  format == kF32 ? "F32" : "BF16", " weight data has dtype ", data.scalar_type());
      w.rows = data.size(0);
      w.cols = data.size(1);
      TORCH_CHECK(rows < 0 || rows == w.rows, "rows ", rows, " != weight rows ", w.rows);
      break;
    case kQ8_0:
    case kQ4_1: {
      const int64_t per_block = format == kQ8_0 ? 512 : 256;
      TORCH_CHECK(data.scalar_type() == (format == kQ8_0 ? at::kChar : at::kByte),
                  format == kQ8_0 ? "Q8_0 weight data must be int8" : "Q4_1 weight data must be uint8", ", got ",
                  data.scalar_type());
      TORCH_CHECK(data.size(1) % per_block == 0, "block weight data must be [G, nb * ", per_block, "], got ",
                  data.sizes());
      w.cols = (data.size(1) / per_block) * kBlock;
      w.rows = rows < 0 ? 16 * data.size(0) : rows;
      TORCH_CHECK(w.rows > 16 * (data.size(0) - 1) && w.rows <= 16 * data.size(0), "rows ", w.rows,
                  " does not fit ", data.size(0), " groups of 16 rows");
      w.scales = halves(scales, "scales");
      if (format == kQ4_1) w.mins = halves(mins, "mins");
      break;
    }
    case kQ4_K:
    case kQ6_K:
      w = kquant_view(data, scales, mins, format, rows);
      break;
    default:
      TORCH_CHECK(false, "format must be 0 (F32), 1 (BF16), 2 (Q8_0), 3 (Q4_1), 4 (Q4_K) or 5 (Q6_K), got ", format);
  }
  return w;
}

}  // namespace

WeightView kquant_view(const at::Tensor& data, const c10::optional<at::Tensor>& scales,
                       const c10::optional<at::Tensor>& sub, int64_t format, int64_t rows) {
  const bool q4 = format == kQ4_K;
  const char* name = q4 ? "Q4_K" : "Q6_K";
  const int64_t per_block = q4 ? 256 : 384;
  TORCH_CHECK(data.device().is_cpu() && data.dim() == 2 && data.is_contiguous() && data.scalar_type() == at::kByte,
              name, " weight data must be a contiguous uint8 [G, nb * ", per_block, "] CPU tensor, got ", data.sizes(),
              " ", data.scalar_type());
  TORCH_CHECK(data.size(1) % (per_block * 8) == 0, name, " weight data must be [G, nb * ", per_block,
              "] with K divisible by 256, got ", data.sizes());
  WeightView w;
  w.format = format;
  w.data = data.data_ptr();
  const int64_t G = data.size(0), nb = data.size(1) / per_block, nsb = nb / 8;
  w.cols = nb * kBlock;
  w.rows = rows < 0 ? 16 * G : rows;
  TORCH_CHECK(w.rows > 16 * (G - 1) && w.rows <= 16 * G, "rows ", w.rows, " does not fit ", G, " groups of 16 rows");
  TORCH_CHECK(scales.has_value() && scales->defined() && scales->scalar_type() == at::kHalf && scales->is_contiguous() &&
                  scales->dim() == 2 && scales->size(0) == G && scales->size(1) == nsb * (q4 ? 32 : 16),
              name, " scales must be contiguous float16 [G, K/256 * ", q4 ? 32 : 16, "] = [", G, ", ",
              nsb * (q4 ? 32 : 16), "]");
  TORCH_CHECK(sub.has_value() && sub->defined() && (sub->scalar_type() == at::kByte || sub->scalar_type() == at::kChar) &&
                  sub->is_contiguous() && sub->dim() == 2 && sub->size(0) == G && sub->size(1) == nb * 32,
              name, " sub-block scales must be contiguous uint8 / int8 [G, K/32 * 32] = [", G, ", ", nb * 32, "]");
  w.scales = reinterpret_cast<const uint16_t*>(scales->data_ptr());
  w.sub = static_cast<const uint8_t*>(sub->data_ptr());
  return w;
}

namespace {

at::Tensor native_linear_cpu(const at::Tensor& x, const at::Tensor& data, const c10::optional<at::Tensor>& scales,
                             const c10::optional<at::Tensor>& mins, int64_t format, int64_t rows) {
  const WeightView w = weight_view(data, scales, mins, format, rows);
  const bool int8_activations = is_block_format(format);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == w.cols, "x must be [..., K] with K = ", w.cols, ", got ", x.sizes());
  auto lead = x.sizes().vec();
  lead.pop_back();
  const at::Tensor x2 = x.reshape({-1, w.cols}).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, w.rows}, x.options());
  if (int8_activations) {
    linear_q8_activations(x2.data_ptr<float>(), M, w.cols, w, y.data_ptr<float>(), w.rows);
  } else {
    linear(x2.data_ptr<float>(), M, w.cols, w, y.data_ptr<float>(), w.rows);
  }
  lead.push_back(w.rows);
  return y.view(lead);
}

at::Tensor native_dequantize_cpu(const at::Tensor& data, const c10::optional<at::Tensor>& scales,
                                 const c10::optional<at::Tensor>& mins, int64_t format, int64_t rows) {
  const WeightView w = weight_view(data, scales, mins, format, rows);
  at::Tensor out = at::empty({w.rows, w.cols}, data.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, w.rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) dequantize_row(w, n, o + n * w.cols);
  });
  return out;
}

at::Tensor native_embedding_cpu(const at::Tensor& ids, const at::Tensor& data, const c10::optional<at::Tensor>& scales,
                                const c10::optional<at::Tensor>& mins, int64_t format, int64_t rows) {
  const WeightView w = weight_view(data, scales, mins, format, rows);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "ids must be [N] int64, got ", ids.sizes(), " ",
              ids.scalar_type());
  const at::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < idc.size(0); ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < w.rows, "ids holds ", id[i], ", outside the vocabulary [0, ", w.rows, ")");
  at::Tensor out = at::empty({idc.size(0), w.cols}, data.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < idc.size(0); ++i) dequantize_row(w, id[i], o + i * w.cols);
  return out;
}

// Round-to-nearest block quantisation of a float32 [N, K] matrix into the interleaved layout (the rule of
// python/specadapt/engine/native/formats.py:pack_weight, bit for bit).
std::vector<at::Tensor> native_pack_cpu(const at::Tensor& weight, int64_t format) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2, "weight must be [N, K] float32, got ",
              weight.sizes(), " ", weight.scalar_type());
  TORCH_CHECK(format == kQ8_0 || format == kQ4_1, "native_pack packs Q8_0 (2) or Q4_1 (3), got ", format);
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % kBlock == 0, "K must be divisible by 32, got ", K);
  const int64_t nb = K / kBlock, groups = (N + 15) / 16;
  const bool q4 = format == kQ4_1;
  at::Tensor data = at::zeros({groups, nb * (q4 ? 256 : 512)}, w.options().dtype(q4 ? at::kByte : at::kChar));
  at::Tensor scales = at::zeros({groups, nb * 16}, w.options().dtype(at::kHalf));
  at::Tensor mins = q4 ? at::zeros({groups, nb * 16}, w.options().dtype(at::kHalf)) : at::Tensor();
  const float* src = w.data_ptr<float>();
  uint16_t* sc = reinterpret_cast<uint16_t*>(scales.data_ptr());
  uint16_t* mn = q4 ? reinterpret_cast<uint16_t*>(mins.data_ptr()) : nullptr;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t g = n / 16, r = n % 16;
      for (int64_t b = 0; b < nb; ++b) {
        const float* x = src + n * K + b * kBlock;
        int32_t code[kBlock];
        if (!q4) {
          float amax = 0.f;
          for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
          const c10::Half d(amax / 127.f);
          const float df = static_cast<float>(d);
          const float inv = df > 0.f ? 1.f / df : 0.f;
          for (int j = 0; j < kBlock; ++j) code[j] = static_cast<int32_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[j] * inv))));
          sc[(g * nb + b) * 16 + r] = d.x;
          int8_t* blk = static_cast<int8_t*>(data.data_ptr()) + (g * nb + b) * 512;
          for (int k = 0; k < kBlock; ++k) blk[(k / 4) * 64 + r * 4 + k % 4] = static_cast<int8_t>(code[k]);
        } else {
          float lo = x[0], hi = x[0];
          for (int j = 1; j < kBlock; ++j) {
            lo = std::min(lo, x[j]);
            hi = std::max(hi, x[j]);
          }
          const c10::Half d((hi - lo) / 15.f), m(lo);
          const float df = static_cast<float>(d), mf = static_cast<float>(m);
          const float inv = df > 0.f ? 1.f / df : 0.f;
          for (int j = 0; j < kBlock; ++j) code[j] = static_cast<int32_t>(std::min(15.f, std::max(0.f, std::nearbyint((x[j] - mf) * inv))));
          sc[(g * nb + b) * 16 + r] = d.x;
          mn[(g * nb + b) * 16 + r] = m.x;
          uint8_t* blk = static_cast<uint8_t*>(data.data_ptr()) + (g * nb + b) * 256;
          for (int k = 0; k < 16; ++k)
            blk[((k / 4) % 4) * 64 + r * 4 + k % 4] = static_cast<uint8_t>(code[k] | (code[k + 16] << 4));
        }
      }
    }
  });
  return q4 ? std::vector<at::Tensor>{data, scales, mins} : std::vector<at::Tensor>{data, scales};
}

}  // namespace

std::string native_set_isa(const std::string& name) {
  static const char* names[] = {"scalar", "avx2", "avx512"};
  if (!name.empty()) {
    const int best = detect_isa();
    int want = -1;
    for (int i = 0; i < 3; ++i)
      if (name == names[i]) want = i;
    TORCH_CHECK(want >= 0, "isa must be one of scalar, avx2, avx512 or empty, got '", name, "'");
    TORCH_CHECK(want <= best, "isa '", name, "' is not supported by this CPU (best: ", names[best], ")");
    active_isa().store(want);
  }
  return names[active_isa().load()];
}

}  // namespace native
}  // namespace cpu
}  // namespace specadapt

TORCH_LIBRARY_FRAGMENT(specadapt, m) {
  // Quantised linear layer of the native forward (native_linear.h): x [..., K] float32, weight data / scales /
  // mins in `format` (0 F32, 1 BF16, 2 Q8_0, 3 Q4_1; block formats in the 16-row interleaved layout, with 8-bit
  // activations), `rows` = N (-1: all rows of the data) -> [..., N] float32.
  m.def("native_linear(Tensor x, Tensor data, Tensor? scales, Tensor? mins, int format, int rows=-1) -> Tensor");
  // The float32 [N, K] matrix a weight stands for.
  m.def("native_dequantize(Tensor data, Tensor? scales, Tensor? mins, int format, int rows=-1) -> Tensor");
  // Rows ids [R] int64 of a [N, K] table (an embedding) as float32 [R, K].
  m.def("native_embedding(Tensor ids, Tensor data, Tensor? scales, Tensor? mins, int format, int rows=-1) -> Tensor");
  // Round-to-nearest Q8_0 / Q4_1 packing of a float32 [N, K] matrix -> [data, scales(, mins)] (interleaved).
  m.def("native_pack(Tensor weight, int format) -> Tensor[]");
  // Force ("scalar", "avx2", "avx512") or query ("") the instruction set of the native CPU kernels.
  m.def("native_set_isa(str name) -> str", &specadapt::cpu::native::native_set_isa);
}

TORCH_LIBRARY_IMPL(specadapt, CPU, m) {
  m.impl("native_linear", &specadapt::cpu::native::native_linear_cpu);
  m.impl("native_dequantize", &specadapt::cpu::native::native_dequantize_cpu);
  m.impl("native_embedding", &specadapt::cpu::native::native_embedding_cpu);
  m.impl("native_pack", &specadapt::cpu::native::native_pack_cpu);
}
